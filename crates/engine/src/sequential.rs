//! Serving a decoder that runs one sequence at a time (speculative decoding) behind the same
//! [`EngineHandle`] as the batching engine, so a server streams, aborts and reports it the
//! same way.
//!
//! Requests queue in arrival order and run one after another to completion. While one runs,
//! every new output gives the thread a chance to read its commands: new requests join the
//! queue, an abort or a closed stream (the client went away) ends the running request before
//! its next round, and a shutdown aborts everything. Layer commands (depth, loads, probes)
//! belong to the layered engine and are answered with an error.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::time::Instant;

use switchyard_request::FinishReason;
use tokio::sync::oneshot;

use crate::core::{EngineRequest, EngineStats, MemoryStats};
use crate::handle::{Command, EngineHandle, EngineInfo};
use crate::output::{OutputSink, RequestOutput};
use crate::{EngineError, RequestId, Result};

/// One token as a sequential decoder reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodedToken {
    pub token: u32,
    /// Its log-probability under the serving model's logits (before sampling transforms).
    pub logprob: f32,
}

/// A decoder that generates one request at a time from prompt to end.
pub trait SequentialDecoder: Send + 'static {
    /// Generates for `request`, applying end-of-generation tokens, stop strings and limits as
    /// [`crate::generate`] does, and calls `emit` with each output token (`None` for the last
    /// call, which flushes held-back text) and the final text it made known. When `emit`
    /// returns `false` the request is over (aborted): the decoder stops before its next round
    /// and returns [`FinishReason::Abort`].
    fn generate(
        &mut self,
        request: &EngineRequest,
        emit: &mut dyn FnMut(Option<DecodedToken>, &str) -> bool,
    ) -> Result<FinishReason>;

    /// Bytes of the weights it holds.
    fn weights_bytes(&self) -> u64;
}

struct Queued {
    id: RequestId,
    request: EngineRequest,
    arrival: Instant,
    sink: OutputSink,
}

impl EngineHandle {
    /// Serves `decoder` on a thread of its own; the handle's layer commands answer with an
    /// error.
    pub fn spawn_sequential(
        decoder: Box<dyn SequentialDecoder>,
        info: EngineInfo,
        memory_budget: u64,
    ) -> Result<Self> {
        let n_layers = info.n_layers;
        let weights_bytes = decoder.weights_bytes();
        Self::run("switchyard-sequential", info, move |rx| {
            Sequential {
                decoder,
                queue: VecDeque::new(),
                shape: Shape {
                    n_layers,
                    memory_budget,
                    weights_bytes,
                },
                running: None,
                abort_running: false,
                stop: None,
            }
            .serve(&rx)
        })
    }
}

struct Sequential {
    decoder: Box<dyn SequentialDecoder>,
    queue: VecDeque<Queued>,
    shape: Shape,
    /// The request being generated.
    running: Option<RequestId>,
    abort_running: bool,
    /// A shutdown's reply, answered once the thread is done.
    stop: Option<oneshot::Sender<Result<()>>>,
}

impl Sequential {
    fn serve(mut self, rx: &mpsc::Receiver<Command>) {
        loop {
            while let Ok(c) = rx.try_recv() {
                self.command(c);
            }
            if self.stop.is_some() {
                break;
            }
            let Some(next) = self.queue.pop_front() else {
                match rx.recv() {
                    Ok(c) => self.command(c),
                    Err(_) => break,
                }
                continue;
            };
            if next.sink.is_closed() {
                continue;
            }
            self.run(next, rx);
        }
        for q in self.queue.drain(..) {
            let _ = q
                .sink
                .send(Ok(last_output(&q, 0, None, FinishReason::Abort)));
        }
        if let Some(reply) = self.stop.take() {
            let _ = reply.send(Ok(()));
        }
    }

    fn run(&mut self, q: Queued, rx: &mpsc::Receiver<Command>) {
        self.running = Some(q.id);
        self.abort_running = false;
        let mut output_tokens = 0;
        let mut first_token_at = None;
        let result = {
            let shape = self.shape;
            let waiting = self.queue.len();
            let decoder = &mut self.decoder;
            let mut pending = Vec::new();
            let mut emit = |t: Option<DecodedToken>, text: &str| {
                while let Ok(c) = rx.try_recv() {
                    match c {
                        Command::Stats { reply } => {
                            let _ = reply.send(Ok(stats_of(&shape, 1, waiting + pending.len())));
                        }
                        c => pending.push(c),
                    }
                }
                if q.sink.is_closed() {
                    return false;
                }
                let now = Instant::now();
                if t.is_some() {
                    output_tokens += 1;
                    first_token_at.get_or_insert(now);
                }
                let out = RequestOutput {
                    id: q.id,
                    token_ids: t.iter().map(|t| t.token).collect(),
                    logprobs: t.iter().map(|t| t.logprob).collect(),
                    top_logprobs: t.iter().map(|_| Vec::new()).collect(),
                    confidences: Vec::new(),
                    probe_exits: Vec::new(),
                    depth: shape.n_layers,
                    text: text.to_string(),
                    finish_reason: None,
                    prompt_tokens: q.request.prompt.len(),
                    output_tokens,
                    cached_tokens: 0,
                    arrival: q.arrival,
                    first_token_at,
                    at: now,
                };
                // Commands read here are handled between outputs; only an abort of this
                // request or a shutdown stops it.
                let stop = pending.iter().any(|c| match c {
                    Command::Abort { id } => *id == q.id,
                    Command::Shutdown { .. } => true,
                    _ => false,
                });
                let sent = q.sink.send(Ok(out)).is_ok();
                sent && !stop
            };
            let r = decoder.generate(&q.request, &mut emit);
            for c in pending {
                self.command(c);
            }
            r
        };
        self.running = None;
        match result {
            Ok(reason) => {
                let reason = if self.abort_running {
                    FinishReason::Abort
                } else {
                    reason
                };
                let _ = q
                    .sink
                    .send(Ok(last_output(&q, output_tokens, first_token_at, reason)));
            }
            Err(e) => {
                let _ = q.sink.send(Err(e));
            }
        }
    }

