"""A Llama-family GGUF's quantized linear weights kept as GGUF blocks (EngineConfig
gguf_weights="quantized"): after the usual load, each decoder layer's nn.Linear whose GGUF
tensors are all one kept type (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) becomes a QuantizedLinear over
those tensors' raw bytes, read from the file's memory map with gguf-py. BF16 tensors beside
float32 activations stay bfloat16 (layers.cpu_linear.BFloat16Linear, the LM head's too: half
the bytes of the float32 weights).

Each swap is checked, not trusted: the blocks must dequantize to exactly the float32 weight
just loaded (transformers dequantizes with gguf-py, the same float32 operations), which also
proves the row order (llama.cpp stores q and k rows permuted for its rotary layout; the
permutation is undone here as transformers does). A layer that differs keeps its float weight.
The LM head (the tied embedding table's blocks, or `output`'s) is read from its blocks too
(layers.quantized_linear.QuantizedLMHeadProduct), checked the same way; the embedding table
stays float32 for the lookups.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from pagedkv.layers.cpu_linear import BFloat16Linear, BFloat16LMHeadProduct
from pagedkv.layers.quantized_linear import GGML_TYPES, QuantizedLinear, QuantizedLMHeadProduct, dequantize

logger = logging.getLogger("pagedkv.models.gguf_quantized")

# our module (under layers[i]) -> its GGUF tensors (under blk.{i}.), in row order
LLAMA_LINEARS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def unpermute_rows(blocks: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order back to HF's (transformers' reverse_permute_weights)."""
    rows = blocks.shape[0]
    return blocks.reshape(num_heads, rows // num_heads // 2, 2, -1).swapaxes(1, 2).reshape(blocks.shape)


def keep_quantized(net: nn.Module, gguf_path: str, hf_config) -> int:
    """Replaces the decoder layers' linears by QuantizedLinear where the GGUF keeps them
    quantized and the blocks match the loaded weight exactly; returns how many were replaced."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    num_heads, num_kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    replaced = 0
    for index, layer in enumerate(getattr(net, "layers", [])):
        for module_path, parts in LLAMA_LINEARS.items():
            parent_path, _, attribute = module_path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            linear = getattr(parent, attribute, None)
            found = [tensors.get(f"blk.{index}.{part}.weight") for part in parts]
            if not isinstance(linear, nn.Linear) or None in found:
                continue
            types = {t.tensor_type.name for t in found}
            if types == {"BF16"}:
                replaced += _keep_bfloat16(parent, attribute, linear, found, parts, (num_heads, num_kv_heads))
                continue
            if len(types) != 1 or not types <= set(GGML_TYPES):
                continue
            blocks = []
            for part, tensor in zip(parts, found):
                data = np.asarray(tensor.data)
                if part in ("attn_q", "attn_k"):
                    data = unpermute_rows(data, num_heads if part == "attn_q" else num_kv_heads)
                blocks.append(data)
            quantized = QuantizedLinear(linear.in_features, linear.out_features, types.pop(), bias=linear.bias is not None)
            rows = np.concatenate(blocks)
            if rows.shape != tuple(quantized.blocks.shape):
                continue
            quantized.blocks.copy_(torch.from_numpy(rows))
            if linear.bias is not None:
                quantized.bias.data.copy_(linear.bias.data)
            if not torch.equal(quantized.weight, linear.weight.data):
                logger.warning("layers.%d.%s: GGUF blocks differ from the loaded weight; kept float32", index, module_path)
                continue
            setattr(parent, attribute, quantized)
            replaced += 1
    head = keep_lm_head_quantized(net, tensors)
    logger.info("kept %d linear layers%s as GGUF blocks (%s)", replaced, f" and the {head} LM head" if head else "",
                gguf_path)
    return replaced


def _bfloat16_rows(tensor, part: str, heads: tuple[int, int]) -> torch.Tensor:
    """A BF16 GGUF tensor's rows (gguf-py gives them as bytes) in HF's order, as bfloat16."""
    data = np.asarray(tensor.data)
    if part in ("attn_q", "attn_k"):
        data = unpermute_rows(data, heads[0] if part == "attn_q" else heads[1])
    return torch.from_numpy(np.ascontiguousarray(data)).view(torch.bfloat16)


def _keep_bfloat16(parent: nn.Module, attribute: str, linear: nn.Linear, found: list, parts: tuple,
                   heads: tuple[int, int]) -> int:
    """Swaps a float32 linear for a BFloat16Linear over its BF16 GGUF tensors (unbiased ones, whose
    widened values equal the loaded weight exactly); returns 1 if swapped."""
    if linear.bias is not None or linear.weight.dtype != torch.float32:
        return 0
    kept = BFloat16Linear(linear.in_features, linear.out_features)
    rows = torch.cat([_bfloat16_rows(tensor, part, heads) for part, tensor in zip(parts, found)])
    if rows.shape != kept.weight.shape or not torch.equal(rows.float(), linear.weight.data):
        return 0
    kept.weight.copy_(rows)
    setattr(parent, attribute, kept)
    return 1


def keep_lm_head_quantized(net: nn.Module, tensors: dict) -> str | None:
    """Points `net.lm_head_linear` at the LM head's GGUF blocks when they are of a kept type and
    dequantize to exactly the head's loaded weight; returns their type (None: left float32)."""
    tied = bool(getattr(net, "tie_word_embeddings", False))
    tensor = tensors.get("token_embd.weight" if tied else "output.weight")
    weight = net.embed_tokens.weight if tied else getattr(getattr(net, "lm_head", None), "weight", None)
    if tensor is None or weight is None or not hasattr(net, "lm_head_linear"):
        return None
    if tensor.tensor_type.name == "BF16" and weight.dtype == torch.float32:
        rows = _bfloat16_rows(tensor, "", (0, 0))
        if rows.shape != weight.shape or not torch.equal(rows.float(), weight.data):
            return None
        net.lm_head_linear = BFloat16LMHeadProduct(rows)
        return "BF16"
    if tensor.tensor_type.name not in GGML_TYPES:
        return None
    ggml_type = tensor.tensor_type.name
    blocks = torch.from_numpy(np.array(tensor.data, order="C"))  # (a writable copy of the mapped file)
    if not torch.equal(dequantize(blocks, ggml_type, tuple(weight.shape)), weight.data):
        logger.warning("the LM head's GGUF blocks differ from the loaded weight; kept float32")
        return None
    net.lm_head_linear = QuantizedLMHeadProduct(blocks, ggml_type, weight.shape[0])
    return ggml_type
