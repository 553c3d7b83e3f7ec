//! Speculative and self-speculative decoding on small synthetic models: greedy output is
//! exactly plain greedy decoding of the target (tokens, text, finish reason) for any draft,
//! draft length, exit depth, stop string, token limit and context limit.

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use switchyard_engine::{generate, Generation};
use switchyard_exits::ExitHeads;
use switchyard_models::{LayeredModel, LoadOptions};
use switchyard_modes::self_speculative::SelfSpeculativeDecoder;
use switchyard_modes::speculative::{SpecGeneration, SpeculativeDecoder, DEFAULT_DRAFT_LEN};
use switchyard_modes::ModesError;
use switchyard_request::{FinishReason, SamplingParams};
use switchyard_tokenizer::Tokenizer;
use switchyard_weights::{Architecture, MetaValue, Metadata, ModelSpec, SyntheticSource};

const VOCAB: usize = 256;

fn spec(arch: Architecture, vocab: usize) -> ModelSpec {
    let mut spec = SyntheticSource::tiny_spec(arch);
    spec.vocab_size = vocab;
    spec
}

fn load(spec: ModelSpec, seed: u64, opts: &LoadOptions) -> LayeredModel {
    let src = SyntheticSource::new(spec, seed, GgmlDType::F32).expect("synthetic model");
    LayeredModel::load(Arc::new(src), opts).expect("load")
}

fn model(seed: u64) -> LayeredModel {
    load(
        spec(Architecture::Llama, VOCAB),
        seed,
        &LoadOptions::default(),
    )
}

/// A SentencePiece vocabulary: `<unk> <s> </s>` (end of generation: 2), then `t3`, `t4`, ...
fn tokenizer(vocab: usize) -> Tokenizer {
    tokenizer_with_eos(vocab, 2)
}

/// As [`tokenizer`], with end of generation at `eos`.
fn tokenizer_with_eos(vocab: usize, eos: u32) -> Tokenizer {
    let pieces = (0..vocab)
        .map(|i| match i {
            0 => "<unk>".to_string(),
            1 => "<s>".to_string(),
            2 => "</s>".to_string(),
            _ => format!("t{i}"),
        })
        .map(MetaValue::String)
        .collect();
    let types = (0..vocab)
        .map(|i| MetaValue::I32([2, 3, 3].get(i).copied().unwrap_or(1)))
        .collect();
    let mut md = Metadata::new(BTreeMap::new());
    md.insert("tokenizer.ggml.model", MetaValue::String("llama".into()));
    md.insert("tokenizer.ggml.tokens", MetaValue::Array(pieces));
    md.insert("tokenizer.ggml.token_type", MetaValue::Array(types));
    md.insert("tokenizer.ggml.eos_token_id", MetaValue::U32(eos));
    Tokenizer::from_gguf_metadata(&md).expect("tokenizer")
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 3 + (seed.wrapping_mul(2_654_435_761).wrapping_add(i * 40_503) >> 9) % 253)
        .collect()
}

fn assert_same(spec: &SpecGeneration, plain: &Generation, what: &str) {
    let g = &spec.generation;
    assert_eq!(g.tokens, plain.tokens, "{what}: tokens");
    assert_eq!(g.text, plain.text, "{what}: text");
    assert_eq!(
        g.finish_reason, plain.finish_reason,
        "{what}: finish reason"
    );
    assert_eq!(
        g.prompt_tokens, plain.prompt_tokens,
        "{what}: prompt tokens"
    );
    let s = &spec.stats;
    assert!(s.accepted <= s.drafted, "{what}: {s:?}");
    // Every round yields its accepted tokens and one more, unless the output was cut short.
    assert!(g.tokens.len() <= 1 + s.accepted + s.rounds, "{what}: {s:?}");
}

/// Streams the output and checks the pieces add up to the text.
fn streamed<E>(
    run: impl FnOnce(&mut dyn FnMut(&str)) -> Result<SpecGeneration, E>,
) -> SpecGeneration
where
    E: std::fmt::Debug,
{
    let mut pieces = String::new();
    let out = run(&mut |p: &str| pieces.push_str(p)).expect("generate");
    assert_eq!(pieces, out.generation.text, "streamed text");
    out
}

