//! Candidate selection (HELIOS step 1: the TopK models that fit the SLO and the memory
//! budget, from the repository's offline telemetry) and the choice of what to serve after an
//! online evaluation (step 3: the best model of the PHT, at the depth its exit histogram
//! needs).
//!
//! A model is judged at one operating point: the depth its exit histogram covers (the
//! profile's offline histogram before any evaluation, the PHT's after), or the first deeper
//! servable depth that meets the SLO and the budget. A model with no such depth is rejected,
//! with the reason its deepest fitting attempt gave.

use crate::manifest::{Manifest, ModelEntry};
use crate::pht::{ExitHistogram, Pht};
use crate::{HeliosError, Result};

use super::depth::coverage_depth;
use super::estimate::{self, compare, Limits, OperatingPoint};
use super::{DepthRule, Policy};

/// A model kept for online evaluation, with the operating point it was ranked at.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub point: OperatingPoint,
}

impl Candidate {
    pub fn model(&self) -> &str {
        &self.point.model
    }

    pub fn depth(&self) -> usize {
        self.point.depth
    }
}

/// The outcome of a selection: the kept candidates best first, and why the others were not.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    pub candidates: Vec<Candidate>,
    /// `(model, reason)`: over the SLO or budget at every depth, or ranked below the TopK.
    pub rejected: Vec<(String, String)>,
}

impl Policy {
    /// The SLO and budget as limits; the quality reference is the repository's best
    /// full-depth bits per byte.
    pub fn limits(&self, repo: &Manifest) -> Limits {
        Limits {
            max_bits_per_byte: self
                .slo
                .max_bits_per_byte_increase
                .map(|inc| repo.best_full_depth_bits_per_byte() + inc),
            ttft_ms: self.slo.ttft_ms,
            tpot_ms: self.slo.tpot_ms,
            budget_bytes: self.budget_bytes,
            min_kv_tokens: self.config.min_kv_tokens,
        }
    }

    /// HELIOS step 1: the TopK candidates, best first, ranked at their offline operating
    /// points.
    pub fn select_candidates(&self, repo: &Manifest) -> Result<Selection> {
        let limits = self.limits(repo);
        let mut points = Vec::new();
        let mut rejected = Vec::new();
        for m in repo.models() {
            let hist = m.profile.as_ref().map(|p| &p.exit_histogram);
            match self.operating_point(m, hist, &limits, |d| estimate::offline(m, d)) {
                Ok(p) => points.push(p),
                Err(why) => rejected.push((m.name.clone(), why)),
            }
        }
        let ranked = self.rank(points);
        if ranked.is_empty() {
            return Err(HeliosError::NoCandidate {
                budget_bytes: self.budget_bytes,
                rejected: rejected.iter().map(|(m, r)| format!("{m}: {r}")).collect(),
            });
        }
        let mut candidates = Vec::new();
        for (i, point) in ranked.into_iter().enumerate() {
            if i < self.config.top_k {
                candidates.push(Candidate { point });
            } else {
                rejected.push((
                    point.model.clone(),
                    format!(
                        "ranked {} for {:?}, below the top {}",
                        i + 1,
                        self.slo.objective,
                        self.config.top_k
                    ),
                ));
            }
        }
        tracing::info!(
            kept = ?candidates.iter().map(|c| (c.model(), c.depth())).collect::<Vec<_>>(),
            rejected = rejected.len(),
            "HELIOS candidate selection"
        );
        Ok(Selection {
            candidates,
            rejected,
        })
    }

