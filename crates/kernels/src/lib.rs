//! The matmul seam: every weight-by-activation product in the model goes through [`QLinear`].
//!
//! A `QLinear` owns one weight matrix in its stored type (f32, f16, bf16 or a ggml block
//! quantization) and an optional bias. Which kernel runs is decided here, per tensor type and
//! shape, so faster kernels can be added without touching model code. Today every type goes to
//! candle's quantized matmul (which quantizes activations to 8-bit blocks, as llama.cpp does);
//! float weights are kept as dense tensors and use candle's GEMM.

pub mod cpu;

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};

pub type Result<T> = candle_core::Result<T>;

/// A linear layer `y = x W^T + b` whose weight `W` is `[out_features, in_features]`.
#[derive(Debug, Clone)]
pub struct QLinear {
    inner: QMatMul,
    bias: Option<Tensor>,
    dtype: GgmlDType,
    out_features: usize,
    in_features: usize,
    resident_bytes: usize,
    span: tracing::Span,
}

impl QLinear {
    pub fn new(weight: QTensor, bias: Option<Tensor>) -> Result<Self> {
        Self::from_arc(Arc::new(weight), bias)
    }

    /// Dequantizes the weight to a dense `dtype` (F32 or F16) matrix and uses GEMM: the
    /// precision baseline, with no activation quantization.
    pub fn dense(weight: &QTensor, dtype: DType, bias: Option<Tensor>) -> Result<Self> {
        let (out_features, in_features) = weight.shape().dims2()?;
        let stored = weight.dtype();
        let w = weight.dequantize(&weight.device())?.to_dtype(dtype)?;
        let inner = match dtype {
            DType::F16 => QMatMul::TensorF16(w),
            _ => QMatMul::Tensor(w),
        };
        Self::from_parts(inner, bias, stored, out_features, in_features)
    }

    /// Shares a weight with another user (tied embeddings share the LM head's matrix).
    pub fn from_arc(weight: Arc<QTensor>, bias: Option<Tensor>) -> Result<Self> {
        let (out_features, in_features) = weight.shape().dims2()?;
        let dtype = weight.dtype();
        // Built directly rather than with `QMatMul::from_arc`, which consults the process-wide
        // CANDLE_DEQUANTIZE_ALL variables: the kernel choice belongs to this seam alone.
        let inner = match dtype {
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
                QMatMul::Tensor(weight.dequantize(&weight.device())?.to_dtype(DType::F32)?)
            }
            _ => QMatMul::QTensor(weight),
        };
        Self::from_parts(inner, bias, dtype, out_features, in_features)
    }

    fn from_parts(
        inner: QMatMul,
        bias: Option<Tensor>,
        dtype: GgmlDType,
        out_features: usize,
        in_features: usize,
    ) -> Result<Self> {
        if let Some(b) = &bias {
            let n = b.dims1()?;
            if n != out_features {
                candle_core::bail!("bias has {n} values for {out_features} outputs");
            }
        }
        let resident_bytes = match &inner {
            QMatMul::QTensor(q) => q.storage_size_in_bytes(),
            QMatMul::Tensor(t) | QMatMul::TensorF16(t) => {
                t.elem_count() * t.dtype().size_in_bytes()
            }
        } + bias
            .as_ref()
            .map_or(0, |b| b.elem_count() * b.dtype().size_in_bytes());
        let span = tracing::trace_span!("qlinear", out = out_features, inp = in_features);
        Ok(Self {
            inner,
            bias,
            dtype,
            out_features,
            in_features,
            resident_bytes,
            span,
        })
    }

    /// `x`: `[.., in_features]` f32, contiguous. Returns `[.., out_features]` f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _enter = self.span.enter();
        let y = self.inner.forward(x)?;
        let y = if y.dtype() == DType::F32 {
            y
        } else {
            y.to_dtype(DType::F32)?
        };
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    /// The weight's stored type (before any dequantization for the kernel).
    pub fn dtype(&self) -> GgmlDType {
        self.dtype
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Bytes this layer keeps in memory (weight as held for the kernel, plus bias).
    pub fn resident_bytes(&self) -> usize {
        self.resident_bytes
    }
}
