"""ModelRunner: owns the model, the KV cache and the sampler; turns a scheduler plan into one
forward pass and the step's results (`execute(plan, requests) -> ModelRunnerOutput`)."""

from __future__ import annotations

import gc
import logging
import os
from typing import Optional

import numpy as np
import torch

from pagedkv_core._core import PLACEHOLDER_TOKEN
from pagedkv.attention import AttentionMetadata, StepContext, get_backend
from pagedkv.attention.registry import check_backend_name
from pagedkv.config import EngineConfig
from pagedkv.runner.cuda_graphs import DecodeGraphs
from pagedkv.runner.prompt_embeds import embedded_rows, embeddings_in_place
from pagedkv.layers.cpu_linear import use_cpu_linear
from pagedkv.errors import EngineStoppedError, InvalidConfigError, TensorParallelError
from pagedkv.runner.host_memory import return_freed_memory, reuse_freed_memory
from pagedkv.runner.kv_cache import KVCache
from pagedkv.runner.kv_groups import KVCacheGroups
from pagedkv.models.loader import generation_defaults, kept_gguf_type, load, load_generation_config, model_spec
from pagedkv.runner.lora import LoRARegistry, lora_batch
from pagedkv.parallel import SINGLE_PROCESS, TensorParallelGroup, using_group
from pagedkv.parallel.sharding import check_shardable
from pagedkv.parallel.workers import TensorParallelWorkers
from pagedkv.runner import results
from pagedkv.runner.model_info import ModelInfo
from pagedkv.runner.persistent_batch import PersistentBatch
from pagedkv.runner.sampler import Sampler, all_plain, all_plain_greedy
from pagedkv.runner.step_messages import ModelRunnerOutput, PendingOutput, StepRequests
from pagedkv.kernels.transfer import to_device

logger = logging.getLogger("pagedkv.runner.model_runner")

_DEFAULT_CPU_KV_BYTES = 512 << 20


