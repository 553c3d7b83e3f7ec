//! The quality gate: whether a mode may serve a class of requests, judged against f16 on the
//! same text and the same items.
//!
//! A mode passes for a class when
//! - its bits per byte on held-out text rise at most `max_bpb_increase` (relative) over f16's,
//!   and
//! - on every task that stands for the class, the lower end of its paired 95 % accuracy
//!   interval against f16 is above `−max_accuracy_drop_points`.
//!
//! The lower end, not the point estimate: a mode that cannot show it keeps accuracy (too few
//! items, too many discordant answers) does not pass. f16 always passes (it is the reference).
//! What stands for a class is configurable (`[router.gate.tasks]`); by default math requests
//! are judged on GSM8K, multiple-choice requests on the multiple-choice tasks, and every other
//! class on every task measured.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use switchyard_request::Mode;

use crate::error::{Result, RouterError};
use crate::features::RequestFeatures;
use crate::rules::{Class, RuleConfig};

/// The paper's quality gate: a mode may lose at most 1.5 accuracy points against f16.
pub const MAX_ACCURACY_DROP_POINTS: f64 = 1.5;

/// Default largest relative bits-per-byte increase over f16 (+5 %).
pub const MAX_BPB_INCREASE: f64 = 0.05;

/// The class of math requests (workload label `gsm8k` or `math`).
pub const CLASS_MATH: &str = "math";
/// The class of multiple-choice requests (workload labels of the multiple-choice benchmarks).
pub const CLASS_MULTIPLE_CHOICE: &str = "multiple-choice";
/// The class of requests served while memory pressure is high.
pub const CLASS_MEMORY_PRESSURE: &str = "memory-pressure";
/// Workload labels of math requests.
pub const MATH_LABELS: [&str; 2] = ["gsm8k", "math"];
/// Workload labels of multiple-choice requests.
pub const MULTIPLE_CHOICE_LABELS: [&str; 6] = [
    "mmlu",
    "mmlu-pro",
    "arc",
    "arc-challenge",
    "hellaswag",
    "gpqa",
];
/// Stands for "every task measured" in a class's task list.
pub const ALL_TASKS: &str = "*";

/// A mode against f16 on the same items of one task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairedDelta {
    /// Items scored (the same for both).
    pub n: usize,
    /// Mean accuracy difference mode − f16, points, and its paired 95 % interval.
    pub delta_points: f64,
    pub lo_points: f64,
    pub hi_points: f64,
    /// Items only the mode answered correctly, and only f16.
    pub only_mode: usize,
    pub only_baseline: usize,
    /// McNemar's exact two-sided p-value on the discordant items.
    pub mcnemar_p: f64,
}

/// A mode's measured quality: bits per byte of the held-out text, and per task its paired
/// comparison with f16.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct QualityMeasure {
    #[serde(default)]
    pub bits_per_byte: Option<f64>,
    /// Bytes of held-out text the bits per byte were measured on.
    #[serde(default)]
    pub bpb_bytes: Option<usize>,
    #[serde(default)]
    pub tasks: BTreeMap<String, PairedDelta>,
}

/// The bounds a mode must keep (the `[router.gate]` table of a policy or configuration file).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Gate {
    /// Largest relative bits-per-byte increase over f16 (0.05 = +5 %).
    pub max_bpb_increase: f64,
    /// The lower end of a task's paired 95 % interval must be above minus this many points.
    pub max_accuracy_drop_points: f64,
    /// Tasks that stand for each class (`"*"`: every task measured). A class not listed is
    /// judged on every task measured.
    pub tasks: BTreeMap<String, Vec<String>>,
}

impl Default for Gate {
    fn default() -> Self {
        let list = |ts: &[&str]| ts.iter().map(|t| t.to_string()).collect::<Vec<_>>();
        Gate {
            max_bpb_increase: MAX_BPB_INCREASE,
            max_accuracy_drop_points: MAX_ACCURACY_DROP_POINTS,
            tasks: BTreeMap::from([
                (CLASS_MATH.to_string(), list(&["gsm8k"])),
                (
                    CLASS_MULTIPLE_CHOICE.to_string(),
                    list(&["arc-challenge", "hellaswag", "mmlu"]),
                ),
            ]),
        }
    }
}

/// Why a mode fails the gate for a class.
#[derive(Debug, Clone, PartialEq)]
pub enum GateFailure {
    /// f16's quality was not measured, so nothing can be compared.
    NoBaseline,
    /// The mode has no bits per byte where f16 has one.
    NoBitsPerByte,
    /// Bits per byte rose more than the bound.
    BitsPerByte { increase: f64, bound: f64 },
    /// A task that stands for the class was not scored for the mode.
    TaskMissing { task: String },
    /// A task's paired interval reaches below the bound.
    Accuracy {
        task: String,
        lo_points: f64,
        bound: f64,
    },
}

