//! `switchyard bench router`: one mixed workload served by every fixed mode, the paper's rule
//! router, the rules `router fit` fits to the matrix, each learned router and the oracle, in
//! one run.
//!
//! The oracle, the fit and the learned routers read the mode × workload matrix that
//! `bench modes` measured for the same model (its JSON), with each mode's quality against f16
//! for the quality gate ([`Gate`]). The learned routers are trained to imitate the oracle on
//! request features drawn at random over the feature space (seeded) and scored on held-out
//! ones; then every router routes the same mixed requests (the matrix's workloads, plus GSM8K
//! and MMLU questions, labelled), each request is served in the routed mode (one at a time; a
//! mode's latency on a request is measured once and shared by every router that picks it), and
//! the table reports the mean latency speedup over f16, gate violations, latency per class,
//! the routing overhead per decision, the best gate-passing fixed mode and the routing
//! headroom (that mode's mean latency over the oracle's).

use std::collections::BTreeMap;
use std::time::Instant;

use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::Serialize;
use switchyard_request::{Mode, SamplingParams};
use switchyard_router::{
    fit, CellMeasure, Constraints, Decision, FitReport, FixedRouter, Gate, LearnedKind,
    LearnedRouter, ModeMatrix, ModeSet, Oracle, PrefixIndex, QualityMeasure, RequestFeatures,
    Router, RuleConfig, RulesRouter,
};

use switchyard_eval::quality::{self, McTask, Pick};
use switchyard_eval::stats::{mean_interval95, median, percentile};

use crate::bench::{workloads, ModesBenchOptions, ModesReport};
use crate::router_trace::{self, TraceClass, TraceOptions, TraceRow};
use crate::serve::{ModeAssets, ModeServer};
use crate::{ModesError, Result};

/// Requests drawn for training the learned routers, and for their held-out score.
pub const TRAIN_REQUESTS: usize = 400;
pub const HELD_OUT_REQUESTS: usize = 200;
/// Passes over the mixed requests whose decisions are timed: the mean and P99 of a router's
/// decision are taken over all of them, so one descheduling or the first, cold call does not
/// make the P99 (of 57 decisions, the P99 is their slowest). The first pass's decisions serve.
pub const DECISION_PASSES: usize = 50;

