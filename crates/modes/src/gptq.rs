//! GPTQ 4-bit weights (Frantar et al., 2023): second-order, error-compensating quantization.
//!
//! Round-to-nearest quantizes every weight on its own. GPTQ quantizes the input columns of a
//! linear layer one at a time and spreads each column's rounding error over the columns not yet
//! quantized, weighted by the inverse Hessian of the layer's reconstruction error
//! `‖W X − Ŵ X‖²`, whose Hessian is `H = X Xᵀ` over calibration inputs `X`. With `U` the upper
//! Cholesky factor of `H⁻¹` (so `H⁻¹ = Uᵀ U`), quantizing column `i` to `q` updates the rest as
//! `W[:, j] −= (W[:, i] − q) / U[i,i] · U[i, j]` for `j > i`. Updates are applied lazily in
//! blocks of [`LAZY_BLOCK`] columns (the paper's "lazy batch" form), the block-external part
//! as one matrix product.
//!
//! The result is written straight into the block formats the 4-bit kernels already run (Q4_K
//! where a row is a multiple of 256, else Q4_0, as `q4` picks): each block's grid (scale and
//! minimum per 32 values) is chosen by the format's own quantizer from the weights as they stand
//! when GPTQ reaches the block (or, with act-order, from the original weights, since columns are
//! then visited out of order), and GPTQ picks each value's 4-bit code on that grid. The codes
//! are packed into the blocks, so serving needs no new kernel and loads them as they are.
//!
//! Layers are quantized in order, each on the activations of the already-quantized layers
//! before it (run through the 4-bit kernels as serving runs them), as GPTQ does; within a
//! layer, the inputs are those of the float layer.
//!
//! The Cholesky factorisation and triangular inverse use `faer` (dense linear algebra written
//! for this; candle has neither).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use faer::{Mat, MatRef, Par, Side};
use switchyard_models::{
    model::load_block, DenseKv, ForwardBatch, LayeredModel, LoadOptions, QuantTarget, TensorLoader,
    WeightFormat,
};
use switchyard_weights::{names, WeightSource};

use crate::overlay::{OverlaySource, RawTensor};

use crate::{ModesError, Result};

/// Columns whose updates are applied together (a multiple of both 4-bit block sizes, so a
/// Q4_0 or Q4_K block never straddles two lazy blocks).
pub const LAZY_BLOCK: usize = 256;

/// Values sharing one scale and minimum inside a 4-bit block (Q4_0's whole block, one Q4_K
/// sub-block).
const SUB_BLOCK: usize = 32;

/// The linear layers of a transformer layer, each with the layer whose input it shares
/// (the tap that observes that input).
const MATRICES: [(&str, &str); 7] = [
    ("attn_q.weight", "attn_q.weight"),
    ("attn_k.weight", "attn_q.weight"),
    ("attn_v.weight", "attn_q.weight"),
    ("attn_output.weight", "attn_output.weight"),
    ("ffn_gate.weight", "ffn_gate.weight"),
    ("ffn_up.weight", "ffn_gate.weight"),
    ("ffn_down.weight", "ffn_down.weight"),
];

/// What GPTQ is run with; part of the calibration cache's key.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GptqSettings {
    /// Dampening added to the Hessian's diagonal: a fraction of each channel's own diagonal
    /// entry with `damp_per_channel`, else of the mean diagonal (the paper's form). 0.1, not
    /// the paper's 0.01: with 8,192 calibration tokens against inputs of up to 4,864 channels,
    /// Qwen2.5-Coder-0.5B's held-out bits per byte were 0.4441 at 0.1 and 0.4455 at 0.01.
    pub damp: f64,
    /// Dampen each channel in proportion to itself instead of by the mean. Off by default: on
    /// Qwen2.5-Coder-0.5B it raised held-out bits per byte (0.4455 → 0.4503, `reports/gptq`),
    /// the quiet channels' Hessians being fitted too closely to the calibration text.
    pub damp_per_channel: bool,
    /// Visit columns in order of decreasing Hessian diagonal (largest activations first); the
    /// block grids then come from the original weights ("static groups") unless
    /// `dynamic_groups`.
    pub act_order: bool,
    /// With act-order, choose each block's grid when GPTQ first visits one of its columns,
    /// from the weights as they stand then (the errors of every column quantized before
    /// folded in, those of the current lazy block's columns only for its own columns), instead
    /// of from the original weights. The blocks stay in column order, as the kernels read
    /// them; the compensated weights are then less often clipped by a grid made for weights
    /// they no longer are. On by default: with `true_sequential` and `choose_order`,
    /// Qwen2.5-Coder-0.5B's held-out bits per byte went from 0.4183 (static) to 0.4179, and
    /// act-order was kept on 114 of its 168 matrices instead of 93 (`reports/gptq`).
    #[serde(default)]
    pub dynamic_groups: bool,
    /// Search each Q4_0 block's scale for the least Hessian-diagonal-weighted error instead
    /// of ggml's largest-magnitude rule.
    pub grid_search: bool,
    /// Leave out of the Hessian the input rows whose norm exceeds this multiple of the median
    /// row norm (0: keep all). Models with attention sinks (Qwen2.5's first token) carry
    /// activations hundreds of times the typical ones on a few positions; left in, those rows
    /// dominate `XᵀX` and its dampening, and GPTQ fits them instead of ordinary tokens.
    pub outlier_norm: f64,
    /// Calibration documents (ShareGPT's calibration split) and their length in tokens.
    pub docs: usize,
    pub doc_tokens: usize,
    /// Run GPTQ on the activation-aware scaled weights of `q4-awq` instead of the file's
    /// (AWQ's scales first, then GPTQ's error compensation on the scaled matrices; the scaled
    /// norms the scales fold into are kept beside the 4-bit blocks).
    #[serde(default)]
    pub awq_scales: bool,
    /// Quantize a layer's matrices group by group (q/k/v, then the attention output, then
    /// gate/up, then down), each group's Hessian taken on the inputs the already-quantized
    /// groups before it produce, as the GPTQ reference's "true sequential" does. Off: every
    /// group's inputs come from the float layer.
    #[serde(default)]
    pub true_sequential: bool,
    /// Quantize every matrix both with act-order and in column order and keep the one with
    /// the lower output error on `select_docs` further calibration documents, which no
    /// Hessian is fitted to (`act_order` is then only the tie-break). The two orders trade
    /// places between models (act-order is better on SmolLM2, column order on
    /// Qwen2.5-Coder-0.5B), and a calibration error of the fitted text cannot tell which
    /// generalizes. Doubles GPTQ's arithmetic, not its forward passes.
    #[serde(default)]
    pub choose_order: bool,
    /// Calibration documents (after the `docs` ones) that only score the two orders.
    #[serde(default)]
    pub select_docs: usize,
}

impl Default for GptqSettings {
    fn default() -> Self {
        Self {
            damp: 0.1,
            damp_per_channel: false,
            act_order: true,
            grid_search: true,
            outlier_norm: 20.0,
            docs: 32,
            doc_tokens: 256,
            awq_scales: false,
            dynamic_groups: true,
            true_sequential: true,
            choose_order: true,
            select_docs: 8,
        }
    }
}

impl GptqSettings {
    /// Calibration documents the settings read: the fitted ones, then those that choose the
    /// order.
    pub fn documents(&self) -> usize {
        self.docs
            + if self.choose_order {
                self.select_docs
            } else {
                0
            }
    }
}

/// One weight matrix after GPTQ: the raw 4-bit blocks, as the kernels read them.
#[derive(Debug, Clone)]
pub struct QuantizedMatrix {
    pub dtype: GgmlDType,
    /// `[rows, cols]`.
    pub shape: [usize; 2],
    pub bytes: Vec<u8>,
}

impl QuantizedMatrix {
    pub fn to_qtensor(&self, device: &Device) -> Result<QTensor> {
        Ok(qtensor_from_ggml(
            self.dtype,
            &self.bytes,
            self.shape.to_vec(),
            device,
        )?)
    }

    /// The dequantized values, `[rows, cols]` row-major.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        Ok(self
            .to_qtensor(&Device::Cpu)?
            .dequantize(&Device::Cpu)?
            .flatten_all()?
            .to_vec1()?)
    }
}

