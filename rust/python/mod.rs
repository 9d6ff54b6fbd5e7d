//! The PyO3 layer: conversions and error mapping only. All logic lives in the plain Rust types.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::block_manager::BlockManager as RustBlockManager;
use crate::block_pool::Device;
use crate::config::{SchedulerConfig as RustSchedulerConfig, SchedulingPolicy};
use crate::cpu_attention::{paged_decode_attention, DecodeShape};
use crate::cpu_layer_ops;
use crate::cpu_prefill_attention::paged_prefill_attention;
use crate::cpu_simd::{Bf16, Isa};
use crate::fp8::{Fp8E4m3, Fp8E5m2};
use crate::errors::Error;
use crate::preemption::{CostModel, PreemptionMode};
use crate::scheduler::{
    ScheduledSequence as RustScheduledSequence, Scheduler as RustScheduler, SchedulerOutput as RustSchedulerOutput,
};

mod exceptions {
    pyo3::import_exception!(pagedkv.errors, PagedKVError);
    pyo3::import_exception!(pagedkv.errors, PromptTooLongError);
    pyo3::import_exception!(pagedkv.errors, OverloadedError);
    pyo3::import_exception!(pagedkv.errors, OutOfBlocksError);
    pyo3::import_exception!(pagedkv.errors, UnknownRequestError);
    pyo3::import_exception!(pagedkv.errors, UnknownSequenceError);
    pyo3::import_exception!(pagedkv.errors, DuplicateRequestError);
    pyo3::import_exception!(pagedkv.errors, InvalidConfigError);
    pyo3::import_exception!(pagedkv.errors, InvalidStateError);
}

fn to_py_err(error: Error) -> PyErr {
    use exceptions::*;
    let message = error.to_string();
    match error {
        Error::PromptTooLong { .. } | Error::PromptExceedsPool { .. } => PromptTooLongError::new_err(message),
        Error::Overloaded { .. } => OverloadedError::new_err(message),
        Error::OutOfBlocks { .. } => OutOfBlocksError::new_err(message),
        Error::UnknownRequest(_) => UnknownRequestError::new_err(message),
        Error::UnknownSequence(_) => UnknownSequenceError::new_err(message),
        Error::DuplicateRequest(_) | Error::DuplicateSequence(_) => DuplicateRequestError::new_err(message),
        Error::InvalidConfig { .. } => InvalidConfigError::new_err(message),
        Error::InvalidState(_) => InvalidStateError::new_err(message),
    }
}

/// Runs core code so that neither an error nor a panic crosses into Python unmapped.
fn call<T>(f: impl FnOnce() -> crate::errors::Result<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result.map_err(to_py_err),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(exceptions::PagedKVError::new_err(format!("internal error in pagedkv core: {what}")))
        }
    }
}

/// Scheduler settings; see `pagedkv._core.pyi` for each field.
#[pyclass(module = "pagedkv._core", from_py_object)]
#[derive(Clone)]
pub struct SchedulerConfig {
    #[pyo3(get, set)]
    block_size: usize,
    #[pyo3(get, set)]
    num_device_blocks: usize,
    #[pyo3(get, set)]
    num_cpu_blocks: usize,
    #[pyo3(get, set)]
    max_num_seqs: usize,
    #[pyo3(get, set)]
    max_num_batched_tokens: usize,
    #[pyo3(get, set)]
    max_model_len: usize,
    #[pyo3(get, set)]
    max_waiting_requests: usize,
    #[pyo3(get, set)]
    enable_prefix_caching: bool,
    #[pyo3(get, set)]
    enable_cpu_prefix_cache: bool,
    #[pyo3(get, set)]
    enable_chunked_prefill: bool,
    #[pyo3(get, set)]
    long_prefill_token_threshold: usize,
    #[pyo3(get, set)]
    sliding_window: usize,
    #[pyo3(get, set)]
    prefix_caching_hash_seed: u64,
    #[pyo3(get, set)]
    preemption_mode: String,
    #[pyo3(get, set)]
    scheduling_policy: String,
    #[pyo3(get, set)]
    watermark: f64,
    #[pyo3(get, set)]
    recompute_cost_per_token: f64,
    #[pyo3(get, set)]
    block_bytes: f64,
    #[pyo3(get, set)]
    swap_bandwidth: f64,
    #[pyo3(get, set)]
    swap_latency: f64,
}

