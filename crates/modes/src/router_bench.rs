//! `switchyard bench router`: one mixed workload served by fixed f16, the rule router, each
//! learned router and the oracle, in one run.
//!
//! The oracle and the learned routers read the mode × workload matrix that `bench modes`
//! measured for the same model (its JSON). The learned routers are trained to imitate the
//! oracle on request features drawn at random over the feature space (seeded) and scored on
//! held-out ones; then every router routes the same mixed requests (the matrix's workloads,
//! labelled), each request is served in the routed mode, and the table reports the mean
//! latency speedup over f16, the accuracy delta of the chosen modes (from the matrix's
//! quality), constraint violations, and the routing overhead per decision.

use std::collections::BTreeMap;
use std::time::Instant;

use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::Serialize;
use switchyard_request::{Mode, SamplingParams};
use switchyard_router::{
    CellMeasure, Constraints, Decision, FixedRouter, LearnedKind, LearnedRouter, ModeMatrix,
    ModeSet, Oracle, RequestFeatures, Router, RulesRouter,
};

use crate::bench::{workloads, ModesBenchOptions, ModesReport};
use crate::serve::{ModeAssets, ModeServer};
use crate::{ModesError, Result};

/// Requests drawn for training the learned routers, and for their held-out score.
pub const TRAIN_REQUESTS: usize = 400;
pub const HELD_OUT_REQUESTS: usize = 200;

/// The matrix as the oracle reads it: cells by workload, latency, memory, accuracy points.
/// A workload where f16 itself did not run (it did not fit) has no baseline to gate against
/// and is left out; the oracle maps its requests to the nearest measured cell.
pub fn matrix_of(report: &ModesReport) -> ModeMatrix {
    let mut m = ModeMatrix::default();
    let has_baseline = |w: &str| {
        report
            .cells
            .iter()
            .any(|c| c.workload == w && c.mode == Mode::F16 && c.error.is_none())
    };
    for c in report
        .cells
        .iter()
        .filter(|c| c.error.is_none() && has_baseline(&c.workload))
    {
        let accuracy = report
            .quality
            .iter()
            .find(|q| q.mode == c.mode)
            .and_then(|q| q.accuracy_points);
        m.insert(
            &c.workload,
            c.mode,
            CellMeasure {
                latency_s: c.latency_mean_s,
                energy_j_per_token: c.energy_j_per_token,
                peak_memory_bytes: c.peak_memory_bytes,
                accuracy_points: accuracy,
                quality_points: None,
            },
        );
    }
    m
}

/// Random request features over the space the workloads span (for training routers).
pub fn random_features(n: usize, seed: u64) -> Vec<RequestFeatures> {
    let mut rng = StdRng::seed_from_u64(seed);
    let labels = [
        None,
        Some("SS"),
        Some("SL"),
        Some("LS"),
        Some("LL"),
        Some("chat"),
        Some("batch"),
        Some("gsm8k"),
        Some("mmlu"),
    ];
    (0..n)
        .map(|_| {
            let prompt = rng.random_range(16..2048);
            let out = [16, 32, 64, 128, 256][rng.random_range(0..5)];
            let shared = if rng.random_bool(0.25) {
                rng.random_range(0..prompt)
            } else {
                0
            };
            RequestFeatures {
                prompt_tokens: prompt,
                max_output_tokens: out,
                expected_output_tokens: None,
                shared_prefix_tokens: shared,
                memory_pressure: if rng.random_bool(0.2) {
                    rng.random_range(0.5..1.0)
                } else {
                    rng.random_range(0.0..0.5)
                },
                queue_depth: if rng.random_bool(0.2) {
                    rng.random_range(8..32)
                } else {
                    rng.random_range(0..4)
                },
                workload: labels[rng.random_range(0..labels.len())].map(str::to_string),
            }
        })
        .collect()
}

