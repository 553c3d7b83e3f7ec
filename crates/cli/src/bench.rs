//! `switchyard bench engine`.

use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use switchyard_bench::engine::{bench_engine, EngineBenchOptions};
use switchyard_models::LoadOptions;

use crate::load::load_model;
use crate::output::write_json;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Prompt and decode tokens/s at batch 1 (median of several runs).
    Engine(EngineArgs),
    /// Where a batched decode step's time goes (products by kind, attention, K/V writes, LM
    /// head, sampling, scheduling, output) at several batches and contexts, beside this
    /// machine's read bandwidth and int8 throughput.
    Step(StepArgs),
    /// GFLOP/s and GB/s of the quantized kernels (scalar reference, candle, ours) on every
    /// tensor type and shape of the zoo's models.
    Kernels(KernelsArgs),
    /// The EE-LLM baseline (per-token early exit) vs full depth: tokens/s, exit depths, bits
    /// per byte.
    Exits(crate::exits::BenchExitsArgs),
    /// ShareGPT prompts through the serving engine: throughput and latency with continuous
    /// batching vs batch 1, largest batch, memory by category.
    Offline(crate::offline::OfflineArgs),
    /// Any OpenAI-compatible server under vLLM's serving benchmark: TTFT, TPOT, ITL, E2E,
    /// throughput and goodput at a request rate.
    Serve(crate::bench_serve::ServeArgs),
    /// A running server held under ShareGPT traffic for a bounded time, with an optional
    /// overload burst: requests sent, completed and failed by reason, resident memory over
    /// time and its growth, K/V blocks after the drain, P50/P99 latency per window, 429s with
    /// Retry-After and the time back to normal latency after the burst.
    Soak(crate::bench_soak::SoakArgs),
    /// One ShareGPT trace served by the best single model at full depth, by the EE-LLM
    /// baseline (per-token exit, batch 1) and by the HELIOS orchestrator: throughput, latency
    /// percentiles, exit shares, batch, memory, bits per byte, decisions.
    Helios(crate::bench_helios::BenchHeliosArgs),
    /// The mode × workload matrix of one model: every inference mode (precisions,
    /// speculative, self-speculative, prefix cache, chunked prefill, continuous batching,
    /// compressed K/V, hybrids) on SS/SL/LS/LL, shared-prefix, memory-pressure and batch
    /// workloads: latency, throughput, energy, peak memory, quality.
    Modes(crate::bench_modes::BenchModesArgs),
    /// One mixed workload served by fixed f16, the rule router, learned routers (decision
    /// tree, random forest, logistic regression) and the oracle, over a `bench modes` matrix.
    Router(crate::bench_modes::BenchRouterArgs),
}

#[derive(Args)]
pub struct EngineArgs {
    #[arg(long, default_value = switchyard_zoo::DEFAULT_MODEL)]
    model: String,
    #[arg(long, default_value_t = switchyard_bench::engine::DEFAULT_PROMPT_TOKENS)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = switchyard_bench::engine::DEFAULT_DECODE_TOKENS)]
    decode_tokens: usize,
    #[arg(long, default_value_t = switchyard_bench::engine::DEFAULT_RUNS)]
    runs: usize,
    /// Run only the first N layers and read logits there (fixed-depth decoding).
    #[arg(long)]
    depth: Option<usize>,
    /// Write the result as JSON to FILE (stdout when omitted).
    #[arg(long, value_name = "FILE", num_args = 0..=1)]
    json: Option<Option<std::path::PathBuf>>,
}

pub fn run(cmd: BenchCommand, threads: usize) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Engine(a) => engine(a, threads),
        BenchCommand::Step(a) => step(a, threads),
        BenchCommand::Kernels(a) => kernels(a, threads),
        BenchCommand::Exits(a) => crate::exits::run_bench_exits(a, threads),
        BenchCommand::Offline(a) => crate::offline::run(a, threads),
        BenchCommand::Serve(a) => crate::bench_serve::run(a),
        BenchCommand::Soak(a) => crate::bench_soak::run(a),
        BenchCommand::Helios(a) => crate::bench_helios::run(a, threads),
        BenchCommand::Modes(a) => crate::bench_modes::run(a, threads),
        BenchCommand::Router(a) => crate::bench_modes::run_router(a, threads),
    }
}

