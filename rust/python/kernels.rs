//! The CPU kernels over tensors given by data pointer (the Python callers check every shape,
//! dtype, device and stride first).

use pyo3::prelude::*;

use super::errors::{call, exceptions};
use crate::cpu_kernels::argmax;
use crate::cpu_kernels::decode_attention::{paged_decode_attention, DecodeShape};
use crate::cpu_kernels::fp8::{Fp8E4m3, Fp8E5m2};
use crate::cpu_kernels::kv_write;
use crate::cpu_kernels::layer_ops;
use crate::cpu_kernels::prefill_attention::paged_prefill_attention;
use crate::cpu_kernels::sampling::{self, RowSampling};
use crate::cpu_kernels::simd::{Bf16, Isa};
use crate::cpu_kernels::small_m_linear::{small_m_linear_with, LinearShape};

/// The kernels' shape from Python's tuple (batch, num_heads, num_kv_heads, head_dim,
/// block_size, num_blocks, block_stride, table_width), sliding window (0: none) and logit soft
/// cap (0: none).
fn decode_shape(
    shape: (usize, usize, usize, usize, usize, usize, usize, usize),
    sliding_window: usize,
    logit_softcap: f32,
) -> DecodeShape {
    let (batch, num_heads, num_kv_heads, head_dim, block_size, num_blocks, block_stride, table_width) = shape;
    DecodeShape {
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        block_stride,
        table_width,
        sliding_window,
        logit_softcap,
    }
}

/// Calls `$body` with `$T` the query/output element type and `$C` the cache element type named by
/// `$cache_dtype`: "float32" and "bfloat16" caches are read with queries of their own type, float8
/// caches ("fp8_e4m3", "fp8_e5m2") with float32 queries.
macro_rules! with_attention_elements {
    ($cache_dtype:expr, $T:ident, $C:ident => $body:expr) => {
        match $cache_dtype {
            "float32" => {
                type $T = f32;
                type $C = f32;
                $body
            }
            "bfloat16" => {
                type $T = Bf16;
                type $C = Bf16;
                $body
            }
            "fp8_e4m3" => {
                type $T = f32;
                type $C = Fp8E4m3;
                $body
            }
            "fp8_e5m2" => {
                type $T = f32;
                type $C = Fp8E5m2;
                $body
            }
            other => Err(exceptions::InvalidConfigError::new_err(format!(
                "cache_dtype must be 'float32', 'bfloat16', 'fp8_e4m3' or 'fp8_e5m2', got {other:?}"
            ))),
        }
    };
}

/// Paged decode attention over CPU tensors given by data pointer: caches of `cache_dtype`, query
/// and out of the type `with_attention_elements!` pairs with it. Internal: the caller
/// (`pagedkv.attention.cpu`) checks every shape, dtype, device and stride first.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn paged_decode_attention_cpu(
    py: Python<'_>,
    out: usize,
    query: usize,
    key_cache: usize,
    value_cache: usize,
    block_tables: usize,
    context_lens: usize,
    shape: (usize, usize, usize, usize, usize, usize, usize, usize),
    scale: f32,
    num_threads: usize,
    cache_dtype: &str,
    sliding_window: usize,
    logit_softcap: f32,
    sinks: usize,
) -> PyResult<()> {
    let shape = decode_shape(shape, sliding_window, logit_softcap);
    let rows = shape.batch * shape.num_heads * shape.head_dim;
    with_attention_elements!(cache_dtype, T, C => py.detach(|| call(|| {
        // SAFETY: 0 or a live float32 tensor of num_heads values (checked by the caller).
        let sinks = (sinks != 0).then(|| unsafe { std::slice::from_raw_parts(sinks as *const f32, shape.num_heads) });
        // SAFETY: the pointers are those of live, contiguous CPU tensors of these shapes (T out
        // and query, C caches, int32 tables/contexts), checked by the caller, and `out` is a
        // fresh tensor that aliases no input. The caches may overlap each other (K and V of the
        // block-major cache): both are only read.
        let (out, query, keys, values, tables, contexts) = unsafe {
            (
                std::slice::from_raw_parts_mut(out as *mut T, rows),
                std::slice::from_raw_parts(query as *const T, rows),
                std::slice::from_raw_parts(key_cache as *const C, shape.cache_len()),
                std::slice::from_raw_parts(value_cache as *const C, shape.cache_len()),
                std::slice::from_raw_parts(block_tables as *const i32, shape.batch * shape.table_width),
                std::slice::from_raw_parts(context_lens as *const i32, shape.batch),
            )
        };
        paged_decode_attention(out, query, keys, values, tables, contexts, &shape, scale, sinks, num_threads)
    })))
}

