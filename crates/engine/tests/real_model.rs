//! Generation and scoring on a real model (smollm2-135m-instruct).

use std::sync::Arc;

use switchyard_engine::{generate, score_text, ScoreOptions};
use switchyard_models::{DenseKv, LayeredModel, LoadOptions};
use switchyard_request::{FinishReason, SamplingParams};
use switchyard_tokenizer::Tokenizer;

fn load() -> (LayeredModel, Tokenizer) {
    let path = switchyard_zoo::ensure("smollm2-135m-instruct").expect("model");
    let src = switchyard_weights::open(path).expect("open");
    let tok = Tokenizer::from_source(&*src).expect("tokenizer");
    let model = LayeredModel::load(Arc::clone(&src), &LoadOptions::default()).expect("load");
    (model, tok)
}

fn prompt(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode(text, true, false).unwrap()
}

#[test]
fn greedy_is_deterministic_and_streams_the_whole_text() {
    let (m, tok) = load();
    let p = prompt(&tok, "The capital of France is");
    let params = SamplingParams::greedy(12);
    let mut streamed = String::new();
    let a = generate(&m, &tok, &p, &params, |t| streamed.push_str(t)).unwrap();
    let b = generate(&m, &tok, &p, &params, |_| {}).unwrap();
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(a.tokens.len(), 12);
    assert_eq!(a.finish_reason, FinishReason::Length);
    assert_eq!(streamed, a.text);
    assert_eq!(a.text, tok.decode(&a.tokens, false).unwrap());
    assert!(a.text.contains("Paris"), "{:?}", a.text);
}

#[test]
fn seeded_sampling_repeats_and_seeds_differ() {
    let (m, tok) = load();
    let p = prompt(&tok, "Once upon a time");
    let params = |seed| SamplingParams {
        max_tokens: 16,
        temperature: 1.0,
        top_p: 0.95,
        top_k: 50,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let a = generate(&m, &tok, &p, &params(1), |_| {}).unwrap();
    let b = generate(&m, &tok, &p, &params(1), |_| {}).unwrap();
    let c = generate(&m, &tok, &p, &params(2), |_| {}).unwrap();
    assert_eq!(a.tokens, b.tokens);
    assert_ne!(a.tokens, c.tokens);
}

#[test]
fn stop_strings_and_end_of_generation() {
    let (m, tok) = load();
    let p = prompt(&tok, "The capital of France is");
    let free = generate(&m, &tok, &p, &SamplingParams::greedy(12), |_| {}).unwrap();
    // Stop at the first occurrence of " Paris": nothing from it on is returned.
    let params = SamplingParams {
        stop: vec![" Paris".into()],
        ..SamplingParams::greedy(12)
    };
    let cut = generate(&m, &tok, &p, &params, |_| {}).unwrap();
    assert_eq!(cut.finish_reason, FinishReason::Stop);
    let at = free.text.find(" Paris").unwrap();
    assert_eq!(cut.text, free.text[..at]);

    // A chat turn ends with the end-of-turn token, which is not part of the text.
    let msgs = [switchyard_tokenizer::ChatMessage::new("user", "Say hi.")];
    let rendered = tok.apply_chat_template(&msgs, true).unwrap();
    let p = tok.encode(&rendered, false, true).unwrap();
    let g = generate(&m, &tok, &p, &SamplingParams::greedy(64), |_| {}).unwrap();
    assert_eq!(g.finish_reason, FinishReason::Stop, "{:?}", g.text);
    assert!(!g.text.contains("<|im_end|>"));
    assert!(g.tokens.len() < 64);
}

#[test]
fn prompt_over_the_context_is_refused() {
    let (m, tok) = load();
    let ctx = m.spec().context_length;
    let p = vec![100u32; ctx];
    let err = generate(&m, &tok, &p, &SamplingParams::greedy(1), |_| {}).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("the prompt has {ctx} tokens; the model's context holds {ctx}, leaving no room to generate")
    );
    let err = generate(&m, &tok, &[], &SamplingParams::greedy(1), |_| {}).unwrap_err();
    assert_eq!(err.to_string(), "the prompt is empty");
}

/// The windowed scorer equals an independent token-by-token sum of -ln p (cached decoding),
/// and bits per byte is the total in bits over the scored bytes.
#[test]
fn score_matches_token_by_token_likelihood() {
    let (m, tok) = load();
    let text = "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness.";
    let ids = tok.encode(text, true, false).unwrap();
    let mut kv = DenseKv::new(m.n_layers(), m.spec().kv_row_len());
    let mut want = 0f64;
    for i in 0..ids.len() - 1 {
        let logits =
            switchyard_engine::generate::last_logits(&m, &mut kv, i, &ids[i..i + 1]).unwrap();
        want -= switchyard_engine::sampler::log_softmax_at(&logits, ids[i + 1] as usize) as f64;
    }
    // A window smaller than the text exercises the sliding path.
    for opts in [
        ScoreOptions::default(),
        ScoreOptions {
            window: 8,
            stride: 3,
            ..ScoreOptions::default()
        },
    ] {
        let s = score_text(&m, &tok, text, opts, |_, _| {}).unwrap();
        assert_eq!(s.tokens_scored, ids.len() - 1);
        if opts.window == 0 {
            assert!(
                (s.total_nll_nats - want).abs() < 1e-3 * want,
                "{} vs {want}",
                s.total_nll_nats
            );
        }
        let first = tok.decode(&ids[..1], false).unwrap();
        assert_eq!(s.bytes_scored, text.len() - first.len());
        assert!(
            (s.bits_per_byte - s.total_nll_nats / std::f64::consts::LN_2 / s.bytes_scored as f64)
                .abs()
                < 1e-12
        );
        assert!((s.perplexity - s.mean_nll_nats.exp()).abs() < 1e-9);
    }
    // Less context per target can only make the text less predictable here.
    let narrow = score_text(
        &m,
        &tok,
        text,
        ScoreOptions {
            window: 8,
            stride: 3,
            ..ScoreOptions::default()
        },
        |_, _| {},
    )
    .unwrap();
    let wide = score_text(&m, &tok, text, ScoreOptions::default(), |_, _| {}).unwrap();
    assert!(narrow.total_nll_nats > wide.total_nll_nats);
}
