//! pagedkv core: the KV-cache memory manager and scheduler of a PagedAttention serving engine.
//!
//! Plain Rust types, tested by `cargo test`; `python.rs` (feature `python`) is the thin PyO3 layer.

pub mod block_manager;
pub mod block_pool;
pub mod block_table;
pub mod errors;
pub mod prefix_cache;

pub use block_manager::{BlockCopy, BlockManager, SeqId};
pub use block_pool::{BlockId, Device};
pub use errors::{Error, Result};
