//! f16 weights by f32 activations, for the `f16` precision.
//!
//! Candle's f16 product (`QMatMul::TensorF16`) converts the input to f16, multiplies through
//! the `gemm` crate's f16 path (which widens packed panels to f32 and runs an AVX2 f32
//! microkernel) and returns f16. On the 2-core AVX-512 machine, scoring SmolLM2 at f16 on 300
//! multiple-choice items and 4,096 tokens of text took 263 s that way (80 s with this kernel,
//! same scores), which made f16, the baseline every mode is compared with, the slowest thing
//! to measure. No crate offers an f16-weight, f32-accumulate product on AVX-512 (candle's own
//! CPU f16 path is the one above), so it is written here, for AVX-512 and for AVX2 (F16C
//! conversions, FMA).
//!
//! The arithmetic is that of an f16 layer: the input is rounded to f16, each output is one f32
//! fused multiply-add chain over the inputs in order, `acc = fma(x[k], w[k], acc)`, and is
//! rounded to f16 at the end. The scalar reference and the vector kernels run the same chain,
//! so they agree bit for bit, and a row's output never depends on the other rows of the call
//! (batch invariance). Against candle's f16 product the outputs differ by the order of the
//! f32 sums only.
//!
//! Layout: 16-row panels (as [`crate::quant`]): panel `p` holds, for each input `k`, the
//! weights of its 16 outputs side by side, so one 256-bit load and one conversion give a
//! vector of 16 output lanes. The last panel is padded with zeros.

use std::mem::MaybeUninit;

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::cpu::{simd_level, SimdLevel};
use crate::prof::{self, Part};
use crate::quant::OutPtr;

/// Output rows per panel (the quantized kernels' panel).
pub use crate::quant::PANEL;
/// Panels a task computes together for a tile of rows.
const PANELS_PER_TILE: usize = 2;
/// Rows of a tile: 2 panels x 6 rows are 12 accumulators, with 8 loads per 12 multiply-adds.
const TILE_ROWS: usize = 6;
/// Multiply-accumulates below which a product runs on one thread.
const PARALLEL_MIN_MACS: usize = 1 << 17;
/// Tasks a parallel product is cut into per thread of the pool.
const TASKS_PER_THREAD: usize = 8;

/// `$run::<R>(args)` for the tile's row count `R` (1 to [`TILE_ROWS`]), so that each
/// kernel's accumulators are a fixed array the compiler keeps in registers.
#[cfg(target_arch = "x86_64")]
macro_rules! by_rows {
    ($($run:ident)::+, $rows:expr, $($arg:expr),*) => {
        match $rows {
            6 => $($run)::+::<6>($($arg),*),
            5 => $($run)::+::<5>($($arg),*),
            4 => $($run)::+::<4>($($arg),*),
            3 => $($run)::+::<3>($($arg),*),
            2 => $($run)::+::<2>($($arg),*),
            1 => $($run)::+::<1>($($arg),*),
            _ => {}
        }
    };
}

/// An f16 weight matrix `[n, k]` in panel layout.
#[derive(Debug, Clone)]
pub struct HalfWeight {
    n: usize,
    k: usize,
    /// `[panel][k][PANEL]`
    data: Vec<f16>,
}

impl HalfWeight {
    /// `w`: `[n, k]` row-major.
    pub fn new(w: &[f16], n: usize, k: usize) -> candle_core::Result<Self> {
        if w.len() != n * k {
            candle_core::bail!("{} f16 values do not hold {n} x {k}", w.len());
        }
        let panels = n.div_ceil(PANEL);
        let mut data = vec![f16::ZERO; panels * k * PANEL];
        for (row, values) in w.chunks_exact(k.max(1)).enumerate().take(n) {
            let (p, r) = (row / PANEL, row % PANEL);
            let panel = &mut data[p * k * PANEL..(p + 1) * k * PANEL];
            for (i, &v) in values.iter().enumerate() {
                panel[i * PANEL + r] = v;
            }
        }
        Ok(Self { n, k, data })
    }

