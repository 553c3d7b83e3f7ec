//! Block exit heads on a real model (SmolLM2-135M): a copy of the last layer reproduces the
//! model's own last layer; per-token decoding through a block head with its own K/V gives the
//! logits of the block run over the whole sequence at once, under both K/V fixes; a short
//! `ee-tune --head block` run trains, scores, saves and resumes.

use std::sync::Arc;

use candle_core::{Tensor, D};
use switchyard_exit_study::{EarlyExitDecoder, ExitPolicy, KvFix};
use switchyard_exit_training::calibrate::hidden_states;
use switchyard_exit_training::corpus::Corpus;
use switchyard_exit_training::tune::run::{ee_tune, TuneConfig, TuneProgress, TuneTarget};
use switchyard_exits::block::BlockHead;
use switchyard_exits::fingerprint::fingerprint;
use switchyard_exits::heads::{model_ref, HeadsMeta, FORMAT_VERSION};
use switchyard_exits::{file, ConfidenceMeasure, ExitHead, ExitHeads, HeadKind};
use switchyard_models::{LayeredModel, LoadOptions, WeightFormat};
use switchyard_tokenizer::Tokenizer;

const MODEL: &str = "smollm2-135m-instruct";
const TEXT: &str = "The capital of France is Paris. The capital of Italy is Rome, and the";

fn open(format: WeightFormat) -> anyhow::Result<(std::path::PathBuf, LayeredModel, Tokenizer)> {
    let path = switchyard_zoo::ensure(MODEL)?;
    let src = switchyard_weights::open(&path)?;
    let tokenizer = Tokenizer::from_source(&*src)?;
    let opts = LoadOptions {
        format,
        ..LoadOptions::default()
    };
    let model = LayeredModel::load(Arc::clone(&src), &opts)?;
    Ok((path, model, tokenizer))
}

fn max_abs(t: &Tensor) -> anyhow::Result<f32> {
    Ok(t.abs()?.max_all()?.to_scalar::<f32>()?)
}

fn block_heads(model: &LayeredModel, depth: usize) -> anyhow::Result<ExitHeads> {
    let block = BlockHead::from_model_layer(model, model.n_layers() - 1)?;
    let meta = HeadsMeta {
        format_version: FORMAT_VERSION,
        model: model_ref(model, MODEL, String::new(), 0),
        heads: Vec::new(),
        calibration: None,
    };
    let mut heads = std::collections::BTreeMap::new();
    heads.insert(depth, ExitHead::Block(Box::new(block)));
    heads.insert(12, ExitHead::Identity);
    Ok(ExitHeads::new(meta, heads)?)
}

#[test]
fn a_copy_of_the_last_layer_reproduces_the_models_last_layer() -> anyhow::Result<()> {
    // f32 weights: the model's layer and the copy differ only in how they compute.
    let (_, model, tokenizer) = open(WeightFormat::F32)?;
    let n = model.n_layers();
    let ids = tokenizer.encode(TEXT, true, false)?;
    let (exits, last) = hidden_states(&model, &ids, &[n - 1])?;
    let block = BlockHead::from_model_layer(&model, n - 1)?;
    assert_eq!(block.cfg.init_layer, n - 1);
    assert_eq!((block.cfg.n_heads, block.cfg.n_kv_heads), (9, 3));
    let ours = block.forward(&exits[0], 0, None)?;
    let diff = max_abs(&(&ours - &last)?)?;
    let scale = max_abs(&last)?;
    assert!(diff <= 1e-4 * scale, "max |Δ| {diff} of {scale}");
    let a = model.logits(&ours)?.argmax(D::Minus1)?.to_vec1::<u32>()?;
    let b = model.logits(&last)?.argmax(D::Minus1)?.to_vec1::<u32>()?;
    assert_eq!(a, b);
    Ok(())
}

