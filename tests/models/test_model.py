"""Our models against HF transformers. One table, CASES, holds a tiny random-weight checkpoint of
every architecture (and variant) we serve; one test checks each against HF: prefill logits at
every position, and greedy generation through the engine. The other tests check what parity does
not: the embedded SmolLM2 GGUF, loader facts and refusals, LongRoPE's factors, MXFP4 experts, and
blocks released behind a sliding window."""

import glob
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from support.checkpoints import save_tiny_checkpoint
from support.hf_parity import (assert_greedy_generation_matches_hf, assert_prefill_matches_hf, hf_logits,
                               prefill_all_positions)
from support.tiny_models import (add_multi_token_prediction_layer, tiny_absolute_position_model, tiny_cohere,
                                 tiny_deepseek, tiny_dots1, tiny_ernie4_5_moe, tiny_exaone4, tiny_falcon, tiny_gemma1,
                                 tiny_gemma2, tiny_gemma3, tiny_glm4, tiny_glm4_moe, tiny_gpt_neox, tiny_gpt_oss,
                                 tiny_gptj, tiny_granite, tiny_image_text, tiny_llama, tiny_llama_variant,
                                 tiny_minimax_m2, tiny_moe, tiny_nemotron, tiny_olmo, tiny_olmo1,
                                 tiny_phi2, tiny_phi3, tiny_qwen2, tiny_qwen3, tiny_qwen_vl, tiny_smollm3,
                                 tiny_stablelm, tiny_starcoder2, tiny_windowed, transpose_stacked_experts)

from pagedkv.layers.activation import gelu_tanh_and_mul
from pagedkv.models.loader import default_model_path, load
from pagedkv.models.blocks import ParallelBlock
from pagedkv.models.registry import SUPPORTED


@dataclass(frozen=True)
class Generation:
    """Greedy generation of random prompts of these lengths (the engine prefills in chunks of 32
    tokens, so the longer prompts span chunks and windows), `max_tokens` each, drawn with `seed`."""

    lengths: tuple[int, ...]
    max_tokens: int
    seed: int


GREEDY = Generation((40, 9), 16, seed=7)
PAST_THE_WINDOW = Generation((40, 9, 70), 16, seed=7)


@dataclass(frozen=True)
class Case:
    """One architecture or variant checked against HF transformers."""

    id: str
    build: Callable[[], torch.nn.Module]
    """The HF model (random weights, in eval mode), saved as the checkpoint our loader loads."""
    model_type: str
    """Our loader's model_type: the language model's, for an image-text checkpoint."""
    checkpoint_type: str | None = None
    """The checkpoint's own model_type where it differs (image-text checkpoints)."""
    rewrite_checkpoint: Callable[[str], None] | None = None
    """Edits the saved checkpoint into the layout the real ones are released in."""
    layout: Callable[[object], bool] = lambda model: True
    """What our loaded model must look like, so a trait that went missing shows even where the
    random logits would barely move."""
    windows: tuple[int | None, ...] | None = None
    """Each layer's sliding window; None: no layer is windowed."""
    tolerance: float = 1e-4
    hf_class: str = "AutoModelForCausalLM"
    hf_options: dict = field(default_factory=dict)
    """Options of HF's from_pretrained for the prefill reference."""
    generation: Generation | None = GREEDY
    """None: prefill logits only."""
    engine_options: dict = field(default_factory=dict)
    """Options of our LLM for the generation."""
    ablation: tuple[str, object] | None = None
    """(attribute of every layer's attention, value that switches the case's trait off): our
    logits must then move by more than 0.1, so the case would catch the trait's loss."""


def attention(model):
    """The first layer's attention of our model."""
    return model.layers[0].self_attn


MOE_LAYERS = {"mixtral": [True] * 3, "qwen3_moe": [True, False, True], "qwen2_moe": [True] * 3,
              "granitemoe": [True] * 3, "olmoe": [True] * 3}

