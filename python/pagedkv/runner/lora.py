"""LoRA adapters per request (vLLM's `enable_lora` / `LoRARequest`): one base model serves many
fine-tunes at once. An adapter is a PEFT directory (`adapter_config.json` +
`adapter_model.safetensors`); each projection it targets gets `scale * B (A x)` added to its
output for the tokens of the requests that named it, so requests with different adapters (or
none) share one batch, and one forward pass. Adapters load on first use and stay in memory
(up to `max_cpu_loras`, least recently used dropped first)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

from pagedkv.errors import InvalidConfigError
from pagedkv.params.lora_request import LoRARequest

logger = logging.getLogger("pagedkv.runner.lora")

# PEFT module name -> (our fused module, which of its parts): q/k/v share qkv_proj, gate/up
# gate_up_proj; None: the whole module (Phi-3's checkpoints, and so its adapters, hold them fused).
_TARGETS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
    "qkv_proj": ("qkv_proj", None), "gate_up_proj": ("gate_up_proj", None),
    "c_fc": ("c_fc", 0), "c_proj": ("c_proj", 0),  # StarCoder2's MLP
    "fc1": ("c_fc", 0), "fc2": ("c_proj", 0), "dense": ("o_proj", 0),  # Phi-2's names for the same
}
_STACKS_KEPT = 8  # adapter sets whose stacked matrices are kept
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRADelta:
    """One projection's low-rank update: output[:, start:end] += (x @ a.T) @ b.T, with the
    adapter's scale folded into `b`; `width` is the whole (fused) output's."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [end - start, rank]
    start: int
    end: int
    width: int


class LoRAAdapter:
    """A loaded adapter: {(layer index, fused module name): [LoRADelta, ...]}."""

    def __init__(self, request: LoRARequest, deltas: dict[tuple[int, str], list[LoRADelta]], rank: int):
        self.request = request
        self.deltas = deltas
        self.rank = rank


class StackedAdapters:
    """Several adapters' updates of each projection as one pair of matrices, so a batch mixing
    them costs the same few ops per projection as one adapter: A stacks every adapter's A rows
    ([total rank, in]), B places each adapter's B at its output columns ([width, total rank]),
    and `owner` says which adapter (its index in the batch) each rank column belongs to."""

    def __init__(self, adapters: list[LoRAAdapter]):
        self.adapters = adapters
        self.modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        owners: dict[tuple[int, ...], torch.Tensor] = {}  # one tensor per column layout (masks are cached by it)
        for key in sorted({key for adapter in adapters for key in adapter.deltas}):
            a_rows, b_blocks, owner = [], [], []
            for index, adapter in enumerate(adapters):
                for delta in adapter.deltas.get(key, ()):
                    block = delta.b.new_zeros((delta.width, delta.b.shape[1]))
                    block[delta.start : delta.end] = delta.b
                    a_rows.append(delta.a)
                    b_blocks.append(block)
                    owner += [index] * delta.a.shape[0]
            owner_tensor = owners.setdefault(tuple(owner), torch.tensor(owner, device=a_rows[0].device))
            self.modules[key] = (torch.cat(a_rows), torch.cat(b_blocks, dim=1), owner_tensor)


