//! The constraint-aware oracle: from a measured matrix (mode x workload cell), the fastest mode
//! that keeps accuracy, energy and memory within bounds of the f16 baseline measured in the same
//! cell. It is the upper bound the rules are judged against and the teacher of the learned
//! routers.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use switchyard_request::Mode;

use crate::decision::{Decision, ModeSet, Router};
use crate::error::{Result, RouterError};
use crate::features::{RequestFeatures, Shape};
use crate::gate::{self, Gate, QualityMeasure};

pub use crate::gate::MAX_ACCURACY_DROP_POINTS;
use crate::learned::Example;
use crate::rules::{Class, RuleConfig};

/// Cell of batch traffic.
pub const CELL_BATCH: &str = "batch";
/// Cell of the shared-prefix chat workload.
pub const CELL_SHARED_PREFIX: &str = "shared-prefix";
/// Cell of the memory-pressure long-context workload.
pub const CELL_MEMORY_PRESSURE: &str = "memory-pressure";

/// Nominal (prompt, output) tokens of each grid shape (the paper's 2x2 grid), used to find the
/// nearest shape cell a matrix has when it lacks the request's own.
const SHAPE_POINTS: [(Shape, f64, f64); 4] = [
    (Shape::SS, 128.0, 32.0),
    (Shape::SL, 128.0, 128.0),
    (Shape::LS, 1024.0, 32.0),
    (Shape::LL, 1024.0, 128.0),
];

/// What one mode measured on one workload cell (means over the cell's requests).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellMeasure {
    /// Mean end-to-end latency, seconds.
    pub latency_s: f64,
    /// Energy per output token, joules, where a power counter was readable.
    #[serde(default)]
    pub energy_j_per_token: Option<f64>,
    /// Peak memory, bytes.
    pub peak_memory_bytes: u64,
    /// Benchmark accuracy (exact match), points out of 100, where the cell has answers.
    #[serde(default)]
    pub accuracy_points: Option<f64>,
    /// A generation quality score (e.g. ROUGE-L x 100), where measured.
    #[serde(default)]
    pub quality_points: Option<f64>,
}

/// Measurements of modes per workload cell: `cells[cell][mode]`. Cells are named freely
/// ("SS", "gsm8k", "shared-prefix", ...); every cell must hold the baseline (f16), unless
/// `baseline_failed` says why f16 could not run there (a workload whose prompts do not fit f16's
/// memory): in such a cell the constraints against f16 cannot be checked, and only the memory
/// limit and the quality gate judge a mode.
/// In JSON: `{"cells": {"SS": {"f16": {"latency_s": 1.0, "peak_memory_bytes": 100}, ...}}}`.
/// `quality` (optional) holds each mode's measured quality against f16 for the [`Gate`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModeMatrix {
    pub cells: BTreeMap<String, BTreeMap<Mode, CellMeasure>>,
    /// Cells f16 could not run, and why.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub baseline_failed: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub quality: BTreeMap<Mode, QualityMeasure>,
}

