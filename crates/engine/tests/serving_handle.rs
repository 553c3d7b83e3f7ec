//! The engine as an actor on a real model (smollm2-135m-instruct): streamed text, stop
//! strings, aborts, clients that go away, refused prompts, and layers loaded in the
//! background while a request streams.

use std::sync::Arc;
use std::time::{Duration, Instant};

use switchyard_engine::{
    generate, EngineConfig, EngineError, EngineHandle, EngineRequest, SchedulerConfig,
};
use switchyard_models::{LayeredModel, LoadOptions};
use switchyard_request::{FinishReason, SamplingParams};
use switchyard_tokenizer::Tokenizer;
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

fn start(src: &Arc<dyn WeightSource>, layers: Option<usize>, budget: u64) -> EngineHandle {
    let tok = Arc::new(Tokenizer::from_source(&**src).expect("tokenizer"));
    let cfg = EngineConfig {
        memory_budget: budget,
        scheduler: SchedulerConfig::default(),
        ..EngineConfig::default()
    };
    EngineHandle::start(load(src, layers), tok, cfg, "smollm2").expect("engine")
}

fn request(tok: &Tokenizer, text: &str, params: SamplingParams) -> EngineRequest {
    EngineRequest {
        prompt: tok.encode(text, true, false).expect("encode"),
        params,
    }
}

