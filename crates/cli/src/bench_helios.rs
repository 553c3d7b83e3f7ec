//! `switchyard bench helios`: one ShareGPT trace served by the best single model at full
//! depth, by the single-model EE-LLM baseline and by the HELIOS orchestrator, side by side.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use switchyard_engine::kv::parse_bytes;
use switchyard_engine::{EngineConfig, DEFAULT_MEMORY_BUDGET};
use switchyard_eval::sharegpt::{sample_requests, Sample, SampleOptions, DEFAULT_SEED};
use switchyard_helios::bench::drift::{run_drift, CodeSource, DriftOptions};
use switchyard_helios::bench::{
    best_single_model, entry_without_telemetry, run_bench_helios, BenchCandidate,
    HeliosBenchContext, HeliosBenchOptions, HeliosBenchReport, SystemReport, DEFAULT_NUM_PROMPTS,
};
use switchyard_helios::manifest::Manifest;
use switchyard_helios::policy::{
    DepthRule, Evaluation, Objective, PolicyConfig, RemedyMode, ShadowConfig, Slo,
};

use crate::load::resolve_text;
use crate::output::write_json;

#[derive(Args)]
#[command(group(clap::ArgGroup::new("repo").required(true).args(["manifest", "models"])))]
pub struct BenchHeliosArgs {
    /// The model repository: a manifest of candidates with their telemetry
    /// (`switchyard profile --json` writes it).
    #[arg(long, value_name = "FILE")]
    manifest: Option<PathBuf>,
    /// Candidates without a manifest (zoo names or paths): exits every n_layers/8 layers, no
    /// measured telemetry (the online evaluation measures them); the first is the vanilla model.
    #[arg(long, value_delimiter = ',')]
    models: Option<Vec<String>>,
    /// A ShareGPT JSON file, or the zoo dataset's name.
    #[arg(long, default_value = "sharegpt")]
    dataset: String,
    /// The trace: stationary (ShareGPT prompts, all at once, vanilla and EE-LLM beside
    /// HELIOS) or drift (prose, code, prose with Poisson arrivals, every candidate alone
    /// beside HELIOS and the hindsight oracle).
    #[arg(long, default_value = "stationary", value_parser = ["stationary", "drift"])]
    trace: String,
    /// Drift trace: requests per phase.
    #[arg(long, default_value_t = switchyard_helios::bench::drift::DEFAULT_PER_PHASE)]
    per_phase: usize,
    /// Drift trace: the code phase's prompts (HumanEval problems, executed for pass@1, or
    /// ShareGPT prompts carrying code).
    #[arg(long, default_value = "humaneval", value_parser = ["humaneval", "sharegpt"])]
    code: String,
    /// Drift trace: output tokens of a HumanEval request (its completion is cut at the end of
    /// generation and HumanEval's stop sequences).
    #[arg(long, default_value_t = 128)]
    code_max_tokens: usize,
    /// Drift trace: requests per second of the Poisson arrivals.
    #[arg(long, default_value_t = 0.5)]
    request_rate: f64,
    #[arg(long, default_value_t = DEFAULT_NUM_PROMPTS)]
    num_prompts: usize,
    /// Seed of the dataset shuffle.
    #[arg(long, default_value_t = DEFAULT_SEED)]
    seed: u64,
    /// Bytes for each system, e.g. 2GiB: vanilla's engine, the baseline, and HELIOS's
    /// candidate engines together (equal shares under serial evaluation; under shadow
    /// evaluation the budget follows the serving engine, the others parked).
    #[arg(long, value_parser = parse_budget)]
    memory_budget: Option<u64>,
    /// Exit confidence threshold of HELIOS and of the EE-LLM baseline.
    #[arg(long, default_value_t = switchyard_helios::policy::DEFAULT_THRESHOLD)]
    threshold: f32,
    /// Requests of the online evaluation per candidate.
    #[arg(long, default_value_t = switchyard_helios::policy::DEFAULT_EVAL_REQUESTS)]
    eval_requests: usize,
    /// Re-profile every RI requests.
    #[arg(long, default_value_t = switchyard_helios::policy::DEFAULT_REPROFILE_INTERVAL)]
    reprofile_interval: usize,
    /// Confidence Breach Counter limit (breaches in its window of 100 tokens).
    #[arg(long, default_value_t = switchyard_helios::policy::CBC_MAX)]
    cbc_max: usize,
    /// What a breach may do: dynamic, extend-only or switch-only.
    #[arg(long, default_value = "dynamic", value_parser = ["dynamic", "extend-only", "switch-only"])]
    remedy: String,
    /// The SLO's objective: throughput, latency or energy.
    #[arg(long, default_value = "throughput", value_parser = ["throughput", "latency", "energy"])]
    objective: String,
    /// The SLO's quality bound: bits per byte at most this much above the repository's best
    /// full-depth model (no bound when omitted). It also bounds the vanilla model's choice.
    #[arg(long, value_name = "BITS")]
    max_bits_per_byte_increase: Option<f64>,
    /// Requests the batch-1 EE-LLM baseline serves (the first of the trace; all when omitted).
    #[arg(long)]
    baseline_prompts: Option<usize>,
    /// Caps every request's output tokens (the dataset answer's length otherwise).
    #[arg(long)]
    max_tokens: Option<usize>,
    /// How HELIOS evaluates candidates: shadow (teacher-forced scoring of sampled prompts
    /// beside serving) or serial (the paper's blocks of requests per candidate).
    #[arg(long, default_value = "shadow", value_parser = ["shadow", "serial"])]
    evaluation: String,
    /// Also run HELIOS with serial evaluation beside the shadow run.
    #[arg(long)]
    serial: bool,
    /// Stationary trace: serve vanilla and HELIOS this many times each, alternating which
    /// goes first, and report the median of their throughput ratios.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=100))]
    repeats: u64,
    /// Most share of the wall time shadow scoring computes.
    #[arg(long, default_value_t = ShadowConfig::default().share)]
    shadow_share: f64,
    /// Sampled prompts per shadow scoring round.
    #[arg(long, default_value_t = ShadowConfig::default().round)]
    shadow_round: usize,
    /// Scored prompts a shadow decision reads (a sliding window over the rounds).
    #[arg(long, default_value_t = ShadowConfig::default().window)]
    shadow_window: usize,
    /// One request in this many has its prompt scored.
    #[arg(long, default_value_t = ShadowConfig::default().sample_every)]
    shadow_sample_every: usize,
    /// Most bytes of each scored prompt.
    #[arg(long, default_value_t = ShadowConfig::default().max_text_bytes)]
    shadow_max_bytes: usize,
    /// Rounds that must agree before HELIOS serves a new choice.
    #[arg(long, default_value_t = ShadowConfig::default().switch_after)]
    shadow_switch_after: usize,
    /// Exit depths read every this many scored positions (full depth reads all).
    #[arg(long, default_value_t = ShadowConfig::default().exit_stride)]
    shadow_exit_stride: usize,
    /// Bits per byte by which a candidate's distance from the best one must move between the
    /// window and the newest round for the traffic to count as changed (the window restarts,
    /// and a choice breaking the bound on the new traffic is left at once); 0 turns it off.
    #[arg(long, default_value_t = ShadowConfig::default().change_margin.unwrap_or(0.0))]
    shadow_change_margin: f64,
    /// Milliseconds a sampled request arriving while the scorer is idle waits for its own
    /// prompt's round before it is routed (0: never held).
    #[arg(long, default_value_t = ShadowConfig::default().hold_ms)]
    shadow_hold_ms: u64,
    /// At a switch to another model, let the serving model finish its running requests and
    /// release its layers before the new one loads (the two are never resident together).
    #[arg(long)]
    shadow_drain_first: bool,
    /// Do not score the trace's reference answers in the shadow (they are reported, never
    /// used to choose, and double the scoring work).
    #[arg(long)]
    shadow_skip_references: bool,
    /// Depth rule: quality-bound (shallowest depth within the bits-per-byte bound) or
    /// coverage (HELIOS's exit-histogram rule).
    #[arg(long, default_value = "quality-bound", value_parser = ["quality-bound", "coverage"])]
    depth_rule: String,
    /// Also run HELIOS switch-only / extend-only / dynamic, RI 50/150/250, thresholds
    /// 0.6/0.8/0.9 and CBCmax 25/50/75 on the same trace.
    #[arg(long)]
    ablation: bool,
    /// Write the result as JSON to FILE (stdout when omitted).
    #[arg(long, value_name = "FILE", num_args = 0..=1)]
    json: Option<Option<PathBuf>>,
    /// Write the Markdown tables to FILE.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
    /// Draw PNG charts into DIR.
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
}