#[pymethods]
impl SchedulerConfig {
    #[new]
    #[pyo3(signature = (
        block_size=16, num_device_blocks=1024, num_cpu_blocks=1024, max_num_seqs=256,
        max_num_batched_tokens=2048, max_model_len=2048, max_waiting_requests=1024,
        enable_prefix_caching=true, enable_chunked_prefill=true, preemption_mode="auto".to_string(),
        scheduling_policy="fcfs".to_string(), watermark=0.01, recompute_cost_per_token=None, block_bytes=None,
        swap_bandwidth=None, swap_latency=None, enable_cpu_prefix_cache=false, long_prefill_token_threshold=0,
        sliding_window=0, prefix_caching_hash_seed=0,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        block_size: usize,
        num_device_blocks: usize,
        num_cpu_blocks: usize,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        max_model_len: usize,
        max_waiting_requests: usize,
        enable_prefix_caching: bool,
        enable_chunked_prefill: bool,
        preemption_mode: String,
        scheduling_policy: String,
        watermark: f64,
        recompute_cost_per_token: Option<f64>,
        block_bytes: Option<f64>,
        swap_bandwidth: Option<f64>,
        swap_latency: Option<f64>,
        enable_cpu_prefix_cache: bool,
        long_prefill_token_threshold: usize,
        sliding_window: usize,
        prefix_caching_hash_seed: u64,
    ) -> PyResult<Self> {
        let cost = CostModel::default();
        let config = SchedulerConfig {
            block_size,
            num_device_blocks,
            num_cpu_blocks,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            max_waiting_requests,
            enable_prefix_caching,
            enable_cpu_prefix_cache,
            enable_chunked_prefill,
            long_prefill_token_threshold,
            sliding_window,
            prefix_caching_hash_seed,
            preemption_mode,
            scheduling_policy,
            watermark,
            recompute_cost_per_token: recompute_cost_per_token.unwrap_or(cost.recompute_cost_per_token),
            block_bytes: block_bytes.unwrap_or(cost.block_bytes),
            swap_bandwidth: swap_bandwidth.unwrap_or(cost.swap_bandwidth),
            swap_latency: swap_latency.unwrap_or(cost.swap_latency),
        };
        config.to_rust()?;
        Ok(config)
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedulerConfig(block_size={}, num_device_blocks={}, num_cpu_blocks={}, max_num_seqs={}, \
             max_num_batched_tokens={}, max_model_len={}, max_waiting_requests={}, enable_prefix_caching={}, \
             enable_chunked_prefill={}, preemption_mode={:?}, scheduling_policy={:?}, watermark={})",
            self.block_size,
            self.num_device_blocks,
            self.num_cpu_blocks,
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.max_model_len,
            self.max_waiting_requests,
            self.enable_prefix_caching,
            self.enable_chunked_prefill,
            self.preemption_mode,
            self.scheduling_policy,
            self.watermark
        )
    }
}

impl SchedulerConfig {
    fn to_rust(&self) -> PyResult<RustSchedulerConfig> {
        let config = RustSchedulerConfig {
            block_size: self.block_size,
            num_device_blocks: self.num_device_blocks,
            num_cpu_blocks: self.num_cpu_blocks,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len: self.max_model_len,
            max_waiting_requests: self.max_waiting_requests,
            enable_prefix_caching: self.enable_prefix_caching,
            enable_cpu_prefix_cache: self.enable_cpu_prefix_cache,
            enable_chunked_prefill: self.enable_chunked_prefill,
            long_prefill_token_threshold: self.long_prefill_token_threshold,
            sliding_window: self.sliding_window,
            prefix_caching_hash_seed: self.prefix_caching_hash_seed,
            preemption_mode: self.preemption_mode.parse::<PreemptionMode>().map_err(to_py_err)?,
            scheduling_policy: self.scheduling_policy.parse::<SchedulingPolicy>().map_err(to_py_err)?,
            watermark: self.watermark,
            cost_model: CostModel {
                recompute_cost_per_token: self.recompute_cost_per_token,
                block_bytes: self.block_bytes,
                swap_bandwidth: self.swap_bandwidth,
                swap_latency: self.swap_latency,
            },
        };
        config.validate().map_err(to_py_err)?;
        Ok(config)
    }
}

