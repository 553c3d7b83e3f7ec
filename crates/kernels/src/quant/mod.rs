//! Quantized matrix products: weights repacked into 16-row panels of integer codes, activations
//! quantized on the fly to 8-bit blocks of 32 (as llama.cpp does), integer dot products per
//! sub-block, then `acc += dx * (d * isum + m * xsum)` in f32.
//!
//! The integer sums are exact and the float updates happen in one fixed order for every output
//! element, so the scalar reference, the AVX2 and the AVX-512 VNNI kernels give bit-identical
//! results, whatever the number of activation rows (batch invariance: a row's output never
//! depends on which other rows share the call).

pub mod pack;

/// The source types as const parameters of the SIMD kernels (`Kind` cannot be one on stable
/// Rust), so that each instance computes its scales without a branch and inlines them.
mod kind_id {
    pub const Q4_0: u8 = 0;
    pub const Q4_1: u8 = 1;
    pub const Q5_0: u8 = 2;
    pub const Q8_0: u8 = 3;
    pub const Q4K: u8 = 4;
    pub const Q6K: u8 = 5;
}

/// Calls `$imp::<GROUPS, WIDE, PLANES, KIND>(w, p, acts, rows, tile)`, one instance per source
/// type, or the scalar reference for a layout no instance covers.
macro_rules! per_kind {
    ($imp:ident, $w:expr, $p:expr, $acts:expr, $rows:expr, $tile:expr) => {{
        use super::kind_id::*;
        use super::pack::Kind;
        let (w, p, acts, rows, tile) = ($w, $p, $acts, $rows, $tile);
        match (w.fmt.kind, w.fmt.groups(), w.fmt.wide, w.fmt.planes) {
            (Kind::Q8_0, 8, true, 0) => $imp::<8, true, 0, Q8_0>(w, p, acts, rows, tile),
            (Kind::Q4_0, 8, false, 0) => $imp::<8, false, 0, Q4_0>(w, p, acts, rows, tile),
            (Kind::Q4_1, 8, false, 0) => $imp::<8, false, 0, Q4_1>(w, p, acts, rows, tile),
            (Kind::Q4K, 8, false, 0) => $imp::<8, false, 0, Q4K>(w, p, acts, rows, tile),
            (Kind::Q5_0, 8, false, 1) => $imp::<8, false, 1, Q5_0>(w, p, acts, rows, tile),
            (Kind::Q6K, 4, false, 2) => $imp::<4, false, 2, Q6K>(w, p, acts, rows, tile),
            _ => super::scalar::panel(w, p, acts, rows, tile),
        }
    }};
}

mod avx2;
mod avx512;
mod scalar;

use std::mem::MaybeUninit;

use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;

use crate::cpu::{simd_level, SimdLevel};
use crate::prof::{self, Part};
use pack::{code_slot, decode_block, format_of, scale_offset, Format, Sub};

/// Output rows per panel: one 512-bit vector of i32 lanes.
pub const PANEL: usize = 16;
/// Activation quantization block (llama.cpp's Q8_0 block).
pub const ACT_BLOCK: usize = 32;
/// Multiply-accumulates below which a product runs on one thread (thread hand-off costs more).
const PARALLEL_MIN_MACS: usize = 1 << 17;
/// Tasks a parallel product is cut into per thread of the pool.
const TASKS_PER_THREAD: usize = 16;

/// A weight matrix `[n, k]` in panel layout (see [`pack`]).
#[derive(Debug, Clone)]
pub struct PackedWeight {
    n: usize,
    k: usize,
    fmt: Format,
    /// `[panel][sub][code_bytes]`
    codes: Vec<u8>,
    /// `[panel][sub][group][plane]` u64 masks of the bits above the low nibble.
    planes: Vec<u64>,
    /// `[panel][super][PANEL]` f16 scales.
    scale: Vec<f16>,
    /// `[panel][super][PANEL]` f16 offsets (Q4_1, Q4_K).
    offset: Vec<f16>,
    /// `[panel][sub][PANEL]` sub-block scales (K-quants).
    sc: Vec<u8>,
    /// `[panel][sub][PANEL]` sub-block mins (Q4_K).
    mn: Vec<u8>,
}

