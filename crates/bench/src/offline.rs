//! `bench offline`: a list of prompts through the serving engine, all submitted at once
//! (vLLM's `benchmark_throughput`): request and output-token throughput, per-request latency,
//! the largest batch, memory by category. In the same run the same engine serves the first
//! prompts at batch 1, so what continuous batching gains is a ratio measured side by side.
//!
//! Requests generate exactly the dataset answer's length (`ignore_eos`, as vLLM's benchmark
//! does), greedily.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use switchyard_engine::scheduler::AdmissionPolicy;
use switchyard_engine::{
    Completion, EngineConfig, EngineHandle, EngineRequest, EngineStats, MemoryStats, RequestStream,
};
use switchyard_models::{LayeredModel, LoadOptions};
use switchyard_request::SamplingParams;
use switchyard_tokenizer::{ChatMessage, Tokenizer};
use switchyard_weights::WeightSource;

use crate::{BenchError, Result};
use switchyard_eval::sharegpt::Sample;
use switchyard_eval::stats::Percentiles;

/// The figure is measured on 500 prompts.
pub const DEFAULT_NUM_PROMPTS: usize = 500;
/// Prompts the batch-1 baseline serves (enough for a stable rate, few enough to be quick).
pub const DEFAULT_BATCH1_PROMPTS: usize = 16;
/// A shared system prompt (about 200 tokens) for the prefix-caching workload.
pub const DEFAULT_SYSTEM_PROMPT: &str = "You are Switchyard Assistant, a careful and friendly \
helper deployed by a team of engineers who run language models in production. Follow these \
rules in every answer. First, read the whole question before answering and restate any \
ambiguity you notice in one short sentence. Second, prefer plain words over jargon; when a \
technical term is needed, define it the first time you use it. Third, keep answers short: \
lead with the direct answer, then give at most three supporting points, each in one \
sentence. Fourth, when you are not sure, say so and explain what would settle the question \
rather than guessing. Fifth, never invent citations, numbers or quotations; if a figure is \
needed and you do not know it, say that it is unknown. Sixth, for code, give a complete \
minimal example that compiles, with comments only where the intent is not obvious. Seventh, \
be polite but do not apologise for things you did not do. Eighth, end with a one-line \
summary when the answer is longer than a paragraph.";
/// How often the engine's stats are sampled during a run (peaks of batch and KV use).
const STATS_EVERY: Duration = Duration::from_millis(100);
/// Sleep between polls of the output streams.
const POLL: Duration = Duration::from_millis(2);

#[derive(Debug, Clone)]
pub struct OfflineOptions {
    pub engine: EngineConfig,
    /// Load and run only the first `d` layers (all when `None`).
    pub max_depth: Option<usize>,
    /// Prompts for the batch-1 baseline (0: no baseline).
    pub batch1_prompts: usize,
    /// Put every prompt in the chat template under this system message.
    pub system_prompt: Option<String>,
}

/// What the benchmark runs on.
pub struct OfflineContext<'a> {
    pub source: Arc<dyn WeightSource>,
    pub tokenizer: Arc<Tokenizer>,
    pub model_name: &'a str,
    pub dataset: &'a str,
    pub sample: &'a Sample,
    pub threads: usize,
}

