//! A decode step's whole stack of Llama decoder layers in one call: per layer, residual add +
//! RMSNorm, the fused qkv projection, rotary embedding, the K/V write into the paged cache, paged
//! decode attention, the output projection, residual add + RMSNorm, gate/up, SiLU-and-mul and the
//! down projection. Each is the kernel the layer-by-layer path calls (same inputs, same order), so
//! the result is the same bits; what goes is the ~70 Python and torch calls a layer costs there,
//! about as long as the layer's own arithmetic at one token on the embedded model. The cache is
//! float32 or bfloat16 (`C`); with bfloat16 the new K/V and the attention's query and output are
//! rounded to it, as the layer-by-layer path's torch casts around the same kernel do.

use crate::cpu_kernels::decode_attention::{check_paged_inputs, paged_decode_attention, DecodeShape};
use crate::cpu_kernels::kv_write::{self, CacheShape, Strides};
use crate::cpu_kernels::layer_ops::{rms_norm, rotary_in_place, silu_and_mul, RotaryShape};
use crate::cpu_kernels::quantized::{quantized_linear, GgmlType};
use crate::cpu_kernels::simd::{Bf16, Element, Isa};
use crate::cpu_kernels::small_m_linear::{small_m_linear, LinearShape};
use crate::errors::{Error, Result};

/// A projection's weight `[out_features, in_features]`: float32, bfloat16 (a BF16 GGUF's, beside
/// float32 activations), GGUF blocks kept quantized, or several of these stacked by rows (a fused
/// q/k/v whose parts a GGUF stores as different types: a Q4_K_M file's Q6_K v beside Q4_K q, k).
#[derive(Debug, Clone, Copy)]
pub enum LinearWeight<'a> {
    Float32(&'a [f32]),
    BFloat16(&'a [Bf16]),
    Quantized(GgmlType, &'a [u8]),
    Stacked(&'a [Linear<'a>]),
}

/// out = x @ weight^T + bias.
#[derive(Debug, Clone, Copy)]
pub struct Linear<'a> {
    pub weight: LinearWeight<'a>,
    pub bias: Option<&'a [f32]>,
    pub in_features: usize,
    pub out_features: usize,
}

impl Linear<'_> {
    fn forward(&self, x: &[f32], out: &mut [f32], rows: usize, num_threads: usize) -> Result<()> {
        let (k, n) = (self.in_features, self.out_features);
        match self.weight {
            LinearWeight::Float32(weight) => small_m_linear(
                out,
                x,
                weight,
                self.bias,
                LinearShape { rows, in_features: k, out_features: n },
                num_threads,
            ),
            LinearWeight::BFloat16(weight) => {
                // (no bias: `check` refuses one, as the kernel would round it to bfloat16)
                let shape = LinearShape { rows, in_features: k, out_features: n };
                small_m_linear(out, x, weight, None, shape, num_threads)
            }
            LinearWeight::Quantized(ty, blocks) => {
                quantized_linear(out, x, blocks, self.bias, ty, (rows, n, k), num_threads, Isa::best())
            }
            LinearWeight::Stacked(parts) => stacked_forward(parts, x, out, rows, n, num_threads),
        }
    }

    fn check(&self, name: &str, in_features: usize, out_features: usize) -> Result<()> {
        let weight_fits = match self.weight {
            LinearWeight::Float32(weight) => weight.len() == in_features * out_features,
            LinearWeight::BFloat16(weight) => weight.len() == in_features * out_features,
            LinearWeight::Quantized(ty, blocks) => {
                ty.row_bytes(in_features).is_ok_and(|row_bytes| blocks.len() == row_bytes * out_features)
            }
            LinearWeight::Stacked(parts) => {
                for (index, part) in parts.iter().enumerate() {
                    if matches!(part.weight, LinearWeight::Stacked(_)) {
                        return invalid(format!("{name}'s part {index} is stacked itself"));
                    }
                    part.check(&format!("{name}'s part {index}"), in_features, part.out_features)?;
                }
                !parts.is_empty() && parts.iter().map(|part| part.out_features).sum::<usize>() == out_features
            }
        };
        if self.in_features != in_features || self.out_features != out_features || !weight_fits {
            return invalid(format!(
                "{name} is [{}, {}] with a weight of {:?}; the layer wants [{out_features}, {in_features}]",
                self.out_features,
                self.in_features,
                self.weight_len()
            ));
        }
        if self.bias.is_some_and(|bias| bias.len() != out_features) {
            return invalid(format!("{name}'s bias is not [{out_features}]"));
        }
        if self.bias.is_some() && matches!(self.weight, LinearWeight::BFloat16(_) | LinearWeight::Stacked(_)) {
            return invalid(format!("{name}: bfloat16 or stacked weights take no bias here (a part's own can)"));
        }
        Ok(())
    }

    fn weight_len(&self) -> usize {
        match self.weight {
            LinearWeight::Float32(weight) => weight.len(),
            LinearWeight::BFloat16(weight) => weight.len(),
            LinearWeight::Quantized(_, blocks) => blocks.len(),
            LinearWeight::Stacked(parts) => parts.iter().map(Linear::weight_len).sum(),
        }
    }
}

