//! Qwen2.5-Coder-0.5B-Instruct: byte-level BPE with llama.cpp's `qwen2` pre-tokenizer.
//! Expected ids were produced once with llama.cpp (llama-cpp-python 0.3.36, `vocab_only`); chat
//! references with jinja2 3.1.6 under Hugging Face's settings (`trim_blocks`, `lstrip_blocks`).

use crate::common;

use std::sync::OnceLock;

use switchyard_tokenizer::Tokenizer;

use crate::common::*;

const MODEL: &str = "qwen2.5-coder-0.5b-instruct";

fn tok() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| load_tokenizer(MODEL))
}

/// `(text, llama.cpp ids)`, tokenized with `parse_special = true` and no BOS.
#[rustfmt::skip]
const CASES: &[(&str, &[u32])] = &[
    ("12345678", &[16, 17, 18, 19, 20, 21, 22, 23]),
    ("3.14159", &[18, 13, 16, 19, 16, 20, 24]),
    ("a  b   c", &[64, 220, 293, 256, 272]),
    ("\t\tx\n\n\ny", &[197, 10225, 1406, 88]),
    ("   leading", &[256, 6388]),
    ("trailing   ", &[376, 14277, 262]),
    ("café naïve résumé", &[924, 58858, 94880, 586, 9333, 1242, 963]),
    ("你好，世界", &[108386, 3837, 99489]),
    ("👋🏽 hi 🚀", &[145707, 145375, 15588, 11162, 248, 222]),
    ("fn main() {\n    println!(\"x\");\n}", &[8822, 1887, 368, 341, 262, 13751, 17223, 87, 797, 92]),
    ("I'm don't WE'LL", &[40, 2776, 1513, 944, 19677, 6, 4086]),
    ("The quick brown fox jumps over the lazy dog. It wasn't the first time: in 1999, 42 foxes (and one very confused badger) did exactly the same thing, and nobody's been able to explain why since. \"Remarkable,\" said Dr. O'Neil -- twice!", &[785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13, 1084, 5710, 944, 279, 1156, 882, 25, 304, 220, 16, 24, 24, 24, 11, 220, 19, 17, 38835, 288, 320, 437, 825, 1602, 21815, 3873, 1389, 8, 1521, 6896, 279, 1852, 3166, 11, 323, 18581, 594, 1012, 2952, 311, 10339, 3170, 2474, 13, 330, 48845, 480, 1335, 1053, 2926, 13, 506, 6, 61940, 1177, 10917, 0]),
    ("", &[]),
    ("Hello world", &[9707, 1879]),
    ("안녕하세요 мир नमस\u{94d}त\u{947} مرحبا", &[126246, 144370, 91145, 137144, 14925, 101, 87244, 78368, 30484, 97, 34370, 23364, 126860, 124671]),
    ("x=1;y=2 // 100% sure?!", &[87, 28, 16, 70863, 28, 17, 442, 220, 16, 15, 15, 4, 2704, 25984]),
    ("line1\r\nline2\r\n", &[1056, 16, 319, 1056, 17, 319]),
    ("e\u{301} vs é, \u{a0}nbsp\u{3000}ideographic", &[68, 53839, 6165, 3958, 11, 220, 4102, 5674, 22441, 94007]),
    ("👨\u{200d}👩\u{200d}👧 family ❤\u{fe0f} 🇫🇷", &[145367, 378, 235, 145233, 378, 235, 145665, 2997, 70470, 30543, 11162, 229, 104, 145070]),
    ("<|im_start|>user\nhi<|im_end|>", &[151644, 872, 198, 6023, 151645]),
    ("<|im_start|>system\nYou are nice.<|im_end|>\n<|im_start|>assistant\n", &[151644, 8948, 198, 2610, 525, 6419, 13, 151645, 198, 151644, 77091, 198]),
    ("<|endoftext|><|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>", &[151643, 151659, 64, 151661, 65, 151660]),
];

