"""Type stubs for the Rust core (`rust/python/`). Errors are raised as `pagedkv.errors` classes."""

from typing import Literal, Optional, Sequence, Union

import numpy as np
import numpy.typing as npt

class SchedulerConfig:
    """Scheduler and pool settings. Invalid values raise InvalidConfigError naming the field."""

    block_size: int
    """Tokens per KV block."""
    num_device_blocks: int
    """Blocks in the device (GPU) pool."""
    num_cpu_blocks: int
    """Blocks in the CPU swap pool."""
    max_num_seqs: int
    """Most sequences running at once."""
    max_num_batched_tokens: int
    """Token budget of one step: prefill chunk tokens plus one per decoding sequence."""
    max_model_len: int
    """Longest sequence (prompt + output); capped at what the device pool holds."""
    max_waiting_requests: int
    """Bound of the waiting queue; add_request raises OverloadedError beyond it."""
    enable_prefix_caching: bool
    enable_cpu_prefix_cache: bool
    """Cached blocks evicted from the device move to free CPU blocks and come back on a hit
    (their copies join blocks_to_swap_out / blocks_to_swap_in). Needs enable_prefix_caching."""
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int
    """Most tokens one sequence's prefill takes in a step (0: only the budget limits it)."""
    sliding_window: int
    """The model's attention window when every layer has one (0: none): blocks wholly before a
    sequence's window are released as it advances, so with chunked prefill a sequence holds at
    most its window plus one step's chunk and may be longer than the pool."""
    kv_group_windows: list[int]
    """KV-cache groups of a model that mixes layer kinds (Gemma 3: [0, 1024, 1024, 1024, 1024,
    1024]), each group's window (0: full attention): a sequence holds one block table per group
    over the shared pool, and a windowed group's table keeps only its window's blocks. Empty (the
    default): one group of `sliding_window`. Steps then carry every group's slots and tables."""
    prefix_caching_hash_seed: int
    """Key of the prefix cache's 128-bit block names (0 here; the engine passes a secret random one)."""
    enable_kv_events: bool
    """Record KV-cache events (Scheduler.take_kv_events) for a KV-aware router."""
    preemption_mode: str
    """'swap', 'recompute' or 'auto' (cheaper of the two per victim by the cost model)."""
    scheduling_policy: str
    """'fcfs' (arrival order) or 'priority' ((priority, arrival) order; a queued request that
    cannot start preempts running requests of lower priority, i.e. larger values)."""
    watermark: float
    """Fraction of device blocks that admissions leave free."""
    recompute_cost_per_token: float
    """Cost model: seconds of compute per recomputed token."""
    block_bytes: float
    """Cost model: bytes of one KV block (all layers)."""
    swap_bandwidth: float
    """Cost model: bytes per second of a device<->CPU copy."""
    swap_latency: float
    """Cost model: fixed seconds per swap transfer."""
    def __init__(
        self,
        *,
        block_size: int = 16,
        num_device_blocks: int = 1024,
        num_cpu_blocks: int = 1024,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 2048,
        max_waiting_requests: int = 1024,
        enable_prefix_caching: bool = True,
        enable_cpu_prefix_cache: bool = False,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        sliding_window: int = 0,
        kv_group_windows: list[int] = [],
        prefix_caching_hash_seed: int = 0,
        enable_kv_events: bool = False,
        preemption_mode: str = "auto",
        scheduling_policy: str = "fcfs",
        watermark: float = 0.01,
        recompute_cost_per_token: float = 5e-05,
        block_bytes: float = 2097152.0,
        swap_bandwidth: float = 20000000000.0,
        swap_latency: float = 0.0001,
    ) -> None:
        """Any field by keyword, the others at their defaults (rust/sched/config.rs, the one
        definition; tests/unit/test_stubs.py checks these against it)."""

