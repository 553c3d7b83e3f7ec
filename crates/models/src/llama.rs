//! Llama (SmolLM2) and Qwen2 (Qwen2.5): pre-norm blocks, SwiGLU MLP. Qwen2 differs only by
//! biases on q/k/v (loaded when the file has them) and half-split rope (a file-layout fact).

use candle_core::Tensor;
use switchyard_weights::{names, Activation, ModelSpec};

use crate::block::{residual, Block, GatedMlp, LayerCtx, RmsNorm, SelfAttention, TensorLoader};
use crate::config::ArchConfig;
use crate::Result;

pub fn config(spec: &ModelSpec) -> ArchConfig {
    ArchConfig {
        spec: spec.clone(),
        activation: spec.activation.unwrap_or(Activation::Silu),
        attn_scale: 1.0 / (spec.head_dim as f32).sqrt(),
        embed_scale: None,
        sliding_window: None,
        rope_theta_local: spec.rope_theta,
    }
}

#[derive(Debug)]
pub struct LlamaBlock {
    attn_norm: RmsNorm,
    attn: SelfAttention,
    ffn_norm: RmsNorm,
    mlp: GatedMlp,
}

impl LlamaBlock {
    pub fn load(ld: &TensorLoader<'_>, cfg: &ArchConfig, l: usize) -> Result<Self> {
        Ok(Self {
            attn_norm: ld.norm(&names::layer(l, "attn_norm.weight"))?,
            attn: SelfAttention::load(ld, l, false)?,
            ffn_norm: ld.norm(&names::layer(l, "ffn_norm.weight"))?,
            mlp: GatedMlp::load(ld, l, cfg.activation)?,
        })
    }
}

impl Block for LlamaBlock {
    fn forward(&self, x: &Tensor, ctx: &mut LayerCtx<'_, '_>) -> Result<Tensor> {
        let h = self.attn.forward(&self.attn_norm.forward(x)?, ctx)?;
        let x = residual(x, &h)?;
        let h = self.mlp.forward(&self.ffn_norm.forward(&x)?)?;
        residual(&x, &h)
    }

    fn write_kv(&self, x: &Tensor, ctx: &mut LayerCtx<'_, '_>) -> Result<()> {
        self.attn.write_kv(&self.attn_norm.forward(x)?, ctx)
    }

    fn resident_bytes(&self) -> usize {
        self.attn_norm.bytes() + self.attn.bytes() + self.ffn_norm.bytes() + self.mlp.bytes()
    }
}
