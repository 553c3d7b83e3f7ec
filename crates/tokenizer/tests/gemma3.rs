//! Gemma 3 270M: SentencePiece (`tokenizer.ggml.model = "llama"`) with scores, byte fallback,
//! user-defined whitespace tokens and no space prefix.
//! Expected ids were produced once with llama.cpp (llama-cpp-python 0.3.36, `vocab_only`); chat
//! references with jinja2 3.1.6 under Hugging Face's settings (`trim_blocks`, `lstrip_blocks`).

use std::sync::OnceLock;

use switchyard_tokenizer::Tokenizer;

use crate::common::*;

const MODEL: &str = "gemma3-270m";

fn tok() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| load_tokenizer(MODEL))
}

/// `(text, llama.cpp ids)`, tokenized with `parse_special = true` and no BOS.
#[rustfmt::skip]
const CASES: &[(&str, &[u32])] = &[
    ("12345678", &[236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828]),
    ("3.14159", &[236800, 236761, 236770, 236812, 236770, 236810, 236819]),
    ("a  b   c", &[236746, 138, 236763, 139, 236755]),
    ("\t\tx\n\n\ny", &[255969, 236781, 109, 236762]),
    ("   leading", &[139, 26016]),
    ("trailing   ", &[136697, 139]),
    ("café naïve résumé", &[123125, 236859, 120362, 118515]),
    ("你好，世界", &[144626, 236900, 12811]),
    ("👋🏽 hi 🚀", &[242687, 242713, 5631, 236743, 242015]),
    ("fn main() {\n    println!(\"x\");\n}", &[15059, 1689, 825, 642, 107, 140, 4629, 36492, 236781, 1443, 107, 236783]),
    ("I'm don't WE'LL", &[236777, 236789, 236757, 1537, 236789, 236745, 19716, 236789, 2182]),
    ("The quick brown fox jumps over the lazy dog. It wasn't the first time: in 1999, 42 foxes (and one very confused badger) did exactly the same thing, and nobody's been able to explain why since. \"Remarkable,\" said Dr. O'Neil -- twice!", &[818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236761, 1030, 7289, 236789, 236745, 506, 1171, 990, 236787, 528, 236743, 236770, 236819, 236819, 236819, 236764, 236743, 236812, 236778, 159564, 568, 624, 886, 1401, 23894, 215044, 236768, 1602, 7121, 506, 1638, 3210, 236764, 532, 24063, 236789, 236751, 1010, 2735, 531, 8082, 3217, 2338, 236761, 623, 37600, 742, 2098, 1176, 3587, 236761, 708, 236789, 70955, 2617, 10911, 236888]),
    ("", &[]),
    ("Hello world", &[9259, 1902]),
    ("안녕하세요 мир नमस\u{94d}त\u{947} مرحبا", &[61659, 58562, 173040, 150423]),
    ("x=1;y=2 // 100% sure?!", &[236781, 236784, 236770, 236793, 236762, 236784, 236778, 973, 236743, 236770, 236771, 236771, 236908, 2889, 26052]),
    ("line1\r\nline2\r\n", &[1257, 236770, 251, 107, 1257, 236778, 251, 107]),
    ("e\u{301} vs é, \u{a0}nbsp\u{3000}ideographic", &[236744, 238288, 7728, 1559, 236764, 236743, 432, 398, 11539, 465, 366, 366, 754, 9814]),
    ("👨\u{200d}👩\u{200d}👧 family ❤\u{fe0f} 🇫🇷", &[243874, 237243, 243767, 237243, 244814, 2523, 64813, 236743, 246598, 242644]),
    ("<start_of_turn>user\nhi<end_of_turn>", &[105, 2364, 107, 2202, 106]),
    ("<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\n", &[105, 4368, 107, 9259, 236888, 106, 107, 105, 2364, 107]),
    ("<bos><eos><pad><unused0>[multimodal]<table> </table>", &[2, 1, 0, 6, 5, 168, 236743, 176]),
];