    pub fn rows(&self) -> usize {
        self.n
    }

    pub fn cols(&self) -> usize {
        self.k
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        2 * self.data.len()
    }

    /// Bytes an `[n, k]` matrix takes in this layout.
    pub fn planned_bytes(n: usize, k: usize) -> usize {
        2 * n.div_ceil(PANEL) * PANEL * k
    }

    /// Row `row` as f32 (exact).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let (p, r) = (row / PANEL, row % PANEL);
        let panel = &self.data[p * self.k * PANEL..(p + 1) * self.k * PANEL];
        for (i, o) in out.iter_mut().enumerate().take(self.k) {
            *o = panel[i * PANEL + r].to_f32();
        }
    }

    fn panel(&self, p: usize) -> &[f16] {
        &self.data[p * self.k * PANEL..(p + 1) * self.k * PANEL]
    }

    /// `out[i][j] = f16(sum_k f16(x[i][k]) * w[j][k])` for `rows` rows of `x` (`[rows, k]`).
    pub fn matmul(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        self.matmul_at(simd_level(), x, rows, out)
    }

    /// As [`matmul`](Self::matmul) with an explicit instruction set (tests, benchmarks).
    pub fn matmul_at(&self, level: SimdLevel, x: &[f32], rows: usize, out: &mut [f32]) {
        // SAFETY: `MaybeUninit<f32>` has `f32`'s layout and only initialized values are
        // stored through it.
        let out = unsafe { &mut *(out as *mut [f32] as *mut [MaybeUninit<f32>]) };
        self.matmul_part(level, x, rows, out, Part::OtherProj)
    }

    /// The product into an output that need not be initialized: every element is written.
    pub fn matmul_uninit_as(
        &self,
        x: &[f32],
        rows: usize,
        out: &mut [MaybeUninit<f32>],
        part: Part,
    ) {
        self.matmul_part(simd_level(), x, rows, out, part)
    }

    fn matmul_part(
        &self,
        level: SimdLevel,
        x: &[f32],
        rows: usize,
        out: &mut [MaybeUninit<f32>],
        part: Part,
    ) {
        let (n, k) = (self.n, self.k);
        assert_eq!(x.len(), rows * k, "activation shape");
        assert_eq!(out.len(), rows * n, "output shape");
        let _span = tracing::trace_span!("hmatmul", n, k, rows).entered();
        let rounded = {
            let _t = prof::time(Part::ActQuant);
            let mut h = vec![f16::ZERO; x.len()];
            h.convert_from_f32_slice(x);
            let mut r = vec![0f32; x.len()];
            h.convert_to_f32_slice(&mut r);
            r
        };
        let _t = prof::time(part);
        let out = OutPtr(out.as_mut_ptr() as *mut f32);
        let groups = n.div_ceil(PANEL * PANELS_PER_TILE);
        let run = |g: usize| {
            let p0 = g * PANELS_PER_TILE;
            let p1 = (p0 + PANELS_PER_TILE).min(n.div_ceil(PANEL));
            let mut i0 = 0;
            while i0 < rows {
                let i1 = (i0 + TILE_ROWS).min(rows);
                for p in p0..p1 {
                    let mut tile = [[0f32; PANEL]; TILE_ROWS];
                    self.tile(level, p, &rounded, i0..i1, &mut tile);
                    let cols = PANEL.min(n - p * PANEL);
                    for (t, i) in (i0..i1).enumerate() {
                        // SAFETY: `out` holds rows * n values; panel p writes columns
                        // p*PANEL .. p*PANEL+cols of row i, and no two tasks share a panel.
                        unsafe { out.write(i * n + p * PANEL, &tile[t][..cols]) };
                    }
                }
                i0 = i1;
            }
        };
        if rows * n * k < PARALLEL_MIN_MACS {
            (0..groups).for_each(run);
        } else {
            let per = groups
                .div_ceil(crate::pool::global().threads() * TASKS_PER_THREAD)
                .max(1);
            crate::pool::run(groups.div_ceil(per), &|t| {
                (t * per..((t + 1) * per).min(groups)).for_each(run)
            });
        }
    }

    /// Panel `p` by rows `rows` of `x` (already rounded to f16) into `tile`.
    fn tile(
        &self,
        level: SimdLevel,
        p: usize,
        x: &[f32],
        rows: std::ops::Range<usize>,
        tile: &mut [[f32; PANEL]; TILE_ROWS],
    ) {
        let (panel, k) = (self.panel(p), self.k);
        assert!(panel.len() >= k * PANEL && x.len() >= rows.end * k);
        match level {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: simd_level() returns Avx512 only with avx512f; the shapes are checked.
            SimdLevel::Avx512 => unsafe {
                by_rows!(avx512::run, rows.len(), panel, k, x, rows.start, tile)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: simd_level() returns Avx2 (and Avx512) only with avx2, fma and f16c; the
            // shapes are checked.
            SimdLevel::Avx2 => unsafe {
                by_rows!(avx2::run, rows.len(), panel, k, x, rows.start, tile)
            },
            _ => scalar_tile(panel, k, x, rows, tile),
        }
    }
}

