//! Hugging Face model folders: `config.json`, `tokenizer.json` and one or more `*.safetensors`.
//!
//! The headers are parsed with the `safetensors` crate; payloads are read from memory maps.
//! Hugging Face stores Gemma's RMSNorm weights as `w` for a scale of `1 + w` where GGUF stores
//! `1 + w`; that difference is a file-format fact and is undone here, like the name mapping.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;
use serde_json::Value;

use crate::gguf::{qtensor_from_bytes, tensor_bytes};
use crate::metadata::{MetaValue, Metadata};
use crate::names;
use crate::spec::{Activation, Architecture, ModelSpec, RopeStyle};
use crate::{Result, TensorMeta, TokenizerOrigin, WeightSource, WeightsError};

#[derive(Debug)]
struct Entry {
    file: usize,
    dtype: GgmlDType,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

#[derive(Debug)]
pub struct SafetensorsDir {
    dir: PathBuf,
    maps: Vec<Mmap>,
    tensors: BTreeMap<String, Entry>,
    spec: ModelSpec,
    metadata: Metadata,
}

fn st_err(path: &Path, detail: impl Into<String>) -> WeightsError {
    WeightsError::Safetensors {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

impl SafetensorsDir {
    pub fn open(dir: &Path) -> Result<Self> {
        let config_path = dir.join("config.json");
        let config_text = std::fs::read_to_string(&config_path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                WeightsError::UnknownFormat {
                    path: dir.to_path_buf(),
                }
            } else {
                WeightsError::Io {
                    path: config_path.clone(),
                    source,
                }
            }
        })?;
        let config: Value = serde_json::from_str(&config_text)
            .map_err(|e| st_err(&config_path, format!("invalid JSON: {e}")))?;
        // Multimodal Gemma 3 checkpoints nest the language model's settings.
        let text = config.get("text_config").unwrap_or(&config);
        let model_type = text
            .get("model_type")
            .or_else(|| config.get("model_type"))
            .and_then(Value::as_str)
            .ok_or_else(|| st_err(&config_path, "config.json has no model_type"))?;
        let architecture = Architecture::parse(model_type)?;

        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|source| WeightsError::Io {
                path: dir.to_path_buf(),
                source,
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(WeightsError::UnknownFormat {
                path: dir.to_path_buf(),
            });
        }

        let mut maps = Vec::with_capacity(files.len());
        let mut tensors = BTreeMap::new();
        for (fi, path) in files.iter().enumerate() {
            let file = File::open(path).map_err(|source| WeightsError::Io {
                path: path.clone(),
                source,
            })?;
            // SAFETY: read-only map of a file we never write; see GgufFile::open.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|source| WeightsError::Io {
                path: path.clone(),
                source,
            })?;
            let (header_len, header) =
                safetensors::SafeTensors::read_metadata(&mmap).map_err(|e| {
                    match past_the_end(&mmap) {
                        Some(detail) => st_err(path, detail),
                        None => st_err(path, format!("bad header: {e}")),
                    }
                })?;
            let data_start = 8 + header_len;
            for (hf_name, info) in header.tensors() {
                let Some(name) = names::from_hf(architecture, &hf_name) else {
                    tracing::debug!(tensor = %hf_name, "ignoring tensor with no canonical name");
                    continue;
                };
                let dtype = match info.dtype {
                    safetensors::Dtype::F32 => GgmlDType::F32,
                    safetensors::Dtype::F16 => GgmlDType::F16,
                    safetensors::Dtype::BF16 => GgmlDType::BF16,
                    other => {
                        return Err(st_err(
                            path,
                            format!("tensor {hf_name} has dtype {other:?}; only F32, F16 and BF16 are supported"),
                        ))
                    }
                };
                let (s, e) = info.data_offsets;
                let expected = tensor_bytes(dtype, &info.shape).unwrap_or(usize::MAX);
                if e < s || e - s != expected || data_start + e > mmap.len() {
                    return Err(st_err(
                        path,
                        format!("tensor {hf_name} data [{s}, {e}) does not match its shape {:?} or lies past the end of the file", info.shape),
                    ));
                }
                tensors.insert(
                    name,
                    Entry {
                        file: fi,
                        dtype,
                        shape: info.shape.clone(),
                        start: data_start + s,
                        end: data_start + e,
                    },
                );
            }
            maps.push(mmap);
        }

        let spec = spec_from_hf(text, architecture, &tensors, &config_path)?;
        let mut metadata = Metadata::default();
        metadata.insert(
            "general.architecture",
            MetaValue::String(architecture.as_str().into()),
        );
        metadata.insert("general.name", MetaValue::String(spec.name.clone()));
        Ok(Self {
            dir: dir.to_path_buf(),
            maps,
            tensors,
            spec,
            metadata,
        })
    }
}

