//! ggml's block formats, byte for byte as ggml-common.h defines them (little-endian), and their
//! dequantization to float32 in ggml's (and gguf-py's) order of float operations.

use crate::errors::{Error, Result};

/// The weight formats kept quantized. Names and layouts are ggml's.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    /// 32 elements: f16 d, 16 bytes of 4-bit q (low nibbles elements 0-15, high 16-31); d * (q - 8).
    Q4_0,
    /// 32 elements: f16 d, f16 m, 16 bytes of 4-bit q (as Q4_0); d * q + m.
    Q4_1,
    /// 32 elements: f16 d, 32 int8 q; d * q.
    Q8_0,
    /// 256 elements: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
    /// 128 bytes of 4-bit q; (d * scale) * q - dmin * min.
    Q4_K,
    /// 256 elements: f16 d, f16 dmin, Q4_K's 12 bytes of scales and mins, 32 bytes of high bits
    /// (bit j of byte l: element 32j + l), 128 bytes of low 4 bits (as Q4_K's q); (d * scale) * q -
    /// dmin * min.
    Q5_K,
    /// 256 elements: 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales for
    /// sub-blocks of 16, f16 d; (d * scale) * (q - 32).
    Q6_K,
}

impl GgmlType {
    pub const ALL: [GgmlType; 6] =
        [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K];

    /// The type named as ggml (and gguf-py's `GGMLQuantizationType`) names it, e.g. "Q4_1".
    pub fn from_name(name: &str) -> Result<GgmlType> {
        GgmlType::ALL.into_iter().find(|ty| ty.name() == name).ok_or_else(|| Error::InvalidConfig {
            field: "ggml_type",
            message: format!("must be one of Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, got {name:?}"),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
        }
    }

    /// Elements per block.
    pub fn block_len(self) -> usize {
        match self {
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => 32,
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q8_0 => 34,
            GgmlType::Q4_K => 144,
            GgmlType::Q5_K => 176,
            GgmlType::Q6_K => 210,
        }
    }

    /// Whether a K-quant's blocks have mins (Q4_K, Q5_K): a term taken off the scaled total.
    pub fn has_mins(self) -> bool {
        matches!(self, GgmlType::Q4_K | GgmlType::Q5_K)
    }

    /// Bytes of one weight row of `in_features` elements; an error unless whole blocks.
    pub fn row_bytes(self, in_features: usize) -> Result<usize> {
        if in_features == 0 || !in_features.is_multiple_of(self.block_len()) {
            return Err(Error::InvalidConfig {
                field: "in_features",
                message: format!(
                    "{} blocks hold {} elements, and {in_features} is not a positive multiple of it",
                    self.name(),
                    self.block_len()
                ),
            });
        }
        Ok(in_features / self.block_len() * self.block_bytes())
    }
}

/// IEEE half to float (exact).
#[inline(always)]
pub fn f16_to_f32(half: u16) -> f32 {
    let sign = ((half as u32) & 0x8000) << 16;
    let exponent = ((half >> 10) & 0x1f) as u32;
    let mantissa = (half & 0x3ff) as u32;
    let magnitude = match exponent {
        0 => (mantissa as f32 * (1.0 / 16_777_216.0)).to_bits(), // subnormal: mantissa * 2^-24
        31 => 0x7f80_0000 | (mantissa << 13),
        _ => ((exponent + 112) << 23) | (mantissa << 13),
    };
    f32::from_bits(sign | magnitude)
}

/// Float to IEEE half, rounded to nearest even (F16C's and numpy's rounding): ggml's portable
/// GGML_FP32_TO_FP16, from Maratyszcza's FP16 library.
pub fn f32_to_f16(value: f32) -> u16 {
    let scale_to_inf = f32::from_bits(0x7780_0000); // 2^112
    let scale_to_zero = f32::from_bits(0x0880_0000); // 2^-110
    let mut base = (value.abs() * scale_to_inf) * scale_to_zero;
    let bits = value.to_bits();
    let shl1 = bits.wrapping_add(bits);
    let sign = bits & 0x8000_0000;
    let bias = (shl1 & 0xff00_0000).max(0x7100_0000);
    base += f32::from_bits((bias >> 1) + 0x0780_0000);
    let base_bits = base.to_bits();
    let nonsign = ((base_bits >> 13) & 0x7c00) + (base_bits & 0x0fff);
    ((sign >> 16) | if shl1 > 0xff00_0000 { 0x7e00 } else { nonsign }) as u16
}

#[inline(always)]
pub(crate) fn f16_at(bytes: &[u8], offset: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([bytes[offset], bytes[offset + 1]]))
}

/// Q4_K's 6-bit scale and min of sub-block `j` (ggml's get_scale_min_k4).
#[inline(always)]
pub(crate) fn q4_k_scale_min(j: usize, scales: &[u8]) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        ((scales[j + 4] & 0xf) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4))
    }
}

/// Q4_K's (4-bit) or Q5_K's (5-bit) value of element `e` (0..256) of a block.
#[inline(always)]
pub(crate) fn q4_k_or_q5_k_value(ty: GgmlType, block: &[u8], e: usize) -> u8 {
    let (sub_block, l) = (e / 32, e % 32);
    let quants = if ty == GgmlType::Q5_K { &block[48..176] } else { &block[16..144] };
    let low = (quants[32 * (sub_block / 2) + l] >> (4 * (sub_block % 2))) & 0xf;
    if ty == GgmlType::Q5_K {
        low | (((block[16 + l] >> sub_block) & 1) << 4)
    } else {
        low
    }
}

