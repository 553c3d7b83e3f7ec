//! AVX-512 VNNI kernel: `vpdpbusd` multiplies 16 rows x 4 codes by 4 activation bytes per
//! instruction. Float updates use separate multiply and add (no FMA) to match the reference.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::kind_id::*;
#[cfg(target_arch = "x86_64")]
use super::{PackedWeight, QActs, ACT_BLOCK, MAX_TILE, PANEL};

/// `(d, m)` vectors of (panel `p`, sub-block `s`) of a `KIND` matrix, by the reference's f32
/// operations.
///
/// # Safety
/// The CPU must support avx512f, and `w` must be of `KIND`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn scale_offset<const KIND: u8>(w: &PackedWeight, p: usize, s: usize) -> (__m512, __m512) {
    let subs = w.subs();
    let per_super = match KIND {
        Q4K => 8,
        Q6K => 16,
        _ => 1,
    };
    let sup = (p * (subs / per_super) + s / per_super) * PANEL;
    let sub = (p * subs + s) * PANEL;
    let f16x16 = |v: &[half::f16], at: usize| {
        _mm512_cvtph_ps(_mm256_loadu_si256(
            v[at..at + PANEL].as_ptr() as *const __m256i
        ))
    };
    let bytes = |v: &[u8], at: usize| _mm_loadu_si128(v[at..at + PANEL].as_ptr() as *const __m128i);
    let neg = |x: __m512| {
        _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(x),
            _mm512_set1_epi32(i32::MIN),
        ))
    };
    let d0 = f16x16(&w.scale, sup);
    match KIND {
        Q4_0 => (d0, _mm512_mul_ps(_mm512_set1_ps(-8.0), d0)),
        Q5_0 => (d0, _mm512_mul_ps(_mm512_set1_ps(-16.0), d0)),
        Q8_0 => (d0, _mm512_mul_ps(_mm512_set1_ps(-128.0), d0)),
        Q4_1 => (d0, f16x16(&w.offset, sup)),
        Q4K => {
            let sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(&w.sc, sub)));
            let mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(&w.mn, sub)));
            (
                _mm512_mul_ps(d0, sc),
                neg(_mm512_mul_ps(f16x16(&w.offset, sup), mn)),
            )
        }
        // Q6K
        _ => {
            let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes(&w.sc, sub)));
            let d = _mm512_mul_ps(d0, sc);
            (d, _mm512_mul_ps(_mm512_set1_ps(-32.0), d))
        }
    }
}

/// # Safety
/// The CPU must support avx512f, avx512bw and avx512vnni.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn panel(
    w: &PackedWeight,
    p: usize,
    acts: &QActs,
    rows: std::ops::Range<usize>,
    tile: &mut [[f32; PANEL]; MAX_TILE],
) {
    // One instance per source type, so the group loops unroll and branch-free.
    per_kind!(panel_impl, w, p, acts, rows, tile)
}

/// Dispatches on the number of activation rows, so that every row's accumulator stays in a
/// register (a run-time row count kept them on the stack, with a load and a store per update).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn panel_impl<const GROUPS: usize, const WIDE: bool, const PLANES: usize, const KIND: u8>(
    w: &PackedWeight,
    p: usize,
    acts: &QActs,
    rows: std::ops::Range<usize>,
    tile: &mut [[f32; PANEL]; MAX_TILE],
) {
    const _: () = assert!(MAX_TILE == 12);
    match rows.len() {
        12 => panel_rows::<GROUPS, WIDE, PLANES, KIND, 12>(w, p, acts, rows.start, tile),
        11 => panel_rows::<GROUPS, WIDE, PLANES, KIND, 11>(w, p, acts, rows.start, tile),
        10 => panel_rows::<GROUPS, WIDE, PLANES, KIND, 10>(w, p, acts, rows.start, tile),
        9 => panel_rows::<GROUPS, WIDE, PLANES, KIND, 9>(w, p, acts, rows.start, tile),
        8 => panel_rows::<GROUPS, WIDE, PLANES, KIND, 8>(w, p, acts, rows.start, tile),
        7 => panel_rows::<GROUPS, WIDE, PLANES, KIND, 7>(w, p, acts, rows.start, tile),
        6 => panel_rows::<GROUPS, WIDE, PLANES, KIND, 6>(w, p, acts, rows.start, tile),
        5 => panel_rows::<GROUPS, WIDE, PLANES, KIND, 5>(w, p, acts, rows.start, tile),
        4 => panel_rows::<GROUPS, WIDE, PLANES, KIND, 4>(w, p, acts, rows.start, tile),
        3 => panel_rows::<GROUPS, WIDE, PLANES, KIND, 3>(w, p, acts, rows.start, tile),
        2 => panel_rows::<GROUPS, WIDE, PLANES, KIND, 2>(w, p, acts, rows.start, tile),
        1 => panel_rows::<GROUPS, WIDE, PLANES, KIND, 1>(w, p, acts, rows.start, tile),
        // No rows: nothing to compute (callers never pass more than MAX_TILE, asserted above).
        _ => {}
    }
}

