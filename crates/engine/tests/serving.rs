//! The serving engine on a real model (smollm2-135m-instruct): continuous batching, chunked
//! prefill, preemption, prefix caching and raising the depth all give, token for token and
//! log-probability for log-probability (bit for bit), what running each sequence alone gives.

use std::collections::HashMap;
use std::sync::Arc;

use switchyard_engine::generate::last_logits_at_depth;
use switchyard_engine::kv::{activation_bytes, BLOCK_TOKENS};
use switchyard_engine::sampler::{argmax, log_softmax_at};
use switchyard_engine::scheduler::AdmissionPolicy;
use switchyard_engine::{
    EngineConfig, EngineCore, EngineError, EngineRequest, RequestId, SchedulerConfig,
};
use switchyard_models::{DenseKv, LayeredModel, LoadOptions};
use switchyard_request::{FinishReason, SamplingParams};
use switchyard_weights::WeightSource;

fn source() -> Arc<dyn WeightSource> {
    let path = switchyard_zoo::ensure("smollm2-135m-instruct").expect("model");
    switchyard_weights::open(path).expect("open")
}

fn load(src: &Arc<dyn WeightSource>, layers: Option<usize>) -> LayeredModel {
    let opts = LoadOptions {
        layers,
        ..LoadOptions::default()
    };
    LayeredModel::load(Arc::clone(src), &opts).expect("load")
}

/// Fixed ids spread over the vocabulary (as the model tests use).
fn fixed_tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 100 + (i * 7919 + 13 + salt * 104_729) % 5000)
        .collect()
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    }
}

/// Greedy tokens and their log-probabilities for `prompt` alone, with a dense cache and
/// one-shot prefill, through the first `depth` layers.
fn alone(model: &LayeredModel, prompt: &[u32], n: usize, depth: usize) -> (Vec<u32>, Vec<f32>) {
    // The engine's default f16 blocks hold each value rounded to half precision.
    let mut kv = DenseKv::rounded_to_f16(model.n_layers(), model.spec().kv_row_len());
    let mut logits = last_logits_at_depth(model, &mut kv, 0, prompt, depth).expect("prefill");
    let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
    for i in 0..n {
        let t = argmax(&logits);
        tokens.push(t as u32);
        logprobs.push(log_softmax_at(&logits, t));
        if i + 1 < n {
            let pos = prompt.len() + i;
            logits = last_logits_at_depth(model, &mut kv, pos, &[t as u32], depth).expect("decode");
        }
    }
    (tokens, logprobs)
}

fn config(max_batched_tokens: usize, prefix_caching: bool) -> EngineConfig {
    EngineConfig {
        memory_budget: 1 << 30,
        scheduler: SchedulerConfig {
            max_batched_tokens,
            prefix_caching,
            ..SchedulerConfig::default()
        },
        ..EngineConfig::default()
    }
}

/// A budget that leaves exactly `blocks` KV blocks beside `model`'s weights.
fn budget_for_blocks(model: &LayeredModel, cfg: &SchedulerConfig, blocks: u64) -> u64 {
    let spec = model.spec();
    let workspace = activation_bytes(
        spec,
        cfg.max_step_tokens(spec.context_length),
        cfg.max_num_seqs,
    ) as u64;
    // K and V, 2 bytes a value in the default f16 blocks.
    let block_bytes = (2 * BLOCK_TOKENS * spec.kv_row_len() * 2) as u64;
    model.resident_bytes().total() as u64 + workspace + blocks * block_bytes
}

#[derive(Debug, Default, Clone, PartialEq)]
struct Out {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    finish: Option<FinishReason>,
    cached: usize,
}

/// Steps `core` until every request has arrived (at its step) and finished; checks the memory
/// budget after every step. Returns each request's output and the largest batch.
fn drive(
    core: &mut EngineCore,
    arrivals: &[(usize, Vec<u32>, usize)],
) -> (HashMap<u64, Out>, usize) {
    let mut outs: HashMap<u64, Out> = HashMap::new();
    let mut largest = 0;
    for step in 0..10_000 {
        for (i, (at, prompt, max)) in arrivals.iter().enumerate() {
            if *at == step {
                core.add_request(
                    RequestId(i as u64),
                    EngineRequest {
                        prompt: prompt.clone(),
                        params: greedy(*max),
                    },
                )
                .expect("add");
            }
        }
        if !core.has_work() && arrivals.iter().all(|a| a.0 <= step) {
            return (outs, largest);
        }
        let r = core.step();
        assert!(r.failed.is_empty(), "{:?}", r.failed);
        largest = largest.max(r.batch);
        core.usage().check().expect("within the budget");
        for o in r.outputs {
            let e = outs.entry(o.id.0).or_default();
            if let Some(t) = o.token {
                e.tokens.push(t);
                e.logprobs.push(o.logprob);
            }
            e.cached = e.cached.max(o.cached_tokens);
            if o.finish.is_some() {
                assert!(e.finish.is_none(), "finished twice");
                e.finish = o.finish;
            }
        }
    }
    panic!("the engine did not finish");
}

