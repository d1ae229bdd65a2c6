//! Sine, cosine and square root over slices of `f64` in straight-line code the compiler
//! vectorises, instead of one libm call per value.
//!
//! `perf` put libm's `sin` and `cos` at a third of the haversine query. Here each value is
//! reduced to `[-pi/4, pi/4]` (Cody-Waite, the quadrant from a rounding by magic-number
//! addition) and evaluated with Cephes' minimax polynomials, with selects instead of branches,
//! so a loop over a block compiles to SIMD: SSE2 everywhere, AVX2 where the CPU has it (chosen
//! at run time; no fused multiply-add, so both give the same bits). Results agree with libm
//! within a few units in the last place (the test measures it). A value's result never depends
//! on where it sits in a slice, so the fused program and the per-node kernels, which slice
//! columns differently, agree bit for bit. Arguments the reduction cannot take exactly (|x| of
//! 2^20 or more), infinities and NaN go to libm.

// Cephes' constants are kept digit for digit as published.
#![allow(clippy::excessive_precision)]

use crate::guest_api::wit::UnaryOp;

/// Arguments up to this magnitude are reduced exactly.
const EXACT_BELOW: f64 = (1u64 << 20) as f64;
/// Adding and subtracting 1.5 x 2^52 rounds a double below 2^51 to the nearest even integer, and
/// leaves that integer in the low bits of the sum.
const ROUNDING_MAGIC: f64 = 6_755_399_441_055_744.0;
/// pi/2 in three parts; the first two have few enough bits that `y * part` is exact.
const PIO2_1: f64 = 1.570_796_310_901_641_845_703_125;
const PIO2_2: f64 = 1.589_325_471_229_585_672_84e-8;
const PIO2_3: f64 = 6.123_233_995_736_766_035_87e-17;
/// Cephes' `sin` and `cos` polynomials on `[-pi/4, pi/4]`, highest power first.
const SIN: [f64; 6] = [
    1.589_623_015_765_465_680_60e-10,
    -2.505_074_776_285_780_728_66e-8,
    2.755_731_362_138_572_452_13e-6,
    -1.984_126_982_958_953_859_96e-4,
    8.333_333_333_322_118_588_78e-3,
    -1.666_666_666_666_663_072_95e-1,
];
const COS: [f64; 6] = [
    -1.135_853_652_138_768_173_00e-11,
    2.087_570_084_197_473_167_78e-9,
    -2.755_731_417_929_673_881_12e-7,
    2.480_158_728_885_170_453_48e-5,
    -1.388_888_888_887_305_641_16e-3,
    4.166_666_666_666_659_292_18e-2,
];

/// Writes `op` of every value of `src` into `dst` (as long as `src`); `false` when `op` is not
/// one of the functions done here (the caller then uses libm).
pub fn apply(op: UnaryOp, src: &[f64], dst: &mut [f64]) -> bool {
    let cosine = match op {
        UnaryOp::Sin => false,
        UnaryOp::Cos => true,
        UnaryOp::Sqrt => {
            // One instruction per lane once inlined into a loop, rather than a call per value
            // through a function pointer; correctly rounded either way, so the same bits.
            for (d, s) in dst.iter_mut().zip(src) {
                *d = s.sqrt();
            }
            return true;
        }
        _ => return false,
    };
    let dst = &mut dst[..src.len()];
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        unsafe { trig_avx2(src, dst, cosine) };
        return true;
    }
    trig(src, dst, cosine);
    true
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn trig_avx2(src: &[f64], dst: &mut [f64], cosine: bool) {
    trig(src, dst, cosine)
}

#[inline(always)]
fn trig(src: &[f64], dst: &mut [f64], cosine: bool) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = sin_or_cos(x, cosine);
    }
    // The rare arguments the reduction cannot take: libm, in a second pass so the first stays
    // branch-free.
    if src.iter().any(|x| needs_libm(*x)) {
        for (d, &x) in dst.iter_mut().zip(src) {
            if needs_libm(x) {
                *d = if cosine { x.cos() } else { x.sin() };
            }
        }
    }
}

