//! Activations quantized to 8 bits the way llama.cpp's reference quantizers do (ggml-quants.c,
//! `quantize_row_q8_0_ref`, `_q8_1_ref`, `_q8_K_ref`), so the weights' dot products run on integers:
//! Q8_0 for Q4_0 and Q8_0 weights, Q8_1 for Q4_1, Q8_K for Q4_K and Q6_K.

use super::formats::{f16_to_f32, f32_to_f16, GgmlType};

/// The 8-bit scheme a weight format's dot product takes.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationScheme {
    /// Blocks of 32: d = amax / 127 stored as f16, q = roundf(x / d) (ties away from zero).
    Q8_0,
    /// Q8_0 plus s = f16(d * sum(q)), which carries Q4_1's min term.
    Q8_1,
    /// Blocks of 256: d = max / -127 as f32 (max: the value of largest magnitude), q =
    /// nearest_int(x / d) (ties to even) capped at 127, and sums of each 16 q.
    Q8_K,
}

impl ActivationScheme {
    pub fn for_weights(ty: GgmlType) -> ActivationScheme {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q8_0 => ActivationScheme::Q8_0,
            GgmlType::Q4_1 => ActivationScheme::Q8_1,
            GgmlType::Q4_K | GgmlType::Q6_K => ActivationScheme::Q8_K,
        }
    }
}

/// Rows of activations quantized block by block (rows are whole blocks, so block b of row m is
/// block m * blocks_per_row + b).
pub struct QuantizedActivations {
    pub block_len: usize,
    /// Each block's scale, as the dot product reads it (f16 schemes: already widened).
    pub scales: Vec<f32>,
    /// Q8_1's s per block (widened from f16); empty for the other schemes.
    pub sums: Vec<f32>,
    /// Q8_K's sums of each 16 q (16 per block); empty for the other schemes.
    pub sums_of_16: Vec<i32>,
    /// Q8_K's sums of each 32 q (8 per block, |sum| <= 32 * 127), for Q4_K's mins; empty for the
    /// other schemes.
    pub sums_of_32: Vec<i16>,
    /// Q8_0's and Q8_1's sum of q per block (exact), for weights read with an offset; empty for Q8_K.
    pub block_sums: Vec<i32>,
    pub quants: Vec<i8>,
}

/// Quantizes `values` (whole blocks) with `scheme`.
pub fn quantize_activations(scheme: ActivationScheme, values: &[f32]) -> QuantizedActivations {
    let block_len = if scheme == ActivationScheme::Q8_K { 256 } else { 32 };
    debug_assert!(values.len().is_multiple_of(block_len));
    let num_blocks = values.len() / block_len;
    let mut quantized = QuantizedActivations {
        block_len,
        scales: Vec::with_capacity(num_blocks),
        sums: Vec::new(),
        sums_of_16: Vec::new(),
        sums_of_32: Vec::new(),
        block_sums: Vec::new(),
        quants: vec![0; values.len()],
    };
    for (block, quants) in values.chunks_exact(block_len).zip(quantized.quants.chunks_exact_mut(block_len)) {
        if scheme == ActivationScheme::Q8_K {
            let (max, _) = block
                .iter()
                .fold((0f32, 0f32), |(max, amax), &x| if x.abs() > amax { (x, x.abs()) } else { (max, amax) });
            if max == 0.0 {
                quantized.scales.push(0.0);
            } else {
                let inverse_scale = -127.0 / max;
                for (q, &x) in quants.iter_mut().zip(block) {
                    *q = ((inverse_scale * x).round_ties_even() as i32).min(127) as i8;
                }
                quantized.scales.push(1.0 / inverse_scale);
            }
            let first = quantized.sums_of_16.len();
            quantized
                .sums_of_16
                .extend(quants.chunks_exact(16).map(|sixteen| sixteen.iter().map(|&q| q as i32).sum::<i32>()));
            let sums_of_16 = &quantized.sums_of_16[first..];
            quantized.sums_of_32.extend(sums_of_16.chunks_exact(2).map(|pair| (pair[0] + pair[1]) as i16));
        } else {
            let amax = block.iter().fold(0f32, |amax, &x| amax.max(x.abs()));
            let scale = amax / 127.0;
            let inverse_scale = if scale != 0.0 { 1.0 / scale } else { 0.0 };
            for (q, &x) in quants.iter_mut().zip(block) {
                *q = (x * inverse_scale).round() as i8;
            }
            quantized.scales.push(f16_to_f32(f32_to_f16(scale)));
            let sum: i32 = quants.iter().map(|&q| q as i32).sum();
            quantized.block_sums.push(sum);
            if scheme == ActivationScheme::Q8_1 {
                quantized.sums.push(f16_to_f32(f32_to_f16(sum as f32 * scale)));
            }
        }
    }
    quantized
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_rounds_ties_away_from_zero_and_q8_k_to_even() {
        // amax 127: scale 1, so x / d is x itself.
        let mut values = vec![0f32; 32];
        (values[0], values[1], values[2]) = (127.0, 2.5, -2.5);
        let q8_0 = quantize_activations(ActivationScheme::Q8_0, &values);
        assert_eq!((q8_0.scales[0], q8_0.quants[1], q8_0.quants[2]), (1.0, 3, -3));
        let mut values = vec![0f32; 256];
        (values[0], values[1], values[2]) = (-127.0, 2.5, -2.5);
        let q8_k = quantize_activations(ActivationScheme::Q8_K, &values);
        assert_eq!((q8_k.scales[0], q8_k.quants[0], q8_k.quants[1], q8_k.quants[2]), (1.0, -127, 2, -2));
        assert_eq!(q8_k.sums_of_16[0], -127);
    }

    #[test]
    fn zero_blocks_quantize_to_zero() {
        let q8_1 = quantize_activations(ActivationScheme::Q8_1, &[0.0; 64]);
        assert_eq!((q8_1.scales.clone(), q8_1.sums.clone()), (vec![0.0; 2], vec![0.0; 2]));
        assert!(q8_1.quants.iter().all(|&q| q == 0));
    }
}
