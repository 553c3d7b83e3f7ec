//! Calibrated and trained heads behind the engine's exit seam ([`switchyard_engine::ExitHead`]),
//! so the serving scheduler's fixed-depth exit can use them in place of the logit lens.
//!
//! Row-wise heads map the sampled rows. A block head attends over its sequence: the engine
//! hands it every row of a step with each sequence's span, and the heads keep each sequence's
//! K/V at that depth until the engine releases the sequence. A span at position 0 starts the
//! sequence afresh (new, or recomputed after preemption); a span that does not continue the
//! K/V held (the sequence was served at another depth before) fails that step with the reason.

use candle_core::Tensor;
use switchyard_engine::{sampled_rows, ExitSpan, RequestId};
use switchyard_models::{LayeredModel, ModelError};

use crate::block::{BlockKv, SeqRows};
use crate::heads::{ExitHead, ExitHeads};

fn model_err(e: crate::ExitsError) -> ModelError {
    match e {
        crate::ExitsError::Model(m) => m,
        crate::ExitsError::Candle(c) => ModelError::Candle(c),
        // A depth without a head: the engine asked for an exit these heads do not have.
        other => ModelError::Candle(candle_core::Error::Msg(other.to_string())),
    }
}

impl switchyard_engine::ExitHead for ExitHeads {
    fn exit_logits(
        &self,
        model: &LayeredModel,
        hidden: &Tensor,
        depth: usize,
    ) -> switchyard_models::Result<Tensor> {
        self.logits(model, depth, hidden).map_err(model_err)
    }

    fn resident_bytes(&self) -> usize {
        self.iter().map(|(_, h)| h.bytes()).sum()
    }

    fn is_sequential(&self, depth: usize) -> bool {
        self.head(depth).is_ok_and(|h| h.is_sequential())
    }

    fn sequence_logits(
        &self,
        model: &LayeredModel,
        hidden: &Tensor,
        depth: usize,
        spans: &[ExitSpan],
    ) -> switchyard_models::Result<Tensor> {
        let ExitHead::Block(block) = self.head(depth).map_err(model_err)? else {
            return self.exit_logits(model, &sampled_rows(hidden, spans)?, depth);
        };
        let mut served = self
            .served
            .lock()
            .map_err(|_| candle_core::Error::Msg("exit K/V lock poisoned".into()))?;
        // Each span's K/V, taken out of the map for the step and put back after it.
        let mut kvs: Vec<BlockKv> = spans
            .iter()
            .map(|s| {
                let kv = served.remove(&(s.id.0, depth)).unwrap_or_default();
                if s.start == 0 {
                    BlockKv::default()
                } else {
                    kv
                }
            })
            .collect();
        let mut seqs: Vec<SeqRows<'_>> = spans
            .iter()
            .zip(kvs.iter_mut())
            .map(|(s, kv)| SeqRows {
                n: s.n,
                start: s.start,
                kv: Some(kv),
            })
            .collect();
        let y = block.forward_many(hidden, &mut seqs);
        drop(seqs);
        for (s, kv) in spans.iter().zip(kvs) {
            served.insert((s.id.0, depth), kv);
        }
        let y = y.map_err(model_err)?;
        if !spans.iter().any(|s| s.sample) {
            // A step of prompt chunks only: the K/V took the rows; no logits are wanted.
            let vocab = model.spec().vocab_size;
            return Ok(Tensor::zeros(
                (0, vocab),
                candle_core::DType::F32,
                y.device(),
            )?);
        }
        model.logits(&sampled_rows(&y, spans)?)
    }

    fn release(&self, id: RequestId) {
        if let Ok(mut served) = self.served.lock() {
            served.retain(|&(seq, _), _| seq != id.0);
        }
    }

    fn state_bytes(&self) -> usize {
        self.served
            .lock()
            .map_or(0, |s| s.values().map(BlockKv::bytes).sum())
    }

    fn unservable(&self, prefix_caching: bool) -> Option<String> {
        let blocks = self.sequential_depths();
        (prefix_caching && !blocks.is_empty()).then(|| {
            format!(
                "the exit heads at depths {blocks:?} are block heads, which need every position \
                 of a sequence to pass through them; a cached prefix skips positions, so serve \
                 them with prefix caching off"
            )
        })
    }
}
