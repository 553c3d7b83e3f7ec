//! The hyperparameters of a decoder-only transformer, as its weight file states them.
//!
//! Fields a format does not carry (GGUF has no key for Gemma 3's sliding-window pattern or its
//! activation) stay `None`; the architecture code fills them with that architecture's defaults.

use serde::{Deserialize, Serialize};

use crate::gguf::GgufFile;
use crate::{Result, WeightsError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    Llama,
    Qwen2,
    Gemma3,
}

impl Architecture {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "llama" => Ok(Self::Llama),
            "qwen2" => Ok(Self::Qwen2),
            "gemma3" | "gemma3_text" => Ok(Self::Gemma3),
            other => Err(WeightsError::UnsupportedArchitecture(other.to_string())),
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Gemma3 => "gemma3",
        }
    }
}

/// How rotary embeddings pair the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RopeStyle {
    /// Pairs (2i, 2i+1): llama.cpp's "normal" rope; GGUF llama files permute q/k for it.
    Interleaved,
    /// Pairs (i, i + d/2): GPT-NeoX / Hugging Face `rotate_half`.
    HalfSplit,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Activation {
    Silu,
    /// tanh approximation of GELU (`gelu_pytorch_tanh`).
    GeluTanh,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub architecture: Architecture,
    pub name: String,
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_style: RopeStyle,
    /// Rope base of sliding-window layers where it differs (Gemma 3).
    pub rope_theta_local: Option<f64>,
    pub sliding_window: Option<usize>,
    /// Every n-th layer is global, the others use the sliding window (Gemma 3: 6).
    pub sliding_window_pattern: Option<usize>,
    pub activation: Option<Activation>,
    /// Attention logits are scaled by 1/sqrt(this); head_dim when `None`.
    pub query_pre_attn_scalar: Option<f64>,
    pub tied_embeddings: bool,
}

impl ModelSpec {
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let md = file.metadata();
        let arch_name = md.get_str("general.architecture")?;
        let architecture = Architecture::parse(arch_name)?;
        let k = |s: &str| format!("{arch_name}.{s}");
        let n_layers = md.get_usize(&k("block_count"))?;
        let d_model = md.get_usize(&k("embedding_length"))?;
        let n_heads = md.get_usize(&k("attention.head_count"))?;
        let n_kv_heads = md
            .opt_usize(&k("attention.head_count_kv"))?
            .unwrap_or(n_heads);
        let head_dim = match md.opt_usize(&k("attention.key_length"))? {
            Some(h) => h,
            None if n_heads > 0 => d_model / n_heads,
            None => 0,
        };
        let embd =
            file.tensor_info("token_embd.weight")
                .ok_or_else(|| WeightsError::MissingTensor {
                    name: "token_embd.weight".into(),
                    source_desc: file.path().display().to_string(),
                })?;
        let vocab_size = embd.shape[0];
        let rope_style = match architecture {
            Architecture::Llama => RopeStyle::Interleaved,
            Architecture::Qwen2 | Architecture::Gemma3 => RopeStyle::HalfSplit,
        };
        let spec = Self {
            architecture,
            name: md.opt_str("general.name")?.unwrap_or(arch_name).to_string(),
            n_layers,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim: md.get_usize(&k("feed_forward_length"))?,
            vocab_size,
            context_length: md.get_usize(&k("context_length"))?,
            rms_norm_eps: md.get_f64(&k("attention.layer_norm_rms_epsilon"))?,
            rope_theta: md.opt_f64(&k("rope.freq_base"))?.unwrap_or(10_000.0),
            rope_style,
            rope_theta_local: md.opt_f64(&k("rope.local_freq_base"))?,
            sliding_window: md.opt_usize(&k("attention.sliding_window"))?,
            sliding_window_pattern: md.opt_usize(&k("attention.sliding_window_pattern"))?,
            activation: None,
            query_pre_attn_scalar: None,
            tied_embeddings: file.tensor_info("output.weight").is_none(),
        };
        spec.validate()?;
        Ok(spec)
    }

    /// Checks the relations the model code relies on, so a bad file fails here, not mid-forward.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(WeightsError::BadConfig(m));
        if self.n_layers == 0 || self.d_model == 0 || self.n_heads == 0 || self.head_dim == 0 {
            return bad(format!(
                "layers {}, width {}, heads {}, head size {} must all be positive",
                self.n_layers, self.d_model, self.n_heads, self.head_dim
            ));
        }
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "{} query heads are not a multiple of {} key/value heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head size {} must be even for rotary embeddings",
                self.head_dim
            ));
        }
        if self.vocab_size == 0 || self.context_length == 0 || self.ffn_dim == 0 {
            return bad("vocabulary, context length and FFN width must be positive".into());
        }
        Ok(())
    }

    /// Bytes of one K or V row (all key/value heads of one position) in f32.
    pub fn kv_row_len(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}
