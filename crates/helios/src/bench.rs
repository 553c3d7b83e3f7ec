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
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use switchyard_engine::{EngineConfig, EngineCore, EngineHandle};
use switchyard_eval::sharegpt::Sample;
use switchyard_eval::stats::median;
use switchyard_eval::stats::Percentiles;
use switchyard_exits::ExitHeads;
use switchyard_models::{LayeredModel, LoadOptions};
use switchyard_request::SamplingParams;
use switchyard_tokenizer::Tokenizer;
use switchyard_weights::WeightSource;

use crate::manifest::{DepthTelemetry, ExitHeadsKind, Manifest, ModelEntry, Source};
use crate::orchestrator::Counters;
use crate::pht::Pht;
use crate::policy::{estimate, DepthRule, Evaluation, PolicyConfig, RemedyMode, Slo};
use crate::{HeliosError, Result};

pub mod drift;
mod report;
mod systems;

use systems::{run_ee_llm, run_helios, run_vanilla};

/// Prompts of the trace: enough for a re-profile at RI = 50 and the evaluation of three
/// candidates (15 requests), few enough for the batch-1 baseline on a small machine.
pub const DEFAULT_NUM_PROMPTS: usize = 100;
/// Thresholds of the ablation's sweep (the paper's Fig. 11 range).
pub const ABLATION_THRESHOLDS: &[f32] = &[0.6, 0.8, 0.9];
/// Re-profiling intervals of the ablation (the paper's Fig. 12).
pub const ABLATION_INTERVALS: &[usize] = &[50, 150, 250];
/// Confidence Breach Counter limits of the ablation (breaches per window of 100 tokens): half,
/// the paper's default, and one and a half times it.
pub const ABLATION_CBC_MAX: &[usize] = &[25, 50, 75];
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
        crate::shadow::candidate_heads(&self.entry, &self.path, model)
    }

    /// The entry's shadow scorer (no layer resident).
    pub fn scorer(&self) -> Result<crate::shadow::ShadowScorer> {
        crate::shadow::ShadowScorer::open(
            &self.entry,
            &self.path,
            Arc::clone(&self.source),
            Arc::clone(&self.tokenizer),
        )
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
    let exits = switchyard_exit_training::calibrate::exit_depths(
        n,
        switchyard_exit_training::calibrate::default_every(n),
    );
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
        tokenizer: None,
        context_length: None,
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
    /// Also run the ablations (remedy modes, RI, thresholds, CBCmax) on the same trace.
    pub ablation: bool,
    /// Also run HELIOS with serial evaluation (the paper's), beside the policy's own.
    pub serial: bool,
    /// Stationary trace: vanilla and HELIOS served this many times each, alternating, so
    /// that their throughput ratio is a median over pairs rather than one draw of this
    /// machine's noise (1: one run each).
    pub repeats: usize,
}

/// One alternating pair of the stationary trace's repeats.
#[derive(Debug, Clone, Serialize)]
pub struct RepeatPair {
    /// Which of the two ran first in this pair.
    pub first: String,
    pub vanilla_output_tokens_per_s: f64,
    pub helios_output_tokens_per_s: f64,
    pub helios_vs_vanilla_throughput: f64,
    pub vanilla_ttft_p99_s: f64,
    pub helios_ttft_p99_s: f64,
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
    /// From the request's arrival to its last token.
    pub latency_s: f64,
    /// When it was sent, and when it finished, from the run's start.
    pub arrival_s: f64,
    pub finished_s: f64,
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
    /// Waiting for the old model's requests before switches (`drain_first`).
    pub switch_drain_seconds: f64,
    pub switch_drained: u64,
    pub cbc_fired: u64,
    pub evaluation_requests: u64,
    pub shadow_rounds: u64,
    pub shadow_texts: u64,
    pub shadow_texts_skipped: u64,
    pub shadow_busy_seconds: f64,
    pub shadow_share_used: f64,
    pub shadow_peak_bytes: u64,
    pub shadow_change_points: u64,
    pub shadow_urgent_switches: u64,
    pub held_requests: u64,
    pub hold_seconds: f64,
    pub hold_timeouts: u64,
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
            switch_drain_seconds: c.switch_drain_seconds,
            switch_drained: c.switch_drained,
            cbc_fired: c.cbc_fired,
            evaluation_requests: c.evaluation_requests,
            shadow_rounds: c.shadow_rounds,
            shadow_texts: c.shadow_texts,
            shadow_texts_skipped: c.shadow_texts_skipped,
            shadow_busy_seconds: c.shadow_busy_seconds,
            shadow_share_used: c.shadow_share_used,
            shadow_peak_bytes: c.shadow_peak_bytes,
            shadow_change_points: c.shadow_change_points,
            shadow_urgent_switches: c.shadow_urgent_switches,
            held_requests: c.held_requests,
            hold_seconds: c.hold_seconds,
            hold_timeouts: c.hold_timeouts,
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
    pub cbc_max: usize,
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
    /// HELIOS with serial evaluation, when asked for beside a shadow run.
    pub helios_serial: Option<SystemReport>,
    pub helios_serial_vs_vanilla_throughput: Option<f64>,
    /// Shadow evaluation's rounds (empty under serial evaluation).
    pub shadow_rounds: Vec<crate::orchestrator::ShadowRound>,
    /// HELIOS output tokens/s over EE-LLM's and over vanilla's (the first pair's).
    pub helios_vs_ee_llm_throughput: f64,
    pub helios_vs_vanilla_throughput: f64,
    /// Every alternating pair of vanilla and HELIOS runs (the first is the one above), and
    /// the median of their throughput ratios.
    pub pairs: Vec<RepeatPair>,
    pub helios_vs_vanilla_throughput_median: f64,
    /// HELIOS's largest batch over EE-LLM's (1).
    pub helios_vs_ee_llm_batch: f64,
    /// 1 - HELIOS's TPOT P50 over EE-LLM's.
    pub helios_tpot_p50_reduction_vs_ee_llm: f64,
    pub pht: Pht,
    pub ablations: Vec<AblationRow>,
    pub seconds: f64,
}

