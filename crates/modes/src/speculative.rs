//! Speculative decoding (Leviathan, Kalman and Matias 2023): a small draft model proposes `k`
//! tokens one at a time, the target scores all of them in one forward over `k + 1` positions,
//! and a rejection rule keeps a prefix of the proposal plus one token of the target's own, so
//! that every output token is distributed exactly as if the target alone had sampled it.
//!
//! The target reads the prompt and samples the first token itself, as plain decoding does (so
//! the first token streams as early). Then each round, with `S` tokens of prompt and output so
//! far, the last of which (the *pending* token) neither cache holds yet:
//!
//! 1. **Draft**: the draft reads the tokens it has not seen (the pending one; the whole prompt in
//!    the first round; after a fully accepted round also the last draft token), samples `x₁`
//!    from `q₁`, reads `x₁`, and so on up to `x_k`: `k` draft forwards.
//! 2. **Verify**: one target forward over `[pending, x₁ … x_k]` at positions `S-1 … S+k-1`
//!    gives `p₁ … p_{k+1}`.
//! 3. **Accept**: `x_i` is kept with probability `min(1, p_i(x_i) / q_i(x_i))`; at the first
//!    rejection the correction is drawn from `norm(max(0, p_i − q_i))` and the round ends; when
//!    all `k` are kept a bonus token is drawn from `p_{k+1}`.
//! 4. **Roll back**: both caches are cut to `S + m` positions (the pending token and the `m`
//!    kept ones, [`DenseKv::truncate`]); the round's last token becomes the pending one.
//!
//! Why the output is exact: for any `q`, a token leaves step 3 with probability
//! `min(q, p) + (1 − Σ min(q, p)) · norm(max(0, p − q)) = p` (Leviathan et al., Appendix A.1).
//! `p` and `q` here are the distributions the engine's [`Sampler`](switchyard_engine::Sampler)
//! draws from: logits after the request's repetition penalty, then temperature, top-k and top-p
//! (`SpecSampler::dist`). So the output follows the target's *sampling* distribution, not its
//! raw softmax. It is the same distribution, not the same random stream: a seed reproduces a
//! speculative run, not a plain one. Greedy requests make `p` and `q` point masses: a draft token is kept iff it is the
//! target's argmax, the correction is the target's argmax, and the output is exactly the
//! target's greedy tokens (the target's rows do not depend on how many rows share a forward;
//! see the models crate's invariant).
//!
//! Vocabularies. Correctness needs nothing of the draft but that its proposals are valid
//! target ids and that `q` is the distribution they were drawn from: the rule is exact for any
//! `q`, whatever the draft conditioned on. So the vocabularies may differ in size (a padded LM
//! head makes them differ within one family). Draft logits are cut to the
//! first `min(draft vocab, target vocab)` ids before the sampling transforms (`q` is zero
//! beyond) and the residual is taken over the target's whole vocabulary; an id the draft has
//! no embedding for (one the target produced past the draft's vocabulary) is read by the draft
//! as [`DRAFT_STAND_IN_ID`], which can only cost acceptance. A draft with another tokenizer
//! altogether stays exact but is rarely accepted. The Qwen2.5-Coder 0.5B and 1.5B GGUF files
//! both have 151,936 embedding rows (their tokenizer lists the padding ids too), so for that
//! pair none of this applies.
//!
//! Why a single sequence: sequences of a batch keep different numbers of tokens per round, so
//! their caches advance unevenly and each rejected suffix must be cut from its own cache. Here
//! each model has one contiguous [`DenseKv`] where that cut is a truncate; batched speculation
//! belongs in the serving engine's scheduler (vLLM's step already carries speculative tokens).

use std::time::Instant;

use candle_core::Tensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use switchyard_engine::generate::last_logits;
use switchyard_engine::sampler::{argmax, log_softmax_at};
use switchyard_engine::{
    DecodedToken, EngineError, Generation, GenerationTiming, StopMatcher, StopOutcome,
};
use switchyard_models::{DenseKv, ForwardBatch, LayeredModel, SeqKv};
use switchyard_request::{FinishReason, SamplingParams};
use switchyard_tokenizer::{StreamDecoder, Tokenizer};

use crate::{ModesError, Result};

/// Draft tokens per round unless set otherwise. Leviathan et al. show the best draft length
/// grows with the acceptance rate and lies in the low single digits for the rates small drafts
/// reach (0.6–0.8); 4 sits there.
pub const DEFAULT_DRAFT_LEN: usize = 4;

/// What the draft reads in place of an id past its vocabulary (see the module notes).
pub const DRAFT_STAND_IN_ID: u32 = 0;

