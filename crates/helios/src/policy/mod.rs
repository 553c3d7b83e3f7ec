//! The HELIOS policy: features and telemetry in, a decision out. Nothing here touches a
//! model, a clock or a thread.
//!
//! * [`select`]: the TopK candidates that fit the SLO and the memory budget, from the
//!   repository's offline telemetry; the model and depth to serve after an online evaluation;
//! * [`eval_plan`]: which candidate serves each of the next requests of an online evaluation;
//! * [`depth`]: the depth to load from an exit histogram;
//! * [`cbc`]: the Confidence Breach Counter;
//! * [`remedy`]: extend or switch when the counter fires;
//! * [`reprofile`]: re-profiling every RI requests, and the drift detector that re-profiles
//!   early;
//! * [`estimate`]: a (model, depth) operating point from the PHT and the repository;
//! * [`shadow`]: shadow evaluation's choice on every candidate's scores of the same traffic,
//!   the depth from the quality bound, and the hysteresis before a switch.
//!
//! [`Policy::decide`] composes the rules for one decision point.

pub mod cbc;
pub mod depth;
pub mod estimate;
pub mod eval_plan;
pub mod remedy;
pub mod reprofile;
pub mod select;
pub mod shadow;

use serde::{Deserialize, Serialize};

use crate::manifest::Manifest;
use crate::pht::Pht;
use crate::{HeliosError, Result};

pub use cbc::ConfidenceBreachCounter;
pub use eval_plan::EvalPlan;
pub use remedy::{Remedy, RemedyMode};
pub use reprofile::{Drift, DriftDetector, ReprofileClock};
pub use select::{Candidate, Selection};
pub use shadow::{DepthRule, Evaluation, ShadowConfig, SwitchGate};

/// Candidates kept for online evaluation (HELIOS default: K = 3).
pub const DEFAULT_TOP_K: usize = 3;
/// Requests each candidate serves in an online evaluation (HELIOS default).
pub const DEFAULT_EVAL_REQUESTS: usize = 5;
/// Tokens in the Confidence Breach Counter's sliding window (HELIOS default).
pub const CBC_WINDOW: usize = 100;
/// Breaches in the window above which extend-or-switch is decided (HELIOS default: more than
/// 50 of 100).
pub const CBC_MAX: usize = 50;
/// Requests between re-profilings (HELIOS default RI = 150; its Fig. 12 finds 50 faster and
/// above 250 slower).
pub const DEFAULT_REPROFILE_INTERVAL: usize = 150;
/// Share of tokens the loaded depth must cover in the exit histogram. HELIOS loads 6 of
/// OPT-1.3B's 24 layers, which cover 74% of its tokens; 0.7 picks that depth.
pub const DEFAULT_EXIT_COVERAGE: f64 = 0.7;
/// Exit confidence threshold (max softmax probability) of the histograms and the counter;
/// the EE-LLM baseline's default.
pub const DEFAULT_THRESHOLD: f32 = 0.8;
/// K/V positions a candidate must be able to hold beside its weights to count as fitting the
/// memory budget: one 2,048-token sequence (ours; HELIOS states no such floor).
pub const DEFAULT_MIN_KV_TOKENS: usize = 2048;

/// What the SLO optimizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Objective {
    /// Most output tokens per second.
    #[default]
    Throughput,
    /// Least time per output token (then least time to the first token).
    Latency,
    /// Least energy per output token: measured joules where every candidate has them,
    /// otherwise weight bytes read per token (decoding is memory-bound, so bytes moved track
    /// energy).
    Energy,
}

/// The user's service-level objective.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Slo {
    #[serde(default)]
    pub objective: Objective,
    /// Most bits per byte above the repository's best full-depth model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bits_per_byte_increase: Option<f64>,
    /// Most milliseconds to the first token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// Most milliseconds per output token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpot_ms: Option<f64>,
}

impl Slo {
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &str, v: f64| {
            HeliosError::Slo(format!("{name} must be positive and finite, got {v}"))
        };
        if let Some(v) = self
            .max_bits_per_byte_increase
            .filter(|v| !(v.is_finite() && *v >= 0.0))
        {
            return Err(HeliosError::Slo(format!(
                "max_bits_per_byte_increase must be finite and not negative, got {v}"
            )));
        }
        if let Some(v) = self.ttft_ms.filter(|v| !(v.is_finite() && *v > 0.0)) {
            return Err(bad("ttft_ms", v));
        }
        if let Some(v) = self.tpot_ms.filter(|v| !(v.is_finite() && *v > 0.0)) {
            return Err(bad("tpot_ms", v));
        }
        Ok(())
    }
}

