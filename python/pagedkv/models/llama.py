"""The Llama family (Llama, Mistral with sliding-window attention, Qwen2 with qkv bias, Qwen3 with
per-head q/k norms, SmolLM3 with rotary-free layers, Granite with its multipliers, Phi-3 with
partial rotary and LongRoPE, tied embeddings, and the mixture-of-experts Mixtral, Qwen2-MoE and
Qwen3-MoE) over the paged cache.

Weights come from HF checkpoints, a decoder layer at a time (loader.py, load_hf_weights); Q/K/V and
gate/up projections are fused into one matmul each, and a MoE layer's experts are stacked into one
tensor per projection, each checkpoint tensor copied into its place.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention.step_context import StepContext
from pagedkv.layers.activation import silu_and_mul
from pagedkv.layers.fused_moe import is_moe_layer, sparse_moe
from pagedkv.layers.quantized_embedding import BFloat16Embedding, QuantizedEmbedding
from pagedkv.layers.rms_norm import RMSNorm
from pagedkv.layers.rotary_embedding import RotaryEmbedding, split_and_rotate, split_heads
from pagedkv.layers.ungated_mlp import UngatedMLP
from pagedkv.models import llama_cpu_decode
from pagedkv.models.registry import Traits
from pagedkv.parallel.group import current_group


def layer_sliding_window(hf_config, layer_index: int) -> int | None:
    """The attention window of this layer, or None for full attention: Mistral's and Mixtral's
    `sliding_window` in every layer; Qwen's and SmolLM3's only with `use_sliding_window`, in the
    layers their `layer_types` name "sliding_attention"."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or not getattr(hf_config, "use_sliding_window", True):  # (Qwen's and SmolLM3's switch)
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and layer_types[layer_index] != "sliding_attention":
        return None
    return int(window)


def norm_eps(hf_config) -> float:
    """The epsilon of the model's norms: `rms_norm_eps`, StarCoder2's `norm_epsilon`, Nemotron's
    `norm_eps`, Cohere's `layer_norm_eps`, GPT-2's `layer_norm_epsilon`, else LayerNorm's default
    (OPT's)."""
    for name in ("rms_norm_eps", "norm_epsilon", "norm_eps", "layer_norm_eps", "layer_norm_epsilon"):
        eps = getattr(hf_config, name, None)
        if eps is not None:
            return eps
    return 1e-5