/// Longest draft accepted: the verify forward holds `k + 1` rows of logits over the whole
/// vocabulary, and past this acceptance rates make longer drafts pure waste.
pub const MAX_DRAFT_LEN: usize = 32;

/// Work counters of one speculative generation.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SpecStats {
    /// Draft-and-verify rounds (the first token, sampled from the prompt pass, is no round).
    pub rounds: usize,
    /// Tokens proposed by the draft.
    pub drafted: usize,
    /// Proposed tokens the rule kept (counted before any end-of-generation or stop cut).
    pub accepted: usize,
    /// Forward passes of the draft (for self-speculation: passes through layers `0..d` and the
    /// exit head).
    pub draft_forwards: usize,
    /// Forward passes of the target, the prompt pass included (for self-speculation: the
    /// prompt pass and each verification through layers `d..N`).
    pub target_forwards: usize,
    /// Wall time of the draft steps.
    pub draft_secs: f64,
    /// Wall time of the verify steps, the accept/reject rule included.
    pub verify_secs: f64,
}

impl SpecStats {
    /// Kept over proposed tokens; 0 when nothing was proposed.
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Tokens each round produced on average (accepted plus the correction or bonus).
    pub fn tokens_per_round(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            (self.accepted + self.rounds) as f64 / self.rounds as f64
        }
    }
}

/// A generation and how speculation went.
#[derive(Debug, Clone)]
pub struct SpecGeneration {
    pub generation: Generation,
    pub stats: SpecStats,
}

/// A draft model speeding up a target for one sequence at a time.
#[derive(Debug, Clone, Copy)]
pub struct SpeculativeDecoder<'m> {
    draft: &'m LayeredModel,
    target: &'m LayeredModel,
    k: usize,
    /// Ids both vocabularies have: `min(draft, target)`.
    common_vocab: usize,
}

