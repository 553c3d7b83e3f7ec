//! Σ exp(x − m) over a row of logits, vectorized: the softmax normalizer that scoring a text
//! against a whole vocabulary needs once per position and depth (150,000 exponentials per
//! row for Qwen2.5), where a scalar `f64::exp` costs as much as the LM head's matmul.
//!
//! `exp` is computed as 2^k · p(r) with x = k·ln 2 + r, |r| ≤ ln 2 / 2, and p the degree-7
//! Taylor polynomial (relative error below 3e-7 with f32 rounding; degree 6 left a
//! truncation error of up to 1.2e-7 of one sign, which attention's softmax turned into flipped
//! near-tie tokens through the 8-bit activations), in plain f32 arithmetic
//! that the compiler vectorizes (AVX2 + FMA where the CPU has them, SSE2 otherwise). Sums
//! run in 16 f32 lanes over blocks of 1,024 values and in f64 across blocks. No crate in the
//! dependency set offers a vectorized exp on stable Rust (candle's CPU `exp` is the scalar
//! one), so it is written here.
//!
//! Beside it: Gemma's GELU through the same exp ([`gelu_tanh_mul`]), and two kernels that
//! keep candle's results bit for bit while skipping its intermediate tensors and rayon split:
//! SiLU·up ([`silu_mul`]) and the RMS norm ([`rms_norm`]).

const LOG2E: f32 = std::f32::consts::LOG2_E;
// ln 2 split so that k · LN2_HI is exact for |k| < 2^9.
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// Below this exp underflows f32's normal range; such terms are ~1e-38 and count as that.
const MIN_X: f32 = -87.0;
const LANES: usize = 16;
const BLOCK: usize = 1024;

/// e^x for x ≤ 0 (larger x are not clamped and must not be passed).
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    // `f32::max`'s NaN rule (a NaN gives MIN_X) written as a compare, which is one vector
    // max instruction.
    let x = if x > MIN_X { x } else { MIN_X };
    // Round to nearest through the 1.5 · 2^23 trick: no rounding instruction needed.
    let magic = 12_582_912.0f32;
    let shifted = x * LOG2E + magic;
    let k = shifted - magic;
    let r = x - k * LN2_HI - k * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // k is a whole number in [-126, 0]: 2^k is a normal f32 with exponent field k + 127.
    // Read k from the shifted value's low mantissa bits (it sits there as an integer) rather
    // than by `k as i32`, whose saturating conversion does not vectorize as cheaply.
    let k_int = shifted.to_bits().wrapping_sub(magic.to_bits()) as i32;
    let bits = ((k_int + 127) as u32) << 23;
    p * f32::from_bits(bits)
}

#[inline(always)]
fn sum_exp_body(xs: &[f32], m: f32) -> f64 {
    let mut total = 0f64;
    for block in xs.chunks(BLOCK) {
        let mut acc = [0f32; LANES];
        let mut chunks = block.chunks_exact(LANES);
        for c in &mut chunks {
            for (a, &x) in acc.iter_mut().zip(c) {
                *a += exp_nonpositive(x - m);
            }
        }
        total += acc.iter().map(|&a| f64::from(a)).sum::<f64>();
        total += chunks
            .remainder()
            .iter()
            .map(|&x| f64::from(exp_nonpositive(x - m)))
            .sum::<f64>();
    }
    total
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_exp_avx2(xs: &[f32], m: f32) -> f64 {
    sum_exp_body(xs, m)
}

/// The same body with 512-bit registers: the 16 lanes are one register instead of two, so the
/// same operations in the same order (the same result, bit for bit) take half the
/// instructions.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn sum_exp_avx512(xs: &[f32], m: f32) -> f64 {
    sum_exp_body(xs, m)
}

#[inline(always)]
fn softmax_body(xs: &mut [f32]) {
    let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        // Nothing finite to normalize against: the scalar definition decides (NaN or an
        // even split), as it did before this path existed.
        let mut sum = 0f32;
        for v in xs.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        let inv = 1.0 / sum;
        xs.iter_mut().for_each(|v| *v *= inv);
        return;
    }
    let inv = 1.0 / exp_shifted_body(xs, max);
    xs.iter_mut().for_each(|v| *v *= inv);
}

