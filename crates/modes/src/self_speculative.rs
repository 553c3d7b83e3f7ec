//! Self-speculative decoding (LayerSkip, Elhoushi et al. 2024): the draft is the model's own
//! layers `0..d` read out through the exit head at depth `d`, the verifier is layers `d..N` of
//! the same model, and the two share one KV cache and the draft's work.
//!
//! One [`DenseKv`] covers all layers. A round, with `S` tokens so far and the last (pending) one
//! in no layer of the cache yet:
//!
//! 1. **Draft**: the pending token goes through layers `0..d` at position `S-1` (writing their
//!    K/V there), the exit head gives `q₁`, `x₁` is drawn and goes through layers `0..d` at `S`,
//!    and so on up to `x_k`. The hidden state at depth `d` of each fed token is kept.
//! 2. **Verify**: `x_k` goes through layers `0..d` (no exit head: nothing reads its draft
//!    distribution), then the `k + 1` kept depth-`d` states run through layers `d..N` together
//!    at positions `S-1 … S+k-1`, writing those layers' K/V and giving `p₁ … p_{k+1}`. Layers
//!    `0..d` never run twice for a position: the verifier starts from the draft's states and
//!    attends to the K/V the draft wrote.
//! 3. **Accept** by Leviathan et al.'s rule ([`crate::speculative`]), so sampled output follows
//!    the full model's sampling distribution exactly, and greedy output is exactly the full
//!    model's greedy tokens, whatever the exit head's quality (a poor head only lowers the
//!    acceptance rate).
//! 4. **Roll back**: the cache is cut to `S + m` positions in every layer. The correction (or
//!    bonus) token is in no layer yet; it is the next round's pending token, so the next draft
//!    pass writes its layers `0..d` K/V.
//!
//! A single sequence for the same reason as [`crate::speculative`]: rounds keep different
//! numbers of tokens per sequence, and here the rollback is one truncate.

use std::time::Instant;

use candle_core::Tensor;
use switchyard_engine::sampler::log_softmax_at;
use switchyard_engine::{DecodedToken, GenerationTiming};
use switchyard_exits::block::BlockKv;
use switchyard_exits::ExitHeads;
use switchyard_models::{DenseKv, ForwardBatch, LayeredModel};
use switchyard_request::SamplingParams;
use switchyard_tokenizer::Tokenizer;

use crate::speculative::{
    check_draft_len, check_prompt, logit_rows, settle_round, text_only, Output, SpecGeneration,
    SpecSampler, SpecStats, DEFAULT_DRAFT_LEN,
};
use crate::{ModesError, Result};

/// One model drafting for itself from an early exit, for one sequence at a time.
#[derive(Debug, Clone, Copy)]
pub struct SelfSpeculativeDecoder<'m> {
    model: &'m LayeredModel,
    heads: &'m ExitHeads,
    depth: usize,
    k: usize,
}

impl<'m> SelfSpeculativeDecoder<'m> {
    /// Drafts from the exit at `depth` (`1..n_layers`, with a head in `heads`, which must fit
    /// `model`). Every layer must be resident.
    pub fn new(model: &'m LayeredModel, heads: &'m ExitHeads, depth: usize) -> Result<Self> {
        let n = model.n_layers();
        if !(1..n).contains(&depth) {
            return Err(ModesError::Invalid(format!(
                "draft depth must be 1 to {}, got {depth}",
                n - 1
            )));
        }
        heads.check_fits(model).map_err(ModesError::Invalid)?;
        heads.head(depth)?;
        if let Some(l) = (0..n).find(|&l| !model.is_resident(l)) {
            return Err(ModesError::Invalid(format!(
                "self-speculative decoding needs every layer resident; layer {l} is not"
            )));
        }
        Ok(Self {
            model,
            heads,
            depth,
            k: DEFAULT_DRAFT_LEN,
        })
    }

    /// Proposes `k` tokens per round (`1..=MAX_DRAFT_LEN`).
    pub fn with_draft_len(mut self, k: usize) -> Result<Self> {
        self.k = check_draft_len(k)?;
        Ok(self)
    }

    pub fn draft_len(&self) -> usize {
        self.k
    }

    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Generates from `prompt` per `params` (validated here), calling `on_text` with each piece
    /// of final text as soon as it is known; stops, limits and streaming behave as
    /// [`switchyard_engine::generate`] on the model alone.
    pub fn generate(
        &self,
        tokenizer: &Tokenizer,
        prompt: &[u32],
        params: &SamplingParams,
        on_text: impl FnMut(&str),
    ) -> Result<SpecGeneration> {
        self.generate_with(tokenizer, prompt, params, text_only(on_text))
    }

