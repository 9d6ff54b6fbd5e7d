//! The float8 KV-cache formats (OCP FP8, torch.float8_e4m3fn and torch.float8_e5m2): one byte
//! per element, half a bfloat16 cache's bytes. The CPU kernels widen them to f32 as they read
//! them; `from_f32` rounds to nearest even and saturates, as the cache writes do.

use crate::cpu_kernels::simd::{Element, ElementKind};

/// float8_e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no infinities; codes 0x7F and 0xFF
/// are NaN, the largest finite value is 448.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct Fp8E4m3(pub u8);

/// float8_e5m2: the upper byte of an IEEE half (bias 15, 2 mantissa bits, infinities and NaNs);
/// the largest finite value is 57344.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct Fp8E5m2(pub u8);

/// The value of an e4m3 code, exactly. Branch-free selects, so loops over codes vectorize; no
/// f32 subnormal is produced or read, so it holds with denormals flushed too.
#[inline(always)]
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = ((code & 0x80) as u32) << 24;
    let magnitude = (code & 0x7f) as u32;
    // Exponent and mantissa moved into an f32's fields, the exponent rebiased by 127 - 7.
    let normal = (magnitude << 20) + (120 << 23);
    // Exponent 0: mantissa/8 * 2^-6.
    let subnormal = (magnitude as f32 * (1.0 / 512.0)).to_bits();
    // Magnitude 0x7f is NaN: the f32 exponent 255 (rebias 255 - 15) over a non-zero mantissa.
    let nan = (magnitude << 20) + (240 << 23);
    let bits = if magnitude < 8 {
        subnormal
    } else if magnitude == 0x7f {
        nan
    } else {
        normal
    };
    f32::from_bits(sign | bits)
}

/// The value of an e5m2 code, exactly (as `e4m3_to_f32`).
#[inline(always)]
pub fn e5m2_to_f32(code: u8) -> f32 {
    let sign = ((code & 0x80) as u32) << 24;
    let magnitude = (code & 0x7f) as u32;
    let normal = (magnitude << 21) + (112 << 23);
    // Exponent 0: mantissa/4 * 2^-14.
    let subnormal = (magnitude as f32 * (1.0 / 65536.0)).to_bits();
    // Exponent 31: infinity (mantissa 0) or NaN, as in a half.
    let special = (magnitude << 21) + (224 << 23);
    let bits = if magnitude < 4 {
        subnormal
    } else if magnitude >= 0x7c {
        special
    } else {
        normal
    };
    f32::from_bits(sign | bits)
}

/// The code nearest `value` (ties to even) of a format with `MANTISSA` mantissa bits and
/// exponent bias `BIAS`, saturating at `max_code`; NaN becomes `nan_code`.
fn narrow<const MANTISSA: u32, const BIAS: i32>(value: f32, max_code: u8, nan_code: u8) -> u8 {
    let sign = if value.is_sign_negative() { 0x80 } else { 0 };
    if value.is_nan() {
        return sign | nan_code;
    }
    let magnitude = value.abs().min(f32::MAX); // infinity saturates like any large value
                                               // Below the smallest normal exponent the spacing stays that of the subnormals.
    let exponent = (((magnitude.to_bits() >> 23) & 0xff) as i32 - 127).max(1 - BIAS);
    let quantum = 2f64.powi(exponent - MANTISSA as i32);
    let steps = (magnitude as f64 / quantum).round_ties_even() as i64;
    // steps counts quanta from the exponent's first value, 2^MANTISSA of them per exponent, so a
    // mantissa that rounds up to the next power of two carries into the exponent by itself.
    let code = (((exponent + BIAS - 1) as i64) << MANTISSA) + steps;
    sign | code.min(max_code as i64) as u8
}

impl Element for Fp8E4m3 {
    const KIND: ElementKind = ElementKind::Fp8E4m3;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        e4m3_to_f32(self.0)
    }
    fn from_f32(value: f32) -> Self {
        Fp8E4m3(narrow::<3, 7>(value, 0x7e, 0x7f))
    }
}