/// The `safetensors` crate refuses a file whose header does not cover its data without saying
/// which tensor is cut; this names the first tensor whose data runs past the end.
fn past_the_end(buf: &[u8]) -> Option<String> {
    let header_len = usize::try_from(u64::from_le_bytes(buf.get(..8)?.try_into().ok()?)).ok()?;
    let data_start = header_len.checked_add(8)?;
    let header: Value = serde_json::from_slice(buf.get(8..data_start)?).ok()?;
    let data_len = (buf.len() - data_start) as u64;
    header
        .as_object()?
        .iter()
        .filter(|(name, _)| name.as_str() != "__metadata__")
        .filter_map(|(name, info)| {
            let o = info.get("data_offsets")?;
            Some((o.get(0)?.as_u64()?, o.get(1)?.as_u64()?, name))
        })
        .filter(|&(_, end, _)| end > data_len)
        .min_by_key(|&(start, _, _)| start)
        .map(|(start, end, name)| {
            format!("tensor {name} data [{start}, {end}) lies past the end of the file's {data_len} bytes of tensor data; the file is truncated or corrupt")
        })
}

fn spec_from_hf(
    c: &Value,
    architecture: Architecture,
    tensors: &BTreeMap<String, Entry>,
    path: &Path,
) -> Result<ModelSpec> {
    let get = |k: &str| -> Result<usize> {
        c.get(k)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| st_err(path, format!("config.json has no integer {k:?}")))
    };
    let opt = |k: &str| c.get(k).and_then(Value::as_u64).map(|v| v as usize);
    let optf = |k: &str| c.get(k).and_then(Value::as_f64);
    let d_model = get("hidden_size")?;
    let n_heads = get("num_attention_heads")?;
    let vocab_size = match tensors.get(names::TOKEN_EMBD) {
        Some(Entry { shape, .. }) => match shape[..] {
            [vocab, _] => vocab,
            _ => {
                return Err(st_err(
                    path,
                    format!(
                        "{} has shape {shape:?}; an embedding is [vocab, hidden]",
                        names::TOKEN_EMBD
                    ),
                ))
            }
        },
        None => get("vocab_size")?,
    };
    let activation = c
        .get("hidden_activation")
        .or_else(|| c.get("hidden_act"))
        .and_then(Value::as_str)
        .map(|a| match a {
            "silu" | "swish" => Ok(Activation::Silu),
            "gelu_pytorch_tanh" | "gelu_tanh" | "gelu" => Ok(Activation::GeluTanh),
            other => Err(st_err(
                path,
                format!("activation {other:?} is not supported"),
            )),
        })
        .transpose()?;
    let spec = ModelSpec {
        architecture,
        name: path
            .parent()
            .and_then(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| architecture.as_str().into()),
        n_layers: get("num_hidden_layers")?,
        d_model,
        n_heads,
        n_kv_heads: opt("num_key_value_heads").unwrap_or(n_heads),
        head_dim: opt("head_dim").unwrap_or(d_model / n_heads.max(1)),
        ffn_dim: get("intermediate_size")?,
        vocab_size,
        context_length: opt("max_position_embeddings").unwrap_or(4096),
        rms_norm_eps: optf("rms_norm_eps").unwrap_or(1e-6),
        rope_theta: optf("rope_theta").unwrap_or(10_000.0),
        rope_style: RopeStyle::HalfSplit,
        rope_theta_local: optf("rope_local_base_freq"),
        sliding_window: if architecture == Architecture::Gemma3 {
            opt("sliding_window")
        } else {
            None
        },
        sliding_window_pattern: opt("sliding_window_pattern"),
        activation,
        query_pre_attn_scalar: optf("query_pre_attn_scalar"),
        tied_embeddings: !tensors.contains_key(names::OUTPUT),
    };
    spec.validate()?;
    Ok(spec)
}

impl WeightSource for SafetensorsDir {
    fn description(&self) -> String {
        self.dir.display().to_string()
    }

    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    fn tensor_meta(&self, name: &str) -> Option<TensorMeta> {
        self.tensors.get(name).map(|e| TensorMeta {
            dtype: e.dtype,
            shape: e.shape.clone(),
            n_bytes: e.end - e.start,
        })
    }

    fn load(&self, name: &str, device: &Device) -> Result<QTensor> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| WeightsError::MissingTensor {
                name: name.to_string(),
                source_desc: self.description(),
            })?;
        let bytes = &self.maps[e.file][e.start..e.end];
        let gemma_norm =
            self.spec.architecture == Architecture::Gemma3 && name.ends_with("norm.weight");
        if gemma_norm {
            let t = qtensor_from_bytes(bytes, e.dtype, &e.shape, &Device::Cpu)?
                .dequantize(&Device::Cpu)?
                .to_dtype(DType::F32)?;
            let t = (t + 1.0)?.to_device(device)?;
            return Ok(QTensor::quantize(&t, GgmlDType::F32)?);
        }
        qtensor_from_bytes(bytes, e.dtype, &e.shape, device)
    }

    fn tokenizer_origin(&self) -> TokenizerOrigin {
        let config = self.dir.join("tokenizer_config.json");
        TokenizerOrigin::HuggingFace {
            tokenizer_json: self.dir.join("tokenizer.json"),
            tokenizer_config: config.exists().then_some(config),
        }
    }

    fn path(&self) -> Option<&Path> {
        Some(&self.dir)
    }
}