/// Panel `p` for the `ROWS` activation rows from `first`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn panel_rows<
    const GROUPS: usize,
    const WIDE: bool,
    const PLANES: usize,
    const KIND: u8,
    const ROWS: usize,
>(
    w: &PackedWeight,
    p: usize,
    acts: &QActs,
    first: usize,
    tile: &mut [[f32; PANEL]; MAX_TILE],
) {
    let sub = GROUPS * 4;
    let subs = w.subs();
    let cb = w.fmt.code_bytes();
    let per_sub_planes = GROUPS * PLANES;
    let codes = &w.codes[p * subs * cb..(p + 1) * subs * cb];
    let planes = &w.planes[p * subs * per_sub_planes..(p + 1) * subs * per_sub_planes];
    // Each row's codes, block scales and sub-block sums, checked once here; the loop below
    // reads them through raw pointers at offsets below `subs * sub`, `subs * sub / ACT_BLOCK`
    // and `subs`.
    let x_rows: [*const i32; ROWS] =
        std::array::from_fn(|t| acts.row(first + t)[..subs * sub].as_ptr() as *const i32);
    let d_rows: [*const f32; ROWS] = std::array::from_fn(|t| acts.row_scales(first + t).as_ptr());
    let s_rows: [*const f32; ROWS] =
        std::array::from_fn(|t| acts.row_sums(first + t)[..subs].as_ptr());
    let mask = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); ROWS];
    let mut wv = [_mm512_setzero_si512(); GROUPS];
    for s in 0..subs {
        let block = codes[s * cb..(s + 1) * cb].as_ptr();
        if WIDE {
            for (g, v) in wv.iter_mut().enumerate() {
                *v = _mm512_loadu_si512(block.add(g * 64) as *const _);
            }
        } else {
            for seg in 0..GROUPS / 2 {
                let v = _mm512_loadu_si512(block.add(seg * 64) as *const _);
                wv[2 * seg] = _mm512_and_si512(v, mask);
                wv[2 * seg + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
            }
            if PLANES > 0 {
                let planes = &planes[s * per_sub_planes..(s + 1) * per_sub_planes];
                for (g, v) in wv.iter_mut().enumerate() {
                    for pl in 0..PLANES {
                        let high = _mm512_set1_epi8(16 << pl);
                        *v = _mm512_mask_add_epi8(*v, planes[g * PLANES + pl], *v, high);
                    }
                }
            }
        }
        let (dv, mv) = scale_offset::<KIND>(w, p, s);
        let block_of_sub = s * sub / ACT_BLOCK;
        // One row's update; written out per row below (a loop over `ROWS` stayed rolled, with
        // the accumulators on the stack).
        macro_rules! row {
            ($t:literal) => {
                if $t < ROWS {
                    // SAFETY: `s * sub + 4 * GROUPS <= subs * sub` codes, block
                    // `s * sub / 32` and sum `s` lie inside the row slices checked above.
                    let x = x_rows[$t].add(s * GROUPS);
                    // Integer sums are exact, so how the chains are split changes no bit.
                    let isum = if ROWS >= 4 {
                        // Enough rows side by side to hide each chain's latency: one chain,
                        // one instruction fewer per row and sub-block.
                        let mut sum = _mm512_setzero_si512();
                        for g in 0..GROUPS {
                            let w = _mm512_set1_epi32(x.add(g).read_unaligned());
                            sum = _mm512_dpbusd_epi32(sum, wv[g], w);
                        }
                        sum
                    } else {
                        // Two independent chains (even and odd groups): a row or two alone
                        // would otherwise wait on each `vpdpbusd` in turn.
                        let (mut even, mut odd) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                        for g in (0..GROUPS).step_by(2) {
                            let (w0, w1) =
                                (x.add(g).read_unaligned(), x.add(g + 1).read_unaligned());
                            even = _mm512_dpbusd_epi32(even, wv[g], _mm512_set1_epi32(w0));
                            odd = _mm512_dpbusd_epi32(odd, wv[g + 1], _mm512_set1_epi32(w1));
                        }
                        _mm512_add_epi32(even, odd)
                    };
                    let t1 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(isum));
                    let t2 = _mm512_mul_ps(mv, _mm512_set1_ps(*s_rows[$t].add(s)));
                    let dx = _mm512_set1_ps(*d_rows[$t].add(block_of_sub));
                    acc[$t] = _mm512_add_ps(acc[$t], _mm512_mul_ps(dx, _mm512_add_ps(t1, t2)));
                }
            };
        }
        row!(0);
        row!(1);
        row!(2);
        row!(3);
        row!(4);
        row!(5);
        row!(6);
        row!(7);
        row!(8);
        row!(9);
        row!(10);
        row!(11);
    }
    for (t, a) in acc.iter().enumerate() {
        _mm512_storeu_ps(tile[t].as_mut_ptr(), *a);
    }
}
