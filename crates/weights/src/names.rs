//! Canonical tensor names (llama.cpp's GGUF names) and the per-layer tensor set of each
//! architecture, with shapes. Loaders map their own names onto these.

use crate::spec::{Architecture, ModelSpec};

pub const TOKEN_EMBD: &str = "token_embd.weight";
pub const OUTPUT_NORM: &str = "output_norm.weight";
pub const OUTPUT: &str = "output.weight";

/// The name of a per-layer tensor, e.g. `layer(3, "attn_q.weight")` is `blk.3.attn_q.weight`.
pub fn layer(l: usize, suffix: &str) -> String {
    format!("blk.{l}.{suffix}")
}

/// The layer a canonical tensor name belongs to, if any.
pub fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// Per-layer tensors of an architecture with their row-major shapes (outermost first).
pub fn layer_tensors(spec: &ModelSpec) -> Vec<(&'static str, Vec<usize>)> {
    let d = spec.d_model;
    let q = spec.n_heads * spec.head_dim;
    let kv = spec.n_kv_heads * spec.head_dim;
    let f = spec.ffn_dim;
    let mut t = vec![
        ("attn_norm.weight", vec![d]),
        ("attn_q.weight", vec![q, d]),
        ("attn_k.weight", vec![kv, d]),
        ("attn_v.weight", vec![kv, d]),
        ("attn_output.weight", vec![d, q]),
        ("ffn_norm.weight", vec![d]),
        ("ffn_gate.weight", vec![f, d]),
        ("ffn_up.weight", vec![f, d]),
        ("ffn_down.weight", vec![d, f]),
    ];
    match spec.architecture {
        Architecture::Llama => {}
        Architecture::Qwen2 => {
            t.push(("attn_q.bias", vec![q]));
            t.push(("attn_k.bias", vec![kv]));
            t.push(("attn_v.bias", vec![kv]));
        }
        Architecture::Gemma3 => {
            t.push(("attn_q_norm.weight", vec![spec.head_dim]));
            t.push(("attn_k_norm.weight", vec![spec.head_dim]));
            t.push(("post_attention_norm.weight", vec![d]));
            t.push(("post_ffw_norm.weight", vec![d]));
        }
    }
    t
}

/// Maps a Hugging Face transformers tensor name to the canonical one.
pub fn from_hf(arch: Architecture, hf: &str) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some(TOKEN_EMBD.into()),
        "model.norm.weight" => return Some(OUTPUT_NORM.into()),
        "lm_head.weight" => return Some(OUTPUT.into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (idx, tail) = rest.split_once('.')?;
    let l: usize = idx.parse().ok()?;
    let suffix = match (arch, tail) {
        (_, "input_layernorm.weight") => "attn_norm.weight",
        (Architecture::Gemma3, "post_attention_layernorm.weight") => "post_attention_norm.weight",
        (Architecture::Gemma3, "pre_feedforward_layernorm.weight") => "ffn_norm.weight",
        (Architecture::Gemma3, "post_feedforward_layernorm.weight") => "post_ffw_norm.weight",
        (_, "post_attention_layernorm.weight") => "ffn_norm.weight",
        (_, "self_attn.q_proj.weight") => "attn_q.weight",
        (_, "self_attn.k_proj.weight") => "attn_k.weight",
        (_, "self_attn.v_proj.weight") => "attn_v.weight",
        (_, "self_attn.o_proj.weight") => "attn_output.weight",
        (_, "self_attn.q_proj.bias") => "attn_q.bias",
        (_, "self_attn.k_proj.bias") => "attn_k.bias",
        (_, "self_attn.v_proj.bias") => "attn_v.bias",
        (_, "self_attn.q_norm.weight") => "attn_q_norm.weight",
        (_, "self_attn.k_norm.weight") => "attn_k_norm.weight",
        (_, "mlp.gate_proj.weight") => "ffn_gate.weight",
        (_, "mlp.up_proj.weight") => "ffn_up.weight",
        (_, "mlp.down_proj.weight") => "ffn_down.weight",
        _ => return None,
    };
    Some(layer(l, suffix))
}

/// The inverse of [`from_hf`], used when exporting a model as a safetensors folder.
pub fn to_hf(arch: Architecture, canonical: &str) -> Option<String> {
    match canonical {
        TOKEN_EMBD => return Some("model.embed_tokens.weight".into()),
        OUTPUT_NORM => return Some("model.norm.weight".into()),
        OUTPUT => return Some("lm_head.weight".into()),
        _ => {}
    }
    let l = layer_of(canonical)?;
    let suffix = canonical.split_once('.')?.1.split_once('.')?.1;
    let tail = match (arch, suffix) {
        (_, "attn_norm.weight") => "input_layernorm.weight",
        (Architecture::Gemma3, "post_attention_norm.weight") => "post_attention_layernorm.weight",
        (Architecture::Gemma3, "ffn_norm.weight") => "pre_feedforward_layernorm.weight",
        (Architecture::Gemma3, "post_ffw_norm.weight") => "post_feedforward_layernorm.weight",
        (_, "ffn_norm.weight") => "post_attention_layernorm.weight",
        (_, "attn_q.weight") => "self_attn.q_proj.weight",
        (_, "attn_k.weight") => "self_attn.k_proj.weight",
        (_, "attn_v.weight") => "self_attn.v_proj.weight",
        (_, "attn_output.weight") => "self_attn.o_proj.weight",
        (_, "attn_q.bias") => "self_attn.q_proj.bias",
        (_, "attn_k.bias") => "self_attn.k_proj.bias",
        (_, "attn_v.bias") => "self_attn.v_proj.bias",
        (_, "attn_q_norm.weight") => "self_attn.q_norm.weight",
        (_, "attn_k_norm.weight") => "self_attn.k_norm.weight",
        (_, "ffn_gate.weight") => "mlp.gate_proj.weight",
        (_, "ffn_up.weight") => "mlp.up_proj.weight",
        (_, "ffn_down.weight") => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{l}.{tail}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_names_round_trip() {
        for arch in [
            Architecture::Llama,
            Architecture::Qwen2,
            Architecture::Gemma3,
        ] {
            for hf in [
                "model.layers.7.self_attn.q_proj.weight",
                "model.layers.0.post_attention_layernorm.weight",
                "model.layers.12.mlp.down_proj.weight",
                "model.embed_tokens.weight",
            ] {
                let c = from_hf(arch, hf).unwrap();
                assert_eq!(to_hf(arch, &c).unwrap(), hf);
            }
        }
        assert_eq!(
            from_hf(
                Architecture::Gemma3,
                "model.layers.2.post_attention_layernorm.weight"
            )
            .unwrap(),
            "blk.2.post_attention_norm.weight"
        );
        assert_eq!(
            from_hf(
                Architecture::Llama,
                "model.layers.2.post_attention_layernorm.weight"
            )
            .unwrap(),
            "blk.2.ffn_norm.weight"
        );
        assert_eq!(layer_of("blk.17.ffn_up.weight"), Some(17));
        assert_eq!(layer_of("output.weight"), None);
    }
}
