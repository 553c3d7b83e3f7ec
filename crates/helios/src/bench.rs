//! `bench helios`: one ShareGPT trace (vLLM's filters), one memory budget, one machine, served
//! three ways in the same run:
//!
//! * **vanilla**: the best single model of the repository at full depth, on the serving
//!   engine with continuous batching and the whole budget;
//! * **EE-LLM**: the same model under per-token early exit (every layer loaded, the exit
//!   decided per token by the confidence threshold, K/V of skipped layers recomputed) at
//!   batch 1, the single-model baseline HELIOS is measured against;
//! * **HELIOS**: the orchestrator over the repository's local candidates, each engine inside
//!   an equal share of the budget (as the server runs it).
//!
//! Every request arrives at the start of its run (vLLM's offline throughput benchmark) and
//! generates exactly the dataset answer's length, greedily, end of generation ignored. TTFT and
//! latency count from that start, so queueing is part of them: batch 1 queues every request
//! behind the ones before it. TPOT is each request's time per output token after its first.
//!
//! Quality is bits per byte of the generated text under the distribution each token was
//! sampled from: `-Σ log₂ p(token) / bytes`, the log-probabilities the engine (or the
//! early-exit decoder) reports at the depth that emitted the token, over the UTF-8 bytes of
//! the output text. It is the measure the online evaluation puts into the PHT, comparable
//! across tokenizers; "vs full depth" subtracts vanilla's, the best single model at full depth
//! on the same prompts.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use switchyard_bench::offline::Percentiles;
use switchyard_bench::sharegpt::Sample;
use switchyard_bench::stats::{median, percentile};
use switchyard_engine::{
    Completion, EngineConfig, EngineCore, EngineHandle, EngineRequest, EngineStats, RequestStream,
};
use switchyard_exits::baseline::{generate_early_exit, EeContext};
use switchyard_exits::plot::{fonts_available, line_chart, Chart, Series};
use switchyard_exits::{ConfidenceMeasure, ExitHeads, ExitPolicy, KvFix};
use switchyard_models::{LayeredModel, LoadOptions};
use switchyard_request::SamplingParams;
use switchyard_tokenizer::Tokenizer;
use switchyard_weights::WeightSource;

use crate::manifest::{DepthTelemetry, ExitHeadsKind, Manifest, ModelEntry, Source};
use crate::orchestrator::{
    CandidateEngine, Counters, HeliosOutput, HeliosPrompt, HeliosRequest, HeliosStream,
    Orchestrator,
};
use crate::pht::Pht;
use crate::policy::{estimate, Policy, PolicyConfig, RemedyMode, Slo};
use crate::{HeliosError, Result};

/// Prompts of the trace: enough for a re-profile at RI = 50 and the evaluation of three
/// candidates (15 requests), few enough for the batch-1 baseline on a small machine.
pub const DEFAULT_NUM_PROMPTS: usize = 100;
/// Thresholds of the ablation's sweep (the paper's Fig. 11 range).
pub const ABLATION_THRESHOLDS: &[f32] = &[0.6, 0.8, 0.9];
/// Re-profiling intervals of the ablation (the paper's Fig. 12).
pub const ABLATION_INTERVALS: &[usize] = &[50, 150, 250];
/// Weight bytes per second assumed to turn a model's size into a prior throughput when the
/// repository has no measured telemetry (`--models`): decoding reads every weight once per
/// token; the online evaluation replaces the prior with measurements.
pub const PRIOR_BYTES_PER_S: f64 = 10e9;
/// How often the engines' stats are sampled during a run (peaks of memory).
const STATS_EVERY: Duration = Duration::from_millis(100);
/// Sleep between polls of the output streams.
const POLL: Duration = Duration::from_millis(2);
/// Prompt tokens and output tokens of the warm-up request each engine serves first.
const WARM_UP: (usize, usize) = (16, 4);

/// One candidate of the repository, opened (weights and tokenizer) but not loaded.
pub struct BenchCandidate {
    pub entry: ModelEntry,
    pub path: PathBuf,
    pub source: Arc<dyn WeightSource>,
    pub tokenizer: Arc<Tokenizer>,
}

impl BenchCandidate {
    /// Opens a local entry (a zoo name or a path); `None` for a remote one.
    pub fn open(entry: &ModelEntry) -> Result<Option<Self>> {
        let Source::Local { path } = entry.source() else {
            return Ok(None);
        };
        let path = switchyard_zoo::resolve_model(path)?;
        let source =
            switchyard_weights::open(&path).map_err(switchyard_models::ModelError::from)?;
        let tokenizer = Arc::new(Tokenizer::from_source(&*source)?);
        Ok(Some(Self {
            entry: entry.clone(),
            path,
            source,
            tokenizer,
        }))
    }

    /// Every layer loaded.
    fn load(&self) -> Result<LayeredModel> {
        Ok(LayeredModel::load(
            Arc::clone(&self.source),
            &LoadOptions::default(),
        )?)
    }

    /// The entry's exit heads: calibrated ones beside the model file, or the logit lens.
    fn heads(&self, model: &LayeredModel) -> Result<ExitHeads> {
        Ok(match self.entry.exit_heads {
            Some(ExitHeadsKind::Tuned) => {
                let fp = switchyard_exits::fingerprint::fingerprint(&self.path)?;
                let file = switchyard_exits::file::default_heads_path(&self.path);
                switchyard_exits::file::load(&file, model, &fp)?
            }
            _ => ExitHeads::logit_lens(model, &self.entry.name, &self.entry.exit_layers)?,
        })
    }

