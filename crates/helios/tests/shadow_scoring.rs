//! Shadow scoring on SmolLM2-135M with logit-lens exits at layers 10 and 20:
//!
//! * at full depth it gives the bits per byte `switchyard eval ppl` gives on the same text
//!   (within 1e-3);
//! * streaming the layers holds one layer at a time (byte counts) and gives the same nats,
//!   at every depth, as the resident model run layer after layer;
//! * a reference answer is scored after its prompt without changing the prompt's score, and
//!   a batch of texts scores each text as it scores alone.

use std::sync::Arc;

use switchyard_engine::{score_text, ScoreOptions};
use switchyard_exits::confidence::ConfidenceMeasure;
use switchyard_exits::ExitHeads;
use switchyard_helios::shadow::{ScoreSettings, ShadowScorer, ShadowText, Throttle};
use switchyard_models::{DenseKv, ForwardBatch, LayeredModel, LoadOptions};
use switchyard_tokenizer::Tokenizer;

const SMOL: &str = "smollm2-135m-instruct";
const EXITS: &[usize] = &[10, 20];
const PROSE: &str = "The old harbour town woke slowly. Fishing boats knocked against the \
pier while gulls argued over the night's catch, and the baker on the corner pulled the first \
loaves from an oven that had been burning since four. Nobody in the town remembered a morning \
that had started any other way.\n";
const CODE: &str = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    \
a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n";
const ANSWER: &str = "It sounds like a quiet place to live.";

fn settings() -> ScoreSettings {
    ScoreSettings {
        threshold: 0.8,
        measure: ConfidenceMeasure::MaxProb,
        max_text_bytes: 4096,
        exit_stride: 1,
    }
}

fn text(prompt: &str, reference: Option<&str>) -> ShadowText {
    ShadowText {
        prompt: prompt.into(),
        reference: reference.map(str::to_string),
    }
}

struct Smol {
    src: Arc<dyn switchyard_weights::WeightSource>,
    tok: Arc<Tokenizer>,
}

fn smol() -> Smol {
    let path = switchyard_zoo::ensure(SMOL).expect("zoo model");
    let src = switchyard_weights::open(&path).expect("open");
    let tok = Arc::new(Tokenizer::from_source(&*src).expect("tokenizer"));
    Smol { src, tok }
}

fn scorer(m: &Smol) -> ShadowScorer {
    let model = LayeredModel::load(
        Arc::clone(&m.src),
        &LoadOptions {
            layers: Some(0),
            ..LoadOptions::default()
        },
    )
    .expect("load");
    let heads = ExitHeads::logit_lens(&model, SMOL, EXITS).expect("heads");
    ShadowScorer::new(SMOL, model, Arc::clone(&m.tok), heads).expect("scorer")
}

/// Σ -ln p of `text`'s tokens at each of `depths`, from the resident model run layer by layer.
fn resident_nats(model: &LayeredModel, tok: &Tokenizer, text: &str, depths: &[usize]) -> Vec<f64> {
    let heads = ExitHeads::logit_lens(model, SMOL, EXITS).expect("heads");
    let ids = tok.encode(text, true, false).expect("encode");
    let inputs = &ids[..ids.len() - 1];
    let mut kv = DenseKv::new(model.n_layers(), model.spec().kv_row_len());
    let mut h = model.embed(inputs).expect("embed");
    let mut done = 0;
    let mut out = Vec::new();
    for &d in depths {
        let mut batch = ForwardBatch::single(&mut kv, 0, inputs.len());
        h = model
            .forward_layers(h, done..d, &mut batch)
            .expect("forward");
        done = d;
        let logits: Vec<Vec<f32>> = heads
            .logits(model, d, &h)
            .expect("logits")
            .to_vec2()
            .expect("rows");
        let nats: f64 = logits
            .iter()
            .zip(&ids[1..])
            .map(|(row, &t)| switchyard_exits::confidence::nll(row, t))
            .sum();
        out.push(nats);
    }
    out
}