/// One sequence's work in a step (see the stub for field meanings).
#[pyclass(module = "pagedkv._core", frozen, get_all)]
pub struct ScheduledSequence {
    request_id: String,
    seq_id: u64,
    is_prefill: bool,
    start: usize,
    end: usize,
    token_ids: Vec<u32>,
    block_table: Vec<u32>,
    block_table_from: usize,
    slot_mapping: Vec<i64>,
    sample: bool,
}

#[pymethods]
impl ScheduledSequence {
    #[getter]
    fn context_len(&self) -> usize {
        self.end
    }

    fn __repr__(&self) -> String {
        format!(
            "ScheduledSequence(request_id={:?}, seq_id={}, is_prefill={}, start={}, end={}, sample={}, blocks={})",
            self.request_id,
            self.seq_id,
            self.is_prefill,
            self.start,
            self.end,
            self.sample,
            self.block_table.len()
        )
    }
}

impl ScheduledSequence {
    fn from_rust(out: &RustSchedulerOutput, seq: &RustScheduledSequence, scheduler: &RustScheduler) -> PyResult<Self> {
        let request_id = scheduler.request_id(seq.seq_id).map_err(to_py_err)?.to_string();
        let block_table = scheduler.block_table(seq.seq_id).map_err(to_py_err)?;
        Ok(ScheduledSequence {
            request_id,
            seq_id: seq.seq_id,
            is_prefill: seq.is_prefill,
            start: seq.start,
            end: seq.end,
            token_ids: out.token_ids(seq).to_vec(),
            block_table: block_table.to_vec(),
            block_table_from: seq.block_table_from,
            slot_mapping: out.slot_mapping(seq).to_vec(),
            sample: seq.sample,
        })
    }
}

/// How many block tables hold `block` (device or CPU pool), range-checked.
fn refcount(blocks: &RustBlockManager, block: u32, on_device: bool) -> PyResult<u32> {
    let device = if on_device { Device::Gpu } else { Device::Cpu };
    let num_blocks = if on_device { blocks.num_device_blocks() } else { blocks.num_cpu_blocks() };
    if block as usize >= num_blocks {
        return Err(exceptions::InvalidStateError::new_err(format!(
            "block {block} out of range: the {device} pool has {num_blocks} blocks"
        )));
    }
    Ok(blocks.refcount(block, device))
}

/// The plan of one step.
#[pyclass(module = "pagedkv._core", frozen, get_all)]
pub struct SchedulerOutput {
    scheduled: Vec<Py<ScheduledSequence>>,
    blocks_to_swap_in: Vec<(u32, u32)>,
    blocks_to_swap_out: Vec<(u32, u32)>,
    blocks_to_copy: Vec<(u32, u32)>,
    preempted: Vec<String>,
    aborted: Vec<String>,
    /// Why each of `aborted` was dropped (the limit it cannot fit).
    abort_reasons: Vec<String>,
    num_batched_tokens: usize,
    num_prefix_hit_tokens: usize,
}

#[pymethods]
impl SchedulerOutput {
    fn is_empty(&self) -> bool {
        self.scheduled.is_empty() && self.blocks_to_swap_out.is_empty()
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedulerOutput(scheduled={}, tokens={}, swap_in={}, swap_out={}, copy={}, preempted={:?}, aborted={:?})",
            self.scheduled.len(),
            self.num_batched_tokens,
            self.blocks_to_swap_in.len(),
            self.blocks_to_swap_out.len(),
            self.blocks_to_copy.len(),
            self.preempted,
            self.aborted
        )
    }
}

