//! `switchyard bench offline`: ShareGPT prompts through the serving engine (continuous
//! batching vs batch 1 in the same run, latency, largest batch, memory by category).

use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use switchyard_bench::offline::{
    run_offline, OfflineContext, OfflineOptions, OfflineReport, RunReport, DEFAULT_BATCH1_PROMPTS,
    DEFAULT_NUM_PROMPTS, DEFAULT_SYSTEM_PROMPT,
};
use switchyard_engine::kv::parse_bytes;
use switchyard_engine::scheduler::{
    AdmissionPolicy, DEFAULT_MAX_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS,
};
use switchyard_engine::{EngineConfig, SchedulerConfig, DEFAULT_MEMORY_BUDGET};
use switchyard_eval::sharegpt::{sample_requests, SampleOptions, DEFAULT_SEED};
use switchyard_tokenizer::Tokenizer;

use crate::load::resolve_text;
use crate::output::write_json;

#[derive(Args)]
pub struct OfflineArgs {
    #[arg(long, default_value = switchyard_zoo::DEFAULT_MODEL)]
    model: String,
    /// A ShareGPT JSON file, or the zoo dataset's name.
    #[arg(long, default_value = "sharegpt")]
    dataset: String,
    #[arg(long, default_value_t = DEFAULT_NUM_PROMPTS)]
    num_prompts: usize,
    /// Seed of the dataset shuffle.
    #[arg(long, default_value_t = DEFAULT_SEED)]
    seed: u64,
    /// Bytes for weights + KV cache + activations, e.g. 1GiB (default 2GiB).
    #[arg(long, value_parser = parse_budget)]
    memory_budget: Option<u64>,
    /// Load and run only the first D layers.
    #[arg(long)]
    max_depth: Option<usize>,
    /// K/V cache format: f32, f16 or int8 (the engine's default when omitted).
    #[arg(long)]
    kv_format: Option<switchyard_engine::KvFormat>,
    /// Token budget of one engine step.
    #[arg(long, default_value_t = DEFAULT_MAX_BATCHED_TOKENS)]
    max_batched_tokens: usize,
    /// Most sequences running at once.
    #[arg(long, default_value_t = DEFAULT_MAX_NUM_SEQS)]
    max_num_seqs: usize,
    /// Prompts the batch-1 baseline serves (0: no baseline).
    #[arg(long, default_value_t = DEFAULT_BATCH1_PROMPTS)]
    batch1_prompts: usize,
    /// Put every prompt in the chat template under a shared system message (the built-in
    /// one of about 200 tokens when TEXT is omitted): the prefix-caching workload.
    #[arg(long, value_name = "TEXT", num_args = 0..=1, default_missing_value = DEFAULT_SYSTEM_PROMPT)]
    system_prompt: Option<String>,
    /// When a waiting request joins: `projected` (when every running sequence can reach its
    /// max_tokens in the pool) or `optimistic` (vLLM's: when its next chunk fits; growth
    /// beyond the pool preempts and recomputes).
    #[arg(long, default_value = "projected", value_parser = ["projected", "optimistic"])]
    admission: String,
    #[arg(long)]
    no_prefix_caching: bool,
    #[arg(long)]
    no_chunked_prefill: bool,
    /// Write the result as JSON to FILE (stdout when omitted).
    #[arg(long, value_name = "FILE", num_args = 0..=1)]
    json: Option<Option<std::path::PathBuf>>,
}

fn parse_budget(s: &str) -> Result<u64, String> {
    parse_bytes(s).map_err(|e| e.to_string())
}

