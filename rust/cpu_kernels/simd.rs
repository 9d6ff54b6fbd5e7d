//! What the CPU kernels share: their element types (float32, bfloat16; the float8 cache formats
//! are in fp8.rs), the instruction sets they are built for, and an exp the compiler can vectorize.

/// Which element type an `Element` is: picks the SIMD load that widens it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElementKind {
    F32,
    Bf16,
    Fp8E4m3,
    Fp8E5m2,
}

/// An element type of the CPU kernels' tensors: math is float32, values are widened as they are
/// read and rounded (to nearest even, as torch) as they are written.
pub trait Element: Copy + Send + Sync {
    const KIND: ElementKind;
    fn to_f32(self) -> f32;
    fn from_f32(value: f32) -> Self;
}

impl Element for f32 {
    const KIND: ElementKind = ElementKind::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        value
    }
}

/// A bfloat16 value: the upper 16 bits of an f32 (torch.bfloat16's layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Element for Bf16 {
    const KIND: ElementKind = ElementKind::Bf16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
    /// Rounds to nearest even, as torch does (NaN stays NaN).
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        let bits = value.to_bits();
        let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
        // Both computed, then selected: a branch here would keep loops from vectorizing.
        Bf16(if value.is_nan() { ((bits >> 16) | 0x40) as u16 } else { rounded })
    }
}

/// Instruction sets the kernel is compiled for (wheels target baseline x86-64, whose SSE2 is a
/// quarter of AVX-512's width and has no fused multiply-add), picked at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Portable,
    Avx2Fma,
    Avx512,
}

impl Isa {
    /// The widest this CPU runs.
    pub fn best() -> Isa {
        [Isa::Avx512, Isa::Avx2Fma].into_iter().find(|isa| isa.is_supported()).unwrap_or(Isa::Portable)
    }

    pub fn is_supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        let fma = std::is_x86_feature_detected!("fma");
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => fma && std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                fma && std::is_x86_feature_detected!("avx2")
                    && std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("f16c")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// e^x for x <= 0 in straight-line code the compiler vectorizes (libm's expf is a call per
/// element): x = n ln2 + r with |r| <= ln2/2, e^r by Cephes' degree-6 polynomial (relative
/// error ~1e-7, as expf), times 2^n built in the exponent bits. Below -87 (and for NaN) it
/// returns e^-87 (~1.6e-38: nothing next to a softmax's max of 1, and 2^n stays a normal
/// float); above 0 it returns 1.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    #[allow(clippy::manual_clamp)] // clamp() would keep a NaN, and n must stay in range
    let x = x.max(-87.0).min(0.0);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e_r = p * r * r + r + 1.0;
    // SAFETY: n is an integer in [-126, 0], as x is in [-87, 0]. Unchecked, the conversion
    // vectorizes; `as` (which saturates) goes scalar.
    let n = unsafe { n.to_int_unchecked::<i32>() };
    e_r * f32::from_bits(((n + 127) << 23) as u32)
}

/// Runs `body` compiled for the widest instruction set (the wheel's baseline is SSE2).
#[inline(always)]
pub(crate) fn with_isa<R>(isa: Isa, body: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn avx512<R>(body: impl FnOnce() -> R) -> R {
            body()
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2<R>(body: impl FnOnce() -> R) -> R {
            body()
        }
        // SAFETY: `Isa::best()` only names instruction sets this CPU runs.
        match isa {
            Isa::Avx512 => return unsafe { avx512(body) },
            Isa::Avx2Fma => return unsafe { avx2(body) },
            Isa::Portable => {}
        }
    }
    let _ = isa;
    body()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(Bf16::from_f32(1.0).0, 0x3f80);
        assert_eq!(Bf16::from_f32(f32::from_bits(0x3f80_8000)).0, 0x3f80); // tie, even stays
        assert_eq!(Bf16::from_f32(f32::from_bits(0x3f81_8000)).0, 0x3f82); // tie, odd rounds up
        assert_eq!(Bf16::from_f32(f32::from_bits(0x3f80_8001)).0, 0x3f81);
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
        assert_eq!(Bf16::from_f32(-2.5).to_f32(), -2.5);
    }

    #[test]
    fn exp_matches_libm_on_softmax_inputs() {
        for i in 0..=200_000 {
            let x = -(i as f32) * 1e-3; // 0 down to -200
            let (got, want) = (exp_nonpositive(x), (x as f64).exp());
            let tolerance = 2e-7 * want + 2e-38; // a few ulps; below -87, e^-87 ~ 1.6e-38 stands for ~0
            assert!((got as f64 - want).abs() <= tolerance, "exp({x}) = {got}, want {want}");
        }
    }
}
