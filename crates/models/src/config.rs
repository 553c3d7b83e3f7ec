//! A [`ModelSpec`] with every architecture default resolved, as the forward pass needs it.

use switchyard_weights::{Activation, ModelSpec};

use crate::attention::AttnShape;

#[derive(Debug, Clone)]
pub struct ArchConfig {
    pub spec: ModelSpec,
    pub activation: Activation,
    /// Multiplies q·k.
    pub attn_scale: f32,
    /// Multiplies the token embeddings (Gemma: sqrt(d_model)).
    pub embed_scale: Option<f32>,
    /// Sliding window and the layers it applies to (`layer % pattern != pattern - 1`).
    pub sliding_window: Option<(usize, usize)>,
    /// Rope base of sliding-window layers.
    pub rope_theta_local: f64,
}

impl ArchConfig {
    pub fn is_sliding(&self, layer: usize) -> bool {
        self.sliding_window
            .is_some_and(|(_, pattern)| pattern > 0 && !(layer + 1).is_multiple_of(pattern))
    }

    pub fn rope_theta(&self, layer: usize) -> f64 {
        if self.is_sliding(layer) {
            self.rope_theta_local
        } else {
            self.spec.rope_theta
        }
    }

    pub fn attn_shape(&self, layer: usize) -> AttnShape {
        AttnShape {
            n_heads: self.spec.n_heads,
            n_kv_heads: self.spec.n_kv_heads,
            head_dim: self.spec.head_dim,
            scale: self.attn_scale,
            window: self
                .sliding_window
                .filter(|_| self.is_sliding(layer))
                .map(|(w, _)| w),
        }
    }

    /// Distinct rope bases used by any layer.
    pub fn rope_thetas(&self) -> Vec<f64> {
        let mut t = vec![self.spec.rope_theta];
        if self.sliding_window.is_some() && self.rope_theta_local != self.spec.rope_theta {
            t.push(self.rope_theta_local);
        }
        t
    }
}
