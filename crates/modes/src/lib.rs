//! Inference modes (ModeSwitch): each a named, fixed serving configuration
//! ([`switchyard_request::Mode`]) that one request is served with from start to finish.
//!
//! * [`precision`]: the model's weights at f16, f32, Q8_0, 4-bit, or 4-bit after
//!   activation-aware scaling ([`awq`]), or GPTQ's error-compensating 4-bit ([`gptq`]).
//! * [`speculative`]: a draft model proposes tokens and the target verifies them in one
//!   forward (Leviathan et al.); [`self_speculative`]: the draft is the model's own first
//!   layers through an exit head (LayerSkip), sharing their K/V with the verifier.

pub mod assets;
pub mod awq;
pub mod bench;
pub mod gptq;
pub mod overlay;
pub mod precision;
pub mod router_bench;
pub mod router_trace;
pub mod self_speculative;
pub mod serve;
pub mod speculative;

/// Errors of the modes crate. Other crates' errors are boxed so the `Result` of every call
/// stays small.
#[derive(Debug, thiserror::Error)]
pub enum ModesError {
    #[error(transparent)]
    Model(Box<switchyard_models::ModelError>),
    #[error(transparent)]
    Engine(Box<switchyard_engine::EngineError>),
    #[error(transparent)]
    Exits(Box<switchyard_exits::ExitsError>),
    #[error(transparent)]
    Candle(Box<candle_core::Error>),
    #[error(transparent)]
    Weights(Box<switchyard_weights::WeightsError>),
    #[error(transparent)]
    Tokenizer(Box<switchyard_tokenizer::TokenizerError>),
    #[error(transparent)]
    Zoo(Box<switchyard_zoo::ZooError>),
    #[error(transparent)]
    Eval(Box<switchyard_eval::EvalError>),
    #[error(transparent)]
    Chart(Box<switchyard_charts::ChartError>),
    #[error("{0}")]
    Invalid(String),
}

macro_rules! boxed_from {
    ($($variant:ident($t:ty)),* $(,)?) => {
        $(impl From<$t> for ModesError {
            fn from(e: $t) -> Self {
                ModesError::$variant(Box::new(e))
            }
        })*
    };
}

boxed_from!(
    Model(switchyard_models::ModelError),
    Engine(switchyard_engine::EngineError),
    Exits(switchyard_exits::ExitsError),
    Candle(candle_core::Error),
    Weights(switchyard_weights::WeightsError),
    Tokenizer(switchyard_tokenizer::TokenizerError),
    Zoo(switchyard_zoo::ZooError),
    Eval(switchyard_eval::EvalError),
    Chart(switchyard_charts::ChartError),
);

pub type Result<T> = std::result::Result<T, ModesError>;
