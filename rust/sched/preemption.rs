//! How a preempted group gives its blocks back: swap to CPU or drop and recompute, chosen by an
//! explicit cost model.

use std::str::FromStr;

use crate::errors::Error;

/// The policy users pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptionMode {
    /// Always swap when the CPU pool has room, else recompute.
    Swap,
    /// Always free the blocks and recompute the KV on resume.
    Recompute,
    /// Pick the cheaper of the two per victim (falls back to recompute without CPU room).
    Auto,
}

impl PreemptionMode {
    /// The name `FromStr` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            PreemptionMode::Swap => "swap",
            PreemptionMode::Recompute => "recompute",
            PreemptionMode::Auto => "auto",
        }
    }
}

impl FromStr for PreemptionMode {
    type Err = Error;
    fn from_str(value: &str) -> Result<Self, Error> {
        match value {
            "swap" => Ok(PreemptionMode::Swap),
            "recompute" => Ok(PreemptionMode::Recompute),
            "auto" => Ok(PreemptionMode::Auto),
            other => Err(Error::InvalidConfig {
                field: "preemption_mode",
                message: format!("must be 'swap', 'recompute' or 'auto', got {other:?}"),
            }),
        }
    }
}

/// What happened to one victim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preemption {
    Swap,
    Recompute,
}

/// Estimated seconds each way costs.
///
/// recompute = tokens x `recompute_cost_per_token`
/// swap      = 2 x (`swap_latency` + blocks x `block_bytes` / `swap_bandwidth`)   (out now, in later)
///
/// The constant latency makes recompute win for short sequences and swap win for long ones
/// whenever per-token compute costs more than moving a token's KV, which is the usual case for
/// models of a billion parameters and up. The engine fills these in from the model and device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    pub recompute_cost_per_token: f64,
    pub block_bytes: f64,
    pub swap_bandwidth: f64,
    pub swap_latency: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        // A 7B-class model on one GPU: ~50 us/token of prefill compute, 2 MiB per 16-token block
        // over ~20 GB/s of PCIe, ~100 us fixed per transfer batch.
        CostModel {
            recompute_cost_per_token: 50e-6,
            block_bytes: (2 << 20) as f64,
            swap_bandwidth: 20e9,
            swap_latency: 100e-6,
        }
    }
}

impl CostModel {
    pub fn recompute_cost(&self, num_tokens: usize) -> f64 {
        num_tokens as f64 * self.recompute_cost_per_token
    }

    pub fn swap_cost(&self, num_blocks: usize) -> f64 {
        2.0 * (self.swap_latency + num_blocks as f64 * self.block_bytes / self.swap_bandwidth)
    }

    /// The way to preempt a group whose sequences hold `num_tokens` tokens in `num_blocks`
    /// unique blocks; `cpu_has_room` says whether the swap pool can take them.
    pub fn choose(&self, mode: PreemptionMode, num_tokens: usize, num_blocks: usize, cpu_has_room: bool) -> Preemption {
        match mode {
            _ if !cpu_has_room => Preemption::Recompute,
            PreemptionMode::Recompute => Preemption::Recompute,
            PreemptionMode::Swap => Preemption::Swap,
            PreemptionMode::Auto => {
                if self.recompute_cost(num_tokens) <= self.swap_cost(num_blocks) {
                    Preemption::Recompute
                } else {
                    Preemption::Swap
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_recomputes_short_and_swaps_long_sequences() {
        let model = CostModel::default();
        assert_eq!(model.choose(PreemptionMode::Auto, 2, 1, true), Preemption::Recompute);
        assert_eq!(model.choose(PreemptionMode::Auto, 2000, 125, true), Preemption::Swap);
        assert_eq!(model.choose(PreemptionMode::Auto, 2000, 125, false), Preemption::Recompute);
    }

    #[test]
    fn fixed_modes() {
        let model = CostModel::default();
        assert_eq!(model.choose(PreemptionMode::Swap, 2, 1, true), Preemption::Swap);
        assert_eq!(model.choose(PreemptionMode::Swap, 2, 1, false), Preemption::Recompute);
        assert_eq!(model.choose(PreemptionMode::Recompute, 5000, 300, true), Preemption::Recompute);
        assert!("bogus".parse::<PreemptionMode>().is_err());
    }
}