impl<'m> SpeculativeDecoder<'m> {
    /// Both models must have every layer resident. Their vocabularies may differ in size (see
    /// the module notes); they should share a tokenizer for the draft to be of any use.
    pub fn new(draft: &'m LayeredModel, target: &'m LayeredModel) -> Result<Self> {
        for (role, m) in [("draft", draft), ("target", target)] {
            if let Some(l) = (0..m.n_layers()).find(|&l| !m.is_resident(l)) {
                return Err(ModesError::Invalid(format!(
                    "speculative decoding needs all layers of the {role} resident; layer {l} is not"
                )));
            }
        }
        let (dv, tv) = (draft.spec().vocab_size, target.spec().vocab_size);
        if dv != tv {
            tracing::warn!(
                draft = dv,
                target = tv,
                "vocabulary sizes differ; the draft proposes only the first {} ids",
                dv.min(tv)
            );
        }
        Ok(Self {
            draft,
            target,
            k: DEFAULT_DRAFT_LEN,
            common_vocab: dv.min(tv),
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

    /// Generates from `prompt` per `params` (validated here), calling `on_text` with each piece
    /// of final text as soon as it is known; stops, limits and streaming behave as
    /// [`switchyard_engine::generate`] on the target alone.
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
    /// [`FinishReason::Abort`] before the next round.
    pub fn generate_with(
        &self,
        tokenizer: &Tokenizer,
        prompt: &[u32],
        params: &SamplingParams,
        emit: impl FnMut(Option<DecodedToken>, &str) -> bool,
    ) -> Result<SpecGeneration> {
        let _span = tracing::debug_span!("speculative", k = self.k).entered();
        let target = self.target;
        let max_new = check_prompt(params, prompt, target.spec().context_length)?;
        let mut sampler = SpecSampler::new(params);
        let mut out = Output::new(tokenizer, prompt, params, max_new, emit);
        let mut target_kv = DenseKv::new(target.n_layers(), target.spec().kv_row_len());
        let mut draft_kv = DenseKv::new(self.draft.n_layers(), self.draft.spec().kv_row_len());
        let mut stats = SpecStats::default();

        let t0 = Instant::now();
        let logits = last_logits(target, &mut target_kv, 0, prompt)?;
        stats.target_forwards += 1;
        let first = sampler.sample(&sampler.dist(&logits, prompt));
        let prompt_secs = t0.elapsed().as_secs_f64();
        let decode_start = Instant::now();
        let mut done = out.push(first, log_softmax_at(&logits, first as usize))?;
        while !done {
            let _round = tracing::trace_span!("spec_round").entered();
            let mut seq = out.history().to_vec();
            let s = seq.len();
            let k = self.round_len(out.remaining(), s);

            let t = Instant::now();
            let mut q = Vec::with_capacity(k);
            for _ in 0..k {
                let _step = tracing::trace_span!("draft_step").entered();
                let seen = draft_kv.len(0);
                let unread = self.draft_ids(&seq[seen..]);
                let logits = last_logits(self.draft, &mut draft_kv, seen, &unread)?;
                stats.draft_forwards += 1;
                let qj = sampler.dist(&logits[..self.common_vocab], &seq);
                seq.push(sampler.sample(&qj));
                q.push(qj);
            }
            stats.draft_secs += t.elapsed().as_secs_f64();

            let t = Instant::now();
            let rows = {
                let _verify = tracing::trace_span!("verify", k).entered();
                let x = target.embed(&seq[s - 1..])?;
                let mut batch = ForwardBatch::single(&mut target_kv, s - 1, k + 1);
                let h = target.forward_layers(x, 0..target.n_layers(), &mut batch)?;
                logit_rows(&target.logits(&h)?)?
            };
            let verdict = settle_round(&mut sampler, &rows, &seq, s, &q, t, &mut stats);

            target_kv.truncate(s + verdict.accepted);
            draft_kv.truncate(s + verdict.accepted);
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

    /// `tokens` as the draft reads them: ids past its vocabulary replaced.
    fn draft_ids(&self, tokens: &[u32]) -> Vec<u32> {
        let vocab = self.draft.spec().vocab_size;
        tokens
            .iter()
            .map(|&t| {
                if (t as usize) < vocab {
                    t
                } else {
                    DRAFT_STAND_IN_ID
                }
            })
            .collect()
    }

    /// Draft tokens this round: at most `k`, one less than the tokens still allowed (the
    /// correction or bonus is always one more), and no more than the draft's context holds
    /// (it reads positions up to `s + k - 2`). Zero makes the round a plain target step.
    fn round_len(&self, remaining: usize, s: usize) -> usize {
        let by_context = (self.draft.spec().context_length + 1).saturating_sub(s);
        self.k.min(remaining.saturating_sub(1)).min(by_context)
    }
}

pub(crate) fn check_draft_len(k: usize) -> Result<usize> {
    if !(1..=MAX_DRAFT_LEN).contains(&k) {
        return Err(ModesError::Invalid(format!(
            "draft length must be 1 to {MAX_DRAFT_LEN}, got {k}"
        )));
    }
    Ok(k)
}

/// Validates the request against a model's context as [`switchyard_engine::generate`] does, and
/// returns the most tokens to generate.
pub(crate) fn check_prompt(
    params: &SamplingParams,
    prompt: &[u32],
    context: usize,
) -> Result<usize> {
    params.validate().map_err(EngineError::from)?;
    if prompt.is_empty() {
        return Err(EngineError::EmptyPrompt.into());
    }
    if prompt.len() >= context {
        return Err(EngineError::PromptTooLong {
            prompt: prompt.len(),
            context,
        }
        .into());
    }
    Ok(params.max_tokens.min(context - prompt.len()))
}

/// The end of one draft-and-verify round, the same for both decoders: the target's
/// distributions at the drafted positions (`rows`, one per drafted token plus the bonus),
/// the accept/reject verdict on `seq[s..]`, and the round's counters.
pub(crate) fn settle_round(
    sampler: &mut SpecSampler,
    rows: &[Vec<f32>],
    seq: &[u32],
    s: usize,
    q: &[Dist],
    started: Instant,
    stats: &mut SpecStats,
) -> Verdict {
    stats.target_forwards += 1;
    let p: Vec<Dist> = rows
        .iter()
        .enumerate()
        .map(|(j, l)| sampler.dist(l, &seq[..s + j]))
        .collect();
    let verdict = sampler.verify(&seq[s..], q, &p);
    stats.verify_secs += started.elapsed().as_secs_f64();
    stats.rounds += 1;
    stats.drafted += q.len();
    stats.accepted += verdict.accepted;
    verdict
}

/// Logits `[rows, vocab]` as one vector per row.
pub(crate) fn logit_rows(logits: &Tensor) -> Result<Vec<Vec<f32>>> {
    Ok(logits.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?)
}

/// A next-token distribution after the request's sampling transforms.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Dist {
    /// Greedy: all mass on one token.
    Point(u32),
    /// Probabilities by token id (summing to 1); ids past the end have none.
    Probs(Vec<f64>),
}

impl Dist {
    fn prob(&self, token: u32) -> f64 {
        match self {
            Self::Point(t) if *t == token => 1.0,
            Self::Point(_) => 0.0,
            Self::Probs(p) => p.get(token as usize).copied().unwrap_or(0.0),
        }
    }
}

/// The outcome of verifying one draft.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// Draft tokens kept, a prefix of the draft.
    pub accepted: usize,
    /// The correction (after a rejection) or the bonus token (all kept).
    pub next: u32,
}

/// Deliberately wrong acceptance rules, to show the distribution test can fail.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rule {
    Exact,
    /// Keep every draft token.
    AlwaysAccept,
    /// After a rejection, draw the correction from `p` instead of `norm(max(0, p − q))`.
    CorrectFromTarget,
}

#[cfg(test)]
thread_local! {
    /// The rule samplers made on this thread use.
    pub(crate) static RULE: std::cell::Cell<Rule> = const { std::cell::Cell::new(Rule::Exact) };
}

/// The request's sampling transforms as distributions, and the draws of speculative decoding
/// (draft tokens, acceptance tests, corrections) from one seeded generator.
#[derive(Debug, Clone)]
pub(crate) struct SpecSampler {
    params: SamplingParams,
    rng: StdRng,
    #[cfg(test)]
    pub(crate) rule: Rule,
}

impl SpecSampler {
    /// `params` must be valid.
    pub fn new(params: &SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Self {
            params: params.clone(),
            rng,
            #[cfg(test)]
            rule: RULE.with(std::cell::Cell::get),
        }
    }

    /// The distribution [`switchyard_engine::Sampler::sample`] draws from for these logits and
    /// history: the repetition penalty, then the argmax (greedy), or temperature, top-k and
    /// top-p with the same order, tie-breaking and cut-offs.
    pub fn dist(&self, logits: &[f32], history: &[u32]) -> Dist {
        let p = &self.params;
        let mut l = logits.to_vec();
        if p.repetition_penalty != 1.0 {
            let mut seen = vec![false; l.len()];
            for &t in history {
                let i = t as usize;
                if i < l.len() && !seen[i] {
                    seen[i] = true;
                    l[i] = if l[i] > 0.0 {
                        l[i] / p.repetition_penalty
                    } else {
                        l[i] * p.repetition_penalty
                    };
                }
            }
        }
        if p.is_greedy() {
            return Dist::Point(argmax(&l) as u32);
        }
        let mut idx: Vec<usize> = (0..l.len()).collect();
        let by_logit = |a: &usize, b: &usize| l[*b].total_cmp(&l[*a]).then(a.cmp(b));
        if p.top_k > 0 && p.top_k < idx.len() {
            idx.select_nth_unstable_by(p.top_k - 1, by_logit);
            idx.truncate(p.top_k);
        }
        if p.top_p < 1.0 {
            idx.sort_unstable_by(by_logit);
        }
        let max = idx.iter().map(|&i| l[i]).fold(f32::NEG_INFINITY, f32::max);
        let inv_t = 1.0 / p.temperature;
        let mut w: Vec<f64> = idx
            .iter()
            .map(|&i| (((l[i] - max) * inv_t) as f64).exp())
            .collect();
        let z: f64 = w.iter().sum();
        w.iter_mut().for_each(|x| *x /= z);
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            if let Some(n) = w.iter().position(|x| {
                cum += x;
                cum >= p.top_p as f64
            }) {
                w.truncate(n + 1);
                idx.truncate(n + 1);
            }
        }
        let total: f64 = w.iter().sum();
        let mut probs = vec![0.0; l.len()];
        for (&i, x) in idx.iter().zip(&w) {
            probs[i] = x / total;
        }
        Dist::Probs(probs)
    }

    /// One token drawn from `d`.
    pub fn sample(&mut self, d: &Dist) -> u32 {
        match d {
            Dist::Point(t) => *t,
            Dist::Probs(p) => self.draw(p.iter().copied()),
        }
    }

    /// Token `i` with probability `w_i / Σ w`; `w` must have positive mass.
    fn draw(&mut self, w: impl Iterator<Item = f64> + Clone) -> u32 {
        let total: f64 = w.clone().sum();
        let mut u = self.rng.random::<f64>() * total;
        let mut last = 0;
        for (i, x) in w.enumerate() {
            if x > 0.0 {
                last = i;
                u -= x;
                if u < 0.0 {
                    return i as u32;
                }
            }
        }
        last as u32
    }

    /// Leviathan et al.'s rule over `drafted` (`x_i` drawn from `q[i]`) against the target's
    /// `p` (one more than the draft: the bonus position).
    pub fn verify(&mut self, drafted: &[u32], q: &[Dist], p: &[Dist]) -> Verdict {
        debug_assert!(q.len() == drafted.len() && p.len() == drafted.len() + 1);
        for (i, &x) in drafted.iter().enumerate() {
            if !self.accepts(x, &q[i], &p[i]) {
                return Verdict {
                    accepted: i,
                    next: self.correction(&q[i], &p[i]),
                };
            }
        }
        Verdict {
            accepted: drafted.len(),
            next: self.sample(&p[drafted.len()]),
        }
    }

    /// Keeps `x` with probability `min(1, p(x) / q(x))`.
    fn accepts(&mut self, x: u32, q: &Dist, p: &Dist) -> bool {
        #[cfg(test)]
        if self.rule == Rule::AlwaysAccept {
            return true;
        }
        match p {
            // Greedy: q is a point mass too; keep x iff it is the target's argmax.
            Dist::Point(t) => x == *t,
            Dist::Probs(_) => self.rng.random::<f64>() * q.prob(x) < p.prob(x),
        }
    }

    /// A token from `norm(max(0, p − q))`.
    fn correction(&mut self, q: &Dist, p: &Dist) -> u32 {
        #[cfg(test)]
        if self.rule == Rule::CorrectFromTarget {
            return self.sample(p);
        }
        match p {
            Dist::Point(t) => *t,
            Dist::Probs(pp) => {
                let residual = pp
                    .iter()
                    .enumerate()
                    .map(|(i, &pi)| (pi - q.prob(i as u32)).max(0.0));
                if residual.clone().sum::<f64>() > 0.0 {
                    self.draw(residual)
                } else {
                    // p == q up to rounding, where rejection cannot happen in exact arithmetic.
                    self.sample(p)
                }
            }
        }
    }
}

/// The output side of generation, as [`switchyard_engine::generate`] does it: end-of-generation
/// tokens, stop strings held back until decided, streamed text, the token limit. Each token
/// goes to `emit` with the text it made final; `emit` returning `false` aborts the generation.
pub(crate) struct Output<'t, F> {
    tokenizer: &'t Tokenizer,
    stream: StreamDecoder<'t>,
    stop: StopMatcher,
    ignore_eos: bool,
    max_new: usize,
    emit: F,
    /// Prompt and output tokens.
    history: Vec<u32>,
    generation: Generation,
    hit_stop_string: bool,
}