/// The special-token strings of [`CASES`] with `parse_special = false`: plain text.
#[rustfmt::skip]
const AS_TEXT: &[(&str, &[u32])] = &[
    ("<start_of_turn>user\nhi<end_of_turn>", &[236820, 3041, 236779, 1340, 236779, 887, 236813, 2364, 107, 2202, 236820, 643, 236779, 1340, 236779, 887, 236813]),
    ("<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\n", &[236820, 3041, 236779, 1340, 236779, 887, 236813, 4368, 107, 9259, 200322, 643, 236779, 1340, 236779, 887, 236813, 107, 236820, 3041, 236779, 1340, 236779, 887, 236813, 2364, 107]),
    ("<bos><eos><pad><unused0>[multimodal]<table> </table>", &[236820, 46757, 1798, 211827, 1798, 13039, 1798, 63634, 236771, 236813, 5, 168, 236743, 176]),
];

#[test]
fn ids_match_llama_cpp_and_decode_back() {
    assert!(CASES.len() >= 12);
    assert_cases(tok(), CASES, AS_TEXT);
}

#[test]
fn whitespace_runs_are_user_defined_tokens() {
    let t = tok();
    // "  " and "   " are user-defined tokens (138, 139), cut out before SentencePiece runs.
    assert_eq!(t.id_to_piece(138).as_deref(), Some("  "));
    assert_eq!(
        t.encode("a  b   c", false, false).expect("encodes"),
        [236746, 138, 236763, 139, 236755]
    );
    // Without a space prefix, "Hello" is not "▁Hello".
    assert_eq!(t.encode("Hello", false, true).expect("encodes"), [9259]);
}

#[test]
fn special_tokens_and_bos() {
    let t = tok();
    assert_eq!(t.vocab_size(), 262144);
    assert_eq!(
        (t.bos_id(), t.eos_id(), t.adds_bos()),
        (Some(2), Some(1), true)
    );
    assert_eq!(
        t.encode("Hello world", true, true).expect("encodes"),
        [2, 9259, 1902]
    );
    assert_eq!(t.encode("", true, true).expect("encodes"), [2]);
    // <eos>, <end_of_turn>, and </s> (user-defined in Gemma, end of generation for llama.cpp).
    assert_eq!(
        end_of_generation_ids(t).into_iter().collect::<Vec<_>>(),
        [1, 106, 212]
    );
    // A leading BOS is dropped when skipping special tokens, kept as text otherwise.
    assert_eq!(
        t.decode(&[2, 9259, 1902], true).expect("decodes"),
        "Hello world"
    );
    assert_eq!(
        t.decode(&[2, 9259, 1902], false).expect("decodes"),
        "<bos>Hello world"
    );
}

#[test]
fn decode_skips_control_tokens_on_request() {
    let t = tok();
    let text = "<bos><eos><pad><unused0>[multimodal]<table> </table>";
    let ids = t.encode(text, false, true).expect("encodes");
    // [multimodal] is user-defined, so it is always rendered.
    assert_eq!(
        t.decode(&ids, true).expect("decodes"),
        "[multimodal]<table> </table>"
    );
    assert_eq!(t.decode(&ids, false).expect("decodes"), text);
}

#[test]
fn base_model_has_no_chat_template() {
    let t = tok();
    assert_eq!(t.chat_template(), None);
    let err = t
        .apply_chat_template(&conversation(), true)
        .expect_err("gemma3-270m is a base model");
    assert!(matches!(
        err,
        switchyard_tokenizer::TokenizerError::NoChatTemplate
    ));
    assert!(err.to_string().contains("no chat template"), "{err}");
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
        "byte-fallback tokens split characters, so some pushes must wait"
    );
}

#[test]
fn save_hf_round_trips() {
    assert_hf_round_trip(tok(), CASES, AS_TEXT);
}
