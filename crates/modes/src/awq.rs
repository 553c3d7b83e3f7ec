//! Activation-aware 4-bit weights, in the spirit of AWQ (Lin et al., 2023).
//!
//! A few input channels of each linear layer carry much larger activations than the rest, and
//! the rounding error of their weights is amplified by them. AWQ scales those weight columns
//! up before quantizing (so their relative rounding error shrinks) and divides the activation
//! by the same scale, which leaves the float product unchanged:
//! `W x = (W diag(s)) (x / s)`. The scale is `s_j = mean|x_j|^α`, with `α` searched per layer
//! on calibration activations to minimise the error of the quantized product.
//!
//! Here the division by `s` costs nothing at run time because it is folded into the weight
//! that produces the activation:
//! - q/k/v read the attention norm's output: the norm's weight is divided by `s`;
//! - gate/up read the MLP norm's output: likewise;
//! - down reads `act(gate) * up`: up's rows are divided by `s` (row scaling does not change
//!   up's own block quantization, whose scales are per row block).
//!
//! The attention output projection is left unscaled: its input comes from the value rows
//! shared by several query heads (grouped-query attention), so a fold would tie the scales of
//! whole head groups; plain 4-bit is used for it. The model is calibrated at f32 (the file's
//! exact values); the scaled weights are then served through the same re-quantizing loader as
//! plain `q4`, so the two differ only by the scales.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use switchyard_models::{
    DenseKv, ForwardBatch, LayeredModel, LoadOptions, QuantTarget, WeightFormat,
};
use switchyard_weights::{names, WeightSource};

use crate::overlay::{OverlaySource, RawTensor};
use crate::{ModesError, Result};

/// The exponents tried for `s = mean|x|^α`; 0 is plain quantization, so the search never does
/// worse than `q4` on the calibration rows.
pub const ALPHA_GRID: [f32; 11] = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0];
/// Calibration rows kept per layer input for the search (a strided sample).
pub const SEARCH_ROWS: usize = 256;

/// One group of linear layers that read the same input, and the weight that input comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Group {
    /// q, k, v after the attention norm.
    Qkv,
    /// gate, up after the MLP norm.
    GateUp,
    /// down after `act(gate) * up`.
    Down,
}

impl Group {
    const ALL: [Group; 3] = [Group::Qkv, Group::GateUp, Group::Down];

    fn name(self) -> &'static str {
        match self {
            Group::Qkv => "qkv",
            Group::GateUp => "gate_up",
            Group::Down => "down",
        }
    }

    /// The layers sharing the input (the first one is the tap that observes it).
    fn members(self) -> &'static [&'static str] {
        match self {
            Group::Qkv => &["attn_q.weight", "attn_k.weight", "attn_v.weight"],
            Group::GateUp => &["ffn_gate.weight", "ffn_up.weight"],
            Group::Down => &["ffn_down.weight"],
        }
    }
}

/// What calibration chose for one group of one layer.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct GroupChoice {
    pub layer: usize,
    pub group: &'static str,
    pub alpha: f32,
    /// Squared error of the quantized products on the calibration rows, plain 4-bit.
    pub error_plain: f64,
    /// The same with the chosen scales.
    pub error_scaled: f64,
}

/// Calibration's result: the scaled tensors (by canonical name) and what was chosen.
#[derive(Debug)]
pub struct AwqCalibration {
    pub tensors: HashMap<String, Tensor>,
    pub choices: Vec<GroupChoice>,
    pub calibration_tokens: usize,
}

impl AwqCalibration {
    /// Summed squared product error over all groups, (plain, scaled).
    pub fn total_error(&self) -> (f64, f64) {
        self.choices.iter().fold((0.0, 0.0), |(p, s), c| {
            (p + c.error_plain, s + c.error_scaled)
        })
    }
}

/// Observed inputs of one tapped layer: per-channel sum of |x| and a row sample.
#[derive(Default)]
struct Observed {
    abs_sum: Vec<f64>,
    rows: usize,
    sample: Vec<Vec<f32>>,
}

