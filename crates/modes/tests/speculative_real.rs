//! Speculative decoding on real models: Qwen2.5-Coder 0.5B drafting for 1.5B, and SmolLM2-135M
//! drafting for itself from layer 21 of 30. Greedy output must be exactly the target's own
//! greedy output; the acceptance rates and times are printed (`--nocapture`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use switchyard_engine::{generate, Generation};
use switchyard_exits::fingerprint::fingerprint;
use switchyard_exits::{file, ExitHeads};
use switchyard_models::{LayeredModel, LoadOptions};
use switchyard_modes::self_speculative::SelfSpeculativeDecoder;
use switchyard_modes::speculative::{SpecGeneration, SpeculativeDecoder, DEFAULT_DRAFT_LEN};
use switchyard_request::SamplingParams;
use switchyard_tokenizer::{ChatMessage, Tokenizer};

/// Tokens generated per comparison: enough for several rounds, short enough for 2 cores.
const TOKENS: usize = 28;
/// The self-speculative draft exit: 21 of SmolLM2-135M's 30 layers (70 %).
const SELF_DEPTH: usize = 21;
/// Floor on the Qwen 0.5B -> 1.5B greedy acceptance rate for the coding prompt below (measured
/// 0.833, 20 of 24, with k = 4; a floor well under it catches a broken rule or misaligned positions, which
/// drive the rate toward 0, without depending on kernel-level ties).
const QWEN_ACCEPTANCE_FLOOR: f64 = 0.4;

fn load(name: &str) -> (PathBuf, LayeredModel, Tokenizer) {
    let path = switchyard_zoo::ensure(name).expect("zoo model");
    let src = switchyard_weights::open(&path).expect("open");
    let tok = Tokenizer::from_source(&*src).expect("tokenizer");
    let model = LayeredModel::load(Arc::clone(&src), &LoadOptions::default()).expect("load");
    (path, model, tok)
}

fn chat_prompt(tok: &Tokenizer, user: &str) -> Vec<u32> {
    let text = tok
        .apply_chat_template(&[ChatMessage::new("user", user)], true)
        .expect("chat template");
    tok.encode(&text, false, true).expect("encode")
}

fn report(what: &str, plain: &Generation, spec: &SpecGeneration) {
    let s = &spec.stats;
    let n = plain.tokens.len();
    eprintln!(
        "{what}: {n} tokens; plain {:.2} s decode ({:.1} tok/s); speculative {:.2} s decode \
         ({:.1} tok/s), acceptance {:.3} ({} of {} drafted), {:.2} tokens per round, {} rounds, \
         draft {:.2} s, verify {:.2} s",
        plain.timing.decode_secs,
        plain.timing.decode_tokens_per_s(n),
        spec.generation.timing.decode_secs,
        spec.generation
            .timing
            .decode_tokens_per_s(spec.generation.tokens.len()),
        s.acceptance_rate(),
        s.accepted,
        s.drafted,
        s.tokens_per_round(),
        s.rounds,
        s.draft_secs,
        s.verify_secs,
    );
    eprintln!("{what} text: {:?}", spec.generation.text);
}

#[test]
fn qwen_coder_half_b_drafts_for_one_and_a_half_b() {
    let (_, target, tok) = load("qwen2.5-coder-1.5b-instruct");
    let (_, draft, _) = load("qwen2.5-coder-0.5b-instruct");
    // Same tokenizer, same (padded) vocabulary: nothing is cut from the draft.
    assert_eq!(draft.spec().vocab_size, target.spec().vocab_size);
    let prompt = chat_prompt(
        &tok,
        "Write a Python function is_prime(n) that returns whether n is a prime number.",
    );
    let params = SamplingParams::greedy(TOKENS);
    let t = Instant::now();
    let plain = generate(&target, &tok, &prompt, &params, |_| {}).expect("plain");
    eprintln!("plain 1.5B: {:.2} s", t.elapsed().as_secs_f64());
    let dec = SpeculativeDecoder::new(&draft, &target).expect("decoder");
    assert_eq!(dec.draft_len(), DEFAULT_DRAFT_LEN);
    let t = Instant::now();
    let spec = dec.generate(&tok, &prompt, &params, |_| {}).expect("spec");
    eprintln!(
        "speculative 0.5B -> 1.5B: {:.2} s",
        t.elapsed().as_secs_f64()
    );
    report("qwen 0.5B -> 1.5B, k = 4", &plain, &spec);
    assert_eq!(spec.generation.tokens, plain.tokens);
    assert_eq!(spec.generation.text, plain.text);
    assert_eq!(spec.generation.finish_reason, plain.finish_reason);
    assert!(
        spec.stats.acceptance_rate() >= QWEN_ACCEPTANCE_FLOOR,
        "{:?}",
        spec.stats
    );
}

