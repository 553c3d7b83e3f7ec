//! Offline profiling (`switchyard profile`): a model's telemetry at each exit depth, the
//! repository entry the policy reads.
//!
//! At every profiled depth `d`, with only layers `0..d` run and the exit head at `d`:
//!
//! * **decode throughput** at batch 1: a short prompt from the start of the text, then greedy
//!   decoding, timed per run; tokens/s and time to the first token are medians over runs, the
//!   depths interleaved within each run so that a disturbance hits them alike;
//! * **bits per byte** by teacher forcing: the text's tokens run once through the layers,
//!   every position emitted at `d` (the fixed-depth serving HELIOS does), scored like
//!   `switchyard eval ppl` (same tokens, same byte count; at full depth the same number);
//! * **memory**: the weights resident with layers `0..d` loaded (embeddings, final norm and
//!   LM head, the layers as their kernels hold them, the exit head at `d`), and the K/V bytes
//!   one position takes at that depth.
//!
//! One teacher-forced pass also gives the offline exit profile: per token, the first profiled
//! exit whose confidence passes the threshold (full depth when none does), every layer
//! computed for every token.

use std::time::Instant;

use candle_core::Tensor;
use switchyard_engine::Sampler;
use switchyard_exits::confidence::{passes, ConfidenceMeasure, TokenStats};
use switchyard_exits::{ExitHead, ExitHeads};
use switchyard_models::{DenseKv, ForwardBatch, LayeredModel};
use switchyard_request::SamplingParams;
use switchyard_tokenizer::Tokenizer;

use crate::manifest::{DepthTelemetry, ExitHeadsKind, ModelEntry, ProfileInfo};
use crate::pht::ExitHistogram;
use crate::policy::DEFAULT_THRESHOLD;
use crate::{HeliosError, Result};

/// The text profiled by default (a zoo dataset: Hamlet).
pub const DEFAULT_TEXT: &str = "shakespeare";
/// Tokens of the text scored by teacher forcing: a few thousand keep SmolLM2-135M's profile
/// near a minute on 2 cores.
pub const DEFAULT_SCORED_TOKENS: usize = 2048;
/// Prompt tokens of the throughput runs.
pub const DEFAULT_PROMPT_TOKENS: usize = 32;
/// Tokens generated per throughput run.
pub const DEFAULT_DECODE_TOKENS: usize = 32;
/// Throughput runs per depth; the median survives one disturbed run on a shared machine.
pub const DEFAULT_RUNS: usize = 3;
/// Rows sent through an exit head at once (bounds the logits buffer to rows × vocab f32).
const HEAD_ROWS: usize = 256;
/// Bytes per K or V element (the KV pool holds f32).
const KV_ELEMENT_BYTES: usize = 4;

#[derive(Debug, Clone, PartialEq)]
pub struct ProfileOptions {
    /// Depths to profile, increasing; each an exit head's depth or the model's layer count.
    pub depths: Vec<usize>,
    pub scored_tokens: usize,
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    pub runs: usize,
    pub threshold: f32,
    pub measure: ConfidenceMeasure,
}

impl ProfileOptions {
    /// Every head of `heads` and full depth, with the defaults.
    pub fn all_depths(heads: &ExitHeads, n_layers: usize) -> Self {
        let mut depths = heads.depths();
        depths.push(n_layers);
        Self {
            depths,
            scored_tokens: DEFAULT_SCORED_TOKENS,
            prompt_tokens: DEFAULT_PROMPT_TOKENS,
            decode_tokens: DEFAULT_DECODE_TOKENS,
            runs: DEFAULT_RUNS,
            threshold: DEFAULT_THRESHOLD,
            measure: ConfidenceMeasure::MaxProb,
        }
    }
}

/// What is profiled.
#[derive(Clone, Copy)]
pub struct ProfileTarget<'a> {
    pub model: &'a LayeredModel,
    pub tokenizer: &'a Tokenizer,
    pub heads: &'a ExitHeads,
    /// The repository name.
    pub name: &'a str,
    /// Where the model comes from when it is not the zoo model `name`.
    pub path: Option<&'a str>,
    /// Bytes of the model file(s).
    pub size_bytes: u64,
    pub threads: usize,
}

/// The text scored and where it came from.
#[derive(Clone, Copy)]
pub struct ProfileText<'a> {
    /// A zoo dataset name or a path, for the record.
    pub name: &'a str,
    pub text: &'a str,
}

/// A profile: the repository entry, and what was measured beyond it.
#[derive(Debug, Clone)]
pub struct Profile {
    pub entry: ModelEntry,
    /// The text actually scored (a prefix of the input, cut at a line end).
    pub scored_text: String,
    /// Greedy tokens of the first throughput run, per profiled depth.
    pub generated: Vec<(usize, Vec<u32>)>,
    /// Teacher-forced steps whose argmax equals full depth's, per profiled depth (when full
    /// depth was profiled).
    pub argmax_agreement: Vec<(usize, f64)>,
}