impl PackedWeight {
    /// Repacks a ggml tensor `[n, k]`; `None` when its type has no kernel here.
    pub fn from_qtensor(t: &QTensor) -> candle_core::Result<Option<Self>> {
        let Some(fmt) = format_of(t.dtype()) else {
            return Ok(None);
        };
        let (n, k) = t.shape().dims2()?;
        if !k.is_multiple_of(fmt.block) || !k.is_multiple_of(ACT_BLOCK) {
            return Ok(None);
        }
        let data = t.data()?;
        Ok(Some(Self::from_blocks(&data, n, k, fmt)?))
    }

    fn from_blocks(data: &[u8], n: usize, k: usize, fmt: Format) -> candle_core::Result<Self> {
        let row_bytes = k / fmt.block * fmt.block_bytes;
        if data.len() != n * row_bytes {
            candle_core::bail!(
                "{:?} data of {} bytes does not hold {n} x {k}",
                fmt.dtype,
                data.len()
            );
        }
        let panels = n.div_ceil(PANEL);
        let subs = k / fmt.sub;
        let supers = subs / fmt.subs_per_super;
        let cb = fmt.code_bytes();
        let per_sub_planes = fmt.groups() * fmt.planes;
        let mut w = Self {
            n,
            k,
            fmt,
            codes: vec![0u8; panels * subs * cb],
            planes: vec![0u64; panels * subs * per_sub_planes],
            scale: vec![f16::ZERO; panels * supers * PANEL],
            offset: if fmt.has_offset() {
                vec![f16::ZERO; panels * supers * PANEL]
            } else {
                Vec::new()
            },
            sc: if fmt.has_sub_scale() {
                vec![0u8; panels * subs * PANEL]
            } else {
                Vec::new()
            },
            mn: if fmt.kind == pack::Kind::Q4K {
                vec![0u8; panels * subs * PANEL]
            } else {
                Vec::new()
            },
        };
        // Panels are independent: each task fills its own panels' codes, planes and scales.
        // Repacking is a large share of loading a model, and of every layer a streaming
        // scorer reads, so it runs on the compute pool.
        let codes = split_panels(&mut w.codes, panels);
        let planes = split_panels(&mut w.planes, panels);
        let scale = split_panels(&mut w.scale, panels);
        let offset = split_panels(&mut w.offset, panels);
        let sc = split_panels(&mut w.sc, panels);
        let mn = split_panels(&mut w.mn, panels);
        let panel_parts: Vec<std::sync::Mutex<PanelParts<'_>>> = codes
            .into_iter()
            .zip(planes)
            .zip(scale.into_iter().zip(offset))
            .zip(sc.into_iter().zip(mn))
            .enumerate()
            .map(|(p, (((codes, planes), (scale, offset)), (sc, mn)))| {
                std::sync::Mutex::new(PanelParts {
                    p,
                    codes,
                    planes,
                    scale,
                    offset,
                    sc,
                    mn,
                })
            })
            .collect();
        let fill = |part: &mut PanelParts<'_>| {
            let mut decoded: Vec<Sub> = Vec::with_capacity(subs);
            let p = part.p;
            for r in 0..PANEL.min(n - p * PANEL) {
                let row = p * PANEL + r;
                decoded.clear();
                let bytes = &data[row * row_bytes..(row + 1) * row_bytes];
                for blk in bytes.chunks_exact(fmt.block_bytes) {
                    decode_block(&fmt, blk, &mut decoded);
                }
                for (s, sub) in decoded.iter().enumerate() {
                    let base = s * cb;
                    for t in 0..fmt.sub {
                        let slot = code_slot(fmt.wide, r, t);
                        let q = sub.q[t];
                        let low = if fmt.wide { q } else { q & 0xF };
                        part.codes[base + slot.byte] |= low << slot.shift;
                        for pl in 0..fmt.planes {
                            if (q >> (4 + pl)) & 1 == 1 {
                                let at = s * per_sub_planes + slot.group * fmt.planes + pl;
                                part.planes[at] |= 1u64 << slot.bit;
                            }
                        }
                    }
                    let sup = (s / fmt.subs_per_super) * PANEL + r;
                    part.scale[sup] = sub.scale;
                    if fmt.has_offset() {
                        part.offset[sup] = sub.offset;
                    }
                    if fmt.has_sub_scale() {
                        part.sc[s * PANEL + r] = sub.sc;
                    }
                    if fmt.kind == pack::Kind::Q4K {
                        part.mn[s * PANEL + r] = sub.mn;
                    }
                }
            }
        };
        let run = |i: usize| {
            if let Ok(mut part) = panel_parts[i].lock() {
                fill(&mut part);
            }
        };
        if n * k >= PARALLEL_MIN_MACS {
            crate::pool::run(panels, &run);
        } else {
            (0..panels).for_each(run);
        }
        drop(panel_parts);
        Ok(w)
    }

    pub fn rows(&self) -> usize {
        self.n
    }

    /// Bytes a `[n, k]` matrix of `dtype` takes once packed; `None` when it would not be.
    pub fn planned_bytes(dtype: GgmlDType, n: usize, k: usize) -> Option<usize> {
        let fmt = format_of(dtype)?;
        if !k.is_multiple_of(fmt.block) || !k.is_multiple_of(ACT_BLOCK) {
            return None;
        }
        let panels = n.div_ceil(PANEL);
        let subs = k / fmt.sub;
        let supers = subs / fmt.subs_per_super;
        let per_sub = fmt.code_bytes()
            + fmt.plane_bytes()
            + if fmt.has_sub_scale() { PANEL } else { 0 }
            + if fmt.kind == pack::Kind::Q4K {
                PANEL
            } else {
                0
            };
        let per_super = 2 * PANEL * if fmt.has_offset() { 2 } else { 1 };
        Some(panels * (subs * per_sub + supers * per_super))
    }

    pub fn cols(&self) -> usize {
        self.k
    }

    pub fn dtype(&self) -> GgmlDType {
        self.fmt.dtype
    }

    /// Bytes held (codes, high-bit masks, scales).
    pub fn bytes(&self) -> usize {
        self.codes.len()
            + 8 * self.planes.len()
            + 2 * (self.scale.len() + self.offset.len())
            + self.sc.len()
            + self.mn.len()
    }

    fn subs(&self) -> usize {
        self.k / self.fmt.sub
    }

    /// Full code of (panel `p`, sub-block `s`, row lane `r`, element `t`).
    fn code(&self, p: usize, s: usize, r: usize, t: usize) -> u8 {
        let slot = code_slot(self.fmt.wide, r, t);
        let byte = self.codes[(p * self.subs() + s) * self.fmt.code_bytes() + slot.byte];
        if self.fmt.wide {
            return byte;
        }
        let mut q = (byte >> slot.shift) & 0xF;
        let per_sub = self.fmt.groups() * self.fmt.planes;
        for pl in 0..self.fmt.planes {
            let mask =
                self.planes[(p * self.subs() + s) * per_sub + slot.group * self.fmt.planes + pl];
            q |= (((mask >> slot.bit) & 1) as u8) << (4 + pl);
        }
        q
    }

    /// `(d, m)` of row lane `r` in (panel `p`, sub-block `s`): `w = d * q + m`.
    fn scale_offset(&self, p: usize, s: usize, r: usize) -> (f32, f32) {
        let supers = self.subs() / self.fmt.subs_per_super;
        let sup = (p * supers + s / self.fmt.subs_per_super) * PANEL + r;
        let sub = (p * self.subs() + s) * PANEL + r;
        scale_offset(
            self.fmt.kind,
            self.scale[sup],
            self.offset.get(sup).copied().unwrap_or(f16::ZERO),
            self.sc.get(sub).copied().unwrap_or(0),
            self.mn.get(sub).copied().unwrap_or(0),
        )
    }

    /// Row `row` dequantized exactly as ggml dequantizes it.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let (p, r) = (row / PANEL, row % PANEL);
        for s in 0..self.subs() {
            let (d, m) = self.scale_offset(p, s, r);
            for t in 0..self.fmt.sub {
                let q = self.code(p, s, r, t);
                out[s * self.fmt.sub + t] = match self.fmt.zero() {
                    Some(zero) => (q as i32 - zero) as f32 * d,
                    None => q as f32 * d + m,
                };
            }
        }
    }

    /// `out[i][j] = sum_k x[i][k] * w[j][k]` for `rows` rows of `x` (`[rows, k]`, row-major).
    pub fn matmul(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        self.matmul_at(simd_level(), x, rows, out)
    }

    /// As [`matmul`](Self::matmul) with an explicit instruction set (tests, benchmarks).
    pub fn matmul_at(&self, level: SimdLevel, x: &[f32], rows: usize, out: &mut [f32]) {
        matmul_many_at(level, &[self], x, rows, &mut [out]);
    }

    /// Panel `p` of `rows` activation rows, written into `out` (`[rows, n]`).
    fn panel_into(&self, level: SimdLevel, p: usize, acts: &QActs, rows: usize, out: &OutPtr) {
        let mut tile = [[0f32; PANEL]; MAX_TILE];
        let cols = PANEL.min(self.n - p * PANEL);
        let step = tile_rows(level, &self.fmt);
        let mut i0 = 0;
        while i0 < rows {
            let i1 = (i0 + step).min(rows);
            self.panel(level, p, acts, i0..i1, &mut tile);
            for (t, i) in (i0..i1).enumerate() {
                // SAFETY: `out` has rows * n elements (checked by the caller); panel p writes
                // only columns p*PANEL .. p*PANEL+cols of each row, and no two tasks share a
                // panel of the same output.
                unsafe { out.write(i * self.n + p * PANEL, &tile[t][..cols]) };
            }
            i0 = i1;
        }
    }

    fn panel(
        &self,
        level: SimdLevel,
        p: usize,
        acts: &QActs,
        rows: std::ops::Range<usize>,
        tile: &mut [[f32; PANEL]; MAX_TILE],
    ) {
        match level {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: simd_level() returns Avx512 only with avx512f, avx512bw and avx512vnni.
            SimdLevel::Avx512 => unsafe { avx512::panel(self, p, acts, rows, tile) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: simd_level() returns Avx2 only with avx2, fma and f16c.
            SimdLevel::Avx2 => unsafe { avx2::panel(self, p, acts, rows, tile) },
            _ => scalar::panel(self, p, acts, rows, tile),
        }
    }
}

