//! Per-request outputs: [`OutputProcessor`] turns the core's token ids into streamed text
//! (incremental detokenization, stop strings) and sends one [`RequestOutput`] per new token
//! to each request's channel; [`Completion`] gathers a whole stream.
//!
//! Stop strings are matched here, outside the core, as vLLM's output processor does: when one
//! matches, the processor reports the request so the engine drops it before the next step.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use switchyard_request::FinishReason;
use switchyard_tokenizer::{StreamDecoder, Tokenizer};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::mpsc::{self, Receiver, Sender};

use crate::core::{StepResult, TokenOutput};
use crate::doorbell::Doorbell;
use crate::status::Liveness;
use crate::stop::{StopMatcher, StopOutcome};
use crate::{EngineError, RequestId, Result};

/// Outputs one request may have waiting for its reader: a reader this far behind has
/// stopped reading, and its request is ended ([`EngineError::OutputOverflow`]) rather than
/// buffered without bound. About 30 s of decoding at 100 tokens/s, and under 1 MiB.
pub const OUTPUT_BUFFER: usize = 4096;

/// Where an engine thread sends one request's outputs, or the error that ended it: a buffer
/// of [`OUTPUT_BUFFER`] items between the engine and the request's reader.
///
/// Dropped while its thread unwinds from a panic, it marks the engine failed and sends
/// [`EngineError::EngineFailed`] as the request's last item, so that the client learns why
/// and `/health` already says so when it does.
#[derive(Debug)]
pub struct OutputSink {
    tx: Sender<Result<RequestOutput>>,
    engine: Arc<Liveness>,
    /// The buffer filled and the request was ended: nothing more is sent.
    overflowed: AtomicBool,
    /// Rung after each item sent (see [`Doorbell`]).
    bell: Option<Doorbell>,
}

/// Why an [`OutputSink`] took nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotSent {
    /// The reader was dropped (the client went away).
    ReaderGone,
    /// The reader fell [`OUTPUT_BUFFER`] items behind; the request has ended.
    Overflow,
}

impl OutputSink {
    /// A sink of `capacity` items and the stream that reads it.
    pub(crate) fn channel(
        capacity: usize,
        engine: Arc<Liveness>,
    ) -> (Self, Receiver<Result<RequestOutput>>) {
        // One place is kept for the item that ends the request.
        let (tx, rx) = mpsc::channel(capacity.max(2));
        let sink = Self {
            tx,
            engine,
            overflowed: AtomicBool::new(false),
            bell: None,
        };
        (sink, rx)
    }

    /// This sink rings `bell` after each item it sends.
    pub(crate) fn with_bell(mut self, bell: Option<Doorbell>) -> Self {
        self.bell = bell;
        self
    }

    fn ring(&self) {
        if let Some(b) = &self.bell {
            b.ring();
        }
    }

    /// Sends one item without waiting. When only the last place is left and `item` does not
    /// end the request, [`EngineError::OutputOverflow`] takes that place instead and the
    /// request is over: the caller must end it.
    pub fn send(&self, item: Result<RequestOutput>) -> std::result::Result<(), NotSent> {
        if self.overflowed.load(Ordering::Relaxed) {
            return Err(NotSent::Overflow);
        }
        let ends = item.as_ref().map_or(true, |o| o.finish_reason.is_some());
        if !ends && self.tx.capacity() <= 1 {
            self.overflowed.store(true, Ordering::Relaxed);
            let behind = self.tx.max_capacity() - 1;
            let _ = self
                .tx
                .try_send(Err(EngineError::OutputOverflow { behind }));
            self.ring();
            return Err(NotSent::Overflow);
        }
        let sent = self.tx.try_send(item).map_err(|e| match e {
            TrySendError::Closed(_) => NotSent::ReaderGone,
            TrySendError::Full(_) => NotSent::Overflow,
        });
        self.ring();
        sent
    }

    /// Whether the reader was dropped, or the request ended on an overflow.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed() || self.overflowed.load(Ordering::Relaxed)
    }
}

impl Drop for OutputSink {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.engine.fail();
            let _ = self.tx.try_send(Err(self.engine.failure()));
        }
        // The stream ends when the sink goes: its reader may be waiting for that.
        self.ring();
    }
}

/// New output of one request (usually one token).
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutput {
    pub id: RequestId,
    /// New token ids (end-of-generation tokens are not output).
    pub token_ids: Vec<u32>,
    /// Their log-probabilities under the model.
    pub logprobs: Vec<f32>,
    /// Per token, the requested most likely alternatives (empty lists unless asked).
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Their exit confidences at the serving depth (largest softmax probability).
    pub confidences: Vec<f32>,
    /// Their first passing probed exit, with an exit probe set (see `ExitProbe`).
    pub probe_exits: Vec<Option<u16>>,
    /// The depth the engine served at when these tokens were produced.
    pub depth: usize,
    /// New text (may be empty while a character or a possible stop string is incomplete).
    pub text: String,
    /// Set on the last output of the request.
    pub finish_reason: Option<FinishReason>,
    pub prompt_tokens: usize,
    /// Output tokens so far.
    pub output_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// When the request entered the engine.
    pub arrival: Instant,
    /// When its first token was sampled.
    pub first_token_at: Option<Instant>,
    /// When this output was produced.
    pub at: Instant,
}

