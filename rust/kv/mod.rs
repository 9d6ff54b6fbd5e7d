//! The KV-cache memory manager: physical blocks of each pool (`block_pool`), each sequence's
//! logical -> physical map (`block_table`), content-addressed reuse (`prefix_cache`) with its CPU
//! offload tier (`offload_tier`), the events a router mirrors them by (`events`), and
//! `block_manager`, which owns them all and is the only place that counts blocks.

pub mod block_manager;
pub mod block_pool;
pub mod block_table;
pub mod events;
pub mod offload_tier;
pub mod prefix_cache;
