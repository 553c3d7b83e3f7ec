//! Causal self-attention of a batch of sequences over their own cached keys and values.
//!
//! Written here rather than taken from candle because the keys and values live in a cache the
//! engine owns (dense or paged, see [`crate::kv`]), not in contiguous tensors; candle's CPU
//! flash attention needs the latter and would force a copy of the whole cache every step.
//!
//! Positions are cut into fixed tiles of [`TILE`] positions, counted from position 0. For each
//! (query row, head) a tile gives a partial softmax: its largest score `m`, `l = Σ exp(s − m)`
//! and `o = Σ exp(s − m) · v` over the tile's visible positions, in position order; the row's
//! output merges the tiles in order (`m* = max m`, `out = Σ e^(m − m*) o / Σ e^(m − m*) l`),
//! as flash-decoding does. The tiles depend only on absolute positions, and a row's arithmetic
//! never on which other rows share its task, so a sequence's output does not depend on how it
//! was batched, chunked or split over threads (batch invariance): with row-independent matmul
//! kernels, cached decoding, chunked prefill and continuous batching reproduce one-shot
//! prefill bit for bit.
//!
//! Work is split over (sequence, block of up to [`ROWS_PER_TASK`] query rows, tile), every
//! head in one task: each task streams whole K and V rows (all key/value heads of a position
//! at once, the next rows prefetched), so a paged cache's blocks are read once, in order, by
//! one thread, and one long context still uses every core (its tiles run in parallel). Before
//! this layout tasks were split by key/value head, each reading a third of every row; on
//! SmolLM2's shape, 64 sequences of 1,024 positions in 16-position blocks, attention read
//! 8.0 GB/s of K/V against 15.5 GB/s now (the ignored `paged_decode_attention_timing` test).
//!
//! A task of one query row (every decode step's) runs a kernel of its own on AVX-512
//! (`row_tile_with`): rows read in place, the output accumulators held in registers over the
//! tile, four positions' dot products reduced together, in the same arithmetic as the
//! general kernel, so the two agree bit for bit. On 64 sequences of 1,024 f16 positions it
//! took a layer from 4.9 to 3.3-3.5 ms (the ignored timing test). A task of several rows
//! (a prompt pass's) runs `rows_tile_with`: the same arithmetic per row, with a block of rows
//! sharing every K and V load, and the value accumulators of several rows and heads in
//! registers. On a 512-row prompt from position 0 over f16 blocks it took a layer from 7.4 to
//! 3.3 ms on SmolLM2's shape, 17.9 to 6.3 on Qwen2.5 1.5B's and 9.9 to 3.2 on Gemma 3's (the
//! ignored `prefill_attention_timing` test).
//!
//! f16 rows ([`crate::kv::F16Rows`]) are widened to f32 a row at a time (exactly); 8-bit rows
//! ([`crate::kv::Int8Rows`]) a head at a time, their scale multiplying the dot product (keys)
//! or the softmax weight (values) rather than every value. The inner loops are compiled for
//! AVX-512 and for AVX2 / scalar and picked once per process
//! ([`switchyard_kernels::cpu::simd_level`]).

use switchyard_kernels::cpu::{simd_level, SimdLevel};
use switchyard_kernels::prof::{self, Part};

use crate::kv::KvChunk;
use crate::Result;

#[cfg(target_arch = "x86_64")]
mod avx2;

/// Query rows per task: they share each K and V row read.
const ROWS_PER_TASK: usize = 16;
/// Positions per tile (fixed by absolute position: part of the arithmetic, not of the split).
pub const TILE: usize = 256;
/// Multiply-accumulates below which attention runs on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 16;
/// Positions ahead whose K (or V) row is prefetched: a paged cache's blocks are separate
/// allocations, so the hardware prefetcher loses the stream at every block.
const PREFETCH_AHEAD: usize = 4;

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

/// One work item: rows `rows` of sequence `seq`, positions of tile `tile`.
#[derive(Debug, Clone)]
struct Task {
    seq: usize,
    rows: std::ops::Range<usize>,
    tile: usize,
}

/// Floats of one (row, head) partial: `m`, `l`, then `o` (`head_dim` values).
fn partial_len(hd: usize) -> usize {
    hd + 2
}

