//! The priority policy: an ordered list of rules (condition -> mode), the first that holds
//! picks the mode. It is data, loaded from a `[router]` TOML table an operator edits without a
//! rebuild, and validated once into a [`Policy`] that cannot name an unknown mode.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use switchyard_request::Mode;

use crate::decision::{Decision, ModeSet, Router};
use crate::error::{Result, RouterError};
use crate::features::{RequestFeatures, Shape};
use crate::gate::Gate;
use crate::rules::{Class, RuleConfig};

/// When a rule applies. In TOML a condition is a string for the ones without a value
/// (`when = "always"`, `when = "memory-pressure-high"`) and a one-key inline table otherwise
/// (`when = { class = "batch" }`, `when = { workload = ["gsm8k"] }`,
/// `when = { any = [{ class = "decode-heavy" }, { workload = ["gsm8k"] }] }`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Condition {
    /// Every request.
    Always,
    /// The classifier puts the request in this class.
    Class(Class),
    /// Memory pressure is at or above `classifier.high_memory_pressure`.
    MemoryPressureHigh,
    /// The workload label is one of these (case-insensitive).
    Workload(Vec<String>),
    /// The workload label is one of these synthetic grid shapes ("SS", "SL", "LS", "LL").
    Shape(Vec<Shape>),
    /// At least one of these holds.
    Any(Vec<Condition>),
    /// All of these hold.
    All(Vec<Condition>),
}

impl Condition {
    /// Whether the condition holds for a request the classifier put in `class`.
    pub fn holds(&self, f: &RequestFeatures, class: Class, config: &RuleConfig) -> bool {
        match self {
            Condition::Always => true,
            Condition::Class(c) => *c == class,
            Condition::MemoryPressureHigh => config.memory_pressure_high(f),
            Condition::Workload(labels) => f.workload_in(labels),
            Condition::Shape(shapes) => f
                .workload
                .as_deref()
                .and_then(Shape::from_label)
                .is_some_and(|s| shapes.contains(&s)),
            Condition::Any(cs) => cs.iter().any(|c| c.holds(f, class, config)),
            Condition::All(cs) => cs.iter().all(|c| c.holds(f, class, config)),
        }
    }

    /// Why the condition is malformed, if it is: every list must be non-empty.
    fn problem(&self) -> Option<&'static str> {
        match self {
            Condition::Always | Condition::Class(_) | Condition::MemoryPressureHigh => None,
            Condition::Workload(labels) if labels.is_empty() => {
                Some("`workload` needs at least one label")
            }
            Condition::Shape(shapes) if shapes.is_empty() => {
                Some("`shape` needs at least one shape")
            }
            Condition::Any(cs) if cs.is_empty() => Some("`any` needs at least one condition"),
            Condition::All(cs) if cs.is_empty() => Some("`all` needs at least one condition"),
            Condition::Any(cs) | Condition::All(cs) => cs.iter().find_map(Condition::problem),
            Condition::Workload(_) | Condition::Shape(_) => None,
        }
    }
}

/// One line of the policy: when `when` holds, serve in `mode`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rule {
    /// A short unique name; decisions report it as `"<position>:<id>"`.
    pub id: String,
    pub when: Condition,
    pub mode: Mode,
}

impl Rule {
    pub fn new(id: &str, when: Condition, mode: Mode) -> Rule {
        Rule {
            id: id.to_string(),
            when,
            mode,
        }
    }
}

/// A validated policy: classifier thresholds in range, at least one rule, unique non-empty
/// ids, known modes, no empty condition list.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Policy {
    classifier: RuleConfig,
    /// The quality gate the policy was fitted under (`router fit` records it; serving does
    /// not read it).
    #[serde(skip_serializing_if = "Option::is_none")]
    gate: Option<Gate>,
    rules: Vec<Rule>,
}

/// The policy file as written, before its mode names are checked.
#[derive(Deserialize)]
struct PolicyFile {
    router: RawPolicy,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    #[serde(default)]
    classifier: RuleConfig,
    #[serde(default)]
    gate: Option<Gate>,
    #[serde(default)]
    rules: Vec<RawRule>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    id: String,
    when: Condition,
    mode: String,
}

#[derive(Serialize)]
struct PolicyFileOut<'a> {
    router: &'a Policy,
}