class LoRABatch:
    """One step's adapters: `token_adapter[t]` is the index (in `stacked`) of token t's adapter,
    -1 for the base model. Models call `add` after each projection an adapter may target."""

    def __init__(self, stacked: StackedAdapters, token_adapter: torch.Tensor):
        self.stacked = stacked
        self.token_adapter = token_adapter
        self._masks: dict[int, torch.Tensor] = {}

    def add(self, layer_index: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += each token's adapter update of `module` in layer `layer_index` (rows of x and
        out are tokens); the update of every adapter is computed for every token and masked."""
        entry = self.stacked.modules.get((layer_index, module))
        if entry is None:
            return
        a, b, owner = entry
        mask = self._masks.get(id(owner))
        if mask is None:
            mask = (self.token_adapter[:, None] == owner[None, :]).to(x.dtype)
            self._masks[id(owner)] = mask
        out.addmm_((x @ a.T) * mask, b.T)


class LoRARegistry:
    """Adapters by id, loaded on first use for one model; at most `max_loaded` of them (least
    recently used dropped first; a request holds its adapter itself, so dropping never breaks one)."""

    def __init__(self, model, max_lora_rank: int, dtype: torch.dtype, device: torch.device,
                 max_loaded: Optional[int] = None):
        self.model, self.max_lora_rank, self.dtype, self.device = model, max_lora_rank, dtype, device
        self.max_loaded = max_loaded
        self.adapters: dict[int, LoRAAdapter] = {}  # least recently used first
        # By the adapter objects' identities (a stack holds its adapters, so they stay unique):
        # an id dropped and loaded again from elsewhere gets a stack of its own. Most recent last.
        self._stacks: dict[tuple[int, ...], StackedAdapters] = {}

    def stacked(self, adapters: list[LoRAAdapter]) -> StackedAdapters:
        """The StackedAdapters of these adapters (in this order), reused while the same set runs."""
        key = tuple(id(adapter) for adapter in adapters)
        stack = self._stacks.pop(key, None) or StackedAdapters(adapters)
        self._stacks[key] = stack
        if len(self._stacks) > _STACKS_KEPT:
            del self._stacks[next(iter(self._stacks))]
        return stack

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The loaded adapter of `request`; raises InvalidConfigError for an adapter this model
        cannot run (naming the reason), ValueError for an id reused with another name or path."""
        if not isinstance(request.lora_int_id, int) or request.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {request.lora_int_id!r}")
        adapter = self.adapters.get(request.lora_int_id)
        if adapter is not None:
            known = adapter.request
            if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} "
                                 f"at {known.lora_path!r}")
            self.adapters[request.lora_int_id] = self.adapters.pop(request.lora_int_id)  # most recent
            return adapter
        adapter = load_adapter(request, self.model, self.max_lora_rank, self.dtype, self.device)
        self.adapters[request.lora_int_id] = adapter
        while self.max_loaded is not None and len(self.adapters) > self.max_loaded:
            dropped = self.adapters.pop(next(iter(self.adapters)))
            logger.info("dropped LoRA adapter %r (id %d): max_cpu_loras=%d", dropped.request.lora_name,
                        dropped.request.lora_int_id, self.max_loaded)
        logger.info("loaded LoRA adapter %r (id %d, rank %d, %d projections) from %s", request.lora_name,
                    request.lora_int_id, adapter.rank, sum(map(len, adapter.deltas.values())), request.lora_path)
        return adapter