impl Element for Fp8E5m2 {
    const KIND: ElementKind = ElementKind::Fp8E5m2;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        e5m2_to_f32(self.0)
    }
    fn from_f32(value: f32) -> Self {
        Fp8E5m2(narrow::<2, 15>(value, 0x7b, 0x7e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A code's value from the format's definition, in f64.
    fn defined_value(code: u8, mantissa_bits: u32, bias: i32) -> f64 {
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let exponent = ((code & 0x7f) >> mantissa_bits) as i32;
        let mantissa = (code & ((1 << mantissa_bits) - 1)) as f64 / (1 << mantissa_bits) as f64;
        if exponent == 0 {
            sign * mantissa * 2f64.powi(1 - bias)
        } else {
            sign * (1.0 + mantissa) * 2f64.powi(exponent - bias)
        }
    }

    #[test]
    fn every_e4m3_code_widens_to_its_value() {
        for code in 0..=255u8 {
            let got = e4m3_to_f32(code);
            if code & 0x7f == 0x7f {
                assert!(got.is_nan(), "{code:#x}");
                continue;
            }
            assert_eq!(got as f64, defined_value(code, 3, 7), "{code:#x}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    }

    #[test]
    fn every_e5m2_code_widens_to_its_value() {
        for code in 0..=255u8 {
            let got = e5m2_to_f32(code);
            match code & 0x7f {
                0x7c => assert_eq!(got, if code & 0x80 != 0 { f32::NEG_INFINITY } else { f32::INFINITY }),
                0x7d..=0x7f => assert!(got.is_nan(), "{code:#x}"),
                _ => assert_eq!(got as f64, defined_value(code, 2, 15), "{code:#x}"),
            }
        }
        assert_eq!(e5m2_to_f32(0x7b), 57344.0);
    }

    #[test]
    fn narrowing_rounds_to_nearest_even_and_saturates() {
        for code in (0..=255u8).filter(|code| code & 0x7f < 0x7f) {
            assert_eq!(Fp8E4m3::from_f32(e4m3_to_f32(code)).0, code, "e4m3 {code:#x} round trip");
        }
        for code in (0..=255u8).filter(|code| code & 0x7f < 0x7c) {
            assert_eq!(Fp8E5m2::from_f32(e5m2_to_f32(code)).0, code, "e5m2 {code:#x} round trip");
        }
        // Between 1.0 (0x38) and 1.125 (0x39): the tie goes to the even code, past it rounds up.
        assert_eq!(Fp8E4m3::from_f32(1.0625).0, 0x38);
        assert_eq!(Fp8E4m3::from_f32(1.0626).0, 0x39);
        assert_eq!(Fp8E4m3::from_f32(1.1875).0, 0x3a); // tie between 0x39 and 0x3a: even
        assert_eq!(Fp8E4m3::from_f32(1.9999).0, 0x40); // carries into the next exponent (2.0)
        assert_eq!(Fp8E4m3::from_f32(2f32.powi(-10)).0, 0x00); // half the smallest subnormal: even (0)
        assert_eq!(Fp8E4m3::from_f32(3.0 * 2f32.powi(-10)).0, 0x02);
        assert_eq!(Fp8E4m3::from_f32(1e6).0, 0x7e);
        assert_eq!(Fp8E4m3::from_f32(-1e30).0, 0xfe);
        assert_eq!(Fp8E4m3::from_f32(f32::INFINITY).0, 0x7e);
        assert_eq!(Fp8E5m2::from_f32(1e9).0, 0x7b);
        assert!(Fp8E4m3::from_f32(f32::NAN).to_f32().is_nan());
        assert!(Fp8E5m2::from_f32(f32::NAN).to_f32().is_nan());
        assert_eq!(Fp8E4m3::from_f32(-0.0).0, 0x80);
    }

    /// No code next to `code` is nearer `value` (codes of one sign are ordered by magnitude).
    fn assert_nearest(value: f32, code: u8, widen: fn(u8) -> f32) {
        let error = (widen(code) - value).abs();
        for neighbour in [code.wrapping_sub(1), code.wrapping_add(1)] {
            let other = widen(neighbour);
            assert!(
                !other.is_finite() || (other - value).abs() >= error,
                "{value}: code {code:#x} ({}) but {neighbour:#x} ({other}) is nearer",
                widen(code)
            );
        }
    }

    #[test]
    fn narrowing_picks_the_nearest_code() {
        for i in 0..20_000 {
            let value = (i as f32 - 10_000.0) * 0.0471;
            assert_nearest(value, Fp8E4m3::from_f32(value).0, e4m3_to_f32);
            assert_nearest(value, Fp8E5m2::from_f32(value).0, e5m2_to_f32);
        }
    }
}
