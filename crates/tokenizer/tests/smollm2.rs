//! SmolLM2-135M-Instruct: byte-level BPE with llama.cpp's `smollm` pre-tokenizer (digits split
//! one by one, then GPT-2 rules).
//! Expected ids were produced once with llama.cpp (llama-cpp-python 0.3.36, `vocab_only`); chat
//! references with jinja2 3.1.6 under Hugging Face's settings (`trim_blocks`, `lstrip_blocks`).

use crate::common;

use std::sync::OnceLock;

use switchyard_tokenizer::Tokenizer;

use crate::common::*;

const MODEL: &str = "smollm2-135m-instruct";

fn tok() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| load_tokenizer(MODEL))
}

/// `(text, llama.cpp ids)`, tokenized with `parse_special = true` and no BOS.
#[rustfmt::skip]
const CASES: &[(&str, &[u32])] = &[
    ("12345678", &[33, 34, 35, 36, 37, 38, 39, 40]),
    ("3.14159", &[35, 30, 33, 36, 33, 37, 41]),
    ("a  b   c", &[81, 216, 278, 256, 265]),
    ("\t\tx\n\n\ny", &[197, 197, 104, 1116, 198, 105]),
    ("   leading", &[256, 2899]),
    ("trailing   ", &[4861, 4966, 333]),
    ("café naïve résumé", &[83, 1939, 2756, 15486, 46494, 412, 2756, 5422, 2756]),
    ("你好，世界", &[18645, 250, 48392, 138, 12831, 7906, 240, 178, 239, 230]),
    ("👋🏽 hi 🚀", &[10813, 235, 229, 10813, 233, 138, 15876, 15107, 244, 218]),
    ("fn main() {\n    println!(\"x\");\n}", &[7853, 1085, 1000, 1662, 472, 1628, 34115, 17, 1470, 104, 21646, 198, 109]),
    ("I'm don't WE'LL", &[57, 5248, 1326, 982, 26587, 23, 16421]),
    ("The quick brown fox jumps over the lazy dog. It wasn't the first time: in 1999, 42 foxes (and one very confused badger) did exactly the same thing, and nobody's been able to explain why since. \"Remarkable,\" said Dr. O'Neil -- twice!", &[504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 657, 5603, 982, 260, 808, 655, 42, 281, 216, 33, 41, 41, 41, 28, 216, 36, 34, 28510, 365, 397, 582, 1035, 11327, 3309, 2008, 25, 1250, 3869, 260, 1142, 2775, 28, 284, 14938, 506, 719, 1730, 288, 3556, 1701, 1675, 30, 476, 7224, 792, 515, 1627, 1137, 2503, 30, 492, 23, 47917, 3009, 6757, 17]),
    ("", &[]),
    ("Hello world", &[19556, 905]),
    ("안녕하세요 мир नमस\u{94d}त\u{947} مرحبا", &[183, 239, 226, 182, 223, 239, 33085, 242, 183, 222, 133, 183, 244, 238, 41337, 7872, 9175, 12335, 118, 35090, 38770, 16525, 26293, 30581, 36395, 20602, 44626, 31462, 10805]),
    ("x=1;y=2 // 100% sure?!", &[104, 45, 33, 43, 105, 45, 34, 13241, 216, 33, 32, 32, 21, 2090, 17593]),
    ("line1\r\nline2\r\n", &[1311, 33, 201, 198, 1311, 34, 2738]),
    ("e\u{301} vs é, \u{a0}nbsp\u{3000}ideographic", &[85, 151, 219, 6375, 26411, 28, 216, 15442, 94, 32093, 12109, 218, 489, 4551]),
    ("👨\u{200d}👩\u{200d}👧 family ❤\u{fe0f} 🇫🇷", &[10813, 235, 118, 321, 231, 10813, 235, 119, 321, 231, 10813, 235, 117, 1564, 4636, 247, 114, 31752, 15107, 225, 121, 10813, 225, 132]),
    ("<|im_start|>user\nhi<|im_end|>", &[1, 4093, 198, 6004, 2]),
    ("<|im_start|>system\nYou are nice.<|im_end|>\n<|im_start|>assistant\n", &[1, 9690, 198, 2683, 359, 9239, 30, 2, 198, 1, 520, 9531, 198]),
    ("<|endoftext|><reponame>x", &[0, 4, 104]),
];

/// The special-token strings of [`CASES`] with `parse_special = false`: plain text.
#[rustfmt::skip]
const AS_TEXT: &[(&str, &[u32])] = &[
    ("<|im_start|>user\nhi<|im_end|>", &[44, 108, 306, 79, 3738, 108, 46, 4093, 198, 6004, 44, 108, 306, 79, 486, 108, 46]),
    ("<|im_start|>system\nYou are nice.<|im_end|>\n<|im_start|>assistant\n", &[44, 108, 306, 79, 3738, 108, 46, 9690, 198, 2683, 359, 9239, 15602, 108, 306, 79, 486, 108, 46, 198, 44, 108, 306, 79, 3738, 108, 46, 520, 9531, 198]),
    ("<|endoftext|><reponame>x", &[44, 108, 486, 1714, 2692, 108, 21198, 10368, 46, 104]),
];

#[test]
fn ids_match_llama_cpp_and_decode_back() {
    assert!(CASES.len() >= 12);
    assert_cases(tok(), CASES, AS_TEXT);
}

#[test]
fn no_leading_space_is_added() {
    // GPT-2 rules with a prefix space (candle's `from_gguf` fallback) would give "ĠHello", 38699.
    assert_eq!(tok().encode("Hello", true, true).expect("encodes"), [19556]);
    assert_eq!(tok().id_to_piece(19556).as_deref(), Some("Hello"));
}

#[test]
fn special_tokens_and_bos() {
    let t = tok();
    assert_eq!(t.vocab_size(), 49152);
    assert_eq!(
        (t.bos_id(), t.eos_id(), t.adds_bos()),
        (Some(1), Some(2), false)
    );
    // add_bos_token = false in the metadata: asking for BOS adds nothing.
    assert_eq!(
        t.encode("Hello world", true, true).expect("encodes"),
        [19556, 905]
    );
    assert_eq!(
        t.encode("", true, true).expect("encodes"),
        Vec::<u32>::new()
    );
    // llama.cpp's end-of-generation set: <|endoftext|>, <|im_end|> and (as FIM repo) <reponame>.
    assert_eq!(
        end_of_generation_ids(t).into_iter().collect::<Vec<_>>(),
        [0, 2, 4]
    );
    assert_eq!(t.id_to_piece(2).as_deref(), Some("<|im_end|>"));
    assert_eq!(t.id_to_piece(49152), None);
}

#[test]
fn decode_skips_control_tokens_on_request() {
    let t = tok();
    let ids = t
        .encode("<|im_start|>user\nhi<|im_end|>", false, true)
        .expect("encodes");
    assert_eq!(t.decode(&ids, true).expect("decodes"), "user\nhi");
    assert_eq!(
        t.decode(&ids, false).expect("decodes"),
        "<|im_start|>user\nhi<|im_end|>"
    );
    assert!(t.decode(&[49152], false).is_err());
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
    // Without a system turn the template inserts its own.
    let hello = [switchyard_tokenizer::ChatMessage::new("user", "Hello")];
    assert_eq!(
        t.apply_chat_template(&hello, true).expect("renders"),
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\
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
