//! Continuous batching over the KV-cache manager: sequences and their groups (`sequence`), the
//! queues and the step plan (`scheduler`), swap vs recompute (`preemption`), and the settings,
//! declared once (`config`).

pub mod config;
pub mod preemption;
pub mod scheduler;
pub mod sequence;

#[cfg(test)]
mod liveness_tests;
#[cfg(test)]
pub(crate) mod scheduler_tests;