/// One engine run over a list of requests.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    pub max_num_seqs: usize,
    pub requests: usize,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub duration_s: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub total_tokens_per_s: f64,
    /// CPU seconds (user + system) the process used during the run (Linux; `None` elsewhere).
    pub cpu_s: Option<f64>,
    /// Output tokens per CPU second: unlike wall time, not diluted by other processes on a
    /// shared machine.
    pub output_tokens_per_cpu_s: Option<f64>,
    pub latency_s: Percentiles,
    pub ttft_s: Percentiles,
    pub tpot_s: Percentiles,
    /// Most sequences in one step.
    pub largest_batch: usize,
    /// Most sequences running at once (sampled every 100 ms).
    pub peak_running: usize,
    pub preemptions: u64,
    pub prompt_tokens_computed: u64,
    pub recomputed_tokens: u64,
    pub prefix_cache_hit_rate: f64,
    /// Memory by category when the KV pool was fullest.
    pub peak_memory: MemoryStats,
    pub kv_blocks_total: usize,
    pub block_bytes: u64,
    /// Sequences of the mean request length (prompt + output) the whole pool holds.
    pub batch_that_fits_mean_request: usize,
    pub mean_request_tokens: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct OfflineReport {
    pub model: String,
    pub dataset: String,
    pub dataset_records: usize,
    pub dataset_truncated: bool,
    pub threads: usize,
    pub n_layers: usize,
    pub depth: usize,
    pub memory_budget_bytes: u64,
    pub max_batched_tokens: usize,
    pub block_tokens: usize,
    pub prefix_caching: bool,
    pub admission: AdmissionPolicy,
    pub system_prompt_tokens: usize,
    /// One layer dropped and loaded again through the engine, in milliseconds.
    pub layer_load_ms: Option<f64>,
    pub continuous: RunReport,
    pub batch1: Option<RunReport>,
    /// Continuous-batching output tokens/s over batch-1 output tokens/s.
    pub output_tokens_per_s_ratio: Option<f64>,
    /// The same ratio per CPU second.
    pub output_tokens_per_cpu_s_ratio: Option<f64>,
}

/// Runs the benchmark: batch 1 on the first prompts, then continuous batching on all.
/// `progress(phase, done, total)` reports finished requests.
pub fn run_offline(
    ctx: &OfflineContext<'_>,
    opts: &OfflineOptions,
    mut progress: impl FnMut(&str, usize, usize),
) -> Result<OfflineReport> {
    let (requests, system_tokens) = build_requests(&ctx.tokenizer, ctx.sample, opts)?;
    if requests.is_empty() {
        return Err(BenchError::Invalid("no request passed the filters".into()));
    }
    let batch1 = if opts.batch1_prompts > 0 {
        let mut cfg = opts.engine.clone();
        cfg.scheduler.max_num_seqs = 1;
        let n = opts.batch1_prompts.min(requests.len());
        let (r, _) = run_engine(ctx, &cfg, opts.max_depth, &requests[..n], false, |d, t| {
            progress("batch 1", d, t)
        })?;
        Some(r)
    } else {
        None
    };
    let (continuous, layer_load_ms) = run_engine(
        ctx,
        &opts.engine,
        opts.max_depth,
        &requests,
        true,
        |d, t| progress("continuous batching", d, t),
    )?;
    let n_layers = ctx.source.spec().n_layers;
    Ok(OfflineReport {
        model: ctx.model_name.to_string(),
        dataset: ctx.dataset.to_string(),
        dataset_records: ctx.sample.records,
        dataset_truncated: ctx.sample.truncated,
        threads: ctx.threads,
        n_layers,
        depth: opts.max_depth.unwrap_or(n_layers).min(n_layers),
        memory_budget_bytes: opts.engine.memory_budget,
        max_batched_tokens: opts.engine.scheduler.max_batched_tokens,
        block_tokens: opts.engine.block_tokens,
        prefix_caching: opts.engine.scheduler.prefix_caching,
        admission: opts.engine.scheduler.admission,
        system_prompt_tokens: system_tokens,
        layer_load_ms,
        output_tokens_per_s_ratio: batch1
            .as_ref()
            .map(|b| continuous.output_tokens_per_s / b.output_tokens_per_s),
        output_tokens_per_cpu_s_ratio: batch1
            .as_ref()
            .and_then(|b| Some(continuous.output_tokens_per_cpu_s? / b.output_tokens_per_cpu_s?)),
        continuous,
        batch1,
    })
}

/// One request of the run: prompt tokens and how many tokens to generate.
#[derive(Debug, Clone)]
struct Job {
    prompt: Vec<u32>,
    output_len: usize,
}