fn engine(a: EngineArgs, threads: usize) -> anyhow::Result<()> {
    let opts = LoadOptions {
        layers: a.depth,
        ..LoadOptions::default()
    };
    let loaded = load_model(&a.model, &opts)?;
    let bar = ProgressBar::new(a.runs as u64).with_style(
        ProgressStyle::with_template("bench {bar:30} run {pos}/{len} ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let bopts = EngineBenchOptions {
        prompt_tokens: a.prompt_tokens,
        decode_tokens: a.decode_tokens,
        runs: a.runs,
        depth: a.depth,
    };
    let r = bench_engine(
        &loaded.model,
        &loaded.tokenizer,
        &loaded.name,
        &bopts,
        threads,
        |i, _| bar.set_position(i as u64),
    )?;
    bar.finish_and_clear();
    eprintln!(
        "{} ({} threads, depth {}/{}, {} kernels): prompt {} tokens: {:.1} tokens/s | decode {} tokens: {:.1} tokens/s (median of {}) | LM head {:.2} ms = {:.0}% of a decode step",
        r.model, r.threads, r.depth, r.n_layers, r.kernels, r.prompt_tokens, r.prompt_tokens_per_s, r.decode_tokens, r.decode_tokens_per_s, r.runs, r.lm_head_ms, 100.0 * r.lm_head_share_of_decode_step
    );
    write_json(&a.json, &r)
}

#[derive(Args)]
pub struct StepArgs {
    #[arg(long, default_value = switchyard_zoo::DEFAULT_MODEL)]
    model: String,
    /// Sequences decoding together.
    #[arg(long, value_delimiter = ',', default_values_t = switchyard_bench::step::DEFAULT_BATCHES.to_vec())]
    batches: Vec<usize>,
    /// Prompt tokens each sequence holds when its decode steps are measured.
    #[arg(long, value_delimiter = ',', default_values_t = switchyard_bench::step::DEFAULT_CONTEXTS.to_vec())]
    contexts: Vec<usize>,
    /// Decode steps averaged per cell.
    #[arg(long, default_value_t = switchyard_bench::step::DEFAULT_STEPS)]
    steps: usize,
    /// K/V cache format: f16 (the engine's default), f32 or int8.
    #[arg(long, default_value = "f16")]
    kv_format: switchyard_engine::KvFormat,
    /// Bytes the engine may hold, e.g. 8GiB.
    #[arg(long, default_value = "8GiB", value_parser = parse_budget)]
    memory_budget: u64,
    /// Write the result as JSON to FILE (stdout when omitted).
    #[arg(long, value_name = "FILE", num_args = 0..=1)]
    json: Option<Option<std::path::PathBuf>>,
    /// Write the Markdown table to FILE.
    #[arg(long, value_name = "FILE")]
    markdown: Option<std::path::PathBuf>,
    /// Draw `step.png` into DIR.
    #[arg(long, value_name = "DIR")]
    plot: Option<std::path::PathBuf>,
}

fn parse_budget(s: &str) -> Result<u64, String> {
    switchyard_engine::kv::parse_bytes(s).map_err(|e| e.to_string())
}

fn step(a: StepArgs, threads: usize) -> anyhow::Result<()> {
    let path = switchyard_zoo::resolve_model(&a.model)?;
    let source = switchyard_weights::open(&path)?;
    let tokenizer = std::sync::Arc::new(switchyard_tokenizer::Tokenizer::from_source(&*source)?);
    let load = || {
        Ok(switchyard_models::LayeredModel::load(
            std::sync::Arc::clone(&source),
            &LoadOptions::default(),
        )?)
    };
    let opts = switchyard_bench::step::StepBenchOptions {
        batches: a.batches,
        contexts: a.contexts,
        steps: a.steps,
        memory_budget: a.memory_budget,
        kv_format: a.kv_format,
    };
    let r = switchyard_bench::step::bench_step(&load, &tokenizer, &a.model, threads, &opts, |c| {
        eprintln!("bench step: {c}")
    })?;
    let md = r.markdown();
    eprintln!("{md}");
    if let Some(p) = &a.markdown {
        std::fs::write(p, &md)?;
    }
    if let Some(dir) = &a.plot {
        let png = r.plot(dir)?;
        eprintln!("wrote {}", png.display());
    }
    write_json(&a.json, &r)
}

#[derive(Args)]
pub struct KernelsArgs {
    /// Models whose tensor shapes to measure (zoo names or GGUF paths).
    #[arg(long, value_delimiter = ',', default_values_t = ["smollm2-135m-instruct".to_string(), "gemma3-270m".to_string(), "qwen2.5-coder-0.5b-instruct".to_string(), "qwen2.5-coder-1.5b-instruct".to_string()])]
    models: Vec<String>,
    /// Activation rows per product.
    #[arg(long, value_delimiter = ',', default_values_t = switchyard_bench::kernels::DEFAULT_ROWS)]
    rows: Vec<usize>,
    /// Write the result as JSON to FILE (stdout when omitted).
    #[arg(long, value_name = "FILE", num_args = 0..=1)]
    json: Option<Option<std::path::PathBuf>>,
}

fn kernels(a: KernelsArgs, threads: usize) -> anyhow::Result<()> {
    use switchyard_bench::kernels::{bench_case, level_name, model_shapes, KernelReport};
    let models = a
        .models
        .iter()
        .map(|m| Ok((m.clone(), switchyard_zoo::resolve_model(m)?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let shapes = model_shapes(&models)?;
    let bar = ProgressBar::new((shapes.len() * a.rows.len()) as u64).with_style(
        ProgressStyle::with_template("kernels {bar:30} {pos}/{len} cases ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut cases = Vec::new();
    for s in &shapes {
        let path = models
            .iter()
            .find(|(m, _)| *m == s.model)
            .map(|(_, p)| p.clone())
            .ok_or_else(|| anyhow::anyhow!("no file for {}", s.model))?;
        for &rows in &a.rows {
            cases.push(bench_case(&path, s, rows)?);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    eprintln!(
        "{:<6} {:>7} {:>6} {:>5} | {:>8} {:>8} {:>8} {:>8} GFLOP/s | {:>6} GB/s | x candle",
        "type", "out", "in", "rows", "scalar", "candle", "deq+gemm", "ours", "ours"
    );
    for c in &cases {
        eprintln!(
            "{:<6} {:>7} {:>6} {:>5} | {:>8.1} {:>8.1} {:>8.1} {:>8.1}         | {:>6.1}      | {:>5.2}",
            c.shape.dtype,
            c.shape.out_features,
            c.shape.in_features,
            c.rows,
            c.scalar_reference.gflops,
            c.candle.gflops,
            c.dequantize_then_gemm.gflops,
            c.switchyard.gflops,
            c.switchyard.weight_gb_per_s,
            c.speedup_vs_candle
        );
    }
    let report = KernelReport {
        simd_level: level_name().to_string(),
        threads,
        cases,
    };
    write_json(&a.json, &report)
}
