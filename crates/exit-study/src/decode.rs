//! Per-token early exit at batch 1, as EE-LLM (Chen et al. 2024) serves it: one model, all
//! layers loaded, a KV cache for all layers, and each token leaving at the first exit whose
//! confidence passes the threshold.
//!
//! A token that exits at depth `d` leaves layers `d..` without K/V at its position, yet a later
//! token that goes deeper attends to it. Two fixes, chosen by [`KvFix`]:
//!
//! * **Recompute** (EE-LLM): the exited hidden state is kept; the next token that goes past `d`
//!   carries the missing positions with it through the missing layers (they ride in the same
//!   forward as extra rows), so their K/V become exactly what the full model would have
//!   written. Cost: extra rows in later forwards.
//! * **Propagate** (CALM, Schuster et al. 2022): right at the exit, the exited hidden state is
//!   projected into K/V of every skipped layer ([`LayeredModel::write_kv_layers`]); no
//!   attention and no MLP run, and the K/V are an approximation.
//!
//! The cache stays a prefix at every layer (positions `0..kv.len(j)` filled), which is what
//! makes recomputation simple: the rows layer `j` must run are exactly positions
//! `kv.len(j)..=t`.
//!
//! Block heads ([`switchyard_exits::block`]) keep K/V of their own, one cache per checked depth, under
//! the same rule: the block at depth `d` holds exactly the positions layer `d - 1` holds. The
//! prompt and every check fill it; under recomputation the rows that catch up pass through it
//! with the token; under propagation an exit writes the exited state's K/V into the blocks of
//! the deeper checked exits, as into the skipped layers.

use std::collections::BTreeMap;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use switchyard_models::{DenseKv, ForwardBatch, LayeredModel, SeqKv};

use switchyard_exits::block::BlockKv;
use switchyard_exits::confidence::{passes, token_stats, ConfidenceMeasure, TokenStats};
use switchyard_exits::heads::ExitHeads;
use switchyard_exits::{ExitsError, Result};

/// How the K/V of layers a token skipped are filled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KvFix {
    /// EE-LLM: the next deeper forward re-runs the missing positions through the missing layers.
    #[default]
    Recompute,
    /// CALM: the exited hidden state is projected into each skipped layer's K/V at once.
    Propagate,
}

impl KvFix {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "recompute" => Some(Self::Recompute),
            "propagate" => Some(Self::Propagate),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Recompute => "recompute",
            Self::Propagate => "propagate",
        }
    }
}

/// When a token may leave early.
#[derive(Debug, Clone, PartialEq)]
pub struct ExitPolicy {
    /// Exit when confidence is strictly above this (so 1.0 never exits and 0 always does).
    pub threshold: f32,
    pub measure: ConfidenceMeasure,
    /// Depths checked, increasing; each must have a head. Empty: full depth, no checks.
    pub depths: Vec<usize>,
    /// Decide with each exit's probe (CALM's classifier, trained by `ee-tune`) instead of the
    /// exit's confidence: a check then costs the head and the probe, and the vocabulary head
    /// runs once, at the exit taken. `threshold` applies to the probe's probability.
    pub probe: bool,
}

impl ExitPolicy {
    /// Every head of `heads`, max-probability test.
    pub fn all_heads(heads: &ExitHeads, threshold: f32) -> Self {
        Self {
            threshold,
            measure: ConfidenceMeasure::MaxProb,
            depths: heads.depths(),
            probe: false,
        }
    }

    /// No exits: the full-depth baseline through the same code path.
    pub fn full_depth() -> Self {
        Self {
            threshold: 1.0,
            measure: ConfidenceMeasure::MaxProb,
            depths: Vec::new(),
            probe: false,
        }
    }
}

/// What one decoding step produced.
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// Logits of the next token, `[vocab]`, from the exit taken (or the final layer).
    pub logits: Vec<f32>,
    /// Layers run for this token (`n_layers` when it did not exit).
    pub depth: usize,
    pub stats: TokenStats,
}

/// Work counters of a decoder.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DecodeCounters {
    /// Tokens stepped.
    pub steps: u64,
    /// Exit checks made (each a pass through the LM head, or through the probe when the
    /// policy decides with probes).
    pub exit_checks: u64,
    /// Layer passes of earlier positions re-run by recomputation (rows × layers).
    pub recomputed_row_layers: u64,
    /// K/V-only layer writes of exited positions by propagation (rows × layers).
    pub propagated_row_layers: u64,
    /// Tokens per depth taken.
    pub depth_histogram: BTreeMap<usize, u64>,
}

