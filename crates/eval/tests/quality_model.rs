//! Multiple-choice scoring on the real smollm2-135m-instruct: the scorer's log-likelihood (with
//! its reused K/V) against log-softmax by hand over one plain full forward, and 20
//! ARC-Challenge items scored end to end.

use std::sync::Arc;
use std::time::Instant;

use switchyard_eval::quality::{
    encode_pair, load_mc, score_mc, LayeredScorer, LogLikelihood, McTask, Pick,
};
use switchyard_models::{DenseKv, ForwardBatch, LayeredModel, LoadOptions};
use switchyard_tokenizer::Tokenizer;
use switchyard_weights::WeightSource;

/// Reuse and one-shot runs agree to this (nats, summed over a continuation): the engine's
/// invariant makes them bit-identical; the bound leaves room for f64 vs f32 summation.
const LL_TOLERANCE: f64 = 1e-3;

fn smollm2() -> (LayeredModel, Tokenizer) {
    let path = switchyard_zoo::ensure("smollm2-135m-instruct").expect("model");
    let src: Arc<dyn WeightSource> = switchyard_weights::open(path).expect("open");
    let tok = Tokenizer::from_source(&*src).expect("tokenizer");
    let model = LayeredModel::load(src, &LoadOptions::default()).expect("load");
    (model, tok)
}

/// Sum of ln softmax(logits[t-1])[ids[t]] for t in `first..`, from one fresh forward of all
/// of `ids`, computed by hand.
fn reference_ll(model: &LayeredModel, ids: &[u32], first: usize) -> f64 {
    let mut kv = DenseKv::new(model.n_layers(), model.spec().kv_row_len());
    let mut batch = ForwardBatch::single(&mut kv, 0, ids.len());
    let logits = model
        .forward(ids, &mut batch)
        .expect("forward")
        .to_vec2::<f32>()
        .expect("logits");
    (first..ids.len())
        .map(|t| {
            let row = &logits[t - 1];
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let lse = max
                + row
                    .iter()
                    .map(|&x| (x as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            row[ids[t] as usize] as f64 - lse
        })
        .sum()
}

#[test]
fn loglikelihood_equals_log_softmax_of_a_plain_forward() {
    let (model, tok) = smollm2();
    let context = "Question: Which gas do plants take in from the air to make food?\nAnswer:";
    let choices = [" carbon dioxide", " oxygen", " nitrogen"];
    let mut scorer = LayeredScorer::new(&model);
    let mut got = Vec::new();
    for (i, choice) in choices.iter().enumerate() {
        let (ctx, cont) = encode_pair(&tok, context, choice).expect("encode");
        let before = scorer.tokens_forwarded();
        let ll = scorer.loglikelihood(&ctx, &cont).expect("ll");
        let forwarded = scorer.tokens_forwarded() - before;
        // The first choice runs everything but the last token; later ones reuse the context
        // and run its last token again, then the continuation but its last token.
        let want_forwarded = if i == 0 {
            ctx.len() + cont.len() - 1
        } else {
            cont.len()
        };
        assert_eq!(forwarded, want_forwarded, "{choice:?}");

        let whole: Vec<u32> = ctx.iter().chain(&cont).copied().collect();
        let reference = reference_ll(&model, &whole, ctx.len());
        assert!(
            (ll - reference).abs() < LL_TOLERANCE,
            "{choice:?}: scorer {ll} vs plain forward {reference}"
        );
        assert!(ll < 0.0);
        got.push(ll);
    }
    eprintln!("log-likelihoods: {got:?}");
    // The same pair again, from a cache that now holds another continuation, is unchanged.
    let (ctx, cont) = encode_pair(&tok, context, choices[0]).expect("encode");
    assert_eq!(scorer.loglikelihood(&ctx, &cont).expect("ll"), got[0]);
}

#[test]
fn twenty_arc_challenge_items() {
    let (model, tok) = smollm2();
    let items = load_mc(McTask::ArcChallenge, 20, Pick::First).expect("arc");
    let mut scorer = LayeredScorer::new(&model);
    let t = Instant::now();
    let score = score_mc(&items, &mut scorer, &tok).expect("score");
    let secs = t.elapsed().as_secs_f64();
    eprintln!(
        "ARC-Challenge, 20 items, smollm2-135m-instruct Q4_1: acc {}/{} = {:.2} ({:.2}..{:.2}), \
         acc_norm {}/{} = {:.2}; {:.3} s per item, {} tokens forwarded",
        score.correct,
        score.n,
        score.accuracy,
        score.ci95.0,
        score.ci95.1,
        score.correct_norm,
        score.n,
        score.accuracy_norm,
        secs / 20.0,
        scorer.tokens_forwarded()
    );
    assert_eq!(score.n, 20);
    assert_eq!(score.per_item.len(), 20);
    assert_eq!(score.per_item.iter().filter(|&&c| c).count(), score.correct);
    assert_eq!((score.correct, score.correct_norm), measured_counts());
}

/// Measured on this model and these 20 items (acc 0.10, acc_norm 0.25–0.30: a 135M model
/// near chance on the hardest ARC split, with a wide interval on 20 items). Scoring is
/// deterministic for a given kernel path, so any change to these counts is a change in the
/// numerics. The AVX-512 and AVX2 kernels sum the int8 dot products in different orders, and
/// one item's length-normalized choices are close enough for that to flip it.
fn measured_counts() -> (usize, usize) {
    match switchyard_kernels::cpu::simd_level() {
        // Measured on an AVX-512 VNNI machine.
        switchyard_kernels::cpu::SimdLevel::Avx512 => (2, 6),
        // Measured on an AMD EPYC with AVX2 and FMA (no AVX-512).
        _ => (2, 5),
    }
}