fn assert_bits(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}: logprob {i}: {x} vs {y}");
    }
}

#[test]
fn batched_sequences_joining_at_different_steps_match_each_alone() {
    let src = source();
    let model = load(&src, None);
    let lens = [5, 17, 33, 48, 64, 80, 100, 130];
    let joins = [0, 0, 1, 2, 3, 5, 8, 13];
    let outs = [12, 8, 16, 10, 6, 12, 9, 7];
    let arrivals: Vec<(usize, Vec<u32>, usize)> = (0..8)
        .map(|i| (joins[i], fixed_tokens(lens[i], i as u32), outs[i]))
        .collect();
    let want: Vec<(Vec<u32>, Vec<f32>)> = arrivals
        .iter()
        .map(|(_, p, n)| alone(&model, p, *n, 30))
        .collect();

    // 64 tokens a step: the longer prompts are chunked and share steps with decode tokens.
    let mut core = EngineCore::new(model, Vec::new(), config(64, false)).expect("engine");
    let (got, largest) = drive(&mut core, &arrivals);
    for (i, (tokens, logprobs)) in want.iter().enumerate() {
        let g = &got[&(i as u64)];
        assert_eq!(&g.tokens, tokens, "sequence {i}");
        assert_bits(&g.logprobs, logprobs, &format!("sequence {i}"));
        assert_eq!(g.finish, Some(FinishReason::Length));
    }
    assert!(largest >= 5, "largest batch {largest}");
    let c = core.stats().counters;
    assert_eq!(c.prompt_tokens_computed, lens.iter().sum::<usize>() as u64);
    // Every output token but the last of each sequence is fed back once.
    assert_eq!(
        c.decode_tokens_computed,
        (outs.iter().sum::<usize>() - 8) as u64
    );
    assert_eq!((c.recomputed_tokens, c.preemptions), (0, 0));
    assert_eq!(c.largest_step_tokens, 64);
}

#[test]
fn preempted_sequences_recompute_to_the_same_tokens() {
    let src = source();
    let model = load(&src, None);
    let arrivals: Vec<(usize, Vec<u32>, usize)> = (0..3)
        .map(|i| (0, fixed_tokens(20 + 3 * i, 10 + i as u32), 40))
        .collect();
    let want: Vec<(Vec<u32>, Vec<f32>)> = arrivals
        .iter()
        .map(|(_, p, n)| alone(&model, p, *n, 30))
        .collect();
    // 8 blocks per layer: three sequences growing to 60+ positions (4 blocks per layer each)
    // cannot all stay.
    let mut cfg = config(512, false);
    cfg.scheduler.admission = AdmissionPolicy::Optimistic;
    cfg.memory_budget = budget_for_blocks(&model, &cfg.scheduler, 8 * 30);
    let mut core = EngineCore::new(model, Vec::new(), cfg).expect("engine");
    assert_eq!(core.stats().kv_blocks_total, 240);
    let (got, _) = drive(&mut core, &arrivals);
    for (i, (tokens, logprobs)) in want.iter().enumerate() {
        assert_eq!(&got[&(i as u64)].tokens, tokens, "sequence {i}");
        assert_bits(
            &got[&(i as u64)].logprobs,
            logprobs,
            &format!("sequence {i}"),
        );
    }
    let s = core.stats();
    assert!(s.counters.preemptions >= 1, "{:?}", s.counters);
    assert!(s.counters.recomputed_tokens > 0);
    assert_eq!(s.kv_blocks_used, 0);
    eprintln!(
        "preemptions {}, recomputed tokens {}",
        s.counters.preemptions, s.counters.recomputed_tokens
    );
}

