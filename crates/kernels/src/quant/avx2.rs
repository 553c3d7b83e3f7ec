//! AVX2 kernel for CPUs without AVX-512 VNNI: `vpmaddubsw` + `vpmaddwd` over two 8-row halves
//! of a panel. 8-bit codes (Q8_0) go through the sign trick so no 16-bit sum can saturate;
//! the exact integer sums then match the reference bit for bit.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::{PackedWeight, QActs, MAX_TILE, PANEL};

/// Sets `add` in the bytes of `v` whose bit is set in the 32-bit `mask`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
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

/// # Safety
/// The CPU must support avx2 and fma.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn panel(
    w: &PackedWeight,
    p: usize,
    acts: &QActs,
    rows: std::ops::Range<usize>,
    tile: &mut [[f32; PANEL]; MAX_TILE],
) {
    let fmt = &w.fmt;
    let sub = fmt.sub;
    let subs = w.subs();
    let cb = fmt.code_bytes();
    let groups = fmt.groups();
    let per_sub_planes = groups * fmt.planes;
    let n_rows = rows.len();
    let codes = &w.codes[p * subs * cb..(p + 1) * subs * cb];
    let mask = _mm256_set1_epi8(0x0F);
    let flip = _mm256_set1_epi8(-128);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); 2]; MAX_TILE];
    // [group][half]
    let mut wv = [[_mm256_setzero_si256(); 2]; 8];
    for s in 0..subs {
        let block = &codes[s * cb..(s + 1) * cb];
        for h in 0..2 {
            if fmt.wide {
                for (g, v) in wv.iter_mut().enumerate().take(groups) {
                    v[h] = _mm256_loadu_si256(block[g * 64 + h * 32..].as_ptr() as *const _);
                }
            } else {
                for seg in 0..groups / 2 {
                    let v = _mm256_loadu_si256(block[seg * 64 + h * 32..].as_ptr() as *const _);
                    wv[2 * seg][h] = _mm256_and_si256(v, mask);
                    wv[2 * seg + 1][h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                }
                if fmt.planes > 0 {
                    let planes = &w.planes[(p * subs + s) * per_sub_planes..][..per_sub_planes];
                    for (g, v) in wv.iter_mut().enumerate().take(groups) {
                        for pl in 0..fmt.planes {
                            let m = (planes[g * fmt.planes + pl] >> (32 * h)) as u32;
                            v[h] = add_masked(v[h], m, 16 << pl);
                        }
                    }
                }
            }
        }
        let mut dv = [_mm256_setzero_ps(); 2];
        let mut mv = [_mm256_setzero_ps(); 2];
        for r in 0..PANEL {
            let (d, m) = w.scale_offset(p, s, r);
            let (h, l) = (r / 8, r % 8);
            let mut lanes_d = [0f32; 8];
            let mut lanes_m = [0f32; 8];
            _mm256_storeu_ps(lanes_d.as_mut_ptr(), dv[h]);
            _mm256_storeu_ps(lanes_m.as_mut_ptr(), mv[h]);
            lanes_d[l] = d;
            lanes_m[l] = m;
            dv[h] = _mm256_loadu_ps(lanes_d.as_ptr());
            mv[h] = _mm256_loadu_ps(lanes_m.as_ptr());
        }
        for (t, a) in acc.iter_mut().enumerate().take(n_rows) {
            let i = rows.start + t;
            let x = &acts.row(i)[s * sub..(s + 1) * sub];
            let xsum = acts.sub_sum(i, s);
            let mut isum = [_mm256_setzero_si256(); 2];
            for (g, wg) in wv.iter().enumerate().take(groups) {
                let word = i32::from_le_bytes([
                    x[4 * g] as u8,
                    x[4 * g + 1] as u8,
                    x[4 * g + 2] as u8,
                    x[4 * g + 3] as u8,
                ]);
                let xb = _mm256_set1_epi32(word);
                for h in 0..2 {
                    let prod = if fmt.wide {
                        // (q - 128) * x as |q - 128| * (x with the sign of q - 128)
                        let ws = _mm256_xor_si256(wg[h], flip);
                        _mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(xb, ws))
                    } else {
                        _mm256_maddubs_epi16(wg[h], xb)
                    };
                    isum[h] = _mm256_add_epi32(isum[h], _mm256_madd_epi16(prod, ones));
                }
            }
            if fmt.wide {
                let back = _mm256_set1_epi32(128 * xsum as i32);
                isum[0] = _mm256_add_epi32(isum[0], back);
                isum[1] = _mm256_add_epi32(isum[1], back);
            }
            let xs = _mm256_set1_ps(xsum);
            let dx = _mm256_set1_ps(acts.scale(i, s * sub));
            for h in 0..2 {
                let t1 = _mm256_mul_ps(dv[h], _mm256_cvtepi32_ps(isum[h]));
                let t2 = _mm256_mul_ps(mv[h], xs);
                a[h] = _mm256_add_ps(a[h], _mm256_mul_ps(dx, _mm256_add_ps(t1, t2)));
            }
        }
    }
    for t in 0..n_rows {
        _mm256_storeu_ps(tile[t].as_mut_ptr(), acc[t][0]);
        _mm256_storeu_ps(tile[t][8..].as_mut_ptr(), acc[t][1]);
    }
}