    /// [`Self::generate`], calling `emit` with each output token, its log-probability and the
    /// text it made final; `emit` returning `false` ends the generation with
    /// [`switchyard_request::FinishReason::Abort`] before the next round.
    pub fn generate_with(
        &self,
        tokenizer: &Tokenizer,
        prompt: &[u32],
        params: &SamplingParams,
        emit: impl FnMut(Option<DecodedToken>, &str) -> bool,
    ) -> Result<SpecGeneration> {
        let _span =
            tracing::debug_span!("self_speculative", k = self.k, depth = self.depth).entered();
        let (model, d, n) = (self.model, self.depth, self.model.n_layers());
        let max_new = check_prompt(params, prompt, model.spec().context_length)?;
        let mut sampler = SpecSampler::new(params);
        let mut out = Output::new(tokenizer, prompt, params, max_new, emit);
        let mut kv = DenseKv::new(n, model.spec().kv_row_len());
        let mut stats = SpecStats::default();

        let head = self.heads.head(d)?;
        // A block head's own K/V: the prompt's, then each drafted position's.
        let mut block_kv = head.is_sequential().then(BlockKv::default);

        let t0 = Instant::now();
        // The prompt through layers 0..d, where a block head's K/V take it, then the rest.
        let logits = {
            let mut batch = ForwardBatch::single(&mut kv, 0, prompt.len());
            let x = model.forward_layers(model.embed(prompt)?, 0..d, &mut batch)?;
            if let Some(bkv) = &mut block_kv {
                head.write_kv(&x, 0, bkv)?;
            }
            let h = model.forward_layers(x, d..n, &mut batch)?;
            let last = h.narrow(0, prompt.len() - 1, 1)?;
            model.logits(&last)?.flatten_all()?.to_vec1::<f32>()?
        };
        stats.target_forwards += 1;
        let first = sampler.sample(&sampler.dist(&logits, prompt));
        let prompt_secs = t0.elapsed().as_secs_f64();
        let decode_start = Instant::now();
        let mut done = out.push(first, log_softmax_at(&logits, first as usize))?;
        while !done {
            let _round = tracing::trace_span!("self_spec_round").entered();
            let mut seq = out.history().to_vec();
            let s = seq.len();
            // One less than allowed: the correction or bonus is always one more token.
            let k = self.k.min(out.remaining().saturating_sub(1));

            let t = Instant::now();
            let mut states = Vec::with_capacity(k + 1);
            let mut q = Vec::with_capacity(k);
            for j in 0..k {
                let _step = tracing::trace_span!("draft_step").entered();
                let h = self.shallow(&mut kv, s - 1 + j, seq[s - 1 + j])?;
                let z = head.translate_seq(&h, s - 1 + j, block_kv.as_mut())?;
                let logits = model.logits(&z)?.flatten_all()?;
                let qj = sampler.dist(&logits.to_vec1::<f32>()?, &seq);
                stats.draft_forwards += 1;
                seq.push(sampler.sample(&qj));
                q.push(qj);
                states.push(h);
            }
            stats.draft_secs += t.elapsed().as_secs_f64();

            let t = Instant::now();
            let rows = {
                let _verify = tracing::trace_span!("verify", k).entered();
                states.push(self.shallow(&mut kv, s - 1 + k, seq[s - 1 + k])?);
                let x = Tensor::cat(&states, 0)?;
                let mut batch = ForwardBatch::single(&mut kv, s - 1, k + 1);
                let h = model.forward_layers(x, d..n, &mut batch)?;
                logit_rows(&model.logits(&h)?)?
            };
            let verdict = settle_round(&mut sampler, &rows, &seq, s, &q, t, &mut stats);

            kv.truncate(s + verdict.accepted);
            if let Some(bkv) = &mut block_kv {
                // The block holds the drafted positions `..s-1+k`; keep the accepted ones and
                // add the last draft's when all were accepted (its K/V come from its input).
                let keep = s + verdict.accepted;
                bkv.truncate(keep)?;
                for p in bkv.len()..keep {
                    head.write_kv(&states[p + 1 - s], p, bkv)?;
                }
            }
            done = out.push_all(&seq[s..s + verdict.accepted], verdict.next, &rows)?;
        }
        let timing = GenerationTiming {
            prompt_secs,
            decode_secs: decode_start.elapsed().as_secs_f64(),
        };
        Ok(SpecGeneration {
            generation: out.finish(timing)?,
            stats,
        })
    }

    /// `token` at `pos` through layers `0..depth` (writing their K/V): its hidden state there.
    fn shallow(&self, kv: &mut DenseKv, pos: usize, token: u32) -> Result<Tensor> {
        let x = self.model.embed(&[token])?;
        let mut batch = ForwardBatch::single(kv, pos, 1);
        Ok(self.model.forward_layers(x, 0..self.depth, &mut batch)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::speculative::testing::{
        model, stat_worst_position, tokenizer, STAT_PROMPT, STAT_VOCAB,
    };

    /// Sampled self-speculation follows the full model's sampling distribution (chi-square at
    /// p = 0.001 on each speculated position): the verifier's rows line up with the draft's.
    #[test]
    fn sampled_output_follows_the_full_models_distribution() {
        let m = model(21, 3, STAT_VOCAB);
        let heads = ExitHeads::logit_lens(&m, "synthetic", &[1]).expect("heads");
        let dec = SelfSpeculativeDecoder::new(&m, &heads, 1)
            .and_then(|d| d.with_draft_len(3))
            .expect("decoder");
        let tok = tokenizer(STAT_VOCAB);
        let worst = stat_worst_position(&m, "self-speculative", |params| {
            dec.generate(&tok, &STAT_PROMPT, params, |_| {})
        });
        assert!(worst < 1.0, "{worst:.2} of the critical value");
    }
}