/// One sequence decoded token by token with per-token early exit.
pub struct EarlyExitDecoder<'m> {
    model: &'m LayeredModel,
    heads: &'m ExitHeads,
    policy: ExitPolicy,
    fix: KvFix,
    kv: DenseKv,
    /// Next position.
    pos: usize,
    /// Positions whose K/V stop at some depth, with the hidden state there (recompute only).
    pending: BTreeMap<usize, (usize, Tensor)>,
    /// K/V of the block heads at checked depths.
    block_kv: BTreeMap<usize, BlockKv>,
    counters: DecodeCounters,
}

impl<'m> EarlyExitDecoder<'m> {
    pub fn new(
        model: &'m LayeredModel,
        heads: &'m ExitHeads,
        policy: ExitPolicy,
        fix: KvFix,
    ) -> Result<Self> {
        let n = model.n_layers();
        check_policy(model, heads, &policy)?;
        if let Some(l) = (0..n).find(|&l| !model.is_resident(l)) {
            return Err(ExitsError::Invalid(format!(
                "per-token early exit needs every layer resident; layer {l} is not"
            )));
        }
        let block_kv = block_depths(heads, &policy)
            .into_iter()
            .map(|d| (d, BlockKv::default()))
            .collect();
        Ok(Self {
            model,
            heads,
            policy,
            fix,
            kv: DenseKv::new(n, model.spec().kv_row_len()),
            pos: 0,
            pending: BTreeMap::new(),
            block_kv,
            counters: DecodeCounters::default(),
        })
    }