CASES = [
    Case("llama", tiny_llama, "llama"),
    Case("qwen2", tiny_qwen2, "qwen2", layout=lambda model: attention(model).qkv_proj.bias is not None,
         generation=None),
    Case("qwen3", tiny_qwen3, "qwen3", layout=lambda model: attention(model).q_norm is not None, generation=None),
    *(Case(model_type, lambda model_type=model_type: tiny_moe(model_type), model_type, generation=None,
           layout=lambda model, model_type=model_type: (
               [layer.is_moe for layer in model.layers] == MOE_LAYERS[model_type]
               and model.layers[0].mlp.has_shared_expert == (model_type == "qwen2_moe")))
      for model_type in MOE_LAYERS),
    Case("smollm3", tiny_smollm3, "smollm3", generation=None,
         layout=lambda model: [layer.self_attn.use_rope for layer in model.layers] == [True, True, False, True]),
    Case("granite", tiny_granite, "granite", generation=None),
    # Within the pretraining length of 64 (test_phi3_longrope_rotates_past_the_pretraining_length
    # checks past it)
    Case("phi3", tiny_phi3, "phi3", generation=None),
    Case("gemma3_text", tiny_gemma3, "gemma3_text", windows=(16, None, 16),
         generation=Generation((40, 7, 70), 20, seed=6)),
    # Soft-capped attention logits (HF's eager attention: SDPA would drop the cap), past the window
    Case("gemma2", tiny_gemma2, "gemma2", windows=(16, None, 16), hf_options={"attn_implementation": "eager"},
         layout=lambda model: {layer.self_attn.logit_softcap for layer in model.layers} == {2.0},
         generation=PAST_THE_WINDOW, ablation=("logit_softcap", None)),
    Case("gemma", tiny_gemma1, "gemma",
         layout=lambda model: not any(layer.sandwich_norms for layer in model.layers)
         and model.layers[0].mlp.act_and_mul is gelu_tanh_and_mul),
    # Every layer windowed, generated in a pool of 5 blocks of 16 that the longest sequence (70 +
    # 16 tokens) outgrows unless blocks behind its window are released
    Case("starcoder2", tiny_starcoder2, "starcoder2", windows=(16, 16),
         layout=lambda model: attention(model).o_proj.bias is not None,
         generation=PAST_THE_WINDOW, engine_options={"attention_backend": "cpu", "num_device_blocks": 5}),
    # Rotating halves instead of adjacent pairs would show
    Case("glm4", tiny_glm4, "glm4",
         layout=lambda model: attention(model).rope_interleaved and attention(model).qkv_proj.bias is not None
         and attention(model).o_proj.bias is None,
         ablation=("rope_interleaved", False)),
    *(Case(f"cohere-{name}", lambda qk_norm=qk_norm: tiny_cohere(qk_norm), "cohere",
           layout=lambda model, qk_norm=qk_norm: (attention(model).q_norm is not None) == qk_norm)
      for name, qk_norm in (("command-r", False), ("command-r-plus", True))),
    Case("phi", tiny_phi2, "phi",
         layout=lambda model: model.lm_head.bias is not None and attention(model).o_proj.bias is not None),
    *(Case(f"gpt_neox-{name}", lambda parallel=parallel: tiny_gpt_neox(parallel), "gpt_neox",
           layout=lambda model, parallel=parallel: isinstance(model.layers[0], ParallelBlock) == parallel)
      for name, parallel in (("pythia", True), ("sequential", False))),
    *(Case(f"falcon-{variant}", lambda variant=variant: tiny_falcon(variant), "falcon",
           layout=lambda model, variant=variant, num_kv_heads=num_kv_heads: (
               attention(model).num_kv_heads == num_kv_heads
               and isinstance(model.layers[0], ParallelBlock) == (variant != "sequential")))
      for variant, num_kv_heads in (("7b", 1), ("40b", 2), ("falcon2", 2), ("sequential", 4))),
    # Learned absolute positions instead of rotary embedding
    *(Case(name, lambda name=name: tiny_absolute_position_model(name), name.split("-")[0],
           layout=lambda model, num_kv_heads=num_kv_heads: not attention(model).use_rope
           and attention(model).num_kv_heads == num_kv_heads)
      for name, num_kv_heads in (("gpt2", 2), ("opt", 2), ("gpt_bigcode-mqa", 1), ("gpt_bigcode-mha", 2))),
    *(Case(model_type, lambda model_type=model_type: tiny_llama_variant(model_type), model_type,
           windows=(16, 16) if model_type == "ministral" else None,
           layout=lambda model, model_type=model_type: (
               attention(model).rope_interleaved == (model_type in ("helium", "ernie4_5", "glm"))
               and (attention(model).o_proj.bias is not None) == (model_type == "ernie4_5")))
      for model_type in ("ministral", "helium", "seed_oss", "ernie4_5", "glm", "arcee")),
    Case("gptj", tiny_gptj, "gptj",
         layout=lambda model: attention(model).rope_interleaved and attention(model).qkv_proj.bias is None
         and model.lm_head.bias is not None),
    Case("olmo", tiny_olmo1, "olmo", layout=lambda model: attention(model).clip_qkv == 0.5),
    Case("nemotron", tiny_nemotron, "nemotron"),
    *(Case(f"stablelm-{name}", lambda twelve_b=twelve_b: tiny_stablelm(twelve_b), "stablelm",
           layout=lambda model, twelve_b=twelve_b: (attention(model).q_norm is not None) == twelve_b)
      for name, twelve_b in (("2-1.6b", False), ("2-12b", True))),
    # The full layer has no rotary embedding
    Case("exaone4", tiny_exaone4, "exaone4", windows=(16, None),
         layout=lambda model: [layer.self_attn.use_rope for layer in model.layers] == [True, False]
         and attention(model).q_norm is not None),
    # Image-text checkpoints: the language model served on text prompts, as HF's whole model
    # computes them, with the vision weights left out
    Case("gemma3", lambda: tiny_image_text("gemma3"), "gemma3_text", checkpoint_type="gemma3",
         hf_class="AutoModelForImageTextToText", windows=(16, None, 16),
         layout=lambda model: model.tie_word_embeddings
         and not any("vision" in name for name, _ in model.named_parameters())),
    Case("mistral3", lambda: tiny_image_text("mistral3"), "mistral", checkpoint_type="mistral3",
         hf_class="AutoModelForImageTextToText", windows=(4096, 4096),  # (MistralConfig's default window)
         layout=lambda model: model.tie_word_embeddings
         and not any("vision" in name for name, _ in model.named_parameters())),
    # Multimodal rotary embedding is plain rotary where every position is a text one
    *(Case(model_type, lambda model_type=model_type: tiny_qwen_vl(model_type), f"{model_type}_text",
           checkpoint_type=model_type, hf_class="AutoModelForImageTextToText",
           rewrite_checkpoint=transpose_stacked_experts if model_type == "qwen3_vl_moe" else None,
           layout=lambda model, model_type=model_type: (
               not any("visual" in name for name, _ in model.named_parameters())
               and (attention(model).qkv_proj.bias is not None) == model_type.startswith("qwen2")
               and (attention(model).q_norm is not None) == model_type.startswith("qwen3")
               and model.layers[0].is_moe == (model_type == "qwen3_vl_moe")))
      for model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")),
    # Latent attention computed on the cached latents (the key projection absorbed into the query),
    # the cache one latent + rope key; V3's multi-token-prediction layer left out
    *(Case(name, lambda variant=variant: tiny_deepseek(variant), model_type,
           rewrite_checkpoint=(lambda directory: add_multi_token_prediction_layer(directory, last_layer=2))
           if variant == "v3" else None,
           layout=lambda model: (attention(model).num_kv_heads, attention(model).head_dim) == (1, 32 + 16)
           and [layer.is_moe for layer in model.layers] == [False, True, True])
      for name, variant, model_type in (("deepseek_v2", "v2", "deepseek_v2"),
                                        ("deepseek_v2-lite", "lite", "deepseek_v2"),
                                        ("deepseek_v3", "v3", "deepseek_v3"))),
    *(Case(name, lambda qk_norm=qk_norm: tiny_glm4_moe(qk_norm), "glm4_moe",
           rewrite_checkpoint=lambda directory: add_multi_token_prediction_layer(directory, last_layer=2),
           layout=lambda model, qk_norm=qk_norm: attention(model).qkv_proj.bias is not None
           and attention(model).o_proj.bias is None and (attention(model).q_norm is not None) == qk_norm
           and [layer.is_moe for layer in model.layers] == [False, True, True])
      for name, qk_norm in (("glm4_moe", False), ("glm4_moe-qk-norm", True))),
    Case("ernie4_5_moe", tiny_ernie4_5_moe, "ernie4_5_moe",
         layout=lambda model: [layer.is_moe for layer in model.layers] == [False, True, True, False]
         and model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0),
    Case("dots1", tiny_dots1, "dots1",
         layout=lambda model: attention(model).q_norm.weight.shape == (32,)
         and [layer.is_moe for layer in model.layers] == [False, True, True]),
    Case("minimax_m2", tiny_minimax_m2, "minimax_m2",
         layout=lambda model: attention(model).q_norm.weight.shape == (4 * 32,)
         and model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0),
    Case("olmo2", lambda: tiny_olmo("olmo2"), "olmo2", generation=Generation((40, 9, 70), 16, seed=8)),
    Case("olmo3", lambda: tiny_olmo("olmo3"), "olmo3", windows=(16, None, 16),
         generation=Generation((40, 9, 70), 16, seed=8)),
    # Attention sinks, biased experts
    Case("gpt_oss", tiny_gpt_oss, "gpt_oss", windows=(16, None), generation=Generation((40, 9, 70), 16, seed=9),
         layout=lambda model: all(layer.self_attn.sinks is not None for layer in model.layers)
         and all(layer.is_moe and layer.mlp.expert_down_bias is not None for layer in model.layers)),
    # Generated through the CPU kernels well past the window (test_blocks_behind_the_window_are_released
    # runs Mistral in a pool too small to hold its sequences otherwise)
    *(Case(name, lambda model_type=model_type: tiny_windowed(model_type), model_type, windows=windows,
           generation=Generation((40, 7, 90), 24, seed=5), engine_options={"attention_backend": "cpu"})
      for name, model_type, windows in (("mistral", "mistral", (16, 16)), ("qwen2-windowed", "qwen2", (None, 16)))),
]


def test_every_supported_model_type_has_a_case():
    """A model type joins the registry with a tiny checkpoint in CASES (and no case names a model
    type the registry lacks)."""
    covered = {case.model_type for case in CASES} | {case.checkpoint_type for case in CASES if case.checkpoint_type}
    assert covered == set(SUPPORTED)
    assert len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_matches_hf(tmp_path, case):
    """Our loader's model gives HF's logits at every position of a 37-token prompt over a
    non-contiguous block table, and our engine HF's greedy tokens (batched, chunked prefill,
    through the Rust kernels)."""
    import transformers

    hf_model = case.build()
    directory = save_tiny_checkpoint(tmp_path, hf_model)
    if case.rewrite_checkpoint:
        case.rewrite_checkpoint(directory)
    assert transformers.AutoConfig.from_pretrained(directory).model_type == (case.checkpoint_type or case.model_type)
    loaded = assert_prefill_matches_hf(directory, case.model_type, case.tolerance,
                                       getattr(transformers, case.hf_class), **case.hf_options)
    assert case.layout(loaded.model)
    windows = [getattr(layer.self_attn, "sliding_window", None) for layer in loaded.model.layers]
    assert windows == list(case.windows or [None] * len(windows))

    if case.generation:
        lengths, max_tokens, seed = case.generation.lengths, case.generation.max_tokens, case.generation.seed
        llm = assert_greedy_generation_matches_hf(hf_model, directory, lengths, max_tokens, seed,
                                                  **case.engine_options)
        # Blocks behind the window are released where every layer is windowed
        assert llm.engine.runner.sliding_window == (0 if None in windows else max(windows))
        assert llm.engine.max_model_len == loaded.hf_config.max_position_embeddings

    if case.ablation:
        attribute, value = case.ablation
        tokens = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(3)).tolist()
        with torch.inference_mode():
            kept = prefill_all_positions(loaded.model, tokens, [3, 0, 6], block_size=16, num_blocks=8)
            for layer in loaded.model.layers:
                setattr(layer.self_attn, attribute, value)
            ablated = prefill_all_positions(loaded.model, tokens, [3, 0, 6], block_size=16, num_blocks=8)
        assert (kept - ablated).abs().max().item() > 0.1


