//! AVX-512 VNNI kernel: `vpdpbusd` multiplies 16 rows x 4 codes by 4 activation bytes per
//! instruction. Float updates use separate multiply and add (no FMA) to match the reference.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::{pack::code_bytes, PackedWeight, QActs, MAX_TILE, PANEL};

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
    let sub = w.fmt.sub;
    let subs = w.subs();
    let cb = code_bytes(&w.fmt);
    let groups = sub / 4;
    let n_rows = rows.len();
    let codes = &w.codes[p * subs * cb..(p + 1) * subs * cb];
    let mask = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); MAX_TILE];
    let mut wv = [_mm512_setzero_si512(); 8];
    for s in 0..subs {
        let block = &codes[s * cb..(s + 1) * cb];
        if w.fmt.nibbles {
            for seg in 0..groups / 2 {
                let v = _mm512_loadu_si512(block[seg * 64..].as_ptr() as *const _);
                wv[2 * seg] = _mm512_and_si512(v, mask);
                wv[2 * seg + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
            }
        } else {
            for (g, v) in wv.iter_mut().enumerate().take(groups) {
                *v = _mm512_loadu_si512(block[g * 64..].as_ptr() as *const _);
            }
        }
        let dv = _mm512_loadu_ps(w.d[(p * subs + s) * PANEL..].as_ptr());
        let mv = _mm512_loadu_ps(w.m[(p * subs + s) * PANEL..].as_ptr());
        for (t, a) in acc.iter_mut().enumerate().take(n_rows) {
            let i = rows.start + t;
            let x = &acts.row(i)[s * sub..(s + 1) * sub];
            let mut isum = _mm512_setzero_si512();
            for (g, wg) in wv.iter().enumerate().take(groups) {
                let word = i32::from_le_bytes([
                    x[4 * g] as u8,
                    x[4 * g + 1] as u8,
                    x[4 * g + 2] as u8,
                    x[4 * g + 3] as u8,
                ]);
                isum = _mm512_dpbusd_epi32(isum, *wg, _mm512_set1_epi32(word));
            }
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