impl ModeMatrix {
    /// Reads and validates a matrix from JSON.
    pub fn from_json(text: &str) -> Result<ModeMatrix> {
        let m: ModeMatrix =
            serde_json::from_str(text).map_err(|e| RouterError::MatrixJson(e.to_string()))?;
        m.validate()?;
        Ok(m)
    }

    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self).map_err(|e| RouterError::MatrixJson(e.to_string()))
    }

    /// Adds (or replaces) one measurement.
    pub fn insert(&mut self, cell: &str, mode: Mode, measure: CellMeasure) {
        self.cells
            .entry(cell.to_string())
            .or_default()
            .insert(mode, measure);
    }

    /// Every cell has a baseline and every number is finite and in range.
    pub fn validate(&self) -> Result<()> {
        if self.cells.is_empty() {
            return Err(RouterError::MatrixJson("the matrix has no cells".into()));
        }
        if !self.quality.is_empty() && !self.quality.contains_key(&Mode::BASELINE) {
            return Err(RouterError::MatrixJson(format!(
                "quality has no {} (baseline) entry to compare against",
                Mode::BASELINE
            )));
        }
        for (cell, modes) in &self.cells {
            let invalid = |reason: String| RouterError::InvalidCell {
                cell: cell.clone(),
                reason,
            };
            let failed = self.baseline_failed.contains_key(cell);
            match (modes.contains_key(&Mode::BASELINE), failed) {
                (false, false) => {
                    return Err(invalid(format!(
                        "no {} (baseline) measure to compare against",
                        Mode::BASELINE
                    )))
                }
                (true, true) => {
                    return Err(invalid(format!(
                        "holds a {} measure but lists it as failed",
                        Mode::BASELINE
                    )))
                }
                _ => {}
            }
            for (mode, m) in modes {
                if !(m.latency_s.is_finite() && m.latency_s > 0.0) {
                    return Err(invalid(format!(
                        "{mode}: latency_s must be positive and finite, got {}",
                        m.latency_s
                    )));
                }
                if let Some(e) = m.energy_j_per_token {
                    if !(e.is_finite() && e >= 0.0) {
                        return Err(invalid(format!(
                            "{mode}: energy_j_per_token must be non-negative and finite, got {e}"
                        )));
                    }
                }
                for (name, v) in [
                    ("accuracy_points", m.accuracy_points),
                    ("quality_points", m.quality_points),
                ] {
                    if let Some(v) = v {
                        if !v.is_finite() {
                            return Err(invalid(format!("{mode}: {name} must be finite, got {v}")));
                        }
                    }
                }
            }
        }
        if let Some(cell) = self
            .baseline_failed
            .keys()
            .find(|c| !self.cells.contains_key(*c))
        {
            return Err(RouterError::InvalidCell {
                cell: cell.clone(),
                reason: "listed as failed for the baseline but has no measures".into(),
            });
        }
        Ok(())
    }

    /// Whether `mode` keeps `constraints` in `cell`: against f16's measure there, or, where f16
    /// could not run, the memory limit alone. False where the mode was not measured.
    pub fn within(&self, constraints: &Constraints, cell: &str, mode: Mode) -> bool {
        let Some(modes) = self.cells.get(cell) else {
            return false;
        };
        match (modes.get(&mode), modes.get(&Mode::BASELINE)) {
            (Some(m), Some(base)) => constraints.admits(m, base),
            (Some(m), None) if self.baseline_failed.contains_key(cell) => {
                constraints.admits_alone(m)
            }
            _ => false,
        }
    }
}

/// What a mode must keep, relative to the baseline in the same cell.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Constraints {
    /// Most accuracy points a mode may lose against f16. Gains are never penalised. Where the
    /// baseline has an accuracy, a mode without one is rejected (it cannot show it passes).
    pub max_accuracy_drop_points: f64,
    /// Largest energy-per-token ratio mode / f16, checked where both were measured.
    pub max_energy_ratio: Option<f64>,
    /// Largest peak memory, bytes.
    pub memory_limit_bytes: Option<u64>,
    /// Most quality points (e.g. ROUGE-L x 100) a mode may lose against f16, checked where both
    /// were measured; off by default (the paper gates on accuracy only).
    pub max_quality_drop_points: Option<f64>,
}

impl Default for Constraints {
    fn default() -> Self {
        Self {
            max_accuracy_drop_points: MAX_ACCURACY_DROP_POINTS,
            max_energy_ratio: None,
            memory_limit_bytes: None,
            max_quality_drop_points: None,
        }
    }
}

impl Constraints {
    pub fn validate(&self) -> Result<()> {
        let non_negative = |field: &'static str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(RouterError::InvalidThreshold {
                    field,
                    value: v,
                    expected: "non-negative and finite",
                })
            }
        };
        non_negative("max_accuracy_drop_points", self.max_accuracy_drop_points)?;
        if let Some(q) = self.max_quality_drop_points {
            non_negative("max_quality_drop_points", q)?;
        }
        if let Some(r) = self.max_energy_ratio {
            if !(r.is_finite() && r > 0.0) {
                return Err(RouterError::InvalidThreshold {
                    field: "max_energy_ratio",
                    value: r,
                    expected: "positive and finite",
                });
            }
        }
        Ok(())
    }

    /// Whether `m` meets every constraint against the baseline `base` of its cell.
    pub fn admits(&self, m: &CellMeasure, base: &CellMeasure) -> bool {
        let accuracy_ok = match (base.accuracy_points, m.accuracy_points) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(b), Some(a)) => b - a <= self.max_accuracy_drop_points,
        };
        let quality_ok = match (self.max_quality_drop_points, base.quality_points) {
            (Some(limit), Some(b)) => m.quality_points.is_some_and(|q| b - q <= limit),
            _ => true,
        };
        let energy_ok = match (
            self.max_energy_ratio,
            base.energy_j_per_token,
            m.energy_j_per_token,
        ) {
            (Some(limit), Some(b), Some(e)) if b > 0.0 => e / b <= limit,
            (Some(_), Some(_), Some(e)) => e == 0.0,
            _ => true,
        };
        accuracy_ok && quality_ok && energy_ok && self.admits_alone(m)
    }

    /// The constraints that hold without a baseline to compare with: the memory limit.
    pub fn admits_alone(&self, m: &CellMeasure) -> bool {
        self.memory_limit_bytes
            .is_none_or(|limit| m.peak_memory_bytes <= limit)
    }
}

