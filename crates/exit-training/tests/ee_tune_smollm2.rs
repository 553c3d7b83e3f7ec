//! EE-Tuning on a real model (SmolLM2-135M): the frozen final norm and LM head that training
//! differentiates through equal the model's own; a short run trains, scores and saves heads
//! the serving path loads; the same seed gives bit-identical heads; an interrupted run
//! resumes its finished exits from the checkpoint.

use std::path::Path;
use std::sync::Arc;

use candle_core::D;
use switchyard_exit_study::{EarlyExitDecoder, ExitPolicy, KvFix};
use switchyard_exit_training::calibrate::hidden_states;
use switchyard_exit_training::corpus::Corpus;
use switchyard_exit_training::tune::run::{
    ee_tune, score_heads, TuneConfig, TuneProgress, TuneReport, TuneTarget,
};
use switchyard_exit_training::tune::Frozen;
use switchyard_exits::fingerprint::fingerprint;
use switchyard_exits::heads::{model_ref, ExitHead, HeadKind};
use switchyard_exits::{file, ConfidenceMeasure, ExitHeads, ExitsError};
use switchyard_models::{LayeredModel, LoadOptions};
use switchyard_tokenizer::Tokenizer;

const MODEL: &str = "smollm2-135m-instruct";
const DEPTHS: &[usize] = &[12, 21];

fn open() -> anyhow::Result<(std::path::PathBuf, LayeredModel, Tokenizer)> {
    let path = switchyard_zoo::ensure(MODEL)?;
    let src = switchyard_weights::open(&path)?;
    let tokenizer = Tokenizer::from_source(&*src)?;
    let model = LayeredModel::load(Arc::clone(&src), &LoadOptions::default())?;
    Ok((path, model, tokenizer))
}

fn params(h: &ExitHead) -> anyhow::Result<Vec<Vec<f32>>> {
    Ok(h.tensors()
        .iter()
        .map(|t| t.flatten_all()?.to_vec1::<f32>())
        .collect::<candle_core::Result<_>>()?)
}

#[test]
fn the_frozen_head_is_the_models_own() -> anyhow::Result<()> {
    let (_, model, tokenizer) = open()?;
    let ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.", true, false)?;
    let (_, last) = hidden_states(&model, &ids, &[])?;
    let frozen = Frozen::from_model(&model)?;
    let ours = frozen.logits(&frozen.norm(&last)?)?;
    let theirs = model.logits(&last)?;
    // The serving head quantizes activations to 8 bits; the f32 head does not.
    let diff = (&ours - &theirs)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let scale = theirs.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff <= 0.02 * scale, "max |Δlogit| {diff} of {scale}");
    let a = ours.argmax(D::Minus1)?.to_vec1::<u32>()?;
    let b = theirs.argmax(D::Minus1)?.to_vec1::<u32>()?;
    let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
    assert!(
        same + 1 >= a.len(),
        "argmax agrees on {same} of {}",
        a.len()
    );
    Ok(())
}

