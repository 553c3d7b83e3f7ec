//! Early exit at serving time: exit heads for models that were not trained with them, the
//! confidence measures that decide an exit, and the seam the engine calls.
//!
//! * [`heads`]: exit heads and the seam the rest of Switchyard calls,
//!   [`ExitHeads::logits`]`(model, depth, hidden)`. A head at depth `d` reads the hidden state
//!   after layers `0..d` and maps it to the final layer's hidden space; the model's own final
//!   norm and LM head then give the logits. Kinds: identity (the logit lens), affine (the
//!   tuned lens), MLP and block heads (a trained copy of a decoder layer, [`block`], with the
//!   K/V it keeps per sequence).
//! * [`file`]: heads stored beside the model as safetensors with JSON metadata keyed to the
//!   model file's SHA-256 ([`fingerprint`]); a stale or mismatched file is refused.
//! * [`confidence`]: max softmax probability and top-1/top-2 margin; KL divergence.
//!
//! [`ExitHeads`] also implements the engine's exit seam (`switchyard_engine::ExitHead`), so the
//! serving scheduler's fixed-depth exit can read calibrated heads.
//!
//! Fitting heads lives in `switchyard-exit-training` (calibration, ridge, `ee-tune`); the exit
//! study and the per-token EE-LLM baseline in `switchyard-exit-study`. Both depend on this
//! crate, never the other way.
//!
//! Architecture invariant: this crate reads models only through the layered-model contract
//! (`embed`, `forward_layers`, `write_kv_layers`, `final_norm`, `lm_head`); it never touches
//! weights files except to hash them.

pub mod block;
pub mod confidence;
mod engine_seam;
pub mod file;
pub mod fingerprint;
pub mod heads;

use std::path::PathBuf;

pub use confidence::{ConfidenceMeasure, TokenStats};
pub use heads::{ExitHead, ExitHeads, HeadKind, HeadsMeta};

#[derive(Debug, thiserror::Error)]
pub enum ExitsError {
    #[error(transparent)]
    Model(#[from] switchyard_models::ModelError),
    #[error(transparent)]
    Engine(#[from] switchyard_engine::EngineError),
    #[error(transparent)]
    Tokenizer(#[from] switchyard_tokenizer::TokenizerError),
    #[error(transparent)]
    Request(#[from] switchyard_request::RequestError),
    #[error(transparent)]
    Zoo(#[from] switchyard_zoo::ZooError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("cannot access {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {detail}")]
    BadHeadsFile { path: PathBuf, detail: String },
    #[error("{path} was calibrated for a model with SHA-256 {heads_sha256}, but the model file has {model_sha256}; run `switchyard calibrate` again for this model")]
    StaleHeads {
        path: PathBuf,
        heads_sha256: String,
        model_sha256: String,
    },
    #[error("{path} does not fit this model: {detail}")]
    HeadsMismatch { path: PathBuf, detail: String },
    #[error("{path}: head kind {kind:?} is not supported by this build (identity, affine, mlp and block are)")]
    UnsupportedHeadKind { path: PathBuf, kind: String },
    #[error("the exit head at depth {depth} has no exit probe; train one with `switchyard ee-tune`, or decide by confidence")]
    NoProbe { depth: usize },
    #[error("no exit head at depth {depth} (heads at {available:?})")]
    NoHead { depth: usize, available: Vec<usize> },
    #[error("exit depth {depth} must be between 1 and {max} (the model has {n_layers} layers)")]
    BadDepth {
        depth: usize,
        max: usize,
        n_layers: usize,
    },
    #[error("the ridge system for depth {depth} is not positive definite (lambda {lambda:e}); calibrate on more tokens or raise lambda")]
    NotPositiveDefinite { depth: usize, lambda: f64 },
    #[error("the calibration corpus {corpus} gave no usable tokens")]
    EmptyCorpus { corpus: String },
    #[error("{0}")]
    Invalid(String),
    #[error("plotting {path}: {detail}")]
    Plot { path: PathBuf, detail: String },
    #[error("internal invariant broken: {0}")]
    Internal(String),
}

impl ExitsError {
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> ExitsError {
        let path = path.into();
        move |source| ExitsError::Io { path, source }
    }
}

pub type Result<T> = std::result::Result<T, ExitsError>;