/// Attention output for every query row of every sequence, `[rows][n_heads * head_dim]`, in the
/// order the sequences are given.
pub fn attend(seqs: &[SeqAttn<'_>], shape: &AttnShape) -> Result<Vec<f32>> {
    attend_at(seqs, shape, simd_level())
}

/// [`attend`] on the inner loops of `level` (which the CPU must run).
fn attend_at(seqs: &[SeqAttn<'_>], shape: &AttnShape, level: SimdLevel) -> Result<Vec<f32>> {
    let _span = tracing::trace_span!("attention", seqs = seqs.len()).entered();
    let _t = prof::time(Part::Attention);
    let hd = shape.head_dim;
    let width = shape.n_heads * hd;
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
        if s.q.len() < s.n * width {
            return Err(candle_core::Error::Msg(format!(
                "{} query rows of {width} values need {} values, got {}",
                s.n,
                s.n * width,
                s.q.len()
            ))
            .into());
        }
    }
    let mut tasks = Vec::new();
    let mut work = 0usize;
    for (si, s) in seqs.iter().enumerate() {
        let mut i = 0;
        while i < s.n {
            let end = (i + ROWS_PER_TASK).min(s.n);
            let lo = visible(shape, s.start + i).start;
            let hi = s.start + end;
            for tile in lo / TILE..hi.div_ceil(TILE) {
                tasks.push(Task {
                    seq: si,
                    rows: i..end,
                    tile,
                });
            }
            work += (end - i) * (hi - lo) * shape.n_heads * hd * 2;
            i = end;
        }
    }
    let plen = partial_len(hd);
    let run = |t: &Task| -> Vec<f32> {
        let mut out = vec![0f32; t.rows.len() * shape.n_heads * plen];
        tile_partials(&seqs[t.seq], t, shape, level, &mut out);
        out
    };
    let parts: Vec<Vec<f32>> = if work < PARALLEL_MIN_WORK {
        tasks.iter().map(run).collect()
    } else {
        let profiling = prof::enabled();
        let slots: Vec<std::sync::Mutex<Vec<f32>>> = tasks
            .iter()
            .map(|_| std::sync::Mutex::new(Vec::new()))
            .collect();
        switchyard_kernels::pool::run(tasks.len(), &|t| {
            let timer = profiling.then(std::time::Instant::now);
            let out = run(&tasks[t]);
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
    Ok(merge(seqs, shape, &tasks, &parts))
}

/// Positions row at `pos` attends to.
fn visible(shape: &AttnShape, pos: usize) -> std::ops::Range<usize> {
    shape.window.map_or(0, |w| (pos + 1).saturating_sub(w))..pos + 1
}

/// Each of `task`'s rows' visible positions inside its tile (empty where it sees none).
fn tile_spans(seq: &SeqAttn<'_>, task: &Task, shape: &AttnShape) -> Vec<(usize, usize)> {
    let (t0, t1) = (task.tile * TILE, (task.tile + 1) * TILE);
    task.rows
        .clone()
        .map(|r| {
            let v = visible(shape, seq.start + r);
            (v.start.max(t0), v.end.min(t1))
        })
        .collect()
}

/// A (row, head) partial's `m` and `l` from its scores over its visible positions, the scores
/// replaced by their softmax numerators: `out[at] = max s`, `out[at + 1] = Σ exp(s − max)`.
#[inline]
fn softmax_partial(scores: &mut [f32], out: &mut [f32], at: usize) {
    let m = switchyard_kernels::fastmath::max(scores);
    out[at] = m;
    out[at + 1] = switchyard_kernels::fastmath::exp_shifted_in_place(scores, m);
}

/// The partial of a (row, head) that sees no position of the tile (the merge skips it).
#[inline]
fn empty_partial(out: &mut [f32], at: usize) {
    out[at] = f32::NEG_INFINITY;
    out[at + 1] = 0.0;
}

/// Each row's output from its tiles' partials, merged in tile order.
fn merge(seqs: &[SeqAttn<'_>], shape: &AttnShape, tasks: &[Task], parts: &[Vec<f32>]) -> Vec<f32> {
    let hd = shape.head_dim;
    let heads = shape.n_heads;
    let width = heads * hd;
    let plen = partial_len(hd);
    let mut firsts = Vec::with_capacity(seqs.len());
    let mut total = 0;
    for s in seqs {
        firsts.push(total);
        total += s.n;
    }
    let mut out = vec![0f32; total * width];
    let mut t = 0;
    while t < tasks.len() {
        // The tasks of one row block are consecutive, tiles in increasing order.
        let mut e = t + 1;
        while e < tasks.len() && tasks[e].seq == tasks[t].seq && tasks[e].rows == tasks[t].rows {
            e += 1;
        }
        let block = &tasks[t].rows;
        for (k, r) in block.clone().enumerate() {
            for h in 0..heads {
                let at = (k * heads + h) * plen;
                let m = parts[t..e]
                    .iter()
                    .map(|p| p[at])
                    .fold(f32::NEG_INFINITY, f32::max);
                let dst = &mut out[(firsts[tasks[t].seq] + r) * width + h * hd..][..hd];
                let mut l = 0f32;
                for p in &parts[t..e] {
                    let (pm, pl) = (p[at], p[at + 1]);
                    if pl == 0.0 {
                        continue;
                    }
                    let w = (pm - m).exp();
                    l += w * pl;
                    for (d, o) in dst.iter_mut().zip(&p[at + 2..at + plen]) {
                        *d += w * o;
                    }
                }
                let inv = 1.0 / l;
                dst.iter_mut().for_each(|d| *d *= inv);
            }
        }
        t = e;
    }
    out
}

/// Calls `f(chunk, offset, position)` for every held position in `a..b`, in order, and
/// prefetches the `half` row [`PREFETCH_AHEAD`] positions ahead of each.
#[inline(always)]
fn for_positions<'c, 'a>(
    chunks: &'c [KvChunk<'a>],
    a: usize,
    b: usize,
    half: Half,
    row: usize,
    mut f: impl FnMut(&'c KvChunk<'a>, usize, usize),
) {
    let mut at = 0;
    for (ci, c) in chunks.iter().enumerate() {
        if at >= b {
            break;
        }
        let end = at + c.tokens;
        if end > a {
            for t in a.saturating_sub(at)..(b - at).min(c.tokens) {
                // The row PREFETCH_AHEAD positions on, in this chunk or the next.
                let ahead = t + PREFETCH_AHEAD;
                if ahead < c.tokens {
                    prefetch(c, ahead, half, row);
                } else if let Some(next) = chunks.get(ci + 1) {
                    if ahead - c.tokens < next.tokens {
                        prefetch(next, ahead - c.tokens, half, row);
                    }
                }
                f(c, t, at + t);
            }
        }
        at = end;
    }
}

/// Which half of a cache row a pass reads.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Half {
    K,
    V,
}

/// One position's row of `half` as f32 (`row` values) and a factor per key/value head that
/// multiplies what the row's values give (1 but for 8-bit rows). f32 rows are used in place;
/// f16 and 8-bit rows are widened into `buf`.
#[inline(always)]
fn load_row<'b, O: Ops>(
    c: &'b KvChunk<'_>,
    t: usize,
    half: Half,
    row: usize,
    hd: usize,
    buf: &'b mut [f32],
    scales: &mut [f32],
) -> &'b [f32] {
    if let Some(h) = &c.f16 {
        let src = match half {
            Half::K => h.k,
            Half::V => h.v,
        };
        O::widen_f16(&src[t * row..(t + 1) * row], buf);
        return buf;
    }
    if let Some(q) = &c.int8 {
        let (values, sc) = match half {
            Half::K => (q.k, q.k_scales),
            Half::V => (q.v, q.v_scales),
        };
        for (d, &x) in buf.iter_mut().zip(&values[t * row..(t + 1) * row]) {
            *d = f32::from(x);
        }
        let heads = row / hd;
        scales[..heads].copy_from_slice(&sc[t * heads..(t + 1) * heads]);
        return buf;
    }
    match half {
        Half::K => &c.k[t * row..(t + 1) * row],
        Half::V => &c.v[t * row..(t + 1) * row],
    }
}

/// Prefetches the `half` row at offset `t` of chunk `c`.
#[inline(always)]
fn prefetch(c: &KvChunk<'_>, t: usize, half: Half, row: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let (ptr, bytes) = if let Some(h) = &c.f16 {
            let s = match half {
                Half::K => h.k,
                Half::V => h.v,
            };
            (s.as_ptr().wrapping_add(t * row) as *const i8, row * 2)
        } else if let Some(q) = &c.int8 {
            let s = match half {
                Half::K => q.k,
                Half::V => q.v,
            };
            (s.as_ptr().wrapping_add(t * row), row)
        } else {
            let s = match half {
                Half::K => c.k,
                Half::V => c.v,
            };
            (s.as_ptr().wrapping_add(t * row) as *const i8, row * 4)
        };
        let mut b = 0;
        while b < bytes {
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(ptr.wrapping_add(b)) };
            b += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (c, t, half, row);
}