/// Products of one activation matrix with several weights (a layer's q/k/v, or gate/up):
/// `outs[i] = x * ws[i]^T`. Weights that share the input width and sub-block length share one
/// quantization of `x` and one parallel loop over all their panels, which saves a
/// quantization and a thread hand-off per extra weight (most of a decode step's overhead on
/// small models). Each output equals `ws[i].matmul(x, rows, outs[i])` bit for bit.
pub fn matmul_many(ws: &[&PackedWeight], x: &[f32], rows: usize, outs: &mut [&mut [f32]]) {
    matmul_many_at(simd_level(), ws, x, rows, outs)
}

/// As [`matmul_many`] with an explicit instruction set (tests, benchmarks).
pub fn matmul_many_at(
    level: SimdLevel,
    ws: &[&PackedWeight],
    x: &[f32],
    rows: usize,
    outs: &mut [&mut [f32]],
) {
    let mut outs: Vec<&mut [MaybeUninit<f32>]> = outs.iter_mut().map(|o| as_uninit(o)).collect();
    matmul_many_part(level, ws, x, rows, &mut outs, Part::OtherProj)
}

/// As [`matmul_many`], its time counted as `part` in the profile ([`crate::prof`]), into
/// outputs that need not be initialized (a vector's spare capacity): the product writes every
/// element of each, so a caller may take them as initialized once it returns. Zeroing fresh
/// outputs first was 3 % of a prompt pass.
pub fn matmul_many_uninit_as(
    ws: &[&PackedWeight],
    x: &[f32],
    rows: usize,
    outs: &mut [&mut [MaybeUninit<f32>]],
    part: Part,
) {
    matmul_many_part(simd_level(), ws, x, rows, outs, part)
}

