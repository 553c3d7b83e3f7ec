//! Calibration of affine exit heads (the tuned lens) by ridge regression.
//!
//! For each exit depth `d`, an affine map from the hidden state after layers `0..d` to the
//! final hidden state (before the final norm) is fitted in closed form over the calibration
//! documents. One full forward per document yields every depth's input and the common target;
//! the statistics stream into [`RidgeStats`] (memory independent of the token count).
//!
//! `λ` is chosen per head on held-out data without storing any: every
//! [`VALIDATION_EVERY`]-th calibration document feeds a second set of statistics, each
//! candidate `λ` is fitted on the rest and scored there (the squared error follows from the
//! statistics), and the best one is refitted on everything.

use std::collections::BTreeMap;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use candle_core::Tensor;
use switchyard_models::{DenseKv, ForwardBatch, LayeredModel};
use switchyard_tokenizer::Tokenizer;

use crate::corpus::{Corpus, Split, HELD_OUT_EVERY};
use crate::ridge::RidgeStats;
use switchyard_exits::heads::{
    CalibrationInfo, ExitHead, ExitHeads, HeadInfo, HeadsMeta, ModelRef, FORMAT_VERSION,
};
use switchyard_exits::{ExitsError, Result};

/// Default calibration budget: about 3 to 5 minutes of smollm2 forward passes on 2 cores
/// (100-200 prompt tokens/s measured there).
pub const DEFAULT_TOKENS: usize = 32_768;
/// Relative ridge `λ` candidates (see [`crate::ridge`]). Chosen per head by validation.
pub const LAMBDA_CANDIDATES: &[f64] = &[1e-4, 1e-3, 1e-2, 1e-1, 1.0];
/// One calibration document in this many feeds the `λ` validation statistics.
pub const VALIDATION_EVERY: usize = 8;
/// Leading positions of each document left out of the statistics: the first token's hidden
/// states carry the attention-sink "massive activations" that would dominate a least-squares
/// fit, and a prompt's first position is never decoded with an exit anyway.
pub const SKIP_POSITIONS: usize = 1;
/// About eight exits per model: one every `n_layers / 8` layers.
pub const EXITS_PER_MODEL: usize = 8;

/// The default spacing of exits for a model of `n_layers`.
pub fn default_every(n_layers: usize) -> usize {
    (n_layers / EXITS_PER_MODEL).max(1)
}

/// Depths `every, 2·every, …` below `n_layers` (the final layer needs no head).
pub fn exit_depths(n_layers: usize, every: usize) -> Vec<usize> {
    (every.max(1)..n_layers).step_by(every.max(1)).collect()
}

#[derive(Debug, Clone)]
pub struct CalibrationConfig {
    pub depths: Vec<usize>,
    /// Stop after this many token positions.
    pub max_tokens: usize,
    /// Most tokens per document.
    pub doc_tokens: usize,
    pub lambdas: Vec<f64>,
}

impl CalibrationConfig {
    pub fn new(n_layers: usize) -> Self {
        Self {
            depths: exit_depths(n_layers, default_every(n_layers)),
            max_tokens: DEFAULT_TOKENS,
            doc_tokens: crate::corpus::DEFAULT_DOC_TOKENS,
            lambdas: LAMBDA_CANDIDATES.to_vec(),
        }
    }
}

/// Reported after each document.
#[derive(Debug, Clone, Copy)]
pub struct CalibrationProgress {
    pub tokens: u64,
    pub max_tokens: u64,
    pub sequences: usize,
}

/// The model being calibrated: its layers, its tokenizer, and the identity its heads file will
/// record.
pub struct CalibrationTarget<'a> {
    pub model: &'a LayeredModel,
    pub tokenizer: &'a Tokenizer,
    pub model_ref: ModelRef,
}

