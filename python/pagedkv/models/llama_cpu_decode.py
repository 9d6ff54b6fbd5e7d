"""A Llama model's CPU decode step: its decoder layers in one core call (`rust/cpu_kernels/decoder.rs`).

At one token a layer of the embedded model costs ~70 Python and torch calls around ~0.4 ms of
arithmetic, and those calls took about as long as the arithmetic. For a plain Llama model on the
CPU (float32 activations, a float32 or bfloat16 cache, linears on the CPU kernels: GGUF blocks kept quantized, a BF16
GGUF's bfloat16 weights, or float32 weights through `cpu_linear`, one KV-cache group, no LoRA, no tensor parallelism), a step
whose tokens are all decodes runs every layer through the same kernels in one call instead: the
same inputs in the same order, so the same bits. Anything else takes the layer-by-layer path.

`enabled = False` turns it off (benchmarks compare).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from pagedkv_core import _core
from pagedkv.layers import cpu_fused
from pagedkv.layers.activation import silu_and_mul
from pagedkv.layers.cpu_linear import MAX_KERNEL_ROWS, BFloat16Linear, CpuLinear
from pagedkv.layers import quantized_linear
from pagedkv.layers.quantized_linear import QuantizedLinear, StackedQuantizedLinear
from pagedkv.layers.rms_norm import RMSNorm

if TYPE_CHECKING:
    from pagedkv.attention.step_context import StepContext
    from pagedkv.models.llama import LlamaForCausalLM

enabled = True
CACHE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
# Largest decode batch the one call takes when every linear's kernel runs at any token count
# (GGUF blocks of 32 kept quantized).
MAX_DECODE_TOKENS = 256


class CpuDecodePath:
    """One model's decoder layers over one KV cache as a `_core.CpuDecoder`; keeps every tensor
    whose address the core holds (so none is freed under it)."""

    def __init__(self, model: LlamaForCausalLM, kv_cache):
        first = model.layers[0]
        attention, mlp = first.self_attn, first.mlp
        self.kv_cache = kv_cache
        self.max_tokens = min(_max_tokens(linear) for layer in model.layers for linear in _linears(layer))
        base = kv_cache.device_cache
        element = base.element_size()
        self._tensors: list[torch.Tensor] = [base]
        layers = []
        for index, layer in enumerate(model.layers):
            key_cache, value_cache = kv_cache.layer(index)
            qkv, o = _linears(layer)[:2]
            layers.append((
                self._address(layer.input_layernorm.weight),
                [self._linear(part, bias) for part, bias in _parts(qkv)],
                self._linear(o, o.bias),
                self._address(layer.post_attention_layernorm.weight),
                *(self._linear(linear, linear.bias) for linear in _linears(layer)[2:]),
                (key_cache.data_ptr() - base.data_ptr()) // element,
                (value_cache.data_ptr() - base.data_ptr()) // element,
                layer.self_attn.sliding_window or 0,
            ))  # fmt: skip
        num_blocks, _, block_size, _ = kv_cache.layer(0)[0].shape
        shape = (
            model.hf_config.hidden_size, attention.num_heads, attention.num_kv_heads, attention.head_dim,
            mlp.down_proj.in_features, block_size, num_blocks, kv_cache.layer(0)[0].stride(0),
        )  # fmt: skip
        self.decoder = _core.CpuDecoder(shape, first.input_layernorm.eps, attention.scale, layers)

    def _address(self, tensor: torch.Tensor) -> int:
        self._tensors.append(tensor)
        return tensor.data_ptr()

    def _linear(self, linear: nn.Module, bias: Optional[torch.Tensor]) -> tuple:
        """A linear's spec for the core, with `bias` (its own, or a stacked part's rows of the fused one)."""
        bias = None if bias is None else self._address(bias)
        if isinstance(linear, QuantizedLinear):
            blocks = linear.blocks
            return (linear.ggml_type, self._address(blocks), blocks.numel(), bias, linear.in_features,
                    linear.out_features)  # fmt: skip
        weight = linear.weight
        kind = "bfloat16" if weight.dtype == torch.bfloat16 else "float32"
        return (kind, self._address(weight), weight.numel() * weight.element_size(), bias, linear.in_features,
                linear.out_features)  # fmt: skip

    def forward(self, model: LlamaForCausalLM, hidden: torch.Tensor, positions: torch.Tensor,
                context: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after every decoder layer, as the layer-by-layer loop gives them;
        hidden [T, H] (the embeddings, contiguous float32) is written in place."""
        metadata = context.metadata
        cos, sin = (table.contiguous() for table in model.rotary(positions))
        tables = metadata.block_tables.to(torch.int32).contiguous()
        contexts = metadata.context_lens.to(torch.int32).contiguous()
        slots = metadata.slot_mapping.to(torch.int64).contiguous()
        residual = torch.empty_like(hidden)
        cache = self.kv_cache.device_cache
        self.decoder.forward(
            hidden.data_ptr(), residual.data_ptr(), cache.data_ptr(), cache.numel(), CACHE_DTYPES[cache.dtype],
            (cos.data_ptr(), sin.data_ptr()),
            tables.data_ptr(), tables.shape[1], contexts.data_ptr(), slots.data_ptr(), hidden.shape[0],
            torch.get_num_threads(),
        )  # fmt: skip
        return hidden, residual


