//! `bench exits`: the EE-LLM baseline measured against full depth in the same run, with the
//! same decoder (full depth = no exit checks): decode tokens/s, the exit-depth histogram, and
//! the bits per byte of the distribution per-token early exit emits, scored by teacher forcing
//! on the benchmark text.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;
use switchyard_request::SamplingParams;
use switchyard_tokenizer::Tokenizer;

use crate::baseline::{generate_early_exit, score_forced, EeContext, EeGeneration, ForcedScore};
use switchyard_eval::stats::median;
use switchyard_exits::confidence::ConfidenceMeasure;

use crate::decode::{DecodeCounters, ExitPolicy, KvFix};
use switchyard_exits::heads::ExitHeads;
use switchyard_exits::{ExitsError, Result};

/// The thresholds the baseline is reported at.
pub const DEFAULT_THRESHOLDS: &[f32] = &[0.6, 0.8, 0.9];
pub const DEFAULT_PROMPT_TOKENS: usize = 128;
pub const DEFAULT_GENERATE_TOKENS: usize = 128;
pub const DEFAULT_FORCED_TOKENS: usize = 512;
/// Repetitions: the median of 3 survives one disturbed run on a shared machine.
pub const DEFAULT_RUNS: usize = 3;

#[derive(Debug, Clone)]
pub struct ExitBenchOptions {
    pub thresholds: Vec<f32>,
    pub fixes: Vec<KvFix>,
    pub measure: ConfidenceMeasure,
    /// Decide with the exit probes instead of the confidence (see [`ExitPolicy::probe`]).
    pub probe: bool,
    /// Exit depths checked (all heads when `None`).
    pub depths: Option<Vec<usize>>,
    pub prompt_tokens: usize,
    pub generate_tokens: usize,
    pub forced_tokens: usize,
    /// Repetitions of every configuration (rates and speed-ups are medians).
    pub runs: usize,
}

impl Default for ExitBenchOptions {
    fn default() -> Self {
        Self {
            thresholds: DEFAULT_THRESHOLDS.to_vec(),
            fixes: vec![KvFix::Recompute, KvFix::Propagate],
            measure: ConfidenceMeasure::MaxProb,
            probe: false,
            depths: None,
            prompt_tokens: DEFAULT_PROMPT_TOKENS,
            generate_tokens: DEFAULT_GENERATE_TOKENS,
            forced_tokens: DEFAULT_FORCED_TOKENS,
            runs: DEFAULT_RUNS,
        }
    }
}

