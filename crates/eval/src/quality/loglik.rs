//! The log-likelihood seam every mode is scored through ([`LogLikelihood`]), lm-eval's way of
//! tokenizing a (context, continuation) pair, and the implementation over a
//! [`LayeredModel`] at any weight precision ([`LayeredScorer`]).

use switchyard_models::{DenseKv, ForwardBatch, LayeredModel, ModelError};
use switchyard_tokenizer::Tokenizer;

use crate::{EvalError, Result};

/// Scores a continuation after a context: the sum over the continuation's tokens of
/// ln p(token | all tokens before it), in nats.
///
/// A mode implements this once (a precision, an exit depth, a remote backend that returns
/// log-probs) and every multiple-choice benchmark scores it.
pub trait LogLikelihood {
    fn loglikelihood(&mut self, context: &[u32], continuation: &[u32]) -> Result<f64>;
}

impl<L: LogLikelihood + ?Sized> LogLikelihood for &mut L {
    fn loglikelihood(&mut self, context: &[u32], continuation: &[u32]) -> Result<f64> {
        (**self).loglikelihood(context, continuation)
    }
}

/// Token ids of `text`, with BOS in front when the model's metadata asks for one (as
/// llama.cpp and the engine do) and never an EOS.
fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let mut ids: Vec<u32> = Vec::with_capacity(text.len() / 3 + 1);
    if tok.adds_bos() {
        ids.extend(tok.bos_id());
    }
    ids.extend(tok.encode(text, false, false)?);
    Ok(ids)
}

/// Splits a (context, continuation) pair into token ids the way lm-eval-harness does
/// (`_encode_pair`):
///
/// * whitespace at the end of the context moves to the front of the continuation;
/// * the context alone and context + continuation are tokenized; the continuation's tokens
///   are the whole string's tokens after the context's token count.
///
/// So the continuation is tokenized as it would be generated after the context (a merge
/// across the boundary lands in the continuation), while the context's tokens are its own.
/// BOS is added in front when the model's metadata asks for one; an empty context (no BOS)
/// becomes the EOS token, as lm-eval does, so the first continuation token has a condition.
pub fn encode_pair(
    tok: &Tokenizer,
    context: &str,
    continuation: &str,
) -> Result<(Vec<u32>, Vec<u32>)> {
    let trimmed = context.trim_end();
    let moved = &context[trimmed.len()..];
    let continuation = format!("{moved}{continuation}");
    let mut ctx = encode(tok, trimmed)?;
    let mut whole = encode(tok, &format!("{trimmed}{continuation}"))?;
    if ctx.is_empty() {
        let eos = tok.eos_id().ok_or_else(|| {
            EvalError::Invalid("empty context and the tokenizer has no EOS token".into())
        })?;
        ctx.push(eos);
        whole.insert(0, eos);
    }
    let cont = whole.get(ctx.len()..).unwrap_or_default().to_vec();
    if cont.is_empty() {
        return Err(EvalError::Invalid(format!(
            "continuation {continuation:?} has no tokens of its own after its context"
        )));
    }
    Ok((ctx, cont))
}

/// [`LogLikelihood`] over a [`LayeredModel`] run at full depth, with the weights in whatever
/// format the model was loaded (so one scorer serves every precision mode).
///
/// It keeps the K/V of the last sequence it ran and reuses the longest prefix the next one
/// shares with it: the choices of one item share their context, and few-shot items share
/// their examples. The context's last token is always run again, since its logits predict the
/// first continuation token. Attention computes a row the same way however the sequence was
/// chunked, so reuse does not change the result.
pub struct LayeredScorer<'m> {
    model: &'m LayeredModel,
    kv: DenseKv,
    /// The tokens whose K/V `kv` holds, positions `0..cached.len()`.
    cached: Vec<u32>,
    forwarded: usize,
}

impl<'m> LayeredScorer<'m> {
    pub fn new(model: &'m LayeredModel) -> Self {
        Self {
            model,
            kv: DenseKv::new(model.n_layers(), model.spec().kv_row_len()),
            cached: Vec::new(),
            forwarded: 0,
        }
    }

    /// Tokens run through the model so far (reused prefixes not counted).
    pub fn tokens_forwarded(&self) -> usize {
        self.forwarded
    }

    fn run(&mut self, context: &[u32], continuation: &[u32]) -> Result<f64> {
        let model = self.model;
        if context.is_empty() || continuation.is_empty() {
            return Err(EvalError::Invalid(format!(
                "log-likelihood needs a context and a continuation ({} and {} tokens given)",
                context.len(),
                continuation.len()
            )));
        }
        let mut full = Vec::with_capacity(context.len() + continuation.len());
        full.extend_from_slice(context);
        full.extend_from_slice(continuation);
        // Inputs are every token but the last; as lm-eval, a sequence longer than the model's
        // context loses tokens from the front of the context.
        let max_inputs = model.spec().context_length;
        let drop = (full.len() - 1).saturating_sub(max_inputs);
        if drop >= context.len() {
            return Err(EvalError::Invalid(format!(
                "continuation of {} tokens does not fit the context length {max_inputs}",
                continuation.len()
            )));
        }
        let inputs = &full[drop..full.len() - 1];
        // Row r of the hidden states predicts inputs[r + 1]; the first continuation token is
        // predicted by the context's last row.
        let first_row = context.len() - drop - 1;
        let keep = self
            .cached
            .iter()
            .zip(inputs)
            .take_while(|(a, b)| a == b)
            .count()
            .min(first_row);
        self.kv.truncate(keep);
        self.cached.truncate(keep);

        let fresh = &inputs[keep..];
        let x = model.embed(fresh)?;
        let mut batch = ForwardBatch::single(&mut self.kv, keep, fresh.len());
        let h = model.forward_layers(x, 0..model.n_layers(), &mut batch)?;
        self.cached.extend_from_slice(fresh);
        self.forwarded += fresh.len();

        let rows = h
            .narrow(0, first_row - keep, continuation.len())
            .map_err(ModelError::from)?;
        let logits = model
            .logits(&rows)?
            .to_vec2::<f32>()
            .map_err(ModelError::from)?;
        let vocab = logits.first().map_or(0, Vec::len);
        if let Some(&t) = continuation.iter().find(|&&t| t as usize >= vocab) {
            return Err(EvalError::Invalid(format!(
                "continuation token {t} is outside the model's {vocab} logits"
            )));
        }
        Ok(logits
            .iter()
            .zip(continuation)
            .map(|(row, &t)| log_softmax_at(row, t as usize))
            .sum())
    }
}

impl LogLikelihood for LayeredScorer<'_> {
    fn loglikelihood(&mut self, context: &[u32], continuation: &[u32]) -> Result<f64> {
        let _span = tracing::debug_span!(
            "loglikelihood",
            context = context.len(),
            continuation = continuation.len()
        )
        .entered();
        let out = self.run(context, continuation);
        if out.is_err() {
            // A failed forward may have written part of the cache: start afresh next time.
            self.kv.truncate(0);
            self.cached.clear();
        }
        out
    }
}

/// ln softmax(row)[target], in f64.
fn log_softmax_at(row: &[f32], target: usize) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    row[target] as f64 - max - sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_of_a_small_row() {
        let row = [1.0f32, 2.0, 3.0];
        let lse = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        assert!((log_softmax_at(&row, 2) - (3.0 - lse)).abs() < 1e-12);
        assert!((log_softmax_at(&row, 0) - (1.0 - lse)).abs() < 1e-12);
    }
}