/// The reconstruction error `tr((W − Ŵ) H (W − Ŵ)ᵀ)` of one matrix on the calibration inputs
/// (the summed squared output error), round-to-nearest against GPTQ.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MatrixReport {
    pub name: String,
    pub dtype: String,
    pub error_rtn: f64,
    pub error_gptq: f64,
    /// Calibration input rows in the Hessian, and rows left out as outliers.
    pub rows: usize,
    pub outlier_rows: usize,
    /// Whether the kept blocks came from act-order (else column order).
    #[serde(default)]
    pub act_order: bool,
    /// With `choose_order`: the output error on the selection documents of the act-order
    /// and the column-order result.
    #[serde(default)]
    pub selection_error: Option<[f64; 2]>,
}

/// A whole model's GPTQ result.
#[derive(Debug)]
pub struct GptqCalibration {
    /// By canonical tensor name.
    pub tensors: HashMap<String, QuantizedMatrix>,
    /// Float tensors served in place of the file's beside the 4-bit blocks: with
    /// `awq_scales`, the norms AWQ's scales are folded into (f32). Empty otherwise.
    pub float_tensors: HashMap<String, RawTensor>,
    pub reports: Vec<MatrixReport>,
    pub calibration_tokens: usize,
    pub settings: GptqSettings,
}

impl GptqCalibration {
    /// Input rows left out of the Hessians as outliers, and all rows seen, over all matrices.
    pub fn outlier_rows(&self) -> (usize, usize) {
        self.reports.iter().fold((0, 0), |(o, n), m| {
            (o + m.outlier_rows, n + m.rows + m.outlier_rows)
        })
    }

    /// Summed reconstruction error over all matrices, (round-to-nearest, GPTQ).
    pub fn total_error(&self) -> (f64, f64) {
        self.reports
            .iter()
            .fold((0.0, 0.0), |(r, g), m| (r + m.error_rtn, g + m.error_gptq))
    }
}

/// Where each value's 4-bit code sits in a block of `dtype`: (byte, shift) of value `e`.
fn nibble(dtype: GgmlDType, e: usize) -> (usize, u32) {
    match dtype {
        // d (f16), then 16 bytes: values 0..16 in the low nibbles, 16..32 in the high ones.
        GgmlDType::Q4_0 => (2 + e % 16, if e < 16 { 0 } else { 4 }),
        // d, dmin (f16), 12 bytes of scales, then 4 runs of 32 bytes, each holding 64 values:
        // the first 32 in the low nibbles, the next 32 in the high ones.
        _ => {
            let (run, within) = (e / 64, e % 64);
            (16 + 32 * run + within % 32, if within < 32 { 0 } else { 4 })
        }
    }
}

/// One sub-block's grid: value = `scale · q − offset` for the code `q` in 0..=15.
#[derive(Debug, Clone, Copy)]
struct Grid {
    scale: f32,
    offset: f32,
}

impl Grid {
    /// The nearest code and its value.
    fn quantize(self, x: f32) -> (u8, f32) {
        let q = if self.scale == 0.0 || !self.scale.is_finite() {
            0.0
        } else {
            ((x + self.offset) / self.scale).round().clamp(0.0, 15.0)
        };
        (q as u8, self.scale * q - self.offset)
    }
}