impl SchedulerOutput {
    /// `scheduler` is the one that just produced `out`: Python gets each sequence's whole table.
    fn from_rust(py: Python<'_>, out: RustSchedulerOutput, scheduler: &RustScheduler) -> PyResult<Self> {
        let scheduled = out
            .scheduled
            .iter()
            .map(|seq| Py::new(py, ScheduledSequence::from_rust(&out, seq, scheduler)?))
            .collect::<PyResult<_>>()?;
        Ok(SchedulerOutput {
            scheduled,
            blocks_to_swap_in: out.blocks_to_swap_in,
            blocks_to_swap_out: out.blocks_to_swap_out,
            blocks_to_copy: out.blocks_to_copy,
            preempted: out.preempted.iter().map(|id| id.to_string()).collect(),
            aborted: out.aborted.iter().map(|id| id.to_string()).collect(),
            abort_reasons: out.abort_reasons,
            num_batched_tokens: out.num_batched_tokens,
            num_prefix_hit_tokens: out.num_prefix_hit_tokens,
        })
    }
}

/// The scheduler: continuous batching over a paged KV cache.
#[pyclass(module = "pagedkv._core")]
pub struct Scheduler {
    inner: RustScheduler,
}

#[pymethods]
impl Scheduler {
    #[new]
    #[pyo3(signature = (config=None))]
    fn new(config: Option<SchedulerConfig>) -> PyResult<Self> {
        let config = match config {
            Some(config) => config.to_rust()?,
            None => RustSchedulerConfig::default(),
        };
        Ok(Scheduler { inner: call(|| RustScheduler::new(config))? })
    }

    #[pyo3(signature = (request_id, prompt_token_ids, extra_key=None, priority=0))]
    fn add_request(
        &mut self,
        request_id: &str,
        prompt_token_ids: Vec<u32>,
        extra_key: Option<u64>,
        priority: i64,
    ) -> PyResult<u64> {
        call(|| self.inner.add_request_with_priority(request_id, prompt_token_ids, extra_key, priority))
    }

    fn schedule(&mut self, py: Python<'_>) -> PyResult<SchedulerOutput> {
        let inner = &mut self.inner;
        let out = py.detach(|| call(|| Ok(inner.schedule())))?;
        SchedulerOutput::from_rust(py, out, &self.inner)
    }

    #[pyo3(signature = (seq_id, token_id, draft_token_ids=Vec::new()))]
    fn append_token(&mut self, seq_id: u64, token_id: u32, draft_token_ids: Vec<u32>) -> PyResult<()> {
        call(|| self.inner.append_token_with_drafts(seq_id, token_id, &draft_token_ids))
    }

    fn accept_drafts(&mut self, seq_id: u64, num_accepted: usize) -> PyResult<()> {
        call(|| self.inner.accept_drafts(seq_id, num_accepted))
    }

    fn fork(&mut self, parent_seq_id: u64) -> PyResult<u64> {
        call(|| self.inner.fork(parent_seq_id))
    }

    fn finish_sequence(&mut self, seq_id: u64) -> PyResult<()> {
        call(|| self.inner.finish_sequence(seq_id))
    }

    fn abort(&mut self, request_id: &str) -> PyResult<()> {
        call(|| self.inner.abort(request_id))
    }

    fn sequence_len(&self, seq_id: u64) -> PyResult<usize> {
        call(|| self.inner.sequence_len(seq_id))
    }

    fn block_table(&self, seq_id: u64) -> PyResult<Vec<u32>> {
        call(|| Ok(self.inner.block_manager().table(seq_id)?.blocks.clone()))
    }

    fn is_swapped(&self, seq_id: u64) -> PyResult<bool> {
        call(|| Ok(self.inner.block_manager().table(seq_id)?.device == Device::Cpu))
    }

    #[pyo3(signature = (block, on_device=true))]
    fn refcount(&self, block: u32, on_device: bool) -> PyResult<u32> {
        refcount(self.inner.block_manager(), block, on_device)
    }

    fn has_unfinished_requests(&self) -> bool {
        self.inner.has_unfinished()
    }

    fn reset_prefix_cache(&mut self) -> bool {
        self.inner.reset_prefix_cache()
    }

    #[getter]
    fn num_unfinished_requests(&self) -> usize {
        self.inner.num_unfinished()
    }

