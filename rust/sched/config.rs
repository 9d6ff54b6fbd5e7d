//! Scheduler settings and their validation.

use std::str::FromStr;

use crate::errors::{Error, Result};
use crate::sched::preemption::{CostModel, PreemptionMode};

/// The order in which queued and running groups are served (vLLM's `--scheduling-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SchedulingPolicy {
    /// First come, first served: by arrival; every request has priority 0.
    #[default]
    Fcfs,
    /// By (priority, arrival), smaller first. A queued group that cannot start preempts running
    /// groups of lower priority (larger value), newest first.
    Priority,
}

impl SchedulingPolicy {
    /// The name `FromStr` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            SchedulingPolicy::Fcfs => "fcfs",
            SchedulingPolicy::Priority => "priority",
        }
    }
}

impl FromStr for SchedulingPolicy {
    type Err = Error;
    fn from_str(value: &str) -> Result<Self> {
        match value {
            "fcfs" => Ok(SchedulingPolicy::Fcfs),
            "priority" => Ok(SchedulingPolicy::Priority),
            other => Err(Error::InvalidConfig {
                field: "scheduling_policy",
                message: format!("must be 'fcfs' or 'priority', got {other:?}"),
            }),
        }
    }
}

/// Everything the scheduler needs to know about the pools and its limits. Declared here once:
/// Python's `pagedkv_core._core.SchedulerConfig` is this struct (its fields as attributes, these
/// defaults, keyword arguments for any of them).
#[cfg_attr(feature = "python", pyo3::pyclass(module = "pagedkv_core._core", get_all, set_all, from_py_object))]
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub block_size: usize,
    pub num_device_blocks: usize,
    pub num_cpu_blocks: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Token budget of one step (prefill chunk tokens + one per decoding sequence).
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt + output). Capped at what the device pool can hold.
    pub max_model_len: usize,
    /// Bound of the waiting queue; beyond it `add_request` fails with `Overloaded`.
    pub max_waiting_requests: usize,
    pub enable_prefix_caching: bool,
    /// Cached blocks evicted from the device move to free CPU swap blocks and are copied back on
    /// a prefix hit instead of recomputed (`kv/offload_tier.rs`). Needs prefix caching.
    pub enable_cpu_prefix_cache: bool,
    pub enable_chunked_prefill: bool,
    /// Most tokens one sequence's prefill takes in a step (0: no limit, only the budget), so one
    /// long prompt leaves room in the step for others (vLLM's long_prefill_token_threshold).
    pub long_prefill_token_threshold: usize,
    /// The model's attention window when every layer has one (Mistral's `sliding_window`): each
    /// token attends to the last `sliding_window` positions, its own included. Blocks before a
    /// sequence's window are released as it advances; 0 = no window. (One KV-cache group; models
    /// that mix layer kinds set `kv_group_windows` instead.)
    pub sliding_window: usize,
    /// The model's KV-cache groups (`BlockManager::set_kv_groups`), by each group's attention
    /// window (0: full attention): each sequence holds one table per group over the shared pool,
    /// and a windowed group keeps only its window's blocks. Empty: one group of `sliding_window`.
    pub kv_group_windows: Vec<usize>,
    /// Root of the prefix cache's block names (see prefix_cache.rs): a secret random value keeps
    /// them from being computed, and collisions crafted, outside the engine.
    pub prefix_caching_hash_seed: u64,
    /// Record KV-cache events (`Scheduler::take_kv_events`): blocks stored, removed, all cleared,
    /// per tier, for a KV-aware router to mirror the prefix cache by.
    pub enable_kv_events: bool,
    pub preemption_mode: PreemptionMode,
    pub scheduling_policy: SchedulingPolicy,
    /// Fraction of device blocks admissions leave free.
    pub watermark: f64,
    /// Cost model (`preemption.rs`): seconds of compute per recomputed token.
    pub recompute_cost_per_token: f64,
    /// Cost model: bytes of one KV block (all layers).
    pub block_bytes: f64,
    /// Cost model: bytes per second of a device<->CPU copy.
    pub swap_bandwidth: f64,
    /// Cost model: fixed seconds per swap transfer.
    pub swap_latency: f64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        let cost = CostModel::default();
        SchedulerConfig {
            block_size: 16,
            num_device_blocks: 1024,
            num_cpu_blocks: 1024,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: 2048,
            max_waiting_requests: 1024,
            enable_prefix_caching: true,
            enable_cpu_prefix_cache: false,
            enable_chunked_prefill: true,
            long_prefill_token_threshold: 0,
            sliding_window: 0,
            kv_group_windows: Vec::new(),
            prefix_caching_hash_seed: 0,
            enable_kv_events: false,
            preemption_mode: PreemptionMode::Auto,
            scheduling_policy: SchedulingPolicy::Fcfs,
            watermark: 0.01,
            recompute_cost_per_token: cost.recompute_cost_per_token,
            block_bytes: cost.block_bytes,
            swap_bandwidth: cost.swap_bandwidth,
            swap_latency: cost.swap_latency,
        }
    }
}