/// The blocks (and each sub-block's grid) for `values` (`[rows, block]` row-major, one block
/// per row): the format's own quantizer's choice, except that with `importance` (one weight
/// per column, the Hessian's diagonal) a Q4_0 block's scale is searched to minimise the
/// importance-weighted squared error (ggml's Q4_0 rule only maps the largest magnitude to
/// -8 steps; Q4_K's quantizer already searches its scales and minimums).
fn block_grids(
    values: &[f32],
    rows: usize,
    dtype: GgmlDType,
    importance: Option<&[f64]>,
) -> Result<(Vec<u8>, Vec<Grid>)> {
    let block = dtype.block_size();
    let device = Device::Cpu;
    let t = Tensor::from_slice(values, (rows, block), &device)?;
    let mut blocks = QTensor::quantize(&t, dtype)?.data()?.into_owned();
    if let (GgmlDType::Q4_0, Some(importance)) = (dtype, importance) {
        let size = dtype.type_size();
        for r in 0..rows {
            let d = q4_0_scale(&values[r * block..(r + 1) * block], importance);
            blocks[r * size..r * size + 2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        }
    }
    // Read the grids back through the format's own dequantizer: all codes 0 give `-offset`,
    // all codes 1 give `scale - offset`.
    let with_codes = |code: u8| -> Result<Vec<f32>> {
        let mut b = blocks.clone();
        let size = dtype.type_size();
        for r in 0..rows {
            for e in 0..block {
                let (byte, shift) = nibble(dtype, e);
                let at = r * size + byte;
                b[at] = (b[at] & !(0xF << shift)) | (code << shift);
            }
        }
        Ok(qtensor_from_ggml(dtype, &b, vec![rows, block], &device)?
            .dequantize(&device)?
            .flatten_all()?
            .to_vec1()?)
    };
    let (zero, one) = (with_codes(0)?, with_codes(1)?);
    let grids = (0..rows * block / SUB_BLOCK)
        .map(|i| {
            let at = i * SUB_BLOCK;
            Grid {
                scale: one[at] - zero[at],
                offset: -zero[at],
            }
        })
        .collect();
    Ok((blocks, grids))
}

/// Q4_0's scale for one block (`x = d · (q − 8)`, q in 0..=15) that minimises
/// `Σ importance · (x − x̂)²`: ggml's `max / −8` shrunk by each factor of a grid, each followed
/// by one weighted least-squares refit of `d` to the codes it gives (the search llama.cpp's
/// importance-matrix quantization makes). Never worse than ggml's rule, which is in the grid.
fn q4_0_scale(x: &[f32], importance: &[f64]) -> f32 {
    let max = x
        .iter()
        .copied()
        .fold(0.0f32, |m, v| if v.abs() > m.abs() { v } else { m });
    if max == 0.0 {
        return 0.0;
    }
    let f16 = |d: f32| half::f16::from_f32(d).to_f32();
    let codes = |d: f32| {
        x.iter()
            .map(move |&v| ((v / d + 8.0).round().clamp(0.0, 15.0)) - 8.0)
    };
    let error = |d: f32| -> f64 {
        if d == 0.0 || !d.is_finite() {
            return f64::INFINITY;
        }
        codes(d)
            .zip(x)
            .zip(importance)
            .map(|((q, &v), &w)| w * f64::from(v - d * q).powi(2))
            .sum()
    };
    let mut best = (error(f16(max / -8.0)), f16(max / -8.0));
    for i in 0..=16 {
        let d = f16(max / -8.0 * (1.0 - 0.025 * i as f32));
        let (num, den) =
            codes(d)
                .zip(x)
                .zip(importance)
                .fold((0.0f64, 0.0f64), |(n, m), ((q, &v), &w)| {
                    (
                        n + w * f64::from(v) * f64::from(q),
                        m + w * f64::from(q * q),
                    )
                });
        let refit = if den > 0.0 {
            f16((num / den) as f32)
        } else {
            d
        };
        for d in [d, refit] {
            let e = error(d);
            if e < best.0 {
                best = (e, d);
            }
        }
    }
    best.1
}

/// `U`, the upper Cholesky factor of `H⁻¹` (`H⁻¹ = Uᵀ U`), for a symmetric positive definite
/// `H`. With `P` the reversal permutation, `P H P = L Lᵀ` gives `H = R Rᵀ` for the upper
/// triangular `R = P L P`, so `H⁻¹ = R⁻ᵀ R⁻¹` and `U = R⁻¹`: one factorisation, one
/// triangular inverse, no explicit `H⁻¹`.
pub fn inverse_cholesky_upper(h: MatRef<'_, f64>) -> Result<Mat<f64>> {
    let n = h.nrows();
    let reversed = h.reverse_rows_and_cols().to_owned();
    let llt = reversed.llt(Side::Lower).map_err(|e| {
        ModesError::Invalid(format!(
            "GPTQ: the dampened Hessian is not positive definite ({e:?})"
        ))
    })?;
    let r = llt.L().reverse_rows_and_cols().to_owned();
    let mut u = Mat::<f64>::zeros(n, n);
    faer::linalg::triangular_inverse::invert_upper_triangular(u.as_mut(), r.as_ref(), par());
    Ok(u)
}

fn par() -> Par {
    Par::rayon(0)
}

/// GPTQ on one `[rows, cols]` row-major matrix `w` with Hessian `h` (`[cols, cols]`, the sum of
/// `x xᵀ` over calibration inputs), into `dtype` blocks (Q4_0 or Q4_K).
pub fn quantize_matrix(
    w: &[f32],
    rows: usize,
    cols: usize,
    h: &[f64],
    dtype: GgmlDType,
    settings: &GptqSettings,
) -> Result<QuantizedMatrix> {
    let block = dtype.block_size();
    if !matches!(dtype, GgmlDType::Q4_0 | GgmlDType::Q4K) {
        return Err(ModesError::Invalid(format!(
            "GPTQ writes Q4_0 or Q4_K blocks, not {dtype:?}"
        )));
    }
    if w.len() != rows * cols || h.len() != cols * cols || !cols.is_multiple_of(block) {
        return Err(ModesError::Invalid(format!(
            "GPTQ: a {rows}x{cols} matrix ({} values) with a {}-value Hessian does not fit {dtype:?} blocks of {block}",
            w.len(),
            h.len()
        )));
    }
    let blocks_per_row = cols / block;
    let size = dtype.type_size();
    let mut h = Mat::<f64>::from_fn(cols, cols, |i, j| h[i * cols + j]);
    let mut w = Mat::<f32>::from_fn(rows, cols, |r, c| w[r * cols + c]);
    // Inputs that never fire carry no information: their weights do not matter; zero them.
    for i in 0..cols {
        if h[(i, i)] <= 0.0 {
            h[(i, i)] = 1.0;
            for r in 0..rows {
                w[(r, i)] = 0.0;
            }
        }
    }
    let mean_diag = (0..cols).map(|i| h[(i, i)]).sum::<f64>() / cols as f64;
    for i in 0..cols {
        let scale = if settings.damp_per_channel {
            h[(i, i)]
        } else {
            mean_diag
        };
        h[(i, i)] += settings.damp * scale;
    }
    let mut order: Vec<usize> = (0..cols).collect();
    if settings.act_order {
        order.sort_by(|&a, &b| h[(b, b)].total_cmp(&h[(a, a)]));
    }

    // Blocks (header bytes, grids) in column order, each set by `set_block` below.
    let mut out = vec![0u8; rows * blocks_per_row * size];
    let mut grids = vec![
        Grid {
            scale: 0.0,
            offset: 0.0
        };
        rows * cols / SUB_BLOCK
    ];
    let diag: Vec<f64> = (0..cols).map(|i| h[(i, i)]).collect();
    let set_block = |b: usize, values: &[f32], out: &mut [u8], grids: &mut [Grid]| {
        let importance = settings
            .grid_search
            .then(|| &diag[b * block..(b + 1) * block]);
        let (bytes, g) = block_grids(values, rows, dtype, importance)?;
        let per_row = block / SUB_BLOCK;
        for r in 0..rows {
            let at = (r * blocks_per_row + b) * size;
            out[at..at + size].copy_from_slice(&bytes[r * size..(r + 1) * size]);
            let gat = r * (cols / SUB_BLOCK) + b * per_row;
            grids[gat..gat + per_row].copy_from_slice(&g[r * per_row..(r + 1) * per_row]);
        }
        Result::Ok(())
    };
    // Work in visiting order: column k of `wp` is column order[k] of `w`.
    let hp = Mat::<f64>::from_fn(cols, cols, |i, j| h[(order[i], order[j])]);
    let u64 = inverse_cholesky_upper(hp.as_ref())?;
    let u = Mat::<f32>::from_fn(cols, cols, |i, j| u64[(i, j)] as f32);
    let mut wp = Mat::<f32>::from_fn(rows, cols, |r, k| w[(r, order[k])]);
    // Where column c of `w` sits in `wp`.
    let mut position = vec![0usize; cols];
    for (k, &c) in order.iter().enumerate() {
        position[c] = k;
    }
    // Block `b`'s values as `wp` holds them now, `[rows, block]` row-major.
    let block_values = |wp: &Mat<f32>, b: usize| -> Vec<f32> {
        let mut v = vec![0.0f32; rows * block];
        for e in 0..block {
            for (r, &x) in wp.col_as_slice(position[b * block + e]).iter().enumerate() {
                v[r * block + e] = x;
            }
        }
        v
    };
    // Static groups: every grid now, from the original weights. Otherwise each block's grid
    // when GPTQ reaches the first of its columns.
    let static_groups = settings.act_order && !settings.dynamic_groups;
    if static_groups {
        for b in 0..blocks_per_row {
            let v = block_values(&wp, b);
            set_block(b, &v, &mut out, &mut grids)?;
        }
    }
    let mut gridded = vec![static_groups; blocks_per_row];
    let mut codes = vec![0u8; rows * cols];
    let mut err = Mat::<f32>::zeros(rows, LAZY_BLOCK);
    let mut i1 = 0;
    while i1 < cols {
        let i2 = (i1 + LAZY_BLOCK).min(cols);
        for k in i1..i2 {
            let c = order[k];
            if !gridded[c / block] {
                // The first of the block's columns GPTQ reaches (in column order, the block's
                // columns are k..k+block, all updated so far).
                let v = block_values(&wp, c / block);
                set_block(c / block, &v, &mut out, &mut grids)?;
                gridded[c / block] = true;
            }
            let d = u[(k, k)];
            let (per_row, sub) = (cols / SUB_BLOCK, c / SUB_BLOCK);
            let col = wp.col_as_slice_mut(k);
            let e = err.col_as_slice_mut(k - i1);
            for r in 0..rows {
                let (q, value) = grids[r * per_row + sub].quantize(col[r]);
                codes[r * cols + c] = q;
                e[r] = (col[r] - value) / d;
            }
            let e = err.col_as_slice(k - i1);
            for j in k + 1..i2 {
                let ukj = u[(k, j)];
                for (t, &ev) in wp.col_as_slice_mut(j).iter_mut().zip(e) {
                    *t -= ev * ukj;
                }
            }
        }
        if i2 < cols {
            faer::linalg::matmul::matmul(
                wp.as_mut().subcols_mut(i2, cols - i2),
                faer::Accum::Add,
                err.as_ref().subcols(0, i2 - i1),
                u.as_ref().submatrix(i1, i2, i2 - i1, cols - i2),
                -1.0f32,
                par(),
            );
        }
        i1 = i2;
    }
    for r in 0..rows {
        for c in 0..cols {
            let (b, e) = (c / block, c % block);
            let (byte, shift) = nibble(dtype, e);
            let at = (r * blocks_per_row + b) * size + byte;
            out[at] = (out[at] & !(0xF << shift)) | (codes[r * cols + c] << shift);
        }
    }
    Ok(QuantizedMatrix {
        dtype,
        shape: [rows, cols],
        bytes: out,
    })
}

/// `tr(D H Dᵀ)` for `D = a − b` (`[rows, cols]` row-major) and `h` (`[cols, cols]`).
pub fn reconstruction_error(a: &[f32], b: &[f32], rows: usize, cols: usize, h: &[f64]) -> f64 {
    let d = Mat::<f64>::from_fn(rows, cols, |r, c| {
        f64::from(a[r * cols + c]) - f64::from(b[r * cols + c])
    });
    let hm = Mat::<f64>::from_fn(cols, cols, |i, j| h[i * cols + j]);
    let dh = &d * &hm;
    let mut sum = 0.0;
    for c in 0..cols {
        for r in 0..rows {
            sum += dh[(r, c)] * d[(r, c)];
        }
    }
    sum
}

/// The entries of `h`'s sum, row-major, in f64.
fn hessian_values(h: &Hessian) -> Result<Vec<f64>> {
    Ok(h.sum
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f64::from)
        .collect())
}

/// Accumulated `X Xᵀ` of one tapped input.
struct Hessian {
    sum: Tensor,
    rows: usize,
    /// Rows left out as outliers (see [`GptqSettings::outlier_norm`]).
    dropped: usize,
}

/// The rows of `x` (`[n, d]`) whose norm is at most `ratio` times the median row norm, and how
/// many were left out (`ratio` 0 keeps all).
fn typical_rows(x: &Tensor, ratio: f64) -> candle_core::Result<(Tensor, usize)> {
    let n = x.dim(0)?;
    if ratio <= 0.0 || n < 2 {
        return Ok((x.clone(), 0));
    }
    let norms: Vec<f32> = x.sqr()?.sum(1)?.to_vec1()?;
    let mut sorted = norms.clone();
    sorted.sort_by(f32::total_cmp);
    let limit = f64::from(sorted[n / 2]) * ratio * ratio;
    let keep: Vec<u32> = (0..n as u32)
        .filter(|&i| f64::from(norms[i as usize]) <= limit)
        .collect();
    let dropped = n - keep.len();
    if dropped == 0 {
        return Ok((x.clone(), 0));
    }
    let idx = Tensor::new(keep.as_slice(), x.device())?;
    Ok((x.index_select(&idx, 0)?, dropped))
}

