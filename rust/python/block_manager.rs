//! `BlockManager`: the allocator alone.

use pyo3::prelude::*;
use pyo3::types::PyList;

use super::errors::{call, exceptions};
use super::kv_events;
use crate::device::Device;
use crate::kv::block_manager::BlockManager as RustBlockManager;

/// The block manager alone: two pools, block tables, fork/CoW, prefix cache, swap.
#[pyclass(module = "pagedkv_core._core")]
pub struct BlockManager {
    inner: RustBlockManager,
}

#[pymethods]
impl BlockManager {
    #[new]
    #[allow(clippy::too_many_arguments)] // (Python's keyword arguments)
    #[pyo3(signature = (
        num_device_blocks, num_cpu_blocks, block_size=16, enable_prefix_caching=false, watermark=0.0, sliding_window=0,
        hash_seed=0, enable_kv_events=false, kv_group_windows=None,
    ))]
    fn new(
        num_device_blocks: usize,
        num_cpu_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
        watermark: f64,
        sliding_window: usize,
        hash_seed: u64,
        enable_kv_events: bool,
        kv_group_windows: Option<Vec<usize>>,
    ) -> PyResult<Self> {
        let mut inner = call(|| {
            RustBlockManager::new(num_device_blocks, num_cpu_blocks, block_size, enable_prefix_caching, watermark)
        })?;
        match kv_group_windows {
            Some(windows) if sliding_window > 0 => {
                return Err(exceptions::InvalidConfigError::new_err(format!(
                    "sliding_window: set either sliding_window (one group) or kv_group_windows={windows:?}, not both"
                )))
            }
            Some(windows) => call(|| inner.set_kv_groups(&windows))?,
            None => inner.set_sliding_window(sliding_window),
        }
        call(|| inner.set_hash_seed(hash_seed))?;
        if enable_kv_events {
            call(|| inner.enable_kv_events())?;
        }
        Ok(BlockManager { inner })
    }

    #[pyo3(signature = (seq_id, token_ids, extra_key=None))]
    fn allocate(&mut self, seq_id: u64, token_ids: Vec<u32>, extra_key: Option<u64>) -> PyResult<usize> {
        call(|| self.inner.allocate(seq_id, &token_ids, extra_key))
    }

    fn append_token(&mut self, seq_id: u64, token_id: u32) -> PyResult<Vec<(u32, u32)>> {
        call(|| self.inner.append_token(seq_id, token_id).map(|copies| copies.into_vec()))
    }

    fn append_slots(&mut self, seq_id: u64, token_ids: Vec<u32>) -> PyResult<Vec<(u32, u32)>> {
        call(|| self.inner.append_slots(seq_id, &token_ids).map(|copies| copies.into_vec()))
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

    #[pyo3(signature = (seq_id, group=0))]
    fn block_table(&self, seq_id: u64, group: usize) -> PyResult<Vec<u32>> {
        call(|| Ok(group_table(&self.inner, seq_id, group)?.blocks.clone()))
    }

    fn num_tokens(&self, seq_id: u64) -> PyResult<usize> {
        call(|| Ok(self.inner.table(seq_id)?.num_tokens))
    }

    #[pyo3(signature = (seq_id, group=0))]
    fn num_released_blocks(&self, seq_id: u64, group: usize) -> PyResult<usize> {
        call(|| Ok(group_table(&self.inner, seq_id, group)?.num_released))
    }

    #[getter]
    fn kv_group_windows(&self) -> Vec<usize> {
        self.inner.kv_group_windows().to_vec()
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

    fn take_kv_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        kv_events::to_python(py, self.inner.take_kv_events())
    }

    #[pyo3(signature = (on_device=true, group=0))]
    fn cached_block_hashes(&self, on_device: bool, group: usize) -> Vec<u64> {
        self.inner.cached_block_hashes(if on_device { Device::Gpu } else { Device::Cpu }, group)
    }

    fn reset_prefix_cache(&mut self) -> bool {
        self.inner.reset_prefix_cache()
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

/// How many block tables hold `block` (device or CPU pool), range-checked.
pub(crate) fn refcount(blocks: &RustBlockManager, block: u32, on_device: bool) -> PyResult<u32> {
    let device = if on_device { Device::Gpu } else { Device::Cpu };
    let num_blocks = if on_device { blocks.num_device_blocks() } else { blocks.num_cpu_blocks() };
    if block as usize >= num_blocks {
        return Err(exceptions::InvalidStateError::new_err(format!(
            "block {block} out of range: the {device} pool has {num_blocks} blocks"
        )));
    }
    Ok(blocks.refcount(block, device))
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<BlockManager>()
}

/// One KV-cache group's table of a sequence (an error for a group the manager does not have).
pub(super) fn group_table(
    manager: &RustBlockManager,
    seq_id: u64,
    group: usize,
) -> crate::errors::Result<&crate::kv::block_table::BlockTable> {
    manager.seq_tables(seq_id)?.get(group).ok_or_else(|| crate::errors::Error::InvalidConfig {
        field: "group",
        message: format!("there are {} KV-cache groups, got group {group}", manager.num_kv_groups()),
    })
}