/// A whole request, gathered from its stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub id: RequestId,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    pub confidences: Vec<f32>,
    pub probe_exits: Vec<Option<u16>>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub arrival: Instant,
    pub first_token_at: Option<Instant>,
    pub finished_at: Instant,
    /// When each output arrived (inter-token latencies).
    pub token_times: Vec<Instant>,
}

impl Completion {
    /// Gathers outputs until the one with a finish reason; `None` if `outputs` ends first.
    pub fn gather(outputs: impl IntoIterator<Item = RequestOutput>) -> Option<Self> {
        let mut c: Option<Completion> = None;
        for o in outputs {
            let c = c.get_or_insert_with(|| Completion {
                id: o.id,
                token_ids: Vec::new(),
                logprobs: Vec::new(),
                top_logprobs: Vec::new(),
                confidences: Vec::new(),
                probe_exits: Vec::new(),
                text: String::new(),
                finish_reason: FinishReason::Abort,
                prompt_tokens: o.prompt_tokens,
                cached_tokens: o.cached_tokens,
                arrival: o.arrival,
                first_token_at: None,
                finished_at: o.at,
                token_times: Vec::new(),
            });
            c.token_ids.extend_from_slice(&o.token_ids);
            c.logprobs.extend_from_slice(&o.logprobs);
            c.top_logprobs.extend(o.top_logprobs);
            c.confidences.extend_from_slice(&o.confidences);
            c.probe_exits.extend_from_slice(&o.probe_exits);
            c.text.push_str(&o.text);
            c.cached_tokens = o.cached_tokens;
            c.first_token_at = o.first_token_at;
            c.finished_at = o.at;
            if !o.token_ids.is_empty() {
                c.token_times.push(o.at);
            }
            if let Some(r) = o.finish_reason {
                c.finish_reason = r;
                return Some(c.clone());
            }
        }
        None
    }

    /// Submission to last output.
    pub fn latency(&self) -> Duration {
        self.finished_at.saturating_duration_since(self.arrival)
    }

    /// Time to first token.
    pub fn ttft(&self) -> Option<Duration> {
        self.first_token_at
            .map(|t| t.saturating_duration_since(self.arrival))
    }

    /// Mean time per output token after the first.
    pub fn tpot(&self) -> Option<Duration> {
        let first = self.first_token_at?;
        let n = self.token_ids.len().checked_sub(1).filter(|&n| n > 0)?;
        Some(self.finished_at.saturating_duration_since(first) / n as u32)
    }
}

struct Tracked<'t> {
    sink: OutputSink,
    decoder: StreamDecoder<'t>,
    stop: StopMatcher,
    prompt_tokens: usize,
    output_tokens: usize,
    cached_tokens: usize,
    arrival: Instant,
    first_token_at: Option<Instant>,
}

/// Detokenizes and routes the core's outputs to each request's channel.
pub struct OutputProcessor<'t> {
    tokenizer: &'t Tokenizer,
    requests: HashMap<RequestId, Tracked<'t>>,
    /// The depth of the latest step processed.
    depth: usize,
}

impl<'t> OutputProcessor<'t> {
    pub fn new(tokenizer: &'t Tokenizer) -> Self {
        Self {
            tokenizer,
            requests: HashMap::new(),
            depth: 0,
        }
    }

