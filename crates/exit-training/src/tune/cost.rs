//! What an exit check costs at batch 1, measured rather than estimated: the check alone (head,
//! final norm, then the vocabulary head or the probe), and one whole decode step that runs
//! layers `0..depth` and then the check, next to the full-depth step it would replace.
//!
//! Every figure is the median of [`REPS`] timed runs after one untimed warm-up. Decode steps
//! run on a KV cache prefilled with [`STEP_CONTEXT`] real tokens and truncated back before each
//! step, so every repetition attends to the same context; a row's steps to its exit and the
//! full-depth steps it is compared with are timed in turn.

use std::fmt::Write as _;
use std::time::Instant;

use candle_core::{Tensor, D};
use serde::Serialize;
use switchyard_models::{DenseKv, ForwardBatch, LayeredModel};

use switchyard_exits::block::{BlockKv, SeqRows};
use switchyard_exits::heads::{ExitHead, ExitProbe};
use switchyard_exits::{ExitsError, Result};

/// Timed repetitions of every measurement (the median is reported).
pub const REPS: usize = 20;
/// Sequences in the batched decode step timed next to the batch-1 one: fixed-depth exit in
/// batched serving runs every sequence of a step to the same depth and through the head.
pub const BATCH: usize = 8;
/// Positions in the KV cache when a decode step is timed: a short chat turn. At this length
/// attention is a small share of a step for the models in the zoo, so the step's time is
/// mostly the layers' weights and the exit check.
pub const STEP_CONTEXT: usize = 128;

/// The costs of one head's exit check, in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct CheckCost {
    pub depth: usize,
    /// The head: its kind in `ee-tune`, `<file> (<kind>)` in `eval exits --head`.
    pub head: String,
    /// Head, final norm and the vocabulary head (the serving path's quantized product).
    pub head_check_ms: f64,
    /// Head, final norm and the probe; absent when the head has no probe.
    pub probe_check_ms: Option<f64>,
    /// One decode step at batch 1: embedding, layers `0..depth`, then the vocabulary-head
    /// check.
    pub step_head_check_ms: f64,
    /// The same step with the probe check instead; absent when the head has no probe.
    pub step_probe_check_ms: Option<f64>,
    /// One full-depth decode step on the same context (every layer, final norm, LM head),
    /// timed in turn with this row's steps: what a step costs without early exit.
    pub full_depth_step_ms: f64,
    /// One decode step of [`BATCH`] sequences (each on its own copy of the context): layers
    /// `0..depth`, the head (a block head on each sequence's K/V) and the vocabulary head for
    /// every row, as fixed-depth batched serving runs it.
    pub batch_step_exit_ms: f64,
    /// The same batch at full depth, timed in turn with it.
    pub batch_step_full_ms: f64,
}

impl CheckCost {
    /// The header of [`CheckCost::cells`]' table, `extra` columns appended.
    pub fn table_header(extra: &[&str]) -> String {
        let mut cols = vec![
            "depth",
            "head",
            "exit check, vocabulary head (ms)",
            "exit check, probe (ms)",
            "decode step to the exit + vocabulary-head check (ms)",
            "decode step to the exit + probe check (ms)",
            "full-depth decode step (ms)",
            "batch-8 step, fixed depth (ms)",
            "batch-8 step, full depth (ms)",
        ];
        cols.extend_from_slice(extra);
        format!("| {} |\n|{}\n", cols.join(" | "), "---|".repeat(cols.len()))
    }

    /// The row's cells, without the closing `|`, so callers can append columns.
    pub fn cells(&self) -> String {
        let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
        let mut s = String::new();
        let _ = write!(
            s,
            "| {} | {} | {:.3} | {} | {:.3} | {} | {:.3} | {:.3} | {:.3} ",
            self.depth,
            self.head,
            self.head_check_ms,
            opt(self.probe_check_ms),
            self.step_head_check_ms,
            opt(self.step_probe_check_ms),
            self.full_depth_step_ms,
            self.batch_step_exit_ms,
            self.batch_step_full_ms
        );
        s
    }
}

/// The median of `t` (the upper one of an even count); NaN when empty.
fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t.get(t.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The median time in milliseconds of `f` over [`REPS`] runs, after one untimed run.
fn median_ms(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut t = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64() * 1e3);
    }
    Ok(median(t))
}