/// `v` seen as possibly uninitialized values, for the products' common path.
fn as_uninit(v: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, and the products only store initialized
    // values through it, so `v` stays initialized.
    unsafe { &mut *(v as *mut [f32] as *mut [MaybeUninit<f32>]) }
}

fn matmul_many_part(
    level: SimdLevel,
    ws: &[&PackedWeight],
    x: &[f32],
    rows: usize,
    outs: &mut [&mut [MaybeUninit<f32>]],
    part: Part,
) {
    assert_eq!(ws.len(), outs.len(), "one output per weight");
    let Some(first) = ws.first() else {
        return;
    };
    if ws
        .iter()
        .any(|w| w.k != first.k || w.fmt.sub != first.fmt.sub)
    {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            matmul_many_part(level, &[w], x, rows, &mut [out], part);
        }
        return;
    }
    let _span = tracing::trace_span!(
        "qmatmul",
        n = ws.iter().map(|w| w.n).sum::<usize>(),
        k = first.k,
        rows
    )
    .entered();
    assert_eq!(x.len(), rows * first.k, "activation shape");
    for (w, out) in ws.iter().zip(outs.iter()) {
        assert_eq!(out.len(), rows * w.n, "output shape");
    }
    let quantized = prof::time(Part::ActQuant);
    let acts = QActs::quantize(x, rows, first.k, first.fmt.sub);
    drop(quantized);
    let _product = prof::time(part);
    // Panel g of the whole group lies in weight i where starts[i] <= g < starts[i + 1].
    let mut starts = Vec::with_capacity(ws.len() + 1);
    starts.push(0);
    for w in ws {
        starts.push(starts[starts.len() - 1] + w.n.div_ceil(PANEL));
    }
    let total = starts[ws.len()];
    let ptrs: Vec<OutPtr> = outs
        .iter_mut()
        .map(|o| OutPtr(o.as_mut_ptr() as *mut f32))
        .collect();
    let macs: usize = ws.iter().map(|w| rows * w.n * w.k).sum();
    let parallel = macs >= PARALLEL_MIN_MACS;
    // Task time is summed only for parallel loops: their wall time against it is the
    // hand-off and waiting.
    let profiling = parallel && prof::enabled();
    let run = |g: usize| {
        let t = profiling.then(std::time::Instant::now);
        let i = starts.partition_point(|&s| s <= g) - 1;
        ws[i].panel_into(level, g - starts[i], &acts, rows, &ptrs[i]);
        if let Some(t) = t {
            prof::add(Part::ParallelBusy, t.elapsed().as_nanos() as u64);
        }
    };
    if !parallel {
        (0..total).for_each(run);
    } else {
        // A few claims per thread: enough to even out a slow thread, few enough that the
        // shared counter is not contended.
        let per = total
            .div_ceil(crate::pool::global().threads() * TASKS_PER_THREAD)
            .max(1);
        crate::pool::run(total.div_ceil(per), &|t| {
            (t * per..((t + 1) * per).min(total)).for_each(run)
        });
    }
}