/// The partials of `task`'s rows over its tile, into `out` (`[row][head][m, l, o]`).
fn tile_partials(
    seq: &SeqAttn<'_>,
    task: &Task,
    shape: &AttnShape,
    level: SimdLevel,
    out: &mut [f32],
) {
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: simd_level() returns Avx512 only when the CPU reports avx512f.
        SimdLevel::Avx512 if shape.head_dim.is_multiple_of(16) => unsafe {
            tile_avx512(seq, task, shape, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: simd_level() returns Avx2/Avx512 only when the CPU reports avx2, fma and
        // f16c.
        SimdLevel::Avx2 | SimdLevel::Avx512 => unsafe { tile_avx2(seq, task, shape, out) },
        _ => tile_with::<Portable>(seq, task, shape, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2(seq: &SeqAttn<'_>, task: &Task, shape: &AttnShape, out: &mut [f32]) {
    // Each row of the task through the one-row kernel (the tile's K/V, at most 256 positions,
    // stays in L2 between rows): 1.4-1.6x faster than `tile_with` sharing each K/V row
    // across the rows, which widens it through a buffer and accumulates outputs in memory
    // (figures at `Avx2`).
    let per = shape.n_heads * partial_len(shape.head_dim);
    for (k, r) in task.rows.clone().enumerate() {
        let one = Task {
            seq: task.seq,
            rows: r..r + 1,
            tile: task.tile,
        };
        // Either every row (same sequence and shape) or none is served, the first decides.
        if !avx2::row_tile(seq, &one, shape, &mut out[k * per..(k + 1) * per]) {
            break;
        }
        if r + 1 == task.rows.end {
            return;
        }
    }
    match shape.head_dim {
        64 => tile_with::<Avx2<64>>(seq, task, shape, out),
        128 => tile_with::<Avx2<128>>(seq, task, shape, out),
        256 => tile_with::<Avx2<256>>(seq, task, shape, out),
        _ => tile_with::<Avx2<0>>(seq, task, shape, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512(seq: &SeqAttn<'_>, task: &Task, shape: &AttnShape, out: &mut [f32]) {
    let done = match shape.head_dim {
        64 => tile_in_place::<4>(seq, task, shape, out),
        128 => tile_in_place::<8>(seq, task, shape, out),
        256 => tile_in_place::<16>(seq, task, shape, out),
        _ => false,
    };
    if done {
        return;
    }
    match shape.head_dim {
        64 => tile_with::<Avx512<64>>(seq, task, shape, out),
        128 => tile_with::<Avx512<128>>(seq, task, shape, out),
        256 => tile_with::<Avx512<256>>(seq, task, shape, out),
        _ => tile_with::<Avx512<0>>(seq, task, shape, out),
    }
}

/// The vector operations of a tile, for one instruction set.
trait Ops {
    /// `dst[i] = src[i]` as f32 (exact).
    fn widen_f16(src: &[half::f16], dst: &mut [f32]);
    fn dot(a: &[f32], b: &[f32]) -> f32;
    /// `out[h] = q_h · k_g` for every query head `h` (`q`: `heads` rows of `hd`) and its
    /// key/value head `g = kv[h]` (`k`: one position's key row).
    #[inline(always)]
    fn dots(q: &[f32], k: &[f32], kv: &[usize], hd: usize, out: &mut [f32]) {
        for (h, o) in out.iter_mut().enumerate() {
            let g = kv[h];
            *o = Self::dot(&q[h * hd..(h + 1) * hd], &k[g * hd..(g + 1) * hd]);
        }
    }
    /// `y += w · x`.
    fn axpy(w: f32, x: &[f32], y: &mut [f32]);
}

/// Plain loops in a fixed order; the compiler vectorizes them for the caller's instruction
/// set.
struct Portable;

impl Ops for Portable {
    #[inline(always)]
    fn widen_f16(src: &[half::f16], dst: &mut [f32]) {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst)
    }

    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        dot(a, b)
    }

    #[inline(always)]
    fn axpy(w: f32, x: &[f32], y: &mut [f32]) {
        axpy(w, x, y)
    }
}

/// Explicit AVX-512 for heads whose length is a multiple of 16 (every zoo model's), `HD`
/// values long; `HD = 0` takes the length from the slices. A known length unrolls the loops
/// over a head's values (a run-time one kept every inner loop rolled); the operations and
/// their order are the same either way.
#[cfg(target_arch = "x86_64")]
struct Avx512<const HD: usize>;

/// A head's `HD` values at the start of `x` (`HD = 0`: all of `x`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn head<const HD: usize>(x: &[f32]) -> &[f32] {
    if HD == 0 {
        x
    } else {
        &x[..HD]
    }
}

#[cfg(target_arch = "x86_64")]
impl<const HD: usize> Ops for Avx512<HD> {
    #[inline(always)]
    fn widen_f16(src: &[half::f16], dst: &mut [f32]) {
        // SAFETY: only used from `tile_avx512`, which runs where the CPU has avx512f.
        unsafe { widen_f16_avx512(src, dst) }
    }

    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: as above.
        unsafe { dot_avx512(head::<HD>(a), head::<HD>(b)) }
    }

    #[inline(always)]
    fn dots(q: &[f32], k: &[f32], kv: &[usize], hd: usize, out: &mut [f32]) {
        debug_assert!(HD == 0 || hd == HD);
        let hd = if HD == 0 { hd } else { HD };
        // SAFETY: as above.
        unsafe { dots_avx512(q, k, kv, hd, out) }
    }

    #[inline(always)]
    fn axpy(w: f32, x: &[f32], y: &mut [f32]) {
        let n = if HD == 0 { x.len().min(y.len()) } else { HD };
        // SAFETY: as above.
        unsafe { axpy_avx512(w, &x[..n], &mut y[..n]) }
    }
}

/// Explicit AVX2 in the portable arithmetic ([`dot`]'s sixteen lane sums of rounded products,
/// [`axpy`]'s rounded product then sum), so a row's result equals the portable tile's and the
/// one-row kernel's bit for bit. `HD` as for [`Avx512`]. It serves what the one-row kernel
/// does not read in place (8-bit K/V, other head lengths); before it those, and every prompt
/// pass, ran `tile_with::<Portable>` with the closures' loops compiled for the baseline
/// instruction set.
///
/// Prompt passes on AVX2, a 512-row prompt from position 0 over f16 blocks, ms per layer on
/// an AMD EPYC (the ignored `prefill_attention_timing` test, the three binaries alternated
/// twice on a quiet machine): portable tile → `tile_with` on these ops → each row through
/// the one-row kernel (`tile_avx2`): SmolLM2's shape 27.7-30.2 → 11.7-13.2 → 8.4-9.3,
/// Qwen2.5 1.5B's 51.9-59.2 → 25.5-27.3 → 16.8, Gemma 3's 33.0-33.2 → 14.8-15.4 → 10.6-11.0.
#[cfg(target_arch = "x86_64")]
struct Avx2<const HD: usize>;

#[cfg(target_arch = "x86_64")]
impl<const HD: usize> Ops for Avx2<HD> {
    #[inline(always)]
    fn widen_f16(src: &[half::f16], dst: &mut [f32]) {
        // SAFETY: only used from `tile_avx2`, which runs where the CPU has avx2, fma and f16c.
        unsafe { avx2::widen_f16(src, dst) }
    }

    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: as above.
        unsafe { avx2::dot(head::<HD>(a), head::<HD>(b)) }
    }

    #[inline(always)]
    fn dots(q: &[f32], k: &[f32], kv: &[usize], hd: usize, out: &mut [f32]) {
        debug_assert!(HD == 0 || hd == HD);
        let hd = if HD == 0 { hd } else { HD };
        // SAFETY: as above.
        unsafe { avx2::dots(q, k, kv, hd, out) }
    }

    #[inline(always)]
    fn axpy(w: f32, x: &[f32], y: &mut [f32]) {
        let n = if HD == 0 { x.len().min(y.len()) } else { HD };
        // SAFETY: as above.
        unsafe { avx2::axpy(w, &x[..n], &mut y[..n]) }
    }
}

/// [`Ops::dots`] with the horizontal sums of four heads folded together (a quarter of the
/// shuffles of four separate reductions).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn dots_avx512(q: &[f32], k: &[f32], kv: &[usize], hd: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let heads = out.len();
    let acc = |h: usize| {
        let (qh, kg) = (q.as_ptr().add(h * hd), k.as_ptr().add(kv[h] * hd));
        let mut a = _mm512_setzero_ps();
        let mut c = 0;
        while c < hd {
            a = _mm512_fmadd_ps(_mm512_loadu_ps(qh.add(c)), _mm512_loadu_ps(kg.add(c)), a);
            c += 16;
        }
        a
    };
    let mut h = 0;
    while h + 4 <= heads {
        let sums = fold4(acc(h), acc(h + 1), acc(h + 2), acc(h + 3));
        _mm_storeu_ps(out.as_mut_ptr().add(h), sums);
        h += 4;
    }
    while h < heads {
        out[h] = _mm512_reduce_add_ps(acc(h));
        h += 1;
    }
}

/// The horizontal sums of four vectors, `[Σa, Σb, Σc, Σd]`, each summed in one fixed order
/// that depends on its own lanes only (so a sum does not depend on its three neighbours).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn fold4(
    a: std::arch::x86_64::__m512,
    b: std::arch::x86_64::__m512,
    c: std::arch::x86_64::__m512,
    d: std::arch::x86_64::__m512,
) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], then [a, b, c, d] partial sums.
    let ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    let cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    let u = _mm512_add_ps(
        _mm512_shuffle_ps::<0b01_00_01_00>(ab, cd),
        _mm512_shuffle_ps::<0b11_10_11_10>(ab, cd),
    );
    // Across the four lanes.
    let v = _mm512_add_ps(u, _mm512_shuffle_f32x4::<0b01_00_11_10>(u, u));
    let w = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0b10_11_00_01>(v, v));
    _mm512_castps512_ps128(w)
}

/// A K/V value type the one-row tile reads in place, 16 at a time.
#[cfg(target_arch = "x86_64")]
trait KvLanes: Copy {
    /// The 16 values at `p` as f32 (exact).
    ///
    /// # Safety
    /// 16 values must be readable at `p`, on a CPU with avx512f.
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

#[cfg(target_arch = "x86_64")]
impl KvLanes for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
}

#[cfg(target_arch = "x86_64")]
impl KvLanes for half::f16 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
}

/// Consecutive held positions in one chunk: their K and V rows, `n` of each.
#[cfg(target_arch = "x86_64")]
struct Run<'a, E> {
    k: &'a [E],
    v: &'a [E],
    /// Offset of the run's first position from the span's first.
    at: usize,
    n: usize,
}