/// One router's row.
#[derive(Debug, Clone, Serialize)]
pub struct RouterRow {
    pub router: String,
    pub requests: usize,
    pub mean_latency_s: f64,
    /// f16's mean latency over this router's (same requests).
    pub speedup_vs_f16: f64,
    /// Not measurable here unless the matrix holds energy.
    pub energy_ratio: Option<f64>,
    /// Mean over requests of the chosen mode's accuracy minus f16's (matrix points).
    pub accuracy_delta_points: Option<f64>,
    /// Requests routed to a mode that breaks a constraint in their cell (accuracy drop over
    /// 1.5 points, memory over the limit) or that failed and fell back.
    pub constraint_violations: usize,
    pub fallbacks: usize,
    /// Mean time of the decision alone, microseconds.
    pub routing_overhead_us: f64,
    /// Held-out agreement with the oracle (learned routers).
    pub held_out_accuracy: Option<f64>,
    pub modes_chosen: BTreeMap<String, usize>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RouterReport {
    pub model: String,
    pub energy: String,
    pub rows: Vec<RouterRow>,
    pub constraints: Constraints,
}

/// A request of the mixed workload: features, prompt, output length and its matrix cell.
struct MixedRequest {
    features: RequestFeatures,
    prompt: Vec<u32>,
    output: usize,
}

fn mixed(assets: &ModeAssets, opts: &ModesBenchOptions) -> Result<Vec<MixedRequest>> {
    let ws = workloads(&assets.tokenizer, opts)?;
    let mut out = Vec::new();
    for w in &ws {
        for (i, p) in w.prompts.iter().enumerate() {
            let shared = if w.name == "shared-prefix" && i > 0 {
                512
            } else {
                0
            };
            out.push(MixedRequest {
                features: RequestFeatures {
                    prompt_tokens: p.len(),
                    max_output_tokens: w.output_tokens,
                    expected_output_tokens: None,
                    shared_prefix_tokens: shared,
                    memory_pressure: w.claimed_bytes as f64 / opts.budget.max(1) as f64,
                    queue_depth: if w.concurrent { w.requests } else { 0 },
                    workload: Some(w.name.clone())
                        .filter(|n| ["SS", "SL", "LS", "LL", "batch"].contains(&n.as_str())),
                },
                prompt: p.clone(),
                output: w.output_tokens,
            });
        }
    }
    Ok(out)
}

/// Runs every router over the same mixed requests.
pub fn run(
    assets: &ModeAssets,
    matrix_report: &ModesReport,
    opts: &ModesBenchOptions,
    save_routers: Option<&std::path::Path>,
    mut progress: impl FnMut(&str),
) -> Result<RouterReport> {
    let matrix = matrix_of(matrix_report);
    let constraints = Constraints::default();
    let oracle = Oracle::new(matrix.clone(), constraints.clone())
        .map_err(|e| ModesError::Invalid(e.to_string()))?;
    let train = oracle.label(&random_features(TRAIN_REQUESTS, 1));
    let held = oracle.label(&random_features(HELD_OUT_REQUESTS, 2));
    let mut routers: Vec<(Box<dyn Router>, Option<f64>)> = vec![
        (Box::new(FixedRouter::new(Mode::F16)), None),
        (Box::new(RulesRouter::default()), None),
    ];
    for kind in LearnedKind::ALL {
        let r = LearnedRouter::train(kind, &train, 7)
            .map_err(|e| ModesError::Invalid(e.to_string()))?;
        let acc = r.accuracy(&held);
        if let Some(dir) = save_routers {
            let path = dir.join(format!("{}.json", kind.name()));
            r.save(&path)
                .map_err(|e| ModesError::Invalid(e.to_string()))?;
            progress(&format!("wrote {}", path.display()));
        }
        routers.push((Box::new(r), Some(acc)));
    }
    routers.push((
        Box::new(
            Oracle::new(matrix.clone(), constraints.clone())
                .map_err(|e| ModesError::Invalid(e.to_string()))?,
        ),
        None,
    ));

    let requests = mixed(assets, opts)?;
    // Modes that load within the budget are available to every router.
    let mut servers: BTreeMap<Mode, ModeServer> = BTreeMap::new();
    let mut available = ModeSet::empty();
    for m in matrix_report.quality.iter().map(|q| q.mode) {
        progress(&format!("loading {m}"));
        match ModeServer::load(m, assets, opts.budget) {
            Ok(s) => {
                servers.insert(m, s);
                available.insert(m);
            }
            Err(e) => progress(&format!("{m} unavailable: {e}")),
        }
    }
    let mut latency_by_mode_request: BTreeMap<(Mode, usize), f64> = BTreeMap::new();
    let mut rows = Vec::new();
    let accuracy = |m: Mode| {
        matrix_report
            .quality
            .iter()
            .find(|q| q.mode == m)
            .and_then(|q| q.accuracy_points)
    };
    let base_acc = accuracy(Mode::F16);
    for (router, held_out_accuracy) in &routers {
        progress(&format!("router {}", router.name()));
        let mut decisions: Vec<Decision> = Vec::new();
        let mut overhead = 0.0;
        for r in &requests {
            let t = Instant::now();
            let d = router.route_among(&r.features, available);
            overhead += t.elapsed().as_secs_f64();
            decisions.push(d);
        }
        let mut lat = Vec::new();
        let mut violations = 0;
        let mut chosen: BTreeMap<String, usize> = BTreeMap::new();
        let mut acc_delta = Vec::new();
        for (i, (r, d)) in requests.iter().zip(&decisions).enumerate() {
            *chosen.entry(d.mode.to_string()).or_default() += 1;
            let l = match latency_by_mode_request.get(&(d.mode, i)) {
                Some(&l) => l,
                None => {
                    let server = servers
                        .get(&d.mode)
                        .ok_or_else(|| ModesError::Invalid(format!("{} is not loaded", d.mode)))?;
                    let params = SamplingParams {
                        max_tokens: r.output,
                        ignore_eos: true,
                        ..SamplingParams::default()
                    };
                    let l = server.run(&assets.tokenizer, &r.prompt, &params)?.latency_s;
                    latency_by_mode_request.insert((d.mode, i), l);
                    l
                }
            };
            lat.push(l);
            if let (Some(a), Some(b)) = (accuracy(d.mode), base_acc) {
                acc_delta.push(a - b);
            }
            let cell = oracle.cell_for(&r.features);
            let breaks = cell.and_then(|c| matrix.cells.get(c)).is_some_and(|cell| {
                match (cell.get(&d.mode), cell.get(&Mode::F16)) {
                    (Some(m), Some(base)) => !constraints.admits(m, base),
                    _ => false,
                }
            });
            if breaks || d.fallback {
                violations += 1;
            }
        }
        let mean = lat.iter().sum::<f64>() / lat.len().max(1) as f64;
        rows.push(RouterRow {
            router: router.name(),
            requests: requests.len(),
            mean_latency_s: mean,
            speedup_vs_f16: f64::NAN,
            energy_ratio: None,
            accuracy_delta_points: (!acc_delta.is_empty())
                .then(|| acc_delta.iter().sum::<f64>() / acc_delta.len() as f64),
            constraint_violations: violations,
            fallbacks: decisions.iter().filter(|d| d.fallback).count(),
            routing_overhead_us: 1e6 * overhead / requests.len().max(1) as f64,
            held_out_accuracy: *held_out_accuracy,
            modes_chosen: chosen,
        });
    }
    let f16 = rows.first().map(|r| r.mean_latency_s).unwrap_or(f64::NAN);
    for r in &mut rows {
        r.speedup_vs_f16 = f16 / r.mean_latency_s;
    }
    Ok(RouterReport {
        model: assets.name.clone(),
        energy: matrix_report.energy.clone(),
        rows,
        constraints,
    })
}

impl RouterReport {
    pub fn markdown(&self) -> String {
        let mut md = format!(
            "# Router table: {}\n\nEnergy: {}.\n\n| router | requests | mean latency (s) | speedup vs f16 | energy ratio | accuracy Δ (points) | constraint violations | fallbacks | routing overhead (µs) | held-out agreement with the oracle | modes chosen |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
            self.model, self.energy
        );
        for r in &self.rows {
            md.push_str(&format!(
                "| {} | {} | {:.3} | {:.2}x | {} | {} | {} | {} | {:.2} | {} | {} |\n",
                r.router,
                r.requests,
                r.mean_latency_s,
                r.speedup_vs_f16,
                r.energy_ratio
                    .map_or("not measurable here".into(), |e| format!("{e:.2}")),
                r.accuracy_delta_points
                    .map_or("—".into(), |a| format!("{a:+.2}")),
                r.constraint_violations,
                r.fallbacks,
                r.routing_overhead_us,
                r.held_out_accuracy
                    .map_or("—".into(), |a| format!("{:.1}%", 100.0 * a)),
                r.modes_chosen
                    .iter()
                    .map(|(m, n)| format!("{m} {n}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            ));
        }
        md
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_features_are_seeded() {
        let a = random_features(50, 3);
        let b = random_features(50, 3);
        assert_eq!(a, b);
        assert_ne!(a, random_features(50, 4));
        assert!(a
            .iter()
            .all(|f| f.prompt_tokens >= 16 && f.prompt_tokens < 2048));
    }
}
