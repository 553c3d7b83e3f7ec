//! `switchyard ee-tune` end to end: cache the hidden states, fit the ridge starting point,
//! train each exit's head, fit its probe, score lens / ridge / trained side by side on
//! held-out rows, time each exit's check, and return the heads ready to save.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use candle_core::{Tensor, D};
use serde::{Deserialize, Serialize};
use switchyard_models::LayeredModel;
use switchyard_tokenizer::Tokenizer;

use super::cache::{CacheKey, HiddenCache};
use super::cost::{CheckCost, StepTimer};
use super::eval::{observe, score, HeadScores};
use super::{epoch_order, fit_probe, optimizer, train_step, Batch, Frozen, Trainable};
use crate::corpus::{Corpus, Split, HELD_OUT_EVERY};
use crate::ridge::RidgeStats;
use switchyard_exits::block::BlockHead;
use switchyard_exits::heads::{
    CalibrationInfo, ExitHead, ExitHeads, ExitProbe, HeadInfo, HeadKind, HeadsMeta, ModelRef,
    TrainedInfo, FORMAT_VERSION,
};
use switchyard_exits::{ExitsError, Result};

/// Training rows by default. Each row costs three products with the vocabulary matrix per
/// epoch (target, exit, gradient), about 2 ms each for SmolLM2-135M on 2 cores (a small
/// run's total time divided by its products). Measured with the defaults (9 exits, 2 epochs,
/// plus the probe and the held-out scoring): about 1 min for the cache, then 2.5-3.8 min per
/// exit (about 26 min in all) with the 2 cores lightly shared, and 3.5-5.1 min per exit
/// (41 min in all) with them shared at a load average of 5. Larger vocabularies cost
/// proportionally more.
pub const DEFAULT_TOKENS: usize = 8192;
/// Held-out rows scored by default.
pub const DEFAULT_EVAL_TOKENS: usize = 4096;
pub const DEFAULT_EPOCHS: usize = 2;
pub const DEFAULT_BATCH: usize = 64;
/// Relative ridge λ of the affine starting point (the middle of calibration's candidates).
pub const DEFAULT_LAMBDA_REL: f64 = 1e-3;
/// Epochs of the probe's logistic regression.
pub const PROBE_EPOCHS: usize = 4;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TuneConfig {
    pub depths: Vec<usize>,
    pub kind: HeadKind,
    pub tokens: usize,
    pub eval_tokens: usize,
    pub doc_tokens: usize,
    pub epochs: usize,
    pub batch: usize,
    pub lr: f64,
    /// Weight of the next-token cross-entropy added to the KL loss (0: KL only).
    pub ce_weight: f64,
    pub lambda_rel: f64,
    pub seed: u64,
}

impl TuneConfig {
    pub fn new(depths: Vec<usize>, kind: HeadKind) -> Self {
        Self {
            depths,
            kind,
            tokens: DEFAULT_TOKENS,
            eval_tokens: DEFAULT_EVAL_TOKENS,
            doc_tokens: crate::corpus::DEFAULT_DOC_TOKENS,
            epochs: DEFAULT_EPOCHS,
            batch: DEFAULT_BATCH,
            lr: super::DEFAULT_LR,
            ce_weight: 0.0,
            lambda_rel: DEFAULT_LAMBDA_REL,
            seed: 0,
        }
    }
}

/// The model being tuned and where intermediate files go.
pub struct TuneTarget<'a> {
    pub model: &'a LayeredModel,
    pub tokenizer: &'a Tokenizer,
    pub model_ref: ModelRef,
    /// Hidden-state caches (reused across runs).
    pub cache_dir: PathBuf,
    /// Finished exits are checkpointed here and skipped when a run with the same
    /// configuration is resumed.
    pub checkpoint_dir: Option<PathBuf>,
}

#[derive(Debug, Clone)]
pub enum TuneProgress {
    Cache {
        split: &'static str,
        rows: usize,
        total: usize,
    },
    Train {
        depth: usize,
        epoch: usize,
        step: usize,
        steps: usize,
        loss: f64,
    },
    Resumed {
        depth: usize,
    },
    Scored {
        depth: usize,
    },
}