    /// Changes the exit policy for the following steps (a controller may move the threshold).
    /// Once tokens are in, a block head can only be checked if it was checked from the start
    /// (its K/V hold every position).
    pub fn set_policy(&mut self, policy: ExitPolicy) -> Result<()> {
        check_policy(self.model, self.heads, &policy)?;
        for d in block_depths(self.heads, &policy) {
            if !self.block_kv.contains_key(&d) {
                if self.pos > 0 {
                    return Err(ExitsError::Invalid(format!(
                        "the block head at depth {d} was not checked so far and has no K/V for \
                         the {} positions in; set its policy before the prompt",
                        self.pos
                    )));
                }
                self.block_kv.insert(d, BlockKv::default());
            }
        }
        self.policy = policy;
        Ok(())
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn kv(&self) -> &DenseKv {
        &self.kv
    }

    pub fn counters(&self) -> &DecodeCounters {
        &self.counters
    }

    pub fn policy(&self) -> &ExitPolicy {
        &self.policy
    }

    /// Runs `tokens` through all layers (the prompt; no exit, no logits).
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Ok(());
        }
        if !self.pending.is_empty() {
            return Err(ExitsError::Internal(
                "prefill after an early exit; step the tokens instead".into(),
            ));
        }
        let mut x = self.model.embed(tokens)?;
        let mut b = ForwardBatch::single(&mut self.kv, self.pos, tokens.len());
        // Layers up to each block head, whose K/V take the prompt there, then the rest.
        let mut at = 0;
        for (&d, kv) in self.block_kv.iter_mut() {
            x = self.model.forward_layers(x, at..d, &mut b)?;
            self.heads.head(d)?.write_kv(&x, self.pos, kv)?;
            at = d;
        }
        self.model
            .forward_layers(x, at..self.model.n_layers(), &mut b)?;
        self.pos += tokens.len();
        Ok(())
    }

    /// Feeds `token` at the next position and returns the next token's logits from the first
    /// exit that passes the policy, or from the final layer.
    pub fn step(&mut self, token: u32) -> Result<StepOutput> {
        let _span = tracing::trace_span!("ee_step", pos = self.pos).entered();
        let n_layers = self.model.n_layers();
        let t = self.pos;
        let mut start = t;
        let mut h = self.model.embed(&[token])?;
        let mut next_check = 0;
        for j in 0..n_layers {
            // Positions whose K/V stop below layer j join here (recomputation).
            let need = self.kv.len(j);
            if need < start {
                h = self.join_pending(need, start, j, h)?;
                start = need;
            } else if need > start {
                return Err(ExitsError::Internal(format!(
                    "layer {j} holds {need} positions, step starts at {start}"
                )));
            }
            self.counters.recomputed_row_layers += (t - start) as u64;
            let rows = t + 1 - start;
            let mut b = ForwardBatch::single(&mut self.kv, start, rows);
            h = self.model.forward_layers(h, j..j + 1, &mut b)?;
            let depth = j + 1;
            if self.policy.depths.get(next_check) == Some(&depth) {
                next_check += 1;
                let head = self.heads.head(depth)?;
                let translated = match self.block_kv.get_mut(&depth) {
                    // A block head takes every row this layer ran: they join its K/V too.
                    Some(kv) => head
                        .translate_seq(&h, start, Some(kv))?
                        .narrow(0, rows - 1, 1)?,
                    None => head.translate(&h.narrow(0, rows - 1, 1)?)?,
                };
                let z = self.model.final_norm(&translated)?;
                if self.policy.probe {
                    self.counters.exit_checks += 1;
                    let probe = self
                        .heads
                        .probe(depth)
                        .ok_or(ExitsError::NoProbe { depth })?;
                    let score = probe.score(&z)?.to_vec1::<f32>()?;
                    if score
                        .first()
                        .is_some_and(|&p| passes(p, self.policy.threshold))
                    {
                        let logits = self.model.lm_head(&z)?.flatten_all()?.to_vec1::<f32>()?;
                        let stats = token_stats(&logits);
                        self.exit(start, depth, &h)?;
                        return Ok(self.finish(depth, logits, stats));
                    }
                    continue;
                }
                let logits = self.model.lm_head(&z)?.flatten_all()?.to_vec1::<f32>()?;
                let stats = token_stats(&logits);
                self.counters.exit_checks += 1;
                if passes(stats.confidence(self.policy.measure), self.policy.threshold) {
                    self.exit(start, depth, &h)?;
                    return Ok(self.finish(depth, logits, stats));
                }
            }
        }
        let last = h.narrow(0, t - start, 1)?;
        let logits = self.model.logits(&last)?.flatten_all()?.to_vec1::<f32>()?;
        let stats = token_stats(&logits);
        Ok(self.finish(n_layers, logits, stats))
    }

    fn finish(&mut self, depth: usize, logits: Vec<f32>, stats: TokenStats) -> StepOutput {
        self.pos += 1;
        self.counters.steps += 1;
        *self.counters.depth_histogram.entry(depth).or_default() += 1;
        StepOutput {
            logits,
            depth,
            stats,
        }
    }

    /// Prepends the pending rows `need..start` (all stopped at depth `j`) to `h`.
    fn join_pending(&mut self, need: usize, start: usize, j: usize, h: Tensor) -> Result<Tensor> {
        let mut rows = Vec::with_capacity(start - need + 1);
        for p in need..start {
            match self.pending.remove(&p) {
                Some((d, x)) if d == j => rows.push(x),
                other => {
                    return Err(ExitsError::Internal(format!(
                        "position {p} lacks K/V at layer {j} but is pending at {:?}",
                        other.map(|(d, _)| d)
                    )))
                }
            }
        }
        rows.push(h);
        Ok(Tensor::cat(&rows, 0)?)
    }

    /// Records the exit of rows `start..=t` (hidden `h`, after layers `0..depth`).
    fn exit(&mut self, start: usize, depth: usize, h: &Tensor) -> Result<()> {
        let n_layers = self.model.n_layers();
        match self.fix {
            KvFix::Recompute => {
                for (i, p) in (start..=self.pos).enumerate() {
                    self.pending.insert(p, (depth, h.narrow(0, i, 1)?));
                }
            }
            KvFix::Propagate => {
                // Only the current token can be short of K/V here: propagation leaves no gaps.
                let last = h.narrow(0, self.pos - start, 1)?;
                let mut b = ForwardBatch::single(&mut self.kv, self.pos, 1);
                self.model.write_kv_layers(&last, depth..n_layers, &mut b)?;
                self.counters.propagated_row_layers += (n_layers - depth) as u64;
                for (&d, kv) in self.block_kv.range_mut(depth + 1..) {
                    self.heads.head(d)?.write_kv(&last, self.pos, kv)?;
                }
            }
        }
        Ok(())
    }
}

/// The policy's depths whose head is a block.
fn block_depths(heads: &ExitHeads, policy: &ExitPolicy) -> Vec<usize> {
    policy
        .depths
        .iter()
        .copied()
        .filter(|&d| heads.head(d).is_ok_and(|h| h.is_sequential()))
        .collect()
}

/// Depths increase, lie inside the model and each has a head.
fn check_policy(model: &LayeredModel, heads: &ExitHeads, policy: &ExitPolicy) -> Result<()> {
    let n = model.n_layers();
    for w in policy.depths.windows(2) {
        if w[0] >= w[1] {
            return Err(ExitsError::Invalid(format!(
                "exit depths must increase: {:?}",
                policy.depths
            )));
        }
    }
    for &d in &policy.depths {
        if d == 0 || d >= n {
            return Err(ExitsError::BadDepth {
                depth: d,
                max: n - 1,
                n_layers: n,
            });
        }
        heads.head(d)?;
        if policy.probe && heads.probe(d).is_none() {
            return Err(ExitsError::NoProbe { depth: d });
        }
    }
    Ok(())
}