#[test]
fn per_token_exit_through_a_block_matches_the_block_over_the_whole_sequence() -> anyhow::Result<()>
{
    let (_, model, tokenizer) = open(WeightFormat::AsStored)?;
    let depth = 21;
    let heads = block_heads(&model, depth)?;
    let prompt = tokenizer.encode(TEXT, true, false)?;
    for fix in [KvFix::Recompute, KvFix::Propagate] {
        // Threshold 0: every token leaves at the block, whose K/V take every position.
        let policy = ExitPolicy {
            threshold: 0.0,
            measure: ConfidenceMeasure::MaxProb,
            depths: vec![depth],
            probe: false,
        };
        let mut dec = EarlyExitDecoder::new(&model, &heads, policy, fix)?;
        let (&last, head) = prompt.split_last().expect("a prompt");
        dec.prefill(head)?;
        let mut seq = prompt.clone();
        let mut logits = Vec::new();
        let mut token = last;
        for _ in 0..6 {
            let out = dec.step(token)?;
            assert_eq!(out.depth, depth);
            token = argmax(&out.logits);
            logits.push(out.logits);
            seq.push(token);
        }
        // The reference: layers 0..21 and the block over the whole sequence at once.
        let (exits, _) = hidden_states(&model, &seq, &[depth])?;
        let block = match heads.head(depth)? {
            ExitHead::Block(b) => b,
            other => panic!("expected a block, got {:?}", other.kind()),
        };
        let want = model.logits(&block.forward(&exits[0], 0, None)?)?;
        for (i, got) in logits.iter().enumerate() {
            let row = want.get(prompt.len() - 1 + i)?.to_vec1::<f32>()?;
            let diff = got
                .iter()
                .zip(&row)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff < 0.05, "{fix:?} step {i}: max |Δlogit| {diff}");
            assert_eq!(argmax(got), argmax(&row), "{fix:?} step {i}");
        }
        // Mixed exits (the logit lens at 12, the block at 21, full depth) keep every cache a
        // prefix: a block whose K/V fell behind would stop the step with an error.
        let policy = ExitPolicy {
            threshold: 0.25,
            measure: ConfidenceMeasure::MaxProb,
            depths: vec![12, depth],
            probe: false,
        };
        let mut dec = EarlyExitDecoder::new(&model, &heads, policy, fix)?;
        dec.prefill(head)?;
        let mut token = last;
        for _ in 0..12 {
            token = argmax(&dec.step(token)?.logits);
        }
        let h = &dec.counters().depth_histogram;
        assert_eq!(h.values().sum::<u64>(), 12, "{fix:?} {h:?}");
        assert!(h.len() >= 2, "{fix:?}: one depth only, {h:?}");
    }
    // A block head not checked from the start cannot join later.
    let mut dec = EarlyExitDecoder::new(
        &model,
        &heads,
        ExitPolicy {
            depths: vec![12],
            ..ExitPolicy::full_depth()
        },
        KvFix::Recompute,
    )?;
    dec.prefill(&prompt)?;
    let err = dec
        .set_policy(ExitPolicy::all_heads(&heads, 0.5))
        .expect_err("a late block head");
    assert!(
        err.to_string().contains("depth 21 was not checked so far"),
        "{err}"
    );
    Ok(())
}

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i as u32)
}

#[test]
fn a_short_block_run_trains_scores_saves_and_resumes() -> anyhow::Result<()> {
    let (path, model, tokenizer) = open(WeightFormat::AsStored)?;
    let fp = fingerprint(&path)?;
    let dir = tempfile::tempdir()?;
    let run = || -> anyhow::Result<_> {
        let target = TuneTarget {
            model: &model,
            tokenizer: &tokenizer,
            model_ref: model_ref(&model, MODEL, fp.sha256.clone(), fp.bytes),
            cache_dir: dir.path().join("cache"),
            checkpoint_dir: Some(dir.path().join("ckpt")),
        };
        let cfg = TuneConfig {
            tokens: 1024,
            eval_tokens: 256,
            epochs: 2,
            lr: 1e-3,
            seed: 3,
            ..TuneConfig::new(vec![24], HeadKind::Block)
        };
        let mut resumed = false;
        let out = ee_tune(&target, &Corpus::resolve("sharegpt")?, &cfg, |p| {
            resumed |= matches!(p, TuneProgress::Resumed { .. });
        })?;
        Ok((out, resumed))
    };
    let ((heads, report), resumed) = run()?;
    assert!(!resumed);
    let names: Vec<&str> = report.rows.iter().map(|r| r.head.as_str()).collect();
    assert_eq!(names, ["lens", "ridge", "block"]);
    let block = &report.rows[2];
    assert!(block.auroc_probe.is_some(), "{block:?}");
    assert!(
        (0.0..=1.0).contains(&block.agreement) && block.kl_nats > 0.0,
        "{block:?}"
    );
    // Training lowers the loss from the first epoch to the second.
    let curve = &report.loss_curves[0].epoch_loss;
    assert!(curve.len() == 2 && curve[1] < curve[0], "{curve:?}");
    // The check runs the block on a context's K/V, and the step to exit 24 is timed.
    let cost = &report.check_costs[0];
    assert!(
        cost.head_check_ms > 0.0 && cost.step_head_check_ms > 0.0,
        "{cost:?}"
    );
    assert_eq!(heads.meta().heads[0].kind, HeadKind::Block);
    assert!(heads.meta().heads[0].block.is_some());

    // Saved and loaded for this model, the head serves per-token exit with identical logits.
    let file_path = dir.path().join("smollm2.exits.block.safetensors");
    file::save(&heads, &file_path)?;
    let back = file::load(&file_path, &model, &fp)?;
    let ids = tokenizer.encode(TEXT, true, false)?;
    let decode = |h: &ExitHeads| -> anyhow::Result<Vec<Vec<f32>>> {
        let policy = ExitPolicy {
            threshold: 0.0,
            measure: ConfidenceMeasure::MaxProb,
            depths: vec![24],
            probe: true,
        };
        let mut dec = EarlyExitDecoder::new(&model, h, policy, KvFix::Propagate)?;
        dec.prefill(&ids[..ids.len() - 1])?;
        let mut token = ids[ids.len() - 1];
        let mut out = Vec::new();
        for _ in 0..3 {
            let step = dec.step(token)?;
            token = argmax(&step.logits);
            out.push(step.logits);
        }
        Ok(out)
    };
    assert_eq!(decode(&heads)?, decode(&back)?);

    // A second run with the same settings resumes the exit from its checkpoint.
    let ((again, _), resumed) = run()?;
    assert!(resumed);
    let params = |h: &ExitHeads| -> anyhow::Result<Vec<Vec<f32>>> {
        Ok(h.head(24)?
            .tensors()
            .iter()
            .map(|t| t.flatten_all()?.to_vec1::<f32>())
            .collect::<candle_core::Result<_>>()?)
    };
    assert_eq!(params(&heads)?, params(&again)?);
    Ok(())
}