    /// HELIOS step 3: after an online evaluation, the best of `candidates` with the PHT's
    /// measurements, at the depth its measured exit histogram covers.
    pub fn choose_serving(
        &self,
        repo: &Manifest,
        candidates: &[Candidate],
        pht: &Pht,
    ) -> Result<OperatingPoint> {
        let limits = self.limits(repo);
        let mut points = Vec::new();
        let mut rejected = Vec::new();
        for c in candidates {
            let Some(m) = repo.get(c.model()) else {
                rejected.push(format!("{}: not in the repository", c.model()));
                continue;
            };
            let hist = measured_histogram(pht, &m.name);
            match self.operating_point(m, hist.as_ref(), &limits, |d| estimate::online(m, pht, d)) {
                Ok(p) => points.push(p),
                Err(why) => rejected.push(format!("{}: {why}", m.name)),
            }
        }
        self.rank(points)
            .into_iter()
            .next()
            .ok_or(HeliosError::NoCandidate {
                budget_bytes: self.budget_bytes,
                rejected,
            })
    }

    /// The first servable depth within `limits` from where the depth rule starts: the depth
    /// `hist` covers (coverage), the shallowest depth when the SLO bounds bits per byte, full
    /// depth when it does not.
    pub(crate) fn operating_point(
        &self,
        m: &ModelEntry,
        hist: Option<&ExitHistogram>,
        limits: &Limits,
        point_at: impl Fn(usize) -> Option<OperatingPoint>,
    ) -> std::result::Result<OperatingPoint, String> {
        let servable: Vec<usize> = m.servable_depths().collect();
        let start = match (self.config.depth_rule, self.slo.max_bits_per_byte_increase) {
            (DepthRule::Coverage, _) => match hist {
                Some(h) => coverage_depth(h, &servable, self.config.exit_coverage),
                None => m.layers,
            },
            // The shallowest depth the limits (the bound among them) accept.
            (DepthRule::QualityBound, Some(_)) => servable.first().copied().unwrap_or(m.layers),
            (DepthRule::QualityBound, None) => m.layers,
        };
        let mut why = format!("no telemetry at depth {start} or deeper");
        for d in servable.into_iter().filter(|&d| d >= start) {
            let Some(p) = point_at(d) else {
                why = format!("no telemetry at depth {d}");
                continue;
            };
            match limits.violation(&p) {
                None => return Ok(p),
                Some(v) => why = v,
            }
        }
        Err(why)
    }

    /// Best first for the SLO's objective.
    pub(crate) fn rank(&self, mut points: Vec<OperatingPoint>) -> Vec<OperatingPoint> {
        let use_joules = points.iter().all(|p| p.joules_per_token.is_some());
        points.sort_by(|a, b| compare(a, b, self.slo.objective, use_joules));
        points
    }
}