/// Whether the reduction cannot take `x` exactly (NaN and infinities included).
#[inline(always)]
fn needs_libm(x: f64) -> bool {
    x.abs().partial_cmp(&EXACT_BELOW) != Some(std::cmp::Ordering::Less)
}

#[inline(always)]
fn polynomial(x: f64, coefficients: &[f64; 6]) -> f64 {
    coefficients.iter().fold(0.0, |acc, c| acc * x + c)
}

#[inline(always)]
fn sin_or_cos(x: f64, cosine: bool) -> f64 {
    let xa = x.abs();
    let shifted = xa * std::f64::consts::FRAC_2_PI + ROUNDING_MAGIC;
    let quadrant = shifted.to_bits() + u64::from(cosine);
    let y = shifted - ROUNDING_MAGIC;
    let r = ((xa - y * PIO2_1) - y * PIO2_2) - y * PIO2_3;
    let r2 = r * r;
    let s = r + r * r2 * polynomial(r2, &SIN);
    let c = 1.0 - 0.5 * r2 + r2 * r2 * polynomial(r2, &COS);
    let value = if quadrant & 1 == 1 { c } else { s };
    // sin is odd, cos even; the quadrant's second bit flips the sign.
    let flip = ((quadrant >> 1) & 1) ^ u64::from(!cosine && x.is_sign_negative());
    f64::from_bits(value.to_bits() ^ (flip << 63))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How many representable doubles lie between `a` and `b`.
    fn ulps(a: f64, b: f64) -> u64 {
        let key = |v: f64| {
            let bits = v.to_bits() as i64;
            bits ^ ((((bits >> 63) as u64) >> 1) as i64)
        };
        key(a).abs_diff(key(b))
    }

    /// Deterministic values spread over `[-range, range]`, with the edges and special values.
    fn values(range: f64) -> Vec<f64> {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut out: Vec<f64> = (0..200_001)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * range
            })
            .collect();
        out.extend([
            0.0,
            -0.0,
            range,
            -range,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ]);
        out
    }

    fn worst(op: UnaryOp, scalar: fn(f64) -> f64, input: &[f64]) -> u64 {
        let mut out = vec![0.0; input.len()];
        assert!(apply(op, input, &mut out));
        input
            .iter()
            .zip(&out)
            .map(|(x, y)| {
                let expected = scalar(*x);
                if expected.is_nan() {
                    assert!(y.is_nan(), "{op:?}({x}) = {y}, libm says NaN");
                    0
                } else {
                    ulps(expected, *y)
                }
            })
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn results_stay_within_a_few_ulps_of_libm() {
        for range in [1.0, 10.0, 1_000.0, 1e6, 1e12] {
            let input = values(range);
            let (sin, cos) = (
                worst(UnaryOp::Sin, f64::sin, &input),
                worst(UnaryOp::Cos, f64::cos, &input),
            );
            assert!(
                sin <= 2 && cos <= 2,
                "range {range}: sin {sin} ulps, cos {cos}"
            );
            assert_eq!(worst(UnaryOp::Sqrt, f64::sqrt, &input), 0);
        }
    }

    #[test]
    fn a_value_gets_the_same_result_wherever_it_sits() {
        let input = values(100.0);
        let mut whole = vec![0.0; input.len()];
        apply(UnaryOp::Sin, &input, &mut whole);
        for offset in [1, 2, 3, 5] {
            let mut shifted = vec![0.0; input.len() - offset];
            apply(UnaryOp::Sin, &input[offset..], &mut shifted);
            assert!(
                shifted
                    .iter()
                    .zip(&whole[offset..])
                    .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()))
            );
        }
    }

    #[test]
    fn the_generic_and_the_avx2_code_give_the_same_bits() {
        let input = values(1e5);
        let (mut generic, mut dispatched) = (vec![0.0; input.len()], vec![0.0; input.len()]);
        trig(&input, &mut generic, false);
        apply(UnaryOp::Sin, &input, &mut dispatched);
        assert!(
            generic
                .iter()
                .zip(&dispatched)
                .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()))
        );
    }

    #[test]
    fn other_functions_are_left_to_libm() {
        assert!(!apply(UnaryOp::Asin, &[1.0], &mut [0.0]));
    }
}
