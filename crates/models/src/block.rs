//! The pieces transformer blocks are built from (norm, self-attention, gated MLP) and the
//! [`Block`] trait each architecture implements.

use std::ops::Range;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use switchyard_kernels::fastmath;
use switchyard_kernels::prof::{self, Part};
use switchyard_kernels::QLinear;
use switchyard_weights::{names, Activation, RopeStyle, WeightSource};

use crate::attention::{attend, AttnShape, SeqAttn};
use crate::batch::ForwardBatch;
use crate::rope::RopeTable;
use crate::{ModelError, Result};

/// Everything a block needs besides its weights for one layer of one step.
pub struct LayerCtx<'b, 'a> {
    pub layer: usize,
    pub batch: &'b mut ForwardBatch<'a>,
    pub rope: &'b RopeTable,
    pub shape: AttnShape,
}

/// One transformer layer: hidden `[tokens, d_model]` in, same shape out.
pub trait Block: Send + Sync + std::fmt::Debug {
    fn forward(&self, x: &Tensor, ctx: &mut LayerCtx<'_, '_>) -> Result<Tensor>;
    /// Writes only this layer's K/V for the batch's positions, computed from `x` exactly as
    /// [`Block::forward`] would (attention norm, k/v projections, k norm, rope), with no
    /// attention and no MLP. Used by CALM-style state propagation: a token that exited early
    /// has its exited hidden state projected into the K/V of each layer it skipped.
    fn write_kv(&self, x: &Tensor, ctx: &mut LayerCtx<'_, '_>) -> Result<()>;
    /// Bytes of weights this block keeps resident.
    fn resident_bytes(&self) -> usize;
}

#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    pub fn new(weight: Tensor, eps: f64) -> Self {
        Self {
            weight,
            eps: eps as f32,
        }
    }

    /// Normalises over the last dimension, which must equal the weight's length
    /// ([`fastmath::rms_norm`]).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _t = prof::time(Part::Norm);
        let n = self.weight.elem_count();
        if x.dims().last() != Some(&n) {
            return Err(candle_core::Error::Msg(format!(
                "rms norm of {n} values applied to rows of shape {:?}",
                x.shape()
            ))
            .into());
        }
        let out =
            switchyard_kernels::elementwise([x, &self.weight], x.elem_count(), |[xs, w], out| {
                fastmath::rms_norm(xs, w, self.eps, out)
            })?;
        Ok(Tensor::from_vec(out, x.shape(), x.device())?.to_dtype(x.dtype())?)
    }

    pub fn bytes(&self) -> usize {
        self.weight.elem_count() * self.weight.dtype().size_in_bytes()
    }

    /// The scale vector (f32) and epsilon, for code that re-implements the norm with
    /// differentiable tensor operations (exit-head training).
    pub fn parts(&self) -> (&Tensor, f32) {
        (&self.weight, self.eps)
    }
}

/// How matrix weights are held once loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// In the file's own type (block-quantized types use the quantized kernels).
    #[default]
    AsStored,
    /// Dequantized to dense f32 (exact values of the file, f32 GEMM, no activation rounding).
    F32,
    /// Dequantized to dense f16.
    F16,
    /// Re-quantized from the file's values to another block type (the precision modes).
    Quantized(QuantTarget),
}

/// The block type of a re-quantized weight matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantTarget {
    /// Q8_0 everywhere.
    Q8_0,
    /// 4-bit: Q4_K where the row length is a multiple of 256, else Q4_0. The LM head is held
    /// at Q8_0, as llama.cpp's 4-bit presets keep the output matrix at higher precision
    /// (it decides the token, and 4-bit rows of a large vocabulary cost the most quality).
    Q4,
}

impl QuantTarget {
    /// The ggml type a `[rows, row_len]` matrix gets; `head` for the LM head.
    pub fn dtype_for(self, row_len: usize, head: bool) -> GgmlDType {
        match self {
            QuantTarget::Q4 if !head && row_len.is_multiple_of(GgmlDType::Q4K.block_size()) => {
                GgmlDType::Q4K
            }
            QuantTarget::Q4 if !head => GgmlDType::Q4_0,
            _ => GgmlDType::Q8_0,
        }
    }
}

