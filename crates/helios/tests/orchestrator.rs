//! The orchestrator on real models (Qwen2.5-Coder-0.5B alone, then with SmolLM2-135M), with
//! logit-lens exits: the online evaluation serves real responses (the same tokens as the
//! candidate served directly), the PHT fills from them, the greedy partial load serves an
//! easy workload (repetition, confident at the exit) without a breach, and a hard workload
//! (open prose, unconfident there) makes it extend or switch. After an extend the tokens are
//! those of the model loaded at the deeper depth from the start, for a new request and for
//! the one running when the layers arrived.
//!
//! Small settings keep it short: 2 evaluation requests per candidate, a 16-token breach
//! window firing above 8 (above 5 for SmolLM2's exit, confident on more of the hard tokens),
//! 12-16 tokens per request. The drift detector's window is set past
//! the test's length so the breaches meet the counter, not an early re-profile.

use std::sync::{Arc, OnceLock};

use switchyard_engine::{EngineConfig, EngineCore, EngineHandle, EngineRequest};
use switchyard_exits::ExitHeads;
use switchyard_helios::manifest::{DepthTelemetry, ExitHeadsKind, Manifest, ModelEntry};
use switchyard_helios::orchestrator::{
    CandidateEngine, HeliosCompletion, HeliosPrompt, HeliosRequest, Orchestrator,
};
use switchyard_helios::policy::{DepthRule, Evaluation, Policy, PolicyConfig, RemedyMode, Slo};
use switchyard_models::{LayeredModel, LoadOptions};
use switchyard_request::SamplingParams;
use switchyard_tokenizer::Tokenizer;
use switchyard_weights::WeightSource;

const QWEN: &str = "qwen2.5-coder-0.5b-instruct";
const QWEN_EXIT: usize = 20;
const QWEN_LAYERS: usize = 24;
const SMOL: &str = "smollm2-135m-instruct";
const SMOL_EXIT: usize = 25;
const SMOL_LAYERS: usize = 30;
/// Qwen's logit lens at layer 20 gives 0.63-0.81 on continuing "a a a ...", mostly below
/// 0.6 on open prose.
const THRESHOLD: f32 = 0.6;
const BUDGET: u64 = 1 << 30;
const EASY_TOKENS: usize = 12;
const HARD_TOKENS: usize = 16;

struct Model {
    src: Arc<dyn WeightSource>,
    tok: Arc<Tokenizer>,
}

fn model(name: &'static str) -> &'static Model {
    static QWEN_M: OnceLock<Model> = OnceLock::new();
    static SMOL_M: OnceLock<Model> = OnceLock::new();
    let cell = if name == QWEN { &QWEN_M } else { &SMOL_M };
    cell.get_or_init(|| {
        let path = switchyard_zoo::ensure(name).expect("zoo model");
        let src = switchyard_weights::open(&path).expect("open");
        let tok = Arc::new(Tokenizer::from_source(&*src).expect("tokenizer"));
        Model { src, tok }
    })
}

fn cfg() -> EngineConfig {
    EngineConfig {
        memory_budget: BUDGET,
        ..EngineConfig::default()
    }
}

/// An engine over `name` with logit-lens heads at `exits`.
fn engine(name: &'static str, exits: &[usize]) -> EngineHandle {
    let m = model(name);
    let lm = LayeredModel::load(Arc::clone(&m.src), &LoadOptions::default()).expect("load");
    let heads = ExitHeads::logit_lens(&lm, name, exits).expect("heads");
    let eog = switchyard_engine::end_of_generation_tokens(&m.tok);
    let core = EngineCore::with_exit(lm, Box::new(heads), eog, cfg()).expect("engine");
    EngineHandle::spawn(core, Arc::clone(&m.tok), name).expect("start")
}

fn depth(d: usize, layers: usize, size: u64, tps: f64, bpb: f64) -> DepthTelemetry {
    DepthTelemetry {
        depth: d,
        tokens_per_s: tps,
        ttft_ms: None,
        bits_per_byte: bpb,
        memory_bytes: size * d as u64 / layers as u64,
        kv_bytes_per_token: None,
        joules_per_token: None,
    }
}

/// Offline telemetry of the order `switchyard profile` measures on this machine; the
/// evaluation's measurements replace it.
fn entry(name: &str) -> ModelEntry {
    let (layers, exit, size, tps) = if name == QWEN {
        (QWEN_LAYERS, QWEN_EXIT, 491_400_064, 18.0)
    } else {
        (SMOL_LAYERS, SMOL_EXIT, 98_362_432, 55.0)
    };
    ModelEntry {
        name: name.into(),
        path: None,
        url: None,
        remote_model: None,
        tokenizer: None,
        context_length: None,
        size_bytes: size,
        layers,
        exit_layers: vec![exit],
        exit_heads: Some(ExitHeadsKind::LogitLens),
        profile: None,
        depths: vec![
            depth(exit, layers, size, tps * layers as f64 / exit as f64, 1.6),
            depth(layers, layers, size, tps, 1.1),
        ],
    }
}

fn policy(remedy: RemedyMode, cbc_max: usize) -> Policy {
    let mut c = PolicyConfig {
        eval_requests: 2,
        cbc_window: 16,
        cbc_max,
        threshold: THRESHOLD,
        remedy,
        reprofile_interval: 1000,
        min_kv_tokens: 256,
        evaluation: Evaluation::Serial,
        depth_rule: DepthRule::Coverage,
        ..PolicyConfig::default()
    };
    c.drift.window = 1_000_000;
    Policy::new(c, Slo::default(), BUDGET).expect("policy")
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(n)
    }
}

