//! Causal self-attention of a batch of sequences over their own cached keys and values.
//!
//! Written here rather than taken from candle because the keys and values live in a cache the
//! engine owns (dense or paged, see [`crate::kv`]), not in contiguous tensors; candle's CPU
//! flash attention needs the latter and would force a copy of the whole cache every step.
//!
//! Every query row is computed the same way whatever else is in the batch: scores over the
//! visible keys in position order, softmax, weighted sum of values in position order. So a
//! sequence's output does not depend on how it was batched or chunked (batch invariance): with
//! row-independent matmul kernels, cached decoding, chunked prefill and continuous batching
//! reproduce one-shot prefill bit for bit. Work is split over (sequence, key/value head, block
//! of query rows).

use rayon::prelude::*;

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
    let width = shape.n_heads * shape.head_dim;
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
    // (sequence, first output row of the sequence, row range inside it)
    let mut tasks = Vec::new();
    let mut row0 = 0;
    for (si, s) in seqs.iter().enumerate() {
        let mut i = 0;
        while i < s.n {
            let end = (i + ROWS_PER_TASK).min(s.n);
            tasks.push((si, row0, i..end));
            i = end;
        }
        row0 += s.n;
    }
    let mut out = vec![0f32; row0 * width];
    // Hand each task the disjoint slice of `out` holding its rows.
    let mut slices = Vec::with_capacity(tasks.len());
    let mut rest: &mut [f32] = &mut out;
    for (_, _, rows) in &tasks {
        let (head, tail) = rest.split_at_mut(rows.len() * width);
        slices.push(head);
        rest = tail;
    }
    tasks
        .par_iter()
        .zip(slices.into_par_iter())
        .for_each(|((si, _, rows), dst)| {
            let seq = &seqs[*si];
            let mut scores = Vec::new();
            for (k, i) in rows.clone().enumerate() {
                let q_row = &seq.q[i * width..(i + 1) * width];
                let o_row = &mut dst[k * width..(k + 1) * width];
                attend_row(seq, seq.start + i, q_row, o_row, shape, &mut scores);
            }
        });
    Ok(out)
}

/// All heads of one query row at position `pos`.
fn attend_row(
    seq: &SeqAttn<'_>,
    pos: usize,
    q_row: &[f32],
    out: &mut [f32],
    shape: &AttnShape,
    scores: &mut Vec<f32>,
) {
    let hd = shape.head_dim;
    let group = shape.n_heads / shape.n_kv_heads;
    let lo = shape.window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let hi = pos + 1;
    for h in 0..shape.n_heads {
        let g = h / group;
        let q = &q_row[h * hd..(h + 1) * hd];
        scores.clear();
        visit(seq, lo, hi, |k_all, _| {
            scores.push(dot(q, &k_all[g * hd..(g + 1) * hd]) * shape.scale);
        });
        softmax_in_place(scores);
        let acc = &mut out[h * hd..(h + 1) * hd];
        let mut j = 0;
        visit(seq, lo, hi, |_, v_all| {
            axpy(scores[j], &v_all[g * hd..(g + 1) * hd], acc);
            j += 1;
        });
    }
}

/// Calls `f(k_row, v_row)` for each cached position in `lo..hi`, in order.
#[inline]
fn visit(seq: &SeqAttn<'_>, lo: usize, hi: usize, mut f: impl FnMut(&[f32], &[f32])) {
    let mut pos = 0;
    for c in &seq.chunks {
        if pos >= hi {
            break;
        }
        let row = c.k.len().checked_div(c.tokens).unwrap_or(0);
        let from = lo.saturating_sub(pos).min(c.tokens);
        let to = (hi - pos).min(c.tokens);
        for t in from..to {
            f(&c.k[t * row..(t + 1) * row], &c.v[t * row..(t + 1) * row]);
        }
        pos += c.tokens;
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent sums let the compiler vectorise without reassociating one chain.
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[inline]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

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
