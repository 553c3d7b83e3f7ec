//! [`EngineCore`]: the serving engine's step — schedule, one batched forward, sample,
//! update — over a model whose resident layers, KV blocks and activation workspace live
//! inside a hard memory budget.
//!
//! One step embeds every scheduled token of every sequence (prefill chunks, decode tokens and
//! recomputed positions together), runs them through layers `0..depth` in one
//! [`ForwardBatch`] (so each matmul sees all rows at once, and attention reads each
//! sequence's own blocks), and sends only the rows that are sampled through the exit head at
//! `depth`. The core speaks token ids; text and stop strings are handled by
//! [`crate::output::OutputProcessor`] outside it (vLLM's split).
//!
//! Memory: `weights (resident layers, embeddings, head, exit head, layers being loaded) + KV
//! pool (used and free) + workspace <= budget` holds after every call. The pool is allocated
//! once from the budget and resized only by residency changes, between steps.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use serde::Serialize;
use switchyard_grammar::{Constraint, GrammarCompiler, GrammarError};
use switchyard_kernels::prof::{self, Part};
use switchyard_models::{ForwardBatch, LayeredModel, SeqChunk, SeqKv};
use switchyard_request::{FinishReason, SamplingParams};

use crate::exit::{ExitHead, ExitSpan, LogitLens};
use crate::kv::{
    activation_bytes, BlockLayout, BlockPool, KvFormat, MemoryBudget, RerunKv, Usage, BLOCK_TOKENS,
};
use crate::residency::{LayerLoadJob, LayerLoadTime, LoadReport, LoadedLayer};
use crate::sampler::Sampler;
use crate::scheduler::{
    NewSequence, SampledToken, Scheduler, SchedulerConfig, SchedulerCounters, SchedulerOutput,
    SeqEnd,
};
use crate::{EngineError, RequestId, Result};

/// The budget when none is given: 2 GiB (the serving issue's example).
pub const DEFAULT_MEMORY_BUDGET: u64 = 2 << 30;
/// Layer load times kept for the stats.
const LOAD_TIMES_KEPT: usize = 64;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineConfig {
    /// Bytes the engine may hold: weights + KV pool + activation workspace.
    pub memory_budget: u64,
    pub scheduler: SchedulerConfig,
    /// Positions per KV block.
    pub block_tokens: usize,
    /// How KV blocks store K and V: f16 (the default: half the bytes of f32, each value the
    /// nearest half), f32 (results bit for bit those of a dense f32 cache) or 8-bit with
    /// per-position scales (the `kv-compressed` mode: ~3.8x the positions of f32 in the same
    /// memory, attention within a stated tolerance; see [`crate::kv::format`]).
    pub kv_format: KvFormat,
    /// Longest sequence (prompt + output) served, below the model's context (as vLLM's
    /// `max_model_len`): without chunked prefill the activation workspace is sized for one
    /// whole prompt, so a long-context model's workspace shrinks with it. `None`: the model's
    /// context.
    pub max_model_len: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            memory_budget: DEFAULT_MEMORY_BUDGET,
            scheduler: SchedulerConfig::default(),
            block_tokens: BLOCK_TOKENS,
            kv_format: KvFormat::default(),
            max_model_len: None,
        }
    }
}

/// A request as the engine takes it: token ids and how to sample.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
}

/// What one step produced for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOutput {
    pub id: RequestId,
    /// The new token (`None` when an end-of-generation token or a memory limit ended it).
    pub token: Option<u32>,
    /// The sampled token's log-probability under the model (0 when nothing was sampled).
    pub logprob: f32,
    /// Exit confidence at the serving depth: the largest softmax probability of the exit
    /// logits (0 when nothing was sampled).
    pub confidence: f32,
    /// With an [`ExitProbe`] set: the first probed depth below the serving depth whose
    /// confidence passed the probe's threshold (`None` when none did, or without a probe).
    pub probe_exit: Option<u16>,
    pub finish: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// The request's `top_logprobs` alternatives at this position (empty unless asked).
    pub top_logprobs: Vec<(u32, f32)>,
}

/// The result of one step.
#[derive(Debug, Default)]
pub struct StepResult {
    pub outputs: Vec<TokenOutput>,
    /// Sequences that ended with an error (their prompt no longer fits, or the forward failed).
    pub failed: Vec<(RequestId, EngineError)>,
    /// Sequences and tokens that ran.
    pub batch: usize,
    pub tokens: usize,
    /// The depth the step ran at.
    pub depth: usize,
}

