//! `bench helios --trace drift`: traffic that changes domain, served by every candidate alone
//! and by HELIOS (shadow, and serial when asked), each from one run over the same trace.
//!
//! The trace has three phases: English prose from ShareGPT first exchanges, then code, then
//! prose again. The code phase is HumanEval by default (each problem's prompt to complete,
//! its canonical solution as the reference answer), or ShareGPT prompts carrying code
//! ([`switchyard_eval::sharegpt::prompt_kind`] tells them apart). Requests arrive by a
//! Poisson process at a fixed rate (a seeded exponential gap between arrivals), the same
//! times for every system.
//!
//! Quality is measured, not inferred: every request's reference answer (the dataset's next
//! turn, HumanEval's canonical solution) is scored after its prompt by teacher forcing,
//! under every candidate at every depth, once; a system's quality in a phase is the bits per
//! byte of its phase's answers under the model and depth that served each request. HumanEval
//! completions are also executed against the problem's tests: pass@1, greedy. The hindsight oracle takes, per
//! phase, the fastest static candidate whose quality there is within the SLO's bound of the
//! best static candidate's (the best static one without a bound).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand_distr::{Distribution, Exp};
use serde::Serialize;
use switchyard_eval::quality::{load_humaneval, run_tests, HumanEvalItem, Isolation, Pick};
use switchyard_eval::sharegpt::{exchanges_of_kind, PromptKind};

use super::systems::{run_helios, run_vanilla};
use super::{
    serial_policy, BenchCandidate, HeliosBenchContext, HeliosBenchOptions, Job, SystemReport,
};
use crate::orchestrator::ShadowRound;
use crate::policy::Evaluation;
use crate::shadow::{ScoreSettings, ShadowText, Throttle};
use crate::{HeliosError, Result};

/// Requests per phase by default.
pub const DEFAULT_PER_PHASE: usize = 24;
/// Prompt sizes kept (bytes): long enough to score, short enough for a small machine.
pub const PROMPT_BYTES: std::ops::RangeInclusive<usize> = 200..=1000;

#[derive(Debug, Clone)]
pub struct DriftOptions {
    pub per_phase: usize,
    /// Requests per second of the Poisson process.
    pub request_rate: f64,
    pub seed: u64,
    /// Output tokens per request (prose; code requests take `code_max_tokens`).
    pub max_tokens: usize,
    pub code: CodeSource,
    /// Output tokens of a HumanEval request; its completion is cut at the first
    /// end-of-generation token and HumanEval's stop sequences.
    pub code_max_tokens: usize,
}

/// Where the code phase's prompts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CodeSource {
    /// HumanEval problems, completed and executed against their tests.
    HumanEval,
    /// ShareGPT first exchanges whose prompt carries code.
    ShareGpt,
}

/// One phase of one system.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseRow {
    pub phase: String,
    pub requests: usize,
    pub output_tokens: usize,
    /// From the phase's first arrival to its last finish.
    pub duration_s: f64,
    pub output_tokens_per_s: f64,
    /// Bits per byte of the phase's reference answers under the serving model and depth.
    pub reference_bits_per_byte: f64,
    /// Requests served by each model.
    pub served_by: BTreeMap<String, usize>,
    /// HumanEval problems whose completion passed its tests, and pass@1 (code phase only).
    pub passed: Option<usize>,
    pub pass_at_1: Option<f64>,
}

/// One system over the drift trace.
#[derive(Debug, Clone, Serialize)]
pub struct DriftSystem {
    pub system: String,
    pub report: SystemReport,
    pub phases: Vec<PhaseRow>,
    /// `(model, depth)` that served each request, in trace order.
    pub served: Vec<(String, usize)>,
    /// Each HumanEval request's outcome, by request index: its completion passed its tests.
    pub passed: BTreeMap<usize, bool>,
}