/// `task` over its tile, for heads of `VECS * 16` values, reading f32 or f16 rows in place:
/// [`row_tile_with`] for one query row (a decode step's), [`rows_tile_with`] for several (a
/// prompt pass's). Returns false (and writes nothing) for 8-bit rows, which [`tile_with`]
/// serves.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_in_place<const VECS: usize>(
    seq: &SeqAttn<'_>,
    task: &Task,
    shape: &AttnShape,
    out: &mut [f32],
) -> bool {
    match in_place_rows(seq) {
        Some(InPlace::F16) => tile_of::<half::f16, VECS>(seq, task, shape, out, f16_rows),
        Some(InPlace::F32) => tile_of::<f32, VECS>(seq, task, shape, out, f32_rows),
        None => return false,
    }
    true
}

/// How every chunk of a sequence holds its rows, where the in-place kernels can read them.
#[derive(Clone, Copy)]
enum InPlace {
    F16,
    F32,
}

/// `None` for 8-bit rows, or a mix of f16 and f32 chunks (the general tile serves those).
fn in_place_rows(seq: &SeqAttn<'_>) -> Option<InPlace> {
    if seq.chunks.iter().any(|c| c.int8.is_some()) {
        None
    } else if seq.chunks.iter().all(|c| c.f16.is_some()) {
        Some(InPlace::F16)
    } else if seq.chunks.iter().all(|c| c.f16.is_none()) {
        Some(InPlace::F32)
    } else {
        None
    }
}

/// A chunk's f16 K and V rows (empty for other chunks, which [`in_place_rows`] rules out).
fn f16_rows<'a>(c: &KvChunk<'a>) -> (&'a [half::f16], &'a [half::f16]) {
    c.f16.map(|h| (h.k, h.v)).unwrap_or_default()
}

/// A chunk's f32 K and V rows.
fn f32_rows<'a>(c: &KvChunk<'a>) -> (&'a [f32], &'a [f32]) {
    (c.k, c.v)
}

/// [`row_tile_with`] or [`rows_tile_with`], by the number of query rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn tile_of<'a, E: KvLanes + 'a, const VECS: usize>(
    seq: &SeqAttn<'a>,
    task: &Task,
    shape: &AttnShape,
    out: &mut [f32],
    rows: impl Fn(&KvChunk<'a>) -> (&'a [E], &'a [E]),
) {
    if task.rows.len() == 1 {
        row_tile_with::<E, VECS>(seq, task, shape, out, rows)
    } else {
        rows_tile_with::<E, VECS>(seq, task, shape, out, rows)
    }
}

/// The runs of `chunks` covering positions `lo..hi`, rows taken by `rows`.
#[cfg(target_arch = "x86_64")]
fn runs_of<'a, E>(
    chunks: &[KvChunk<'a>],
    lo: usize,
    hi: usize,
    shape: &AttnShape,
    rows: impl Fn(&KvChunk<'a>) -> (&'a [E], &'a [E]),
) -> Vec<Run<'a, E>> {
    let row = shape.n_kv_heads * shape.head_dim;
    let mut runs = Vec::new();
    let mut at = 0;
    for c in chunks {
        if at >= hi {
            break;
        }
        let end = at + c.tokens;
        if end > lo {
            let (a, b) = (lo.max(at) - at, hi.min(end) - at);
            let (k, v) = rows(c);
            runs.push(Run {
                k: &k[a * row..b * row],
                v: &v[a * row..b * row],
                at: at + a - lo,
                n: b - a,
            });
        }
        at = end;
    }
    runs
}

/// The one query row of `task`: the number of positions it sees in its tile and their runs;
/// `None`, with every head's partial written empty, where it sees none.
#[cfg(target_arch = "x86_64")]
fn row_runs<'a, E>(
    seq: &SeqAttn<'a>,
    task: &Task,
    shape: &AttnShape,
    out: &mut [f32],
    rows: impl Fn(&KvChunk<'a>) -> (&'a [E], &'a [E]),
) -> Option<(usize, Vec<Run<'a, E>>)> {
    let v = visible(shape, seq.start + task.rows.start);
    let (lo, hi) = (
        v.start.max(task.tile * TILE),
        v.end.min((task.tile + 1) * TILE),
    );
    if lo >= hi {
        for h in 0..shape.n_heads {
            empty_partial(out, h * partial_len(shape.head_dim));
        }
        return None;
    }
    Some((hi - lo, runs_of(&seq.chunks, lo, hi, shape, rows)))
}

/// The one query row of `task` over its tile: the arithmetic of [`tile_with`] on [`Avx512`]
/// (each dot product summed in the same order, the same softmax, each output accumulated over
/// positions in the same order), so a row's result does not depend on which path ran it.
/// Faster because nothing is widened into a buffer, the value accumulators stay in registers
/// over the whole tile (a position's update was a load and a store of every output), and four
/// positions' dot products share one horizontal fold.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn row_tile_with<'a, E: KvLanes + 'a, const VECS: usize>(
    seq: &SeqAttn<'a>,
    task: &Task,
    shape: &AttnShape,
    out: &mut [f32],
    rows: impl Fn(&KvChunk<'a>) -> (&'a [E], &'a [E]),
) {
    use std::arch::x86_64::*;
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
    // Heads below `folded` sum their dot products as `dots_avx512` folds whole groups of four;
    // the rest as it reduces a remainder head alone.
    let folded = heads / 4 * 4;
    let mut scores = vec![0f32; heads * n];
    for (ri, run) in runs.iter().enumerate() {
        // While this run's scores are computed, the next run's K rows and this run's V rows
        // are fetched a few lines per step (a burst at the start of the run left the loads
        // waiting on one another; the values pass then reads V from cache).
        let next_k = runs.get(ri + 1).map_or(&[][..], |nx| nx.k);
        let mut ahead = Spread::new([next_k, run.v], heads * run.n.div_ceil(4));
        for g in 0..shape.n_kv_heads {
            for h in g * group..(g + 1) * group {
                let qh = q.as_ptr().add(h * hd);
                let dot = |i: usize| {
                    let kp = run.k.as_ptr().add(i * row + g * hd);
                    let mut a = _mm512_setzero_ps();
                    for c in 0..VECS {
                        a = _mm512_fmadd_ps(
                            _mm512_loadu_ps(qh.add(c * 16)),
                            E::load16(kp.add(c * 16)),
                            a,
                        );
                    }
                    a
                };
                let dst = &mut scores[h * n + run.at..h * n + run.at + run.n];
                let mut i = 0;
                while i < run.n {
                    ahead.step();
                    let m = (run.n - i).min(4);
                    let mut sums = [0f32; 4];
                    if h < folded {
                        let z = _mm512_setzero_ps();
                        let acc = |j: usize| if j < m { dot(i + j) } else { z };
                        _mm_storeu_ps(sums.as_mut_ptr(), fold4(acc(0), acc(1), acc(2), acc(3)));
                    } else {
                        for (j, s) in sums.iter_mut().enumerate().take(m) {
                            *s = _mm512_reduce_add_ps(dot(i + j));
                        }
                    }
                    for (d, s) in dst[i..i + m].iter_mut().zip(sums) {
                        *d = s * shape.scale;
                    }
                    i += 4;
                }
            }
        }
    }
    for h in 0..heads {
        softmax_partial(&mut scores[h * n..(h + 1) * n], out, h * plen);
    }
    let most = match VECS {
        0..=4 => 4,
        5..=8 => 3,
        _ => 1,
    };
    for g in 0..shape.n_kv_heads {
        let mut h = g * group;
        let end = (g + 1) * group;
        while h < end {
            let take = (end - h).min(most);
            let args = (&runs[..], g, h, &scores[..], n, row, &mut *out, plen);
            match take {
                4 => row_values::<E, VECS, 4>(args),
                3 => row_values::<E, VECS, 3>(args),
                2 => row_values::<E, VECS, 2>(args),
                _ => row_values::<E, VECS, 1>(args),
            }
            h += take;
        }
    }
}

/// Prefetches two byte ranges a few cache lines per [`Spread::step`], evenly over a given
/// number of steps, into L2: prefetched into L1, the kernel spent about half its time on the
/// instruction after a prefetch, waiting for a fill buffer (at 187 sequences of 400
/// positions; into L2, a step's attention took 143-149 ms against 156).
#[cfg(target_arch = "x86_64")]
struct Spread {
    ranges: [(*const i8, usize); 2],
    /// Range being fetched and the byte offset in it.
    at: (usize, usize),
    lines_per_step: usize,
}