/// Memory in use by category, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemoryStats {
    pub budget_bytes: u64,
    /// Resident weights, exit head and layers being loaded.
    pub weights_bytes: u64,
    /// Of `weights_bytes`: layers being loaded.
    pub weights_loading_bytes: u64,
    pub kv_used_bytes: u64,
    pub kv_free_bytes: u64,
    pub workspace_bytes: u64,
    /// weights + KV pool + workspace.
    pub in_use_bytes: u64,
    /// K/V the sequences in the engine will hold when each reaches its `max_tokens`
    /// (blocks shared through the prefix cache counted once): what a budget must keep for
    /// them to finish without preemption.
    pub kv_to_finish_bytes: u64,
}

/// A snapshot of the engine.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineStats {
    pub memory: MemoryStats,
    pub block_tokens: usize,
    pub block_bytes: u64,
    pub kv_format: KvFormat,
    pub kv_blocks_total: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_free: usize,
    pub prefix_cached_blocks: usize,
    pub depth: usize,
    pub n_layers: usize,
    pub resident_layers: usize,
    pub running: usize,
    pub waiting: usize,
    pub counters: SchedulerCounters,
    pub prefix_cache_hit_tokens: u64,
    pub prefix_cache_queried_tokens: u64,
    pub prefix_cache_hit_rate: f64,
    pub constrained: ConstrainedCounters,
    /// The latest layer loads.
    pub layer_loads: Vec<LayerLoadTime>,
}

impl EngineStats {
    /// How many sequences of `tokens` positions the whole pool holds at the current depth.
    pub fn batch_that_fits(&self, tokens: usize) -> usize {
        let per_seq = tokens.max(1).div_ceil(self.block_tokens.max(1)) * self.depth.max(1);
        self.kv_blocks_total / per_seq
    }

    /// KV positions the whole pool holds at the current depth.
    pub fn kv_capacity_tokens(&self) -> usize {
        self.kv_blocks_total / self.depth.max(1) * self.block_tokens
    }
}

/// Structured-output tokens sampled since start, and how many needed the constraint's full
/// mask over the vocabulary (the others were drawn first and checked alone).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ConstrainedCounters {
    pub tokens: u64,
    pub masked: u64,
    /// Seconds spent on the constraints beyond what unconstrained rows cost: the masks
    /// computed together before sampling, each drawn token's check and the parser's advance,
    /// and for a mask the logits' copy, the mask and the draw over the masked row (for rows
    /// that always mask, that draw is one an unconstrained row makes too: an upper bound).
    pub seconds: f64,
    /// Wall seconds of the steps that sampled at least one constrained row: `seconds` over
    /// this is the share of those steps that constraints took.
    pub step_seconds: f64,
}

/// Exits to test below the serving depth, for measuring an exit-depth distribution while
/// serving (HELIOS's online evaluation). Each probed depth costs one more exit head per
/// sampled row; the served tokens do not change (the forward is only split at the probes).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExitProbe {
    /// Depths to test, increasing; those at or above the serving depth are skipped.
    pub depths: Vec<usize>,
    /// A depth passes when its largest softmax probability is at least this.
    pub threshold: f32,
}

/// Per-request state the scheduler does not hold.
struct Request {
    sampler: Sampler,
    /// The structured-output constraint, when the request has one.
    constraint: Option<Constraint>,
}

/// A step's sampled tokens, their exit confidences and their requested log-probability
/// alternatives.
type StepSamples = (
    Vec<SampledToken>,
    HashMap<RequestId, ExitSeen>,
    HashMap<RequestId, Vec<(u32, f32)>>,
);

pub struct EngineCore {
    model: LayeredModel,
    exit: Box<dyn ExitHead>,
    scheduler: Scheduler,
    requests: HashMap<RequestId, Request>,
    /// Tokens that end generation (EOS, end of turn).
    end_of_generation: Vec<u32>,
    budget: MemoryBudget,
    workspace: u64,
    block_bytes: u64,
    /// Layers being loaded and the bytes reserved for each.
    loading: Option<Vec<(usize, u64)>>,
    load_times: Vec<LayerLoadTime>,
    probe: Option<ExitProbe>,
    /// Compiles requests' structured-output constraints (`None`: such requests are refused).
    grammar: Option<Arc<GrammarCompiler>>,
    /// Constrained requests whose grammar failed in the last forward, to end with an error.
    grammar_failed: Vec<(RequestId, GrammarError)>,
    /// Constrained tokens sampled, and how many of them needed a full mask.
    constrained: ConstrainedCounters,
}

impl std::fmt::Debug for EngineCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineCore")
            .field("model", &self.model)
            .field("exit", &self.exit)
            .field("scheduler", &self.scheduler)
            .finish()
    }
}

impl EngineCore {
    /// An engine over `model` (its resident layers must be the first N; it runs all of them)
    /// with the logit-lens exit head. `end_of_generation`: the tokenizer's end tokens.
    pub fn new(
        model: LayeredModel,
        end_of_generation: Vec<u32>,
        cfg: EngineConfig,
    ) -> Result<Self> {
        Self::with_exit(model, Box::new(LogitLens), end_of_generation, cfg)
    }

