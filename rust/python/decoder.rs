//! `CpuDecoder`: `cpu_kernels::decoder::decode_layers` over a model's tensors given by data pointer.
//! The addresses and lengths are taken once, when the model's decode path is built; the Python
//! side (`pagedkv.models.llama_cpu_decode`) keeps the tensors alive and unmoved for the object's life.

use pyo3::prelude::*;

use super::errors::{call, to_py_err};
use crate::cpu_kernels::decoder::{decode_layers, DecodeBatch, DecoderLayer, DecoderShape, Linear, LinearWeight};
use crate::cpu_kernels::quantized::GgmlType;
use crate::cpu_kernels::simd::Bf16;
use crate::errors::Error;

/// (weight kind: "float32", "bfloat16" or a GGUF type such as "Q4_1", weight address, weight bytes, bias
/// address (float32) or None, in_features, out_features).
type LinearSpec = (String, usize, usize, Option<usize>, usize, usize);
/// (input norm address, qkv's parts (one, or several stacked by rows: a fused projection whose
/// parts are of different GGUF types), o, post-attention norm address, gate_up, down, key offset,
/// value offset, sliding window or 0).
type LayerSpec = (usize, Vec<LinearSpec>, LinearSpec, usize, LinearSpec, LinearSpec, usize, usize, usize);

#[derive(Clone, Copy)]
enum WeightKind {
    Float32,
    BFloat16,
    Quantized(GgmlType),
}

#[derive(Clone, Copy)]
struct LinearAddresses {
    kind: WeightKind,
    weight: usize,
    weight_bytes: usize,
    bias: Option<usize>,
    in_features: usize,
    out_features: usize,
}

impl LinearAddresses {
    fn new((kind, weight, weight_bytes, bias, in_features, out_features): LinearSpec) -> PyResult<Self> {
        let kind = match kind.as_str() {
            "float32" => WeightKind::Float32,
            "bfloat16" => WeightKind::BFloat16,
            name => WeightKind::Quantized(GgmlType::from_name(name).map_err(to_py_err)?),
        };
        Ok(LinearAddresses { kind, weight, weight_bytes, bias, in_features, out_features })
    }

    /// # Safety
    /// The addresses are live tensors of the lengths given (`CpuDecoder::new`'s contract).
    unsafe fn linear(&self) -> Linear<'_> {
        let weight = match self.kind {
            WeightKind::Float32 => {
                LinearWeight::Float32(std::slice::from_raw_parts(self.weight as *const f32, self.weight_bytes / 4))
            }
            WeightKind::BFloat16 => {
                LinearWeight::BFloat16(std::slice::from_raw_parts(self.weight as *const Bf16, self.weight_bytes / 2))
            }
            WeightKind::Quantized(ty) => {
                LinearWeight::Quantized(ty, std::slice::from_raw_parts(self.weight as *const u8, self.weight_bytes))
            }
        };
        let bias = self.bias.map(|bias| std::slice::from_raw_parts(bias as *const f32, self.out_features));
        Linear { weight, bias, in_features: self.in_features, out_features: self.out_features }
    }
}