/// Each part's output columns side by side: written in place for one row, through a part's own
/// buffer for more (a part's rows are then strided in `out`).
fn stacked_forward(parts: &[Linear], x: &[f32], out: &mut [f32], rows: usize, n: usize, threads: usize) -> Result<()> {
    let mut column = 0;
    for part in parts {
        let width = part.out_features;
        if rows == 1 {
            part.forward(x, &mut out[column..column + width], 1, threads)?;
        } else {
            let mut own = vec![0f32; rows * width];
            part.forward(x, &mut own, rows, threads)?;
            for (row, values) in out.chunks_exact_mut(n).zip(own.chunks_exact(width)) {
                row[column..column + width].copy_from_slice(values);
            }
        }
        column += width;
    }
    Ok(())
}

/// One decoder layer's weights and where its K/V live in the cache (element offsets of its key
/// and value views; blocks `DecoderShape::block_stride` apart).
#[derive(Debug, Clone, Copy)]
pub struct DecoderLayer<'a> {
    pub input_norm: &'a [f32],
    pub qkv: Linear<'a>,
    pub o: Linear<'a>,
    pub post_attention_norm: &'a [f32],
    pub gate_up: Linear<'a>,
    pub down: Linear<'a>,
    pub key_offset: usize,
    pub value_offset: usize,
    /// 0: full attention.
    pub sliding_window: usize,
}

/// The sizes every layer shares, and the paged cache's.
#[derive(Debug, Clone, Copy)]
pub struct DecoderShape {
    pub hidden_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    pub attention_scale: f32,
    pub block_size: usize,
    pub num_blocks: usize,
    pub block_stride: usize,
}

impl DecoderShape {
    fn query_width(&self) -> usize {
        self.num_heads * self.head_dim
    }

    fn kv_width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    fn qkv_width(&self) -> usize {
        self.query_width() + 2 * self.kv_width()
    }

    fn attention_shape(&self, batch: usize, table_width: usize, sliding_window: usize) -> DecodeShape {
        DecodeShape {
            batch,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            block_stride: self.block_stride,
            table_width,
            sliding_window,
            logit_softcap: 0.0,
        }
    }

    fn cache_shape<C>(&self) -> CacheShape {
        CacheShape {
            num_blocks: self.num_blocks,
            num_heads: self.num_kv_heads,
            block_size: self.block_size,
            head_size: self.head_dim,
            element_bytes: std::mem::size_of::<C>(),
        }
    }
}

/// One decode step's batch: a token per sequence, its rotary (cos, sin) rows `[T, head_dim]`, and
/// where each sequence's K/V are (block tables `[T, table_width]`, context lengths counting the
/// new token, the new token's slot).
#[derive(Debug, Clone, Copy)]
pub struct DecodeBatch<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub block_tables: &'a [i32],
    pub table_width: usize,
    pub context_lens: &'a [i32],
    pub slots: &'a [i64],
}

