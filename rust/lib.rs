//! pagedkv core: the KV-cache memory manager and scheduler of a PagedAttention serving engine.
//!
//! Four parts, one folder each; plain Rust types, tested by `cargo test`:
//! - [`kv`]: the memory manager. Block pools (device and CPU swap), block tables, refcounts and
//!   copy-on-write, KV-cache groups (one table per group for models mixing sliding-window and
//!   full layers), the prefix cache and its CPU offload tier, all owned by [`BlockManager`].
//! - [`sched`]: continuous batching over it. Sequence groups, the step plan, preemption by swap
//!   or recompute, and [`SchedulerConfig`].
//! - [`cpu_kernels`]: the CPU engine's paged attention and fused layers.
//! - `python` (cargo feature `python`, built by maturin): the thin PyO3 layer, one file per part
//!   it binds.
//!
//! A step: plan it, run the model over the planned tokens, report what was sampled.
//!
//! ```
//! use pagedkv::{Scheduler, SchedulerConfig};
//!
//! let config = SchedulerConfig { block_size: 4, num_device_blocks: 8, ..SchedulerConfig::default() };
//! let mut scheduler = Scheduler::new(config).unwrap();
//! let seq = scheduler.add_request("req-0", vec![1, 2, 3, 4, 5], None).unwrap();
//! let out = scheduler.schedule();
//! let step = &out.scheduled[0];
//! // The model computes K/V for tokens 0..5, written to these slots of the paged cache, and
//! // samples the next token after the last one.
//! assert_eq!((step.start, step.end, step.sample), (0, 5, true));
//! assert_eq!(out.slot_mapping(step, 0).len(), 5); // (slots in KV-cache group 0, the only one)
//! scheduler.append_token(seq, 42).unwrap();
//! scheduler.finish_sequence(seq).unwrap(); // its blocks are free again
//! assert_eq!(scheduler.stats().num_free_device_blocks, 8);
//! ```

pub mod cpu_kernels;
pub mod device;
pub mod errors;
pub mod kv;
pub mod sched;

#[cfg(feature = "python")]
mod python;

pub use device::Device;
pub use errors::{Error, Result};
pub use kv::block_manager::{BlockCopy, BlockManager, SeqId};
pub use kv::block_pool::BlockId;
pub use sched::config::SchedulerConfig;
pub use sched::preemption::{CostModel, Preemption, PreemptionMode};
pub use sched::scheduler::{ScheduledSequence, Scheduler, SchedulerOutput, SchedulerStats};
