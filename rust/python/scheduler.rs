//! The scheduler's classes: `SchedulerConfig`, `Scheduler` and the step it plans.

use std::convert::Infallible;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyString};

use super::block_manager::refcount;
use super::errors::{call, exceptions, to_py_err};
use super::kv_events;
use crate::device::Device;
use crate::sched::config::{SchedulerConfig, SchedulingPolicy};
use crate::sched::preemption::PreemptionMode;
use crate::sched::scheduler::{
    Fork, ScheduledSequence as RustScheduledSequence, Scheduler as RustScheduler,
    SchedulerOutput as RustSchedulerOutput, StepUpdate,
};

/// `SchedulerConfig(**options)`: the struct of `sched/config.rs` (its fields are the attributes),
/// its defaults, any field given by keyword; invalid values raise InvalidConfigError.
#[pymethods]
impl SchedulerConfig {
    #[new]
    #[pyo3(signature = (**options))]
    fn py_new(py: Python<'_>, options: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let config = Bound::new(py, SchedulerConfig::default())?;
        for (name, value) in options.into_iter().flatten() {
            let name: String = name.extract()?;
            if name.starts_with('_') || !config.hasattr(name.as_str())? {
                let fields: Vec<String> = config
                    .dir()?
                    .iter()
                    .filter_map(|field| field.extract::<String>().ok())
                    .filter(|field| !field.starts_with('_'))
                    .collect();
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "SchedulerConfig has no option '{name}'; its options: {}",
                    fields.join(", ")
                )));
            }
            config.setattr(name.as_str(), value)?;
        }
        let config = config.borrow().clone();
        config.validate().map_err(to_py_err)?;
        Ok(config)
    }

    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

/// The policies cross as their names ('swap', 'fcfs', ...): `as_str` out, `FromStr` in.
macro_rules! crosses_as_its_name {
    ($policy:ty) => {
        impl<'py> IntoPyObject<'py> for $policy {
            type Target = PyString;
            type Output = Bound<'py, PyString>;
            type Error = Infallible;
            fn into_pyobject(self, py: Python<'py>) -> Result<Self::Output, Infallible> {
                Ok(PyString::new(py, self.as_str()))
            }
        }

        impl<'a, 'py> FromPyObject<'a, 'py> for $policy {
            type Error = PyErr;
            fn extract(value: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
                value.extract::<String>()?.parse().map_err(to_py_err)
            }
        }
    };
}

crosses_as_its_name!(PreemptionMode);
crosses_as_its_name!(SchedulingPolicy);

/// One sequence's work in a step (see the stub for field meanings).
#[pyclass(module = "pagedkv_core._core", frozen, get_all)]
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
    row: u32,
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
            slot_mapping: out.slot_mapping(seq, 0).to_vec(),
            sample: seq.sample,
            row: seq.row,
        })
    }
}

/// The plan of one step, as columns: built once in Rust and handed to numpy with one copy each,
/// on first read. `scheduled` is the per-sequence view, built on first read too (read it before
/// reporting the step: it takes each sequence's whole table from the scheduler then).
#[pyclass(module = "pagedkv_core._core", frozen)]
pub struct SchedulerOutput {
    inner: RustSchedulerOutput,
    /// The scheduler that planned the step (None in a copy made from bytes, on another rank).
    scheduler: Option<Py<Scheduler>>,
    scheduled: PyOnceLock<Py<PyList>>,
    #[pyo3(get)]
    preempted: Vec<String>,
    #[pyo3(get)]
    aborted: Vec<String>,
    /// Why each of `aborted` was dropped (the limit it cannot fit).
    #[pyo3(get)]
    abort_reasons: Vec<String>,
}

#[pymethods]
impl SchedulerOutput {
    #[getter]
    fn scheduled(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        let list = self.scheduled.get_or_try_init(py, || {
            let scheduler = self.scheduler.as_ref().ok_or_else(|| {
                exceptions::InvalidStateError::new_err(
                    "a step rebuilt from bytes has no per-sequence view (its scheduler is elsewhere); read its columns",
                )
            })?;
            let scheduler = scheduler.bind(py).borrow();
            let items = self
                .inner
                .scheduled
                .iter()
                .map(|seq| Py::new(py, ScheduledSequence::from_rust(&self.inner, seq, &scheduler.inner)?))
                .collect::<PyResult<Vec<_>>>()?;
            Ok::<_, PyErr>(PyList::new(py, items)?.unbind())
        })?;
        Ok(list.clone_ref(py))
    }

