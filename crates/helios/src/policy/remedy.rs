//! Extend or switch, when the Confidence Breach Counter fires (HELIOS step 3): load more
//! layers of the serving model, or move to another candidate's partial load, whichever the PHT
//! says costs less.
//!
//! Cost of an option, in milliseconds: its one-time cost (extend: layers to load × the PHT's
//! load time per layer; switch: the PHT's switch time of the target) plus the time to serve
//! the horizon (the tokens expected before the next re-profiling) at the option's speed. For
//! the energy objective this is energy at constant power. Options outside the SLO or the
//! memory budget are not considered; on a tie the extend wins (no sequence has to move).

use serde::{Deserialize, Serialize};

use crate::manifest::Manifest;
use crate::pht::Pht;

use super::depth::extend_target;
use super::estimate::{self, OperatingPoint};
use super::select::measured_histogram;
use super::{Policy, Serving};

/// Which remedies the policy may choose (HELIOS's Table 8 ablation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RemedyMode {
    /// The cheaper of extend and switch (HELIOS).
    #[default]
    Dynamic,
    ExtendOnly,
    SwitchOnly,
}

/// What to do about the breaches.
#[derive(Debug, Clone, PartialEq)]
pub enum Remedy {
    /// Load layers `from..to` of the serving model and serve at `to`.
    Extend {
        model: String,
        from: usize,
        to: usize,
        cost_ms: f64,
    },
    /// Serve with another candidate, loaded up to `depth`.
    Switch {
        from: String,
        to: String,
        depth: usize,
        cost_ms: f64,
    },
}

impl Remedy {
    pub fn cost_ms(&self) -> f64 {
        match self {
            Remedy::Extend { cost_ms, .. } | Remedy::Switch { cost_ms, .. } => *cost_ms,
        }
    }
}

pub(crate) struct RemedyContext<'a> {
    pub policy: &'a Policy,
    pub repo: &'a Manifest,
    pub pht: &'a Pht,
    pub serving: &'a Serving,
    pub horizon_tokens: f64,
}

fn horizon_ms(p: &OperatingPoint, horizon_tokens: f64) -> f64 {
    horizon_tokens.max(0.0) * p.tpot_ms()
}

/// The extend option: the depth the high-exit tokens need, or deeper if that breaks a limit.
fn extend(ctx: &RemedyContext<'_>) -> Option<Remedy> {
    let s = ctx.serving;
    let m = ctx.repo.get(&s.model)?;
    let per_layer = ctx
        .pht
        .of_model(&m.name)
        .map(|r| f64::from(r.extend_ms_per_layer))
        .fold(None, |acc: Option<f64>, v| {
            Some(acc.map_or(v, |a| a.max(v)))
        })?;
    let servable: Vec<usize> = m.servable_depths().collect();
    let hist = measured_histogram(ctx.pht, &m.name).unwrap_or_default();
    let target = extend_target(&hist, &servable, s.depth, ctx.policy.config.exit_coverage)?;
    let limits = ctx.policy.limits(ctx.repo);
    let point = servable
        .iter()
        .copied()
        .filter(|&d| d >= target)
        .filter_map(|d| estimate::online(m, ctx.pht, d))
        .find(|p| limits.violation(p).is_none())?;
    let load_ms = (point.depth - s.depth) as f64 * per_layer;
    Some(Remedy::Extend {
        model: m.name.clone(),
        from: s.depth,
        to: point.depth,
        cost_ms: load_ms + horizon_ms(&point, ctx.horizon_tokens),
    })
}

/// The cheapest switch to another model of the PHT, at the depth its histogram covers.
fn switch(ctx: &RemedyContext<'_>) -> Option<Remedy> {
    let limits = ctx.policy.limits(ctx.repo);
    ctx.pht
        .models()
        .into_iter()
        .filter(|&name| name != ctx.serving.model)
        .filter_map(|name| {
            let m = ctx.repo.get(name)?;
            let switch_ms = ctx
                .pht
                .of_model(name)
                .map(|r| f64::from(r.switch_ms))
                .fold(None, |acc: Option<f64>, v| {
                    Some(acc.map_or(v, |a| a.max(v)))
                })?;
            let hist = measured_histogram(ctx.pht, name);
            let p = ctx
                .policy
                .operating_point(m, hist.as_ref(), &limits, |d| {
                    estimate::online(m, ctx.pht, d)
                })
                .ok()?;
            Some(Remedy::Switch {
                from: ctx.serving.model.clone(),
                to: name.to_string(),
                depth: p.depth,
                cost_ms: switch_ms + horizon_ms(&p, ctx.horizon_tokens),
            })
        })
        .min_by(|a, b| a.cost_ms().total_cmp(&b.cost_ms()))
}

