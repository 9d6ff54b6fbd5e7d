"""Which models shard over a tensor-parallel group, and each rank's slice of their weights
(Megatron style, as vLLM's ColumnParallelLinear / RowParallelLinear): q/k/v and gate/up split by
output, o_proj and down_proj by input (an all-reduce sums the ranks' parts), KV heads split
across ranks or, with more ranks than KV heads, each rank holding the one its query heads read
(the query heads of rank r read KV head r * num_kv_heads // size, GQA's grouping).
Embeddings, norms and the LM head are replicated: every rank ends a step with the full hidden
states, and rank 0 samples from its own logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedkv.errors import InvalidConfigError
from pagedkv.parallel.group import TensorParallelGroup

if TYPE_CHECKING:
    from pagedkv.models.registry import Traits


def check_shardable(hf_config, model_class, traits: Traits, size: int) -> None:
    """Raises InvalidConfigError, naming the numbers, unless `size` ranks can shard this model
    (a checkpoint's loader.ModelSpec: its config, class and traits)."""
    from pagedkv.layers.fused_moe import is_moe_layer
    from pagedkv.models.llama import LlamaForCausalLM

    model_type = hf_config.model_type
    # (norms over whole q/k projections span every rank's heads; the ungated MLP has no sharding rules)
    if model_class is not LlamaForCausalLM or traits.qk_norm == "projection" or traits.ungated_mlp:
        raise InvalidConfigError(f"tensor_parallel_size={size}: model_type {model_type!r} does not shard yet "
                                 "(tensor parallelism covers the Llama family: llama, mistral, qwen2, qwen3, "
                                 "smollm3, granite, phi3, ...)")
    if any(is_moe_layer(hf_config, traits, i) for i in range(hf_config.num_hidden_layers)):
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


class CheckpointShard:
    """This rank's slice of each checkpoint tensor, by HF name (before q/k/v and gate/up are
    fused): the same rows or columns whether the tensor is in memory or still in a safetensors
    file (`safe_open(...).get_slice(name)`), so a rank reads its shard and no more."""

    def __init__(self, hf_config, tp: TensorParallelGroup):
        self.tp = tp
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        q_size, kv_size, intermediate = num_heads * head_dim, num_kv_heads * head_dim, hf_config.intermediate_size
        first_kv_head = tp.rank * num_kv_heads // tp.size
        kv = (first_kv_head * head_dim, (first_kv_head + max(1, num_kv_heads // tp.size)) * head_dim)
        q, mlp = tp.shard(q_size), tp.shard(intermediate)
        # name suffix -> (dim, [(start, stop), ...] concatenated), or None: zeros on ranks other than 0
        self.rules = {
            "self_attn.q_proj": (0, [q]),
            "self_attn.k_proj": (0, [kv]),
            "self_attn.v_proj": (0, [kv]),
            "self_attn.qkv_proj": (0, [q, _shift(kv, q_size), _shift(kv, q_size + kv_size)]),  # (Phi-3's, fused)
            "self_attn.o_proj.weight": (1, [q]),
            "self_attn.sinks": (0, [tp.shard(num_heads)]),
            "mlp.gate_proj": (0, [mlp]),
            "mlp.up_proj": (0, [mlp]),
            "mlp.gate_up_proj": (0, [mlp, _shift(mlp, intermediate)]),  # (Phi-3's, fused)
            "mlp.down_proj.weight": (1, [mlp]),
            "self_attn.o_proj.bias": None,  # (added once: the all-reduce sums the ranks' outputs)
            "mlp.down_proj.bias": None,
        }

    def rule(self, name: str):
        """(dim, ranges) for a sharded tensor, None for a bias only rank 0 adds, False if whole."""
        for suffix, rule in self.rules.items():
            if f".{suffix}." in f".{name}.":
                return rule
        return False

    def take(self, name: str, source) -> torch.Tensor:
        """This rank's part of `source` (a tensor, or a safetensors slice of one)."""
        rule = self.rule(name)
        if rule is False:
            return source if isinstance(source, torch.Tensor) else source[:]
        if rule is None:
            whole = source if isinstance(source, torch.Tensor) else source[:]
            return whole if self.tp.rank == 0 else torch.zeros_like(whole)
        dim, ranges = rule
        parts = [source[start:stop] if dim == 0 else source[:, start:stop] for start, stop in ranges]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)).contiguous()

    def of(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: self.take(name, tensor) for name, tensor in state.items()}


def _shift(span: tuple[int, int], offset: int) -> tuple[int, int]:
    return span[0] + offset, span[1] + offset