    pub fn add(
        &mut self,
        id: RequestId,
        prompt_tokens: usize,
        stop: &[String],
        arrival: Instant,
        sink: OutputSink,
    ) {
        self.requests.insert(
            id,
            Tracked {
                sink,
                decoder: self.tokenizer.stream(),
                stop: StopMatcher::new(stop),
                prompt_tokens,
                output_tokens: 0,
                cached_tokens: 0,
                arrival,
                first_token_at: None,
            },
        );
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Requests whose receiver was dropped (the client went away).
    pub fn closed(&self) -> Vec<RequestId> {
        self.requests
            .iter()
            .filter(|(_, t)| t.sink.is_closed())
            .map(|(id, _)| *id)
            .collect()
    }

    /// Forgets a request without sending anything.
    pub fn remove(&mut self, id: RequestId) {
        self.requests.remove(&id);
    }

    /// Ends a request with `error`.
    pub fn fail(&mut self, id: RequestId, error: EngineError) {
        if let Some(t) = self.requests.remove(&id) {
            let _ = t.sink.send(Err(error));
        }
    }

    /// Ends a request with `reason` (and whatever text it held back), as after an abort.
    pub fn finish(&mut self, id: RequestId, reason: FinishReason) {
        self.emit(
            TokenOutput {
                id,
                token: None,
                logprob: 0.0,
                confidence: 0.0,
                probe_exit: None,
                finish: Some(reason),
                cached_tokens: 0,
                top_logprobs: Vec::new(),
            },
            Instant::now(),
        );
    }

    /// Sends a step's outputs; returns the requests a stop string ended, which the engine
    /// must drop from the core.
    pub fn process(&mut self, step: StepResult) -> Vec<RequestId> {
        let now = Instant::now();
        self.depth = step.depth;
        for (id, e) in step.failed {
            self.fail(id, e);
        }
        step.outputs
            .into_iter()
            .filter_map(|o| {
                let id = o.id;
                self.emit(o, now).then_some(id)
            })
            .collect()
    }

    /// Sends one output; whether a stop string ended a request the core still runs.
    fn emit(&mut self, o: TokenOutput, now: Instant) -> bool {
        let Some(t) = self.requests.get_mut(&o.id) else {
            return false;
        };
        let mut text = String::new();
        let mut finish = o.finish;
        let mut stopped = false;
        let mut token_ids = Vec::new();
        let mut logprobs = Vec::new();
        let mut top_logprobs = Vec::new();
        let mut confidences = Vec::new();
        let mut probe_exits = Vec::new();
        if o.token.is_some() || o.finish == Some(FinishReason::Stop) {
            t.first_token_at.get_or_insert(now);
        }
        t.cached_tokens = t.cached_tokens.max(o.cached_tokens);
        if let Some(tok) = o.token {
            token_ids.push(tok);
            logprobs.push(o.logprob);
            top_logprobs.push(o.top_logprobs);
            confidences.push(o.confidence);
            probe_exits.push(o.probe_exit);
            t.output_tokens += 1;
            match t.decoder.push(tok) {
                Ok(Some(piece)) => stopped = push_text(&mut t.stop, &piece, &mut text),
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, token = tok, "cannot detokenize"),
            }
        }
        if stopped {
            finish = Some(FinishReason::Stop);
        } else if finish.is_some() {
            // Bytes of an incomplete character, then text held back as a possible stop.
            let tail = t.decoder.flush().unwrap_or_default();
            if push_text(&mut t.stop, &tail, &mut text) {
                finish = Some(FinishReason::Stop);
            } else {
                text.push_str(&t.stop.finish());
            }
        }
        let out = RequestOutput {
            id: o.id,
            token_ids,
            logprobs,
            top_logprobs,
            confidences,
            probe_exits,
            depth: self.depth,
            text,
            finish_reason: finish,
            prompt_tokens: t.prompt_tokens,
            output_tokens: t.output_tokens,
            cached_tokens: t.cached_tokens,
            arrival: t.arrival,
            first_token_at: t.first_token_at,
            at: now,
        };
        let _ = t.sink.send(Ok(out));
        if finish.is_some() {
            self.requests.remove(&o.id);
        }
        stopped && o.finish.is_none()
    }
}

/// Feeds text to the stop matcher; whether a stop string ended it.
fn push_text(stop: &mut StopMatcher, piece: &str, text: &mut String) -> bool {
    match stop.push(piece) {
        StopOutcome::Continue(s) => {
            text.push_str(&s);
            false
        }
        StopOutcome::Stopped(s) => {
            text.push_str(&s);
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn output(finish: Option<FinishReason>) -> Result<RequestOutput> {
        let now = Instant::now();
        Ok(RequestOutput {
            id: RequestId(1),
            token_ids: vec![3],
            logprobs: vec![-0.5],
            top_logprobs: vec![Vec::new()],
            confidences: Vec::new(),
            probe_exits: Vec::new(),
            depth: 1,
            text: "x".into(),
            finish_reason: finish,
            prompt_tokens: 1,
            output_tokens: 1,
            cached_tokens: 0,
            arrival: now,
            first_token_at: Some(now),
            at: now,
        })
    }

    /// A reader that stops reading gets the buffer's outputs, then the overflow error in the
    /// place kept for the last item; the sink then reports itself closed, which is how the
    /// engine learns to abort the request.
    #[test]
    fn a_reader_a_whole_buffer_behind_ends_its_request() {
        let (sink, mut rx) = OutputSink::channel(4, Arc::new(Liveness::new("m")));
        for _ in 0..3 {
            assert_eq!(sink.send(output(None)), Ok(()));
        }
        assert!(!sink.is_closed());
        assert_eq!(sink.send(output(None)), Err(NotSent::Overflow));
        assert!(sink.is_closed());
        assert_eq!(sink.send(output(None)), Err(NotSent::Overflow));
        let items: Vec<_> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
        assert_eq!(items.len(), 4);
        assert!(items[..3].iter().all(|o| o.is_ok()));
        assert_eq!(
            items[3].as_ref().err().map(ToString::to_string).as_deref(),
            Some("the request was ended: its reader fell 3 outputs behind")
        );
    }

    /// The last output may take the kept place; a gone reader is told apart from a full one.
    #[test]
    fn the_last_output_fits_and_a_gone_reader_is_named() {
        let (sink, rx) = OutputSink::channel(2, Arc::new(Liveness::new("m")));
        assert_eq!(sink.send(output(None)), Ok(()));
        assert_eq!(sink.send(output(Some(FinishReason::Length))), Ok(()));
        drop(rx);
        assert_eq!(sink.send(output(None)), Err(NotSent::ReaderGone));
        assert!(sink.is_closed());
    }
}