/// Quantizes the model layer by layer with GPTQ over `docs`. `target` decides the block type
/// per matrix as serving does; `progress(done, total)` counts layers.
pub fn calibrate(
    source: Arc<dyn WeightSource>,
    docs: &[Vec<u32>],
    target: QuantTarget,
    settings: &GptqSettings,
    mut progress: impl FnMut(usize, usize),
) -> Result<GptqCalibration> {
    let mut model = LayeredModel::load(
        Arc::clone(&source),
        &LoadOptions {
            layers: None,
            format: WeightFormat::F32,
        },
    )?;
    let n_layers = model.n_layers();
    let kv_dim = model.config().spec.n_kv_heads * model.config().spec.head_dim;
    let docs: Vec<&Vec<u32>> = docs.iter().filter(|d| !d.is_empty()).collect();
    // The last `select_docs` documents only choose each matrix's order.
    let n_fit = if settings.choose_order {
        if docs.len() <= settings.select_docs || settings.select_docs == 0 {
            return Err(ModesError::Invalid(format!(
                "GPTQ with choose_order needs documents to fit and {} to choose on; {} given",
                settings.select_docs,
                docs.len()
            )));
        }
        docs.len() - settings.select_docs
    } else {
        docs.len()
    };
    let tokens: usize = docs[..n_fit].iter().map(|d| d.len()).sum();
    if tokens == 0 {
        return Err(ModesError::Invalid(
            "GPTQ calibration needs at least one token".into(),
        ));
    }
    let mut xs = docs
        .iter()
        .map(|d| model.embed(d))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let device = Device::Cpu;
    let mut tensors: HashMap<String, QuantizedMatrix> = HashMap::new();
    let mut reports = Vec::new();
    let run_doc = |model: &LayeredModel, x: &Tensor, l: usize| -> Result<Tensor> {
        let n = x.dim(0)?;
        let mut kv = DenseKv::new(n_layers, kv_dim);
        Ok(model.forward_layers(
            x.clone(),
            l..l + 1,
            &mut ForwardBatch::single(&mut kv, 0, n),
        )?)
    };
    // The Hessians of the inputs of `taps` on layer `l` as `model` holds it now: over the
    // fitted documents, and over the selection documents.
    let observe = |model: &LayeredModel, xs: &[Tensor], l: usize, taps: Vec<String>| {
        let observed: Rc<RefCell<[HashMap<String, Hessian>; 2]>> = Rc::default();
        let selecting = Rc::new(Cell::new(false));
        let (sink, which) = (Rc::clone(&observed), Rc::clone(&selecting));
        let outlier_norm = settings.outlier_norm;
        let observer = move |name: &str, x: &Tensor| -> candle_core::Result<()> {
            if !taps.iter().any(|t| t == name) {
                return Ok(());
            }
            let x = x.flatten_to(x.rank().saturating_sub(2))?;
            let (x, dropped) = typical_rows(&x, outlier_norm)?;
            let xtx = x.t()?.matmul(&x)?;
            let rows = x.dim(0)?;
            let mut all = sink.borrow_mut();
            let all = &mut all[usize::from(which.get())];
            match all.get_mut(name) {
                Some(h) => {
                    h.sum = (&h.sum + xtx)?;
                    h.rows += rows;
                    h.dropped += dropped;
                }
                None => {
                    let h = Hessian {
                        sum: xtx,
                        rows,
                        dropped,
                    };
                    all.insert(name.to_string(), h);
                }
            }
            Ok(())
        };
        switchyard_kernels::tap::with_tap(observer, || -> Result<()> {
            for (i, x) in xs.iter().enumerate() {
                selecting.set(i >= n_fit);
                run_doc(model, x, l)?;
            }
            Ok(())
        })??;
        Result::Ok(observed.take())
    };
    // Layer `l` with the blocks GPTQ has made for it so far, the rest of it from `source`
    // loaded as `format`.
    let install = |model: &mut LayeredModel,
                   tensors: &HashMap<String, QuantizedMatrix>,
                   l: usize,
                   format: WeightFormat|
     -> Result<()> {
        let own: HashMap<String, QuantizedMatrix> = MATRICES
            .iter()
            .map(|(member, _)| names::layer(l, member))
            .filter_map(|n| tensors.get(&n).map(|m| (n, m.clone())))
            .collect();
        let overlay = OverlaySource::new(Arc::clone(&source), "GPTQ 4-bit", raw_blocks(&own));
        let loader = TensorLoader {
            src: &overlay,
            device: &device,
            format,
        };
        let block = load_block(&loader, model.config(), l)?;
        model.install_layer(l, block)?;
        Ok(())
    };
    for l in 0..n_layers {
        let mut observed: [HashMap<String, Hessian>; 2] = Default::default();
        for (g, (member, tap)) in MATRICES.iter().enumerate() {
            let tap = names::layer(l, tap);
            if !observed[0].contains_key(&tap) {
                // A new group of matrices sharing one input.
                let taps = if settings.true_sequential {
                    if g > 0 {
                        // Its inputs as the groups quantized before it make them (their
                        // blocks dequantized; this group and those after it still float).
                        install(&mut model, &tensors, l, WeightFormat::F32)?;
                    }
                    vec![tap.clone()]
                } else {
                    MATRICES.iter().map(|(_, t)| names::layer(l, t)).collect()
                };
                observed = observe(&model, &xs, l, taps)?;
            }
            let name = names::layer(l, member);
            let hessian = observed[0].get(&tap).ok_or_else(|| {
                ModesError::Invalid(format!(
                    "GPTQ calibration never observed the input of {tap}"
                ))
            })?;
            let h = hessian_values(hessian)?;
            let selection = if settings.choose_order {
                let hs = observed[1].get(&tap).ok_or_else(|| {
                    ModesError::Invalid(format!(
                        "GPTQ's selection documents never reached the input of {tap}"
                    ))
                })?;
                Some(hessian_values(hs)?)
            } else {
                None
            };
            let w = source.load(&name, &device)?.dequantize(&device)?;
            let (rows, cols) = w.dims2()?;
            let dtype = target.dtype_for(cols, false);
            let values: Vec<f32> = w.flatten_all()?.to_vec1()?;
            // The blocks, their values, and the order they came from.
            let quantize = |act_order| {
                let s = GptqSettings {
                    act_order,
                    ..*settings
                };
                let q = quantize_matrix(&values, rows, cols, &h, dtype, &s)?;
                let deq = q.dequantize()?;
                Result::Ok((q, deq, act_order))
            };
            let ((q, deq, act_order), selection_error) = match &selection {
                None => (quantize(settings.act_order)?, None),
                Some(hs) => {
                    let (a, c) = (quantize(true)?, quantize(false)?);
                    let ea = reconstruction_error(&values, &a.1, rows, cols, hs);
                    let ec = reconstruction_error(&values, &c.1, rows, cols, hs);
                    let act = ea < ec || (ea == ec && settings.act_order);
                    (if act { a } else { c }, Some([ea, ec]))
                }
            };
            let rtn: Vec<f32> = QTensor::quantize(&w, dtype)?
                .dequantize(&device)?
                .flatten_all()?
                .to_vec1()?;
            reports.push(MatrixReport {
                name: name.clone(),
                dtype: format!("{dtype:?}"),
                error_rtn: reconstruction_error(&values, &rtn, rows, cols, &h),
                error_gptq: reconstruction_error(&values, &deq, rows, cols, &h),
                rows: hessian.rows,
                outlier_rows: hessian.dropped,
                act_order,
                selection_error,
            });
            tensors.insert(name, q);
        }
        // The next layer sees this one's output through the 4-bit kernels.
        install(&mut model, &tensors, l, WeightFormat::Quantized(target))?;
        xs = xs
            .iter()
            .map(|x| run_doc(&model, x, l))
            .collect::<Result<Vec<_>>>()?;
        model.drop_layer(l);
        progress(l + 1, n_layers);
    }
    Ok(GptqCalibration {
        tensors,
        float_tensors: HashMap::new(),
        reports,
        calibration_tokens: tokens,
        settings: *settings,
    })
}