/// Loads tensors of one source onto one device in one format.
#[derive(Clone, Copy)]
pub struct TensorLoader<'a> {
    pub src: &'a dyn WeightSource,
    pub device: &'a Device,
    pub format: WeightFormat,
}

impl TensorLoader<'_> {
    /// Loads `name` (and `bias`, when the file has it) as a linear layer.
    pub fn linear(&self, name: &str, bias: Option<&str>) -> Result<QLinear> {
        self.linear_as(name, bias, false, None)
    }

    /// Loads `name` as the LM head (which a 4-bit format keeps at 8 bits).
    pub fn head(&self, name: &str) -> Result<QLinear> {
        self.linear_as(name, None, true, None)
    }

    /// Rows `rows` of the LM head `name` (a slice of the vocabulary), held as
    /// [`TensorLoader::head`] holds the whole: the same logits for those rows.
    pub fn head_rows(&self, name: &str, rows: Range<usize>) -> Result<QLinear> {
        self.linear_as(name, None, true, Some(rows))
    }

    fn linear_as(
        &self,
        name: &str,
        bias: Option<&str>,
        head: bool,
        rows: Option<Range<usize>>,
    ) -> Result<QLinear> {
        let w = match rows {
            None => self.src.load(name, self.device)?,
            Some(r) => self.src.load_rows(name, r, self.device)?,
        };
        let b = match bias {
            Some(b) if self.src.tensor_meta(b).is_some() => Some(self.vector(b)?),
            _ => None,
        };
        let linear = match self.format {
            WeightFormat::AsStored => QLinear::new(w, b)?,
            WeightFormat::F32 => QLinear::dense(&w, DType::F32, b)?,
            WeightFormat::F16 => QLinear::dense(&w, DType::F16, b)?,
            WeightFormat::Quantized(target) => {
                let (_, row_len) = w.shape().dims2()?;
                let dtype = target.dtype_for(row_len, head);
                let q = if w.dtype() == dtype {
                    w
                } else {
                    QTensor::quantize(&w.dequantize(self.device)?, dtype)?
                };
                QLinear::new(q, b)?
            }
        };
        Ok(linear.named(name))
    }

    /// A 1-D tensor (norm weight, bias) as f32.
    pub fn vector(&self, name: &str) -> Result<Tensor> {
        Ok(self
            .src
            .load(name, self.device)?
            .dequantize(self.device)?
            .to_dtype(DType::F32)?)
    }

    pub fn norm(&self, name: &str) -> Result<RmsNorm> {
        Ok(RmsNorm::new(
            self.vector(name)?,
            self.src.spec().rms_norm_eps,
        ))
    }
}

/// Grouped-query self-attention with rotary embeddings and optional per-head q/k norms.
#[derive(Debug)]
pub struct SelfAttention {
    pub q: QLinear,
    pub k: QLinear,
    pub v: QLinear,
    pub o: QLinear,
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    pub rope_style: RopeStyle,
}

impl SelfAttention {
    pub fn load(ld: &TensorLoader<'_>, l: usize, qk_norm: bool) -> Result<Self> {
        let n = |s: &str| names::layer(l, s);
        let (q_norm, k_norm) = if qk_norm {
            (
                Some(ld.norm(&n("attn_q_norm.weight"))?),
                Some(ld.norm(&n("attn_k_norm.weight"))?),
            )
        } else {
            (None, None)
        };
        Ok(Self {
            q: ld.linear(&n("attn_q.weight"), Some(&n("attn_q.bias")))?,
            k: ld.linear(&n("attn_k.weight"), Some(&n("attn_k.bias")))?,
            v: ld.linear(&n("attn_v.weight"), Some(&n("attn_v.bias")))?,
            o: ld.linear(&n("attn_output.weight"), None)?,
            q_norm,
            k_norm,
            rope_style: ld.src.spec().rope_style,
        })
    }

