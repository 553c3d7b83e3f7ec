//! The rule classifier: which bottleneck a request will hit (batch, shared prefix, prefill,
//! decode), from thresholds an operator can tune. The priority policy built on it lives in
//! `policy`.

use serde::{Deserialize, Serialize};

use crate::error::{Result, RouterError};
use crate::features::{RequestFeatures, Shape, WorkloadFamily};

/// Queue depth from which a request counts as batch traffic.
pub const BATCH_QUEUE_DEPTH: usize = 8;
/// Cached prefix tokens from which a request counts as shared-prefix (one 64-token block of
/// system prompt is already worth reusing).
pub const SHARED_PREFIX_MIN_TOKENS: usize = 64;
/// Cached share of the prompt from which a request counts as shared-prefix.
pub const SHARED_PREFIX_MIN_FRACTION: f64 = 0.5;
/// Prompt tokens from which a prompt is long (between the paper's S = 128 and L = 1024).
pub const LONG_PROMPT_TOKENS: usize = 512;
/// Most output tokens of a short output (between the paper's S = 32 and L = 128).
pub const SHORT_OUTPUT_TOKENS: usize = 64;
/// Expected output tokens from which a request is decode-heavy (the paper's L output).
pub const DECODE_HEAVY_OUTPUT_TOKENS: usize = 128;
/// Share of the memory budget in use from which memory pressure is high.
pub const HIGH_MEMORY_PRESSURE: f64 = 0.8;

/// The bottleneck a request is expected to hit, the first that applies in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Class {
    /// Many requests queued, or offline batch traffic: throughput matters more than latency.
    Batch,
    /// Much of the prompt is already cached.
    SharedPrefix,
    /// Long prompt, short answer: prefill dominates.
    PrefillHeavy,
    /// Long answer: decode dominates.
    DecodeHeavy,
    /// Short prompt, short answer: latency-sensitive.
    Interactive,
}

impl Class {
    pub const ALL: [Class; 5] = [
        Class::Batch,
        Class::SharedPrefix,
        Class::PrefillHeavy,
        Class::DecodeHeavy,
        Class::Interactive,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Class::Batch => "batch",
            Class::SharedPrefix => "shared-prefix",
            Class::PrefillHeavy => "prefill-heavy",
            Class::DecodeHeavy => "decode-heavy",
            Class::Interactive => "interactive",
        }
    }
}

/// Thresholds of the classifier (the `[router.classifier]` table of a policy file).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RuleConfig {
    /// Batch if at least this many requests are queued or running.
    pub batch_queue_depth: usize,
    /// Shared-prefix if at least this many prompt tokens are cached...
    pub shared_prefix_min_tokens: usize,
    /// ...or at least this share of the prompt is (0 < x <= 1).
    pub shared_prefix_min_fraction: f64,
    /// A prompt of at least this many tokens is long (prefill-heavy with a short output).
    pub long_prompt_tokens: usize,
    /// An output of at most this many tokens is short.
    pub short_output_tokens: usize,
    /// Decode-heavy if at least this many output tokens are expected.
    pub decode_heavy_output_tokens: usize,
    /// Memory pressure is high from this share of the budget on (0..=1).
    pub high_memory_pressure: f64,
}

impl Default for RuleConfig {
    fn default() -> Self {
        Self {
            batch_queue_depth: BATCH_QUEUE_DEPTH,
            shared_prefix_min_tokens: SHARED_PREFIX_MIN_TOKENS,
            shared_prefix_min_fraction: SHARED_PREFIX_MIN_FRACTION,
            long_prompt_tokens: LONG_PROMPT_TOKENS,
            short_output_tokens: SHORT_OUTPUT_TOKENS,
            decode_heavy_output_tokens: DECODE_HEAVY_OUTPUT_TOKENS,
            high_memory_pressure: HIGH_MEMORY_PRESSURE,
        }
    }
}

impl RuleConfig {
    /// Checks the thresholds that have a range.
    pub fn validate(&self) -> Result<()> {
        let f = self.shared_prefix_min_fraction;
        if !(f > 0.0 && f <= 1.0) {
            return Err(RouterError::InvalidThreshold {
                field: "classifier.shared_prefix_min_fraction",
                value: f,
                expected: "in (0, 1]",
            });
        }
        let m = self.high_memory_pressure;
        if !(0.0..=1.0).contains(&m) {
            return Err(RouterError::InvalidThreshold {
                field: "classifier.high_memory_pressure",
                value: m,
                expected: "in [0, 1]",
            });
        }
        if self.batch_queue_depth == 0 {
            return Err(RouterError::InvalidThreshold {
                field: "classifier.batch_queue_depth",
                value: 0.0,
                expected: "at least 1",
            });
        }
        Ok(())
    }

    /// The class of a request: batch, then shared-prefix, prefill-heavy, decode-heavy, and
    /// interactive when none applies.
    pub fn classify(&self, f: &RequestFeatures) -> Class {
        if f.queue_depth >= self.batch_queue_depth || f.family() == Some(WorkloadFamily::Batch) {
            Class::Batch
        } else if self.shared_prefix(f) {
            Class::SharedPrefix
        } else if f.prompt_tokens >= self.long_prompt_tokens
            && f.expected_output() <= self.short_output_tokens
        {
            Class::PrefillHeavy
        } else if f.expected_output() >= self.decode_heavy_output_tokens {
            Class::DecodeHeavy
        } else {
            Class::Interactive
        }
    }