    #[getter]
    fn num_scheduled(&self) -> usize {
        self.inner.scheduled.len()
    }

    /// KV-cache groups: `slot_mapping` holds each group's slots in turn, the block tables one
    /// table per group.
    #[getter]
    fn num_kv_groups(&self) -> usize {
        self.inner.num_kv_groups
    }

    #[getter]
    fn seq_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.column(py, |seq| seq.seq_id as i64)
    }

    /// Each sequence's persistent-batch row (see the stub).
    #[getter]
    fn rows<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.column(py, |seq| seq.row as i64)
    }

    #[getter]
    fn starts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.column(py, |seq| seq.start as i64)
    }

    #[getter]
    fn ends<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.column(py, |seq| seq.end as i64)
    }

    #[getter]
    fn samples<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let column: Vec<bool> = self.inner.scheduled.iter().map(|seq| seq.sample).collect();
        numpy_array(py, &column, "bool")
    }

    #[getter]
    fn is_prefill<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let column: Vec<bool> = self.inner.scheduled.iter().map(|seq| seq.is_prefill).collect();
        numpy_array(py, &column, "bool")
    }

    #[getter]
    fn block_table_from<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.column(py, |seq| seq.block_table_from as i64)
    }

    /// [n + 1] offsets of each sequence's tokens in `token_ids` / `slot_mapping`.
    #[getter]
    fn query_start_loc<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let offsets: Vec<i64> =
            std::iter::once(0).chain(self.inner.scheduled.iter().map(|seq| seq.token_range.end as i64)).collect();
        numpy_array(py, &offsets, "int64")
    }

    /// [n + 1] offsets of each sequence's block-table update in `block_table_updates`.
    #[getter]
    fn block_table_update_loc<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let offsets: Vec<i64> =
            std::iter::once(0).chain(self.inner.scheduled.iter().map(|seq| seq.block_range.end as i64)).collect();
        numpy_array(py, &offsets, "int64")
    }

    /// Each scheduled token's position (flat, as `token_ids`).
    #[getter]
    fn positions<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let positions: Vec<i64> =
            self.inner.scheduled.iter().flat_map(|seq| (seq.start..seq.end).map(|position| position as i64)).collect();
        numpy_array(py, &positions, "int64")
    }

    /// Index in `token_ids` of each sampling sequence's last token (the rows the logits are of).
    #[getter]
    fn sample_index<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let index: Vec<i64> =
            self.inner.scheduled.iter().filter(|seq| seq.sample).map(|seq| seq.token_range.end as i64 - 1).collect();
        numpy_array(py, &index, "int64")
    }

    /// Place in `scheduled` of each sampling sequence.
    #[getter]
    fn sample_rows<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let rows: Vec<i64> =
            self.inner.scheduled.iter().enumerate().filter(|(_, seq)| seq.sample).map(|(i, _)| i as i64).collect();
        numpy_array(py, &rows, "int64")
    }

    /// Sequences that compute one token, counted from the end (decodes trail the prefills).
    #[getter]
    fn num_decodes(&self) -> usize {
        self.inner.scheduled.iter().rev().take_while(|seq| seq.token_range.len() == 1).count()
    }

    /// The most tokens one sequence computes (0 when none is scheduled).
    #[getter]
    fn max_query_len(&self) -> usize {
        self.inner.scheduled.iter().map(|seq| seq.token_range.len()).max().unwrap_or(0)
    }

    /// The longest context after the step (0 when none is scheduled).
    #[getter]
    fn max_context_len(&self) -> usize {
        self.inner.scheduled.iter().map(|seq| seq.end).max().unwrap_or(0)
    }

    #[getter]
    fn token_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let tokens: Vec<i64> = self.inner.token_ids.iter().map(|&token| token as i64).collect();
        numpy_array(py, &tokens, "int64")
    }

    #[getter]
    fn slot_mapping<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        numpy_array(py, &self.inner.slot_mapping, "int64")
    }

    #[getter]
    fn block_table_updates<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        numpy_array(py, &self.inner.block_table_updates, "int32")
    }

    #[getter]
    fn blocks_to_swap_in(&self) -> Vec<(u32, u32)> {
        self.inner.blocks_to_swap_in.clone()
    }

    #[getter]
    fn blocks_to_swap_out(&self) -> Vec<(u32, u32)> {
        self.inner.blocks_to_swap_out.clone()
    }

    #[getter]
    fn blocks_to_copy(&self) -> Vec<(u32, u32)> {
        self.inner.blocks_to_copy.clone()
    }

    #[getter]
    fn num_batched_tokens(&self) -> usize {
        self.inner.num_batched_tokens
    }

    #[getter]
    fn num_prefix_hit_tokens(&self) -> usize {
        self.inner.num_prefix_hit_tokens
    }

    fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }

    /// The step as bytes (see the stub); `from_bytes` rebuilds it, pickle uses both.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.to_bytes())
    }

    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Self> {
        Ok(SchedulerOutput::from_rust(call(|| RustSchedulerOutput::from_bytes(data))?, None))
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        Ok((slf.get_type().getattr("from_bytes")?, (slf.get().to_bytes(slf.py()),)))
    }

    /// Writes each sequence's block-table update into a persistent batch's tables (see the stub).
    fn write_block_tables(&self, tables: &Bound<'_, PyAny>) -> PyResult<()> {
        let (data, rows, width) = int32_matrix(tables, true)?;
        // SAFETY: a live, writable, C-contiguous int32 array of rows x width (checked above).
        let tables = unsafe { std::slice::from_raw_parts_mut(data as *mut i32, rows * width) };
        call(|| self.inner.write_block_tables(tables, width))
    }

    /// The scheduled sequences' tables from a persistent batch's tables into `out` (see the stub).
    fn gather_block_tables(&self, tables: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let (data, rows, width) = int32_matrix(tables, false)?;
        let (out_data, out_rows, num_blocks) = int32_matrix(out, true)?;
        if out_data == data && rows * width > 0 {
            return Err(exceptions::InvalidStateError::new_err("out must not be the tables themselves"));
        }
        // SAFETY: live, C-contiguous int32 arrays of these shapes (checked above), not the same memory.
        let (tables, out) = unsafe {
            (
                std::slice::from_raw_parts(data as *const i32, rows * width),
                std::slice::from_raw_parts_mut(out_data as *mut i32, out_rows * num_blocks),
            )
        };
        call(|| self.inner.gather_block_tables(tables, width, out, num_blocks))
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedulerOutput(scheduled={}, tokens={}, swap_in={}, swap_out={}, copy={}, preempted={:?}, aborted={:?})",
            self.inner.scheduled.len(),
            self.inner.num_batched_tokens,
            self.inner.blocks_to_swap_in.len(),
            self.inner.blocks_to_swap_out.len(),
            self.inner.blocks_to_copy.len(),
            self.preempted,
            self.aborted
        )
    }
}