/// The policy's tunables; every default is HELIOS's unless its doc says otherwise.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    pub top_k: usize,
    pub eval_requests: usize,
    pub cbc_window: usize,
    pub cbc_max: usize,
    pub reprofile_interval: usize,
    pub exit_coverage: f64,
    pub threshold: f32,
    pub min_kv_tokens: usize,
    pub remedy: RemedyMode,
    pub drift: reprofile::DriftConfig,
    /// Shadow (ours, the default) or serial (HELIOS's) online evaluation.
    pub evaluation: Evaluation,
    /// How the partial-load depth is chosen (ours: the quality bound; HELIOS: coverage).
    pub depth_rule: DepthRule,
    pub shadow: ShadowConfig,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            top_k: DEFAULT_TOP_K,
            eval_requests: DEFAULT_EVAL_REQUESTS,
            cbc_window: CBC_WINDOW,
            cbc_max: CBC_MAX,
            reprofile_interval: DEFAULT_REPROFILE_INTERVAL,
            exit_coverage: DEFAULT_EXIT_COVERAGE,
            threshold: DEFAULT_THRESHOLD,
            min_kv_tokens: DEFAULT_MIN_KV_TOKENS,
            remedy: RemedyMode::Dynamic,
            drift: reprofile::DriftConfig::default(),
            evaluation: Evaluation::default(),
            depth_rule: DepthRule::default(),
            shadow: ShadowConfig::default(),
        }
    }
}

impl PolicyConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(HeliosError::Config(m));
        if self.top_k == 0 {
            return bad("top_k must be at least 1".into());
        }
        if self.eval_requests == 0 {
            return bad("eval_requests must be at least 1".into());
        }
        if self.cbc_window == 0 || self.cbc_max >= self.cbc_window {
            return bad(format!(
                "cbc_max ({}) must be below cbc_window ({}), which must be positive",
                self.cbc_max, self.cbc_window
            ));
        }
        if self.reprofile_interval == 0 {
            return bad("reprofile_interval must be at least 1".into());
        }
        if !(self.exit_coverage > 0.0 && self.exit_coverage <= 1.0) {
            return bad(format!(
                "exit_coverage must be in (0, 1], got {}",
                self.exit_coverage
            ));
        }
        if !(0.0..=1.0).contains(&self.threshold) {
            return bad(format!(
                "threshold must be in [0, 1], got {}",
                self.threshold
            ));
        }
        self.shadow.validate()?;
        self.drift.validate()
    }
}

/// What the orchestrator serves with now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Serving {
    pub model: String,
    pub depth: usize,
}

/// Why an online evaluation runs.
#[derive(Debug, Clone, PartialEq)]
pub enum ProfileReason {
    /// Nothing measured yet.
    Initial,
    /// RI requests were served since the last one.
    Interval,
    /// The exit distribution moved away from the profile's.
    Drift(Drift),
}

/// The signals at one decision point, gathered by the orchestrator from its state machines.
#[derive(Debug, Clone, PartialEq)]
pub struct Features {
    /// `None` before the first evaluation finished.
    pub serving: Option<Serving>,
    /// The Confidence Breach Counter fired.
    pub cbc_fired: bool,
    /// The re-profile clock ran out.
    pub reprofile_due: bool,
    /// What the drift detector saw, if it fired.
    pub drift: Option<Drift>,
    /// Output tokens the current choice is expected to serve before the next re-profiling:
    /// the horizon over which extend and switch costs are compared.
    pub horizon_tokens: f64,
}

/// What to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Keep serving as is.
    Continue,
    /// Run an online evaluation of the candidates.
    Profile(ProfileReason),
    /// Breaches fired: load more layers of the serving model, or move to another candidate.
    Remedy(Remedy),
}

/// The policy over one repository, SLO and memory budget.
#[derive(Debug, Clone)]
pub struct Policy {
    pub config: PolicyConfig,
    pub slo: Slo,
    pub budget_bytes: u64,
}

impl Policy {
    pub fn new(config: PolicyConfig, slo: Slo, budget_bytes: u64) -> Result<Self> {
        config.validate()?;
        slo.validate()?;
        Ok(Self {
            config,
            slo,
            budget_bytes,
        })
    }

    /// Candidates are re-selected only when the SLO or the budget changes (HELIOS step 4).
    pub fn needs_reselection(&self, slo: &Slo, budget_bytes: u64) -> bool {
        &self.slo != slo || self.budget_bytes != budget_bytes
    }