#[derive(Debug, Clone, Serialize)]
pub struct LossCurve {
    pub depth: usize,
    /// Mean training loss of each epoch (KL + weighted CE, nats).
    pub epoch_loss: Vec<f64>,
    /// Whether the exit came from a checkpoint (no curve then).
    pub resumed: bool,
    /// Wall time of the exit: ridge fit, training (or restoring), probe, held-out scoring and
    /// check timing.
    pub seconds: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct TuneReport {
    pub model: String,
    pub n_layers: usize,
    pub corpus: String,
    pub config: TuneConfig,
    pub train_rows: usize,
    pub eval_rows: usize,
    pub eval_bytes: u64,
    /// Bits per byte of the held-out next tokens at full depth.
    pub full_depth_bits_per_byte: f64,
    /// Per depth: the logit lens, the ridge starting point and the trained head.
    pub rows: Vec<HeadScores>,
    pub check_costs: Vec<CheckCost>,
    pub loss_curves: Vec<LossCurve>,
    pub seconds: f64,
}

/// Trains heads of `cfg.kind` at `cfg.depths` on the calibration split of `corpus` and scores
/// them on its held-out split.
pub fn ee_tune(
    target: &TuneTarget<'_>,
    corpus: &Corpus,
    cfg: &TuneConfig,
    mut progress: impl FnMut(TuneProgress),
) -> Result<(ExitHeads, TuneReport)> {
    let t0 = Instant::now();
    let model = target.model;
    let n_layers = model.n_layers();
    if cfg.depths.is_empty() {
        return Err(ExitsError::Invalid("no exit depths to train".into()));
    }
    if let Some(&depth) = cfg.depths.iter().find(|&&d| d == 0 || d >= n_layers) {
        return Err(ExitsError::BadDepth {
            depth,
            max: n_layers - 1,
            n_layers,
        });
    }
    if !matches!(cfg.kind, HeadKind::Affine | HeadKind::Mlp | HeadKind::Block) {
        return Err(ExitsError::Invalid(format!(
            "ee-tune trains affine, mlp and block heads, not {}",
            cfg.kind.as_str()
        )));
    }
    // A block starts as a copy of the last layer (EE-LLM's initialisation); checked before
    // the cache is built, so an unsupported architecture fails at once.
    let block_init = match cfg.kind {
        HeadKind::Block => Some(ExitHead::Block(Box::new(BlockHead::from_model_layer(
            model,
            n_layers - 1,
        )?))),
        _ => None,
    };
    let dev = model.device().clone();
    let d = model.spec().d_model;
    let open = |split: Split, rows: usize, name: &'static str, p: &mut dyn FnMut(TuneProgress)| {
        let key = CacheKey {
            model_sha256: &target.model_ref.sha256,
            corpus,
            split,
            depths: &cfg.depths,
            doc_tokens: cfg.doc_tokens,
            rows,
        };
        HiddenCache::open_or_build(&target.cache_dir, &key, model, target.tokenizer, |r, t| {
            p(TuneProgress::Cache {
                split: name,
                rows: r,
                total: t,
            })
        })
    };
    let train = open(Split::Calibration, cfg.tokens, "train", &mut progress)?;
    let held = open(Split::HeldOut, cfg.eval_tokens, "held-out", &mut progress)?;
    let frozen = Frozen::from_model(model)?;
    let last_train = train.slot(train.final_slot(), &dev)?;
    let last_eval = held.slot(held.final_slot(), &dev)?;
    let next_train = Tensor::from_slice(&train.meta.next_tokens, train.rows(), &dev)?;
    let next_eval = &held.meta.next_tokens;
    let mut steps = StepTimer::new(model, next_eval)?;
    let ckpt = target
        .checkpoint_dir
        .as_deref()
        .map(|dir| Checkpoints::open(dir, &target.model_ref.sha256, cfg))
        .transpose()?;