impl SchedulerOutput {
    fn from_rust(out: RustSchedulerOutput, scheduler: Option<Py<Scheduler>>) -> Self {
        SchedulerOutput {
            preempted: out.preempted.iter().map(|id| id.to_string()).collect(),
            aborted: out.aborted.iter().map(|id| id.to_string()).collect(),
            abort_reasons: out.abort_reasons.clone(),
            inner: out,
            scheduler,
            scheduled: PyOnceLock::new(),
        }
    }

    fn column<'py>(
        &self,
        py: Python<'py>,
        value: impl Fn(&RustScheduledSequence) -> i64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let column: Vec<i64> = self.inner.scheduled.iter().map(value).collect();
        numpy_array(py, &column, "int64")
    }
}

/// (data pointer, rows, columns) of a C-contiguous 2-D int32 numpy array, writable if `write`;
/// an InvalidStateError names what else it is.
fn int32_matrix(array: &Bound<'_, PyAny>, write: bool) -> PyResult<(usize, usize, usize)> {
    let refuse = |what: &str| {
        exceptions::InvalidStateError::new_err(format!(
            "block tables must be a C-contiguous 2-D{} int32 numpy array, got {what}",
            if write { " writable" } else { "" }
        ))
    };
    let interface = array.getattr("__array_interface__").map_err(|_| refuse("no numpy array"))?;
    let typestr: String = interface.get_item("typestr")?.extract()?;
    let shape: Vec<usize> = interface.get_item("shape")?.extract()?;
    let (data, read_only): (usize, bool) = interface.get_item("data")?.extract()?;
    let contiguous = interface.get_item("strides").map(|strides| strides.is_none()).unwrap_or(true);
    match shape[..] {
        [rows, columns] if typestr == "<i4" && contiguous && !(write && read_only) => Ok((data, rows, columns)),
        _ => Err(refuse(&format!(
            "typestr {typestr:?}, shape {shape:?}, contiguous {contiguous}, read-only {read_only}"
        ))),
    }
}

