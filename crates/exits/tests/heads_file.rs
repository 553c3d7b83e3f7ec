//! The heads file on a synthetic model: round trip, and refusal of stale, mismatched and
//! unknown-kind files.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};
use switchyard_exits::file::{self, META_KEY};
use switchyard_exits::fingerprint::Fingerprint;
use switchyard_exits::heads::Affine;
use switchyard_exits::heads::{model_ref, ExitProbe, HeadsMeta, FORMAT_VERSION};
use switchyard_exits::{ExitHead, ExitHeads, ExitsError};
use switchyard_models::{LayeredModel, LoadOptions};
use switchyard_weights::{Architecture, SyntheticSource, WeightSource};

fn synthetic(arch: Architecture) -> LayeredModel {
    let spec = SyntheticSource::tiny_spec(arch);
    let src: Arc<dyn WeightSource> =
        Arc::new(SyntheticSource::new(spec, 3, GgmlDType::F32).unwrap());
    LayeredModel::load(src, &LoadOptions::default()).unwrap()
}

fn heads_for(m: &LayeredModel, sha: &str) -> ExitHeads {
    let d = m.spec().d_model;
    let affine = Affine {
        d_in: d,
        d_out: d,
        weight: (0..d * d)
            .map(|i| ((i * 7 % 13) as f64 - 6.0) / 20.0)
            .collect(),
        bias: (0..d).map(|i| i as f64 / 100.0).collect(),
        lambda_rel: 0.1,
    };
    let mut heads = BTreeMap::new();
    heads.insert(1, ExitHead::from_affine(&affine, &Device::Cpu).unwrap());
    heads.insert(2, ExitHead::Identity);
    let meta = HeadsMeta {
        format_version: FORMAT_VERSION,
        model: model_ref(m, "tiny", sha.to_string(), 123),
        heads: Vec::new(),
        calibration: None,
    };
    ExitHeads::new(meta, heads).unwrap()
}

fn fp(sha: &str) -> Fingerprint {
    Fingerprint {
        sha256: sha.into(),
        bytes: 123,
    }
}

#[test]
fn heads_round_trip_and_stale_or_mismatched_files_are_refused() -> anyhow::Result<()> {
    let m = synthetic(Architecture::Llama);
    let heads = heads_for(&m, "aa11");
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("tiny.gguf.exits.safetensors");
    file::save(&heads, &path)?;
    let back = file::load(&path, &m, &fp("AA11"))?;
    assert_eq!(back.depths(), vec![1, 2]);
    assert_eq!(back.meta(), heads.meta());
    let x = m.embed(&[1, 2, 3])?;
    for d in [1, 2] {
        let a = heads.logits(&m, d, &x)?.to_vec2::<f32>()?;
        let b = back.logits(&m, d, &x)?.to_vec2::<f32>()?;
        assert_eq!(a, b, "depth {d}");
    }
    // Identity heads are the logit lens; at full depth any heads give the model's output.
    let lens = m.logits(&x)?.to_vec2::<f32>()?;
    assert_eq!(back.logits(&m, 2, &x)?.to_vec2::<f32>()?, lens);
    assert_eq!(back.logits(&m, m.n_layers(), &x)?.to_vec2::<f32>()?, lens);
    assert!(matches!(
        back.logits(&m, 3, &x),
        Err(ExitsError::NoHead { depth: 3, .. })
    ));

    match file::load(&path, &m, &fp("bb22")) {
        Err(e @ ExitsError::StaleHeads { .. }) => {
            assert!(e.to_string().contains("switchyard calibrate"), "{e}")
        }
        other => panic!("expected StaleHeads, got {other:?}"),
    }
    // Same hash, different shape (a file and heads that disagree): refused, not misapplied.
    let mut spec = SyntheticSource::tiny_spec(Architecture::Llama);
    spec.n_layers += 1;
    let src: Arc<dyn WeightSource> = Arc::new(SyntheticSource::new(spec, 3, GgmlDType::F32)?);
    let deeper = LayeredModel::load(src, &LoadOptions::default())?;
    match file::load(&path, &deeper, &fp("aa11")) {
        Err(ExitsError::HeadsMismatch { detail, .. }) => assert!(detail.contains("layers")),
        other => panic!("expected HeadsMismatch, got {other:?}"),
    }
    Ok(())
}