/// The first `tokens` tokens' worth of `text`, cut back to a line end so that the prefix
/// tokenizes as it reads. Scoring this text with `switchyard eval ppl` scores the same tokens.
pub fn scoring_text(tokenizer: &Tokenizer, text: &str, tokens: usize) -> Result<String> {
    let ids = tokenizer.encode(text, false, false)?;
    if ids.len() <= tokens {
        return Ok(text.to_string());
    }
    let prefix = tokenizer.decode(&ids[..tokens], false)?;
    let cut = match prefix.rfind('\n') {
        Some(i) if i > 0 => &prefix[..=i],
        _ => prefix.as_str(),
    };
    Ok(cut.to_string())
}

/// Profiles `target` on `text` at every depth of `opts`; `on_step` hears what runs.
pub fn profile(
    target: &ProfileTarget<'_>,
    text: &ProfileText<'_>,
    opts: &ProfileOptions,
    mut on_step: impl FnMut(&str),
) -> Result<Profile> {
    let t0 = Instant::now();
    let model = target.model;
    let n_layers = model.n_layers();
    check_depths(target, &opts.depths)?;
    if opts.prompt_tokens == 0 || opts.decode_tokens < 2 || opts.runs == 0 {
        return Err(HeliosError::Profile(format!(
            "a throughput run needs a prompt, at least 2 generated tokens and 1 run (got {} \
             prompt tokens, {} generated, {} runs)",
            opts.prompt_tokens, opts.decode_tokens, opts.runs
        )));
    }
    let scored_text = scoring_text(target.tokenizer, text.text, opts.scored_tokens)?;
    let ids = target.tokenizer.encode(&scored_text, true, false)?;
    let context = model.spec().context_length;
    if ids.len() < opts.prompt_tokens.max(2) || ids.len() > context {
        return Err(HeliosError::Profile(format!(
            "{} gives {} tokens; profiling needs at least {} and the context holds {context}",
            text.name,
            ids.len(),
            opts.prompt_tokens.max(2)
        )));
    }

    on_step("teacher forcing");
    let forced = teacher_force(target, &ids, opts)?;
    let bytes = scored_bytes(target.tokenizer, &scored_text, &ids)?;

    on_step("warm-up");
    decode_run(target, &ids[..opts.prompt_tokens], 2, opts.depths[0])?;
    let mut runs: Vec<Vec<DecodeRun>> = vec![Vec::with_capacity(opts.runs); opts.depths.len()];
    for r in 0..opts.runs {
        for (i, &d) in opts.depths.iter().enumerate() {
            on_step(&format!("decode run {}/{} at depth {d}", r + 1, opts.runs));
            runs[i].push(decode_run(
                target,
                &ids[..opts.prompt_tokens],
                opts.decode_tokens,
                d,
            )?);
        }
    }

    let spec = model.spec();
    let base = model.resident_bytes();
    let mut depths = Vec::with_capacity(opts.depths.len());
    let mut generated = Vec::with_capacity(opts.depths.len());
    for (i, &d) in opts.depths.iter().enumerate() {
        let layers: usize = (0..d).map(|l| model.layer_bytes(l)).sum();
        let head = if d == n_layers {
            0
        } else {
            target.heads.head(d).map(ExitHead::bytes)?
        };
        let tps: Vec<f64> = runs[i].iter().map(|r| r.tokens_per_s).collect();
        let ttft: Vec<f64> = runs[i].iter().map(|r| r.ttft_ms).collect();
        depths.push(DepthTelemetry {
            depth: d,
            tokens_per_s: median(&tps),
            ttft_ms: Some(median(&ttft)),
            bits_per_byte: forced.nll_nats[i] / std::f64::consts::LN_2 / bytes.max(1) as f64,
            memory_bytes: (base.embedding + base.head + layers + head) as u64,
            kv_bytes_per_token: Some((2 * spec.kv_row_len() * KV_ELEMENT_BYTES * d) as u64),
            joules_per_token: None,
        });
        generated.push((d, runs[i][0].tokens.clone()));
    }
    let full_argmax = opts
        .depths
        .iter()
        .position(|&d| d == n_layers)
        .map(|i| &forced.argmax[i]);
    let argmax_agreement = match full_argmax {
        Some(full) => opts
            .depths
            .iter()
            .zip(&forced.argmax)
            .map(|(&d, a)| {
                let same = a.iter().zip(full).filter(|(x, y)| x == y).count();
                (d, same as f64 / full.len().max(1) as f64)
            })
            .collect(),
        None => Vec::new(),
    };
    let tuned = target
        .heads
        .iter()
        .any(|(_, h)| !matches!(h, ExitHead::Identity));
    let entry = ModelEntry {
        name: target.name.to_string(),
        path: target.path.map(str::to_string),
        url: None,
        remote_model: None,
        tokenizer: None,
        context_length: None,
        size_bytes: target.size_bytes,
        layers: n_layers,
        exit_layers: opts
            .depths
            .iter()
            .copied()
            .filter(|&d| d < n_layers)
            .collect(),
        exit_heads: Some(if tuned {
            ExitHeadsKind::Tuned
        } else {
            ExitHeadsKind::LogitLens
        }),
        profile: Some(ProfileInfo {
            text: text.name.to_string(),
            scored_tokens: ids.len() - 1,
            scored_bytes: bytes,
            prompt_tokens: opts.prompt_tokens,
            decode_tokens: opts.decode_tokens,
            runs: opts.runs,
            threads: target.threads,
            threshold: opts.threshold,
            confidence: opts.measure,
            exit_histogram: forced.exits,
            seconds: t0.elapsed().as_secs_f64(),
        }),
        depths,
    };
    entry
        .check()
        .map_err(|e| HeliosError::Profile(format!("the measured entry is inconsistent: {e}")))?;
    Ok(Profile {
        entry,
        scored_text,
        generated,
        argmax_agreement,
    })
}

