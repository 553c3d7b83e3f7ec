//! `switchyard bench modes`: the mode × workload matrix.
//!
//! Workloads (prompts cut from ShareGPT text, outputs forced to their length with
//! `ignore_eos`):
//! - `SS`, `SL`, `LS`, `LL`: prompt 128 or 1024 tokens × output 32 or 128, one request at a
//!   time (an interactive client: latency is the request's own);
//! - `shared-prefix`: chat turns sharing one long system prefix, one at a time;
//! - `memory-pressure`: long prompts sent together while part of the budget is claimed by
//!   something else (the engine gets only what is left);
//! - `batch`: many short requests sent at once.
//!
//! Per cell: mean/P50/P99 end-to-end latency (submit to last token), output tokens per second
//! of the workload's wall time, peak memory (weights + KV in use + workspace, sampled), and
//! energy per token where a counter is readable (Intel RAPL under `/sys/class/powercap`);
//! where none is, the report says so and holds no number. Quality per mode: bits per byte on
//! held-out ShareGPT text, ROUGE-L of the `SL` outputs against f16's, and accuracy on
//! benchmark items (ARC-Challenge, HellaSwag, MMLU by the answer options' log-likelihoods;
//! GSM8K by exact match of generated answers), the same items for every mode, with 95%
//! intervals.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use switchyard_engine::EngineRequest;
use switchyard_eval::quality::{self, McTask, Pick};
use switchyard_eval::sharegpt;
use switchyard_eval::stats::{median, percentile};
use switchyard_models::LayeredModel;
use switchyard_request::{Mode, Precision, SamplingParams};
use switchyard_tokenizer::Tokenizer;

use crate::serve::{ModeAssets, ModeServer};
use crate::{precision, ModesError, Result};

/// Where the energy column comes from, or why it is empty.
pub fn energy_source() -> std::result::Result<PathBuf, String> {
    let dir = Path::new("/sys/class/powercap");
    let rapl = dir.join("intel-rapl:0/energy_uj");
    match std::fs::read_to_string(&rapl) {
        Ok(_) => Ok(rapl),
        Err(e) => Err(format!(
            "not measurable here: no readable RAPL counter ({}: {e}) and no GPU",
            rapl.display()
        )),
    }
}

fn read_energy_uj(path: &Path) -> Option<f64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// One workload: its requests and whether they are sent together.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Workload {
    pub name: String,
    #[serde(skip, default)]
    pub prompts: Vec<Vec<u32>>,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub requests: usize,
    pub concurrent: bool,
    /// Bytes of the budget claimed by something else during the workload.
    pub claimed_bytes: u64,
}

#[derive(Debug, Clone)]
pub struct ModesBenchOptions {
    pub modes: Vec<Mode>,
    /// Requests per shape workload.
    pub requests: usize,
    /// Requests of the batch workload.
    pub batch_requests: usize,
    /// Memory budget of each mode.
    pub budget: u64,
    /// Share of the budget claimed during the memory-pressure workload.
    pub pressure_claim: f64,
    pub mc_items: usize,
    pub gsm8k_items: usize,
    /// Held-out text for bits per byte (tokens).
    pub bpb_tokens: usize,
    /// Workloads to run by name (all when empty).
    pub only: Vec<String>,
    /// Take every mode's quality from this report (of the same model) instead of measuring
    /// it: the latency cells are measured, the quality columns are the report's.
    pub quality_from: Option<BorrowedQuality>,
}

/// Quality rows measured by an earlier `bench modes` run, and where they came from.
#[derive(Debug, Clone)]
pub struct BorrowedQuality {
    /// The report's file, as named in the new report's notes.
    pub source: String,
    pub report: ModesReport,
}

impl BorrowedQuality {
    /// The report's quality row of every mode in `modes`. Refuses a report of another model,
    /// or one without a row (or without bits per byte) for one of `modes`: a mode with no
    /// quality would pass no gate, silently.
    pub fn rows(&self, model: &str, modes: &[Mode]) -> Result<Vec<ModeQuality>> {
        if self.report.model != model {
            return Err(ModesError::Invalid(format!(
                "{} measured {}, not {model}: quality is borrowed only from the same model",
                self.source, self.report.model
            )));
        }
        modes
            .iter()
            .map(|&mode| {
                let row = self
                    .report
                    .quality
                    .iter()
                    .find(|q| q.mode == mode && q.bits_per_byte.is_some())
                    .ok_or_else(|| {
                        ModesError::Invalid(format!(
                            "{} has no quality row with bits per byte for {mode}",
                            self.source
                        ))
                    })?;
                let mut row = row.clone();
                let measured = row.note.take();
                row.note = Some(match measured {
                    Some(n) => format!("from {}: {n}", self.source),
                    None => format!("from {}", self.source),
                });
                Ok(row)
            })
            .collect()
    }
}

