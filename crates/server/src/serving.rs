//! The one seam between the HTTP handlers and the four ways a model is served: a local
//! engine, ModeSwitch (one model in a mode picked per request), remote replicas and HELIOS.
//! Each [`Backend`] admits a request (or answers 429), prepares it and starts it; what comes
//! back is a [`Generation`], a stream of outputs with the metadata for the response's
//! headers, from which `respond` builds the answer, whole or as server-sent events, the same
//! way for all of them. A new request parameter is handled once, there.
//!
//! A remote backend is the exception by design: it relays the replica's answer as the
//! replica sent it ([`Started::Relayed`]), fields this server does not know included, so
//! there is nothing to rebuild.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::Response;
use switchyard_engine::{EngineHandle, EngineRequest, RequestOutput, RequestStream};
use switchyard_tokenizer::Tokenizer;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::validate::{Endpoint, ValidRequest};

/// What a backend is given besides the request.
pub struct RequestContext<'a> {
    /// Requests one backend may hold at once (`max_in_flight`).
    pub max_in_flight: usize,
    /// Places on the blocking pool for tokenizing.
    pub tokenizing: &'a Arc<Semaphore>,
    pub metrics: &'a Metrics,
    /// `request_timeout_s`, for the 504's message.
    pub timeout_s: u64,
    /// The request's headers (ModeSwitch reads `x-switchyard-workload`).
    pub headers: &'a HeaderMap,
    /// The body as the client sent it: a remote backend forwards it, fields this server does
    /// not know included. Empty for the other backends.
    pub body: Bytes,
    /// When the request times out (504): `request_timeout_s` after its body was read.
    pub deadline: Instant,
}

/// The requests in flight on one backend, each counted by its [`Place`], and the most it
/// has held at once since the server started.
#[derive(Debug, Default)]
pub struct Places {
    now: Arc<AtomicUsize>,
    peak: AtomicUsize,
}

impl Places {
    pub fn in_flight(&self) -> usize {
        self.now.load(Ordering::SeqCst)
    }

    /// The most requests admitted at once so far (`switchyard_requests_in_flight_max`): the
    /// admission limit seen from the server, where a client only sees responses end a moment
    /// after their places were given back.
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }

    /// Reserves a place, or says the backend is at capacity (429). The place is held until
    /// the returned guard drops.
    pub fn admit(&self, limit: usize) -> Result<Place, ApiError> {
        let prev = self.now.fetch_add(1, Ordering::SeqCst);
        if prev >= limit {
            self.now.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::Overloaded(prev));
        }
        self.peak.fetch_max(prev + 1, Ordering::SeqCst);
        Ok(Place(Arc::clone(&self.now)))
    }
}

/// One request's place on a backend, given back when dropped.
#[derive(Debug)]
pub struct Place(Arc<AtomicUsize>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A request admitted to a backend: it holds its place until what [`Backend::start`] returns
/// is dropped (the answer is complete, or the client went away).
pub struct Admitted<'a> {
    pub place: Place,
    pub req: ValidRequest,
    pub ctx: &'a RequestContext<'a>,
}

/// One way of serving a model.
pub trait Backend {
    /// Where the backend counts its requests in flight.
    fn places(&self) -> &Places;