/// Prompt tokens and output lengths; with a system prompt, each prompt goes into the chat
/// template under it. Also returns the system prompt's length in tokens.
fn build_requests(
    tok: &Tokenizer,
    sample: &Sample,
    opts: &OfflineOptions,
) -> Result<(Vec<Job>, usize)> {
    let Some(system) = &opts.system_prompt else {
        let r = sample
            .requests
            .iter()
            .map(|r| Job {
                prompt: r.prompt_tokens.clone(),
                output_len: r.output_len,
            })
            .collect();
        return Ok((r, 0));
    };
    let system_tokens = tok.encode(system, false, false)?.len();
    let mut out = Vec::with_capacity(sample.requests.len());
    for r in &sample.requests {
        let msgs = [
            ChatMessage::new("system", system.clone()),
            ChatMessage::new("user", r.prompt.clone()),
        ];
        let text = tok.apply_chat_template(&msgs, true)?;
        // Templates that write the BOS token themselves must not get a second one.
        let has_bos = tok
            .bos_id()
            .and_then(|b| tok.id_to_piece(b))
            .is_some_and(|b| text.starts_with(&b));
        out.push(Job {
            prompt: tok.encode(&text, !has_bos, true)?,
            output_len: r.output_len,
        });
    }
    Ok((out, system_tokens))
}

/// One engine over `requests`, all submitted at once.
fn run_engine(
    ctx: &OfflineContext<'_>,
    cfg: &EngineConfig,
    max_depth: Option<usize>,
    requests: &[Job],
    measure_layer_load: bool,
    mut progress: impl FnMut(usize, usize),
) -> Result<(RunReport, Option<f64>)> {
    let opts = LoadOptions {
        layers: max_depth,
        ..LoadOptions::default()
    };
    let model = LayeredModel::load(Arc::clone(&ctx.source), &opts)?;
    let h = EngineHandle::start(
        model,
        Arc::clone(&ctx.tokenizer),
        cfg.clone(),
        ctx.model_name,
    )?;
    let layer_load_ms = if measure_layer_load {
        measure_layer_load_ms(&h)?
    } else {
        None
    };
    // Warm-up: thread pools and first touches are not what a server pays per request.
    let warm = h.add_request(EngineRequest {
        prompt: requests[0].prompt.iter().copied().take(16).collect(),
        params: greedy(4),
    })?;
    warm.wait()?;
    let base = h.stats().wait()?;

    let t0 = Instant::now();
    let cpu0 = process_cpu_secs();
    let mut streams = Vec::with_capacity(requests.len());
    for r in requests {
        streams.push(h.add_request(EngineRequest {
            prompt: r.prompt.clone(),
            params: greedy(r.output_len),
        })?);
    }
    let (completions, peaks) = gather(&h, &mut streams, &mut progress)?;
    let cpu = process_cpu_secs().zip(cpu0).map(|(b, a)| b - a);
    let end = h.stats().wait()?;
    h.shutdown().wait()?;
    let mut report = run_report(cfg, requests, &completions, t0, &base, &end, peaks);
    report.cpu_s = cpu;
    report.output_tokens_per_cpu_s = cpu.map(|c| report.output_tokens as f64 / c);
    Ok((report, layer_load_ms))
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens.max(1))
    }
}

/// Drops the last resident layer and loads it again (when there is more than one).
fn measure_layer_load_ms(h: &EngineHandle) -> Result<Option<f64>> {
    let s = h.stats().wait()?;
    if s.resident_layers < 2 {
        return Ok(None);
    }
    h.drop_layers(s.resident_layers - 1).wait()?;
    let r = h.load_layers(s.resident_layers, true).wait()?;
    Ok(Some(r.mean_layer_secs() * 1e3))
}

/// Peaks seen while sampling the stats.
struct Peaks {
    running: usize,
    memory: MemoryStats,
}