/// Fits affine heads at `cfg.depths` of the target model on the calibration split of `corpus`.
pub fn calibrate(
    target: &CalibrationTarget<'_>,
    corpus: &Corpus,
    cfg: &CalibrationConfig,
    mut progress: impl FnMut(&CalibrationProgress),
) -> Result<ExitHeads> {
    let (model, tokenizer) = (target.model, target.tokenizer);
    let t0 = Instant::now();
    let n_layers = model.n_layers();
    let d = model.spec().d_model;
    if cfg.depths.is_empty() {
        return Err(ExitsError::Invalid("no exit depths to calibrate".into()));
    }
    if let Some(&bad) = cfg.depths.iter().find(|&&x| x == 0 || x >= n_layers) {
        return Err(ExitsError::BadDepth {
            depth: bad,
            max: n_layers - 1,
            n_layers,
        });
    }
    let mut depths = cfg.depths.clone();
    depths.sort_unstable();
    depths.dedup();
    let dev = model.device();
    // [depth] -> (fit, validation)
    let mut stats = depths
        .iter()
        .map(|_| Ok((RidgeStats::new(d, d, dev)?, RidgeStats::new(d, d, dev)?)))
        .collect::<Result<Vec<_>>>()?;

    let mut tokens = 0u64;
    let mut sequences = 0usize;
    let docs = corpus.documents(tokenizer, Split::Calibration, cfg.doc_tokens)?;
    for doc in docs {
        if tokens >= cfg.max_tokens as u64 {
            break;
        }
        let mut doc = doc?;
        let left = cfg.max_tokens - tokens as usize;
        doc.tokens.truncate(left + SKIP_POSITIONS);
        let n = doc.tokens.len();
        if n <= SKIP_POSITIONS {
            continue;
        }
        let validation = sequences % VALIDATION_EVERY == VALIDATION_EVERY - 1;
        let _span = tracing::debug_span!("calibrate_doc", index = doc.index, n).entered();
        let (inputs, target) = hidden_states(model, &doc.tokens, &depths)?;
        let rows = n - SKIP_POSITIONS;
        let y = target.narrow(0, SKIP_POSITIONS, rows)?;
        for (x, (fit, val)) in inputs.iter().zip(stats.iter_mut()) {
            let x = x.narrow(0, SKIP_POSITIONS, rows)?;
            if validation { val } else { fit }.add(&x, &y)?;
        }
        tokens += rows as u64;
        sequences += 1;
        progress(&CalibrationProgress {
            tokens,
            max_tokens: cfg.max_tokens as u64,
            sequences,
        });
    }
    if tokens == 0 {
        return Err(ExitsError::EmptyCorpus {
            corpus: corpus.name().to_string(),
        });
    }

    let mut heads = BTreeMap::new();
    let mut infos = Vec::new();
    for (&depth, (fit, val)) in depths.iter().zip(stats.iter_mut()) {
        let _span = tracing::debug_span!("solve", depth).entered();
        let (lambda, r2, r2_id) = choose_lambda(fit, val, &cfg.lambdas)?;
        fit.merge(val)?;
        let affine = fit
            .solve(lambda)?
            .ok_or(ExitsError::NotPositiveDefinite { depth, lambda })?;
        heads.insert(depth, ExitHead::from_affine(&affine, dev)?);
        infos.push(HeadInfo {
            depth,
            kind: switchyard_exits::HeadKind::Affine,
            lambda_rel: Some(lambda),
            validation_r2: r2,
            validation_r2_identity: r2_id,
            block: None,
            trained: None,
        });
    }
    let meta = HeadsMeta {
        format_version: FORMAT_VERSION,
        model: target.model_ref.clone(),
        heads: infos,
        calibration: Some(CalibrationInfo {
            corpus: corpus.name().to_string(),
            tokens,
            sequences,
            max_sequence_tokens: cfg.doc_tokens,
            held_out: format!(
                "documents i with i % {HELD_OUT_EVERY} == {} (evaluation); every \
                 {VALIDATION_EVERY}th calibration document validates lambda; first \
                 {SKIP_POSITIONS} position(s) of each document skipped",
                HELD_OUT_EVERY - 1
            ),
            lambda_candidates: cfg.lambdas.clone(),
            seconds: t0.elapsed().as_secs_f64(),
            created_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }),
    };
    ExitHeads::new(meta, heads)
}

/// The best `λ` on the validation statistics, with its R² and the identity map's R² there
/// (`None` when there is no validation data; then the middle candidate is used).
fn choose_lambda(
    fit: &RidgeStats,
    val: &RidgeStats,
    lambdas: &[f64],
) -> Result<(f64, Option<f64>, Option<f64>)> {
    let fallback = lambdas.get(lambdas.len() / 2).copied().unwrap_or(1e-2);
    if val.n() == 0 || fit.n() == 0 {
        return Ok((fallback, None, None));
    }
    let sst = val.sst()?;
    let mut best: Option<(f64, f64)> = None;
    for &l in lambdas {
        if let Some(a) = fit.solve(l)? {
            let sse = val.sse(&a)?;
            tracing::debug!(lambda = l, sse, "validation");
            if best.is_none_or(|(_, s)| sse < s) {
                best = Some((l, sse));
            }
        }
    }
    let r2 = |sse: f64| (sst > 0.0).then(|| 1.0 - sse / sst);
    let id = r2(val.identity_sse()?);
    Ok(match best {
        Some((l, sse)) => (l, r2(sse), id),
        None => (fallback, None, id),
    })
}

/// One full forward of `tokens` from position 0: the hidden state after each of `depths`
/// (increasing) and after the last layer, each `[tokens, d_model]`.
pub fn hidden_states(
    model: &LayeredModel,
    tokens: &[u32],
    depths: &[usize],
) -> Result<(Vec<Tensor>, Tensor)> {
    let mut kv = DenseKv::new(model.n_layers(), model.spec().kv_row_len());
    let mut batch = ForwardBatch::single(&mut kv, 0, tokens.len());
    let mut x = model.embed(tokens)?;
    let mut at = 0;
    let mut out = Vec::with_capacity(depths.len());
    for &d in depths {
        x = model.forward_layers(x, at..d, &mut batch)?;
        out.push(x.clone());
        at = d;
    }
    let x = model.forward_layers(x, at..model.n_layers(), &mut batch)?;
    Ok((out, x))
}