/// Calls `$body` with `$E` the element type named by `$dtype` ("float32" or "bfloat16").
macro_rules! with_element {
    ($dtype:expr, $E:ident => $body:expr) => {
        match $dtype {
            "float32" => {
                type $E = f32;
                $body
            }
            "bfloat16" => {
                type $E = Bf16;
                $body
            }
            other => Err(exceptions::InvalidConfigError::new_err(format!(
                "dtype must be 'float32' or 'bfloat16', got {other:?}"
            ))),
        }
    };
}

/// Paged prefill/extend attention over CPU tensors given by data pointer: caches of
/// `cache_dtype`, query and out `[num_tokens, num_heads, head_dim]` of the type
/// `with_attention_elements!` pairs with it, int32 tables, query_start_loc
/// and context_lens; `shape.0` is the number of sequences. Internal: the caller
/// (`pagedkv.attention.cpu`) checks every shape, dtype, device and stride first.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn paged_prefill_attention_cpu(
    py: Python<'_>,
    out: usize,
    query: usize,
    key_cache: usize,
    value_cache: usize,
    block_tables: usize,
    query_start_loc: usize,
    context_lens: usize,
    shape: (usize, usize, usize, usize, usize, usize, usize, usize),
    num_tokens: usize,
    scale: f32,
    num_threads: usize,
    cache_dtype: &str,
    sliding_window: usize,
    logit_softcap: f32,
    sinks: usize,
) -> PyResult<()> {
    let shape = decode_shape(shape, sliding_window, logit_softcap);
    let rows = num_tokens * shape.num_heads * shape.head_dim;
    with_attention_elements!(cache_dtype, T, C => py.detach(|| call(|| {
        // SAFETY: 0 or a live float32 tensor of num_heads values (checked by the caller).
        let sinks = (sinks != 0).then(|| unsafe { std::slice::from_raw_parts(sinks as *const f32, shape.num_heads) });
        // SAFETY: as in `paged_decode_attention_cpu`; query_start_loc has batch + 1 entries.
        let (out, query, keys, values, tables, starts, contexts) = unsafe {
            (
                std::slice::from_raw_parts_mut(out as *mut T, rows),
                std::slice::from_raw_parts(query as *const T, rows),
                std::slice::from_raw_parts(key_cache as *const C, shape.cache_len()),
                std::slice::from_raw_parts(value_cache as *const C, shape.cache_len()),
                std::slice::from_raw_parts(block_tables as *const i32, shape.batch * shape.table_width),
                std::slice::from_raw_parts(query_start_loc as *const i32, shape.batch + 1),
                std::slice::from_raw_parts(context_lens as *const i32, shape.batch),
            )
        };
        paged_prefill_attention(
            Isa::best(), out, query, keys, values, tables, starts, contexts, &shape, scale, sinks, num_threads,
        )
    })))
}

/// Residual add + RMSNorm in place over `[rows, width]` CPU tensors given by data pointer.
/// Internal: `pagedkv.layers.cpu_fused` checks the tensors first.
/// A step's keys or values `[len(slots), heads, head]` written into the cache `[num_blocks, heads,
/// block_size, head]` at `slots` (int64); CPU tensors given by data pointer and element strides
/// (cache block, row token, row head; contiguous within a block and a head), elements of
/// `element_bytes` bytes. Internal: `pagedkv.attention.cpu.write_kv` checks the tensors first.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn write_kv_cpu(
    py: Python<'_>,
    cache: usize,
    rows: usize,
    slots: usize,
    num_tokens: usize,
    cache_shape: (usize, usize, usize, usize),
    strides: (usize, usize, usize),
    element_bytes: usize,
) -> PyResult<()> {
    let (num_blocks, num_heads, block_size, head_size) = cache_shape;
    let shape = kv_write::CacheShape { num_blocks, num_heads, block_size, head_size, element_bytes };
    let strides = kv_write::Strides { cache_block: strides.0, row_token: strides.1, row_head: strides.2 };
    let (cache_bytes, rows_bytes) = kv_write::spans(shape, strides, num_tokens);
    py.detach(|| {
        call(|| {
            // SAFETY: live CPU tensors spanning these bytes from their data pointers, the rows apart
            // from the cache (caller-checked).
            let (cache, rows, slots) = unsafe {
                (
                    std::slice::from_raw_parts_mut(cache as *mut u8, cache_bytes),
                    std::slice::from_raw_parts(rows as *const u8, rows_bytes),
                    std::slice::from_raw_parts(slots as *const i64, num_tokens),
                )
            };
            kv_write::write_kv(cache, rows, slots, shape, strides)
        })
    })
}