    /// Prepares an admitted request (tokenizing, routing, validation against the backend's
    /// limits) and starts it.
    async fn start(self: &Arc<Self>, a: Admitted<'_>) -> Result<Started, ApiError>;

    /// Admits `req` (429 at capacity) before it costs anything, then starts it.
    async fn admit_and_start(
        self: &Arc<Self>,
        req: ValidRequest,
        ctx: &RequestContext<'_>,
    ) -> Result<Started, ApiError> {
        let place = self.places().admit(ctx.max_in_flight)?;
        self.start(Admitted { place, req, ctx }).await
    }
}

/// A started request.
pub enum Started {
    // Boxed: a generation is several hundred bytes, a relayed response a pointer's worth.
    /// Outputs produced by this server; the handlers build the response from them.
    Generated(Box<Generation>),
    /// A replica's answer, relayed unchanged.
    Relayed(Response),
}

/// A started request's outputs and what its response needs to say.
pub struct Generation {
    /// The request, as the backend prepared it.
    pub req: ValidRequest,
    /// The served model's name (metrics).
    pub name: String,
    /// The response's `id`.
    pub id: String,
    /// The engine's tokenizer when one engine serves the request: token pieces for
    /// log-probabilities and echoed token-id prompts. `None` for HELIOS, which refuses both.
    pub vocabulary: Option<Arc<Tokenizer>>,
    /// Response headers: the mode and route ModeSwitch picked, the candidate HELIOS picked.
    pub headers: Vec<(&'static str, String)>,
    pub deadline: Instant,
    outputs: Outputs,
    /// Choice 0's output read before the response started (HELIOS: to learn the serving
    /// candidate for its header).
    pending: Option<RequestOutput>,
    /// The places the request holds (dropped with it).
    _admission: Vec<Box<dyn Send + Sync>>,
}

/// Where a generation's outputs come from. Dropping it aborts the request.
pub enum Outputs {
    /// The choices of one engine's request.
    Engine(Choices),
    /// The HELIOS orchestrator, which picks the serving candidate itself.
    Helios(switchyard_helios::orchestrator::HeliosStream),
}

impl Generation {
    pub fn new(
        req: ValidRequest,
        name: String,
        id: String,
        outputs: Outputs,
        deadline: Instant,
    ) -> Self {
        Self {
            req,
            name,
            id,
            vocabulary: None,
            headers: Vec::new(),
            deadline,
            outputs,
            pending: None,
            _admission: Vec::new(),
        }
    }

    /// Token pieces come from `tokenizer`.
    pub fn with_vocabulary(mut self, tokenizer: Arc<Tokenizer>) -> Self {
        self.vocabulary = Some(tokenizer);
        self
    }

    /// Keeps `place` until the generation is dropped.
    pub fn holding(mut self, place: impl Send + Sync + 'static) -> Self {
        self._admission.push(Box::new(place));
        self
    }

    pub fn with_header(mut self, name: &'static str, value: String) -> Self {
        self.headers.push((name, value));
        self
    }

    /// Choice 0's first output, already read.
    pub fn with_pending(mut self, first: RequestOutput) -> Self {
        self.pending = Some(first);
        self
    }

    /// How many choices the response holds.
    pub fn choices(&self) -> usize {
        self.req.n
    }

    /// The next output and the index of its choice; `None` once every choice's stream is
    /// gone (the server is shutting down, if a choice had not finished).
    pub async fn next(&mut self) -> Option<(usize, Result<RequestOutput, ApiError>)> {
        if let Some(o) = self.pending.take() {
            return Some((0, Ok(o)));
        }
        match &mut self.outputs {
            Outputs::Engine(choices) => choices.next().await,
            Outputs::Helios(stream) => Some((
                0,
                stream
                    .next()
                    .await?
                    .map(|o| o.output)
                    .map_err(helios_api_error),
            )),
        }
    }
}

pub fn helios_api_error(e: switchyard_helios::HeliosError) -> ApiError {
    match e {
        switchyard_helios::HeliosError::Engine(e) => ApiError::from(e),
        other => ApiError::Internal(other.to_string()),
    }
}

/// Events a streamed response holds for a client that has not taken them yet. The client's
/// socket buffers hold more; once both are full, the client has `write_timeout_s` to read.
pub const STREAM_BUFFER: usize = 16;

/// The outputs of a request's `n` choices from one engine, tagged with their index, in one
/// bounded channel (a client that stops reading still holds the engine back).
///
/// Choice 0 is sent first; the others once its first output is in, so that its prompt's
/// blocks are in the prefix cache and they compute only the prompt's last partial block.
/// Dropping this aborts every choice still running.
pub struct Choices {
    pub id: switchyard_engine::RequestId,
    rx: tokio::sync::mpsc::Receiver<(usize, Result<RequestOutput, ApiError>)>,
    _launcher: AbortOnDrop,
}

/// Aborts a task (and so drops the request streams it holds) when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Choices {
    pub fn start(engine: &EngineHandle, req: EngineRequest, n: usize) -> Result<Self, ApiError> {
        let first = engine.add_request(choice_request(&req, 0))?;
        let id = first.id();
        let (tx, rx) = tokio::sync::mpsc::channel(STREAM_BUFFER);
        let handle = engine.clone();
        let launcher = tokio::spawn(tracing::Instrument::in_current_span(async move {
            let mut rest = tokio::task::JoinSet::new();
            let mut started = n == 1;
            let mut stream = first;
            while let Some(o) = stream.next().await {
                let ok = o.is_ok();
                if tx.send((0, o.map_err(ApiError::from))).await.is_err() {
                    return;
                }
                if ok && !started {
                    started = true;
                    for i in 1..n {
                        let tx = tx.clone();
                        match handle.add_request(choice_request(&req, i)) {
                            Ok(s) => {
                                rest.spawn(forward(i, s, tx));
                            }
                            Err(e) => {
                                let _ = tx.send((i, Err(ApiError::from(e)))).await;
                                return;
                            }
                        }
                    }
                }
            }
            drop(tx);
            while rest.join_next().await.is_some() {}
        }));
        Ok(Self {
            id,
            rx,
            _launcher: AbortOnDrop(launcher),
        })
    }

