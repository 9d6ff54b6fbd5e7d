//! KV-cache events as Python objects, named and laid out as vLLM's (`vllm.distributed.kv_events`).

use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::kv::events::KvEvent;

/// Full blocks became cached in `medium` ('GPU': the device pool, 'CPU': the CPU prefix tier):
/// `block_hashes[i]` holds `token_ids[i * block_size:(i + 1) * block_size]` and is the child of
/// `block_hashes[i - 1]`, the first of `parent_block_hash` (None: a prompt's first block).
/// `lora_id` is the prefix-cache extra key of the request (adapter and cache salt), None for
/// plain prompts. `group_idx` is the KV-cache group whose blocks these are (0 with one group).
#[pyclass(module = "pagedkv_core._core", frozen, get_all, eq)]
#[derive(PartialEq)]
pub struct BlockStored {
    block_hashes: Vec<u64>,
    parent_block_hash: Option<u64>,
    token_ids: Vec<u32>,
    block_size: usize,
    lora_id: Option<u64>,
    medium: &'static str,
    group_idx: usize,
}

#[pymethods]
impl BlockStored {
    fn __repr__(&self) -> String {
        format!(
            "BlockStored(block_hashes={:?}, parent_block_hash={:?}, {} tokens, block_size={}, lora_id={:?}, medium={:?}, \
             group_idx={})",
            self.block_hashes,
            self.parent_block_hash,
            self.token_ids.len(),
            self.block_size,
            self.lora_id,
            self.medium,
            self.group_idx
        )
    }
}

/// Cached blocks of KV-cache group `group_idx` left `medium` (evicted, or their content became stale).
#[pyclass(module = "pagedkv_core._core", frozen, get_all, eq)]
#[derive(PartialEq)]
pub struct BlockRemoved {
    block_hashes: Vec<u64>,
    medium: &'static str,
    group_idx: usize,
}

#[pymethods]
impl BlockRemoved {
    fn __repr__(&self) -> String {
        format!(
            "BlockRemoved(block_hashes={:?}, medium={:?}, group_idx={})",
            self.block_hashes, self.medium, self.group_idx
        )
    }
}

/// Every cached block of every tier was dropped (`reset_prefix_cache`).
#[pyclass(module = "pagedkv_core._core", frozen, eq)]
#[derive(PartialEq)]
pub struct AllBlocksCleared {}

#[pymethods]
impl AllBlocksCleared {
    fn __repr__(&self) -> &'static str {
        "AllBlocksCleared()"
    }
}

/// The events as a Python list, in order.
pub(crate) fn to_python<'py>(py: Python<'py>, events: Vec<KvEvent>) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for event in events {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                extra_key,
                medium,
                group,
            } => {
                let stored = BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id: extra_key,
                    medium: medium.medium(),
                    group_idx: group,
                };
                list.append(Bound::new(py, stored)?)?
            }
            KvEvent::BlockRemoved { block_hashes, medium, group } => {
                let removed = BlockRemoved { block_hashes, medium: medium.medium(), group_idx: group };
                list.append(Bound::new(py, removed)?)?
            }
            KvEvent::AllBlocksCleared => list.append(Bound::new(py, AllBlocksCleared {})?)?,
        }
    }
    Ok(list)
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<BlockStored>()?;
    m.add_class::<BlockRemoved>()?;
    m.add_class::<AllBlocksCleared>()
}
