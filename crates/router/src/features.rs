//! What the router knows about a request before generation: the six cheap features of
//! ModeSwitch (prompt length, expected output, shared prefix, memory pressure, batch pressure,
//! workload label) and their fixed numeric encoding for learned routers.

use serde::{Deserialize, Serialize};

/// Workload labels of the math family (long step-by-step generations).
pub const MATH_LABELS: [&str; 2] = ["gsm8k", "math"];
/// Workload labels of multiple-choice benchmarks (short answers after a long prompt).
pub const MULTIPLE_CHOICE_LABELS: [&str; 8] = [
    "mmlu",
    "mmlu-pro",
    "arc",
    "arc-easy",
    "arc-challenge",
    "hellaswag",
    "gpqa",
    "truthfulqa",
];
/// Workload labels of chat traffic (multi-turn, shared system prompts).
pub const CHAT_LABELS: [&str; 3] = ["chat", "sharegpt", "shared-prefix"];
/// The workload label of offline batch traffic.
pub const BATCH_LABEL: &str = "batch";

/// One of the paper's synthetic prompt x output grid cells (SS 128/32, SL 128/128, LS 1024/32,
/// LL 1024/128 tokens): first letter prompt length, second output length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Shape {
    SS,
    SL,
    LS,
    LL,
}

impl Shape {
    pub const ALL: [Shape; 4] = [Shape::SS, Shape::SL, Shape::LS, Shape::LL];

    /// The shape with a long (`true`) or short prompt and output.
    pub fn new(long_prompt: bool, long_output: bool) -> Shape {
        match (long_prompt, long_output) {
            (false, false) => Shape::SS,
            (false, true) => Shape::SL,
            (true, false) => Shape::LS,
            (true, true) => Shape::LL,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Shape::SS => "SS",
            Shape::SL => "SL",
            Shape::LS => "LS",
            Shape::LL => "LL",
        }
    }

    /// The shape a workload label names, if it names one (case-insensitive).
    pub fn from_label(label: &str) -> Option<Shape> {
        Shape::ALL
            .into_iter()
            .find(|s| s.name().eq_ignore_ascii_case(label))
    }

    pub fn long_prompt(self) -> bool {
        matches!(self, Shape::LS | Shape::LL)
    }

    pub fn long_output(self) -> bool {
        matches!(self, Shape::SL | Shape::LL)
    }
}

/// The family a workload label belongs to; learned routers see the family, not the label, so
/// an unseen benchmark of a known kind still encodes sensibly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadFamily {
    /// [`BATCH_LABEL`].
    Batch,
    /// [`CHAT_LABELS`].
    Chat,
    /// A synthetic grid shape, [`Shape`].
    Shape,
    /// [`MATH_LABELS`].
    Math,
    /// [`MULTIPLE_CHOICE_LABELS`].
    MultipleChoice,
    /// A label none of the above knows.
    Other,
}

impl WorkloadFamily {
    /// The family of a label (case-insensitive).
    pub fn of_label(label: &str) -> WorkloadFamily {
        let is = |set: &[&str]| set.iter().any(|l| l.eq_ignore_ascii_case(label));
        if label.eq_ignore_ascii_case(BATCH_LABEL) {
            WorkloadFamily::Batch
        } else if is(&CHAT_LABELS) {
            WorkloadFamily::Chat
        } else if Shape::from_label(label).is_some() {
            WorkloadFamily::Shape
        } else if is(&MATH_LABELS) {
            WorkloadFamily::Math
        } else if is(&MULTIPLE_CHOICE_LABELS) {
            WorkloadFamily::MultipleChoice
        } else {
            WorkloadFamily::Other
        }
    }
}

/// Columns of [`RequestFeatures::vector`].
pub const FEATURE_COUNT: usize = 13;