impl<'t, F: FnMut(Option<DecodedToken>, &str) -> bool> Output<'t, F> {
    pub fn new(
        tokenizer: &'t Tokenizer,
        prompt: &[u32],
        params: &SamplingParams,
        max_new: usize,
        emit: F,
    ) -> Self {
        Self {
            tokenizer,
            stream: tokenizer.stream(),
            stop: StopMatcher::new(&params.stop),
            ignore_eos: params.ignore_eos,
            max_new,
            emit,
            history: prompt.to_vec(),
            generation: Generation {
                tokens: Vec::new(),
                text: String::new(),
                finish_reason: FinishReason::Length,
                prompt_tokens: prompt.len(),
                timing: GenerationTiming::default(),
            },
            hit_stop_string: false,
        }
    }

    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// Tokens still allowed.
    pub fn remaining(&self) -> usize {
        self.max_new - self.generation.tokens.len()
    }

    /// Takes `accepted` then `next`, in order, until one ends the generation; returns whether
    /// one did. `rows[j]` holds the serving model's logits for the `j`-th of them.
    pub fn push_all(&mut self, accepted: &[u32], next: u32, rows: &[Vec<f32>]) -> Result<bool> {
        for (j, &t) in accepted.iter().chain([&next]).enumerate() {
            let logprob = rows
                .get(j)
                .filter(|r| (t as usize) < r.len())
                .map_or(0.0, |r| log_softmax_at(r, t as usize));
            if self.push(t, logprob)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Takes one generated token and its log-probability; returns whether the generation is
    /// over.
    pub fn push(&mut self, token: u32, logprob: f32) -> Result<bool> {
        if !self.ignore_eos && self.tokenizer.is_end_of_generation(token) {
            self.generation.finish_reason = FinishReason::Stop;
            return Ok(true);
        }
        self.generation.tokens.push(token);
        self.history.push(token);
        let mut text = String::new();
        let mut over = false;
        if let Some(piece) = self.stream.push(token).map_err(EngineError::from)? {
            match self.stop.push(&piece) {
                StopOutcome::Continue(t) => text = t,
                StopOutcome::Stopped(t) => {
                    text = t;
                    self.generation.finish_reason = FinishReason::Stop;
                    self.hit_stop_string = true;
                    over = true;
                }
            }
        }
        self.generation.text.push_str(&text);
        if !(self.emit)(Some(DecodedToken { token, logprob }), &text) {
            self.generation.finish_reason = FinishReason::Abort;
            return Ok(true);
        }
        Ok(over || self.generation.tokens.len() >= self.max_new)
    }

    /// Emits what the stream decoder and the stop matcher still hold.
    pub fn finish(mut self, timing: GenerationTiming) -> Result<Generation> {
        if !self.hit_stop_string && self.generation.finish_reason != FinishReason::Abort {
            let tail = self.stream.flush().unwrap_or_default();
            let text = match self.stop.push(&tail) {
                StopOutcome::Continue(mut t) => {
                    t.push_str(&self.stop.finish());
                    t
                }
                StopOutcome::Stopped(t) => {
                    self.generation.finish_reason = FinishReason::Stop;
                    t
                }
            };
            if !text.is_empty() {
                self.generation.text.push_str(&text);
                (self.emit)(None, &text);
            }
        }
        self.generation.timing = timing;
        Ok(self.generation)
    }
}

/// Adapts a text callback to [`Output`]'s emitter.
pub(crate) fn text_only(
    mut on_text: impl FnMut(&str),
) -> impl FnMut(Option<DecodedToken>, &str) -> bool {
    move |_, text| {
        if !text.is_empty() {
            on_text(text);
        }
        true
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! Synthetic models, a matching tokenizer and the distribution test, for fast tests.

    use std::collections::BTreeMap;
    use std::sync::Arc;

    use candle_core::quantized::GgmlDType;
    use switchyard_engine::generate::last_logits;
    use switchyard_models::{DenseKv, LayeredModel, LoadOptions};
    use switchyard_request::SamplingParams;
    use switchyard_tokenizer::Tokenizer;
    use switchyard_weights::{Architecture, MetaValue, Metadata, SyntheticSource};

    use super::{Dist, SpecGeneration, SpecSampler, SpecStats};
    use crate::Result;

    /// A random model of `layers` layers with `vocab` tokens. Models of one seed share their
    /// embedding, final norm and first layers (the weights are drawn in that order), so a
    /// shallower one is an early exit of a deeper one: a draft that agrees often, not always.
    pub fn model(seed: u64, layers: usize, vocab: usize) -> LayeredModel {
        let mut spec = SyntheticSource::tiny_spec(Architecture::Llama);
        spec.n_layers = layers;
        spec.vocab_size = vocab;
        let src = SyntheticSource::new(spec, seed, GgmlDType::F32).expect("synthetic model");
        LayeredModel::load(Arc::new(src), &LoadOptions::default()).expect("load")
    }

    /// A SentencePiece vocabulary of `vocab` tokens: `<unk> <s> </s>` (end of generation: 2),
    /// then pieces `t3`, `t4`, ...
    pub fn tokenizer(vocab: usize) -> Tokenizer {
        let pieces: Vec<MetaValue> = (0..vocab)
            .map(|i| match i {
                0 => "<unk>".to_string(),
                1 => "<s>".to_string(),
                2 => "</s>".to_string(),
                _ => format!("t{i}"),
            })
            .map(MetaValue::String)
            .collect();
        let types = (0..vocab)
            .map(|i| MetaValue::I32([2, 3, 3].get(i).copied().unwrap_or(1)))
            .collect();
        let mut md = Metadata::new(BTreeMap::new());
        md.insert("tokenizer.ggml.model", MetaValue::String("llama".into()));
        md.insert("tokenizer.ggml.tokens", MetaValue::Array(pieces));
        md.insert("tokenizer.ggml.token_type", MetaValue::Array(types));
        Tokenizer::from_gguf_metadata(&md).expect("tokenizer")
    }

    /// Vocabulary of the distribution tests: small enough to enumerate every output prefix.
    pub const STAT_VOCAB: usize = 8;
    pub const STAT_PROMPT: [u32; 3] = [1, 3, 4];
    /// Generations per distribution test: enough to fail both wrong rules by a factor of 5 or
    /// more at the synthetic pair's 74 % acceptance, few enough for ~5 s each.
    pub const STAT_SAMPLES: usize = 2_000;
    /// Output length: the prompt pass gives token 1, speculation tokens 2 to 4.
    const STAT_TOKENS: usize = 4;
    /// Flattens the synthetic models' peaked logits so that every token has mass.
    const STAT_TEMPERATURE: f32 = 2.5;

    pub fn stat_params(seed: u64) -> SamplingParams {
        SamplingParams {
            max_tokens: STAT_TOKENS,
            temperature: STAT_TEMPERATURE,
            seed: Some(seed),
            ignore_eos: true,
            ..SamplingParams::default()
        }
    }

    /// Exact probabilities of each token at output positions 2 to [`STAT_TOKENS`] under
    /// `target`'s sampling distribution, summed over all earlier outputs.
    pub fn exact_marginals(target: &LayeredModel) -> Vec<Vec<f64>> {
        let sampler = SpecSampler::new(&stat_params(0));
        let next = |prefix: &[u32]| -> Vec<f64> {
            let mut seq = STAT_PROMPT.to_vec();
            seq.extend_from_slice(prefix);
            let mut kv = DenseKv::new(target.n_layers(), target.spec().kv_row_len());
            let logits = last_logits(target, &mut kv, 0, &seq).expect("forward");
            match sampler.dist(&logits, &seq) {
                Dist::Probs(p) => p,
                Dist::Point(_) => unreachable!("sampled params"),
            }
        };
        // Joint probabilities of all output prefixes, one length at a time.
        let mut prefixes: Vec<(Vec<u32>, f64)> = vec![(Vec::new(), 1.0)];
        let mut marginals = Vec::new();
        for len in 0..STAT_TOKENS {
            let mut longer = Vec::new();
            let mut marginal = vec![0.0; STAT_VOCAB];
            for (prefix, w) in &prefixes {
                for (t, p) in next(prefix).into_iter().enumerate() {
                    marginal[t] += w * p;
                    let mut pre = prefix.clone();
                    pre.push(t as u32);
                    longer.push((pre, w * p));
                }
            }
            if len > 0 {
                marginals.push(marginal);
            }
            prefixes = longer;
        }
        marginals
    }

    /// Runs `generate` for [`STAT_SAMPLES`] seeds and returns the largest chi-square statistic
    /// over output positions 2 to [`STAT_TOKENS`] against `target`'s exact marginals, as a
    /// fraction of its critical value at p = 0.001 (below 1 passes).
    pub fn stat_worst_position(
        target: &LayeredModel,
        what: &str,
        mut generate: impl FnMut(&SamplingParams) -> Result<SpecGeneration>,
    ) -> f64 {
        let want = exact_marginals(target);
        let mut counts = vec![vec![0usize; STAT_VOCAB]; STAT_TOKENS - 1];
        let mut stats = SpecStats::default();
        for seed in 0..STAT_SAMPLES as u64 {
            let out = generate(&stat_params(seed)).expect("generate");
            assert_eq!(out.generation.tokens.len(), STAT_TOKENS);
            for (pos, &t) in out.generation.tokens[1..].iter().enumerate() {
                counts[pos][t as usize] += 1;
            }
            stats.accepted += out.stats.accepted;
            stats.drafted += out.stats.drafted;
        }
        eprintln!("{what}: acceptance {:.3}", stats.acceptance_rate());
        counts
            .iter()
            .zip(&want)
            .map(|(c, p)| {
                let (stat, df) = chi2(c, p);
                eprintln!("{what}: chi2 {stat:.1} at {df} df");
                stat / chi2_critical_p001(df)
            })
            .fold(0.0, f64::max)
    }

    /// Upper 0.1 % point of the chi-square distribution with `df` degrees of freedom
    /// (Wilson–Hilferty; within 1 % of the exact value from 5 degrees of freedom up).
    pub fn chi2_critical_p001(df: usize) -> f64 {
        const Z_999: f64 = 3.090_232;
        let k = df as f64;
        let a = 2.0 / (9.0 * k);
        k * (1.0 - a + Z_999 * a.sqrt()).powi(3)
    }

    /// Pearson's statistic of `observed` counts against `expected` probabilities, cells with
    /// an expected count under 5 pooled into one; returns (statistic, degrees of freedom).
    pub fn chi2(observed: &[usize], expected: &[f64]) -> (f64, usize) {
        let n: usize = observed.iter().sum();
        let n = n as f64;
        let (mut stat, mut cells) = (0.0, 0usize);
        let (mut pooled_o, mut pooled_e) = (0.0, 0.0);
        for (&o, &p) in observed.iter().zip(expected) {
            let e = p * n;
            if e < 5.0 {
                pooled_o += o as f64;
                pooled_e += e;
            } else {
                stat += (o as f64 - e).powi(2) / e;
                cells += 1;
            }
        }
        if pooled_e > 0.0 {
            stat += (pooled_o - pooled_e).powi(2) / pooled_e.max(1e-12);
            cells += 1;
        }
        (stat, cells.saturating_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{
        chi2, chi2_critical_p001, model, stat_worst_position, tokenizer, STAT_PROMPT, STAT_VOCAB,
    };
    use super::*;
    use switchyard_engine::Sampler;

    fn sampled(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams {
            temperature: 1.0,
            seed: Some(11),
            ..SamplingParams::default()
        };
        f(&mut p);
        p
    }

    /// The distributions speculative decoding reasons with are the ones the engine's sampler
    /// draws from, for every transform.
    #[test]
    fn dist_is_the_engine_samplers_distribution() {
        let logits: Vec<f32> = (0..12).map(|i| (i as f32 * 1.7).sin() * 2.0).collect();
        let history = [3u32, 5, 5, 9];
        let cases: Vec<SamplingParams> = vec![
            sampled(|_| {}),
            sampled(|p| p.temperature = 0.6),
            sampled(|p| p.top_k = 4),
            sampled(|p| p.top_p = 0.7),
            sampled(|p| {
                p.temperature = 1.4;
                p.top_k = 6;
                p.top_p = 0.9;
                p.repetition_penalty = 1.5;
            }),
        ];
        let n = 20_000;
        for params in cases {
            let d = SpecSampler::new(&params).dist(&logits, &history);
            let Dist::Probs(probs) = &d else {
                panic!("sampled params give a distribution")
            };
            assert!((probs.iter().sum::<f64>() - 1.0).abs() < 1e-9);
            let mut engine = Sampler::new(&params);
            let mut counts = vec![0usize; logits.len()];
            for _ in 0..n {
                counts[engine.sample(&logits, &history, 0).token as usize] += 1;
            }
            // Same support exactly: the cut-offs agree.
            for (i, (&c, &p)) in counts.iter().zip(probs).enumerate() {
                assert!(
                    p > 0.0 || c == 0,
                    "{params:?}: token {i} drawn, probability 0"
                );
            }
            let (stat, df) = chi2(&counts, probs);
            assert!(
                stat < chi2_critical_p001(df.max(1)),
                "{params:?}: chi2 {stat:.1} at {df} df"
            );
        }
        let greedy = SamplingParams {
            repetition_penalty: 1.5,
            ..SamplingParams::greedy(1)
        };
        let want = Sampler::new(&greedy).sample(&logits, &history, 0).token;
        assert_eq!(
            SpecSampler::new(&greedy).dist(&logits, &history),
            Dist::Point(want)
        );
    }

    #[test]
    fn greedy_verdicts_keep_the_target_argmax_prefix() {
        let mut s = SpecSampler::new(&SamplingParams::greedy(8));
        let q = [Dist::Point(4), Dist::Point(7), Dist::Point(1)];
        let p = [4, 7, 2, 5].map(Dist::Point);
        let v = s.verify(&[4, 7, 1], &q, &p);
        assert_eq!((v.accepted, v.next), (2, 2));
        let p = [4, 7, 1, 5].map(Dist::Point);
        let v = s.verify(&[4, 7, 1], &q, &p);
        assert_eq!((v.accepted, v.next), (3, 5));
        let p = [0, 7, 1, 5].map(Dist::Point);
        assert_eq!(s.verify(&[4, 7, 1], &q, &p).accepted, 0);
    }

    /// Corrections come only from where the target has more mass than the draft.
    #[test]
    fn corrections_come_from_the_residual() {
        let mut s = SpecSampler::new(&sampled(|_| {}));
        let q = Dist::Probs(vec![0.5, 0.5, 0.0, 0.0]);
        let p = Dist::Probs(vec![0.5, 0.1, 0.3, 0.1]);
        for _ in 0..500 {
            let t = s.correction(&q, &p);
            assert!(t == 2 || t == 3, "residual is (0, 0, 0.3, 0.1); drew {t}");
        }
    }

    /// The largest chi-square statistic over the speculated positions, as a fraction of its
    /// critical value at p = 0.001 (below 1 passes), for a rule.
    fn worst_position(draft: &LayeredModel, target: &LayeredModel, rule: Rule) -> f64 {
        let dec = SpeculativeDecoder::new(draft, target)
            .and_then(|d| d.with_draft_len(3))
            .expect("decoder");
        let tok = tokenizer(STAT_VOCAB);
        RULE.with(|r| r.set(rule));
        let worst = stat_worst_position(target, &format!("{rule:?}"), |params| {
            dec.generate(&tok, &STAT_PROMPT, params, |_| {})
        });
        RULE.with(|r| r.set(Rule::Exact));
        worst
    }

    /// Speculative sampling reproduces the target's sampling distribution (chi-square at
    /// p = 0.001 on each speculated position), while rules that skip the rejection or draw
    /// corrections from `p` instead of the residual are caught by the same test.
    #[test]
    fn sampled_output_follows_the_target_distribution() {
        let target = model(21, 3, STAT_VOCAB);
        let draft = model(21, 1, STAT_VOCAB);
        let exact = worst_position(&draft, &target, Rule::Exact);
        assert!(exact < 1.0, "exact rule: {exact:.2} of the critical value");
        let always = worst_position(&draft, &target, Rule::AlwaysAccept);
        assert!(always > 1.0, "always-accept passed: {always:.2}");
        let from_p = worst_position(&draft, &target, Rule::CorrectFromTarget);
        assert!(from_p > 1.0, "corrections from p passed: {from_p:.2}");
    }
}