impl Default for ModesBenchOptions {
    fn default() -> Self {
        Self {
            modes: Mode::ALL.to_vec(),
            requests: 3,
            batch_requests: 16,
            budget: 2 << 30,
            pressure_claim: 0.7,
            mc_items: 20,
            gsm8k_items: 5,
            bpb_tokens: 4096,
            only: Vec::new(),
            quality_from: None,
        }
    }
}

/// Builds the workloads from ShareGPT text tokenized for `tokenizer`.
pub fn workloads(tokenizer: &Tokenizer, opts: &ModesBenchOptions) -> Result<Vec<Workload>> {
    let need = (4 * opts.requests + 8) * 1024 + opts.batch_requests * 128;
    let stream = sharegpt_tokens(tokenizer, need)?;
    let mut at = 0;
    let mut take = |n: usize| {
        let p = stream[at..at + n].to_vec();
        at += n;
        p
    };
    let mut out = Vec::new();
    let shape = |name: &str,
                 p: usize,
                 o: usize,
                 n: usize,
                 concurrent: bool,
                 claim: u64,
                 take: &mut dyn FnMut(usize) -> Vec<u32>| Workload {
        name: name.into(),
        prompts: (0..n).map(|_| take(p)).collect(),
        prompt_tokens: p,
        output_tokens: o,
        requests: n,
        concurrent,
        claimed_bytes: claim,
    };
    let n = opts.requests;
    for (name, p, o) in [
        ("SS", 128, 32),
        ("SL", 128, 128),
        ("LS", 1024, 32),
        ("LL", 1024, 128),
    ] {
        out.push(shape(name, p, o, n, false, 0, &mut take));
    }
    // Shared prefix: one 512-token system prefix, then a distinct 64-token turn.
    let prefix = take(512);
    let turns: Vec<Vec<u32>> = (0..2 * n)
        .map(|_| prefix.iter().copied().chain(take(64)).collect())
        .collect();
    out.push(Workload {
        name: "shared-prefix".into(),
        requests: turns.len(),
        prompts: turns,
        prompt_tokens: 576,
        output_tokens: 32,
        concurrent: false,
        claimed_bytes: 0,
    });
    let claim = (opts.budget as f64 * opts.pressure_claim) as u64;
    out.push(shape(
        "memory-pressure",
        1024,
        32,
        n + 1,
        true,
        claim,
        &mut take,
    ));
    out.push(shape(
        "batch",
        128,
        32,
        opts.batch_requests,
        true,
        0,
        &mut take,
    ));
    if !opts.only.is_empty() {
        if let Some(bad) = opts
            .only
            .iter()
            .find(|n| !out.iter().any(|w| &w.name == *n))
        {
            return Err(ModesError::Invalid(format!(
                "unknown workload {bad:?}; known: SS, SL, LS, LL, shared-prefix, memory-pressure, batch"
            )));
        }
        out.retain(|w| opts.only.contains(&w.name));
    }
    Ok(out)
}

/// At least `need` tokens of ShareGPT text, the conversations in file order, turns joined.
pub fn sharegpt_tokens(tokenizer: &Tokenizer, need: usize) -> Result<Vec<u32>> {
    let path = switchyard_zoo::ensure("sharegpt")?;
    let mut stream: Vec<u32> = Vec::new();
    let records = sharegpt::records(&path).map_err(|e| ModesError::Invalid(e.to_string()))?;
    for conv in records {
        let conv = conv.map_err(|e| ModesError::Invalid(e.to_string()))?;
        for t in &conv.conversations {
            stream.extend(tokenizer.encode(&t.value, false, false)?);
        }
        if stream.len() >= need {
            break;
        }
    }
    if stream.len() < need {
        return Err(ModesError::Invalid(format!(
            "ShareGPT gave {} tokens; the workloads need {need}",
            stream.len()
        )));
    }
    Ok(stream)
}

/// One mode on one workload.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cell {
    pub mode: Mode,
    pub workload: String,
    /// Why the cell has no measurement (the mode does not fit, or cannot run here).
    pub error: Option<String>,
    pub latency_mean_s: f64,
    pub latency_p50_s: f64,
    pub latency_p99_s: f64,
    /// Half-width of the mean latency's 95% interval over the mean (t-free normal
    /// approximation; `None` with fewer than two requests).
    #[serde(default)]
    pub latency_ci95_rel: Option<f64>,
    pub output_tokens: usize,
    pub duration_s: f64,
    pub output_tokens_per_s: f64,
    /// `None`: not measurable here (see the report's `energy`).
    pub energy_j_per_token: Option<f64>,
    pub peak_memory_bytes: u64,
    /// Speculative modes: accepted / drafted tokens.
    pub acceptance: Option<f64>,
}