/// A request of the trace.
#[derive(Debug, Clone)]
struct Job {
    text: String,
    /// Tokenized by the vanilla model's tokenizer.
    prompt: Vec<u32>,
    output_len: usize,
    /// The dataset's answer, scored by shadow evaluation as a reference.
    reference: Option<String>,
    /// Seconds after the run's start when the request is sent.
    arrival_s: f64,
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(n.max(1))
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
            reference: (!r.answer.is_empty()).then(|| r.answer.clone()),
            arrival_s: 0.0,
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
    on_phase(&format!("HELIOS ({:?} evaluation)", opts.policy.evaluation));
    let (mut helios, pht, shadow_rounds) = run_helios(ctx, &jobs, opts, &opts.policy)?;
    let mut helios_serial = None;
    let mut pht = pht;
    if opts.serial && opts.policy.evaluation != Evaluation::Serial {
        on_phase("HELIOS (serial evaluation)");
        let (s, serial_pht, _) = run_helios(ctx, &jobs, opts, &serial_policy(&opts.policy))?;
        helios_serial = Some(s);
        pht = serial_pht;
    }

    let pair = |first: &str, v: &SystemReport, h: &SystemReport| RepeatPair {
        first: first.to_string(),
        vanilla_output_tokens_per_s: v.output_tokens_per_s,
        helios_output_tokens_per_s: h.output_tokens_per_s,
        helios_vs_vanilla_throughput: h.output_tokens_per_s / v.output_tokens_per_s,
        vanilla_ttft_p99_s: v.ttft_s.p99,
        helios_ttft_p99_s: h.ttft_s.p99,
    };
    let mut pairs = vec![pair("vanilla", &vanilla, &helios)];
    for k in 1..opts.repeats.max(1) {
        on_phase(&format!("repeat {} of {}", k + 1, opts.repeats));
        // Alternate which system goes first, so that neither always runs on a warmer (or
        // busier) machine.
        let helios_first = k % 2 == 1;
        let (v, h) = if helios_first {
            let (h, _, _) = run_helios(ctx, &jobs, opts, &opts.policy)?;
            (run_vanilla(vanilla_c, &jobs, opts)?, h)
        } else {
            let v = run_vanilla(vanilla_c, &jobs, opts)?;
            (v, run_helios(ctx, &jobs, opts, &opts.policy)?.0)
        };
        pairs.push(pair(
            if helios_first { "HELIOS" } else { "vanilla" },
            &v,
            &h,
        ));
    }
    let ratios: Vec<f64> = pairs
        .iter()
        .map(|p| p.helios_vs_vanilla_throughput)
        .collect();
    let helios_vs_vanilla_throughput_median = median(&ratios);

    let full_bpb = vanilla.bits_per_byte;
    for s in [&mut vanilla, &mut ee, &mut helios]
        .into_iter()
        .chain(helios_serial.as_mut())
    {
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
                    ..serial_policy(&opts.policy)
                },
            ));
        }
        for &ri in ABLATION_INTERVALS {
            variants.push((
                format!("RI {ri}"),
                PolicyConfig {
                    reprofile_interval: ri,
                    ..serial_policy(&opts.policy)
                },
            ));
        }
        for &th in ABLATION_THRESHOLDS {
            variants.push((
                format!("threshold {th}"),
                PolicyConfig {
                    threshold: th,
                    ..serial_policy(&opts.policy)
                },
            ));
        }
        for &cbc_max in ABLATION_CBC_MAX {
            variants.push((
                format!("CBCmax {cbc_max}"),
                PolicyConfig {
                    cbc_max,
                    ..serial_policy(&opts.policy)
                },
            ));
        }
        for (label, policy) in variants {
            on_phase(&format!("ablation: {label}"));
            let (s, _, _) = run_helios(ctx, &jobs, opts, &policy)?;
            ablations.push(AblationRow {
                label,
                remedy: policy.remedy,
                reprofile_interval: policy.reprofile_interval,
                threshold: policy.threshold,
                cbc_max: policy.cbc_max,
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
        helios_serial_vs_vanilla_throughput: helios_serial
            .as_ref()
            .map(|s| s.output_tokens_per_s / vanilla.output_tokens_per_s),
        helios_serial,
        shadow_rounds,
        helios_vs_ee_llm_throughput: helios.output_tokens_per_s / ee.output_tokens_per_s,
        helios_vs_vanilla_throughput: helios.output_tokens_per_s / vanilla.output_tokens_per_s,
        pairs,
        helios_vs_vanilla_throughput_median,
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

/// The paper's loop: serial evaluation, the coverage depth rule, the rest of `p` as given
/// (the ablations vary its remedy, RI, threshold and CBCmax).
fn serial_policy(p: &PolicyConfig) -> PolicyConfig {
    PolicyConfig {
        evaluation: Evaluation::Serial,
        depth_rule: DepthRule::Coverage,
        ..p.clone()
    }
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