/// The special-token strings of [`CASES`] with `parse_special = false`: plain text.
#[rustfmt::skip]
const AS_TEXT: &[(&str, &[u32])] = &[
    ("<|im_start|>user\nhi<|im_end|>", &[27, 91, 318, 4906, 91, 29, 872, 198, 6023, 27, 91, 318, 6213, 91, 29]),
    ("<|im_start|>system\nYou are nice.<|im_end|>\n<|im_start|>assistant\n", &[27, 91, 318, 4906, 91, 29, 8948, 198, 2610, 525, 6419, 15757, 91, 318, 6213, 91, 397, 27, 91, 318, 4906, 91, 29, 77091, 198]),
    ("<|endoftext|><|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>", &[27, 91, 8691, 723, 427, 91, 1784, 91, 69, 318, 13974, 91, 29, 64, 27, 91, 69, 318, 37151, 91, 29, 65, 27, 91, 69, 318, 62580, 91, 29]),
];

#[test]
fn ids_match_llama_cpp_and_decode_back() {
    assert!(CASES.len() >= 12);
    assert_cases(tok(), CASES, AS_TEXT);
}

#[test]
fn special_tokens_and_bos() {
    let t = tok();
    // The GGUF pads the vocabulary to the embedding size with unused `[PAD…]` tokens.
    assert_eq!(t.vocab_size(), 151936);
    assert_eq!(
        (t.bos_id(), t.eos_id(), t.adds_bos()),
        (Some(151643), Some(151645), false)
    );
    assert_eq!(
        t.encode("Hello world", true, true).expect("encodes"),
        [9707, 1879]
    );
    // llama.cpp's set: </s> (a normal token llama.cpp promotes), <|endoftext|>, <|im_end|>,
    // <|fim_pad|>, <|repo_name|>, <|file_sep|>.
    assert_eq!(
        end_of_generation_ids(t).into_iter().collect::<Vec<_>>(),
        [128247, 151643, 151645, 151662, 151663, 151664]
    );
    // User-defined tokens are split out even without parse_special.
    assert_eq!(
        t.encode("<tool_call>", false, false).expect("encodes"),
        [151657]
    );
    assert_eq!(t.id_to_piece(151644).as_deref(), Some("<|im_start|>"));
}

#[test]
fn decode_skips_control_tokens_on_request() {
    let t = tok();
    let text = "<|endoftext|><|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>";
    let ids = t.encode(text, false, true).expect("encodes");
    assert_eq!(t.decode(&ids, true).expect("decodes"), "ab");
    assert_eq!(t.decode(&ids, false).expect("decodes"), text);
}

#[test]
fn chat_template_matches_jinja2() {
    let t = tok();
    assert_eq!(
        t.apply_chat_template(&conversation(), true).expect("renders"),
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi! Say café 👋<|im_end|>\n\
         <|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n  What is 2+2?\n<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    assert_eq!(
        t.apply_chat_template(&conversation(), false).expect("renders"),
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi! Say café 👋<|im_end|>\n\
         <|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n  What is 2+2?\n<|im_end|>\n"
    );
    let hello = [switchyard_tokenizer::ChatMessage::new("user", "Hello")];
    assert_eq!(
        t.apply_chat_template(&hello, true).expect("renders"),
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\
         <|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn stream_matches_decode() {
    let t = tok();
    let ids = t.encode(STREAM_TEXT, false, true).expect("encodes");
    let (text, held) = stream(t, &ids);
    assert_eq!(text, STREAM_TEXT);
    assert_eq!(text, t.decode(&ids, true).expect("decodes"));
    assert!(
        held > 0,
        "byte-level tokens split emoji, so some pushes must wait"
    );
}

#[test]
fn save_hf_round_trips() {
    assert_hf_round_trip(tok(), CASES, AS_TEXT);
}

#[test]
fn the_longest_conversation_a_request_can_hold_renders() {
    common::assert_the_longest_conversation_renders(tok());
}
