//! The Hugging Face safetensors weight source on real models: each zoo GGUF model, exported as a
//! safetensors folder (f32 tensors in Hugging Face's layout, `config.json`, tokenizer files),
//! opens with the same spec, gives the same logits and tokenizes the same as the GGUF file.
//! Also the folder errors users meet: an unsupported `model_type` and a cut-off tensor.
//!
//! The export holds the GGUF's dequantized values exactly, and `WeightFormat::F32` runs both
//! models on those values, so what is compared is the format handling: llama's q/k row
//! permutation (interleaved rope in GGUF, rotate-half in Hugging Face), Gemma's `w` for `1 + w`
//! norms, Qwen2's q/k/v biases, tied embeddings and the config keys.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::sync::{Arc, Mutex};

use candle_core::Device;
use switchyard_models::{DenseKv, ForwardBatch, LayeredModel, LoadOptions, WeightFormat};
use switchyard_tokenizer::{ChatMessage, Tokenizer};
use switchyard_weights::{names, Architecture, ModelSpec, RopeStyle, WeightSource, WeightsError};

use crate::common::{argmax, error_of_range, fixed_tokens, model_path};

const N_TOKENS: usize = 32;
/// max |folder - GGUF| over each position's logits, as a share of that position's logit range.
/// Both run f32 GEMMs on identical weight values; only the order of rope arithmetic and Gemma's
/// `(1 + w) - 1 + 1` norm round trip differ (measured: smollm2 2.5e-6, gemma3 and qwen2 0).
const LOGIT_TOLERANCE: f32 = 1e-4;
/// Texts both tokenizers must split identically (with BOS as the model adds it, specials parsed).
const TOKENIZER_TEXTS: &[&str] = &[
    "Hello, world!",
    "fn main() {\n    println!(\"x = {}\", 42);\n}",
    "  two leading spaces,\ttabs and 12345 digits",
    "café naïve — 日本語 🙂",
];

/// The real-model tests each hold a few GB (the export, then one model at a time); run them one
/// after another rather than all at once.
static ONE_MODEL_AT_A_TIME: Mutex<()> = Mutex::new(());

fn f32_logits(source: Arc<dyn WeightSource>, tokens: &[u32]) -> Vec<Vec<f32>> {
    let opts = LoadOptions {
        format: WeightFormat::F32,
        ..Default::default()
    };
    let m = LayeredModel::load(source, &opts).expect("model loads");
    let mut kv = DenseKv::new(m.n_layers(), m.spec().kv_row_len());
    let mut batch = ForwardBatch::single(&mut kv, 0, tokens.len());
    m.forward(tokens, &mut batch)
        .expect("forward")
        .to_vec2()
        .expect("logits to host")
}

/// The ids of each probe text and, when the model has a chat template, of a rendered prompt.
fn probe_ids(tok: &Tokenizer) -> Vec<Vec<u32>> {
    let chat = [
        ChatMessage::new("user", "What is 2 + 2?"),
        ChatMessage::new("assistant", "4."),
        ChatMessage::new("user", "And 3 + 3?"),
    ];
    let prompt = tok.chat_template().map(|_| {
        tok.apply_chat_template(&chat, true)
            .expect("chat template renders")
    });
    TOKENIZER_TEXTS
        .iter()
        .copied()
        .chain(prompt.as_deref())
        .map(|t| tok.encode(t, true, true).expect("encodes"))
        .collect()
}

/// A tensor as the exported file stores it, read from the bytes without any weight source:
/// (shape, values).
fn stored_f32(file: &Path, hf_name: &str) -> (Vec<usize>, Vec<f32>) {
    let mut f = File::open(file).expect("open model.safetensors");
    let mut len = [0u8; 8];
    f.read_exact(&mut len).expect("header length");
    let header_len = u64::from_le_bytes(len);
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header).expect("header");
    let header: serde_json::Value = serde_json::from_slice(&header).expect("header is JSON");
    let info = &header[hf_name];
    assert_eq!(info["dtype"], "F32", "{hf_name}");
    let shape = info["shape"]
        .as_array()
        .expect("shape")
        .iter()
        .map(|d| d.as_u64().expect("dimension") as usize)
        .collect();
    let offset = |i: usize| info["data_offsets"][i].as_u64().expect("data offset");
    let mut bytes = vec![0u8; (offset(1) - offset(0)) as usize];
    f.seek(SeekFrom::Start(8 + header_len + offset(0)))
        .expect("seek");
    f.read_exact(&mut bytes).expect("tensor data");
    let values = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (shape, values)
}

