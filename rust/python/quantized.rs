//! GGUF weights kept quantized (`cpu_kernels::quantized`) over tensors given by data pointer. The
//! byte and element counts come with the pointers, so the core checks every length itself.

use pyo3::prelude::*;

use super::errors::{call, to_py_err};
use crate::cpu_kernels::quantized::{self, GgmlType};
use crate::cpu_kernels::simd::Isa;

/// (elements, bytes) of one block of `ggml_type` ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K").
#[pyfunction]
fn ggml_block_size(ggml_type: &str) -> PyResult<(usize, usize)> {
    let ty = GgmlType::from_name(ggml_type).map_err(to_py_err)?;
    Ok((ty.block_len(), ty.block_bytes()))
}

/// Whether `quantized_linear_cpu` beats dequantizing `ggml_type` for float32's GEMM at every token
/// count on this CPU (the blocks of 32 always; the K-quants on AVX-512 VNNI).
#[pyfunction]
fn quantized_kernel_at_every_token_count(ggml_type: &str) -> PyResult<bool> {
    let ty = GgmlType::from_name(ggml_type).map_err(to_py_err)?;
    Ok(quantized::kernel_at_every_token_count(ty))
}

/// out `[m, n]` float32 = x `[m, k]` float32 @ dequantize(weight)^T (+ bias `[n]` float32), with
/// weight `weight_bytes` bytes of `ggml_type` blocks, `n` rows of `k` elements. Internal:
/// `pagedkv.layers.quantized_linear` checks dtypes, devices and contiguity first.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn quantized_linear_cpu(
    py: Python<'_>,
    out: usize,
    x: usize,
    weight: usize,
    weight_bytes: usize,
    bias: Option<usize>,
    ggml_type: &str,
    shape: (usize, usize, usize),
    num_threads: usize,
) -> PyResult<()> {
    let ty = GgmlType::from_name(ggml_type).map_err(to_py_err)?;
    let (m, n, k) = shape;
    py.detach(|| {
        call(|| {
            // SAFETY: live, contiguous CPU tensors: out float32 [m, n] (fresh, aliasing nothing), x
            // float32 [m, k], weight of weight_bytes bytes, bias float32 [n] (caller-checked).
            let (out, x, weight, bias) = unsafe {
                (
                    std::slice::from_raw_parts_mut(out as *mut f32, m * n),
                    std::slice::from_raw_parts(x as *const f32, m * k),
                    std::slice::from_raw_parts(weight as *const u8, weight_bytes),
                    bias.map(|bias| std::slice::from_raw_parts(bias as *const f32, n)),
                )
            };
            quantized::quantized_linear(out, x, weight, bias, ty, (m, n, k), num_threads, Isa::best())
        })
    })
}

/// out (`out_len` float32) = the values of `blocks_bytes` bytes of `ggml_type` blocks.
/// Internal: `pagedkv.layers.quantized_linear.dequantize` checks the tensors first.
#[pyfunction]
fn dequantize_cpu(
    py: Python<'_>,
    out: usize,
    out_len: usize,
    blocks: usize,
    blocks_bytes: usize,
    ggml_type: &str,
    num_threads: usize,
) -> PyResult<()> {
    let ty = GgmlType::from_name(ggml_type).map_err(to_py_err)?;
    py.detach(|| {
        call(|| {
            // SAFETY: a live, contiguous float32 CPU tensor of out_len elements and a uint8 one of
            // blocks_bytes bytes, distinct (caller-checked).
            let (out, blocks) = unsafe {
                (
                    std::slice::from_raw_parts_mut(out as *mut f32, out_len),
                    std::slice::from_raw_parts(blocks as *const u8, blocks_bytes),
                )
            };
            quantized::dequantize(ty, blocks, out, num_threads)
        })
    })
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(ggml_block_size, m)?)?;
    m.add_function(wrap_pyfunction!(quantized_linear_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(quantized_kernel_at_every_token_count, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_cpu, m)?)
}