    #[getter]
    fn max_model_len(&self) -> usize {
        self.inner.max_model_len()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.config().block_size
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.inner.block_manager().check_invariants().map_err(exceptions::InvalidStateError::new_err)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.inner.stats();
        let dict = PyDict::new(py);
        dict.set_item("num_device_blocks", stats.num_device_blocks)?;
        dict.set_item("num_free_device_blocks", stats.num_free_device_blocks)?;
        dict.set_item("num_cached_device_blocks", stats.num_cached_device_blocks)?;
        dict.set_item("num_cpu_blocks", stats.num_cpu_blocks)?;
        dict.set_item("num_free_cpu_blocks", stats.num_free_cpu_blocks)?;
        dict.set_item("num_cached_cpu_blocks", stats.num_cached_cpu_blocks)?;
        dict.set_item("num_running", stats.num_running)?;
        dict.set_item("num_waiting", stats.num_waiting)?;
        dict.set_item("num_swapped", stats.num_swapped)?;
        dict.set_item("num_running_seqs", stats.num_running_seqs)?;
        dict.set_item("num_preemptions_swap", stats.num_preemptions_swap)?;
        dict.set_item("num_preemptions_recompute", stats.num_preemptions_recompute)?;
        dict.set_item("num_blocks_swapped_in", stats.num_blocks_swapped_in)?;
        dict.set_item("num_blocks_swapped_out", stats.num_blocks_swapped_out)?;
        dict.set_item("num_blocks_copied", stats.num_blocks_copied)?;
        dict.set_item("prefix_cache_queries", stats.prefix_cache_queries)?;
        dict.set_item("prefix_cache_hits", stats.prefix_cache_hits)?;
        let hit_rate = if stats.prefix_cache_queries == 0 {
            0.0
        } else {
            stats.prefix_cache_hits as f64 / stats.prefix_cache_queries as f64
        };
        dict.set_item("prefix_cache_hit_rate", hit_rate)?;
        dict.set_item("num_blocks_offloaded", stats.num_blocks_offloaded)?;
        dict.set_item("cpu_prefix_cache_hits", stats.cpu_prefix_cache_hits)?;
        dict.set_item("num_steps", stats.num_steps)?;
        Ok(dict)
    }
}

/// The block manager alone: two pools, block tables, fork/CoW, prefix cache, swap.
#[pyclass(module = "pagedkv._core")]
pub struct BlockManager {
    inner: RustBlockManager,
}

#[pymethods]
impl BlockManager {
    #[new]
    #[pyo3(signature = (
        num_device_blocks, num_cpu_blocks, block_size=16, enable_prefix_caching=false, watermark=0.0, sliding_window=0,
        hash_seed=0,
    ))]
    fn new(
        num_device_blocks: usize,
        num_cpu_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
        watermark: f64,
        sliding_window: usize,
        hash_seed: u64,
    ) -> PyResult<Self> {
        let mut inner = call(|| {
            RustBlockManager::new(num_device_blocks, num_cpu_blocks, block_size, enable_prefix_caching, watermark)
        })?;
        inner.set_sliding_window(sliding_window);
        call(|| inner.set_hash_seed(hash_seed))?;
        Ok(BlockManager { inner })
    }

    #[pyo3(signature = (seq_id, token_ids, extra_key=None))]
    fn allocate(&mut self, seq_id: u64, token_ids: Vec<u32>, extra_key: Option<u64>) -> PyResult<usize> {
        call(|| self.inner.allocate(seq_id, &token_ids, extra_key))
    }

    fn append_token(&mut self, seq_id: u64, token_id: u32) -> PyResult<Option<(u32, u32)>> {
        call(|| self.inner.append_token(seq_id, token_id))
    }

    fn append_slots(&mut self, seq_id: u64, token_ids: Vec<u32>) -> PyResult<Option<(u32, u32)>> {
        call(|| self.inner.append_slots(seq_id, &token_ids))
    }

    fn fork(&mut self, parent_seq_id: u64, child_seq_id: u64) -> PyResult<()> {
        call(|| self.inner.fork(parent_seq_id, child_seq_id))
    }

    fn free(&mut self, seq_id: u64) -> PyResult<()> {
        call(|| self.inner.free(seq_id))
    }

    fn swap_out(&mut self, seq_ids: Vec<u64>) -> PyResult<Vec<(u32, u32)>> {
        call(|| self.inner.swap_out(&seq_ids))
    }

    fn swap_in(&mut self, seq_ids: Vec<u64>) -> PyResult<Vec<(u32, u32)>> {
        call(|| self.inner.swap_in(&seq_ids))
    }

    fn block_table(&self, seq_id: u64) -> PyResult<Vec<u32>> {
        call(|| Ok(self.inner.table(seq_id)?.blocks.clone()))
    }

    fn num_tokens(&self, seq_id: u64) -> PyResult<usize> {
        call(|| Ok(self.inner.table(seq_id)?.num_tokens))
    }

    fn num_released_blocks(&self, seq_id: u64) -> PyResult<usize> {
        call(|| Ok(self.inner.table(seq_id)?.num_released))
    }

    fn is_swapped(&self, seq_id: u64) -> PyResult<bool> {
        call(|| Ok(self.inner.table(seq_id)?.device == Device::Cpu))
    }

    #[pyo3(signature = (block, on_device=true))]
    fn refcount(&self, block: u32, on_device: bool) -> PyResult<u32> {
        refcount(&self.inner, block, on_device)
    }

    fn blocks_needed_to_append(&self, seq_id: u64, num_tokens: usize) -> PyResult<usize> {
        call(|| self.inner.blocks_needed_to_append(seq_id, num_tokens))
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().map_err(exceptions::InvalidStateError::new_err)
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    #[getter]
    fn num_device_blocks(&self) -> usize {
        self.inner.num_device_blocks()
    }
    #[getter]
    fn num_free_device_blocks(&self) -> usize {
        self.inner.num_free_device_blocks()
    }
    #[getter]
    fn num_cached_device_blocks(&self) -> usize {
        self.inner.num_cached_device_blocks()
    }
    #[getter]
    fn num_cpu_blocks(&self) -> usize {
        self.inner.num_cpu_blocks()
    }
    #[getter]
    fn num_free_cpu_blocks(&self) -> usize {
        self.inner.num_free_cpu_blocks()
    }
    #[getter]
    fn prefix_cache_queries(&self) -> u64 {
        self.inner.prefix_cache().queries
    }
    #[getter]
    fn prefix_cache_hits(&self) -> u64 {
        self.inner.prefix_cache().hits
    }
}

