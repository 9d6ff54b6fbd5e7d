"""A Llama-family GGUF's quantized linear weights kept as GGUF blocks (EngineConfig
gguf_weights="quantized"). Before the weights load, each decoder layer's nn.Linear whose GGUF
tensors are of kept types (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) becomes a QuantizedLinear over those
tensors' raw bytes, read from the file's memory map (models.gguf_tensor_index), or, where the
parts of a fused one are of different types (a Q4_K_M file's Q6_K v beside Q4_K q and k), a
StackedQuantizedLinear of them; BF16 tensors beside float32 activations stay bfloat16
(layers.cpu_linear.BFloat16Linear, the LM head's too: half the bytes of the float32 weights). So
the float32 linears are allocated but never written: a model whose float32 weights would not
fit the host's memory loads as its blocks.

Where the file's other weights come through transformers' reader, each swap is checked, not
trusted: as the float weight a kept module stands for streams past during the load, the blocks
must dequantize to exactly it (transformers dequantizes with gguf-py, the same float32
operations), which also proves the row order (llama.cpp stores a "llama" file's q and k rows
permuted for its rotary layout; the permutation is undone here as transformers does). A module
that differs goes back to a float nn.Linear holding that weight. The LM head (the tied embedding
table's blocks, or `output`'s) is read from its blocks too after the load
(layers.quantized_linear.QuantizedLMHeadProduct), checked the same way, and so is the token
embedding table (layers.quantized_embedding.QuantizedEmbedding: a lookup dequantizes its rows; a
BF16 table stays bfloat16, BFloat16Embedding; a tied head and table share one copy). A load that
reads the file's other weights itself (models/gguf_file_weights.py: the dense files transformers
reads) trusts them: the same bytes, rows and dequantization, which a test checks against this
route model for model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from pagedkv.layers.cpu_linear import BFloat16Linear, BFloat16LMHeadProduct
from pagedkv.layers.quantized_embedding import BFloat16Embedding, QuantizedEmbedding
from pagedkv.layers.quantized_linear import (GGML_TYPES, QuantizedLinear, QuantizedLMHeadProduct,
                                             StackedQuantizedLinear, dequantize)
from pagedkv.models.gguf_tensor_index import ELEMENT_TYPES, release_resident_pages
from pagedkv.models.gguf_file_weights import permuted_heads, unpermute_rows

logger = logging.getLogger("pagedkv.models.gguf_quantized")

# our module (under layers[i]) -> its GGUF tensors (under blk.{i}.), in row order
LLAMA_LINEARS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def take_over_linears(net: nn.Module, tensors: dict, hf_config, architecture: str | None,
                      checked: bool = True) -> dict[str, Callable | None]:
    """Before the load (the float32 model's linears allocated, not yet written): replaces each
    decoder-layer linear whose GGUF tensors are of one kept type by its kept module. Returns, per
    replaced module, the name of the float weight the checkpoint gives for it
    ("layers.3.self_attn.qkv_proj.weight") -> the check to run on that weight (or its fused parts)
    as it streams past (`load_hf_weights`); None where not `checked` (the weights come from this
    file's other tensors, models/gguf_file_weights.py, and that one never streams)."""
    heads = (hf_config.num_attention_heads, hf_config.num_key_value_heads)
    checks: dict[str, Callable | None] = {}
    for index, layer in enumerate(getattr(net, "layers", [])):
        for module_path, parts in LLAMA_LINEARS.items():
            parent_path, _, attribute = module_path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            linear = getattr(parent, attribute, None)
            found = [tensors.get(f"blk.{index}.{part}.weight") for part in parts]
            if type(linear) is not nn.Linear or linear.weight.dtype != torch.float32 or None in found:
                continue
            kept = _kept_module(linear, found, architecture, heads)
            if kept is not None:
                setattr(parent, attribute, kept)
                name = f"layers.{index}.{module_path}"
                checks[f"{name}.weight"] = _check(parent, attribute, kept, name) if checked else None
            release_resident_pages(found)  # (copied: a 7B model's file would be resident twice)
    return checks


def gguf_names_of(checks: dict) -> set[str]:
    """The GGUF tensors the decoder-layer modules named in take_over_linears' result stand for."""
    names = set()
    for name in checks:
        if name.startswith("layers."):
            _, index, module_path = name.removesuffix(".weight").split(".", 2)
            names.update(f"blk.{index}.{part}.weight" for part in LLAMA_LINEARS[module_path])
    return names


def _kept_module(linear: nn.Linear, found: list, architecture: str | None, heads: tuple[int, int]) -> nn.Module | None:
    """The QuantizedLinear or BFloat16Linear over these GGUF tensors (a StackedQuantizedLinear
    where they are of several kept types), or None where they are of another type, or do not fit
    the linear's shape."""
    types = {t.tensor_type.name for t in found}
    if len(types) > 1 and types <= set(GGML_TYPES):
        return _stacked_module(linear, found, architecture, heads)
    if types == {"BF16"} and linear.bias is None:
        kept = BFloat16Linear(linear.in_features, linear.out_features)
        rows = torch.cat([_bfloat16_rows(tensor, architecture, heads) for tensor in found])
        if rows.shape != kept.weight.shape:
            return None
        kept.weight.copy_(rows)
        return kept
    if len(types) != 1 or not types <= set(GGML_TYPES):
        return None
    return _blocks_module(linear.in_features, linear.out_features, found, architecture, heads, linear.bias is not None)


def _blocks_module(in_features: int, out_features: int, tensors: list, architecture: str | None,
                   heads: tuple[int, int], bias: bool = False) -> QuantizedLinear | None:
    """A QuantizedLinear over these GGUF tensors (of one type) stacked by rows, or None where they
    do not fit its shape."""
    kept = QuantizedLinear(in_features, out_features, tensors[0].tensor_type.name, bias=bias)
    rows = np.concatenate([_hf_rows(tensor, architecture, heads) for tensor in tensors])
    if rows.shape != tuple(kept.blocks.shape):
        return None
    kept.blocks.copy_(torch.from_numpy(rows))
    return kept


def _stacked_module(linear: nn.Linear, found: list, architecture: str | None,
                    heads: tuple[int, int]) -> StackedQuantizedLinear | None:
    """Consecutive tensors of one type become one part (a Q4_K_M file's q and k; its Q6_K v)."""
    runs: list[list] = []
    for tensor in found:
        if runs and runs[-1][0].tensor_type == tensor.tensor_type:
            runs[-1].append(tensor)
        else:
            runs.append([tensor])
    parts = [_blocks_module(linear.in_features, sum(logical_shape(t)[0] for t in run), run, architecture, heads)
             for run in runs]
    if None in parts:
        return None
    kept = StackedQuantizedLinear(parts, bias=linear.bias is not None)
    return kept if kept.out_features == linear.out_features else None


def _check(parent: nn.Module, attribute: str, kept: nn.Module, name: str) -> Callable:
    def check(value: torch.Tensor | list) -> None:
        weight = torch.cat(value) if isinstance(value, list) else value
        if torch.equal(kept.weight.float(), weight.float()):
            return
        logger.warning("%s: GGUF blocks differ from the checkpoint's weight; kept float32", name)
        linear = nn.Linear(kept.in_features, kept.out_features, bias=False)
        linear.weight = nn.Parameter(weight.float().clone(), requires_grad=False)
        linear.bias = kept.bias  # (the one the load fills, before or after this)
        setattr(parent, attribute, linear)

    return check


def _hf_rows(tensor, architecture: str | None = None, heads: tuple[int, int] = (1, 1)) -> np.ndarray:
    """A GGUF tensor's rows (blocks, or a BF16 tensor's bytes, as gguf-py gives them) in HF's order."""
    data = np.asarray(tensor.data)
    num_heads = permuted_heads(tensor.name, architecture, heads)
    return data if num_heads is None else unpermute_rows(data, num_heads)


def _bfloat16_rows(tensor, architecture: str | None = None, heads: tuple[int, int] = (1, 1)) -> torch.Tensor:
    """A BF16 GGUF tensor's rows in HF's order, as bfloat16: a copy, never a view of the file's
    mapping (a tensor kept as a view keeps the whole mapping, and every page of it the load read,
    resident beside the copies of the other weights: 258 MB more for the embedded model's BF16 file)."""
    return torch.from_numpy(np.array(_hf_rows(tensor, architecture, heads), order="C")).view(torch.bfloat16)


def kept_outside_layers(net: nn.Module, tensors: dict) -> dict[str, str]:
    """Which of the LM head and the token embedding table a load will keep as this file stores
    them (keep_lm_head_quantized, keep_embedding_quantized), by type alone: our weight name ->
    its GGUF tensor. A load that trusts the file (models/gguf_file_weights.py) reads neither."""
    def keepable(name: str) -> bool:
        tensor = tensors.get(name)
        return tensor is not None and tensor.tensor_type.name in (*GGML_TYPES, "BF16")

    if type(getattr(net, "embed_tokens", None)) is not nn.Embedding or not hasattr(net, "lm_head_linear"):
        return {}
    if getattr(net, "tie_word_embeddings", False):
        return {"embed_tokens.weight": "token_embd.weight"} if keepable("token_embd.weight") else {}
    kept = {"embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}
    return {ours: theirs for ours, theirs in kept.items() if keepable(theirs)}


def keep_lm_head_quantized(net: nn.Module, tensors: dict, checked: bool = True) -> str | None:
    """Points `net.lm_head_linear` at the LM head's GGUF blocks when they are of a kept type and
    dequantize to exactly the head's loaded weight; returns their type (None: left float32). Not
    `checked`: the head was not loaded (kept_outside_layers), its blocks are taken as they are."""
    tied = bool(getattr(net, "tie_word_embeddings", False))
    tensor = tensors.get("token_embd.weight" if tied else "output.weight")
    weight = net.embed_tokens.weight if tied else getattr(getattr(net, "lm_head", None), "weight", None)
    if tensor is None or weight is None or not hasattr(net, "lm_head_linear"):
        return None
    if tensor.tensor_type.name == "BF16" and weight.dtype == torch.float32:
        rows = _bfloat16_rows(tensor)
        if rows.shape != weight.shape or (checked and not torch.equal(rows.float(), weight.data)):
            return _unkept("the LM head's", checked)
        net.lm_head_linear = BFloat16LMHeadProduct(rows)
        _drop_float_head(net, tied)
        return "BF16"
    if tensor.tensor_type.name not in GGML_TYPES:
        return None
    ggml_type = tensor.tensor_type.name
    blocks = torch.from_numpy(np.array(tensor.data, order="C"))  # (a writable copy of the mapped file)
    if logical_shape(tensor) != tuple(weight.shape) or (
            checked and not torch.equal(dequantize(blocks, ggml_type, tuple(weight.shape)), weight.data)):
        return _unkept("the LM head's", checked)
    net.lm_head_linear = QuantizedLMHeadProduct(blocks, ggml_type, weight.shape[0])
    _drop_float_head(net, tied)
    return ggml_type


def _drop_float_head(net: nn.Module, tied: bool) -> None:
    """An untied head kept as blocks needs no float32 weight (a 152k-token vocabulary's is 2 GB)."""
    if not tied:
        del net.lm_head


def keep_embedding_quantized(net: nn.Module, tensors: dict, checked: bool = True) -> str | None:
    """Swaps `net.embed_tokens` for a QuantizedEmbedding over the GGUF's token_embd blocks (a
    BFloat16Embedding over a BF16 table beside float32 activations) when they are of a kept type
    and give exactly the loaded table (the float table is then freed); a tied LM head kept the same
    way shares them (a tied head left float32 keeps the table float32: it is the head's weight).
    Returns their type (None: left float32). Not `checked`: the table was not loaded
    (kept_outside_layers), its blocks are taken as they are."""
    tensor, table = tensors.get("token_embd.weight"), getattr(net, "embed_tokens", None)
    if tensor is None or type(table) is not nn.Embedding:
        return None
    ggml_type, shape = tensor.tensor_type.name, tuple(table.weight.shape)
    if ggml_type == "BF16" and table.weight.dtype == torch.float32:
        kept_head_type, make = BFloat16LMHeadProduct, BFloat16Embedding
    elif ggml_type in GGML_TYPES:
        kept_head_type, make = QuantizedLMHeadProduct, lambda blocks: QuantizedEmbedding(blocks, ggml_type, shape[1])
    else:
        return None
    head = getattr(net, "lm_head_linear", None)
    if getattr(net, "tie_word_embeddings", False):
        if not isinstance(head, kept_head_type):
            return _unkept("the embedding table's", checked)  # (the float table is the head's weight)
        stored = head.weight if ggml_type == "BF16" else head.blocks  # (checked by keep_lm_head_quantized)
    else:
        stored = _bfloat16_rows(tensor) if ggml_type == "BF16" else torch.from_numpy(np.array(tensor.data, order="C"))
        if logical_shape(tensor) != shape:
            return _unkept("the embedding table's", checked)
        if checked:
            widened = stored.float() if ggml_type == "BF16" else dequantize(stored, ggml_type, shape)
            if not torch.equal(widened, table.weight.data):
                return _unkept("the embedding table's", checked)
    net.embed_tokens = make(stored)
    return ggml_type


def logical_shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in elements (gguf-py shapes a block type's data in bytes)."""
    import gguf

    shape = tuple(tensor.data.shape)
    if tensor.tensor_type.name in ELEMENT_TYPES:
        return shape
    block_len, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    return (*shape[:-1], shape[-1] // block_bytes * block_len)


def _unkept(what: str, checked: bool) -> None:
    if not checked:  # (nothing was loaded in its place)
        raise ValueError(f"{what} GGUF tensor does not fit the model")
    logger.warning("%s GGUF blocks differ from the loaded weight; kept float32", what)
    return None