fn tune(
    model: &LayeredModel,
    tokenizer: &Tokenizer,
    path: &Path,
    cache: &Path,
    ckpt: &Path,
    kind: HeadKind,
) -> anyhow::Result<(ExitHeads, Vec<usize>, TuneReport)> {
    let fp = fingerprint(path)?;
    let target = TuneTarget {
        model,
        tokenizer,
        model_ref: model_ref(model, MODEL, fp.sha256, fp.bytes),
        cache_dir: cache.to_path_buf(),
        checkpoint_dir: Some(ckpt.to_path_buf()),
    };
    let cfg = TuneConfig {
        tokens: 1024,
        eval_tokens: 256,
        epochs: 1,
        seed: 5,
        ..TuneConfig::new(DEPTHS.to_vec(), kind)
    };
    let mut resumed = Vec::new();
    let (heads, report) = ee_tune(&target, &Corpus::resolve("sharegpt")?, &cfg, |p| {
        if let TuneProgress::Resumed { depth } = p {
            resumed.push(depth);
        }
    })?;
    // Lens, ridge and trained rows per depth, each with figures in range.
    assert_eq!(report.rows.len(), 3 * DEPTHS.len());
    for r in &report.rows {
        assert!((0.0..=1.0).contains(&r.agreement), "{r:?}");
        assert!(r.kl_nats >= 0.0 && r.bits_per_byte > 0.0, "{r:?}");
    }
    let trained: Vec<_> = report.rows.iter().filter(|r| r.head == "mlp").collect();
    assert!(trained.iter().all(|r| r.auroc_probe.is_some()));
    // Every exit's wall time is recorded, and together they fit in the run's.
    let per_exit: Vec<f64> = report.loss_curves.iter().map(|c| c.seconds).collect();
    assert_eq!(per_exit.len(), DEPTHS.len());
    assert!(per_exit.iter().all(|&s| s > 0.0), "{per_exit:?}");
    assert!(
        per_exit.iter().sum::<f64>() <= report.seconds,
        "{per_exit:?}"
    );
    // The probe's check is far cheaper than the vocabulary head's.
    assert_eq!(report.check_costs.len(), DEPTHS.len());
    for c in &report.check_costs {
        assert!(
            c.probe_check_ms.is_some_and(|p| p < c.head_check_ms),
            "{c:?}"
        );
    }
    Ok((heads, resumed, report))
}

