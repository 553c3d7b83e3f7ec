//! [`ExitHead`]: how the hidden state leaving the model after layer `depth` becomes logits.
//!
//! The engine runs every sequence of a step through the same layers `0..depth` (fixed-depth
//! batched exit, HELIOS: no per-token depth synchronisation) and sends the rows it samples
//! through one exit head. The default is the model's own final norm and LM head applied at
//! `depth` (the "logit lens"), which at full depth is the model's plain output; calibrated or
//! trained heads per exit layer plug in behind the same seam.

use candle_core::Tensor;
use switchyard_models::LayeredModel;

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

    /// Why these heads cannot be served by the batching engine, if they cannot: a head that
    /// attends over its sequence needs K/V per sequence, which this seam does not carry.
    fn unservable(&self) -> Option<String> {
        None
    }
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