    pub fn bytes(&self) -> usize {
        [&self.q, &self.k, &self.v, &self.o]
            .iter()
            .map(|l| l.resident_bytes())
            .sum::<usize>()
            + self.q_norm.as_ref().map_or(0, RmsNorm::bytes)
            + self.k_norm.as_ref().map_or(0, RmsNorm::bytes)
    }

    /// `x` is the normed hidden state `[tokens, d_model]`; writes this layer's K/V for the new
    /// positions into each sequence's cache and returns the projected attention output.
    pub fn forward(&self, x: &Tensor, ctx: &mut LayerCtx<'_, '_>) -> Result<Tensor> {
        let shape = ctx.shape;
        let hd = shape.head_dim;
        let tokens = x.dim(0)?;
        let [q, k, v]: [Tensor; 3] = QLinear::forward_many(&[&self.q, &self.k, &self.v], x)?
            .try_into()
            .map_err(|_| candle_core::Error::Msg("q/k/v projections".into()))?;
        let q = Self::norm_heads(q, self.q_norm.as_ref(), shape.n_heads, hd)?;
        let copy = prof::time(Part::Copy);
        let mut q = q.flatten_all()?.to_vec1::<f32>()?;
        drop(copy);
        {
            let _t = prof::time(Part::Rope);
            ctx.rope.apply(&mut q, shape.n_heads, self.rope_style);
        }
        self.store_kv(k, v, ctx)?;

        let q_row = shape.n_heads * hd;
        let mut views = Vec::with_capacity(ctx.batch.seqs.len());
        let mut at = 0;
        for seq in ctx.batch.seqs.iter() {
            views.push(SeqAttn {
                q: &q[at * q_row..(at + seq.n) * q_row],
                start: seq.start,
                n: seq.n,
                chunks: seq.kv.chunks(ctx.layer, seq.start + seq.n)?,
            });
            at += seq.n;
        }
        let out = attend(&views, &shape)?;
        let out = {
            let _t = prof::time(Part::Copy);
            Tensor::from_vec(out, (tokens, q_row), x.device())?
        };
        Ok(self.o.forward(&out)?)
    }

    /// `x` is the normed hidden state `[tokens, d_model]`; writes this layer's K/V (k norm and
    /// rope applied) for the new positions into each sequence's cache. The K/V half of
    /// [`SelfAttention::forward`], callable alone.
    pub fn write_kv(&self, x: &Tensor, ctx: &mut LayerCtx<'_, '_>) -> Result<()> {
        let [k, v]: [Tensor; 2] = QLinear::forward_many(&[&self.k, &self.v], x)?
            .try_into()
            .map_err(|_| candle_core::Error::Msg("k/v projections".into()))?;
        self.store_kv(k, v, ctx)
    }

    /// Normalises (where the model has a k norm), ropes and stores projected K/V rows.
    fn store_kv(&self, k: Tensor, v: Tensor, ctx: &mut LayerCtx<'_, '_>) -> Result<()> {
        let shape = ctx.shape;
        let hd = shape.head_dim;
        let k = Self::norm_heads(k, self.k_norm.as_ref(), shape.n_kv_heads, hd)?;
        let copy = prof::time(Part::Copy);
        let mut k = k.flatten_all()?.to_vec1::<f32>()?;
        let v = v.flatten_all()?.to_vec1::<f32>()?;
        drop(copy);
        {
            let _t = prof::time(Part::Rope);
            ctx.rope.apply(&mut k, shape.n_kv_heads, self.rope_style);
        }
        let _t = prof::time(Part::KvWrite);
        let kv_row = shape.n_kv_heads * hd;
        let mut at = 0;
        for seq in ctx.batch.seqs.iter_mut() {
            let (a, b) = (at * kv_row, (at + seq.n) * kv_row);
            seq.kv.write(ctx.layer, seq.start, &k[a..b], &v[a..b])?;
            at += seq.n;
        }
        Ok(())
    }