class LlamaAttention(nn.Module):
    def __init__(self, hf_config, traits: Traits, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        # Under tensor parallelism this rank holds num_heads of the model's query heads and
        # num_kv_heads KV heads (parallel/sharding.py); o_proj's partial outputs are summed.
        self.tp = current_group()
        total_num_heads = hf_config.num_attention_heads
        total_num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or total_num_heads
        self.num_heads = total_num_heads // self.tp.size
        self.num_kv_heads = max(1, total_num_kv_heads // self.tp.size)
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // total_num_heads
        # Granite scales attention by its own multiplier
        self.scale = getattr(hf_config, "attention_multiplier", None) or self.head_dim**-0.5
        self.sliding_window = layer_sliding_window(hf_config, layer_index)
        self.logit_softcap = getattr(hf_config, "attn_logit_softcapping", None)  # Gemma 2's
        # GPT-OSS's attention sinks: a learned logit per query head, a key of value zero
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if traits.attention_sinks else None
        # SmolLM3 leaves rotary embedding out of the layers whose no_rope_layers entry is 0
        no_rope_layers = getattr(hf_config, "no_rope_layers", None)
        self.use_rope = no_rope_layers is None or bool(no_rope_layers[layer_index])
        if traits.nope_full_layers and not self.sliding_window:
            self.use_rope = False  # EXAONE 4's full layers beside windowed ones: no positions (NoPE)
        self.rope_interleaved = traits.interleaved_rope
        bias = bool(getattr(hf_config, "attention_bias", False) or getattr(hf_config, "use_bias", False)
                    or getattr(hf_config, "qkv_bias", False) or getattr(hf_config, "use_qkv_bias", False)
                    or traits.qkv_bias)
        output_bias = bool(getattr(hf_config, "attention_bias", False) or getattr(hf_config, "use_bias", False))
        output_bias = bool(getattr(hf_config, "attention_out_bias", output_bias))  # (Seed-OSS names its own)
        output_bias = output_bias and not traits.unbiased_o_proj
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(hf_config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hf_config.hidden_size, bias=output_bias)
        self.qk_norm_per_head = traits.qk_norm == "head"
        if self.qk_norm_per_head:
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
        elif traits.qk_norm == "projection":
            self.q_norm = RMSNorm(self.q_size, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, hf_config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.clip_qkv = getattr(hf_config, "clip_qkv", None)  # OLMoE's

    def forward(self, hidden, cos_sin, context: StepContext):
        num_tokens = hidden.shape[0]
        lora = context.lora
        qkv = self.qkv_proj(hidden)
        if lora is not None:
            lora.add(self.layer_index, "qkv_proj", hidden, qkv)
        if self.q_norm is not None:
            self._normalize_query_and_key_(qkv)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        if self.use_rope:
            query, key, value = split_and_rotate(qkv, cos_sin, self.num_heads, self.num_kv_heads, self.head_dim,
                                                 self.rope_interleaved)
        else:
            query, key, value = split_heads(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        out = context.attend(self.layer_index, query, key, value, self.scale, self.sliding_window, self.logit_softcap,
                             self.sinks)
        out = out.reshape(num_tokens, self.q_size)
        projected = self.o_proj(out)
        if lora is not None:
            lora.add(self.layer_index, "o_proj", out, projected)
        return self.tp.all_reduce(projected)

    def _normalize_query_and_key_(self, qkv: torch.Tensor) -> None:
        """RMSNorm over each query and key head (Qwen3's) or over the query and key projections
        as wholes (OLMo's), before the rotation; writes qkv."""
        num_tokens = qkv.shape[0]
        query, key = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
        if self.qk_norm_per_head:
            query = query.reshape(num_tokens * self.num_heads, self.head_dim)
            key = key.reshape(num_tokens * self.num_kv_heads, self.head_dim)
        qkv[:, : self.q_size] = self.q_norm(query.contiguous()).view(num_tokens, self.q_size)
        qkv[:, self.q_size : self.q_size + self.kv_size] = self.k_norm(key.contiguous()).view(num_tokens, self.kv_size)


class LlamaMLP(nn.Module):
    def __init__(self, hf_config, layer_index: int, act_and_mul=silu_and_mul):
        super().__init__()
        self.layer_index = layer_index
        self.act_and_mul = act_and_mul
        self.tp = current_group()  # (each rank holds a slice of the intermediate columns)
        intermediate_size = hf_config.intermediate_size // self.tp.size
        bias = bool(getattr(hf_config, "mlp_bias", False) or getattr(hf_config, "use_bias", False))
        self.gate_up_proj = nn.Linear(hf_config.hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hf_config.hidden_size, bias=bias)

    def forward(self, hidden, lora=None):
        if lora is None:
            return self.tp.all_reduce(self.down_proj(self.act_and_mul(self.gate_up_proj(hidden))))
        gate_up = self.gate_up_proj(hidden)
        lora.add(self.layer_index, "gate_up_proj", hidden, gate_up)
        activated = self.act_and_mul(gate_up)
        out = self.down_proj(activated)
        lora.add(self.layer_index, "down_proj", activated, out)
        return self.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config, traits: Traits, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.self_attn = LlamaAttention(hf_config, traits, layer_index)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.residual_multiplier = getattr(hf_config, "residual_multiplier", 1.0)  # Granite's
        self.is_moe = is_moe_layer(hf_config, traits, layer_index)
        if self.is_moe:
            self.mlp = sparse_moe(hf_config, traits)
        elif traits.ungated_mlp:
            self.mlp = UngatedMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act, layer_index,
                                  bias=bool(getattr(hf_config, "mlp_bias", False)))
        else:
            self.mlp = LlamaMLP(hf_config, layer_index)

    def forward(self, hidden, residual, cos_sin, context: StepContext):
        """(hidden, residual) -> the next layer's (hidden, residual), whose sum is this layer's
        output (vLLM's form: each norm adds the residual in, fused on the CPU)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos_sin, context)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        # LoRA adapters never target experts (refused when they load)
        hidden = self.mlp(hidden) if self.is_moe else self.mlp(hidden, context.lora)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], context) -> hidden [T, H]; `context` (a StepContext)
    holds the step's attention metadata, KV cache and attention backend, and its LoRA adapters
    (a pagedkv.runner.lora.LoRABatch, or None), which add their updates to the projections."""

    # What a variant of the family swaps (Gemma's and OLMo's: their decoder layers and norm); the
    # decoder layer is a class or a function building one from (hf_config, traits, layer_index)
    decoder_layer_class = LlamaDecoderLayer
    norm_class = RMSNorm
    # The LM head's product (layers.cpu_linear.use_cpu_linear swaps in the CPU kernel's)
    lm_head_linear = staticmethod(F.linear)

    def __init__(self, hf_config, traits: Traits, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.hf_config = hf_config
        self.traits = traits  # (registry.resolve_traits(hf_config))
        self.embed_tokens = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer_class(hf_config, traits, i)
                                    for i in range(hf_config.num_hidden_layers))
        self.norm = self.norm_class(hf_config.hidden_size, norm_eps(hf_config))
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
        # Granite's: embeddings scaled up, logits scaled down
        self.embedding_multiplier = getattr(hf_config, "embedding_multiplier", 1.0)
        self.logits_scaling = getattr(hf_config, "logits_scaling", 1.0)
        self.compute_buffers(max_positions, dtype)

    def compute_buffers(self, max_positions: int, dtype: torch.dtype) -> None:
        """(Re)builds what is computed, not loaded: the rotary tables (the loader builds the model
        on the meta device, which leaves them empty). Where `rope_parameters` are per layer type
        (Gemma 3's, OLMo 3's), sliding layers get a table of their own."""
        if "full_attention" in (getattr(self.hf_config, "rope_parameters", None) or {}):
            self.rotary = RotaryEmbedding(self.hf_config, max_positions, dtype, "full_attention")
            self.rotary_sliding = RotaryEmbedding(self.hf_config, max_positions, dtype, "sliding_attention")
        else:
            self.rotary, self.rotary_sliding = RotaryEmbedding(self.hf_config, max_positions, dtype), None

    def layer_rotations(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (cos, sin) for these positions, looked up once per table."""
        full = self.rotary(positions)
        if self.rotary_sliding is None:
            return [full] * len(self.layers)
        sliding = self.rotary_sliding(positions)
        layer_types = self.hf_config.layer_types
        return [sliding if layer_type == "sliding_attention" else full for layer_type in layer_types]

    def forward(self, input_ids, positions, context: StepContext) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        one_call = llama_cpu_decode.decode_path(self, hidden, context)
        if one_call is not None:
            hidden, residual = one_call.forward(self, hidden, positions, context)
        else:
            for layer, cos_sin in zip(self.layers, self.layer_rotations(positions)):
                hidden, residual = layer(hidden, residual, cos_sin, context)
        return self.norm(hidden, residual)[0]

    @property
    def lm_head_weight(self) -> torch.Tensor | None:
        """The LM head's float weight, as `lm_head_linear` takes it; None where the head (or the
        tied embedding table) is kept as the GGUF stores it (the head's product reads that itself)."""
        if not self.tie_word_embeddings:
            head = getattr(self, "lm_head", None)  # (a kept head's float module is dropped)
            return None if head is None else head.weight
        kept = isinstance(self.embed_tokens, (QuantizedEmbedding, BFloat16Embedding))
        return None if kept else self.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head_linear(hidden, self.lm_head_weight).float()
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling

    def compute_narrow_logits(self, hidden: torch.Tensor, order_only: bool = False) -> torch.Tensor:
        """The LM head's output in the model's dtype, where all `compute_logits` adds to it is the
        float32 copy (widening is exact, so a draw or argmax over these is the same; on the CPU the
        copy costs as much as the argmax: 50 MB written at 256 rows of a 49k vocabulary): for
        logits_scaling 1, or any positive scaling when only the order is read (`order_only`:
        greedy rows' argmax). Else `compute_logits`'."""
        scaling = self.logits_scaling
        if type(self).compute_logits is not LlamaForCausalLM.compute_logits or not (
                scaling == 1.0 or (order_only and scaling > 0)):
            return self.compute_logits(hidden)
        return self.lm_head_linear(hidden, self.lm_head_weight)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Loads a whole HF state dict (a GGUF file's, transformers' in memory): load_hf_weights
        with one group."""
        self.load_hf_weights([state])

    def load_hf_weights(self, groups: Iterable[dict[str, torch.Tensor]]) -> None:
        """Loads HF-named weights a group at a time (loader.py streams a checkpoint one decoder
        layer per group, the weights outside the layers in a group of their own), each tensor copied
        into its parameter and cast to its dtype on the way: q/k/v and gate/up into their rows of
        the fused projection, each expert into its index of the stacked ones (nano-vllm's
        weight_loader). A group must hold every tensor one of our weights is made of. Fails
        loudly, after the last group, on weights missing or left over."""
        targets = self.state_dict(keep_vars=True)
        # Modules a GGUF's blocks stand for (models/gguf_quantized.py): their float weight is only
        # checked against them as it streams past (a check of None: it never streams); their own
        # state is already filled.
        checks = self.__dict__.pop("kept_weight_checks", {})
        kept_modules = tuple(name.removesuffix("weight") for name in checks)  # ("layers.0.self_attn.qkv_proj.", ...)
        loaded = {name for name in targets if name.startswith(kept_modules) and not name.endswith(".bias")}
        unexpected = []
        with torch.no_grad():
            for group in groups:
                for name, value in self.own_weights(group).items():
                    if checks.get(name) is not None:
                        checks.pop(name)(value)
                    elif name in targets:
                        fill_(targets[name], value, name)
                        loaded.add(name)
                    elif "rotary" not in name:
                        unexpected.append(name)
        missing = [name for name in targets if name not in loaded] + [name for name in checks if checks[name]]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")

    def own_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | list]:
        """Some HF-named weights (a group of load_hf_weights) under our names: q/k/v and gate/up
        as the lists of parts their fused parameters are made of, a MoE layer's experts as lists
        to stack (see fill_). A family's model class adds its renames here."""
        own = {}
        prefix = "model."
        for name, tensor in state.items():
            if name.startswith(prefix):
                name = name[len(prefix) :]
            # Mixtral's and Granite MoE's name for the MoE, GPT-OSS's and Granite MoE's for its router
            name = name.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.router.layer.", ".mlp.gate.")
            own[name.replace(".mlp.router.", ".mlp.gate.")] = tensor
        fused = {}
        layer_indices = {int(name.split(".")[1]) for name in own if name.startswith("layers.")}
        for i in sorted(index for index in layer_indices if index < len(self.layers)):
            layer, p = self.layers[i], f"layers.{i}."
            if p + "self_attn.k_proj.weight" in own:  # (Phi-3 stores them fused already; MLA has no k/v)
                fused[p + "self_attn.qkv_proj.weight"] = [own.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
            if p + "self_attn.k_proj.bias" in own:  # (also without the weights: a GGUF's kept blocks stand for them)
                fused[p + "self_attn.qkv_proj.bias"] = [own.pop(p + f"self_attn.{x}_proj.bias") for x in "qkv"]
            if layer.is_moe:
                fused.update(_stacked_experts(own, p + "mlp.", layer.mlp.num_experts))
            elif isinstance(layer.mlp, UngatedMLP) and p + "mlp.up_proj.weight" in own:  # (Arcee's, Nemotron's)
                for ours, theirs in (("c_fc", "up_proj"), ("c_proj", "down_proj")):
                    for kind in ("weight", "bias"):
                        if p + f"mlp.{theirs}.{kind}" in own:
                            fused[p + f"mlp.{ours}.{kind}"] = own.pop(p + f"mlp.{theirs}.{kind}")
            elif p + "mlp.gate_proj.weight" in own:  # (StarCoder2's c_fc and c_proj load as they are)
                for kind in ("weight", "bias") if p + "mlp.gate_proj.bias" in own else ("weight",):
                    fused[p + f"mlp.gate_up_proj.{kind}"] = [own.pop(p + f"mlp.gate_proj.{kind}"),
                                                             own.pop(p + f"mlp.up_proj.{kind}")]
        own.update(fused)
        if self.tie_word_embeddings:
            own.pop("lm_head.weight", None)
        return own


def fill_(target: torch.Tensor, value: torch.Tensor | list, name: str) -> None:
    """Copies `value` into the parameter `target` (casting it): a tensor of its shape, or a list of
    parts laid along dim 0, each some rows (a tensor of target's rank: q, k, v of a fused qkv) or
    one index (of lower rank, or a list itself: one expert of stacked ones)."""
    if isinstance(value, torch.Tensor):
        if value.shape != target.shape:
            raise ValueError(f"checkpoint's {name} has shape {list(value.shape)}, the model's {list(target.shape)}")
        target.copy_(value)
        return
    one_index = [isinstance(part, list) or part.dim() < target.dim() for part in value]
    rows = [1 if index else part.shape[0] for part, index in zip(value, one_index)]
    if sum(rows) != target.shape[0]:
        shapes = [len(part) if isinstance(part, list) else list(part.shape) for part in value]
        raise ValueError(f"checkpoint's parts of {name} (shapes {shapes}) make {sum(rows)} rows, the model's "
                         f"{target.shape[0]}")
    row = 0
    for part, index, count in zip(value, one_index, rows):
        fill_(target[row] if index else target[row : row + count], part, name)
        row += count


class PlainLayersForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM for decoder layers that take and return the hidden states alone (no
    residual stream beside them, unlike LlamaDecoderLayer's): Gemma's, OLMo's and the GPT-style
    blocks of blocks.py. `embed` is where a model scales its embeddings or adds positions;
    `checkpoint_names` are (theirs, ours) substrings of weight names, replaced in order at load."""

    checkpoint_names: tuple[tuple[str, str], ...] = ()

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def renamed(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` under our names (`checkpoint_names`)."""
        out = {}
        for name, tensor in state.items():
            for theirs, ours in self.checkpoint_names:
                name = name.replace(theirs, ours)
            out[name] = tensor
        return out

    def own_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | list]:
        return super().own_weights(self.renamed(state))

    def forward(self, input_ids, positions, context: StepContext) -> torch.Tensor:
        hidden = self.embed(input_ids, positions)
        for layer, cos_sin in zip(self.layers, self.layer_rotations(positions)):
            hidden = layer(hidden, cos_sin, context)
        return self.norm(hidden)


def _stacked_experts(own: dict[str, torch.Tensor], p: str, num_experts: int) -> dict[str, torch.Tensor | list]:
    """One MoE layer's weights in our names (lists to stack, as own_weights gives them), popped
    from `own`: the experts as checkpoints store them (Mixtral's w1/w3/w2 or Qwen's
    gate/up/down_proj, one tensor each per expert; Granite MoE's stacked input/output_linear;
    GPT-OSS's stacked, transposed and interleaved, with biases) or as transformers holds them in
    memory (already stacked: experts.gate_up_proj, experts.down_proj)."""
    out = {}
    for name in ("gate_up_proj", "down_proj"):
        if p + f"experts.{name}_blocks" in own:  # GPT-OSS's MXFP4 experts, widened as transformers widens them
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors

            blocks, scales = own.pop(p + f"experts.{name}_blocks"), own.pop(p + f"experts.{name}_scales")
            own[p + f"experts.{name}"] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    if p + "experts.gate_up_proj_bias" in own:  # GPT-OSS: [E, H, 2I] with gate and up interleaved, biases
        gate_up, gate_up_bias = own.pop(p + "experts.gate_up_proj"), own.pop(p + "experts.gate_up_proj_bias")
        out[p + "expert_gate_up"] = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2)
        out[p + "expert_gate_up_bias"] = torch.cat([gate_up_bias[:, ::2], gate_up_bias[:, 1::2]], dim=-1)
        out[p + "expert_down"] = own.pop(p + "experts.down_proj").transpose(1, 2)
        out[p + "expert_down_bias"] = own.pop(p + "experts.down_proj_bias")
    elif p + "input_linear.weight" in own:  # Granite MoE's: stacked, [gate; up] per expert
        out[p + "expert_gate_up"] = own.pop(p + "input_linear.weight")
        out[p + "expert_down"] = own.pop(p + "output_linear.weight")
    elif p + "experts.gate_up_proj" in own:
        gate_up, down = own.pop(p + "experts.gate_up_proj"), own.pop(p + "experts.down_proj")
        if gate_up.shape[2] != down.shape[1]:  # stored transposed ([E, H, 2I], [E, I, H]: Qwen3-VL-MoE's files)
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        out[p + "expert_gate_up"], out[p + "expert_down"] = gate_up, down
    else:
        gate, up, down = ("w1", "w3", "w2") if p + "experts.0.w1.weight" in own else ("gate_proj", "up_proj", "down_proj")
        expert = [f"{p}experts.{e}." for e in range(num_experts)]
        out[p + "expert_gate_up"] = [[own.pop(x + f"{gate}.weight"), own.pop(x + f"{up}.weight")] for x in expert]
        out[p + "expert_down"] = [own.pop(x + f"{down}.weight") for x in expert]
    if p + "shared_expert.gate_proj.weight" in own:
        out[p + "shared_gate_up.weight"] = [own.pop(p + "shared_expert.gate_proj.weight"),
                                            own.pop(p + "shared_expert.up_proj.weight")]
        out[p + "shared_down.weight"] = own.pop(p + "shared_expert.down_proj.weight")
    return out
