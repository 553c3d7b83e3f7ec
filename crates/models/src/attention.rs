//! Causal self-attention of a batch of sequences over their own cached keys and values.
//!
//! Written here rather than taken from candle because the keys and values live in a cache the
//! engine owns (dense or paged, see [`crate::kv`]), not in contiguous tensors; candle's CPU
//! flash attention needs the latter and would force a copy of the whole cache every step.
//!
//! Every (query row, head) is computed the same way whatever else is in the batch: scores over
//! the visible keys in position order, softmax, weighted sum of values in position order. So a
//! sequence's output does not depend on how it was batched or chunked (batch invariance): with
//! row-independent matmul kernels, cached decoding, chunked prefill and continuous batching
//! reproduce one-shot prefill bit for bit. Work is split over (sequence, key/value head, block
//! of query rows); the inner loops are compiled for AVX-512, AVX2 and scalar and picked once
//! per process ([`switchyard_kernels::cpu::simd_level`]).
//!
//! 8-bit chunks ([`crate::kv::Int8Rows`]) are read in place: each position's head row is
//! widened to f32 once (exactly) into a `head_dim` scratch the task reuses, used by every query
//! head of its group, and its scale multiplies the dot product (keys) or the softmax weight
//! (values) rather than every value. Measured on the development CPU (the ignored
//! `int8_attention_timing` test, one thread, smollm2's shape, 1024 positions): a decode step of
//! 16 sequences takes 6.6 ms over f32 blocks, 4.7 ms over 8-bit blocks read in place and
//! 9.2 ms dequantizing each cache into a scratch copy first; a 256-row prefill 52, 55 and
//! 52 ms. Decode reads a quarter of the bytes; prefill is bound by arithmetic, and widening
//! once per task instead of per row did not measurably help it, so rows are widened one at a
//! time.

use switchyard_kernels::cpu::{simd_level, SimdLevel};
use switchyard_kernels::prof::{self, Part};

use crate::kv::KvChunk;
use crate::Result;

/// Query rows per work item: enough work per task to amortise scheduling, small enough to
/// spread a long prefill over all cores.
const ROWS_PER_TASK: usize = 16;
/// Multiply-accumulates below which attention runs on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 16;

#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies q·k (1/sqrt(head_dim) unless the architecture says otherwise).
    pub scale: f32,
    /// Keys more than `window - 1` positions behind the query are not attended (sliding window).
    pub window: Option<usize>,
}

/// One sequence's part of a batch: `n` new query rows at positions `start..start + n`, and the
/// cache holding positions `0..start + n` (new ones included).
pub struct SeqAttn<'a> {
    pub q: &'a [f32],
    pub start: usize,
    pub n: usize,
    pub chunks: Vec<KvChunk<'a>>,
}