/// A head as a check runs it: a block head with its K/V of the fixed context, which each row
/// checked extends by one position on a copy of its own (so every repetition, and every
/// sequence of a batch, sees the same context).
struct Checked<'h> {
    head: &'h ExitHead,
    /// The context's K/V at the head's depth; empty for row-wise heads.
    kv: BlockKv,
    at: usize,
}

impl Checked<'_> {
    /// Rows `[n, d_model]`, each the next position of its own sequence.
    fn translate(&self, rows: &Tensor) -> Result<Tensor> {
        let ExitHead::Block(block) = self.head else {
            return self.head.translate(rows);
        };
        let mut kvs: Vec<BlockKv> = (0..rows.dim(0)?).map(|_| self.kv.clone()).collect();
        let mut seqs: Vec<SeqRows<'_>> = kvs
            .iter_mut()
            .map(|kv| SeqRows {
                n: 1,
                start: self.at,
                kv: Some(kv),
            })
            .collect();
        block.forward_many(rows, &mut seqs)
    }
}

/// Head, final norm, vocabulary head and the top-1 read back: the check of the serving path
/// without a probe.
fn head_check(model: &LayeredModel, head: &Checked<'_>, row: &Tensor) -> Result<()> {
    let z = model.final_norm(&head.translate(row)?)?;
    model.lm_head(&z)?.argmax(D::Minus1)?.to_vec1::<u32>()?;
    Ok(())
}

/// Head, final norm, probe and its probability read back.
fn probe_check(
    model: &LayeredModel,
    head: &Checked<'_>,
    probe: &ExitProbe,
    row: &Tensor,
) -> Result<()> {
    let z = model.final_norm(&head.translate(row)?)?;
    probe.score(&z)?.to_vec1::<f32>()?;
    Ok(())
}

/// Decode steps at batch 1 on a fixed context.
pub struct StepTimer<'m> {
    model: &'m LayeredModel,
    kv: DenseKv,
    context: usize,
    /// The context's tokens (a block head's K/V is built from them).
    prompt: Vec<u32>,
    token: u32,
}

impl<'m> StepTimer<'m> {
    /// Prefills `tokens` but the last (at most [`STEP_CONTEXT`] of them); the last is the
    /// token every timed step feeds.
    pub fn new(model: &'m LayeredModel, tokens: &[u32]) -> Result<Self> {
        let tokens = &tokens[..tokens.len().min(STEP_CONTEXT + 1)];
        let Some((&token, prompt)) = tokens.split_last() else {
            return Err(ExitsError::Invalid(
                "no tokens to time a decode step on".into(),
            ));
        };
        let n = model.n_layers();
        let mut kv = DenseKv::new(n, model.spec().kv_row_len());
        if !prompt.is_empty() {
            let mut b = ForwardBatch::single(&mut kv, 0, prompt.len());
            model.forward_layers(model.embed(prompt)?, 0..n, &mut b)?;
        }
        Ok(Self {
            model,
            kv,
            context: prompt.len(),
            prompt: prompt.to_vec(),
            token,
        })
    }

    /// Milliseconds of one decode step of [`BATCH`] sequences on copies of the context:
    /// layers `0..depth`, then the head (`None`: full depth, the model's own output), then the
    /// vocabulary head on every row.
    fn batch_step_ms(&mut self, depth: usize, head: Option<&Checked<'_>>) -> Result<f64> {
        let model = self.model;
        self.kv.truncate(self.context);
        let mut kvs: Vec<DenseKv> = (0..BATCH).map(|_| self.kv.clone()).collect();
        let s = Instant::now();
        let x = model.embed(&[self.token; BATCH])?;
        let chunks = kvs
            .iter_mut()
            .map(|kv| switchyard_models::SeqChunk {
                start: self.context,
                n: 1,
                kv: kv as &mut dyn switchyard_models::SeqKv,
            })
            .collect();
        let mut b = ForwardBatch::new(chunks);
        let h = model.forward_layers(x, 0..depth, &mut b)?;
        let z = match head {
            None => h,
            Some(c) => c.translate(&h)?,
        };
        model.logits(&z)?.argmax(D::Minus1)?.to_vec1::<u32>()?;
        Ok(s.elapsed().as_secs_f64() * 1e3)
    }