/// A mode's quality, on the same items for every mode.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModeQuality {
    pub mode: Mode,
    pub bits_per_byte: Option<f64>,
    /// ROUGE-L F of the SL outputs against f16's (1 for f16 itself).
    pub rouge_l_vs_f16: Option<f64>,
    pub tasks: Vec<TaskScore>,
    /// Mean accuracy over the tasks, in points.
    pub accuracy_points: Option<f64>,
    /// Against f16 on the same items, with a paired 95% interval (points).
    pub accuracy_delta_points: Option<(f64, f64, f64)>,
    /// Per task, against f16 on the same items: paired 95% interval and McNemar's test (what
    /// the router's quality gate reads).
    #[serde(default)]
    pub paired: std::collections::BTreeMap<String, switchyard_router::PairedDelta>,
    /// Bytes of held-out text `bits_per_byte` was measured on.
    #[serde(default)]
    pub bpb_bytes: Option<usize>,
    /// How this mode's quality was obtained when it is not measured directly.
    pub note: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskScore {
    pub task: String,
    pub n: usize,
    pub correct: usize,
    pub accuracy: f64,
    pub ci95: (f64, f64),
    #[serde(skip, default)]
    pub per_item: Vec<bool>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModesReport {
    pub model: String,
    pub threads: usize,
    pub budget_bytes: u64,
    pub energy: String,
    pub workloads: Vec<Workload>,
    pub cells: Vec<Cell>,
    pub quality: Vec<ModeQuality>,
    pub notes: Vec<String>,
}

/// Precision modes measure quality on the model; the others inherit their precision's
/// model-level quality (their logits are the same: batching, chunking and the prefix cache
/// do not change them, which the engine's tests assert bit for bit) and measure what they
/// change on generation.
fn quality_source(mode: Mode) -> Option<Precision> {
    match mode {
        Mode::F16 | Mode::F32 | Mode::Int8 | Mode::Q4 | Mode::Q4Awq | Mode::Q4Gptq => {
            Some(mode.precision())
        }
        _ => None,
    }
}

/// Runs the whole matrix. `progress(message)` reports each step.
pub fn run(
    assets: &ModeAssets,
    threads: usize,
    opts: &ModesBenchOptions,
    mut progress: impl FnMut(&str),
) -> Result<ModesReport> {
    let tokenizer = Arc::clone(&assets.tokenizer);
    let workloads = workloads(&tokenizer, opts)?;
    let energy = energy_source();
    let mut cells = Vec::new();
    let mut sl_texts: Vec<(Mode, Vec<String>)> = Vec::new();
    let mut gsm: Vec<(Mode, Vec<bool>)> = Vec::new();
    let borrowed = match &opts.quality_from {
        Some(b) => Some((b.rows(&assets.name, &opts.modes)?, b.source.as_str())),
        None => None,
    };
    let gsm_items = match borrowed {
        Some(_) => Vec::new(),
        None => quality::load_gsm8k(opts.gsm8k_items, Pick::First)?,
    };
    let mut notes = Vec::new();
    for &mode in &opts.modes {
        progress(&format!("{mode}: loading"));
        let full = ModeServer::load(mode, assets, opts.budget);
        for w in &workloads {
            let reduced;
            let server = match (&full, w.claimed_bytes) {
                (Ok(s), 0) => s,
                (Err(e), 0) => {
                    cells.push(failed(mode, w, e.to_string()));
                    continue;
                }
                (_, claimed) => {
                    match ModeServer::load(mode, assets, opts.budget.saturating_sub(claimed)) {
                        Ok(s) => {
                            reduced = s;
                            &reduced
                        }
                        Err(e) => {
                            cells.push(failed(mode, w, e.to_string()));
                            continue;
                        }
                    }
                }
            };
            progress(&format!("{mode}: {}", w.name));
            match run_cell(server, mode, w, &tokenizer, energy.as_ref().ok()) {
                Ok((cell, texts)) => {
                    if w.name == "SL" {
                        sl_texts.push((mode, texts));
                    }
                    cells.push(cell);
                }
                Err(e) => cells.push(failed(mode, w, e.to_string())),
            }
        }
        let generates = matches!(
            mode,
            Mode::F16
                | Mode::F32
                | Mode::Int8
                | Mode::Q4
                | Mode::Q4Awq
                | Mode::Q4Gptq
                | Mode::KvCompressed
                | Mode::SelfSpeculative
                | Mode::Speculative
        );
        if generates && !gsm_items.is_empty() {
            progress(&format!("{mode}: GSM8K ({} items)", gsm_items.len()));
            match gsm8k_answers(mode, &full, assets, opts.budget, &gsm_items, &tokenizer) {
                Ok(v) => gsm.push((mode, v)),
                Err(e) => notes.push(format!("{mode}: GSM8K not scored: {e}")),
            }
        }
    }

    let quality = match borrowed {
        Some((rows, source)) => {
            notes.push(format!(
                "Quality (bits per byte, accuracies, paired intervals, ROUGE-L) is {source}'s, measured there on the same model and items; only the latency cells were measured in this run."
            ));
            rows
        }
        None => {
            progress("quality: bits per byte and multiple-choice items");
            score_quality(assets, opts, &sl_texts, &gsm, &mut progress)?
        }
    };
    notes.push("CUDA graphs do not apply on a CPU; no mode stands for them.".into());
    Ok(ModesReport {
        model: assets.name.clone(),
        threads,
        budget_bytes: opts.budget,
        energy: match &energy {
            Ok(p) => format!("RAPL package counter {}", p.display()),
            Err(why) => why.clone(),
        },
        workloads,
        cells,
        quality,
        notes,
    })
}

/// Whether `mode` answers each GSM8K item correctly (greedy, up to 256 tokens). Engine
/// modes answer every item at once on a batched twin of their engine (same tokens as one at
/// a time); speculative modes answer one after another on `server`.
fn gsm8k_answers(
    mode: Mode,
    server: &std::result::Result<ModeServer, ModesError>,
    assets: &ModeAssets,
    budget: u64,
    items: &[quality::GenItem],
    tokenizer: &Tokenizer,
) -> Result<Vec<bool>> {
    let params = SamplingParams {
        max_tokens: 256,
        stop: quality::GSM8K_STOP.iter().map(|s| s.to_string()).collect(),
        ..SamplingParams::default()
    };
    let prompts = items
        .iter()
        .map(|item| Ok(tokenizer.encode(&item.prompt, true, false)?))
        .collect::<Result<Vec<_>>>()?;
    let texts = match ModeServer::batched(mode, assets, budget)? {
        Some(h) => {
            let streams = prompts
                .into_iter()
                .map(|prompt| {
                    h.add_request(EngineRequest {
                        prompt,
                        params: params.clone(),
                    })
                })
                .collect::<std::result::Result<Vec<_>, _>>()?;
            streams
                .into_iter()
                .map(|s| Ok(s.wait()?.text))
                .collect::<Result<Vec<_>>>()?
        }
        None => {
            let s = server
                .as_ref()
                .map_err(|e| ModesError::Invalid(e.to_string()))?;
            prompts
                .iter()
                .map(|p| Ok(s.run(tokenizer, p, &params)?.text))
                .collect::<Result<Vec<_>>>()?
        }
    };
    Ok(texts
        .iter()
        .zip(items)
        .map(|(t, item)| quality::gsm8k_correct(t, &item.answer))
        .collect())
}

fn failed(mode: Mode, w: &Workload, error: String) -> Cell {
    Cell {
        mode,
        workload: w.name.clone(),
        error: Some(error),
        latency_mean_s: 0.0,
        latency_p50_s: 0.0,
        latency_p99_s: 0.0,
        latency_ci95_rel: None,
        output_tokens: 0,
        duration_s: 0.0,
        output_tokens_per_s: 0.0,
        energy_j_per_token: None,
        peak_memory_bytes: 0,
        acceptance: None,
    }
}

fn run_cell(
    server: &ModeServer,
    mode: Mode,
    w: &Workload,
    tokenizer: &Tokenizer,
    energy: Option<&PathBuf>,
) -> Result<(Cell, Vec<String>)> {
    let params = SamplingParams {
        max_tokens: w.output_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let e0 = energy.and_then(|p| read_energy_uj(p));
    let t0 = Instant::now();
    let mut latencies = Vec::new();
    let mut texts = Vec::new();
    let mut tokens = 0;
    let mut peak = 0u64;
    let (mut drafted, mut accepted) = (0, 0);
    match (server.engine(), w.concurrent) {
        (Some(h), true) => {
            let streams = w
                .prompts
                .iter()
                .map(|p| {
                    h.add_request(EngineRequest {
                        prompt: p.clone(),
                        params: params.clone(),
                    })
                })
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let waiter = std::thread::spawn(move || {
                streams
                    .into_iter()
                    .map(|s| s.wait())
                    .collect::<std::result::Result<Vec<_>, _>>()
            });
            while !waiter.is_finished() {
                peak = peak.max(used_bytes(&h.stats().wait()?.memory));
                std::thread::sleep(Duration::from_millis(50));
            }
            let done = waiter
                .join()
                .map_err(|_| ModesError::Invalid("the request waiter panicked".into()))??;
            for c in done {
                latencies.push((c.finished_at - c.arrival).as_secs_f64());
                tokens += c.token_ids.len();
                texts.push(c.text);
            }
        }
        _ => {
            // Sequential requests (and every request of a speculative mode, which decodes
            // one sequence at a time: later requests of a concurrent workload queue, and
            // their latency counts from the workload's start).
            for p in &w.prompts {
                let out = server.run(tokenizer, p, &params)?;
                latencies.push(if w.concurrent {
                    t0.elapsed().as_secs_f64()
                } else {
                    out.latency_s
                });
                tokens += out.tokens.len();
                drafted += out.drafted;
                accepted += out.accepted;
                texts.push(out.text);
                if let Some(h) = server.engine() {
                    peak = peak.max(used_bytes(&h.stats().wait()?.memory));
                }
            }
        }
    }
    let duration = t0.elapsed().as_secs_f64();
    if server.engine().is_none() {
        peak = peak.max(server.weights_bytes());
    }
    let energy_j = match (energy.and_then(|p| read_energy_uj(p)), e0) {
        (Some(e1), Some(e0)) if e1 >= e0 && tokens > 0 => Some((e1 - e0) / 1e6 / tokens as f64),
        _ => None,
    };
    let mean = latencies.iter().sum::<f64>() / latencies.len().max(1) as f64;
    Ok((
        Cell {
            mode,
            workload: w.name.clone(),
            error: None,
            latency_mean_s: mean,
            latency_p50_s: median(&latencies),
            latency_p99_s: percentile(&latencies, 99.0),
            latency_ci95_rel: mean_ci95_rel(&latencies),
            output_tokens: tokens,
            duration_s: duration,
            output_tokens_per_s: tokens as f64 / duration,
            energy_j_per_token: energy_j,
            peak_memory_bytes: peak,
            acceptance: (drafted > 0).then(|| accepted as f64 / drafted as f64),
        },
        texts,
    ))
}

/// Half-width of the 95% interval of the mean of `xs`, relative to the mean.
pub fn mean_ci95_rel(xs: &[f64]) -> Option<f64> {
    let (mean, se) = switchyard_eval::stats::mean_and_se(xs)?;
    (mean > 0.0).then(|| quality::Z95 * se / mean)
}

/// Memory the mode actually uses: weights, KV blocks holding positions (the pool itself is
/// allocated up to the budget at start) and the activation workspace.
fn used_bytes(m: &switchyard_engine::MemoryStats) -> u64 {
    m.weights_bytes + m.kv_used_bytes + m.workspace_bytes
}

fn task_score(task: &str, per_item: Vec<bool>) -> TaskScore {
    let n = per_item.len();
    let correct = per_item.iter().filter(|&&c| c).count();
    TaskScore {
        task: task.into(),
        n,
        correct,
        accuracy: correct as f64 / n.max(1) as f64,
        ci95: quality::wilson95(correct, n),
        per_item,
    }
}

fn score_quality(
    assets: &ModeAssets,
    opts: &ModesBenchOptions,
    sl_texts: &[(Mode, Vec<String>)],
    gsm: &[(Mode, Vec<bool>)],
    progress: &mut impl FnMut(&str),
) -> Result<Vec<ModeQuality>> {
    let tokenizer = &assets.tokenizer;
    let held_out = held_out_text(tokenizer, opts.bpb_tokens)?;
    let mut items = Vec::new();
    if opts.mc_items > 0 {
        for task in [McTask::ArcChallenge, McTask::Hellaswag, McTask::Mmlu] {
            // MMLU's file is sorted by subject: a seeded draw spreads the items over them.
            let pick = match task {
                McTask::Mmlu => Pick::Seeded(1),
                _ => Pick::First,
            };
            items.push((task, quality::load_mc(task, opts.mc_items, pick)?));
        }
    }
    // Model-level scores per precision used by any mode.
    let mut by_precision: Vec<(Precision, Option<f64>, Vec<TaskScore>)> = Vec::new();
    for p in Precision::ALL {
        if !opts.modes.iter().any(|m| m.precision() == p) {
            continue;
        }
        progress(&format!("quality: {}", p.name()));
        let model: LayeredModel =
            precision::load(Arc::clone(&assets.source), p, assets.calibrations())?;
        let bpb = switchyard_engine::score::score_text(
            &model,
            tokenizer,
            &held_out,
            Default::default(),
            |_, _| {},
        )?
        .bits_per_byte;
        let mut tasks = Vec::new();
        let mut scorer = quality::LayeredScorer::new(&model);
        for (task, its) in &items {
            let s = quality::score_mc(its, &mut scorer, tokenizer)?;
            tasks.push(task_score(task.asset(), s.per_item.clone()));
        }
        by_precision.push((p, Some(bpb), tasks));
    }
    let f16_texts = sl_texts.iter().find(|(m, _)| *m == Mode::F16).map(|t| &t.1);
    let f16_gsm = gsm.iter().find(|(m, _)| *m == Mode::F16).map(|g| &g.1);
    let mut out = Vec::new();
    for &mode in &opts.modes {
        let Some((_, bpb, tasks)) = by_precision.iter().find(|(p, ..)| *p == mode.precision())
        else {
            continue;
        };
        let mut tasks = tasks.clone();
        let own_gsm = gsm.iter().find(|(m, _)| *m == mode).map(|g| g.1.clone());
        let note = match (quality_source(mode), &own_gsm) {
            (Some(_), _) => None,
            (None, Some(_)) => Some(format!(
                "log-likelihood scores and bits per byte are the {} model's (same logits); GSM8K and ROUGE-L are this mode's own generations",
                mode.precision().name()
            )),
            (None, None) if mode.speculative() || mode.kv_compressed() => Some(format!(
                "log-likelihood scores and bits per byte are the {} model's (same logits); ROUGE-L is this mode's own generations",
                mode.precision().name()
            )),
            (None, None) => Some(format!(
                "all scores are the {} model's: this mode changes scheduling only, not logits",
                mode.precision().name()
            )),
        };
        // A mode that changes scheduling only answers as its precision's mode does (same
        // logits, greedy); f16's answers stand in only where that precision generated none.
        let gsm_items = own_gsm
            .or_else(|| {
                gsm.iter()
                    .find(|(m, _)| {
                        m.precision() == mode.precision() && quality_source(*m).is_some()
                    })
                    .map(|g| g.1.clone())
            })
            .or_else(|| {
                gsm.iter()
                    .find(|(m, _)| *m == Mode::F16)
                    .map(|g| g.1.clone())
            });
        if let Some(v) = gsm_items {
            tasks.push(task_score("gsm8k", v));
        }
        let rouge = match (f16_texts, sl_texts.iter().find(|(m, _)| *m == mode)) {
            (Some(r), Some((_, c))) if !r.is_empty() => Some(
                c.iter()
                    .zip(r)
                    .map(|(c, r)| quality::rouge_l(c, r))
                    .sum::<f64>()
                    / r.len() as f64,
            ),
            _ => None,
        };
        let accuracy = (!tasks.is_empty())
            .then(|| 100.0 * tasks.iter().map(|t| t.accuracy).sum::<f64>() / tasks.len() as f64);
        let delta = by_precision
            .iter()
            .find(|(p, ..)| *p == Precision::F16)
            .and_then(|(_, _, base)| {
                let mut a = Vec::new();
                let mut b = Vec::new();
                for t in &tasks {
                    if let Some(bt) = base.iter().find(|x| x.task == t.task) {
                        a.extend(&t.per_item);
                        b.extend(&bt.per_item);
                    } else if t.task == "gsm8k" {
                        if let Some(g) = f16_gsm {
                            a.extend(&t.per_item);
                            b.extend(g);
                        }
                    }
                }
                (a.len() >= 2).then(|| quality::paired_diff95(&a, &b))
            });
        let mut paired = std::collections::BTreeMap::new();
        for t in &tasks {
            let base_items = if t.task == "gsm8k" {
                f16_gsm.cloned()
            } else {
                by_precision
                    .iter()
                    .find(|(p, ..)| *p == Precision::F16)
                    .and_then(|(_, _, base)| base.iter().find(|x| x.task == t.task))
                    .map(|bt| bt.per_item.clone())
            };
            if let Some(b) = base_items.filter(|b| b.len() == t.per_item.len() && b.len() >= 2) {
                let (delta, lo, hi) = quality::paired_diff95(&t.per_item, &b);
                let m = quality::mcnemar(&t.per_item, &b);
                paired.insert(
                    t.task.clone(),
                    switchyard_router::PairedDelta {
                        n: b.len(),
                        delta_points: delta,
                        lo_points: lo,
                        hi_points: hi,
                        only_mode: m.only_a,
                        only_baseline: m.only_b,
                        mcnemar_p: m.p_value,
                    },
                );
            }
        }
        out.push(ModeQuality {
            mode,
            paired,
            bpb_bytes: Some(held_out.len()),
            bits_per_byte: *bpb,
            rouge_l_vs_f16: rouge,
            tasks,
            accuracy_points: accuracy,
            accuracy_delta_points: delta,
            note,
        });
    }
    Ok(out)
}

/// Held-out ShareGPT text (conversations the workloads do not use: from the end of the
/// readable part of the file backwards is not possible on a stream, so the workloads take
/// the first conversations and this takes every conversation from the 2000th on).
/// At least `tokens` tokens of it: the text every precision's bits per byte are measured on.
pub fn held_out_text(tokenizer: &Tokenizer, tokens: usize) -> Result<String> {
    let path = switchyard_zoo::ensure("sharegpt")?;
    let mut text = String::new();
    let mut count = 0;
    for (i, conv) in sharegpt::records(&path)
        .map_err(|e| ModesError::Invalid(e.to_string()))?
        .enumerate()
    {
        if i < 2000 {
            continue;
        }
        let conv = conv.map_err(|e| ModesError::Invalid(e.to_string()))?;
        for t in &conv.conversations {
            count += tokenizer.encode(&t.value, false, false)?.len();
            text.push_str(&t.value);
            text.push('\n');
        }
        if count >= tokens {
            break;
        }
    }
    Ok(text)
}

impl ModesReport {
    fn cell(&self, mode: Mode, workload: &str) -> Option<&Cell> {
        self.cells
            .iter()
            .find(|c| c.mode == mode && c.workload == workload && c.error.is_none())
    }

    /// Mean end-to-end latency of f16 over `mode`'s in the same workload.
    pub fn speedup(&self, mode: Mode, workload: &str) -> Option<f64> {
        let base = self.cell(Mode::BASELINE, workload)?;
        let m = self.cell(mode, workload)?;
        Some(base.latency_mean_s / m.latency_mean_s)
    }

    /// Mean of the per-workload speedups of `mode` over the workloads both served.
    pub fn mean_speedup(&self, mode: Mode) -> Option<f64> {
        let s: Vec<f64> = self
            .workloads
            .iter()
            .filter_map(|w| self.speedup(mode, &w.name))
            .collect();
        (!s.is_empty()).then(|| s.iter().sum::<f64>() / s.len() as f64)
    }

    pub fn markdown(&self) -> String {
        let mut md = format!(
            "# Mode × workload matrix: {}\n\n{} threads, budget {} MiB per mode. Energy: {}.\n\n",
            self.model,
            self.threads,
            self.budget_bytes >> 20,
            self.energy
        );
        md.push_str("| workload | prompt | output | requests | sent | budget claimed |\n|---|---|---|---|---|---|\n");
        for w in &self.workloads {
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} MiB |\n",
                w.name,
                w.prompt_tokens,
                w.output_tokens,
                w.requests,
                if w.concurrent {
                    "together"
                } else {
                    "one at a time"
                },
                w.claimed_bytes >> 20
            ));
        }
        md.push_str(
            "\n## Latency speedup vs f16 (mean end-to-end latency, f16 / mode)\n\n| mode |",
        );
        for w in &self.workloads {
            md.push_str(&format!(" {} |", w.name));
        }
        md.push_str(" mean |\n|---|");
        md.push_str(&"---|".repeat(self.workloads.len() + 1));
        md.push('\n');
        let modes: Vec<Mode> = self
            .quality
            .iter()
            .map(|q| q.mode)
            .chain(self.cells.iter().map(|c| c.mode))
            .fold(Vec::new(), |mut v, m| {
                if !v.contains(&m) {
                    v.push(m);
                }
                v
            });
        for &m in &modes {
            md.push_str(&format!("| {m} |"));
            for w in &self.workloads {
                md.push_str(&match self.speedup(m, &w.name) {
                    Some(s) => format!(" {s:.2}x |"),
                    None => " — |".into(),
                });
            }
            md.push_str(&match self.mean_speedup(m) {
                Some(s) => format!(" {s:.2}x |\n"),
                None => " — |\n".into(),
            });
        }
        md.push_str("\n## Cells\n\n| mode | workload | latency mean / P50 / P99 (s) | mean's 95% interval | output tok/s | peak memory (MiB) | energy (J/token) | acceptance | error |\n|---|---|---|---|---|---|---|---|---|\n");
        for c in &self.cells {
            let energy = match c.energy_j_per_token {
                Some(e) => format!("{e:.3}"),
                None => "not measurable here".into(),
            };
            match &c.error {
                Some(e) => md.push_str(&format!(
                    "| {} | {} | — | — | — | — | — | — | {} |\n",
                    c.mode,
                    c.workload,
                    e.replace('|', "/")
                )),
                None => md.push_str(&format!(
                    "| {} | {} | {:.2} / {:.2} / {:.2} | {} | {:.1} | {:.0} | {} | {} | |\n",
                    c.mode,
                    c.workload,
                    c.latency_mean_s,
                    c.latency_p50_s,
                    c.latency_p99_s,
                    c.latency_ci95_rel
                        .map_or("—".into(), |r| format!("±{:.1}%", 100.0 * r)),
                    c.output_tokens_per_s,
                    c.peak_memory_bytes as f64 / (1 << 20) as f64,
                    energy,
                    c.acceptance
                        .map_or("".into(), |a| format!("{:.1}%", 100.0 * a)),
                )),
            }
        }
        md.push_str("\n## Quality (same items for every mode)\n\n| mode | bits per byte | ROUGE-L vs f16 (SL) |");
        let tasks: Vec<String> = self
            .quality
            .first()
            .map(|q| q.tasks.iter().map(|t| t.task.clone()).collect())
            .unwrap_or_default();
        for t in &tasks {
            md.push_str(&format!(" {t} |"));
        }
        md.push_str(" mean accuracy (points) | Δ vs f16 (points, 95% CI) | note |\n|---|---|---|");
        md.push_str(&"---|".repeat(tasks.len() + 3));
        md.push('\n');
        for q in &self.quality {
            md.push_str(&format!(
                "| {} | {} | {} |",
                q.mode,
                q.bits_per_byte.map_or("—".into(), |b| format!("{b:.4}")),
                q.rouge_l_vs_f16.map_or("—".into(), |r| format!("{r:.3}")),
            ));
            for t in &tasks {
                md.push_str(&match q.tasks.iter().find(|x| &x.task == t) {
                    Some(s) => format!(
                        " {}/{} ({:.0}–{:.0}%) |",
                        s.correct,
                        s.n,
                        100.0 * s.ci95.0,
                        100.0 * s.ci95.1
                    ),
                    None => " — |".into(),
                });
            }
            md.push_str(&format!(
                " {} | {} | {} |\n",
                q.accuracy_points.map_or("—".into(), |a| format!("{a:.1}")),
                q.accuracy_delta_points
                    .map_or("—".into(), |(d, lo, hi)| format!(
                        "{d:+.1} [{lo:+.1}, {hi:+.1}]"
                    )),
                q.note.clone().unwrap_or_default(),
            ));
        }
        if !self.notes.is_empty() {
            md.push_str("\n## Notes\n\n");
            for n in &self.notes {
                md.push_str(&format!("- {n}\n"));
            }
        }
        md
    }

    /// `speedup.png`: each mode's latency speedup over f16 per workload.
    pub fn plot(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        use switchyard_charts::{fonts_available, line_chart, Chart, Series};
        std::fs::create_dir_all(dir)
            .map_err(|e| ModesError::Invalid(format!("{}: {e}", dir.display())))?;
        let text = fonts_available();
        let modes: Vec<Mode> = self.quality.iter().map(|q| q.mode).collect();
        let series: Vec<Series> = modes
            .iter()
            .map(|&m| Series {
                name: m.to_string(),
                points: self
                    .workloads
                    .iter()
                    .enumerate()
                    .filter_map(|(i, w)| self.speedup(m, &w.name).map(|s| (i as f64, s)))
                    .collect(),
            })
            .filter(|s| !s.points.is_empty())
            .collect();
        let y_max = series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .fold(1.0, f64::max);
        let path = dir.join("speedup.png");
        let title = format!("Latency speedup vs f16 ({})", self.model);
        let x_label = format!(
            "workload: {}",
            self.workloads
                .iter()
                .enumerate()
                .map(|(i, w)| format!("{i} {}", w.name))
                .collect::<Vec<_>>()
                .join(", ")
        );
        line_chart(
            &path,
            &Chart {
                title: &title,
                x_label: &x_label,
                y_label: "f16 latency / mode latency",
                x: (0.0, (self.workloads.len().max(2) - 1) as f64),
                y: (0.0, y_max * 1.1),
                series: &series,
                legend: plotters::chart::SeriesLabelPosition::UpperLeft,
            },
            text,
        )?;
        Ok(vec![path])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quality_row(mode: Mode, bpb: Option<f64>, note: Option<&str>) -> ModeQuality {
        ModeQuality {
            mode,
            bits_per_byte: bpb,
            rouge_l_vs_f16: None,
            tasks: Vec::new(),
            accuracy_points: None,
            accuracy_delta_points: None,
            paired: Default::default(),
            bpb_bytes: Some(142_323),
            note: note.map(String::from),
        }
    }

    fn borrowed() -> BorrowedQuality {
        BorrowedQuality {
            source: "m.json".into(),
            report: ModesReport {
                model: "smollm2-135m-instruct".into(),
                threads: 2,
                budget_bytes: 2 << 30,
                energy: String::new(),
                workloads: Vec::new(),
                cells: Vec::new(),
                quality: vec![
                    quality_row(Mode::F16, Some(0.5024), None),
                    quality_row(Mode::Int8, Some(0.5042), None),
                    quality_row(
                        Mode::PrefixCache,
                        Some(0.5024),
                        Some("all scores are f16's"),
                    ),
                    quality_row(Mode::Q4, None, None),
                ],
                notes: Vec::new(),
            },
        }
    }

    #[test]
    fn borrowed_quality_takes_the_rows_of_the_modes_asked_for() {
        let b = borrowed();
        let rows = b
            .rows(
                "smollm2-135m-instruct",
                &[Mode::PrefixCache, Mode::F16, Mode::Int8],
            )
            .unwrap();
        let got: Vec<(Mode, Option<f64>, Option<String>)> = rows
            .into_iter()
            .map(|r| (r.mode, r.bits_per_byte, r.note))
            .collect();
        assert_eq!(
            got,
            vec![
                (
                    Mode::PrefixCache,
                    Some(0.5024),
                    Some("from m.json: all scores are f16's".into())
                ),
                (Mode::F16, Some(0.5024), Some("from m.json".into())),
                (Mode::Int8, Some(0.5042), Some("from m.json".into())),
            ]
        );
    }

    #[test]
    fn borrowed_quality_refuses_another_model_and_missing_rows() {
        let b = borrowed();
        let e = b
            .rows("qwen2.5-coder-0.5b-instruct", &[Mode::F16])
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "m.json measured smollm2-135m-instruct, not qwen2.5-coder-0.5b-instruct: quality is borrowed only from the same model"
        );
        let e = b
            .rows("smollm2-135m-instruct", &[Mode::F16, Mode::Q4])
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "m.json has no quality row with bits per byte for q4"
        );
        let e = b
            .rows("smollm2-135m-instruct", &[Mode::Q4Gptq])
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "m.json has no quality row with bits per byte for q4-gptq"
        );
    }
}