#[cfg(target_arch = "x86_64")]
impl Spread {
    fn new<E>(ranges: [&[E]; 2], steps: usize) -> Self {
        let ranges = ranges.map(|r| (r.as_ptr() as *const i8, std::mem::size_of_val(r)));
        let lines: usize = ranges.iter().map(|r| r.1.div_ceil(64)).sum();
        Self {
            ranges,
            at: (0, 0),
            lines_per_step: lines.div_ceil(steps.max(1)),
        }
    }

    #[inline(always)]
    fn step(&mut self) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let mut left = self.lines_per_step;
        while left > 0 {
            let Some(&(base, len)) = self.ranges.get(self.at.0) else {
                return;
            };
            if self.at.1 >= len {
                self.at = (self.at.0 + 1, 0);
                continue;
            }
            // SAFETY: a prefetch never faults, and the address lies inside the range anyway.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(base.wrapping_add(self.at.1)) };
            self.at.1 += 64;
            left -= 1;
        }
    }
}

/// The values of query heads `h0..h0 + S` (all of key/value head `g`) over every run: their
/// accumulators stay in registers across the tile, each updated once per position in order
/// (`o = w · v + o`, as `axpy_avx512` does).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
#[allow(clippy::type_complexity)]
unsafe fn row_values<E: KvLanes, const VECS: usize, const S: usize>(
    (runs, g, h0, scores, n, row, out, plen): (
        &[Run<'_, E>],
        usize,
        usize,
        &[f32],
        usize,
        usize,
        &mut [f32],
        usize,
    ),
) {
    use std::arch::x86_64::*;
    let hd = VECS * 16;
    let mut acc = [[_mm512_setzero_ps(); VECS]; S];
    for run in runs {
        for i in 0..run.n {
            let vp = run.v.as_ptr().add(i * row + g * hd);
            let mut w = [_mm512_setzero_ps(); S];
            for (j, wj) in w.iter_mut().enumerate() {
                *wj = _mm512_set1_ps(scores[(h0 + j) * n + run.at + i]);
            }
            for c in 0..VECS {
                let x = E::load16(vp.add(c * 16));
                for (a, &wj) in acc.iter_mut().zip(&w) {
                    a[c] = _mm512_fmadd_ps(wj, x, a[c]);
                }
            }
        }
    }
    for (j, a) in acc.iter().enumerate() {
        let o = out[(h0 + j) * plen + 2..(h0 + j) * plen + 2 + hd].as_mut_ptr();
        for (c, v) in a.iter().enumerate() {
            _mm512_storeu_ps(o.add(c * 16), *v);
        }
    }
}

/// Rows per block of the multi-row score pass.
const SCORE_ROWS: usize = 4;

/// What every block of a multi-row tile reads: the runs over the rows' joint span `a..`,
/// each row's own span, the query rows and the scores (`[row][head][position - a]`).
#[cfg(target_arch = "x86_64")]
struct Block<'r, 'a, E> {
    runs: &'r [Run<'a, E>],
    spans: &'r [(usize, usize)],
    a: usize,
    n: usize,
    heads: usize,
    row: usize,
}

/// The query rows of `task` over its tile (a prompt pass's tasks): each row's arithmetic is
/// [`row_tile_with`]'s (the same dot products, folds, softmax and value updates in the same
/// order), so a row's result does not depend on how many rows share its task. Faster than one
/// [`row_tile_with`] per row because a block of rows shares every K and V load: four rows' dot
/// products with four positions run side by side, and the value accumulators of up to three
/// rows times two heads stay in registers, a quarter of a head (four vectors) at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn rows_tile_with<'a, E: KvLanes + 'a, const VECS: usize>(
    seq: &SeqAttn<'a>,
    task: &Task,
    shape: &AttnShape,
    out: &mut [f32],
    rows: impl Fn(&KvChunk<'a>) -> (&'a [E], &'a [E]),
) {
    let hd = VECS * 16;
    let heads = shape.n_heads;
    let group = heads / shape.n_kv_heads;
    let plen = partial_len(hd);
    let spans = tile_spans(seq, task, shape);
    let seen = || spans.iter().filter(|s| s.0 < s.1);
    let (Some(a), Some(b)) = (seen().map(|s| s.0).min(), seen().map(|s| s.1).max()) else {
        for i in 0..spans.len() * heads {
            empty_partial(out, i * plen);
        }
        return;
    };
    let n = b - a;
    let runs = runs_of(&seq.chunks, a, b, shape, rows);
    let blk = Block {
        runs: &runs,
        spans: &spans,
        a,
        n,
        heads,
        row: shape.n_kv_heads * hd,
    };
    let width = heads * hd;
    let q = &seq.q[task.rows.start * width..task.rows.end * width];
    let mut scores = vec![0f32; spans.len() * heads * n];
    // Heads below `folded` sum their dot products as `dots_avx512` folds whole groups of four;
    // the rest as it reduces a remainder head alone (as `row_tile_with` does).
    let folded = heads / 4 * 4;
    for h in 0..heads {
        let mut j = 0;
        while j < spans.len() {
            let take = (spans.len() - j).min(SCORE_ROWS);
            let args = (
                &blk,
                h,
                h / group,
                j,
                q,
                &mut scores[..],
                shape.scale,
                h < folded,
            );
            match take {
                4 => block_scores::<E, VECS, 4>(args),
                3 => block_scores::<E, VECS, 3>(args),
                2 => block_scores::<E, VECS, 2>(args),
                _ => block_scores::<E, VECS, 1>(args),
            }
            j += take;
        }
    }
    for (j, &(lo, hi)) in spans.iter().enumerate() {
        for h in 0..heads {
            let at = (j * heads + h) * plen;
            if lo >= hi {
                empty_partial(out, at);
            } else {
                softmax_partial(&mut scores[(j * heads + h) * n..][lo - a..hi - a], out, at);
            }
        }
    }
    for g in 0..shape.n_kv_heads {
        let mut h = g * group;
        while h < (g + 1) * group {
            let hs = ((g + 1) * group - h).min(2);
            let mut j = 0;
            while j < spans.len() {
                let js = (spans.len() - j).min(3);
                for c0 in (0..VECS).step_by(4) {
                    let args = (
                        &blk,
                        g * hd + c0 * 16,
                        h,
                        j,
                        &scores[..],
                        &mut *out,
                        plen,
                        c0 * 16,
                    );
                    match (js, hs) {
                        (3, 2) => block_values::<E, 3, 2>(args),
                        (3, _) => block_values::<E, 3, 1>(args),
                        (2, 2) => block_values::<E, 2, 2>(args),
                        (2, _) => block_values::<E, 2, 1>(args),
                        (_, 2) => block_values::<E, 1, 2>(args),
                        _ => block_values::<E, 1, 1>(args),
                    }
                }
                j += js;
            }
            h += hs;
        }
    }
}

