//! The one-row tile (every decode step's) on AVX2: K and V rows read in place, f32 as they
//! are and f16 widened eight at a time with F16C, in the arithmetic of the portable tile
//! (`tile_with::<Portable>`): each dot product as sixteen lane sums of separately rounded
//! products, folded 8, 4, 2, 1; each output as `o + w · v`, position by position. Prompt
//! passes run `tile_with` on this file's `dot`, `axpy` and `widen_f16`, the same arithmetic
//! again. So a decode row equals the same row in a prompt pass bit for bit here too, and the
//! portable tile stays the reference.
//!
//! Before it, a decode row went through the portable tile, which widens every K and V row
//! into a buffer and calls a dot product per head and position: on this shape (SmolLM2, 64
//! sequences of 1,024 f16 positions) 2.7 GB/s of K/V on an AMD EPYC (Zen 3) with AVX2, 11.4
//! GB/s with this kernel (18.9 → 4.4 ms per layer; the ignored `paged_decode_attention_timing`
//! test).

use std::arch::x86_64::*;

use super::{
    f16_rows, f32_rows, in_place_rows, partial_len, row_runs, softmax_partial, AttnShape, InPlace,
    KvChunk, Run, SeqAttn, Spread, Task,
};

/// A K/V value type the tile reads in place, eight at a time.
trait Lanes8: Copy {
    /// The 8 values at `p` as f32 (exact).
    ///
    /// # Safety
    /// 8 values must be readable at `p`, on a CPU with avx2 and f16c.
    unsafe fn load8(p: *const Self) -> __m256;
}

impl Lanes8 for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        _mm256_loadu_ps(p)
    }
}

