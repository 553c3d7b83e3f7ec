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
use crate::shadow::{DepthNats, ShadowScore};
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
    pub round: usize,
    /// A decision is made on the last `window` scored prompts, whichever rounds scored
    /// them: a sliding window, so a phase change shows after a round or two while one odd
    /// prompt cannot move the choice alone.
    pub window: usize,
    /// Most bytes of a prompt (or reference) scored.
    pub max_text_bytes: usize,
    /// Consecutive rounds that must name the same new choice before it is served.
    pub switch_after: usize,
    /// Also score each sampled request's reference answer where the caller gives one
    /// (reported apart, never used to choose; it doubles the scoring work).
    pub references: bool,
    /// Exit depths read every `exit_stride`-th scored position (full depth reads all): a
    /// paired estimate of each exit's bits per byte at a fraction of the LM-head work.
    pub exit_stride: usize,
    /// Change point, in bits per byte: when a candidate's distance from the best candidate
    /// moves by more than this between the window and the newest round alone, the traffic
    /// has changed. The window then restarts from the newest round (what came before belongs
    /// to other traffic), and a serving choice that breaks the quality bound on it is left
    /// at once, without waiting for `switch_after` agreeing rounds: hysteresis is for noise,
    /// not for a bound the new traffic breaks. `None` turns it off.
    pub change_margin: Option<f64>,
    /// A sampled request waits for its own prompt's round (run unthrottled) before it is
    /// routed, so that the first request of new traffic is already served by the choice its
    /// score makes; its time to the first token grows by the round's time. Held requests
    /// take their rounds in arrival order, one at a time: each waits at most this many
    /// milliseconds for the scorer to take its round, and as long again for the round, then
    /// goes to the current choice unscored. Holds take every round (no background round is
    /// sent). 0: never held (background rounds within `share`).
    pub hold_ms: u64,
    /// At a switch to another model, let the serving model's running requests finish and
    /// release its layers before the new one loads, so the two are never resident together
    /// (peak memory: the larger model, not both). New requests wait meanwhile, so the switch
    /// costs their time to the first token the rest of the longest running answer. Off: the
    /// new model loads at once and the old one drains beside it.
    pub drain_first: bool,
}

