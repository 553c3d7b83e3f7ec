//! The heads file: one safetensors file beside the model, `<model>.exits.safetensors`.
//!
//! Tensors: `exit.<depth>.weight` (`A`, `[d_model, d_model]` f32, `y = A h + b`) and
//! `exit.<depth>.bias` (`[d_model]` f32) for each affine head; identity heads have none. An MLP
//! head adds `exit.<depth>.mlp.w1` (`[hidden, d_model]`), `exit.<depth>.mlp.b1` (`[hidden]`)
//! and `exit.<depth>.mlp.w2` (`[d_model, hidden]`); a block head is `exit.<depth>.block.<part>`
//! for each part of [`crate::block::PARTS`] (matrices `[out, in]`, as in the model), its shape
//! in the metadata; an exit probe, when trained, is
//! `exit.<depth>.probe.weight` (`[d_model]`) and `exit.<depth>.probe.bias` (`[1]`). The
//! safetensors header's metadata holds one key, [`META_KEY`], whose value is the JSON of
//! [`HeadsMeta`]: the model's SHA-256, size, name and shape, each head's depth and kind, and how
//! the heads were calibrated. One file, written to a temporary name and renamed, so heads and
//! their metadata can never disagree. Loading checks the model hash and shape and refuses a
//! stale or mismatched file.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use switchyard_models::LayeredModel;

use crate::block::{BlockHead, PARTS};
use crate::fingerprint::Fingerprint;
use crate::heads::{ExitHead, ExitHeads, ExitProbe, HeadKind, HeadsMeta, FORMAT_VERSION};
use crate::{ExitsError, Result};

pub use crate::fingerprint::sibling;

/// The metadata key holding [`HeadsMeta`] as JSON.
pub const META_KEY: &str = "switchyard.exits";

/// Where `switchyard calibrate` puts the heads of the model at `model`.
pub fn default_heads_path(model: &Path) -> PathBuf {
    sibling(model, ".exits.safetensors")
}

fn weight_name(depth: usize) -> String {
    format!("exit.{depth}.weight")
}

fn bias_name(depth: usize) -> String {
    format!("exit.{depth}.bias")
}

fn part_name(depth: usize, part: &str) -> String {
    format!("exit.{depth}.{part}")
}

fn block_name(depth: usize, part: &str) -> String {
    format!("exit.{depth}.block.{part}")
}

fn f32_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let v = t.flatten_all()?.to_vec1::<f32>()?;
    Ok(v.iter().flat_map(|x| x.to_le_bytes()).collect())
}

