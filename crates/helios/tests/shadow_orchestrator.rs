//! Shadow evaluation on real models: SmolLM2-135M (fast, weak on code) and
//! Qwen2.5-Coder-0.5B (slower, a coder), over a ShareGPT trace of prose, then code, then
//! prose again. With a quality bound of [`BOUND`] bits per byte above the best candidate on
//! the scored prompts, SmolLM2 is within it on prose and far outside it on code, so HELIOS
//! must move to the coder within a bounded number of requests after the phase change, and
//! back after the next one. Every request is answered by the serving model alone; the
//! scores come from the sampled prompts, never from a model's own output.
//!
//! Small settings keep it short: every prompt sampled, rounds of 2 prompts, decisions on the
//! last 4 scored prompts, 2 agreeing rounds before a switch, 4 output tokens per request. The
//! first test waits for each round's result before the next request, and the second holds
//! each request for its own round, so the bounds do not depend on the machine's speed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use switchyard_engine::{EngineConfig, EngineCore, EngineHandle};
use switchyard_eval::sharegpt::{exchanges_of_kind, PromptKind};
use switchyard_exits::ExitHeads;
use switchyard_helios::manifest::{DepthTelemetry, ExitHeadsKind, Manifest, ModelEntry};
use switchyard_helios::orchestrator::{CandidateEngine, HeliosPrompt, HeliosRequest, Orchestrator};
use switchyard_helios::policy::{Evaluation, Policy, PolicyConfig, ShadowConfig, Slo};
use switchyard_helios::shadow::ShadowScorer;
use switchyard_models::{LayeredModel, LoadOptions};
use switchyard_request::SamplingParams;
use switchyard_tokenizer::Tokenizer;
use switchyard_weights::WeightSource;

const QWEN: &str = "qwen2.5-coder-0.5b-instruct";
const SMOL: &str = "smollm2-135m-instruct";
/// Bits per byte above the best candidate's full depth on the round's prompts.
const BOUND: f64 = 0.2;
const ROUND: usize = 2;
const WINDOW: usize = 4;
const SWITCH_AFTER: usize = 2;
const PHASE: usize = 12;
const BUDGET: u64 = 1 << 30;

struct Opened {
    src: Arc<dyn WeightSource>,
    tok: Arc<Tokenizer>,
    path: std::path::PathBuf,
}

fn open(name: &str) -> Opened {
    let path = switchyard_zoo::ensure(name).expect("zoo model");
    let src = switchyard_weights::open(&path).expect("open");
    let tok = Arc::new(Tokenizer::from_source(&*src).expect("tokenizer"));
    Opened { src, tok, path }
}

fn entry(name: &str) -> ModelEntry {
    let (layers, exit, size, tps) = if name == QWEN {
        (24, 20, 491_400_064u64, 18.0)
    } else {
        (30, 25, 98_362_432u64, 55.0)
    };
    let depth = |d: usize, tps: f64| DepthTelemetry {
        depth: d,
        tokens_per_s: tps,
        ttft_ms: None,
        bits_per_byte: 1.0,
        memory_bytes: size * d as u64 / layers as u64,
        kv_bytes_per_token: None,
        joules_per_token: None,
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
            depth(exit, tps * layers as f64 / exit as f64),
            depth(layers, tps),
        ],
    }
}

fn candidate(m: &Opened, e: &ModelEntry) -> (CandidateEngine, ShadowScorer) {
    let lm = LayeredModel::load(Arc::clone(&m.src), &LoadOptions::default()).expect("load");
    let heads = ExitHeads::logit_lens(&lm, &e.name, &e.exit_layers).expect("heads");
    let eog = switchyard_engine::end_of_generation_tokens(&m.tok);
    let cfg = EngineConfig {
        memory_budget: BUDGET,
        ..EngineConfig::default()
    };
    let core = EngineCore::with_exit(lm, Box::new(heads), eog, cfg).expect("engine");
    let handle = EngineHandle::spawn(core, Arc::clone(&m.tok), &e.name).expect("start");
    let scorer =
        ShadowScorer::open(e, &m.path, Arc::clone(&m.src), Arc::clone(&m.tok)).expect("scorer");
    (
        CandidateEngine {
            name: e.name.clone(),
            handle,
        },
        scorer,
    )
}