/// The hindsight oracle: per phase, the static candidate it would have run.
#[derive(Debug, Clone, Serialize)]
pub struct OracleRow {
    pub phase: String,
    pub model: String,
    pub output_tokens_per_s: f64,
    pub reference_bits_per_byte: f64,
    pub pass_at_1: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct DriftReport {
    pub dataset: String,
    pub per_phase: usize,
    pub request_rate: f64,
    pub seed: u64,
    pub max_tokens: usize,
    pub memory_budget_bytes: u64,
    pub max_bits_per_byte_increase: Option<f64>,
    pub code: CodeSource,
    pub code_max_tokens: usize,
    /// How HumanEval's tests ran (with or without a network of their own).
    pub test_isolation: Option<Isolation>,
    pub phases: Vec<String>,
    pub statics: Vec<DriftSystem>,
    pub helios: DriftSystem,
    pub helios_serial: Option<DriftSystem>,
    pub oracle: Vec<OracleRow>,
    /// Σ oracle tokens over Σ oracle phase durations.
    pub oracle_output_tokens_per_s: f64,
    pub helios_vs_oracle_throughput: f64,
    /// Per phase, the static candidates both faster and better than HELIOS there (empty:
    /// HELIOS is on the Pareto front of that phase).
    pub dominating_statics: Vec<(String, Vec<String>)>,
    pub shadow_rounds: Vec<ShadowRound>,
    pub seconds: f64,
}

/// One answer's bytes and its nats at each scored depth.
type AnswerNats = (u64, Vec<(usize, f64)>);

/// Reference answers' nats per candidate, request and depth.
struct ReferenceTable {
    /// `[candidate][request]`.
    nats: BTreeMap<String, Vec<AnswerNats>>,
}

impl ReferenceTable {
    fn score(
        candidates: &[BenchCandidate],
        texts: &[ShadowText],
        on: &mut dyn FnMut(&str),
    ) -> Result<Self> {
        let settings = ScoreSettings {
            threshold: 1.0,
            measure: switchyard_exits::ConfidenceMeasure::MaxProb,
            max_text_bytes: 2048,
            // The quality of what was served: every position at every depth.
            exit_stride: 1,
        };
        let mut nats = BTreeMap::new();
        for c in candidates {
            on(&format!("scoring reference answers under {}", c.entry.name));
            let mut scorer = c.scorer()?;
            let mut throttle = Throttle::new(1.0);
            let rows = texts
                .iter()
                .map(|t| {
                    let s = scorer.score(std::slice::from_ref(t), &settings, &mut throttle)?;
                    Ok((s.reference.bytes, s.reference.nats))
                })
                .collect::<Result<Vec<_>>>()?;
            nats.insert(c.entry.name.clone(), rows);
        }
        Ok(Self { nats })
    }