/// Integers from a numpy int64 array (its bytes, read at once) or any sequence of ints.
fn int_column(values: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    // (dtype's kind and itemsize, not its name: str(dtype) costs more than the rest together)
    let is_int64_array = values.getattr("dtype").is_ok_and(|dtype| {
        let kind = dtype.getattr("kind").and_then(|kind| kind.extract::<String>());
        let itemsize = dtype.getattr("itemsize").and_then(|size| size.extract::<usize>());
        kind.is_ok_and(|kind| kind == "i") && itemsize.is_ok_and(|size| size == 8)
    });
    if !is_int64_array {
        return values.extract();
    }
    let bytes = values.call_method0("tobytes")?;
    let bytes = bytes.cast::<PyBytes>()?.as_bytes();
    Ok(bytes.chunks_exact(8).map(|chunk| i64::from_ne_bytes(chunk.try_into().unwrap())).collect())
}

/// A numpy array of `dtype` holding a copy of `data` (a bytearray, so it is writable).
fn numpy_array<'py, T: Copy>(py: Python<'py>, data: &[T], dtype: &str) -> PyResult<Bound<'py, PyAny>> {
    static FROMBUFFER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let frombuffer =
        FROMBUFFER.get_or_try_init(py, || Ok::<_, PyErr>(py.import("numpy")?.getattr("frombuffer")?.unbind()))?;
    // SAFETY: plain integers and bools, read as the bytes they are.
    let bytes = unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data)) };
    frombuffer.bind(py).call1((PyByteArray::new(py, bytes), dtype))
}

/// The scheduler: continuous batching over a paged KV cache.
#[pyclass(module = "pagedkv_core._core")]
pub struct Scheduler {
    inner: RustScheduler,
}

