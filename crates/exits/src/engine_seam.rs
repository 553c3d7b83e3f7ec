//! Calibrated heads behind the engine's exit seam ([`switchyard_engine::ExitHead`]), so the
//! serving scheduler's fixed-depth exit can use them in place of the logit lens.

use candle_core::Tensor;
use switchyard_models::{LayeredModel, ModelError};

use crate::heads::ExitHeads;

impl switchyard_engine::ExitHead for ExitHeads {
    fn exit_logits(
        &self,
        model: &LayeredModel,
        hidden: &Tensor,
        depth: usize,
    ) -> switchyard_models::Result<Tensor> {
        self.logits(model, depth, hidden).map_err(|e| match e {
            crate::ExitsError::Model(m) => m,
            crate::ExitsError::Candle(c) => ModelError::Candle(c),
            // A depth without a head: the engine asked for an exit these heads do not have.
            other => ModelError::Candle(candle_core::Error::Msg(other.to_string())),
        })
    }

    fn resident_bytes(&self) -> usize {
        self.iter().map(|(_, h)| h.bytes()).sum()
    }

    fn unservable(&self) -> Option<String> {
        let blocks = self.sequential_depths();
        (!blocks.is_empty()).then(|| {
            format!(
                "the exit heads at depths {blocks:?} are block heads, which keep K/V per \
                 sequence; the batching engine's exit seam maps rows one by one and cannot \
                 serve them (per-token early exit and self-speculative decoding can)"
            )
        })
    }
}
