"""ModelRunner: owns the model and the KV cache; turns a scheduler plan into one forward pass."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from pagedkv.attention import AttentionMetadata, get_backend
from pagedkv.config import EngineConfig
from pagedkv.cuda_graphs import DecodeGraphs
from pagedkv.errors import InvalidConfigError
from pagedkv.kv_cache import KVCache
from pagedkv.loader import generation_defaults, load, load_generation_config
from pagedkv.lora import LoRARegistry, lora_batch

logger = logging.getLogger("pagedkv.model_runner")

_DEFAULT_CPU_KV_BYTES = 512 << 20


class ModelRunner:
    """Loads the model, sizes and allocates the KV cache, executes steps."""

    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype()
        self.kv_dtype = config.kv_cache_torch_dtype()
        loaded = load(config.model, config.gguf_file, config.tokenizer, self.dtype, self.device, config.max_model_len)
        self.model, self.tokenizer, self.hf_config = loaded.model, loaded.tokenizer, loaded.hf_config
        self.eos_token_ids, self.model_name = loaded.eos_token_ids, loaded.name
        self.generation_defaults = self._generation_defaults(loaded.generation_config)
        self.max_position_embeddings = self.hf_config.max_position_embeddings
        self.max_model_len = self._max_model_len()
        self.vocab_size = self.hf_config.vocab_size
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        attention = self.model.layers[0].self_attn
        self.backend = get_backend(config.attention_backend, config.device, attention.head_dim)
        num_layers = len(self.model.layers)
        self.sliding_window = _common_sliding_window(self.model)
        self.block_bytes = KVCache.bytes_per_block(
            num_layers, attention.num_kv_heads, attention.head_dim, config.block_size, self.kv_dtype
        )
        self.num_device_blocks = config.num_device_blocks or max(1, self._kv_budget() // self.block_bytes)
        self.num_cpu_blocks = config.swap_space_bytes // self.block_bytes
        self.kv_cache = KVCache(
            num_layers,
            attention.num_kv_heads,
            attention.head_dim,
            config.block_size,
            self.num_device_blocks,
            self.num_cpu_blocks,
            self.kv_dtype,
            self.device,
        )
        logger.info(
            "KV cache: %d device blocks + %d CPU blocks of %d tokens, %.1f KiB each (%s, %s backend)",
            self.num_device_blocks,
            self.num_cpu_blocks,
            config.block_size,
            self.block_bytes / 1024,
            self.kv_dtype,
            self.backend.name,
        )
        self.lora_registry = None
        if config.enable_lora:
            self.lora_registry = LoRARegistry(self.model, config.max_lora_rank, self.dtype, self.device,
                                              config.max_cpu_loras)
        self.decode_graphs = None
        if config.is_cuda and not config.enforce_eager:
            if any(layer.is_moe for layer in self.model.layers):
                logger.info("CUDA graphs off: a mixture-of-experts step sizes its expert matmuls on the host")
            elif not getattr(self.backend, "supports_cuda_graphs", False):
                logger.info("CUDA graphs off: the %r attention backend reads host-side metadata", self.backend.name)
            else:
                self.capture_decode_graphs()

    @torch.inference_mode()
    def capture_decode_graphs(self, capture=None) -> None:
        """Captures decode steps of up to max_num_seqs sequences as CUDA graphs (`capture`:
        see cuda_graphs.py; tests pass `replay_eagerly`)."""
        self.decode_graphs = DecodeGraphs(
            self.model, self.kv_cache, self.backend,
            max_batch_size=self.config.max_num_seqs, max_model_len=self.max_model_len,
            block_size=self.config.block_size, hidden_size=self.hf_config.hidden_size,
            dtype=self.dtype, device=self.device, capture=capture,
        )

    def _generation_defaults(self, model_generation_config) -> dict:
        """Default sampling parameters per `config.generation_config` (see EngineConfig)."""
        source = self.config.generation_config
        if source == "vllm":
            return {}
        generation_config = model_generation_config if source == "auto" else load_generation_config(source)
        defaults = generation_defaults(generation_config)
        if defaults:
            logger.info("default sampling parameters from %s's generation config: %s (generation_config='vllm' "
                        "leaves them out)", "the model" if source == "auto" else source, defaults)
        return defaults

    def _max_model_len(self) -> int:
        """`max_model_len`, else min(the model's positions, 8192)."""
        limit = self.max_position_embeddings
        requested = self.config.max_model_len
        if requested is not None:
            if requested > limit:
                raise InvalidConfigError(f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}")
            return requested
        return min(limit, 8192)

    def _kv_budget(self) -> int:
        if self.config.kv_cache_memory_bytes:
            return self.config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.9)
        return _DEFAULT_CPU_KV_BYTES

    @torch.inference_mode()
    def execute(self, plan, all_hidden_for: frozenset[int] = frozenset(), loras: Optional[dict] = None
                ) -> tuple[torch.Tensor, dict]:
        """Runs the copies of `plan`, then the forward over its scheduled tokens. Returns float32
        logits [num sampled sequences, vocab] in the order of the sequences with `sample`, and
        {seq_id: final hidden states of every scheduled token} for the sequences in `all_hidden_for`
        (`model.compute_logits` turns them into logits). `loras`: {seq_id: LoRAAdapter} of the
        sequences that run one."""
        self.kv_cache.swap_out(plan.blocks_to_swap_out)
        self.kv_cache.swap_in(plan.blocks_to_swap_in)
        self.kv_cache.copy_blocks(plan.blocks_to_copy, self.backend)
        scheduled = plan.scheduled
        if not scheduled:
            return torch.empty(0, self.vocab_size), {}
        self.kv_cache.wait_for_swap_in()
        graphs = self.decode_graphs
        adapters = [loras.get(item.seq_id) for item in scheduled] if loras else []
        if (graphs is not None and not all_hidden_for and not any(adapters) and len(scheduled) <= graphs.max_batch_size
                and _trailing_decodes(scheduled) == len(scheduled)):
            hidden = graphs.run(
                [item.token_ids[0] for item in scheduled],
                [item.start for item in scheduled],
                [item.slot_mapping[0] for item in scheduled],
                [item.block_table for item in scheduled],
            )
            sample_index = [i for i, item in enumerate(scheduled) if item.sample]
            if len(sample_index) < len(scheduled):
                hidden = hidden[sample_index]
            return self.model.compute_logits(hidden), {}  # (decode steps have no prompt tokens to score)
        input_ids, positions, metadata, sample_index = self._prepare(scheduled)
        starts = metadata.query_start_loc_host
        lora = None
        if adapters:
            lora = lora_batch(self.lora_registry, adapters, [b - a for a, b in zip(starts, starts[1:])], self.device)
        hidden = self.model(input_ids, positions, metadata, self.kv_cache, self.backend, lora)
        all_hidden = {
            item.seq_id: hidden[starts[i] : starts[i + 1]] for i, item in enumerate(scheduled) if item.seq_id in all_hidden_for
        }
        return self.model.compute_logits(hidden[sample_index]), all_hidden

    def _prepare(self, scheduled):
        """Flat inputs and attention metadata; prefills come first, then decodes (scheduler order)."""
        tokens, positions, slots, starts, context_lens, tables, sample_index = [], [], [], [0], [], [], []
        num_decodes = 0
        for item in scheduled:
            tokens += item.token_ids
            positions += range(item.start, item.end)
            slots += item.slot_mapping
            starts.append(len(tokens))
            context_lens.append(item.end)
            tables.append(item.block_table)
            num_decodes += not item.is_prefill and item.end - item.start == 1
            if item.sample:
                sample_index.append(len(tokens) - 1)
        width = max(len(table) for table in tables)
        padded = [table + [0] * (width - len(table)) for table in tables]
        device = self.device
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
            max_context_len=max(context_lens),
            num_decode_tokens=_trailing_decodes(scheduled),
            query_start_loc_host=starts,
            context_lens_host=context_lens,
        )
        return (
            torch.tensor(tokens, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            metadata,
            torch.tensor(sample_index, dtype=torch.long, device=device),
        )


def _common_sliding_window(model) -> int:
    """The window every attention layer stays within (the widest, where they differ), or 0 when
    some layer attends to the whole context: the scheduler releases blocks before it."""
    windows = [getattr(layer.self_attn, "sliding_window", None) for layer in model.layers]
    return 0 if None in windows else max(windows)


def _trailing_decodes(scheduled) -> int:
    """How many sequences at the end of the batch have exactly one new token."""
    count = 0
    for item in reversed(scheduled):
        if item.end - item.start != 1:
            break
        count += 1
    return count