/// Writes `heads` to `path` (atomically: a temporary file renamed into place).
pub fn save(heads: &ExitHeads, path: &Path) -> Result<()> {
    let mut blobs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut push = |name: String, t: &Tensor| -> Result<()> {
        blobs.push((name, t.dims().to_vec(), f32_bytes(t)?));
        Ok(())
    };
    for (depth, head) in heads.iter() {
        match head {
            ExitHead::Identity => {}
            ExitHead::Affine { weight_t, bias } => {
                push(weight_name(depth), &weight_t.t()?.contiguous()?)?;
                push(bias_name(depth), bias)?;
            }
            ExitHead::Mlp {
                weight_t,
                bias,
                w1_t,
                b1,
                w2_t,
            } => {
                push(weight_name(depth), &weight_t.t()?.contiguous()?)?;
                push(bias_name(depth), bias)?;
                push(part_name(depth, "mlp.w1"), &w1_t.t()?.contiguous()?)?;
                push(part_name(depth, "mlp.b1"), b1)?;
                push(part_name(depth, "mlp.w2"), &w2_t.t()?.contiguous()?)?;
            }
            ExitHead::Block(b) => {
                for (part, t) in PARTS.iter().zip(&b.params) {
                    // Matrices are stored `[out, in]`, as the model's own.
                    let t = if t.rank() == 2 {
                        t.t()?.contiguous()?
                    } else {
                        t.clone()
                    };
                    push(block_name(depth, part), &t)?;
                }
            }
        }
        if let Some(p) = heads.probe(depth) {
            push(part_name(depth, "probe.weight"), &p.weight.flatten_all()?)?;
            push(part_name(depth, "probe.bias"), &p.bias)?;
        }
    }
    let meta = serde_json::to_string(heads.meta())
        .map_err(|e| ExitsError::Internal(format!("heads metadata as JSON: {e}")))?;
    let views = blobs
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| ExitsError::Internal(format!("tensor {name}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let tmp = sibling(path, ".tmp");
    let info = HashMap::from([(META_KEY.to_string(), meta)]);
    safetensors::tensor::serialize_to_file(views, Some(info), &tmp).map_err(|e| {
        ExitsError::BadHeadsFile {
            path: tmp.clone(),
            detail: format!("cannot write: {e}"),
        }
    })?;
    std::fs::rename(&tmp, path).map_err(ExitsError::io(path))
}

/// Reads a heads file without checking it against a model.
pub fn load_unchecked(path: &Path, device: &Device) -> Result<ExitHeads> {
    let bad = |detail: String| ExitsError::BadHeadsFile {
        path: path.to_path_buf(),
        detail,
    };
    let bytes = std::fs::read(path).map_err(ExitsError::io(path))?;
    let (_, header) =
        SafeTensors::read_metadata(&bytes).map_err(|e| bad(format!("not safetensors: {e}")))?;
    let json = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get(META_KEY))
        .ok_or_else(|| {
            bad(format!(
                "no {META_KEY:?} metadata: not a Switchyard heads file"
            ))
        })?;
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| bad(format!("metadata is not JSON: {e}")))?;
    // Name an unknown head kind before serde's generic enum error would.
    if let Some(kind) = value
        .get("heads")
        .and_then(|h| h.as_array())
        .into_iter()
        .flatten()
        .filter_map(|h| h.get("kind").and_then(|k| k.as_str()))
        .find(|k| !matches!(*k, "identity" | "affine" | "mlp" | "block"))
    {
        return Err(ExitsError::UnsupportedHeadKind {
            path: path.to_path_buf(),
            kind: kind.to_string(),
        });
    }
    let meta: HeadsMeta =
        serde_json::from_value(value).map_err(|e| bad(format!("bad metadata: {e}")))?;
    if meta.format_version != FORMAT_VERSION {
        return Err(bad(format!(
            "format version {} (this build reads {FORMAT_VERSION})",
            meta.format_version
        )));
    }
    let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(format!("{e}")))?;
    let d = meta.model.d_model;
    let load = |name: &str, shape: &[usize]| -> Result<Tensor> {
        let t = st
            .tensor(name)
            .map_err(|_| bad(format!("tensor {name} is missing")))?;
        if t.dtype() != Dtype::F32 || t.shape() != shape {
            return Err(bad(format!(
                "tensor {name} is {:?} {:?}, expected F32 {shape:?}",
                t.dtype(),
                t.shape()
            )));
        }
        let v: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(Tensor::from_vec(v, shape, device)?)
    };
    let mut heads = BTreeMap::new();
    let mut probes = Vec::new();
    for info in &meta.heads {
        let head = match info.kind {
            HeadKind::Identity => ExitHead::Identity,
            HeadKind::Affine => {
                let w = load(&weight_name(info.depth), &[d, d])?;
                ExitHead::Affine {
                    weight_t: w.t()?.contiguous()?,
                    bias: load(&bias_name(info.depth), &[d])?,
                }
            }
            HeadKind::Mlp => {
                let w1_name = part_name(info.depth, "mlp.w1");
                let hidden = st
                    .tensor(&w1_name)
                    .ok()
                    .and_then(|t| t.shape().first().copied())
                    .ok_or_else(|| bad(format!("tensor {w1_name} is missing")))?;
                ExitHead::Mlp {
                    weight_t: load(&weight_name(info.depth), &[d, d])?.t()?.contiguous()?,
                    bias: load(&bias_name(info.depth), &[d])?,
                    w1_t: load(&w1_name, &[hidden, d])?.t()?.contiguous()?,
                    b1: load(&part_name(info.depth, "mlp.b1"), &[hidden])?,
                    w2_t: load(&part_name(info.depth, "mlp.w2"), &[d, hidden])?
                        .t()?
                        .contiguous()?,
                }
            }
            HeadKind::Block => {
                let cfg = info.block.clone().ok_or_else(|| {
                    bad(format!(
                        "the block head at depth {} has no shape",
                        info.depth
                    ))
                })?;
                let params = PARTS
                    .iter()
                    .zip(BlockHead::shapes(&cfg, d))
                    .map(|(part, shape)| {
                        let name = block_name(info.depth, part);
                        if shape.len() == 2 {
                            Ok(load(&name, &[shape[1], shape[0]])?.t()?.contiguous()?)
                        } else {
                            load(&name, &shape)
                        }
                    })
                    .collect::<Result<Vec<_>>>()?;
                let head = BlockHead { cfg, params };
                head.check(d).map_err(|e| bad(e.to_string()))?;
                ExitHead::Block(Box::new(head))
            }
        };
        if heads.insert(info.depth, head).is_some() {
            return Err(bad(format!("two heads at depth {}", info.depth)));
        }
        let probe_name = part_name(info.depth, "probe.weight");
        if st.tensor(&probe_name).is_ok() {
            probes.push((
                info.depth,
                ExitProbe {
                    weight: load(&probe_name, &[d])?.reshape((d, 1))?,
                    bias: load(&part_name(info.depth, "probe.bias"), &[1])?,
                },
            ));
        }
    }
    let mut out = ExitHeads::new(meta, heads).map_err(|e| bad(e.to_string()))?;
    for (depth, p) in probes {
        out = out.with_probe(depth, p)?;
    }
    Ok(out)
}

/// Reads a heads file and checks that it was made for this model file (`fingerprint`) and fits
/// the loaded `model`.
pub fn load(path: &Path, model: &LayeredModel, fingerprint: &Fingerprint) -> Result<ExitHeads> {
    let heads = load_unchecked(path, model.device())?;
    let m = &heads.meta().model;
    if !m.sha256.eq_ignore_ascii_case(&fingerprint.sha256) {
        return Err(ExitsError::StaleHeads {
            path: path.to_path_buf(),
            heads_sha256: m.sha256.clone(),
            model_sha256: fingerprint.sha256.clone(),
        });
    }
    heads
        .check_fits(model)
        .map_err(|detail| ExitsError::HeadsMismatch {
            path: path.to_path_buf(),
            detail,
        })?;
    Ok(heads)
}