    fn command(&mut self, c: Command) {
        match c {
            Command::Add {
                id,
                request,
                arrival,
                sink,
            } => match request.params.batching_only() {
                Some(param) => {
                    let _ = sink.send(Err(EngineError::Unsupported {
                        param,
                        reason: "a speculative decoder samples without it".into(),
                    }));
                }
                None => self.queue.push_back(Queued {
                    id,
                    request: *request,
                    arrival,
                    sink,
                }),
            },
            Command::Abort { id } => {
                if self.running == Some(id) {
                    self.abort_running = true;
                } else if let Some(i) = self.queue.iter().position(|q| q.id == id) {
                    if let Some(q) = self.queue.remove(i) {
                        let _ = q
                            .sink
                            .send(Ok(last_output(&q, 0, None, FinishReason::Abort)));
                    }
                }
            }
            Command::SetDepth { reply, .. } => {
                let _ = reply.send(Err(unsupported("setting the depth")));
            }
            Command::LoadLayers { reply, .. }
            | Command::DropLayers { reply, .. }
            | Command::SetBudget { reply, .. }
            | Command::Park { reply } => {
                let _ = reply.send(Err(unsupported("loading or dropping layers")));
            }
            Command::ClearPrefixCache { reply } => {
                let _ = reply.send(Ok(0));
            }
            Command::SetProbe { .. } => {}
            Command::Stats { reply } => {
                let _ = reply.send(Ok(stats_of(
                    &self.shape,
                    usize::from(self.running.is_some()),
                    self.queue.len(),
                )));
            }
            Command::Shutdown { reply } => {
                self.abort_running = true;
                self.stop = Some(reply);
            }
        }
    }
}

/// What the statistics of an engine without a KV pool are made of.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub n_layers: usize,
    pub memory_budget: u64,
    pub weights_bytes: u64,
}

/// Statistics of an engine without a KV pool: its weights, and requests running or waiting.
pub(crate) fn stats_of(shape: &Shape, running: usize, waiting: usize) -> EngineStats {
    let weights = shape.weights_bytes;
    EngineStats {
        memory: MemoryStats {
            budget_bytes: shape.memory_budget,
            weights_bytes: weights,
            weights_loading_bytes: 0,
            kv_used_bytes: 0,
            kv_free_bytes: 0,
            workspace_bytes: 0,
            in_use_bytes: weights,
            kv_to_finish_bytes: 0,
        },
        block_tokens: 0,
        block_bytes: 0,
        kv_format: Default::default(),
        kv_blocks_total: 0,
        kv_blocks_used: 0,
        kv_blocks_free: 0,
        prefix_cached_blocks: 0,
        depth: shape.n_layers,
        n_layers: shape.n_layers,
        resident_layers: shape.n_layers,
        running,
        waiting,
        counters: Default::default(),
        prefix_cache_hit_tokens: 0,
        prefix_cache_queried_tokens: 0,
        prefix_cache_hit_rate: 0.0,
        constrained: Default::default(),
        layer_loads: Vec::new(),
    }
}

fn unsupported(what: &str) -> EngineError {
    EngineError::BadConfig(format!(
        "{what} is not supported by a one-sequence-at-a-time decoder"
    ))
}

fn last_output(
    q: &Queued,
    output_tokens: usize,
    first_token_at: Option<Instant>,
    reason: FinishReason,
) -> RequestOutput {
    RequestOutput {
        id: q.id,
        token_ids: Vec::new(),
        logprobs: Vec::new(),
        top_logprobs: Vec::new(),
        confidences: Vec::new(),
        probe_exits: Vec::new(),
        depth: 0,
        text: String::new(),
        finish_reason: Some(reason),
        prompt_tokens: q.request.prompt.len(),
        output_tokens,
        cached_tokens: 0,
        arrival: q.arrival,
        first_token_at,
        at: Instant::now(),
    }
}
