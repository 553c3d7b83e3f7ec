//! Generation for one sequence: prefill the prompt, then decode token by token with the KV
//! cache, streaming text as it becomes final.

use std::time::Instant;

use candle_core::Tensor;
use switchyard_models::{DenseKv, ForwardBatch, LayeredModel};
use switchyard_request::{FinishReason, SamplingParams};
use switchyard_tokenizer::Tokenizer;

use crate::sampler::Sampler;
use crate::stop::{StopMatcher, StopOutcome};
use crate::{EngineError, Result};

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GenerationTiming {
    /// Prompt forward pass up to the first sampled token.
    pub prompt_secs: f64,
    /// Every later token.
    pub decode_secs: f64,
}

impl GenerationTiming {
    pub fn prompt_tokens_per_s(&self, prompt_tokens: usize) -> f64 {
        prompt_tokens as f64 / self.prompt_secs
    }

    /// Tokens after the first (which the prompt pass produced) per second of decoding.
    pub fn decode_tokens_per_s(&self, generated: usize) -> f64 {
        generated.saturating_sub(1) as f64 / self.decode_secs
    }
}

#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated tokens, end-of-generation token excluded.
    pub tokens: Vec<u32>,
    /// Their text, cut before a stop string.
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    pub timing: GenerationTiming,
}

/// Runs `prompt` through `model` and generates per `params`, calling `on_text` with each piece
/// of final text as soon as it is known.
pub fn generate(
    model: &LayeredModel,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    params: &SamplingParams,
    on_text: impl FnMut(&str),
) -> Result<Generation> {
    let kv = DenseKv::new(model.n_layers(), model.spec().kv_row_len());
    generate_with_cache(model, tokenizer, prompt, params, kv, on_text)
}

/// [`generate`] over a given empty cache, e.g. [`DenseKv::rounded_to_f16`] for the tokens the
/// serving engine gives with its default f16 blocks.
pub fn generate_with_cache(
    model: &LayeredModel,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    params: &SamplingParams,
    mut kv: DenseKv,
    mut on_text: impl FnMut(&str),
) -> Result<Generation> {
    params.validate()?;
    if prompt.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    let spec = model.spec();
    let context = spec.context_length;
    if prompt.len() >= context {
        return Err(EngineError::PromptTooLong {
            prompt: prompt.len(),
            context,
        });
    }
    let max_new = params.max_tokens.min(context - prompt.len());

    // The end tokens matter to the sampler only under `min_tokens`.
    let eog = if params.min_tokens > 0 {
        crate::end_of_generation_tokens(tokenizer)
    } else {
        Vec::new()
    };
    let mut sampler = Sampler::new(params).with_end_tokens(&eog);
    let mut stop = StopMatcher::new(&params.stop);
    let mut stream = tokenizer.stream();
    let mut history = prompt.to_vec();
    let mut out = Generation {
        tokens: Vec::new(),
        text: String::new(),
        finish_reason: FinishReason::Length,
        prompt_tokens: prompt.len(),
        timing: GenerationTiming::default(),
    };

    let t0 = Instant::now();
    let mut logits = last_logits(model, &mut kv, 0, prompt)?;
    let mut decode_start = None;
    let mut hit_stop_string = false;
    loop {
        let next = sampler.sample(&logits, &history, prompt.len()).token;
        if decode_start.is_none() {
            out.timing.prompt_secs = t0.elapsed().as_secs_f64();
            decode_start = Some(Instant::now());
        }
        if (!params.ignore_eos && tokenizer.is_end_of_generation(next))
            || params.stop_token_ids.contains(&next)
        {
            out.finish_reason = FinishReason::Stop;
            break;
        }
        out.tokens.push(next);
        history.push(next);
        if let Some(piece) = stream.push(next)? {
            match stop.push(&piece) {
                StopOutcome::Continue(t) => emit(&mut out.text, &t, &mut on_text),
                StopOutcome::Stopped(t) => {
                    emit(&mut out.text, &t, &mut on_text);
                    out.finish_reason = FinishReason::Stop;
                    hit_stop_string = true;
                    break;
                }
            }
        }
        if out.tokens.len() >= max_new {
            break;
        }
        logits = last_logits(model, &mut kv, history.len() - 1, &[next])?;
    }
    if !hit_stop_string {
        // Bytes the stream decoder held (an incomplete character), then text held back as a
        // possible stop-string start.
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
    out.timing.decode_secs = decode_start.map_or(0.0, |t| t.elapsed().as_secs_f64());
    Ok(out)
}

fn emit(text: &mut String, piece: &str, on_text: &mut impl FnMut(&str)) {
    if !piece.is_empty() {
        text.push_str(piece);
        on_text(piece);
    }
}

/// Forwards `tokens` at positions `start..` through all layers and returns the logits of the
/// last one.
pub fn last_logits(
    model: &LayeredModel,
    kv: &mut DenseKv,
    start: usize,
    tokens: &[u32],
) -> Result<Vec<f32>> {
    last_logits_at_depth(model, kv, start, tokens, model.n_layers())
}

/// As [`last_logits`], through the first `depth` layers only; the hidden state there goes
/// through the model's own final norm and LM head (the logit lens).
pub fn last_logits_at_depth(
    model: &LayeredModel,
    kv: &mut DenseKv,
    start: usize,
    tokens: &[u32],
    depth: usize,
) -> Result<Vec<f32>> {
    let x = model.embed(tokens)?;
    let mut batch = ForwardBatch::single(kv, start, tokens.len());
    let h = model.forward_layers(x, 0..depth, &mut batch)?;
    let last: Tensor = h.narrow(0, tokens.len() - 1, 1)?;
    Ok(model.logits(&last)?.flatten_all()?.to_vec1::<f32>()?)
}
