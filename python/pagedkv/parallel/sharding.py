"""Which models shard over a tensor-parallel group, and each rank's slice of their weights
(Megatron style, as vLLM's ColumnParallelLinear / RowParallelLinear): q/k/v and gate/up split by
output, o_proj and down_proj by input (an all-reduce sums the ranks' parts), KV heads split
across ranks or, with more ranks than KV heads, each rank holding the one its query heads read.
Embeddings, norms and the LM head are replicated: every rank ends a step with the full hidden
states, and rank 0 samples from its own logits."""

from __future__ import annotations

import torch

from pagedkv.errors import InvalidConfigError
from pagedkv.parallel.group import TensorParallelGroup


def check_shardable(hf_config, model_class, size: int) -> None:
    """Raises InvalidConfigError, naming the numbers, unless `size` ranks can shard this model."""
    from pagedkv.layers.fused_moe import is_moe_layer
    from pagedkv.models.llama import PROJECTION_QK_NORM_MODEL_TYPES, UNGATED_MLP_MODEL_TYPES, LlamaForCausalLM

    model_type = hf_config.model_type
    if model_class is not LlamaForCausalLM or model_type in PROJECTION_QK_NORM_MODEL_TYPES + UNGATED_MLP_MODEL_TYPES:
        raise InvalidConfigError(f"tensor_parallel_size={size}: model_type {model_type!r} does not shard yet "
                                 "(tensor parallelism covers the Llama family: llama, mistral, qwen2, qwen3, "
                                 "smollm3, granite, phi3, ...)")
    if any(is_moe_layer(hf_config, i) for i in range(hf_config.num_hidden_layers)):
        raise InvalidConfigError(f"tensor_parallel_size={size}: mixture-of-experts models ({model_type}) do not "
                                 "shard yet; run them with tensor_parallel_size=1")
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    if num_heads % size:
        raise InvalidConfigError(f"tensor_parallel_size={size} must divide the model's {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise InvalidConfigError(f"tensor_parallel_size={size} must divide the model's {num_kv_heads} KV heads, "
                                 "or be a multiple of them (each KV head then replicated)")
    if hf_config.intermediate_size % size:
        raise InvalidConfigError(f"tensor_parallel_size={size} must divide the model's intermediate_size="
                                 f"{hf_config.intermediate_size}")


def shard_state(own: dict[str, torch.Tensor], model, tp: TensorParallelGroup) -> dict[str, torch.Tensor]:
    """This rank's slices of a Llama-family state dict in our names (q/k/v and gate/up fused)."""
    out = dict(own)
    for i, layer in enumerate(model.layers):
        attention, p = layer.self_attn, f"layers.{i}."
        for kind in ("weight", "bias"):
            name = p + f"self_attn.qkv_proj.{kind}"
            if name in out:
                out[name] = _qkv_slice(out[name], attention, tp)
        out[p + "self_attn.o_proj.weight"] = out[p + "self_attn.o_proj.weight"][:, tp.shard(attention.total_q_size)]
        if attention.sinks is not None:
            out[p + "self_attn.sinks"] = out[p + "self_attn.sinks"][tp.shard(attention.total_num_heads)]
        intermediate = tp.shard(layer.mlp.total_intermediate_size)
        for kind in ("weight", "bias"):
            name = p + f"mlp.gate_up_proj.{kind}"
            if name in out:
                gate, up = out[name].chunk(2, dim=0)
                out[name] = torch.cat([gate[intermediate], up[intermediate]], dim=0)
        out[p + "mlp.down_proj.weight"] = out[p + "mlp.down_proj.weight"][:, intermediate]
        for name in (p + "self_attn.o_proj.bias", p + "mlp.down_proj.bias"):
            if name in out and tp.rank != 0:  # (added once: the all-reduce sums the ranks' outputs)
                out[name] = torch.zeros_like(out[name])
    return {name: tensor.contiguous() for name, tensor in out.items()}


def _qkv_slice(fused: torch.Tensor, attention, tp: TensorParallelGroup) -> torch.Tensor:
    """This rank's query heads, then its KV heads' keys and values, of a fused q/k/v tensor."""
    head_dim, q_size = attention.head_dim, attention.total_q_size
    kv_size = attention.total_num_kv_heads * head_dim
    query, key, value = fused[:q_size], fused[q_size : q_size + kv_size], fused[q_size + kv_size :]
    first_kv_head = tp.rank * attention.total_num_kv_heads // tp.size
    kv = slice(first_kv_head * head_dim, (first_kv_head + attention.num_kv_heads) * head_dim)
    return torch.cat([query[tp.shard(q_size)], key[kv], value[kv]], dim=0)