#[test]
fn shadow_scores_equal_eval_ppl_and_the_resident_model() {
    let m = smol();
    let mut s = scorer(&m);
    assert_eq!(s.depths(), &[10, 20, 30]);
    let mut throttle = Throttle::new(1.0);
    let alone = s
        .score(&[text(PROSE, None)], &settings(), &mut throttle)
        .expect("score");

    // Full depth: the number `switchyard eval ppl` prints for the same text.
    let full = LayeredModel::load(Arc::clone(&m.src), &LoadOptions::default()).expect("load");
    let ppl = score_text(&full, &m.tok, PROSE, ScoreOptions::default(), |_, _| {}).expect("ppl");
    let bpb = alone.prompt.bits_per_byte(30).expect("full depth");
    assert_eq!(alone.prompt.bytes, ppl.bytes_scored as u64);
    assert!(
        (bpb - ppl.bits_per_byte).abs() < 1e-3,
        "shadow {bpb} vs eval ppl {}",
        ppl.bits_per_byte
    );

    // Every depth: the resident model's nats, the layers streamed one at a time.
    let want = resident_nats(&full, &m.tok, PROSE, &[10, 20, 30]);
    for (&(d, got), w) in alone.prompt.nats.iter().zip(&want) {
        assert!(
            (got - w).abs() <= 1e-6 * w.abs().max(1.0),
            "depth {d}: streamed {got} vs resident {w}"
        );
    }
    assert!(
        alone.prompt.bits_per_byte(10) > alone.prompt.bits_per_byte(30),
        "an early exit scores worse than full depth"
    );
    assert_eq!(alone.peak_layers_resident, 1, "one layer at a time");
    let largest = (0..30).map(|l| full.layer_bytes(l)).max().expect("layers");
    assert_eq!(alone.peak_layer_bytes, largest);
    // The tied embedding is the head: 49,152 rows read in six slices of 8,192, one at a
    // time; between batches the scorer holds the final norm (576 f32) and nothing else.
    let head = full.resident_bytes().embedding;
    assert_eq!(alone.peak_head_bytes * 6, head);
    assert_eq!(s.resident_bytes(), 576 * 4);
    assert!(alone.peak_activation_bytes > 0);
    assert_eq!(alone.exits.total(), alone.prompt.tokens);
    assert!(
        alone.busy_s > 0.0 && alone.prefill_tokens_per_s > 0.0,
        "{alone:?}"
    );

    // A batch of texts, one with a reference: each prompt scores as it does alone.
    // Exits read every 4th position: full depth is unchanged, each exit is full depth plus
    // the difference measured on a quarter of the positions, and the histogram counts those.
    let strided = s
        .score(
            &[text(PROSE, None)],
            &ScoreSettings {
                exit_stride: 4,
                ..settings()
            },
            &mut throttle,
        )
        .expect("strided");
    assert_eq!(strided.prompt.nats[2], alone.prompt.nats[2]);
    for i in 0..2 {
        let (d, got) = strided.prompt.nats[i];
        let want = alone.prompt.nats[i].1;
        assert!(
            (got - want).abs() <= 0.1 * want,
            "depth {d}: strided {got} vs every position {want}"
        );
    }
    assert_eq!(strided.exits.total(), alone.prompt.tokens.div_ceil(4));

    let batch = s
        .score(
            &[text(CODE, None), text(PROSE, Some(ANSWER))],
            &settings(),
            &mut throttle,
        )
        .expect("batch");
    let code = s
        .score(&[text(CODE, None)], &settings(), &mut throttle)
        .expect("code");
    for i in 0..3 {
        let sum = code.prompt.nats[i].1 + alone.prompt.nats[i].1;
        let got = batch.prompt.nats[i].1;
        assert!(
            (got - sum).abs() <= 1e-6 * sum,
            "depth {}: batch {got} vs alone {sum}",
            batch.prompt.nats[i].0
        );
    }
    assert_eq!(batch.prompt.bytes, code.prompt.bytes + alone.prompt.bytes);
    assert_eq!(batch.reference.bytes, ANSWER.len() as u64);
    let ref_bpb = batch.reference.bits_per_byte(30).expect("reference");
    assert!(ref_bpb > 0.0 && ref_bpb.is_finite(), "{ref_bpb}");
    assert_eq!(code.reference.bits_per_byte(30), None, "no reference given");
    assert_eq!(s.depths(), &[10, 20, 30]);
}