#[test]
fn greedy_equals_the_target_with_a_different_draft() {
    let target = model(1);
    let draft = model(2);
    let tok = tokenizer(VOCAB);
    let mut rates = Vec::new();
    for (i, k) in [1, 2, DEFAULT_DRAFT_LEN, 7].into_iter().enumerate() {
        let prompt = prompt(i as u32, 5 + 3 * i);
        let params = SamplingParams::greedy(40);
        let plain = generate(&target, &tok, &prompt, &params, |_| {}).expect("plain");
        let dec = SpeculativeDecoder::new(&draft, &target)
            .and_then(|d| d.with_draft_len(k))
            .expect("decoder");
        let out = streamed(|f| dec.generate(&tok, &prompt, &params, f));
        assert_same(&out, &plain, &format!("k = {k}"));
        assert_eq!(out.stats.draft_forwards, out.stats.drafted);
        assert_eq!(out.stats.target_forwards, out.stats.rounds + 1);
        rates.push(out.stats.acceptance_rate());
    }
    eprintln!("acceptance of an unrelated draft: {rates:?}");
    // Two unrelated random models often disagree: every run takes the rejection path.
    assert!(rates.iter().all(|&r| r < 1.0), "{rates:?}");
}

#[test]
fn greedy_with_the_target_as_draft_accepts_every_token() {
    let target = model(3);
    let tok = tokenizer(VOCAB);
    for k in [1, 3, 6] {
        let prompt = prompt(k as u32, 9);
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(33)
        };
        let plain = generate(&target, &tok, &prompt, &params, |_| {}).expect("plain");
        let dec = SpeculativeDecoder::new(&target, &target)
            .and_then(|d| d.with_draft_len(k))
            .expect("decoder");
        let out = dec.generate(&tok, &prompt, &params, |_| {}).expect("spec");
        assert_same(&out, &plain, &format!("k = {k}"));
        assert_eq!(out.stats.acceptance_rate(), 1.0, "k = {k}: {:?}", out.stats);
        // 32 tokens after the first, k + 1 per round (the last round may be shorter).
        assert_eq!(out.stats.rounds, 32usize.div_ceil(k + 1), "k = {k}");
    }
}

#[test]
fn self_speculative_greedy_equals_full_depth_at_every_exit() {
    let model = model(4);
    let tok = tokenizer(VOCAB);
    let heads = ExitHeads::logit_lens(&model, "synthetic", &[1, 2, 3]).expect("heads");
    for depth in 1..model.n_layers() {
        for k in [1, DEFAULT_DRAFT_LEN, 6] {
            let prompt = prompt((depth * 10 + k) as u32, 7);
            let params = SamplingParams::greedy(30);
            let plain = generate(&model, &tok, &prompt, &params, |_| {}).expect("plain");
            let dec = SelfSpeculativeDecoder::new(&model, &heads, depth)
                .and_then(|d| d.with_draft_len(k))
                .expect("decoder");
            let out = streamed(|f| dec.generate(&tok, &prompt, &params, f));
            assert_same(&out, &plain, &format!("depth {depth}, k = {k}"));
            assert_eq!(out.stats.draft_forwards, out.stats.drafted);
            eprintln!(
                "depth {depth}, k = {k}: acceptance {:.2}",
                out.stats.acceptance_rate()
            );
        }
    }
}

/// Self-speculation through the logit lens at depth `d` is speculation with a draft made of
/// the model's first `d` layers: with the same seed, sampled outputs agree token for token.
#[test]
fn self_speculation_is_speculation_with_the_first_layers_as_draft() {
    let deep = spec(Architecture::Llama, VOCAB);
    let mut shallow = deep.clone();
    shallow.n_layers = 2;
    // One seed: the shallow model's weights are the deep one's embedding, norm and layers 0..2.
    let target = load(deep, 12, &LoadOptions::default());
    let draft = load(shallow, 12, &LoadOptions::default());
    let heads = ExitHeads::logit_lens(&target, "synthetic", &[2]).expect("heads");
    let tok = tokenizer(VOCAB);
    let spec_dec = SpeculativeDecoder::new(&draft, &target).expect("decoder");
    let self_dec = SelfSpeculativeDecoder::new(&target, &heads, 2).expect("decoder");
    for seed in 0..4 {
        let params = SamplingParams {
            max_tokens: 24,
            temperature: 1.5,
            top_k: 40,
            top_p: 0.95,
            repetition_penalty: 1.1,
            seed: Some(seed),
            ..SamplingParams::default()
        };
        let prompt = prompt(seed as u32, 6);
        let a = spec_dec
            .generate(&tok, &prompt, &params, |_| {})
            .expect("spec");
        let b = self_dec
            .generate(&tok, &prompt, &params, |_| {})
            .expect("self");
        assert_eq!(a.generation.tokens, b.generation.tokens, "seed {seed}");
        assert_eq!(
            (a.stats.drafted, a.stats.accepted),
            (b.stats.drafted, b.stats.accepted),
            "seed {seed}"
        );
        assert!(
            a.stats.accepted < a.stats.drafted,
            "seed {seed}: {:?}",
            a.stats
        );
    }
}