fn gguf_f32(gguf: &dyn WeightSource, name: &str) -> Vec<f32> {
    gguf.load(name, &Device::Cpu)
        .and_then(|t| Ok(t.dequantize(&Device::Cpu)?))
        .expect("GGUF tensor loads")
        .flatten_all()
        .and_then(|t| t.to_vec1())
        .expect("GGUF tensor to host")
}

/// The folder holds Hugging Face's layout, not the GGUF's: checked on layer 0's stored bytes
/// against the GGUF values, so that an export and a loader both skipping a conversion cannot
/// agree with each other by accident.
fn check_hugging_face_layout(gguf: &dyn WeightSource, file: &Path) {
    let spec = gguf.spec();
    match spec.architecture {
        Architecture::Llama => {
            // GGUF orders each head's rows (pair, half); Hugging Face orders them (half, pair).
            let hd = spec.head_dim;
            for (hf, canonical, heads) in [
                (
                    "model.layers.0.self_attn.q_proj.weight",
                    "blk.0.attn_q.weight",
                    spec.n_heads,
                ),
                (
                    "model.layers.0.self_attn.k_proj.weight",
                    "blk.0.attn_k.weight",
                    spec.n_kv_heads,
                ),
            ] {
                let (shape, stored) = stored_f32(file, hf);
                assert_eq!(shape, [heads * hd, spec.d_model], "{hf}");
                let g = gguf_f32(gguf, canonical);
                let d = spec.d_model;
                for h in 0..heads {
                    for half in 0..2 {
                        for pair in 0..hd / 2 {
                            let hf_row = h * hd + half * hd / 2 + pair;
                            let gguf_row = h * hd + 2 * pair + half;
                            assert_eq!(
                                stored[hf_row * d..(hf_row + 1) * d],
                                g[gguf_row * d..(gguf_row + 1) * d],
                                "{hf} row {hf_row}"
                            );
                        }
                    }
                }
                assert_ne!(stored, g, "{hf} must not be in GGUF order");
            }
        }
        Architecture::Gemma3 => {
            // GGUF holds the RMSNorm scale 1 + w; Hugging Face holds w.
            for (hf, canonical) in [
                ("model.norm.weight", "output_norm.weight"),
                (
                    "model.layers.0.input_layernorm.weight",
                    "blk.0.attn_norm.weight",
                ),
                (
                    "model.layers.0.post_attention_layernorm.weight",
                    "blk.0.post_attention_norm.weight",
                ),
                (
                    "model.layers.0.pre_feedforward_layernorm.weight",
                    "blk.0.ffn_norm.weight",
                ),
                (
                    "model.layers.0.post_feedforward_layernorm.weight",
                    "blk.0.post_ffw_norm.weight",
                ),
                (
                    "model.layers.0.self_attn.q_norm.weight",
                    "blk.0.attn_q_norm.weight",
                ),
                (
                    "model.layers.0.self_attn.k_norm.weight",
                    "blk.0.attn_k_norm.weight",
                ),
            ] {
                let (_, stored) = stored_f32(file, hf);
                let want: Vec<f32> = gguf_f32(gguf, canonical).iter().map(|v| v - 1.0).collect();
                assert_eq!(stored, want, "{hf}");
            }
        }
        Architecture::Qwen2 => {
            // Rotate-half rope in both formats: q/k and their biases are copied unchanged.
            for (hf, canonical) in [
                (
                    "model.layers.0.self_attn.q_proj.weight",
                    "blk.0.attn_q.weight",
                ),
                ("model.layers.0.self_attn.q_proj.bias", "blk.0.attn_q.bias"),
                ("model.layers.0.self_attn.k_proj.bias", "blk.0.attn_k.bias"),
                ("model.layers.0.self_attn.v_proj.bias", "blk.0.attn_v.bias"),
            ] {
                let (_, stored) = stored_f32(file, hf);
                assert_eq!(stored, gguf_f32(gguf, canonical), "{hf}");
            }
        }
    }
}