def decode_path(model: LlamaForCausalLM, hidden: torch.Tensor, context: StepContext) -> Optional[CpuDecodePath]:
    """The model's one-call decode path for this step, or None where the step takes the layers one
    by one (see the module docstring; the model's own checks run once, the step's every step)."""
    if not enabled or context.lora is not None or context.kv_cache is None:
        return None
    path = model.__dict__.get("_cpu_decode_path", False)
    if path is False:  # (not yet looked at)
        path = CpuDecodePath(model, context.kv_cache) if _model_fits(model, context) else None
        model.__dict__["_cpu_decode_path"] = path
    if path is None:
        return None
    if path.kv_cache is not context.kv_cache:  # (a new cache: rebuild the addresses)
        path = model.__dict__["_cpu_decode_path"] = CpuDecodePath(model, context.kv_cache)
    metadata = context.metadata
    num_tokens = hidden.shape[0]
    if not (metadata.num_decode_tokens == metadata.num_seqs == num_tokens <= path.max_tokens and cpu_fused.enabled
            and hidden.dtype == torch.float32 and hidden.is_contiguous()):
        return None
    return path


def _model_fits(model: LlamaForCausalLM, context: StepContext) -> bool:
    from pagedkv.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

    kv_cache = context.kv_cache
    if (type(model).forward is not LlamaForCausalLM.forward or model.rotary_sliding is not None
            or context.backend.name != "cpu" or kv_cache.is_cuda or kv_cache.num_groups != 1
            or kv_cache.device_cache.dtype not in CACHE_DTYPES):
        return False
    first = model.layers[0]
    if type(first) is not LlamaDecoderLayer or model.rotary.cos.shape[-1] != first.self_attn.head_dim:
        return False
    return all(_layer_fits(layer, first, LlamaDecoderLayer, LlamaMLP) for layer in model.layers)


def _layer_fits(layer, first, decoder_layer_class, mlp_class) -> bool:
    attention, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (
        type(layer) is decoder_layer_class and layer.residual_multiplier == 1.0 and not layer.is_moe
        and type(mlp) is mlp_class and mlp.act_and_mul is silu_and_mul and mlp.tp.size == 1 and attention.tp.size == 1
        and attention.q_norm is None and attention.clip_qkv is None and attention.use_rope
        and not attention.rope_interleaved and attention.logit_softcap is None and attention.sinks is None
        and (attention.num_heads, attention.num_kv_heads, attention.head_dim, attention.scale)
        == (first.self_attn.num_heads, first.self_attn.num_kv_heads, first.self_attn.head_dim, first.self_attn.scale)
        and all(type(norm) is RMSNorm and norm.eps == first.input_layernorm.eps and _plain_float32(norm.weight)
                for norm in norms)
        and all(_linear_fits(linear) for linear in _linears(layer))
    )  # fmt: skip


def _linears(layer) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _parts(linear: nn.Module) -> list[tuple[nn.Module, Optional[torch.Tensor]]]:
    """(part, its bias) of a stacked linear, each part with its rows of the fused bias; any other
    linear alone, with its own."""
    if not isinstance(linear, StackedQuantizedLinear):
        return [(linear, linear.bias)]
    biases = ([None] * len(linear.parts) if linear.bias is None
              else linear.bias.split([part.out_features for part in linear.parts]))
    return list(zip(linear.parts, biases))


def _linear_fits(linear: nn.Module) -> bool:
    if linear.bias is not None and not _plain_float32(linear.bias):
        return False
    if isinstance(linear, StackedQuantizedLinear):
        return all(_linear_fits(part) for part in linear.parts)
    if isinstance(linear, QuantizedLinear):
        return linear.blocks.is_contiguous()
    if isinstance(linear, BFloat16Linear):
        return linear.bias is None and linear.weight.is_contiguous()
    return type(linear) is CpuLinear and _plain_float32(linear.weight)


def _max_tokens(linear: nn.Module) -> int:
    """Rows up to which the layer-by-layer path runs this linear on the kernel the core calls."""
    if isinstance(linear, StackedQuantizedLinear):
        return min(_max_tokens(part) for part in linear.parts)
    if isinstance(linear, QuantizedLinear):
        takes_any = quantized_linear.kernel_takes(linear.ggml_type, MAX_DECODE_TOKENS)
        return MAX_DECODE_TOKENS if takes_any else quantized_linear.MAX_KERNEL_TOKENS
    return MAX_KERNEL_ROWS[torch.float32]


def _plain_float32(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous()