impl Lanes8 for half::f16 {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

/// `task`'s partials (`[head][m, l, o]`) when it is one query row over f32 or f16 rows with
/// heads of 64, 128 or 256 values; false, with nothing written, otherwise (the portable tile
/// serves those).
///
/// # Safety
/// The CPU must have avx2, fma and f16c.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn row_tile(
    seq: &SeqAttn<'_>,
    task: &Task,
    shape: &AttnShape,
    out: &mut [f32],
) -> bool {
    if task.rows.len() != 1 {
        return false;
    }
    match shape.head_dim {
        64 => in_place::<4>(seq, task, shape, out),
        128 => in_place::<8>(seq, task, shape, out),
        256 => in_place::<16>(seq, task, shape, out),
        _ => false,
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn in_place<const VECS: usize>(
    seq: &SeqAttn<'_>,
    task: &Task,
    shape: &AttnShape,
    out: &mut [f32],
) -> bool {
    match in_place_rows(seq) {
        Some(InPlace::F16) => row::<half::f16, VECS>(seq, task, shape, out, f16_rows),
        Some(InPlace::F32) => row::<f32, VECS>(seq, task, shape, out, f32_rows),
        None => return false,
    }
    true
}

/// The one query row of `task` over its tile, heads of `VECS * 16` values.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn row<'a, E: Lanes8 + 'a, const VECS: usize>(
    seq: &SeqAttn<'a>,
    task: &Task,
    shape: &AttnShape,
    out: &mut [f32],
    rows: impl Fn(&KvChunk<'a>) -> (&'a [E], &'a [E]),
) {
    let hd = VECS * 16;
    let heads = shape.n_heads;
    let group = heads / shape.n_kv_heads;
    let row = shape.n_kv_heads * hd;
    let plen = partial_len(hd);
    let r = task.rows.start;
    let Some((n, runs)) = row_runs(seq, task, shape, out, rows) else {
        return;
    };
    let q = &seq.q[r * heads * hd..(r + 1) * heads * hd];
    // The portable dot product adds its (empty) remainder's sum to the folded lanes.
    let tail = _mm_set1_ps(std::iter::empty::<f32>().sum());
    let scale = _mm_set1_ps(shape.scale);
    let mut scores = vec![0f32; heads * n];
    for (ri, run) in runs.iter().enumerate() {
        // The next run's K rows and this run's V rows are fetched a few lines per step while
        // this run's scores are computed.
        let next_k = runs.get(ri + 1).map_or(&[][..], |nx| nx.k);
        let mut ahead = Spread::new([next_k, run.v], heads * run.n.div_ceil(4));
        for h in 0..heads {
            let qh = q.as_ptr().add(h * hd);
            let g = h / group;
            let dst = &mut scores[h * n + run.at..h * n + run.at + run.n];
            let mut i = 0;
            while i < run.n {
                ahead.step();
                let m = (run.n - i).min(4);
                // A quad past the run's end repeats its last position, not stored.
                let kp: [*const E; 4] =
                    std::array::from_fn(|p| run.k.as_ptr().add((i + p.min(m - 1)) * row + g * hd));
                let sums = _mm_mul_ps(_mm_add_ps(tail, quad_dots::<E, VECS>(qh, &kp)), scale);
                let mut four = [0f32; 4];
                _mm_storeu_ps(four.as_mut_ptr(), sums);
                dst[i..i + m].copy_from_slice(&four[..m]);
                i += 4;
            }
        }
    }
    for h in 0..heads {
        softmax_partial(&mut scores[h * n..(h + 1) * n], out, h * plen);
    }
    for g in 0..shape.n_kv_heads {
        let mut h = g * group;
        let end = (g + 1) * group;
        while h < end {
            let take = (end - h).min(3);
            for c0 in (0..hd).step_by(32) {
                let args = (
                    &runs[..],
                    g * hd + c0,
                    h,
                    &scores[..],
                    n,
                    row,
                    &mut *out,
                    plen,
                    c0,
                );
                match take {
                    3 => values::<E, 3>(args),
                    2 => values::<E, 2>(args),
                    _ => values::<E, 1>(args),
                }
            }
            h += take;
        }
    }
}

/// The dot products of the query head at `q` with four positions' key rows, each as the
/// portable `dot` sums it: lanes `k` and `k + 8` of sixteen accumulate `q · k` (products
/// rounded, then added) over the head's values in order, then the lanes fold 8, 4, 2, 1.
///
/// # Safety
/// The CPU must have avx2 and f16c; `VECS * 16` values must be readable at `q` and at every
/// pointer of `kp`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn quad_dots<E: Lanes8, const VECS: usize>(q: *const f32, kp: &[*const E; 4]) -> __m128 {
    let mut lo = [_mm256_setzero_ps(); 4];
    let mut hi = [_mm256_setzero_ps(); 4];
    for c in 0..VECS {
        let (q0, q1) = (
            _mm256_loadu_ps(q.add(c * 16)),
            _mm256_loadu_ps(q.add(c * 16 + 8)),
        );
        for p in 0..4 {
            lo[p] = _mm256_add_ps(lo[p], _mm256_mul_ps(q0, E::load8(kp[p].add(c * 16))));
            hi[p] = _mm256_add_ps(hi[p], _mm256_mul_ps(q1, E::load8(kp[p].add(c * 16 + 8))));
        }
    }
    // Lane k += lane k + 8, then k + 4: four lanes per position.
    let w: [__m128; 4] = std::array::from_fn(|p| {
        let v = _mm256_add_ps(lo[p], hi[p]);
        _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v))
    });
    // Lane k += lane k + 2: [a0, b0, a1, b1] for positions a, b (and c, d).
    let ab = _mm_add_ps(_mm_unpacklo_ps(w[0], w[1]), _mm_unpackhi_ps(w[0], w[1]));
    let cd = _mm_add_ps(_mm_unpacklo_ps(w[2], w[3]), _mm_unpackhi_ps(w[2], w[3]));
    // Lane 0 += lane 1.
    _mm_add_ps(_mm_movelh_ps(ab, cd), _mm_movehl_ps(cd, ab))
}