/// Q6_K's 6-bit value of element `e` (0..256) of a block, before the -32 offset.
#[inline(always)]
pub(crate) fn q6_k_value(block: &[u8], e: usize) -> u8 {
    let (half, within) = (e / 128, e % 128);
    let (quarter, l) = (within / 32, within % 32);
    let low_bytes = &block[64 * half..];
    let high_byte = block[128 + 32 * half + l];
    let low = if quarter % 2 == 0 { low_bytes[l] } else { low_bytes[l + 32] };
    let low = if quarter < 2 { low & 0xf } else { low >> 4 };
    low | (((high_byte >> (2 * quarter)) & 3) << 4)
}

/// Writes the `ty.block_len()` values of one block.
#[inline(always)]
pub fn dequantize_block(ty: GgmlType, block: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let d = f16_at(block, 0);
            let (min, quants) =
                if ty == GgmlType::Q4_1 { (f16_at(block, 2), &block[4..20]) } else { (0.0, &block[2..18]) };
            for (j, &byte) in quants.iter().enumerate() {
                let (low, high) = ((byte & 0xf) as f32, (byte >> 4) as f32);
                if ty == GgmlType::Q4_1 {
                    (out[j], out[j + 16]) = (d * low + min, d * high + min);
                } else {
                    (out[j], out[j + 16]) = (d * (low - 8.0), d * (high - 8.0));
                }
            }
        }
        GgmlType::Q8_0 => {
            let d = f16_at(block, 0);
            for (value, &q) in out.iter_mut().zip(&block[2..34]) {
                *value = d * (q as i8) as f32;
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let (d, dmin, scales) = (f16_at(block, 0), f16_at(block, 2), &block[4..16]);
            let (fifth_bits, quants) =
                (&block[16..48], if ty == GgmlType::Q5_K { &block[48..176] } else { &block[16..144] });
            for (sub_block, values) in out[..256].chunks_exact_mut(32).enumerate() {
                let (scale, min) = q4_k_scale_min(sub_block, scales);
                let (scale, min) = (d * scale as f32, dmin * min as f32);
                let nibbles = &quants[32 * (sub_block / 2)..32 * (sub_block / 2) + 32];
                for ((value, &byte), &high) in values.iter_mut().zip(nibbles).zip(fifth_bits) {
                    let mut q = (byte >> (4 * (sub_block % 2))) & 0xf;
                    if ty == GgmlType::Q5_K {
                        q |= ((high >> sub_block) & 1) << 4;
                    }
                    *value = scale * q as f32 - min;
                }
            }
        }
        GgmlType::Q6_K => {
            let d = f16_at(block, 208);
            for (chunk, values) in out[..256].chunks_exact_mut(32).enumerate() {
                let (half, quarter) = (chunk / 4, chunk % 4);
                let low = &block[64 * half + 32 * (quarter % 2)..][..32];
                let high = &block[128 + 32 * half..][..32];
                let (low_shift, high_shift) = (4 * (quarter / 2), 2 * quarter);
                for (l, value) in values.iter_mut().enumerate() {
                    let q = ((low[l] >> low_shift) & 0xf) | (((high[l] >> high_shift) & 3) << 4);
                    let scale = block[192 + 2 * chunk + l / 16] as i8;
                    *value = (d * scale as f32) * (q as i32 - 32) as f32;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_conversions_round_trip_and_round_to_nearest_even() {
        for half in 0..=u16::MAX {
            let value = f16_to_f32(half);
            if !value.is_nan() {
                assert_eq!(f32_to_f16(value), half, "{half:#x}");
            }
        }
        assert_eq!(f32_to_f16(1.0 + 1.0 / 2048.0), 0x3c00); // tie to even (down)
        assert_eq!(f32_to_f16(1.0 + 3.0 / 2048.0), 0x3c02); // tie to even (up)
        assert_eq!(f32_to_f16(1e6), 0x7c00);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
    }

    #[test]
    fn row_bytes_checks_whole_blocks() {
        assert_eq!(GgmlType::Q4_1.row_bytes(576).unwrap(), 18 * 20);
        assert_eq!(GgmlType::Q6_K.row_bytes(512).unwrap(), 2 * 210);
        assert!(GgmlType::Q4_K.row_bytes(576).is_err());
        assert!(GgmlType::Q8_0.row_bytes(0).is_err());
        assert_eq!(GgmlType::from_name("Q5_K").unwrap().row_bytes(512).unwrap(), 2 * 176);
        assert!(GgmlType::from_name("Q3_K").is_err());
    }

    #[test]
    fn q4_0_and_q8_0_decode_their_nibbles_and_bytes() {
        let mut block = vec![0u8; 18];
        block[..2].copy_from_slice(&f32_to_f16(0.5).to_le_bytes());
        block[2] = 0xf1; // element 0: 1, element 16: 15
        let mut out = [0f32; 32];
        dequantize_block(GgmlType::Q4_0, &block, &mut out);
        assert_eq!((out[0], out[16], out[1]), (-3.5, 3.5, -4.0));
        let mut block = vec![0u8; 34];
        block[..2].copy_from_slice(&f32_to_f16(2.0).to_le_bytes());
        block[2 + 31] = (-128i8) as u8;
        dequantize_block(GgmlType::Q8_0, &block, &mut out);
        assert_eq!((out[31], out[0]), (-256.0, 0.0));
    }
}