/// The kernels' shape from Python's tuple (batch, num_heads, num_kv_heads, head_dim,
/// block_size, num_blocks, block_stride, table_width), sliding window (0: none) and logit soft
/// cap (0: none).
fn decode_shape(
    shape: (usize, usize, usize, usize, usize, usize, usize, usize),
    sliding_window: usize,
    logit_softcap: f32,
) -> DecodeShape {
    let (batch, num_heads, num_kv_heads, head_dim, block_size, num_blocks, block_stride, table_width) = shape;
    DecodeShape {
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        block_stride,
        table_width,
        sliding_window,
        logit_softcap,
    }
}

/// Calls `$body` with `$T` the query/output element type and `$C` the cache element type named by
/// `$cache_dtype`: "float32" and "bfloat16" caches are read with queries of their own type, float8
/// caches ("fp8_e4m3", "fp8_e5m2") with float32 queries.
macro_rules! with_attention_elements {
    ($cache_dtype:expr, $T:ident, $C:ident => $body:expr) => {
        match $cache_dtype {
            "float32" => {
                type $T = f32;
                type $C = f32;
                $body
            }
            "bfloat16" => {
                type $T = Bf16;
                type $C = Bf16;
                $body
            }
            "fp8_e4m3" => {
                type $T = f32;
                type $C = Fp8E4m3;
                $body
            }
            "fp8_e5m2" => {
                type $T = f32;
                type $C = Fp8E5m2;
                $body
            }
            other => Err(exceptions::InvalidConfigError::new_err(format!(
                "cache_dtype must be 'float32', 'bfloat16', 'fp8_e4m3' or 'fp8_e5m2', got {other:?}"
            ))),
        }
    };
}