/// `v` cut into `panels` equal consecutive slices (all empty when `v` is).
fn split_panels<T>(v: &mut [T], panels: usize) -> Vec<&mut [T]> {
    let size = v.len() / panels.max(1);
    let mut out = Vec::with_capacity(panels);
    let mut rest = v;
    for _ in 0..panels {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(size);
        out.push(head);
        rest = tail;
    }
    out
}

/// One panel's share of a [`PackedWeight`]'s arrays while it is filled (offsets, sub-block
/// scales and mins are empty for the formats without them).
struct PanelParts<'a> {
    p: usize,
    codes: &'a mut [u8],
    planes: &'a mut [u64],
    scale: &'a mut [f16],
    offset: &'a mut [f16],
    sc: &'a mut [u8],
    mn: &'a mut [u8],
}

/// One row's input, codes, block scales and sub-block sums.
type RowParts<'a> = ((&'a [f32], &'a mut [i8]), (&'a mut [f32], &'a mut [f32]));

/// Activation values above which quantizing them is split across threads.
const PARALLEL_MIN_QUANT: usize = 1 << 15;

/// llama.cpp's quantize_row_q8_0 for one row: per block of 32, `d = amax / 127` and
/// `q = round(x / d)` with ties to even, as llama.cpp's SIMD paths round.
fn quantize_row(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer, ties to even, for
    // |v| < 2^22 (|v| <= 127 here) in the default rounding mode, without a libm call.
    const ROUND: f32 = 12_582_912.0;
    for ((xs, qs), db) in x
        .chunks_exact(ACT_BLOCK)
        .zip(q.chunks_exact_mut(ACT_BLOCK))
        .zip(d.iter_mut())
    {
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let dv = amax / 127.0;
        let id = if dv != 0.0 { 1.0 / dv } else { 0.0 };
        for (qv, xv) in qs.iter_mut().zip(xs) {
            let r = (xv * id + ROUND) - ROUND;
            *qv = r.clamp(-127.0, 127.0) as i8;
        }
        *db = dv;
    }
}

