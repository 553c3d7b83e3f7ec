//! The portable reference kernel: the arithmetic every SIMD kernel must reproduce bit for bit.

use super::{PackedWeight, QActs, MAX_TILE, PANEL};

pub(super) fn panel(
    w: &PackedWeight,
    p: usize,
    acts: &QActs,
    rows: std::ops::Range<usize>,
    tile: &mut [[f32; PANEL]; MAX_TILE],
) {
    let sub = w.fmt.sub;
    let mut codes = [[0u8; 32]; PANEL];
    let mut acc = [[0f32; PANEL]; MAX_TILE];
    for s in 0..w.subs() {
        let mut d = [0f32; PANEL];
        let mut m = [0f32; PANEL];
        for (r, row) in codes.iter_mut().enumerate() {
            for (t, c) in row.iter_mut().take(sub).enumerate() {
                *c = w.code(p, s, r, t);
            }
            (d[r], m[r]) = w.scale_offset(p, s, r);
        }
        for (t, i) in rows.clone().enumerate() {
            let x = &acts.row(i)[s * sub..(s + 1) * sub];
            let dx = acts.scale(i, s * sub);
            let xs = acts.sub_sum(i, s);
            for r in 0..PANEL {
                let isum: i32 = codes[r][..sub]
                    .iter()
                    .zip(x)
                    .map(|(&c, &v)| c as i32 * v as i32)
                    .sum();
                acc[t][r] += dx * (d[r] * isum as f32 + m[r] * xs);
            }
        }
    }
    for (t, _) in rows.enumerate() {
        tile[t] = acc[t];
    }
}
