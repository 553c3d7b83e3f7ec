//! AVX2 kernel for CPUs without AVX-512 VNNI: `vpmaddubsw` + `vpmaddwd` over two 8-row halves
//! of a panel. 8-bit codes (Q8_0) go through the sign trick so no 16-bit sum can saturate;
//! the exact integer sums then match the reference bit for bit.
//!
//! Per sub-block the codes are unpacked and the scales widened once (sixteen rows' scales as
//! two vectors, by the reference's f32 operations), then shared by up to four activation rows
//! whose accumulators stay in registers. The narrow formats add the 16-bit products of several
//! groups before widening them to 32 bits, as many as cannot overflow. The previous kernel
//! built each sub-block's scale vectors a lane at a time through memory and held eight rows'
//! accumulators beside sixteen code vectors, far more than AVX2's sixteen registers: it ran
//! 16.8 GMAC/s on an AMD EPYC (Zen 3, 2 threads; `bench step`'s 512 x 1024 x 32-row product),
//! against 188 for the VNNI kernel on a Sapphire Rapids core pair; this one ran 30.0 on that
//! product and 58.3 on the 2048 x 1024 x 64-row one `bench step` now uses.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::kind_id::*;
#[cfg(target_arch = "x86_64")]
use super::{PackedWeight, QActs, ACT_BLOCK, MAX_TILE, PANEL};

/// Activation rows sharing one unpacking of a sub-block's codes (two accumulators each).
const ROWS_PER_PASS: usize = 4;

/// Sets `add` in the bytes of `v` whose bit is set in the 32-bit `mask`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn add_masked(v: __m256i, mask: u32, add: i8) -> __m256i {
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(mask as i32),
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        ),
    );
    let bits = _mm256_setr_epi8(
        1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128,
        1, 2, 4, 8, 16, 32, 64, -128,
    );
    let on = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits);
    _mm256_add_epi8(v, _mm256_and_si256(on, _mm256_set1_epi8(add)))
}

/// `(d, m)` of (panel `p`, sub-block `s`) of a `KIND` matrix, rows 0-7 and 8-15, by the
/// reference's f32 operations.
///
/// # Safety
/// The CPU must support avx2 and f16c, and `w` must be of `KIND`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn scale_offset<const KIND: u8>(
    w: &PackedWeight,
    p: usize,
    s: usize,
) -> ([__m256; 2], [__m256; 2]) {
    let subs = w.subs();
    let per_super = match KIND {
        Q4K => 8,
        Q6K => 16,
        _ => 1,
    };
    let sup = (p * (subs / per_super) + s / per_super) * PANEL;
    let sub = (p * subs + s) * PANEL;
    let f16x8 = |v: &[half::f16], at: usize| {
        _mm256_cvtph_ps(_mm_loadu_si128(v[at..at + 8].as_ptr() as *const __m128i))
    };
    let bytes8 = |v: &[u8], at: usize| _mm_loadl_epi64(v[at..at + 8].as_ptr() as *const __m128i);
    let neg = |x: __m256| _mm256_xor_ps(x, _mm256_set1_ps(-0.0));
    let mut d = [_mm256_setzero_ps(); 2];
    let mut m = [_mm256_setzero_ps(); 2];
    for h in 0..2 {
        let d0 = f16x8(&w.scale, sup + 8 * h);
        (d[h], m[h]) = match KIND {
            Q4_0 => (d0, _mm256_mul_ps(_mm256_set1_ps(-8.0), d0)),
            Q5_0 => (d0, _mm256_mul_ps(_mm256_set1_ps(-16.0), d0)),
            Q8_0 => (d0, _mm256_mul_ps(_mm256_set1_ps(-128.0), d0)),
            Q4_1 => (d0, f16x8(&w.offset, sup + 8 * h)),
            Q4K => {
                let sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(&w.sc, sub + 8 * h)));
                let mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(&w.mn, sub + 8 * h)));
                (
                    _mm256_mul_ps(d0, sc),
                    neg(_mm256_mul_ps(f16x8(&w.offset, sup + 8 * h), mn)),
                )
            }
            // Q6K
            _ => {
                let sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8(&w.sc, sub + 8 * h)));
                let d1 = _mm256_mul_ps(d0, sc);
                (d1, _mm256_mul_ps(_mm256_set1_ps(-32.0), d1))
            }
        };
    }
    (d, m)
}

/// # Safety
/// The CPU must support avx2, fma and f16c.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
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

/// The tile's rows in passes of up to [`ROWS_PER_PASS`], each pass's row count a constant so
/// that its accumulators stay in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn panel_impl<const GROUPS: usize, const WIDE: bool, const PLANES: usize, const KIND: u8>(
    w: &PackedWeight,
    p: usize,
    acts: &QActs,
    rows: std::ops::Range<usize>,
    tile: &mut [[f32; PANEL]; MAX_TILE],
) {
    let mut first = rows.start;
    while first < rows.end {
        let n = (rows.end - first).min(ROWS_PER_PASS);
        let at = first - rows.start;
        let out = &mut tile[at..at + n];
        match n {
            4 => panel_rows::<GROUPS, WIDE, PLANES, KIND, 4>(w, p, acts, first, out),
            3 => panel_rows::<GROUPS, WIDE, PLANES, KIND, 3>(w, p, acts, first, out),
            2 => panel_rows::<GROUPS, WIDE, PLANES, KIND, 2>(w, p, acts, first, out),
            _ => panel_rows::<GROUPS, WIDE, PLANES, KIND, 1>(w, p, acts, first, out),
        }
        first += n;
    }
}

