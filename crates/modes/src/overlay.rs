//! A model's weights with some tensors replaced: what the calibrated precisions serve
//! (`q4-awq`'s scaled f32 tensors, `q4-gptq`'s 4-bit blocks). Every other tensor, the
//! metadata and the tokenizer are the inner source's.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};
use candle_core::Device;
use switchyard_weights::{Metadata, ModelSpec, TensorMeta, TokenizerOrigin, WeightSource};

/// One replacement tensor as raw ggml data.
#[derive(Debug, Clone)]
pub struct RawTensor {
    pub dtype: GgmlDType,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

#[derive(Debug)]
pub struct OverlaySource {
    inner: Arc<dyn WeightSource>,
    /// What the replacements are, for the description ("GPTQ 4-bit").
    label: &'static str,
    tensors: HashMap<String, RawTensor>,
}

impl OverlaySource {
    pub fn new(
        inner: Arc<dyn WeightSource>,
        label: &'static str,
        tensors: HashMap<String, RawTensor>,
    ) -> Self {
        Self {
            inner,
            label,
            tensors,
        }
    }

    /// The replacement for `name`, if there is one.
    pub fn raw(&self, name: &str) -> Option<&RawTensor> {
        self.tensors.get(name)
    }
}

impl WeightSource for OverlaySource {
    fn description(&self) -> String {
        format!("{} ({})", self.inner.description(), self.label)
    }

    fn spec(&self) -> &ModelSpec {
        self.inner.spec()
    }

    fn metadata(&self) -> &Metadata {
        self.inner.metadata()
    }

    fn tensor_meta(&self, name: &str) -> Option<TensorMeta> {
        let meta = self.inner.tensor_meta(name)?;
        Some(match self.tensors.get(name) {
            Some(t) => TensorMeta {
                dtype: t.dtype,
                n_bytes: t.bytes.len(),
                ..meta
            },
            None => meta,
        })
    }

    fn load(&self, name: &str, device: &Device) -> switchyard_weights::Result<QTensor> {
        match self.tensors.get(name) {
            Some(t) => Ok(qtensor_from_ggml(
                t.dtype,
                &t.bytes,
                t.shape.clone(),
                device,
            )?),
            None => self.inner.load(name, device),
        }
    }

    fn tokenizer_origin(&self) -> TokenizerOrigin {
        self.inner.tokenizer_origin()
    }

    fn path(&self) -> Option<&Path> {
        self.inner.path()
    }
}