    /// A serving engine with the entry's exit heads inside `budget` bytes.
    fn engine(&self, cfg: &EngineConfig) -> Result<EngineHandle> {
        let model = self.load()?;
        let heads = self.heads(&model)?;
        let eog = switchyard_engine::end_of_generation_tokens(&self.tokenizer);
        let core = EngineCore::with_exit(model, Box::new(heads), eog, cfg.clone())?;
        Ok(EngineHandle::spawn(
            core,
            Arc::clone(&self.tokenizer),
            &self.entry.name,
        )?)
    }
}

/// A repository entry for a model with no measured telemetry (`--models`): exits every
/// `n_layers / 8` layers (logit lens, or calibrated heads when their file sits beside the
/// model), memory per depth from the tensor shapes, and a prior throughput of
/// [`PRIOR_BYTES_PER_S`] over that memory; bits per byte 1.0 at every depth, so no depth
/// looks better than another until the online evaluation measures them.
pub fn entry_without_telemetry(name: &str) -> Result<ModelEntry> {
    let path = switchyard_zoo::resolve_model(name)?;
    let source = switchyard_weights::open(&path).map_err(switchyard_models::ModelError::from)?;
    let one = LoadOptions {
        layers: Some(1),
        ..LoadOptions::default()
    };
    let model = LayeredModel::load(source, &one)?;
    let n = model.n_layers();
    let exits =
        switchyard_exits::calibrate::exit_depths(n, switchyard_exits::calibrate::default_every(n));
    let r = model.resident_bytes();
    let base = (r.embedding + r.head) as u64;
    let kv_row = model.spec().kv_row_len();
    let tuned = switchyard_exits::file::default_heads_path(&path).is_file();
    let depths = exits
        .iter()
        .copied()
        .chain(std::iter::once(n))
        .map(|d| {
            let memory = base + (0..d).map(|l| model.layer_bytes(l) as u64).sum::<u64>();
            DepthTelemetry {
                depth: d,
                tokens_per_s: PRIOR_BYTES_PER_S / memory.max(1) as f64,
                ttft_ms: None,
                bits_per_byte: 1.0,
                memory_bytes: memory,
                kv_bytes_per_token: Some((2 * kv_row * 4 * d) as u64),
                joules_per_token: None,
            }
        })
        .collect::<Vec<_>>();
    let size = depths.last().map_or(base, |t| t.memory_bytes);
    Ok(ModelEntry {
        name: name.to_string(),
        path: Some(name.to_string()),
        url: None,
        remote_model: None,
        size_bytes: size,
        layers: n,
        exit_layers: exits,
        exit_heads: Some(if tuned {
            ExitHeadsKind::Tuned
        } else {
            ExitHeadsKind::LogitLens
        }),
        profile: None,
        depths,
    })
}

/// The best single local model at full depth by the repository's telemetry under `slo`,
/// among those whose full depth fits `budget` (and the SLO's quality bound); the first local
/// model when none does.
pub fn best_single_model<'a>(repo: &'a Manifest, slo: &Slo, budget: u64) -> Option<&'a ModelEntry> {
    let local: Vec<&ModelEntry> = repo.models().iter().filter(|m| !m.is_remote()).collect();
    let max_bpb = slo
        .max_bits_per_byte_increase
        .map(|d| repo.best_full_depth_bits_per_byte() + d);
    let mut points: Vec<(&ModelEntry, estimate::OperatingPoint)> = local
        .iter()
        .filter_map(|m| Some((*m, estimate::offline(m, m.layers)?)))
        .filter(|(_, p)| p.memory_bytes <= budget && max_bpb.is_none_or(|b| p.bits_per_byte <= b))
        .collect();
    points.sort_by(|a, b| estimate::compare(&a.1, &b.1, slo.objective, false));
    points.first().map(|(m, _)| *m).or(local.first().copied())
}

#[derive(Debug, Clone)]
pub struct HeliosBenchOptions {
    /// Bytes for everything: vanilla's engine, the baseline's model and K/V, the sum of the
    /// orchestrator's candidate engines.
    pub memory_budget: u64,
    /// The engines' configuration (its `memory_budget` is replaced per system).
    pub engine: EngineConfig,
    /// The orchestrator's policy; its `threshold` is also the baseline's.
    pub policy: PolicyConfig,
    pub slo: Slo,
    /// The vanilla model's name (the best single model by telemetry when `None`).
    pub vanilla: Option<String>,
    /// Requests of the trace the batch-1 baseline serves (all when `None`).
    pub baseline_prompts: Option<usize>,
    /// Caps every request's output length (the dataset answer's length when `None`).
    pub max_tokens: Option<usize>,
    /// Also run the ablations (remedy modes, RI, thresholds) on the same trace.
    pub ablation: bool,
}

/// What the benchmark runs on: the repository, its opened local candidates, and the trace
/// sampled with the vanilla model's tokenizer ([`best_single_model`]).
pub struct HeliosBenchContext<'a> {
    pub repo: &'a Manifest,
    pub candidates: &'a [BenchCandidate],
    pub dataset: &'a str,
    pub sample: &'a Sample,
    pub threads: usize,
}

/// One request as a system served it.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    pub model: String,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    #[serde(skip)]
    pub token_ids: Vec<u32>,
    /// Layers run for each output token.
    #[serde(skip)]
    pub depths: Vec<usize>,
    pub output_bytes: usize,
    /// `-Σ ln p` of the output tokens.
    pub output_nats: f64,
    pub ttft_s: Option<f64>,
    pub tpot_s: Option<f64>,
    pub latency_s: f64,
}

/// Tokens one model emitted at one depth.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DepthCount {
    pub model: String,
    pub depth: usize,
    pub layers: usize,
    pub tokens: u64,
}

/// HELIOS's decisions and what they cost.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Decisions {
    pub profiles: u64,
    pub profile_seconds: f64,
    pub reprofiles: u64,
    pub extends: u64,
    pub extend_seconds: f64,
    pub switches: u64,
    pub switch_seconds: f64,
    pub switch_drained: u64,
    pub cbc_fired: u64,
    pub evaluation_requests: u64,
}