/// Runs the model (loaded at f32) over `docs` with taps on every group's input, then searches
/// each group's scale exponent. `target` decides the 4-bit type per matrix as serving does.
pub fn calibrate(
    source: Arc<dyn WeightSource>,
    docs: &[Vec<u32>],
    target: QuantTarget,
    mut progress: impl FnMut(usize, usize),
) -> Result<AwqCalibration> {
    let model = LayeredModel::load(
        Arc::clone(&source),
        &LoadOptions {
            layers: None,
            format: WeightFormat::F32,
        },
    )?;
    let n_layers = model.n_layers();
    let tokens: usize = docs.iter().map(Vec::len).sum();
    if tokens == 0 {
        return Err(ModesError::Invalid(
            "AWQ calibration needs at least one token".into(),
        ));
    }
    // Keep every `stride`-th row so that about SEARCH_ROWS rows per layer survive.
    let stride = tokens.div_ceil(SEARCH_ROWS).max(1);
    let observed: Rc<RefCell<HashMap<String, Observed>>> = Rc::default();
    let taps: Vec<String> = (0..n_layers)
        .flat_map(|l| Group::ALL.map(|g| names::layer(l, g.members()[0])))
        .collect();
    let sink = Rc::clone(&observed);
    let mut seen_rows: HashMap<String, usize> = HashMap::new();
    let observer = move |name: &str, x: &Tensor| -> candle_core::Result<()> {
        if !taps.iter().any(|t| t == name) {
            return Ok(());
        }
        let rows = x.flatten_to(x.rank().saturating_sub(2))?.to_vec2::<f32>()?;
        let mut all = sink.borrow_mut();
        let o = all.entry(name.to_string()).or_default();
        let counter = seen_rows.entry(name.to_string()).or_default();
        for r in rows {
            if o.abs_sum.is_empty() {
                o.abs_sum = vec![0.0; r.len()];
            }
            for (s, v) in o.abs_sum.iter_mut().zip(&r) {
                *s += f64::from(v.abs());
            }
            o.rows += 1;
            if (*counter).is_multiple_of(stride) {
                o.sample.push(r);
            }
            *counter += 1;
        }
        Ok(())
    };
    switchyard_kernels::tap::with_tap(observer, || -> Result<()> {
        for doc in docs.iter().filter(|d| !d.is_empty()) {
            let mut kv = DenseKv::new(
                n_layers,
                model.config().spec.n_kv_heads * model.config().spec.head_dim,
            );
            model.forward(doc, &mut ForwardBatch::single(&mut kv, 0, doc.len()))?;
        }
        Ok(())
    })??;
    drop(model);

    let observed = observed.take();
    let mut tensors = HashMap::new();
    let mut choices = Vec::new();
    let device = Device::Cpu;
    let load =
        |name: &str| -> Result<Tensor> { Ok(source.load(name, &device)?.dequantize(&device)?) };
    for l in 0..n_layers {
        let mut s_of = HashMap::new();
        for g in Group::ALL {
            let tap = names::layer(l, g.members()[0]);
            let o = observed.get(&tap).ok_or_else(|| {
                ModesError::Invalid(format!("AWQ calibration never observed the input of {tap}"))
            })?;
            let mean: Vec<f32> = o
                .abs_sum
                .iter()
                .map(|s| (s / o.rows.max(1) as f64) as f32)
                .collect();
            let x = Tensor::new(o.sample.clone(), &device)?;
            let weights: Vec<Tensor> = g
                .members()
                .iter()
                .map(|m| load(&names::layer(l, m)))
                .collect::<Result<_>>()?;
            let (alpha, error_plain, error_scaled, s) = search(&x, &weights, &mean, target)?;
            choices.push(GroupChoice {
                layer: l,
                group: g.name(),
                alpha,
                error_plain,
                error_scaled,
            });
            s_of.insert(g, Tensor::new(s.as_slice(), &device)?);
        }
        let [s_qkv, s_gu, s_down] = Group::ALL.map(|g| s_of.remove(&g));
        let (Some(s_qkv), Some(s_gu), Some(s_down)) = (s_qkv, s_gu, s_down) else {
            return Err(ModesError::Invalid("AWQ: a group has no scales".into()));
        };
        let n = |suffix: &str| names::layer(l, suffix);
        let cols =
            |w: Tensor, s: &Tensor| -> Result<Tensor> { Ok(w.broadcast_mul(&s.unsqueeze(0)?)?) };
        tensors.insert(
            n("attn_norm.weight"),
            load(&n("attn_norm.weight"))?.broadcast_div(&s_qkv)?,
        );
        for m in Group::Qkv.members() {
            tensors.insert(n(m), cols(load(&n(m))?, &s_qkv)?);
        }
        tensors.insert(
            n("ffn_norm.weight"),
            load(&n("ffn_norm.weight"))?.broadcast_div(&s_gu)?,
        );
        tensors.insert(
            n("ffn_gate.weight"),
            cols(load(&n("ffn_gate.weight"))?, &s_gu)?,
        );
        let up = cols(load(&n("ffn_up.weight"))?, &s_gu)?.broadcast_div(&s_down.unsqueeze(1)?)?;
        tensors.insert(n("ffn_up.weight"), up);
        tensors.insert(
            n("ffn_down.weight"),
            cols(load(&n("ffn_down.weight"))?, &s_down)?,
        );
        progress(l + 1, n_layers);
    }
    Ok(AwqCalibration {
        tensors,
        choices,
        calibration_tokens: tokens,
    })
}