/// GPTQ over `awq`'s activation-aware scaled weights of `source` (what `awq_scales` asks
/// for): the scaled matrices are quantized as [`calibrate`] quantizes the file's, and the
/// scaled tensors GPTQ does not quantize (the norms the scales fold into) are kept beside
/// the blocks as f32, so [`gptq_source`] over the original `source` serves the pair.
pub fn calibrate_on_awq(
    source: Arc<dyn WeightSource>,
    awq: &crate::awq::AwqCalibration,
    docs: &[Vec<u32>],
    target: QuantTarget,
    settings: &GptqSettings,
    progress: impl FnMut(usize, usize),
) -> Result<GptqCalibration> {
    let scaled = Arc::new(crate::awq::scaled_source(source, awq)?);
    let mut c = calibrate(scaled.clone(), docs, target, settings, progress)?;
    for name in awq.tensors.keys() {
        if !c.tensors.contains_key(name) {
            let t = scaled.raw(name).ok_or_else(|| {
                ModesError::Invalid(format!("AWQ's scaled tensor {name} is missing"))
            })?;
            c.float_tensors.insert(name.clone(), t.clone());
        }
    }
    Ok(c)
}

/// The model's weights with GPTQ's 4-bit matrices in place of the originals.
pub fn gptq_source(inner: Arc<dyn WeightSource>, calibration: &GptqCalibration) -> OverlaySource {
    let mut all = raw_blocks(&calibration.tensors);
    all.extend(
        calibration
            .float_tensors
            .iter()
            .map(|(k, t)| (k.clone(), t.clone())),
    );
    OverlaySource::new(inner, "GPTQ 4-bit", all)
}

fn raw_blocks(tensors: &HashMap<String, QuantizedMatrix>) -> HashMap<String, RawTensor> {
    tensors
        .iter()
        .map(|(k, m)| {
            let raw = RawTensor {
                dtype: m.dtype,
                shape: m.shape.to_vec(),
                bytes: m.bytes.clone(),
            };
            (k.clone(), raw)
        })
        .collect()
}

/// The GPTQ cache: one safetensors file per (model, settings), holding each matrix's raw
/// blocks as bytes and, in the metadata, what they were made from.
pub mod cache {
    use std::collections::HashMap;
    use std::path::{Path, PathBuf};

    use candle_core::quantized::GgmlDType;
    use safetensors::tensor::{Dtype, SafeTensors, TensorView};
    use serde::{Deserialize, Serialize};
    use sha2::{Digest, Sha256};

    use super::{GptqCalibration, GptqSettings, MatrixReport, QuantizedMatrix};
    use crate::overlay::RawTensor;
    use crate::{ModesError, Result};

    /// Bumped whenever the algorithm or the file layout changes, so old results are remade.
    /// 2: float tensors (AWQ-scaled norms) beside the blocks, shapes of any rank.
    pub const FORMAT_VERSION: u32 = 2;
    const META_KEY: &str = "switchyard.gptq";

    #[derive(Debug, Serialize, Deserialize)]
    struct Meta {
        format_version: u32,
        model_sha256: String,
        settings: GptqSettings,
        calibration_tokens: usize,
        tensors: Vec<Entry>,
        reports: Vec<MatrixReport>,
    }

    #[derive(Debug, Serialize, Deserialize)]
    struct Entry {
        name: String,
        /// "q4_0" or "q4_k" (GPTQ's blocks), "f32" (a float tensor served as it is).
        dtype: String,
        shape: Vec<usize>,
    }

    /// The cache file of the model with SHA-256 `model_sha256` under `settings`, in `dir`.
    pub fn path(dir: &Path, model_sha256: &str, settings: &GptqSettings) -> PathBuf {
        let key = serde_json::to_string(&(FORMAT_VERSION, settings)).unwrap_or_default();
        let digest = hex::encode(Sha256::digest(key.as_bytes()));
        let model = model_sha256.get(..16).unwrap_or(model_sha256);
        dir.join(format!("{model}-{}.gptq.safetensors", &digest[..16]))
    }