/// The reference: one fused multiply-add chain per output, inputs in order.
fn scalar_tile(
    panel: &[f16],
    k: usize,
    x: &[f32],
    rows: std::ops::Range<usize>,
    tile: &mut [[f32; PANEL]; TILE_ROWS],
) {
    for (t, i) in rows.enumerate() {
        let xs = &x[i * k..(i + 1) * k];
        let mut acc = [0f32; PANEL];
        for (kk, &xv) in xs.iter().enumerate() {
            let w = &panel[kk * PANEL..(kk + 1) * PANEL];
            for (a, wv) in acc.iter_mut().zip(w) {
                *a = xv.mul_add(wv.to_f32(), *a);
            }
        }
        for (o, a) in tile[t].iter_mut().zip(acc) {
            *o = f16::from_f32(a).to_f32();
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::{PANEL, TILE_ROWS};

    /// [`super::scalar_tile`] for `R` rows from row `base`, with 16 output lanes per vector:
    /// the same chain per output.
    ///
    /// # Safety
    /// avx512f; `panel` holds `k * PANEL` values and `x` rows `base .. base + R` of `k`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn run<const R: usize>(
        panel: &[f16],
        k: usize,
        x: &[f32],
        base: usize,
        tile: &mut [[f32; PANEL]; TILE_ROWS],
    ) {
        let mut acc = [_mm512_setzero_ps(); R];
        let wp = panel.as_ptr() as *const __m256i;
        let xp = x.as_ptr().add(base * k);
        for kk in 0..k {
            let w = _mm512_cvtph_ps(_mm256_loadu_si256(wp.add(kk)));
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(_mm512_set1_ps(*xp.add(r * k + kk)), w, *a);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            // Round to f16 and back (to nearest, ties to even, as `f16::from_f32`).
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(*a);
            _mm512_storeu_ps(tile[r].as_mut_ptr(), _mm512_cvtph_ps(h));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::{PANEL, TILE_ROWS};

    /// [`super::scalar_tile`] for `R` rows from row `base`, with a panel's 16 outputs in two
    /// 8-lane vectors: the same chain per output (AVX2's fused multiply-add rounds once, as
    /// `f32::mul_add`). Six rows by two vectors are 12 accumulators, beside the two weight
    /// vectors and the broadcast input: 15 of AVX2's 16 registers.
    ///
    /// # Safety
    /// avx2, fma and f16c; `panel` holds `k * PANEL` values and `x` rows `base .. base + R`
    /// of `k`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn run<const R: usize>(
        panel: &[f16],
        k: usize,
        x: &[f32],
        base: usize,
        tile: &mut [[f32; PANEL]; TILE_ROWS],
    ) {
        let mut lo = [_mm256_setzero_ps(); R];
        let mut hi = [_mm256_setzero_ps(); R];
        let wp = panel.as_ptr() as *const __m128i;
        let xp = x.as_ptr().add(base * k);
        for kk in 0..k {
            let w0 = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(2 * kk)));
            let w1 = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(2 * kk + 1)));
            for r in 0..R {
                let xv = _mm256_set1_ps(*xp.add(r * k + kk));
                lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
                hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
            }
        }
        // (F16C's immediate has three bits: no exception-suppression flag.)
        const ROUND: i32 = _MM_FROUND_TO_NEAREST_INT;
        for r in 0..R {
            // Round to f16 and back (to nearest, ties to even, as `f16::from_f32`).
            let out = tile[r].as_mut_ptr();
            _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm256_cvtps_ph::<ROUND>(lo[r])));
            _mm256_storeu_ps(out.add(8), _mm256_cvtph_ps(_mm256_cvtps_ph::<ROUND>(hi[r])));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Module, Tensor};

    fn values(n: usize, seed: u32) -> Vec<f32> {
        // A fixed pseudo-random sequence in [-1, 1) (xorshift).
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn weight(n: usize, k: usize) -> (Vec<f16>, HalfWeight) {
        let w: Vec<f16> = values(n * k, 7).into_iter().map(f16::from_f32).collect();
        let hw = HalfWeight::new(&w, n, k).expect("pack");
        (w, hw)
    }

    #[test]
    fn vector_kernels_equal_the_scalar_reference_bit_for_bit() {
        // Every level this CPU runs (an AVX-512 CPU runs the AVX2 kernel too).
        let levels: &[SimdLevel] = match simd_level() {
            SimdLevel::Avx512 => &[SimdLevel::Avx2, SimdLevel::Avx512],
            SimdLevel::Avx2 => &[SimdLevel::Avx2],
            SimdLevel::Scalar => &[],
        };
        // n not a multiple of the panel, k odd, rows over and under a tile (every row count of
        // a tile's kernel is reached: 13 rows are tiles of 6, 6 and 1, 11 of 6 and 5, ...).
        let shapes = [
            (37, 45, 1),
            (37, 45, 7),
            (64, 576, 13),
            (16, 8, 6),
            (48, 64, 11),
            (33, 70, 10),
            (40, 96, 9),
        ];
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for &level in levels {
            for (n, k, rows) in shapes {
                for cancel in [false, true] {
                    let (w, x) = if cancel {
                        cancelling(n, k, rows)
                    } else {
                        (weight(n, k).1, values(rows * k, 3))
                    };
                    let mut a = vec![0f32; rows * n];
                    let mut b = vec![0f32; rows * n];
                    w.matmul_at(SimdLevel::Scalar, &x, rows, &mut a);
                    w.matmul_at(level, &x, rows, &mut b);
                    let at = format!("{level:?}: n {n} k {k} rows {rows} cancelling {cancel}");
                    assert_eq!(bits(&a), bits(&b), "{at}");
                }
            }
        }
    }

    /// A product whose exact sums are zero: the second half of each input row is the first
    /// half negated, and each weight row repeats its first half. What the f32 chain leaves is
    /// its own rounding, which depends on the order of the sums; with random operands the
    /// final rounding to f16 hides that order (a kernel summing in reverse passed them all,
    /// and fails on these inputs in most outputs).
    fn cancelling(n: usize, k: usize, rows: usize) -> (HalfWeight, Vec<f32>) {
        let h = k / 2;
        let (w16, _) = weight(n, k);
        let w16: Vec<f16> = (0..n * k)
            .map(|i| w16[i / k * k + (i % k) % h.max(1)])
            .collect();
        let mut x = values(rows * k, 3);
        for row in x.chunks_exact_mut(k) {
            for i in 0..h {
                row[h + i] = -row[i];
            }
        }
        (HalfWeight::new(&w16, n, k).expect("pack"), x)
    }

    #[test]
    fn a_rows_output_does_not_depend_on_the_other_rows() {
        let (n, k, rows) = (50, 96, 11);
        let (_, w) = weight(n, k);
        let x = values(rows * k, 5);
        let mut all = vec![0f32; rows * n];
        w.matmul(&x, rows, &mut all);
        for i in 0..rows {
            let mut one = vec![0f32; n];
            w.matmul(&x[i * k..(i + 1) * k], 1, &mut one);
            assert_eq!(one, all[i * n..(i + 1) * n], "row {i}");
        }
    }

    #[test]
    fn outputs_match_candles_f16_product_and_an_f64_sum() {
        let (n, k, rows) = (40, 576, 9);
        let (w16, w) = weight(n, k);
        let x = values(rows * k, 11);
        let mut got = vec![0f32; rows * n];
        w.matmul(&x, rows, &mut got);
        // Exact f64 sums of the f16-rounded inputs, then rounded to f16: the result may differ
        // from ours by the f32 chain's rounding only, far below one f16 step of these sums.
        let xr: Vec<f64> = x.iter().map(|&v| f16::from_f32(v).to_f64()).collect();
        for i in 0..rows {
            for j in 0..n {
                let exact: f64 = (0..k)
                    .map(|kk| xr[i * k + kk] * w16[j * k + kk].to_f64())
                    .sum();
                let g = got[i * n + j] as f64;
                assert!(
                    (g - exact).abs() <= 2e-3 * exact.abs().max(1.0),
                    "({i}, {j}): {g} vs {exact}"
                );
            }
        }
        // Candle's f16 product of the same operands.
        let dev = Device::Cpu;
        let wt = Tensor::from_vec(w16.clone(), (n, k), &dev).expect("w");
        let xt = Tensor::from_vec(x.clone(), (rows, k), &dev)
            .and_then(|t| t.to_dtype(candle_core::DType::F16))
            .expect("x");
        let want: Vec<f32> = candle_core::quantized::QMatMul::TensorF16(wt)
            .forward(&xt)
            .and_then(|y| y.to_dtype(candle_core::DType::F32))
            .and_then(|y| y.flatten_all())
            .and_then(|y| y.to_vec1())
            .expect("candle");
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
            .fold(0f32, f32::max);
        let mut ours = 0f64;
        let mut theirs = 0f64;
        for i in 0..rows {
            for j in 0..n {
                let exact: f64 = (0..k)
                    .map(|kk| xr[i * k + kk] * w16[j * k + kk].to_f64())
                    .sum();
                let e = exact.abs().max(1.0);
                ours = ours.max((got[i * n + j] as f64 - exact).abs() / e);
                theirs = theirs.max((want[i * n + j] as f64 - exact).abs() / e);
            }
        }
        // Candle's CPU f16 product is less exact than ours on machines without AVX-512:
        // measured on an AMD EPYC (AVX2), ours 4.8e-4 from the exact sums, candle's 3.6e-3,
        // 3.4e-3 apart; on Sapphire Rapids the two were within 2e-3 of each other.
        assert!(
            ours <= 1e-3,
            "largest difference from the exact sums {ours}"
        );
        assert!(
            ours <= theirs,
            "ours {ours} from the exact sums, candle's product {theirs}"
        );
        assert!(worst <= 4e-3, "largest difference from candle {worst}");
    }

    #[test]
    fn rows_dequantize_exactly_and_shapes_are_checked() {
        let (n, k) = (19, 33);
        let (w16, w) = weight(n, k);
        let mut row = vec![0f32; k];
        w.dequantize_row(17, &mut row);
        let want: Vec<f32> = w16[17 * k..18 * k].iter().map(|v| v.to_f32()).collect();
        assert_eq!(row, want);
        assert_eq!(w.bytes(), HalfWeight::planned_bytes(n, k));
        assert_eq!(w.bytes(), 2 * 32 * 33);
        let err = HalfWeight::new(&w16[1..], n, k).expect_err("short");
        // (candle's errors carry a backtrace after the message when RUST_BACKTRACE is set)
        let want = format!("{} f16 values do not hold 19 x 33", n * k - 1);
        assert!(err.to_string().starts_with(&want), "{err}");
    }
}