/// Stop strings, end-of-generation tokens, `ignore_eos`, small token limits and the
/// repetition penalty end and shape the output exactly as in plain generation.
#[test]
fn stops_and_limits_match_plain_generation() {
    let target = model(5);
    let draft = model(6);
    let tok = tokenizer(VOCAB);
    let heads = ExitHeads::logit_lens(&target, "synthetic", &[2]).expect("heads");
    let spec = SpeculativeDecoder::new(&draft, &target).expect("decoder");
    let own = SpecGen::Own(SelfSpeculativeDecoder::new(&target, &heads, 2).expect("decoder"));
    let prompt = prompt(77, 6);
    let long = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(48)
    };
    let long_plain = generate(&target, &tok, &prompt, &long, |_| {}).expect("plain");
    let text = &long_plain.text;
    // A stop string from the middle of the output, and one that starts there and never ends.
    let mid = text.len() / 2;
    let stop = text[mid..mid + 5].to_string();
    let cases = [
        SamplingParams::greedy(1),
        SamplingParams::greedy(2),
        SamplingParams::greedy(5),
        long.clone(),
        SamplingParams {
            stop: vec![stop.clone()],
            ..long.clone()
        },
        SamplingParams {
            stop: vec![format!("{stop}never")],
            ..long.clone()
        },
        SamplingParams {
            repetition_penalty: 1.3,
            ..long.clone()
        },
    ];
    // End of generation as the model's own choice: a tokenizer whose end-of-generation id is
    // the 11th token of the output.
    let eos_tok = tokenizer_with_eos(VOCAB, long_plain.tokens[10]);
    let eos_case = SamplingParams::greedy(48);
    let cases = cases
        .iter()
        .map(|p| (&tok, p))
        .chain([(&eos_tok, &eos_case)]);
    for (i, (tok, params)) in cases.enumerate() {
        let plain = generate(&target, tok, &prompt, params, |_| {}).expect("plain");
        for dec in [SpecGen::Draft(spec), own] {
            let out = streamed(|f| dec.generate(tok, &prompt, params, f));
            assert_same(&out, &plain, &format!("{dec:?}, case {i}: {params:?}"));
        }
        if params.stop.first() == Some(&stop) {
            assert_eq!(plain.finish_reason, FinishReason::Stop);
            assert!(plain.text.len() < mid + 5, "{:?}", plain.text);
        }
        if std::ptr::eq(params, &eos_case) {
            assert_eq!(plain.finish_reason, FinishReason::Stop);
            assert!(plain.tokens.len() <= 10);
        }
    }
}

/// Either decoder, for tests that run both.
#[derive(Debug, Clone, Copy)]
enum SpecGen<'m> {
    Draft(SpeculativeDecoder<'m>),
    Own(SelfSpeculativeDecoder<'m>),
}

impl SpecGen<'_> {
    fn generate(
        &self,
        tok: &Tokenizer,
        prompt: &[u32],
        params: &SamplingParams,
        on_text: impl FnMut(&str),
    ) -> Result<SpecGeneration, ModesError> {
        match self {
            Self::Draft(d) => d.generate(tok, prompt, params, on_text),
            Self::Own(d) => d.generate(tok, prompt, params, on_text),
        }
    }
}