#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn rms_norm_cpu(
    py: Python<'_>,
    hidden: usize,
    residual: Option<usize>,
    weight: usize,
    rows_width: (usize, usize),
    eps: f32,
    num_threads: usize,
    dtype: &str,
) -> PyResult<()> {
    let (rows, width) = rows_width;
    with_element!(dtype, E => py.detach(|| call(|| {
        // SAFETY: live, contiguous, distinct CPU tensors of these shapes and dtype (caller-checked).
        let (hidden, residual, weight) = unsafe {
            (
                std::slice::from_raw_parts_mut(hidden as *mut E, rows * width),
                residual.map(|residual| std::slice::from_raw_parts_mut(residual as *mut E, rows * width)),
                std::slice::from_raw_parts(weight as *const E, width),
            )
        };
        layer_ops::rms_norm(hidden, residual, weight, width, eps, num_threads)
    })))
}

/// out `[rows, width]` = silu(gate) * up of input `[rows, 2 * width]`, CPU tensors given by data
/// pointer. Internal: `pagedkv.layers.cpu_fused` checks the tensors first.
#[pyfunction]
fn silu_and_mul_cpu(
    py: Python<'_>,
    out: usize,
    input: usize,
    rows_width: (usize, usize),
    num_threads: usize,
    dtype: &str,
) -> PyResult<()> {
    let (rows, width) = rows_width;
    with_element!(dtype, E => py.detach(|| call(|| {
        // SAFETY: live, contiguous CPU tensors of these shapes and dtype; `out` is fresh.
        let (out, input) = unsafe {
            (
                std::slice::from_raw_parts_mut(out as *mut E, rows * width),
                std::slice::from_raw_parts(input as *const E, rows * 2 * width),
            )
        };
        layer_ops::silu_and_mul(out, input, width, num_threads)
    })))
}

/// Rotary embedding in place on the first `num_heads` heads of each `[num_tokens, row_width]`
/// row, by cos/sin `[num_tokens, head_dim]`. Internal: `pagedkv.layers.cpu_fused` checks the
/// tensors first.
#[pyfunction]
fn rotary_cpu(
    py: Python<'_>,
    qkv: usize,
    cos: usize,
    sin: usize,
    shape: (usize, usize, usize, usize),
    num_threads: usize,
    dtype: &str,
) -> PyResult<()> {
    let (num_tokens, row_width, num_heads, head_dim) = shape;
    let shape = layer_ops::RotaryShape { num_tokens, row_width, num_heads, head_dim };
    with_element!(dtype, E => py.detach(|| call(|| {
        // SAFETY: live, contiguous CPU tensors of these shapes and dtype; qkv aliases neither table.
        let (qkv, cos, sin) = unsafe {
            (
                std::slice::from_raw_parts_mut(qkv as *mut E, num_tokens * row_width),
                std::slice::from_raw_parts(cos as *const E, num_tokens * head_dim),
                std::slice::from_raw_parts(sin as *const E, num_tokens * head_dim),
            )
        };
        layer_ops::rotary_in_place(qkv, cos, sin, shape, num_threads)
    })))
}

