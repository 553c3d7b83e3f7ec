//! Benchmarks that measure Switchyard. Each returns a serde-serializable report whose keys
//! carry their units (`decode_tokens_per_s`); the CLI writes it as JSON.
//!
//! Architecture invariant: benchmarks measure through the same public APIs users call; they
//! never reach into private state to make a number look better.

pub mod engine;
pub mod kernels;
pub mod offline;
pub mod serve;
pub mod soak;
pub mod step;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Engine(#[from] switchyard_engine::EngineError),
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
    #[error(transparent)]
    Eval(#[from] switchyard_eval::EvalError),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, BenchError>;