fn easy(i: usize) -> String {
    "a ".repeat(16 + 2 * i).trim_end().to_string()
}

const HARD: [&str; 6] = [
    "Write a poem about the sea in the style of Emily Dickinson, with slant rhymes:",
    "The capital of France is",
    "Explain why the sky appears blue at noon and red at sunset.",
    "List three surprising facts about octopuses and their nervous system.",
    "Describe the smell of a library after rain to someone who has never read a book.",
    "What would a medieval blacksmith think of a modern skyscraper?",
];

fn ask(o: &Orchestrator, text: &str, n: usize) -> HeliosCompletion {
    o.submit(HeliosRequest::new(
        HeliosPrompt::Text(text.to_string()),
        greedy(n),
    ))
    .expect("submit")
    .wait()
    .expect("completion")
}

/// Greedy tokens of `prompt` (ids) on a plain engine at full depth.
fn direct(reference: &EngineHandle, prompt: Vec<u32>, n: usize) -> Vec<u32> {
    reference
        .add_request(EngineRequest {
            prompt,
            params: greedy(n),
        })
        .expect("add")
        .wait()
        .expect("reference")
        .token_ids
}

fn ids(name: &'static str, text: &str) -> Vec<u32> {
    model(name).tok.encode(text, true, true).expect("encode")
}

#[test]
fn qwen_alone_evaluates_serves_partially_and_extends_to_the_full_models_tokens() {
    let repo = Manifest::new(vec![entry(QWEN)], "test").expect("manifest");
    let o = Orchestrator::start(
        repo,
        policy(RemedyMode::ExtendOnly, 8),
        vec![CandidateEngine {
            name: QWEN.into(),
            handle: engine(QWEN, &[QWEN_EXIT]),
        }],
    )
    .expect("orchestrator");
    let reference = EngineHandle::start(
        LayeredModel::load(Arc::clone(&model(QWEN).src), &LoadOptions::default()).expect("load"),
        Arc::clone(&model(QWEN).tok),
        cfg(),
        QWEN,
    )
    .expect("reference");

    // Online evaluation: the first 2 requests, at full depth, exits probed.
    for i in 0..2 {
        let c = ask(&o, &easy(i), EASY_TOKENS);
        assert!(c.evaluation, "request {i} is part of the evaluation");
        assert_eq!(&*c.model, QWEN);
        assert!(c.depths.iter().all(|&d| d == QWEN_LAYERS), "{:?}", c.depths);
        let want = direct(&reference, ids(QWEN, &easy(i)), EASY_TOKENS);
        assert_eq!(c.completion.token_ids, want, "evaluation request {i}");
    }
    let s = o.stats_blocking().expect("stats");
    assert_eq!(s.counters.profiles, 1);
    let row = s.pht.get(QWEN, QWEN_LAYERS).expect("PHT row");
    eprintln!("PHT {}", s.pht.to_json().expect("json"));
    assert_eq!(
        (row.requests, row.exits.total()),
        (2, 2 * EASY_TOKENS as u64)
    );
    assert!(row.tokens_per_s > 1.0, "{}", row.tokens_per_s);
    assert!(
        row.bits_per_byte > 0.0 && row.bits_per_byte < 2.0,
        "{}",
        row.bits_per_byte
    );
    assert!(row.extend_ms_per_layer > 0.0);
    assert!(
        row.exits.share_at_or_below(QWEN_EXIT) >= 0.7,
        "{:?}",
        row.exits
    );
    let serving = s.serving.expect("serving");
    assert_eq!((serving.model.as_str(), serving.depth), (QWEN, QWEN_EXIT));

    // Easy traffic at the partial load: confident, no remedy.
    for i in 2..4 {
        let c = ask(&o, &easy(i), EASY_TOKENS);
        assert!(!c.evaluation);
        assert!(c.depths.iter().all(|&d| d == QWEN_EXIT), "{:?}", c.depths);
    }
    let s = o.stats_blocking().expect("stats");
    assert_eq!((s.counters.extends, s.counters.cbc_fired), (0, 0));
    assert!(s.counters.tokens_observed >= 2 * EASY_TOKENS as u64 - 2);

    // Hard traffic: breaches fire the counter and the only remedy allowed is extend.
    let mut extended = None;
    for text in HARD.iter().take(4) {
        let c = ask(&o, text, HARD_TOKENS);
        if c.depths.contains(&QWEN_LAYERS) {
            extended = Some((text, c));
            break;
        }
    }
    let (text, c) = extended.expect("the hard prompts extended qwen");
    let s = o.stats_blocking().expect("stats");
    eprintln!("counters {:?}", s.counters);
    assert_eq!((s.counters.extends, s.counters.switches), (1, 0));
    assert!(s.counters.extend_seconds > 0.0);
    assert_eq!(s.serving.expect("serving").depth, QWEN_LAYERS);

    // The request running when the layers arrived: from there on, the full model's tokens
    // for the same history (the engine recomputed layers 20..24 of its positions).
    let k = c
        .depths
        .iter()
        .position(|&d| d == QWEN_LAYERS)
        .expect("extended");
    let mut history = ids(QWEN, text);
    history.extend_from_slice(&c.completion.token_ids[..k]);
    let want = direct(&reference, history, HARD_TOKENS - k);
    assert_eq!(&c.completion.token_ids[k..], &want[..], "after the extend");

    // A new request after the extend: the full model's tokens.
    let c = ask(&o, HARD[5], HARD_TOKENS);
    assert!(c.depths.iter().all(|&d| d == QWEN_LAYERS));
    assert_eq!(
        c.completion.token_ids,
        direct(&reference, ids(QWEN, HARD[5]), HARD_TOKENS)
    );
    o.shutdown_blocking();
}

