//! Continuous batching over the KV-cache manager: sequences and their groups (`sequence`), the
//! queues and the step plan (`scheduler`; as bytes for other ranks: `output_bytes`), swap vs recompute (`preemption`), and the settings,
//! declared once (`config`).

pub mod config;
mod output_bytes;
pub mod preemption;
pub mod scheduler;
pub mod sequence;

#[cfg(test)]
mod liveness_tests;
#[cfg(test)]
pub(crate) mod scheduler_tests;