    pub fn with_exit(
        model: LayeredModel,
        exit: Box<dyn ExitHead>,
        end_of_generation: Vec<u32>,
        cfg: EngineConfig,
    ) -> Result<Self> {
        let depth = resident_prefix(&model)?;
        let spec = model.spec();
        if let Some(why) = exit.unservable(cfg.scheduler.prefix_caching) {
            return Err(EngineError::BadConfig(why));
        }
        if cfg.block_tokens == 0 {
            return Err(EngineError::BadConfig(
                "block_tokens must be positive".into(),
            ));
        }
        let context = match cfg.max_model_len {
            Some(m) if m < 2 => {
                return Err(EngineError::BadConfig(format!(
                    "max_model_len must be at least 2 (one prompt token and one output), got {m}"
                )))
            }
            Some(m) => m.min(spec.context_length),
            None => spec.context_length,
        };
        let step_tokens = cfg.scheduler.max_step_tokens(context);
        let workspace = activation_bytes(spec, step_tokens, cfg.scheduler.max_num_seqs) as u64;
        let layout = BlockLayout::for_spec(spec, cfg.block_tokens, cfg.kv_format);
        let block_bytes = layout.block_bytes() as u64;
        let budget = MemoryBudget::new(cfg.memory_budget);
        let weights = model.resident_bytes().total() as u64 + exit.resident_bytes() as u64;
        let plan = budget.plan(weights, workspace, block_bytes)?;
        let pool = BlockPool::with_layout(layout, plan.kv_blocks);
        let scheduler = Scheduler::new(cfg.scheduler, pool, model.n_layers(), depth, context)?;
        tracing::info!(
            budget = cfg.memory_budget,
            weights,
            workspace,
            context,
            kv_blocks = plan.kv_blocks,
            kv_format = %cfg.kv_format,
            depth,
            "engine memory plan"
        );
        Ok(Self {
            model,
            exit,
            scheduler,
            requests: HashMap::new(),
            end_of_generation,
            budget,
            workspace,
            block_bytes,
            loading: None,
            load_times: Vec::new(),
            probe: None,
            grammar: None,
            grammar_failed: Vec::new(),
            constrained: ConstrainedCounters::default(),
        })
    }

    /// Serves structured-output requests with constraints compiled by `grammar` (the engine
    /// handle sets it from the model's tokenizer).
    pub fn set_grammar(&mut self, grammar: Arc<GrammarCompiler>) {
        self.grammar = Some(grammar);
    }

    pub fn model(&self) -> &LayeredModel {
        &self.model
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// The exit head the engine reads logits through.
    pub fn exit_head(&self) -> &dyn ExitHead {
        self.exit.as_ref()
    }

    pub fn depth(&self) -> usize {
        self.scheduler.depth()
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    /// Validates and queues a request under `id`.
    pub fn add_request(&mut self, id: RequestId, req: EngineRequest) -> Result<()> {
        req.params.validate()?;
        if self.is_parked() {
            return Err(EngineError::Parked);
        }
        let vocab = self.model.spec().vocab_size;
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(switchyard_models::ModelError::TokenOutOfRange { id: t, vocab }.into());
        }
        let constraint = match &req.params.guide {
            None => None,
            Some(guide) => {
                let grammar = self.grammar.as_ref().ok_or(EngineError::Unsupported {
                    param: "response_format",
                    reason: "this engine was started without a tokenizer to constrain".into(),
                })?;
                Some(grammar.compile(guide)?)
            }
        };
        self.scheduler.add(
            id,
            NewSequence {
                prompt: req.prompt,
                max_tokens: req.params.max_tokens,
                ignore_eos: req.params.ignore_eos,
            },
        )?;
        self.requests.insert(
            id,
            Request {
                sampler: Sampler::new(&req.params).with_end_tokens(&self.end_of_generation),
                constraint,
            },
        );
        Ok(())
    }

    /// Ends a request wherever it is and frees its blocks; whether it was there.
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.requests.remove(&id);
        self.exit.release(id);
        self.scheduler.remove(id)
    }

    /// One engine step.
    pub fn step(&mut self) -> StepResult {
        let started = std::time::Instant::now();
        let constrained_before = self.constrained.tokens;
        let result = self.step_inner();
        if self.constrained.tokens > constrained_before {
            self.constrained.step_seconds += started.elapsed().as_secs_f64();
        }
        result
    }

