//! The engine: turns a loaded model and a tokenizer into generated and scored text, one
//! sequence at a time ([`generate`], [`score_text`]) or as a serving engine that runs many
//! requests at once inside a memory budget ([`EngineHandle`]).
//!
//! The serving engine, from the outside in:
//!
//! * [`handle`]: [`EngineHandle`], the command handle of the one thread that owns the engine
//!   (add, abort, depth and residency changes, stats), and per-request output streams;
//! * [`output`]: incremental detokenization and stop strings, outside the core (vLLM's split);
//! * [`core`]: [`EngineCore`], one step = schedule, one batched forward, sample, update;
//! * [`scheduler`]: queues, continuous batching, chunked prefill, admission, preemption;
//! * [`kv`]: the paged KV pool, block tables, prefix cache and memory budget;
//! * [`residency`]: loading layers on a background thread; [`exit`]: the exit head at a depth.
//!
//! Architecture invariant: the engine speaks token ids and text; it knows nothing of HTTP or
//! of how a request was chosen for this model. Model code never samples; this crate never
//! reads weight files itself (layers are loaded through the model crate's loader).

pub mod core;
pub mod doorbell;
pub mod exit;
pub mod external;
pub mod generate;
pub mod handle;
pub mod kv;
pub mod output;
pub mod residency;
pub mod sampler;
pub mod scheduler;
pub mod score;
pub mod sequential;
pub mod status;
pub mod stop;

pub use crate::core::{
    end_of_generation_tokens, max_prob, ConstrainedCounters, EngineConfig, EngineCore,
    EngineRequest, EngineStats, ExitProbe, MemoryStats, StepResult, TokenOutput,
    DEFAULT_MEMORY_BUDGET,
};
pub use doorbell::Doorbell;
pub use exit::{sampled_rows, ExitHead, ExitSpan, LogitLens};
pub use external::RequestBackend;
pub use generate::{generate, generate_with_cache, Generation, GenerationTiming};
pub use handle::{EngineHandle, EngineInfo, EngineStatus, Pending, Reachability, RequestStream};
pub use kv::KvFormat;
pub use output::{Completion, OutputProcessor, RequestOutput};
pub use residency::{LayerLoadTime, LoadReport};
pub use sampler::{Sampled, Sampler};
pub use scheduler::SchedulerConfig;
pub use score::{score_text, Score, ScoreOptions};
pub use sequential::{DecodedToken, SequentialDecoder};
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
    #[error(transparent)]
    Grammar(#[from] switchyard_grammar::GrammarError),
    #[error("`{param}` is not supported here: {reason}")]
    Unsupported { param: &'static str, reason: String },
    #[error("the prompt has {prompt} tokens; the model's context holds {context}, leaving no room to generate")]
    PromptTooLong { prompt: usize, context: usize },
    #[error("the prompt has {prompt} tokens, which need {blocks_needed} KV blocks at depth {depth}; the whole KV pool under the memory budget holds {pool_blocks}")]
    PromptExceedsMemory {
        prompt: usize,
        blocks_needed: usize,
        pool_blocks: usize,
        depth: usize,
    },
    #[error("request {id} is already in the engine")]
    DuplicateRequest { id: RequestId },
    #[error("depth {depth} is outside 1..={n_layers}")]
    BadDepth { depth: usize, n_layers: usize },
    #[error("depth {depth} needs layers 0..{depth} resident; resident: {resident:?}")]
    DepthNotResident { depth: usize, resident: Vec<usize> },
    #[error("resident layers must be the first N of the model; resident: {resident:?}")]
    ResidentNotPrefix { resident: Vec<usize> },
    #[error("a layer load is already in progress (layers {start}..{end})")]
    LoadInProgress { start: usize, end: usize },
    #[error("layers {start}..{end} need {bytes} bytes; the memory budget of {budget} bytes cannot hold them beside the other weights ({weights} bytes) and the workspace ({workspace} bytes) with at least one KV block")]
    LayersExceedBudget {
        start: usize,
        end: usize,
        bytes: u64,
        budget: u64,
        weights: u64,
        workspace: u64,
    },
    #[error("invalid engine configuration: {0}")]
    BadConfig(String),
    #[error("the forward step failed: {0}")]
    StepFailed(String),
    #[error("the engine holds no weights (its orchestrator parked it): load its layers before sending requests")]
    Parked,
    #[error("the engine has stopped")]
    EngineStopped,
    #[error("the engine of `{model}` failed and is down: its thread panicked")]
    EngineFailed { model: String },
    #[error("the request was ended: its reader fell {behind} outputs behind")]
    OutputOverflow { behind: usize },
    #[error(transparent)]
    Kv(#[from] kv::KvError),
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

/// Names one request inside an engine.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}