    let mut rows = Vec::new();
    let mut costs = Vec::new();
    let mut curves = Vec::new();
    let mut heads = BTreeMap::new();
    let mut probes: Vec<(usize, ExitProbe)> = Vec::new();
    let mut infos = Vec::new();
    let mut full_bpb = f64::NAN;
    for (slot, &depth) in cfg.depths.iter().enumerate() {
        let t_exit = Instant::now();
        let _span = tracing::debug_span!("ee_tune_exit", depth).entered();
        let x_train = train.slot(slot, &dev)?;
        let x_eval = held.slot(slot, &dev)?;
        let ridge = ridge_head(&x_train, &last_train, cfg.lambda_rel, depth)?;
        for (name, h) in [("lens", &ExitHead::Identity), ("ridge", &ridge)] {
            let o = observe(h, None, &frozen, &x_eval, &last_eval, next_eval)?;
            full_bpb = super::eval::bits_per_byte(&o.nll_final, held.meta.bytes);
            rows.push(score(depth, name, &o, held.meta.bytes));
        }

        let seed = cfg.seed ^ ((depth as u64) << 32);
        let trainable = Trainable::new(
            cfg.kind,
            block_init.as_ref().unwrap_or(&ridge),
            d,
            seed,
            &dev,
        )?;
        let resumed = match &ckpt {
            Some(c) => c.restore(depth, &trainable)?,
            None => false,
        };
        let mut epoch_loss = Vec::new();
        if resumed {
            progress(TuneProgress::Resumed { depth });
        } else {
            let mut opt = optimizer(&trainable, cfg.lr)?;
            let mut step_on = |x: &Tensor, idx: &Tensor, offset: usize| -> Result<f64> {
                let target_lp = frozen.log_probs(&last_train.index_select(idx, 0)?)?;
                let next = next_train.index_select(idx, 0)?;
                let batch = Batch {
                    x,
                    target_log_probs: &target_lp,
                    next: &next,
                    offset,
                };
                Ok(train_step(&trainable, &mut opt, &frozen, &batch, cfg.ce_weight)?.total)
            };
            // Row-wise heads train on shuffled batches of rows; a block on one whole document
            // per step (its position-0 row attended to, not scored), documents shuffled.
            let sequential = cfg.kind == HeadKind::Block;
            let units = if sequential {
                train.documents()
            } else {
                train.rows()
            };
            let per_step = if sequential { 1 } else { cfg.batch.max(1) };
            let steps = units.div_ceil(per_step);
            for epoch in 0..cfg.epochs {
                let order = epoch_order(units, seed ^ epoch as u64);
                let mut sum = 0.0;
                for (step, chunk) in order.chunks(per_step).enumerate() {
                    // The scored rows: the document's, or the batch's.
                    let rows: Vec<u32> = if sequential {
                        train.doc_rows(chunk[0]).map(|r| r as u32).collect()
                    } else {
                        chunk.iter().map(|&r| r as u32).collect()
                    };
                    let n = rows.len();
                    let idx = Tensor::from_vec(rows, n, &dev)?;
                    let loss = if sequential {
                        step_on(&train.document(slot, chunk[0], &dev)?, &idx, 1)?
                    } else {
                        step_on(&x_train.index_select(&idx, 0)?, &idx, 0)?
                    };
                    sum += loss * n as f64;
                    progress(TuneProgress::Train {
                        depth,
                        epoch,
                        step: step + 1,
                        steps,
                        loss,
                    });
                }
                epoch_loss.push(sum / train.rows().max(1) as f64);
            }
        }
        let head = trainable.to_head()?;
        // A block head's output on every cached row, run document by document; row-wise heads
        // are applied row by row where they are scored.
        let seq_train = translate_docs(&head, &train, slot, &dev)?;
        let seq_eval = translate_docs(&head, &held, slot, &dev)?;
        let (scored, x_train_scored, x_eval_scored) = match (&seq_train, &seq_eval) {
            (Some(t), Some(e)) => (&ExitHead::Identity, t, e),
            _ => (&head, &x_train, &x_eval),
        };
        let probe = match &ckpt {
            Some(c) if resumed => c.probe(depth, &dev)?,
            _ => None,
        };
        let probe = match probe {
            Some(p) => p,
            None => {
                let (features, labels) = probe_data(scored, &frozen, x_train_scored, &last_train)?;
                fit_probe(&features, &labels, PROBE_EPOCHS, 256, seed)?
            }
        };
        if let (Some(c), false) = (&ckpt, resumed) {
            c.save(depth, &trainable, &probe)?;
        }
        let o = observe(
            scored,
            Some(&probe),
            &frozen,
            x_eval_scored,
            &last_eval,
            next_eval,
        )?;
        let s = score(depth, cfg.kind.as_str(), &o, held.meta.bytes);
        infos.push(HeadInfo {
            depth,
            kind: cfg.kind,
            lambda_rel: Some(cfg.lambda_rel),
            validation_r2: None,
            validation_r2_identity: None,
            block: None,
            trained: Some(TrainedInfo {
                epochs: cfg.epochs,
                tokens: train.rows() as u64,
                seed: cfg.seed,
                ce_weight: cfg.ce_weight,
                held_out_agreement: s.agreement,
                held_out_kl_nats: s.kl_nats,
                probe_auroc: s.auroc_probe,
            }),
        });
        rows.push(s);
        costs.push(steps.cost(depth, cfg.kind.as_str(), &head, Some(&probe))?);
        heads.insert(depth, head);
        probes.push((depth, probe));
        let seconds = t_exit.elapsed().as_secs_f64();
        tracing::info!(depth, seconds, resumed, "exit trained and scored");
        curves.push(LossCurve {
            depth,
            epoch_loss,
            resumed,
            seconds,
        });
        progress(TuneProgress::Scored { depth });
    }
    let seconds = t0.elapsed().as_secs_f64();
    let meta = HeadsMeta {
        format_version: FORMAT_VERSION,
        model: target.model_ref.clone(),
        heads: infos,
        calibration: Some(CalibrationInfo {
            corpus: corpus.name().to_string(),
            tokens: train.rows() as u64,
            sequences: train.meta.documents,
            max_sequence_tokens: cfg.doc_tokens,
            held_out: format!(
                "documents i with i % {HELD_OUT_EVERY} == {} (evaluation)",
                HELD_OUT_EVERY - 1
            ),
            lambda_candidates: vec![cfg.lambda_rel],
            seconds,
            created_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }),
    };
    let mut out = ExitHeads::new(meta, heads)?;
    for (depth, p) in probes {
        out = out.with_probe(depth, p)?;
    }
    let report = TuneReport {
        model: target.model_ref.name.clone(),
        n_layers,
        corpus: corpus.name().to_string(),
        config: cfg.clone(),
        train_rows: train.rows(),
        eval_rows: held.rows(),
        eval_bytes: held.meta.bytes,
        full_depth_bits_per_byte: full_bpb,
        rows,
        check_costs: costs,
        loss_curves: curves,
        seconds,
    };
    Ok((out, report))
}

