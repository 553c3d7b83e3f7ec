//! Tokenizers built from small in-memory GGUF metadata and hand-written Hugging Face files:
//! format handling and error reporting, without model files.

use std::collections::BTreeMap;

use switchyard_tokenizer::{ChatMessage, Tokenizer, TokenizerError};
use switchyard_weights::synthetic::SyntheticSource;
use switchyard_weights::{Architecture, MetaValue, Metadata};

fn strings(items: &[&str]) -> MetaValue {
    MetaValue::Array(
        items
            .iter()
            .map(|s| MetaValue::String(s.to_string()))
            .collect(),
    )
}

/// A SentencePiece vocabulary: <unk> <s> </s>, "▁", "a", "b", "▁a", "ab", "▁ab", then bytes.
fn spm_metadata() -> Metadata {
    let mut tokens = vec!["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab", "▁ab"];
    let bytes: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
    tokens.extend(bytes.iter().map(String::as_str));
    let mut scores = vec![0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0];
    scores.extend(std::iter::repeat_n(0.0, 256));
    let mut types = vec![2, 3, 3, 1, 1, 1, 1, 1, 1];
    types.extend(std::iter::repeat_n(6, 256));
    let mut md = Metadata::new(BTreeMap::new());
    md.insert("tokenizer.ggml.model", MetaValue::String("llama".into()));
    md.insert("tokenizer.ggml.tokens", strings(&tokens));
    md.insert(
        "tokenizer.ggml.scores",
        MetaValue::Array(scores.into_iter().map(MetaValue::F32).collect()),
    );
    md.insert(
        "tokenizer.ggml.token_type",
        MetaValue::Array(types.into_iter().map(MetaValue::I32).collect()),
    );
    md
}

#[test]
fn spm_from_metadata_follows_llama_defaults() {
    let tok = Tokenizer::from_gguf_metadata(&spm_metadata()).expect("valid metadata");
    // llama.cpp defaults for "llama": BOS 1, EOS 2, add BOS, and a space in front of the text.
    assert_eq!(
        (tok.bos_id(), tok.eos_id(), tok.adds_bos()),
        (Some(1), Some(2), true)
    );
    // "▁a" (-4) merges before "ab" (-5), then "▁a" + "b" makes "▁ab".
    assert_eq!(tok.encode("ab", true, true).expect("encodes"), [1, 8]);
    assert_eq!(tok.encode("a", true, true).expect("encodes"), [1, 6]);
    // "c" is not in the vocabulary: byte fallback (0x63 is id 9 + 0x63).
    assert_eq!(
        tok.encode("c", false, true).expect("encodes"),
        [3, 9 + 0x63]
    );
    // Decoding drops the prefix space from the first token, except (as llama.cpp does) after a
    // BOS that skip_special removed.
    assert_eq!(tok.decode(&[8], true).expect("decodes"), "ab");
    assert_eq!(tok.decode(&[1, 8], true).expect("decodes"), " ab");
    assert_eq!(tok.decode(&[1, 8], false).expect("decodes"), "<s> ab");
    for ids in [&[8][..], &[1, 8], &[3, 9 + 0x63, 2]] {
        let mut stream = tok.stream();
        let mut text = String::new();
        for &id in ids {
            text.extend(stream.push(id).expect("known id"));
        }
        text.extend(stream.flush());
        assert_eq!(
            text,
            tok.decode(ids, true).expect("decodes"),
            "stream of {ids:?}"
        );
    }
    assert_eq!(tok.decode(&[3, 9 + 0x63], true).expect("decodes"), "c");
    assert!(tok.is_end_of_generation(2));
}

#[test]
fn metadata_errors_name_the_problem() {
    let mut md = spm_metadata();
    md.insert("tokenizer.ggml.model", MetaValue::String("bert".into()));
    let err = Tokenizer::from_gguf_metadata(&md).expect_err("bert is not supported");
    assert!(matches!(err, TokenizerError::UnsupportedModel { ref model } if model == "bert"));

    let mut md = spm_metadata();
    md.insert("tokenizer.ggml.model", MetaValue::String("gpt2".into()));
    md.insert("tokenizer.ggml.pre", MetaValue::String("made-up".into()));
    md.insert("tokenizer.ggml.merges", strings(&["a b"]));
    let err = Tokenizer::from_gguf_metadata(&md).expect_err("unknown pre-tokenizer");
    assert!(
        matches!(err, TokenizerError::UnsupportedPreTokenizer { ref pre, .. } if pre == "made-up")
    );
    assert!(err.to_string().contains("smollm"), "{err}");

    let mut md = spm_metadata();
    md.insert(
        "tokenizer.ggml.scores",
        MetaValue::Array(vec![MetaValue::F32(0.0)]),
    );
    let err = Tokenizer::from_gguf_metadata(&md).expect_err("too few scores");
    assert!(matches!(
        err,
        TokenizerError::LengthMismatch {
            key: "tokenizer.ggml.scores",
            found: 1,
            expected: 265
        }
    ));

    let err = Tokenizer::from_gguf_metadata(&Metadata::new(BTreeMap::new()))
        .expect_err("no tokenizer keys");
    assert!(err.to_string().contains("tokenizer.ggml.model"), "{err}");
}