#[test]
fn a_prefix_cache_hit_gives_the_cold_logits_and_skips_the_cached_tokens() {
    let src = source();
    let system = fixed_tokens(48, 7);
    let with_tail = |salt, n| {
        let mut p = system.clone();
        p.extend(fixed_tokens(n, salt));
        p
    };
    let (a, b) = (with_tail(1, 9), with_tail(2, 14));

    // Cold: B alone in a fresh engine.
    let mut cold =
        EngineCore::new(load(&src, None), Vec::new(), config(512, true)).expect("engine");
    let (cold_out, _) = drive(&mut cold, &[(0, b.clone(), 6)]);
    assert_eq!(cold.stats().counters.prompt_tokens_computed, 62);

    // Warm: A first, then B reuses the 3 shared blocks (48 tokens).
    let mut warm =
        EngineCore::new(load(&src, None), Vec::new(), config(512, true)).expect("engine");
    let (warm_out, _) = drive(&mut warm, &[(0, a, 6), (10, b, 6)]);
    let s = warm.stats();
    assert_eq!(warm_out[&1].cached, 48);
    assert_eq!(warm_out[&1].tokens, cold_out[&0].tokens);
    assert_bits(
        &warm_out[&1].logprobs,
        &cold_out[&0].logprobs,
        "warm vs cold",
    );
    // A's 57 prompt tokens, then only B's 14 uncached ones.
    assert_eq!(s.counters.prompt_tokens_computed, 57 + 14);
    assert_eq!(
        (s.prefix_cache_hit_tokens, s.prefix_cache_queried_tokens),
        (48, 57 + 62)
    );
}

#[test]
fn chunked_prefill_gives_the_one_shot_logits_while_decodes_flow() {
    let src = source();
    let long = fixed_tokens(100, 3);
    let short = fixed_tokens(6, 4);
    let mut one_shot =
        EngineCore::new(load(&src, None), Vec::new(), config(512, false)).expect("engine");
    let (a, _) = drive(&mut one_shot, &[(0, long.clone(), 5)]);
    assert_eq!(one_shot.stats().counters.largest_step_tokens, 100);

    let mut chunked =
        EngineCore::new(load(&src, None), Vec::new(), config(16, false)).expect("engine");
    // The short sequence decodes while the long prompt arrives and is prefilled 15 tokens a
    // step beside it.
    let (b, largest) = drive(&mut chunked, &[(0, short.clone(), 12), (2, long, 5)]);
    assert_eq!(b[&1].tokens, a[&0].tokens);
    assert_bits(&b[&1].logprobs, &a[&0].logprobs, "chunked vs one-shot");
    let (short_alone, _) = alone(chunked.model(), &short, 12, 30);
    assert_eq!(b[&0].tokens, short_alone);
    assert_eq!(largest, 2);
    assert_eq!(chunked.stats().counters.largest_step_tokens, 16);
}

#[test]
fn layers_added_to_a_running_model_give_the_full_models_logits_after_recomputation() {
    let src = source();
    let full = load(&src, None);
    let prompt = fixed_tokens(40, 5);
    let mut core =
        EngineCore::new(load(&src, Some(10)), Vec::new(), config(512, true)).expect("engine");
    assert_eq!((core.depth(), core.resident_layers()), (10, 10));
    let before = core.stats();
    core.add_request(
        RequestId(0),
        EngineRequest {
            prompt: prompt.clone(),
            params: greedy(15),
        },
    )
    .expect("add");
    let mut out = Out::default();
    let collect = |core: &mut EngineCore, out: &mut Out| {
        let r = core.step();
        assert!(r.failed.is_empty());
        core.usage().check().expect("within the budget");
        for o in r.outputs {
            out.tokens.extend(o.token);
            out.logprobs.extend(o.token.map(|_| o.logprob));
            out.finish = o.finish;
        }
    };
    while out.tokens.len() < 5 {
        collect(&mut core, &mut out);
    }
    // The first 5 tokens leave at layer 10 through the model's own head.
    let (lens_tokens, lens_logprobs) = alone(&full, &prompt, 5, 10);
    assert_eq!(out.tokens, lens_tokens);
    assert_bits(&out.logprobs, &lens_logprobs, "depth 10");

    // Layers 10..30 load on another thread while the engine holds the sequence.
    let (job, report) = core.begin_load(30).expect("room for 20 layers");
    assert!(report.preempted.is_empty());
    assert!(report.pool_blocks_freed > 0);
    let loaded = std::thread::spawn(move || {
        job.layers()
            .map(|l| job.load(l).expect("load layer"))
            .collect::<Vec<_>>()
    })
    .join()
    .expect("load thread");
    for l in loaded {
        core.install_layer(l).expect("install");
        core.usage()
            .check()
            .expect("within the budget while installing");
    }
    core.finish_load();
    core.set_depth(30).expect("depth 30");
    let s = core.stats();
    assert_eq!(s.layer_loads.len(), 20);
    let mean = s.layer_loads.iter().map(|l| l.secs).sum::<f64>() / 20.0;
    eprintln!(
        "one layer: {:.1} ms, {} bytes",
        mean * 1e3,
        s.layer_loads[0].bytes
    );
    assert_eq!(
        s.memory.weights_bytes,
        full.resident_bytes().total() as u64,
        "the weights are the full model's"
    );
    assert!(s.kv_blocks_total < before.kv_blocks_total);

    while out.finish.is_none() {
        collect(&mut core, &mut out);
    }
    // After the raise: the full model's continuation of prompt + the 5 depth-10 tokens.
    let mut history = prompt.clone();
    history.extend(&out.tokens[..5]);
    let (rest, rest_logprobs) = alone(&full, &history, 10, 30);
    assert_eq!(out.tokens[5..], rest[..]);
    assert_bits(&out.logprobs[5..], &rest_logprobs, "after the raise");
    // The 44 positions computed at depth 10 ran again (only layers 10..30 stored them).
    let c = core.stats().counters;
    assert_eq!(c.recomputed_tokens, 44);
    assert_eq!(c.prompt_tokens_computed, 40);
    assert_eq!(c.decode_tokens_computed, 14);
}