/// [`quantize_row`], then the sum of the codes of each sub-block of `sub` values into `sums`.
fn quantize_row_summed(
    level: SimdLevel,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    sums: &mut [f32],
    sub: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if level == SimdLevel::Avx512 && (sub == 16 || sub == ACT_BLOCK) {
        // SAFETY: simd_level() returns Avx512 only when the CPU reports avx512f.
        unsafe { quantize_row_avx512(x, q, d, sums, sub) };
        return;
    }
    let _ = level;
    quantize_row(x, q, d);
    for (s, c) in sums.iter_mut().zip(q.chunks_exact(sub)) {
        *s = c.iter().map(|&v| v as i32).sum::<i32>() as f32;
    }
}

/// [`quantize_row_summed`] for sub-blocks of 16 or 32, 16 values at a time, with the scalar
/// arithmetic: the same block maximum (NaN ignored, as `f32::max` does), the same product
/// rounded by adding and subtracting the same constant, the same clamp, and 0 for a NaN as
/// the saturating cast gives; the sums are exact integers. So the same codes and sums, bit
/// for bit (the scalar loop, whose cast defeats the vectorizer, was 8 % of a batched step).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn quantize_row_avx512(
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    sums: &mut [f32],
    sub: usize,
) {
    use std::arch::x86_64::*;
    const ROUND: f32 = 12_582_912.0;
    let round = _mm512_set1_ps(ROUND);
    let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
    for (b, ((xs, qs), db)) in x
        .chunks_exact(ACT_BLOCK)
        .zip(q.chunks_exact_mut(ACT_BLOCK))
        .zip(d.iter_mut())
        .enumerate()
    {
        let v = [
            _mm512_loadu_ps(xs.as_ptr()),
            _mm512_loadu_ps(xs.as_ptr().add(16)),
        ];
        // `max(|x|, m)` keeps `m` where |x| is NaN.
        let m = _mm512_max_ps(
            _mm512_abs_ps(v[1]),
            _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_setzero_ps()),
        );
        let dv = _mm512_reduce_max_ps(m) / 127.0;
        let id = _mm512_set1_ps(if dv != 0.0 { 1.0 / dv } else { 0.0 });
        let mut half_sums = [0i32; 2];
        for (h, &vh) in v.iter().enumerate() {
            let r = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(vh, id), round), round);
            let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(r, r);
            let c = _mm512_maskz_mov_ps(ordered, _mm512_min_ps(_mm512_max_ps(r, lo), hi));
            let ints = _mm512_cvttps_epi32(c);
            _mm_storeu_si128(
                qs.as_mut_ptr().add(h * 16) as *mut __m128i,
                _mm512_cvtepi32_epi8(ints),
            );
            half_sums[h] = _mm512_reduce_add_epi32(ints);
        }
        *db = dv;
        if sub == 16 {
            sums[2 * b] = half_sums[0] as f32;
            sums[2 * b + 1] = half_sums[1] as f32;
        } else {
            sums[b] = (half_sums[0] + half_sums[1]) as f32;
        }
    }
}

/// Activation rows computed together per panel at most (register blocking, see
/// [`tile_rows`]): every row's accumulators stay in registers.
pub(crate) const MAX_TILE: usize = 12;
/// Rows per tile elsewhere.
const NARROW_TILE: usize = 8;

/// Activation rows per tile of `fmt` on `level`. On AVX-512, 12 for the formats whose codes
/// take work to unpack (high-bit planes, K-quant sub-block scales): the unpacked codes serve
/// half as many rows again as at 8, and 12 accumulators beside 8 code vectors still fit the
/// 32 registers. Measured with `cargo bench -p switchyard-kernels --bench qmatmul`, against 8
/// rows: 512-row products of Qwen2.5-Coder-1.5B's MLP shapes Q4_K +10 %, Q6_K +5 %; 64 rows of
/// Q5_0 +11 %, but Q4_1 -4 % and Q8_0 -10 % (nothing to unpack, so only the extra pressure on
/// registers), which keep 8. 10 rows gained nothing, 14 and 16 lost most of the gain to
/// spills.
fn tile_rows(level: SimdLevel, fmt: &Format) -> usize {
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 if fmt.planes > 0 || fmt.has_sub_scale() => MAX_TILE,
        _ => NARROW_TILE,
    }
}