/// Polls the stats until `done` holds (the engine acts on dropped streams between steps).
fn wait_for(h: &EngineHandle, done: impl Fn(&switchyard_engine::EngineStats) -> bool) {
    let t0 = Instant::now();
    loop {
        let s = h.stats().wait().expect("stats");
        if done(&s) {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "timed out: {s:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn streams_text_honours_stop_strings_aborts_and_clients_that_leave() {
    let src = source();
    let h = start(&src, None, 1 << 30);
    let tok = Arc::clone(&h.info().tokenizer);
    let reference = generate(
        &load(&src, None),
        &tok,
        &tok.encode("The capital of France is", true, false)
            .expect("encode"),
        &SamplingParams::greedy(12),
        |_| {},
    )
    .expect("reference");

    // Streamed text: the same tokens and text as single-sequence generation.
    let a = h
        .add_request(request(
            &tok,
            "The capital of France is",
            SamplingParams::greedy(12),
        ))
        .expect("add");
    // The same prompt stopping at " Paris": nothing from it on is returned.
    let b = h
        .add_request(request(
            &tok,
            "The capital of France is",
            SamplingParams {
                stop: vec![" Paris".into()],
                ..SamplingParams::greedy(12)
            },
        ))
        .expect("add");
    let a = a.wait().expect("a");
    assert_eq!(a.token_ids, reference.tokens);
    assert_eq!(a.text, reference.text);
    assert_eq!(a.finish_reason, FinishReason::Length);
    assert_eq!(a.logprobs.len(), 12);
    assert!(a.ttft().is_some() && a.latency() >= a.ttft().unwrap_or_default());
    let b = b.wait().expect("b");
    assert_eq!(b.finish_reason, FinishReason::Stop);
    let at = reference.text.find(" Paris").expect("reference says Paris");
    assert_eq!(b.text, reference.text[..at]);
    assert!(b.token_ids.len() < 12);
    // B shared A's full prompt blocks? The prompt is 6 tokens: no full block to share.
    assert_eq!(b.cached_tokens, 0);

    // Abort: the stream ends with an Abort output.
    let long = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(400)
    };
    let mut c = h
        .add_request(request(&tok, "Once upon a time", long.clone()))
        .expect("add");
    let first = c.blocking_next().expect("an output").expect("ok");
    assert_eq!(first.token_ids.len(), 1);
    h.abort(c.id());
    let mut last = first;
    while let Some(o) = c.blocking_next() {
        last = o.expect("ok");
    }
    assert_eq!(last.finish_reason, Some(FinishReason::Abort));
    assert!(last.output_tokens < 400);

    // A client that goes away: dropping the stream frees the sequence's blocks.
    let mut d = h
        .add_request(request(&tok, "Once upon a time", long))
        .expect("add");
    d.blocking_next().expect("an output").expect("ok");
    drop(d);
    wait_for(&h, |s| s.running == 0 && s.waiting == 0);
    let s = h.stats().wait().expect("stats");
    // Only blocks the prefix cache keeps are in use.
    assert_eq!(s.kv_blocks_used, s.prefix_cached_blocks);
    assert!(s.memory.in_use_bytes <= s.memory.budget_bytes);

    // Refused at once: longer than the context.
    let too_long = EngineRequest {
        prompt: vec![1; h.info().context_length],
        params: SamplingParams::greedy(1),
    };
    assert!(matches!(
        h.add_request(too_long),
        Err(EngineError::PromptTooLong { .. })
    ));
    h.shutdown().wait().expect("shutdown");
    assert!(matches!(
        h.add_request(request(&tok, "x", SamplingParams::greedy(1))),
        Err(EngineError::EngineStopped)
    ));
}

#[test]
fn clearing_the_prefix_cache_makes_a_repeated_prompt_pay_its_prefill_again() {
    let src = source();
    let h = start(&src, None, 1 << 30);
    let tok = Arc::clone(&h.info().tokenizer);
    // 45 tokens: two full 16-token blocks to share, and a tail of 13.
    let mut prompt = tok
        .encode(
            "A long prompt about rivers, mountains and the weather of the northern coast, told slowly so that it runs to many tokens. \
             The rivers run north in spring, the mountains hold their snow until June, and the coast sees fog on most mornings of the year.",
            true,
            false,
        )
        .expect("encode");
    assert!(prompt.len() >= 45, "{}", prompt.len());
    prompt.truncate(45);
    let run = || {
        h.add_request(EngineRequest {
            prompt: prompt.clone(),
            params: SamplingParams::greedy(8),
        })
        .expect("add")
        .wait()
        .expect("completion")
    };
    let first = run();
    assert_eq!(first.cached_tokens, 0);
    let again = run();
    assert_eq!(again.cached_tokens, 32);
    assert_eq!(again.token_ids, first.token_ids);

    let held = h.stats().wait().expect("stats");
    assert!(held.prefix_cached_blocks > 0);
    assert_eq!(held.kv_blocks_used, held.prefix_cached_blocks);
    let freed = h.clear_prefix_cache().wait().expect("clear");
    assert_eq!(freed, held.prefix_cached_blocks);
    let after = h.stats().wait().expect("stats");
    assert_eq!((after.prefix_cached_blocks, after.kv_blocks_used), (0, 0));

    let cold = run();
    assert_eq!(cold.cached_tokens, 0);
    assert_eq!(cold.token_ids, first.token_ids);
    // Nothing cached: clearing again frees nothing but the blocks the last run left.
    let left = h.stats().wait().expect("stats").prefix_cached_blocks;
    assert_eq!(h.clear_prefix_cache().wait().expect("clear"), left);
    assert_eq!(h.clear_prefix_cache().wait().expect("clear"), 0);
    h.shutdown().wait().expect("shutdown");
}

#[test]
fn layers_load_in_the_background_while_a_request_streams() {
    let src = source();
    // A budget the full model fits in with room to spare: 10 layers resident at first.
    let h = start(&src, Some(10), 512 << 20);
    let tok = Arc::clone(&h.info().tokenizer);
    let before = h.stats().wait().expect("stats");
    assert_eq!((before.depth, before.resident_layers), (10, 10));

    let mut r = h
        .add_request(request(
            &tok,
            "Once upon a time",
            SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(120)
            },
        ))
        .expect("add");
    r.blocking_next().expect("output").expect("ok");
    let t0 = Instant::now();
    let report = h.load_layers(30, true).wait().expect("load");
    let t1 = Instant::now();
    assert_eq!(report.layers.len(), 20);
    assert_eq!(
        report.layers.iter().map(|l| l.layer).collect::<Vec<_>>(),
        (10..30).collect::<Vec<_>>()
    );
    eprintln!(
        "one layer loads in {:.1} ms ({} bytes); 20 layers in {:.0} ms",
        report.mean_layer_secs() * 1e3,
        report.layers[0].bytes,
        (t1 - t0).as_secs_f64() * 1e3
    );
    let mut during = 0;
    let mut outputs = 1;
    let mut last = None;
    while let Some(o) = r.blocking_next() {
        let o = o.expect("ok");
        outputs += o.token_ids.len();
        if o.at > t0 && o.at < t1 {
            during += 1;
        }
        last = o.finish_reason;
    }
    assert_eq!((outputs, last), (120, Some(FinishReason::Length)));
    assert!(during >= 1, "no token was produced while the layers loaded");

    let s = h.stats().wait().expect("stats");
    assert_eq!((s.depth, s.resident_layers), (30, 30));
    assert!(s.memory.in_use_bytes <= s.memory.budget_bytes);
    assert!(s.kv_blocks_total < before.kv_blocks_total);
    assert_eq!(
        s.memory.weights_bytes - before.memory.weights_bytes,
        report.layers.iter().map(|l| l.bytes as u64).sum::<u64>()
    );
    // A second load while none is needed does nothing; depth cannot exceed residency.
    assert!(h
        .load_layers(30, false)
        .wait()
        .expect("no-op")
        .layers
        .is_empty());
    h.drop_layers(10).wait().expect("drop");
    let after = h.stats().wait().expect("stats");
    assert_eq!((after.depth, after.resident_layers), (10, 10));
    assert_eq!(after.kv_blocks_total, before.kv_blocks_total);
    assert!(matches!(
        h.set_depth(11).wait(),
        Err(EngineError::DepthNotResident { depth: 11, .. })
    ));
}

