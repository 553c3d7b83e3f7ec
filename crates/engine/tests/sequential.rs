//! A one-sequence-at-a-time decoder behind an [`EngineHandle`]: requests run in arrival order,
//! outputs stream as the decoder emits them, aborts and closed streams end the running request
//! before its next output, queued requests can be aborted, and layer commands are refused.
//!
//! The decoder here is scripted (it emits fixed tokens at a fixed pace) so the actor's
//! behaviour is checked exactly; the speculative decoders behind the same handle are tested on
//! real models in the modes and server crates.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use switchyard_engine::{
    DecodedToken, EngineError, EngineHandle, EngineInfo, EngineRequest, SequentialDecoder,
};
use switchyard_request::{FinishReason, SamplingParams};
use switchyard_tokenizer::Tokenizer;

/// Pause between two emitted tokens.
const PACE: Duration = Duration::from_millis(15);

/// Emits `max_tokens` tokens `prompt[0] * 100 + i`, each with text `<id>`, one per `PACE`.
struct Scripted {
    emitted: Arc<AtomicUsize>,
}

impl SequentialDecoder for Scripted {
    fn generate(
        &mut self,
        request: &EngineRequest,
        emit: &mut dyn FnMut(Option<DecodedToken>, &str) -> bool,
    ) -> switchyard_engine::Result<FinishReason> {
        for i in 0..request.params.max_tokens {
            std::thread::sleep(PACE);
            let token = request.prompt[0] * 100 + i as u32;
            self.emitted.fetch_add(1, Ordering::SeqCst);
            let t = DecodedToken {
                token,
                logprob: -(i as f32),
            };
            if !emit(Some(t), &format!("<{token}>")) {
                return Ok(FinishReason::Abort);
            }
        }
        Ok(FinishReason::Length)
    }

    fn weights_bytes(&self) -> u64 {
        1234
    }
}

fn start() -> (EngineHandle, Arc<AtomicUsize>) {
    let path = switchyard_zoo::ensure("smollm2-135m-instruct").expect("model");
    let src = switchyard_weights::open(path).expect("open");
    let tokenizer = Arc::new(Tokenizer::from_source(&*src).expect("tokenizer"));
    let emitted = Arc::new(AtomicUsize::new(0));
    let info = EngineInfo::new("scripted", 3, 64, 100_000, tokenizer);
    let decoder = Box::new(Scripted {
        emitted: Arc::clone(&emitted),
    });
    let h = EngineHandle::spawn_sequential(decoder, info, 4096).expect("spawn");
    (h, emitted)
}

fn request(first: u32, max_tokens: usize) -> EngineRequest {
    EngineRequest {
        prompt: vec![first, 7, 7],
        params: SamplingParams::greedy(max_tokens),
    }
}

#[test]
fn requests_run_one_after_another_in_arrival_order() {
    let (h, _) = start();
    let a = h.add_request(request(1, 4)).expect("a");
    let b = h.add_request(request(2, 3)).expect("b");
    let (a, b) = (a.wait().expect("a"), b.wait().expect("b"));
    assert_eq!(a.token_ids, [100, 101, 102, 103]);
    assert_eq!(a.text, "<100><101><102><103>");
    assert_eq!(a.logprobs, [0.0, -1.0, -2.0, -3.0]);
    assert_eq!(a.finish_reason, FinishReason::Length);
    assert_eq!(a.prompt_tokens, 3);
    assert_eq!(b.token_ids, [200, 201, 202]);
    // b waited for a: its first token came after a's last.
    let b_first = b.first_token_at.expect("b started");
    assert!(b_first >= a.finished_at, "b began before a ended");
    assert!(b.ttft().expect("ttft") >= PACE * 4);
}

#[test]
fn an_abort_or_a_closed_stream_ends_the_running_request_and_the_queue_goes_on() {
    let (h, emitted) = start();
    // Aborted while running: it ends with Abort before all its tokens.
    let mut a = h.add_request(request(1, 40)).expect("a");
    let first = a.blocking_next().expect("output").expect("ok");
    assert_eq!(first.token_ids, [100]);
    h.abort(a.id());
    let mut n = 1;
    let last = loop {
        let o = a.blocking_next().expect("output").expect("ok");
        n += o.token_ids.len();
        if o.finish_reason.is_some() {
            break o;
        }
    };
    assert_eq!(last.finish_reason, Some(FinishReason::Abort));
    assert!(n < 40, "{n} tokens after the abort");

    // A client that goes away: the decoder stops emitting, and the next request runs.
    let mut b = h.add_request(request(2, 40)).expect("b");
    let _ = b.blocking_next();
    drop(b);
    let c = h.add_request(request(3, 2)).expect("c").wait().expect("c");
    assert_eq!(c.token_ids, [300, 301]);
    let after = emitted.load(Ordering::SeqCst);
    std::thread::sleep(PACE * 5);
    assert_eq!(emitted.load(Ordering::SeqCst), after, "still decoding");
    assert!(after < 40 + 40, "{after} tokens emitted in all");
}

#[test]
fn a_queued_request_can_be_aborted_and_stats_show_the_queue() {
    let (h, _) = start();
    let a = h.add_request(request(1, 10)).expect("a");
    let b = h.add_request(request(2, 10)).expect("b");
    let c = h.add_request(request(3, 1)).expect("c");
    // Stats answer while a request runs.
    let t0 = Instant::now();
    let s = loop {
        let s = h.stats().wait().expect("stats");
        if s.running == 1 {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(10));
    };
    assert_eq!(s.memory.weights_bytes, 1234);
    assert_eq!(s.memory.budget_bytes, 4096);
    assert_eq!(s.n_layers, 3);
    h.abort(b.id());
    let b = b.wait().expect("b");
    assert_eq!(b.finish_reason, FinishReason::Abort);
    assert!(b.token_ids.is_empty());
    assert!(b.first_token_at.is_none());
    assert_eq!(a.wait().expect("a").token_ids.len(), 10);
    assert_eq!(c.wait().expect("c").token_ids, [300]);
}

#[test]
fn layer_commands_are_refused_and_shutdown_aborts_what_is_left() {
    let (h, _) = start();
    let err = h.set_depth(2).wait().unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid engine configuration: setting the depth is not supported by a one-sequence-at-a-time decoder"
    );
    assert!(matches!(
        h.load_layers(3, true).wait(),
        Err(EngineError::BadConfig(_))
    ));
    // The handle's own checks still apply.
    assert!(matches!(
        h.add_request(EngineRequest {
            prompt: vec![1; 64],
            params: SamplingParams::greedy(1),
        }),
        Err(EngineError::PromptTooLong {
            prompt: 64,
            context: 64
        })
    ));
    let a = h.add_request(request(1, 200)).expect("a");
    let b = h.add_request(request(2, 5)).expect("b");
    std::thread::sleep(PACE * 3);
    h.shutdown().wait().expect("shutdown");
    let (a, b) = (a.wait().expect("a"), b.wait().expect("b"));
    assert_eq!(a.finish_reason, FinishReason::Abort);
    assert!(a.token_ids.len() < 200);
    assert_eq!(b.finish_reason, FinishReason::Abort);
    assert!(b.token_ids.is_empty());
    assert!(h.add_request(request(3, 1)).is_err() || h.stats().wait().is_err());
}
