//! Block exit heads: one pre-norm transformer layer (grouped-query attention with rotary
//! embeddings, then a SwiGLU MLP), initialised from a copy of the model's last layer and
//! trained like the other heads: EE-LLM's strongest exit.
//!
//! Unlike the row-wise heads a block attends over its sequence, so it keeps K/V of its own per
//! sequence ([`BlockKv`]). One forward serves both uses: training runs a whole document from
//! position 0 without a cache, tracked by candle's autograd (every operation here has a
//! backward pass: candle-nn's composed softmax, rope written with `narrow`/`cat`); decoding appends the new rows' K/V to the sequence's cache and
//! attends over it. The model's own attention kernel is not reused: it writes f32 slices in
//! place and has no backward pass.

use candle_core::{DType, Device, Tensor, D};
use serde::{Deserialize, Serialize};
use switchyard_models::LayeredModel;
use switchyard_weights::{names, Activation, Architecture, RopeStyle};

use crate::{ExitsError, Result};

/// The shape of a block head, stored with it in the heads file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockConfig {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_dim: usize,
    pub rope_theta: f64,
    pub rope_style: RopeStyle,
    pub norm_eps: f64,
    /// The model layer the block was copied from before training.
    pub init_layer: usize,
}

/// Parameter names, in [`BlockHead::params`] order (also their names in the heads file).
pub const PARTS: [&str; 12] = [
    "attn_norm",
    "q",
    "q_bias",
    "k",
    "k_bias",
    "v",
    "v_bias",
    "o",
    "ffn_norm",
    "gate",
    "up",
    "down",
];
const ATTN_NORM: usize = 0;
const Q: usize = 1;
const K: usize = 3;
const V: usize = 5;
const O: usize = 7;
const FFN_NORM: usize = 8;
const GATE: usize = 9;
const UP: usize = 10;
const DOWN: usize = 11;

/// One block head: its shape and its parameters, f32.
#[derive(Debug, Clone)]
pub struct BlockHead {
    pub cfg: BlockConfig,
    /// In [`PARTS`] order: norm scales `[d_model]`, matrices transposed to `[in, out]` (rows
    /// multiply as `x · W`), biases `[out]` (zero where the model has none).
    pub params: Vec<Tensor>,
}

/// One sequence's K/V of a block head: `[n_kv_heads, positions, head_dim]` each, roped.
#[derive(Debug, Clone, Default)]
pub struct BlockKv {
    k: Option<Tensor>,
    v: Option<Tensor>,
}

impl BlockKv {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.k.as_ref().and_then(|k| k.dim(1).ok()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps the first `len` positions (a rejected speculative draft rolls back).
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len >= self.len() {
            return Ok(());
        }
        if len == 0 {
            *self = Self::default();
            return Ok(());
        }
        for t in [&mut self.k, &mut self.v].into_iter().flatten() {
            *t = t.narrow(1, 0, len)?;
        }
        Ok(())
    }

    /// Appends `k`, `v` (`[n_kv_heads, rows, head_dim]`) and returns the whole cache.
    fn append(&mut self, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
        let k = match self.k.take() {
            Some(old) => Tensor::cat(&[&old, &k], 1)?,
            None => k,
        };
        let v = match self.v.take() {
            Some(old) => Tensor::cat(&[&old, &v], 1)?,
            None => v,
        };
        self.k = Some(k.clone());
        self.v = Some(v.clone());
        Ok((k, v))
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        [&self.k, &self.v]
            .into_iter()
            .flatten()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }
}