/// Fixed-depth batched serving through a block head: the engine, holding layers 0..21, serves
/// three requests at once through a block at depth 21 and gives each the tokens per-token
/// decoding gives at that exit; the heads hold K/V only while the requests run; prefix caching
/// (which skips positions) is refused with the reason.
#[test]
fn the_batching_engine_serves_a_block_head_at_fixed_depth() -> anyhow::Result<()> {
    use switchyard_engine::{EngineConfig, EngineCore, EngineRequest, RequestId, SchedulerConfig};
    use switchyard_request::SamplingParams;

    let (_, full, tokenizer) = open(WeightFormat::AsStored)?;
    let depth = 21;
    let heads = block_heads(&full, depth)?;
    let prompts: Vec<Vec<u32>> = [
        TEXT,
        "Once upon a time, in a small village by the sea,",
        "def fibonacci(n):",
    ]
    .iter()
    .map(|t| tokenizer.encode(t, true, false))
    .collect::<Result<_, _>>()?;
    let new_tokens = 6;
    // The reference: per-token decoding, every token leaving at the block.
    let mut want = Vec::new();
    for p in &prompts {
        let policy = ExitPolicy {
            threshold: 0.0,
            measure: ConfidenceMeasure::MaxProb,
            depths: vec![depth],
            probe: false,
        };
        let mut dec = EarlyExitDecoder::new(&full, &heads, policy, KvFix::Recompute)?;
        let (&last, head) = p.split_last().expect("a prompt");
        dec.prefill(head)?;
        let mut token = last;
        let mut out = Vec::new();
        for _ in 0..new_tokens {
            token = argmax(&dec.step(token)?.logits);
            out.push(token);
        }
        want.push(out);
    }

    let shallow = |prefix_caching: bool| -> anyhow::Result<EngineCore> {
        let src = switchyard_weights::open(&switchyard_zoo::ensure(MODEL)?)?;
        let model = LayeredModel::load(
            src,
            &LoadOptions {
                layers: Some(depth),
                ..LoadOptions::default()
            },
        )?;
        let cfg = EngineConfig {
            scheduler: SchedulerConfig {
                prefix_caching,
                ..SchedulerConfig::default()
            },
            // The per-token reference holds exact f32 K/V.
            kv_format: switchyard_engine::KvFormat::F32,
            ..EngineConfig::default()
        };
        let eog = switchyard_engine::end_of_generation_tokens(&tokenizer);
        Ok(EngineCore::with_exit(
            model,
            Box::new(block_heads(&full, depth)?),
            eog,
            cfg,
        )?)
    };
    match shallow(true) {
        Err(e) => assert!(
            e.to_string().contains("serve them with prefix caching off"),
            "{e}"
        ),
        Ok(_) => panic!("prefix caching with a block head was accepted"),
    }
    let mut engine = shallow(false)?;
    assert_eq!(engine.depth(), depth);
    for (i, p) in prompts.iter().enumerate() {
        let mut params = SamplingParams::greedy(new_tokens);
        params.ignore_eos = true;
        engine.add_request(
            RequestId(i as u64),
            EngineRequest {
                prompt: p.clone(),
                params,
            },
        )?;
    }
    let mut got = vec![Vec::new(); prompts.len()];
    let mut largest_batch = 0;
    let mut held = 0;
    for _ in 0..100 {
        let r = engine.step();
        assert!(r.failed.is_empty(), "{:?}", r.failed);
        largest_batch = largest_batch.max(r.batch);
        held = held.max(engine.exit_head().state_bytes());
        for o in r.outputs {
            if let Some(t) = o.token {
                got[o.id.0 as usize].push(t);
            }
        }
        if got.iter().all(|g| g.len() == new_tokens) {
            break;
        }
    }
    assert_eq!(got, want);
    assert_eq!(largest_batch, prompts.len());
    // K/V of 3 K/V heads of 64 f32 values, K and V, per position held. Read after each step:
    // the largest is after the next-to-last step (every position but the last token's); the
    // last step finishes and releases all three.
    let positions: usize = prompts.iter().map(|p| p.len() + new_tokens - 2).sum();
    assert_eq!(held, positions * 2 * 3 * 64 * 4);
    assert_eq!(engine.exit_head().state_bytes(), 0);
    Ok(())
}