fn parse_budget(s: &str) -> Result<u64, String> {
    parse_bytes(s).map_err(|e| e.to_string())
}

fn remedy(s: &str) -> RemedyMode {
    match s {
        "extend-only" => RemedyMode::ExtendOnly,
        "switch-only" => RemedyMode::SwitchOnly,
        _ => RemedyMode::Dynamic,
    }
}

fn objective(s: &str) -> Objective {
    match s {
        "latency" => Objective::Latency,
        "energy" => Objective::Energy,
        _ => Objective::Throughput,
    }
}

pub fn run(a: BenchHeliosArgs, threads: usize) -> anyhow::Result<()> {
    let (repo, first) = match (&a.manifest, &a.models) {
        (Some(path), _) => (Manifest::load(path)?, None),
        (None, Some(names)) => {
            let entries = names
                .iter()
                .map(|n| entry_without_telemetry(n).with_context(|| format!("opening {n}")))
                .collect::<anyhow::Result<Vec<_>>>()?;
            (Manifest::new(entries, "--models")?, names.first().cloned())
        }
        (None, None) => anyhow::bail!("give --manifest FILE or --models a,b,c"),
    };
    let candidates = repo
        .models()
        .iter()
        .filter_map(|m| BenchCandidate::open(m).transpose())
        .collect::<Result<Vec<_>, _>>()?;
    let budget = a.memory_budget.unwrap_or(DEFAULT_MEMORY_BUDGET);
    let slo = Slo {
        objective: objective(&a.objective),
        max_bits_per_byte_increase: a.max_bits_per_byte_increase,
        ..Slo::default()
    };
    let vanilla = match first {
        Some(f) => f,
        None => best_single_model(&repo, &slo, budget)
            .map(|m| m.name.clone())
            .ok_or_else(|| anyhow::anyhow!("the repository has no local model"))?,
    };
    let vanilla_c = candidates
        .iter()
        .find(|c| c.entry.name == vanilla)
        .ok_or_else(|| anyhow::anyhow!("{vanilla} is not a local model"))?;
    if a.trace == "drift" {
        return run_drift_trace(&a, &repo, &candidates, budget, slo, threads);
    }
    let data = resolve_text(&a.dataset)?;
    eprintln!(
        "sampling {} prompts from {} with {}'s tokenizer",
        a.num_prompts,
        data.display(),
        vanilla
    );
    let sample = sample_requests(
        &data,
        &vanilla_c.tokenizer,
        &SampleOptions {
            num_prompts: a.num_prompts,
            seed: a.seed,
        },
    )?;
    let opts = options(&a, budget, slo, Some(vanilla));
    let ctx = HeliosBenchContext {
        repo: &repo,
        candidates: &candidates,
        dataset: &a.dataset,
        sample: &sample,
        threads,
    };
    let r = run_bench_helios(&ctx, &opts, |phase| eprintln!("running {phase}"))?;
    summary(&r);
    let md = r.markdown();
    if let Some(p) = &a.markdown {
        std::fs::write(p, &md).with_context(|| format!("writing {}", p.display()))?;
    } else {
        eprintln!("\n{md}");
    }
    if let Some(dir) = &a.plot {
        for p in r.plot(dir)? {
            eprintln!("wrote {}", p.display());
        }
    }
    write_json(&a.json, &r)
}

