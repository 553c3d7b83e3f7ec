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

/// A benchmark's error: the engine's, or one from reading a model, tokenizer, dataset or file,
/// which the evaluation crate already names (`EvalError`), or a bad setting.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Engine(#[from] switchyard_engine::EngineError),
    #[error(transparent)]
    Eval(#[from] switchyard_eval::EvalError),
    #[error("{0}")]
    Invalid(String),
}

impl BenchError {
    /// A file that could not be read or written.
    pub fn io(path: impl Into<std::path::PathBuf>, source: std::io::Error) -> BenchError {
        BenchError::Eval(switchyard_eval::EvalError::Io {
            path: path.into(),
            source,
        })
    }
}

/// Errors the evaluation crate already wraps reach a benchmark through it.
macro_rules! via_eval {
    ($($error:ty),*) => {$(
        impl From<$error> for BenchError {
            fn from(err: $error) -> BenchError {
                BenchError::Eval(err.into())
            }
        }
    )*};
}
via_eval!(
    switchyard_tokenizer::TokenizerError,
    switchyard_zoo::ZooError,
    switchyard_models::ModelError
);

pub type Result<T> = std::result::Result<T, BenchError>;