impl Policy {
    /// Checks and wraps a classifier configuration and an ordered rule list.
    pub fn new(classifier: RuleConfig, rules: Vec<Rule>) -> Result<Policy> {
        classifier.validate()?;
        if rules.is_empty() {
            return Err(RouterError::EmptyPolicy);
        }
        let mut seen = HashSet::new();
        for (i, rule) in rules.iter().enumerate() {
            let invalid = |reason: &str| RouterError::InvalidRule {
                index: i + 1,
                id: rule.id.clone(),
                reason: reason.to_string(),
            };
            if rule.id.trim().is_empty() {
                return Err(invalid("the id must not be empty"));
            }
            if !seen.insert(rule.id.as_str()) {
                return Err(invalid("the id is used by an earlier rule"));
            }
            if let Some(problem) = rule.when.problem() {
                return Err(invalid(problem));
            }
        }
        Ok(Policy {
            classifier,
            gate: None,
            rules,
        })
    }

    /// The same policy, recording the gate it was fitted under.
    pub fn with_gate(mut self, gate: Gate) -> Result<Policy> {
        gate.validate()?;
        self.gate = Some(gate);
        Ok(self)
    }

    pub fn gate(&self) -> Option<&Gate> {
        self.gate.as_ref()
    }

    /// Reads the `[router]` table of a TOML document (other tables are ignored, so the table
    /// can live in a larger configuration file).
    pub fn from_toml(text: &str) -> Result<Policy> {
        let file: PolicyFile = toml::from_str(text).map_err(|e| toml_error(text, &e))?;
        let raw = file.router;
        let mut rules = Vec::with_capacity(raw.rules.len());
        for (i, r) in raw.rules.into_iter().enumerate() {
            let mode = r.mode.parse().map_err(|source| RouterError::UnknownMode {
                index: i + 1,
                id: r.id.clone(),
                source,
            })?;
            rules.push(Rule {
                id: r.id,
                when: r.when,
                mode,
            });
        }
        let policy = Policy::new(raw.classifier, rules)?;
        match raw.gate {
            Some(gate) => policy.with_gate(gate),
            None => Ok(policy),
        }
    }

    /// The policy as a `[router]` TOML table that [`Policy::from_toml`] reads back.
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string(&PolicyFileOut { router: self })
            .map_err(|e| RouterError::PolicyToml(e.to_string()))
    }

    pub fn classifier(&self) -> &RuleConfig {
        &self.classifier
    }

    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }
}

/// The parser's message, prefixed with the line it points at so an operator can find it.
fn toml_error(text: &str, e: &toml::de::Error) -> RouterError {
    let message = e.message().trim_end();
    match e.span() {
        // An empty or whole-document span at the start (a missing table) points at no line.
        Some(span) if !(span.start == 0 && (span.is_empty() || span.end == text.len())) => {
            let line = text
                .get(..span.start)
                .map_or(0, |before| before.matches('\n').count())
                + 1;
            RouterError::PolicyToml(format!("line {line}: {message}"))
        }
        _ => RouterError::PolicyToml(message.to_string()),
    }
}

impl Default for Policy {
    /// The paper's priority order (ModeSwitch-LLM section 4.6), with f16 as the emergency
    /// fallback when the chosen mode cannot be served.
    fn default() -> Policy {
        let labels = |ls: &[&str]| ls.iter().map(|l| l.to_string()).collect::<Vec<_>>();
        Policy {
            classifier: RuleConfig::default(),
            gate: None,
            rules: vec![
                Rule::new(
                    "batch",
                    Condition::Class(Class::Batch),
                    Mode::Int8ContinuousBatching,
                ),
                Rule::new(
                    "shared-prefix",
                    Condition::Class(Class::SharedPrefix),
                    Mode::Q4PrefixCache,
                ),
                Rule::new("memory-pressure", Condition::MemoryPressureHigh, Mode::Q4),
                Rule::new(
                    "synthetic-shape",
                    Condition::Shape(vec![Shape::SS, Shape::LS, Shape::LL]),
                    Mode::Q4,
                ),
                Rule::new(
                    "decode-heavy",
                    Condition::Any(vec![
                        Condition::Class(Class::DecodeHeavy),
                        Condition::Workload(labels(&["gsm8k", "math"])),
                    ]),
                    Mode::Speculative,
                ),
                Rule::new(
                    "multiple-choice",
                    Condition::Any(vec![
                        Condition::Workload(labels(&[
                            "mmlu",
                            "mmlu-pro",
                            "arc",
                            "hellaswag",
                            "gpqa",
                            "truthfulqa",
                        ])),
                        Condition::Class(Class::PrefillHeavy),
                    ]),
                    Mode::Int8,
                ),
                Rule::new("default", Condition::Always, Mode::Int8),
            ],
        }
    }
}