/// The drift trace's run and report.
fn run_drift_trace(
    a: &BenchHeliosArgs,
    repo: &Manifest,
    candidates: &[BenchCandidate],
    budget: u64,
    slo: Slo,
    threads: usize,
) -> anyhow::Result<()> {
    let opts = options(a, budget, slo, None);
    let sample = Sample {
        requests: Vec::new(),
        records: 0,
        truncated: false,
        examined: 0,
    };
    let ctx = HeliosBenchContext {
        repo,
        candidates,
        dataset: &a.dataset,
        sample: &sample,
        threads,
    };
    let d = DriftOptions {
        per_phase: a.per_phase,
        request_rate: a.request_rate,
        seed: a.seed,
        max_tokens: a.max_tokens.unwrap_or(128),
        code: match a.code.as_str() {
            "sharegpt" => CodeSource::ShareGpt,
            _ => CodeSource::HumanEval,
        },
        code_max_tokens: a.code_max_tokens,
    };
    let r = run_drift(&ctx, &opts, &d, |phase| eprintln!("running {phase}"))?;
    let md = r.markdown();
    if let Some(p) = &a.markdown {
        std::fs::write(p, &md).with_context(|| format!("writing {}", p.display()))?;
    }
    eprintln!("\n{md}");
    if let Some(dir) = &a.plot {
        for p in r.plot(dir)? {
            eprintln!("wrote {}", p.display());
        }
    }
    write_json(&a.json, &r)
}