/// Runs `layers` over `hidden` `[T, hidden_size]` (the embeddings in, the last layer's MLP output
/// out) and `residual` (written: the residual stream beside it, as LlamaDecoderLayer returns it),
/// writing each layer's new K/V into `cache` (the whole block-major cache, float32 or bfloat16).
/// Everything is checked before anything is written.
pub fn decode_layers<C: Element>(
    layers: &[DecoderLayer],
    shape: &DecoderShape,
    hidden: &mut [f32],
    residual: &mut [f32],
    cache: &mut [C],
    batch: &DecodeBatch,
    num_threads: usize,
) -> Result<()> {
    let tokens = batch.context_lens.len();
    check(layers, shape, hidden, residual, cache, batch)?;
    if tokens == 0 {
        return Ok(());
    }
    let (query_width, kv_width, qkv_width) = (shape.query_width(), shape.kv_width(), shape.qkv_width());
    let mut qkv = vec![0f32; tokens * qkv_width];
    let zero = C::from_f32(0.0);
    let mut qkv_in_cache_type = vec![zero; tokens * qkv_width];
    let mut query = vec![zero; tokens * query_width];
    let mut attention_in_cache_type = vec![zero; tokens * query_width];
    let mut attention = vec![0f32; tokens * query_width];
    let mut gate_up = vec![0f32; tokens * 2 * shape.intermediate_size];
    let mut activated = vec![0f32; tokens * shape.intermediate_size];
    let rotary = RotaryShape {
        num_tokens: tokens,
        row_width: qkv_width,
        num_heads: shape.num_heads + shape.num_kv_heads,
        head_dim: shape.head_dim,
    };
    let strides = Strides { cache_block: shape.block_stride, row_token: qkv_width, row_head: shape.head_dim };
    for (index, layer) in layers.iter().enumerate() {
        if index == 0 {
            residual.copy_from_slice(hidden);
            rms_norm(hidden, None, layer.input_norm, shape.hidden_size, shape.rms_norm_eps, num_threads)?;
        } else {
            rms_norm(hidden, Some(residual), layer.input_norm, shape.hidden_size, shape.rms_norm_eps, num_threads)?;
        }
        layer.qkv.forward(hidden, &mut qkv, tokens, num_threads)?;
        rotary_in_place(&mut qkv, batch.cos, batch.sin, rotary, num_threads)?;
        let attention_shape = shape.attention_shape(tokens, batch.table_width, layer.sliding_window);
        let span = attention_shape.cache_len();
        for (rounded, &value) in qkv_in_cache_type.iter_mut().zip(&qkv) {
            *rounded = C::from_f32(value);
        }
        for (offset, rows_from) in [(layer.key_offset, query_width), (layer.value_offset, query_width + kv_width)] {
            kv_write::write_kv(
                as_bytes_mut(&mut cache[offset..offset + span]),
                as_bytes(&qkv_in_cache_type[rows_from..]),
                batch.slots,
                shape.cache_shape::<C>(),
                strides,
            )?;
        }
        for (row, qkv_row) in query.chunks_exact_mut(query_width).zip(qkv_in_cache_type.chunks_exact(qkv_width)) {
            row.copy_from_slice(&qkv_row[..query_width]);
        }
        paged_decode_attention(
            &mut attention_in_cache_type,
            &query,
            &cache[layer.key_offset..layer.key_offset + span],
            &cache[layer.value_offset..layer.value_offset + span],
            batch.block_tables,
            batch.context_lens,
            &attention_shape,
            shape.attention_scale,
            None,
            num_threads,
        )?;
        for (widened, &value) in attention.iter_mut().zip(&attention_in_cache_type) {
            *widened = value.to_f32();
        }
        layer.o.forward(&attention, hidden, tokens, num_threads)?;
        rms_norm(
            hidden,
            Some(residual),
            layer.post_attention_norm,
            shape.hidden_size,
            shape.rms_norm_eps,
            num_threads,
        )?;
        layer.gate_up.forward(hidden, &mut gate_up, tokens, num_threads)?;
        silu_and_mul(&mut activated, &gate_up, shape.intermediate_size, num_threads)?;
        layer.down.forward(&activated, hidden, tokens, num_threads)?;
    }
    Ok(())
}