/// Panel `p` for the `ROWS` activation rows from `first`, into `out[..ROWS]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
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
    out: &mut [[f32; PANEL]],
) {
    // Groups whose 16-bit products are added before widening: a pair of products of a code
    // below 2^(4 + PLANES) and an activation of at most 127 in magnitude is below
    // 2 * 127 * 2^(4 + PLANES), so 8 >> PLANES of them stay below 2^15. With the sign trick
    // (8-bit codes) a pair can reach 2 * 128 * 127: one at a time.
    let chunk = if WIDE { 1 } else { 8 >> PLANES };
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
    let mask = _mm256_set1_epi8(0x0F);
    let flip = _mm256_set1_epi8(-128);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); 2]; ROWS];
    // [group][half]: the codes (8-bit: q - 128) and, for 8-bit codes, their magnitudes.
    let mut wv = [[_mm256_setzero_si256(); 2]; GROUPS];
    let mut wa = [[_mm256_setzero_si256(); 2]; GROUPS];
    for s in 0..subs {
        let block = codes[s * cb..(s + 1) * cb].as_ptr();
        for h in 0..2 {
            if WIDE {
                for g in 0..GROUPS {
                    let v = _mm256_loadu_si256(block.add(g * 64 + h * 32) as *const _);
                    wv[g][h] = _mm256_xor_si256(v, flip);
                    wa[g][h] = _mm256_abs_epi8(wv[g][h]);
                }
            } else {
                for seg in 0..GROUPS / 2 {
                    let v = _mm256_loadu_si256(block.add(seg * 64 + h * 32) as *const _);
                    wv[2 * seg][h] = _mm256_and_si256(v, mask);
                    wv[2 * seg + 1][h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                }
                if PLANES > 0 {
                    let planes = &planes[s * per_sub_planes..(s + 1) * per_sub_planes];
                    for (g, v) in wv.iter_mut().enumerate() {
                        for pl in 0..PLANES {
                            let m = (planes[g * PLANES + pl] >> (32 * h)) as u32;
                            v[h] = add_masked(v[h], m, 16 << pl);
                        }
                    }
                }
            }
        }
        let (dv, mv) = scale_offset::<KIND>(w, p, s);
        let block_of_sub = s * sub / ACT_BLOCK;
        for (t, a) in acc.iter_mut().enumerate() {
            // SAFETY: `s * sub + 4 * GROUPS <= subs * sub` codes, block `s * sub / 32` and
            // sum `s` lie inside the row slices checked above.
            let x = x_rows[t].add(s * GROUPS);
            let xsum = *s_rows[t].add(s);
            // Integer sums are exact, so how they are grouped changes no bit.
            let mut isum = [_mm256_setzero_si256(); 2];
            let mut g0 = 0;
            while g0 < GROUPS {
                let mut part = [_mm256_setzero_si256(); 2];
                for g in g0..(g0 + chunk).min(GROUPS) {
                    let xb = _mm256_set1_epi32(x.add(g).read_unaligned());
                    for h in 0..2 {
                        let prod = if WIDE {
                            // (q - 128) * x as |q - 128| * (x with the sign of q - 128)
                            _mm256_maddubs_epi16(wa[g][h], _mm256_sign_epi8(xb, wv[g][h]))
                        } else {
                            _mm256_maddubs_epi16(wv[g][h], xb)
                        };
                        part[h] = _mm256_add_epi16(part[h], prod);
                    }
                }
                for h in 0..2 {
                    isum[h] = _mm256_add_epi32(isum[h], _mm256_madd_epi16(part[h], ones));
                }
                g0 += chunk;
            }
            if WIDE {
                let back = _mm256_set1_epi32(128 * xsum as i32);
                isum[0] = _mm256_add_epi32(isum[0], back);
                isum[1] = _mm256_add_epi32(isum[1], back);
            }
            let xs = _mm256_set1_ps(xsum);
            let dx = _mm256_set1_ps(*d_rows[t].add(block_of_sub));
            for h in 0..2 {
                let t1 = _mm256_mul_ps(dv[h], _mm256_cvtepi32_ps(isum[h]));
                let t2 = _mm256_mul_ps(mv[h], xs);
                a[h] = _mm256_add_ps(a[h], _mm256_mul_ps(dx, _mm256_add_ps(t1, t2)));
            }
        }
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        _mm256_storeu_ps(o.as_mut_ptr(), a[0]);
        _mm256_storeu_ps(o[8..].as_mut_ptr(), a[1]);
    }
}