#[test]
fn two_candidates_are_evaluated_in_turn_and_hard_traffic_extends_or_switches() {
    let repo = Manifest::new(vec![entry(QWEN), entry(SMOL)], "test").expect("manifest");
    let o = Orchestrator::start(
        repo,
        // SmolLM2's logit lens at layer 25 passes 0.6 on about 60% of open-prose tokens:
        // the counter fires above 5 of 16 here.
        policy(RemedyMode::Dynamic, 5),
        vec![
            CandidateEngine {
                name: QWEN.into(),
                handle: engine(QWEN, &[QWEN_EXIT]),
            },
            CandidateEngine {
                name: SMOL.into(),
                handle: engine(SMOL, &[SMOL_EXIT]),
            },
        ],
    )
    .expect("orchestrator");
    let order = o.candidates().to_vec();
    assert_eq!(order.len(), 2);
    // Evaluation: 2 requests per candidate, in the selection's order, each at full depth
    // and with the tokens the candidate gives when served directly.
    for i in 0..4 {
        let c = ask(&o, &easy(i), EASY_TOKENS);
        let name: &'static str = if *c.model == *QWEN { QWEN } else { SMOL };
        assert!(c.evaluation);
        assert_eq!(*c.model, *order[i / 2], "request {i}");
        let full = if name == QWEN {
            QWEN_LAYERS
        } else {
            SMOL_LAYERS
        };
        assert!(c.depths.iter().all(|&d| d == full));
        let reference = EngineHandle::start(
            LayeredModel::load(Arc::clone(&model(name).src), &LoadOptions::default())
                .expect("load"),
            Arc::clone(&model(name).tok),
            cfg(),
            name,
        )
        .expect("reference");
        let want = direct(&reference, ids(name, &easy(i)), EASY_TOKENS);
        assert_eq!(
            c.completion.token_ids, want,
            "evaluation request {i} on {name}"
        );
        let _ = reference.shutdown().wait();
    }
    let s = o.stats_blocking().expect("stats");
    let json = s.pht.to_json().expect("json");
    eprintln!("PHT ({} bytes) {json}", json.len());
    assert!(json.len() < 1024);
    assert_eq!(s.pht.rows().len(), 2);
    assert_eq!(s.counters.evaluation_requests, 4);
    let serving = s.serving.expect("serving");
    eprintln!("serving {serving:?}");

    for text in HARD.iter().cycle().take(8) {
        ask(&o, text, HARD_TOKENS);
        let c = o.stats_blocking().expect("stats").counters;
        if c.extends + c.switches > 0 {
            break;
        }
    }
    let s = o.stats_blocking().expect("stats");
    eprintln!("counters {:?} serving {:?}", s.counters, s.serving);
    assert!(s.counters.cbc_fired >= 1);
    assert_eq!(s.counters.extends + s.counters.switches, 1);
    assert_eq!(s.counters.cbc_unremedied, 0);
    let after = s.serving.expect("serving");
    assert_ne!(after, serving, "the remedy changed the model or the depth");
    // Every request ran to the end before the next was sent: nothing was left to drain.
    assert_eq!(s.counters.switch_drained + s.counters.switch_moved, 0);
    o.shutdown_blocking();
}