pub fn run(a: OfflineArgs, threads: usize) -> anyhow::Result<()> {
    let path = switchyard_zoo::resolve_model(&a.model)?;
    let source =
        switchyard_weights::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let tokenizer = Arc::new(
        Tokenizer::from_source(&*source)
            .with_context(|| format!("reading the tokenizer of {}", path.display()))?,
    );
    let data = resolve_text(&a.dataset)?;
    eprintln!("sampling {} prompts from {}", a.num_prompts, data.display());
    let sample = sample_requests(
        &data,
        &tokenizer,
        &SampleOptions {
            num_prompts: a.num_prompts,
            seed: a.seed,
        },
    )?;
    eprintln!(
        "{} records{}, {} examined, {} kept",
        sample.records,
        if sample.truncated {
            " (file cut off mid-record)"
        } else {
            ""
        },
        sample.examined,
        sample.requests.len()
    );
    let opts = OfflineOptions {
        engine: EngineConfig {
            memory_budget: a.memory_budget.unwrap_or(DEFAULT_MEMORY_BUDGET),
            scheduler: SchedulerConfig {
                max_batched_tokens: a.max_batched_tokens,
                max_num_seqs: a.max_num_seqs,
                chunked_prefill: !a.no_chunked_prefill,
                prefix_caching: !a.no_prefix_caching,
                admission: if a.admission == "optimistic" {
                    AdmissionPolicy::Optimistic
                } else {
                    AdmissionPolicy::Projected
                },
            },
            kv_format: a.kv_format.unwrap_or_default(),
            ..EngineConfig::default()
        },
        max_depth: a.max_depth,
        batch1_prompts: a.batch1_prompts,
        system_prompt: a.system_prompt,
    };
    let ctx = OfflineContext {
        source,
        tokenizer,
        model_name: &a.model,
        dataset: &a.dataset,
        sample: &sample,
        threads,
    };
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} requests ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let r = run_offline(&ctx, &opts, |phase, done, total| {
        bar.set_message(phase.to_string());
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    summary(&r);
    write_json(&a.json, &r)
}

fn summary(r: &OfflineReport) {
    eprintln!(
        "{} depth {}/{}, budget {:.0} MiB, {} threads, {} tokens/step, {:?} admission{}",
        r.model,
        r.depth,
        r.n_layers,
        r.memory_budget_bytes as f64 / (1 << 20) as f64,
        r.threads,
        r.max_batched_tokens,
        r.admission,
        if r.system_prompt_tokens > 0 {
            format!(
                ", shared system prompt of {} tokens",
                r.system_prompt_tokens
            )
        } else {
            String::new()
        }
    );
    if let Some(b) = &r.batch1 {
        run_line("batch 1", b);
    }
    run_line("continuous batching", &r.continuous);
    if let Some(x) = r.output_tokens_per_s_ratio {
        eprintln!("continuous batching / batch 1 output tokens/s: {x:.2}x");
    }
    if let Some(x) = r.output_tokens_per_cpu_s_ratio {
        eprintln!("continuous batching / batch 1 output tokens per CPU second: {x:.2}x");
    }
    let c = &r.continuous;
    let m = &c.peak_memory;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "memory at peak KV use (MiB): weights {:.1}, KV used {:.1}, KV free {:.1}, workspace {:.1}, total {:.1} of {:.1}",
        mib(m.weights_bytes),
        mib(m.kv_used_bytes),
        mib(m.kv_free_bytes),
        mib(m.workspace_bytes),
        mib(m.in_use_bytes),
        mib(m.budget_bytes)
    );
    eprintln!(
        "largest batch {} (peak running {}), {} sequences of the mean {:.0} tokens fit the pool of {} blocks; {} preemptions; prefix-cache hit rate {:.1}%",
        c.largest_batch,
        c.peak_running,
        c.batch_that_fits_mean_request,
        c.mean_request_tokens,
        c.kv_blocks_total,
        c.preemptions,
        100.0 * c.prefix_cache_hit_rate
    );
    if let Some(ms) = r.layer_load_ms {
        eprintln!("one layer loads in {ms:.1} ms");
    }
}

fn run_line(name: &str, r: &RunReport) {
    eprintln!(
        "{name}: {} requests in {:.1} s: {:.2} requests/s, {:.1} output tokens/s ({:.1} per CPU second); latency mean {:.2} s, P50 {:.2} s, P99 {:.2} s; TTFT P50 {:.2} s; TPOT P50 {:.1} ms",
        r.requests,
        r.duration_s,
        r.requests_per_s,
        r.output_tokens_per_s,
        r.output_tokens_per_cpu_s.unwrap_or(f64::NAN),
        r.latency_s.mean,
        r.latency_s.p50,
        r.latency_s.p99,
        r.ttft_s.p50,
        r.tpot_s.p50 * 1e3
    );
}
