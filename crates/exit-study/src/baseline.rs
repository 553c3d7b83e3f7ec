//! The EE-LLM baseline as a user runs it: generation with per-token early exit (text streamed
//! as it becomes final) and teacher-forced scoring of a text under the same exit policy.

use std::time::Instant;

use switchyard_engine::{Sampler, StopMatcher, StopOutcome};
use switchyard_models::LayeredModel;
use switchyard_request::{FinishReason, SamplingParams};
use switchyard_tokenizer::Tokenizer;

use crate::decode::{DecodeCounters, EarlyExitDecoder, ExitPolicy, KvFix};
use switchyard_exits::confidence::nll;
use switchyard_exits::heads::ExitHeads;
use switchyard_exits::{ExitsError, Result};

#[derive(Debug, Clone)]
pub struct EeGeneration {
    /// Generated tokens, end-of-generation token excluded.
    pub tokens: Vec<u32>,
    /// Layers run for each generated token (end-of-generation token excluded).
    pub depths: Vec<usize>,
    /// Log-probability of each generated token under the distribution it was sampled from
    /// (the exit's or full depth's).
    pub logprobs: Vec<f32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt prefill and the first token.
    pub prompt_secs: f64,
    /// Every later token.
    pub decode_secs: f64,
    pub counters: DecodeCounters,
}

impl EeGeneration {
    pub fn decode_tokens_per_s(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.decode_secs
    }
}

/// The per-token early-exit decoding of one prompt at batch 1. The prompt but its last token is
/// prefilled at full depth; every token after that, the first generated one included, goes
/// through the exit policy.
pub fn generate_early_exit(
    ctx: &EeContext<'_>,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    params: &SamplingParams,
    mut on_text: impl FnMut(&str),
) -> Result<EeGeneration> {
    params.validate()?;
    let Some((&last, head)) = prompt.split_last() else {
        return Err(ExitsError::Invalid("the prompt is empty".into()));
    };
    let context = ctx.model.spec().context_length;
    if prompt.len() >= context {
        return Err(ExitsError::Invalid(format!(
            "the prompt has {} tokens; the context holds {context}",
            prompt.len()
        )));
    }
    let max_new = params.max_tokens.min(context - prompt.len());
    let mut dec = EarlyExitDecoder::new(ctx.model, ctx.heads, ctx.policy.clone(), ctx.fix)?;
    let mut sampler = Sampler::new(params);
    let mut stop = StopMatcher::new(&params.stop);
    let mut stream = tokenizer.stream();
    let mut history = prompt.to_vec();
    let mut out = EeGeneration {
        tokens: Vec::new(),
        depths: Vec::new(),
        logprobs: Vec::new(),
        text: String::new(),
        finish_reason: FinishReason::Length,
        prompt_tokens: prompt.len(),
        prompt_secs: 0.0,
        decode_secs: 0.0,
        counters: DecodeCounters::default(),
    };
    let t0 = Instant::now();
    dec.prefill(head)?;
    let mut step = dec.step(last)?;
    let mut decode_start = None;
    let mut stopped_by_string = false;
    loop {
        let sampled = sampler.sample(&step.logits, &history, prompt.len());
        let next = sampled.token;
        if decode_start.is_none() {
            out.prompt_secs = t0.elapsed().as_secs_f64();
            decode_start = Some(Instant::now());
        }
        if !params.ignore_eos && tokenizer.is_end_of_generation(next) {
            out.finish_reason = FinishReason::Stop;
            break;
        }
        out.tokens.push(next);
        out.depths.push(step.depth);
        out.logprobs.push(sampled.logprob);
        history.push(next);
        if let Some(piece) = stream.push(next)? {
            match stop.push(&piece) {
                StopOutcome::Continue(t) => emit(&mut out.text, &t, &mut on_text),
                StopOutcome::Stopped(t) => {
                    emit(&mut out.text, &t, &mut on_text);
                    out.finish_reason = FinishReason::Stop;
                    stopped_by_string = true;
                    break;
                }
            }
        }
        if out.tokens.len() >= max_new {
            break;
        }
        step = dec.step(next)?;
    }
    if !stopped_by_string {
        let tail = stream.flush().unwrap_or_default();
        match stop.push(&tail) {
            StopOutcome::Continue(t) => {
                emit(&mut out.text, &t, &mut on_text);
                let rest = stop.finish();
                emit(&mut out.text, &rest, &mut on_text);
            }
            StopOutcome::Stopped(t) => {
                emit(&mut out.text, &t, &mut on_text);
                out.finish_reason = FinishReason::Stop;
            }
        }
    }
    out.decode_secs = decode_start.map_or(0.0, |t| t.elapsed().as_secs_f64());
    out.counters = dec.counters().clone();
    Ok(out)
}

fn emit(text: &mut String, piece: &str, on_text: &mut impl FnMut(&str)) {
    if !piece.is_empty() {
        text.push_str(piece);
        on_text(piece);
    }
}

/// The model, its heads, and how tokens exit.
#[derive(Clone, Copy)]
pub struct EeContext<'a> {
    pub model: &'a LayeredModel,
    pub heads: &'a ExitHeads,
    pub policy: &'a ExitPolicy,
    pub fix: KvFix,
}

/// Teacher-forced scoring under an exit policy.
#[derive(Debug, Clone)]
pub struct ForcedScore {
    /// Targets scored (all tokens but the first).
    pub tokens_scored: usize,
    pub nll_nats: f64,
    /// UTF-8 bytes of the scored tokens' text.
    pub bytes: usize,
    pub bits_per_byte: f64,
    /// The argmax each step predicted (one per target).
    pub argmax: Vec<u32>,
    /// The depth each step took.
    pub depths: Vec<usize>,
    pub seconds: f64,
    pub counters: DecodeCounters,
}

/// Feeds `tokens` one by one (each step exits per the policy) and scores each next token under
/// the distribution the step produced: the quality of what per-token early exit would emit.
pub fn score_forced(
    ctx: &EeContext<'_>,
    tokenizer: &Tokenizer,
    tokens: &[u32],
) -> Result<ForcedScore> {
    if tokens.len() < 2 {
        return Err(ExitsError::Invalid(format!(
            "teacher forcing needs at least 2 tokens, got {}",
            tokens.len()
        )));
    }
    let t0 = Instant::now();
    let mut dec = EarlyExitDecoder::new(ctx.model, ctx.heads, ctx.policy.clone(), ctx.fix)?;
    let mut total = 0f64;
    let mut argmax = Vec::with_capacity(tokens.len() - 1);
    let mut depths = Vec::with_capacity(tokens.len() - 1);
    for w in tokens.windows(2) {
        let s = dec.step(w[0])?;
        total += nll(&s.logits, w[1]);
        argmax.push(s.stats.argmax);
        depths.push(s.depth);
    }
    let bytes = tokenizer.decode(&tokens[1..], false)?.len();
    Ok(ForcedScore {
        tokens_scored: tokens.len() - 1,
        nll_nats: total,
        bytes,
        bits_per_byte: total / std::f64::consts::LN_2 / bytes.max(1) as f64,
        argmax,
        depths,
        seconds: t0.elapsed().as_secs_f64(),
        counters: dec.counters().clone(),
    })
}