/// Activations quantized to 8-bit blocks of 32: `x ≈ d[block] * q`.
pub(crate) struct QActs {
    k: usize,
    /// `[rows][k]`
    q: Vec<i8>,
    /// `[rows][k / ACT_BLOCK]`
    d: Vec<f32>,
    /// Sum of `q` per weight sub-block, `[rows][k / sub]`, as f32 (exact: |sum| <= 32 * 127),
    /// the form the float update takes and the AVX-512 kernel broadcasts.
    sum: Vec<f32>,
    sub: usize,
}

impl QActs {
    fn quantize(x: &[f32], rows: usize, k: usize, sub: usize) -> Self {
        let nb = k / ACT_BLOCK;
        let mut q = vec![0i8; rows * k];
        let mut d = vec![0f32; rows * nb];
        let mut sum = vec![0f32; rows * (k / sub)];
        let level = simd_level();
        let one_row = |((xr, qr), (dr, sr)): &mut RowParts<'_>| {
            quantize_row_summed(level, xr, qr, dr, sr, sub)
        };
        let mut parts: Vec<RowParts<'_>> = x
            .chunks_exact(k)
            .zip(q.chunks_exact_mut(k))
            .zip(d.chunks_exact_mut(nb).zip(sum.chunks_exact_mut(k / sub)))
            .collect();
        if rows * k >= PARALLEL_MIN_QUANT {
            // Each task quantizes its own run of rows (taken through a lock it alone uses).
            let per = rows.div_ceil(crate::pool::global().threads() * TASKS_PER_THREAD);
            let runs: Vec<std::sync::Mutex<&mut [RowParts<'_>]>> = parts
                .chunks_mut(per.max(1))
                .map(std::sync::Mutex::new)
                .collect();
            crate::pool::run(runs.len(), &|t| {
                if let Ok(mut run) = runs[t].lock() {
                    run.iter_mut().for_each(one_row);
                }
            });
        } else {
            parts.iter_mut().for_each(one_row);
        }
        Self { k, q, d, sum, sub }
    }

    #[inline(always)]
    fn row(&self, i: usize) -> &[i8] {
        &self.q[i * self.k..(i + 1) * self.k]
    }

    /// Scale of the activation block holding element `e` of row `i`.
    #[inline(always)]
    fn scale(&self, i: usize, e: usize) -> f32 {
        self.d[(i * self.k + e) / ACT_BLOCK]
    }

    #[inline(always)]
    fn sub_sum(&self, i: usize, s: usize) -> f32 {
        self.sum[i * (self.k / self.sub) + s]
    }

    /// Row `i`'s block scales, `[k / ACT_BLOCK]`.
    #[inline(always)]
    fn row_scales(&self, i: usize) -> &[f32] {
        let nb = self.k / ACT_BLOCK;
        &self.d[i * nb..(i + 1) * nb]
    }

    /// Row `i`'s sub-block sums as f32, `[k / sub]`.
    #[inline(always)]
    fn row_sums(&self, i: usize) -> &[f32] {
        let ns = self.k / self.sub;
        &self.sum[i * ns..(i + 1) * ns]
    }
}

#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: only used to write disjoint regions from parallel tasks (see `matmul_at`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// # Safety
    /// `at + vals.len()` must lie inside the buffer and no other thread may touch that range.
    pub(crate) unsafe fn write(&self, at: usize, vals: &[f32]) {
        // A whole panel's row is one fixed-size copy (two vector stores); a copy of a run-time
        // length calls `memmove`, which was 4 % of a prompt pass.
        if let Ok(full) = <&[f32; PANEL]>::try_from(vals) {
            std::ptr::write_unaligned(self.0.add(at) as *mut [f32; PANEL], *full);
        } else {
            std::ptr::copy_nonoverlapping(vals.as_ptr(), self.0.add(at), vals.len());
        }
    }
}

#[cfg(test)]
mod tests;