/// Scores of head `h` (key/value head `g`) for the `R` rows from `j0`, over every position of
/// the block's joint span: four positions of `R` rows at a time, each dot product summed and
/// folded as [`row_tile_with`] does. Positions outside a row's own span get scores nobody reads.
///
/// # Safety
/// The CPU must have avx512f; `blk`'s runs hold `n` rows of `row` values each, of which key/
/// value head `g`'s `VECS * 16` are read (`(g + 1) * VECS * 16 <= row`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
#[allow(clippy::type_complexity)]
unsafe fn block_scores<E: KvLanes, const VECS: usize, const R: usize>(
    (blk, h, g, j0, q, scores, scale, folded): (
        &Block<'_, '_, E>,
        usize,
        usize,
        usize,
        &[f32],
        &mut [f32],
        f32,
        bool,
    ),
) {
    use std::arch::x86_64::*;
    let hd = VECS * 16;
    let width = blk.heads * hd;
    let mut qs = [q.as_ptr(); R];
    for (r, p) in qs.iter_mut().enumerate() {
        *p = q[(j0 + r) * width + h * hd..][..hd].as_ptr();
    }
    let scale = _mm_set1_ps(scale);
    for run in blk.runs {
        let mut i = 0;
        while i < run.n {
            let m = (run.n - i).min(4);
            let mut kp = [run.k.as_ptr(); 4];
            for (p, k) in kp.iter_mut().enumerate() {
                *k = run.k.as_ptr().add((i + p.min(m - 1)) * blk.row + g * hd);
            }
            // A quad past the run's end repeats its last position; each dot product is
            // summed from its own lanes only (`fold4`), so the repeats change nothing and are
            // not stored.
            let acc = quad_dots::<E, VECS, R>(&qs, &kp);
            for (r, a) in acc.iter().enumerate() {
                let sums = if folded {
                    fold4(a[0], a[1], a[2], a[3])
                } else {
                    _mm_setr_ps(
                        _mm512_reduce_add_ps(a[0]),
                        _mm512_reduce_add_ps(a[1]),
                        _mm512_reduce_add_ps(a[2]),
                        _mm512_reduce_add_ps(a[3]),
                    )
                };
                let at = ((j0 + r) * blk.heads + h) * blk.n + run.at + i;
                let dst = &mut scores[at..at + m];
                let scaled = _mm_mul_ps(sums, scale);
                if m == 4 {
                    _mm_storeu_ps(dst.as_mut_ptr(), scaled);
                } else {
                    let mut four = [0f32; 4];
                    _mm_storeu_ps(four.as_mut_ptr(), scaled);
                    dst.copy_from_slice(&four[..m]);
                }
            }
            i += 4;
        }
    }
}

/// The dot products of `R` query rows with four positions' key rows (`acc[r][p]`, lanes not
/// yet summed), each accumulated over the head's vectors in order. Not inlined: inside its
/// caller the compiler unrolled the loop whole, hoisted every K load ahead of the products
/// and spilled most accumulators to the stack.
///
/// # Safety
/// The CPU must have avx512f, and `VECS * 16` values must be readable at every pointer.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline(never)]
unsafe fn quad_dots<E: KvLanes, const VECS: usize, const R: usize>(
    qs: &[*const f32; R],
    kp: &[*const E; 4],
) -> [[std::arch::x86_64::__m512; 4]; R] {
    use std::arch::x86_64::*;
    let mut a = [[_mm512_setzero_ps(); 4]; R];
    for c in 0..VECS {
        let mut k = [_mm512_setzero_ps(); 4];
        for p in 0..4 {
            k[p] = E::load16(kp[p].add(c * 16));
        }
        for r in 0..R {
            let x = _mm512_loadu_ps(qs[r].add(c * 16));
            for p in 0..4 {
                a[r][p] = _mm512_fmadd_ps(x, k[p], a[r][p]);
            }
        }
    }
    a
}

/// Four vectors (values `c0..c0 + 64` of key/value head row offset `off`) of the outputs of
/// heads `h0..h0 + S` for the `R` rows from `j0`: their accumulators stay in registers over
/// the tile, each updated once per position of its row's span, in order (`o = w · v + o`, as
/// [`row_values`] does).
///
/// # Safety
/// The CPU must have avx512f, and `off + 64 <= row` for `blk`'s rows of `row` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
#[allow(clippy::type_complexity)]
unsafe fn block_values<E: KvLanes, const R: usize, const S: usize>(
    (blk, off, h0, j0, scores, out, plen, c0): (
        &Block<'_, '_, E>,
        usize,
        usize,
        usize,
        &[f32],
        &mut [f32],
        usize,
        usize,
    ),
) {
    use std::arch::x86_64::*;
    let spans: [(usize, usize); R] = std::array::from_fn(|r| blk.spans[j0 + r]);
    let (all_lo, all_hi) = (
        spans.iter().map(|s| s.0).max().unwrap_or(0),
        spans.iter().map(|s| s.1).min().unwrap_or(0),
    );
    let w_at: [[usize; S]; R] =
        std::array::from_fn(|r| std::array::from_fn(|s| ((j0 + r) * blk.heads + h0 + s) * blk.n));
    let mut acc = [[[_mm512_setzero_ps(); 4]; S]; R];
    for run in blk.runs {
        for i in 0..run.n {
            let p = blk.a + run.at + i;
            let vp = run.v.as_ptr().add(i * blk.row + off);
            let mut x = [_mm512_setzero_ps(); 4];
            for (c, xc) in x.iter_mut().enumerate() {
                *xc = E::load16(vp.add(c * 16));
            }
            let every = p >= all_lo && p < all_hi;
            for r in 0..R {
                if !every && (p < spans[r].0 || p >= spans[r].1) {
                    continue;
                }
                for s in 0..S {
                    let w = _mm512_set1_ps(scores[w_at[r][s] + run.at + i]);
                    for c in 0..4 {
                        acc[r][s][c] = _mm512_fmadd_ps(w, x[c], acc[r][s][c]);
                    }
                }
            }
        }
    }
    for (r, ar) in acc.iter().enumerate() {
        if spans[r].0 >= spans[r].1 {
            continue;
        }
        for (s, a) in ar.iter().enumerate() {
            let o = out[((j0 + r) * blk.heads + h0 + s) * plen + 2 + c0..][..64].as_mut_ptr();
            for (c, v) in a.iter().enumerate() {
                _mm512_storeu_ps(o.add(c * 16), *v);
            }
        }
    }
}

/// Scores, softmax and values of one tile.
#[inline(always)]
fn tile_with<O: Ops>(seq: &SeqAttn<'_>, task: &Task, shape: &AttnShape, out: &mut [f32]) {
    let hd = shape.head_dim;
    let heads = shape.n_heads;
    let group = heads / shape.n_kv_heads;
    // Each query head's key/value head, looked up rather than divided for per position (an
    // integer division per head and position was most of a decode tile's time).
    let kv: Vec<usize> = (0..heads).map(|h| h / group).collect();
    let row = shape.n_kv_heads * hd;
    let width = heads * hd;
    let plen = partial_len(hd);
    let t0 = task.tile * TILE;
    let spans = tile_spans(seq, task, shape);
    let a = spans.iter().map(|s| s.0).min().unwrap_or(t0);
    let b = spans.iter().map(|s| s.1).max().unwrap_or(t0);
    let mut buf = vec![0f32; row];
    let mut sc = vec![1f32; shape.n_kv_heads];
    let mut scores = vec![0f32; task.rows.len() * heads * TILE];
    let mut d = vec![0f32; heads];
    for_positions(&seq.chunks, a, b, Half::K, row, |c, t, p| {
        let k = load_row::<O>(c, t, Half::K, row, hd, &mut buf, &mut sc);
        for (kk, r) in task.rows.clone().enumerate() {
            let (lo, hi) = spans[kk];
            if p < lo || p >= hi {
                continue;
            }
            O::dots(&seq.q[r * width..(r + 1) * width], k, &kv, hd, &mut d);
            for (h, s) in d.iter().enumerate() {
                scores[(kk * heads + h) * TILE + (p - t0)] = s * sc[kv[h]] * shape.scale;
            }
        }
    });
    for (kk, &(lo, hi)) in spans.iter().enumerate() {
        for h in 0..heads {
            let at = (kk * heads + h) * plen;
            if lo >= hi {
                empty_partial(out, at);
            } else {
                softmax_partial(
                    &mut scores[(kk * heads + h) * TILE..][lo - t0..hi - t0],
                    out,
                    at,
                );
            }
        }
    }
    for_positions(&seq.chunks, a, b, Half::V, row, |c, t, p| {
        let v = load_row::<O>(c, t, Half::V, row, hd, &mut buf, &mut sc);
        for (kk, &(lo, hi)) in spans.iter().enumerate() {
            if p < lo || p >= hi {
                continue;
            }
            for h in 0..heads {
                let g = kv[h];
                let w = scores[(kk * heads + h) * TILE + (p - t0)] * sc[g];
                let at = (kk * heads + h) * plen + 2;
                O::axpy(w, &v[g * hd..(g + 1) * hd], &mut out[at..at + hd]);
            }
        }
    });
}

