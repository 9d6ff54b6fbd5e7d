//! GGUF weights kept quantized: ggml's block formats, the 8-bit activations llama.cpp pairs with
//! each, their integer dot products (a scalar reference and AVX2, the same sums), and the small-M
//! linear layer built on them.

pub mod activations;
pub mod dot;
#[cfg(target_arch = "x86_64")]
mod eight_rows;
pub mod formats;
#[cfg(target_arch = "x86_64")]
mod k_quant_tiles;
#[cfg(target_arch = "x86_64")]
mod k_quant_tiles_avx2;
#[cfg(target_arch = "x86_64")]
mod k_quants;
pub mod linear;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use formats::GgmlType;
pub use linear::{dequantize, kernel_at_every_token_count, quantized_linear};