    /// The next output of any choice; `None` once every sender is gone.
    async fn next(&mut self) -> Option<(usize, Result<RequestOutput, ApiError>)> {
        self.rx.recv().await
    }
}

/// Choice `i` of a request: its own seed (`seed + i`), so that a seeded request's choices
/// differ from each other and are reproducible.
fn choice_request(req: &EngineRequest, i: usize) -> EngineRequest {
    let mut r = req.clone();
    r.params.seed = r.params.seed.map(|s| s.wrapping_add(i as u64));
    r
}

async fn forward(
    i: usize,
    mut stream: RequestStream,
    tx: tokio::sync::mpsc::Sender<(usize, Result<RequestOutput, ApiError>)>,
) {
    while let Some(o) = stream.next().await {
        if tx.send((i, o.map_err(ApiError::from))).await.is_err() {
            return;
        }
    }
}

/// A response's `id`: `cmpl-`/`chatcmpl-`, a per-process tag (so that ids stay unique across
/// restarts) and `tail`, the backend's request id.
pub fn response_id(e: Endpoint, tail: impl std::fmt::Display) -> String {
    static TAG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let tag = TAG.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("{:x}{:x}", nanos & 0xffff_ffff, std::process::id())
    });
    match e {
        Endpoint::Completions => format!("cmpl-{tag}-{tail}"),
        Endpoint::Chat => format!("chatcmpl-{tag}-{tail}"),
    }
}

/// Runs `work` until `deadline`; a timeout is counted for `model` and becomes 504.
pub async fn before_deadline<T>(
    metrics: &Metrics,
    timeout_s: u64,
    model: &str,
    deadline: Instant,
    work: impl std::future::Future<Output = Result<T, ApiError>>,
) -> Result<T, ApiError> {
    match tokio::time::timeout_at(deadline, work).await {
        Ok(r) => r,
        Err(_) => {
            metrics.aborted.with_label_values(&[model, "timeout"]).inc();
            Err(ApiError::Timeout(timeout_s))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_refuse_past_the_limit_and_remember_their_peak() {
        let places = Places::default();
        let held: Vec<Place> = (0..3).map(|_| places.admit(3).expect("a place")).collect();
        let refused = places.admit(3).expect_err("full");
        assert!(matches!(refused, ApiError::Overloaded(3)), "{refused:?}");
        assert_eq!((places.in_flight(), places.peak()), (3, 3));
        drop(held);
        assert_eq!((places.in_flight(), places.peak()), (0, 3));
        let one = places.admit(3).expect("a place again");
        assert_eq!((places.in_flight(), places.peak()), (1, 3));
        drop(one);
        assert_eq!(places.in_flight(), 0);
    }
}
