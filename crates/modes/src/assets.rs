//! What some modes need besides the model's weights, found or made the same way by the
//! benchmarks and the server: the exit heads `self-speculative` drafts through, and the
//! activation-aware calibration of `q4-awq`.

use std::path::Path;
use std::sync::Arc;

use switchyard_exits::corpus::{Corpus, Split};
use switchyard_exits::{file, fingerprint, ExitHeads};
use switchyard_models::{LayeredModel, LoadOptions, QuantTarget};
use switchyard_tokenizer::Tokenizer;
use switchyard_weights::WeightSource;

use crate::awq::{self, AwqCalibration};
use crate::{ModesError, Result};

/// Documents of the AWQ calibration (ShareGPT's calibration split) and their length.
pub const AWQ_DOCS: usize = 4;
pub const AWQ_DOC_TOKENS: usize = 256;

/// ShareGPT calibration-split documents for the activation-aware scales.
pub fn calibration_docs(tokenizer: &Tokenizer) -> Result<Vec<Vec<u32>>> {
    let corpus = Corpus::resolve("sharegpt")?;
    let mut docs = Vec::new();
    for d in corpus.documents(tokenizer, Split::Calibration, AWQ_DOC_TOKENS)? {
        let d = d?;
        if d.tokens.len() == AWQ_DOC_TOKENS {
            docs.push(d.tokens);
        }
        if docs.len() == AWQ_DOCS {
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