#[test]
fn smollm2_drafts_for_itself_from_layer_21() {
    let (path, model, tok) = load("smollm2-135m-instruct");
    let prompt = chat_prompt(&tok, "Write a short poem about the sea.");
    let params = SamplingParams::greedy(TOKENS);
    let plain = generate(&model, &tok, &prompt, &params, |_| {}).expect("plain");

    let lens = ExitHeads::logit_lens(&model, "smollm2-135m-instruct", &[SELF_DEPTH]).expect("lens");
    let dec = SelfSpeculativeDecoder::new(&model, &lens, SELF_DEPTH).expect("decoder");
    let spec = dec.generate(&tok, &prompt, &params, |_| {}).expect("spec");
    report("smollm2 self, logit lens at 21", &plain, &spec);
    assert_eq!(spec.generation.tokens, plain.tokens);
    assert_eq!(spec.generation.text, plain.text);
    assert!(spec.stats.drafted > 0);

    // The calibrated (tuned-lens) heads, when `switchyard calibrate` has written them: the
    // same output, normally at a higher acceptance rate.
    let heads_path = file::default_heads_path(&path);
    let calibrated = heads_path.exists().then(|| {
        let fp = fingerprint(&path).expect("fingerprint");
        file::load(&heads_path, &model, &fp)
    });
    match calibrated {
        Some(Ok(heads)) if heads.head(SELF_DEPTH).is_ok() => {
            let dec = SelfSpeculativeDecoder::new(&model, &heads, SELF_DEPTH).expect("decoder");
            let tuned = dec.generate(&tok, &prompt, &params, |_| {}).expect("spec");
            report("smollm2 self, calibrated head at 21", &plain, &tuned);
            assert_eq!(tuned.generation.tokens, plain.tokens);
        }
        Some(Ok(_)) => eprintln!("calibrated heads have no exit at {SELF_DEPTH}; skipped"),
        Some(Err(e)) => eprintln!("calibrated heads not usable ({e}); skipped"),
        None => eprintln!("no calibrated heads at {}; skipped", heads_path.display()),
    }
}

/// A block head drafting: a copy of the last layer at depth 29 of 30 is the model's own last
/// layer, so nearly every draft is accepted if, and only if, the block's K/V stay aligned with
/// the sequence through every round's rollback; the output is the model's greedy output.
#[test]
fn smollm2_drafts_through_a_block_head_with_its_own_kv() -> anyhow::Result<()> {
    use switchyard_exits::block::BlockHead;
    use switchyard_exits::heads::{model_ref, HeadsMeta, FORMAT_VERSION};
    use switchyard_exits::ExitHead;

    let (_, model, tok) = load("smollm2-135m-instruct");
    let prompt = chat_prompt(&tok, "Write a short poem about the sea.");
    let params = SamplingParams::greedy(TOKENS);
    let plain = generate(&model, &tok, &prompt, &params, |_| {})?;
    let n = model.n_layers();
    let block = BlockHead::from_model_layer(&model, n - 1)?;
    let meta = HeadsMeta {
        format_version: FORMAT_VERSION,
        model: model_ref(&model, "smollm2-135m-instruct", String::new(), 0),
        heads: Vec::new(),
        calibration: None,
    };
    let heads = ExitHeads::new(
        meta,
        std::collections::BTreeMap::from([
            (n - 1, ExitHead::Block(Box::new(block.clone()))),
            (24, ExitHead::Block(Box::new(block))),
        ]),
    )?;
    // Drafting from depth 24 through the untrained copy rejects drafts, so rounds roll the
    // block's K/V back; a misaligned cache would stop the round with an error.
    let early = SelfSpeculativeDecoder::new(&model, &heads, 24)?.generate(
        &tok,
        &prompt,
        &params,
        |_| {},
    )?;
    report("smollm2 self, block head at 24", &plain, &early);
    assert_eq!(early.generation.tokens, plain.tokens);
    assert!(
        early.stats.accepted < early.stats.drafted,
        "{:?}",
        early.stats
    );
    let dec = SelfSpeculativeDecoder::new(&model, &heads, n - 1)?;
    let spec = dec.generate(&tok, &prompt, &params, |_| {})?;
    report("smollm2 self, block head at 29", &plain, &spec);
    assert_eq!(spec.generation.tokens, plain.tokens);
    assert!(
        spec.stats.acceptance_rate() >= 0.9,
        "acceptance {} ({} of {})",
        spec.stats.acceptance_rate(),
        spec.stats.accepted,
        spec.stats.drafted
    );
    Ok(())
}
