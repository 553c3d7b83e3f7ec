//! [`ExitHead`]: how the hidden state leaving the model after layer `depth` becomes logits.
//!
//! The engine runs every sequence of a step through the same layers `0..depth` (fixed-depth
//! batched exit, HELIOS: no per-token depth synchronisation) and sends the rows it samples
//! through one exit head. The default is the model's own final norm and LM head applied at
//! `depth` (the "logit lens"), which at full depth is the model's plain output; calibrated or
//! trained heads per exit layer plug in behind the same seam.

use candle_core::Tensor;
use switchyard_models::LayeredModel;

use crate::RequestId;

/// One sequence's rows in a step's hidden states, which hold the sequences' rows one after
/// another in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitSpan {
    pub id: RequestId,
    /// Position of the sequence's first row.
    pub start: usize,
    pub n: usize,
    /// Whether the last row is sampled (its logits are wanted).
    pub sample: bool,
}

/// Turns hidden states `[rows, d_model]` after layer `depth - 1` into logits `[rows, vocab]`.
pub trait ExitHead: Send + Sync + std::fmt::Debug {
    fn exit_logits(
        &self,
        model: &LayeredModel,
        hidden: &Tensor,
        depth: usize,
    ) -> switchyard_models::Result<Tensor>;

    /// Bytes of weights the head keeps beyond the model's own (counted in the memory budget).
    fn resident_bytes(&self) -> usize {
        0
    }

    /// Whether the head at `depth` attends over each sequence's rows, keeping K/V per
    /// sequence (a transformer-block exit). The engine then hands it every row of a step
    /// through [`ExitHead::sequence_logits`], and tells it when a sequence is gone.
    fn is_sequential(&self, _depth: usize) -> bool {
        false
    }

    /// Logits `[sampled spans, vocab]` of the last row of each span with `sample`, in span
    /// order, from all of a step's rows `hidden` `[tokens, d_model]` after layers `0..depth`.
    /// A sequential head appends each span's rows to the sequence's K/V; a span starting at
    /// position 0 starts the sequence afresh (a new or recomputed sequence).
    fn sequence_logits(
        &self,
        model: &LayeredModel,
        hidden: &Tensor,
        depth: usize,
        spans: &[ExitSpan],
    ) -> switchyard_models::Result<Tensor> {
        self.exit_logits(model, &sampled_rows(hidden, spans)?, depth)
    }

    /// The sequence `id` is gone (finished, aborted or failed): its K/V can go.
    fn release(&self, _id: RequestId) {}

    /// Bytes of per-sequence state the head holds now (a sequential head's K/V).
    fn state_bytes(&self) -> usize {
        0
    }

    /// Why these heads cannot be served by the batching engine under `prefix_caching`, if
    /// they cannot: a sequential head needs every position of a sequence to pass through it,
    /// and a cached prefix skips them.
    fn unservable(&self, _prefix_caching: bool) -> Option<String> {
        None
    }
}

/// The last row of each span with `sample`, in span order, from a step's rows laid out span
/// by span.
pub fn sampled_rows(hidden: &Tensor, spans: &[ExitSpan]) -> switchyard_models::Result<Tensor> {
    let mut at = 0u32;
    let mut idx = Vec::new();
    for s in spans {
        at += s.n as u32;
        if s.sample {
            idx.push(at - 1);
        }
    }
    let n = idx.len();
    let idx = Tensor::from_vec(idx, n, hidden.device())?;
    Ok(hidden.index_select(&idx, 0)?)
}

/// The model's final norm and LM head at any depth (the final head when `depth` is the model's
/// number of layers).
#[derive(Debug, Clone, Copy, Default)]
pub struct LogitLens;

impl ExitHead for LogitLens {
    fn exit_logits(
        &self,
        model: &LayeredModel,
        hidden: &Tensor,
        _depth: usize,
    ) -> switchyard_models::Result<Tensor> {
        model.logits(hidden)
    }
}