impl SchedulerConfig {
    /// The swap-vs-recompute cost model of these settings.
    pub fn cost_model(&self) -> CostModel {
        CostModel {
            recompute_cost_per_token: self.recompute_cost_per_token,
            block_bytes: self.block_bytes,
            swap_bandwidth: self.swap_bandwidth,
            swap_latency: self.swap_latency,
        }
    }

    /// Each KV-cache group's window: `kv_group_windows`, or one group of `sliding_window`.
    pub fn group_windows(&self) -> Vec<usize> {
        if self.kv_group_windows.is_empty() {
            vec![self.sliding_window]
        } else {
            self.kv_group_windows.clone()
        }
    }

    pub fn validate(&self) -> Result<()> {
        if !self.kv_group_windows.is_empty() && self.sliding_window > 0 {
            return Err(Error::InvalidConfig {
                field: "sliding_window",
                message: "set either sliding_window (one group) or kv_group_windows, not both".into(),
            });
        }
        let positive = [
            ("block_size", self.block_size),
            ("num_device_blocks", self.num_device_blocks),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(Error::InvalidConfig { field, message: "must be > 0".into() });
            }
        }
        if !self.block_size.is_power_of_two() {
            // Token position -> (block, offset) is a shift and a mask on the per-token path.
            return Err(Error::InvalidConfig {
                field: "block_size",
                message: format!("must be a power of two (8, 16, 32, ...), got {}", self.block_size),
            });
        }
        if !self.enable_chunked_prefill && self.max_num_batched_tokens < self.max_model_len {
            return Err(Error::InvalidConfig {
                field: "max_num_batched_tokens",
                message: format!(
                    "must be >= max_model_len={} when chunked prefill is off, got {}",
                    self.max_model_len, self.max_num_batched_tokens
                ),
            });
        }
        if !(0.0..1.0).contains(&self.watermark) {
            return Err(Error::InvalidConfig {
                field: "watermark",
                message: format!("must be in [0, 1), got {}", self.watermark),
            });
        }
        let cost = self.cost_model();
        if !(cost.recompute_cost_per_token >= 0.0
            && cost.swap_bandwidth > 0.0
            && cost.block_bytes >= 0.0
            && cost.swap_latency >= 0.0)
        {
            return Err(Error::InvalidConfig {
                field: "cost_model",
                message: format!("costs must be >= 0 and swap_bandwidth > 0, got {cost:?}"),
            });
        }
        Ok(())
    }

    /// The longest sequence that can be served: `max_model_len`, or less when the device pool
    /// cannot hold that many tokens in every KV-cache group. With chunked prefill a windowed
    /// group's table only ever holds its window and one step's chunk, so when every group is
    /// windowed, a pool that holds those serves any length; a full group's table grows with the
    /// length.
    pub fn effective_max_model_len(&self) -> usize {
        let windows = self.group_windows();
        let (mut windowed_blocks, mut full_groups) = (0, 0);
        for &window in &windows {
            if window > 0 && self.enable_chunked_prefill {
                windowed_blocks += self.max_windowed_blocks(window);
            } else {
                full_groups += 1;
            }
        }
        if windowed_blocks > self.num_device_blocks {
            // (the windowed tables alone do not fit: bound by the length every table can reach)
            return self.max_model_len.min(self.num_device_blocks / windows.len() * self.block_size);
        }
        if full_groups == 0 {
            return self.max_model_len;
        }
        self.max_model_len.min((self.num_device_blocks - windowed_blocks) / full_groups * self.block_size)
    }

    /// Most blocks a sequence's table holds under a window of `window` positions: the window's
    /// positions before the next computed one, plus one step's chunk, at any alignment to the blocks.
    fn max_windowed_blocks(&self, window: usize) -> usize {
        let mut chunk = self.max_num_batched_tokens;
        if self.long_prefill_token_threshold > 0 {
            chunk = chunk.min(self.long_prefill_token_threshold);
        }
        (window - 1 + chunk).div_ceil(self.block_size) + 1
    }
}