/// `x ← exp(x − m)` over `xs` and their sum (16 f32 lanes, fixed order), for `m` at least
/// every x (finite).
#[inline(always)]
fn exp_shifted_body(xs: &mut [f32], m: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c.iter_mut()) {
            *v = exp_nonpositive(*v - m);
            *a += *v;
        }
    }
    let mut sum = 0f32;
    for v in chunks.into_remainder() {
        *v = exp_nonpositive(*v - m);
        sum += *v;
    }
    for half in [8, 4, 2, 1] {
        for k in 0..half {
            acc[k] += acc[k + half];
        }
    }
    sum + acc[0]
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_avx2(xs: &mut [f32], m: f32) -> f32 {
    exp_shifted_body(xs, m)
}

/// See [`sum_exp_avx512`]: the same operations in one 512-bit register.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn exp_shifted_avx512(xs: &mut [f32], m: f32) -> f32 {
    exp_shifted_body(xs, m)
}

#[inline(always)]
fn max_body(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = a.max(v);
        }
    }
    let rest = chunks.remainder().iter().copied();
    acc.into_iter()
        .chain(rest)
        .fold(f32::NEG_INFINITY, f32::max)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn max_avx512(xs: &[f32]) -> f32 {
    max_body(xs)
}

/// The largest of `xs` as `f32::max` folds it (NaNs skipped; −∞ for none), in 16 lanes: a
/// scalar fold waits on each comparison in turn, which was most of a prompt pass's softmax.
/// The value is the fold's; only the sign of a zero maximum may differ.
pub fn max(xs: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd_level() >= crate::cpu::SimdLevel::Avx512 {
        // SAFETY: AVX-512 F was detected on this CPU.
        return unsafe { max_avx512(xs) };
    }
    max_body(xs)
}

/// `x ← exp(x − m)` over `xs`, returning their sum: a softmax's numerators and normalizer
/// for `m` the row's (finite) maximum, through the vectorized exp, summed in a fixed order.
pub fn exp_shifted_in_place(xs: &mut [f32], m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd_level() >= crate::cpu::SimdLevel::Avx512 {
        // SAFETY: AVX-512 F (with AVX2 and FMA) was detected on this CPU.
        return unsafe { exp_shifted_avx512(xs, m) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd_level() >= crate::cpu::SimdLevel::Avx2 {
        // SAFETY: AVX2 and FMA were detected on this CPU (every level from Avx2 up has them).
        return unsafe { exp_shifted_avx2(xs, m) };
    }
    exp_shifted_body(xs, m)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_avx2(xs: &mut [f32]) {
    softmax_body(xs)
}

/// `xs` replaced by its softmax: exponentials through the vectorized exp, summed in 16 f32
/// lanes in a fixed order (so a row's result depends only on the row).
pub fn softmax_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd_level() >= crate::cpu::SimdLevel::Avx2 {
        // SAFETY: AVX2 and FMA were detected on this CPU (every level from Avx2 up has them).
        return unsafe { softmax_avx2(xs) };
    }
    softmax_body(xs)
}

/// Σ exp(x − m) over `xs`, for `m` at least every x (the row's maximum), in f64.
pub fn sum_exp(xs: &[f32], m: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd_level() >= crate::cpu::SimdLevel::Avx512 {
        // SAFETY: AVX-512 F (with AVX2 and FMA) was detected on this CPU.
        return unsafe { sum_exp_avx512(xs, m) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd_level() >= crate::cpu::SimdLevel::Avx2 {
        // SAFETY: AVX2 and FMA were detected on this CPU (every level from Avx2 up has them).
        return unsafe { sum_exp_avx2(xs, m) };
    }
    sum_exp_body(xs, m)
}

/// √(2/π), as candle's GELU takes it.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// GELU with the tanh approximation (Gemma's MLP activation), through the vectorized exp:
/// with u = √(2/π)·x·(1 + 0.044715·x²) and t = e^(−2|u|) ≤ 1,
/// 0.5·x·(1 + tanh u) = x / (1 + t) for u ≥ 0 and x·t / (1 + t) for u < 0. Both forms avoid
/// the cancellation of 1 + tanh u for negative u. libm's `tanhf` per element (candle's GELU)
/// took a tenth of a Gemma 3 prompt pass.
#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x);
    let t = exp_nonpositive(-2.0 * u.abs());
    let num = if u >= 0.0 { x } else { x * t };
    num / (1.0 + t)
}

#[inline(always)]
fn gelu_tanh_mul_body(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = gelu_tanh(*g) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_tanh_mul_avx2(gate: &mut [f32], up: &[f32]) {
    gelu_tanh_mul_body(gate, up)
}

/// See [`sum_exp_avx512`]: the same operations in 512-bit registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn gelu_tanh_mul_avx512(gate: &mut [f32], up: &[f32]) {
    gelu_tanh_mul_body(gate, up)
}

/// `gate[i] = gelu_tanh(gate[i]) * up[i]`, the gated MLP's activation in one pass, in place;
/// the same bits on every instruction set, large inputs spread over the pool's threads. The
/// two slices must have the same length.
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    fn body(gate: &mut [f32], up: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::simd_level() >= crate::cpu::SimdLevel::Avx512 {
            // SAFETY: AVX-512 F (with AVX2 and FMA) was detected on this CPU.
            return unsafe { gelu_tanh_mul_avx512(gate, up) };
        }
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::simd_level() >= crate::cpu::SimdLevel::Avx2 {
            // SAFETY: AVX2 and FMA were detected on this CPU (every level from Avx2 up has
            // them).
            return unsafe { gelu_tanh_mul_avx2(gate, up) };
        }
        gelu_tanh_mul_body(gate, up)
    }
    gated_over_pool(gate, up, body)
}

/// Values above which the gated activations are split over the pool's threads.
const PARALLEL_MIN_GATED: usize = 1 << 15;

/// `body(gate, up)` on equal runs of both, over the pool's threads for large inputs (each
/// element's result depends on its own inputs only, so the split changes no bit).
fn gated_over_pool(gate: &mut [f32], up: &[f32], body: fn(&mut [f32], &[f32])) {
    assert_eq!(gate.len(), up.len(), "gate and up lengths");
    if gate.len() < PARALLEL_MIN_GATED {
        return body(gate, up);
    }
    let per = gate.len().div_ceil(crate::pool::global().threads() * 4);
    // Each task writes its own run (taken through a lock it alone uses).
    let parts: Vec<std::sync::Mutex<&mut [f32]>> =
        gate.chunks_mut(per).map(std::sync::Mutex::new).collect();
    crate::pool::run(parts.len(), &|t| {
        if let Ok(mut g) = parts[t].lock() {
            let at = t * per;
            let n = g.len();
            body(&mut g, &up[at..at + n]);
        }
    });
}

/// `gate[i] = silu(gate[i]) * up[i]` in place, with candle's SiLU, `x / (1 + e^(−x))` through
/// libm's `expf`, bit for bit: one pass over both, no intermediate tensors, large inputs
/// spread over the pool's threads (candle maps it on one thread, then allocates the product).
/// libm rather than the vectorized exp: a vectorized SiLU as accurate on exact weights moved
/// the 8-bit-activation comparison with candle's quantized llama from 57 to 52 of 64 argmax
/// agreements. The two slices must have the same length.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    fn body(gate: &mut [f32], up: &[f32]) {
        for (g, &u) in gate.iter_mut().zip(up) {
            *g = *g / (1.0 + (-*g).exp()) * u;
        }
    }
    gated_over_pool(gate, up, body)
}