def load_adapter(request: LoRARequest, model, max_lora_rank: int, dtype, device) -> LoRAAdapter:
    """Reads a PEFT LoRA directory and checks it against `model` (a LlamaForCausalLM)."""
    path = request.lora_path
    config_path = os.path.join(path, "adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    for required in (config_path, weights_path):
        if not os.path.isfile(required):
            raise InvalidConfigError(f"LoRA adapter {request.lora_name!r}: {required} does not exist "
                                     "(a PEFT directory needs adapter_config.json and adapter_model.safetensors)")
    try:
        with open(config_path) as file:
            config = json.load(file)
    except (OSError, ValueError) as error:
        raise InvalidConfigError(f"LoRA adapter {request.lora_name!r}: {config_path} is not readable JSON ({error})") from None
    if not isinstance(config, dict):
        raise InvalidConfigError(f"LoRA adapter {request.lora_name!r}: {config_path} is not a JSON object")
    _check_config(request.lora_name, config, max_lora_rank)
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    from safetensors.torch import load_file

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        weights = load_file(weights_path)
    except Exception as error:  # (safetensors' own error type for a damaged file)
        raise InvalidConfigError(f"LoRA adapter {request.lora_name!r}: {weights_path} is not a readable "
                                 f"safetensors file ({error})") from None
    for key, tensor in weights.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in _TARGETS:
            raise InvalidConfigError(f"LoRA adapter {request.lora_name!r}: weight {key!r} is not a LoRA update of "
                                     f"one of {sorted(_TARGETS)} (embedding, lm_head and DoRA adapters are not supported)")
        pairs.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    deltas: dict[tuple[int, str], list[LoRADelta]] = {}
    for (layer_index, name), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise InvalidConfigError(f"LoRA adapter {request.lora_name!r}: layer {layer_index} {name} lacks lora_"
                                     f"{'A' if 'A' not in pair else 'B'}")
        deltas.setdefault((layer_index, _TARGETS[name][0]), []).append(
            _delta(request.lora_name, model, layer_index, name, pair["A"], pair["B"], scale, dtype, device))
    if not deltas:
        raise InvalidConfigError(f"LoRA adapter {request.lora_name!r} holds no LoRA weights")
    return LoRAAdapter(request, deltas, rank)


def _check_config(name: str, config: dict, max_lora_rank: int) -> None:
    def fail(message: str):
        raise InvalidConfigError(f"LoRA adapter {name!r}: {message}")

    if config.get("peft_type", "LORA") != "LORA":
        fail(f"peft_type is {config.get('peft_type')!r}, not 'LORA'")
    if "r" not in config or int(config["r"]) < 1:
        fail("adapter_config.json needs a rank r >= 1")
    if int(config["r"]) > max_lora_rank:  # (the words vLLM's tests match)
        fail(f"LoRA rank {config['r']} is greater than max_lora_rank {max_lora_rank}")
    if config.get("use_dora"):
        fail("use_dora=true: pagedkv does not yet support DoRA")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in ("gaussian", "eva", "orthogonal", "mica", "lora_ga"):
        # (these only set the adapter's starting weights; the others changed the base model's)
        fail(f"init_lora_weights={init!r} is not supported: inits such as PiSSA, OLoRA, CorDA and LoftQ modify the "
             "base model's weights; convert the adapter to a plain LoRA with PEFT's "
             "path_initial_model_for_weight_conversion")
    for unsupported in ("fan_in_fan_out", "lora_bias", "use_qalora", "layer_replication", "alora_invocation_tokens"):
        if config.get(unsupported):
            fail(f"{unsupported}={config[unsupported]!r} is not supported")
    for per_module in ("rank_pattern", "alpha_pattern"):
        if config.get(per_module):
            fail(f"{per_module} (per-module ranks) is not supported")
    if config.get("bias", "none") != "none":
        fail(f"bias={config['bias']!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        fail(f"Unsupported modules_to_save: {config['modules_to_save']} (fully trained modules)")


def _delta(adapter_name, model, layer_index, name, a, b, scale, dtype, device) -> LoRADelta:
    if not 0 <= layer_index < len(model.layers):
        raise InvalidConfigError(f"LoRA adapter {adapter_name!r}: layer {layer_index} is not in the model "
                                 f"({len(model.layers)} layers)")
    layer = model.layers[layer_index]
    fused_name, part = _TARGETS[name]
    if layer.is_moe and fused_name not in ("qkv_proj", "o_proj"):
        raise InvalidConfigError(f"LoRA adapter {adapter_name!r}: layer {layer_index} {name} is a mixture of experts; "
                                 "adapters of expert layers are not supported (attention projections are)")
    module = getattr(layer.self_attn if fused_name in ("qkv_proj", "o_proj") else layer.mlp, fused_name, None)
    if module is None:
        raise InvalidConfigError(f"LoRA adapter {adapter_name!r}: this model has no {name} to adapt")
    if part is None:
        sizes, part = [module.out_features], 0
    elif fused_name == "qkv_proj":
        attention = layer.self_attn
        sizes = [attention.q_size, attention.kv_size, attention.kv_size]
    elif fused_name == "gate_up_proj":
        sizes = [module.out_features // 2] * 2
    else:
        sizes = [module.out_features]
    start = sum(sizes[:part])
    expected_a, expected_b = (a.shape[0], module.in_features), (sizes[part], a.shape[0])
    if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
        raise InvalidConfigError(f"LoRA adapter {adapter_name!r}: layer {layer_index} {name} has A {tuple(a.shape)} "
                                 f"and B {tuple(b.shape)}; this model needs A [r, {module.in_features}] and "
                                 f"B [{sizes[part]}, r]")
    return LoRADelta(a.to(device=device, dtype=dtype), (b.float() * scale).to(device=device, dtype=dtype),
                     start, start + sizes[part], sum(sizes))


def lora_batch(registry: LoRARegistry, adapters: list[Optional[LoRAAdapter]], token_counts: list[int],
               device) -> Optional[LoRABatch]:
    """The LoRABatch of a step whose i-th scheduled sequence has token_counts[i] tokens and runs
    adapters[i] (None: the base model); None when no sequence has one."""
    active = list({id(adapter): adapter for adapter in adapters if adapter is not None}.values())
    if not active:
        return None
    index = {id(adapter): i for i, adapter in enumerate(active)}
    token_adapter = [index[id(adapter)] if adapter is not None else -1
                     for adapter, count in zip(adapters, token_counts) for _ in range(count)]
    return LoRABatch(registry.stacked(active), torch.tensor(token_adapter, device=device))
