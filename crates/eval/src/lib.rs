//! Datasets and quality scoring: the traffic benchmarks replay (ShareGPT) and the measures of
//! how good an answer is (benchmark tasks, log-likelihood, exact match, executed tests,
//! ROUGE-L, paired intervals), plus the small statistics every report shares.
//!
//! Benchmarks, controllers and routers read datasets and score quality through this crate;
//! it never runs a server or a benchmark itself.

pub mod quality;
pub mod sharegpt;
pub mod stats;

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error(transparent)]
    Tokenizer(#[from] switchyard_tokenizer::TokenizerError),
    #[error(transparent)]
    Zoo(#[from] switchyard_zoo::ZooError),
    #[error(transparent)]
    Model(#[from] switchyard_models::ModelError),
    #[error("cannot read {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, EvalError>;