/// The oracle router: workload cell of the request, then the fastest admissible mode there:
/// within the constraints against f16 in that cell, and through the quality [`Gate`] for the
/// request's class where the matrix holds quality.
#[derive(Debug, Clone)]
pub struct Oracle {
    matrix: ModeMatrix,
    constraints: Constraints,
    classifier: RuleConfig,
    gate: Gate,
    /// Per gate class the matrix can route to (its cells' classes, math, multiple-choice,
    /// memory-pressure), the modes that pass the gate: judged once, not per decision.
    passing: BTreeMap<String, ModeSet>,
}

/// The rule every oracle decision reports.
pub const ORACLE_RULE: &str = "oracle";

impl Oracle {
    /// An oracle over a validated matrix, with the default classifier for the situational
    /// cells (batch, shared-prefix, memory-pressure).
    pub fn new(matrix: ModeMatrix, constraints: Constraints) -> Result<Oracle> {
        Oracle::with_classifier(matrix, constraints, RuleConfig::default())
    }

    pub fn with_classifier(
        matrix: ModeMatrix,
        constraints: Constraints,
        classifier: RuleConfig,
    ) -> Result<Oracle> {
        matrix.validate()?;
        constraints.validate()?;
        classifier.validate()?;
        let mut oracle = Oracle {
            matrix,
            constraints,
            classifier,
            gate: Gate::default(),
            passing: BTreeMap::new(),
        };
        oracle.judge();
        Ok(oracle)
    }

    /// The same oracle judging quality with `gate`.
    pub fn with_gate(mut self, gate: Gate) -> Result<Oracle> {
        gate.validate()?;
        self.gate = gate;
        self.judge();
        Ok(self)
    }

    /// Fills `passing` for every class a request can be judged in.
    fn judge(&mut self) {
        let classes = self.matrix.cells.keys().map(|c| gate::cell_class(c)).chain(
            [
                gate::CLASS_MATH,
                gate::CLASS_MULTIPLE_CHOICE,
                gate::CLASS_MEMORY_PRESSURE,
            ]
            .map(str::to_string),
        );
        let mut passing = BTreeMap::new();
        for class in classes {
            let mut set = ModeSet::empty();
            for mode in Mode::ALL {
                if self.gate.passes(&self.matrix.quality, mode, &class) {
                    set.insert(mode);
                }
            }
            passing.insert(class, set);
        }
        self.passing = passing;
    }

    pub fn gate(&self) -> &Gate {
        &self.gate
    }

    /// The gate class a request is judged in: `math` or `multiple-choice` by its label, else
    /// the class of its cell.
    pub fn class_for(&self, f: &RequestFeatures) -> String {
        let class = gate::request_class(f, &self.classifier);
        if class == gate::CLASS_MATH || class == gate::CLASS_MULTIPLE_CHOICE {
            return class;
        }
        self.cell_for(f).map_or(class, gate::cell_class)
    }

    /// Whether `mode` may serve this request: admitted in the request's cell for its class.
    pub fn admits_request(&self, f: &RequestFeatures, mode: Mode) -> bool {
        let class = self.class_for(f);
        self.cell_for(f)
            .is_some_and(|cell| self.admits(cell, &class, mode))
    }

