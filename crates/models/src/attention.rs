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

use rayon::prelude::*;
use switchyard_kernels::cpu::{simd_level, SimdLevel};

use crate::kv::KvChunk;
use crate::Result;

/// Query rows per work item: enough work per task to amortise scheduling, small enough to
/// spread a long prefill over all cores.
const ROWS_PER_TASK: usize = 16;

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
    let hd = shape.head_dim;
    let width = shape.n_heads * hd;
    let group = shape.n_heads / shape.n_kv_heads;
    for s in seqs {
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
    let parts: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(si, _, g, i0, i1)| run_task(&seqs[si], g, i0..i1, shape, level))
        .collect();
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
    let mut scores = Vec::new();
    for (k, i) in rows.enumerate() {
        let pos = seq.start + i;
        let job = GroupJob {
            chunks: &seq.chunks,
            offset: g * hd,
            row: shape.n_kv_heads * hd,
            lo: shape.window.map_or(0, |w| (pos + 1).saturating_sub(w)),
            hi: pos + 1,
            scale: shape.scale,
            heads: group,
            hd,
        };
        // The group's query heads are adjacent in the row, and so are their outputs.
        let q = &seq.q[i * width + g * group * hd..i * width + (g + 1) * group * hd];
        let o = &mut out[k * group * hd..(k + 1) * group * hd];
        job.run(level, q, &mut scores, o);
    }
    out
}

/// The query heads sharing one key/value head, for one query row: each visible key and value
/// is read once for all of them.
struct GroupJob<'a, 'b> {
    chunks: &'a [KvChunk<'b>],
    /// Offset of this key/value head inside a cache row.
    offset: usize,
    /// Values per cache row (all key/value heads of one position).
    row: usize,
    /// Visible positions `lo..hi`.
    lo: usize,
    hi: usize,
    scale: f32,
    heads: usize,
    hd: usize,
}

impl GroupJob<'_, '_> {
    /// `q`, `out`: `[heads][hd]`; `scores` is scratch.
    fn run(&self, level: SimdLevel, q: &[f32], scores: &mut Vec<f32>, out: &mut [f32]) {
        let len = self.hi - self.lo;
        scores.clear();
        scores.resize(self.heads * len, 0.0);
        out.fill(0.0);
        match level {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: simd_level() returns Avx512 only when the CPU reports avx512f.
            SimdLevel::Avx512 if self.hd.is_multiple_of(16) => unsafe {
                self.run_avx512(q, scores, out)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: simd_level() returns Avx2/Avx512 only when the CPU reports avx2 and fma.
            SimdLevel::Avx2 | SimdLevel::Avx512 => unsafe { self.run_avx2(q, scores, out) },
            _ => self.run_portable(q, scores, out),
        }
    }

    /// Explicit AVX-512 for head sizes that are a multiple of 16 (all zoo models).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn run_avx512(&self, q: &[f32], scores: &mut [f32], out: &mut [f32]) {
        use std::arch::x86_64::*;
        let (hd, heads, off) = (self.hd, self.heads, self.offset);
        let len = self.hi - self.lo;
        let mut j = 0;
        self.for_each(|k, _| {
            let k = &k[off..off + hd];
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
                scores[h * len + j] = _mm512_reduce_add_ps(acc) * self.scale;
            }
            j += 1;
        });
        for h in 0..heads {
            softmax_in_place(&mut scores[h * len..(h + 1) * len]);
        }
        let mut j = 0;
        self.for_each(|_, v| {
            let v = &v[off..off + hd];
            for h in 0..heads {
                let p = _mm512_set1_ps(scores[h * len + j]);
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
    unsafe fn run_avx2(&self, q: &[f32], scores: &mut [f32], out: &mut [f32]) {
        self.run_portable(q, scores, out)
    }

    /// The portable implementation; `run_avx2` compiles it with 256-bit vectors.
    #[inline(always)]
    fn run_portable(&self, q: &[f32], scores: &mut [f32], out: &mut [f32]) {
        let (hd, heads, off) = (self.hd, self.heads, self.offset);
        let len = self.hi - self.lo;
        let mut j = 0;
        self.for_each(|k, _| {
            let k = &k[off..off + hd];
            for h in 0..heads {
                scores[h * len + j] = dot(&q[h * hd..(h + 1) * hd], k) * self.scale;
            }
            j += 1;
        });
        for h in 0..heads {
            softmax_in_place(&mut scores[h * len..(h + 1) * len]);
        }
        let mut j = 0;
        self.for_each(|_, v| {
            let v = &v[off..off + hd];
            for h in 0..heads {
                axpy(scores[h * len + j], v, &mut out[h * hd..(h + 1) * hd]);
            }
            j += 1;
        });
    }

    /// Calls `f(k_row, v_row)` for each visible position, in order.
    #[inline(always)]
    fn for_each(&self, mut f: impl FnMut(&[f32], &[f32])) {
        let mut pos = 0;
        for c in self.chunks {
            if pos >= self.hi {
                break;
            }
            let from = self.lo.saturating_sub(pos).min(c.tokens);
            let to = (self.hi - pos).min(c.tokens);
            for t in from..to {
                let r = t * self.row..(t + 1) * self.row;
                f(&c.k[r.clone()], &c.v[r]);
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

#[inline(always)]
fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

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
                chunks.push(KvChunk {
                    k: &k[at * row..(at + take) * row],
                    v: &v[at * row..(at + take) * row],
                    tokens: take,
                });
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
}
