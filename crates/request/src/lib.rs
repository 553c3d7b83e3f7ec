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

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    #[error("temperature must be between 0 and 100, got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("repetition_penalty must be between {MIN_REPETITION_PENALTY} and {MAX_REPETITION_PENALTY}, got {0}")]
    RepetitionPenalty(f32),
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("at most {max} stop strings are allowed, got {got}")]
    TooManyStops { got: usize, max: usize },
    #[error("stop strings must be 1 to {max} bytes long, got one of {len} bytes")]
    StopLength { len: usize, max: usize },
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
        if self.max_tokens == 0 {
            return Err(RequestError::ZeroMaxTokens);
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
            bad(|p| p.stop = vec![String::new()]),
            "stop strings must be 1 to 256 bytes long, got one of 0 bytes"
        );
        assert_eq!(
            bad(|p| p.stop = vec!["x".into(); 17]),
            "at most 16 stop strings are allowed, got 17"
        );
    }
}