class ScheduledSequence:
    """One sequence's work in a step: compute the KV of token_ids = tokens[start:end]."""

    request_id: str
    seq_id: int
    is_prefill: bool
    start: int
    """First token position computed this step."""
    end: int
    """One past the last position; also the context length after the step."""
    token_ids: list[int]
    block_table: list[int]
    """Physical device block of each logical block of the sequence (the whole table). Under a
    sliding window, entries of blocks released before the window are stale ids: attention never
    reads them (the torch reference reads them masked)."""
    block_table_from: int
    """First logical block that changed since this sequence was last scheduled: a consumer that
    keeps a persistent block-table tensor rewrites only `block_table[block_table_from:]`. It is 0
    the first time (and after a fork, swap-in or recompute), len(block_table) when nothing changed."""
    slot_mapping: list[int]
    """Destination slot (block * block_size + offset) of each new token's K/V (KV-cache group 0's;
    the step's `slot_mapping` column holds every group's)."""
    sample: bool
    """True when this step yields the sequence's next token (decode or last prefill chunk)."""
    row: int
    """Its persistent-batch row: kept while the sequence stays on the device, then reused by
    another, which reports its whole table (block_table_from 0) when it takes the row."""
    @property
    def context_len(self) -> int: ...

class SchedulerOutput:
    """The plan of one step. Execute swap-out, swap-in, then copies, before the forward pass.

    Columns (numpy arrays, one row per scheduled sequence, prefills first, then decodes; each
    built once, on first read): `seq_ids`, `rows`, `starts`, `ends`, `samples`, `is_prefill`,
    `block_table_from`; flat over all scheduled tokens: `token_ids`, `slot_mapping` (sequence i's
    are `[query_start_loc[i]:query_start_loc[i + 1]]`); block tables as changes:
    `block_table_updates[block_table_update_loc[i]:block_table_update_loc[i + 1]]` replaces sequence
    i's blocks from `block_table_from[i]` on.

    With G KV-cache groups (`SchedulerConfig.kv_group_windows`), `slot_mapping` holds G * T slots,
    group after group, and sequence i's update holds its blocks from `block_table_from[i]` on in
    each group's table, group after group (all of one length)."""

    scheduled: list[ScheduledSequence]
    """The same step, one object per sequence (built on first read: read it before reporting; a
    step rebuilt by from_bytes has none and raises InvalidStateError)."""
    num_scheduled: int
    num_kv_groups: int
    seq_ids: npt.NDArray[np.int64]
    rows: npt.NDArray[np.int64]
    starts: npt.NDArray[np.int64]
    ends: npt.NDArray[np.int64]
    samples: npt.NDArray[np.bool_]
    is_prefill: npt.NDArray[np.bool_]
    block_table_from: npt.NDArray[np.int64]
    query_start_loc: npt.NDArray[np.int64]
    block_table_update_loc: npt.NDArray[np.int64]
    token_ids: npt.NDArray[np.int64]
    slot_mapping: npt.NDArray[np.int64]
    block_table_updates: npt.NDArray[np.int32]
    blocks_to_swap_in: list[tuple[int, int]]
    """(cpu block, device block) copies."""
    blocks_to_swap_out: list[tuple[int, int]]
    """(device block, cpu block) copies."""
    blocks_to_copy: list[tuple[int, int]]
    """(source, destination) device block copies for copy-on-write."""
    preempted: list[str]
    """Request ids preempted this step."""
    aborted: list[str]
    """Request ids dropped because they cannot run even alone on the empty device pool."""
    abort_reasons: list[str]
    """Why each of `aborted` was dropped, naming the limit."""
    num_batched_tokens: int
    num_prefix_hit_tokens: int
    positions: npt.NDArray[np.int64]
    """Each scheduled token's position, flat as `token_ids`."""
    sample_index: npt.NDArray[np.int64]
    """Index in `token_ids` of each sampling sequence's last token (the rows logits are of)."""
    sample_rows: npt.NDArray[np.int64]
    """Place in the step's sequences of each sampling sequence."""
    num_decodes: int
    """Sequences computing one token, counted from the end (decodes trail the prefills)."""
    max_query_len: int
    """The most tokens one sequence computes (0 when none is scheduled)."""
    max_context_len: int
    """The longest context after the step (0 when none is scheduled)."""
    def is_empty(self) -> bool: ...
    def write_block_tables(self, tables: npt.NDArray[np.int32]) -> None:
        """Writes each scheduled sequence's block-table update into a persistent batch's tables,
        a C-contiguous writable int32 array of [G * rows, width] (each KV-cache group's rows after
        the previous group's): row `rows[i]` of each group, blocks from `block_table_from[i]` on.
        Raises InvalidStateError, writing nothing, if a row or a table does not fit."""
    def gather_block_tables(self, tables: npt.NDArray[np.int32], out: npt.NDArray[np.int32]) -> None:
        """out [G * num_scheduled, num_blocks] (C-contiguous int32, num_blocks <= the tables' width) =
        each scheduled sequence's first num_blocks blocks from its row of `tables`, in each of the
        G KV-cache groups in turn (blocks past its own table are whatever the row holds). Raises
        InvalidStateError if they do not fit."""
    def to_bytes(self) -> bytes:
        """The whole step as bytes, for another process (the ranks of a tensor-parallel group);
        pickling a SchedulerOutput uses them."""
    @staticmethod
    def from_bytes(data: bytes) -> SchedulerOutput:
        """The step `to_bytes` wrote, columns and lists alike (no per-sequence view). Raises
        InvalidStateError, naming what does not hold, for bytes it did not write."""