/// Rows whose sums of squares [`rms_norm`] runs side by side.
const NORM_ROWS: usize = 8;

#[inline(always)]
fn rms_norm_body(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (xs, os) in x.chunks(NORM_ROWS * n).zip(out.chunks_mut(NORM_ROWS * n)) {
        // Each row's squares summed one after another from the first, candle's order; the
        // rows' chains are independent, so eight of them overlap in the pipeline.
        let rows = xs.len() / n;
        let mut sums = [0f32; NORM_ROWS];
        if rows == NORM_ROWS {
            for i in 0..n {
                for (r, s) in sums.iter_mut().enumerate() {
                    let v = xs[r * n + i];
                    *s += v * v;
                }
            }
        } else {
            for (s, xr) in sums.iter_mut().zip(xs.chunks_exact(n)) {
                for &v in xr {
                    *s += v * v;
                }
            }
        }
        for ((xr, or), &sum) in xs.chunks_exact(n).zip(os.chunks_exact_mut(n)).zip(&sums) {
            let m = (sum / n as f32 + eps).sqrt();
            for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
                *o = v / m * w;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rms_norm_avx2(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    rms_norm_body(x, weight, eps, out)
}

/// See [`sum_exp_avx512`]: the same operations in 512-bit registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn rms_norm_avx512(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    rms_norm_body(x, weight, eps, out)
}

/// RMS norm of each row of `x` (rows of `weight.len()` values):
/// `out = x / sqrt(mean(x²) + eps) · weight`, candle's formula and summation order, bit for
/// bit. candle sums a row's squares one element at a time (a chain of dependent adds) and
/// spreads more than 32 rows over rayon's threads beside the engine's own; here eight rows'
/// chains run side by side on the caller's thread. The same bits on every instruction set.
/// `x` and `out` must have the same length, a multiple of the row's.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert!(
        x.len() == out.len() && !weight.is_empty() && x.len().is_multiple_of(weight.len()),
        "rows, weight and output lengths"
    );
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd_level() >= crate::cpu::SimdLevel::Avx512 {
        // SAFETY: AVX-512 F (with AVX2 and FMA) was detected on this CPU.
        return unsafe { rms_norm_avx512(x, weight, eps, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd_level() >= crate::cpu::SimdLevel::Avx2 {
        // SAFETY: AVX2 and FMA were detected on this CPU (every level from Avx2 up has them).
        return unsafe { rms_norm_avx2(x, weight, eps, out) };
    }
    rms_norm_body(x, weight, eps, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_3e_7_relative() {
        let mut worst = 0f64;
        let mut x = 0f32;
        while x > -80.0 {
            let got = f64::from(exp_nonpositive(x));
            let want = f64::from(x).exp();
            worst = worst.max((got - want).abs() / want);
            x -= 0.001_37;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert!(exp_nonpositive(f32::NEG_INFINITY) < 1e-37);
    }

    #[test]
    fn max_is_the_scalar_fold_on_every_path() {
        let fold = |xs: &[f32]| xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for n in [0usize, 1, 15, 16, 17, 100, 1031] {
            let mut xs: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 4001) as f32 / 200.0 - 10.0)
                .collect();
            for case in 0..4 {
                match (case, n) {
                    (1, 1..) => xs[n / 2] = f32::NAN,
                    (2, 1..) => xs[n - 1] = 1e30,
                    (3, 1..) => xs.iter_mut().for_each(|x| *x = f32::NAN),
                    _ => {}
                }
                let want = fold(&xs);
                for got in [max(&xs), max_body(&xs)] {
                    assert_eq!(got.to_bits(), want.to_bits(), "n {n} case {case}");
                }
            }
        }
    }

    #[test]
    fn softmax_matches_the_f64_definition() {
        for n in [1usize, 3, 16, 17, 100, 1024, 1031] {
            let xs: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 4001) as f32 / 200.0 - 10.0)
                .collect();
            let m = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let z: f64 = xs
                .iter()
                .map(|&x| (f64::from(x) - f64::from(m)).exp())
                .sum();
            let mut got = xs.clone();
            softmax_in_place(&mut got);
            let mut portable = xs.clone();
            softmax_body(&mut portable);
            assert_eq!(got, portable, "n {n}: the same result on every path");
            for (g, &x) in got.iter().zip(&xs) {
                let want = (f64::from(x) - f64::from(m)).exp() / z;
                assert!(
                    (f64::from(*g) - want).abs() <= 2e-6 * want + 1e-12,
                    "n {n}: {g} vs {want}"
                );
            }
        }
        // A row of −∞ (every key masked) keeps the scalar definition's NaN.
        let mut masked = vec![f32::NEG_INFINITY; 4];
        softmax_in_place(&mut masked);
        assert!(masked.iter().all(|v| v.is_nan()));
    }

    #[test]
    fn shifted_exponentials_are_the_same_bits_on_every_path() {
        for n in [1usize, 15, 16, 17, 256, 1000] {
            let xs: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 4001) as f32 / 100.0 - 30.0)
                .collect();
            let m = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let (mut body, mut got) = (xs.clone(), xs.clone());
            let want = exp_shifted_body(&mut body, m);
            let sum = exp_shifted_in_place(&mut got, m);
            assert_eq!(sum.to_bits(), want.to_bits(), "n {n}");
            assert!(got
                .iter()
                .zip(&body)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                let mut avx2 = xs.clone();
                // SAFETY: just detected.
                let s2 = unsafe { exp_shifted_avx2(&mut avx2, m) };
                assert_eq!(s2.to_bits(), want.to_bits(), "n {n}: AVX2");
                assert!(avx2
                    .iter()
                    .zip(&body)
                    .all(|(a, b)| a.to_bits() == b.to_bits()));
            }
        }
    }

    #[test]
    fn sums_equal_f64_sums() {
        for n in [0usize, 1, 15, 16, 17, 1023, 1024, 1025, 150_000] {
            let xs: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 4001) as f32 / 100.0 - 30.0)
                .collect();
            let m = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let m = if m.is_finite() { m } else { 0.0 };
            let want: f64 = xs
                .iter()
                .map(|&x| (f64::from(x) - f64::from(m)).exp())
                .sum();
            let got = sum_exp(&xs, m);
            assert!(
                (got - want).abs() <= 1e-6 * want.max(f64::MIN_POSITIVE),
                "n {n}: {got} vs {want}"
            );
            assert_eq!(
                sum_exp_body(&xs, m),
                got,
                "n {n}: the same sum on every path"
            );
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                // SAFETY: just detected.
                let avx2 = unsafe { sum_exp_avx2(&xs, m) };
                assert_eq!(avx2.to_bits(), got.to_bits(), "n {n}: AVX2 path");
            }
        }
    }

    #[test]
    fn gelu_is_within_its_bound_and_the_same_bits_on_every_path() {
        let xs: Vec<f32> = (0..48_001).map(|i| i as f32 / 2000.0 - 12.0).collect();
        let ups: Vec<f32> = xs.iter().map(|x| 1.0 + x / 16.0).collect();
        // Large enough to be split over the pool.
        assert!(xs.len() > PARALLEL_MIN_GATED);
        let mut got = xs.clone();
        gelu_tanh_mul(&mut got, &ups);
        let mut portable = xs.clone();
        gelu_tanh_mul_body(&mut portable, &ups);
        assert!(got
            .iter()
            .zip(&portable)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        let mut worst = 0f64;
        for ((&x, &u), &g) in xs.iter().zip(&ups).zip(&got) {
            let x64 = f64::from(x);
            let inner = 0.797_884_560_802_865_4 * x64 * (1.0 + 0.044715 * x64 * x64);
            // 0.5·x·(1 + tanh u) written as x / (1 + e^(−2u)): exact in f64 where 1 + tanh u
            // would cancel to zero.
            let want = x64 / (1.0 + (-2.0 * inner).exp()) * f64::from(u);
            let err = (f64::from(g) - want).abs();
            // 1e-6 relative, plus f32's rounding of u amplified by the exponential in the
            // negative tail (d e^(2u) / e^(2u) = 2 du), where the values are below 1e-20.
            let bound = (1e-6 + 6e-7 * inner.abs()) * want.abs() + 1e-30;
            assert!(err <= bound, "x {x}: {g} vs {want}");
            if want != 0.0 {
                worst = worst.max(err / want.abs());
            }
        }
        assert!(worst > 0.0, "the comparison ran");
        assert_eq!(gelu_tanh(0.0), 0.0);
        // Far tails: the identity above and zero below.
        assert_eq!(gelu_tanh(30.0), 30.0);
        assert!(gelu_tanh(-30.0).abs() < 1e-30);
    }

    #[test]
    fn rms_norm_is_candles_bit_for_bit() {
        use candle_core::{Device, Tensor};
        // Whole groups of eight rows, a partial group, rows of odd lengths, and more than
        // the 32 rows above which candle splits the rows over rayon.
        for (rows, n) in [(8usize, 64usize), (3, 576), (19, 576), (40, 576), (5, 1000)] {
            let x: Vec<f32> = (0..rows * n)
                .map(|i| ((i * 7919) % 2001) as f32 / 100.0 - 10.0)
                .collect();
            let w: Vec<f32> = (0..n).map(|i| 0.5 + (i % 7) as f32 / 10.0).collect();
            let mut got = vec![0f32; x.len()];
            rms_norm(&x, &w, 1e-6, &mut got);
            let mut portable = vec![0f32; x.len()];
            rms_norm_body(&x, &w, 1e-6, &mut portable);
            assert!(got
                .iter()
                .zip(&portable)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            let xt = Tensor::from_vec(x.clone(), (rows, n), &Device::Cpu).unwrap();
            let wt = Tensor::from_vec(w.clone(), n, &Device::Cpu).unwrap();
            let want: Vec<f32> = candle_nn::ops::rms_norm(&xt, &wt, 1e-6)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "rows {rows} n {n}"
            );
        }
    }

    #[test]
    fn silu_mul_is_candles_silu_times_up() {
        use candle_core::{Device, Tensor};
        // Small (one thread) and large (the pool) inputs.
        for n in [1000usize, 100_000] {
            let gate: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 12.0).collect();
            let up: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 3.0).collect();
            let mut got = gate.clone();
            silu_mul(&mut got, &up);
            let g = Tensor::from_vec(gate.clone(), n, &Device::Cpu).unwrap();
            let u = Tensor::from_vec(up.clone(), n, &Device::Cpu).unwrap();
            let want: Vec<f32> = (g.silu().unwrap() * u).unwrap().to_vec1().unwrap();
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "n {n}"
            );
        }
    }
}