/// The matrix as the oracle reads it: cells by workload, latency, memory, accuracy points,
/// and each mode's quality against f16 (bits per byte, paired task intervals) for the gate.
/// A workload f16 tried and could not run (it did not fit) keeps the modes that ran, with
/// f16's error as the reason it has no baseline; one f16 never tried is left out.
pub fn matrix_of(report: &ModesReport) -> ModeMatrix {
    let mut m = ModeMatrix::default();
    let baseline = |w: &str| {
        report
            .cells
            .iter()
            .find(|c| c.workload == w && c.mode == Mode::F16)
    };
    for c in report.cells.iter().filter(|c| c.error.is_none()) {
        let Some(f16) = baseline(&c.workload) else {
            continue;
        };
        if let Some(why) = &f16.error {
            m.baseline_failed.insert(c.workload.clone(), why.clone());
        }
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
    for q in &report.quality {
        m.quality.insert(
            q.mode,
            QualityMeasure {
                bits_per_byte: q.bits_per_byte,
                bpb_bytes: q.bpb_bytes,
                tasks: q.paired.clone(),
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
    /// `fixed`, `rules`, `fitted`, `learned` or `oracle`.
    pub kind: String,
    pub requests: usize,
    pub mean_latency_s: f64,
    /// f16's mean latency over this router's (same requests).
    pub speedup_vs_f16: f64,
    /// Not measurable here unless the matrix holds energy.
    pub energy_ratio: Option<f64>,
    /// Mean over requests of the chosen mode's accuracy minus f16's (matrix points).
    pub accuracy_delta_points: Option<f64>,
    /// Requests routed to a mode that fails the quality gate or a constraint for their class
    /// and cell, or that fell back.
    pub constraint_violations: usize,
    pub fallbacks: usize,
    /// Mean time of the decision alone, microseconds, over [`DECISION_PASSES`] passes.
    pub routing_overhead_us: f64,
    /// 99th percentile of the decision's time, microseconds, over the same.
    pub routing_p99_us: f64,
    /// Held-out agreement with the oracle (learned routers).
    pub held_out_accuracy: Option<f64>,
    pub modes_chosen: BTreeMap<String, usize>,
    /// Per class of requests: (requests, mean, P50, P99 latency in seconds).
    pub by_class: BTreeMap<String, (usize, f64, f64, f64)>,
}

/// Whether a mode passes the gate, per class of the mixed workload.
#[derive(Debug, Clone, Serialize)]
pub struct GateRow {
    pub mode: Mode,
    pub bits_per_byte: Option<f64>,
    /// Bits per byte over f16's, minus one.
    pub bpb_increase: Option<f64>,
    /// Per task, against f16 on the same items.
    pub paired: BTreeMap<String, switchyard_router::PairedDelta>,
    /// Class → the reasons it fails there (empty: passes).
    pub classes: BTreeMap<String, Vec<String>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RouterReport {
    pub model: String,
    pub energy: String,
    pub rows: Vec<RouterRow>,
    pub constraints: Constraints,
    pub gate: Gate,
    pub gate_rows: Vec<GateRow>,
    pub fit: FitReport,
    /// The fastest fixed mode with no gate or constraint violation on this workload.
    pub best_fixed: Option<String>,
    /// Best gate-passing fixed mode's mean latency over the oracle's: what per-request routing
    /// can gain at most here.
    pub headroom: Option<f64>,
    /// Best gate-passing fixed mode's mean latency over the fitted router's.
    pub fitted_vs_best_fixed: Option<f64>,
    /// The same routers under a Poisson trace, every mode's engine loaded at once.
    pub trace: Option<TraceReport>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TraceReport {
    pub requests: usize,
    pub rate: f64,
    pub mix: Vec<(TraceClass, f64)>,
    /// Replays per router.
    pub repeats: usize,
    /// Every replay, round by round.
    pub rows: Vec<TraceRow>,
    /// Per router, over its replays.
    pub summary: Vec<ReplaySummary>,
    /// Speedups measured round by round (best fixed over fitted, over the oracle; oracle
    /// over fitted).
    pub paired: Vec<PairedSpeedup>,
    /// Fixed modes not replayed: they fail the gate for some request class, or were not
    /// asked for.
    pub skipped_fixed: Vec<String>,
    /// The fastest fixed mode (mean over its replays) with no violation or failure in any.
    pub best_fixed: Option<String>,
    /// Its mean latency over the oracle's (geometric mean over rounds).
    pub headroom: Option<f64>,
    /// Its mean latency over the fitted router's (geometric mean over rounds).
    pub fitted_vs_best_fixed: Option<f64>,
    /// The oracle's mean latency over the fitted router's (geometric mean over rounds).
    pub fitted_vs_oracle: Option<f64>,
}

/// One router's replays of the trace.
#[derive(Debug, Clone, Serialize)]
pub struct ReplaySummary {
    pub router: String,
    pub kind: String,
    /// Each replay's mean latency (seconds), round by round.
    pub means_s: Vec<f64>,
    /// Their mean, and its 95 % interval over replays (Student's t; two replays or more).
    pub mean_latency_s: f64,
    pub interval_s: Option<(f64, f64)>,
    /// Summed over replays.
    pub violations: usize,
    pub failed: usize,
}

/// `baseline`'s mean latency over `router`'s, taken in each round (both replayed the same
/// trace in it), so that drift between rounds cancels: above 1, `router` is faster.
#[derive(Debug, Clone, Serialize)]
pub struct PairedSpeedup {
    pub router: String,
    pub baseline: String,
    pub per_round: Vec<f64>,
    /// Per round, the requests the two routed to different modes.
    pub differing_decisions: Vec<usize>,
    /// Geometric mean over rounds, and its 95 % interval (t over the rounds' log ratios).
    pub geometric_mean: f64,
    pub interval: Option<(f64, f64)>,
}

/// Per router (in first-replay order), its replays summarized.
pub fn summarize_replays(rows: &[TraceRow]) -> Vec<ReplaySummary> {
    let mut out: Vec<ReplaySummary> = Vec::new();
    for r in rows {
        let i = match out.iter().position(|s| s.router == r.router) {
            Some(i) => i,
            None => {
                out.push(ReplaySummary {
                    router: r.router.clone(),
                    kind: r.kind.clone(),
                    means_s: Vec::new(),
                    mean_latency_s: f64::NAN,
                    interval_s: None,
                    violations: 0,
                    failed: 0,
                });
                out.len() - 1
            }
        };
        let s = &mut out[i];
        s.means_s.push(r.mean_latency_s);
        s.violations += r.violations;
        s.failed += r.failed;
    }
    for s in &mut out {
        s.mean_latency_s = s.means_s.iter().sum::<f64>() / s.means_s.len() as f64;
        s.interval_s = mean_interval95(&s.means_s).map(|(_, lo, hi)| (lo, hi));
    }
    out
}

/// `baseline`'s mean latency over `router`'s, round by round; `None` unless both replayed
/// in the same rounds.
pub fn paired_speedup(rows: &[TraceRow], router: &str, baseline: &str) -> Option<PairedSpeedup> {
    let of = |name: &str| -> BTreeMap<usize, &TraceRow> {
        rows.iter()
            .filter(|r| r.router == name)
            .map(|r| (r.replay, r))
            .collect()
    };
    let (a, b) = (of(router), of(baseline));
    if a.is_empty() || a.keys().ne(b.keys()) {
        return None;
    }
    let per_round: Vec<f64> = a
        .iter()
        .map(|(k, x)| b[k].mean_latency_s / x.mean_latency_s)
        .collect();
    let differing_decisions = a
        .iter()
        .map(|(k, x)| {
            x.decisions
                .iter()
                .zip(&b[k].decisions)
                .filter(|(p, q)| p != q)
                .count()
        })
        .collect();
    let logs: Vec<f64> = per_round.iter().map(|r| r.ln()).collect();
    let geometric_mean = (logs.iter().sum::<f64>() / logs.len() as f64).exp();
    Some(PairedSpeedup {
        router: router.to_string(),
        baseline: baseline.to_string(),
        per_round,
        differing_decisions,
        geometric_mean,
        interval: mean_interval95(&logs).map(|(_, lo, hi)| (lo.exp(), hi.exp())),
    })
}

/// The fastest fixed row with no violation, and the headroom and fitted ratios against it:
/// `(best, best / oracle, best / fitted)` in mean latency.
fn best_fixed_of<'r>(
    rows: impl Iterator<Item = (&'r str, &'r str, f64, bool)> + Clone,
) -> (Option<String>, Option<f64>, Option<f64>) {
    let best = rows
        .clone()
        .filter(|(_, kind, _, clean)| *kind == "fixed" && *clean)
        .min_by(|a, b| a.2.total_cmp(&b.2));
    let of = |k: &str| rows.clone().find(|(_, kind, ..)| *kind == k).map(|r| r.2);
    (
        best.map(|b| b.0.to_string()),
        best.zip(of("oracle")).map(|(b, o)| b.2 / o),
        best.zip(of("fitted")).map(|(b, f)| b.2 / f),
    )
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
        for p in &w.prompts {
            out.push(MixedRequest {
                features: RequestFeatures {
                    prompt_tokens: p.len(),
                    max_output_tokens: w.output_tokens,
                    expected_output_tokens: None,
                    shared_prefix_tokens: 0,
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
    // Quality-sensitive classes: GSM8K questions (long answers) and MMLU questions (one
    // token: the answer letter), labelled so routers and the gate see their class.
    let n = opts.requests;
    for item in quality::load_gsm8k(n, Pick::First)? {
        let prompt = assets.tokenizer.encode(&item.prompt, true, false)?;
        out.push(labelled(prompt, 128, "gsm8k"));
    }
    for item in quality::load_mc(McTask::Mmlu, n, Pick::Seeded(7))? {
        let prompt = assets.tokenizer.encode(&item.context, true, false)?;
        out.push(labelled(prompt, 1, "mmlu"));
    }
    // Shared prefixes as the server sees them: the block-aligned prefix an earlier request's
    // prompt already had (the shared-prefix workload's system prompt, GSM8K's 8 shots).
    let mut seen = PrefixIndex::default();
    for r in &mut out {
        r.features.shared_prefix_tokens = seen.observe_prompt(&r.prompt);
    }
    Ok(out)
}

fn labelled(prompt: Vec<u32>, output: usize, label: &str) -> MixedRequest {
    MixedRequest {
        features: RequestFeatures {
            prompt_tokens: prompt.len(),
            max_output_tokens: output,
            workload: Some(label.to_string()),
            ..RequestFeatures::default()
        },
        prompt,
        output,
    }
}

/// Runs every router over the same mixed requests: every fixed mode that loads, the paper's
/// rules, the rules `router fit` fits to the matrix under `gate`, the learned routers and the
/// oracle.
pub fn run(
    assets: &ModeAssets,
    matrix_report: &ModesReport,
    opts: &ModesBenchOptions,
    gate: &Gate,
    trace: Option<&TraceOptions>,
    save_routers: Option<&std::path::Path>,
    mut progress: impl FnMut(&str),
) -> Result<RouterReport> {
    let invalid = |e: switchyard_router::RouterError| ModesError::Invalid(e.to_string());
    let matrix = matrix_of(matrix_report);
    let constraints = Constraints::default();
    let oracle = Oracle::new(matrix.clone(), constraints.clone())
        .and_then(|o| o.with_gate(gate.clone()))
        .map_err(invalid)?;
    let fitted = fit(&matrix, &constraints, gate, RuleConfig::default()).map_err(invalid)?;
    let train = oracle.label(&random_features(TRAIN_REQUESTS, 1));
    let held = oracle.label(&random_features(HELD_OUT_REQUESTS, 2));

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

    // (label, kind, router, held-out agreement)
    type Entry = (String, &'static str, Box<dyn Router>, Option<f64>);
    let mut routers: Vec<Entry> = Vec::new();
    for &m in servers.keys() {
        routers.push((
            format!("fixed {m}"),
            "fixed",
            Box::new(FixedRouter::new(m)),
            None,
        ));
    }
    routers.push((
        "rules (the paper's priority order)".into(),
        "rules",
        Box::new(RulesRouter::default()),
        None,
    ));
    routers.push((
        "rules fitted to this matrix (router fit)".into(),
        "fitted",
        Box::new(RulesRouter::new(fitted.policy.clone())),
        None,
    ));
    for kind in LearnedKind::ALL {
        let r = LearnedRouter::train(kind, &train, 7).map_err(invalid)?;
        let acc = r.accuracy(&held);
        if let Some(dir) = save_routers {
            let path = dir.join(format!("{}.json", kind.name()));
            r.save(&path).map_err(invalid)?;
            progress(&format!("wrote {}", path.display()));
        }
        routers.push((r.name(), "learned", Box::new(r), Some(acc)));
    }
    routers.push(("oracle".into(), "oracle", Box::new(oracle.clone()), None));

    let classes: Vec<String> = requests
        .iter()
        .map(|r| oracle.class_for(&r.features))
        .collect();
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
    for (label, kind, router, held_out_accuracy) in &routers {
        progress(&format!("router {label}"));
        let mut decisions: Vec<Decision> = Vec::new();
        let mut each_us = Vec::with_capacity(DECISION_PASSES * requests.len());
        for pass in 0..DECISION_PASSES {
            for r in &requests {
                let t = Instant::now();
                let d = router.route_among(&r.features, available);
                each_us.push(1e6 * t.elapsed().as_secs_f64());
                if pass == 0 {
                    decisions.push(d);
                }
            }
        }
        let mut lat = Vec::new();
        let mut violations = 0;
        let mut chosen: BTreeMap<String, usize> = BTreeMap::new();
        let mut acc_delta = Vec::new();
        let mut per_class: BTreeMap<String, Vec<f64>> = BTreeMap::new();
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
            per_class.entry(classes[i].clone()).or_default().push(l);
            if let (Some(a), Some(b)) = (accuracy(d.mode), base_acc) {
                acc_delta.push(a - b);
            }
            if !oracle.admits_request(&r.features, d.mode) || d.fallback {
                violations += 1;
            }
        }
        let mean = lat.iter().sum::<f64>() / lat.len().max(1) as f64;
        rows.push(RouterRow {
            router: label.clone(),
            kind: kind.to_string(),
            requests: requests.len(),
            mean_latency_s: mean,
            speedup_vs_f16: f64::NAN,
            energy_ratio: None,
            accuracy_delta_points: (!acc_delta.is_empty())
                .then(|| acc_delta.iter().sum::<f64>() / acc_delta.len() as f64),
            constraint_violations: violations,
            fallbacks: decisions.iter().filter(|d| d.fallback).count(),
            routing_overhead_us: each_us.iter().sum::<f64>() / each_us.len().max(1) as f64,
            routing_p99_us: percentile(&each_us, 99.0),
            held_out_accuracy: *held_out_accuracy,
            modes_chosen: chosen,
            by_class: per_class
                .into_iter()
                .map(|(c, ls)| {
                    let m = ls.iter().sum::<f64>() / ls.len() as f64;
                    (c, (ls.len(), m, median(&ls), percentile(&ls, 99.0)))
                })
                .collect(),
        });
    }
    let f16_row = format!("fixed {}", Mode::F16);
    let f16 = rows
        .iter()
        .find(|r| r.router == f16_row)
        .map_or(f64::NAN, |r| r.mean_latency_s);
    for r in &mut rows {
        r.speedup_vs_f16 = f16 / r.mean_latency_s;
    }
    let (best_fixed, headroom, fitted_vs_best_fixed) = best_fixed_of(rows.iter().map(|r| {
        (
            r.router.as_str(),
            r.kind.as_str(),
            r.mean_latency_s,
            r.constraint_violations == 0,
        )
    }));
    let trace = match trace {
        Some(t) if t.requests > 0 => {
            t.validate()?;
            progress(&format!(
                "trace: {} requests at {} per second",
                t.requests, t.rate
            ));
            let reqs = router_trace::build(assets, t)?;
            let mut engines = BTreeMap::new();
            for (m, s) in std::mem::take(&mut servers) {
                engines.insert(m, s.into_handle(assets, opts.budget)?);
            }
            // A fixed mode that fails the gate for some request of the one-at-a-time table
            // cannot be the best fixed mode: it is not replayed (the classes are the same).
            // Or, when the caller names the fixed modes to replay, every other one.
            let named = |r: &RouterRow| {
                t.fixed.is_empty() || t.fixed.iter().any(|m| r.router == format!("fixed {m}"))
            };
            let skipped_fixed: Vec<String> = rows
                .iter()
                .filter(|r| r.kind == "fixed" && (r.constraint_violations > 0 || !named(r)))
                .map(|r| r.router.clone())
                .collect();
            let chosen: Vec<&Entry> = routers
                .iter()
                .filter(|(label, kind, ..)| !skipped_fixed.contains(label) && t.replays_kind(kind))
                .collect();
            let mut trace_rows = Vec::new();
            for round in 0..t.repeats {
                for i in 0..chosen.len() {
                    let (label, kind, router, _) = chosen[(i + round) % chosen.len()];
                    progress(&format!(
                        "trace: replay {}/{}: router {label}",
                        round + 1,
                        t.repeats
                    ));
                    let mut row = router_trace::replay(
                        &reqs,
                        label,
                        kind,
                        router.as_ref(),
                        &engines,
                        &oracle,
                    )?;
                    row.replay = round;
                    progress(&format!(
                        "trace: {label}: mean {:.3} s, P99 {:.3} s, {} violations, {} failed",
                        row.mean_latency_s, row.p99_latency_s, row.violations, row.failed
                    ));
                    trace_rows.push(row);
                }
            }
            let summary = summarize_replays(&trace_rows);
            let (best, ..) = best_fixed_of(summary.iter().map(|s| {
                (
                    s.router.as_str(),
                    s.kind.as_str(),
                    s.mean_latency_s,
                    s.violations == 0 && s.failed == 0,
                )
            }));
            let name_of = |kind: &str| {
                summary
                    .iter()
                    .find(|s| s.kind == kind)
                    .map(|s| s.router.clone())
            };
            let (fitted, oracle_name) = (name_of("fitted"), name_of("oracle"));
            let pair = |r: &Option<String>, b: &Option<String>| -> Option<PairedSpeedup> {
                paired_speedup(&trace_rows, r.as_deref()?, b.as_deref()?)
            };
            let fitted_vs_best = pair(&fitted, &best);
            let oracle_vs_best = pair(&oracle_name, &best);
            let fitted_vs_oracle = pair(&fitted, &oracle_name);
            let geo = |p: &Option<PairedSpeedup>| p.as_ref().map(|p| p.geometric_mean);
            Some(TraceReport {
                requests: reqs.len(),
                rate: t.rate,
                mix: t.mix.clone(),
                repeats: t.repeats,
                headroom: geo(&oracle_vs_best),
                fitted_vs_best_fixed: geo(&fitted_vs_best),
                fitted_vs_oracle: geo(&fitted_vs_oracle),
                paired: [fitted_vs_best, oracle_vs_best, fitted_vs_oracle]
                    .into_iter()
                    .flatten()
                    .collect(),
                rows: trace_rows,
                summary,
                skipped_fixed,
                best_fixed: best,
            })
        }
        _ => None,
    };
    let mut class_names: Vec<String> = classes.clone();
    class_names.sort();
    class_names.dedup();
    let gate_rows = matrix
        .quality
        .iter()
        .map(|(&mode, q)| GateRow {
            mode,
            bits_per_byte: q.bits_per_byte,
            bpb_increase: q
                .bits_per_byte
                .zip(matrix.quality.get(&Mode::F16).and_then(|b| b.bits_per_byte))
                .map(|(x, b)| x / b - 1.0),
            paired: q.tasks.clone(),
            classes: class_names
                .iter()
                .map(|c| {
                    let why = gate
                        .failures(&matrix.quality, mode, c)
                        .iter()
                        .map(ToString::to_string)
                        .collect();
                    (c.clone(), why)
                })
                .collect(),
        })
        .collect();
    Ok(RouterReport {
        model: assets.name.clone(),
        energy: matrix_report.energy.clone(),
        rows,
        constraints,
        gate: gate.clone(),
        gate_rows,
        fit: fitted,
        best_fixed,
        headroom,
        fitted_vs_best_fixed,
        trace,
    })
}

impl RouterReport {
    pub fn markdown(&self) -> String {
        let mut md = format!(
            "# Router table: {}\n\nEnergy: {}.\n\nQuality gate: bits per byte at most +{:.1} % over f16, and on the tasks that stand for a request's class the lower end of the paired 95 % interval above −{} points. A violation is a request served in a mode that fails the gate (or a constraint) for its class. Routing: each decision timed alone, mean and P99 over {} passes over the requests.\n\n| router | requests | mean latency (s) | speedup vs f16 | accuracy Δ (points) | gate violations | fallbacks | routing mean / P99 (µs) | held-out agreement with the oracle | modes chosen |\n|---|---|---|---|---|---|---|---|---|---|\n",
            self.model,
            self.energy,
            100.0 * self.gate.max_bpb_increase,
            self.gate.max_accuracy_drop_points,
            DECISION_PASSES,
        );
        for r in &self.rows {
            md.push_str(&format!(
                "| {} | {} | {:.3} | {:.2}x | {} | {} | {} | {:.2} / {:.2} | {} | {} |\n",
                r.router,
                r.requests,
                r.mean_latency_s,
                r.speedup_vs_f16,
                r.accuracy_delta_points
                    .map_or("—".into(), |a| format!("{a:+.2}")),
                r.constraint_violations,
                r.fallbacks,
                r.routing_overhead_us,
                r.routing_p99_us,
                r.held_out_accuracy
                    .map_or("—".into(), |a| format!("{:.1}%", 100.0 * a)),
                r.modes_chosen
                    .iter()
                    .map(|(m, n)| format!("{m} {n}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            ));
        }
        md.push('\n');
        match (&self.best_fixed, self.headroom) {
            (Some(best), Some(h)) => {
                md.push_str(&format!(
                    "Best fixed mode with no gate violation: **{best}**. Routing headroom (its mean latency over the oracle's): **{h:.3}x**.",
                ));
                if let Some(f) = self.fitted_vs_best_fixed {
                    md.push_str(&format!(" The fitted router runs at **{f:.3}x** it."));
                }
                if h < 1.05 {
                    md.push_str(" The headroom is below 1.05x: on this machine and model, per-request routing cannot pay over serving every request in that one mode.");
                }
                md.push('\n');
            }
            _ => md.push_str(
                "No fixed mode served the whole workload without a gate violation (f16 was not loaded).\n",
            ),
        }
        if let Some(t) = &self.trace {
            md.push_str(&t.markdown());
        }
        md.push_str(
            "\n## Latency per class, one request at a time (mean / P50 / P99, seconds)\n\n",
        );
        md.push_str(&class_table(
            self.rows.iter().map(|r| (r.router.as_str(), &r.by_class)),
        ));
        md.push_str(&self.paired_table());
        md.push_str("\n## The gate per mode and class\n\n| mode | bits per byte |");
        let gate_classes: Vec<&String> = self
            .gate_rows
            .first()
            .map(|g| g.classes.keys().collect())
            .unwrap_or_default();
        for c in &gate_classes {
            md.push_str(&format!(" {c} |"));
        }
        md.push_str("\n|---|---|");
        md.push_str(&"---|".repeat(gate_classes.len()));
        md.push('\n');
        for g in &self.gate_rows {
            md.push_str(&format!(
                "| {} | {} |",
                g.mode,
                g.bits_per_byte.map_or("—".into(), |b| format!("{b:.4}"))
            ));
            for c in &gate_classes {
                let why = &g.classes[*c];
                if why.is_empty() {
                    md.push_str(" pass |");
                } else {
                    md.push_str(&format!(" fail: {} |", why.join("; ")));
                }
            }
            md.push('\n');
        }
        md.push_str("\n## The fitted policy (`switchyard router fit` on the same matrix)\n\n");
        md.push_str(&self.fit.markdown());
        md
    }
}

impl RouterReport {
    /// Each mode against f16 on the same items: the paired interval and McNemar's test per
    /// task, and bits per byte.
    fn paired_table(&self) -> String {
        let tasks: Vec<&String> = self
            .gate_rows
            .iter()
            .flat_map(|g| g.paired.keys())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let mut md = String::from("\n## Quality against f16 on the same text and items\n\nPer task: accuracy Δ (points) [paired 95 % interval], McNemar's exact p (items only the mode / only f16 answered correctly).\n\n| mode | bits per byte (vs f16) |");
        for t in &tasks {
            md.push_str(&format!(" {t} |"));
        }
        md.push_str("\n|---|---|");
        md.push_str(&"---|".repeat(tasks.len()));
        md.push('\n');
        for g in &self.gate_rows {
            md.push_str(&format!(
                "| {} | {} |",
                g.mode,
                match (g.bits_per_byte, g.bpb_increase) {
                    (Some(b), Some(i)) => format!("{b:.4} ({:+.2} %)", 100.0 * i),
                    (Some(b), None) => format!("{b:.4}"),
                    _ => "—".into(),
                }
            ));
            for t in &tasks {
                match g.paired.get(*t) {
                    Some(d) => md.push_str(&format!(
                        " {:+.1} [{:+.1}, {:+.1}], p {:.3} ({}/{}), n {} |",
                        d.delta_points,
                        d.lo_points,
                        d.hi_points,
                        d.mcnemar_p,
                        d.only_mode,
                        d.only_baseline,
                        d.n
                    )),
                    None => md.push_str(" — |"),
                }
            }
            md.push('\n');
        }
        md
    }
}

/// An interval as `[lo, hi]` to three decimals; empty for none.
fn bracketed(interval: Option<(f64, f64)>) -> String {
    interval.map_or(String::new(), |(lo, hi)| format!("[{lo:.3}, {hi:.3}]"))
}

/// `xs` formatted by `f`, comma-separated.
fn joined<T>(xs: &[T], f: impl FnMut(&T) -> String) -> String {
    xs.iter().map(f).collect::<Vec<_>>().join(", ")
}

/// Latency per class, (requests, mean, P50, P99) per row: a Markdown table with the classes
/// of the first row as columns.
fn class_table<'r>(
    rows: impl Iterator<Item = (&'r str, &'r BTreeMap<String, (usize, f64, f64, f64)>)> + Clone,
) -> String {
    let classes: Vec<(&String, usize)> = rows
        .clone()
        .next()
        .map(|(_, by)| by.iter().map(|(c, v)| (c, v.0)).collect())
        .unwrap_or_default();
    let mut md = String::from("| router |");
    for (c, n) in &classes {
        md.push_str(&format!(" {c} ({n}) |"));
    }
    md.push_str("\n|---|");
    md.push_str(&"---|".repeat(classes.len()));
    md.push('\n');
    for (router, by) in rows {
        md.push_str(&format!("| {router} |"));
        for (c, _) in &classes {
            match by.get(*c) {
                Some((_, mean, p50, p99)) => {
                    md.push_str(&format!(" {mean:.3} / {p50:.3} / {p99:.3} |"))
                }
                None => md.push_str(" — |"),
            }
        }
        md.push('\n');
    }
    md
}

impl TraceReport {
    pub fn markdown(&self) -> String {
        let mix = self
            .mix
            .iter()
            .map(|(c, w)| format!("{}={w}", c.name()))
            .collect::<Vec<_>>()
            .join(", ");
        let skipped = if self.skipped_fixed.is_empty() {
            String::new()
        } else {
            format!(
                " Fixed modes not replayed (they fail the gate for some class of the table above, or were not asked for with --trace-fixed): {}.",
                self.skipped_fixed.join(", ")
            )
        };
        let repeats = if self.repeats > 1 {
            format!(
                " Each router replayed the trace {} times, in rounds: every round replays each router once, the order rotated by one per round.",
                self.repeats
            )
        } else {
            String::new()
        };
        let mut md = format!(
            "\n## Under traffic: {} requests, Poisson arrivals at {} per second ({mix})\n\nEvery mode's engine loaded at once; each request routed at its arrival (queue depth: requests then in flight) and served in its mode's engine.{skipped}{repeats}\n\n| router | replay | mean latency (s) | P50 (s) | P99 (s) | mean TTFT (s) | output tok/s | gate violations | failed | most in flight | modes chosen |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
            self.requests, self.rate
        );
        for r in &self.rows {
            md.push_str(&format!(
                "| {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.1} | {} | {} | {} | {} |\n",
                r.router,
                r.replay + 1,
                r.mean_latency_s,
                r.p50_latency_s,
                r.p99_latency_s,
                r.mean_ttft_s,
                r.output_tokens_per_s,
                r.violations,
                r.failed,
                r.max_in_flight,
                r.modes_chosen
                    .iter()
                    .map(|(m, n)| format!("{m} {n}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            ));
        }
        if self.repeats > 1 {
            md.push_str("\nOver the replays (the mean of their mean latencies, its 95 % interval by Student's t over replays):\n\n| router | replays | mean latency (s) [95 %] | each replay (s) | violations | failed |\n|---|---|---|---|---|---|\n");
            for s in &self.summary {
                md.push_str(&format!(
                    "| {} | {} | {:.3} {} | {} | {} | {} |\n",
                    s.router,
                    s.means_s.len(),
                    s.mean_latency_s,
                    bracketed(s.interval_s),
                    joined(&s.means_s, |m| format!("{m:.3}")),
                    s.violations,
                    s.failed,
                ));
            }
        }
        if !self.paired.is_empty() {
            md.push_str("\nSpeedups taken round by round (the baseline's mean latency over the router's in the same round; geometric mean over rounds, its 95 % interval by t over the log ratios):\n\n| router | over | geometric mean [95 %] | per round | requests routed differently, per round |\n|---|---|---|---|---|\n");
            for p in &self.paired {
                md.push_str(&format!(
                    "| {} | {} | {:.3}x {} | {} | {} |\n",
                    p.router,
                    p.baseline,
                    p.geometric_mean,
                    bracketed(p.interval),
                    joined(&p.per_round, |r| format!("{r:.3}")),
                    joined(&p.differing_decisions, ToString::to_string),
                ));
            }
        }
        match (&self.best_fixed, self.headroom) {
            (Some(best), Some(h)) => {
                md.push_str(&format!(
                    "\nBest fixed mode with no gate violation under traffic: **{best}**. Headroom (its mean latency over the oracle's): **{h:.3}x**."
                ));
                if let Some(f) = self.fitted_vs_best_fixed {
                    md.push_str(&format!(" The fitted router runs at **{f:.3}x** it."));
                }
                if let Some(o) = self.fitted_vs_oracle {
                    md.push_str(&format!(" It runs at **{o:.3}x** the oracle."));
                }
                if h < 1.05 {
                    md.push_str(" Below 1.05x: under this traffic, per-request routing cannot pay over that one mode.");
                }
                md.push('\n');
            }
            (Some(best), None) => md.push_str(&format!(
                "\nBest fixed mode with no gate violation under traffic: **{best}** (the oracle was not replayed).\n"
            )),
            _ => md.push_str("\nNo fixed mode served the trace without a gate violation.\n"),
        }
        md.push_str("\nPer class (mean / P50 / P99 latency, seconds):\n\n");
        let labels: Vec<String> = self
            .rows
            .iter()
            .map(|r| {
                if self.repeats > 1 {
                    format!("{} (replay {})", r.router, r.replay + 1)
                } else {
                    r.router.clone()
                }
            })
            .collect();
        md.push_str(&class_table(
            labels
                .iter()
                .zip(&self.rows)
                .map(|(l, r)| (l.as_str(), &r.by_class)),
        ));
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

    fn row(router: &str, kind: &str, replay: usize, mean: f64, violations: usize) -> TraceRow {
        let mut decisions = vec![Mode::Int8; 4];
        if kind == "fixed" {
            decisions[3] = Mode::ContinuousBatching;
        }
        TraceRow {
            decisions,
            router: router.into(),
            kind: kind.into(),
            replay,
            requests: 10,
            failed: 0,
            mean_latency_s: mean,
            p50_latency_s: mean,
            p99_latency_s: mean,
            mean_ttft_s: 0.0,
            output_tokens_per_s: 0.0,
            duration_s: 0.0,
            violations,
            modes_chosen: BTreeMap::new(),
            by_class: BTreeMap::new(),
            max_in_flight: 0,
        }
    }

    #[test]
    fn replays_summarize_and_pair_round_by_round() {
        // Three rounds; the machine slows down by half in round 2, for both routers.
        let rows = vec![
            row("fixed cb", "fixed", 0, 6.0, 0),
            row("fitted", "fitted", 0, 2.0, 0),
            row("fitted", "fitted", 1, 3.0, 1),
            row("fixed cb", "fixed", 1, 9.0, 0),
            row("fixed cb", "fixed", 2, 6.0, 0),
            row("fitted", "fitted", 2, 2.4, 0),
        ];
        let s = summarize_replays(&rows);
        assert_eq!(s.len(), 2);
        assert_eq!(
            (s[0].router.as_str(), s[0].means_s.clone()),
            ("fixed cb", vec![6.0, 9.0, 6.0])
        );
        assert_eq!(s[0].mean_latency_s, 7.0);
        // Sample variance 3, n 3: half width 4.303 · 1 = 4.303.
        let (lo, hi) = s[0].interval_s.unwrap();
        assert!(
            (lo - 2.697).abs() < 1e-9 && (hi - 11.303).abs() < 1e-9,
            "{lo} {hi}"
        );
        assert_eq!((s[1].violations, s[1].failed), (1, 0));

        // Per round 3, 3, 2.5: the drift cancels within a round.
        let p = paired_speedup(&rows, "fitted", "fixed cb").unwrap();
        assert_eq!(p.per_round, vec![3.0, 3.0, 2.5]);
        assert_eq!(p.differing_decisions, vec![1, 1, 1]);
        let want = (3.0f64.ln() * 2.0 + 2.5f64.ln()) / 3.0;
        assert!((p.geometric_mean - want.exp()).abs() < 1e-12);
        let (lo, hi) = p.interval.unwrap();
        // Reference (python3): exp(mean ± 4.303 · sd / √3) of the log ratios.
        assert!(
            (lo - 2.173_478).abs() < 1e-5 && (hi - 3.666_906).abs() < 1e-5,
            "{lo} {hi}"
        );
        // Rounds that do not match, or an unknown router: no pairing.
        assert!(paired_speedup(&rows[..3], "fitted", "fixed cb").is_none());
        assert!(paired_speedup(&rows, "oracle", "fixed cb").is_none());
    }
}
