//! Exit heads: what turns the hidden state after layers `0..d` into logits, and
//! [`ExitHeads::logits`], the seam the decoder, the study and the scheduler call.
//!
//! A head maps the hidden state at its depth into the final layer's hidden space; the model's
//! own final norm and LM head finish the job, so a head is small (`d_model²` at most for the
//! affine kind) and the vocabulary projection is shared with the full-depth path.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};
use switchyard_models::LayeredModel;

use crate::block::{BlockConfig, BlockHead, BlockKv};
use crate::{ExitsError, Result};

/// `y = A x + b`, `A` row-major `[d_out][d_in]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Affine {
    pub d_in: usize,
    pub d_out: usize,
    pub weight: Vec<f64>,
    pub bias: Vec<f64>,
    /// The relative `λ` it was solved with.
    pub lambda_rel: f64,
}

impl Affine {
    pub fn apply(&self, x: &[f64]) -> Vec<f64> {
        (0..self.d_out)
            .map(|i| {
                let row = &self.weight[i * self.d_in..(i + 1) * self.d_in];
                row.iter().zip(x).map(|(a, b)| a * b).sum::<f64>() + self.bias[i]
            })
            .collect()
    }
}

/// What a head computes before the final norm. Stored in the heads file as a lowercase string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HeadKind {
    /// The hidden state as it is: the logit lens.
    Identity,
    /// `A h + b`: the tuned lens (ridge regression) or an affine head trained by `ee-tune`.
    Affine,
    /// `A h + b + W₂ silu(W₁ rms(h) + b₁)`: an affine map plus a residual MLP, trained by
    /// `ee-tune` from the ridge solution (the MLP's output starts at zero).
    Mlp,
    /// One transformer layer with its own K/V per sequence ([`crate::block`]), trained by
    /// `ee-tune` from a copy of the model's last layer.
    Block,
}

impl HeadKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Identity => "identity",
            Self::Affine => "affine",
            Self::Mlp => "mlp",
            Self::Block => "block",
        }
    }
}

/// One exit's head.
#[derive(Debug, Clone)]
pub enum ExitHead {
    Identity,
    Affine {
        /// `Aᵀ`, `[d_model, d_model]` f32, so that rows translate as `h · Aᵀ + b`.
        weight_t: Tensor,
        /// `[d_model]` f32.
        bias: Tensor,
    },
    Mlp {
        /// The affine part, as in [`ExitHead::Affine`].
        weight_t: Tensor,
        bias: Tensor,
        /// `W₁ᵀ`, `[d_model, hidden]` f32.
        w1_t: Tensor,
        /// `[hidden]` f32.
        b1: Tensor,
        /// `W₂ᵀ`, `[hidden, d_model]` f32.
        w2_t: Tensor,
    },
    /// A transformer layer; it attends over its sequence, so it is run through
    /// [`ExitHead::translate_seq`] with the sequence's [`BlockKv`].
    Block(Box<BlockHead>),
}

/// Epsilon of the parameter-free RMS norm at the input of an MLP head's hidden layer.
pub const MLP_NORM_EPS: f64 = 1e-6;

/// Parameter-free RMS normalisation over the last dimension, written with differentiable
/// tensor operations (the MLP head's input, in serving and in training alike).
pub fn rms(x: &Tensor) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(candle_core::D::Minus1)?;
    x.broadcast_div(&(ms + MLP_NORM_EPS)?.sqrt()?)
}

impl ExitHead {
    pub fn kind(&self) -> HeadKind {
        match self {
            Self::Identity => HeadKind::Identity,
            Self::Affine { .. } => HeadKind::Affine,
            Self::Mlp { .. } => HeadKind::Mlp,
            Self::Block(_) => HeadKind::Block,
        }
    }

    /// Whether the head attends over its sequence (and so needs a [`BlockKv`] per sequence).
    pub fn is_sequential(&self) -> bool {
        matches!(self, Self::Block(_))
    }

    /// An affine head from a ridge solution (rounded to f32).
    pub fn from_affine(a: &Affine, device: &candle_core::Device) -> Result<Self> {
        let w: Vec<f32> = a.weight.iter().map(|&v| v as f32).collect();
        let b: Vec<f32> = a.bias.iter().map(|&v| v as f32).collect();
        let weight = Tensor::from_vec(w, (a.d_out, a.d_in), device)?;
        Ok(Self::Affine {
            weight_t: weight.t()?.contiguous()?,
            bias: Tensor::from_vec(b, a.d_out, device)?,
        })
    }

