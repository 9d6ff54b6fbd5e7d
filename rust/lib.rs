//! pagedkv core: the KV-cache memory manager and scheduler of a PagedAttention serving engine.
//!
//! Plain Rust types, tested by `cargo test`; `python.rs` (feature `python`) is the thin PyO3 layer.

pub mod block_manager;
pub mod block_pool;
pub mod block_table;
pub mod config;
pub mod cpu_attention;
pub mod cpu_layer_ops;
pub mod cpu_prefill_attention;
pub mod cpu_prefix_tier;
pub mod cpu_simd;
pub mod errors;
pub mod fp8;
pub mod openmp_team;
pub mod prefix_cache;
pub mod preemption;
pub mod scheduler;
pub mod sequence;

#[cfg(test)]
mod scheduler_liveness_tests;
#[cfg(test)]
mod scheduler_tests;

#[cfg(feature = "python")]
mod python;

pub use block_manager::{BlockCopy, BlockManager, SeqId};
pub use block_pool::{BlockId, Device};
pub use config::SchedulerConfig;
pub use errors::{Error, Result};
pub use preemption::{CostModel, Preemption, PreemptionMode};
pub use scheduler::{ScheduledSequence, Scheduler, SchedulerOutput, SchedulerStats};