fn check<C: Element>(
    layers: &[DecoderLayer],
    shape: &DecoderShape,
    hidden: &[f32],
    residual: &[f32],
    cache: &[C],
    batch: &DecodeBatch,
) -> Result<()> {
    let tokens = batch.context_lens.len();
    let hidden_size = shape.hidden_size;
    if hidden.len() != tokens * hidden_size || residual.len() != hidden.len() {
        return invalid(format!(
            "hidden ({}) and residual ({}) must be [{tokens}, {hidden_size}]",
            hidden.len(),
            residual.len()
        ));
    }
    let rotary_len = tokens * shape.head_dim;
    if batch.cos.len() != rotary_len || batch.sin.len() != rotary_len || batch.slots.len() != tokens {
        return invalid(format!("cos, sin must be [{tokens}, {}] and slots [{tokens}]", shape.head_dim));
    }
    if shape.num_heads == 0 || shape.num_kv_heads == 0 || shape.head_dim == 0 || hidden_size == 0 {
        return invalid(format!("{shape:?} has an empty dimension"));
    }
    let (query_width, intermediate) = (shape.query_width(), shape.intermediate_size);
    for (index, layer) in layers.iter().enumerate() {
        let name = |part: &str| format!("layer {index}'s {part}");
        if layer.input_norm.len() != hidden_size || layer.post_attention_norm.len() != hidden_size {
            return invalid(format!("{} must be [{hidden_size}]", name("norm weights")));
        }
        layer.qkv.check(&name("qkv_proj"), hidden_size, shape.qkv_width())?;
        layer.o.check(&name("o_proj"), query_width, hidden_size)?;
        layer.gate_up.check(&name("gate_up_proj"), hidden_size, 2 * intermediate)?;
        layer.down.check(&name("down_proj"), intermediate, hidden_size)?;
        let attention_shape = shape.attention_shape(tokens, batch.table_width, layer.sliding_window);
        attention_shape.check()?;
        let span = attention_shape.cache_len();
        let view = |offset: usize| offset.checked_add(span).and_then(|end| cache.get(offset..end));
        let (Some(keys), Some(values)) = (view(layer.key_offset), view(layer.value_offset)) else {
            return invalid(format!("{}: its K/V views run past the cache of {} elements", name("cache"), cache.len()));
        };
        check_paged_inputs(Isa::best(), &attention_shape, keys, values, batch.block_tables, batch.context_lens, 1)?;
    }
    let num_slots = (shape.num_blocks * shape.block_size) as i64;
    if let Some(slot) = batch.slots.iter().find(|&&slot| slot >= num_slots) {
        return invalid(format!("slot {slot} is past the cache's {num_slots} slots"));
    }
    Ok(())
}

fn invalid(message: String) -> Result<()> {
    Err(Error::InvalidConfig { field: "decoder", message })
}

fn as_bytes<C: Element>(values: &[C]) -> &[u8] {
    // SAFETY: an Element (f32, Bf16, the float8 types) is plain initialized bytes, and u8 has no
    // alignment to keep.
    unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values)) }
}