    /// Bytes of weights the head keeps beyond the model's own.
    pub fn bytes(&self) -> usize {
        self.tensors()
            .iter()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }

    /// The head's parameters: none, `[Aᵀ, b]`, `[Aᵀ, b, W₁ᵀ, b₁, W₂ᵀ]`, or a block's in
    /// [`crate::block::PARTS`] order.
    pub fn tensors(&self) -> Vec<&Tensor> {
        match self {
            Self::Identity => Vec::new(),
            Self::Affine { weight_t, bias } => vec![weight_t, bias],
            Self::Mlp {
                weight_t,
                bias,
                w1_t,
                b1,
                w2_t,
            } => vec![weight_t, bias, w1_t, b1, w2_t],
            Self::Block(b) => b.params.iter().collect(),
        }
    }

    /// Hidden rows `[rows, d_model]` of one sequence at positions `start..`, mapped into the
    /// final layer's hidden space. A block head attends over the positions before them, held
    /// by `kv`, which the rows then join; row-wise heads ignore `start` and `kv`.
    pub fn translate_seq(
        &self,
        hidden: &Tensor,
        start: usize,
        kv: Option<&mut BlockKv>,
    ) -> Result<Tensor> {
        match self {
            Self::Block(b) => b.forward(hidden, start, kv),
            _ => self.translate(hidden),
        }
    }

    /// Appends the K/V of rows `hidden` (positions `start..`) to a block head's `kv` without
    /// running the rest of it; nothing for row-wise heads.
    pub fn write_kv(&self, hidden: &Tensor, start: usize, kv: &mut BlockKv) -> Result<()> {
        match self {
            Self::Block(b) => b.write_kv(hidden, start, kv),
            _ => Ok(()),
        }
    }

    /// Hidden rows `[rows, d_model]` mapped into the final layer's hidden space, each row on
    /// its own. A block head refuses: it needs its sequence ([`ExitHead::translate_seq`]).
    pub fn translate(&self, hidden: &Tensor) -> Result<Tensor> {
        match self {
            Self::Identity => Ok(hidden.clone()),
            Self::Affine { weight_t, bias } => {
                let h = hidden.to_dtype(DType::F32)?;
                Ok(h.matmul(weight_t)?.broadcast_add(bias)?)
            }
            Self::Mlp {
                weight_t,
                bias,
                w1_t,
                b1,
                w2_t,
            } => {
                let h = hidden.to_dtype(DType::F32)?;
                let lin = h.matmul(weight_t)?.broadcast_add(bias)?;
                let mid = rms(&h)?.matmul(w1_t)?.broadcast_add(b1)?.silu()?;
                Ok((lin + mid.matmul(w2_t)?)?)
            }
            Self::Block(_) => Err(ExitsError::Invalid(
                "a block exit head attends over its sequence and needs that sequence's K/V; \
                 this path maps rows one by one (use per-token decoding or fixed-depth decoding \
                 with a block head's own K/V)"
                    .into(),
            )),
        }
    }
}

/// Who the heads were made for and how; stored as JSON in the heads file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeadsMeta {
    pub format_version: u32,
    pub model: ModelRef,
    /// One entry per head, by increasing depth.
    pub heads: Vec<HeadInfo>,
    /// Absent for heads not made by `switchyard calibrate` (identity heads, imported heads).
    pub calibration: Option<CalibrationInfo>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelRef {
    /// The name the model was given by (zoo name or path).
    pub name: String,
    /// SHA-256 of the model file (or folder, see [`crate::fingerprint`]).
    pub sha256: String,
    pub bytes: u64,
    pub architecture: String,
    pub n_layers: usize,
    pub d_model: usize,
    pub vocab_size: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeadInfo {
    /// Layers run before the head: the head reads the output of layer `depth - 1`.
    pub depth: usize,
    pub kind: HeadKind,
    /// Relative ridge `λ` (affine heads made by calibration).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lambda_rel: Option<f64>,
    /// Fraction of the final hidden state's variance explained on the λ-validation split.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation_r2: Option<f64>,
    /// The same for the identity map (the logit lens), for comparison.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation_r2_identity: Option<f64>,
    /// A block head's shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block: Option<BlockConfig>,
    /// Held-out figures of a head trained by `ee-tune`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trained: Option<TrainedInfo>,
}

/// How a head was trained (`switchyard ee-tune`) and what it reached on held-out tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainedInfo {
    pub epochs: usize,
    pub tokens: u64,
    pub seed: u64,
    /// Weight of the next-token cross-entropy added to the KL loss.
    pub ce_weight: f64,
    pub held_out_agreement: f64,
    pub held_out_kl_nats: f64,
    /// AUROC of the exit probe's score for "this exit's top-1 equals the final one's".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe_auroc: Option<f64>,
}

