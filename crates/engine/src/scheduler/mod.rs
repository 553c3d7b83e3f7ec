//! The scheduler: which sequences run in the next step and how many of their tokens, in the
//! shape of vLLM's v1 scheduler, owning the KV pool, the prefix cache and every sequence's
//! block tables.
//!
//! A step is `schedule() -> one batched forward -> sample -> update_from_output()`. One
//! [`SchedulerOutput`] maps each scheduled sequence to the positions it runs this step, which
//! covers prefill chunks, decode tokens and recomputation alike: a sequence always runs
//! `computed..computed + n`, where `computed` is what every layer in use already holds. That
//! one rule serves
//!
//! * **continuous batching** (Orca): sequences join and leave between steps;
//! * **chunked prefill**: a long prompt takes what is left of the step's token budget and
//!   continues next step, while decoding sequences keep their one token per step;
//! * **prefix caching**: an admitted prompt starts after its cached full blocks;
//! * **recompute preemption** (vLLM): when decoding runs out of blocks, the newest running
//!   sequence gives all of its blocks back and waits at the head of the queue; readmitted, it
//!   runs its prompt and its generated tokens again;
//! * **raising the depth**: new layers hold nothing, so every sequence re-runs its positions
//!   through all layers and only the new layers store them (see [`crate::kv::RerunKv`]).
//!
//! Running sequences are served oldest first and take the budget before waiting ones are
//! admitted; admission is first come, first served and stops at the first request that does
//! not fit (no overtaking), keeping a small watermark of free blocks for running sequences'
//! growth so that admitting does not immediately force a preemption.

mod sequence;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};

use serde::Serialize;
use switchyard_request::FinishReason;

use crate::kv::{BlockPool, PagedKv, PrefixCache};
use crate::{EngineError, RequestId, Result};

pub use sequence::{NewSequence, SeqStatus, Sequence};

/// Tokens per step: vLLM's default budget with chunked prefill (v0), which keeps one CPU step
/// short enough for decode tokens to keep flowing.
pub const DEFAULT_MAX_BATCHED_TOKENS: usize = 512;
/// Most sequences running at once (vLLM's default `max_num_seqs`).
pub const DEFAULT_MAX_NUM_SEQS: usize = 256;
/// Fraction of the pool kept free when admitting while others run (vLLM v0's block manager).
pub const WATERMARK: f64 = 0.01;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SchedulerConfig {
    /// Token budget of one step (`--max-batched-tokens`).
    pub max_batched_tokens: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Split prompts across steps; when off, a prompt runs whole (alone if it exceeds the
    /// budget).
    pub chunked_prefill: bool,
    /// Reuse cached full blocks of earlier prompts.
    pub prefix_caching: bool,
    /// When a waiting request may join.
    pub admission: AdmissionPolicy,
}

/// When a waiting request may join the running batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AdmissionPolicy {
    /// vLLM's: as soon as its next chunk's blocks fit (beside a 1% watermark); decoding
    /// sequences that later run out of blocks are preempted and recomputed. Largest batches,
    /// but on a CPU, where recomputing a prompt costs as much as computing it, a workload
    /// that outgrows the pool spends much of its time recomputing.
    Optimistic,
    /// Only when every running sequence and this one can reach their `max_tokens` (capped by
    /// the context) in the pool: blocks are still taken as positions are written, and
    /// preemption remains for what admission cannot foresee (the pool shrinking for a layer
    /// load, a depth increase). Blocks shared through the prefix cache are counted once.
    #[default]
    Projected,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_batched_tokens: DEFAULT_MAX_BATCHED_TOKENS,
            max_num_seqs: DEFAULT_MAX_NUM_SEQS,
            chunked_prefill: true,
            prefix_caching: true,
            admission: AdmissionPolicy::default(),
        }
    }
}

impl SchedulerConfig {
    /// The most tokens one step can run (what the activation workspace must hold).
    pub fn max_step_tokens(&self, context: usize) -> usize {
        if self.chunked_prefill {
            self.max_batched_tokens
        } else {
            self.max_batched_tokens.max(context)
        }
    }
}