fn as_bytes_mut<C: Element>(values: &mut [C]) -> &mut [u8] {
    // SAFETY: as `as_bytes`, and any bytes written are some value of C (every bit pattern is).
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr() as *mut u8, std::mem::size_of_val(values)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: DecoderShape = DecoderShape {
        hidden_size: 8,
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 4,
        intermediate_size: 8,
        rms_norm_eps: 1e-5,
        attention_scale: 0.5,
        block_size: 4,
        num_blocks: 2,
        // two layers' K and V in each block
        block_stride: 2 * 2 * 4 * 4,
    };

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000) as f32 / 1000.0 - 0.5).collect()
    }

    fn linear(weight: &[f32], in_features: usize, out_features: usize) -> Linear<'_> {
        Linear { weight: LinearWeight::Float32(weight), bias: None, in_features, out_features }
    }

    #[test]
    fn a_stacked_linear_gives_its_whole_weights_bits_at_any_row_count() {
        let (k, n) = (8, 16);
        let (weight, bias) = (values(n * k, 7), values(n, 8));
        let whole = Linear { bias: Some(&bias), ..linear(&weight, k, n) };
        let parts = [
            Linear {
                weight: LinearWeight::Float32(&weight[..10 * k]),
                bias: Some(&bias[..10]),
                in_features: k,
                out_features: 10,
            },
            Linear {
                weight: LinearWeight::Float32(&weight[10 * k..]),
                bias: Some(&bias[10..]),
                in_features: k,
                out_features: 6,
            },
        ];
        let stacked = Linear { weight: LinearWeight::Stacked(&parts), bias: None, in_features: k, out_features: n };
        stacked.check("qkv", k, n).unwrap();
        for rows in [1, 3] {
            let x = values(rows * k, 9);
            let (mut expected, mut got) = (vec![0f32; rows * n], vec![0f32; rows * n]);
            whole.forward(&x, &mut expected, rows, 1).unwrap();
            stacked.forward(&x, &mut got, rows, 2).unwrap();
            assert_eq!(got, expected, "{rows} rows");
        }
        assert!(stacked.check("qkv", k, n + 1).is_err());
        assert!(Linear { bias: Some(&bias), ..stacked }.check("qkv", k, n).is_err());
        let nested = [stacked];
        assert!(Linear { weight: LinearWeight::Stacked(&nested), ..stacked }.check("qkv", k, n).is_err());
    }

    #[test]
    fn each_layer_writes_its_own_keys_and_values_and_bad_input_writes_nothing() {
        let (qkv, o, gate_up, down, norm) =
            (values(16 * 8, 1), values(64, 2), values(16 * 8, 3), values(64, 4), values(8, 5));
        let layer = |index: usize| DecoderLayer {
            input_norm: &norm,
            qkv: linear(&qkv, 8, 16),
            o: linear(&o, 8, 8),
            post_attention_norm: &norm,
            gate_up: linear(&gate_up, 8, 16),
            down: linear(&down, 8, 8),
            key_offset: 2 * index * 16,
            value_offset: (2 * index + 1) * 16,
            sliding_window: 0,
        };
        let layers = [layer(0), layer(1)];
        let (cos, sin) = (vec![1.0; 4], vec![0.0; 4]);
        let batch = |slots: &'static [i64]| DecodeBatch {
            cos: &cos,
            sin: &sin,
            block_tables: &[1, 0],
            table_width: 2,
            context_lens: &[2],
            slots,
        };
        let mut cache = vec![0f32; 2 * SHAPE.block_stride];
        let (mut hidden, mut residual) = (values(8, 6), vec![0f32; 8]);
        let input = hidden.clone();
        // a slot past the cache, then a layer whose o_proj is the wrong size: errors, nothing written
        assert!(decode_layers(&layers, &SHAPE, &mut hidden, &mut residual, &mut cache, &batch(&[8]), 1).is_err());
        let wrong = [layer(0), DecoderLayer { o: linear(&o, 4, 16), ..layer(1) }];
        assert!(decode_layers(&wrong, &SHAPE, &mut hidden, &mut residual, &mut cache, &batch(&[5]), 1).is_err());
        assert!(hidden == input && cache.iter().all(|&v| v == 0.0));

        decode_layers(&layers, &SHAPE, &mut hidden, &mut residual, &mut cache, &batch(&[5]), 1).unwrap();
        // slot 5: block 1, offset 1; each layer's key then value view, head_dim 4 apart
        let written: Vec<usize> =
            (0..cache.len()).filter(|&i| cache[i] != 0.0).map(|i| i - SHAPE.block_stride).collect();
        let expected: Vec<usize> = (0..4).flat_map(|view| (0..4).map(move |d| view * 16 + 4 + d)).collect();
        assert_eq!(written, expected);
        assert!(hidden != input && residual.iter().all(|v| v.is_finite()));
    }
}