impl Default for ShadowConfig {
    fn default() -> Self {
        Self {
            share: 0.1,
            sample_every: 4,
            round: 2,
            window: 6,
            max_text_bytes: 1024,
            switch_after: 2,
            references: true,
            exit_stride: 4,
            change_margin: Some(0.2),
            hold_ms: 0,
            drain_first: false,
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
        if self.sample_every == 0
            || self.round == 0
            || self.window == 0
            || self.switch_after == 0
            || self.exit_stride == 0
        {
            return bad(
                "shadow.sample_every, round, window, switch_after and exit_stride must be at least 1"
                    .into(),
            );
        }
        if let Some(m) = self.change_margin.filter(|m| !(m.is_finite() && *m > 0.0)) {
            return bad(format!(
                "shadow.change_margin must be a positive number of bits per byte, got {m}"
            ));
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

/// Each scored model's full-depth bits per byte above the best scored model's, on the same
/// texts (`nats` per model, as the scorer sums them).
fn excess_over_best(repo: &Manifest, nats: &BTreeMap<String, DepthNats>) -> BTreeMap<String, f64> {
    let full: BTreeMap<&str, f64> = nats
        .iter()
        .filter_map(|(m, n)| Some((m.as_str(), n.bits_per_byte(repo.get(m)?.layers)?)))
        .collect();
    let best = full.values().copied().fold(f64::INFINITY, f64::min);
    full.into_iter()
        .map(|(m, b)| (m.to_string(), b - best))
        .collect()
}

/// Whether the newest round's texts are other traffic than the window before them: some
/// model's distance from the best model (full depth, bits per byte) differs by more than
/// `margin` between the two. Prose then code moves a small model from about the coder's
/// level to far above it; code then prose moves it back.
pub fn change_point(
    repo: &Manifest,
    window: &BTreeMap<String, DepthNats>,
    newest: &BTreeMap<String, DepthNats>,
    margin: f64,
) -> bool {
    let before = excess_over_best(repo, window);
    let now = excess_over_best(repo, newest);
    now.iter()
        .any(|(m, e)| before.get(m).is_some_and(|b| (e - b).abs() > margin))
}

impl Policy {
    /// Whether `serving` breaks the quality bound on `nats`: its bits per byte at its depth
    /// above the best scored model's full depth by more than `max_bits_per_byte_increase`.
    /// `false` without a bound or a score for it.
    pub fn breaks_bound(
        &self,
        repo: &Manifest,
        serving: &Serving,
        nats: &BTreeMap<String, DepthNats>,
    ) -> bool {
        let Some(bound) = self.slo.max_bits_per_byte_increase else {
            return false;
        };
        let best = nats
            .iter()
            .filter_map(|(m, n)| n.bits_per_byte(repo.get(m)?.layers))
            .fold(f64::INFINITY, f64::min);
        nats.get(&serving.model)
            .and_then(|n| n.bits_per_byte(serving.depth))
            .is_some_and(|b| b > best + bound)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pht::ExitHistogram;
    use crate::policy::{PolicyConfig, Slo};
    use crate::shadow::DepthNats;

    const REPO: &str = r#"
version = 1

[[model]]
name = "fast"
size_bytes = 100000000
layers = 30
exit_layers = [15]

[[model.depth]]
depth = 15
tokens_per_s = 100.0
bits_per_byte = 3.0
memory_bytes = 50000000

[[model.depth]]
depth = 30
tokens_per_s = 50.0
bits_per_byte = 1.5
memory_bytes = 100000000

[[model]]
name = "coder"
size_bytes = 500000000
layers = 24
exit_layers = [12]

[[model.depth]]
depth = 12
tokens_per_s = 40.0
bits_per_byte = 3.0
memory_bytes = 250000000

[[model.depth]]
depth = 24
tokens_per_s = 20.0
bits_per_byte = 1.7
memory_bytes = 500000000
"#;

    fn policy(bound: Option<f64>, rule: DepthRule) -> Policy {
        let config = PolicyConfig {
            depth_rule: rule,
            min_kv_tokens: 0,
            ..PolicyConfig::default()
        };
        let slo = Slo {
            max_bits_per_byte_increase: bound,
            ..Slo::default()
        };
        Policy::new(config, slo, 1 << 30).unwrap()
    }

    /// A score of `bytes` bytes with these bits per byte at each depth.
    fn score(model: &str, bpb: &[(usize, f64)], exits: &[(usize, u64)]) -> ShadowScore {
        let bytes = 1000u64;
        ShadowScore {
            model: model.into(),
            texts: 4,
            prompt: DepthNats {
                bytes,
                tokens: 250,
                nats: bpb
                    .iter()
                    .map(|&(d, b)| (d, b * bytes as f64 * std::f64::consts::LN_2))
                    .collect(),
            },
            per_prompt: Vec::new(),
            reference: DepthNats::default(),
            exits: ExitHistogram::from_counts(exits.iter().copied()),
            busy_s: 1.0,
            prefill_tokens_per_s: 250.0,
            wall_s: 1.0,
            peak_layers_resident: 1,
            peak_layer_bytes: 1,
            peak_head_bytes: 1,
            peak_activation_bytes: 1,
        }
    }

    fn choose(p: &Policy, scores: &[ShadowScore]) -> (String, usize) {
        let repo = Manifest::from_toml(REPO, "t").unwrap();
        let cands = p.select_candidates(&repo).unwrap().candidates;
        let map = scores
            .iter()
            .map(|s| (s.model.clone(), s.clone()))
            .collect();
        let c = p.choose_shadow(&repo, &cands, &map).unwrap();
        (c.model, c.depth)
    }

    #[test]
    fn the_bound_is_judged_on_the_traffic_and_picks_the_shallowest_passing_depth() {
        let p = policy(Some(0.2), DepthRule::QualityBound);
        // Prose: the fast model is within 0.2 of the coder at full depth, not at 15.
        let prose = [
            score("fast", &[(15, 1.5), (30, 1.1)], &[]),
            score("coder", &[(12, 1.6), (24, 1.0)], &[]),
        ];
        assert_eq!(choose(&p, &prose), ("fast".into(), 30));
        // An easy text: the fast model's depth 15 is within the bound too, and faster.
        let easy = [
            score("fast", &[(15, 1.15), (30, 1.05)], &[]),
            score("coder", &[(12, 1.6), (24, 1.0)], &[]),
        ];
        assert_eq!(choose(&p, &easy), ("fast".into(), 15));
        // Code: the fast model is 0.5 above the coder; the coder's depth 12 is too.
        let code = [
            score("fast", &[(15, 2.0), (30, 1.0)], &[]),
            score("coder", &[(12, 1.2), (24, 0.5)], &[]),
        ];
        assert_eq!(choose(&p, &code), ("coder".into(), 24));
        // Before any score, offline telemetry: the fast model (its own 3.0 at depth 15 is
        // over 1.5 + 0.2).
        assert_eq!(choose(&p, &[]), ("fast".into(), 30));
    }

    #[test]
    fn without_a_bound_the_depth_is_full_and_coverage_stays_selectable() {
        let code = [
            score("fast", &[(15, 1.15), (30, 1.0)], &[(15, 90), (30, 10)]),
            score("coder", &[(12, 1.2), (24, 0.5)], &[]),
        ];
        assert_eq!(
            choose(&policy(None, DepthRule::QualityBound), &code),
            ("fast".into(), 30)
        );
        // Coverage: 90% of the fast model's tokens exit at 15; the bound still applies.
        let cov = policy(Some(1.0), DepthRule::Coverage);
        assert_eq!(choose(&cov, &code), ("fast".into(), 15));
    }

    #[test]
    fn a_model_without_a_score_is_left_out_once_others_have_one() {
        let p = policy(Some(0.2), DepthRule::QualityBound);
        let only_coder = [score("coder", &[(12, 1.2), (24, 0.5)], &[])];
        assert_eq!(choose(&p, &only_coder), ("coder".into(), 24));
    }

    #[test]
    fn the_gate_waits_for_agreeing_rounds() {
        let cur = Serving {
            model: "fast".into(),
            depth: 30,
        };
        let coder = Serving {
            model: "coder".into(),
            depth: 24,
        };
        let mut g = SwitchGate::new(2);
        assert!(!g.propose(&cur, &coder));
        assert_eq!(g.pending(), Some((&coder, 1)));
        // A round that keeps the current choice resets the count.
        assert!(!g.propose(&cur, &cur));
        assert_eq!(g.pending(), None);
        assert!(!g.propose(&cur, &coder));
        assert!(g.propose(&cur, &coder));
        assert_eq!(g.pending(), None);
        assert!(SwitchGate::new(1).propose(&cur, &coder));
    }

    /// Prompt nats per model with these full-depth bits per byte (over 1,000 bytes).
    fn nats(full: &[(&str, usize, f64)]) -> BTreeMap<String, DepthNats> {
        full.iter()
            .map(|&(m, d, b)| {
                let n = DepthNats {
                    bytes: 1000,
                    tokens: 250,
                    nats: vec![(d, b * 1000.0 * std::f64::consts::LN_2)],
                };
                (m.to_string(), n)
            })
            .collect()
    }

    #[test]
    fn a_change_point_is_a_moved_distance_from_the_best_model() {
        let repo = Manifest::from_toml(REPO, "t").unwrap();
        let prose = nats(&[("fast", 30, 1.12), ("coder", 24, 1.10)]);
        let other_prose = nats(&[("fast", 30, 1.31), ("coder", 24, 1.27)]);
        let code = nats(&[("fast", 30, 0.85), ("coder", 24, 0.50)]);
        // Harder prose moves both models: the distance between them stays (0.02 → 0.04).
        assert!(!change_point(&repo, &prose, &other_prose, 0.1));
        // Code: the fast model goes from 0.02 to 0.35 above the coder, and back.
        assert!(change_point(&repo, &prose, &code, 0.1));
        assert!(change_point(&repo, &code, &prose, 0.1));
        assert!(!change_point(&repo, &prose, &code, 0.4));
        // Nothing before (the first round) is no change.
        assert!(!change_point(&repo, &BTreeMap::new(), &code, 0.1));
    }

    #[test]
    fn the_bound_is_broken_by_the_serving_depth_against_the_best_full_depth() {
        let repo = Manifest::from_toml(REPO, "t").unwrap();
        let fast = Serving {
            model: "fast".into(),
            depth: 30,
        };
        let code = nats(&[("fast", 30, 0.85), ("coder", 24, 0.50)]);
        let prose = nats(&[("fast", 30, 1.12), ("coder", 24, 1.10)]);
        let p = policy(Some(0.1), DepthRule::QualityBound);
        assert!(p.breaks_bound(&repo, &fast, &code));
        assert!(!p.breaks_bound(&repo, &fast, &prose));
        assert!(!policy(None, DepthRule::QualityBound).breaks_bound(&repo, &fast, &code));
        // A depth that was not scored breaks nothing it can be judged on.
        let shallow = Serving {
            model: "fast".into(),
            depth: 15,
        };
        assert!(!p.breaks_bound(&repo, &shallow, &code));
    }

    #[test]
    fn config_is_validated() {
        assert!(ShadowConfig::default().validate().is_ok());
        for bad in [
            ShadowConfig {
                share: 0.0,
                ..ShadowConfig::default()
            },
            ShadowConfig {
                window: 0,
                ..ShadowConfig::default()
            },
            ShadowConfig {
                round: 0,
                ..ShadowConfig::default()
            },
            ShadowConfig {
                max_text_bytes: 8,
                ..ShadowConfig::default()
            },
            ShadowConfig {
                exit_stride: 0,
                ..ShadowConfig::default()
            },
            ShadowConfig {
                change_margin: Some(0.0),
                ..ShadowConfig::default()
            },
            ShadowConfig {
                change_margin: Some(f64::NAN),
                ..ShadowConfig::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        let c: PolicyConfig = toml::from_str(
            "evaluation = \"serial\"\ndepth_rule = \"coverage\"\n[shadow]\nshare = 0.3",
        )
        .unwrap();
        assert_eq!(c.evaluation, Evaluation::Serial);
        assert_eq!(c.depth_rule, DepthRule::Coverage);
        assert_eq!(c.shadow.share, 0.3);
        assert!(toml::from_str::<PolicyConfig>("evaluation = \"parallel\"").is_err());
    }
}