/// Full depth through the same decoder, no exit checks.
#[derive(Debug, Clone, Serialize)]
pub struct FullDepthRow {
    pub decode_tokens_per_s: f64,
    /// Teacher-forced steps per second (same text for every row).
    pub forced_tokens_per_s: f64,
    pub forced_bits_per_byte: f64,
    pub forced_seconds: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ExitBenchRow {
    pub kv_fix: KvFix,
    pub threshold: f32,
    pub decode_tokens_per_s: f64,
    /// `decode_tokens_per_s` over full depth's, same run.
    pub speedup_vs_full: f64,
    /// Teacher-forced steps per second: the same tokens for every row, so unlike generation
    /// (whose text, hence depths, differ per row) it compares like with like.
    pub forced_tokens_per_s: f64,
    pub forced_speedup_vs_full: f64,
    /// Leading generated tokens equal to full depth's greedy output.
    pub generated_prefix_equal_to_full: usize,
    pub generated_mean_depth: f64,
    /// Generated tokens per depth (`n_layers`: no exit).
    pub generated_depth_histogram: BTreeMap<usize, u64>,
    pub forced_bits_per_byte: f64,
    /// `forced_bits_per_byte` minus full depth's.
    pub forced_delta_bits_per_byte: f64,
    /// Teacher-forced steps whose argmax equals full depth's.
    pub forced_argmax_agreement: f64,
    pub forced_mean_depth: f64,
    pub forced_depth_histogram: BTreeMap<usize, u64>,
    /// Per teacher-forced token: exit heads evaluated, rows × layers re-run by recomputation,
    /// rows × layers of K/V written by propagation.
    pub exit_checks_per_token: f64,
    pub recomputed_row_layers_per_token: f64,
    pub propagated_row_layers_per_token: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ExitBenchReport {
    pub model: String,
    pub n_layers: usize,
    pub exit_depths: Vec<usize>,
    pub head_kinds: Vec<String>,
    pub confidence: ConfidenceMeasure,
    /// The exit decision was the exit probes' (`confidence` then unused).
    pub probe: bool,
    pub threads: usize,
    pub file: String,
    pub prompt_tokens: usize,
    pub generate_tokens: usize,
    pub forced_tokens: usize,
    pub runs: usize,
    pub full_depth: FullDepthRow,
    pub rows: Vec<ExitBenchRow>,
    pub seconds: f64,
}

/// What the benchmark runs on.
#[derive(Clone, Copy)]
pub struct BenchTarget<'a> {
    pub model: &'a switchyard_models::LayeredModel,
    pub name: &'a str,
    pub heads: &'a ExitHeads,
    pub tokenizer: &'a Tokenizer,
    pub threads: usize,
}

fn forced_rate(f: &ForcedScore) -> f64 {
    f.tokens_scored as f64 / f.seconds
}

fn mean_depth(depths: &[usize]) -> f64 {
    depths.iter().sum::<usize>() as f64 / depths.len().max(1) as f64
}

fn histogram(depths: &[usize]) -> BTreeMap<usize, u64> {
    let mut h = BTreeMap::new();
    for &d in depths {
        *h.entry(d).or_default() += 1;
    }
    h
}

/// Runs full depth, then every (fix, threshold); `on_step(label)` before each.
pub fn bench_exits(
    target: &BenchTarget<'_>,
    file_name: &str,
    text: &str,
    opts: &ExitBenchOptions,
    mut on_step: impl FnMut(&str),
) -> Result<ExitBenchReport> {
    let t0 = Instant::now();
    let tok = target.tokenizer;
    let ids = tok.encode(text, true, false)?;
    if ids.len() < 2 || opts.prompt_tokens == 0 || opts.forced_tokens < 2 {
        return Err(ExitsError::Invalid(format!(
            "{file_name} has {} tokens; the benchmark needs at least 2, a prompt and 2 forced tokens",
            ids.len()
        )));
    }
    let prompt = &ids[..opts.prompt_tokens.min(ids.len())];
    let forced = &ids[..opts.forced_tokens.min(ids.len())];
    let depths = opts.depths.clone().unwrap_or_else(|| target.heads.depths());
    let params = SamplingParams {
        max_tokens: opts.generate_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let run = |policy: &ExitPolicy, fix: KvFix| -> Result<(EeGeneration, ForcedScore)> {
        let ctx = EeContext {
            model: target.model,
            heads: target.heads,
            policy,
            fix,
        };
        let g = generate_early_exit(&ctx, tok, prompt, &params, |_| {})?;
        let f = score_forced(&ctx, tok, forced)?;
        Ok((g, f))
    };

    on_step("warm-up");
    let warm = ExitPolicy::full_depth();
    let ctx = EeContext {
        model: target.model,
        heads: target.heads,
        policy: &warm,
        fix: KvFix::Recompute,
    };
    score_forced(&ctx, tok, &forced[..forced.len().min(8)])?;

    // Every configuration once per repetition, full depth first: each ratio compares runs made
    // seconds apart, and the median over repetitions damps a shared machine's noise.
    let mut configs = vec![(KvFix::Recompute, ExitPolicy::full_depth())];
    for &fix in &opts.fixes {
        for &threshold in &opts.thresholds {
            let policy = ExitPolicy {
                threshold,
                measure: opts.measure,
                depths: depths.clone(),
                probe: opts.probe,
            };
            configs.push((fix, policy));
        }
    }
    let runs = opts.runs.max(1);
    let mut first: Vec<(EeGeneration, ForcedScore)> = Vec::with_capacity(configs.len());
    // [config][repetition] -> (decode tokens/s, forced tokens/s)
    let mut rates = vec![Vec::with_capacity(runs); configs.len()];
    for r in 0..runs {
        for (i, (fix, policy)) in configs.iter().enumerate() {
            let label = match i {
                0 => "full depth".to_string(),
                _ => format!("{} threshold {}", fix.as_str(), policy.threshold),
            };
            on_step(&format!("run {}/{runs}: {label}", r + 1));
            let (g, f) = run(policy, *fix)?;
            rates[i].push((g.decode_tokens_per_s(), forced_rate(&f)));
            if r == 0 {
                first.push((g, f));
            }
        }
    }
    let speedups = |i: usize| -> (f64, f64) {
        let d: Vec<f64> = (0..runs).map(|r| rates[i][r].0 / rates[0][r].0).collect();
        let f: Vec<f64> = (0..runs).map(|r| rates[i][r].1 / rates[0][r].1).collect();
        (median(&d), median(&f))
    };
    let median_rates = |i: usize| -> (f64, f64) {
        let d: Vec<f64> = rates[i].iter().map(|x| x.0).collect();
        let f: Vec<f64> = rates[i].iter().map(|x| x.1).collect();
        (median(&d), median(&f))
    };
    let (full_g, full_f) = &first[0];
    let (full_decode, full_forced) = median_rates(0);
    let full = FullDepthRow {
        decode_tokens_per_s: full_decode,
        forced_tokens_per_s: full_forced,
        forced_bits_per_byte: full_f.bits_per_byte,
        forced_seconds: full_f.seconds,
    };
    let mut rows = Vec::new();
    for (i, ((fix, policy), (g, f))) in configs.iter().zip(&first).enumerate().skip(1) {
        let prefix = g
            .tokens
            .iter()
            .zip(&full_g.tokens)
            .take_while(|(a, b)| a == b)
            .count();
        let agree = f
            .argmax
            .iter()
            .zip(&full_f.argmax)
            .filter(|(a, b)| a == b)
            .count() as f64
            / f.argmax.len().max(1) as f64;
        let per = |c: &DecodeCounters, x: u64| x as f64 / c.steps.max(1) as f64;
        let c = &f.counters;
        let (decode, forced_tps) = median_rates(i);
        let (decode_x, forced_x) = speedups(i);
        rows.push(ExitBenchRow {
            kv_fix: *fix,
            threshold: policy.threshold,
            decode_tokens_per_s: decode,
            speedup_vs_full: decode_x,
            forced_tokens_per_s: forced_tps,
            forced_speedup_vs_full: forced_x,
            generated_prefix_equal_to_full: prefix,
            generated_mean_depth: mean_depth(&g.depths),
            generated_depth_histogram: histogram(&g.depths),
            forced_bits_per_byte: f.bits_per_byte,
            forced_delta_bits_per_byte: f.bits_per_byte - full.forced_bits_per_byte,
            forced_argmax_agreement: agree,
            forced_mean_depth: mean_depth(&f.depths),
            forced_depth_histogram: histogram(&f.depths),
            exit_checks_per_token: per(c, c.exit_checks),
            recomputed_row_layers_per_token: per(c, c.recomputed_row_layers),
            propagated_row_layers_per_token: per(c, c.propagated_row_layers),
        });
    }
    Ok(ExitBenchReport {
        model: target.name.to_string(),
        n_layers: target.model.n_layers(),
        head_kinds: depths
            .iter()
            .map(|&d| target.heads.head(d).map(|h| h.kind().as_str().to_string()))
            .collect::<Result<_>>()?,
        exit_depths: depths,
        confidence: opts.measure,
        probe: opts.probe,
        threads: target.threads,
        file: file_name.to_string(),
        prompt_tokens: prompt.len(),
        generate_tokens: opts.generate_tokens,
        forced_tokens: forced.len(),
        runs,
        full_depth: full,
        rows,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

impl ExitBenchReport {
    pub fn markdown(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "### EE-LLM baseline: {} ({} layers, exits at {:?} through {} heads, decided by {}, {} threads, {}, median of {} runs)\n",
            self.model,
            self.n_layers,
            self.exit_depths,
            self.head_kinds.first().map_or("no", String::as_str),
            if self.probe { "the exit probes" } else { self.confidence.as_str() },
            self.threads,
            self.file,
            self.runs
        );
        let _ = writeln!(
            s,
            "Full depth: {:.2} decode tokens/s, {:.2} teacher-forced tokens/s, {:.4} bits per byte (teacher forcing, {} tokens).\n",
            self.full_depth.decode_tokens_per_s,
            self.full_depth.forced_tokens_per_s,
            self.full_depth.forced_bits_per_byte,
            self.forced_tokens
        );
        let _ = writeln!(s, "| KV fix | threshold | decode tokens/s | vs full | forced tokens/s | vs full | mean depth (gen / forced) | bits/byte | Δ bits/byte | argmax = full | exit checks/token | extra row-layers/token |");
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|");
        for r in &self.rows {
            let _ = writeln!(
                s,
                "| {} | {} | {:.2} | {:.2}x | {:.2} | {:.2}x | {:.1} / {:.1} | {:.4} | {:+.4} | {:.1}% | {:.2} | {:.2} |",
                r.kv_fix.as_str(),
                r.threshold,
                r.decode_tokens_per_s,
                r.speedup_vs_full,
                r.forced_tokens_per_s,
                r.forced_speedup_vs_full,
                r.generated_mean_depth,
                r.forced_mean_depth,
                r.forced_bits_per_byte,
                r.forced_delta_bits_per_byte,
                100.0 * r.forced_argmax_agreement,
                r.exit_checks_per_token,
                r.recomputed_row_layers_per_token + r.propagated_row_layers_per_token
            );
        }
        let _ = writeln!(s, "\nExit-depth histogram (teacher forcing):\n");
        for r in &self.rows {
            let h: Vec<String> = r
                .forced_depth_histogram
                .iter()
                .map(|(d, c)| format!("{d}: {c}"))
                .collect();
            let _ = writeln!(
                s,
                "- {} {}: {}",
                r.kv_fix.as_str(),
                r.threshold,
                h.join(", ")
            );
        }
        s
    }
}
