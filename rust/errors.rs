//! The one error type of the crate. `pagedkv_core.errors` (Python) mirrors it class by class.

use std::fmt;

use crate::device::Device;

/// Everything that can go wrong in the block manager and the scheduler. Messages name the
/// limit or field that was violated and its value.
#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    PromptTooLong { prompt_len: usize, max_model_len: usize },
    PromptExceedsPool { blocks_needed: usize, num_device_blocks: usize, block_size: usize },
    Overloaded { num_waiting: usize, max_waiting_requests: usize },
    OutOfBlocks { device: Device, needed: usize, free: usize },
    UnknownRequest(String),
    UnknownSequence(u64),
    DuplicateRequest(String),
    DuplicateSequence(u64),
    InvalidConfig { field: &'static str, message: String },
    InvalidState(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::PromptTooLong { prompt_len, max_model_len } => write!(
                f,
                "prompt has {prompt_len} tokens, more than max_model_len={max_model_len}"
            ),
            Error::PromptExceedsPool { blocks_needed, num_device_blocks, block_size } => write!(
                f,
                "prompt needs {blocks_needed} KV blocks of {block_size} tokens, more than the whole \
                 device pool (num_device_blocks={num_device_blocks})"
            ),
            Error::Overloaded { num_waiting, max_waiting_requests } => write!(
                f,
                "server overloaded: {num_waiting} requests waiting, at max_waiting_requests={max_waiting_requests}; retry later"
            ),
            Error::OutOfBlocks { device, needed, free } => {
                write!(f, "out of {device} KV blocks: needed {needed}, {free} free")
            }
            Error::UnknownRequest(id) => write!(f, "unknown request id {id:?}"),
            Error::UnknownSequence(id) => write!(f, "unknown sequence id {id}"),
            Error::DuplicateRequest(id) => write!(f, "request id {id:?} is already in use"),
            Error::DuplicateSequence(id) => write!(f, "sequence id {id} is already in use"),
            Error::InvalidConfig { field, message } => write!(f, "invalid {field}: {message}"),
            Error::InvalidState(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for Error {}