/// Writes `source` as a Hugging Face folder with f32 tensors and a `config.json` (no tokenizer:
/// the tokenizer crate writes `tokenizer.json`). GGUF llama files permute the rows of q and k
/// for interleaved rope; the permutation is undone so the folder uses Hugging Face's layout.
pub fn export(source: &dyn WeightSource, dir: &Path) -> Result<()> {
    let spec = source.spec();
    std::fs::create_dir_all(dir).map_err(|e| WeightsError::Io {
        path: dir.to_path_buf(),
        source: e,
    })?;
    let data = hf_tensors(source)?;
    let path = dir.join("model.safetensors");
    candle_core::safetensors::save(
        &data
            .into_iter()
            .collect::<std::collections::HashMap<_, _>>(),
        &path,
    )?;
    let model_type = match spec.architecture {
        Architecture::Gemma3 => "gemma3_text",
        a => a.as_str(),
    };
    let mut config = serde_json::json!({
        "model_type": model_type,
        "hidden_size": spec.d_model,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.ffn_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.context_length,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tied_embeddings,
    });
    if let Some(w) = spec.sliding_window {
        config["sliding_window"] = w.into();
    }
    if let Some(r) = spec.rope_theta_local {
        config["rope_local_base_freq"] = r.into();
    }
    let cfg_path = dir.join("config.json");
    std::fs::write(
        &cfg_path,
        serde_json::to_string_pretty(&config).unwrap_or_default(),
    )
    .map_err(|e| WeightsError::Io {
        path: cfg_path,
        source: e,
    })?;
    Ok(())
}

/// Every tensor of `source` as dense f32 under its Hugging Face name, in Hugging Face's layout
/// (Gemma norms as `w` for `1 + w`, llama q/k rows in rotate-half order).
pub fn hf_tensors(source: &dyn WeightSource) -> Result<Vec<(String, Tensor)>> {
    let spec = source.spec();
    let mut names_out: Vec<String> = vec![names::TOKEN_EMBD.into(), names::OUTPUT_NORM.into()];
    if !spec.tied_embeddings {
        names_out.push(names::OUTPUT.into());
    }
    for l in 0..spec.n_layers {
        for (suffix, _) in names::layer_tensors(spec) {
            names_out.push(names::layer(l, suffix));
        }
    }
    let mut data = Vec::with_capacity(names_out.len());
    for name in &names_out {
        let mut t = source
            .load(name, &Device::Cpu)?
            .dequantize(&Device::Cpu)?
            .to_dtype(DType::F32)?;
        if spec.architecture == Architecture::Gemma3 && name.ends_with("norm.weight") {
            t = (t - 1.0)?;
        }
        let is_qk = name.ends_with("attn_q.weight") || name.ends_with("attn_k.weight");
        if is_qk && spec.rope_style == RopeStyle::Interleaved {
            t = unpermute_rope_rows(&t, spec.head_dim)?;
        }
        let hf = names::to_hf(spec.architecture, name)
            .ok_or_else(|| WeightsError::BadConfig(format!("no Hugging Face name for {name}")))?;
        data.push((hf, t));
    }
    Ok(data)
}

/// Rows of a GGUF llama q/k weight are ordered (head, pair, half); Hugging Face orders them
/// (head, half, pair). Returns the Hugging Face order.
fn unpermute_rope_rows(t: &Tensor, head_dim: usize) -> Result<Tensor> {
    let (rows, cols) = t.dims2()?;
    let heads = rows / head_dim;
    Ok(t.reshape((heads, head_dim / 2, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An embedding that is not [vocab, hidden] is refused with its shape, not indexed.
    #[test]
    fn an_embedding_of_the_wrong_rank_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = r#"{"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2,
            "num_hidden_layers": 1, "intermediate_size": 16, "vocab_size": 4}"#;
        std::fs::write(dir.path().join("config.json"), config).expect("config");
        let scalar = 1f32.to_le_bytes();
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![], &scalar)
            .expect("view");
        safetensors::serialize_to_file(
            [("model.embed_tokens.weight", view)],
            None,
            &dir.path().join("model.safetensors"),
        )
        .expect("write");
        let err = SafetensorsDir::open(dir.path())
            .expect_err("refused")
            .to_string();
        assert!(
            err.ends_with("token_embd.weight has shape []; an embedding is [vocab, hidden]"),
            "{err}"
        );
    }
}
