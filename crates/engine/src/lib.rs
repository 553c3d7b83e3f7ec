//! The engine: turns a loaded model and a tokenizer into generated and scored text.
//!
//! Architecture invariant: the engine speaks token ids and text; it knows nothing of HTTP or
//! of how a request was chosen for this model. Model code never samples; this crate never
//! touches weights.

pub mod generate;
pub mod kv;
pub mod sampler;
pub mod score;
pub mod stop;

pub use generate::{generate, Generation, GenerationTiming};
pub use sampler::{Sampled, Sampler};
pub use score::{score_text, Score, ScoreOptions};
pub use stop::{StopMatcher, StopOutcome};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] switchyard_models::ModelError),
    #[error(transparent)]
    Tokenizer(#[from] switchyard_tokenizer::TokenizerError),
    #[error(transparent)]
    Request(#[from] switchyard_request::RequestError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens; the model's context holds {context}, leaving no room to generate")]
    PromptTooLong { prompt: usize, context: usize },
    #[error("the text to score has {tokens} tokens; at least 2 are needed")]
    TooFewTokens { tokens: usize },
    #[error("scoring window {window} and stride {stride} must satisfy 1 <= stride <= window <= context ({context})")]
    BadWindow {
        window: usize,
        stride: usize,
        context: usize,
    },
}

pub type Result<T> = std::result::Result<T, EngineError>;
