//! AVX-512 VNNI kernel: `vpdpbusd` multiplies 16 rows x 4 codes by 4 activation bytes per
//! instruction. Float updates use separate multiply and add (no FMA) to match the reference.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::{pack::Kind, PackedWeight, QActs, MAX_TILE, PANEL};

/// `(d, m)` vectors of (panel `p`, sub-block `s`), by the reference's f32 operations.
///
/// # Safety
/// The CPU must support avx512f.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn scale_offset(w: &PackedWeight, p: usize, s: usize) -> (__m512, __m512) {
    let fmt = &w.fmt;
    let subs = w.subs();
    let sup = (p * (subs / fmt.subs_per_super) + s / fmt.subs_per_super) * PANEL;
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
    match fmt.kind {
        Kind::Q4_0 => (d0, _mm512_mul_ps(_mm512_set1_ps(-8.0), d0)),
        Kind::Q5_0 => (d0, _mm512_mul_ps(_mm512_set1_ps(-16.0), d0)),
        Kind::Q8_0 => (d0, _mm512_mul_ps(_mm512_set1_ps(-128.0), d0)),
        Kind::Q4_1 => (d0, f16x16(&w.offset, sup)),
        Kind::Q4K => {
            let sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(&w.sc, sub)));
            let mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(&w.mn, sub)));
            (
                _mm512_mul_ps(d0, sc),
                neg(_mm512_mul_ps(f16x16(&w.offset, sup), mn)),
            )
        }
        Kind::Q6K => {
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
    // One instance per storage shape, so the group loops unroll and branch-free.
    match (w.fmt.groups(), w.fmt.wide, w.fmt.planes) {
        (8, true, _) => panel_impl::<8, true, 0>(w, p, acts, rows, tile),
        (8, false, 0) => panel_impl::<8, false, 0>(w, p, acts, rows, tile),
        (8, false, 1) => panel_impl::<8, false, 1>(w, p, acts, rows, tile),
        (4, false, 2) => panel_impl::<4, false, 2>(w, p, acts, rows, tile),
        _ => super::scalar::panel(w, p, acts, rows, tile),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn panel_impl<const GROUPS: usize, const WIDE: bool, const PLANES: usize>(
    w: &PackedWeight,
    p: usize,
    acts: &QActs,
    rows: std::ops::Range<usize>,
    tile: &mut [[f32; PANEL]; MAX_TILE],
) {
    let sub = GROUPS * 4;
    let subs = w.subs();
    let cb = w.fmt.code_bytes();
    let per_sub_planes = GROUPS * PLANES;
    let n_rows = rows.len();
    let codes = &w.codes[p * subs * cb..(p + 1) * subs * cb];
    let mask = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); MAX_TILE];
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
                let planes = &w.planes[(p * subs + s) * per_sub_planes..][..per_sub_planes];
                for (g, v) in wv.iter_mut().enumerate() {
                    for pl in 0..PLANES {
                        let high = _mm512_set1_epi8(16 << pl);
                        *v = _mm512_mask_add_epi8(*v, planes[g * PLANES + pl], *v, high);
                    }
                }
            }
        }
        let (dv, mv) = scale_offset(w, p, s);
        for (t, a) in acc.iter_mut().enumerate().take(n_rows) {
            let i = rows.start + t;
            let x = acts.row(i)[s * sub..(s + 1) * sub].as_ptr() as *const i32;
            // Two independent chains of dot products (even and odd groups): one row alone
            // would otherwise wait on each `vpdpbusd` in turn. Integer sums are exact, so the
            // split changes no bit.
            let (mut even, mut odd) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            for g in (0..GROUPS).step_by(2) {
                // SAFETY: x points at `sub` = 4 * GROUPS activation bytes.
                let (w0, w1) = (x.add(g).read_unaligned(), x.add(g + 1).read_unaligned());
                even = _mm512_dpbusd_epi32(even, wv[g], _mm512_set1_epi32(w0));
                odd = _mm512_dpbusd_epi32(odd, wv[g + 1], _mm512_set1_epi32(w1));
            }
            let isum = _mm512_add_epi32(even, odd);
            let t1 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(isum));
            let t2 = _mm512_mul_ps(mv, _mm512_set1_ps(acts.sub_sum(i, s) as f32));
            let dx = _mm512_set1_ps(acts.scale(i, s * sub));
            *a = _mm512_add_ps(*a, _mm512_mul_ps(dx, _mm512_add_ps(t1, t2)));
        }
    }
    for t in 0..n_rows {
        _mm512_storeu_ps(tile[t].as_mut_ptr(), acc[t]);
    }
}