/// A CALM-style exit classifier: `σ(w · z + b)` on the exit's translated, final-normed hidden
/// state `z`, the probability that the exit's top-1 token equals the final layer's. It costs
/// `d_model` multiply-adds instead of the vocabulary head's `d_model × vocab`.
#[derive(Debug, Clone)]
pub struct ExitProbe {
    /// `[d_model, 1]` f32.
    pub weight: Tensor,
    /// `[1]` f32.
    pub bias: Tensor,
}

impl ExitProbe {
    /// Probabilities `[rows]` for final-normed rows `[rows, d_model]`.
    pub fn score(&self, normed: &Tensor) -> Result<Tensor> {
        let z = normed.to_dtype(DType::F32)?;
        Ok(sigmoid(&z.matmul(&self.weight)?.broadcast_add(&self.bias)?)?.flatten_all()?)
    }
}

/// `1 / (1 + e^{-x})` from core operations (differentiable).
pub fn sigmoid(x: &Tensor) -> candle_core::Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalibrationInfo {
    /// `sharegpt` or a file path.
    pub corpus: String,
    /// Rows (token positions) the statistics were accumulated over.
    pub tokens: u64,
    pub sequences: usize,
    /// Most tokens taken from one conversation or text chunk.
    pub max_sequence_tokens: usize,
    /// Which documents were held out for evaluation and validation.
    pub held_out: String,
    /// Relative `λ` candidates tried per head.
    pub lambda_candidates: Vec<f64>,
    pub seconds: f64,
    pub created_unix: u64,
}

/// The exit heads of one model, by depth.
#[derive(Debug)]
pub struct ExitHeads {
    meta: HeadsMeta,
    heads: BTreeMap<usize, ExitHead>,
    probes: BTreeMap<usize, ExitProbe>,
    /// Block heads' K/V of the sequences the batching engine serves through these heads, by
    /// request id and depth ([`crate::engine_seam`]).
    pub(crate) served: std::sync::Mutex<std::collections::HashMap<(u64, usize), BlockKv>>,
}

impl Clone for ExitHeads {
    /// The heads and probes; a clone serves no sequences yet.
    fn clone(&self) -> Self {
        Self {
            meta: self.meta.clone(),
            heads: self.heads.clone(),
            probes: self.probes.clone(),
            served: Default::default(),
        }
    }
}

/// Current [`HeadsMeta::format_version`].
pub const FORMAT_VERSION: u32 = 1;

impl ExitHeads {
    /// Heads with their metadata; the metadata's head list is rebuilt from `heads`.
    pub fn new(mut meta: HeadsMeta, heads: BTreeMap<usize, ExitHead>) -> Result<Self> {
        let known: BTreeMap<usize, HeadInfo> = meta.heads.drain(..).map(|h| (h.depth, h)).collect();
        meta.heads = heads
            .iter()
            .map(|(&depth, h)| {
                let mut info = match known.get(&depth) {
                    Some(info) if info.kind == h.kind() => info.clone(),
                    _ => HeadInfo {
                        depth,
                        kind: h.kind(),
                        lambda_rel: None,
                        validation_r2: None,
                        validation_r2_identity: None,
                        block: None,
                        trained: None,
                    },
                };
                info.block = match h {
                    ExitHead::Block(b) => Some(b.cfg.clone()),
                    _ => None,
                };
                info
            })
            .collect();
        let n_layers = meta.model.n_layers;
        if let Some(&depth) = heads.keys().find(|&&d| d == 0 || d >= n_layers) {
            return Err(ExitsError::BadDepth {
                depth,
                max: n_layers.saturating_sub(1),
                n_layers,
            });
        }
        Ok(Self {
            meta,
            heads,
            probes: BTreeMap::new(),
            served: Default::default(),
        })
    }