/// Reads every stream to its end; samples the stats meanwhile.
fn gather(
    h: &EngineHandle,
    streams: &mut [RequestStream],
    progress: &mut impl FnMut(usize, usize),
) -> Result<(Vec<Completion>, Peaks)> {
    let total = streams.len();
    let mut outputs: Vec<Vec<switchyard_engine::RequestOutput>> = vec![Vec::new(); total];
    let mut done = vec![false; total];
    let mut n_done = 0;
    let first = h.stats().wait()?;
    let mut peaks = Peaks {
        running: first.running,
        memory: first.memory,
    };
    let mut last_stats = Instant::now();
    while n_done < total {
        let mut any = false;
        for (i, s) in streams.iter_mut().enumerate() {
            while !done[i] {
                let Some(o) = s.try_next() else { break };
                let o = o?;
                any = true;
                let last = o.finish_reason.is_some();
                outputs[i].push(o);
                if last {
                    done[i] = true;
                    n_done += 1;
                    progress(n_done, total);
                }
            }
        }
        if last_stats.elapsed() >= STATS_EVERY {
            let s = h.stats().wait()?;
            peaks.running = peaks.running.max(s.running);
            if s.memory.kv_used_bytes > peaks.memory.kv_used_bytes {
                peaks.memory = s.memory;
            }
            last_stats = Instant::now();
        }
        if !any {
            std::thread::sleep(POLL);
        }
    }
    let completions = outputs
        .into_iter()
        .map(|o| {
            Completion::gather(o).ok_or_else(|| BenchError::Invalid("a stream ended early".into()))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((completions, peaks))
}

fn run_report(
    cfg: &EngineConfig,
    requests: &[Job],
    done: &[Completion],
    t0: Instant,
    base: &EngineStats,
    end: &EngineStats,
    peaks: Peaks,
) -> RunReport {
    let last = done.iter().map(|c| c.finished_at).max().unwrap_or(t0);
    let duration = last.saturating_duration_since(t0).as_secs_f64();
    let prompt_tokens: usize = requests.iter().map(|r| r.prompt.len()).sum();
    let output_tokens: usize = done.iter().map(|c| c.token_ids.len()).sum();
    let secs = |d: Option<Duration>| d.map(|d| d.as_secs_f64());
    let latency: Vec<f64> = done.iter().map(|c| c.latency().as_secs_f64()).collect();
    let ttft: Vec<f64> = done.iter().filter_map(|c| secs(c.ttft())).collect();
    let tpot: Vec<f64> = done.iter().filter_map(|c| secs(c.tpot())).collect();
    let mean_request_tokens = requests
        .iter()
        .map(|r| (r.prompt.len() + r.output_len) as f64)
        .sum::<f64>()
        / requests.len() as f64;
    let (c, b) = (&end.counters, &base.counters);
    RunReport {
        max_num_seqs: cfg.scheduler.max_num_seqs,
        requests: done.len(),
        prompt_tokens,
        output_tokens,
        duration_s: duration,
        requests_per_s: done.len() as f64 / duration,
        output_tokens_per_s: output_tokens as f64 / duration,
        total_tokens_per_s: (prompt_tokens + output_tokens) as f64 / duration,
        cpu_s: None,
        output_tokens_per_cpu_s: None,
        latency_s: Percentiles::of(&latency),
        ttft_s: Percentiles::of(&ttft),
        tpot_s: Percentiles::of(&tpot),
        largest_batch: c.largest_batch,
        peak_running: peaks.running,
        preemptions: c.preemptions - b.preemptions,
        prompt_tokens_computed: c.prompt_tokens_computed - b.prompt_tokens_computed,
        recomputed_tokens: c.recomputed_tokens - b.recomputed_tokens,
        prefix_cache_hit_rate: hit_rate(base, end),
        peak_memory: peaks.memory,
        kv_blocks_total: end.kv_blocks_total,
        block_bytes: end.block_bytes,
        batch_that_fits_mean_request: end.batch_that_fits(mean_request_tokens.ceil() as usize),
        mean_request_tokens,
    }
}

/// User + system CPU seconds of this process so far, from `/proc/self/stat` (Linux, whose
/// `/proc` counts in units of 1/100 s).
fn process_cpu_secs() -> Option<f64> {
    const TICKS_PER_S: f64 = 100.0;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at the state, field 3.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / TICKS_PER_S)
}

/// The hit rate over the measured requests only (the warm-up excluded).
fn hit_rate(base: &EngineStats, end: &EngineStats) -> f64 {
    let q = end.prefix_cache_queried_tokens - base.prefix_cache_queried_tokens;
    let h = end.prefix_cache_hit_tokens - base.prefix_cache_hit_tokens;
    if q == 0 {
        0.0
    } else {
        h as f64 / q as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_grows_with_work() {
        let Some(a) = process_cpu_secs() else {
            return; // not Linux
        };
        let mut x = 0u64;
        let t = std::time::Instant::now();
        while t.elapsed() < Duration::from_millis(50) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        let b = process_cpu_secs().expect("cpu time");
        assert!(b > a, "{a} -> {b}");
    }
}