impl From<&Counters> for Decisions {
    fn from(c: &Counters) -> Self {
        Self {
            profiles: c.profiles,
            profile_seconds: c.profile_seconds,
            reprofiles: c.reprofiles,
            extends: c.extends,
            extend_seconds: c.extend_seconds,
            switches: c.switches,
            switch_seconds: c.switch_seconds,
            switch_drained: c.switch_drained,
            cbc_fired: c.cbc_fired,
            evaluation_requests: c.evaluation_requests,
        }
    }
}

/// One system over the trace.
#[derive(Debug, Clone, Serialize)]
pub struct SystemReport {
    pub system: String,
    pub requests: usize,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    /// From the first submission to the last output.
    pub duration_s: f64,
    pub output_tokens_per_s: f64,
    pub ttft_s: Percentiles,
    pub tpot_s: Percentiles,
    pub latency_s: Percentiles,
    /// Output tokens emitted at the serving model's earliest exit layer, and at its full depth.
    pub tokens_at_earliest_exit: u64,
    pub tokens_at_full_depth: u64,
    pub earliest_exit_share: f64,
    pub full_depth_share: f64,
    /// Mean of depth / layers over output tokens.
    pub mean_depth_fraction: f64,
    pub depth_counts: Vec<DepthCount>,
    /// Output tokens per serving model.
    pub tokens_by_model: BTreeMap<String, u64>,
    /// Most sequences in one step.
    pub largest_batch: usize,
    /// Peak of weights + K/V in use + workspace (summed over the engines), sampled.
    pub peak_resident_bytes: u64,
    pub peak_weights_bytes: u64,
    pub peak_kv_used_bytes: u64,
    pub memory_budget_bytes: u64,
    pub output_bytes: u64,
    pub output_nats: f64,
    pub bits_per_byte: f64,
    /// `bits_per_byte` minus vanilla's.
    pub bits_per_byte_vs_full: f64,
    /// Output tokens equal to vanilla's at the same position of the same request (only when
    /// the system ran vanilla's model).
    pub tokens_equal_to_vanilla: Option<u64>,
    pub decisions: Option<Decisions>,
    pub per_request: Vec<RequestRecord>,
}

/// One ablation run of HELIOS over the same trace.
#[derive(Debug, Clone, Serialize)]
pub struct AblationRow {
    pub label: String,
    pub remedy: RemedyMode,
    pub reprofile_interval: usize,
    pub threshold: f32,
    pub output_tokens_per_s: f64,
    pub tpot_p50_s: f64,
    pub tpot_p99_s: f64,
    pub earliest_exit_share: f64,
    pub full_depth_share: f64,
    pub bits_per_byte: f64,
    pub bits_per_byte_vs_full: f64,
    pub largest_batch: usize,
    pub decisions: Decisions,
}

#[derive(Debug, Clone, Serialize)]
pub struct HeliosBenchReport {
    pub dataset: String,
    pub dataset_records: usize,
    pub threads: usize,
    pub memory_budget_bytes: u64,
    pub threshold: f32,
    pub candidates: Vec<String>,
    pub vanilla_model: String,
    pub policy: PolicyConfig,
    pub slo: Slo,
    pub vanilla: SystemReport,
    pub ee_llm: SystemReport,
    pub helios: SystemReport,
    /// HELIOS output tokens/s over EE-LLM's and over vanilla's.
    pub helios_vs_ee_llm_throughput: f64,
    pub helios_vs_vanilla_throughput: f64,
    /// HELIOS's largest batch over EE-LLM's (1).
    pub helios_vs_ee_llm_batch: f64,
    /// 1 - HELIOS's TPOT P50 over EE-LLM's.
    pub helios_tpot_p50_reduction_vs_ee_llm: f64,
    pub pht: Pht,
    pub ablations: Vec<AblationRow>,
    pub seconds: f64,
}

/// A request of the trace.
struct Job {
    text: String,
    /// Tokenized by the vanilla model's tokenizer.
    prompt: Vec<u32>,
    output_len: usize,
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(n.max(1))
    }
}