/// Paged decode attention over CPU tensors given by data pointer: caches of `cache_dtype`, query
/// and out of the type `with_attention_elements!` pairs with it. Internal: the caller
/// (`pagedkv.attention.cpu`) checks every shape, dtype, device and stride first.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn paged_decode_attention_cpu(
    py: Python<'_>,
    out: usize,
    query: usize,
    key_cache: usize,
    value_cache: usize,
    block_tables: usize,
    context_lens: usize,
    shape: (usize, usize, usize, usize, usize, usize, usize, usize),
    scale: f32,
    num_threads: usize,
    cache_dtype: &str,
    sliding_window: usize,
    logit_softcap: f32,
    sinks: usize,
) -> PyResult<()> {
    let shape = decode_shape(shape, sliding_window, logit_softcap);
    let rows = shape.batch * shape.num_heads * shape.head_dim;
    with_attention_elements!(cache_dtype, T, C => py.detach(|| call(|| {
        // SAFETY: 0 or a live float32 tensor of num_heads values (checked by the caller).
        let sinks = (sinks != 0).then(|| unsafe { std::slice::from_raw_parts(sinks as *const f32, shape.num_heads) });
        // SAFETY: the pointers are those of live, contiguous CPU tensors of these shapes (T out
        // and query, C caches, int32 tables/contexts), checked by the caller, and `out` is a
        // fresh tensor that aliases no input. The caches may overlap each other (K and V of the
        // block-major cache): both are only read.
        let (out, query, keys, values, tables, contexts) = unsafe {
            (
                std::slice::from_raw_parts_mut(out as *mut T, rows),
                std::slice::from_raw_parts(query as *const T, rows),
                std::slice::from_raw_parts(key_cache as *const C, shape.cache_len()),
                std::slice::from_raw_parts(value_cache as *const C, shape.cache_len()),
                std::slice::from_raw_parts(block_tables as *const i32, shape.batch * shape.table_width),
                std::slice::from_raw_parts(context_lens as *const i32, shape.batch),
            )
        };
        paged_decode_attention(out, query, keys, values, tables, contexts, &shape, scale, sinks, num_threads)
    })))
}

/// Calls `$body` with `$E` the element type named by `$dtype` ("float32" or "bfloat16").
macro_rules! with_element {
    ($dtype:expr, $E:ident => $body:expr) => {
        match $dtype {
            "float32" => {
                type $E = f32;
                $body
            }
            "bfloat16" => {
                type $E = Bf16;
                $body
            }
            other => Err(exceptions::InvalidConfigError::new_err(format!(
                "dtype must be 'float32' or 'bfloat16', got {other:?}"
            ))),
        }
    };
}

/// Paged prefill/extend attention over CPU tensors given by data pointer: caches of
/// `cache_dtype`, query and out `[num_tokens, num_heads, head_dim]` of the type
/// `with_attention_elements!` pairs with it, int32 tables, query_start_loc
/// and context_lens; `shape.0` is the number of sequences. Internal: the caller
/// (`pagedkv.attention.cpu`) checks every shape, dtype, device and stride first.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn paged_prefill_attention_cpu(
    py: Python<'_>,
    out: usize,
    query: usize,
    key_cache: usize,
    value_cache: usize,
    block_tables: usize,
    query_start_loc: usize,
    context_lens: usize,
    shape: (usize, usize, usize, usize, usize, usize, usize, usize),
    num_tokens: usize,
    scale: f32,
    num_threads: usize,
    cache_dtype: &str,
    sliding_window: usize,
    logit_softcap: f32,
    sinks: usize,
) -> PyResult<()> {
    let shape = decode_shape(shape, sliding_window, logit_softcap);
    let rows = num_tokens * shape.num_heads * shape.head_dim;
    with_attention_elements!(cache_dtype, T, C => py.detach(|| call(|| {
        // SAFETY: 0 or a live float32 tensor of num_heads values (checked by the caller).
        let sinks = (sinks != 0).then(|| unsafe { std::slice::from_raw_parts(sinks as *const f32, shape.num_heads) });
        // SAFETY: as in `paged_decode_attention_cpu`; query_start_loc has batch + 1 entries.
        let (out, query, keys, values, tables, starts, contexts) = unsafe {
            (
                std::slice::from_raw_parts_mut(out as *mut T, rows),
                std::slice::from_raw_parts(query as *const T, rows),
                std::slice::from_raw_parts(key_cache as *const C, shape.cache_len()),
                std::slice::from_raw_parts(value_cache as *const C, shape.cache_len()),
                std::slice::from_raw_parts(block_tables as *const i32, shape.batch * shape.table_width),
                std::slice::from_raw_parts(query_start_loc as *const i32, shape.batch + 1),
                std::slice::from_raw_parts(context_lens as *const i32, shape.batch),
            )
        };
        paged_prefill_attention(
            Isa::best(), out, query, keys, values, tables, starts, contexts, &shape, scale, sinks, num_threads,
        )
    })))
}