class ModelRunner:
    """Loads the model, sizes and allocates the KV cache, executes steps.

    With tensor_parallel_size > 1 the runner built by the engine is rank 0: it starts the other
    ranks (parallel/workers.py), whose runners are built with their `group`, and sends each step
    to them before executing it itself; every rank holds a shard of the model and of the KV
    cache (its KV heads of the same blocks)."""

    def __init__(self, config: EngineConfig, group: Optional[TensorParallelGroup] = None):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype()
        self.kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_torch_dtype()
        kept = (config.dtype == "auto" and self.dtype != torch.float32 and not config.is_cuda
                and config.gguf_weights != "dequantized" and config.tensor_parallel_size == 1
                and kept_gguf_type(config.model, config.gguf_file))
        if kept:
            # A GGUF's kept weights run on float32 activations, and there beat bfloat16 weights even
            # on CPUs with bfloat16 math: quantized blocks at a third of the memory, a BF16 file's
            # weights at its memory, a single stream ~1.4x faster (docs/benchmarks.md). A BF16
            # file's KV cache stays bfloat16, as its bfloat16 model's: half the bytes a step reads.
            self.dtype = torch.float32
            if kept != "BF16" and config.kv_cache_dtype == "auto":
                self.kv_dtype = torch.float32
        self.workers: Optional[TensorParallelWorkers] = None
        self.failure: Optional[Exception] = None  # (TensorParallelError, or EngineStoppedError after shutdown)
        if group is None and config.tensor_parallel_size > 1:
            if config.enable_lora:
                raise InvalidConfigError(f"tensor_parallel_size={config.tensor_parallel_size}: LoRA adapters do "
                                         "not shard yet; serve them with tensor_parallel_size=1")
            spec = model_spec(config.model, config.gguf_file)
            check_shardable(spec.hf_config, spec.model_class, spec.traits, config.tensor_parallel_size)
            self.workers = TensorParallelWorkers.start(config)
            group = self.workers.group
        self.group = group or SINGLE_PROCESS
        self._threads_before = None
        if self.group.size > 1 and not config.is_cuda and not config.num_threads:
            # The ranks share this machine's cores: more threads than that only fight over them.
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.group.size))
        try:
            self._build()
        except BaseException:
            self.shutdown()
            raise

    def _build(self) -> None:
        config = self.config
        check_backend_name(config.attention_backend)  # (before minutes of loading)
        with using_group(self.group):
            loaded = load(config.model, config.gguf_file, config.tokenizer, self.dtype, self.device,
                          config.max_model_len, dummy=config.load_format == "dummy",
                          gguf_weights=config.gguf_weights, skip_tokenizer=config.skip_tokenizer_init)
        self.model, self.tokenizer, self.hf_config = loaded.model, loaded.tokenizer, loaded.hf_config
        if not config.is_cuda and config.cpu_linear_kernel:
            use_cpu_linear(self.model)
        if not config.is_cuda:
            reuse_freed_memory()  # (after loading: the checkpoint's transient copies went back to the system)
        self.eos_token_ids, self.model_name = loaded.eos_token_ids, loaded.name
        self.generation_defaults = self._generation_defaults(loaded.generation_config)
        self.max_position_embeddings = self.hf_config.max_position_embeddings
        self.max_model_len = self._max_model_len()
        self.vocab_size = self.hf_config.vocab_size
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        attention = self.model.layers[0].self_attn
        self.backend = get_backend(config.attention_backend, config.device, attention.head_dim)
        num_layers = len(self.model.layers)
        self.kv_groups = KVCacheGroups.for_layers(
            [getattr(layer.self_attn, "sliding_window", None) for layer in self.model.layers],
            hybrid=not config.disable_hybrid_kv_cache_manager)
        self.sliding_window = self.kv_groups.windows[0] if self.kv_groups.num_groups == 1 else 0
        self.sampler = Sampler()
        self._sampled: Optional[tuple[np.ndarray, torch.Tensor]] = None  # (seq ids, tokens) of the last asynchronous step
        classifier = getattr(self.model, "classifier", None)
        self.info = ModelInfo(
            name=self.model_name, vocab_size=self.vocab_size, hidden_size=self.hf_config.hidden_size,
            max_model_len=self.max_model_len, eos_token_ids=frozenset(self.eos_token_ids),
            num_parameters=self.num_parameters, dtype=str(self.dtype).removeprefix("torch."),
            attention_backend=self.backend.name, sliding_window=self.sliding_window,
            kv_group_windows=self.kv_groups.windows if self.kv_groups.num_groups > 1 else (),
            num_labels=classifier.num_labels if classifier is not None else 0,
            class_labels={int(k): v for k, v in (getattr(self.hf_config, "id2label", None) or {}).items()}
            if classifier is not None else {},
            generation_defaults=self.generation_defaults,
        )
        self.block_bytes = KVCache.bytes_per_block(
            self.kv_groups.slots_per_block, attention.num_kv_heads, attention.head_dim, config.block_size, self.kv_dtype
        )
        # Every rank holds the same block numbers: they agree on the smallest pool.
        self.num_device_blocks = self.group.min(config.num_device_blocks or max(1, self._kv_budget() // self.block_bytes))
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
            groups=self.kv_groups,
        )
        if self.kv_groups.num_groups > 1:
            logger.info("KV-cache groups: %s (a block holds one group's layers; windowed groups keep their window)",
                        self.kv_groups.describe())
        logger.info(
            "KV cache: %d device blocks + %d CPU blocks of %d tokens, %.1f KiB each (%s, %s backend)",
            self.num_device_blocks,
            self.num_cpu_blocks,
            config.block_size,
            self.block_bytes / 1024,
            self.kv_dtype,
            self.backend.name,
        )
        self.batch = PersistentBatch(-(-self.max_model_len // config.block_size), self.device,
                                     initial_rows=config.max_num_seqs, num_kv_groups=self.kv_groups.num_groups)
        self.lora_registry = None
        if config.enable_lora:
            self.lora_registry = LoRARegistry(self.model, config.max_lora_rank, self.dtype, self.device,
                                              config.max_cpu_loras)
        self.decode_graphs = None
        if config.is_cuda and not config.enforce_eager:
            if self.group.size > 1:
                logger.info("CUDA graphs off: tensor-parallel steps run eagerly (their all-reduces are not captured)")
            elif any(layer.is_moe for layer in self.model.layers):
                logger.info("CUDA graphs off: a mixture-of-experts step sizes its expert matmuls on the host")
            elif not self.backend.supports_cuda_graphs:
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
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states. Rank 0 holds the whole LM head."""
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def sampling_logits(self, hidden: torch.Tensor, requests: StepRequests) -> torch.Tensor:
        """Logits of the step's sampling sequences: in the model's dtype when every row `is_plain`
        and nothing else reads them (the draw or argmax reads them as they are), else float32."""
        narrow = getattr(self.model, "compute_narrow_logits", None)
        rows = requests.sampling_rows
        if narrow is not None and not requests.logits_for:
            if all_plain_greedy(rows):
                return narrow(hidden, order_only=True)
            if all_plain(rows):
                return narrow(hidden)
        return self.compute_logits(hidden)

    def shutdown(self) -> None:
        """Stops the other tensor-parallel ranks and lets go of the model, the KV cache, the
        persistent batch and the CUDA graphs, so their memory goes back (idempotent; the runner
        executes no step after it)."""
        if self.workers is not None:
            self.workers.shutdown()
            self.workers, self.group = None, SINGLE_PROCESS
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        for name in ("decode_graphs", "kv_cache", "batch", "model", "_sampled"):
            if hasattr(self, name):
                setattr(self, name, None)
        self.failure = self.failure or EngineStoppedError("the engine was shut down")
        gc.collect()  # (the model's modules hold reference cycles: free their tensors now)
        if self.config.is_cuda and torch.cuda.is_available():
            # cuBLAS's per-stream workspaces (33 MiB on an H200) are tensors of torch's allocator,
            # kept for the process; the next engine's first matmul makes them again.
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()
        return_freed_memory()

    def execute(self, plan, requests: Optional[StepRequests] = None) -> ModelRunnerOutput:
        """Runs the copies of `plan`, then the forward over its scheduled tokens (built from the
        plan's columns and the persistent batch), then what `requests` asks of the step: logits
        of the plan's sampling sequences, samples, verified drafts, prompt logprobs, pooled
        vectors. Without `requests` (the other tensor-parallel ranks), the forward alone. Rank 0
        of a tensor-parallel group sends the step to the other ranks first; any failure then is
        a TensorParallelError, for good (what follows the forward is rank 0's alone)."""
        if self.workers is None:
            hidden = self._forward(plan, requests)
        else:
            if self.failure is not None:
                raise self.failure
            try:
                self.workers.send_step(plan)
                hidden = self._forward(plan, requests)
            except Exception as error:  # the ranks are out of step: no later step can run
                self.failure = TensorParallelError(f"tensor-parallel step failed: {error}")
                self.failure.__cause__ = error
                logger.error("%s; the engine cannot go on", self.failure)
                raise self.failure from error
        if hidden is None or requests is None:
            return ModelRunnerOutput()
        return self._results(requests, *hidden, plan)

    @torch.inference_mode()
    def execute_async(self, plan, requests: StepRequests) -> PendingOutput:
        """`execute` for a step whose sampling rows are all `is_plain` (one per sampling sequence,
        nothing else asked): launches the forward, logits and sampling and returns without
        waiting for them. The sampled tokens stay on the device as well, where the next step's
        forward reads the inputs its plan holds placeholders for (`Scheduler.append_placeholders`)."""
        hidden = self._forward(plan, requests)
        if hidden is None or not requests.sampling_rows:  # (nothing scheduled, or prefill chunks alone)
            return PendingOutput(torch.empty(0, dtype=torch.long))
        logits = self.sampling_logits(hidden[0], requests)
        seq_ids = np.asarray(requests.row_seq_ids, dtype=np.int64)
        try:
            tokens = self.sampler.sample_tokens(logits, requests.sampling_rows)
        except Exception:  # (out of memory, say): row by row, as `execute`; a failed row's request is aborted
            logger.warning("sampling an asynchronous step failed; sampling its rows one by one", exc_info=True)
            done = ModelRunnerOutput()
            sampled = results.sample(self.sampler, logits, requests.sampling_rows, requests.row_seq_ids, done.errors)
            done.sampled_token_ids, done.sampled_logprobs = sampled.token_ids, sampled.logprobs
            tokens = torch.tensor([0 if token is None else token for token in done.sampled_token_ids])
            self._sampled = (seq_ids, tokens.to(logits.device))
            return PendingOutput(tokens, done=done)
        self._sampled = (seq_ids, tokens)
        if self.device.type != "cuda":
            return PendingOutput(tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return PendingOutput(host, ready)

    def _input_ids(self, plan, step: _StepColumns) -> torch.Tensor:
        """The step's input token ids on the device; where the plan holds placeholders, the tokens
        the previous step sampled there (still on the device when it ran asynchronously)."""
        ids = to_device(step.token_ids, self.device)
        sampled, self._sampled = self._sampled, None
        placeholders = np.flatnonzero(plan.token_ids == PLACEHOLDER_TOKEN)
        if placeholders.size == 0:
            return ids
        owners = np.repeat(plan.seq_ids, step.query_lens)[placeholders]
        if sampled is None:
            raise RuntimeError(f"sequences {owners[:5].tolist()} have placeholder tokens but no step sampled them")
        seq_ids, tokens = sampled
        order = np.argsort(seq_ids)
        rows = order[np.minimum(np.searchsorted(seq_ids, owners, sorter=order), len(order) - 1)]
        if not np.array_equal(seq_ids[rows], owners):
            raise RuntimeError(f"placeholders of sequences {owners[seq_ids[rows] != owners][:5].tolist()} have no "
                               "token sampled in the previous step")
        if self.device.type == "cpu":
            ids = ids.clone()  # (a view of the plan's column)
        ids[to_device(torch.from_numpy(placeholders), self.device)] = tokens[to_device(torch.from_numpy(rows),
                                                                                       tokens.device)]
        return ids

    @torch.inference_mode()
    def _forward(self, plan, requests: Optional[StepRequests]) -> Optional[tuple[torch.Tensor, dict]]:
        """The copies, then the forward: (final hidden states of the sampling sequences' last
        tokens, {seq_id: every scheduled token's} for the sequences that need them), or None
        when nothing is scheduled."""
        self.kv_cache.swap_out(plan.blocks_to_swap_out)
        self.kv_cache.swap_in(plan.blocks_to_swap_in)
        self.kv_cache.copy_blocks(plan.blocks_to_copy, self.backend)
        if plan.num_scheduled == 0:
            return None
        self.batch.apply(plan)
        self.kv_cache.wait_for_swap_in()
        step = _StepColumns(plan, self.config.block_size)
        hidden_for = requests.needs_hidden_states() if requests is not None else frozenset()
        loras = requests.loras if requests is not None else None
        adapters = [loras.get(seq_id) for seq_id in step.seq_ids] if loras else []
        embeds = requests.prompt_embeds if requests is not None else {}
        graphs = self.decode_graphs
        if (graphs is not None and not hidden_for and not any(adapters) and step.num_seqs <= graphs.max_batch_size
                and step.num_decodes == step.num_seqs and not embeds):
            hidden = graphs.run(self._input_ids(plan, step), to_device(step.positions, self.device),
                                to_device(step.slot_mapping, self.device), self.batch.tables(plan, step.num_blocks))
            all_hidden = {}
            sample_hidden = hidden if len(step.sample_rows) == step.num_seqs else hidden[to_device(step.sample_rows,
                                                                                                   self.device)]
        else:
            input_ids, positions, metadata = self._prepare(plan, step)
            lora = None
            if adapters:
                lora = lora_batch(self.lora_registry, adapters, step.query_lens.tolist(), self.device)
            context = StepContext.build(metadata, self.kv_cache, self.backend, lora)
            rows, values = embedded_rows(step.seq_ids, plan.query_start_loc, plan.positions, embeds)
            with embeddings_in_place(self.model.embed_tokens, rows, values):
                hidden = self.model(input_ids, positions, context)
            starts = metadata.query_start_loc_host
            all_hidden = {seq_id: hidden[starts[i]:starts[i + 1]]
                          for i, seq_id in enumerate(step.seq_ids) if seq_id in hidden_for}
            # (as many samples as tokens: every token samples, in order, as in a step of decodes)
            sample_hidden = (hidden if len(step.sample_index) == hidden.shape[0]
                             else hidden[to_device(step.sample_index, self.device)])
        return sample_hidden, all_hidden

    @torch.inference_mode()
    def _results(self, requests: StepRequests, sample_hidden: torch.Tensor, all_hidden: dict,
                 plan) -> ModelRunnerOutput:
        output = ModelRunnerOutput()
        errors = output.errors
        for seq_id, request in requests.prompt_logprobs.items():
            try:
                output.prompt_logprobs[seq_id] = results.prompt_logprobs(self.compute_logits, all_hidden[seq_id], request)
            except Exception as error:
                errors[seq_id] = error  # (the engine logs it, aborting that request)
        for seq_id, params in requests.pooling.items():
            try:
                output.pooled[seq_id] = results.pool(getattr(self.model, "classifier", None), all_hidden[seq_id][-1], params)
            except Exception as error:
                errors[seq_id] = error  # (the engine logs it, aborting that request)
        for seq_id, drafts in requests.drafts.items():
            try:
                output.accepted_tokens[seq_id] = results.verify_drafts(self.compute_logits, all_hidden[seq_id], drafts)
            except Exception as error:
                errors[seq_id] = error  # (the engine logs it, aborting that request)
        if not (requests.sampling_rows or requests.logits_for):
            return output
        logits = self.sampling_logits(sample_hidden, requests)
        if requests.sampling_rows:
            # (beams read the raw logits after sampling; else the sampler may change them in place)
            recompute = None if requests.logits_for else (lambda: self.compute_logits(sample_hidden))
            sampled = results.sample(self.sampler, logits, requests.sampling_rows, requests.row_seq_ids, errors,
                                     recompute)
            output.sampled_token_ids, output.sampled_logprobs = sampled.token_ids, sampled.logprobs
        if requests.logits_for:
            sampling_seq_ids = plan.seq_ids[plan.samples].tolist()
            row_of = {seq_id: row for row, seq_id in enumerate(sampling_seq_ids)}
            output.logits = logits[to_device(torch.tensor([row_of[seq_id] for seq_id in requests.logits_for]), logits.device)]
        return output

    def _prepare(self, plan, step: _StepColumns):
        """Flat inputs and attention metadata; prefills come first, then decodes (scheduler order)."""
        device = self.device
        metadata = AttentionMetadata(
            query_start_loc=to_device(step.query_start_loc.to(torch.int32), device),
            context_lens=to_device(step.context_lens.to(torch.int32), device),
            block_tables=self.batch.tables(plan, step.num_blocks),
            slot_mapping=to_device(step.slot_mapping, device),
            max_query_len=step.max_query_len,
            max_context_len=step.max_context_len,
            num_decode_tokens=step.num_decodes,
            query_start_loc_host=step.query_start_loc.tolist(),
            context_lens_host=step.context_lens.tolist(),
        )
        return self._input_ids(plan, step), to_device(step.positions, device), metadata


class _StepColumns:
    """One step's inputs as host tensors: the plan's columns (derived ones computed in Rust)."""

    def __init__(self, plan, block_size: int):
        self.seq_ids = plan.seq_ids.tolist()
        self.num_seqs = len(self.seq_ids)
        query_start_loc = plan.query_start_loc
        self.query_lens = np.diff(query_start_loc)
        self.query_start_loc = torch.from_numpy(query_start_loc)
        self.context_lens = torch.from_numpy(plan.ends)
        self.token_ids = torch.from_numpy(plan.token_ids)
        self.slot_mapping = torch.from_numpy(plan.slot_mapping)
        self.positions = torch.from_numpy(plan.positions)
        self.sample_index = torch.from_numpy(plan.sample_index)
        self.sample_rows = torch.from_numpy(plan.sample_rows)
        self.max_query_len = plan.max_query_len
        self.max_context_len = plan.max_context_len
        self.num_blocks = -(-self.max_context_len // block_size)
        self.num_decodes = plan.num_decodes