    fn dtype_name(d: GgmlDType) -> &'static str {
        match d {
            GgmlDType::Q4_0 => "q4_0",
            GgmlDType::F32 => "f32",
            _ => "q4_k",
        }
    }

    /// Every tensor of `cal` as (name, dtype, shape, bytes), blocks and float tensors alike,
    /// in name order.
    fn entries(cal: &GptqCalibration) -> Vec<(&str, GgmlDType, Vec<usize>, &[u8])> {
        let mut all: Vec<(&str, GgmlDType, Vec<usize>, &[u8])> = cal
            .tensors
            .iter()
            .map(|(n, m)| (n.as_str(), m.dtype, m.shape.to_vec(), m.bytes.as_slice()))
            .chain(
                cal.float_tensors
                    .iter()
                    .map(|(n, t)| (n.as_str(), t.dtype, t.shape.clone(), t.bytes.as_slice())),
            )
            .collect();
        all.sort_by(|a, b| a.0.cmp(b.0));
        all
    }

    /// Writes `cal` to `path` (through a temporary file, so a reader never sees half of it).
    pub fn save(path: &Path, model_sha256: &str, cal: &GptqCalibration) -> Result<()> {
        let io =
            |e: std::io::Error| ModesError::Invalid(format!("GPTQ cache {}: {e}", path.display()));
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let all = entries(cal);
        let meta = Meta {
            format_version: FORMAT_VERSION,
            model_sha256: model_sha256.to_string(),
            settings: cal.settings,
            calibration_tokens: cal.calibration_tokens,
            tensors: all
                .iter()
                .map(|(n, dtype, shape, _)| Entry {
                    name: n.to_string(),
                    dtype: dtype_name(*dtype).into(),
                    shape: shape.clone(),
                })
                .collect(),
            reports: cal.reports.clone(),
        };
        let views = all
            .iter()
            .map(|(n, _, _, bytes)| {
                TensorView::new(Dtype::U8, vec![bytes.len()], bytes)
                    .map(|v| (n.to_string(), v))
                    .map_err(|e| ModesError::Invalid(format!("GPTQ cache tensor {n}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let json = serde_json::to_string(&meta)
            .map_err(|e| ModesError::Invalid(format!("GPTQ cache metadata: {e}")))?;
        let tmp = path.with_extension("tmp");
        safetensors::tensor::serialize_to_file(
            views,
            Some(HashMap::from([(META_KEY.to_string(), json)])),
            &tmp,
        )
        .map_err(|e| ModesError::Invalid(format!("GPTQ cache {}: {e}", tmp.display())))?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Reads the result at `path` if it was made from the model `model_sha256` with
    /// `settings`. `Ok(None)`: no file. A file that is not such a result is an error naming
    /// what is wrong (the caller recalibrates).
    pub fn load(
        path: &Path,
        model_sha256: &str,
        settings: &GptqSettings,
    ) -> Result<Option<GptqCalibration>> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(ModesError::Invalid(format!(
                    "GPTQ cache {}: {e}",
                    path.display()
                )))
            }
        };
        let bad = |detail: String| {
            ModesError::Invalid(format!("GPTQ cache {}: {detail}", path.display()))
        };
        let (_, header) =
            SafeTensors::read_metadata(&bytes).map_err(|e| bad(format!("not safetensors: {e}")))?;
        let json = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get(META_KEY))
            .ok_or_else(|| bad(format!("no {META_KEY:?} metadata")))?;
        let meta: Meta =
            serde_json::from_str(json).map_err(|e| bad(format!("bad metadata: {e}")))?;
        if meta.format_version != FORMAT_VERSION
            || meta.model_sha256 != model_sha256
            || meta.settings != *settings
        {
            return Err(bad(format!(
                "made by format {} from model {} with {:?}, not format {FORMAT_VERSION} from {model_sha256} with {settings:?}",
                meta.format_version, meta.model_sha256, meta.settings
            )));
        }
        let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
        let mut tensors = HashMap::new();
        let mut float_tensors = HashMap::new();
        for e in meta.tensors {
            let dtype = match e.dtype.as_str() {
                "q4_0" => GgmlDType::Q4_0,
                "q4_k" => GgmlDType::Q4K,
                "f32" => GgmlDType::F32,
                other => return Err(bad(format!("{}: unknown block type {other:?}", e.name))),
            };
            let t = st
                .tensor(&e.name)
                .map_err(|_| bad(format!("tensor {} is missing", e.name)))?;
            let values = e.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
            let want = values
                .filter(|v| v % dtype.block_size() == 0)
                .and_then(|v| (v / dtype.block_size()).checked_mul(dtype.type_size()));
            if t.dtype() != Dtype::U8 || Some(t.data().len()) != want {
                return Err(bad(format!(
                    "tensor {} holds {} bytes, not what {:?} {} takes",
                    e.name,
                    t.data().len(),
                    e.shape,
                    e.dtype
                )));
            }
            let bytes = t.data().to_vec();
            match (dtype, <[usize; 2]>::try_from(e.shape.as_slice())) {
                (GgmlDType::F32, _) => {
                    let shape = e.shape;
                    float_tensors.insert(
                        e.name,
                        RawTensor {
                            dtype,
                            shape,
                            bytes,
                        },
                    );
                }
                (_, Ok(shape)) => {
                    tensors.insert(
                        e.name,
                        QuantizedMatrix {
                            dtype,
                            shape,
                            bytes,
                        },
                    );
                }
                (_, Err(_)) => {
                    return Err(bad(format!(
                        "tensor {}: 4-bit blocks of shape {:?}, not a matrix",
                        e.name, e.shape
                    )))
                }
            }
        }
        Ok(Some(GptqCalibration {
            tensors,
            float_tensors,
            reports: meta.reports,
            calibration_tokens: meta.calibration_tokens,
            settings: meta.settings,
        }))
    }
}

#[cfg(test)]
mod tests {
    use rand::{rngs::StdRng, Rng, SeedableRng};
    use switchyard_weights::{Architecture, SyntheticSource};

    use super::*;

    fn gaussian(rng: &mut StdRng, n: usize) -> Vec<f32> {
        // Box-Muller, so the test needs no distribution crate.
        (0..n)
            .map(|_| {
                let (u, v): (f64, f64) = (rng.random::<f64>().max(1e-12), rng.random());
                ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
            })
            .collect()
    }

    /// Calibration inputs `[n, cols]` with correlated channels and a few loud ones (as real
    /// activations have), and their Hessian `XᵀX`.
    fn inputs(rng: &mut StdRng, n: usize, cols: usize) -> (Vec<f32>, Vec<f64>) {
        let z = gaussian(rng, n * cols);
        let mix = gaussian(rng, cols * cols);
        let mut x = vec![0.0f32; n * cols];
        for r in 0..n {
            for c in 0..cols {
                // Each channel is itself plus a little of its 8 neighbours.
                let mut v = z[r * cols + c];
                for k in 1..=8 {
                    v += 0.3 * mix[c * cols + (c + k) % cols] * z[r * cols + (c + k) % cols];
                }
                let loud = if c % 37 == 0 { 8.0 } else { 1.0 };
                x[r * cols + c] = v * loud;
            }
        }
        let mut h = vec![0.0f64; cols * cols];
        for r in 0..n {
            let row = &x[r * cols..(r + 1) * cols];
            for i in 0..cols {
                for j in 0..cols {
                    h[i * cols + j] += f64::from(row[i]) * f64::from(row[j]);
                }
            }
        }
        (x, h)
    }

    /// GPTQ written the textbook way, in f64: the inverse Hessian by Gauss-Jordan elimination,
    /// each quantized column's error spread with the current inverse's row, then that column
    /// removed from the inverse (the OBS update), no Cholesky, no lazy blocks; Q4_0 grids by
    /// ggml's rule (the signed value of largest magnitude is -8 steps), in `order`, with the
    /// grids taken from the original weights under act-order, or with `dynamic_groups` (and
    /// always in column order) from the weights when the block's first column is visited.
    fn reference(
        w: &[f32],
        rows: usize,
        cols: usize,
        h: &[f64],
        settings: &GptqSettings,
        order: &[usize],
    ) -> Vec<f32> {
        let (damp, per_channel) = (settings.damp, settings.damp_per_channel);
        let static_grids = settings.act_order && !settings.dynamic_groups;
        let mut h = h.to_vec();
        let mut w: Vec<f64> = w.iter().map(|&v| f64::from(v)).collect();
        let mean = (0..cols).map(|i| h[i * cols + i]).sum::<f64>() / cols as f64;
        for i in 0..cols {
            let scale = if per_channel { h[i * cols + i] } else { mean };
            h[i * cols + i] += damp * scale;
        }
        // Gauss-Jordan on [H | I].
        let mut a = h.clone();
        let mut inv = vec![0.0f64; cols * cols];
        for i in 0..cols {
            inv[i * cols + i] = 1.0;
        }
        for p in 0..cols {
            let d = a[p * cols + p];
            for j in 0..cols {
                a[p * cols + j] /= d;
                inv[p * cols + j] /= d;
            }
            for r in 0..cols {
                if r != p {
                    let f = a[r * cols + p];
                    for j in 0..cols {
                        a[r * cols + j] -= f * a[p * cols + j];
                        inv[r * cols + j] -= f * inv[p * cols + j];
                    }
                }
            }
        }
        let grid_of = |w: &[f64], r: usize, b: usize| -> f64 {
            let block = &w[r * cols + b * 32..r * cols + b * 32 + 32];
            let max = block
                .iter()
                .copied()
                .fold(0.0f64, |m, v| if v.abs() > m.abs() { v } else { m });
            f64::from(half::f16::from_f64(max / -8.0).to_f32())
        };
        let mut grids = vec![0.0f64; rows * cols / 32];
        if static_grids {
            for r in 0..rows {
                for b in 0..cols / 32 {
                    grids[r * cols / 32 + b] = grid_of(&w, r, b);
                }
            }
        }
        let mut out = vec![0.0f32; rows * cols];
        let mut done = vec![false; cols];
        for &i in order {
            if !static_grids && (i / 32 * 32..i / 32 * 32 + 32).all(|j| !done[j]) {
                for r in 0..rows {
                    grids[r * cols / 32 + i / 32] = grid_of(&w, r, i / 32);
                }
            }
            let hii = inv[i * cols + i];
            for r in 0..rows {
                let d = grids[r * cols / 32 + i / 32];
                let q = if d == 0.0 {
                    0.0
                } else {
                    (w[r * cols + i] / d + 8.0).round().clamp(0.0, 15.0)
                };
                let value = d * (q - 8.0);
                out[r * cols + i] = value as f32;
                let err = (w[r * cols + i] - value) / hii;
                for j in 0..cols {
                    if !done[j] && j != i {
                        w[r * cols + j] -= err * inv[i * cols + j];
                    }
                }
            }
            done[i] = true;
            // Remove column i: Hinv -= Hinv[:, i] Hinv[i, :] / Hinv[i, i].
            let col: Vec<f64> = (0..cols).map(|r| inv[r * cols + i]).collect();
            let row: Vec<f64> = (0..cols).map(|j| inv[i * cols + j]).collect();
            for r in 0..cols {
                for j in 0..cols {
                    inv[r * cols + j] -= col[r] * row[j] / hii;
                }
            }
        }
        out
    }

    fn rtn(w: &[f32], rows: usize, cols: usize, dtype: GgmlDType) -> Vec<f32> {
        let t = Tensor::from_slice(w, (rows, cols), &Device::Cpu).unwrap();
        QTensor::quantize(&t, dtype)
            .unwrap()
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    #[test]
    fn inverse_cholesky_factor_gives_the_inverse() {
        let mut rng = StdRng::seed_from_u64(3);
        let n = 48;
        let (_, h) = inputs(&mut rng, 200, n);
        let hm = Mat::<f64>::from_fn(n, n, |i, j| h[i * n + j]);
        let u = inverse_cholesky_upper(hm.as_ref()).unwrap();
        for i in 0..n {
            for j in 0..i {
                assert_eq!(u[(i, j)], 0.0, "U is upper triangular");
            }
        }
        // Uᵀ U H = I.
        let p = u.transpose() * &u * &hm;
        let mut worst = 0.0f64;
        for i in 0..n {
            for j in 0..n {
                let want = if i == j { 1.0 } else { 0.0 };
                worst = worst.max((p[(i, j)] - want).abs());
            }
        }
        assert!(worst < 1e-8, "max |UᵀUH - I| = {worst:e}");
    }

    #[test]
    fn gptq_equals_the_textbook_update_and_beats_round_to_nearest() {
        let mut rng = StdRng::seed_from_u64(7);
        let (rows, cols) = (16, 128);
        let (_, h) = inputs(&mut rng, 512, cols);
        let w = gaussian(&mut rng, rows * cols);
        // (act-order, per-channel dampening, dynamic groups); one lazy block holds all 128
        // columns, so act-order's grids at first visit see every update the textbook's do.
        for (act_order, damp_per_channel, dynamic_groups) in [
            (false, true, false),
            (true, true, false),
            (true, false, false),
            (true, false, true),
        ] {
            let settings = GptqSettings {
                act_order,
                damp_per_channel,
                dynamic_groups,
                grid_search: false,
                ..GptqSettings::default()
            };
            let q = quantize_matrix(&w, rows, cols, &h, GgmlDType::Q4_0, &settings).unwrap();
            let got = q.dequantize().unwrap();
            let mut order: Vec<usize> = (0..cols).collect();
            if act_order {
                order.sort_by(|&a, &b| h[b * cols + b].total_cmp(&h[a * cols + a]));
            }
            let want = reference(&w, rows, cols, &h, &settings, &order);
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                worst < 1e-5,
                "act_order {act_order}, dynamic {dynamic_groups}: max |Δ| {worst:e}"
            );

            let (e_rtn, e_gptq) = (
                reconstruction_error(&w, &rtn(&w, rows, cols, GgmlDType::Q4_0), rows, cols, &h),
                reconstruction_error(&w, &got, rows, cols, &h),
            );
            eprintln!(
                "Q4_0 act_order {act_order}, dynamic {dynamic_groups}: rtn {e_rtn:.4e} gptq {e_gptq:.4e}"
            );
            assert!(
                e_gptq < 0.8 * e_rtn,
                "GPTQ cuts the output error by over 20%: {e_gptq:e} vs {e_rtn:e}"
            );
        }
    }

    /// The searched Q4_0 scales lower the weighted error of plain rounding and of GPTQ.
    #[test]
    fn searched_q4_0_scales_beat_ggml_rule() {
        let mut rng = StdRng::seed_from_u64(13);
        let (rows, cols) = (16, 128);
        let (_, h) = inputs(&mut rng, 512, cols);
        let w = gaussian(&mut rng, rows * cols);
        let diag: Vec<f64> = (0..cols).map(|i| h[i * cols + i]).collect();
        let weighted = |deq: &[f32]| -> f64 {
            (0..rows * cols)
                .map(|i| diag[i % cols] * f64::from(w[i] - deq[i]).powi(2))
                .sum()
        };
        let rule = rtn(&w, rows, cols, GgmlDType::Q4_0);
        let mut searched = vec![0.0f32; rows * cols];
        for r in 0..rows {
            for b in 0..cols / 32 {
                let x = &w[r * cols + b * 32..r * cols + b * 32 + 32];
                let d = q4_0_scale(x, &diag[b * 32..b * 32 + 32]);
                for (e, &v) in x.iter().enumerate() {
                    let q = (v / d + 8.0).round().clamp(0.0, 15.0) - 8.0;
                    searched[r * cols + b * 32 + e] = d * q;
                }
            }
        }
        let (e_rule, e_searched) = (weighted(&rule), weighted(&searched));
        eprintln!("weighted rounding error: ggml rule {e_rule:.4e}, searched {e_searched:.4e}");
        assert!(e_searched < 0.85 * e_rule, "{e_searched:e} vs {e_rule:e}");

        let gptq = |grid_search| {
            let settings = GptqSettings {
                grid_search,
                ..GptqSettings::default()
            };
            let q = quantize_matrix(&w, rows, cols, &h, GgmlDType::Q4_0, &settings).unwrap();
            reconstruction_error(&w, &q.dequantize().unwrap(), rows, cols, &h)
        };
        let (plain, searched) = (gptq(false), gptq(true));
        eprintln!("GPTQ output error: ggml grids {plain:.4e}, searched grids {searched:.4e}");
        assert!(searched < plain, "{searched:e} vs {plain:e}");
    }

    #[test]
    fn gptq_in_q4_k_blocks_beats_round_to_nearest() {
        let mut rng = StdRng::seed_from_u64(11);
        let (rows, cols) = (32, 512);
        let (_, h) = inputs(&mut rng, 1024, cols);
        let w = gaussian(&mut rng, rows * cols);
        let e_rtn = reconstruction_error(&w, &rtn(&w, rows, cols, GgmlDType::Q4K), rows, cols, &h);
        for act_order in [false, true] {
            let settings = GptqSettings {
                act_order,
                ..GptqSettings::default()
            };
            let q = quantize_matrix(&w, rows, cols, &h, GgmlDType::Q4K, &settings).unwrap();
            assert_eq!(q.bytes.len(), rows * 2 * 144);
            let e = reconstruction_error(&w, &q.dequantize().unwrap(), rows, cols, &h);
            eprintln!("Q4_K act_order {act_order}: rtn {e_rtn:.4e} gptq {e:.4e}");
            assert!(e < 0.8 * e_rtn, "{e:e} vs {e_rtn:e}");
        }
    }

    #[test]
    fn rows_far_above_the_median_norm_are_left_out() {
        let mut v = vec![1.0f32; 5 * 4];
        v[8..12].copy_from_slice(&[30.0, 0.0, 0.0, 0.0]); // norm 30 against a median of 2
        v[12..16].copy_from_slice(&[20.0, 0.0, 0.0, 0.0]); // norm 20: kept at ratio 10
        let x = Tensor::from_vec(v, (5, 4), &Device::Cpu).unwrap();
        let (kept, dropped) = typical_rows(&x, 10.0).unwrap();
        assert_eq!((kept.dims2().unwrap(), dropped), ((4, 4), 1));
        assert_eq!(kept.to_vec2::<f32>().unwrap()[2], vec![20.0, 0.0, 0.0, 0.0]);
        let (all, none) = typical_rows(&x, 0.0).unwrap();
        assert_eq!((all.dims2().unwrap(), none), ((5, 4), 0));
    }

    #[test]
    fn shapes_that_do_not_fit_the_blocks_are_refused() {
        let s = GptqSettings::default();
        let err = quantize_matrix(&[0.0; 48], 2, 24, &[0.0; 576], GgmlDType::Q4_0, &s)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "GPTQ: a 2x24 matrix (48 values) with a 576-value Hessian does not fit Q4_0 blocks of 32"
        );
        let err = quantize_matrix(&[0.0; 64], 2, 32, &[0.0; 1024], GgmlDType::Q8_0, &s)
            .unwrap_err()
            .to_string();
        assert_eq!(err, "GPTQ writes Q4_0 or Q4_K blocks, not Q8_0");
    }

    /// The tiny synthetic Qwen2 model (f32) and 4 random documents of 48 tokens.
    fn tiny_model_and_docs(seed: u64) -> (Arc<dyn WeightSource>, Vec<Vec<u32>>) {
        let spec = SyntheticSource::tiny_spec(Architecture::Qwen2);
        let src: Arc<dyn WeightSource> =
            Arc::new(SyntheticSource::new(spec, 5, GgmlDType::F32).unwrap());
        let mut rng = StdRng::seed_from_u64(seed);
        let docs = (0..4)
            .map(|_| (0..48).map(|_| rng.random_range(0..256u32)).collect())
            .collect();
        (src, docs)
    }

    /// A whole (synthetic) model: every matrix of every layer is replaced, each GPTQ error is
    /// below round-to-nearest's on the calibration inputs, the model loads the blocks as they
    /// are, and the cache gives back the same bytes.
    #[test]
    fn calibrates_a_model_and_round_trips_through_the_cache() {
        let (src, docs) = tiny_model_and_docs(1);
        // Four documents, all fitted (no selection documents, so one order).
        let settings = GptqSettings {
            docs: 4,
            doc_tokens: 48,
            choose_order: false,
            ..GptqSettings::default()
        };
        let mut layers = Vec::new();
        let cal = calibrate(
            Arc::clone(&src),
            &docs,
            QuantTarget::Q4,
            &settings,
            |d, n| layers.push((d, n)),
        )
        .unwrap();
        assert_eq!(layers, vec![(1, 4), (2, 4), (3, 4), (4, 4)]);
        assert_eq!(cal.tensors.len(), 4 * 7);
        assert_eq!(cal.calibration_tokens, 4 * 48);
        for r in &cal.reports {
            assert!(r.error_gptq < r.error_rtn, "{r:?}");
        }
        let (e_rtn, e_gptq) = cal.total_error();
        assert!(e_gptq < 0.8 * e_rtn, "{e_gptq:e} vs {e_rtn:e}");

        // Served as stored: the loaded model holds exactly the calibration's blocks.
        let gptq_src = gptq_source(Arc::clone(&src), &cal);
        let name = names::layer(2, "ffn_down.weight");
        let loaded = gptq_src.load(&name, &Device::Cpu).unwrap();
        assert_eq!(loaded.dtype(), GgmlDType::Q4_0);
        assert_eq!(
            loaded.data().unwrap().as_ref(),
            cal.tensors[&name].bytes.as_slice()
        );
        let model = crate::precision::load(
            Arc::clone(&src),
            switchyard_request::Precision::Q4Gptq,
            crate::precision::Calibrations {
                awq: None,
                gptq: Some(&cal),
            },
        )
        .unwrap();
        let q4 = crate::precision::load(
            Arc::clone(&src),
            switchyard_request::Precision::Q4,
            Default::default(),
        )
        .unwrap();
        assert_eq!(
            model.resident_bytes().total(),
            q4.resident_bytes().total(),
            "the same block types as q4"
        );

        let dir = tempfile::tempdir().unwrap();
        let path = cache::path(dir.path(), "ab".repeat(32).as_str(), &settings);
        assert!(cache::load(&path, &"ab".repeat(32), &settings)
            .unwrap()
            .is_none());
        cache::save(&path, &"ab".repeat(32), &cal).unwrap();
        let back = cache::load(&path, &"ab".repeat(32), &settings)
            .unwrap()
            .unwrap();
        assert_eq!(back.tensors.len(), cal.tensors.len());
        for (k, v) in &cal.tensors {
            assert_eq!(back.tensors[k].bytes, v.bytes);
            assert_eq!(back.tensors[k].shape, v.shape);
        }
        // JSON keeps the errors to within the last digit.
        assert_eq!(back.reports.len(), cal.reports.len());
        for (a, b) in back.reports.iter().zip(&cal.reports) {
            assert_eq!(a.name, b.name);
            assert!((a.error_gptq - b.error_gptq).abs() <= 1e-12 * b.error_gptq);
        }
        // Other settings key another file; a file made for other settings is refused.
        let other = GptqSettings {
            act_order: false,
            ..settings
        };
        assert_ne!(cache::path(dir.path(), &"ab".repeat(32), &other), path);
        let err = cache::load(&path, &"ab".repeat(32), &other).unwrap_err();
        assert!(err.to_string().contains("not format 2 from"), "{err}");
        // A truncated file is an error, not a panic.
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        assert!(cache::load(&path, &"ab".repeat(32), &settings).is_err());
    }

    /// True sequential changes a group's Hessian only once a group before it in the layer is
    /// quantized; choosing the order keeps, per matrix, the order with the lower error on the
    /// selection documents, whose tokens fit no Hessian.
    #[test]
    fn true_sequential_and_chosen_orders_on_a_model() {
        let (src, mut docs) = tiny_model_and_docs(3);
        let mut rng = StdRng::seed_from_u64(4);
        docs.extend((0..2).map(|_| (0..48).map(|_| rng.random_range(0..256u32)).collect()));
        let base = GptqSettings {
            docs: 4,
            doc_tokens: 48,
            true_sequential: false,
            choose_order: false,
            ..GptqSettings::default()
        };
        let run = |s: &GptqSettings, docs: &[Vec<u32>]| {
            calibrate(Arc::clone(&src), docs, QuantTarget::Q4, s, |_, _| {}).unwrap()
        };
        let report = |c: &GptqCalibration, name: &str| {
            c.reports.iter().find(|r| r.name == name).cloned().unwrap()
        };
        let plain = run(&base, &docs[..4]);
        let seq = run(
            &GptqSettings {
                true_sequential: true,
                ..base
            },
            &docs[..4],
        );
        let (q0, o0) = (
            names::layer(0, "attn_q.weight"),
            names::layer(0, "attn_output.weight"),
        );
        assert_eq!(seq.tensors[&q0].bytes, plain.tensors[&q0].bytes);
        assert_eq!(report(&seq, &q0).error_rtn, report(&plain, &q0).error_rtn);
        // The attention output's inputs now come through the 4-bit q/k/v.
        let (a, b) = (report(&seq, &o0).error_rtn, report(&plain, &o0).error_rtn);
        assert!((a - b).abs() > 1e-6 * b, "{a} vs {b}");
        for r in &seq.reports {
            assert!(r.error_gptq < r.error_rtn, "{r:?}");
            assert_eq!((r.act_order, r.selection_error), (true, None));
        }

        let choose = GptqSettings {
            choose_order: true,
            select_docs: 2,
            ..base
        };
        assert_eq!(choose.documents(), 6);
        let chosen = run(&choose, &docs);
        assert_eq!(
            chosen.calibration_tokens,
            4 * 48,
            "selection tokens fit nothing"
        );
        let mut kept = [0, 0];
        for r in &chosen.reports {
            let [ea, ec] = r.selection_error.unwrap();
            assert!(ea.is_finite() && ec.is_finite() && ea != ec, "{r:?}");
            assert_eq!(r.act_order, ea < ec, "{r:?}");
            kept[usize::from(r.act_order)] += 1;
        }
        eprintln!("column order kept on {}, act-order on {}", kept[0], kept[1]);
        // The first group of the first layer sees the same inputs either way: its blocks are
        // the fixed-order result of the order kept.
        let fixed = |act_order| run(&GptqSettings { act_order, ..base }, &docs[..4]);
        let kept_q0 = fixed(report(&chosen, &q0).act_order);
        assert_eq!(chosen.tensors[&q0].bytes, kept_q0.tensors[&q0].bytes);
        assert_eq!(
            report(&chosen, &q0).error_gptq,
            report(&kept_q0, &q0).error_gptq
        );

        let err = calibrate(
            Arc::clone(&src),
            &docs[..2],
            QuantTarget::Q4,
            &choose,
            |_, _| {},
        )
        .map(|_| ())
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "GPTQ with choose_order needs documents to fit and 2 to choose on; 2 given"
        );
    }

    #[test]
    fn gptq_on_awq_scales_serves_the_scaled_norms_and_round_trips() {
        let (src, docs) = tiny_model_and_docs(2);
        let settings = GptqSettings {
            docs: 4,
            doc_tokens: 48,
            awq_scales: true,
            choose_order: false,
            ..GptqSettings::default()
        };
        let awq =
            crate::awq::calibrate(Arc::clone(&src), &docs, QuantTarget::Q4, |_, _| {}).unwrap();
        let cal = calibrate_on_awq(
            Arc::clone(&src),
            &awq,
            &docs,
            QuantTarget::Q4,
            &settings,
            |_, _| {},
        )
        .unwrap();
        // Every matrix is GPTQ's; every other scaled tensor (the norms) is kept as f32.
        assert_eq!(cal.tensors.len(), 4 * 7);
        let floats: std::collections::BTreeSet<&String> = cal.float_tensors.keys().collect();
        let want: std::collections::BTreeSet<&String> = awq
            .tensors
            .keys()
            .filter(|k| !cal.tensors.contains_key(*k))
            .collect();
        assert_eq!(floats, want);
        assert!(!floats.is_empty(), "the scales fold into some norms");
        for (name, t) in &cal.float_tensors {
            assert_eq!(t.dtype, GgmlDType::F32);
            let expect: Vec<f32> = awq.tensors[name].flatten_all().unwrap().to_vec1().unwrap();
            let got = gptq_source(Arc::clone(&src), &cal)
                .load(name, &Device::Cpu)
                .unwrap()
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            assert_eq!(got, expect, "{name} served as AWQ scaled it");
        }
        // GPTQ still beats round-to-nearest of the scaled matrices.
        let (e_rtn, e_gptq) = cal.total_error();
        assert!(e_gptq < 0.8 * e_rtn, "{e_gptq:e} vs {e_rtn:e}");
        // The float tensors go through the cache with the blocks.
        let dir = tempfile::tempdir().unwrap();
        let path = cache::path(dir.path(), &"cd".repeat(32), &settings);
        cache::save(&path, &"cd".repeat(32), &cal).unwrap();
        let back = cache::load(&path, &"cd".repeat(32), &settings)
            .unwrap()
            .unwrap();
        assert_eq!(back.float_tensors.len(), cal.float_tensors.len());
        for (k, v) in &cal.float_tensors {
            assert_eq!(back.float_tensors[k].bytes, v.bytes);
            assert_eq!(back.float_tensors[k].shape, v.shape);
        }
        assert_eq!(back.tensors.len(), cal.tensors.len());
        // Without the scales the settings key another file.
        let plain = GptqSettings {
            awq_scales: false,
            ..settings
        };
        assert_ne!(cache::path(dir.path(), &"cd".repeat(32), &plain), path);
    }
}