impl std::fmt::Display for GateFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GateFailure::NoBaseline => write!(f, "f16's quality was not measured"),
            GateFailure::NoBitsPerByte => write!(f, "no bits per byte measured"),
            GateFailure::BitsPerByte { increase, bound } => write!(
                f,
                "bits per byte +{:.2} % over f16 (bound +{:.2} %)",
                100.0 * increase,
                100.0 * bound
            ),
            GateFailure::TaskMissing { task } => write!(f, "{task} not scored"),
            GateFailure::Accuracy {
                task,
                lo_points,
                bound,
            } => write!(
                f,
                "{task}: paired 95 % interval reaches {lo_points:+.2} points (bound −{bound})"
            ),
        }
    }
}

impl Gate {
    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("gate.max_bpb_increase", self.max_bpb_increase),
            (
                "gate.max_accuracy_drop_points",
                self.max_accuracy_drop_points,
            ),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(RouterError::InvalidThreshold {
                    field,
                    value: v,
                    expected: "non-negative and finite",
                });
            }
        }
        Ok(())
    }

    /// The tasks that stand for `class` among those measured (`measured`).
    pub fn tasks_for<'a>(&'a self, class: &str, measured: &'a [String]) -> Vec<&'a str> {
        match self.tasks.get(class) {
            Some(list) if !list.iter().any(|t| t == ALL_TASKS) => {
                list.iter().map(String::as_str).collect()
            }
            _ => measured.iter().map(String::as_str).collect(),
        }
    }

    /// Every reason `mode` fails for `class` (empty: it passes), from the modes' measured
    /// quality (`quality[f16]` is the baseline). With no quality measured at all the gate has
    /// nothing to judge and every mode passes (the caller's other constraints still apply).
    pub fn failures(
        &self,
        quality: &BTreeMap<Mode, QualityMeasure>,
        mode: Mode,
        class: &str,
    ) -> Vec<GateFailure> {
        if mode == Mode::BASELINE || quality.is_empty() {
            return Vec::new();
        }
        let Some(base) = quality.get(&Mode::BASELINE) else {
            return vec![GateFailure::NoBaseline];
        };
        let empty = QualityMeasure::default();
        let m = quality.get(&mode).unwrap_or(&empty);
        let mut out = Vec::new();
        match (base.bits_per_byte, m.bits_per_byte) {
            (Some(b), Some(x)) if b > 0.0 => {
                let increase = x / b - 1.0;
                if increase > self.max_bpb_increase {
                    out.push(GateFailure::BitsPerByte {
                        increase,
                        bound: self.max_bpb_increase,
                    });
                }
            }
            (Some(_), None) => out.push(GateFailure::NoBitsPerByte),
            _ => {}
        }
        // The tasks measured are those of the baseline's comparison set (f16 is paired with
        // itself), or else any mode's.
        let mut measured: Vec<String> = quality
            .values()
            .flat_map(|q| q.tasks.keys().cloned())
            .collect();
        measured.sort();
        measured.dedup();
        for task in self.tasks_for(class, &measured) {
            match m.tasks.get(task) {
                None => out.push(GateFailure::TaskMissing {
                    task: task.to_string(),
                }),
                // A NaN lower end (fewer than two items) cannot show the bound is kept.
                Some(d)
                    if d.lo_points.is_nan() || d.lo_points <= -self.max_accuracy_drop_points =>
                {
                    out.push(GateFailure::Accuracy {
                        task: task.to_string(),
                        lo_points: d.lo_points,
                        bound: self.max_accuracy_drop_points,
                    })
                }
                Some(_) => {}
            }
        }
        out
    }

    pub fn passes(
        &self,
        quality: &BTreeMap<Mode, QualityMeasure>,
        mode: Mode,
        class: &str,
    ) -> bool {
        self.failures(quality, mode, class).is_empty()
    }
}

/// The gate class of a request: `math` or `multiple-choice` from its workload label, else the
/// classifier's class, with `memory-pressure` where that is high and the request is neither
/// batch nor shared-prefix (the order the policies use).
pub fn request_class(f: &RequestFeatures, classifier: &RuleConfig) -> String {
    if f.workload_in(&MATH_LABELS) {
        return CLASS_MATH.to_string();
    }
    if f.workload_in(&MULTIPLE_CHOICE_LABELS) {
        return CLASS_MULTIPLE_CHOICE.to_string();
    }
    let class = classifier.classify(f);
    if !matches!(class, Class::Batch | Class::SharedPrefix) && classifier.memory_pressure_high(f) {
        return CLASS_MEMORY_PRESSURE.to_string();
    }
    class.name().to_string()
}