/// Held-out scores of several sets of heads side by side (`eval exits --head`): per depth of
/// each set, the logit lens once, then every set's head there, probes included, with each
/// head's check costs ([`super::cost`]). The rows of `cfg`'s held-out split are cached like
/// ee-tune's.
pub fn score_heads(
    target: &TuneTarget<'_>,
    corpus: &Corpus,
    sets: &[(String, &ExitHeads)],
    eval_tokens: usize,
    doc_tokens: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<(Vec<HeadScores>, Vec<CheckCost>, f64)> {
    let model = target.model;
    let dev = model.device().clone();
    let mut depths: Vec<usize> = sets.iter().flat_map(|(_, h)| h.depths()).collect();
    depths.sort_unstable();
    depths.dedup();
    if depths.is_empty() {
        return Err(ExitsError::Invalid("no exit heads to score".into()));
    }
    let key = CacheKey {
        model_sha256: &target.model_ref.sha256,
        corpus,
        split: Split::HeldOut,
        depths: &depths,
        doc_tokens,
        rows: eval_tokens,
    };
    let held = HiddenCache::open_or_build(
        &target.cache_dir,
        &key,
        model,
        target.tokenizer,
        &mut progress,
    )?;
    let frozen = Frozen::from_model(model)?;
    let last = held.slot(held.final_slot(), &dev)?;
    let next = &held.meta.next_tokens;
    let mut steps = StepTimer::new(model, next)?;
    let mut rows = Vec::new();
    let mut costs = Vec::new();
    let mut full_bpb = f64::NAN;
    for (slot, &depth) in depths.iter().enumerate() {
        let x = held.slot(slot, &dev)?;
        let o = observe(&ExitHead::Identity, None, &frozen, &x, &last, next)?;
        full_bpb = super::eval::bits_per_byte(&o.nll_final, held.meta.bytes);
        rows.push(score(depth, "lens", &o, held.meta.bytes));
        for (name, heads) in sets {
            let Ok(head) = heads.head(depth) else {
                continue;
            };
            let probe = heads.probe(depth);
            let o = match translate_docs(head, &held, slot, &dev)? {
                Some(y) => observe(&ExitHead::Identity, probe, &frozen, &y, &last, next)?,
                None => observe(head, probe, &frozen, &x, &last, next)?,
            };
            let label = format!("{name} ({})", head.kind().as_str());
            rows.push(score(depth, &label, &o, held.meta.bytes));
            costs.push(steps.cost(depth, &label, head, probe)?);
        }
    }
    Ok((rows, costs, full_bpb))
}

/// A sequential (block) head's output on every row of `cache` at `slot`, document by
/// document, each from its position 0; `None` for row-wise heads.
fn translate_docs(
    head: &ExitHead,
    cache: &HiddenCache,
    slot: usize,
    dev: &candle_core::Device,
) -> Result<Option<Tensor>> {
    if !head.is_sequential() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(cache.documents());
    for doc in 0..cache.documents() {
        let rows = cache.doc_rows(doc).len();
        let y = head.translate_seq(&cache.document(slot, doc, dev)?, 0, None)?;
        out.push(y.narrow(0, 1, rows)?);
    }
    Ok(Some(Tensor::cat(&out, 0)?))
}

/// The ridge solution mapping exit rows to final rows (the tuned lens), the starting point.
fn ridge_head(x: &Tensor, y: &Tensor, lambda_rel: f64, depth: usize) -> Result<ExitHead> {
    let (rows, d) = x.dims2()?;
    let mut stats = RidgeStats::new(d, d, x.device())?;
    for lo in (0..rows).step_by(1024) {
        let n = 1024.min(rows - lo);
        stats.add(&x.narrow(0, lo, n)?, &y.narrow(0, lo, n)?)?;
    }
    let a = stats
        .solve(lambda_rel)?
        .ok_or(ExitsError::NotPositiveDefinite {
            depth,
            lambda: lambda_rel,
        })?;
    ExitHead::from_affine(&a, x.device())
}

/// The probe's training data: the exit's normed states and whether its top-1 agrees.
fn probe_data(
    head: &ExitHead,
    frozen: &Frozen,
    x: &Tensor,
    last: &Tensor,
) -> Result<(Tensor, Vec<f32>)> {
    let rows = x.dim(0)?;
    let mut feats = Vec::new();
    let mut labels = Vec::with_capacity(rows);
    for lo in (0..rows).step_by(super::eval::EVAL_ROWS) {
        let n = super::eval::EVAL_ROWS.min(rows - lo);
        let z = frozen.norm(&head.translate(&x.narrow(0, lo, n)?)?)?;
        let a = frozen.logits(&z)?.argmax(D::Minus1)?.to_vec1::<u32>()?;
        let zf = frozen.norm(&last.narrow(0, lo, n)?)?;
        let b = frozen.logits(&zf)?.argmax(D::Minus1)?.to_vec1::<u32>()?;
        labels.extend(a.iter().zip(&b).map(|(a, b)| f32::from(u8::from(a == b))));
        feats.push(z);
    }
    Ok((Tensor::cat(&feats, 0)?, labels))
}

/// Checkpoints of finished exits: `config.json` (the run's configuration and model hash) and
/// per exit `depth-<d>.safetensors` with the head's and the probe's tensors. A directory made
/// by another configuration is cleared.
struct Checkpoints {
    dir: PathBuf,
}

#[derive(Serialize, Deserialize, PartialEq)]
struct CheckpointKey {
    model_sha256: String,
    config: TuneConfig,
}

impl Checkpoints {
    fn open(dir: &Path, sha: &str, cfg: &TuneConfig) -> Result<Self> {
        let key = CheckpointKey {
            model_sha256: sha.to_string(),
            config: cfg.clone(),
        };
        let path = dir.join("config.json");
        let same = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<CheckpointKey>(&b).ok())
            .is_some_and(|k| k == key);
        if !same && dir.exists() {
            std::fs::remove_dir_all(dir).map_err(ExitsError::io(dir))?;
        }
        std::fs::create_dir_all(dir).map_err(ExitsError::io(dir))?;
        let json = serde_json::to_vec_pretty(&key)
            .map_err(|e| ExitsError::Internal(format!("checkpoint key as JSON: {e}")))?;
        std::fs::write(&path, json).map_err(ExitsError::io(&path))?;
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    fn path(&self, depth: usize) -> PathBuf {
        self.dir.join(format!("depth-{depth}.safetensors"))
    }

    fn save(&self, depth: usize, head: &Trainable, probe: &ExitProbe) -> Result<()> {
        let mut map: std::collections::HashMap<String, Tensor> =
            head.tensors()?.into_iter().collect();
        map.insert("probe.weight".into(), probe.weight.clone());
        map.insert("probe.bias".into(), probe.bias.clone());
        let tmp = self.dir.join(format!("depth-{depth}.tmp"));
        candle_core::safetensors::save(&map, &tmp)?;
        let path = self.path(depth);
        std::fs::rename(&tmp, &path).map_err(ExitsError::io(&path))
    }

    /// Restores a finished exit into `head`; false when there is none.
    fn restore(&self, depth: usize, head: &Trainable) -> Result<bool> {
        let path = self.path(depth);
        if !path.exists() {
            return Ok(false);
        }
        let map = candle_core::safetensors::load(&path, &candle_core::Device::Cpu)?;
        head.restore(&map)?;
        Ok(true)
    }

    fn probe(&self, depth: usize, dev: &candle_core::Device) -> Result<Option<ExitProbe>> {
        let path = self.path(depth);
        if !path.exists() {
            return Ok(None);
        }
        let map = candle_core::safetensors::load(&path, dev)?;
        match (map.get("probe.weight"), map.get("probe.bias")) {
            (Some(w), Some(b)) => Ok(Some(ExitProbe {
                weight: w.clone(),
                bias: b.clone(),
            })),
            _ => Ok(None),
        }
    }
}

impl TuneReport {
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let c = &self.config;
        let _ = writeln!(
            s,
            "### ee-tune: {} ({} layers), {} heads\n\n{} training rows of {} ({} epochs, batch {}, lr {}, CE weight {}, seed {}), {} held-out rows ({} bytes); full depth {:.4} bits per byte. {:.1} s.\n",
            self.model,
            self.n_layers,
            c.kind.as_str(),
            self.train_rows,
            self.corpus,
            c.epochs,
            c.batch,
            c.lr,
            c.ce_weight,
            c.seed,
            self.eval_rows,
            self.eval_bytes,
            self.full_depth_bits_per_byte,
            self.seconds
        );
        s.push_str(&super::eval::scores_table(
            &self.rows,
            self.full_depth_bits_per_byte,
        ));
        s.push('\n');
        s.push_str(&CheckCost::table_header(&[
            "training loss per epoch",
            "exit time (s)",
        ]));
        for (cost, curve) in self.check_costs.iter().zip(&self.loss_curves) {
            let losses = if curve.resumed {
                "(checkpoint)".to_string()
            } else {
                curve
                    .epoch_loss
                    .iter()
                    .map(|l| format!("{l:.3}"))
                    .collect::<Vec<_>>()
                    .join(" → ")
            };
            let _ = writeln!(s, "{}| {losses} | {:.1} |", cost.cells(), curve.seconds);
        }
        s
    }
}
