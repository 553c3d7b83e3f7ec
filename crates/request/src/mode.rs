//! Inference modes: the named, fixed serving configurations a request can be routed to
//! (ModeSwitch). A mode is chosen once per request, before generation, and never changes
//! inside it. This module holds only the names and what each one means; the modes crate
//! builds them and the router chooses among them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Weight precision of a mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    /// Weights dequantized to f16 (the baseline).
    F16,
    /// Weights dequantized to f32.
    F32,
    /// Q8_0 blocks.
    Int8,
    /// 4-bit blocks: Q4_K where the row length allows, else Q4_0.
    Q4,
    /// 4-bit after activation-aware per-channel scaling (in the spirit of AWQ).
    Q4Awq,
    /// 4-bit chosen by GPTQ's error-compensating, Hessian-weighted rounding (same blocks as
    /// `Q4`).
    Q4Gptq,
}

impl Precision {
    pub const ALL: [Precision; 6] = [
        Precision::F16,
        Precision::F32,
        Precision::Int8,
        Precision::Q4,
        Precision::Q4Awq,
        Precision::Q4Gptq,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Precision::F16 => "f16",
            Precision::F32 => "f32",
            Precision::Int8 => "int8",
            Precision::Q4 => "q4",
            Precision::Q4Awq => "q4-awq",
            Precision::Q4Gptq => "q4-gptq",
        }
    }
}

/// A named, fixed serving configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    /// f16 weights, one request at a time: the baseline and the emergency fallback.
    F16,
    F32,
    Int8,
    Q4,
    Q4Awq,
    /// A draft model proposes tokens, the target verifies them (Leviathan et al.).
    Speculative,
    /// The model's own first layers plus an exit head draft, the full model verifies
    /// (LayerSkip), sharing the draft layers' K/V.
    SelfSpeculative,
    /// f16 with the prefix cache on.
    PrefixCache,
    /// f16 with chunked prefill on.
    ChunkedPrefill,
    /// f16 with continuous batching (many sequences per step).
    ContinuousBatching,
    /// f16 with K/V stored as 8-bit with one scale per (position, K/V head) in each block.
    KvCompressed,
    /// Q4 weights with the prefix cache on.
    Q4PrefixCache,
    /// Q8_0 weights with continuous batching.
    Int8ContinuousBatching,
    /// GPTQ 4-bit weights.
    Q4Gptq,
    /// GPTQ 4-bit weights with the prefix cache on.
    Q4GptqPrefixCache,
}

impl Mode {
    /// Every mode. New modes go at the end: learned routers label modes by position here.
    pub const ALL: [Mode; 15] = [
        Mode::F16,
        Mode::F32,
        Mode::Int8,
        Mode::Q4,
        Mode::Q4Awq,
        Mode::Speculative,
        Mode::SelfSpeculative,
        Mode::PrefixCache,
        Mode::ChunkedPrefill,
        Mode::ContinuousBatching,
        Mode::KvCompressed,
        Mode::Q4PrefixCache,
        Mode::Int8ContinuousBatching,
        Mode::Q4Gptq,
        Mode::Q4GptqPrefixCache,
    ];

    /// The baseline every ratio is taken against, and the fallback when a mode fails.
    pub const BASELINE: Mode = Mode::F16;

    pub fn name(self) -> &'static str {
        match self {
            Mode::F16 => "f16",
            Mode::F32 => "f32",
            Mode::Int8 => "int8",
            Mode::Q4 => "q4",
            Mode::Q4Awq => "q4-awq",
            Mode::Speculative => "speculative",
            Mode::SelfSpeculative => "self-speculative",
            Mode::PrefixCache => "prefix-cache",
            Mode::ChunkedPrefill => "chunked-prefill",
            Mode::ContinuousBatching => "continuous-batching",
            Mode::KvCompressed => "kv-compressed",
            Mode::Q4PrefixCache => "q4+prefix-cache",
            Mode::Int8ContinuousBatching => "int8+continuous-batching",
            Mode::Q4Gptq => "q4-gptq",
            Mode::Q4GptqPrefixCache => "q4-gptq+prefix-cache",
        }
    }

    /// The weight precision the mode runs at (of the target, for speculative modes).
    pub fn precision(self) -> Precision {
        match self {
            Mode::F32 => Precision::F32,
            Mode::Int8 | Mode::Int8ContinuousBatching => Precision::Int8,
            Mode::Q4 | Mode::Q4PrefixCache => Precision::Q4,
            Mode::Q4Awq => Precision::Q4Awq,
            Mode::Q4Gptq | Mode::Q4GptqPrefixCache => Precision::Q4Gptq,
            _ => Precision::F16,
        }
    }

    /// Whether the prefix cache is on.
    pub fn prefix_cache(self) -> bool {
        matches!(
            self,
            Mode::PrefixCache | Mode::Q4PrefixCache | Mode::Q4GptqPrefixCache
        )
    }

    /// Whether long prompts are prefilled in chunks interleaved with decode steps.
    pub fn chunked_prefill(self) -> bool {
        matches!(self, Mode::ChunkedPrefill)
    }

    /// Whether many sequences share each step; otherwise requests run one at a time.
    pub fn continuous_batching(self) -> bool {
        matches!(
            self,
            Mode::ContinuousBatching | Mode::Int8ContinuousBatching
        )
    }

    /// Whether K/V blocks are stored as 8-bit.
    pub fn kv_compressed(self) -> bool {
        matches!(self, Mode::KvCompressed)
    }

    /// Whether the mode decodes by draft and verify (one sequence at a time).
    pub fn speculative(self) -> bool {
        matches!(self, Mode::Speculative | Mode::SelfSpeculative)
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown mode name; the message lists the known ones.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown mode {0:?}; known modes: {known}", known = Mode::ALL.map(Mode::name).join(", "))]
pub struct UnknownMode(pub String);

impl FromStr for Mode {
    type Err = UnknownMode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Mode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| UnknownMode(s.to_string()))
    }
}

impl Serialize for Mode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Mode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_modes() {
        for m in Mode::ALL {
            assert_eq!(m.name().parse::<Mode>(), Ok(m));
            let json = serde_json::to_string(&m).unwrap();
            assert_eq!(json, format!("\"{}\"", m.name()));
            assert_eq!(serde_json::from_str::<Mode>(&json).unwrap(), m);
        }
        let err = "fp8".parse::<Mode>().unwrap_err().to_string();
        assert!(err.starts_with(
            "unknown mode \"fp8\"; known modes: f16, f32, int8, q4, q4-awq, speculative"
        ));
    }

    #[test]
    fn hybrids_combine_precision_and_engine_features() {
        assert_eq!(Mode::Q4PrefixCache.precision(), Precision::Q4);
        assert!(Mode::Q4PrefixCache.prefix_cache());
        assert_eq!(Mode::Int8ContinuousBatching.precision(), Precision::Int8);
        assert!(Mode::Int8ContinuousBatching.continuous_batching());
        assert!(!Mode::F16.continuous_batching() && !Mode::F16.prefix_cache());
        assert_eq!(Mode::KvCompressed.precision(), Precision::F16);
        assert_eq!(Mode::Q4GptqPrefixCache.precision(), Precision::Q4Gptq);
        assert!(Mode::Q4GptqPrefixCache.prefix_cache() && !Mode::Q4Gptq.prefix_cache());
        assert_eq!(Mode::Q4Gptq.name(), "q4-gptq");
        assert_eq!(
            "q4-gptq+prefix-cache".parse::<Mode>(),
            Ok(Mode::Q4GptqPrefixCache)
        );
    }
}