impl BlockHead {
    /// A copy of layer `layer` of `model`, dequantized to f32: a block head before training.
    /// Llama and Qwen2 layers only (Gemma 3's extra norms and q/k norms are not modelled).
    pub fn from_model_layer(model: &LayeredModel, layer: usize) -> Result<Self> {
        let spec = model.spec();
        if !matches!(spec.architecture, Architecture::Llama | Architecture::Qwen2) {
            return Err(ExitsError::Invalid(format!(
                "block exit heads copy a llama or qwen2 layer; this model is {}",
                spec.architecture.as_str()
            )));
        }
        if model.config().activation != Activation::Silu {
            return Err(ExitsError::Invalid(
                "block exit heads need a SiLU-gated MLP".into(),
            ));
        }
        if layer >= spec.n_layers {
            return Err(ExitsError::Invalid(format!(
                "layer {layer} is not in a model of {} layers",
                spec.n_layers
            )));
        }
        let dev = model.device();
        let src = model.source();
        let load = |part: &str| -> Result<Tensor> {
            Ok(src
                .load(&names::layer(layer, part), dev)
                .map_err(switchyard_models::ModelError::from)?
                .dequantize(dev)?
                .to_dtype(DType::F32)?)
        };
        let matrix = |part: &str| -> Result<Tensor> { Ok(load(part)?.t()?.contiguous()?) };
        let bias = |part: &str, out: usize| -> Result<Tensor> {
            if src.tensor_meta(&names::layer(layer, part)).is_some() {
                load(part)
            } else {
                Ok(Tensor::zeros(out, DType::F32, dev)?)
            }
        };
        let (hd, nh, nkv) = (spec.head_dim, spec.n_heads, spec.n_kv_heads);
        let gate = matrix("ffn_gate.weight")?;
        let ffn_dim = gate.dim(1)?;
        let params = vec![
            load("attn_norm.weight")?,
            matrix("attn_q.weight")?,
            bias("attn_q.bias", nh * hd)?,
            matrix("attn_k.weight")?,
            bias("attn_k.bias", nkv * hd)?,
            matrix("attn_v.weight")?,
            bias("attn_v.bias", nkv * hd)?,
            matrix("attn_output.weight")?,
            load("ffn_norm.weight")?,
            gate,
            matrix("ffn_up.weight")?,
            matrix("ffn_down.weight")?,
        ];
        let head = Self {
            cfg: BlockConfig {
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
                ffn_dim,
                rope_theta: spec.rope_theta,
                rope_style: spec.rope_style,
                norm_eps: spec.rms_norm_eps,
                init_layer: layer,
            },
            params,
        };
        head.check(spec.d_model)?;
        Ok(head)
    }