/// The remedy the mode allows at the least cost; `None` when no option exists (already at
/// full depth and no other candidate fits, for example).
pub(crate) fn decide(ctx: &RemedyContext<'_>) -> Option<Remedy> {
    let mode = ctx.policy.config.remedy;
    let e = (mode != RemedyMode::SwitchOnly)
        .then(|| extend(ctx))
        .flatten();
    let s = (mode != RemedyMode::ExtendOnly)
        .then(|| switch(ctx))
        .flatten();
    let choice = match (e, s) {
        (Some(e), Some(s)) if s.cost_ms() < e.cost_ms() => Some(s),
        (Some(e), _) => Some(e),
        (None, s) => s,
    };
    if let Some(c) = &choice {
        tracing::info!(remedy = ?c, "HELIOS breach remedy");
    }
    choice
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::select::tests::repo;
    use crate::policy::tests::row;
    use crate::policy::{PolicyConfig, Slo};

    fn policy(mode: RemedyMode, slo: Slo) -> Policy {
        let cfg = PolicyConfig {
            remedy: mode,
            depth_rule: crate::policy::DepthRule::Coverage,
            ..PolicyConfig::default()
        };
        Policy::new(cfg, slo, 10 << 30).unwrap()
    }

    /// Serving small (24 layers) at 6; 26% of its tokens go deeper, 10 of 26 by 12. Medium is
    /// the other candidate, measured at full depth with most tokens exiting at its first exit.
    fn pht(small_ext_ms: f32, medium_switch_ms: f32) -> Pht {
        let mut pht = Pht::new(0.8);
        let mut s = row(
            "small",
            24,
            40.0,
            1.2,
            &[(6, 74), (12, 10), (18, 6), (24, 10)],
        );
        s.extend_ms_per_layer = small_ext_ms;
        pht.upsert(s);
        let mut m = row("medium", 32, 20.0, 1.0, &[(8, 90), (32, 10)]);
        m.switch_ms = medium_switch_ms;
        pht.upsert(m);
        pht
    }

    fn decide_with(p: &Policy, pht: &Pht, horizon: f64) -> Option<Remedy> {
        let repo = repo();
        let serving = Serving {
            model: "small".into(),
            depth: 6,
        };
        decide(&RemedyContext {
            policy: p,
            repo: &repo,
            pht,
            serving: &serving,
            horizon_tokens: horizon,
        })
    }

    #[test]
    fn cheaper_option_wins_by_the_pht_costs() {
        // Extend: the 26 deeper tokens need 24 for 70% (10 by 12, 16 by 18, 26 by 24), so
        // 18 layers at 10 ms = 180 ms, then 1000 tokens at 40 tok/s = 25,000 ms.
        // Switch: medium at 8 (90% exit there): 80 tok/s, 1000 tokens = 12,500 ms + 500 ms.
        let p = policy(RemedyMode::Dynamic, Slo::default());
        let r = decide_with(&p, &pht(10.0, 500.0), 1000.0).unwrap();
        match r {
            Remedy::Switch {
                ref to,
                depth,
                cost_ms,
                ..
            } => {
                assert_eq!((to.as_str(), depth), ("medium", 8));
                assert!((cost_ms - 13_000.0).abs() < 1e-6, "{cost_ms}");
            }
            other => panic!("expected a switch, got {other:?}"),
        }
        // A switch that costs more than the horizon it saves loses: 20 s to switch.
        let r = decide_with(&p, &pht(10.0, 20_000.0), 1000.0).unwrap();
        assert!(
            matches!(r, Remedy::Extend { from: 6, to: 24, cost_ms, .. } if (cost_ms - 25_180.0).abs() < 1e-6),
            "{r:?}"
        );
    }

    #[test]
    fn modes_restrict_the_options_and_limits_filter_them() {
        let pht = pht(10.0, 500.0);
        let e = decide_with(
            &policy(RemedyMode::ExtendOnly, Slo::default()),
            &pht,
            1000.0,
        );
        assert!(matches!(e, Some(Remedy::Extend { to: 24, .. })), "{e:?}");
        let s = decide_with(
            &policy(RemedyMode::SwitchOnly, Slo::default()),
            &pht,
            1000.0,
        );
        assert!(matches!(s, Some(Remedy::Switch { .. })), "{s:?}");
        // Quality bound 0.8 + 0.25: medium at 8 (1.75) is out; its first fitting depth is 32
        // (1.0): 20 tok/s, 50,500 ms, so extending small to 24 (1.2 > 1.05) fails the bound
        // too, and only the switch to medium at full depth is left.
        let slo = Slo {
            max_bits_per_byte_increase: Some(0.25),
            ..Slo::default()
        };
        let r = decide_with(&policy(RemedyMode::Dynamic, slo), &pht, 1000.0).unwrap();
        assert!(
            matches!(r, Remedy::Switch { depth: 32, cost_ms, .. } if (cost_ms - 50_500.0).abs() < 1e-6),
            "{r:?}"
        );
    }

    #[test]
    fn nothing_to_do_at_full_depth_without_other_candidates() {
        let repo = repo();
        let p = policy(RemedyMode::Dynamic, Slo::default());
        let mut pht = Pht::new(0.8);
        pht.upsert(row("small", 24, 40.0, 1.2, &[(24, 10)]));
        let serving = Serving {
            model: "small".into(),
            depth: 24,
        };
        let r = decide(&RemedyContext {
            policy: &p,
            repo: &repo,
            pht: &pht,
            serving: &serving,
            horizon_tokens: 100.0,
        });
        assert_eq!(r, None);
    }
}