#[test]
fn unknown_head_kinds_and_foreign_files_are_named() -> anyhow::Result<()> {
    let m = synthetic(Architecture::Qwen2);
    let dir = tempfile::tempdir()?;
    let heads = heads_for(&m, "aa11");
    let mut meta = serde_json::to_value(heads.meta())?;
    meta["heads"][0]["kind"] = "lstm".into();
    let path = dir.path().join("lstm.safetensors");
    let info = HashMap::from([(META_KEY.to_string(), meta.to_string())]);
    let empty: Vec<(String, safetensors::tensor::TensorView<'_>)> = Vec::new();
    safetensors::tensor::serialize_to_file(empty, Some(info), &path)?;
    match file::load_unchecked(&path, &Device::Cpu) {
        Err(e @ ExitsError::UnsupportedHeadKind { .. }) => {
            assert!(e.to_string().contains("head kind \"lstm\""), "{e}")
        }
        other => panic!("expected UnsupportedHeadKind, got {other:?}"),
    }
    // A block head without its shape in the metadata is named.
    let mut meta = serde_json::to_value(heads.meta())?;
    meta["heads"][0]["kind"] = "block".into();
    let info = HashMap::from([(META_KEY.to_string(), meta.to_string())]);
    let empty: Vec<(String, safetensors::tensor::TensorView<'_>)> = Vec::new();
    safetensors::tensor::serialize_to_file(empty, Some(info), &path)?;
    match file::load_unchecked(&path, &Device::Cpu) {
        Err(ExitsError::BadHeadsFile { detail, .. }) => {
            assert_eq!(detail, "the block head at depth 1 has no shape")
        }
        other => panic!("expected BadHeadsFile, got {other:?}"),
    }

    // A safetensors file without our metadata, and a file that is not safetensors at all.
    let plain = dir.path().join("plain.safetensors");
    let t = Tensor::zeros(2, candle_core::DType::F32, &Device::Cpu)?;
    candle_core::safetensors::save(&HashMap::from([("x".to_string(), t)]), &plain)?;
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"not a safetensors file")?;
    for p in [&plain, &junk] {
        assert!(matches!(
            file::load_unchecked(p, &Device::Cpu),
            Err(ExitsError::BadHeadsFile { .. })
        ));
    }
    // A missing weight tensor is named.
    let meta = serde_json::to_value(heads.meta())?;
    file::save(&heads, &path)?;
    let bytes = std::fs::read(&path)?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| !n.ends_with("weight"))
        .collect();
    let info = HashMap::from([(META_KEY.to_string(), meta.to_string())]);
    let broken = dir.path().join("broken.safetensors");
    safetensors::tensor::serialize_to_file(tensors, Some(info), &broken)?;
    match file::load_unchecked(&broken, &Device::Cpu) {
        Err(ExitsError::BadHeadsFile { detail, .. }) => {
            assert!(detail.contains("exit.1.weight"), "{detail}")
        }
        other => panic!("expected BadHeadsFile, got {other:?}"),
    }
    Ok(())
}

/// A trained MLP head with an exit probe, as `ee-tune` writes them.
fn trained_heads(m: &LayeredModel, sha: &str) -> anyhow::Result<ExitHeads> {
    let d = m.spec().d_model;
    let hidden = 2 * d;
    let dev = Device::Cpu;
    let ramp = |n: usize, k: usize| -> Vec<f32> {
        (0..n).map(|i| ((i * k % 17) as f32 - 8.0) / 40.0).collect()
    };
    let head = ExitHead::Mlp {
        weight_t: Tensor::from_vec(ramp(d * d, 7), (d, d), &dev)?,
        bias: Tensor::from_vec(ramp(d, 3), d, &dev)?,
        w1_t: Tensor::from_vec(ramp(d * hidden, 5), (d, hidden), &dev)?,
        b1: Tensor::from_vec(ramp(hidden, 11), hidden, &dev)?,
        w2_t: Tensor::from_vec(ramp(hidden * d, 13), (hidden, d), &dev)?,
    };
    let meta = HeadsMeta {
        format_version: FORMAT_VERSION,
        model: model_ref(m, "tiny", sha.to_string(), 123),
        heads: Vec::new(),
        calibration: None,
    };
    let probe = ExitProbe {
        weight: Tensor::from_vec(ramp(d, 9), (d, 1), &dev)?,
        bias: Tensor::from_vec(vec![0.25f32], 1, &dev)?,
    };
    Ok(ExitHeads::new(meta, BTreeMap::from([(2, head)]))?.with_probe(2, probe)?)
}