    /// Whether enough of the prompt is cached to make prefix reuse pay.
    pub fn shared_prefix(&self, f: &RequestFeatures) -> bool {
        let cached = f.shared_prefix();
        cached > 0
            && (cached >= self.shared_prefix_min_tokens
                || f.shared_prefix_fraction() >= self.shared_prefix_min_fraction)
    }

    /// Whether the memory budget is under high pressure.
    pub fn memory_pressure_high(&self, f: &RequestFeatures) -> bool {
        f.memory_pressure() >= self.high_memory_pressure
    }

    /// The synthetic grid cell nearest the request's lengths: long prompt from
    /// `long_prompt_tokens`, long output above `short_output_tokens`.
    pub fn shape_of(&self, f: &RequestFeatures) -> Shape {
        Shape::new(
            f.prompt_tokens >= self.long_prompt_tokens,
            f.expected_output() > self.short_output_tokens,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(prompt: usize, output: usize) -> RequestFeatures {
        RequestFeatures {
            prompt_tokens: prompt,
            max_output_tokens: output,
            ..Default::default()
        }
    }

    #[test]
    fn classes_follow_thresholds_in_priority_order() {
        let c = RuleConfig::default();
        let with = |f: RequestFeatures, edit: fn(&mut RequestFeatures)| {
            let mut f = f;
            edit(&mut f);
            f
        };
        let cases: Vec<(&str, RequestFeatures, Class)> = vec![
            ("short/short", req(128, 32), Class::Interactive),
            ("long prompt, 64 out", req(512, 64), Class::PrefillHeavy),
            ("511 prompt is short", req(511, 32), Class::Interactive),
            ("65 out is not short", req(1024, 65), Class::Interactive),
            ("128 out", req(128, 128), Class::DecodeHeavy),
            ("long/long", req(1024, 128), Class::DecodeHeavy),
            (
                "hint beats the cap",
                with(req(128, 1024), |f| f.expected_output_tokens = Some(16)),
                Class::Interactive,
            ),
            (
                "queue of 8",
                with(req(128, 32), |f| f.queue_depth = 8),
                Class::Batch,
            ),
            (
                "queue of 7",
                with(req(128, 32), |f| f.queue_depth = 7),
                Class::Interactive,
            ),
            (
                "batch label",
                with(req(1024, 32), |f| f.workload = Some("batch".into())),
                Class::Batch,
            ),
            (
                "64 cached",
                with(req(1024, 32), |f| f.shared_prefix_tokens = 64),
                Class::SharedPrefix,
            ),
            (
                "63 cached of 1024",
                with(req(1024, 32), |f| f.shared_prefix_tokens = 63),
                Class::PrefillHeavy,
            ),
            (
                "half of a short prompt",
                with(req(40, 32), |f| f.shared_prefix_tokens = 20),
                Class::SharedPrefix,
            ),
            (
                "batch beats shared prefix",
                with(req(1024, 32), |f| {
                    f.shared_prefix_tokens = 512;
                    f.queue_depth = 9;
                }),
                Class::Batch,
            ),
        ];
        for (name, f, class) in cases {
            assert_eq!(c.classify(&f), class, "{name}");
        }
    }

    #[test]
    fn shape_and_memory_pressure_thresholds() {
        let c = RuleConfig::default();
        assert_eq!(c.shape_of(&req(128, 32)), Shape::SS);
        assert_eq!(c.shape_of(&req(128, 128)), Shape::SL);
        assert_eq!(c.shape_of(&req(1024, 32)), Shape::LS);
        assert_eq!(c.shape_of(&req(1024, 128)), Shape::LL);
        assert_eq!(c.shape_of(&req(512, 64)), Shape::LS);
        assert_eq!(c.shape_of(&req(511, 65)), Shape::SL);
        let mut f = req(128, 32);
        f.memory_pressure = 0.8;
        assert!(c.memory_pressure_high(&f));
        f.memory_pressure = 0.79;
        assert!(!c.memory_pressure_high(&f));
    }

    #[test]
    fn thresholds_out_of_range_are_refused() {
        let bad = RuleConfig {
            shared_prefix_min_fraction: 1.5,
            ..Default::default()
        };
        assert_eq!(
            bad.validate().unwrap_err().to_string(),
            "classifier.shared_prefix_min_fraction must be in (0, 1], got 1.5"
        );
        let bad = RuleConfig {
            high_memory_pressure: f64::NAN,
            ..Default::default()
        };
        assert_eq!(
            bad.validate().unwrap_err().to_string(),
            "classifier.high_memory_pressure must be in [0, 1], got NaN"
        );
        let bad = RuleConfig {
            batch_queue_depth: 0,
            ..Default::default()
        };
        assert_eq!(
            bad.validate().unwrap_err().to_string(),
            "classifier.batch_queue_depth must be at least 1, got 0"
        );
        assert!(RuleConfig::default().validate().is_ok());
    }
}