/// Exports `model` as a folder and checks spec, tensors, tokenizer and logits against the GGUF.
fn folder_matches_gguf(model: &str) {
    let _one = ONE_MODEL_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let gguf = switchyard_weights::open(model_path(model)).expect("GGUF opens");
    let dir = tempfile::tempdir().expect("tempdir");
    switchyard_weights::safetensors_dir::export(&*gguf, dir.path()).expect("export");
    let gguf_tok = Tokenizer::from_source(&*gguf).expect("GGUF tokenizer");
    gguf_tok.save_hf(dir.path()).expect("save tokenizer");
    let folder = switchyard_weights::open(dir.path()).expect("folder opens");

    // Spec: the same model, except for the name (the folder's) and, for llama, the rope pairing
    // (the export undoes GGUF's q/k permutation).
    let g = gguf.spec().clone();
    let folder_name = dir
        .path()
        .file_name()
        .expect("tempdir has a name")
        .to_string_lossy()
        .into_owned();
    let expected = ModelSpec {
        name: folder_name,
        rope_style: RopeStyle::HalfSplit,
        ..g.clone()
    };
    assert_eq!(folder.spec(), &expected);
    assert_eq!(
        g.rope_style,
        match g.architecture {
            Architecture::Llama => RopeStyle::Interleaved,
            _ => RopeStyle::HalfSplit,
        }
    );

    // Every canonical tensor is there, with the GGUF's shape, as f32.
    let mut tensor_names = vec![names::TOKEN_EMBD.to_string(), names::OUTPUT_NORM.into()];
    for l in 0..g.n_layers {
        for (suffix, shape) in names::layer_tensors(&g) {
            let name = names::layer(l, suffix);
            let meta = gguf.tensor_meta(&name).expect("GGUF has the layer tensor");
            assert_eq!(meta.shape, shape, "{name} in the GGUF");
            tensor_names.push(name);
        }
    }
    for name in &tensor_names {
        let want = gguf.tensor_meta(name).expect("GGUF has the tensor");
        let got = folder.tensor_meta(name).expect("folder has the tensor");
        assert_eq!(got.shape, want.shape, "{name}");
        assert_eq!(got.dtype, candle_core::quantized::GgmlDType::F32, "{name}");
        assert_eq!(
            got.n_bytes,
            4 * want.shape.iter().product::<usize>(),
            "{name}"
        );
    }
    assert_eq!(
        folder.tensor_meta(names::OUTPUT).is_some(),
        !g.tied_embeddings
    );

    // Tokenizer: the folder's tokenizer.json gives the GGUF tokenizer's ids.
    let folder_tok = Tokenizer::from_source(&*folder).expect("folder tokenizer");
    assert_eq!(folder_tok.vocab_size(), gguf_tok.vocab_size());
    assert_eq!(
        (
            folder_tok.bos_id(),
            folder_tok.eos_id(),
            folder_tok.adds_bos()
        ),
        (gguf_tok.bos_id(), gguf_tok.eos_id(), gguf_tok.adds_bos())
    );
    assert_eq!(folder_tok.chat_template(), gguf_tok.chat_template());
    let want_ids = probe_ids(&gguf_tok);
    assert!(want_ids.iter().all(|ids| ids.len() > 3), "{want_ids:?}");
    assert_eq!(probe_ids(&folder_tok), want_ids);

    check_hugging_face_layout(&*gguf, &dir.path().join("model.safetensors"));

    // Logits: the folder model first, then the folder is deleted before the GGUF model loads.
    let tokens = fixed_tokens(N_TOKENS);
    let from_folder = f32_logits(folder, &tokens);
    dir.close().expect("remove the export");
    let from_gguf = f32_logits(gguf, &tokens);
    assert_eq!(from_folder.len(), N_TOKENS);
    let mut worst = 0f32;
    for (pos, (got, want)) in from_folder.iter().zip(&from_gguf).enumerate() {
        assert_eq!(got.len(), g.vocab_size, "position {pos}");
        let err = error_of_range(got, want);
        worst = worst.max(err);
        assert!(
            err <= LOGIT_TOLERANCE,
            "{model} position {pos}: error {err:e} of the range"
        );
        assert_eq!(argmax(got), argmax(want), "{model} position {pos}");
    }
    eprintln!("{model}: worst logit error {worst:e} of the range over {N_TOKENS} positions");
}