fn options(
    a: &BenchHeliosArgs,
    budget: u64,
    slo: Slo,
    vanilla: Option<String>,
) -> HeliosBenchOptions {
    HeliosBenchOptions {
        memory_budget: budget,
        engine: EngineConfig::default(),
        policy: PolicyConfig {
            threshold: a.threshold,
            eval_requests: a.eval_requests,
            reprofile_interval: a.reprofile_interval,
            cbc_max: a.cbc_max,
            remedy: remedy(&a.remedy),
            evaluation: if a.evaluation == "serial" {
                Evaluation::Serial
            } else {
                Evaluation::Shadow
            },
            depth_rule: if a.depth_rule == "coverage" {
                DepthRule::Coverage
            } else {
                DepthRule::QualityBound
            },
            shadow: ShadowConfig {
                share: a.shadow_share,
                round: a.shadow_round,
                window: a.shadow_window,
                sample_every: a.shadow_sample_every,
                max_text_bytes: a.shadow_max_bytes,
                switch_after: a.shadow_switch_after,
                references: !a.shadow_skip_references,
                exit_stride: a.shadow_exit_stride,
                change_margin: (a.shadow_change_margin > 0.0).then_some(a.shadow_change_margin),
                hold_ms: a.shadow_hold_ms,
                drain_first: a.shadow_drain_first,
            },
            ..PolicyConfig::default()
        },
        slo,
        vanilla,
        baseline_prompts: a.baseline_prompts,
        max_tokens: a.max_tokens,
        ablation: a.ablation,
        serial: a.serial,
        repeats: a.repeats as usize,
    }
}

fn summary(r: &HeliosBenchReport) {
    let line = |s: &SystemReport| {
        eprintln!(
            "{}: {} requests, {} output tokens in {:.1} s: {:.2} tokens/s; TPOT P50 {:.1} ms, P99 {:.1} ms; {:.1}% at the earliest exit, {:.1}% at full depth; largest batch {}; {:.4} bits/byte ({:+.4} vs full)",
            s.system,
            s.requests,
            s.output_tokens,
            s.duration_s,
            s.output_tokens_per_s,
            s.tpot_s.p50 * 1e3,
            s.tpot_s.p99 * 1e3,
            100.0 * s.earliest_exit_share,
            100.0 * s.full_depth_share,
            s.largest_batch,
            s.bits_per_byte,
            s.bits_per_byte_vs_full
        )
    };
    line(&r.vanilla);
    line(&r.ee_llm);
    line(&r.helios);
    if let Some(s) = &r.helios_serial {
        line(s);
    }
    if let Some(d) = &r.helios.decisions {
        if d.shadow_rounds > 0 {
            eprintln!(
                "shadow scoring: {} rounds, {:.1} s computing, {:.1}% of its time, {} switches",
                d.shadow_rounds,
                d.shadow_busy_seconds,
                100.0 * d.shadow_share_used,
                d.switches
            );
        }
    }
}
