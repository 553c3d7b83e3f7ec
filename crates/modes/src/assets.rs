//! What some modes need besides the model's weights, found or made the same way by the
//! benchmarks and the server: the exit heads `self-speculative` drafts through, the
//! activation-aware calibration of `q4-awq`, and the GPTQ blocks of `q4-gptq` (cached).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use switchyard_exit_training::corpus::{Corpus, Split};
use switchyard_exits::{file, fingerprint, ExitHeads};
use switchyard_models::{LayeredModel, LoadOptions, QuantTarget};
use switchyard_tokenizer::Tokenizer;
use switchyard_weights::WeightSource;

use crate::awq::{self, AwqCalibration};
use crate::gptq::{self, GptqCalibration, GptqSettings};
use crate::{ModesError, Result};

/// Documents of the AWQ calibration (ShareGPT's calibration split) and their length.
pub const AWQ_DOCS: usize = 4;
pub const AWQ_DOC_TOKENS: usize = 256;

/// ShareGPT calibration-split documents for the activation-aware scales.
pub fn calibration_docs(tokenizer: &Tokenizer) -> Result<Vec<Vec<u32>>> {
    sharegpt_calibration(tokenizer, AWQ_DOCS, AWQ_DOC_TOKENS)
}

/// The first `n` documents of ShareGPT's calibration split that reach `len` tokens, cut to it.
pub fn sharegpt_calibration(tokenizer: &Tokenizer, n: usize, len: usize) -> Result<Vec<Vec<u32>>> {
    let corpus = Corpus::resolve("sharegpt")?;
    let mut docs = Vec::new();
    for d in corpus.documents(tokenizer, Split::Calibration, len)? {
        let d = d?;
        if d.tokens.len() == len {
            docs.push(d.tokens);
        }
        if docs.len() == n {
            break;
        }
    }
    Ok(docs)
}

/// Calibrates `q4-awq` on [`calibration_docs`]; `progress(done, total)` counts layers.
pub fn calibrate_awq(
    source: Arc<dyn WeightSource>,
    tokenizer: &Tokenizer,
    progress: impl FnMut(usize, usize),
) -> Result<AwqCalibration> {
    let docs = calibration_docs(tokenizer)?;
    awq::calibrate(source, &docs, QuantTarget::Q4, progress)
}

/// Where `q4-gptq` results are cached: `gptq/` in the model cache.
pub fn gptq_cache_dir() -> PathBuf {
    switchyard_zoo::home().join("gptq")
}

/// `q4-gptq`'s blocks for `source`: read from `cache_dir` when a result made from the same
/// model file (by SHA-256) with the same settings is there, else made now on ShareGPT's
/// calibration split and written there. Returns the result and whether it came from the
/// cache. A source without a file (nothing to key the cache to) is calibrated every time; an
/// unreadable or stale cache file is logged and remade.
pub fn calibrate_gptq(
    source: Arc<dyn WeightSource>,
    tokenizer: &Tokenizer,
    settings: &GptqSettings,
    cache_dir: &Path,
    progress: impl FnMut(usize, usize),
) -> Result<(GptqCalibration, bool)> {
    let sha = match source.path() {
        Some(p) => Some(fingerprint::fingerprint(p)?.sha256),
        None => None,
    };
    let cached = sha
        .as_deref()
        .map(|sha| (gptq::cache::path(cache_dir, sha, settings), sha));
    if let Some((path, sha)) = &cached {
        match gptq::cache::load(path, sha, settings) {
            Ok(Some(c)) => return Ok((c, true)),
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "GPTQ cache not used; calibrating again"),
        }
    }
    let docs = sharegpt_calibration(tokenizer, settings.documents(), settings.doc_tokens)?;
    let c = if settings.awq_scales {
        tracing::info!("GPTQ: calibrating the activation-aware scales first");
        let awq = calibrate_awq(Arc::clone(&source), tokenizer, |_, _| {})?;
        gptq::calibrate_on_awq(source, &awq, &docs, QuantTarget::Q4, settings, progress)?
    } else {
        gptq::calibrate(source, &docs, QuantTarget::Q4, settings, progress)?
    };
    if let Some((path, sha)) = &cached {
        if let Err(e) = gptq::cache::save(path, sha, &c) {
            tracing::warn!(error = %e, "cannot cache the GPTQ result");
        }
    }
    Ok((c, false))
}

/// Loads the exit heads at `heads_path` (checked against the model file at `model_path`) and
/// picks the exit nearest `want_depth` (default: 3/4 of the layers) for `self-speculative`.
pub fn self_speculative_heads(
    model_path: &Path,
    source: Arc<dyn WeightSource>,
    heads_path: &Path,
    want_depth: Option<usize>,
) -> Result<(Arc<ExitHeads>, usize)> {
    if !heads_path.exists() {
        return Err(ModesError::Invalid(format!(
            "self-speculative needs exit heads: none at {} (make them with `switchyard calibrate` or `switchyard ee-tune`)",
            heads_path.display()
        )));
    }
    let model = LayeredModel::load(source, &LoadOptions::default())?;
    let fp = fingerprint::fingerprint(model_path)?;
    let heads = file::load(heads_path, &model, &fp)?;
    let n = model.n_layers();
    let want = want_depth.unwrap_or(3 * n / 4);
    let depth = heads
        .depths()
        .into_iter()
        .min_by_key(|d| d.abs_diff(want))
        .ok_or_else(|| {
            ModesError::Invalid(format!("{} has no exit heads", heads_path.display()))
        })?;
    Ok((Arc::new(heads), depth))
}