    fn step_inner(&mut self) -> StepResult {
        let _span = tracing::debug_span!("step").entered();
        let schedule = prof::time(Part::Schedule);
        let plan = self.scheduler.schedule();
        drop(schedule);
        let mut result = StepResult {
            batch: plan.scheduled.len(),
            tokens: plan.total_tokens(),
            depth: self.depth(),
            ..StepResult::default()
        };
        for (id, end) in &plan.ended {
            self.requests.remove(id);
            self.exit.release(*id);
            match *end {
                SeqEnd::Finished(reason) => result.outputs.push(TokenOutput {
                    id: *id,
                    token: None,
                    logprob: 0.0,
                    confidence: 0.0,
                    probe_exit: None,
                    finish: Some(reason),
                    cached_tokens: 0,
                    top_logprobs: Vec::new(),
                }),
                SeqEnd::TooLarge {
                    tokens,
                    blocks_needed,
                    pool_blocks,
                } => result.failed.push((
                    *id,
                    EngineError::PromptExceedsMemory {
                        prompt: tokens,
                        blocks_needed,
                        pool_blocks,
                        depth: self.depth(),
                    },
                )),
            }
        }
        if plan.is_empty() {
            return result;
        }
        let ran = self.run(&plan);
        for (id, e) in std::mem::take(&mut self.grammar_failed) {
            tracing::warn!(error = %e, "a constrained request failed");
            self.abort(id);
            result.failed.push((id, EngineError::Grammar(e)));
        }
        match ran {
            Ok((sampled, exits, mut top)) => {
                let _t = prof::time(Part::Schedule);
                let logprobs: HashMap<RequestId, f32> =
                    sampled.iter().map(|t| (t.id, t.logprob)).collect();
                for u in self.scheduler.update_from_output(&plan, &sampled) {
                    let exit = exits.get(&u.id).copied().unwrap_or_default();
                    let cached_tokens = self
                        .scheduler
                        .sequence(u.id)
                        .map_or(0, |s| s.cached_tokens());
                    if u.finish.is_some() {
                        self.requests.remove(&u.id);
                        self.exit.release(u.id);
                    }
                    result.outputs.push(TokenOutput {
                        id: u.id,
                        token: u.token,
                        logprob: logprobs.get(&u.id).copied().unwrap_or(0.0),
                        confidence: exit.confidence,
                        probe_exit: exit.probe_exit,
                        finish: u.finish,
                        cached_tokens,
                        top_logprobs: top.remove(&u.id).unwrap_or_default(),
                    });
                }
            }
            Err(e) => {
                // The sequences of this step cannot continue (their caches may be partly
                // written); the others are untouched.
                tracing::error!(error = %e, "forward step failed");
                let msg = e.to_string();
                for s in &plan.scheduled {
                    self.abort(s.id);
                    result
                        .failed
                        .push((s.id, EngineError::StepFailed(msg.clone())));
                }
            }
        }
        result
    }

    /// The batched forward of a plan, the sampled tokens and their exit confidences.
    fn run(&mut self, plan: &SchedulerOutput) -> Result<StepSamples> {
        let depth = self.scheduler.depth();
        let mut tokens = Vec::with_capacity(plan.total_tokens());
        let mut rows: Vec<(RequestId, u32)> = Vec::new();
        for s in &plan.scheduled {
            let seq = self
                .scheduler
                .sequence(s.id)
                .ok_or_else(|| EngineError::StepFailed(format!("request {} vanished", s.id)))?;
            tokens.extend_from_slice(&seq.tokens()[s.start..s.start + s.n]);
            if s.sample {
                rows.push((s.id, (tokens.len() - 1) as u32));
            }
        }
        let idx: Vec<u32> = rows.iter().map(|r| r.1).collect();
        let n_rows = idx.len();
        let idx = (n_rows > 0)
            .then(|| Tensor::from_vec(idx, n_rows, self.model.device()))
            .transpose()?;
        let (probes, threshold) = match (&self.probe, &idx) {
            (Some(p), Some(_)) => (
                // A sequential head needs every row of every step at its depth; a probe
                // looks at sampled rows only, so those depths are not probed.
                p.depths
                    .iter()
                    .copied()
                    .filter(|&d| d > 0 && d < depth && !self.exit.is_sequential(d))
                    .collect::<Vec<_>>(),
                p.threshold,
            ),
            _ => (Vec::new(), 1.0),
        };
        let mut probe_exit: Vec<Option<u16>> = vec![None; n_rows];
        let hidden = {
            let _span = tracing::debug_span!("forward", tokens = tokens.len()).entered();
            let mut views: Vec<RerunKv<'_>> = self
                .scheduler
                .kv_batch(plan)
                .into_iter()
                .map(RerunKv::new)
                .collect();
            if views.len() != plan.scheduled.len() {
                return Err(EngineError::StepFailed(
                    "a scheduled sequence has no cache".into(),
                ));
            }
            let chunks = plan
                .scheduled
                .iter()
                .zip(views.iter_mut())
                .map(|(s, kv)| SeqChunk {
                    start: s.start,
                    n: s.n,
                    kv: kv as &mut dyn SeqKv,
                })
                .collect();
            let mut batch = ForwardBatch::new(chunks);
            let mut x = self.model.embed(&tokens)?;
            // Split only at the probes that apply; layers are independent of where the
            // range is cut, so the served tokens are those of one unsplit forward.
            let mut start = 0;
            for &d in probes.iter() {
                x = self.model.forward_layers(x, start..d, &mut batch)?;
                start = d;
                if let Some(idx) = &idx {
                    let picked = x.index_select(idx, 0)?;
                    let logits = self
                        .exit
                        .exit_logits(&self.model, &picked, d)?
                        .to_dtype(DType::F32)?
                        .to_vec2::<f32>()?;
                    for (slot, row) in probe_exit.iter_mut().zip(&logits) {
                        if slot.is_none() && max_prob(row) >= threshold {
                            *slot = u16::try_from(d).ok();
                        }
                    }
                }
            }
            self.model.forward_layers(x, start..depth, &mut batch)?
        };
        let logits = if depth < self.model.n_layers() && self.exit.is_sequential(depth) {
            // Every row goes to the head, sampled or not: its K/V take them all.
            self.exit
                .sequence_logits(&self.model, &hidden, depth, &spans(plan))?
        } else {
            let Some(idx) = idx else {
                return Ok((Vec::new(), HashMap::new(), HashMap::new()));
            };
            self.exit
                .exit_logits(&self.model, &hidden.index_select(&idx, 0)?, depth)?
        };
        // Read in place: a copy of every row's logits was 3 % of a decode step at batch 187.
        let vocab = logits.dim(candle_core::D::Minus1)?;
        switchyard_kernels::with_values(&logits, |logits| {
            self.sample_rows(logits.chunks_exact(vocab.max(1)), rows, probe_exit)
        })?
    }