#[test]
fn synthetic_sources_have_no_tokenizer() {
    let spec = SyntheticSource::tiny_spec(Architecture::Llama);
    let source = SyntheticSource::new(spec, 0, candle_core::quantized::GgmlDType::F32)
        .expect("tiny synthetic model");
    let err = Tokenizer::from_source(&source).expect_err("synthetic models carry no tokenizer");
    assert!(matches!(err, TokenizerError::NoTokenizer { .. }));
}

/// A Gemma-style `tokenizer.json`: BPE with byte fallback over `▁`-escaped text, written by
/// hand the way Hugging Face's SentencePiece converter lays it out.
const SPM_STYLE_JSON: &str = r#"{
  "version": "1.0",
  "added_tokens": [
    {"id": 0, "content": "<pad>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 1, "content": "<eos>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 2, "content": "<bos>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 3, "content": "<turn>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 4, "content": "\n\n", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": false}
  ],
  "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
  "pre_tokenizer": null,
  "post_processor": null,
  "decoder": {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"}]},
  "model": {
    "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
    "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
    "vocab": {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<turn>": 3, "\n\n": 4, "<0x0A>": 5, "<0x63>": 6,
              "▁": 7, "h": 8, "i": 9, "hi": 10, "▁hi": 11, "\n": 12},
    "merges": [["h", "i"], ["▁", "hi"]]
  }
}"#;

#[test]
fn hf_files_sentencepiece_style_with_config_and_template_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let json = dir.path().join("tokenizer.json");
    let config = dir.path().join("tokenizer_config.json");
    std::fs::write(&json, SPM_STYLE_JSON).expect("writes");
    std::fs::write(
        &config,
        r#"{"bos_token": {"content": "<bos>"}, "eos_token": "<eos>", "add_bos_token": true}"#,
    )
    .expect("writes");
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{{ bos_token }}{% for m in messages %}<turn>{{ m.role }}\n{{ m.content | trim }}\n{% endfor %}",
    )
    .expect("writes");

    let tok = Tokenizer::from_hf_files(&json, Some(&config)).expect("loads");
    assert_eq!(
        (tok.bos_id(), tok.eos_id(), tok.adds_bos()),
        (Some(2), Some(1), true)
    );
    assert_eq!(tok.vocab_size(), 13);
    // "hi hi\n\nc": user-defined "\n\n" is cut out; "c" falls back to its byte; <turn> only
    // becomes a token with parse_special.
    assert_eq!(
        tok.encode("hi hi\n\nc", true, true).expect("encodes"),
        [2, 10, 11, 4, 6]
    );
    assert_eq!(tok.encode("<turn>", false, true).expect("encodes"), [3]);
    assert_eq!(
        tok.decode(&[2, 10, 11, 4, 6], true).expect("decodes"),
        "hi hi\n\nc"
    );
    assert!(tok.is_end_of_generation(1));
    assert_eq!(
        tok.apply_chat_template(&[ChatMessage::new("user", " hi ")], false)
            .expect("renders"),
        "<bos><turn>user\nhi\n"
    );
}

#[test]
fn hf_errors_name_the_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let missing = dir.path().join("tokenizer.json");
    let err = Tokenizer::from_hf_files(&missing, None).expect_err("no file");
    assert!(matches!(err, TokenizerError::Io { ref path, .. } if path == &missing));

    let word_level = dir.path().join("word_level.json");
    std::fs::write(
        &word_level,
        r#"{"version": "1.0", "added_tokens": [], "normalizer": null, "pre_tokenizer": null,
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"a": 0, "[UNK]": 1}, "unk_token": "[UNK]"}}"#,
    )
    .expect("writes");
    let err = Tokenizer::from_hf_files(&word_level, None).expect_err("WordLevel is unsupported");
    assert!(
        matches!(err, TokenizerError::UnsupportedHfModel { ref kind, .. } if kind == "WordLevel")
    );

    let broken = dir.path().join("broken.json");
    std::fs::write(&broken, "{").expect("writes");
    let err = Tokenizer::from_hf_files(&broken, None).expect_err("not JSON");
    assert!(matches!(err, TokenizerError::HfFormat { ref path, .. } if path == &broken));
}
