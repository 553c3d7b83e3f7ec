//! Gemma 3: sandwich norms around attention and MLP, per-head q/k RMSNorm, GELU (tanh) MLP,
//! embeddings scaled by sqrt(d_model), and five sliding-window layers (rope base 10k) for
//! every global one (the file's rope base).

use candle_core::Tensor;
use switchyard_weights::{names, Activation, ModelSpec};

use crate::block::{residual, Block, GatedMlp, LayerCtx, RmsNorm, SelfAttention, TensorLoader};
use crate::config::ArchConfig;
use crate::Result;

/// Every 6th layer attends globally (Gemma 3 technical report; llama.cpp's swa pattern).
pub const SLIDING_WINDOW_PATTERN: usize = 6;
/// Rope base of the sliding-window layers (Hugging Face `rope_local_base_freq`).
pub const ROPE_THETA_LOCAL: f64 = 10_000.0;
/// Used when a file states no window (Gemma 3 270M/1B config).
pub const DEFAULT_SLIDING_WINDOW: usize = 512;

pub fn config(spec: &ModelSpec) -> ArchConfig {
    let scalar = spec.query_pre_attn_scalar.unwrap_or(spec.head_dim as f64);
    ArchConfig {
        spec: spec.clone(),
        activation: spec.activation.unwrap_or(Activation::GeluTanh),
        attn_scale: (1.0 / scalar.sqrt()) as f32,
        embed_scale: Some((spec.d_model as f32).sqrt()),
        sliding_window: Some((
            spec.sliding_window.unwrap_or(DEFAULT_SLIDING_WINDOW),
            spec.sliding_window_pattern
                .unwrap_or(SLIDING_WINDOW_PATTERN),
        )),
        rope_theta_local: spec.rope_theta_local.unwrap_or(ROPE_THETA_LOCAL),
    }
}

#[derive(Debug)]
pub struct Gemma3Block {
    attn_norm: RmsNorm,
    attn: SelfAttention,
    post_attn_norm: RmsNorm,
    ffn_norm: RmsNorm,
    mlp: GatedMlp,
    post_ffn_norm: RmsNorm,
}

impl Gemma3Block {
    pub fn load(ld: &TensorLoader<'_>, cfg: &ArchConfig, l: usize) -> Result<Self> {
        let norm = |s: &str| ld.norm(&names::layer(l, s));
        Ok(Self {
            attn_norm: norm("attn_norm.weight")?,
            attn: SelfAttention::load(ld, l, true)?,
            post_attn_norm: norm("post_attention_norm.weight")?,
            ffn_norm: norm("ffn_norm.weight")?,
            mlp: GatedMlp::load(ld, l, cfg.activation)?,
            post_ffn_norm: norm("post_ffw_norm.weight")?,
        })
    }
}

impl Block for Gemma3Block {
    fn forward(&self, x: &Tensor, ctx: &mut LayerCtx<'_, '_>) -> Result<Tensor> {
        let h = self.attn.forward(&self.attn_norm.forward(x)?, ctx)?;
        let x = residual(x, &self.post_attn_norm.forward(&h)?)?;
        let h = self.mlp.forward(&self.ffn_norm.forward(&x)?)?;
        residual(&x, &self.post_ffn_norm.forward(&h)?)
    }

    fn write_kv(&self, x: &Tensor, ctx: &mut LayerCtx<'_, '_>) -> Result<()> {
        self.attn.write_kv(&self.attn_norm.forward(x)?, ctx)
    }

    fn resident_bytes(&self) -> usize {
        self.attn_norm.bytes()
            + self.attn.bytes()
            + self.post_attn_norm.bytes()
            + self.ffn_norm.bytes()
            + self.mlp.bytes()
            + self.post_ffn_norm.bytes()
    }
}