/// The default policy as an operator would write it; `Policy::from_toml(DEFAULT_POLICY_TOML)`
/// equals `Policy::default()`. Copy it to a file, edit, and load it with [`Policy::from_toml`].
pub const DEFAULT_POLICY_TOML: &str = r#"# ModeSwitch routing policy.
#
# Each request is classified once (batch, shared-prefix, prefill-heavy, decode-heavy or
# interactive, the first that applies), then the rules are tried in order and the first whose
# `when` holds picks the mode. If that mode cannot be served (not loaded, does not fit), the
# request falls back to f16. Modes: f16, f32, int8, q4, q4-awq, speculative,
# self-speculative, prefix-cache, chunked-prefill, continuous-batching, kv-compressed,
# q4+prefix-cache, int8+continuous-batching, q4-gptq, q4-gptq+prefix-cache.
#
# Conditions: "always", "memory-pressure-high", { class = "<class>" },
# { workload = ["<label>", ...] }, { shape = ["SS" | "SL" | "LS" | "LL", ...] } (synthetic
# grid labels), { any = [<condition>, ...] }, { all = [<condition>, ...] }.

[router.classifier]
batch_queue_depth = 8            # batch from this many queued or running requests (or label "batch")
shared_prefix_min_tokens = 64    # shared-prefix from this many cached prompt tokens...
shared_prefix_min_fraction = 0.5 # ...or this share of the prompt cached
long_prompt_tokens = 512         # prefill-heavy: a prompt this long...
short_output_tokens = 64         # ...with at most this many output tokens
decode_heavy_output_tokens = 128 # decode-heavy from this many expected output tokens
high_memory_pressure = 0.8       # memory pressure is high from this share of the budget

# 1. Batch traffic: throughput first.
[[router.rules]]
id = "batch"
when = { class = "batch" }
mode = "int8+continuous-batching"

# 2. Shared-prefix chat: reuse the cached prefix, 4-bit weights.
[[router.rules]]
id = "shared-prefix"
when = { class = "shared-prefix" }
mode = "q4+prefix-cache"

# 3. Memory pressure: the smallest weights.
[[router.rules]]
id = "memory-pressure"
when = "memory-pressure-high"
mode = "q4"

# 4. Synthetic SS / LS / LL shapes: 4-bit was the best balance on these.
[[router.rules]]
id = "synthetic-shape"
when = { shape = ["SS", "LS", "LL"] }
mode = "q4"

# 5. Decode-heavy, long output, long math: speculative decoding.
[[router.rules]]
id = "decode-heavy"
when = { any = [{ class = "decode-heavy" }, { workload = ["gsm8k", "math"] }] }
mode = "speculative"

# 6. Multiple-choice benchmarks and prefill-heavy prompts: int8 kept accuracy best.
[[router.rules]]
id = "multiple-choice"
when = { any = [{ workload = ["mmlu", "mmlu-pro", "arc", "hellaswag", "gpqa", "truthfulqa"] }, { class = "prefill-heavy" }] }
mode = "int8"

# 7. Everything else.
[[router.rules]]
id = "default"
when = "always"
mode = "int8"
"#;

/// The rule-based ModeSwitch router: classify, then the first rule that holds.
#[derive(Debug, Clone)]
pub struct RulesRouter {
    policy: Policy,
    /// `"<position>:<id>"` of each rule, built once so a decision only clones it.
    labels: Vec<String>,
}

/// Reported when no rule holds (a policy without a catch-all rule).
pub const NO_RULE: &str = "none";

impl RulesRouter {
    pub fn new(policy: Policy) -> RulesRouter {
        let labels = policy
            .rules
            .iter()
            .enumerate()
            .map(|(i, r)| format!("{}:{}", i + 1, r.id))
            .collect();
        RulesRouter { policy, labels }
    }

    /// A router for the policy in a TOML document's `[router]` table.
    pub fn from_toml(text: &str) -> Result<RulesRouter> {
        Policy::from_toml(text).map(RulesRouter::new)
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }
}

impl Default for RulesRouter {
    fn default() -> Self {
        RulesRouter::new(Policy::default())
    }
}

impl Router for RulesRouter {
    fn name(&self) -> String {
        "rules".to_string()
    }

    fn route_among(&self, f: &RequestFeatures, available: ModeSet) -> Decision {
        let config = &self.policy.classifier;
        let class = config.classify(f);
        let fired = self
            .policy
            .rules
            .iter()
            .zip(&self.labels)
            .find(|(rule, _)| rule.when.holds(f, class, config));
        match fired {
            Some((rule, label)) => Decision::checked(rule.mode, label.clone(), class, available),
            None => Decision {
                mode: Mode::BASELINE,
                rule: NO_RULE.to_string(),
                class,
                fallback: true,
            },
        }
    }
}