/// Name of each column of [`RequestFeatures::vector`], in order.
pub const FEATURE_NAMES: [&str; FEATURE_COUNT] = [
    "prompt_tokens",
    "expected_output_tokens",
    "max_output_tokens",
    "shared_prefix_tokens",
    "shared_prefix_fraction",
    "memory_pressure",
    "queue_depth",
    "family_batch",
    "family_chat",
    "family_shape",
    "family_math",
    "family_multiple_choice",
    "family_other",
];

/// The features of one request, all known before its first token is generated.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RequestFeatures {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// The request's generation cap (`max_tokens`).
    pub max_output_tokens: usize,
    /// A better guess of the output length than the cap, when the caller has one (a workload
    /// family's typical answer length, a client hint).
    pub expected_output_tokens: Option<usize>,
    /// Tokens of the prompt already in the prefix cache.
    pub shared_prefix_tokens: usize,
    /// Share of the memory budget in use, 0 to 1.
    pub memory_pressure: f64,
    /// Requests waiting or running: the batch pressure.
    pub queue_depth: usize,
    /// Label of the known workload family the request belongs to ("gsm8k", "mmlu", "SS", "chat",
    /// "batch", ...), if any.
    pub workload: Option<String>,
}

impl RequestFeatures {
    /// Expected output tokens: the hint when given, else the cap.
    pub fn expected_output(&self) -> usize {
        self.expected_output_tokens
            .unwrap_or(self.max_output_tokens)
    }

    /// Cached prefix tokens, never more than the prompt.
    pub fn shared_prefix(&self) -> usize {
        self.shared_prefix_tokens.min(self.prompt_tokens)
    }