    /// `head` ready to check: a block head gets the K/V of the context at `depth`.
    fn checked<'h>(&self, depth: usize, head: &'h ExitHead) -> Result<Checked<'h>> {
        let mut kv = BlockKv::default();
        if head.is_sequential() && !self.prompt.is_empty() {
            let model = self.model;
            let mut ctx = DenseKv::new(model.n_layers(), model.spec().kv_row_len());
            let mut b = ForwardBatch::single(&mut ctx, 0, self.prompt.len());
            let h = model.forward_layers(model.embed(&self.prompt)?, 0..depth, &mut b)?;
            head.write_kv(&h, 0, &mut kv)?;
        }
        Ok(Checked {
            head,
            kv,
            at: self.context,
        })
    }

    /// The step's token through layers `0..depth` on the fixed context.
    fn layers(&mut self, depth: usize) -> Result<Tensor> {
        self.kv.truncate(self.context);
        let x = self.model.embed(&[self.token])?;
        let mut b = ForwardBatch::single(&mut self.kv, self.context, 1);
        Ok(self.model.forward_layers(x, 0..depth, &mut b)?)
    }

    /// Milliseconds of one step: layers `0..depth`, then `check` on their output.
    fn step_ms(
        &mut self,
        depth: usize,
        check: impl FnOnce(&LayeredModel, &Tensor) -> Result<()>,
    ) -> Result<f64> {
        let s = Instant::now();
        let h = self.layers(depth)?;
        check(self.model, &h)?;
        Ok(s.elapsed().as_secs_f64() * 1e3)
    }

    /// Every cost of `head` (and `probe`) at `depth`, named `name`. The steps to the exit and
    /// the full-depth step take turns, so both see the same load on a shared machine.
    pub fn cost(
        &mut self,
        depth: usize,
        name: &str,
        head: &ExitHead,
        probe: Option<&ExitProbe>,
    ) -> Result<CheckCost> {
        let model = self.model;
        let n = model.n_layers();
        let head = &self.checked(depth, head)?;
        let row = self.layers(depth)?;
        let head_check_ms = median_ms(|| head_check(model, head, &row))?;
        let probe_check_ms = probe
            .map(|p| median_ms(|| probe_check(model, head, p, &row)))
            .transpose()?;
        let mut step_head = Vec::with_capacity(REPS);
        let mut step_probe = Vec::with_capacity(REPS);
        let mut full = Vec::with_capacity(REPS);
        // Repetition 0 warms up and is not kept.
        for rep in 0..=REPS {
            let a = self.step_ms(depth, |m, h| head_check(m, head, h))?;
            let b = match probe {
                Some(p) => Some(self.step_ms(depth, |m, h| probe_check(m, head, p, h))?),
                None => None,
            };
            let f = self.step_ms(n, |m, h| {
                m.logits(h)?.argmax(D::Minus1)?.to_vec1::<u32>()?;
                Ok(())
            })?;
            if rep > 0 {
                step_head.push(a);
                step_probe.extend(b);
                full.push(f);
            }
        }
        let mut batch_exit = Vec::with_capacity(REPS);
        let mut batch_full = Vec::with_capacity(REPS);
        for rep in 0..=REPS {
            let a = self.batch_step_ms(depth, Some(head))?;
            let f = self.batch_step_ms(n, None)?;
            if rep > 0 {
                batch_exit.push(a);
                batch_full.push(f);
            }
        }
        Ok(CheckCost {
            depth,
            head: name.to_string(),
            head_check_ms,
            probe_check_ms,
            step_head_check_ms: median(step_head),
            step_probe_check_ms: probe.map(|_| median(step_probe)),
            full_depth_step_ms: median(full),
            batch_step_exit_ms: median(batch_exit),
            batch_step_full_ms: median(batch_full),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_takes_the_middle_or_the_upper_middle() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 3.0);
        assert!(median(Vec::new()).is_nan());
    }

    #[test]
    fn a_row_fills_every_column_of_the_header() {
        let c = CheckCost {
            depth: 12,
            head: "affine".into(),
            head_check_ms: 1.5,
            probe_check_ms: None,
            step_head_check_ms: 7.25,
            step_probe_check_ms: None,
            full_depth_step_ms: 16.0,
            batch_step_exit_ms: 30.5,
            batch_step_full_ms: 60.0,
        };
        let header = CheckCost::table_header(&["loss"]);
        let row = format!("{}| 1.0 |", c.cells());
        let columns = |line: &str| line.matches('|').count();
        assert_eq!(
            columns(header.lines().next().unwrap_or_default()),
            columns(&row)
        );
        assert_eq!(
            row,
            "| 12 | affine | 1.500 | - | 7.250 | - | 16.000 | 30.500 | 60.000 | 1.0 |"
        );
    }
}