    /// Samples each row's token from its logits (`rows[i]`'s in `logits`' `i`th item).
    fn sample_rows<'a>(
        &mut self,
        logits: impl Iterator<Item = &'a [f32]>,
        rows: Vec<(RequestId, u32)>,
        probe_exit: Vec<Option<u16>>,
    ) -> Result<StepSamples> {
        let _span = tracing::debug_span!("sample", rows = rows.len()).entered();
        let _t = prof::time(Part::Sample);
        let preparing = std::time::Instant::now();
        if self.prepare_masks(&rows) {
            self.constrained.seconds += preparing.elapsed().as_secs_f64();
        }
        let mut sampled = Vec::with_capacity(rows.len());
        let mut exits = HashMap::with_capacity(rows.len());
        let mut top = HashMap::new();
        for (((id, _), row), probe_exit) in rows.iter().zip(logits).zip(probe_exit) {
            let (Some(seq), Some(req)) = (self.scheduler.sequence(*id), self.requests.get_mut(id))
            else {
                continue;
            };
            let (tokens, prompt_len) = (seq.tokens(), seq.prompt_len());
            let s = match req.constraint.as_mut() {
                None => req.sampler.sample(row, tokens, prompt_len),
                Some(c) => match req.sampler.sample_constrained(row, tokens, prompt_len, c) {
                    Ok((s, masked)) => {
                        self.constrained.seconds += req.sampler.take_constraint_seconds();
                        self.constrained.tokens += 1;
                        self.constrained.masked += u64::from(masked);
                        s
                    }
                    Err(e) => {
                        self.grammar_failed.push((*id, e));
                        continue;
                    }
                },
            };
            let token = s.token;
            let end_of_generation = self.end_of_generation.contains(&token);
            // A constrained output ends at its end token even with `ignore_eos`: nothing may
            // follow a complete one.
            let finished = req
                .constraint
                .as_ref()
                .is_some_and(|c| c.is_finished() && end_of_generation);
            sampled.push(SampledToken {
                id: *id,
                token,
                logprob: s.logprob,
                end_of_generation,
                stop_token: finished || req.sampler.params().stop_token_ids.contains(&token),
            });
            if !s.top.is_empty() {
                top.insert(*id, s.top);
            }
            exits.insert(
                *id,
                ExitSeen {
                    confidence: s.max_prob,
                    probe_exit,
                },
            );
        }
        Ok((sampled, exits, top))
    }

    /// Computes the masks of every constrained row about to be sampled that will need one,
    /// spread over the compute pool (each row's llguidance mask is independent of the
    /// others'), so a batch of constrained rows costs about one mask per thread instead of
    /// one per row on this thread. Rows the sampler may draw before masking (see
    /// [`Sampler::sample_constrained`]) are left out: most of their tokens need no mask.
    /// Whether any mask was computed.
    fn prepare_masks(&mut self, rows: &[(RequestId, u32)]) -> bool {
        // Most steps have no constrained row: nothing to gather.
        let constrained = self.requests.values().filter(|r| r.constraint.is_some());
        if constrained.take(2).count() < 2 {
            return false;
        }
        let ids: std::collections::HashSet<RequestId> = rows.iter().map(|(id, _)| *id).collect();
        let constraints: Vec<std::sync::Mutex<&mut Constraint>> = self
            .requests
            .iter_mut()
            .filter(|(id, r)| ids.contains(id) && !r.sampler.may_sample_before_mask())
            .filter_map(|(_, r)| r.constraint.as_mut())
            .map(std::sync::Mutex::new)
            .collect();
        if constraints.len() < 2 {
            return false;
        }
        switchyard_kernels::pool::run(constraints.len(), &|i| {
            if let Ok(mut c) = constraints[i].lock() {
                c.prepare();
            }
        });
        true
    }

    /// Tests `probe`'s exits below the serving depth on every sampled row from the next step
    /// on (`None`: no probing, the default).
    pub fn set_probe(&mut self, probe: Option<ExitProbe>) {
        self.probe = probe;
    }

    /// Runs layers `0..depth` from the next step on (they must be resident). Lowering the
    /// depth frees the KV blocks of the layers above it; raising it makes every sequence
    /// recompute its positions for the new layers (see [`crate::scheduler`]).
    pub fn set_depth(&mut self, depth: usize) -> Result<()> {
        let n_layers = self.model.n_layers();
        if depth == 0 || depth > n_layers {
            return Err(EngineError::BadDepth { depth, n_layers });
        }
        if (0..depth).any(|l| !self.model.is_resident(l)) {
            return Err(EngineError::DepthNotResident {
                depth,
                resident: self.model.resident_layers(),
            });
        }
        self.scheduler.set_depth(depth)
    }

    /// Number of resident layers (always the first N).
    pub fn resident_layers(&self) -> usize {
        (0..self.model.n_layers())
            .take_while(|&l| self.model.is_resident(l))
            .count()
    }

    /// First half of loading layers `resident..upto`: takes their bytes from the KV pool
    /// (free blocks, then cached ones, then by preempting the newest sequences) and returns
    /// the job that reads them, to run on any thread. Install what it loads with
    /// [`EngineCore::install_layer`], then call [`EngineCore::finish_load`].
    pub fn begin_load(&mut self, upto: usize) -> Result<(LayerLoadJob, LoadReport)> {
        self.no_load_in_progress()?;
        let n_layers = self.model.n_layers();
        if upto > n_layers {
            return Err(EngineError::BadDepth {
                depth: upto,
                n_layers,
            });
        }
        self.unpark()?;
        let start = self.resident_layers();
        let layers = start..upto.max(start);
        let planned: Vec<(usize, u64)> = layers
            .clone()
            .map(|l| (l, self.model.layer_bytes(l) as u64))
            .collect();
        let bytes: u64 = planned.iter().map(|p| p.1).sum();
        let weights = self.weights_bytes();
        let target = self
            .budget
            .plan(weights + bytes, self.workspace, self.block_bytes)
            .map_err(|_| EngineError::LayersExceedBudget {
                start: layers.start,
                end: layers.end,
                bytes,
                budget: self.budget.total_bytes,
                weights,
                workspace: self.workspace,
            })?
            .kv_blocks;
        let before = self.scheduler.pool().total_blocks();
        let preempted = self.scheduler.shrink_pool_to(target);
        self.loading = Some(planned);
        let job = LayerLoadJob {
            source: std::sync::Arc::clone(self.model.source()),
            device: self.model.device().clone(),
            format: self.model.loader().format,
            cfg: self.model.config().clone(),
            layers,
        };
        let report = LoadReport {
            layers: Vec::new(),
            preempted,
            pool_blocks_freed: before as i64 - self.scheduler.pool().total_blocks() as i64,
        };
        Ok((job, report))
    }

    /// Puts a layer of the load in progress in place (between steps).
    pub fn install_layer(&mut self, loaded: LoadedLayer) -> Result<LayerLoadTime> {
        let Some(planned) = self.loading.as_mut() else {
            return Err(EngineError::BadConfig(format!(
                "layer {} arrived with no load in progress",
                loaded.layer
            )));
        };
        let Some(i) = planned.iter().position(|p| p.0 == loaded.layer) else {
            return Err(EngineError::BadConfig(format!(
                "layer {} is not part of the load in progress",
                loaded.layer
            )));
        };
        planned.remove(i);
        self.model.install_layer(loaded.layer, loaded.block)?;
        // The planned size is computed from the file; should the kernels hold more, the pool
        // gives the difference back so the budget still holds.
        self.fit_pool();
        let t = LayerLoadTime {
            layer: loaded.layer,
            bytes: loaded.bytes,
            secs: loaded.secs,
        };
        self.load_times.push(t);
        if self.load_times.len() > LOAD_TIMES_KEPT {
            self.load_times.remove(0);
        }
        Ok(t)
    }

    /// Ends the load in progress: bytes reserved for layers that never arrived go back to
    /// the pool.
    pub fn finish_load(&mut self) {
        self.loading = None;
        self.fit_pool();
    }

    /// Loads layers `resident..upto` on this thread (for callers without an actor).
    pub fn load_layers_now(&mut self, upto: usize) -> Result<LoadReport> {
        let (job, mut report) = self.begin_load(upto)?;
        let mut result = Ok(());
        job.run(|r| match r {
            Ok(layer) => match self.install_layer(layer) {
                Ok(t) => {
                    report.layers.push(t);
                    true
                }
                Err(e) => {
                    result = Err(e);
                    false
                }
            },
            Err(e) => {
                result = Err(e);
                false
            }
        });
        self.finish_load();
        result.map(|()| report)
    }

    /// Keeps only layers `0..keep` resident: frees the other layers' weights and KV blocks
    /// and gives their memory to the KV pool. The depth drops to `keep` if it was above.
    pub fn drop_layers(&mut self, keep: usize) -> Result<LoadReport> {
        self.no_load_in_progress()?;
        let n_layers = self.model.n_layers();
        if keep == 0 || keep > n_layers {
            return Err(EngineError::BadDepth {
                depth: keep,
                n_layers,
            });
        }
        if self.depth() > keep {
            self.scheduler.set_depth(keep)?;
        }
        for l in keep..n_layers {
            self.model.drop_layer(l);
        }
        let before = self.scheduler.pool().total_blocks();
        self.fit_pool();
        Ok(LoadReport {
            pool_blocks_freed: before as i64 - self.scheduler.pool().total_blocks() as i64,
            ..LoadReport::default()
        })
    }

    /// Changes the memory budget between steps (an orchestrator moving memory from an idle
    /// engine to the serving one): the KV pool grows into a larger budget, or shrinks into a
    /// smaller one (free blocks first, then cached prefixes, then running sequences are
    /// preempted for recomputation). Refused while layers load, and below the resident
    /// weights plus the workspace.
    pub fn set_budget(&mut self, bytes: u64) -> Result<LoadReport> {
        self.no_load_in_progress()?;
        let floor = self.weights_bytes() + self.workspace_held();
        if bytes < floor {
            return Err(EngineError::BadConfig(format!(
                "a memory budget of {bytes} bytes is below the resident weights and the \
                 workspace ({floor} bytes)"
            )));
        }
        let before = self.scheduler.pool().total_blocks();
        self.budget = MemoryBudget::new(bytes);
        self.fit_pool();
        Ok(LoadReport {
            pool_blocks_freed: before as i64 - self.scheduler.pool().total_blocks() as i64,
            ..LoadReport::default()
        })
    }

    fn no_load_in_progress(&self) -> Result<()> {
        match &self.loading {
            Some(l) => Err(EngineError::LoadInProgress {
                start: l.first().map_or(0, |x| x.0),
                end: l.last().map_or(0, |x| x.0 + 1),
            }),
            None => Ok(()),
        }
    }

    /// Frees everything the model holds (its layers, token embedding and LM head) and the
    /// whole KV pool, and reserves no workspace: an engine that its orchestrator does not
    /// serve from holds nothing but its exit head's own weights. Refused while requests are
    /// in the engine or layers load. The next layer load ([`EngineCore::begin_load`]) holds
    /// the embedding and the head again first; requests are refused until then.
    pub fn park(&mut self) -> Result<LoadReport> {
        self.no_load_in_progress()?;
        if self.scheduler.has_work() {
            return Err(EngineError::BadConfig(format!(
                "cannot park an engine that holds {} requests",
                self.requests.len()
            )));
        }
        if self.depth() > 1 {
            self.scheduler.set_depth(1)?;
        }
        for l in 0..self.model.n_layers() {
            self.model.drop_layer(l);
        }
        self.model.drop_io();
        let before = self.scheduler.pool().total_blocks();
        self.scheduler.shrink_pool_to(0);
        Ok(LoadReport {
            pool_blocks_freed: before as i64,
            ..LoadReport::default()
        })
    }

    /// Empties the prefix cache: blocks only the cache held go back to the pool (blocks that
    /// running sequences share go back when they finish), so that the next request of a
    /// prompt seen before pays its prefill again, as on a fresh engine. Returns the blocks
    /// freed now.
    pub fn clear_prefix_cache(&mut self) -> usize {
        self.scheduler.clear_prefix_cache()
    }

    /// Whether the engine is parked (see [`EngineCore::park`]).
    pub fn is_parked(&self) -> bool {
        !self.model.io_resident()
    }

    /// The activation workspace the budget reserves: none while parked.
    fn workspace_held(&self) -> u64 {
        if self.is_parked() {
            0
        } else {
            self.workspace
        }
    }

    /// Holds the embedding and the head of a parked engine again, if the budget has room
    /// for them beside the workspace and one KV block.
    fn unpark(&mut self) -> Result<()> {
        if !self.is_parked() {
            return Ok(());
        }
        self.model.load_io()?;
        let weights = self.weights_bytes();
        if self
            .budget
            .plan(weights, self.workspace, self.block_bytes)
            .is_err()
        {
            self.model.drop_io();
            return Err(EngineError::BadConfig(format!(
                "the embedding and LM head ({weights} bytes with the exit head) and the \
                 workspace ({} bytes) do not fit the memory budget of {} bytes",
                self.workspace, self.budget.total_bytes
            )));
        }
        self.fit_pool();
        Ok(())
    }

    /// Resizes the pool to what the budget leaves beside the weights and the workspace
    /// (nothing while parked).
    fn fit_pool(&mut self) {
        let weights = self.weights_bytes();
        let target = match self.is_parked() {
            true => 0,
            false => self
                .budget
                .plan(weights, self.workspace, self.block_bytes)
                .map_or(0, |p| p.kv_blocks),
        };
        let total = self.scheduler.pool().total_blocks();
        if target < total {
            self.scheduler.shrink_pool_to(target);
        } else {
            self.scheduler.grow_pool_to(target);
        }
    }

    /// Resident weights, the exit head and the bytes reserved for layers being loaded.
    pub fn weights_bytes(&self) -> u64 {
        self.model.resident_bytes().total() as u64
            + self.exit.resident_bytes() as u64
            + self.loading_bytes()
    }

    fn loading_bytes(&self) -> u64 {
        self.loading
            .as_ref()
            .map_or(0, |l| l.iter().map(|p| p.1).sum())
    }

    /// Memory in use by category; [`Usage::check`] holds after every call.
    pub fn usage(&self) -> Usage {
        self.budget.usage(
            self.weights_bytes(),
            self.scheduler.pool(),
            self.workspace_held(),
        )
    }

    pub fn stats(&self) -> EngineStats {
        let u = self.usage();
        let pool = self.scheduler.pool();
        let cache = self.scheduler.cache();
        EngineStats {
            memory: MemoryStats {
                budget_bytes: u.total,
                weights_bytes: u.weights,
                weights_loading_bytes: self.loading_bytes(),
                kv_used_bytes: u.kv_used,
                kv_free_bytes: u.kv_free,
                workspace_bytes: u.workspace,
                in_use_bytes: u.in_use(),
                kv_to_finish_bytes: self.scheduler.blocks_to_finish() as u64 * self.block_bytes,
            },
            block_tokens: pool.block_tokens(),
            block_bytes: self.block_bytes,
            kv_format: pool.format(),
            kv_blocks_total: pool.total_blocks(),
            kv_blocks_used: pool.used_blocks(),
            kv_blocks_free: pool.free_blocks(),
            prefix_cached_blocks: cache.len(),
            depth: self.depth(),
            n_layers: self.model.n_layers(),
            resident_layers: self.resident_layers(),
            running: self.scheduler.running().len(),
            waiting: self.scheduler.waiting().count(),
            counters: *self.scheduler.counters(),
            prefix_cache_hit_tokens: cache.hits_tokens(),
            prefix_cache_queried_tokens: cache.queried_tokens(),
            prefix_cache_hit_rate: cache.hit_rate(),
            constrained: self.constrained,
            layer_loads: self.load_times.clone(),
        }
    }
}