/// All exit histograms the PHT holds for `model`, merged (`None` when it has none).
pub(crate) fn measured_histogram(pht: &Pht, model: &str) -> Option<ExitHistogram> {
    let mut h = ExitHistogram::new();
    for r in pht.of_model(model) {
        h.merge(&r.exits);
    }
    (!h.is_empty()).then_some(h)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::manifest::{DepthTelemetry, ModelEntry};
    use crate::policy::tests::row;
    use crate::policy::{Objective, PolicyConfig, Slo};

    fn depth(d: usize, tps: f64, bpb: f64, mem: u64) -> DepthTelemetry {
        DepthTelemetry {
            depth: d,
            tokens_per_s: tps,
            ttft_ms: Some(2000.0 / tps),
            bits_per_byte: bpb,
            memory_bytes: mem,
            kv_bytes_per_token: Some(1000 * d as u64),
            joules_per_token: None,
        }
    }

    /// A model of `layers` layers with exits every quarter, speed falling and quality rising
    /// with depth: at depth d, `tps0 * layers / d` tokens/s, `bpb0 + (layers - d) / layers`
    /// bits per byte, and `base + d * per_layer` bytes.
    pub(crate) fn model(
        name: &str,
        layers: usize,
        tps0: f64,
        bpb0: f64,
        base: u64,
        per_layer: u64,
    ) -> ModelEntry {
        let q = layers / 4;
        let exits = vec![q, 2 * q, 3 * q];
        let depths = exits
            .iter()
            .copied()
            .chain([layers])
            .map(|d| {
                depth(
                    d,
                    tps0 * layers as f64 / d as f64,
                    bpb0 + (layers - d) as f64 / layers as f64,
                    base + d as u64 * per_layer,
                )
            })
            .collect();
        ModelEntry {
            name: name.into(),
            path: None,
            url: None,
            remote_model: None,
            tokenizer: None,
            context_length: None,
            size_bytes: base + layers as u64 * per_layer,
            layers,
            exit_layers: exits,
            exit_heads: None,
            profile: None,
            depths,
        }
    }

    /// small: 24 layers, 40 tok/s at full depth, 1.2 bpb, 100 MB + 10 MB/layer;
    /// medium: 32 layers, 20 tok/s, 1.0 bpb, 200 MB + 40 MB/layer;
    /// large: 40 layers, 8 tok/s, 0.8 bpb, 400 MB + 100 MB/layer;
    /// tiny: 12 layers, 100 tok/s, 2.0 bpb, 50 MB + 5 MB/layer.
    pub(crate) fn repo() -> Manifest {
        Manifest::new(
            vec![
                model("small", 24, 40.0, 1.2, 100_000_000, 10_000_000),
                model("medium", 32, 20.0, 1.0, 200_000_000, 40_000_000),
                model("large", 40, 8.0, 0.8, 400_000_000, 100_000_000),
                model("tiny", 12, 100.0, 2.0, 50_000_000, 5_000_000),
            ],
            "test",
        )
        .unwrap()
    }

    /// HELIOS's depth rule (the exit histogram's coverage).
    fn policy(slo: Slo, budget: u64) -> Policy {
        let config = PolicyConfig {
            depth_rule: DepthRule::Coverage,
            ..PolicyConfig::default()
        };
        Policy::new(config, slo, budget).unwrap()
    }

    fn names(s: &Selection) -> Vec<(&str, usize)> {
        s.candidates
            .iter()
            .map(|c| (c.model(), c.depth()))
            .collect()
    }

    #[test]
    fn top_k_by_throughput_at_full_depth_without_profiles() {
        let s = policy(Slo::default(), 10 << 30)
            .select_candidates(&repo())
            .unwrap();
        assert_eq!(names(&s), vec![("tiny", 12), ("small", 24), ("medium", 32)]);
        assert_eq!(s.rejected.len(), 1);
        assert_eq!(s.rejected[0].0, "large");
        assert!(
            s.rejected[0].1.contains("below the top 3"),
            "{}",
            s.rejected[0].1
        );
    }

    #[test]
    fn quality_bound_is_relative_to_the_best_full_depth_model() {
        // Best full depth: large, 0.8. Allowed: 0.8 + 0.5 = 1.3: tiny (2.0) is out at every
        // depth, small at 24 (1.2) is in, medium at 32 (1.0) is in, large in.
        let slo = Slo {
            max_bits_per_byte_increase: Some(0.5),
            ..Slo::default()
        };
        let s = policy(slo, 10 << 30).select_candidates(&repo()).unwrap();
        assert_eq!(
            names(&s),
            vec![("small", 24), ("medium", 32), ("large", 40)]
        );
        let tiny = s.rejected.iter().find(|r| r.0 == "tiny").unwrap();
        assert!(tiny.1.contains("bits per byte"), "{}", tiny.1);
        // The quality-bound rule: each model at its shallowest depth within 1.3.
        let config = PolicyConfig {
            depth_rule: DepthRule::QualityBound,
            ..PolicyConfig::default()
        };
        let slo = Slo {
            max_bits_per_byte_increase: Some(0.5),
            ..Slo::default()
        };
        let p = Policy::new(config, slo, 10 << 30).unwrap();
        let s = p.select_candidates(&repo()).unwrap();
        assert_eq!(
            names(&s),
            vec![("small", 24), ("medium", 24), ("large", 20)]
        );
    }

    #[test]
    fn offline_exit_profile_sets_the_depth_and_the_slo_can_push_it_deeper() {
        let mut repo_models = repo().models().to_vec();
        // medium: 75% of tokens exit by its first exit (8 of 32 layers).
        let m = &mut repo_models[1];
        m.profile = Some(crate::manifest::ProfileInfo {
            text: "t".into(),
            scored_tokens: 100,
            scored_bytes: 400,
            prompt_tokens: 8,
            decode_tokens: 8,
            runs: 1,
            threads: 1,
            threshold: 0.8,
            confidence: switchyard_exits::ConfidenceMeasure::MaxProb,
            exit_histogram: ExitHistogram::from_counts([(8, 75), (32, 25)]),
            seconds: 1.0,
        });
        let repo = Manifest::new(repo_models, "t").unwrap();
        // At depth 8: 20 * 32 / 8 = 80 tok/s, second only to tiny.
        let s = policy(Slo::default(), 10 << 30)
            .select_candidates(&repo)
            .unwrap();
        assert_eq!(names(&s), vec![("tiny", 12), ("medium", 8), ("small", 24)]);
        // Depth 8 has 1.0 + 24/32 = 1.75 bits per byte; with at most 0.8 + 0.5 the first
        // fitting depth is 24 (1.25).
        let slo = Slo {
            max_bits_per_byte_increase: Some(0.5),
            ..Slo::default()
        };
        // (tiny is out at every depth: 2.0 bits per byte.)
        let s = policy(slo, 10 << 30).select_candidates(&repo).unwrap();
        assert_eq!(
            names(&s),
            vec![("small", 24), ("medium", 24), ("large", 40)]
        );
    }

    #[test]
    fn memory_budget_and_latency_bounds_reject_models() {
        // large needs 400 MB + 40 × 100 MB + 2048 × 40,000 B of K/V = 4.48 GB.
        let budget = 1_500_000_000;
        let s = policy(Slo::default(), budget)
            .select_candidates(&repo())
            .unwrap();
        let large = s.rejected.iter().find(|r| r.0 == "large").unwrap();
        assert!(large.1.contains("exceed the budget"), "{}", large.1);
        let slo = Slo {
            objective: Objective::Latency,
            tpot_ms: Some(30.0),
            ..Slo::default()
        };
        // 30 ms per token: only tiny (10 ms) and small (25 ms) at full depth.
        let s = policy(slo, 10 << 30).select_candidates(&repo()).unwrap();
        assert_eq!(names(&s), vec![("tiny", 12), ("small", 24)]);
        let slo = Slo {
            tpot_ms: Some(1.0),
            ..Slo::default()
        };
        let e = policy(slo, 10 << 30)
            .select_candidates(&repo())
            .unwrap_err();
        assert!(matches!(e, HeliosError::NoCandidate { .. }));
        assert!(e.to_string().contains("ms per token"), "{e}");
    }

    #[test]
    fn energy_prefers_fewer_bytes_per_token() {
        let slo = Slo {
            objective: Objective::Energy,
            ..Slo::default()
        };
        let s = policy(slo, 10 << 30).select_candidates(&repo()).unwrap();
        // Full depth: tiny 110 MB, small 340 MB, medium 1.48 GB, large 4.4 GB.
        assert_eq!(names(&s), vec![("tiny", 12), ("small", 24), ("medium", 32)]);
    }

    #[test]
    fn serving_choice_uses_the_measured_histogram_and_speed() {
        let repo = repo();
        let p = policy(Slo::default(), 10 << 30);
        let sel = p.select_candidates(&repo).unwrap();
        let mut pht = Pht::new(0.8);
        // tiny turned out slow online (a tenth of its offline speed); small exits 80% at 6.
        pht.upsert(row("tiny", 12, 10.0, 2.0, &[(12, 50)]));
        pht.upsert(row("small", 24, 40.0, 1.2, &[(6, 80), (24, 20)]));
        pht.upsert(row("medium", 32, 20.0, 1.0, &[(32, 50)]));
        let best = p.choose_serving(&repo, &sel.candidates, &pht).unwrap();
        assert_eq!((best.model.as_str(), best.depth), ("small", 6));
        // small at 6: offline 160 tok/s, scaled by the measured/offline ratio 1 at 24.
        assert!((best.tokens_per_s - 160.0).abs() < 1e-6);
    }
}
