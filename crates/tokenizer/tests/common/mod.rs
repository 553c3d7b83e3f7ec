//! Shared helpers for the tokenizer tests: model files, and checks every model runs.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::path::PathBuf;

use switchyard_tokenizer::{ChatMessage, Tokenizer};

/// Path of a zoo model's GGUF file, fetched into the cache when missing.
pub fn model_path(name: &str) -> PathBuf {
    switchyard_zoo::ensure(name).unwrap_or_else(|e| panic!("cannot fetch test model {name}: {e}"))
}

pub fn load_tokenizer(name: &str) -> Tokenizer {
    let path = model_path(name);
    let source = switchyard_weights::open(&path)
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
    Tokenizer::from_source(source.as_ref())
        .unwrap_or_else(|e| panic!("cannot build the tokenizer of {name}: {e}"))
}

/// `cases` encode to llama.cpp's ids with special tokens parsed, `as_text` with them left as
/// text; both decode back to their input.
pub fn assert_cases(tok: &Tokenizer, cases: &[(&str, &[u32])], as_text: &[(&str, &[u32])]) {
    for &(text, want) in cases {
        let ids = tok.encode(text, false, true).expect("encodes");
        assert_eq!(ids, want, "ids of {text:?} (parse_special = true)");
        let back = tok.decode(&ids, false).expect("decodes");
        assert_eq!(back, text, "decode(encode({text:?}))");
    }
    for &(text, want) in as_text {
        let ids = tok.encode(text, false, false).expect("encodes");
        assert_eq!(ids, want, "ids of {text:?} (parse_special = false)");
        let back = tok.decode(&ids, true).expect("decodes");
        assert_eq!(back, text, "decode(encode({text:?}))");
    }
}

/// Streams `ids` one at a time; returns the text and how many pushes held bytes back.
pub fn stream(tok: &Tokenizer, ids: &[u32]) -> (String, usize) {
    let mut decoder = tok.stream();
    let mut text = String::new();
    let mut held = 0;
    for &id in ids {
        match decoder.push(id).expect("known id") {
            Some(piece) => text.push_str(&piece),
            None => held += 1,
        }
    }
    if let Some(rest) = decoder.flush() {
        text.push_str(&rest);
    }
    (text, held)
}

pub fn end_of_generation_ids(tok: &Tokenizer) -> BTreeSet<u32> {
    (0..tok.vocab_size() as u32)
        .filter(|&id| tok.is_end_of_generation(id))
        .collect()
}

/// `save_hf` then `from_hf_files` gives a tokenizer that behaves the same on the cases.
pub fn assert_hf_round_trip(tok: &Tokenizer, cases: &[(&str, &[u32])], as_text: &[(&str, &[u32])]) {
    let dir = tempfile::tempdir().expect("temp dir");
    tok.save_hf(dir.path()).expect("saves");
    let back = Tokenizer::from_hf_files(
        &dir.path().join("tokenizer.json"),
        Some(&dir.path().join("tokenizer_config.json")),
    )
    .expect("loads what it saved");
    assert_cases(&back, cases, as_text);
    assert_eq!(back.vocab_size(), tok.vocab_size());
    assert_eq!(back.bos_id(), tok.bos_id());
    assert_eq!(back.eos_id(), tok.eos_id());
    assert_eq!(back.adds_bos(), tok.adds_bos());
    assert_eq!(back.chat_template(), tok.chat_template());
    assert_eq!(end_of_generation_ids(&back), end_of_generation_ids(tok));
    assert_eq!(
        back.encode("Hello world", true, true).expect("encodes"),
        tok.encode("Hello world", true, true).expect("encodes")
    );
    // The file is a regular `tokenizers` file, usable outside this crate.
    let plain = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json"))
        .expect("tokenizers reads it");
    assert_eq!(plain.get_vocab_size(true), tok.vocab_size());
}

/// The conversation the chat-template references were rendered from (jinja2, HF settings).
pub fn conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", "Hi! Say café 👋"),
        ChatMessage::new("assistant", "Hello."),
        ChatMessage::new("user", "  What is 2+2?\n"),
    ]
}

/// Emoji (with skin tone and ZWJ sequences) and CJK, ending with a rare ideograph and emoji that
/// even Gemma's vocabulary spells byte by byte.
pub const STREAM_TEXT: &str = "👋🏽 hi 🚀 你好，世界 👨\u{200d}👩\u{200d}👧 naïve ❤\u{fe0f} 𪚥🦩";

/// The most messages a 1 MiB request body can hold (`{"role":"user","content":""},` is 29
/// bytes): the chat template's fuel must cover them.
pub const MESSAGES_IN_ONE_MIB: usize = (1 << 20) / 29;

/// A conversation of [`MESSAGES_IN_ONE_MIB`] alternating turns renders within the template's
/// limits, with one `<|im_start|>` per message.
pub fn assert_the_longest_conversation_renders(tok: &Tokenizer) {
    let messages: Vec<ChatMessage> = (0..MESSAGES_IN_ONE_MIB)
        .map(|i| ChatMessage::new(if i % 2 == 0 { "user" } else { "assistant" }, "x"))
        .collect();
    let t0 = std::time::Instant::now();
    let text = tok
        .apply_chat_template(&messages, true)
        .expect("the longest conversation renders");
    assert!(
        text.matches("<|im_start|>").count() > MESSAGES_IN_ONE_MIB,
        "{} bytes",
        text.len()
    );
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        t0.elapsed()
    );
}