#[test]
fn trained_mlp_heads_and_probes_round_trip_bit_identically() -> anyhow::Result<()> {
    let m = synthetic(Architecture::Llama);
    let heads = trained_heads(&m, "cc33")?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("tiny.gguf.exits.mlp.safetensors");
    file::save(&heads, &path)?;
    let back = file::load(&path, &m, &fp("cc33"))?;
    assert_eq!(back.meta(), heads.meta());
    assert_eq!(back.head(2)?.kind(), switchyard_exits::HeadKind::Mlp);
    let x = m.embed(&[5, 6, 7, 8])?;
    let a = heads.logits(&m, 2, &x)?.to_vec2::<f32>()?;
    let b = back.logits(&m, 2, &x)?.to_vec2::<f32>()?;
    assert_eq!(a, b);
    // The MLP part is used: the same file without it gives other logits.
    let lin = match back.head(2)? {
        ExitHead::Mlp { weight_t, bias, .. } => ExitHead::Affine {
            weight_t: weight_t.clone(),
            bias: bias.clone(),
        },
        other => panic!("expected an MLP head, got {:?}", other.kind()),
    };
    let z = m.final_norm(&lin.translate(&x)?)?;
    assert_ne!(m.lm_head(&z)?.to_vec2::<f32>()?, b);
    // The probe's scores are identical too, and are probabilities.
    let zn = m.final_norm(&back.head(2)?.translate(&x)?)?;
    let (p, q) = (heads.probe(2), back.probe(2));
    let (Some(p), Some(q)) = (p, q) else {
        panic!("the probe did not round-trip");
    };
    let sp = p.score(&zn)?.to_vec1::<f32>()?;
    assert_eq!(sp, q.score(&zn)?.to_vec1::<f32>()?);
    assert!(sp.iter().all(|v| (0.0..=1.0).contains(v)), "{sp:?}");
    // Another model's file is refused.
    match file::load(&path, &m, &fp("dd44")) {
        Err(ExitsError::StaleHeads { heads_sha256, .. }) => assert_eq!(heads_sha256, "cc33"),
        other => panic!("expected StaleHeads, got {:?}", other.map(|h| h.depths())),
    }
    Ok(())
}

#[test]
fn block_heads_round_trip_bit_identically_and_refuse_rows_alone() -> anyhow::Result<()> {
    use switchyard_exits::block::{BlockHead, BlockKv};

    for arch in [Architecture::Llama, Architecture::Qwen2] {
        let m = synthetic(arch);
        let n = m.n_layers();
        let block = BlockHead::from_model_layer(&m, n - 1)?;
        let meta = HeadsMeta {
            format_version: FORMAT_VERSION,
            model: model_ref(&m, "tiny", "ee55".to_string(), 123),
            heads: Vec::new(),
            calibration: None,
        };
        let heads = ExitHeads::new(
            meta,
            BTreeMap::from([(1, ExitHead::Block(Box::new(block)))]),
        )?;
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("tiny.exits.block.safetensors");
        file::save(&heads, &path)?;
        let back = file::load(&path, &m, &fp("ee55"))?;
        assert_eq!(back.meta(), heads.meta());
        assert_eq!(back.sequential_depths(), vec![1]);
        let x = m.embed(&[5, 6, 7, 8, 9])?;
        let run = |h: &ExitHeads| -> anyhow::Result<Vec<Vec<f32>>> {
            // Two rows, then three more on the same K/V.
            let head = h.head(1)?;
            let mut kv = BlockKv::default();
            let a = head.translate_seq(&x.narrow(0, 0, 2)?, 0, Some(&mut kv))?;
            let b = head.translate_seq(&x.narrow(0, 2, 3)?, 2, Some(&mut kv))?;
            assert_eq!(kv.len(), 5);
            let y = Tensor::cat(&[a, b], 0)?;
            Ok(m.logits(&y)?.to_vec2::<f32>()?)
        };
        assert_eq!(run(&heads)?, run(&back)?, "{arch:?}");
        // The row-by-row seam refuses a block head, with the reason.
        match back.logits(&m, 1, &x) {
            Err(ExitsError::Invalid(why)) => {
                assert!(why.contains("attends over its sequence"), "{why}")
            }
            other => panic!(
                "expected a refusal, got {:?}",
                other.map(|t| t.dims().to_vec())
            ),
        }
        let seam: &dyn switchyard_engine::ExitHead = &back;
        assert!(seam.is_sequential(1));
        assert_eq!(seam.unservable(false), None);
        let why = seam.unservable(true).unwrap_or_default();
        assert!(
            why.starts_with("the exit heads at depths [1] are block heads"),
            "{why}"
        );
        let why = back
            .require_row_wise("HELIOS")
            .expect_err("HELIOS with block heads");
        assert!(
            why.to_string()
                .starts_with("HELIOS moves sequences between depths"),
            "{why}"
        );
        // A head file for another model is refused.
        assert!(matches!(
            file::load(&path, &m, &fp("ff66")),
            Err(ExitsError::StaleHeads { .. })
        ));
    }
    // Gemma 3 layers (extra norms, q/k norms, GELU) are not copied.
    let gemma = synthetic(Architecture::Gemma3);
    match BlockHead::from_model_layer(&gemma, 1) {
        Err(ExitsError::Invalid(why)) => assert_eq!(
            why,
            "block exit heads copy a llama or qwen2 layer; this model is gemma3"
        ),
        other => panic!("expected a refusal, got {:?}", other.map(|b| b.cfg)),
    }
    Ok(())
}