/// One sequence's share of a step: positions `start..start + n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub id: RequestId,
    pub start: usize,
    pub n: usize,
    /// The chunk ends at the sequence's last token: its last row is sampled.
    pub sample: bool,
}

/// Why a sequence left without finishing normally.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeqEnd {
    /// It finished (e.g. it alone outgrew the whole pool: [`FinishReason::Length`]).
    Finished(FinishReason),
    /// Its prompt no longer fits the pool (the pool shrank after it was queued).
    TooLarge {
        tokens: usize,
        blocks_needed: usize,
        pool_blocks: usize,
    },
}

/// What runs in one step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    /// In batch order: running sequences first (oldest first), then those admitted this step.
    pub scheduled: Vec<ScheduledSeq>,
    /// Sent back to the waiting queue this step (their blocks are free).
    pub preempted: Vec<RequestId>,
    /// Removed this step without running.
    pub ended: Vec<(RequestId, SeqEnd)>,
}

impl SchedulerOutput {
    pub fn total_tokens(&self) -> usize {
        self.scheduled.iter().map(|s| s.n).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty()
    }
}

/// A token sampled for a scheduled sequence.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampledToken {
    pub id: RequestId,
    pub token: u32,
    /// Its log-probability under the model's distribution at this position.
    pub logprob: f32,
    /// The tokenizer ends generation on this token (EOS, end of turn).
    pub end_of_generation: bool,
    /// One of the request's `stop_token_ids`: ends generation even with `ignore_eos`.
    pub stop_token: bool,
}

/// What a step did to one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqUpdate {
    pub id: RequestId,
    /// The new output token (`None` for an end-of-generation token, which is not output).
    pub token: Option<u32>,
    pub finish: Option<FinishReason>,
}

/// Running totals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SchedulerCounters {
    pub steps: u64,
    /// Prompt positions run through the model for the first time.
    pub prompt_tokens_computed: u64,
    /// Generated tokens run through the model for the first time.
    pub decode_tokens_computed: u64,
    /// Positions run again (after a preemption or a depth increase).
    pub recomputed_tokens: u64,
    pub preemptions: u64,
    /// Most sequences in one step.
    pub largest_batch: usize,
    /// Most tokens in one step.
    pub largest_step_tokens: usize,
}

/// Queues, block tables and the KV pool.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    n_layers: usize,
    /// Layers every step runs (`0..depth`); only they hold blocks.
    depth: usize,
    context: usize,
    pool: BlockPool,
    cache: PrefixCache,
    seqs: HashMap<RequestId, Sequence>,
    waiting: VecDeque<RequestId>,
    /// Admission order: the last one is the newest (preempted first).
    running: Vec<RequestId>,
    counters: SchedulerCounters,
}