#[test]
fn prompts_that_can_never_run_are_refused_with_a_clear_error() {
    let src = source();
    let model = load(&src, None);
    let context = model.spec().context_length;
    let mut cfg = config(512, false);
    // 10 blocks per layer: 160 positions at full depth.
    cfg.memory_budget = budget_for_blocks(&model, &cfg.scheduler, 300);
    let mut core = EngineCore::new(model, Vec::new(), cfg).expect("engine");
    let add = |core: &mut EngineCore, id, n| {
        core.add_request(
            RequestId(id),
            EngineRequest {
                prompt: fixed_tokens(n, 1),
                params: greedy(4),
            },
        )
    };
    assert!(matches!(
        add(&mut core, 0, context),
        Err(EngineError::PromptTooLong { prompt, context: c }) if prompt == context && c == context
    ));
    let e = add(&mut core, 1, 200).unwrap_err();
    assert!(
        matches!(
            e,
            EngineError::PromptExceedsMemory {
                prompt: 200,
                blocks_needed: 390,
                pool_blocks: 300,
                depth: 30
            }
        ),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "the prompt has 200 tokens, which need 390 KV blocks at depth 30; the whole KV pool under the memory budget holds 300"
    );
    add(&mut core, 2, 160).expect("160 positions fit");
    assert_eq!(core.stats().waiting, 1);
}

/// An exit probe splits the forward at the probed depths: the served tokens and
/// log-probabilities stay bit for bit those of the unprobed engine; the confidence is the
/// sampled token's probability under greedy sampling; each probed exit is the first probed
/// depth whose own greedy step (run alone) is at least the threshold confident.
#[test]
fn exit_probes_report_confidences_without_changing_the_tokens() {
    const PROBES: [usize; 2] = [10, 20];
    const THRESHOLD: f32 = 0.3;
    let src = source();
    let model = load(&src, None);
    let prompt = fixed_tokens(24, 3);
    let n = 10;
    let (want, want_lp) = alone(&model, &prompt, n, 30);
    // The confidence at each probe of each generated position, computed directly: the
    // prompt plus the served tokens so far, layers 0..depth, the logit lens.
    let mut want_exit = Vec::new();
    for i in 0..n {
        let mut ctx = prompt.clone();
        ctx.extend_from_slice(&want[..i]);
        let exit = PROBES.iter().copied().find(|&d| {
            let mut kv = DenseKv::rounded_to_f16(model.n_layers(), model.spec().kv_row_len());
            let logits = last_logits_at_depth(&model, &mut kv, 0, &ctx, d).expect("probe");
            switchyard_engine::max_prob(&logits) >= THRESHOLD
        });
        want_exit.push(exit.map(|d| d as u16));
    }
    let mut core = EngineCore::new(model, Vec::new(), config(64, false)).expect("engine");
    core.set_probe(Some(switchyard_engine::ExitProbe {
        depths: PROBES.to_vec(),
        threshold: THRESHOLD,
    }));
    core.add_request(
        RequestId(0),
        EngineRequest {
            prompt,
            params: greedy(n),
        },
    )
    .expect("add");
    let (mut tokens, mut logprobs, mut confidences, mut exits) = (vec![], vec![], vec![], vec![]);
    while core.has_work() {
        let r = core.step();
        assert_eq!(r.depth, 30);
        for o in r.outputs {
            if let Some(t) = o.token {
                tokens.push(t);
                logprobs.push(o.logprob);
                confidences.push(o.confidence);
                exits.push(o.probe_exit);
            }
        }
    }
    assert_eq!(tokens, want);
    assert_bits(&logprobs, &want_lp, "probed");
    for (c, lp) in confidences.iter().zip(&logprobs) {
        assert!(
            (c - lp.exp()).abs() < 1e-5,
            "confidence {c} vs exp(logprob) {}",
            lp.exp()
        );
    }
    assert_eq!(exits, want_exit);
    eprintln!("probed exits: {exits:?}");
}