/// Attention output for every query row of every sequence, `[rows][n_heads * head_dim]`, in the
/// order the sequences are given.
pub fn attend(seqs: &[SeqAttn<'_>], shape: &AttnShape) -> Result<Vec<f32>> {
    let _span = tracing::trace_span!("attention", seqs = seqs.len()).entered();
    let _t = prof::time(Part::Attention);
    let hd = shape.head_dim;
    let width = shape.n_heads * hd;
    let group = shape.n_heads / shape.n_kv_heads;
    let row = shape.n_kv_heads * hd;
    for s in seqs {
        for c in &s.chunks {
            let (values, scales) = match (&c.int8, &c.f16) {
                (Some(q), _) => (
                    q.k.len().min(q.v.len()),
                    q.k_scales.len().min(q.v_scales.len()),
                ),
                (None, Some(h)) => (h.k.len().min(h.v.len()), usize::MAX),
                (None, None) => (c.k.len().min(c.v.len()), usize::MAX),
            };
            if values < c.tokens * row || scales < c.tokens * shape.n_kv_heads {
                return Err(candle_core::Error::Msg(format!(
                    "a KV chunk of {} positions holds {values} values and {scales} scales per half; rows of {row} values need more",
                    c.tokens
                ))
                .into());
            }
        }
        let held: usize = s.chunks.iter().map(|c| c.tokens).sum();
        if held < s.start + s.n {
            return Err(candle_core::Error::Msg(format!(
                "attention needs {} cached positions, the cache holds {held}",
                s.start + s.n
            ))
            .into());
        }
    }
    // (sequence, its first row in the batch, key/value head, first row, end row)
    let mut tasks = Vec::new();
    let mut row0 = 0;
    for (si, s) in seqs.iter().enumerate() {
        for g in 0..shape.n_kv_heads {
            let mut i = 0;
            while i < s.n {
                let end = (i + ROWS_PER_TASK).min(s.n);
                tasks.push((si, row0, g, i, end));
                i = end;
            }
        }
        row0 += s.n;
    }
    let level = simd_level();
    // Work of every task (multiply-accumulates of scores and values): small steps run on
    // this thread, where a hand-off would cost more than the work.
    let work: usize = tasks
        .iter()
        .map(|&(si, _, _, i0, i1)| (i1 - i0) * (seqs[si].start + i1) * group * hd * 2)
        .sum();
    let parts: Vec<Vec<f32>> = if work < PARALLEL_MIN_WORK {
        tasks
            .iter()
            .map(|&(si, _, g, i0, i1)| run_task(&seqs[si], g, i0..i1, shape, level))
            .collect()
    } else {
        let profiling = prof::enabled();
        let slots: Vec<std::sync::Mutex<Vec<f32>>> = tasks
            .iter()
            .map(|_| std::sync::Mutex::new(Vec::new()))
            .collect();
        switchyard_kernels::pool::run(tasks.len(), &|t| {
            let timer = profiling.then(std::time::Instant::now);
            let (si, _, g, i0, i1) = tasks[t];
            let out = run_task(&seqs[si], g, i0..i1, shape, level);
            if let Some(timer) = timer {
                prof::add(Part::ParallelBusy, timer.elapsed().as_nanos() as u64);
            }
            if let Ok(mut slot) = slots[t].lock() {
                *slot = out;
            }
        });
        slots
            .into_iter()
            .map(|s| s.into_inner().unwrap_or_default())
            .collect()
    };
    let gw = group * hd;
    let mut out = vec![0f32; row0 * width];
    for (&(_, base, g, i0, i1), part) in tasks.iter().zip(&parts) {
        for (k, i) in (i0..i1).enumerate() {
            let dst = (base + i) * width + g * gw;
            out[dst..dst + gw].copy_from_slice(&part[k * gw..(k + 1) * gw]);
        }
    }
    Ok(out)
}

/// Output `[rows][group * head_dim]` of the query heads sharing key/value head `g`.
fn run_task(
    seq: &SeqAttn<'_>,
    g: usize,
    rows: std::ops::Range<usize>,
    shape: &AttnShape,
    level: SimdLevel,
) -> Vec<f32> {
    let hd = shape.head_dim;
    let group = shape.n_heads / shape.n_kv_heads;
    let width = shape.n_heads * hd;
    let mut out = vec![0f32; rows.len() * group * hd];
    let mut scratch = Scratch {
        scores: Vec::new(),
        row: vec![0f32; hd],
    };
    for (k, i) in rows.enumerate() {
        let pos = seq.start + i;
        let job = GroupJob {
            chunks: &seq.chunks,
            head: g,
            n_kv_heads: shape.n_kv_heads,
            lo: shape.window.map_or(0, |w| (pos + 1).saturating_sub(w)),
            hi: pos + 1,
            scale: shape.scale,
            heads: group,
            hd,
        };
        // The group's query heads are adjacent in the row, and so are their outputs.
        let q = &seq.q[i * width + g * group * hd..i * width + (g + 1) * group * hd];
        let o = &mut out[k * group * hd..(k + 1) * group * hd];
        job.run(level, q, &mut scratch, o);
    }
    out
}

/// Buffers one task reuses for all its query rows.
struct Scratch {
    /// `[heads][visible positions]`.
    scores: Vec<f32>,
    /// One 8-bit head row widened to f32 (`head_dim` values).
    row: Vec<f32>,
}

/// Which half of a cache row a pass reads.
#[derive(Clone, Copy)]
enum Half {
    K,
    V,
}

/// One position's values of one key/value head, as the cache stores them.
#[derive(Clone, Copy)]
enum HeadRow<'a> {
    F32(&'a [f32]),
    F16(&'a [half::f16]),
    /// The 8-bit values and their scale.
    Int8(&'a [i8], f32),
}

impl HeadRow<'_> {
    /// The values as f32 and the factor they still carry: an 8-bit row is widened into `buf`
    /// (exactly, i8 -> f32) and its scale is applied once to the dot product or the softmax
    /// weight instead of to every value. An f32 row carries 1, and `x * 1.0 == x`, so the f32
    /// path keeps its arithmetic bit for bit.
    #[inline(always)]
    fn widen<'s>(self, buf: &'s mut [f32]) -> (&'s [f32], f32)
    where
        Self: 's,
    {
        match self {
            HeadRow::F32(x) => (x, 1.0),
            HeadRow::F16(x) => {
                // Exact: every half is an f32 (F16C where the CPU has it).
                half::slice::HalfFloatSliceExt::convert_to_f32_slice(x, buf);
                (buf, 1.0)
            }
            HeadRow::Int8(q, scale) => {
                for (d, &x) in buf.iter_mut().zip(q) {
                    *d = f32::from(x);
                }
                (buf, scale)
            }
        }
    }
}

/// The query heads sharing one key/value head, for one query row: each visible key and value
/// is read once for all of them.
struct GroupJob<'a, 'b> {
    chunks: &'a [KvChunk<'b>],
    /// The key/value head.
    head: usize,
    n_kv_heads: usize,
    /// Visible positions `lo..hi`.
    lo: usize,
    hi: usize,
    scale: f32,
    heads: usize,
    hd: usize,
}

impl GroupJob<'_, '_> {
    /// `q`, `out`: `[heads][hd]`.
    fn run(&self, level: SimdLevel, q: &[f32], scratch: &mut Scratch, out: &mut [f32]) {
        let len = self.hi - self.lo;
        let Scratch { scores, row } = scratch;
        scores.clear();
        scores.resize(self.heads * len, 0.0);
        out.fill(0.0);
        match level {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: simd_level() returns Avx512 only when the CPU reports avx512f.
            SimdLevel::Avx512 if self.hd.is_multiple_of(16) => unsafe {
                self.run_avx512(q, scores, row, out)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: simd_level() returns Avx2/Avx512 only when the CPU reports avx2 and fma.
            SimdLevel::Avx2 | SimdLevel::Avx512 => unsafe { self.run_avx2(q, scores, row, out) },
            _ => self.run_portable(q, scores, row, out),
        }
    }

    /// Explicit AVX-512 for head sizes that are a multiple of 16 (all zoo models).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn run_avx512(&self, q: &[f32], scores: &mut [f32], buf: &mut [f32], out: &mut [f32]) {
        use std::arch::x86_64::*;
        let (hd, heads) = (self.hd, self.heads);
        let len = self.hi - self.lo;
        let mut j = 0;
        self.for_each(Half::K, |row| {
            let (k, ks) = row.widen(buf);
            for h in 0..heads {
                let qh = &q[h * hd..(h + 1) * hd];
                let mut acc = _mm512_setzero_ps();
                let mut c = 0;
                while c < hd {
                    acc = _mm512_fmadd_ps(
                        _mm512_loadu_ps(qh.as_ptr().add(c)),
                        _mm512_loadu_ps(k.as_ptr().add(c)),
                        acc,
                    );
                    c += 16;
                }
                scores[h * len + j] = _mm512_reduce_add_ps(acc) * ks * self.scale;
            }
            j += 1;
        });
        for h in 0..heads {
            softmax_in_place(&mut scores[h * len..(h + 1) * len]);
        }
        let mut j = 0;
        self.for_each(Half::V, |row| {
            let (v, vs) = row.widen(buf);
            for h in 0..heads {
                let p = _mm512_set1_ps(scores[h * len + j] * vs);
                let oh = &mut out[h * hd..(h + 1) * hd];
                let mut c = 0;
                while c < hd {
                    let o = _mm512_loadu_ps(oh.as_ptr().add(c));
                    let o = _mm512_fmadd_ps(p, _mm512_loadu_ps(v.as_ptr().add(c)), o);
                    _mm512_storeu_ps(oh.as_mut_ptr().add(c), o);
                    c += 16;
                }
            }
            j += 1;
        });
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, q: &[f32], scores: &mut [f32], buf: &mut [f32], out: &mut [f32]) {
        self.run_portable(q, scores, buf, out)
    }

    /// The portable implementation; `run_avx2` compiles it with 256-bit vectors.
    #[inline(always)]
    fn run_portable(&self, q: &[f32], scores: &mut [f32], buf: &mut [f32], out: &mut [f32]) {
        let (hd, heads) = (self.hd, self.heads);
        let len = self.hi - self.lo;
        let mut j = 0;
        self.for_each(Half::K, |row| {
            let (k, ks) = row.widen(buf);
            for h in 0..heads {
                scores[h * len + j] = dot(&q[h * hd..(h + 1) * hd], k) * ks * self.scale;
            }
            j += 1;
        });
        for h in 0..heads {
            softmax_in_place(&mut scores[h * len..(h + 1) * len]);
        }
        let mut j = 0;
        self.for_each(Half::V, |row| {
            let (v, vs) = row.widen(buf);
            for h in 0..heads {
                axpy(scores[h * len + j] * vs, v, &mut out[h * hd..(h + 1) * hd]);
            }
            j += 1;
        });
    }

    /// Calls `f` with this job's head of `half` for each visible position, in order.
    #[inline(always)]
    fn for_each(&self, half: Half, mut f: impl FnMut(HeadRow<'_>)) {
        let hd = self.hd;
        let row = self.n_kv_heads * hd;
        let off = self.head * hd;
        let mut pos = 0;
        for c in self.chunks {
            if pos >= self.hi {
                break;
            }
            let from = self.lo.saturating_sub(pos).min(c.tokens);
            let to = (self.hi - pos).min(c.tokens);
            if let Some(h) = c.f16 {
                let values = match half {
                    Half::K => h.k,
                    Half::V => h.v,
                };
                for t in from..to {
                    f(HeadRow::F16(&values[t * row + off..t * row + off + hd]));
                }
                pos += c.tokens;
                continue;
            }
            match (c.int8, half) {
                (None, Half::K) => {
                    for t in from..to {
                        f(HeadRow::F32(&c.k[t * row + off..t * row + off + hd]));
                    }
                }
                (None, Half::V) => {
                    for t in from..to {
                        f(HeadRow::F32(&c.v[t * row + off..t * row + off + hd]));
                    }
                }
                (Some(q), half) => {
                    let (values, scales) = match half {
                        Half::K => (q.k, q.k_scales),
                        Half::V => (q.v, q.v_scales),
                    };
                    for t in from..to {
                        f(HeadRow::Int8(
                            &values[t * row + off..t * row + off + hd],
                            scales[t * self.n_kv_heads + self.head],
                        ));
                    }
                }
            }
            pos += c.tokens;
        }
    }
}

/// Lanes of the accumulators: one AVX-512 register, two AVX2 registers.
const LANES: usize = 16;

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Independent lane sums let the compiler vectorise without reassociating one chain; the
    // summation order is fixed, so every row gets the same arithmetic.
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..LANES {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s = tail;
    for half in [8, 4, 2, 1] {
        for k in 0..half {
            acc[k] += acc[k + half];
        }
    }
    s += acc[0];
    s
}

#[inline(always)]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// Through the kernels' vectorized exp: at a context of 1,024 a decode step takes
/// 1,024 exponentials per query head per layer, which the scalar `exp` made a large share of
/// attention.
#[inline(always)]
fn softmax_in_place(x: &mut [f32]) {
    switchyard_kernels::fastmath::softmax_in_place(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{quantize_kv_int8, F16Rows, Int8Rows};
    use rand::{Rng, SeedableRng};
    use rayon::prelude::*;

    /// Plain reference: per head, per query, full softmax over the visible keys.
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        start: usize,
        n: usize,
        s: &AttnShape,
    ) -> Vec<f32> {
        let hd = s.head_dim;
        let group = s.n_heads / s.n_kv_heads;
        let row = s.n_kv_heads * hd;
        let mut out = vec![0f32; n * s.n_heads * hd];
        for i in 0..n {
            let p = start + i;
            let lo = s.window.map_or(0, |w| (p + 1).saturating_sub(w));
            for h in 0..s.n_heads {
                let g = h / group;
                let qh = &q[(i * s.n_heads + h) * hd..][..hd];
                let sc: Vec<f64> = (lo..=p)
                    .map(|j| {
                        let kj = &k[j * row + g * hd..][..hd];
                        qh.iter().zip(kj).map(|(a, b)| (a * b) as f64).sum::<f64>() * s.scale as f64
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (idx, j) in (lo..=p).enumerate() {
                    let vj = &v[j * row + g * hd..][..hd];
                    for d in 0..hd {
                        out[(i * s.n_heads + h) * hd + d] += (e[idx] / z * vj[d] as f64) as f32;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn matches_reference_with_chunks_and_window() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for (start, n, window) in [
            (0, 1, None),
            (5, 1, Some(3)),
            (0, 24, None),
            (7, 20, Some(6)),
            (3, 4, None),
        ] {
            let s = AttnShape {
                n_heads: 4,
                n_kv_heads: 2,
                head_dim: 8,
                scale: 0.35,
                window,
            };
            let row = s.n_kv_heads * s.head_dim;
            let ctx = start + n;
            let k: Vec<f32> = (0..ctx * row)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let v: Vec<f32> = (0..ctx * row)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let q: Vec<f32> = (0..n * s.n_heads * s.head_dim)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            // Split the cache into uneven chunks like a paged cache would.
            let mut chunks = Vec::new();
            let mut at = 0;
            for size in [3usize, 5, 1, 100] {
                let take = size.min(ctx - at);
                if take == 0 {
                    break;
                }
                chunks.push(KvChunk::f32(
                    &k[at * row..(at + take) * row],
                    &v[at * row..(at + take) * row],
                    take,
                ));
                at += take;
            }
            let got = attend(
                &[SeqAttn {
                    q: &q,
                    start,
                    n,
                    chunks,
                }],
                &s,
            )
            .unwrap();
            let want = reference(&q, &k, &v, start, n, &s);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "start {start} n {n}: {a} vs {b}");
            }
        }
    }

    /// Attention over f16 chunks gives bit for bit what it gives over f32 chunks holding the
    /// same (rounded) values, at every SIMD level the CPU has: widening a half is exact and
    /// the arithmetic after it is the f32 path's.
    #[test]
    fn f16_chunks_read_as_their_f32_values() {
        use half::f16;
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let s = SMOLLM2;
        let row = s.n_kv_heads * s.head_dim;
        for (start, n) in [(0usize, 1usize), (40, 1), (0, 33), (17, 5)] {
            let ctx = start + n;
            let (k, v) = realistic(&mut rng, ctx, &s);
            let kh: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
            let vh: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
            let kr: Vec<f32> = kh.iter().map(|x| x.to_f32()).collect();
            let vr: Vec<f32> = vh.iter().map(|x| x.to_f32()).collect();
            let q: Vec<f32> = (0..n * s.n_heads * s.head_dim)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let split = ctx / 2;
            let halves = vec![
                KvChunk::f16(
                    F16Rows {
                        k: &kh[..split * row],
                        v: &vh[..split * row],
                    },
                    split,
                ),
                KvChunk::f16(
                    F16Rows {
                        k: &kh[split * row..],
                        v: &vh[split * row..],
                    },
                    ctx - split,
                ),
            ];
            let floats = vec![
                KvChunk::f32(&kr[..split * row], &vr[..split * row], split),
                KvChunk::f32(&kr[split * row..], &vr[split * row..], ctx - split),
            ];
            let run = |chunks| {
                attend(
                    &[SeqAttn {
                        q: &q,
                        start,
                        n,
                        chunks,
                    }],
                    &s,
                )
                .unwrap()
            };
            let (a, b) = (run(halves), run(floats));
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "start {start} n {n}"
            );
            // And within the rounding of the values of the f32 cache's own result.
            let exact = run(vec![KvChunk::f32(&k, &v, ctx)]);
            let vmax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
            let worst = a
                .iter()
                .zip(&exact)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(
                worst < 1e-2 * vmax,
                "start {start} n {n}: {worst} of {vmax}"
            );
        }
    }

    /// Attention over an 8-bit cache against attention over the f32 cache it was quantized
    /// from, on the data of [`realistic`] (smollm2's shape, K with outlier channels): the RMS of
    /// the difference as a fraction of the RMS of the f32 output. Measured 2.1-2.3e-2
    /// (seeds as in the test). Nearly all of it comes from K: an outlier channel sets its
    /// row's scale, so the other channels of that row get a coarse step (V alone moves the
    /// output by < 4e-3 of max|V|, below its worst case `max|V| / 254`).
    const KV_INT8_ATTN_RMS_TOL: f32 = 4e-2;
    /// The largest difference, as a fraction of the largest |V| in the cache. Measured 2.8e-2
    /// for a decode row and 6.1e-2 over a 40-row prefill chunk.
    const KV_INT8_ATTN_MAX_TOL: f32 = 1e-1;

    /// smollm2-135m's attention: 9 query heads over 3 key/value heads of 64.
    const SMOLLM2: AttnShape = AttnShape {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
        scale: 0.125,
        window: None,
    };

    /// Values shaped like a real model's K/V after rope: normal, with a few outlier channels
    /// in K several times larger than the rest (which set each row's scale).
    fn realistic(rng: &mut impl Rng, positions: usize, s: &AttnShape) -> (Vec<f32>, Vec<f32>) {
        let row = s.n_kv_heads * s.head_dim;
        let mut normal = |sd: f32| -> f32 {
            let (u1, u2): (f32, f32) = (rng.random_range(1e-7..1.0), rng.random());
            sd * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
        };
        let mut k = Vec::with_capacity(positions * row);
        let mut v = Vec::with_capacity(positions * row);
        for _ in 0..positions {
            for c in 0..row {
                let outlier = matches!(c % s.head_dim, 3 | 17 | 40);
                k.push(normal(if outlier { 8.0 } else { 1.5 }));
                v.push(normal(0.6));
            }
        }
        (k, v)
    }

    /// K and V of `positions` rows quantized per (position, head), and the dequantized f32.
    struct Quantized {
        k: Vec<i8>,
        v: Vec<i8>,
        ks: Vec<f32>,
        vs: Vec<f32>,
    }

    impl Quantized {
        fn new(k: &[f32], v: &[f32], hd: usize) -> Self {
            let mut q = Self {
                k: vec![0; k.len()],
                v: vec![0; v.len()],
                ks: vec![0.0; k.len() / hd],
                vs: vec![0.0; v.len() / hd],
            };
            quantize_kv_int8(k, hd, &mut q.k, &mut q.ks);
            quantize_kv_int8(v, hd, &mut q.v, &mut q.vs);
            q
        }

        fn dequantized(&self, hd: usize) -> (Vec<f32>, Vec<f32>) {
            let deq = |q: &[i8], s: &[f32]| -> Vec<f32> {
                q.iter()
                    .enumerate()
                    .map(|(i, &x)| f32::from(x) * s[i / hd])
                    .collect()
            };
            (deq(&self.k, &self.ks), deq(&self.v, &self.vs))
        }

        /// Chunks of `block` positions (the last one partial), like a paged cache's.
        fn chunks(&self, s: &AttnShape, block: usize) -> Vec<KvChunk<'_>> {
            let row = s.n_kv_heads * s.head_dim;
            let positions = self.k.len() / row;
            (0..positions)
                .step_by(block)
                .map(|t0| {
                    let t1 = (t0 + block).min(positions);
                    let (r, h) = (t0 * row..t1 * row, t0 * s.n_kv_heads..t1 * s.n_kv_heads);
                    KvChunk::int8(
                        Int8Rows {
                            k: &self.k[r.clone()],
                            v: &self.v[r],
                            k_scales: &self.ks[h.clone()],
                            v_scales: &self.vs[h],
                        },
                        t1 - t0,
                    )
                })
                .collect()
        }
    }

    fn f32_chunks<'a>(k: &'a [f32], v: &'a [f32], s: &AttnShape, block: usize) -> Vec<KvChunk<'a>> {
        let row = s.n_kv_heads * s.head_dim;
        k.chunks(block * row)
            .zip(v.chunks(block * row))
            .map(|(k, v)| KvChunk::f32(k, v, k.len() / row))
            .collect()
    }

    fn attend_one(
        q: &[f32],
        start: usize,
        n: usize,
        chunks: Vec<KvChunk<'_>>,
        s: &AttnShape,
    ) -> Vec<f32> {
        attend(
            &[SeqAttn {
                q,
                start,
                n,
                chunks,
            }],
            s,
        )
        .expect("attend")
    }

    /// The 8-bit kernel computes exactly attention over the dequantized values (to the f32
    /// path's 1e-5 against the f64 reference), windows and uneven chunks included.
    #[test]
    fn int8_chunks_are_attention_over_the_dequantized_values() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        for (start, n, window, block) in [
            (0, 1, None, 16),
            (40, 1, Some(9), 16),
            (0, 30, None, 7),
            (21, 12, Some(10), 3),
        ] {
            let s = AttnShape { window, ..SMOLLM2 };
            let (k, v) = realistic(&mut rng, start + n, &s);
            let q: Vec<f32> = (0..n * s.n_heads * s.head_dim)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let quant = Quantized::new(&k, &v, s.head_dim);
            let (dk, dv) = quant.dequantized(s.head_dim);
            let got = attend_one(&q, start, n, quant.chunks(&s, block), &s);
            let want = reference(&q, &dk, &dv, start, n, &s);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "start {start} n {n}: {a} vs {b}");
            }
        }
    }

    /// Every compiled path this CPU can run (scalar, AVX2, AVX-512) reads 8-bit chunks
    /// correctly: attention over the dequantized values, as the reference computes it.
    #[test]
    fn int8_chunks_are_read_alike_by_every_simd_path() {
        let levels: &[SimdLevel] = match simd_level() {
            SimdLevel::Avx512 => &[SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512],
            SimdLevel::Avx2 => &[SimdLevel::Scalar, SimdLevel::Avx2],
            SimdLevel::Scalar => &[SimdLevel::Scalar],
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let s = SMOLLM2;
        let (start, n) = (33, 7);
        let (k, v) = realistic(&mut rng, start + n, &s);
        let q: Vec<f32> = realistic(&mut rng, n * 3, &s).0;
        let quant = Quantized::new(&k, &v, s.head_dim);
        let (dk, dv) = quant.dequantized(s.head_dim);
        let want = reference(&q, &dk, &dv, start, n, &s);
        let seq = SeqAttn {
            q: &q,
            start,
            n,
            chunks: quant.chunks(&s, 16),
        };
        let (hd, group) = (s.head_dim, s.n_heads / s.n_kv_heads);
        for &level in levels {
            for g in 0..s.n_kv_heads {
                let got = run_task(&seq, g, 0..n, &s, level);
                for i in 0..n {
                    let w = &want[i * s.n_heads * hd + g * group * hd..][..group * hd];
                    for (a, b) in got[i * group * hd..(i + 1) * group * hd].iter().zip(w) {
                        assert!(
                            (a - b).abs() < 1e-5,
                            "{level:?} head {g} row {i}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    /// Against the f32 cache the 8-bit one was made from: close (within
    /// [`KV_INT8_ATTN_RMS_TOL`] and [`KV_INT8_ATTN_MAX_TOL`]) but not equal, so the compression
    /// really is applied; and, like the f32 path, independent of how the cache is chunked,
    /// bit for bit.
    #[test]
    fn int8_attention_stays_within_tolerance_of_f32() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let s = SMOLLM2;
        // A 300-position cache; a decode row at its end, a 40-row prefill chunk, position 0.
        let (k, v) = realistic(&mut rng, 300, &s);
        let vmax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
        let quant = Quantized::new(&k, &v, s.head_dim);
        let (dk, dv) = quant.dequantized(s.head_dim);
        let rms = |x: &mut dyn Iterator<Item = f32>| {
            let (sum, n) = x.fold((0f64, 0usize), |(s, n), v| (s + f64::from(v * v), n + 1));
            (sum / n as f64).sqrt() as f32
        };
        for (start, n) in [(299, 1), (260, 40), (0, 1)] {
            let q: Vec<f32> = realistic(&mut rng, n * 3, &s).0;
            let ctx = (start + n) * s.n_kv_heads * s.head_dim;
            let dense = attend_one(&q, start, n, f32_chunks(&k[..ctx], &v[..ctx], &s, 16), &s);
            let int8 = attend_one(&q, start, n, quant.chunks(&s, 16), &s);
            let int8_one_chunk = attend_one(&q, start, n, quant.chunks(&s, 1000), &s);
            assert!(
                int8.iter()
                    .zip(&int8_one_chunk)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "chunking changed the 8-bit result"
            );
            let max_diff = |x: &[f32]| {
                dense
                    .iter()
                    .zip(x)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
                    / vmax
            };
            let rel_rms = rms(&mut dense.iter().zip(&int8).map(|(a, b)| a - b))
                / rms(&mut dense.iter().copied());
            let max = max_diff(&int8);
            // Which half the difference comes from: only K or only V quantized.
            let k_only = attend_one(&q, start, n, f32_chunks(&dk[..ctx], &v[..ctx], &s, 16), &s);
            let v_only = attend_one(&q, start, n, f32_chunks(&k[..ctx], &dv[..ctx], &s, 16), &s);
            eprintln!(
                "start {start} n {n}: rms |int8 - f32| {rel_rms:.2e} of rms f32; max {max:.2e} of max|V| ({vmax:.2}); K alone {:.2e}, V alone {:.2e}",
                max_diff(&k_only),
                max_diff(&v_only)
            );
            assert!(
                rel_rms <= KV_INT8_ATTN_RMS_TOL,
                "start {start} n {n}: {rel_rms:e}"
            );
            assert!(max <= KV_INT8_ATTN_MAX_TOL, "start {start} n {n}: {max:e}");
            assert!(max_diff(&v_only) <= 1.0 / 254.0);
            if start > 0 {
                let same = dense
                    .iter()
                    .zip(&int8)
                    .filter(|(a, b)| a.to_bits() == b.to_bits())
                    .count();
                assert!(
                    same * 100 < dense.len(),
                    "{same} of {} outputs unchanged",
                    dense.len()
                );
                assert!(
                    rel_rms > 1e-3,
                    "the 8-bit cache barely changed anything ({rel_rms:e})"
                );
            }
        }
    }

    /// Attention time over f32 chunks, 8-bit chunks read in place, and 8-bit chunks first
    /// dequantized into a scratch copy (the alternative design), for a decode step of 16
    /// sequences (each its own cache, so the caches do not all sit in L2) at 1024 positions
    /// and a 256-row prefill. Run with `--ignored --nocapture`.
    #[test]
    #[ignore = "timing; prints numbers"]
    fn int8_attention_timing() {
        use std::time::Instant;
        let s = SMOLLM2;
        let row = s.n_kv_heads * s.head_dim;
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let ctx = 1024;
        let best = |f: &mut dyn FnMut()| {
            f();
            (0..9)
                .map(|_| {
                    let t = Instant::now();
                    f();
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
        };
        for (label, seqs, n) in [
            ("decode 16 x 1 row", 16, 1),
            ("prefill 1 x 256 rows", 1, 256),
        ] {
            let start = ctx - n;
            let caches: Vec<(Vec<f32>, Vec<f32>)> =
                (0..seqs).map(|_| realistic(&mut rng, ctx, &s)).collect();
            let quant: Vec<Quantized> = caches
                .iter()
                .map(|(k, v)| Quantized::new(k, v, s.head_dim))
                .collect();
            let q: Vec<f32> = realistic(&mut rng, n * 3, &s).0;
            let batch = |chunks: Vec<Vec<KvChunk<'_>>>| -> Vec<f32> {
                let seq: Vec<SeqAttn<'_>> = chunks
                    .into_iter()
                    .map(|chunks| SeqAttn {
                        q: &q,
                        start,
                        n,
                        chunks,
                    })
                    .collect();
                attend(&seq, &s).expect("attend")
            };
            let f32_t = best(&mut || {
                let c = caches
                    .iter()
                    .map(|(k, v)| f32_chunks(k, v, &s, 16))
                    .collect();
                std::hint::black_box(batch(c));
            });
            let int8_t = best(&mut || {
                let c = quant.iter().map(|q| q.chunks(&s, 16)).collect();
                std::hint::black_box(batch(c));
            });
            // Each sequence's blocks dequantized into its own reused f32 copy, then the f32
            // kernel (the copy's memory is allocated once, outside the timing).
            let mut copies = vec![(vec![0f32; ctx * row], vec![0f32; ctx * row]); seqs];
            let scratch_t = best(&mut || {
                copies
                    .par_iter_mut()
                    .zip(&quant)
                    .for_each(|((dk, dv), quant)| {
                        for (dst, q, sc) in [(dk, &quant.k, &quant.ks), (dv, &quant.v, &quant.vs)] {
                            for ((d, q), sc) in dst
                                .chunks_mut(s.head_dim)
                                .zip(q.chunks(s.head_dim))
                                .zip(sc.iter())
                            {
                                for (d, &q) in d.iter_mut().zip(q) {
                                    *d = f32::from(q) * sc;
                                }
                            }
                        }
                    });
                let c = copies
                    .iter()
                    .map(|(dk, dv)| vec![KvChunk::f32(dk, dv, ctx)])
                    .collect();
                std::hint::black_box(batch(c));
            });
            eprintln!(
                "{label}, {ctx} positions, row {row}: f32 {:.3} ms, int8 in place {:.3} ms, int8 via scratch {:.3} ms",
                f32_t * 1e3,
                int8_t * 1e3,
                scratch_t * 1e3
            );
        }
    }
}