    /// Per-head RMS norm of projected rows `[tokens, heads * hd]` (Qwen3/Gemma 3's q/k norm).
    fn norm_heads(y: Tensor, norm: Option<&RmsNorm>, heads: usize, hd: usize) -> Result<Tensor> {
        match norm {
            Some(n) => {
                let t = y.dim(0)?;
                Ok(n.forward(&y.reshape((t * heads, hd))?)?
                    .reshape((t, heads * hd))?)
            }
            None => Ok(y),
        }
    }
}

/// `down(act(gate(x)) * up(x))`.
#[derive(Debug)]
pub struct GatedMlp {
    pub gate: QLinear,
    pub up: QLinear,
    pub down: QLinear,
    pub activation: Activation,
}

impl GatedMlp {
    pub fn load(ld: &TensorLoader<'_>, l: usize, act: Activation) -> Result<Self> {
        let n = |s: &str| names::layer(l, s);
        Ok(Self {
            gate: ld.linear(&n("ffn_gate.weight"), None)?,
            up: ld.linear(&n("ffn_up.weight"), None)?,
            down: ld.linear(&n("ffn_down.weight"), None)?,
            activation: act,
        })
    }

    pub fn bytes(&self) -> usize {
        self.gate.resident_bytes() + self.up.resident_bytes() + self.down.resident_bytes()
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _span = tracing::trace_span!("mlp").entered();
        let activation: fn(&mut [f32], &[f32]) = match self.activation {
            Activation::Silu => fastmath::silu_mul,
            Activation::GeluTanh => fastmath::gelu_tanh_mul,
        };
        // The activation is written over the gate's own values where the products come as
        // plain values (packed weights): no third buffer of the MLP's width.
        let gated = match QLinear::forward_many_values(&[&self.gate, &self.up], x)? {
            Some((mut outs, mut dims)) => {
                let [gate, up] = &mut outs[..] else {
                    return Err(candle_core::Error::Msg("gate/up projections".into()).into());
                };
                // A file's shapes: refused here rather than asserted in the kernel.
                if gate.len() != up.len() {
                    return Err(shape_mismatch(gate.len(), up.len()));
                }
                {
                    let _t = prof::time(Part::Activation);
                    activation(gate, up);
                }
                dims.push(self.gate.out_features());
                Tensor::from_vec(std::mem::take(gate), dims, x.device())?
            }
            None => {
                let [gate, up]: [Tensor; 2] = QLinear::forward_many(&[&self.gate, &self.up], x)?
                    .try_into()
                    .map_err(|_| candle_core::Error::Msg("gate/up projections".into()))?;
                let _t = prof::time(Part::Activation);
                gated(&gate, &up, activation)?
            }
        };
        Ok(self.down.forward(&gated)?)
    }
}

/// The error for gate and up projections of different shapes (or value counts).
fn shape_mismatch(gate: impl std::fmt::Debug, up: impl std::fmt::Debug) -> ModelError {
    candle_core::Error::Msg(format!(
        "gated activation: gate {gate:?} and up {up:?} differ in shape"
    ))
    .into()
}

/// `activation(gate, up)` over two tensors of one shape, into a new tensor.
fn gated(gate: &Tensor, up: &Tensor, activation: fn(&mut [f32], &[f32])) -> Result<Tensor> {
    if gate.shape() != up.shape() {
        return Err(shape_mismatch(gate.shape(), up.shape()));
    }
    let out = switchyard_kernels::elementwise([gate, up], gate.elem_count(), |[g, u], out| {
        out.copy_from_slice(g);
        activation(out, u)
    })?;
    Ok(Tensor::from_vec(out, gate.shape(), gate.device())?.to_dtype(gate.dtype())?)
}

/// `x + h`, the residual connection.
pub fn residual(x: &Tensor, h: &Tensor) -> Result<Tensor> {
    let _t = prof::time(Part::Residual);
    Ok(switchyard_kernels::add(x, h)?)
}

pub(crate) fn check_rows(x: &Tensor, batch: &ForwardBatch<'_>) -> Result<()> {
    let rows = x.dim(0)?;
    if rows != batch.total_tokens() {
        return Err(ModelError::BatchMismatch {
            batch: batch.total_tokens(),
            hidden: rows,
        });
    }
    Ok(())
}