/// Residual add + RMSNorm in place over `[rows, width]` CPU tensors given by data pointer.
/// Internal: `pagedkv.layers.cpu_fused` checks the tensors first.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn rms_norm_cpu(
    py: Python<'_>,
    hidden: usize,
    residual: Option<usize>,
    weight: usize,
    rows_width: (usize, usize),
    eps: f32,
    num_threads: usize,
    dtype: &str,
) -> PyResult<()> {
    let (rows, width) = rows_width;
    with_element!(dtype, E => py.detach(|| call(|| {
        // SAFETY: live, contiguous, distinct CPU tensors of these shapes and dtype (caller-checked).
        let (hidden, residual, weight) = unsafe {
            (
                std::slice::from_raw_parts_mut(hidden as *mut E, rows * width),
                residual.map(|residual| std::slice::from_raw_parts_mut(residual as *mut E, rows * width)),
                std::slice::from_raw_parts(weight as *const E, width),
            )
        };
        cpu_layer_ops::rms_norm(hidden, residual, weight, width, eps, num_threads)
    })))
}

/// out `[rows, width]` = silu(gate) * up of input `[rows, 2 * width]`, CPU tensors given by data
/// pointer. Internal: `pagedkv.layers.cpu_fused` checks the tensors first.
#[pyfunction]
fn silu_and_mul_cpu(
    py: Python<'_>,
    out: usize,
    input: usize,
    rows_width: (usize, usize),
    num_threads: usize,
    dtype: &str,
) -> PyResult<()> {
    let (rows, width) = rows_width;
    with_element!(dtype, E => py.detach(|| call(|| {
        // SAFETY: live, contiguous CPU tensors of these shapes and dtype; `out` is fresh.
        let (out, input) = unsafe {
            (
                std::slice::from_raw_parts_mut(out as *mut E, rows * width),
                std::slice::from_raw_parts(input as *const E, rows * 2 * width),
            )
        };
        cpu_layer_ops::silu_and_mul(out, input, width, num_threads)
    })))
}

/// Rotary embedding in place on the first `num_heads` heads of each `[num_tokens, row_width]`
/// row, by cos/sin `[num_tokens, head_dim]`. Internal: `pagedkv.layers.cpu_fused` checks the
/// tensors first.
#[pyfunction]
fn rotary_cpu(
    py: Python<'_>,
    qkv: usize,
    cos: usize,
    sin: usize,
    shape: (usize, usize, usize, usize),
    num_threads: usize,
    dtype: &str,
) -> PyResult<()> {
    let (num_tokens, row_width, num_heads, head_dim) = shape;
    let shape = cpu_layer_ops::RotaryShape { num_tokens, row_width, num_heads, head_dim };
    with_element!(dtype, E => py.detach(|| call(|| {
        // SAFETY: live, contiguous CPU tensors of these shapes and dtype; qkv aliases neither table.
        let (qkv, cos, sin) = unsafe {
            (
                std::slice::from_raw_parts_mut(qkv as *mut E, num_tokens * row_width),
                std::slice::from_raw_parts(cos as *const E, num_tokens * head_dim),
                std::slice::from_raw_parts(sin as *const E, num_tokens * head_dim),
            )
        };
        cpu_layer_ops::rotary_in_place(qkv, cos, sin, shape, num_threads)
    })))
}

/// (instruction set, runs on an OpenMP team) of the CPU decode attention in this process.
#[pyfunction]
fn cpu_attention_build() -> (String, bool) {
    (format!("{:?}", Isa::best()), crate::openmp_team::is_available())
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SchedulerConfig>()?;
    m.add_class::<ScheduledSequence>()?;
    m.add_class::<SchedulerOutput>()?;
    m.add_class::<Scheduler>()?;
    m.add_class::<BlockManager>()?;
    m.add_function(wrap_pyfunction!(paged_decode_attention_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(paged_prefill_attention_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_attention_build, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(silu_and_mul_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(rotary_cpu, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