/// Depths increase, lie in `1..=n_layers`, and below full depth have a head.
fn check_depths(target: &ProfileTarget<'_>, depths: &[usize]) -> Result<()> {
    let n = target.model.n_layers();
    if depths.is_empty() {
        return Err(HeliosError::Profile("no depth to profile".into()));
    }
    if let Some(w) = depths.windows(2).find(|w| w[0] >= w[1]) {
        return Err(HeliosError::Profile(format!(
            "depths must increase, got {} then {}",
            w[0], w[1]
        )));
    }
    for &d in depths {
        if d == 0 || d > n {
            return Err(HeliosError::Profile(format!(
                "depth {d} is outside 1..={n} (the model has {n} layers)"
            )));
        }
        if d < n {
            target.heads.head(d)?;
        }
        if !(0..d).all(|l| target.model.is_resident(l)) {
            return Err(HeliosError::Profile(format!(
                "depth {d} needs layers 0..{d} resident; resident: {:?}",
                target.model.resident_layers()
            )));
        }
    }
    Ok(())
}

/// UTF-8 bytes the scored tokens stand for, counted as `score_text` counts them: the whole
/// text when a BOS was prepended, otherwise all but the first token's text.
fn scored_bytes(tokenizer: &Tokenizer, text: &str, ids: &[u32]) -> Result<usize> {
    let bos_added = tokenizer.adds_bos() && ids.first() == tokenizer.bos_id().as_ref();
    if bos_added {
        return Ok(text.len());
    }
    Ok(text
        .len()
        .saturating_sub(tokenizer.decode(&ids[..1], false)?.len()))
}

/// Per profiled depth: total NLL in nats and argmax per position; the exit histogram.
struct Forced {
    nll_nats: Vec<f64>,
    argmax: Vec<Vec<u32>>,
    exits: ExitHistogram,
}

/// One forward pass over `ids` (inputs `ids[..n-1]`, targets `ids[1..]`), reading every
/// profiled depth on the way up.
fn teacher_force(target: &ProfileTarget<'_>, ids: &[u32], opts: &ProfileOptions) -> Result<Forced> {
    let model = target.model;
    let n_layers = model.n_layers();
    let inputs = &ids[..ids.len() - 1];
    let rows = inputs.len();
    let mut kv = DenseKv::new(n_layers, model.spec().kv_row_len());
    let mut h = model.embed(inputs)?;
    let mut done = 0;
    let mut out = Forced {
        nll_nats: Vec::with_capacity(opts.depths.len()),
        argmax: Vec::with_capacity(opts.depths.len()),
        exits: ExitHistogram::new(),
    };
    // First passing exit per position (None: not yet).
    let mut exit_at: Vec<Option<usize>> = vec![None; rows];
    for &d in &opts.depths {
        let _span = tracing::debug_span!("profile_depth", depth = d).entered();
        let mut batch = ForwardBatch::single(&mut kv, 0, rows);
        h = model.forward_layers(h, done..d, &mut batch)?;
        done = d;
        let mut nll = 0f64;
        let mut argmax = Vec::with_capacity(rows);
        let mut r = 0;
        while r < rows {
            let n = HEAD_ROWS.min(rows - r);
            let logits = target.heads.logits(model, d, &h.narrow(0, r, n)?)?;
            let logits: Vec<Vec<f32>> = logits.to_vec2()?;
            for (i, row) in logits.iter().enumerate() {
                let (l, stats) = nll_and_stats(row, ids[r + i + 1]);
                nll += l;
                argmax.push(stats.argmax);
                let slot = &mut exit_at[r + i];
                if slot.is_none()
                    && (d == n_layers || passes(opts.measure.of(&stats), opts.threshold))
                {
                    *slot = Some(d);
                }
            }
            r += n;
        }
        out.nll_nats.push(nll);
        out.argmax.push(argmax);
    }
    for e in exit_at {
        out.exits.record(e.unwrap_or(n_layers));
    }
    Ok(out)
}