/// A layer's qkv from its parts: the one part itself, or the parts stacked by rows.
fn stacked<'a>(parts: &'a [Linear<'a>]) -> Linear<'a> {
    if parts.len() == 1 {
        return parts[0];
    }
    Linear {
        weight: LinearWeight::Stacked(parts),
        bias: None,
        in_features: parts[0].in_features,
        out_features: parts.iter().map(|part| part.out_features).sum(),
    }
}

struct LayerAddresses {
    input_norm: usize,
    qkv: Vec<LinearAddresses>,
    o: LinearAddresses,
    post_attention_norm: usize,
    gate_up: LinearAddresses,
    down: LinearAddresses,
    key_offset: usize,
    value_offset: usize,
    sliding_window: usize,
}

/// A Llama model's decoder layers for decode steps on the CPU, float32 activations and cache.
/// Internal: built and called by `pagedkv.models.llama_cpu_decode`, which checks the tensors.
#[pyclass(module = "pagedkv_core._core", frozen)]
pub struct CpuDecoder {
    shape: DecoderShape,
    layers: Vec<LayerAddresses>,
}

#[pymethods]
impl CpuDecoder {
    /// shape: (hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, block_size,
    /// num_blocks, block_stride); layers: one LayerSpec each (addresses of contiguous float32
    /// norms, linears as LinearSpec, the layer's K/V view offsets in cache elements).
    #[new]
    fn new(
        shape: (usize, usize, usize, usize, usize, usize, usize, usize),
        rms_norm_eps: f32,
        attention_scale: f32,
        layers: Vec<LayerSpec>,
    ) -> PyResult<Self> {
        let (hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, block_size, num_blocks, block_stride) =
            shape;
        let shape = DecoderShape {
            hidden_size,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size,
            rms_norm_eps,
            attention_scale,
            block_size,
            num_blocks,
            block_stride,
        };
        let layers = layers
            .into_iter()
            .map(
                |(input_norm, qkv, o, post_attention_norm, gate_up, down, key_offset, value_offset, sliding_window)| {
                    if qkv.is_empty() {
                        return Err(to_py_err(Error::InvalidConfig {
                            field: "decoder",
                            message: "a layer's qkv has no parts".into(),
                        }));
                    }
                    Ok(LayerAddresses {
                        input_norm,
                        qkv: qkv.into_iter().map(LinearAddresses::new).collect::<PyResult<_>>()?,
                        o: LinearAddresses::new(o)?,
                        post_attention_norm,
                        gate_up: LinearAddresses::new(gate_up)?,
                        down: LinearAddresses::new(down)?,
                        key_offset,
                        value_offset,
                        sliding_window,
                    })
                },
            )
            .collect::<PyResult<_>>()?;
        Ok(CpuDecoder { shape, layers })
    }

    /// Runs every layer over hidden `[T, hidden_size]` float32 (in: the embeddings; out: the last
    /// MLP's output) and writes residual `[T, hidden_size]`; each layer's K/V go into the cache
    /// (`cache_len` elements of `cache_dtype`: "float32" or "bfloat16"). cos/sin float32 `[T, head_dim]`, block_tables int32
    /// `[T, table_width]`, context_lens int32 `[T]`, slots int64 `[T]`; all contiguous.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        hidden: usize,
        residual: usize,
        cache: usize,
        cache_len: usize,
        cache_dtype: &str,
        cos_sin: (usize, usize),
        block_tables: usize,
        table_width: usize,
        context_lens: usize,
        slots: usize,
        num_tokens: usize,
        num_threads: usize,
    ) -> PyResult<()> {
        let hidden_len = num_tokens * self.shape.hidden_size;
        let rotary_len = num_tokens * self.shape.head_dim;
        py.detach(|| {
            call(|| {
                // SAFETY: the caller passes live, contiguous CPU tensors of these lengths, hidden and
                // residual distinct from each other and from the cache, and the weights given to
                // `new` are still alive (see the module's contract).
                unsafe {
                    let qkv_parts: Vec<Vec<Linear>> =
                        self.layers.iter().map(|layer| layer.qkv.iter().map(|part| part.linear()).collect()).collect();
                    let layers: Vec<DecoderLayer> = self
                        .layers
                        .iter()
                        .zip(&qkv_parts)
                        .map(|(layer, parts)| DecoderLayer {
                            input_norm: std::slice::from_raw_parts(
                                layer.input_norm as *const f32,
                                self.shape.hidden_size,
                            ),
                            qkv: stacked(parts),
                            o: layer.o.linear(),
                            post_attention_norm: std::slice::from_raw_parts(
                                layer.post_attention_norm as *const f32,
                                self.shape.hidden_size,
                            ),
                            gate_up: layer.gate_up.linear(),
                            down: layer.down.linear(),
                            key_offset: layer.key_offset,
                            value_offset: layer.value_offset,
                            sliding_window: layer.sliding_window,
                        })
                        .collect();
                    let batch = DecodeBatch {
                        cos: std::slice::from_raw_parts(cos_sin.0 as *const f32, rotary_len),
                        sin: std::slice::from_raw_parts(cos_sin.1 as *const f32, rotary_len),
                        block_tables: std::slice::from_raw_parts(block_tables as *const i32, num_tokens * table_width),
                        table_width,
                        context_lens: std::slice::from_raw_parts(context_lens as *const i32, num_tokens),
                        slots: std::slice::from_raw_parts(slots as *const i64, num_tokens),
                    };
                    let hidden = std::slice::from_raw_parts_mut(hidden as *mut f32, hidden_len);
                    let residual = std::slice::from_raw_parts_mut(residual as *mut f32, hidden_len);
                    match cache_dtype {
                        "float32" => {
                            let cache = std::slice::from_raw_parts_mut(cache as *mut f32, cache_len);
                            decode_layers(&layers, &self.shape, hidden, residual, cache, &batch, num_threads)
                        }
                        "bfloat16" => {
                            let cache = std::slice::from_raw_parts_mut(cache as *mut Bf16, cache_len);
                            decode_layers(&layers, &self.shape, hidden, residual, cache, &batch, num_threads)
                        }
                        other => Err(Error::InvalidConfig {
                            field: "cache_dtype",
                            message: format!("must be 'float32' or 'bfloat16', got {other:?}"),
                        }),
                    }
                }
            })
        })
    }

    /// Number of decoder layers.
    #[getter]
    fn num_layers(&self) -> usize {
        self.layers.len()
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CpuDecoder>()
}