/// How a trace's requests are sent.
#[derive(Clone, Copy, PartialEq)]
enum Pace {
    /// Each after the previous answer, and after every round's worth of requests that
    /// round's result (without holds, so the lag does not depend on the machine).
    RoundByRound,
    /// All at once, then their answers in order.
    AllAtOnce,
}

/// What a trace of `phase` prose, `phase` code and `phase` prose requests was served by, and
/// the orchestrator's counters and rounds.
fn serve_trace(
    phase: usize,
    shadow: ShadowConfig,
    pace: Pace,
) -> (
    Vec<String>,
    switchyard_helios::orchestrator::OrchestratorStats,
) {
    let data = switchyard_zoo::ensure("sharegpt").expect("sharegpt");
    let prose =
        exchanges_of_kind(&data, PromptKind::Prose, 2 * phase, 200..=1000, 1).expect("prose");
    let code = exchanges_of_kind(&data, PromptKind::Code, phase, 200..=1000, 1).expect("code");
    assert_eq!((prose.len(), code.len()), (2 * phase, phase));
    let trace: Vec<&(String, String)> = prose[..phase]
        .iter()
        .chain(&code)
        .chain(&prose[phase..])
        .collect();

    let entries = vec![entry(SMOL), entry(QWEN)];
    let repo = Manifest::new(entries.clone(), "test").expect("manifest");
    let (mut engines, mut scorers) = (Vec::new(), Vec::new());
    for e in &entries {
        let (c, s) = candidate(&open(&e.name), e);
        engines.push(c);
        scorers.push(s);
    }
    let handles: Vec<EngineHandle> = engines.iter().map(|e| e.handle.clone()).collect();
    let round = shadow.round;
    let config = PolicyConfig {
        evaluation: Evaluation::Shadow,
        min_kv_tokens: 256,
        shadow,
        ..PolicyConfig::default()
    };
    let slo = Slo {
        max_bits_per_byte_increase: Some(BOUND),
        ..Slo::default()
    };
    let policy = Policy::new(config, slo, BUDGET).expect("policy");
    let o = Orchestrator::start_with_scorers(repo, policy, engines, scorers).expect("start");

    let submit = |(prompt, answer): &(String, String)| {
        o.submit(HeliosRequest {
            prompt: HeliosPrompt::Text(prompt.clone()),
            params: SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(4)
            },
            reference: Some(answer.clone()),
        })
        .expect("submit")
    };
    let mut served = Vec::new();
    let mut record = |done: switchyard_helios::orchestrator::HeliosCompletion| {
        assert!(
            !done.evaluation,
            "shadow evaluation serves no evaluation block"
        );
        assert_eq!(done.completion.token_ids.len(), 4);
        served.push(done.model.to_string());
    };
    match pace {
        Pace::RoundByRound => {
            for (i, t) in trace.iter().enumerate() {
                record(submit(t).wait().expect("completion"));
                if (i + 1) % round == 0 {
                    wait_rounds(&o, ((i + 1) / round) as u64);
                }
            }
        }
        Pace::AllAtOnce => {
            let pending: Vec<_> = trace.iter().map(|t| submit(t)).collect();
            for p in pending {
                record(p.wait().expect("completion"));
            }
            wait_rounds(&o, trace.len().div_ceil(round) as u64);
        }
    }
    let stats = o.stats_blocking().expect("stats");
    o.shutdown_blocking();
    for h in &handles {
        let _ = h.shutdown().wait();
    }
    for r in &stats.shadow_rounds {
        eprintln!(
            "round at {}: serving {} best {:?} switched {} change point {}; {:?}",
            r.at_request,
            r.serving.model,
            r.best,
            r.switched,
            r.change_point,
            r.scores
                .iter()
                .map(|s| (
                    s.model.as_str(),
                    s.prompt_bits_per_byte.clone(),
                    s.reference_bits_per_byte.last().map(|x| x.1)
                ))
                .collect::<Vec<_>>()
        );
    }
    eprintln!("served: {served:?}");
    // Every round scored both candidates on the same text: the same bytes but for each
    // text's first token, which a model without a BOS cannot be scored on (as `eval ppl`).
    for r in &stats.shadow_rounds {
        assert_eq!(r.scores.len(), 2);
        let (a, b) = (r.scores[0].prompt_bytes, r.scores[1].prompt_bytes);
        assert!(a.abs_diff(b) <= 8 * round as u64, "{a} vs {b} bytes");
        assert!(r.scores.iter().all(|s| s.reference_bytes > 0));
    }
    let c = &stats.counters;
    assert_eq!(c.shadow_texts as usize, trace.len());
    assert_eq!(c.shadow_errors, 0);
    assert_eq!(c.evaluation_requests, 0);
    (served, stats)
}