    /// A block of width `d` with unit norm scales and other parameters drawn uniformly from
    /// `±scale / √fan_in` by a generator seeded with `seed`: a block trained from scratch.
    pub fn seeded(cfg: BlockConfig, d: usize, scale: f32, seed: u64, dev: &Device) -> Result<Self> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let params = Self::shapes(&cfg, d)
            .iter()
            .enumerate()
            .map(|(i, shape)| {
                if i == ATTN_NORM || i == FFN_NORM {
                    return Ok(Tensor::ones(d, DType::F32, dev)?);
                }
                let n: usize = shape.iter().product();
                let bound = scale / (shape[0] as f32).sqrt();
                let v: Vec<f32> = (0..n).map(|_| rng.random_range(-bound..=bound)).collect();
                Ok(Tensor::from_vec(v, shape.as_slice(), dev)?)
            })
            .collect::<Result<Vec<_>>>()?;
        let head = Self { cfg, params };
        head.check(d)?;
        Ok(head)
    }

    /// The shape of each parameter, in [`PARTS`] order, for a model of width `d`.
    pub fn shapes(cfg: &BlockConfig, d: usize) -> [Vec<usize>; 12] {
        let (q, kv, f) = (
            cfg.n_heads * cfg.head_dim,
            cfg.n_kv_heads * cfg.head_dim,
            cfg.ffn_dim,
        );
        [
            vec![d],
            vec![d, q],
            vec![q],
            vec![d, kv],
            vec![kv],
            vec![d, kv],
            vec![kv],
            vec![q, d],
            vec![d],
            vec![d, f],
            vec![d, f],
            vec![f, d],
        ]
    }

    /// Checks every parameter's shape against the configuration and width `d`.
    pub fn check(&self, d: usize) -> Result<()> {
        let c = &self.cfg;
        if c.n_kv_heads == 0
            || !c.n_heads.is_multiple_of(c.n_kv_heads)
            || !c.head_dim.is_multiple_of(2)
        {
            return Err(ExitsError::Invalid(format!(
                "block head with {} heads, {} K/V heads of width {}",
                c.n_heads, c.n_kv_heads, c.head_dim
            )));
        }
        if self.params.len() != PARTS.len() {
            return Err(ExitsError::Invalid(format!(
                "block head with {} parameters, expected {}",
                self.params.len(),
                PARTS.len()
            )));
        }
        for ((name, want), t) in PARTS.iter().zip(Self::shapes(c, d)).zip(&self.params) {
            if t.dims() != want.as_slice() {
                return Err(ExitsError::Invalid(format!(
                    "block parameter {name} is {:?}, expected {want:?}",
                    t.dims()
                )));
            }
        }
        Ok(())
    }

    fn linear(&self, x: &Tensor, w: usize, bias: bool) -> Result<Tensor> {
        let y = x.matmul(&self.params[w])?;
        Ok(if bias {
            y.broadcast_add(&self.params[w + 1])?
        } else {
            y
        })
    }

    /// Rows `at..at + n` of projected rows `t` as heads `[n_heads, n, head_dim]`, rotated by
    /// the rope tables when given.
    fn heads(
        &self,
        t: &Tensor,
        (at, n): (usize, usize),
        n_heads: usize,
        rope_by: Option<(&Tensor, &Tensor)>,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let t = t.narrow(0, at, n)?.reshape((n, n_heads, c.head_dim))?;
        let t = match rope_by {
            Some((cos, sin)) => rope(&t, cos, sin, c.rope_style)?,
            None => t,
        };
        Ok(t.transpose(0, 1)?.contiguous()?)
    }

    /// Normed, projected and roped K/V of rows `x` at positions `start..`, `[n_kv_heads, rows,
    /// head_dim]` each.
    fn project_kv(&self, x: &Tensor, start: usize) -> Result<(Tensor, Tensor)> {
        let c = &self.cfg;
        let rows = x.dim(0)?;
        let h = rms_norm(x, &self.params[ATTN_NORM], c.norm_eps)?;
        let (cos, sin) = rope_tables(c, start, rows, x.device())?;
        let k = self.linear(&h, K, true)?;
        let v = self.linear(&h, V, true)?;
        Ok((
            self.heads(&k, (0, rows), c.n_kv_heads, Some((&cos, &sin)))?,
            self.heads(&v, (0, rows), c.n_kv_heads, None)?,
        ))
    }

    /// Appends the K/V of rows `x` (positions `start..`) to `kv` without running the rest of
    /// the block: what an exit deeper than a token's own needs from it (K/V propagation).
    pub fn write_kv(&self, x: &Tensor, start: usize, kv: &mut BlockKv) -> Result<()> {
        check_start(kv, start)?;
        let (k, v) = self.project_kv(&x.to_dtype(DType::F32)?, start)?;
        kv.append(k, v)?;
        Ok(())
    }

    /// The block on rows `x` `[rows, d_model]` at positions `start..start + rows`, each
    /// attending to itself, the rows before it, and the positions `0..start` held by `kv`
    /// (whose K/V these rows then join). Without `kv`, `start` must be 0: one whole sequence.
    pub fn forward(&self, x: &Tensor, start: usize, kv: Option<&mut BlockKv>) -> Result<Tensor> {
        let n = x.dim(0)?;
        self.forward_many(x, &mut [SeqRows { n, start, kv }])
    }

    /// The block on the rows of several sequences at once, `x` holding each sequence's rows
    /// one after another in `seqs` order: the projections and the MLP run on all rows in one
    /// product each (as a batched step runs a model layer); attention runs per sequence, on
    /// its own K/V.
    pub fn forward_many(&self, x: &Tensor, seqs: &mut [SeqRows<'_>]) -> Result<Tensor> {
        let c = &self.cfg;
        let x = x.to_dtype(DType::F32)?;
        let h = rms_norm(&x, &self.params[ATTN_NORM], c.norm_eps)?;
        let (q_all, k_all, v_all) = (
            self.linear(&h, Q, true)?,
            self.linear(&h, K, true)?,
            self.linear(&h, V, true)?,
        );
        let group = c.n_heads / c.n_kv_heads;
        let scale = 1.0 / (c.head_dim as f64).sqrt();
        let mut outs = Vec::with_capacity(seqs.len());
        let mut at = 0;
        for s in seqs.iter_mut() {
            let (rows, start) = (s.n, s.start);
            let (cos, sin) = rope_tables(c, start, rows, x.device())?;
            let roped = Some((&cos, &sin));
            let q = self.heads(&q_all, (at, rows), c.n_heads, roped)?;
            let k = self.heads(&k_all, (at, rows), c.n_kv_heads, roped)?;
            let v = self.heads(&v_all, (at, rows), c.n_kv_heads, None)?;
            let (k, v) = match s.kv.as_deref_mut() {
                Some(kv) => {
                    check_start(kv, start)?;
                    kv.append(k, v)?
                }
                None if start == 0 => (k, v),
                None => {
                    return Err(ExitsError::Internal(format!(
                        "a block head at position {start} needs the K/V before it"
                    )))
                }
            };
            let (k, v) = (repeat_kv(&k, group)?, repeat_kv(&v, group)?);
            let len = k.dim(1)?;
            let scores = (q.matmul(&k.t()?.contiguous()?)? * scale)?;
            let scores = if rows > 1 {
                scores.broadcast_add(&causal_mask(rows, len - rows, x.device())?)?
            } else {
                scores
            };
            let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
            outs.push(
                probs
                    .matmul(&v)?
                    .transpose(0, 1)?
                    .contiguous()?
                    .reshape((rows, c.n_heads * c.head_dim))?,
            );
            at += rows;
        }
        if at != x.dim(0)? {
            return Err(ExitsError::Internal(format!(
                "{} rows for sequences of {at} rows",
                x.dim(0)?
            )));
        }
        let attn = if outs.len() == 1 {
            outs.remove(0)
        } else {
            Tensor::cat(&outs, 0)?
        };
        let x = (x + self.linear(&attn, O, false)?)?;
        let h = rms_norm(&x, &self.params[FFN_NORM], c.norm_eps)?;
        let mid = (self.linear(&h, GATE, false)?.silu()? * self.linear(&h, UP, false)?)?;
        Ok((x + self.linear(&mid, DOWN, false)?)?)
    }
}