fn percentiles(xs: &[f64]) -> Percentiles {
    let mean = if xs.is_empty() {
        f64::NAN
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    };
    Percentiles {
        mean,
        p50: median(xs),
        p99: percentile(xs, 99.0),
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Runs vanilla, the EE-LLM baseline and HELIOS (then the ablations) on the trace.
/// `on_phase(label)` before each run.
pub fn run_bench_helios(
    ctx: &HeliosBenchContext<'_>,
    opts: &HeliosBenchOptions,
    mut on_phase: impl FnMut(&str),
) -> Result<HeliosBenchReport> {
    let t0 = Instant::now();
    opts.policy.validate()?;
    opts.slo.validate()?;
    let vanilla_name = match &opts.vanilla {
        Some(v) => v.clone(),
        None => best_single_model(ctx.repo, &opts.slo, opts.memory_budget)
            .map(|m| m.name.clone())
            .ok_or_else(|| HeliosError::Config("the repository has no local model".into()))?,
    };
    let vanilla_c = ctx
        .candidates
        .iter()
        .find(|c| c.entry.name == vanilla_name)
        .ok_or_else(|| {
            HeliosError::Config(format!("{vanilla_name} is not an opened local candidate"))
        })?;
    let jobs: Vec<Job> = ctx
        .sample
        .requests
        .iter()
        .map(|r| Job {
            text: r.prompt.clone(),
            prompt: r.prompt_tokens.clone(),
            output_len: opts
                .max_tokens
                .map_or(r.output_len, |m| r.output_len.min(m)),
        })
        .collect();
    if jobs.is_empty() {
        return Err(HeliosError::Config("no request passed the filters".into()));
    }

    on_phase(&format!("vanilla ({vanilla_name}, full depth)"));
    let mut vanilla = run_vanilla(vanilla_c, &jobs, opts)?;
    on_phase(&format!("EE-LLM baseline ({vanilla_name}, batch 1)"));
    let n_base = opts.baseline_prompts.unwrap_or(jobs.len()).min(jobs.len());
    let mut ee = run_ee_llm(vanilla_c, &jobs[..n_base], opts)?;
    on_phase("HELIOS");
    let (mut helios, pht) = run_helios(ctx, &jobs, opts, &opts.policy)?;

    let full_bpb = vanilla.bits_per_byte;
    for s in [&mut vanilla, &mut ee, &mut helios] {
        s.bits_per_byte_vs_full = s.bits_per_byte - full_bpb;
    }
    ee.tokens_equal_to_vanilla = Some(equal_tokens(&ee.per_request, &vanilla.per_request));
    vanilla.tokens_equal_to_vanilla = Some(vanilla.output_tokens as u64);
    helios.tokens_equal_to_vanilla = None;

    let mut ablations = Vec::new();
    if opts.ablation {
        let mut variants: Vec<(String, PolicyConfig)> = Vec::new();
        for (name, mode) in [
            ("switch-only", RemedyMode::SwitchOnly),
            ("extend-only", RemedyMode::ExtendOnly),
            ("dynamic", RemedyMode::Dynamic),
        ] {
            variants.push((
                name.into(),
                PolicyConfig {
                    remedy: mode,
                    ..opts.policy.clone()
                },
            ));
        }
        for &ri in ABLATION_INTERVALS {
            variants.push((
                format!("RI {ri}"),
                PolicyConfig {
                    reprofile_interval: ri,
                    ..opts.policy.clone()
                },
            ));
        }
        for &th in ABLATION_THRESHOLDS {
            variants.push((
                format!("threshold {th}"),
                PolicyConfig {
                    threshold: th,
                    ..opts.policy.clone()
                },
            ));
        }
        for (label, policy) in variants {
            on_phase(&format!("ablation: {label}"));
            let (s, _) = run_helios(ctx, &jobs, opts, &policy)?;
            ablations.push(AblationRow {
                label,
                remedy: policy.remedy,
                reprofile_interval: policy.reprofile_interval,
                threshold: policy.threshold,
                output_tokens_per_s: s.output_tokens_per_s,
                tpot_p50_s: s.tpot_s.p50,
                tpot_p99_s: s.tpot_s.p99,
                earliest_exit_share: s.earliest_exit_share,
                full_depth_share: s.full_depth_share,
                bits_per_byte: s.bits_per_byte,
                bits_per_byte_vs_full: s.bits_per_byte - full_bpb,
                largest_batch: s.largest_batch,
                decisions: s.decisions.clone().unwrap_or_default(),
            });
        }
    }

    Ok(HeliosBenchReport {
        dataset: ctx.dataset.to_string(),
        dataset_records: ctx.sample.records,
        threads: ctx.threads,
        memory_budget_bytes: opts.memory_budget,
        threshold: opts.policy.threshold,
        candidates: ctx
            .candidates
            .iter()
            .map(|c| c.entry.name.clone())
            .collect(),
        vanilla_model: vanilla_name,
        policy: opts.policy.clone(),
        slo: opts.slo.clone(),
        helios_vs_ee_llm_throughput: helios.output_tokens_per_s / ee.output_tokens_per_s,
        helios_vs_vanilla_throughput: helios.output_tokens_per_s / vanilla.output_tokens_per_s,
        helios_vs_ee_llm_batch: helios.largest_batch as f64 / ee.largest_batch.max(1) as f64,
        helios_tpot_p50_reduction_vs_ee_llm: 1.0 - helios.tpot_s.p50 / ee.tpot_s.p50,
        vanilla,
        ee_llm: ee,
        helios,
        pht,
        ablations,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Output tokens equal, position by position, to the reference's same request.
fn equal_tokens(a: &[RequestRecord], reference: &[RequestRecord]) -> u64 {
    a.iter()
        .zip(reference)
        .map(|(x, y)| {
            x.token_ids
                .iter()
                .zip(&y.token_ids)
                .filter(|(p, q)| p == q)
                .count() as u64
        })
        .sum()
}

/// Peaks of the memory stats over a run.
#[derive(Debug, Clone, Copy, Default)]
struct MemoryPeaks {
    resident: u64,
    weights: u64,
    kv_used: u64,
}

impl MemoryPeaks {
    /// Records one sample: the stats of every engine at about the same time.
    fn sample(&mut self, stats: &[EngineStats]) {
        let sum = |f: fn(&EngineStats) -> u64| stats.iter().map(f).sum::<u64>();
        self.resident = self.resident.max(sum(|s| {
            s.memory.weights_bytes + s.memory.kv_used_bytes + s.memory.workspace_bytes
        }));
        self.weights = self.weights.max(sum(|s| s.memory.weights_bytes));
        self.kv_used = self.kv_used.max(sum(|s| s.memory.kv_used_bytes));
    }
}

fn sample_stats(engines: &[EngineHandle], peaks: &mut MemoryPeaks) -> Result<()> {
    let stats = engines
        .iter()
        .map(|h| Ok(h.stats().wait()?))
        .collect::<Result<Vec<_>>>()?;
    peaks.sample(&stats);
    Ok(())
}

fn warm_up(h: &EngineHandle, job: &Job) -> Result<()> {
    h.add_request(EngineRequest {
        prompt: job.prompt.iter().copied().take(WARM_UP.0).collect(),
        params: greedy(WARM_UP.1),
    })?
    .wait()?;
    Ok(())
}

fn record(model: &str, c: &Completion, depths: Vec<usize>, t0: Instant) -> RequestRecord {
    RequestRecord {
        model: model.to_string(),
        prompt_tokens: c.prompt_tokens,
        output_tokens: c.token_ids.len(),
        token_ids: c.token_ids.clone(),
        depths,
        output_bytes: c.text.len(),
        output_nats: -c.logprobs.iter().map(|&l| f64::from(l)).sum::<f64>(),
        ttft_s: c
            .first_token_at
            .map(|t| secs(t.saturating_duration_since(t0))),
        tpot_s: c.tpot().map(secs),
        latency_s: secs(c.finished_at.saturating_duration_since(t0)),
    }
}

/// The best single model at full depth with continuous batching and the whole budget.
fn run_vanilla(
    c: &BenchCandidate,
    jobs: &[Job],
    opts: &HeliosBenchOptions,
) -> Result<SystemReport> {
    let cfg = EngineConfig {
        memory_budget: opts.memory_budget,
        ..opts.engine.clone()
    };
    let h = EngineHandle::start(c.load()?, Arc::clone(&c.tokenizer), cfg, &c.entry.name)?;
    warm_up(&h, &jobs[0])?;
    let engines = [h.clone()];
    let mut peaks = MemoryPeaks::default();
    let t0 = Instant::now();
    let mut streams = jobs
        .iter()
        .map(|j| {
            Ok(h.add_request(EngineRequest {
                prompt: j.prompt.clone(),
                params: greedy(j.output_len),
            })?)
        })
        .collect::<Result<Vec<RequestStream>>>()?;
    let mut outputs = vec![Vec::new(); streams.len()];
    let mut done = vec![false; streams.len()];
    let mut n_done = 0;
    let mut last_stats = Instant::now();
    sample_stats(&engines, &mut peaks)?;
    while n_done < streams.len() {
        let mut any = false;
        for (i, s) in streams.iter_mut().enumerate() {
            while !done[i] {
                let Some(o) = s.try_next() else { break };
                let o = o?;
                any = true;
                done[i] = o.finish_reason.is_some();
                n_done += usize::from(done[i]);
                outputs[i].push(o);
            }
        }
        if last_stats.elapsed() >= STATS_EVERY {
            sample_stats(&engines, &mut peaks)?;
            last_stats = Instant::now();
        }
        if !any {
            std::thread::sleep(POLL);
        }
    }
    let end = h.stats().wait()?;
    h.shutdown().wait()?;
    let layers = c.entry.layers;
    let per_request = outputs
        .into_iter()
        .map(|o| {
            let c2 = Completion::gather(o)
                .ok_or_else(|| HeliosError::Orchestrator("a stream ended early".into()))?;
            Ok(record(
                &c.entry.name,
                &c2,
                vec![layers; c2.token_ids.len()],
                t0,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let earliest = c.entry.exit_layers.first().copied().unwrap_or(layers);
    Ok(system_report(
        "vanilla",
        per_request,
        &|_| (earliest, layers),
        Resources {
            largest_batch: end.counters.largest_batch,
            peaks,
            budget: opts.memory_budget,
            decisions: None,
        },
    ))
}

/// Per-token early exit on every layer of the model, one request after the other.
fn run_ee_llm(c: &BenchCandidate, jobs: &[Job], opts: &HeliosBenchOptions) -> Result<SystemReport> {
    let model = c.load()?;
    let heads = c.heads(&model)?;
    let policy = ExitPolicy {
        threshold: opts.policy.threshold,
        measure: ConfidenceMeasure::MaxProb,
        depths: heads.depths(),
    };
    let ee = EeContext {
        model: &model,
        heads: &heads,
        policy: &policy,
        fix: KvFix::Recompute,
    };
    let tok = &c.tokenizer;
    let warm: Vec<u32> = jobs[0].prompt.iter().copied().take(WARM_UP.0).collect();
    generate_early_exit(&ee, tok, &warm, &greedy(WARM_UP.1), |_| {})?;
    let layers = model.n_layers();
    let kv_row_bytes = (2 * model.spec().kv_row_len() * 4 * layers) as u64;
    let weights = model.resident_bytes().total() as u64;
    let mut longest = 0usize;
    let t0 = Instant::now();
    let mut per_request = Vec::with_capacity(jobs.len());
    for j in jobs {
        let start = Instant::now();
        let g = generate_early_exit(&ee, tok, &j.prompt, &greedy(j.output_len), |_| {})?;
        let end = Instant::now();
        longest = longest.max(j.prompt.len() + g.tokens.len());
        let ttft = secs(start.saturating_duration_since(t0)) + g.prompt_secs;
        per_request.push(RequestRecord {
            model: c.entry.name.clone(),
            prompt_tokens: g.prompt_tokens,
            output_tokens: g.tokens.len(),
            output_bytes: g.text.len(),
            output_nats: -g.logprobs.iter().map(|&l| f64::from(l)).sum::<f64>(),
            ttft_s: (!g.tokens.is_empty()).then_some(ttft),
            tpot_s: (g.tokens.len() > 1).then(|| g.decode_secs / (g.tokens.len() - 1) as f64),
            latency_s: secs(end.saturating_duration_since(t0)),
            token_ids: g.tokens,
            depths: g.depths,
        });
    }
    let kv = kv_row_bytes * longest as u64;
    let peaks = MemoryPeaks {
        resident: weights + kv,
        weights,
        kv_used: kv,
    };
    let earliest = heads.depths().first().copied().unwrap_or(layers);
    Ok(system_report(
        "EE-LLM",
        per_request,
        &|_| (earliest, layers),
        Resources {
            largest_batch: 1,
            peaks,
            budget: opts.memory_budget,
            decisions: None,
        },
    ))
}

/// The orchestrator over every opened candidate, each engine in an equal share of the budget.
fn run_helios(
    ctx: &HeliosBenchContext<'_>,
    jobs: &[Job],
    opts: &HeliosBenchOptions,
    policy: &PolicyConfig,
) -> Result<(SystemReport, Pht)> {
    let share = opts.memory_budget / ctx.candidates.len().max(1) as u64;
    let cfg = EngineConfig {
        memory_budget: share,
        ..opts.engine.clone()
    };
    let mut engines = Vec::with_capacity(ctx.candidates.len());
    for c in ctx.candidates {
        let h = c.engine(&cfg)?;
        let warm: Vec<u32> = c
            .tokenizer
            .encode(&jobs[0].text, true, false)?
            .into_iter()
            .take(WARM_UP.0)
            .collect();
        h.add_request(EngineRequest {
            prompt: warm,
            params: greedy(WARM_UP.1),
        })?
        .wait()?;
        engines.push(CandidateEngine {
            name: c.entry.name.clone(),
            handle: h,
        });
    }
    let handles: Vec<EngineHandle> = engines.iter().map(|e| e.handle.clone()).collect();
    let policy = Policy::new(policy.clone(), opts.slo.clone(), share)?;
    let o = Orchestrator::start(ctx.repo.clone(), policy, engines)?;
    let result = drive_helios(&o, &handles, jobs);
    let stats = o.stats_blocking();
    o.shutdown_blocking();
    let ends = handles
        .iter()
        .map(|h| Ok(h.stats().wait()?))
        .collect::<Result<Vec<_>>>();
    for h in &handles {
        let _ = h.shutdown().wait();
    }
    let (per_request, peaks) = result?;
    let stats = stats?;
    let ends = ends?;
    // The warm-up's batch of one is below any run's largest batch, so it does not count.
    let largest_batch = ends
        .iter()
        .map(|e| e.counters.largest_batch)
        .max()
        .unwrap_or(0);
    let depths = |m: &str| {
        ctx.repo.get(m).map_or((usize::MAX, usize::MAX), |e| {
            (e.exit_layers.first().copied().unwrap_or(e.layers), e.layers)
        })
    };
    let report = system_report(
        "HELIOS",
        per_request,
        &depths,
        Resources {
            largest_batch,
            peaks,
            budget: opts.memory_budget,
            decisions: Some(Decisions::from(&stats.counters)),
        },
    );
    Ok((report, stats.pht))
}

/// Submits every job at once and reads every stream to its end.
fn drive_helios(
    o: &Orchestrator,
    engines: &[EngineHandle],
    jobs: &[Job],
) -> Result<(Vec<RequestRecord>, MemoryPeaks)> {
    let mut peaks = MemoryPeaks::default();
    let t0 = Instant::now();
    let mut streams = jobs
        .iter()
        .map(|j| {
            o.submit(HeliosRequest {
                prompt: HeliosPrompt::Text(j.text.clone()),
                params: greedy(j.output_len),
            })
        })
        .collect::<Result<Vec<HeliosStream>>>()?;
    let mut outputs: Vec<Vec<HeliosOutput>> = vec![Vec::new(); streams.len()];
    let mut done = vec![false; streams.len()];
    let mut n_done = 0;
    let mut last_stats = Instant::now();
    sample_stats(engines, &mut peaks)?;
    while n_done < streams.len() {
        let mut any = false;
        for (i, s) in streams.iter_mut().enumerate() {
            while !done[i] {
                let Some(out) = s.try_next() else { break };
                let out = out?;
                any = true;
                done[i] = out.output.finish_reason.is_some();
                n_done += usize::from(done[i]);
                outputs[i].push(out);
            }
        }
        if last_stats.elapsed() >= STATS_EVERY {
            sample_stats(engines, &mut peaks)?;
            last_stats = Instant::now();
        }
        if !any {
            std::thread::sleep(POLL);
        }
    }
    let records = outputs
        .into_iter()
        .map(|outs| {
            let model = outs
                .first()
                .map(|o| o.model.to_string())
                .unwrap_or_default();
            let depths: Vec<usize> = outs
                .iter()
                .flat_map(|o| std::iter::repeat_n(o.output.depth, o.output.token_ids.len()))
                .collect();
            let c = Completion::gather(outs.into_iter().map(|o| o.output))
                .ok_or_else(|| HeliosError::Orchestrator("a stream ended early".into()))?;
            Ok(record(&model, &c, depths, t0))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((records, peaks))
}

/// What a system held and decided over its run.
struct Resources {
    largest_batch: usize,
    peaks: MemoryPeaks,
    budget: u64,
    decisions: Option<Decisions>,
}

/// Sums a system's requests into its report. `depths(model)`: the serving model's earliest
/// exit layer and its layer count.
fn system_report(
    system: &str,
    per_request: Vec<RequestRecord>,
    depths: &dyn Fn(&str) -> (usize, usize),
    res: Resources,
) -> SystemReport {
    let layers = |m: &str| depths(m).1;
    let output_tokens: usize = per_request.iter().map(|r| r.output_tokens).sum();
    let prompt_tokens: usize = per_request.iter().map(|r| r.prompt_tokens).sum();
    let duration = per_request.iter().map(|r| r.latency_s).fold(0.0, f64::max);
    let mut counts: BTreeMap<(String, usize), u64> = BTreeMap::new();
    let mut by_model: BTreeMap<String, u64> = BTreeMap::new();
    let (mut at_earliest, mut at_full, mut depth_frac) = (0u64, 0u64, 0f64);
    for r in &per_request {
        let (e, n) = depths(&r.model);
        for &d in &r.depths {
            *counts.entry((r.model.clone(), d)).or_default() += 1;
            at_earliest += u64::from(d == e);
            at_full += u64::from(d == n);
            depth_frac += d as f64 / n.max(1) as f64;
        }
        *by_model.entry(r.model.clone()).or_default() += r.output_tokens as u64;
    }
    let share = |x: u64| x as f64 / output_tokens.max(1) as f64;
    let output_bytes: u64 = per_request.iter().map(|r| r.output_bytes as u64).sum();
    let output_nats: f64 = per_request.iter().map(|r| r.output_nats).sum();
    let col = |f: fn(&RequestRecord) -> Option<f64>| -> Vec<f64> {
        per_request.iter().filter_map(f).collect()
    };
    SystemReport {
        system: system.to_string(),
        requests: per_request.len(),
        prompt_tokens,
        output_tokens,
        duration_s: duration,
        output_tokens_per_s: output_tokens as f64 / duration,
        ttft_s: percentiles(&col(|r| r.ttft_s)),
        tpot_s: percentiles(&col(|r| r.tpot_s)),
        latency_s: percentiles(&col(|r| Some(r.latency_s))),
        tokens_at_earliest_exit: at_earliest,
        tokens_at_full_depth: at_full,
        earliest_exit_share: share(at_earliest),
        full_depth_share: share(at_full),
        mean_depth_fraction: depth_frac / output_tokens.max(1) as f64,
        depth_counts: counts
            .into_iter()
            .map(|((model, depth), tokens)| DepthCount {
                layers: layers(&model),
                model,
                depth,
                tokens,
            })
            .collect(),
        tokens_by_model: by_model,
        largest_batch: res.largest_batch,
        peak_resident_bytes: res.peaks.resident,
        peak_weights_bytes: res.peaks.weights,
        peak_kv_used_bytes: res.peaks.kv_used,
        memory_budget_bytes: res.budget,
        output_bytes,
        output_nats,
        bits_per_byte: if output_bytes == 0 {
            0.0
        } else {
            output_nats / std::f64::consts::LN_2 / output_bytes as f64
        },
        bits_per_byte_vs_full: 0.0,
        tokens_equal_to_vanilla: None,
        decisions: res.decisions,
        per_request,
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

impl HeliosBenchReport {
    /// The systems side by side, then HELIOS's decisions and the ablations.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "### HELIOS vs EE-LLM vs vanilla: candidates {}, vanilla {}, {} prompts of {}, budget {:.0} MiB, threshold {}, {} threads\n",
            self.candidates.join(", "),
            self.vanilla_model,
            self.vanilla.requests,
            self.dataset,
            mib(self.memory_budget_bytes),
            self.threshold,
            self.threads
        );
        let _ = writeln!(s, "| system | requests | output tokens | tokens/s | TTFT mean / P50 / P99 (s) | TPOT mean / P50 / P99 (ms) | earliest exit | full depth | largest batch | peak resident (MiB) | bits/byte | Δ vs full |");
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|");
        for r in [&self.vanilla, &self.ee_llm, &self.helios] {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.2} | {:.2} / {:.2} / {:.2} | {:.1} / {:.1} / {:.1} | {:.1}% | {:.1}% | {} | {:.1} | {:.4} | {:+.4} |",
                r.system,
                r.requests,
                r.output_tokens,
                r.output_tokens_per_s,
                r.ttft_s.mean,
                r.ttft_s.p50,
                r.ttft_s.p99,
                r.tpot_s.mean * 1e3,
                r.tpot_s.p50 * 1e3,
                r.tpot_s.p99 * 1e3,
                100.0 * r.earliest_exit_share,
                100.0 * r.full_depth_share,
                r.largest_batch,
                mib(r.peak_resident_bytes),
                r.bits_per_byte,
                r.bits_per_byte_vs_full
            );
        }
        let _ = writeln!(
            s,
            "\nHELIOS / EE-LLM: {:.2}x output tokens/s, {:.1}x largest batch, TPOT P50 {:+.1}%; HELIOS / vanilla: {:.2}x output tokens/s.",
            self.helios_vs_ee_llm_throughput,
            self.helios_vs_ee_llm_batch,
            -100.0 * self.helios_tpot_p50_reduction_vs_ee_llm,
            self.helios_vs_vanilla_throughput
        );
        if let Some(d) = &self.helios.decisions {
            let _ = writeln!(
                s,
                "\nHELIOS decisions: {} profiles ({} re-profiles, {:.3} s of loads and decisions), {} extends ({:.3} s), {} switches ({:.3} s, {} sequences drained), CBC fired {} times; {} evaluation requests.",
                d.profiles,
                d.reprofiles,
                d.profile_seconds,
                d.extends,
                d.extend_seconds,
                d.switches,
                d.switch_seconds,
                d.switch_drained,
                d.cbc_fired,
                d.evaluation_requests
            );
        }
        let by_model: Vec<String> = self
            .helios
            .tokens_by_model
            .iter()
            .map(|(m, t)| format!("{m}: {t}"))
            .collect();
        let _ = writeln!(s, "HELIOS output tokens by model: {}.", by_model.join(", "));
        if let Some(eq) = self.ee_llm.tokens_equal_to_vanilla {
            let _ = writeln!(
                s,
                "EE-LLM tokens equal to vanilla's at the same position: {eq} of {}.",
                self.ee_llm.output_tokens
            );
        }
        let _ = writeln!(
            s,
            "\nBits per byte: −Σ log₂ p of the generated tokens, p from the distribution each token was sampled from (the depth that emitted it), over the UTF-8 bytes of the generated text; Δ vs full subtracts vanilla's (the best single model at full depth, same prompts). Every request arrives at the start (TTFT and latency include queueing); EE-LLM serves one request at a time with every layer loaded, its resident memory the weights plus the K/V of its longest sequence."
        );
        if !self.ablations.is_empty() {
            let _ = writeln!(s, "\n#### Ablations (same trace)\n");
            let _ = writeln!(s, "| variant | tokens/s | TPOT P50 / P99 (ms) | earliest exit | full depth | bits/byte | Δ vs full | largest batch | profiles | extends | switches |");
            let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|");
            for a in &self.ablations {
                let _ = writeln!(
                    s,
                    "| {} | {:.2} | {:.1} / {:.1} | {:.1}% | {:.1}% | {:.4} | {:+.4} | {} | {} | {} | {} |",
                    a.label,
                    a.output_tokens_per_s,
                    a.tpot_p50_s * 1e3,
                    a.tpot_p99_s * 1e3,
                    100.0 * a.earliest_exit_share,
                    100.0 * a.full_depth_share,
                    a.bits_per_byte,
                    a.bits_per_byte_vs_full,
                    a.largest_batch,
                    a.decisions.profiles,
                    a.decisions.extends,
                    a.decisions.switches
                );
            }
        }
        s
    }

    /// PNG charts into `dir`: latency and TTFT distributions per system, the cumulative
    /// share of tokens by depth (as a fraction of the serving model's layers), and, with
    /// ablations, tokens/s against threshold and against RI.
    pub fn plot(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir).map_err(|source| HeliosError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let text = fonts_available();
        let systems = [&self.vanilla, &self.ee_llm, &self.helios];
        let mut written = Vec::new();
        let cdf = |f: fn(&RequestRecord) -> Option<f64>| -> Vec<Series> {
            systems
                .iter()
                .map(|r| {
                    let mut xs: Vec<f64> = r.per_request.iter().filter_map(f).collect();
                    xs.sort_by(f64::total_cmp);
                    let n = xs.len().max(1) as f64;
                    Series {
                        name: r.system.clone(),
                        points: xs
                            .iter()
                            .enumerate()
                            .map(|(i, &x)| (x, (i + 1) as f64 / n))
                            .collect(),
                    }
                })
                .collect()
        };
        for (file, title, x_label, f) in [
            (
                "latency.png",
                "Request latency",
                "seconds from the start",
                (|r: &RequestRecord| Some(r.latency_s)) as fn(&RequestRecord) -> Option<f64>,
            ),
            ("ttft.png", "Time to first token", "seconds", |r| r.ttft_s),
            ("tpot.png", "Time per output token", "seconds", |r| r.tpot_s),
        ] {
            let series = cdf(f);
            let x_max = series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| p.0))
                .fold(0.0, f64::max);
            let path = dir.join(file);
            line_chart(
                &path,
                &Chart {
                    title,
                    x_label,
                    y_label: "share of requests",
                    x: (0.0, x_max.max(1e-3) * 1.05),
                    y: (0.0, 1.0),
                    series: &series,
                    legend: plotters::prelude::SeriesLabelPosition::LowerRight,
                },
                text,
            )?;
            written.push(path);
        }
        let depth_series: Vec<Series> = systems
            .iter()
            .map(|r| {
                let mut fr: Vec<(f64, u64)> = r
                    .depth_counts
                    .iter()
                    .map(|c| (c.depth as f64 / c.layers.max(1) as f64, c.tokens))
                    .collect();
                fr.sort_by(|a, b| a.0.total_cmp(&b.0));
                let total = r.output_tokens.max(1) as f64;
                let mut acc = 0u64;
                Series {
                    name: r.system.clone(),
                    points: fr
                        .into_iter()
                        .map(|(x, t)| {
                            acc += t;
                            (x, acc as f64 / total)
                        })
                        .collect(),
                }
            })
            .collect();
        let path = dir.join("depth.png");
        line_chart(
            &path,
            &Chart {
                title: "Tokens by exit depth",
                x_label: "depth / layers of the serving model",
                y_label: "cumulative share of tokens",
                x: (0.0, 1.05),
                y: (0.0, 1.05),
                series: &depth_series,
                legend: plotters::prelude::SeriesLabelPosition::UpperLeft,
            },
            text,
        )?;
        written.push(path);
        let sweep = |prefix: &str, x: fn(&AblationRow) -> f64| -> Vec<(f64, f64)> {
            self.ablations
                .iter()
                .filter(|a| a.label.starts_with(prefix))
                .map(|a| (x(a), a.output_tokens_per_s))
                .collect()
        };
        for (file, title, x_label, prefix, x) in [
            (
                "ablation-threshold.png",
                "HELIOS tokens/s by confidence threshold",
                "threshold",
                "threshold",
                (|a: &AblationRow| f64::from(a.threshold)) as fn(&AblationRow) -> f64,
            ),
            (
                "ablation-ri.png",
                "HELIOS tokens/s by re-profiling interval",
                "RI (requests)",
                "RI",
                |a| a.reprofile_interval as f64,
            ),
        ] {
            let points = sweep(prefix, x);
            if points.is_empty() {
                continue;
            }
            let (x_lo, x_hi) = points
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), p| {
                    (l.min(p.0), h.max(p.0))
                });
            let y_hi = points.iter().map(|p| p.1).fold(0.0, f64::max);
            let pad = ((x_hi - x_lo) * 0.05).max(1e-3);
            let path = dir.join(file);
            line_chart(
                &path,
                &Chart {
                    title,
                    x_label,
                    y_label: "output tokens/s",
                    x: (x_lo - pad, x_hi + pad),
                    y: (0.0, y_hi.max(1e-3) * 1.1),
                    series: &[Series {
                        name: "HELIOS".into(),
                        points,
                    }],
                    legend: plotters::prelude::SeriesLabelPosition::LowerRight,
                },
                text,
            )?;
            written.push(path);
        }
        Ok(written)
    }
}