impl Scheduler {
    /// A scheduler over `pool` for a model of `n_layers` layers running `depth` of them, with
    /// a context of `context` positions.
    pub fn new(
        cfg: SchedulerConfig,
        pool: BlockPool,
        n_layers: usize,
        depth: usize,
        context: usize,
    ) -> Result<Self> {
        if cfg.max_batched_tokens == 0 || cfg.max_num_seqs == 0 {
            return Err(EngineError::BadConfig(format!(
                "max_batched_tokens ({}) and max_num_seqs ({}) must be positive",
                cfg.max_batched_tokens, cfg.max_num_seqs
            )));
        }
        check_depth(depth, n_layers)?;
        let cache = PrefixCache::new(pool.block_tokens());
        Ok(Self {
            cfg,
            n_layers,
            depth,
            context,
            pool,
            cache,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            counters: SchedulerCounters::default(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn depth(&self) -> usize {
        self.depth
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }

    pub fn counters(&self) -> &SchedulerCounters {
        &self.counters
    }

    pub fn sequence(&self, id: RequestId) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    pub fn running(&self) -> &[RequestId] {
        &self.running
    }

    pub fn waiting(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.waiting.iter().copied()
    }

    pub fn has_work(&self) -> bool {
        !self.seqs.is_empty()
    }

    /// KV blocks positions `0..tokens` take at the current depth.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.pool.block_tokens()) * self.depth
    }

    /// Positions a sequence may reach (prompt + output).
    pub fn context(&self) -> usize {
        self.context
    }

    /// Queues a request. Refused when the prompt is empty, leaves no room to generate in the
    /// context, or needs more blocks than the whole pool holds (it could never run).
    pub fn add(&mut self, id: RequestId, new: NewSequence) -> Result<()> {
        let prompt = new.prompt.len();
        if prompt == 0 {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt >= self.context {
            return Err(EngineError::PromptTooLong {
                prompt,
                context: self.context,
            });
        }
        let blocks_needed = self.blocks_for(prompt);
        if blocks_needed > self.pool.total_blocks() {
            return Err(EngineError::PromptExceedsMemory {
                prompt,
                blocks_needed,
                pool_blocks: self.pool.total_blocks(),
                depth: self.depth,
            });
        }
        if self.seqs.contains_key(&id) {
            return Err(EngineError::DuplicateRequest { id });
        }
        let seq = Sequence {
            id,
            prompt_len: prompt,
            max_tokens: new.max_tokens.min(self.context - prompt),
            ignore_eos: new.ignore_eos,
            tokens: new.prompt,
            kv: PagedKv::for_pool(&self.pool, self.n_layers),
            status: SeqStatus::Waiting,
            high_water: 0,
            cached_tokens: 0,
            preemptions: 0,
        };
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
        Ok(())
    }

    /// Removes a sequence wherever it is and frees its blocks; whether it was there.
    pub fn remove(&mut self, id: RequestId) -> bool {
        let Some(mut seq) = self.seqs.remove(&id) else {
            return false;
        };
        seq.kv.release(&mut self.pool, &mut self.cache);
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
        true
    }

    /// Plans the next step.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let _span = tracing::trace_span!("schedule").entered();
        let mut out = SchedulerOutput::default();
        let mut budget = self.cfg.max_batched_tokens;
        self.schedule_running(&mut budget, &mut out);
        if out.preempted.is_empty() {
            self.schedule_waiting(&mut budget, &mut out);
        }
        self.counters.largest_batch = self.counters.largest_batch.max(out.scheduled.len());
        self.counters.largest_step_tokens =
            self.counters.largest_step_tokens.max(out.total_tokens());
        out
    }

    /// Gives each running sequence its next chunk, oldest first, preempting the newest when
    /// blocks run out.
    fn schedule_running(&mut self, budget: &mut usize, out: &mut SchedulerOutput) {
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let id = self.running[i];
            let Some((start, remaining)) = self.next_chunk(id) else {
                i += 1;
                continue;
            };
            let Some(n) = self.chunk_len(remaining, *budget, out) else {
                i += 1;
                continue;
            };
            if !self.reserve_or_preempt(id, start + n, out) {
                // It was the newest and went back to waiting (or ended).
                break;
            }
            out.scheduled.push(self.scheduled(id, start, n));
            *budget -= n;
            i += 1;
        }
    }

    /// Admits waiting sequences in order while the budget, the sequence cap and the pool allow.
    fn schedule_waiting(&mut self, budget: &mut usize, out: &mut SchedulerOutput) {
        while let Some(&id) = self.waiting.front() {
            if *budget == 0 || self.running.len() >= self.cfg.max_num_seqs {
                break;
            }
            match self.try_admit(id, budget, out) {
                Admission::Admitted => {}
                Admission::Later => break,
                Admission::Never(end) => {
                    self.waiting.pop_front();
                    self.remove(id);
                    out.ended.push((id, end));
                }
            }
        }
    }

    /// `(start, tokens left)` of a sequence's next chunk; `None` when nothing is left to run.
    fn next_chunk(&self, id: RequestId) -> Option<(usize, usize)> {
        let seq = self.seqs.get(&id)?;
        let start = seq.computed(self.depth);
        let remaining = seq.tokens.len() - start;
        (remaining > 0).then_some((start, remaining))
    }

    /// Tokens of a chunk of `remaining` under `budget`; `None` when it must wait a step
    /// (chunking off and the rest of the step cannot hold it whole).
    fn chunk_len(&self, remaining: usize, budget: usize, out: &SchedulerOutput) -> Option<usize> {
        if remaining <= budget || self.cfg.chunked_prefill {
            Some(remaining.min(budget))
        } else if out.scheduled.is_empty() {
            // Too long for any budget: it runs whole, alone.
            Some(remaining)
        } else {
            None
        }
    }

    fn scheduled(&self, id: RequestId, start: usize, n: usize) -> ScheduledSeq {
        let len = self.seqs.get(&id).map_or(0, |s| s.tokens.len());
        ScheduledSeq {
            id,
            start,
            n,
            sample: start + n == len,
        }
    }

    /// Reserves blocks for positions `0..len` of running sequence `id`, preempting the newest
    /// running sequences until they fit. `false` when `id` itself had to go.
    fn reserve_or_preempt(&mut self, id: RequestId, len: usize, out: &mut SchedulerOutput) -> bool {
        loop {
            if self.reserve(id, len) {
                return true;
            }
            let Some(victim) = self.running.pop() else {
                return false;
            };
            if victim == id && self.running.is_empty() {
                // Alone with every other block freed, it still does not fit: it never will.
                let end = self.too_large(id);
                self.remove(id);
                out.ended.push((id, end));
                return false;
            }
            self.preempt(victim);
            out.preempted.push(victim);
            if victim == id {
                return false;
            }
        }
    }

    /// Takes the blocks sequence `id` needs for positions `0..len` (evicting cached blocks
    /// first); all or nothing.
    fn reserve(&mut self, id: RequestId, len: usize) -> bool {
        let depth = self.depth;
        let Some(seq) = self.seqs.get_mut(&id) else {
            return false;
        };
        let needed = seq.kv.blocks_needed(0..depth, len);
        let free = self.pool.free_blocks();
        if needed > free {
            self.cache.evict_into(&mut self.pool, needed - free);
        }
        needed <= self.pool.free_blocks() && seq.kv.reserve(&mut self.pool, 0..depth, len).is_ok()
    }

    /// vLLM's recompute preemption: all blocks back, to the head of the waiting queue.
    fn preempt(&mut self, id: RequestId) {
        let _span = tracing::debug_span!("preempt", id = id.0).entered();
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.kv.release(&mut self.pool, &mut self.cache);
            seq.status = SeqStatus::Waiting;
            seq.preemptions += 1;
            self.counters.preemptions += 1;
        }
        self.running.retain(|&r| r != id);
        self.waiting.push_front(id);
    }

    /// How a sequence that can never fit the pool ends: a prompt that does not fit is an
    /// error; one that outgrew the pool while generating stops as if its context were full.
    fn too_large(&self, id: RequestId) -> SeqEnd {
        let Some(seq) = self.seqs.get(&id) else {
            return SeqEnd::Finished(FinishReason::Length);
        };
        let blocks_needed = self.blocks_for(seq.prompt_len);
        if blocks_needed > self.pool.total_blocks() {
            SeqEnd::TooLarge {
                tokens: seq.prompt_len,
                blocks_needed,
                pool_blocks: self.pool.total_blocks(),
            }
        } else {
            SeqEnd::Finished(FinishReason::Length)
        }
    }

    fn try_admit(
        &mut self,
        id: RequestId,
        budget: &mut usize,
        out: &mut SchedulerOutput,
    ) -> Admission {
        let depth = self.depth;
        let Some(len) = self.seqs.get(&id).map(|s| s.tokens.len()) else {
            return Admission::Never(SeqEnd::Finished(FinishReason::Abort));
        };
        if self.blocks_for(len) > self.pool.total_blocks() {
            return Admission::Never(self.too_large(id));
        }
        let hit = self.attach_prefix(id);
        let start = hit * self.pool.block_tokens();
        let Some(n) = self.chunk_len(len - start, *budget, out) else {
            self.release(id);
            return Admission::Later;
        };
        let Some(seq) = self.seqs.get(&id) else {
            return Admission::Later;
        };
        let needed = seq.kv.blocks_needed(0..depth, start + n);
        let watermark = if self.running.is_empty() {
            0
        } else {
            (self.pool.total_blocks() as f64 * WATERMARK).ceil() as usize
        };
        let available = self.pool.free_blocks() + self.cache.evictable_blocks();
        let projected_ok = match self.cfg.admission {
            AdmissionPolicy::Optimistic => true,
            AdmissionPolicy::Projected => {
                self.running.is_empty()
                    || self.projected_blocks() + self.final_blocks(seq) <= self.pool.total_blocks()
            }
        };
        if !projected_ok || needed + watermark > available || !self.reserve(id, start + n) {
            self.release(id);
            return Admission::Later;
        }
        if self.cfg.prefix_caching {
            self.cache.record_lookup(len, hit);
        }
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.cached_tokens = start;
            seq.status = SeqStatus::Running;
        }
        self.waiting.pop_front();
        self.running.push(id);
        out.scheduled.push(self.scheduled(id, start, n));
        *budget = budget.saturating_sub(n);
        Admission::Admitted
    }