    /// Adds an exit probe at `depth` (which must have a head).
    pub fn with_probe(mut self, depth: usize, probe: ExitProbe) -> Result<Self> {
        self.head(depth)?;
        self.probes.insert(depth, probe);
        Ok(self)
    }

    /// The exit probe at `depth`, if the file has one.
    pub fn probe(&self, depth: usize) -> Option<&ExitProbe> {
        self.probes.get(&depth)
    }

    /// Identity heads (the logit lens) at `depths` of `model`.
    pub fn logit_lens(model: &LayeredModel, name: &str, depths: &[usize]) -> Result<Self> {
        let heads = depths.iter().map(|&d| (d, ExitHead::Identity)).collect();
        Self::new(
            HeadsMeta {
                format_version: FORMAT_VERSION,
                model: model_ref(model, name, String::new(), 0),
                heads: Vec::new(),
                calibration: None,
            },
            heads,
        )
    }

    pub fn meta(&self) -> &HeadsMeta {
        &self.meta
    }

    /// Depths with a head, increasing.
    pub fn depths(&self) -> Vec<usize> {
        self.heads.keys().copied().collect()
    }

    pub fn head(&self, depth: usize) -> Result<&ExitHead> {
        self.heads.get(&depth).ok_or_else(|| ExitsError::NoHead {
            depth,
            available: self.depths(),
        })
    }

    pub fn iter(&self) -> impl Iterator<Item = (usize, &ExitHead)> {
        self.heads.iter().map(|(&d, h)| (d, h))
    }

    /// Refuses block heads for `user`, which moves sequences between depths: a block head's
    /// K/V hold the positions that passed through it at its own depth only.
    pub fn require_row_wise(&self, user: &str) -> Result<()> {
        let blocks = self.sequential_depths();
        if blocks.is_empty() {
            return Ok(());
        }
        Err(ExitsError::Invalid(format!(
            "{user} moves sequences between depths, and the exit heads at depths {blocks:?} are \
             block heads, whose K/V hold only the positions served at their own depth; use \
             affine or mlp heads"
        )))
    }

    /// Depths whose head attends over its sequence (block heads).
    pub fn sequential_depths(&self) -> Vec<usize> {
        self.iter()
            .filter(|(_, h)| h.is_sequential())
            .map(|(d, _)| d)
            .collect()
    }

    /// Logits `[rows, vocab]` of hidden rows taken after layers `0..depth`: the head, then the
    /// model's final norm and LM head. At `depth == n_layers` this is the model's own output.
    pub fn logits(&self, model: &LayeredModel, depth: usize, hidden: &Tensor) -> Result<Tensor> {
        let _span = tracing::trace_span!("exit_logits", depth).entered();
        Ok(model.lm_head(&self.normed(model, depth, hidden)?)?)
    }

    /// What [`ExitHeads::logits`] sends through the LM head: the head at `depth` (none at
    /// full depth), then the model's final norm.
    pub fn normed(&self, model: &LayeredModel, depth: usize, hidden: &Tensor) -> Result<Tensor> {
        if depth == model.n_layers() {
            return Ok(model.final_norm(hidden)?);
        }
        let h = self.head(depth)?.translate(hidden)?;
        Ok(model.final_norm(&h)?)
    }

    /// Checks that these heads fit `model` (layer count, width, vocabulary).
    pub fn check_fits(&self, model: &LayeredModel) -> std::result::Result<(), String> {
        let m = &self.meta.model;
        let s = model.spec();
        if m.n_layers != s.n_layers || m.d_model != s.d_model || m.vocab_size != s.vocab_size {
            return Err(format!(
                "heads are for {} layers, d_model {}, vocab {}; the model has {}, {}, {}",
                m.n_layers, m.d_model, m.vocab_size, s.n_layers, s.d_model, s.vocab_size
            ));
        }
        Ok(())
    }
}

/// The [`ModelRef`] of a loaded model.
pub fn model_ref(model: &LayeredModel, name: &str, sha256: String, bytes: u64) -> ModelRef {
    let s = model.spec();
    ModelRef {
        name: name.to_string(),
        sha256,
        bytes,
        architecture: s.architecture.as_str().to_string(),
        n_layers: s.n_layers,
        d_model: s.d_model,
        vocab_size: s.vocab_size,
    }
}
