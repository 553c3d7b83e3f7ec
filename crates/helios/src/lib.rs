//! HELIOS (MLSys 2026): adaptive model and early-exit selection. From a repository of
//! calibrated models, keep choosing the model and the exit depth that serve the current
//! traffic best.
//!
//! * [`manifest`]: the model repository, a TOML manifest of candidate models (local or remote
//!   OpenAI-compatible) with their offline telemetry per exit depth;
//! * [`profile`]: measures that telemetry on a loaded model (`switchyard profile`): decode
//!   throughput, bits per byte and weight bytes at each exit depth;
//! * [`pht`]: the Performance History Table, what the online evaluation measured per
//!   candidate, small enough to serialize under 1 KB;
//! * [`policy`]: the decisions, as pure functions and small state machines: TopK candidates
//!   under the SLO and memory budget, the online-evaluation plan, the depth from an exit
//!   histogram, the Confidence Breach Counter, extend vs switch, re-profiling every RI
//!   requests and the drift detector;
//! * [`shadow`]: teacher-forced scoring of live prompts by candidates that do not serve,
//!   streaming their layers one at a time, with a bounded share of compute;
//! * [`orchestrator`]: the loop over real traffic and candidate engines: online evaluation
//!   into the PHT, greedy partial load, breach remedies (extend or switch), re-profiling;
//! * [`bench`]: `switchyard bench helios`, one ShareGPT trace served by the best single model
//!   at full depth, by the single-model EE-LLM baseline and by the orchestrator.
//!
//! Architecture invariant: the policy never touches a model, a clock or a thread; it reads
//! features and telemetry and returns a decision, so every rule is tested without a model.
//! Only [`profile`] runs models, through the layered-model contract and the exit heads, and
//! only [`orchestrator`] drives engines.

pub mod bench;
pub mod manifest;
pub mod orchestrator;
pub mod pht;
pub mod policy;
pub mod profile;
pub mod remote;
pub mod shadow;

pub use manifest::{DepthTelemetry, Manifest, ModelEntry, Source};
pub use pht::{ExitHistogram, Pht, PhtRow};

#[derive(Debug, thiserror::Error)]
pub enum HeliosError {
    #[error(transparent)]
    Model(#[from] switchyard_models::ModelError),
    #[error(transparent)]
    Engine(#[from] switchyard_engine::EngineError),
    #[error(transparent)]
    Exits(#[from] switchyard_exits::ExitsError),
    #[error(transparent)]
    Tokenizer(#[from] switchyard_tokenizer::TokenizerError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// Boxed, as is [`HeliosError::Zoo`]: they would double the size of every `Result`.
    #[error(transparent)]
    Eval(Box<switchyard_eval::EvalError>),
    #[error(transparent)]
    Zoo(Box<switchyard_zoo::ZooError>),
    #[error(transparent)]
    Chart(#[from] switchyard_charts::ChartError),
    #[error("cannot read {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{origin}: {message}")]
    ManifestSyntax { origin: String, message: String },
    #[error("{origin}: model {model:?}: {message}")]
    ManifestModel {
        origin: String,
        model: String,
        message: String,
    },
    #[error("{origin}: {message}")]
    Manifest { origin: String, message: String },
    #[error("the Performance History Table is not valid: {0}")]
    Pht(String),
    #[error("invalid SLO: {0}")]
    Slo(String),
    #[error("invalid policy configuration: {0}")]
    Config(String),
    #[error("no candidate fits the SLO and the memory budget of {budget_bytes} bytes: {}", .rejected.join("; "))]
    NoCandidate {
        budget_bytes: u64,
        rejected: Vec<String>,
    },
    #[error("cannot profile: {0}")]
    Profile(String),
    #[error("orchestrator: {0}")]
    Orchestrator(String),
}

impl From<switchyard_eval::EvalError> for HeliosError {
    fn from(e: switchyard_eval::EvalError) -> Self {
        Self::Eval(Box::new(e))
    }
}

impl From<switchyard_zoo::ZooError> for HeliosError {
    fn from(e: switchyard_zoo::ZooError) -> Self {
        Self::Zoo(Box::new(e))
    }
}

pub type Result<T> = std::result::Result<T, HeliosError>;