#[test]
fn shadow_evaluation_follows_prose_then_code_then_prose() {
    let shadow = ShadowConfig {
        share: 1.0,
        sample_every: 1,
        round: ROUND,
        window: WINDOW,
        switch_after: SWITCH_AFTER,
        ..ShadowConfig::default()
    };
    let (served, stats) = serve_trace(PHASE, shadow, Pace::RoundByRound);

    // Prose first: the fast model, from offline telemetry.
    assert!(served[..PHASE].iter().all(|m| m == SMOL), "{served:?}");
    // Code: the first round holding a code prompt is a change point on which SmolLM2 breaks
    // the bound, so HELIOS moves at once, one round into the phase, and stays.
    let code_phase = &served[PHASE..2 * PHASE];
    let first = code_phase
        .iter()
        .position(|m| m == QWEN)
        .expect("switched to the coder");
    assert!(
        first <= ROUND,
        "switched {first} requests into code: {served:?}"
    );
    assert!(code_phase[first..].iter().all(|m| m == QWEN), "{served:?}");
    // Prose again: a change point too, but the coder breaks no bound there, so the way back
    // waits for SWITCH_AFTER agreeing rounds.
    let back = served[2 * PHASE..]
        .iter()
        .position(|m| m == SMOL)
        .expect("switched back");
    assert!(
        back <= ROUND * SWITCH_AFTER,
        "switched back {back} requests into prose: {served:?}"
    );
    let c = &stats.counters;
    assert_eq!(c.switches, 2, "{c:?}");
    assert_eq!(c.shadow_urgent_switches, 1, "{c:?}");
    assert!(c.shadow_change_points >= 2, "{c:?}");
    assert_eq!(c.shadow_rounds as usize, 3 * PHASE / ROUND);
    assert_eq!(c.held_requests, 0);
    // Without `drain_first` the old model is still resident when the new one has loaded.
    assert!(c.switch_overlap_bytes > 50 << 20, "{c:?}");
}

#[test]
fn held_requests_are_served_by_the_choice_their_own_prompt_makes() {
    // Every request is held for its own round. They arrive all at once: the first finds the
    // scorer idle, and each of the others waits for the rounds before its own. Switches
    // drain the old model first.
    let phase = 6;
    let shadow = ShadowConfig {
        share: 1.0,
        sample_every: 1,
        round: 1,
        window: WINDOW,
        switch_after: SWITCH_AFTER,
        hold_ms: 600_000,
        drain_first: true,
        ..ShadowConfig::default()
    };
    let (served, stats) = serve_trace(phase, shadow, Pace::AllAtOnce);
    assert!(served[..phase].iter().all(|m| m == SMOL), "{served:?}");
    // The first code request is scored before it is routed: the whole phase on the coder.
    assert!(
        served[phase..2 * phase].iter().all(|m| m == QWEN),
        "{served:?}"
    );
    // Back to SmolLM2 once SWITCH_AFTER rounds agree (the last of them is served by it; a
    // code prompt on which SmolLM2 is within the bound may have been the first).
    let back = served[2 * phase..]
        .iter()
        .position(|m| m == SMOL)
        .expect("switched back");
    assert!(back < SWITCH_AFTER, "{served:?}");
    assert!(
        served[2 * phase + back..].iter().all(|m| m == SMOL),
        "{served:?}"
    );
    let c = &stats.counters;
    assert_eq!(c.held_requests as usize, 3 * phase, "{c:?}");
    assert_eq!(c.hold_timeouts, 0, "{c:?}");
    assert!(c.hold_seconds > 0.0);
    assert_eq!(c.switches, 2, "{c:?}");
    // The old model finished its requests and released its layers before the new one
    // loaded, at both switches: a parked model keeps its final norm alone (a few KB; the
    // test above sees SmolLM2's whole 100 MB).
    assert!(c.switch_overlap_bytes < 64 << 10, "{c:?}");
}

/// Waits until `n` scoring rounds have finished.
fn wait_rounds(o: &Orchestrator, n: u64) {
    let t0 = Instant::now();
    loop {
        let s = o.stats_blocking().expect("stats");
        if s.counters.shadow_rounds + s.counters.shadow_errors >= n {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "round {n} did not finish"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