/// Values `c0..c0 + 32` of the outputs of heads `h0..h0 + S` (key/value head row offset
/// `off`) over every run: accumulators in registers over the tile, each updated once per
/// position in order as the portable `axpy` does (`o + w · v`, the product rounded first).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::type_complexity)]
unsafe fn values<E: Lanes8, const S: usize>(
    (runs, off, h0, scores, n, row, out, plen, c0): (
        &[Run<'_, E>],
        usize,
        usize,
        &[f32],
        usize,
        usize,
        &mut [f32],
        usize,
        usize,
    ),
) {
    let mut acc = [[_mm256_setzero_ps(); 4]; S];
    for run in runs {
        for i in 0..run.n {
            let vp = run.v.as_ptr().add(i * row + off);
            let w: [__m256; S] =
                std::array::from_fn(|j| _mm256_set1_ps(scores[(h0 + j) * n + run.at + i]));
            for c in 0..4 {
                let x = E::load8(vp.add(c * 8));
                for (a, &wj) in acc.iter_mut().zip(&w) {
                    a[c] = _mm256_add_ps(a[c], _mm256_mul_ps(wj, x));
                }
            }
        }
    }
    for (j, a) in acc.iter().enumerate() {
        let o = out[(h0 + j) * plen + 2 + c0..][..32].as_mut_ptr();
        for (c, v) in a.iter().enumerate() {
            _mm256_storeu_ps(o.add(c * 8), *v);
        }
    }
}

/// `dst = src` widened (exactly), eight values at a time.
///
/// # Safety
/// The CPU must have avx2 and f16c.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn widen_f16(src: &[half::f16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let mut c = 0;
    while c + 8 <= n {
        _mm256_storeu_ps(
            dst.as_mut_ptr().add(c),
            half::f16::load8(src.as_ptr().add(c)),
        );
        c += 8;
    }
    for i in c..n {
        dst[i] = src[i].to_f32();
    }
}

/// `a · b` as the portable `dot` sums it: the products of values `16j + k` and `16j + k + 8`
/// accumulate in lanes `k` and `k + 8` (rounded product, then added), the lanes fold 8, 4, 2,
/// 1, and the remainder's products, summed in order, go first.
///
/// # Safety
/// The CPU must have avx2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let whole = n / 16 * 16;
    let tail: f32 = a[whole..n]
        .iter()
        .zip(&b[whole..n])
        .map(|(x, y)| x * y)
        .sum();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut c = 0;
    while c < whole {
        lo = _mm256_add_ps(
            lo,
            _mm256_mul_ps(_mm256_loadu_ps(pa.add(c)), _mm256_loadu_ps(pb.add(c))),
        );
        hi = _mm256_add_ps(
            hi,
            _mm256_mul_ps(
                _mm256_loadu_ps(pa.add(c + 8)),
                _mm256_loadu_ps(pb.add(c + 8)),
            ),
        );
        c += 16;
    }
    let v = _mm256_add_ps(lo, hi);
    let x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let y = _mm_add_ps(x, _mm_movehl_ps(x, x));
    let z = _mm_add_ss(y, _mm_shuffle_ps::<1>(y, y));
    tail + _mm_cvtss_f32(z)
}

/// `out[h] = q_h · k_{kv[h]}` for every query head, each as [`dot`] sums it.
///
/// # Safety
/// The CPU must have avx2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn dots(q: &[f32], k: &[f32], kv: &[usize], hd: usize, out: &mut [f32]) {
    for (h, o) in out.iter_mut().enumerate() {
        let g = kv[h];
        *o = dot(&q[h * hd..(h + 1) * hd], &k[g * hd..(g + 1) * hd]);
    }
}

/// `y += w · x` as the portable `axpy` computes it (the product rounded, then added).
///
/// # Safety
/// The CPU must have avx2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn axpy(w: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let wv = _mm256_set1_ps(w);
    let (px, py) = (x.as_ptr(), y.as_mut_ptr());
    let mut c = 0;
    while c + 8 <= n {
        let o = _mm256_loadu_ps(py.add(c));
        _mm256_storeu_ps(
            py.add(c),
            _mm256_add_ps(o, _mm256_mul_ps(wv, _mm256_loadu_ps(px.add(c)))),
        );
        c += 8;
    }
    for i in c..n {
        y[i] += w * x[i];
    }
}
