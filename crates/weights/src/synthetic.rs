//! A tiny random model held in memory, for fast unit tests of model and engine code.
//!
//! Weights are uniform with a 1/sqrt(fan_in) scale so activations stay in a sane range through
//! the layers; the same seed always gives the same bytes.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};

use crate::gguf::qtensor_from_bytes;
use crate::metadata::{MetaValue, Metadata};
use crate::names;
use crate::spec::{Architecture, ModelSpec, RopeStyle};
use crate::{Result, TensorMeta, TokenizerOrigin, WeightSource, WeightsError};

#[derive(Debug)]
struct Stored {
    dtype: GgmlDType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

#[derive(Debug)]
pub struct SyntheticSource {
    spec: ModelSpec,
    metadata: Metadata,
    tensors: BTreeMap<String, Stored>,
}

impl SyntheticSource {
    /// A small spec of `arch`: 4 layers, width 64, 4 query / 2 key-value heads of 16, vocab 256.
    pub fn tiny_spec(arch: Architecture) -> ModelSpec {
        ModelSpec {
            architecture: arch,
            name: format!("synthetic-{}", arch.as_str()),
            n_layers: 4,
            d_model: 64,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            ffn_dim: 128,
            vocab_size: 256,
            context_length: 512,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            rope_style: match arch {
                Architecture::Llama => RopeStyle::Interleaved,
                _ => RopeStyle::HalfSplit,
            },
            rope_theta_local: None,
            sliding_window: (arch == Architecture::Gemma3).then_some(8),
            sliding_window_pattern: (arch == Architecture::Gemma3).then_some(2),
            activation: None,
            query_pre_attn_scalar: None,
            tied_embeddings: arch != Architecture::Qwen2,
        }
    }

    /// Random weights for `spec`; matrices stored as `matrix_dtype`, norms and biases as f32.
    pub fn new(spec: ModelSpec, seed: u64, matrix_dtype: GgmlDType) -> Result<Self> {
        spec.validate()?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut tensors = BTreeMap::new();
        let mut add =
            |name: String, shape: Vec<usize>, rng: &mut rand::rngs::StdRng| -> Result<()> {
                let n: usize = shape.iter().product();
                let is_norm = name.ends_with("norm.weight");
                let is_vector = shape.len() == 1;
                let scale = if is_vector {
                    0.1
                } else if name == names::TOKEN_EMBD {
                    1.0
                } else {
                    (3.0 / shape[1] as f32).sqrt()
                };
                let values: Vec<f32> = (0..n)
                    .map(|_| {
                        let u: f32 = rng.random_range(-1.0..1.0);
                        if is_norm {
                            1.0 + 0.1 * u
                        } else {
                            scale * u
                        }
                    })
                    .collect();
                let dtype = if is_vector {
                    GgmlDType::F32
                } else {
                    matrix_dtype
                };
                let t = Tensor::from_vec(values, shape.clone(), &Device::Cpu)?;
                let q = QTensor::quantize(&t, dtype)?;
                tensors.insert(
                    name,
                    Stored {
                        dtype,
                        shape,
                        bytes: q.data()?.into_owned(),
                    },
                );
                Ok(())
            };
        add(
            names::TOKEN_EMBD.into(),
            vec![spec.vocab_size, spec.d_model],
            &mut rng,
        )?;
        add(names::OUTPUT_NORM.into(), vec![spec.d_model], &mut rng)?;
        if !spec.tied_embeddings {
            add(
                names::OUTPUT.into(),
                vec![spec.vocab_size, spec.d_model],
                &mut rng,
            )?;
        }
        for l in 0..spec.n_layers {
            for (suffix, shape) in names::layer_tensors(&spec) {
                add(names::layer(l, suffix), shape, &mut rng)?;
            }
        }
        let mut metadata = Metadata::default();
        metadata.insert(
            "general.architecture",
            MetaValue::String(spec.architecture.as_str().into()),
        );
        metadata.insert("general.name", MetaValue::String(spec.name.clone()));
        Ok(Self {
            spec,
            metadata,
            tensors,
        })
    }
}

impl WeightSource for SyntheticSource {
    fn description(&self) -> String {
        self.spec.name.clone()
    }

    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    fn tensor_meta(&self, name: &str) -> Option<TensorMeta> {
        self.tensors.get(name).map(|s| TensorMeta {
            dtype: s.dtype,
            shape: s.shape.clone(),
            n_bytes: s.bytes.len(),
        })
    }

    fn load(&self, name: &str, device: &Device) -> Result<QTensor> {
        let s = self
            .tensors
            .get(name)
            .ok_or_else(|| WeightsError::MissingTensor {
                name: name.to_string(),
                source_desc: self.description(),
            })?;
        qtensor_from_bytes(&s.bytes, s.dtype, &s.shape, device)
    }

    fn tokenizer_origin(&self) -> TokenizerOrigin {
        TokenizerOrigin::None
    }

    fn path(&self) -> Option<&Path> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_bytes() {
        let spec = SyntheticSource::tiny_spec(Architecture::Qwen2);
        let a = SyntheticSource::new(spec.clone(), 7, GgmlDType::Q8_0).unwrap();
        let b = SyntheticSource::new(spec, 7, GgmlDType::Q8_0).unwrap();
        let name = "blk.1.attn_q.weight";
        assert_eq!(a.tensors[name].bytes, b.tensors[name].bytes);
        assert_eq!(a.tensor_meta(name).unwrap().n_bytes, 64 * 64 / 32 * 34);
        assert!(a.tensor_meta("blk.0.attn_q.bias").is_some());
    }
}
