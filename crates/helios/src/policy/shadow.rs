//! Shadow evaluation's decisions: which candidate and depth serve the traffic the last
//! scoring round saw, and when a new choice is trusted enough to switch to.
//!
//! Quality comes from [`crate::shadow`]: every candidate's bits per byte at every depth on the
//! same sampled prompts. The reference is the best full-depth candidate on those prompts, so
//! the SLO's `max_bits_per_byte_increase` is judged on the traffic itself, never on the
//! profile text. Speed, time to the first token and memory come from the repository's
//! offline telemetry at each depth (a scoring pass is a prefill: it measures no decoding).
//!
//! Depth: with a quality bound, every servable depth whose measured bits per byte stays
//! within it is a candidate point, so the shallowest passing depth of the fastest model wins
//! under the throughput objective ([`DepthRule::QualityBound`]); [`DepthRule::Coverage`]
//! keeps HELIOS's rule (the depth the measured exit histogram covers, or deeper). Without a
//! bound the depth is full.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::manifest::Manifest;
use crate::shadow::ShadowScore;
use crate::{HeliosError, Result};

use super::depth::coverage_depth;
use super::estimate::{self, OperatingPoint};
use super::{Candidate, Policy, Serving};

/// How the candidates are evaluated online.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Evaluation {
    /// HELIOS's evaluation: each candidate serves `eval_requests` requests in turn, one
    /// candidate's block after the other, its own output scored.
    Serial,
    /// The serving candidate serves everything; the others score sampled prompts by teacher
    /// forcing, streaming their layers, with a bounded share of compute.
    #[default]
    Shadow,
}

/// How the depth to load is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DepthRule {
    /// The shallowest depth within the SLO's bits-per-byte bound (full depth without one).
    #[default]
    QualityBound,
    /// The depth covering `exit_coverage` of the exit histogram (HELIOS's rule).
    Coverage,
}

/// Shadow evaluation's tunables (ours: HELIOS has no shadow evaluation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShadowConfig {
    /// Most share of the wall time the scorer computes (it sleeps the rest).
    pub share: f64,
    /// One request in this many has its prompt sampled for scoring.
    pub sample_every: usize,
    /// Sampled prompts per scoring round; each round can lead to a decision.
    pub window: usize,
    /// Most bytes of a prompt (or reference) scored.
    pub max_text_bytes: usize,
    /// Consecutive rounds that must name the same new choice before it is served.
    pub switch_after: usize,
}

impl Default for ShadowConfig {
    fn default() -> Self {
        Self {
            share: 0.2,
            sample_every: 4,
            window: 6,
            max_text_bytes: 1024,
            switch_after: 2,
        }
    }
}

impl ShadowConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(HeliosError::Config(m));
        if !(self.share > 0.0 && self.share <= 1.0) {
            return bad(format!(
                "shadow.share must be in (0, 1], got {}",
                self.share
            ));
        }
        if self.sample_every == 0 || self.window == 0 || self.switch_after == 0 {
            return bad("shadow.sample_every, window and switch_after must be at least 1".into());
        }
        if self.max_text_bytes < 16 {
            return bad(format!(
                "shadow.max_text_bytes must be at least 16, got {}",
                self.max_text_bytes
            ));
        }
        Ok(())
    }
}

impl Policy {
    /// The best `(model, depth)` for the traffic `scores` measured (prompt bits per byte per
    /// model and depth, on the same texts). A model without a score is judged on its offline
    /// telemetry only when no model has one (before the first round).
    pub fn choose_shadow(
        &self,
        repo: &Manifest,
        candidates: &[Candidate],
        scores: &BTreeMap<String, ShadowScore>,
    ) -> Result<OperatingPoint> {
        let measured = |m: &str| scores.get(m).filter(|s| s.prompt.bytes > 0);
        let any_measured = candidates.iter().any(|c| measured(c.model()).is_some());
        let full_bpb = |c: &Candidate| -> Option<f64> {
            let m = repo.get(c.model())?;
            match measured(c.model()) {
                Some(s) => s.prompt.bits_per_byte(m.layers),
                None if !any_measured => m.full().map(|t| t.bits_per_byte),
                None => None,
            }
        };
        let reference = candidates
            .iter()
            .filter_map(full_bpb)
            .fold(f64::INFINITY, f64::min);
        let mut limits = self.limits(repo);
        limits.max_bits_per_byte = self
            .slo
            .max_bits_per_byte_increase
            .filter(|_| reference.is_finite())
            .map(|inc| reference + inc);
        let mut points = Vec::new();
        let mut rejected = Vec::new();
        for c in candidates {
            let Some(m) = repo.get(c.model()) else {
                continue;
            };
            let score = measured(&m.name);
            if any_measured && score.is_none() {
                rejected.push(format!("{}: not scored on this traffic", m.name));
                continue;
            }
            let servable: Vec<usize> = m.servable_depths().collect();
            let depths: Vec<usize> = match (limits.max_bits_per_byte, self.config.depth_rule) {
                (None, _) => vec![m.layers],
                (Some(_), DepthRule::QualityBound) => servable,
                (Some(_), DepthRule::Coverage) => {
                    let from = match score {
                        Some(s) if !s.exits.is_empty() => {
                            coverage_depth(&s.exits, &servable, self.config.exit_coverage)
                        }
                        _ => m.layers,
                    };
                    servable.into_iter().filter(|&d| d >= from).collect()
                }
            };
            let mut why = format!("{}: no telemetry at a servable depth", m.name);
            for d in depths {
                let Some(mut p) = estimate::offline(m, d) else {
                    continue;
                };
                if let Some(s) = score {
                    match s.prompt.bits_per_byte(d) {
                        Some(b) => p.bits_per_byte = b,
                        None => continue,
                    }
                }
                match limits.violation(&p) {
                    None => points.push(p),
                    Some(v) => why = format!("{}: {v}", m.name),
                }
            }
            rejected.push(why);
        }
        self.rank(points)
            .into_iter()
            .next()
            .ok_or(HeliosError::NoCandidate {
                budget_bytes: self.budget_bytes,
                rejected,
            })
    }
}

/// Hysteresis: a new choice is served only after `after` consecutive rounds named it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwitchGate {
    after: usize,
    pending: Option<Serving>,
    count: usize,
}

impl SwitchGate {
    pub fn new(after: usize) -> Self {
        Self {
            after: after.max(1),
            pending: None,
            count: 0,
        }
    }

    /// One round's choice `best` while `current` serves: `true` when it is time to switch.
    pub fn propose(&mut self, current: &Serving, best: &Serving) -> bool {
        if best == current {
            self.pending = None;
            self.count = 0;
            return false;
        }
        if self.pending.as_ref() == Some(best) {
            self.count += 1;
        } else {
            self.pending = Some(best.clone());
            self.count = 1;
        }
        if self.count >= self.after {
            self.pending = None;
            self.count = 0;
            return true;
        }
        false
    }

    /// Rounds the pending choice has been named in a row.
    pub fn pending(&self) -> Option<(&Serving, usize)> {
        self.pending.as_ref().map(|p| (p, self.count))
    }
}
