//! The two memory tiers a block pool can live in.

use std::fmt;

/// Which memory tier a pool lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Gpu,
    Cpu,
}

impl Device {
    /// The tier's name in KV events, as vLLM writes it.
    pub fn medium(self) -> &'static str {
        match self {
            Device::Gpu => "GPU",
            Device::Cpu => "CPU",
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Device::Gpu => "device",
            Device::Cpu => "CPU swap",
        })
    }
}
