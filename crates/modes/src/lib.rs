//! Inference modes (ModeSwitch): each a named, fixed serving configuration
//! ([`switchyard_request::Mode`]) that one request is served with from start to finish.
//!
//! * [`precision`]: the model's weights at f16, f32, Q8_0, 4-bit, or 4-bit after
//!   activation-aware scaling ([`awq`]).
//! * [`speculative`]: a draft model proposes tokens and the target verifies them in one
//!   forward (Leviathan et al.); [`self_speculative`]: the draft is the model's own first
//!   layers through an exit head (LayerSkip), sharing their K/V with the verifier.

pub mod awq;
pub mod bench;
pub mod precision;
pub mod router_bench;
pub mod self_speculative;
pub mod serve;
pub mod speculative;

#[derive(Debug, thiserror::Error)]
pub enum ModesError {
    #[error(transparent)]
    Model(#[from] switchyard_models::ModelError),
    #[error(transparent)]
    Engine(#[from] switchyard_engine::EngineError),
    #[error(transparent)]
    Exits(#[from] switchyard_exits::ExitsError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Weights(#[from] switchyard_weights::WeightsError),
    #[error(transparent)]
    Tokenizer(#[from] switchyard_tokenizer::TokenizerError),
    #[error(transparent)]
    Zoo(#[from] switchyard_zoo::ZooError),
    #[error(transparent)]
    Bench(#[from] switchyard_bench::BenchError),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, ModesError>;