#[pymethods]
impl Scheduler {
    #[new]
    #[pyo3(signature = (config=None))]
    fn new(config: Option<SchedulerConfig>) -> PyResult<Self> {
        let config = config.unwrap_or_default();
        config.validate().map_err(to_py_err)?;
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

    fn schedule(mut slf: PyRefMut<'_, Self>) -> PyResult<SchedulerOutput> {
        let out = call(|| Ok(slf.inner.schedule()))?;
        let scheduler: Py<Scheduler> = slf.into();
        Ok(SchedulerOutput::from_rust(out, Some(scheduler)))
    }

    /// Closes a step in one call (`Scheduler::close_step`): fills placeholders, keeps accepted
    /// drafts, forks (`forks`: (parent, child's first token, whether the child ends with it)),
    /// appends `token_ids[i]` to `seq_ids[i]` (then `draft_token_ids[seq_id]` after it), then ends
    /// `finished`. Checks everything first: an error changes nothing. Returns the children's ids.
    #[pyo3(signature = (seq_ids, token_ids, finished=None, *, draft_token_ids=None, accepted_drafts=None,
                        forks=None, fill_seq_ids=None, fill_token_ids=None))]
    #[allow(clippy::too_many_arguments)]
    fn update(
        &mut self,
        seq_ids: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        finished: Option<&Bound<'_, PyAny>>,
        draft_token_ids: Option<std::collections::HashMap<u64, Vec<u32>>>,
        accepted_drafts: Option<std::collections::HashMap<u64, usize>>,
        forks: Option<Vec<(u64, u32, bool)>>,
        fill_seq_ids: Option<&Bound<'_, PyAny>>,
        fill_token_ids: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<u64>> {
        let appends = pairs(seq_ids, token_ids)?;
        let finished = match finished {
            Some(finished) => seq_id_column(finished)?,
            None => Vec::new(),
        };
        let fills = match (fill_seq_ids, fill_token_ids) {
            (Some(seq_ids), Some(token_ids)) => pairs(seq_ids, token_ids)?,
            (None, None) => Vec::new(),
            _ => return Err(exceptions::InvalidStateError::new_err("fill_seq_ids and fill_token_ids go together")),
        };
        let forks: Vec<Fork> = forks
            .unwrap_or_default()
            .into_iter()
            .map(|(parent, token, finished)| Fork { parent, token, finished })
            .collect();
        let drafts: Vec<(u64, Vec<u32>)> = draft_token_ids.unwrap_or_default().into_iter().collect();
        let accepted: Vec<(u64, usize)> = accepted_drafts.unwrap_or_default().into_iter().collect();
        let update = StepUpdate {
            fills: &fills,
            accepted: &accepted,
            forks: &forks,
            appends: &appends,
            drafts: &drafts,
            finished: &finished,
        };
        call(|| self.inner.close_step(&update))
    }

    /// Asynchronous scheduling: a placeholder for each sequence's token still being sampled.
    fn append_placeholders(&mut self, seq_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let seq_ids = seq_id_column(seq_ids)?;
        call(|| self.inner.append_placeholders(&seq_ids))
    }

    /// The sampled tokens the placeholders stood for. Checks everything first.
    fn fill_placeholders(&mut self, seq_ids: &Bound<'_, PyAny>, token_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let seq_ids = seq_id_column(seq_ids)?;
        let token_ids = int_column(token_ids)?
            .into_iter()
            .map(|token| {
                u32::try_from(token)
                    .map_err(|_| exceptions::InvalidStateError::new_err(format!("invalid token id {token}")))
            })
            .collect::<PyResult<Vec<_>>>()?;
        call(|| self.inner.fill_placeholders(&seq_ids, &token_ids))
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

    #[pyo3(signature = (seq_id, group=0))]
    fn block_table(&self, seq_id: u64, group: usize) -> PyResult<Vec<u32>> {
        call(|| Ok(super::block_manager::group_table(self.inner.block_manager(), seq_id, group)?.blocks.clone()))
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

    fn take_kv_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        kv_events::to_python(py, self.inner.take_kv_events())
    }

    #[pyo3(signature = (on_device=true, group=0))]
    fn cached_block_hashes(&self, on_device: bool, group: usize) -> Vec<u64> {
        self.inner.block_manager().cached_block_hashes(if on_device { Device::Gpu } else { Device::Cpu }, group)
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

/// (sequence, token id) pairs from two columns of equal length.
fn pairs(seq_ids: &Bound<'_, PyAny>, token_ids: &Bound<'_, PyAny>) -> PyResult<Vec<(u64, u32)>> {
    let (seq_ids, token_ids) = (int_column(seq_ids)?, int_column(token_ids)?);
    if seq_ids.len() != token_ids.len() {
        return Err(exceptions::InvalidStateError::new_err(format!(
            "{} seq_ids but {} token_ids",
            seq_ids.len(),
            token_ids.len()
        )));
    }
    let invalid = |what: &str, value: i64| exceptions::InvalidStateError::new_err(format!("invalid {what} {value}"));
    seq_ids
        .iter()
        .zip(&token_ids)
        .map(|(&seq, &token)| {
            Ok((
                u64::try_from(seq).map_err(|_| invalid("seq_id", seq))?,
                u32::try_from(token).map_err(|_| invalid("token id", token))?,
            ))
        })
        .collect()
}

fn seq_id_column(seq_ids: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    int_column(seq_ids)?
        .into_iter()
        .map(|seq| {
            u64::try_from(seq).map_err(|_| exceptions::InvalidStateError::new_err(format!("invalid seq_id {seq}")))
        })
        .collect()
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("PLACEHOLDER_TOKEN", crate::sched::scheduler::PLACEHOLDER_TOKEN)?;
    m.add_class::<SchedulerConfig>()?;
    m.add_class::<ScheduledSequence>()?;
    m.add_class::<SchedulerOutput>()?;
    m.add_class::<Scheduler>()
}