    /// Whether `mode` may serve requests of `class` in `cell`: the constraints against the
    /// cell's f16 and the quality gate for the class.
    pub fn admits(&self, cell: &str, class: &str, mode: Mode) -> bool {
        self.matrix.within(&self.constraints, cell, mode)
            && self.passing.get(class).map_or_else(
                || self.gate.passes(&self.matrix.quality, mode, class),
                |set| set.contains(mode),
            )
    }

    pub fn matrix(&self) -> &ModeMatrix {
        &self.matrix
    }

    pub fn constraints(&self) -> &Constraints {
        &self.constraints
    }

    fn cell_named(&self, name: &str) -> Option<&str> {
        self.matrix
            .cells
            .keys()
            .find(|c| c.eq_ignore_ascii_case(name))
            .map(String::as_str)
    }

    /// The cell a request is judged in: its workload label's cell if the matrix has one; else
    /// batch, shared-prefix or memory-pressure when the request is in that situation and the
    /// cell exists; else its grid shape's cell, or the nearest shape cell the matrix has; else
    /// the first cell by name.
    pub fn cell_for(&self, f: &RequestFeatures) -> Option<&str> {
        if let Some(cell) = f.workload.as_deref().and_then(|l| self.cell_named(l)) {
            return Some(cell);
        }
        let c = &self.classifier;
        let situations = [
            (c.classify(f) == Class::Batch, CELL_BATCH),
            (c.shared_prefix(f), CELL_SHARED_PREFIX),
            (c.memory_pressure_high(f), CELL_MEMORY_PRESSURE),
        ];
        for (applies, name) in situations {
            if let Some(cell) = applies.then(|| self.cell_named(name)).flatten() {
                return Some(cell);
            }
        }
        if let Some(cell) = self.cell_named(c.shape_of(f).name()) {
            return Some(cell);
        }
        self.nearest_shape_cell(f)
            .or_else(|| self.matrix.cells.keys().next().map(String::as_str))
    }

    /// The shape cell whose nominal lengths are nearest the request's, in log space.
    fn nearest_shape_cell(&self, f: &RequestFeatures) -> Option<&str> {
        let log = |x: f64| x.max(1.0).log2();
        let (p, o) = (log(f.prompt_tokens as f64), log(f.expected_output() as f64));
        SHAPE_POINTS
            .iter()
            .filter_map(|&(shape, sp, so)| {
                let d = (p - log(sp)).powi(2) + (o - log(so)).powi(2);
                self.cell_named(shape.name()).map(|cell| (d, cell))
            })
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, cell)| cell)
    }

    /// The fastest available mode of `cell` that meets the constraints and the gate for the
    /// cell's own class (ties: the earlier mode of [`Mode::ALL`]), if any.
    pub fn best_in_cell(&self, cell: &str, available: ModeSet) -> Option<Mode> {
        self.best_for(cell, &gate::cell_class(cell), available)
    }

    /// The fastest available mode of `cell` admitted for requests of `class`.
    pub fn best_for(&self, cell: &str, class: &str, available: ModeSet) -> Option<Mode> {
        let modes = self.matrix.cells.get(cell)?;
        modes
            .iter()
            .filter(|(mode, _)| available.contains(**mode) && self.admits(cell, class, **mode))
            .min_by(|a, b| a.1.latency_s.total_cmp(&b.1.latency_s))
            .map(|(mode, _)| *mode)
    }

    /// Each request paired with the oracle's mode for it: a training set for learned routers.
    pub fn label(&self, requests: &[RequestFeatures]) -> Vec<Example> {
        requests
            .iter()
            .map(|f| (f.clone(), self.route(f).mode))
            .collect()
    }
}

impl Router for Oracle {
    fn name(&self) -> String {
        ORACLE_RULE.to_string()
    }

    /// The fastest admissible available mode of the request's cell; f16 as a fallback when no
    /// mode there meets the constraints.
    fn route_among(&self, f: &RequestFeatures, available: ModeSet) -> Decision {
        let class = self.classifier.classify(f);
        let gate_class = self.class_for(f);
        let best = self
            .cell_for(f)
            .and_then(|cell| self.best_for(cell, &gate_class, available));
        Decision {
            mode: best.unwrap_or(Mode::BASELINE),
            rule: ORACLE_RULE.to_string(),
            class,
            fallback: best.is_none(),
        }
    }
}