/// What the exit heads said about one sampled row.
#[derive(Debug, Clone, Copy, Default)]
struct ExitSeen {
    confidence: f32,
    probe_exit: Option<u16>,
}

/// The largest softmax probability of `logits` (HELIOS's and EE-LLM's exit confidence).
pub use crate::sampler::max_prob;

/// Every token `tokenizer` ends generation on (EOS, end of turn, ...).
pub fn end_of_generation_tokens(tokenizer: &switchyard_tokenizer::Tokenizer) -> Vec<u32> {
    (0..tokenizer.vocab_size() as u32)
        .filter(|&t| tokenizer.is_end_of_generation(t))
        .collect()
}

/// The number of resident layers, which must be the first N (at least one).
fn resident_prefix(model: &LayeredModel) -> Result<usize> {
    let resident = model.resident_layers();
    let n = resident.len();
    if n == 0 || resident.iter().enumerate().any(|(i, &l)| i != l) {
        return Err(EngineError::ResidentNotPrefix { resident });
    }
    Ok(n)
}

/// The exit seam's view of a plan: each scheduled sequence's rows, in the forward's order.
fn spans(plan: &SchedulerOutput) -> Vec<ExitSpan> {
    plan.scheduled
        .iter()
        .map(|s| ExitSpan {
            id: s.id,
            start: s.start,
            n: s.n,
            sample: s.sample,
        })
        .collect()
}
