//! The CPU engine's kernels: paged decode and prefill attention read K/V in place through the
//! block table, `kv_write` puts a step's new K/V there; the elementwise layers are fused; `small_m_linear` is the decode steps' matrix products;
//! `simd` and `fp8` are their element types, and `openmp_team` runs them on torch's thread team.

pub mod argmax;
pub mod decode_attention;
pub mod decoder;
pub mod fp8;
pub mod kv_write;
pub mod layer_ops;
pub mod openmp_team;
pub mod prefill_attention;
pub mod quantized;
pub mod sampling;
pub mod simd;
pub mod small_m_linear;