/// One sequence's rows in [`BlockHead::forward_many`].
pub struct SeqRows<'a> {
    pub n: usize,
    /// Position of the first row.
    pub start: usize,
    /// The K/V of positions `0..start`, which the rows join; `None`: the rows are a whole
    /// sequence (`start` 0) and their K/V are not kept.
    pub kv: Option<&'a mut BlockKv>,
}

fn check_start(kv: &BlockKv, start: usize) -> Result<()> {
    if kv.len() != start {
        return Err(ExitsError::Internal(format!(
            "a block head's K/V holds {} positions; rows start at {start}",
            kv.len()
        )));
    }
    Ok(())
}

/// RMS norm with a scale, in differentiable operations (a block's norms, and the model's
/// final norm in training).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(ms + eps)?.sqrt()?)?
        .broadcast_mul(weight)?)
}

/// cos/sin of `position · θ^(-2i/d)` for positions `start..start + rows`, `[rows, 1, d/2]`,
/// computed in f64 then rounded, as the model's own rope tables are.
fn rope_tables(
    c: &BlockConfig,
    start: usize,
    rows: usize,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let half = c.head_dim / 2;
    let mut cos = Vec::with_capacity(rows * half);
    let mut sin = Vec::with_capacity(rows * half);
    for p in start..start + rows {
        for i in 0..half {
            let a = p as f64 * c.rope_theta.powf(-((2 * i) as f64) / c.head_dim as f64);
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    Ok((
        Tensor::from_vec(cos, (rows, 1, half), dev)?,
        Tensor::from_vec(sin, (rows, 1, half), dev)?,
    ))
}

/// Rotates `x` `[rows, heads, head_dim]` by the tables of [`rope_tables`].
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, style: RopeStyle) -> Result<Tensor> {
    let (rows, heads, hd) = x.dims3()?;
    let half = hd / 2;
    let rot = |a: &Tensor, b: &Tensor| -> Result<(Tensor, Tensor)> {
        let ra = (a.broadcast_mul(cos)? - b.broadcast_mul(sin)?)?;
        let rb = (a.broadcast_mul(sin)? + b.broadcast_mul(cos)?)?;
        Ok((ra, rb))
    };
    Ok(match style {
        RopeStyle::HalfSplit => {
            let (a, b) = rot(&x.narrow(2, 0, half)?, &x.narrow(2, half, half)?)?;
            Tensor::cat(&[a, b], 2)?
        }
        RopeStyle::Interleaved => {
            let pairs = x.reshape((rows, heads, half, 2))?;
            let a = pairs.narrow(3, 0, 1)?.squeeze(3)?;
            let b = pairs.narrow(3, 1, 1)?.squeeze(3)?;
            let (a, b) = rot(&a, &b)?;
            Tensor::stack(&[a, b], 3)?.reshape((rows, heads, hd))?
        }
    })
}

/// K/V heads repeated for their query heads: `[kv, len, hd]` → `[kv · group, len, hd]`,
/// query head `h` reading K/V head `h / group`.
fn repeat_kv(t: &Tensor, group: usize) -> Result<Tensor> {
    if group == 1 {
        return Ok(t.clone());
    }
    let (kv, len, hd) = t.dims3()?;
    Ok(t.unsqueeze(1)?
        .broadcast_as((kv, group, len, hd))?
        .contiguous()?
        .reshape((kv * group, len, hd))?)
}

/// `[rows, past + rows]`: 0 where row `i` may attend (key `j ≤ past + i`), −∞ elsewhere.
fn causal_mask(rows: usize, past: usize, dev: &Device) -> Result<Tensor> {
    let len = past + rows;
    let m: Vec<f32> = (0..rows)
        .flat_map(|i| {
            (0..len).map(move |j| {
                if j <= past + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(m, (rows, len), dev)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn tiny_cfg(style: RopeStyle) -> BlockConfig {
        BlockConfig {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 4,
            ffn_dim: 24,
            rope_theta: 10_000.0,
            rope_style: style,
            norm_eps: 1e-6,
            init_layer: 0,
        }
    }

    fn rows(n: usize, d: usize, seed: u64) -> Tensor {
        let b = BlockHead::seeded(tiny_cfg(RopeStyle::HalfSplit), d, 1.0, seed, &Device::Cpu)
            .expect("block");
        b.params[Q]
            .narrow(1, 0, d)
            .expect("narrow")
            .narrow(0, 0, n.min(d))
            .expect("rows")
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .and_then(|t| t.abs())
            .and_then(|t| t.max_all())
            .and_then(|t| t.to_scalar::<f32>())
            .expect("diff")
    }

    #[test]
    fn decoding_on_the_cache_equals_the_whole_sequence_at_once() -> Result<()> {
        let d = 16;
        for style in [RopeStyle::HalfSplit, RopeStyle::Interleaved] {
            let b = BlockHead::seeded(tiny_cfg(style), d, 1.0, 3, &Device::Cpu)?;
            let x = (rows(7, d, 9) * 4.0)?;
            let whole = b.forward(&x, 0, None)?;
            // Three rows, then one at a time; and K/V written alone for row 3.
            let mut kv = BlockKv::default();
            let mut parts = vec![b.forward(&x.narrow(0, 0, 3)?, 0, Some(&mut kv))?];
            let mut skip = BlockKv::default();
            b.forward(&x.narrow(0, 0, 3)?, 0, Some(&mut skip))?;
            b.write_kv(&x.narrow(0, 3, 1)?, 3, &mut skip)?;
            for p in 3..7 {
                parts.push(b.forward(&x.narrow(0, p, 1)?, p, Some(&mut kv))?);
                if p > 3 {
                    let y = b.forward(&x.narrow(0, p, 1)?, p, Some(&mut skip))?;
                    assert!(max_diff(&y, &whole.narrow(0, p, 1)?) < 1e-5, "{style:?}");
                }
            }
            let steps = Tensor::cat(&parts, 0)?;
            assert!(max_diff(&steps, &whole) < 1e-5, "{style:?}");
            assert_eq!(kv.len(), 7);
            // Rolled back to 5 positions, position 5 again gives the same row.
            kv.truncate(5)?;
            let again = b.forward(&x.narrow(0, 5, 1)?, 5, Some(&mut kv))?;
            assert!(max_diff(&again, &whole.narrow(0, 5, 1)?) < 1e-5);
            // Rows that do not continue the cache are refused.
            assert!(b.forward(&x.narrow(0, 0, 1)?, 2, Some(&mut kv)).is_err());
            assert!(b.forward(&x.narrow(0, 0, 1)?, 2, None).is_err());
            // Causal: the first rows do not see the later ones.
            let short = b.forward(&x.narrow(0, 0, 4)?, 0, None)?;
            assert!(max_diff(&short, &whole.narrow(0, 0, 4)?) < 1e-5);
        }
        Ok(())
    }

    #[test]
    fn several_sequences_at_once_equal_each_on_its_own() -> Result<()> {
        let d = 16;
        let b = BlockHead::seeded(tiny_cfg(RopeStyle::Interleaved), d, 1.0, 5, &Device::Cpu)?;
        let x = (rows(7, d, 11) * 3.0)?;
        // Sequence A: positions 0..3 held, rows 3..5 new; sequence B: a whole sequence of 2;
        // sequence C: positions 0..1 held, one new row.
        let (mut a, mut c) = (BlockKv::default(), BlockKv::default());
        b.forward(&x.narrow(0, 0, 3)?, 0, Some(&mut a))?;
        b.forward(&x.narrow(0, 0, 1)?, 0, Some(&mut c))?;
        let (mut a2, mut c2) = (a.clone(), c.clone());
        let alone = Tensor::cat(
            &[
                b.forward(&x.narrow(0, 3, 2)?, 3, Some(&mut a))?,
                b.forward(&x.narrow(0, 5, 2)?, 0, None)?,
                b.forward(&x.narrow(0, 6, 1)?, 1, Some(&mut c))?,
            ],
            0,
        )?;
        let rows_in = Tensor::cat(
            &[x.narrow(0, 3, 2)?, x.narrow(0, 5, 2)?, x.narrow(0, 6, 1)?],
            0,
        )?;
        let together = b.forward_many(
            &rows_in,
            &mut [
                SeqRows {
                    n: 2,
                    start: 3,
                    kv: Some(&mut a2),
                },
                SeqRows {
                    n: 2,
                    start: 0,
                    kv: None,
                },
                SeqRows {
                    n: 1,
                    start: 1,
                    kv: Some(&mut c2),
                },
            ],
        )?;
        assert!(max_diff(&alone, &together) < 1e-5);
        assert_eq!((a2.len(), c2.len()), (5, 2));
        Ok(())
    }

    #[test]
    fn rope_rotates_pairs_by_position() -> Result<()> {
        // One head of width 4, position 1, θ = 1: angles 1 and 1^(-1/2) = 1 for both pairs.
        let cfg = BlockConfig {
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 4,
            rope_theta: 1.0,
            ..tiny_cfg(RopeStyle::HalfSplit)
        };
        let (cos, sin) = rope_tables(&cfg, 1, 1, &Device::Cpu)?;
        let x = Tensor::from_vec(vec![1f32, 2.0, 3.0, 4.0], (1, 1, 4), &Device::Cpu)?;
        let (c, s) = (1f32.cos(), 1f32.sin());
        let half = rope(&x, &cos, &sin, RopeStyle::HalfSplit)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        // Pairs (x0, x2) and (x1, x3).
        let want = [
            c - 3.0 * s,
            2.0 * c - 4.0 * s,
            s + 3.0 * c,
            2.0 * s + 4.0 * c,
        ];
        for (a, b) in half.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{half:?} vs {want:?}");
        }
        let inter = rope(&x, &cos, &sin, RopeStyle::Interleaved)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        // Pairs (x0, x1) and (x2, x3).
        let want = [
            c - 2.0 * s,
            s + 2.0 * c,
            3.0 * c - 4.0 * s,
            3.0 * s + 4.0 * c,
        ];
        for (a, b) in inter.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{inter:?} vs {want:?}");
        }
        Ok(())
    }
}