/// The gate class a matrix cell's requests belong to: the grid shapes by their bottleneck
/// (`SS` interactive, `LS` prefill-heavy, `SL` and `LL` decode-heavy), the situational cells
/// by name, task cells by their task's class; any other cell is its own class.
pub fn cell_class(cell: &str) -> String {
    let lower = cell.to_ascii_lowercase();
    match lower.as_str() {
        "ss" => Class::Interactive.name().to_string(),
        "ls" => Class::PrefillHeavy.name().to_string(),
        "sl" | "ll" => Class::DecodeHeavy.name().to_string(),
        l if MATH_LABELS.contains(&l) => CLASS_MATH.to_string(),
        l if MULTIPLE_CHOICE_LABELS.contains(&l) => CLASS_MULTIPLE_CHOICE.to_string(),
        _ => lower,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delta(lo: f64) -> PairedDelta {
        PairedDelta {
            n: 500,
            delta_points: lo + 2.0,
            lo_points: lo,
            hi_points: lo + 4.0,
            only_mode: 10,
            only_baseline: 12,
            mcnemar_p: 0.8,
        }
    }

    fn quality() -> BTreeMap<Mode, QualityMeasure> {
        let q = |bpb: f64, gsm: f64, mmlu: f64| QualityMeasure {
            bits_per_byte: Some(bpb),
            bpb_bytes: Some(100_000),
            tasks: BTreeMap::from([
                ("gsm8k".to_string(), delta(gsm)),
                ("mmlu".to_string(), delta(mmlu)),
            ]),
        };
        BTreeMap::from([
            (Mode::F16, q(0.50, 0.0, 0.0)),
            (Mode::Int8, q(0.501, -1.0, -1.2)),
            (Mode::Q4, q(0.55, -3.0, -1.0)),
            (Mode::Q4Awq, q(0.52, -1.4, -2.5)),
        ])
    }

    #[test]
    fn a_mode_passes_by_its_bits_per_byte_and_the_lower_end_of_each_classes_tasks() {
        let g = Gate::default();
        let q = quality();
        assert!(g.passes(&q, Mode::F16, "interactive"));
        assert!(g.passes(&q, Mode::Int8, "interactive"));
        // q4: +10 % bits per byte fails everywhere, and GSM8K's interval fails math.
        assert_eq!(
            g.failures(&q, Mode::Q4, CLASS_MATH),
            vec![
                GateFailure::BitsPerByte {
                    increase: 0.55 / 0.50 - 1.0,
                    bound: 0.05
                },
                GateFailure::Accuracy {
                    task: "gsm8k".into(),
                    lo_points: -3.0,
                    bound: 1.5
                }
            ]
        );
        // q4-awq: +4 % passes bits per byte; GSM8K passes, MMLU does not.
        assert!(g.passes(&q, Mode::Q4Awq, CLASS_MATH));
        assert!(!g.passes(&q, Mode::Q4Awq, CLASS_MULTIPLE_CHOICE));
        assert!(!g.passes(&q, Mode::Q4Awq, "interactive"), "every task");
        // An unmeasured mode cannot pass; nothing measured at all gates nothing.
        assert_eq!(
            g.failures(&q, Mode::Q4Gptq, "interactive")[0],
            GateFailure::NoBitsPerByte
        );
        assert!(g.passes(&BTreeMap::new(), Mode::Q4, "interactive"));
        assert_eq!(
            GateFailure::Accuracy {
                task: "mmlu".into(),
                lo_points: -2.5,
                bound: 1.5
            }
            .to_string(),
            "mmlu: paired 95 % interval reaches -2.50 points (bound −1.5)"
        );
    }

    #[test]
    fn classes_of_requests_and_cells() {
        let c = RuleConfig::default();
        let f = |label: Option<&str>, prompt: usize, out: usize, pressure: f64| RequestFeatures {
            prompt_tokens: prompt,
            max_output_tokens: out,
            memory_pressure: pressure,
            workload: label.map(str::to_string),
            ..Default::default()
        };
        assert_eq!(request_class(&f(Some("GSM8K"), 100, 256, 0.0), &c), "math");
        assert_eq!(
            request_class(&f(Some("mmlu"), 100, 1, 0.0), &c),
            "multiple-choice"
        );
        assert_eq!(request_class(&f(None, 100, 32, 0.0), &c), "interactive");
        assert_eq!(request_class(&f(None, 1024, 32, 0.0), &c), "prefill-heavy");
        assert_eq!(
            request_class(&f(None, 100, 256, 0.9), &c),
            "memory-pressure"
        );
        assert_eq!(request_class(&f(Some("batch"), 100, 32, 0.9), &c), "batch");
        for (cell, class) in [
            ("SS", "interactive"),
            ("LS", "prefill-heavy"),
            ("SL", "decode-heavy"),
            ("LL", "decode-heavy"),
            ("batch", "batch"),
            ("shared-prefix", "shared-prefix"),
            ("gsm8k", "math"),
            ("hellaswag", "multiple-choice"),
        ] {
            assert_eq!(cell_class(cell), class, "{cell}");
        }
    }
}