    /// Share of the prompt already cached, 0 for an empty prompt.
    pub fn shared_prefix_fraction(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.shared_prefix() as f64 / self.prompt_tokens as f64
        }
    }

    /// Memory pressure clamped to 0..=1; a value that is not a number reads as 0, so a broken
    /// gauge never pushes traffic to the memory-pressure mode.
    pub fn memory_pressure(&self) -> f64 {
        if self.memory_pressure.is_nan() {
            0.0
        } else {
            self.memory_pressure.clamp(0.0, 1.0)
        }
    }

    /// The family of the workload label, if there is a label.
    pub fn family(&self) -> Option<WorkloadFamily> {
        self.workload.as_deref().map(WorkloadFamily::of_label)
    }

    /// Whether the workload label is one of `labels` (case-insensitive).
    pub fn workload_in<S: AsRef<str>>(&self, labels: &[S]) -> bool {
        self.workload
            .as_deref()
            .is_some_and(|w| labels.iter().any(|l| l.as_ref().eq_ignore_ascii_case(w)))
    }

    /// The fixed numeric encoding learned routers see ([`FEATURE_NAMES`] names the columns):
    ///
    /// | column | value |
    /// |---|---|
    /// | 0 | prompt tokens |
    /// | 1 | expected output tokens ([`Self::expected_output`]) |
    /// | 2 | max output tokens |
    /// | 3 | shared prefix tokens, at most the prompt |
    /// | 4 | shared prefix fraction of the prompt, 0..=1 |
    /// | 5 | memory pressure, 0..=1 ([`Self::memory_pressure`]) |
    /// | 6 | queue depth |
    /// | 7..=12 | one-hot workload family: batch, chat, shape, math, multiple-choice, other; all 0 without a label |
    ///
    /// Counts are raw (not logs): trees split on them as they are and the logistic router
    /// standardises them itself.
    pub fn vector(&self) -> [f64; FEATURE_COUNT] {
        let mut v = [0.0; FEATURE_COUNT];
        v[0] = self.prompt_tokens as f64;
        v[1] = self.expected_output() as f64;
        v[2] = self.max_output_tokens as f64;
        v[3] = self.shared_prefix() as f64;
        v[4] = self.shared_prefix_fraction();
        v[5] = self.memory_pressure();
        v[6] = self.queue_depth as f64;
        if let Some(family) = self.family() {
            let column = match family {
                WorkloadFamily::Batch => 7,
                WorkloadFamily::Chat => 8,
                WorkloadFamily::Shape => 9,
                WorkloadFamily::Math => 10,
                WorkloadFamily::MultipleChoice => 11,
                WorkloadFamily::Other => 12,
            };
            v[column] = 1.0;
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vector_encodes_each_column() {
        let f = RequestFeatures {
            prompt_tokens: 200,
            max_output_tokens: 256,
            expected_output_tokens: Some(100),
            shared_prefix_tokens: 50,
            memory_pressure: 0.25,
            queue_depth: 3,
            workload: Some("GSM8K".into()),
        };
        let v = f.vector();
        assert_eq!(v[0], 200.0, "prompt tokens");
        assert_eq!(v[1], 100.0, "expected output: the hint, not the cap");
        assert_eq!(v[2], 256.0, "max output tokens");
        assert_eq!(v[3], 50.0, "shared prefix tokens");
        assert_eq!(v[4], 0.25, "shared prefix fraction");
        assert_eq!(v[5], 0.25, "memory pressure");
        assert_eq!(v[6], 3.0, "queue depth");
        assert_eq!(&v[7..], &[0.0, 0.0, 0.0, 1.0, 0.0, 0.0], "math one-hot");
        assert_eq!(FEATURE_NAMES[10], "family_math");
    }

    #[test]
    fn vector_clamps_and_defaults() {
        let f = RequestFeatures {
            prompt_tokens: 10,
            max_output_tokens: 64,
            shared_prefix_tokens: 40,
            memory_pressure: f64::NAN,
            ..Default::default()
        };
        let v = f.vector();
        assert_eq!(v[1], 64.0, "no hint: expected output is the cap");
        assert_eq!(v[3], 10.0, "shared prefix capped at the prompt");
        assert_eq!(v[4], 1.0);
        assert_eq!(v[5], 0.0, "NaN pressure reads as 0");
        assert_eq!(&v[7..], &[0.0; 6], "no label: no family");
        let over = RequestFeatures {
            memory_pressure: 1.7,
            ..Default::default()
        };
        assert_eq!(over.vector()[4], 0.0, "empty prompt has no cached share");
        assert_eq!(over.vector()[5], 1.0);
    }

    #[test]
    fn labels_map_to_families_and_shapes() {
        let cases = [
            ("batch", WorkloadFamily::Batch, 7),
            ("chat", WorkloadFamily::Chat, 8),
            ("ll", WorkloadFamily::Shape, 9),
            ("gsm8k", WorkloadFamily::Math, 10),
            ("HellaSwag", WorkloadFamily::MultipleChoice, 11),
            ("poetry", WorkloadFamily::Other, 12),
        ];
        for (label, family, column) in cases {
            let f = RequestFeatures {
                workload: Some(label.into()),
                ..Default::default()
            };
            assert_eq!(f.family(), Some(family), "{label}");
            let v = f.vector();
            assert_eq!(v[column], 1.0, "{label}");
            assert_eq!(v[7..].iter().sum::<f64>(), 1.0, "{label}: one-hot");
        }
        assert_eq!(Shape::from_label("ls"), Some(Shape::LS));
        assert_eq!(Shape::from_label("XL"), None);
        assert_eq!(Shape::new(true, false), Shape::LS);
        assert!(Shape::SL.long_output() && !Shape::SL.long_prompt());
    }

    #[test]
    fn features_read_from_json_with_defaults() {
        let f: RequestFeatures =
            serde_json::from_str(r#"{"prompt_tokens": 128, "workload": "SS"}"#).unwrap();
        assert_eq!(f.prompt_tokens, 128);
        assert_eq!(f.max_output_tokens, 0);
        assert_eq!(f.expected_output_tokens, None);
        assert_eq!(f.workload.as_deref(), Some("SS"));
    }
}