def test_default_model_path_points_at_the_embedded_gguf(smollm2):
    assert default_model_path() == smollm2


def test_smollm2_prefill_logits_match_hf(smollm2_runner, smollm2_hf_model):
    """The embedded SmolLM2 GGUF (a real Llama, dequantized) on a tokenized prompt."""
    tokens = smollm2_runner.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    tokens = tokens + tokens[:7]  # 2 blocks of 16, the second partly filled
    ours = prefill_all_positions(smollm2_runner.model, tokens, [5, 2], block_size=16, num_blocks=8)
    reference = hf_logits(smollm2_hf_model, tokens)
    assert ours.dtype == torch.float32 and ours.shape == reference.shape
    assert (ours - reference).abs().max().item() < 2e-3
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_a_safetensors_checkpoint_loads_with_its_tokenizer_and_end_of_sequence_id(tiny_qwen2_dir):
    loaded = load(tiny_qwen2_dir, None, None, torch.float32, torch.device("cpu"), None)
    assert loaded.hf_config.model_type == "qwen2"
    assert 2 in loaded.eos_token_ids
    assert loaded.tokenizer.convert_tokens_to_ids("w7") == 7


def test_a_bfloat16_load_holds_the_float32_weights_rounded_once(tiny_qwen2_dir):
    """The loader allocates parameters in the engine's dtype and copies the checkpoint into them:
    the same numbers as a float32 model cast afterwards, with no float32 copy on the host."""
    as_float32 = load(tiny_qwen2_dir, None, None, torch.float32, torch.device("cpu"), None).model.state_dict()
    as_bfloat16 = load(tiny_qwen2_dir, None, None, torch.bfloat16, torch.device("cpu"), None).model.state_dict()
    assert as_float32.keys() == as_bfloat16.keys()
    for name, tensor in as_bfloat16.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, as_float32[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("model_type", list(MOE_LAYERS))
def test_stacked_experts_load_as_their_checkpoint(tmp_path, model_type):
    """transformers keeps experts stacked in memory (what a GGUF file is dequantized into): loaded
    from it, the same weights as from the saved checkpoint."""
    hf_model = tiny_moe(model_type)
    loaded = load(save_tiny_checkpoint(tmp_path, hf_model), None, None, torch.float32, torch.device("cpu"), None)
    again = type(loaded.model)(loaded.hf_config, loaded.model.traits, 512, torch.float32)
    again.load_hf_state_dict(hf_model.state_dict())
    for (name, ours), theirs in zip(loaded.model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(ours, theirs), name


def test_phi3_longrope_rotates_past_the_pretraining_length(tmp_path):
    """Phi-3's LongRoPE over half of each head: within the pretraining length (64) the short
    factors, past it each position rotated with the long ones."""
    from pagedkv.layers.rotary_embedding import rope_inverse_frequencies

    loaded = load(save_tiny_checkpoint(tmp_path, tiny_phi3()), None, None, torch.float32, torch.device("cpu"), None)
    rotary, config = loaded.model.rotary, loaded.hf_config
    assert rotary.cos.shape[-1] == 8  # half of each 16-dim head rotates
    short, scaling = rope_inverse_frequencies(config)
    long, _ = rope_inverse_frequencies(config, seq_len=65)
    assert not torch.allclose(short, long)
    for position, inv_freq in ((63, short), (64, long), (200, long)):
        angles = position * inv_freq
        torch.testing.assert_close(rotary.cos[position], torch.cat([angles, angles]).cos() * scaling)


def test_gpt_oss_mxfp4_experts_load_as_transformers_widens_them(tmp_path):
    """GPT-OSS checkpoints store experts in MXFP4 (experts.*_blocks: two 4-bit floats a byte,
    *_scales: a power of two per 32): random codes, widened into the HF model's weights, then
    saved packed; our loader's model matches the HF model on them."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_model = tiny_gpt_oss()
    generator = torch.Generator().manual_seed(4)
    packed = {}
    for i, layer in enumerate(hf_model.model.layers):
        for name, rows, columns in (("gate_up_proj", 128, 64), ("down_proj", 64, 64)):
            blocks = torch.randint(0, 256, (4, rows, columns // 32, 16), generator=generator, dtype=torch.uint8)
            scales = torch.randint(122, 127, (4, rows, columns // 32), generator=generator, dtype=torch.uint8)
            with torch.no_grad():
                getattr(layer.mlp.experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            packed[f"model.layers.{i}.mlp.experts.{name}_blocks"] = blocks
            packed[f"model.layers.{i}.mlp.experts.{name}_scales"] = scales
    directory = save_tiny_checkpoint(tmp_path, hf_model)
    [weights_file] = glob.glob(f"{directory}/*.safetensors")
    state = {name: tensor for name, tensor in load_file(weights_file).items()
             if not name.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**state, **packed}, weights_file, metadata={"format": "pt"})

    loaded = load(directory, None, None, torch.float32, torch.device("cpu"), None)
    tokens = torch.randint(3, 256, (37,), generator=generator).tolist()
    ours = prefill_all_positions(loaded.model, tokens, [3, 0, 6], block_size=16, num_blocks=8)
    assert (ours - hf_logits(hf_model, tokens)).abs().max().item() < 1e-4


def test_falcon_with_alibi_is_refused(tmp_path):
    from transformers import FalconConfig, FalconForCausalLM

    model = FalconForCausalLM(FalconConfig(vocab_size=256, hidden_size=64, ffn_hidden_size=96, num_hidden_layers=1,
                                           num_attention_heads=2, alibi=True, multi_query=False))
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    with pytest.raises(ValueError, match="ALiBi"):
        load(directory, None, None, torch.float32, torch.device("cpu"), None)


def test_gemma_options_the_kernels_lack_are_refused(tmp_path):
    directory = save_tiny_checkpoint(tmp_path, tiny_gemma3(use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        load(directory, None, None, torch.float32, torch.device("cpu"), None)


def test_loader_rejects_unknown_directories(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(str(tmp_path / "missing"), None, None, torch.float32, torch.device("cpu"), None)


def test_max_model_len_stays_within_the_positions(tmp_path):
    import pagedkv
    from pagedkv import LLM
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    directory = save_tiny_checkpoint(tmp_path, Qwen2ForCausalLM(config))
    assert LLM(directory, dtype="float32", num_device_blocks=64).engine.max_model_len == 512
    with pytest.raises(pagedkv.InvalidConfigError, match="max_model_len=600 exceeds the model's max_position_embeddings=512"):
        LLM(directory, dtype="float32", num_device_blocks=64, max_model_len=600)


def test_blocks_behind_the_window_are_released(tmp_path):
    """Mistral's every layer is windowed: blocks before each sequence's window are released, so a
    pool of 5 blocks of 16 tokens (80) serves the 114-token sequence, through both backends (the
    torch reference reads released entries of the tables masked)."""
    from pagedkv import SamplingParams

    hf_model = tiny_windowed("mistral")
    directory = save_tiny_checkpoint(tmp_path, hf_model)
    for backend in ("cpu", "torch"):
        llm = assert_greedy_generation_matches_hf(hf_model, directory, (40, 7, 90), 24, seed=5,
                                                  attention_backend=backend, num_device_blocks=5)
        assert llm.engine.max_model_len == 512
        stats = llm.engine.scheduler.stats()
        assert stats["num_free_device_blocks"] == 5
        # The 90-token prompt again: its first blocks were evicted from the 5-block pool, but
        # those its first computed token reads are cached, so it hits (windowed cache hits)
        # and still generates what HF does.
        generator = torch.Generator().manual_seed(5)  # (the helper's prompts, drawn again)
        prompt = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in (40, 7, 90)][2]
        with torch.inference_mode():
            expected = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24,
                                         min_new_tokens=24, pad_token_id=0)[0, len(prompt):].tolist()
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        again = llm.generate([prompt], params, use_tqdm=False)[0]
        assert again.outputs[0].token_ids == expected
        assert llm.engine.scheduler.stats()["prefix_cache_hits"] > stats["prefix_cache_hits"]