/// The 4-bit type serving will use for a matrix with `row_len` columns.
fn q4_type(target: QuantTarget, row_len: usize) -> GgmlDType {
    target.dtype_for(row_len, false)
}

/// Searches `α` for one group: returns (α, plain error, chosen error, scales).
fn search(
    x: &Tensor,
    weights: &[Tensor],
    mean: &[f32],
    target: QuantTarget,
) -> Result<(f32, f64, f64, Vec<f32>)> {
    let device = x.device();
    let reference: Vec<Tensor> = weights
        .iter()
        .map(|w| x.matmul(&w.t()?))
        .collect::<candle_core::Result<_>>()?;
    let mut best: Option<(f32, f64, Vec<f32>)> = None;
    let mut plain = f64::NAN;
    for alpha in ALPHA_GRID {
        let s = scales(mean, alpha);
        let s_t = Tensor::new(s.as_slice(), device)?;
        let xs = x.broadcast_div(&s_t.unsqueeze(0)?)?;
        let mut err = 0.0f64;
        for (w, y) in weights.iter().zip(&reference) {
            let (_, k) = w.dims2()?;
            let q = QTensor::quantize(&w.broadcast_mul(&s_t.unsqueeze(0)?)?, q4_type(target, k))?;
            let wq = q.dequantize(device)?;
            let diff = (xs.matmul(&wq.t()?)? - y)?;
            err += f64::from(diff.sqr()?.sum_all()?.to_scalar::<f32>()?);
        }
        if alpha == 0.0 {
            plain = err;
        }
        if best.as_ref().is_none_or(|(_, e, _)| err < *e) {
            best = Some((alpha, err, s));
        }
    }
    let (alpha, err, s) = best.ok_or_else(|| ModesError::Invalid("empty alpha grid".into()))?;
    Ok((alpha, plain, err, s))
}

/// `s_j = mean_j^α`, normalised by `sqrt(max · min)` as AWQ does so the scales straddle 1.
pub fn scales(mean: &[f32], alpha: f32) -> Vec<f32> {
    let s: Vec<f32> = mean.iter().map(|m| m.max(1e-4).powf(alpha)).collect();
    let (lo, hi) = s
        .iter()
        .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let norm = (lo * hi).sqrt();
    if norm.is_finite() && norm > 0.0 {
        s.iter().map(|v| v / norm).collect()
    } else {
        s
    }
}

/// The model's weights with AWQ's scaled tensors (as f32) in place of the originals.
pub fn scaled_source(
    inner: Arc<dyn WeightSource>,
    calibration: &AwqCalibration,
) -> Result<OverlaySource> {
    let tensors = calibration
        .tensors
        .iter()
        .map(|(k, t)| {
            let q = QTensor::quantize(t, GgmlDType::F32)?;
            let raw = RawTensor {
                dtype: GgmlDType::F32,
                shape: t.dims().to_vec(),
                bytes: q.data()?.into_owned(),
            };
            Ok((k.clone(), raw))
        })
        .collect::<Result<_>>()?;
    Ok(OverlaySource::new(
        inner,
        "activation-aware scales",
        tensors,
    ))
}