/// `dst = src` widened, 16 values at a time (a head's length is a multiple of 16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn widen_f16_avx512(src: &[half::f16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let mut c = 0;
    while c + 16 <= n {
        let h = _mm256_loadu_si256(src.as_ptr().add(c) as *const __m256i);
        _mm512_storeu_ps(dst.as_mut_ptr().add(c), _mm512_cvtph_ps(h));
        c += 16;
    }
    for i in c..n {
        dst[i] = src[i].to_f32();
    }
}

/// `a · b` for lengths that are a multiple of 16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = _mm512_setzero_ps();
    let n = a.len().min(b.len());
    let mut c = 0;
    while c + 16 <= n {
        acc = _mm512_fmadd_ps(
            _mm512_loadu_ps(a.as_ptr().add(c)),
            _mm512_loadu_ps(b.as_ptr().add(c)),
            acc,
        );
        c += 16;
    }
    _mm512_reduce_add_ps(acc)
}

/// `y += w · x` for lengths that are a multiple of 16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn axpy_avx512(w: f32, x: &[f32], y: &mut [f32]) {
    use std::arch::x86_64::*;
    let wv = _mm512_set1_ps(w);
    let n = x.len().min(y.len());
    let mut c = 0;
    while c + 16 <= n {
        let o = _mm512_loadu_ps(y.as_ptr().add(c));
        _mm512_storeu_ps(
            y.as_mut_ptr().add(c),
            _mm512_fmadd_ps(wv, _mm512_loadu_ps(x.as_ptr().add(c)), o),
        );
        c += 16;
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

    /// A decode row (a task of one row, served by `row_tile_with` on AVX-512) gets bit for bit the
    /// output the same row gets inside a prefill chunk (tasks of up to 16 rows, served by
    /// `rows_tile_with`: blocks of 4, 3, 2 and 1 rows, rows whose span starts or ends inside a
    /// block), on every zoo shape, f32 and f16 rows, 16-position blocks and uneven chunks,
    /// across tile borders and a sliding window; and both within 1e-5 of the f64 reference.
    #[test]
    fn a_decode_row_equals_the_same_row_in_a_prefill_chunk() {
        use half::f16;
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for s in ZOO_SHAPES {
            let row = s.n_kv_heads * s.head_dim;
            let width = s.n_heads * s.head_dim;
            for (ctx, block) in [
                (1usize, 16usize),
                (7, 16),
                (256, 16),
                (257, 16),
                (530, 16),
                (530, 37),
            ] {
                let (k, v) = realistic(&mut rng, ctx, &s);
                let kh: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
                let vh: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
                let n = ctx.min(23);
                let q: Vec<f32> = (0..n * width)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let f16_chunks = || -> Vec<KvChunk<'_>> {
                    kh.chunks(block * row)
                        .zip(vh.chunks(block * row))
                        .map(|(k, v)| KvChunk::f16(F16Rows { k, v }, k.len() / row))
                        .collect()
                };
                for half in [false, true] {
                    let chunks = || {
                        if half {
                            f16_chunks()
                        } else {
                            f32_chunks(&k, &v, &s, block)
                        }
                    };
                    let chunk = attend_one(&q, ctx - n, n, chunks(), &s);
                    let mut alone = Vec::new();
                    for i in 0..n {
                        let one = &q[i * width..(i + 1) * width];
                        alone = attend_one(one, ctx - n + i, 1, chunks(), &s);
                        assert!(
                            chunk[i * width..(i + 1) * width]
                                .iter()
                                .zip(&alone)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{s:?} ctx {ctx} block {block} f16 {half} row {i} of {n}"
                        );
                    }
                    // `alone` is now the last row's.
                    let last = &q[(n - 1) * width..];
                    let (kr, vr): (Vec<f32>, Vec<f32>) = if half {
                        (
                            kh.iter().map(|x| x.to_f32()).collect(),
                            vh.iter().map(|x| x.to_f32()).collect(),
                        )
                    } else {
                        (k.clone(), v.clone())
                    };
                    let want = reference(last, &kr, &vr, ctx - 1, 1, &s);
                    let vmax = vr.iter().fold(0f32, |m, x| m.max(x.abs()));
                    for (a, b) in alone.iter().zip(&want) {
                        assert!(
                            (a - b).abs() <= 1e-5 * vmax.max(1.0),
                            "{s:?} ctx {ctx}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    /// A batch of decode rows (one per sequence, f32, f16 and 8-bit caches, several shapes and
    /// lengths, a sliding window) on AVX2 equals the portable tile compiled without SIMD, bit
    /// for bit: the kernels share one arithmetic, so a decode row's output does not depend on
    /// the instruction set below AVX-512, nor on the kernel that served it.
    #[test]
    fn decode_rows_on_avx2_equal_the_portable_tile() {
        let parts = [1usize, 5, 256, 257, 530].map(|n| (n - 1, 1));
        avx2_equals_the_portable_tile(17, &parts);
    }

    /// Prompt rows (several per sequence, from position 0 and as a later chunk; f32, f16 and
    /// 8-bit caches) on AVX2 equal the portable tile compiled without SIMD, bit for bit, as
    /// decode rows do: so chunked prefill and decoding reproduce a one-shot prefill on this
    /// instruction set too.
    #[test]
    fn prompt_rows_on_avx2_equal_the_portable_tile() {
        avx2_equals_the_portable_tile(23, &[(0, 7), (0, 300), (250, 40), (513, 3)]);
    }

    /// Sequences of `parts` (cached positions before the rows, rows), over f32, f16 and 8-bit
    /// caches of every zoo shape: attention on AVX2 (the one-row kernel for f32 and f16,
    /// `tile_with` on the AVX2 ops for 8-bit rows) equals the scalar portable tile bit for bit.
    fn avx2_equals_the_portable_tile(seed: u64, parts: &[(usize, usize)]) {
        use half::f16;
        if !switchyard_kernels::cpu::available_levels().contains(&SimdLevel::Avx2) {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for s in ZOO_SHAPES {
            let row = s.n_kv_heads * s.head_dim;
            let width = s.n_heads * s.head_dim;
            let caches: Vec<(Vec<f32>, Vec<f32>)> = parts
                .iter()
                .map(|&(start, n)| realistic(&mut rng, start + n, &s))
                .collect();
            let halves: Vec<(Vec<f16>, Vec<f16>)> = caches
                .iter()
                .map(|(k, v)| {
                    let h = |x: &Vec<f32>| x.iter().map(|&x| f16::from_f32(x)).collect();
                    (h(k), h(v))
                })
                .collect();
            let int8: Vec<Quantized> = caches
                .iter()
                .map(|(k, v)| Quantized::new(k, v, s.head_dim))
                .collect();
            let rows: usize = parts.iter().map(|p| p.1).sum();
            let q: Vec<f32> = (0..rows * width)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            for kind in ["f32", "f16", "int8"] {
                let seqs = || -> Vec<SeqAttn<'_>> {
                    let mut at = 0;
                    parts
                        .iter()
                        .enumerate()
                        .map(|(i, &(start, n))| {
                            let sq = &q[at * width..(at + n) * width];
                            at += n;
                            SeqAttn {
                                q: sq,
                                start,
                                n,
                                chunks: match kind {
                                    "f16" => {
                                        let (k, v) = &halves[i];
                                        k.chunks(16 * row)
                                            .zip(v.chunks(16 * row))
                                            .map(|(k, v)| {
                                                KvChunk::f16(F16Rows { k, v }, k.len() / row)
                                            })
                                            .collect()
                                    }
                                    "int8" => int8[i].chunks(&s, 16),
                                    _ => f32_chunks(&caches[i].0, &caches[i].1, &s, 16),
                                },
                            }
                        })
                        .collect()
                };
                let want = attend_at(&seqs(), &s, SimdLevel::Scalar).expect("scalar");
                let got = attend_at(&seqs(), &s, SimdLevel::Avx2).expect("avx2");
                assert_eq!(got.len(), want.len());
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{s:?} {kind} value {i}: {a} vs {b}"
                    );
                }
            }
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

    /// The zoo's attention shapes: SmolLM2, Qwen2.5 0.5B and 1.5B, Gemma 3 270M with its
    /// sliding window.
    const ZOO_SHAPES: [AttnShape; 4] = [
        SMOLLM2,
        AttnShape {
            n_heads: 14,
            n_kv_heads: 2,
            head_dim: 64,
            scale: 0.125,
            window: None,
        },
        AttnShape {
            n_heads: 12,
            n_kv_heads: 2,
            head_dim: 128,
            scale: 0.088,
            window: None,
        },
        AttnShape {
            n_heads: 4,
            n_kv_heads: 1,
            head_dim: 256,
            scale: 0.0625,
            window: Some(300),
        },
    ];

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
    /// correctly: attention over the dequantized values, as the reference computes it, over a
    /// context that spans two tiles (so their partials are merged).
    #[test]
    fn int8_chunks_are_read_alike_by_every_simd_path() {
        let levels: &[SimdLevel] = match simd_level() {
            SimdLevel::Avx512 => &[SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512],
            SimdLevel::Avx2 => &[SimdLevel::Scalar, SimdLevel::Avx2],
            SimdLevel::Scalar => &[SimdLevel::Scalar],
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let s = SMOLLM2;
        let (start, n) = (TILE + 33, 7);
        let (k, v) = realistic(&mut rng, start + n, &s);
        let q: Vec<f32> = realistic(&mut rng, n * 3, &s).0;
        let quant = Quantized::new(&k, &v, s.head_dim);
        let (dk, dv) = quant.dequantized(s.head_dim);
        let want = reference(&q, &dk, &dv, start, n, &s);
        for &level in levels {
            let seq = SeqAttn {
                q: &q,
                start,
                n,
                chunks: quant.chunks(&s, 16),
            };
            let got = attend_at(&[seq], &s, level).expect("attend");
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!((a - b).abs() < 1e-5, "{level:?} value {i}: {a} vs {b}");
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

    /// Prefill attention as a prompt pass runs it: one sequence's 512 new rows from position 0
    /// over f16 blocks of 16 positions, on SmolLM2's, Qwen2.5 1.5B's and Gemma 3's shapes.
    /// Prints ms per layer and the multiply-accumulates per second (the causal half of
    /// `512 x 512` scores and values). Run with `--ignored --nocapture`.
    #[test]
    #[ignore = "timing; prints numbers"]
    fn prefill_attention_timing() {
        use half::f16;
        use std::time::Instant;
        let mut rng = rand::rngs::StdRng::seed_from_u64(6);
        let shapes = [
            ("smollm2", SMOLLM2),
            (
                "qwen2.5-1.5b",
                AttnShape {
                    n_heads: 12,
                    n_kv_heads: 2,
                    head_dim: 128,
                    scale: 0.088,
                    window: None,
                },
            ),
            (
                "gemma3-270m",
                AttnShape {
                    n_heads: 4,
                    n_kv_heads: 1,
                    head_dim: 256,
                    scale: 0.0625,
                    window: Some(512),
                },
            ),
        ];
        let n = 512;
        for (name, s) in shapes {
            let row = s.n_kv_heads * s.head_dim;
            let width = s.n_heads * s.head_dim;
            let (k, v) = realistic(&mut rng, n, &s);
            let kh: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
            let vh: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
            let q: Vec<f32> = (0..n * width)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let run = || {
                let chunks: Vec<KvChunk<'_>> = kh
                    .chunks(16 * row)
                    .zip(vh.chunks(16 * row))
                    .map(|(k, v)| KvChunk::f16(F16Rows { k, v }, k.len() / row))
                    .collect();
                std::hint::black_box(attend_one(&q, 0, n, chunks, &s));
            };
            run();
            let reps = 10;
            let t = Instant::now();
            for _ in 0..reps {
                run();
            }
            let per = t.elapsed().as_secs_f64() / reps as f64;
            let macs = (n * (n + 1) / 2 * s.n_heads * s.head_dim * 2) as f64;
            eprintln!(
                "prefill {name}, {n} rows from 0: {:.3} ms per layer, {:.1} GMAC/s",
                per * 1e3,
                macs / per / 1e9
            );
        }
    }

    /// Decode attention as the serving engine runs it: `seqs` sequences of `ctx` positions in
    /// 16-position blocks, each block its own allocation (K rows then V rows), a different
    /// layer's blocks at each call so nothing stays in cache. Prints ms per layer and the K/V
    /// bytes read per second. Run with `--ignored --nocapture`.
    #[test]
    #[ignore = "timing; prints numbers"]
    fn paged_decode_attention_timing() {
        use std::time::Instant;
        let s = SMOLLM2;
        let row = s.n_kv_heads * s.head_dim;
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for (seqs, ctx) in [(64usize, 1024usize), (8, 256), (1, 1024)] {
            let layers = (2_000_000_000 / (seqs * ctx * row * 8)).clamp(2, 30);
            let blocks: Vec<Vec<Vec<Box<[f32]>>>> = (0..layers)
                .map(|_| {
                    (0..seqs)
                        .map(|_| {
                            (0..ctx.div_ceil(16))
                                .map(|_| {
                                    (0..2 * 16 * row)
                                        .map(|_| rng.random_range(-1.0f32..1.0))
                                        .collect()
                                })
                                .collect()
                        })
                        .collect()
                })
                .collect();
            let q: Vec<f32> = (0..seqs * s.n_heads * s.head_dim)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let halves: Vec<Vec<Vec<Vec<half::f16>>>> = blocks
                .iter()
                .map(|l| {
                    l.iter()
                        .map(|bs| {
                            bs.iter()
                                .map(|d| d.iter().map(|&x| half::f16::from_f32(x)).collect())
                                .collect()
                        })
                        .collect()
                })
                .collect();
            let width = s.n_heads * s.head_dim;
            // One sequence per query row, its blocks (K rows then V rows) as `chunk` views them.
            fn views<'a, T: 'a, D: AsRef<[T]>>(
                seqs: &'a [Vec<D>],
                q: &'a [f32],
                width: usize,
                ctx: usize,
                chunk: impl Fn(&'a [T], usize) -> KvChunk<'a>,
            ) -> Vec<SeqAttn<'a>> {
                seqs.iter()
                    .enumerate()
                    .map(|(i, bs)| SeqAttn {
                        q: &q[i * width..(i + 1) * width],
                        start: ctx - 1,
                        n: 1,
                        chunks: bs
                            .iter()
                            .enumerate()
                            .map(|(b, d)| chunk(d.as_ref(), 16.min(ctx - b * 16)))
                            .collect(),
                    })
                    .collect()
            }
            let run_f16 = |l: usize| {
                let v = views(&halves[l], &q, width, ctx, |d, t| {
                    KvChunk::f16(
                        F16Rows {
                            k: &d[..t * row],
                            v: &d[16 * row..(16 + t) * row],
                        },
                        t,
                    )
                });
                std::hint::black_box(attend(&v, &s).expect("attend"));
            };
            let run = |l: usize| {
                let v = views(&blocks[l], &q, width, ctx, |d, t| {
                    KvChunk::f32(&d[..t * row], &d[16 * row..(16 + t) * row], t)
                });
                std::hint::black_box(attend(&v, &s).expect("attend"));
            };
            run(0);
            let t = Instant::now();
            let reps = 3;
            for _ in 0..reps {
                for l in 0..layers {
                    run(l);
                }
            }
            let per = t.elapsed().as_secs_f64() / (reps * layers) as f64;
            let bytes = (seqs * ctx * row * 8) as f64;
            run_f16(0);
            let t = Instant::now();
            for _ in 0..reps {
                for l in 0..layers {
                    run_f16(l);
                }
            }
            let per16 = t.elapsed().as_secs_f64() / (reps * layers) as f64;
            eprintln!(
                "paged decode {seqs} x {ctx} positions, {layers} layers of data: f32 {:.3} ms per layer ({:.1} GB/s of K/V), f16 {:.3} ms ({:.1} GB/s)",
                per * 1e3,
                bytes / per / 1e9,
                per16 * 1e3,
                bytes / 2.0 / per16 / 1e9
            );
        }
    }
}