/// Llama: GGUF permutes q/k rows for interleaved rope; the folder is in rotate-half order.
#[test]
fn smollm2_folder_matches_gguf() {
    folder_matches_gguf("smollm2-135m-instruct");
}

/// Gemma 3: the folder stores norm weights as `w` for a scale of `1 + w`.
#[test]
fn gemma3_folder_matches_gguf() {
    folder_matches_gguf("gemma3-270m");
}

/// Qwen2: q/k/v biases and tied embeddings (about 2 GB of f32 on disk while it runs).
#[test]
fn qwen2_folder_matches_gguf() {
    folder_matches_gguf("qwen2.5-coder-0.5b-instruct");
}

/// A small llama `config.json` (4 layers of width 8) for the hand-built folders below.
fn write_config(dir: &Path, model_type: &str) {
    let config = format!(
        r#"{{
  "model_type": "{model_type}",
  "hidden_size": 8,
  "num_hidden_layers": 4,
  "num_attention_heads": 2,
  "num_key_value_heads": 1,
  "intermediate_size": 16,
  "vocab_size": 16,
  "max_position_embeddings": 64
}}"#
    );
    std::fs::write(dir.join("config.json"), config).expect("write config.json");
}

/// A safetensors file of f32 tensors whose header claims `tensors` (name, shape) back to back,
/// followed by only `data_bytes` bytes of data.
fn write_safetensors(path: &Path, tensors: &[(&str, &[usize])], data_bytes: usize) {
    let mut entries = Vec::new();
    let mut offset = 0;
    for (name, shape) in tensors {
        let n = 4 * shape.iter().product::<usize>();
        entries.push(format!(
            r#""{name}":{{"dtype":"F32","shape":{shape:?},"data_offsets":[{offset},{}]}}"#,
            offset + n
        ));
        offset += n;
    }
    let mut header = format!("{{{}}}", entries.join(","));
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend((0..data_bytes).map(|i| (i % 251) as u8));
    std::fs::write(path, bytes).expect("write safetensors");
}

#[test]
fn unsupported_model_type_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_config(dir.path(), "mamba");
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &[("model.embed_tokens.weight", &[16, 8])],
        16 * 8 * 4,
    );
    let err = switchyard_weights::open(dir.path()).expect_err("mamba is refused");
    assert_eq!(
        err.to_string(),
        "architecture \"mamba\" is not supported (llama, qwen2 and gemma3 are)"
    );
    assert!(
        matches!(&err, WeightsError::UnsupportedArchitecture(a) if a == "mamba"),
        "{err:?}"
    );
}

/// A file cut short inside its last tensor: the error names that tensor and says its data lies
/// past the end of the file.
#[test]
fn tensor_past_the_end_of_its_file_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_config(dir.path(), "llama");
    let path = dir.path().join("model.safetensors");
    // 512 bytes of embedding, then a 32-byte norm.
    let tensors: &[(&str, &[usize])] = &[
        ("model.embed_tokens.weight", &[16, 8]),
        ("model.norm.weight", &[8]),
    ];
    // Whole, the folder opens (open reads the header and config, not the layers), so the cut
    // below is the only problem.
    write_safetensors(&path, tensors, 512 + 32);
    let whole = switchyard_weights::open(dir.path()).expect("the whole file opens");
    assert_eq!(
        whole.tensor_meta(names::OUTPUT_NORM).map(|m| m.n_bytes),
        Some(32)
    );
    drop(whole);
    // Only 20 of the norm's 32 bytes are present.
    write_safetensors(&path, tensors, 512 + 20);
    let err = switchyard_weights::open(dir.path())
        .expect_err("cut file is refused")
        .to_string();
    assert!(
        err.starts_with(&path.display().to_string()),
        "names the file: {err}"
    );
    assert!(err.contains("model.norm.weight"), "names the tensor: {err}");
    assert!(err.contains("past the end"), "says what is wrong: {err}");
}