    /// Rule order: profile first (no PHT yet, drift, then the RI clock), then the breach
    /// remedy, else continue. Drift outranks the remedy because a remedy chosen from a stale
    /// PHT is itself stale.
    pub fn decide(&self, f: &Features, repo: &Manifest, pht: &Pht) -> Decision {
        let Some(serving) = &f.serving else {
            return Decision::Profile(ProfileReason::Initial);
        };
        if pht.is_empty() {
            return Decision::Profile(ProfileReason::Initial);
        }
        if let Some(d) = &f.drift {
            return Decision::Profile(ProfileReason::Drift(d.clone()));
        }
        if f.reprofile_due {
            return Decision::Profile(ProfileReason::Interval);
        }
        if f.cbc_fired {
            let ctx = remedy::RemedyContext {
                policy: self,
                repo,
                pht,
                serving,
                horizon_tokens: f.horizon_tokens,
            };
            return match remedy::decide(&ctx) {
                Some(r) => Decision::Remedy(r),
                None => Decision::Continue,
            };
        }
        Decision::Continue
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::pht::{ExitHistogram, PhtRow};

    pub(crate) fn row(
        model: &str,
        depth: u16,
        tps: f32,
        bpb: f32,
        hist: &[(usize, u64)],
    ) -> PhtRow {
        PhtRow {
            model: model.into(),
            depth,
            tokens_per_s: tps,
            bits_per_byte: bpb,
            exits: ExitHistogram::from_counts(hist.iter().copied()),
            extend_ms_per_layer: 10.0,
            switch_ms: 500.0,
            requests: 5,
        }
    }

    fn features(serving: Option<Serving>) -> Features {
        Features {
            serving,
            cbc_fired: false,
            reprofile_due: false,
            drift: None,
            horizon_tokens: 1000.0,
        }
    }

    #[test]
    fn defaults_are_helios_and_validate() {
        let c = PolicyConfig::default();
        assert_eq!(
            (
                c.top_k,
                c.eval_requests,
                c.cbc_window,
                c.cbc_max,
                c.reprofile_interval
            ),
            (3, 5, 100, 50, 150)
        );
        c.validate().unwrap();
        let bad = PolicyConfig {
            cbc_max: 100,
            ..PolicyConfig::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("cbc_max"));
        let bad = PolicyConfig {
            exit_coverage: 0.0,
            ..PolicyConfig::default()
        };
        assert!(bad.validate().is_err());
        let slo = Slo {
            tpot_ms: Some(-1.0),
            ..Slo::default()
        };
        assert!(slo.validate().unwrap_err().to_string().contains("tpot_ms"));
        let slo: Slo = toml::from_str("objective = \"latency\"\ntpot_ms = 50.0").unwrap();
        assert_eq!(slo.objective, Objective::Latency);
        assert!(toml::from_str::<Slo>("objective = \"speed\"").is_err());
        assert!(toml::from_str::<Slo>("tpot = 5.0").is_err());
    }

    #[test]
    fn decide_orders_profile_then_remedy_then_continue() {
        let repo = Manifest::from_toml(crate::manifest::tests::EXAMPLE, "t").unwrap();
        let p = Policy::new(PolicyConfig::default(), Slo::default(), 1 << 30).unwrap();
        let mut pht = Pht::new(0.8);
        let serving = Serving {
            model: "smollm2-135m-instruct".into(),
            depth: 15,
        };
        assert_eq!(
            p.decide(&features(None), &repo, &pht),
            Decision::Profile(ProfileReason::Initial)
        );
        assert_eq!(
            p.decide(&features(Some(serving.clone())), &repo, &pht),
            Decision::Profile(ProfileReason::Initial),
            "an empty PHT means nothing was measured"
        );
        pht.upsert(row(
            "smollm2-135m-instruct",
            30,
            38.0,
            1.1,
            &[(15, 60), (30, 40)],
        ));
        let mut f = features(Some(serving));
        assert_eq!(p.decide(&f, &repo, &pht), Decision::Continue);
        f.cbc_fired = true;
        assert!(matches!(
            p.decide(&f, &repo, &pht),
            Decision::Remedy(Remedy::Extend { to: 30, .. })
        ));
        f.reprofile_due = true;
        assert_eq!(
            p.decide(&f, &repo, &pht),
            Decision::Profile(ProfileReason::Interval)
        );
        let drift = Drift::BreachRate {
            reference: 0.4,
            observed: 0.9,
        };
        f.drift = Some(drift.clone());
        assert_eq!(
            p.decide(&f, &repo, &pht),
            Decision::Profile(ProfileReason::Drift(drift))
        );
    }

    #[test]
    fn reselection_only_on_slo_or_budget_change() {
        let p = Policy::new(PolicyConfig::default(), Slo::default(), 1 << 30).unwrap();
        assert!(!p.needs_reselection(&Slo::default(), 1 << 30));
        assert!(p.needs_reselection(&Slo::default(), 1 << 29));
        let slo = Slo {
            objective: Objective::Energy,
            ..Slo::default()
        };
        assert!(p.needs_reselection(&slo, 1 << 30));
    }
}