    /// `(bytes, nats)` of request `i`'s answer under `model` at `depth` (the nearest scored
    /// depth at or above it).
    fn get(&self, model: &str, i: usize, depth: usize) -> Option<(u64, f64)> {
        let (bytes, by_depth) = self.nats.get(model)?.get(i)?;
        let (_, n) = by_depth
            .iter()
            .find(|(d, _)| *d >= depth)
            .or(by_depth.last())?;
        Some((*bytes, *n))
    }
}

/// The trace: `per_phase` prose, code, prose requests and Poisson arrival times, each
/// request's phase, and the HumanEval problem behind each code request.
type Trace = (Vec<Job>, Vec<usize>, BTreeMap<usize, HumanEvalItem>);

fn drift_trace(ctx: &HeliosBenchContext<'_>, d: &DriftOptions) -> Result<Trace> {
    let data = switchyard_zoo::ensure(ctx.dataset)?;
    let prose = exchanges_of_kind(
        &data,
        PromptKind::Prose,
        2 * d.per_phase,
        PROMPT_BYTES,
        d.seed,
    )?;
    // Each code request: prompt, reference answer, and its HumanEval problem.
    let code: Vec<(String, String, Option<HumanEvalItem>)> = match d.code {
        CodeSource::HumanEval => load_humaneval(d.per_phase, Pick::Seeded(d.seed))?
            .into_iter()
            .map(|it| (it.prompt.clone(), it.canonical_solution.clone(), Some(it)))
            .collect(),
        CodeSource::ShareGpt => {
            exchanges_of_kind(&data, PromptKind::Code, d.per_phase, PROMPT_BYTES, d.seed)?
                .into_iter()
                .map(|(p, a)| (p, a, None))
                .collect()
        }
    };
    if prose.len() < 2 * d.per_phase || code.len() < d.per_phase {
        return Err(HeliosError::Config(format!(
            "the trace needs {} prose and {} code prompts; {} prose ({PROMPT_BYTES:?} bytes) and \
             {} code prompts were found",
            2 * d.per_phase,
            d.per_phase,
            prose.len(),
            code.len(),
        )));
    }
    let tok = &ctx.candidates[0].tokenizer;
    let mut rng = rand::rngs::StdRng::seed_from_u64(d.seed);
    // Exponential gaps between arrivals: a Poisson process of `request_rate` per second.
    let gap = Exp::new(d.request_rate)
        .map_err(|e| HeliosError::Config(format!("request rate {}: {e}", d.request_rate)))?;
    let mut t = 0.0;
    let mut jobs = Vec::new();
    let mut phase_of = Vec::new();
    let mut problems = BTreeMap::new();
    let as_code = |(p, a): &(String, String)| (p.clone(), a.clone(), None);
    let phases: [Vec<(String, String, Option<HumanEvalItem>)>; 3] = [
        prose[..d.per_phase].iter().map(as_code).collect(),
        code,
        prose[d.per_phase..].iter().map(as_code).collect(),
    ];
    for (p, items) in phases.into_iter().enumerate() {
        for (prompt, answer, problem) in items {
            let humaneval = problem.is_some();
            if let Some(it) = problem {
                problems.insert(jobs.len(), it);
            }
            jobs.push(Job {
                prompt: tok.encode(&prompt, true, false)?,
                text: prompt,
                output_len: if humaneval {
                    d.code_max_tokens
                } else {
                    d.max_tokens
                },
                reference: Some(answer),
                arrival_s: t,
            });
            phase_of.push(p);
            t += gap.sample(&mut rng);
        }
    }
    Ok((jobs, phase_of, problems))
}

/// Pass or fail of each HumanEval request's completion, by request index.
type Passes = BTreeMap<usize, bool>;

/// Executes the HumanEval completions of `report` (decoded with the serving model's
/// tokenizer) against their problems' tests.
fn humaneval_passes(
    report: &SystemReport,
    problems: &BTreeMap<usize, HumanEvalItem>,
    ctx: &HeliosBenchContext<'_>,
    isolation: Isolation,
) -> Result<Passes> {
    let mut out = BTreeMap::new();
    for (&i, item) in problems {
        let r = &report.per_request[i];
        let tok = &ctx
            .candidates
            .iter()
            .find(|c| c.entry.name == r.model)
            .ok_or_else(|| HeliosError::Config(format!("{} served but is no candidate", r.model)))?
            .tokenizer;
        // Every request generates its whole length (the same work for every system): the
        // completion is what came before the first end-of-generation token.
        let eog = switchyard_engine::end_of_generation_tokens(tok);
        let end = r
            .token_ids
            .iter()
            .position(|t| eog.contains(t))
            .unwrap_or(r.token_ids.len());
        let completion = tok.decode(&r.token_ids[..end], true)?;
        let outcome = run_tests(item, &completion, isolation)?;
        out.insert(i, outcome.passed());
    }
    Ok(out)
}

const PHASES: [&str; 3] = ["prose", "code", "prose again"];

fn phase_rows(
    report: &SystemReport,
    served: &[(String, usize)],
    phase_of: &[usize],
    refs: &ReferenceTable,
    passes: &Passes,
) -> Vec<PhaseRow> {
    (0..PHASES.len())
        .map(|p| {
            let idx: Vec<usize> = (0..phase_of.len()).filter(|&i| phase_of[i] == p).collect();
            let recs: Vec<_> = idx.iter().map(|&i| &report.per_request[i]).collect();
            let tokens: usize = recs.iter().map(|r| r.output_tokens).sum();
            let start = recs
                .iter()
                .map(|r| r.arrival_s)
                .fold(f64::INFINITY, f64::min);
            let end = recs.iter().map(|r| r.finished_s).fold(0.0, f64::max);
            let (mut bytes, mut nats) = (0u64, 0f64);
            let mut by = BTreeMap::new();
            for &i in &idx {
                let (m, d) = &served[i];
                *by.entry(m.clone()).or_insert(0) += 1;
                if let Some((b, n)) = refs.get(m, i, *d) {
                    bytes += b;
                    nats += n;
                }
            }
            let duration = (end - start).max(f64::MIN_POSITIVE);
            let tested: Vec<bool> = idx.iter().filter_map(|i| passes.get(i).copied()).collect();
            let passed = (!tested.is_empty()).then(|| tested.iter().filter(|&&p| p).count());
            PhaseRow {
                passed,
                pass_at_1: passed.map(|n| n as f64 / tested.len() as f64),
                phase: PHASES[p].to_string(),
                requests: idx.len(),
                output_tokens: tokens,
                duration_s: duration,
                output_tokens_per_s: tokens as f64 / duration,
                reference_bits_per_byte: nats / std::f64::consts::LN_2 / bytes.max(1) as f64,
                served_by: by,
            }
        })
        .collect()
}

/// The most common depth of a request's tokens (its serving depth).
fn serving_depth(depths: &[usize]) -> usize {
    let mut count: BTreeMap<usize, usize> = BTreeMap::new();
    for &d in depths {
        *count.entry(d).or_default() += 1;
    }
    count
        .into_iter()
        .max_by_key(|&(d, n)| (n, d))
        .map_or(0, |(d, _)| d)
}

fn drift_system(
    report: SystemReport,
    phase_of: &[usize],
    refs: &ReferenceTable,
    passes: &Passes,
    layers: &dyn Fn(&str) -> usize,
) -> DriftSystem {
    let served: Vec<(String, usize)> = report
        .per_request
        .iter()
        .map(|r| {
            let d = serving_depth(&r.depths);
            (r.model.clone(), if d == 0 { layers(&r.model) } else { d })
        })
        .collect();
    DriftSystem {
        system: report.system.clone(),
        phases: phase_rows(&report, &served, phase_of, refs, passes),
        served,
        passed: passes.clone(),
        report,
    }
}

/// Runs the drift trace. `ctx.sample` is not used: the trace is built from the dataset.
pub fn run_drift(
    ctx: &HeliosBenchContext<'_>,
    opts: &HeliosBenchOptions,
    d: &DriftOptions,
    mut on_phase: impl FnMut(&str),
) -> Result<DriftReport> {
    let t0 = std::time::Instant::now();
    opts.policy.validate()?;
    opts.slo.validate()?;
    if !(d.request_rate > 0.0 && d.request_rate.is_finite()) || d.per_phase == 0 {
        return Err(HeliosError::Config(format!(
            "the drift trace needs a positive request rate and phase length (got {} and {})",
            d.request_rate, d.per_phase
        )));
    }
    let (jobs, phase_of, problems) = drift_trace(ctx, d)?;
    let isolation = (!problems.is_empty()).then(Isolation::detect);
    let passes = |r: &SystemReport| match isolation {
        Some(iso) => humaneval_passes(r, &problems, ctx, iso),
        None => Ok(Passes::new()),
    };
    let texts: Vec<ShadowText> = jobs
        .iter()
        .map(|j| ShadowText {
            prompt: j.text.clone(),
            reference: j.reference.clone(),
        })
        .collect();
    let refs = ReferenceTable::score(ctx.candidates, &texts, &mut on_phase)?;
    let layers = |m: &str| ctx.repo.get(m).map_or(0, |e| e.layers);

    let mut statics = Vec::new();
    for c in ctx.candidates {
        on_phase(&format!(
            "static {} (full depth, whole budget)",
            c.entry.name
        ));
        // Each candidate reads the prompts in its own tokens, as HELIOS hands them to it.
        let own = jobs
            .iter()
            .map(|j| {
                Ok(Job {
                    prompt: c.tokenizer.encode(&j.text, true, true)?,
                    ..j.clone()
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut r = run_vanilla(c, &own, opts)?;
        r.system = format!("static {}", c.entry.name);
        let p = passes(&r)?;
        statics.push(drift_system(r, &phase_of, &refs, &p, &layers));
    }
    on_phase(&format!("HELIOS ({:?} evaluation)", opts.policy.evaluation));
    let (h, _, shadow_rounds) = run_helios(ctx, &jobs, opts, &opts.policy)?;
    let p = passes(&h)?;
    let helios = drift_system(h, &phase_of, &refs, &p, &layers);
    let helios_serial = if opts.serial && opts.policy.evaluation != Evaluation::Serial {
        on_phase("HELIOS (serial evaluation)");
        let (s, _, _) = run_helios(ctx, &jobs, opts, &serial_policy(&opts.policy))?;
        let p = passes(&s)?;
        Some(drift_system(s, &phase_of, &refs, &p, &layers))
    } else {
        None
    };

    // The oracle, per phase, from the static runs.
    let bound = opts.slo.max_bits_per_byte_increase;
    let mut oracle = Vec::new();
    let (mut o_tokens, mut o_secs) = (0usize, 0f64);
    for p in 0..PHASES.len() {
        let best_q = statics
            .iter()
            .map(|s| s.phases[p].reference_bits_per_byte)
            .fold(f64::INFINITY, f64::min);
        let pick = statics
            .iter()
            .filter(|s| match bound {
                Some(b) => s.phases[p].reference_bits_per_byte <= best_q + b,
                None => s.phases[p].reference_bits_per_byte <= best_q,
            })
            .max_by(|a, b| {
                a.phases[p]
                    .output_tokens_per_s
                    .total_cmp(&b.phases[p].output_tokens_per_s)
            });
        if let Some(s) = pick {
            let row = &s.phases[p];
            o_tokens += row.output_tokens;
            o_secs += row.duration_s;
            oracle.push(OracleRow {
                phase: row.phase.clone(),
                model: s.system.trim_start_matches("static ").to_string(),
                output_tokens_per_s: row.output_tokens_per_s,
                reference_bits_per_byte: row.reference_bits_per_byte,
                pass_at_1: row.pass_at_1,
            });
        }
    }
    let oracle_tps = o_tokens as f64 / o_secs.max(f64::MIN_POSITIVE);
    let dominating_statics = (0..PHASES.len())
        .map(|p| {
            let h = &helios.phases[p];
            let names = statics
                .iter()
                .filter(|s| {
                    let r = &s.phases[p];
                    r.output_tokens_per_s > h.output_tokens_per_s
                        && r.reference_bits_per_byte < h.reference_bits_per_byte
                })
                .map(|s| s.system.clone())
                .collect();
            (PHASES[p].to_string(), names)
        })
        .collect();
    Ok(DriftReport {
        dataset: ctx.dataset.to_string(),
        per_phase: d.per_phase,
        request_rate: d.request_rate,
        seed: d.seed,
        max_tokens: d.max_tokens,
        memory_budget_bytes: opts.memory_budget,
        max_bits_per_byte_increase: bound,
        code: d.code,
        code_max_tokens: d.code_max_tokens,
        test_isolation: isolation,
        phases: PHASES.iter().map(|s| s.to_string()).collect(),
        helios_vs_oracle_throughput: helios.report.output_tokens_per_s / oracle_tps,
        oracle_output_tokens_per_s: oracle_tps,
        statics,
        helios,
        helios_serial,
        oracle,
        dominating_statics,
        shadow_rounds,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

impl DriftReport {
    pub fn markdown(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "### HELIOS on a drifting trace: {} requests per phase (prose, code, prose) of {}, \
             Poisson arrivals at {} requests/s, {} output tokens each ({}), budget {} MiB, \
             quality bound {}\n",
            self.per_phase,
            self.dataset,
            self.request_rate,
            self.max_tokens,
            match self.code {
                CodeSource::HumanEval => format!(
                    "code: HumanEval, {} tokens each, completions cut at the end of \
                     generation and HumanEval's stop sequences, pass@1 by executing the tests{}",
                    self.code_max_tokens,
                    match self.test_isolation {
                        Some(Isolation::NoNetwork) => " with no network",
                        _ => "",
                    }
                ),
                CodeSource::ShareGpt => "code: ShareGPT prompts carrying code".to_string(),
            },
            self.memory_budget_bytes >> 20,
            self.max_bits_per_byte_increase
                .map_or("none".to_string(), |b| format!("+{b} bits/byte"))
        );
        let _ = writeln!(
            s,
            "| system | output tok/s | TTFT P50 / P99 (s) | TPOT P50 / P99 (ms) | peak resident (MiB) | {} |",
            self.phases
                .iter()
                .map(|p| format!("{p}: tok/s, answer bits/byte, [pass@1,] served by"))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        let _ = writeln!(
            s,
            "|---|---|---|---|---|{}",
            "---|".repeat(self.phases.len())
        );
        let systems = self
            .statics
            .iter()
            .chain(std::iter::once(&self.helios))
            .chain(self.helios_serial.as_ref());
        for sys in systems {
            let r = &sys.report;
            let phases: Vec<String> = sys
                .phases
                .iter()
                .map(|p| {
                    let by: Vec<String> = p
                        .served_by
                        .iter()
                        .map(|(m, n)| format!("{m} {n}"))
                        .collect();
                    let pass = p
                        .passed
                        .map_or(String::new(), |n| format!(" pass@1 {n}/{},", p.requests));
                    format!(
                        "{:.2}, {:.4},{pass} {}",
                        p.output_tokens_per_s,
                        p.reference_bits_per_byte,
                        by.join(" + ")
                    )
                })
                .collect();
            let _ = writeln!(
                s,
                "| {} | {:.2} | {:.2} / {:.2} | {:.1} / {:.1} | {:.1} | {} |",
                sys.system,
                r.output_tokens_per_s,
                r.ttft_s.p50,
                r.ttft_s.p99,
                r.tpot_s.p50 * 1e3,
                r.tpot_s.p99 * 1e3,
                r.peak_resident_bytes as f64 / (1u64 << 20) as f64,
                phases.join(" | ")
            );
        }
        let _ = writeln!(s, "\nHindsight oracle (per phase, from the static runs):\n");
        let _ = writeln!(s, "| phase | model | tok/s | answer bits/byte | pass@1 |");
        let _ = writeln!(s, "|---|---|---|---|---|");
        for o in &self.oracle {
            let _ = writeln!(
                s,
                "| {} | {} | {:.2} | {:.4} | {} |",
                o.phase,
                o.model,
                o.output_tokens_per_s,
                o.reference_bits_per_byte,
                o.pass_at_1.map_or("-".to_string(), |p| format!("{p:.3}"))
            );
        }
        let _ = writeln!(
            s,
            "\nOracle: {:.2} output tokens/s; HELIOS / oracle: {:.2}x.",
            self.oracle_output_tokens_per_s, self.helios_vs_oracle_throughput
        );
        for (phase, names) in &self.dominating_statics {
            let _ = writeln!(
                s,
                "- {phase}: {}",
                if names.is_empty() {
                    "no static candidate is both faster and better than HELIOS (on the Pareto front)"
                        .to_string()
                } else {
                    format!("dominated by {}", names.join(", "))
                }
            );
        }
        if !self.helios.passed.is_empty() {
            let _ = writeln!(
                s,
                "\nHumanEval problem by problem: HELIOS against each static run on the problems \
                 HELIOS served with that model (same model, same prompt: the completions should \
                 be the same tokens):\n"
            );
            for st in &self.statics {
                let model = st.system.trim_start_matches("static ");
                let mine: Vec<usize> = self
                    .helios
                    .passed
                    .keys()
                    .copied()
                    .filter(|&i| self.helios.served.get(i).is_some_and(|(m, _)| m == model))
                    .collect();
                let same = mine
                    .iter()
                    .filter(|&&i| {
                        self.helios.report.per_request.get(i).map(|r| &r.token_ids)
                            == st.report.per_request.get(i).map(|r| &r.token_ids)
                    })
                    .count();
                let count = |p: &BTreeMap<usize, bool>| {
                    mine.iter().filter(|i| p.get(i) == Some(&true)).count()
                };
                let _ = writeln!(
                    s,
                    "- {model}: {} problems, {same} identical completions; passed {} under \
                     HELIOS, {} alone",
                    mine.len(),
                    count(&self.helios.passed),
                    count(&st.passed),
                );
            }
        }
        if let Some(d) = &self.helios.report.decisions {
            let _ = writeln!(
                s,
                "\nHELIOS shadow scoring: {} rounds of {} prompts ({} sampled prompts skipped, displaced by newer ones while the scorer was busy), {:.1} s computing ({:.1}% of its time), {} switches, {} depth changes.",
                d.shadow_rounds,
                d.shadow_texts,
                d.shadow_texts_skipped,
                d.shadow_busy_seconds,
                100.0 * d.shadow_share_used,
                d.switches,
                d.extends
            );
            let _ = writeln!(
                s,
                "Change points (the window restarted): {}; switches made at once because the serving choice broke the bound on new traffic: {}. Requests held for their own prompt's round: {} (mean wait {:.2} s, {} holds ran out).",
                d.shadow_change_points,
                d.shadow_urgent_switches,
                d.held_requests,
                d.hold_seconds / d.held_requests.max(1) as f64,
                d.hold_timeouts
            );
        }
        s
    }

    /// `served.png`: which model and depth served each request, per HELIOS run, with the
    /// phase boundaries.
    pub fn plot(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        use switchyard_charts::{fonts_available, line_chart, Chart, Series};
        std::fs::create_dir_all(dir).map_err(|source| HeliosError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        // Each model a band: model index + depth / layers.
        let models: Vec<String> = self
            .statics
            .iter()
            .map(|s| s.system.trim_start_matches("static ").to_string())
            .collect();
        let level = |m: &str, d: usize| -> f64 {
            let i = models.iter().position(|x| x == m).unwrap_or(0);
            let layers = self
                .statics
                .iter()
                .find(|s| s.system.ends_with(m))
                .and_then(|s| s.served.first().map(|x| x.1))
                .unwrap_or(d.max(1));
            i as f64 + d as f64 / layers.max(1) as f64
        };
        let mut series: Vec<Series> = std::iter::once(&self.helios)
            .chain(self.helios_serial.as_ref())
            .map(|sys| Series {
                name: sys.system.clone(),
                points: sys
                    .served
                    .iter()
                    .enumerate()
                    .map(|(i, (m, d))| (i as f64, level(m, *d)))
                    .collect(),
            })
            .collect();
        let n = self.helios.served.len();
        let top = models.len() as f64 + 0.2;
        for k in 1..self.phases.len() {
            let x = (k * self.per_phase) as f64 - 0.5;
            series.push(Series {
                name: format!("phase {}", k + 1),
                points: vec![(x, 0.0), (x, top)],
            });
        }
        // Short names keep the title inside the picture: up to the second '-'.
        let bands: Vec<String> = models
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let short: Vec<&str> = m.splitn(3, '-').take(2).collect();
                format!("{} {}", i + 1, short.join("-"))
            })
            .collect();
        let title = format!(
            "Model per request ({}; below the line: shallower)",
            bands.join(", ")
        );
        let path = dir.join("served.png");
        line_chart(
            &path,
            &Chart {
                title: &title,
                x_label: "request (arrival order)",
                y_label: "model index + depth / layers",
                x: (0.0, n.max(1) as f64),
                y: (0.0, top),
                series: &series,
                legend: plotters::prelude::SeriesLabelPosition::UpperLeft,
            },
            fonts_available(),
        )?;
        Ok(vec![path])
    }
}