class Scheduler:
    """Continuous batching over a paged KV cache: running decodes first, then swapped groups
    back in, then waiting prefills chunked into the remaining token budget. Growing groups
    preempt the newest running group by swap or recompute."""

    def __init__(self, config: Optional[SchedulerConfig] = None) -> None: ...
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], extra_key: Optional[int] = None, priority: int = 0
    ) -> int:
        """Queue a request; returns its first sequence id. `priority` (smaller first) needs
        scheduling_policy='priority', else InvalidConfigError. Raises PromptTooLongError when the
        prompt can never fit, OverloadedError when the waiting queue is full."""
    def schedule(self) -> SchedulerOutput:
        """Plan one step (releases the GIL)."""
    def update(
        self,
        seq_ids: Sequence[int],
        token_ids: Sequence[int],
        finished: Sequence[int] = ...,
        *,
        draft_token_ids: Optional[dict[int, list[int]]] = ...,
        accepted_drafts: Optional[dict[int, int]] = ...,
        forks: Optional[Sequence[tuple[int, int, bool]]] = ...,
        fill_seq_ids: Optional[Sequence[int]] = ...,
        fill_token_ids: Optional[Sequence[int]] = ...,
    ) -> list[int]:
        """Closes a step in one call, in this order: fills placeholders (fill_token_ids[i] for the
        one ending fill_seq_ids[i]), keeps accepted_drafts[seq_id] of each sequence's drafts,
        forks (parent, child's first token, whether the child ends with it: each parent as it
        stands before its own token, its blocks shared copy-on-write), appends token_ids[i] to
        seq_ids[i] (each sampled in the last step; then draft_token_ids[seq_id] after it), then
        ends the `finished` sequences. Checks everything first: an error (InvalidStateError,
        UnknownSequenceError) changes nothing. Returns the forked children's seq ids, in order."""
    def append_placeholders(self, seq_ids: Sequence[int]) -> None:
        """Asynchronous scheduling: appends PLACEHOLDER_TOKEN to each sequence (each sampled in the
        last step) for the token its step is still sampling, so the next step can be planned; its
        input token then comes from the device. Checked as `update`: an error changes nothing."""
    def fill_placeholders(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> None:
        """The sampled tokens: token_ids[i] replaces the placeholder ending seq_ids[i] (running,
        swapped or waiting to be recomputed); blocks it filled are re-hashed for the prefix cache.
        Checks everything first: an error changes nothing."""
    def append_token(self, seq_id: int, token_id: int, draft_token_ids: list[int] = []) -> None:
        """Report the token sampled for a sequence that had sample=True, optionally followed by
        speculative draft tokens: the next step computes them all in one multi-token decode."""
    def accept_drafts(self, seq_id: int, num_accepted: int) -> None:
        """After the step that computed a sequence's drafts: keep the first `num_accepted`, drop
        the rest and their KV slots; then report the next token with `append_token`."""
    def fork(self, parent_seq_id: int) -> int:
        """New sequence sharing every block of the parent (n > 1, beams). Returns its id."""
    def finish_sequence(self, seq_id: int) -> None:
        """End one sequence and free its blocks; the request ends with its last sequence."""
    def abort(self, request_id: str) -> None:
        """Drop a request in any state and free all its blocks."""
    def sequence_len(self, seq_id: int) -> int: ...
    def block_table(self, seq_id: int, group: int = 0) -> list[int]:
        """The sequence's physical blocks in KV-cache group `group`'s table (CPU blocks while
        swapped out); UnknownSequenceError while it holds none (waiting, or about to be rebuilt
        after a recompute)."""
    def is_swapped(self, seq_id: int) -> bool: ...
    def refcount(self, block: int, on_device: bool = True) -> int:
        """Block tables holding `block` of the device (or CPU) pool."""
    def has_unfinished_requests(self) -> bool: ...
    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (device and CPU tier); False, changing nothing, while any
        request is unfinished."""
    def take_kv_events(self) -> list[KVCacheEvent]:
        """The KV-cache events since the last call, oldest first (empty unless the config's
        enable_kv_events). Take them once per step, after `update`: replayed in order from the
        start they give exactly `cached_block_hashes` of each tier."""
    def cached_block_hashes(self, on_device: bool = True, group: int = 0) -> list[int]:
        """Sorted 64-bit names (the events' block hashes) of KV-cache group `group`'s blocks
        cached on the device, or in the CPU prefix tier."""
    @property
    def num_unfinished_requests(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    def check_invariants(self) -> None:
        """Raise InvalidStateError if any refcount or free list disagrees with the tables."""
    def stats(self) -> dict[str, float]: ...

class BlockManager:
    """Device and CPU block pools with per-sequence block tables, fork and copy-on-write,
    prefix caching by block content hash, swap between tiers. With `sliding_window` (positions
    each token attends to, its own included; 0 = all), appending to a sequence first releases its
    blocks wholly before the window of its next position. `kv_group_windows` (instead of
    `sliding_window`): one table per KV-cache group over the shared pool, each with its window (0:
    full attention), as SchedulerConfig.kv_group_windows. `hash_seed`: the root the prefix cache's
    block names chain from."""

    def __init__(
        self,
        num_device_blocks: int,
        num_cpu_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = False,
        watermark: float = 0.0,
        sliding_window: int = 0,
        hash_seed: int = 0,
        enable_kv_events: bool = False,
        kv_group_windows: Optional[list[int]] = None,
    ) -> None: ...
    def allocate(self, seq_id: int, token_ids: list[int], extra_key: Optional[int] = None) -> int:
        """Blocks for a new sequence; returns the number of prefix-cache hit tokens."""
    def append_token(self, seq_id: int, token_id: int) -> list[tuple[int, int]]:
        """Room for one more token in every KV-cache group; returns the (src, dst) copies that
        copy-on-write made of a shared last block (none, or one per group)."""
    def append_slots(self, seq_id: int, token_ids: list[int]) -> list[tuple[int, int]]: ...
    def fork(self, parent_seq_id: int, child_seq_id: int) -> None: ...
    def free(self, seq_id: int) -> None: ...
    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move the sequences' blocks to the CPU pool; returns (device, cpu) copies."""
    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move them back; returns (cpu, device) copies."""
    def block_table(self, seq_id: int, group: int = 0) -> list[int]:
        """Physical block of each logical block in KV-cache group `group`'s table; the first
        num_released_blocks entries are released (stale ids that nothing reads)."""
    def num_released_blocks(self, seq_id: int, group: int = 0) -> int:
        """Leading blocks of the group's table released because its window moved past them."""
    def num_tokens(self, seq_id: int) -> int: ...
    def is_swapped(self, seq_id: int) -> bool: ...
    def refcount(self, block: int, on_device: bool = True) -> int: ...
    def blocks_needed_to_append(self, seq_id: int, num_tokens: int) -> int: ...
    def check_invariants(self) -> None: ...
    def take_kv_events(self) -> list[KVCacheEvent]:
        """As Scheduler.take_kv_events (needs enable_kv_events)."""
    def cached_block_hashes(self, on_device: bool = True, group: int = 0) -> list[int]:
        """As Scheduler.cached_block_hashes."""
    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; False, changing nothing, while any sequence holds blocks."""
    @property
    def block_size(self) -> int: ...
    @property
    def kv_group_windows(self) -> list[int]:
        """Each KV-cache group's window (0: full attention); one entry with one group."""
    @property
    def num_device_blocks(self) -> int: ...
    @property
    def num_free_device_blocks(self) -> int: ...
    @property
    def num_cached_device_blocks(self) -> int: ...
    @property
    def num_cpu_blocks(self) -> int: ...
    @property
    def num_free_cpu_blocks(self) -> int: ...
    @property
    def prefix_cache_queries(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...

__version__: str
PLACEHOLDER_TOKEN: int  # (2**32 - 1: the token id of a placeholder; prompts may not hold it)

def paged_decode_attention_cpu(
    out: int,
    query: int,
    key_cache: int,
    value_cache: int,
    block_tables: int,
    context_lens: int,
    shape: tuple[int, int, int, int, int, int, int, int],
    scale: float,
    num_threads: int,
    cache_dtype: Literal["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"],
    sliding_window: int,
    logit_softcap: float,
    sinks: int,
) -> None:
    """Paged decode attention over CPU tensors given by data pointer: caches of `cache_dtype`;
    query and out of the same dtype, or float32 for the float8 caches; shape is (batch, num_heads, num_kv_heads, head_dim, block_size,
    num_blocks, block_stride, table_width); each token sees the last `sliding_window` positions
    (0: all); scaled logits become `logit_softcap * tanh(logit / logit_softcap)` (0: unchanged);
    `sinks`: 0 or a float32 [num_heads] of attention-sink logits. Internal: use
    `pagedkv.attention.cpu.paged_decode_attention`, which checks the tensors."""

def paged_prefill_attention_cpu(
    out: int,
    query: int,
    key_cache: int,
    value_cache: int,
    block_tables: int,
    query_start_loc: int,
    context_lens: int,
    shape: tuple[int, int, int, int, int, int, int, int],
    num_tokens: int,
    scale: float,
    num_threads: int,
    cache_dtype: Literal["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"],
    sliding_window: int,
    logit_softcap: float,
    sinks: int,
) -> None:
    """Paged prefill/extend attention over CPU tensors given by data pointer: query, out
    [num_tokens, num_heads, head_dim] (float32 for the float8 caches, else the cache dtype),
    caches of `cache_dtype`, int32 block_tables,
    query_start_loc and context_lens; shape as for `paged_decode_attention_cpu` with the number
    of sequences first. Internal: use `pagedkv.attention.cpu.paged_prefill_attention`."""

def cpu_attention_build() -> tuple[str, bool]:
    """(instruction set, runs on an OpenMP team) of the CPU decode attention in this process:
    "Avx512", "Avx2Fma" or "Portable"; True when torch's libgomp team runs it."""

def write_kv_cpu(
    cache: int,
    rows: int,
    slots: int,
    num_tokens: int,
    cache_shape: tuple[int, int, int, int],
    strides: tuple[int, int, int],
    element_bytes: int,
) -> None:
    """Writes rows [num_tokens, heads, head] into the cache [num_blocks, heads, block_size, head]
    at slots (int64; a negative slot is skipped, one past the cache an error); CPU tensors given
    by data pointer and element strides (cache block, row token, row head; contiguous within a
    block and a head), elements of element_bytes bytes. Internal: use
    `pagedkv.attention.cpu.write_kv`, which checks the tensors."""

def rms_norm_cpu(
    hidden: int,
    residual: int | None,
    weight: int,
    rows_width: tuple[int, int],
    eps: float,
    num_threads: int,
    dtype: Literal["float32", "bfloat16"],
) -> None:
    """In place on [rows, width] CPU tensors given by data pointer: residual += hidden, then
    hidden = weight * normalize(residual) (without a residual, of hidden). Internal: use
    `pagedkv.layers.cpu_fused.rms_norm_`, which checks the tensors."""

def silu_and_mul_cpu(
    out: int,
    input: int,
    rows_width: tuple[int, int],
    num_threads: int,
    dtype: Literal["float32", "bfloat16"],
) -> None:
    """out [rows, width] = silu(gate) * up of input [rows, 2 * width] = [gate | up]. Internal:
    use `pagedkv.layers.cpu_fused.silu_and_mul`."""

def rotary_cpu(
    qkv: int,
    cos: int,
    sin: int,
    shape: tuple[int, int, int, int],
    num_threads: int,
    dtype: Literal["float32", "bfloat16"],
) -> None:
    """Rotary embedding in place on the first num_heads heads of each qkv row; shape is
    (num_tokens, row_width, num_heads, head_dim), cos/sin [num_tokens, head_dim]. Internal: use
    `pagedkv.layers.cpu_fused.rotary_`."""

def small_m_linear_cpu(
    out: int,
    x: int,
    weight: int,
    bias: int | None,
    shape: tuple[int, int, int],
    num_threads: int,
    dtype: Literal["float32", "bfloat16"],
    weight_dtype: Literal["float32", "bfloat16"],
    portable: bool = False,
) -> None:
    """out [rows, out_features] = x [rows, in_features] @ weight [out_features, in_features]^T
    (+ bias [out_features]); shape is (rows, in_features, out_features), x and out of `dtype`,
    weight and bias of `weight_dtype`; `portable` skips the SIMD path. Internal: use
    `pagedkv.layers.cpu_linear.linear`."""

def argmax_rows_cpu(
    out: int, logits: int, rows_width: tuple[int, int], num_threads: int,
    dtype: Literal["float32", "bfloat16"] = "float32",
) -> None:
    """out [rows] int64 = the index of each row's largest value (the first of equals; a row
    holding NaN: its first NaN) of logits [rows, width] of `dtype`. Internal: use
    `pagedkv.runner.sampler.argmax_rows`."""

def sample_rows_cpu(
    out: int,
    logits: int,
    rows_width: tuple[int, int],
    settings: int,
    uniform: int,
    num_threads: int,
    dtype: str,
) -> None:
    """out [rows] int64 = a token drawn from each row of logits [rows, width] of `dtype`
    ("float32" or "bfloat16"): logits / temperature, the top_k (0: all), softmax, min_p, top_p,
    then the first token whose cumulative kept probability in vocabulary order reaches
    (1 - uniform) of the kept total; per-row settings float32 [rows, 4] (temperature, top_k,
    top_p, min_p) and uniform float32 [rows]. Internal: used by `pagedkv.runner.sampler`."""

def ggml_block_size(ggml_type: Literal["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]) -> tuple[int, int]:
    """(elements, bytes) of one GGUF block of `ggml_type`."""

def quantized_kernel_at_every_token_count(ggml_type: Literal["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]) -> bool:
    """Whether `quantized_linear_cpu` beats dequantizing for float32's GEMM at every token count
    on this CPU (the blocks of 32 always; the K-quants on AVX-512 VNNI)."""

def quantized_linear_cpu(
    out: int,
    x: int,
    weight: int,
    weight_bytes: int,
    bias: int | None,
    ggml_type: Literal["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"],
    shape: tuple[int, int, int],
    num_threads: int,
) -> None:
    """out [m, n] float32 = x [m, k] float32 @ dequantize(weight)^T (+ bias [n] float32), weight
    `weight_bytes` bytes of GGUF blocks, n rows of k elements; x is quantized to 8 bits per block
    as llama.cpp does and each dot product is integer per block. Raises InvalidConfigError on a
    k that is not whole blocks or a byte count that is not n rows. Internal: use
    `pagedkv.layers.quantized_linear`, which checks the tensors."""

def dequantize_cpu(
    out: int,
    out_len: int,
    blocks: int,
    blocks_bytes: int,
    ggml_type: Literal["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"],
    num_threads: int,
) -> None:
    """out (out_len float32) = the values of `blocks_bytes` bytes of GGUF blocks. Internal: use
    `pagedkv.layers.quantized_linear.dequantize`."""

# (weight kind: "float32", "bfloat16" or a GGUF type, weight address, weight bytes, bias address or None,
# in_features, out_features)
_LinearSpec = tuple[str, int, int, int | None, int, int]

class CpuDecoder:
    """A Llama model's decoder layers for CPU decode steps in one call (float32 activations and
    cache): per layer residual + RMSNorm, qkv, rotary, K/V write, paged decode attention, o_proj,
    residual + RMSNorm, gate_up, SiLU-and-mul, down, through the same kernels as the layer-by-layer
    path. Holds addresses: the caller keeps the tensors alive. Internal: use
    `pagedkv.models.llama_cpu_decode`, which checks the tensors."""

    def __init__(
        self,
        shape: tuple[int, int, int, int, int, int, int, int],
        rms_norm_eps: float,
        attention_scale: float,
        layers: list[tuple[int, list[_LinearSpec], _LinearSpec, int, _LinearSpec, _LinearSpec, int, int, int]],
    ) -> None:
        """shape: (hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, block_size,
        num_blocks, block_stride); each layer: (input norm address, qkv's parts (one, or several
        stacked by rows: a fused projection whose parts are of different GGUF types), o,
        post-attention norm address, gate_up, down, key view offset, value view offset in cache
        elements, sliding window or 0)."""

    @property
    def num_layers(self) -> int: ...
    def forward(
        self,
        hidden: int,
        residual: int,
        cache: int,
        cache_len: int,
        cache_dtype: str,
        cos_sin: tuple[int, int],
        block_tables: int,
        table_width: int,
        context_lens: int,
        slots: int,
        num_tokens: int,
        num_threads: int,
    ) -> None:
        """Every layer over hidden [T, hidden_size] float32 in place (residual [T, hidden_size]
        written), each layer's new K/V written to its slot of the cache (cache_len elements of
        cache_dtype, "float32" or "bfloat16": K/V, query and attention output rounded to it); cos/sin [T, head_dim] float32, block
        tables int32 [T, table_width], context lengths int32 [T], slots int64 [T]. Raises
        InvalidConfigError, writing nothing, on shapes, tables or slots that do not fit."""

class BlockStored:
    """Full blocks became cached in `medium` ('GPU': the device pool, 'CPU': the CPU prefix tier).
    block_hashes[i] holds token_ids[i * block_size:(i + 1) * block_size] and is the child of
    block_hashes[i - 1]; the first is the child of parent_block_hash (None: a prompt's first
    block). lora_id: the request's prefix-cache extra key (adapter and cache salt), else None.
    group_idx: the KV-cache group whose blocks these are (0 with one group; each group caches
    its own block of a prefix under the same hash). The fields and their order are vLLM's."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: str
    group_idx: int

class BlockRemoved:
    """Cached blocks of KV-cache group `group_idx` left `medium` (evicted, moved to the other
    tier, or stale)."""

    block_hashes: list[int]
    medium: str
    group_idx: int

class AllBlocksCleared:
    """Every cached block of every tier was dropped (reset_prefix_cache)."""

KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