/// out `[rows, out_features]` = x `[rows, in_features]` @ weight`[out_features, in_features]`^T
/// (+ bias `[out_features]`), CPU tensors given by data pointer: x and out of `dtype`, weight and
/// bias of `weight_dtype` ("float32" or "bfloat16" each); `shape` is (rows, in_features,
/// out_features). `portable` skips the SIMD path (tests). Internal: `pagedkv.layers.cpu_linear`
/// checks the tensors first.
#[pyfunction]
#[pyo3(signature = (out, x, weight, bias, shape, num_threads, dtype, weight_dtype, portable = false))]
#[allow(clippy::too_many_arguments)]
fn small_m_linear_cpu(
    py: Python<'_>,
    out: usize,
    x: usize,
    weight: usize,
    bias: Option<usize>,
    shape: (usize, usize, usize),
    num_threads: usize,
    dtype: &str,
    weight_dtype: &str,
    portable: bool,
) -> PyResult<()> {
    let (rows, in_features, out_features) = shape;
    let shape = LinearShape { rows, in_features, out_features };
    let isa = if portable { Isa::Portable } else { Isa::best() };
    with_element!(dtype, E => with_element!(weight_dtype, W => py.detach(|| call(|| {
        // SAFETY: live, contiguous CPU tensors of these shapes and dtypes; `out` is fresh.
        let (out, x, weight, bias) = unsafe {
            (
                std::slice::from_raw_parts_mut(out as *mut E, rows * out_features),
                std::slice::from_raw_parts(x as *const E, rows * in_features),
                std::slice::from_raw_parts(weight as *const W, out_features * in_features),
                bias.map(|bias| std::slice::from_raw_parts(bias as *const W, out_features)),
            )
        };
        small_m_linear_with(isa, out, x, weight, bias, shape, num_threads)
    }))))
}

/// out `[rows]` int64 = argmax of each row of logits `[rows, width]` of `dtype` ("float32" or
/// "bfloat16"), CPU tensors given by data pointer. Internal: `pagedkv.runner.sampler.argmax_rows`
/// checks the tensors first.
#[pyfunction]
#[pyo3(signature = (out, logits, rows_width, num_threads, dtype = "float32"))]
fn argmax_rows_cpu(
    py: Python<'_>,
    out: usize,
    logits: usize,
    rows_width: (usize, usize),
    num_threads: usize,
    dtype: &str,
) -> PyResult<()> {
    let (rows, width) = rows_width;
    py.detach(|| {
        with_element!(dtype, E => call(|| {
            // SAFETY: live, contiguous CPU tensors of these shapes and dtypes; `out` is fresh.
            let (out, logits) = unsafe {
                (
                    std::slice::from_raw_parts_mut(out as *mut i64, rows),
                    std::slice::from_raw_parts(logits as *const E, rows * width),
                )
            };
            argmax::argmax_rows(logits, width, out, num_threads)
        }))
    })
}

/// out `[rows]` int64 = a token drawn from each row of logits `[rows, width]` of `dtype`
/// ("float32" or "bfloat16") under the row's settings (float32 `[rows, 4]`: temperature, top_k,
/// top_p, min_p) and uniform number (float32 `[rows]`), CPU tensors given by data pointer.
/// Internal: `pagedkv.runner.sampler` checks the tensors first.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn sample_rows_cpu(
    py: Python<'_>,
    out: usize,
    logits: usize,
    rows_width: (usize, usize),
    settings: usize,
    uniform: usize,
    num_threads: usize,
    dtype: &str,
) -> PyResult<()> {
    let (rows, width) = rows_width;
    py.detach(|| {
        with_element!(dtype, E => call(|| {
            // SAFETY: live, contiguous CPU tensors of these shapes and dtypes; `out` is fresh.
            let (out, logits, settings, uniform) = unsafe {
                (
                    std::slice::from_raw_parts_mut(out as *mut i64, rows),
                    std::slice::from_raw_parts(logits as *const E, rows * width),
                    std::slice::from_raw_parts(settings as *const [f32; 4], rows),
                    std::slice::from_raw_parts(uniform as *const f32, rows),
                )
            };
            let settings: Vec<RowSampling> = settings
                .iter()
                .zip(uniform)
                .map(|(&[temperature, top_k, top_p, min_p], &uniform)| RowSampling {
                    temperature,
                    top_k: top_k.max(0.0) as usize,
                    top_p,
                    min_p,
                    uniform,
                })
                .collect();
            sampling::sample_rows(logits, width, &settings, out, num_threads)
        }))
    })
}

/// (instruction set, runs on an OpenMP team) of the CPU decode attention in this process.
#[pyfunction]
fn cpu_attention_build() -> (String, bool) {
    (format!("{:?}", Isa::best()), crate::cpu_kernels::openmp_team::is_available())
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(paged_decode_attention_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(paged_prefill_attention_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_attention_build, m)?)?;
    m.add_function(wrap_pyfunction!(argmax_rows_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(sample_rows_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(silu_and_mul_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(rotary_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(small_m_linear_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(write_kv_cpu, m)?)
}
