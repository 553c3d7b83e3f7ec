//! Request types shared by every layer of Switchyard: what a caller asks a sequence to do.
//!
//! Architecture invariant: this crate knows nothing about models, HTTP or scheduling; it holds
//! plain data and the rules that make it valid. Values are checked once, by [`SamplingParams::validate`],
//! at the edge (CLI, server); everything downstream may assume them valid.

use serde::{Deserialize, Serialize};

pub mod mode;
pub use mode::{Mode, Precision, UnknownMode};

/// Most stop strings one request may carry (OpenAI allows 4; a generous cap still bounds the
/// per-token matching cost).
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string in bytes.
pub const MAX_STOP_STRING_BYTES: usize = 256;
/// Temperatures below this sample greedily (vLLM's `_SAMPLING_EPS`): dividing logits by a
/// smaller one overflows f32 and turns the distribution into NaN.
pub const SAMPLING_EPS: f32 = 1e-5;
/// Repetition penalties are kept within two orders of magnitude of 1 (off), so a penalized
/// logit of any magnitude a model produces stays finite.
pub const MIN_REPETITION_PENALTY: f32 = 0.01;
pub const MAX_REPETITION_PENALTY: f32 = 100.0;
/// OpenAI's ranges for `presence_penalty` / `frequency_penalty` and for `logit_bias` values.
pub const MAX_OPENAI_PENALTY: f32 = 2.0;
pub const MAX_LOGIT_BIAS: f32 = 100.0;
/// Most entries in one `logit_bias` map (OpenAI accepts up to 300).
pub const MAX_LOGIT_BIAS_ENTRIES: usize = 300;
/// Most log-probability alternatives per position (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most entries in `stop_token_ids`.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    #[error("temperature must be between 0 and 100, got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("repetition_penalty must be between {MIN_REPETITION_PENALTY} and {MAX_REPETITION_PENALTY}, got {0}")]
    RepetitionPenalty(f32),
    #[error("{name} must be between -{MAX_OPENAI_PENALTY} and {MAX_OPENAI_PENALTY}, got {value}")]
    OpenAiPenalty { name: &'static str, value: f32 },
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
    #[error("logit_bias values must be between -{MAX_LOGIT_BIAS} and {MAX_LOGIT_BIAS}, got {value} for token {token}")]
    LogitBias { token: u32, value: f32 },
    #[error("logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {0}")]
    LogitBiasEntries(usize),
    #[error("at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {0}")]
    StopTokenIds(usize),
    #[error("top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {0}")]
    TopLogprobs(usize),
    #[error("min_tokens ({min}) must not exceed max_tokens ({max})")]
    MinTokens { min: usize, max: usize },
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("at most {max} stop strings are allowed, got {got}")]
    TooManyStops { got: usize, max: usize },
    #[error("stop strings must be 1 to {max} bytes long, got one of {len} bytes")]
    StopLength { len: usize, max: usize },
}

/// A constraint on the output's text (structured outputs), enforced token by token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Guide {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid under this schema (`json_schema`, vLLM's `guided_json`).
    JsonSchema(serde_json::Value),
    /// Text the regular expression matches in full (`guided_regex`).
    Regex(String),
    /// Exactly one of these strings (`guided_choice`).
    Choice(Vec<String>),
    /// A Lark context-free grammar (`guided_grammar`).
    Lark(String),
}

impl Guide {
    /// The request field it came from, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Guide::JsonObject => "json_object",
            Guide::JsonSchema(_) => "json_schema",
            Guide::Regex(_) => "regex",
            Guide::Choice(_) => "choice",
            Guide::Lark(_) => "grammar",
        }
    }
}