/// `-ln softmax(logits)[target]` and the top of the distribution, in one pass over the
/// vocabulary (sums in f64).
pub(crate) fn nll_and_stats(logits: &[f32], target: u32) -> (f64, TokenStats) {
    let (mut i1, mut l1, mut l2) = (0usize, f32::NEG_INFINITY, f32::NEG_INFINITY);
    for (i, &l) in logits.iter().enumerate() {
        if l > l1 {
            l2 = l1;
            l1 = l;
            i1 = i;
        } else if l > l2 {
            l2 = l;
        }
    }
    let max = f64::from(l1);
    let z: f64 = logits.iter().map(|&l| (f64::from(l) - max).exp()).sum();
    let nll = match logits.get(target as usize) {
        Some(&l) => z.ln() + max - f64::from(l),
        None => f64::INFINITY,
    };
    let p1 = 1.0 / z;
    let p2 = if l2.is_finite() {
        (f64::from(l2) - max).exp() / z
    } else {
        0.0
    };
    let stats = TokenStats {
        argmax: i1 as u32,
        max_prob: p1 as f32,
        margin: (p1 - p2) as f32,
    };
    (nll, stats)
}

#[derive(Clone)]
struct DecodeRun {
    tokens: Vec<u32>,
    /// Prompt prefill through the first sampled token.
    ttft_ms: f64,
    /// Tokens after the first per second.
    tokens_per_s: f64,
}

/// Greedy decoding of `count` tokens after `prompt`, layers `0..depth` and the exit head at
/// `depth`, batch 1.
fn decode_run(
    target: &ProfileTarget<'_>,
    prompt: &[u32],
    count: usize,
    depth: usize,
) -> Result<DecodeRun> {
    let model = target.model;
    let mut kv = DenseKv::new(model.n_layers(), model.spec().kv_row_len());
    let mut sampler = Sampler::new(&SamplingParams::greedy(count));
    let mut history = prompt.to_vec();
    let t0 = Instant::now();
    let mut logits = logits_at(target, &mut kv, 0, prompt, depth)?;
    let mut next = sampler.sample(&logits, &history, prompt.len()).token;
    let ttft = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut tokens = vec![next];
    while tokens.len() < count {
        history.push(next);
        logits = logits_at(target, &mut kv, history.len() - 1, &[next], depth)?;
        next = sampler.sample(&logits, &history, prompt.len()).token;
        tokens.push(next);
    }
    let secs = t1.elapsed().as_secs_f64();
    Ok(DecodeRun {
        tokens_per_s: (count - 1) as f64 / secs.max(f64::MIN_POSITIVE),
        ttft_ms: ttft * 1000.0,
        tokens,
    })
}

/// Logits of the last of `tokens` (at positions `start..`) at `depth`.
fn logits_at(
    target: &ProfileTarget<'_>,
    kv: &mut DenseKv,
    start: usize,
    tokens: &[u32],
    depth: usize,
) -> Result<Vec<f32>> {
    let model = target.model;
    let x = model.embed(tokens)?;
    let mut batch = ForwardBatch::single(kv, start, tokens.len());
    let h = model.forward_layers(x, 0..depth, &mut batch)?;
    let last: Tensor = h.narrow(0, tokens.len() - 1, 1)?;
    let logits = target.heads.logits(model, depth, &last)?;
    Ok(logits.flatten_all()?.to_vec1::<f32>()?)
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => 0.5 * (s[n / 2 - 1] + s[n / 2]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_and_stats_match_the_exits_crate() {
        let l = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln(), -3.0];
        let (nll, s) = nll_and_stats(&l, 1);
        let want = switchyard_exits::confidence::token_stats(&l);
        assert_eq!(s.argmax, want.argmax);
        assert!((s.max_prob - want.max_prob).abs() < 1e-7);
        assert!((s.margin - want.margin).abs() < 1e-7);
        assert!((nll - switchyard_exits::confidence::nll(&l, 1)).abs() < 1e-12);
        assert_eq!(nll_and_stats(&l, 9).0, f64::INFINITY);
    }

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}