    /// Blocks `seq` holds of its own once it reaches `max_tokens` (its shared blocks are
    /// counted with the cache's).
    fn final_blocks(&self, seq: &Sequence) -> usize {
        let end = (seq.prompt_len + seq.max_tokens).min(self.context);
        self.blocks_for(end).saturating_sub(seq.kv.shared_blocks())
    }

    /// Blocks the running sequences will hold when they all reach `max_tokens`, with each
    /// block shared through the prefix cache counted once.
    fn projected_blocks(&self) -> usize {
        let own: usize = self
            .running
            .iter()
            .filter_map(|id| self.seqs.get(id))
            .map(|s| self.final_blocks(s))
            .sum();
        own + self.cache.len() - self.cache.evictable_blocks()
    }

    /// Blocks every sequence in the scheduler, running or waiting, will hold when each
    /// reaches `max_tokens`, with each block shared through the prefix cache counted once.
    pub fn blocks_to_finish(&self) -> usize {
        let own: usize = self.seqs.values().map(|s| self.final_blocks(s)).sum();
        own + self.cache.len() - self.cache.evictable_blocks()
    }

    /// Attaches the cached full blocks of a waiting sequence's tokens; how many.
    fn attach_prefix(&mut self, id: RequestId) -> usize {
        let depth = self.depth;
        let Some(seq) = self.seqs.get_mut(&id) else {
            return 0;
        };
        if !self.cfg.prefix_caching {
            return 0;
        }
        let hit = self.cache.probe(&seq.tokens, 0..depth);
        match self.cache.attach(&mut seq.kv, &seq.tokens, 0..depth, hit) {
            Ok(()) => hit,
            Err(e) => {
                tracing::warn!(error = %e, "prefix attach failed; computing the prompt cold");
                0
            }
        }
    }