#[test]
fn the_throttle_sleeps_its_share() {
    let m = smol();
    let mut s = scorer(&m);
    let mut throttle = Throttle::new(0.5);
    let r = s
        .score(&[text(PROSE, None)], &settings(), &mut throttle)
        .expect("score");
    // Half the time sleeping: the wall time is at least twice the compute.
    assert!((throttle.share_used() - 0.5).abs() < 1e-9);
    assert!(
        r.wall_s >= 2.0 * r.busy_s * 0.99,
        "{} vs {}",
        r.wall_s,
        r.busy_s
    );
}

/// A scorer working beside the serving engine, on the same cores, within a share of 0.25:
/// every request is served in full while it scores, and the throttle keeps the scorer to its
/// share. How much the scorer delays serving is a speed figure: `bench helios` reports it
/// (the share used and each system's TTFT/TPOT), not this test.
#[test]
fn a_throttled_scorer_beside_serving_keeps_its_share() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use switchyard_engine::{EngineConfig, EngineHandle, EngineRequest};

    let m = smol();
    let full = LayeredModel::load(Arc::clone(&m.src), &LoadOptions::default()).expect("load");
    let engine = EngineHandle::start(full, Arc::clone(&m.tok), EngineConfig::default(), SMOL)
        .expect("engine");
    let prompt = m.tok.encode(PROSE, true, false).expect("encode");
    let serve = || {
        let streams: Vec<_> = (0..4)
            .map(|_| {
                engine
                    .add_request(EngineRequest {
                        prompt: prompt.clone(),
                        params: switchyard_request::SamplingParams {
                            ignore_eos: true,
                            ..switchyard_request::SamplingParams::greedy(48)
                        },
                    })
                    .expect("added")
            })
            .collect();
        for s in streams {
            assert_eq!(s.wait().expect("served").token_ids.len(), 48);
        }
    };
    let mut s = scorer(&m);
    let stop = AtomicBool::new(false);
    let mut throttle = Throttle::new(0.25);
    let scored = std::thread::scope(|scope| {
        let worker = scope.spawn(|| {
            let mut rounds = 0;
            while !stop.load(Ordering::Relaxed) {
                s.score(&[text(PROSE, None)], &settings(), &mut throttle)
                    .expect("score");
                rounds += 1;
            }
            rounds
        });
        serve();
        stop.store(true, Ordering::Relaxed);
        worker.join().expect("scorer")
    });
    assert!(scored >= 1, "the scorer ran beside serving");
    let used = throttle.share_used();
    assert!((used - 0.25).abs() < 0.01, "share used {used}");
}

/// Scoring speed on Qwen2.5-Coder-0.5B (prints numbers; run under a profiler).
#[test]
#[ignore = "timing; prints numbers"]
fn qwen_scoring_timing() {
    let path = switchyard_zoo::ensure("qwen2.5-coder-0.5b-instruct").expect("zoo model");
    let src = switchyard_weights::open(&path).expect("open");
    let tok = Arc::new(Tokenizer::from_source(&*src).expect("tokenizer"));
    let model = LayeredModel::load(
        src,
        &LoadOptions {
            layers: Some(0),
            ..LoadOptions::default()
        },
    )
    .expect("load");
    let exits: Vec<usize> = (1..8).map(|k| 3 * k).collect();
    let heads = ExitHeads::logit_lens(&model, "qwen", &exits).expect("heads");
    let mut s = ShadowScorer::new("qwen", model, tok, heads).expect("scorer");
    let texts: Vec<ShadowText> = (0..3).map(|_| text(&PROSE.repeat(3), None)).collect();
    let mut throttle = Throttle::new(1.0);
    for stride in [usize::MAX, 4, 1] {
        let r = s
            .score(
                &texts,
                &ScoreSettings {
                    exit_stride: stride,
                    ..settings()
                },
                &mut throttle,
            )
            .expect("score");
        println!(
            "exit_stride {stride}: {} tokens in {:.2} s, {:.1} tokens/s",
            r.prompt.tokens, r.busy_s, r.prefill_tokens_per_s
        );
    }
}