/// Generation fills the target's context exactly; a draft with a shorter context stops
/// drafting at its end and the target finishes alone.
#[test]
fn context_limits_match_plain_generation() {
    let mut short = spec(Architecture::Llama, VOCAB);
    short.context_length = 24;
    let target = load(short.clone(), 7, &LoadOptions::default());
    short.context_length = 16;
    let draft = load(short, 8, &LoadOptions::default());
    let tok = tokenizer(VOCAB);
    let heads = ExitHeads::logit_lens(&target, "synthetic", &[3]).expect("heads");
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(100)
    };
    for (prompt_len, k) in [(10, 4), (13, 5), (20, 3), (23, 4)] {
        let prompt = prompt(prompt_len as u32, prompt_len);
        let plain = generate(&target, &tok, &prompt, &params, |_| {}).expect("plain");
        assert_eq!(plain.tokens.len(), 24 - prompt_len);
        let decs = [
            SpecGen::Draft(
                SpeculativeDecoder::new(&draft, &target)
                    .and_then(|d| d.with_draft_len(k))
                    .expect("decoder"),
            ),
            SpecGen::Draft(
                SpeculativeDecoder::new(&target, &target)
                    .and_then(|d| d.with_draft_len(k))
                    .expect("decoder"),
            ),
            SpecGen::Own(
                SelfSpeculativeDecoder::new(&target, &heads, 3)
                    .and_then(|d| d.with_draft_len(k))
                    .expect("decoder"),
            ),
        ];
        for dec in decs {
            let out = dec.generate(&tok, &prompt, &params, |_| {}).expect("spec");
            assert_same(&out, &plain, &format!("prompt {prompt_len}, {dec:?}"));
        }
    }
}

/// A draft with fewer or more ids than the target proposes only ids both have; the output is
/// still exactly the target's.
#[test]
fn vocabulary_sizes_may_differ() {
    let target = model(9);
    let tok = tokenizer(VOCAB);
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(30)
    };
    let prompt = prompt(5, 8);
    let plain = generate(&target, &tok, &prompt, &params, |_| {}).expect("plain");
    // The smaller draft must read ids it has no embedding for.
    assert!(prompt.iter().chain(&plain.tokens).any(|&t| t >= 200));
    for vocab in [200, 300] {
        let draft = load(
            spec(Architecture::Qwen2, vocab),
            10,
            &LoadOptions::default(),
        );
        let dec = SpeculativeDecoder::new(&draft, &target).expect("decoder");
        let out = dec.generate(&tok, &prompt, &params, |_| {}).expect("spec");
        assert_same(&out, &plain, &format!("draft vocab {vocab}"));
    }
}

#[test]
fn bad_settings_are_refused() {
    let m = model(11);
    let tok = tokenizer(VOCAB);
    let heads = ExitHeads::logit_lens(&m, "synthetic", &[2]).expect("heads");
    let invalid = |r: Result<_, ModesError>| match r {
        Err(ModesError::Invalid(msg)) => msg,
        other => panic!("expected Invalid, got {other:?}"),
    };
    let dec = SpeculativeDecoder::new(&m, &m).expect("decoder");
    assert_eq!(
        invalid(dec.with_draft_len(0).map(|_| ())),
        "draft length must be 1 to 32, got 0"
    );
    assert!(dec.with_draft_len(33).is_err());
    assert_eq!(
        invalid(SelfSpeculativeDecoder::new(&m, &heads, 4).map(|_| ())),
        "draft depth must be 1 to 3, got 4"
    );
    assert!(matches!(
        SelfSpeculativeDecoder::new(&m, &heads, 3),
        Err(ModesError::Exits(_))
    ));
    let partial = load(
        spec(Architecture::Llama, VOCAB),
        11,
        &LoadOptions {
            layers: Some(2),
            ..LoadOptions::default()
        },
    );
    assert!(invalid(SpeculativeDecoder::new(&m, &partial).map(|_| ())).contains("layer 2"));
    let other_heads = ExitHeads::logit_lens(
        &load(spec(Architecture::Llama, 100), 1, &LoadOptions::default()),
        "x",
        &[2],
    )
    .expect("heads");
    assert!(
        invalid(SelfSpeculativeDecoder::new(&m, &other_heads, 2).map(|_| ())).contains("vocab")
    );
    let params = SamplingParams::greedy(4);
    assert!(matches!(
        dec.generate(&tok, &[], &params, |_| {}),
        Err(ModesError::Engine(e)) if matches!(*e, switchyard_engine::EngineError::EmptyPrompt)
    ));
    let too_long = vec![5u32; 512];
    assert!(matches!(
        dec.generate(&tok, &too_long, &params, |_| {}),
        Err(ModesError::Engine(e))
            if matches!(*e, switchyard_engine::EngineError::PromptTooLong { .. })
    ));
    let bad = SamplingParams {
        top_p: 0.0,
        ..params
    };
    assert!(matches!(
        dec.generate(&tok, &[5], &bad, |_| {}),
        Err(ModesError::Engine(e)) if matches!(*e, switchyard_engine::EngineError::Request(_))
    ));
}