#[test]
fn a_short_run_trains_saves_reproduces_and_resumes() -> anyhow::Result<()> {
    let (path, model, tokenizer) = open()?;
    let dir = tempfile::tempdir()?;
    let cache = dir.path().join("cache");
    let (a, resumed_a, report_a) = tune(
        &model,
        &tokenizer,
        &path,
        &cache,
        &dir.path().join("a"),
        HeadKind::Mlp,
    )?;
    assert!(resumed_a.is_empty());
    let (b, _, _) = tune(
        &model,
        &tokenizer,
        &path,
        &cache,
        &dir.path().join("b"),
        HeadKind::Mlp,
    )?;
    // The same seed, the same heads, bit for bit.
    for &d in DEPTHS {
        assert_eq!(params(a.head(d)?)?, params(b.head(d)?)?, "depth {d}");
    }
    // A second run over the first one's checkpoints resumes every finished exit.
    let (c, resumed_c, _) = tune(
        &model,
        &tokenizer,
        &path,
        &cache,
        &dir.path().join("a"),
        HeadKind::Mlp,
    )?;
    assert_eq!(resumed_c, DEPTHS.to_vec());
    for &d in DEPTHS {
        assert_eq!(params(a.head(d)?)?, params(c.head(d)?)?, "depth {d}");
    }

    // `eval exits --head`: the same held-out rows score the same heads the same way.
    let fp = fingerprint(&path)?;
    let target = TuneTarget {
        model: &model,
        tokenizer: &tokenizer,
        model_ref: model_ref(&model, MODEL, fp.sha256, fp.bytes),
        cache_dir: cache.clone(),
        checkpoint_dir: None,
    };
    let (rows, costs, _) = score_heads(
        &target,
        &Corpus::resolve("sharegpt")?,
        &[("a".to_string(), &a)],
        256,
        switchyard_exit_training::corpus::DEFAULT_DOC_TOKENS,
        |_, _| {},
    )?;
    assert_eq!(rows.len(), 2 * DEPTHS.len());
    assert_eq!(costs.len(), DEPTHS.len());
    // Measured decode steps: every figure positive, and a step that stops at the shallowest
    // exit (12 of 30 layers, then the check through the vocabulary head) faster than a
    // full-depth one.
    for c in &costs {
        assert_eq!(c.head, "a (mlp)");
        let probe = c.step_probe_check_ms.unwrap_or(f64::NAN);
        assert!(
            c.step_head_check_ms > 0.0 && probe > 0.0 && c.full_depth_step_ms > 0.0,
            "{c:?}"
        );
    }
    let shallowest = costs
        .iter()
        .find(|c| c.depth == DEPTHS[0])
        .expect("a cost at the shallowest exit");
    assert!(
        shallowest.full_depth_step_ms > shallowest.step_head_check_ms,
        "{shallowest:?}"
    );
    // So is a batch of 8 at that depth against the same batch at full depth.
    assert!(
        shallowest.batch_step_full_ms > shallowest.batch_step_exit_ms,
        "{shallowest:?}"
    );
    let json = serde_json::to_value(shallowest)?;
    for field in [
        "step_head_check_ms",
        "step_probe_check_ms",
        "full_depth_step_ms",
        "batch_step_exit_ms",
        "batch_step_full_ms",
    ] {
        assert!(json[field].as_f64().is_some_and(|v| v > 0.0), "{json}");
    }
    for &d in DEPTHS {
        let mine = rows.iter().find(|r| r.depth == d && r.head == "a (mlp)");
        let theirs = report_a
            .rows
            .iter()
            .find(|r| r.depth == d && r.head == "mlp");
        let (Some(mine), Some(theirs)) = (mine, theirs) else {
            panic!("depth {d} is missing: {rows:?}");
        };
        assert_eq!(mine.agreement, theirs.agreement);
        assert_eq!(mine.kl_nats, theirs.kl_nats);
        assert_eq!(mine.auroc_probe, theirs.auroc_probe);
    }

    // Saved beside the model, loaded as the serving path loads heads: the same logits.
    let out = dir.path().join("heads.safetensors");
    file::save(&a, &out)?;
    let back = file::load(&out, &model, &fingerprint(&path)?)?;
    let ids = tokenizer.encode("Once upon a time", true, false)?;
    let (exits, _) = hidden_states(&model, &ids, DEPTHS)?;
    for (&d, h) in DEPTHS.iter().zip(&exits) {
        assert_eq!(back.head(d)?.kind(), HeadKind::Mlp);
        assert_eq!(
            a.logits(&model, d, h)?.to_vec2::<f32>()?,
            back.logits(&model, d, h)?.to_vec2::<f32>()?
        );
        assert!(back.probe(d).is_some());
    }

    // Per-token exit decided by the probes: threshold 0 exits every token at the first exit
    // with that head's logits, threshold 1 never exits; heads without probes are refused.
    let (prefix, last) = ids.split_at(ids.len() - 1);
    let policy = |threshold: f32| ExitPolicy {
        threshold,
        measure: ConfidenceMeasure::MaxProb,
        depths: DEPTHS.to_vec(),
        probe: true,
    };
    let step = |threshold: f32| -> anyhow::Result<(usize, Vec<f32>)> {
        let mut dec = EarlyExitDecoder::new(&model, &back, policy(threshold), KvFix::Recompute)?;
        dec.prefill(prefix)?;
        let out = dec.step(last[0])?;
        Ok((out.depth, out.logits))
    };
    let (depth, logits) = step(0.0)?;
    assert_eq!(depth, DEPTHS[0]);
    let at_exit = back
        .logits(&model, DEPTHS[0], &exits[0].narrow(0, ids.len() - 1, 1)?)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i)
    };
    assert_eq!(argmax(&logits), argmax(&at_exit));
    assert_eq!(step(1.0)?.0, model.n_layers());
    let lens = ExitHeads::logit_lens(&model, MODEL, DEPTHS)?;
    match EarlyExitDecoder::new(&model, &lens, policy(0.5), KvFix::Recompute) {
        Err(e @ ExitsError::NoProbe { .. }) => assert!(e.to_string().contains("ee-tune"), "{e}"),
        Err(e) => panic!("expected NoProbe, got {e}"),
        Ok(_) => panic!("expected NoProbe, got a decoder"),
    }
    Ok(())
}