#[test]
fn a_prompt_over_the_whole_budget_gets_an_error_on_its_stream() {
    let src = source();
    let model = load(&src, None);
    // Weights + workspace + 1 MiB of KV: 85 f16 blocks of 12,288 bytes (16 positions of K and
    // V, 192 values each), under three blocks per layer at full depth.
    let workspace = switchyard_engine::kv::activation_bytes(
        model.spec(),
        switchyard_engine::scheduler::DEFAULT_MAX_BATCHED_TOKENS,
        switchyard_engine::scheduler::DEFAULT_MAX_NUM_SEQS,
    ) as u64;
    let budget = model.resident_bytes().total() as u64 + workspace + (1 << 20);
    drop(model);
    let h = start(&src, None, budget);
    let tok = Arc::clone(&h.info().tokenizer);
    let mut s = h
        .add_request(request(
            &tok,
            "The capital of France is",
            SamplingParams::greedy(4),
        ))
        .expect("queued");
    // 6 tokens take 30 of the 85 blocks: it runs.
    let first = s.blocking_next().expect("an output").expect("ok");
    assert_eq!(first.token_ids.len(), 1);
    let long = "word ".repeat(40);
    let mut s = h
        .add_request(request(&tok, &long, SamplingParams::greedy(4)))
        .expect("queued");
    match s.blocking_next() {
        Some(Err(
            e @ EngineError::PromptExceedsMemory {
                pool_blocks: 85,
                depth: 30,
                ..
            },
        )) => {
            assert!(e
                .to_string()
                .contains("the whole KV pool under the memory budget holds 85"))
        }
        other => panic!("expected an out-of-memory refusal, got {other:?}"),
    }
    assert!(
        s.blocking_next().is_none(),
        "the stream ends after the error"
    );
    let st = h.stats().wait().expect("stats");
    assert_eq!(st.waiting, 0, "nothing is left queued");
}