/// How to pick each next token and when to stop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// 0 (or anything below [`SAMPLING_EPS`]) means greedy (argmax).
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: off).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1: off).
    pub top_p: f32,
    /// CTRL-style penalty on tokens already in the prompt or output (1: off).
    pub repetition_penalty: f32,
    /// Same seed, same output. `None`: seeded from the OS.
    pub seed: Option<u64>,
    /// Generation ends before the first occurrence of any of these strings.
    pub stop: Vec<String>,
    /// Keep going past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// OpenAI's penalties on tokens already generated (not the prompt): the logit drops by
    /// `presence_penalty` once a token has appeared and by `frequency_penalty` per occurrence.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Added to a token's logit before sampling (−100 bans it, +100 all but forces it).
    pub logit_bias: Vec<(u32, f32)>,
    /// Drop tokens whose probability is below `min_p` times the most likely one's (0: off).
    pub min_p: f32,
    /// End-of-generation tokens and `stop_token_ids` are banned until this many tokens exist.
    pub min_tokens: usize,
    /// Extra tokens that end generation like the model's own end-of-generation tokens (the
    /// token itself is not part of the output). They end it even with `ignore_eos`.
    pub stop_token_ids: Vec<u32>,
    /// How many most likely alternatives to report with each sampled token (0: none).
    pub top_logprobs: usize,
    /// Whether the caller reads each sampled token's log-probability (the server sets it
    /// from OpenAI's `logprobs`). When it does not, a constrained greedy or plain-temperature
    /// row may be drawn before its mask is computed (the tokens' distribution is the same, see
    /// the engine's sampler) and the log-probability it carries is not normalized over the
    /// allowed tokens. On by default, so direct callers always get exact figures.
    pub report_logprobs: bool,
    /// The output must follow this constraint (structured outputs).
    pub guide: Option<Guide>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_tokens: 256,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: None,
            stop: Vec::new(),
            ignore_eos: false,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            min_p: 0.0,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            top_logprobs: 0,
            report_logprobs: true,
            guide: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> Self {
        Self {
            max_tokens,
            ..Self::default()
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature < SAMPLING_EPS
    }

    /// The first parameter set here that only the batching engine's sampler implements (the
    /// speculative decoders' samplers do temperature, top-k, top-p and the repetition
    /// penalty); `None` when there is none.
    pub fn batching_only(&self) -> Option<&'static str> {
        [
            ("presence_penalty", self.presence_penalty != 0.0),
            ("frequency_penalty", self.frequency_penalty != 0.0),
            ("logit_bias", !self.logit_bias.is_empty()),
            ("min_p", self.min_p > 0.0),
            ("min_tokens", self.min_tokens > 0),
            ("stop_token_ids", !self.stop_token_ids.is_empty()),
            ("top_logprobs", self.top_logprobs > 0),
            ("response_format", self.guide.is_some()),
        ]
        .into_iter()
        .find_map(|(name, set)| set.then_some(name))
    }

    /// Whether anything changes the logits before temperature: a bias, a penalty, or banned
    /// end tokens under `min_tokens`. A guide's mask comes after these and is not counted.
    pub fn processes_logits(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || !self.logit_bias.is_empty()
            || self.min_tokens > 0
    }

    pub fn validate(&self) -> Result<(), RequestError> {
        if !(0.0..=100.0).contains(&self.temperature) {
            return Err(RequestError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(RequestError::TopP(self.top_p));
        }
        if !(MIN_REPETITION_PENALTY..=MAX_REPETITION_PENALTY).contains(&self.repetition_penalty) {
            return Err(RequestError::RepetitionPenalty(self.repetition_penalty));
        }
        for (name, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-MAX_OPENAI_PENALTY..=MAX_OPENAI_PENALTY).contains(&value) {
                return Err(RequestError::OpenAiPenalty { name, value });
            }
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(RequestError::MinP(self.min_p));
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS_ENTRIES {
            return Err(RequestError::LogitBiasEntries(self.logit_bias.len()));
        }
        if let Some(&(token, value)) = self
            .logit_bias
            .iter()
            .find(|(_, v)| !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(v))
        {
            return Err(RequestError::LogitBias { token, value });
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(RequestError::StopTokenIds(self.stop_token_ids.len()));
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(RequestError::TopLogprobs(self.top_logprobs));
        }
        if self.max_tokens == 0 {
            return Err(RequestError::ZeroMaxTokens);
        }
        if self.min_tokens > self.max_tokens {
            return Err(RequestError::MinTokens {
                min: self.min_tokens,
                max: self.max_tokens,
            });
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return Err(RequestError::TooManyStops {
                got: self.stop.len(),
                max: MAX_STOP_STRINGS,
            });
        }
        if let Some(s) = self
            .stop
            .iter()
            .find(|s| s.is_empty() || s.len() > MAX_STOP_STRING_BYTES)
        {
            return Err(RequestError::StopLength {
                len: s.len(),
                max: MAX_STOP_STRING_BYTES,
            });
        }
        Ok(())
    }
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` reached, or the context is full.
    Length,
    /// Aborted by the caller.
    Abort,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_bad_field() {
        let ok = SamplingParams::default();
        assert_eq!(ok.validate(), Ok(()));
        let bad = |f: fn(&mut SamplingParams)| {
            let mut p = SamplingParams::default();
            f(&mut p);
            p.validate().unwrap_err().to_string()
        };
        assert_eq!(
            bad(|p| p.temperature = -1.0),
            "temperature must be between 0 and 100, got -1"
        );
        assert_eq!(bad(|p| p.top_p = 0.0), "top_p must be in (0, 1], got 0");
        assert_eq!(
            bad(|p| p.top_p = f32::NAN),
            "top_p must be in (0, 1], got NaN"
        );
        assert_eq!(
            bad(|p| p.repetition_penalty = 1e-3),
            "repetition_penalty must be between 0.01 and 100, got 0.001"
        );
        assert_eq!(
            bad(|p| p.repetition_penalty = 1e3),
            "repetition_penalty must be between 0.01 and 100, got 1000"
        );
        assert_eq!(bad(|p| p.max_tokens = 0), "max_tokens must be at least 1");
        assert_eq!(
            bad(|p| p.presence_penalty = 2.5),
            "presence_penalty must be between -2 and 2, got 2.5"
        );
        assert_eq!(
            bad(|p| p.frequency_penalty = f32::NAN),
            "frequency_penalty must be between -2 and 2, got NaN"
        );
        assert_eq!(bad(|p| p.min_p = 1.5), "min_p must be in [0, 1], got 1.5");
        assert_eq!(
            bad(|p| p.logit_bias = vec![(7, -101.0)]),
            "logit_bias values must be between -100 and 100, got -101 for token 7"
        );
        assert_eq!(
            bad(|p| p.top_logprobs = 21),
            "top_logprobs must be at most 20, got 21"
        );
        assert_eq!(
            bad(|p| {
                p.max_tokens = 4;
                p.min_tokens = 5
            }),
            "min_tokens (5) must not exceed max_tokens (4)"
        );
        assert_eq!(
            bad(|p| p.stop = vec![String::new()]),
            "stop strings must be 1 to 256 bytes long, got one of 0 bytes"
        );
        assert_eq!(
            bad(|p| p.stop = vec!["x".into(); 17]),
            "at most 16 stop strings are allowed, got 17"
        );
    }
}