    fn release(&mut self, id: RequestId) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.kv.release(&mut self.pool, &mut self.cache);
        }
    }

    /// The block tables of the scheduled sequences, in batch order, for the forward pass.
    pub fn kv_batch(&mut self, out: &SchedulerOutput) -> Vec<&mut PagedKv> {
        let mut by_id: HashMap<RequestId, &mut PagedKv> = self
            .seqs
            .iter_mut()
            .map(|(id, s)| (*id, &mut s.kv))
            .collect();
        out.scheduled
            .iter()
            .filter_map(|s| by_id.remove(&s.id))
            .collect()
    }

    /// Records a step's results: counts the computed tokens, appends the sampled ones, ends
    /// the sequences that finished (freeing their blocks) and publishes newly full blocks to
    /// the prefix cache.
    pub fn update_from_output(
        &mut self,
        out: &SchedulerOutput,
        sampled: &[SampledToken],
    ) -> Vec<SeqUpdate> {
        self.counters.steps += 1;
        for s in &out.scheduled {
            self.count_computed(s);
        }
        let mut updates = Vec::with_capacity(sampled.len());
        for t in sampled {
            if let Some(u) = self.append(t) {
                updates.push(u);
            }
        }
        // Publish before finished sequences free their blocks: their prompts are reusable.
        if self.cfg.prefix_caching {
            let depth = self.depth;
            for s in &out.scheduled {
                if let Some(seq) = self.seqs.get_mut(&s.id) {
                    self.cache.publish(&mut seq.kv, &seq.tokens, 0..depth);
                }
            }
        }
        for u in &updates {
            if u.finish.is_some() {
                self.remove(u.id);
            }
        }
        updates
    }

    fn count_computed(&mut self, s: &ScheduledSeq) {
        let Some(seq) = self.seqs.get_mut(&s.id) else {
            return;
        };
        let end = s.start + s.n;
        let again = seq.high_water.min(end).saturating_sub(s.start);
        let fresh = s.start.max(seq.high_water)..end.max(seq.high_water);
        let prompt = fresh.end.min(seq.prompt_len).saturating_sub(fresh.start);
        let c = &mut self.counters;
        c.recomputed_tokens += again as u64;
        c.prompt_tokens_computed += prompt as u64;
        c.decode_tokens_computed += (fresh.len() - prompt) as u64;
        seq.high_water = seq.high_water.max(end);
    }

    fn append(&mut self, t: &SampledToken) -> Option<SeqUpdate> {
        let seq = self.seqs.get_mut(&t.id)?;
        if (t.end_of_generation && !seq.ignore_eos) || t.stop_token {
            return Some(SeqUpdate {
                id: t.id,
                token: None,
                finish: Some(FinishReason::Stop),
            });
        }
        seq.tokens.push(t.token);
        let full =
            seq.tokens.len() - seq.prompt_len >= seq.max_tokens || seq.tokens.len() >= self.context;
        Some(SeqUpdate {
            id: t.id,
            token: Some(t.token),
            finish: full.then_some(FinishReason::Length),
        })
    }

    /// Runs layers `0..depth` from the next step on. Lowering it frees the blocks of the
    /// layers no longer run (and their cached blocks); raising it makes every sequence re-run
    /// its positions so the new layers get their K/V (recomputation).
    pub fn set_depth(&mut self, depth: usize) -> Result<()> {
        check_depth(depth, self.n_layers)?;
        if depth < self.depth {
            let dropped = depth..self.n_layers;
            for seq in self.seqs.values_mut() {
                seq.kv
                    .release_layers(&mut self.pool, &mut self.cache, dropped.clone());
            }
            self.cache.evict_layers_into(&mut self.pool, dropped);
        }
        self.depth = depth;
        Ok(())
    }

    /// Frees pool memory until the pool holds at most `target` blocks: free blocks first,
    /// then cached ones, then by preempting the newest running sequences. Returns the
    /// preempted sequences.
    pub fn shrink_pool_to(&mut self, target: usize) -> Vec<RequestId> {
        let mut preempted = Vec::new();
        while self.pool.total_blocks() > target {
            let excess = self.pool.total_blocks() - target;
            if self.pool.shrink(excess) > 0 || self.cache.evict_into(&mut self.pool, excess) > 0 {
                continue;
            }
            match self.running.last().copied() {
                Some(victim) => {
                    self.preempt(victim);
                    preempted.push(victim);
                }
                None => break,
            }
        }
        preempted
    }

    /// Allocates blocks until the pool holds `target` (never shrinks).
    pub fn grow_pool_to(&mut self, target: usize) {
        let total = self.pool.total_blocks();
        if target > total {
            self.pool.grow(target - total);
        }
    }

    /// Empties the prefix cache, leaving the sequences; returns the blocks freed now.
    pub fn clear_prefix_cache(&mut self) -> usize {
        let before = self.pool.free_blocks();
        self.cache.clear(&mut self.pool);
        self.pool.free_blocks().saturating_sub(before)
    }

    /// Ends every sequence and empties the prefix cache: all blocks back in the pool.
    pub fn clear(&mut self) {
        let ids: Vec<RequestId> = self.seqs.keys().copied().collect();
        for id in ids {
            self.remove(id);
        }
        self.clear_prefix_cache();
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.clear();
    }
}

enum Admission {
    Admitted,
    /// Does not fit now; stays at the head of the queue.
    Later,
    Never(SeqEnd),
}

fn check_depth(depth: usize, n_layers: usize) -> Result<()> {
    if depth == 0 || depth > n_layers {
        return Err(EngineError::BadDepth { depth, n_layers });
    }
    Ok(())
}
