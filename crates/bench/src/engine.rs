//! `bench engine`: prompt and decode throughput of one model at batch 1, the figures llama.cpp's
//! `llama-bench` reports (pp512 / tg128), measured as the median of several runs.

use std::time::Instant;

use serde::Serialize;
use switchyard_engine::generate::last_logits_at_depth;
use switchyard_engine::sampler::argmax;
use switchyard_models::{DenseKv, LayeredModel};
use switchyard_tokenizer::Tokenizer;

use crate::{BenchError, Result};
use switchyard_eval::stats::median;

/// llama-bench's defaults.
pub const DEFAULT_PROMPT_TOKENS: usize = 512;
pub const DEFAULT_DECODE_TOKENS: usize = 128;
pub const DEFAULT_RUNS: usize = 5;
/// The prompt text: a real English play, from the zoo.
pub const PROMPT_DATASET: &str = "shakespeare";

#[derive(Debug, Clone)]
pub struct EngineBenchOptions {
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    pub runs: usize,
    /// Layers run per token (all when `None`): decode at a fixed early-exit depth.
    pub depth: Option<usize>,
}

impl Default for EngineBenchOptions {
    fn default() -> Self {
        Self {
            prompt_tokens: DEFAULT_PROMPT_TOKENS,
            decode_tokens: DEFAULT_DECODE_TOKENS,
            runs: DEFAULT_RUNS,
            depth: None,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct EngineBenchReport {
    pub model: String,
    pub architecture: String,
    pub n_layers: usize,
    pub depth: usize,
    pub threads: usize,
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    pub runs: usize,
    pub prompt_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    pub prompt_tokens_per_s_runs: Vec<f64>,
    pub decode_tokens_per_s_runs: Vec<f64>,
    pub resident_weight_bytes: usize,
    /// Final norm + LM head for one token (median of repeated calls).
    pub lm_head_ms: f64,
    /// The head's share of one decode step at this depth.
    pub lm_head_share_of_decode_step: f64,
    /// Which kernels served the quantized weights (`switchyard` or `candle`).
    pub kernels: String,
}

/// Runs the benchmark; `on_run(i, runs)` is called after each run (progress).
pub fn bench_engine(
    model: &LayeredModel,
    tokenizer: &Tokenizer,
    name: &str,
    opts: &EngineBenchOptions,
    threads: usize,
    mut on_run: impl FnMut(usize, usize),
) -> Result<EngineBenchReport> {
    let depth = opts.depth.unwrap_or(model.n_layers());
    if depth == 0 || depth > model.n_layers() || opts.runs == 0 || opts.prompt_tokens == 0 {
        return Err(BenchError::Invalid(format!(
            "depth {depth} (1..={}), runs {} and prompt tokens {} must be positive",
            model.n_layers(),
            opts.runs,
            opts.prompt_tokens
        )));
    }
    let prompt = prompt_tokens(tokenizer, opts.prompt_tokens)?;
    // Warm-up: first touches of weights and kernel set-up are not what a server pays per request.
    run_once(model, &prompt[..prompt.len().min(64)], 4, depth)?;
    let mut pp = Vec::with_capacity(opts.runs);
    let mut tg = Vec::with_capacity(opts.runs);
    for i in 0..opts.runs {
        let (p, d) = run_once(model, &prompt, opts.decode_tokens, depth)?;
        pp.push(prompt.len() as f64 / p);
        if opts.decode_tokens > 0 {
            tg.push(opts.decode_tokens as f64 / d);
        }
        on_run(i + 1, opts.runs);
    }
    let head_s = time_head(model)?;
    let decode_tps = median(&tg);
    Ok(EngineBenchReport {
        lm_head_ms: head_s * 1e3,
        lm_head_share_of_decode_step: head_s * decode_tps,
        kernels: if std::env::var(switchyard_kernels::KERNELS_ENV).is_ok_and(|v| v == "candle") {
            "candle".into()
        } else {
            "switchyard".into()
        },
        model: name.to_string(),
        architecture: model.spec().architecture.as_str().to_string(),
        n_layers: model.n_layers(),
        depth,
        threads,
        prompt_tokens: prompt.len(),
        decode_tokens: opts.decode_tokens,
        runs: opts.runs,
        prompt_tokens_per_s: median(&pp),
        decode_tokens_per_s: median(&tg),
        prompt_tokens_per_s_runs: pp,
        decode_tokens_per_s_runs: tg,
        resident_weight_bytes: model.resident_bytes().total(),
    })
}

/// Median seconds of the final norm and LM head on one hidden state.
fn time_head(model: &LayeredModel) -> Result<f64> {
    let err = |e: switchyard_models::ModelError| BenchError::Engine(e.into());
    let hidden = model.embed(&[1]).map_err(err)?;
    let mut runs = Vec::new();
    for _ in 0..21 {
        let t = Instant::now();
        model.logits(&hidden).map_err(err)?;
        runs.push(t.elapsed().as_secs_f64());
    }
    Ok(median(&runs))
}

/// The first `n` tokens of the benchmark text (repeated if it is shorter).
pub fn prompt_tokens(tokenizer: &Tokenizer, n: usize) -> Result<Vec<u32>> {
    let path = switchyard_zoo::ensure(PROMPT_DATASET)?;
    let text = std::fs::read(&path).map_err(|source| BenchError::io(&path, source))?;
    let text = String::from_utf8_lossy(&text);
    let ids = tokenizer.encode(&text, true, false)?;
    if ids.is_empty() {
        return Err(BenchError::Invalid(format!(
            "{} has no tokens",
            path.display()
        )));
    }
    Ok(ids.iter().copied().cycle().take(n).collect())
}

/// Seconds for the prompt pass and for `decode` greedy tokens after it.
fn run_once(
    model: &LayeredModel,
    prompt: &[u32],
    decode: usize,
    depth: usize,
) -> Result<(f64, f64)> {
    let mut kv = DenseKv::new(model.n_layers(), model.spec().kv_row_len());
    let t0 = Instant::now();
    let logits = last_logits_at_depth(model, &mut kv, 0, prompt, depth)?;
    let prompt_secs = t0.elapsed().as_secs_f64();
    let mut next = argmax(&logits) as u32;
    let t1 = Instant::now();
    for i in 0..decode {
        let logits = last_logits_at_depth(model, &mut kv, prompt.len() + i, &[next], depth)?;
        next = argmax(&logits) as u32;
    }
    Ok((prompt_secs, t1.elapsed().as_secs_f64()))
}
