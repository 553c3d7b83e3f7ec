//! [`EngineHandle`]: the serving engine as an actor. One thread owns the [`EngineCore`] and
//! the output processor and runs `commands -> step -> outputs` in a loop; the rest of the
//! program reaches it through a cloneable handle that sends commands over a channel.
//!
//! Each request gets its own output stream (a tokio channel of [`OUTPUT_BUFFER`] outputs,
//! usable from async and from plain threads). Dropping the stream is how a client says it went
//! away: the engine aborts the request before its next step and frees its blocks; a stream
//! that falls a whole buffer behind is ended the same way.
//!
//! Layer loads run on a background thread; the engine installs each layer between steps, so
//! loading overlaps with serving.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use switchyard_grammar::GrammarCompiler;
use switchyard_kernels::prof::{self, Part};
use switchyard_request::FinishReason;
use switchyard_tokenizer::Tokenizer;
use tokio::sync::{mpsc as tmpsc, oneshot};

use switchyard_models::LayeredModel;

use crate::core::{
    end_of_generation_tokens, EngineConfig, EngineCore, EngineRequest, EngineStats, ExitProbe,
};
use crate::doorbell::Doorbell;
use crate::output::{Completion, OutputProcessor, OutputSink, RequestOutput, OUTPUT_BUFFER};
use crate::residency::{LoadReport, LoadedLayer};
use crate::status::Liveness;
use crate::{EngineError, RequestId, Result};

pub use crate::status::EngineStatus;

/// How often an idle engine looks for layers finished by a background load.
const LOAD_POLL: Duration = Duration::from_millis(2);

/// Lets a backend that serves through another server (see
/// [`crate::external::RequestBackend::watch`]) say whether that server can be reached: its
/// handle's status is [`EngineStatus::Unreachable`] while it cannot, and back to running once
/// it can. A stopped or failed engine stays so.
#[derive(Debug, Clone)]
pub struct Reachability(pub(crate) Arc<Liveness>);

impl Reachability {
    /// Marks the server reachable or not; `true` when that changed the status.
    pub fn set(&self, reachable: bool) -> bool {
        let (from, to) = if reachable {
            (EngineStatus::Unreachable, EngineStatus::Running)
        } else {
            (EngineStatus::Running, EngineStatus::Unreachable)
        };
        self.0
            .status
            .compare_exchange(from as u8, to as u8, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    pub fn status(&self) -> EngineStatus {
        self.0.status()
    }
}

/// The message a panic carried, when it was a string.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(not a string)")
}

/// What the rest of the program needs to know about the engine's model.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    pub model: String,
    pub n_layers: usize,
    pub context_length: usize,
    pub vocab_size: usize,
    pub tokenizer: Arc<Tokenizer>,
    /// Compiles structured-output constraints over this tokenizer (shared with the engine).
    pub grammar: Arc<GrammarCompiler>,
}

impl EngineInfo {
    pub fn new(
        model: impl Into<String>,
        n_layers: usize,
        context_length: usize,
        vocab_size: usize,
        tokenizer: Arc<Tokenizer>,
    ) -> Self {
        let grammar = Arc::new(GrammarCompiler::new(Arc::clone(&tokenizer)));
        Self {
            model: model.into(),
            n_layers,
            context_length,
            vocab_size,
            tokenizer,
            grammar,
        }
    }
}

pub(crate) enum Command {
    Add {
        id: RequestId,
        request: Box<EngineRequest>,
        arrival: Instant,
        sink: OutputSink,
    },
    Abort {
        id: RequestId,
    },
    SetDepth {
        depth: usize,
        reply: oneshot::Sender<Result<()>>,
    },
    LoadLayers {
        upto: usize,
        raise_depth: bool,
        reply: oneshot::Sender<Result<LoadReport>>,
    },
    SetBudget {
        bytes: u64,
        reply: oneshot::Sender<Result<LoadReport>>,
    },
    Park {
        reply: oneshot::Sender<Result<LoadReport>>,
    },
    ClearPrefixCache {
        reply: oneshot::Sender<Result<usize>>,
    },
    DropLayers {
        keep: usize,
        reply: oneshot::Sender<Result<LoadReport>>,
    },
    SetProbe {
        probe: Option<ExitProbe>,
    },
    Stats {
        reply: oneshot::Sender<Result<EngineStats>>,
    },
    Shutdown {
        reply: oneshot::Sender<Result<()>>,
    },
}

/// A reply on its way from the engine thread: [`Pending::wait`] from plain threads,
/// [`Pending::recv`] from async code.
#[derive(Debug)]
pub struct Pending<T> {
    rx: Option<oneshot::Receiver<Result<T>>>,
}

impl<T> Pending<T> {
    /// Blocks until the engine answers. Must not be called from inside an async runtime.
    pub fn wait(self) -> Result<T> {
        match self.rx {
            Some(rx) => rx
                .blocking_recv()
                .unwrap_or(Err(EngineError::EngineStopped)),
            None => Err(EngineError::EngineStopped),
        }
    }

    pub async fn recv(self) -> Result<T> {
        match self.rx {
            Some(rx) => rx.await.unwrap_or(Err(EngineError::EngineStopped)),
            None => Err(EngineError::EngineStopped),
        }
    }
}

/// One request's outputs, in order; the last one has a finish reason (or is an error).
/// Dropping it aborts the request.
#[derive(Debug)]
pub struct RequestStream {
    id: RequestId,
    rx: tmpsc::Receiver<Result<RequestOutput>>,
}

impl RequestStream {
    pub fn id(&self) -> RequestId {
        self.id
    }

    pub async fn next(&mut self) -> Option<Result<RequestOutput>> {
        self.rx.recv().await
    }

    /// The next output if one is ready (`None` when none is, or the stream has ended).
    pub fn try_next(&mut self) -> Option<Result<RequestOutput>> {
        self.rx.try_recv().ok()
    }

    /// Blocks for the next output. Must not be called from inside an async runtime.
    pub fn blocking_next(&mut self) -> Option<Result<RequestOutput>> {
        self.rx.blocking_recv()
    }

    /// Blocks until the request ends and gathers it.
    pub fn wait(mut self) -> Result<Completion> {
        let mut outputs = Vec::new();
        while let Some(o) = self.blocking_next() {
            let o = o?;
            let last = o.finish_reason.is_some();
            outputs.push(o);
            if last {
                break;
            }
        }
        Completion::gather(outputs).ok_or(EngineError::EngineStopped)
    }
}

/// The handle to a running engine; clone it freely.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    next_id: Arc<AtomicU64>,
    info: Arc<EngineInfo>,
    liveness: Arc<Liveness>,
}

impl EngineHandle {
    /// Runs `serve` on a thread named `thread`, reading the commands the returned handle
    /// sends. A panic in it is caught and logged, and the engine is marked
    /// [`EngineStatus::Failed`] rather than left looking alive.
    pub(crate) fn run(
        thread: &str,
        info: EngineInfo,
        serve: impl FnOnce(mpsc::Receiver<Command>) + Send + 'static,
    ) -> Result<Self> {
        let liveness = Arc::new(Liveness::new(&info.model));
        Self::run_with(liveness, thread, info, serve)
    }

    /// [`EngineHandle::run`] with the status shared with whoever else reports on it.
    pub(crate) fn run_with(
        liveness: Arc<Liveness>,
        thread: &str,
        info: EngineInfo,
        serve: impl FnOnce(mpsc::Receiver<Command>) + Send + 'static,
    ) -> Result<Self> {
        let (tx, rx) = mpsc::channel();
        let alive = Arc::clone(&liveness);
        std::thread::Builder::new()
            .name(thread.into())
            .spawn(move || {
                match std::panic::catch_unwind(AssertUnwindSafe(|| serve(rx))) {
                    Ok(()) => alive.stop(),
                    Err(panic) => {
                        alive.fail();
                        tracing::error!(
                            model = %alive.model,
                            panic = panic_message(&*panic),
                            "the engine thread panicked; the model is down until the server restarts"
                        );
                    }
                }
            })
            .map_err(|e| EngineError::BadConfig(format!("cannot start the {thread} thread: {e}")))?;
        Ok(Self {
            tx,
            next_id: Arc::new(AtomicU64::new(0)),
            info: Arc::new(info),
            liveness,
        })
    }

    /// Whether the engine thread serves, has stopped, or failed.
    pub fn status(&self) -> EngineStatus {
        self.liveness.status()
    }
}

impl EngineHandle {
    /// Builds an engine over `model` (see [`EngineCore::new`]) that stops on the tokenizer's
    /// end-of-generation tokens, and starts it.
    pub fn start(
        model: LayeredModel,
        tokenizer: Arc<Tokenizer>,
        cfg: EngineConfig,
        model_name: &str,
    ) -> Result<Self> {
        let eog = end_of_generation_tokens(&tokenizer);
        let core = EngineCore::new(model, eog, cfg)?;
        Self::spawn(core, tokenizer, model_name)
    }

    /// Starts the engine thread; it runs until [`EngineHandle::shutdown`] or until every
    /// handle is dropped and no request is left.
    pub fn spawn(
        mut core: EngineCore,
        tokenizer: Arc<Tokenizer>,
        model_name: &str,
    ) -> Result<Self> {
        let spec = core.model().spec();
        let info = EngineInfo::new(
            model_name,
            core.model().n_layers(),
            core.scheduler().context(),
            spec.vocab_size,
            Arc::clone(&tokenizer),
        );
        core.set_grammar(Arc::clone(&info.grammar));
        Self::run("switchyard-engine", info, move |rx| {
            serve(core, &tokenizer, rx)
        })
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// Queues a request; its outputs arrive on the returned stream. Requests that can never
    /// run (empty, longer than the context, invalid sampling) are refused here; one that
    /// cannot fit the memory budget gets the error as the first item of its stream.
    pub fn add_request(&self, request: EngineRequest) -> Result<RequestStream> {
        self.add_request_with_bell(request, None)
    }

    /// [`EngineHandle::add_request`], ringing `bell` after each output of the request (see
    /// [`Doorbell`]).
    pub fn add_request_with_bell(
        &self,
        request: EngineRequest,
        bell: Option<&Doorbell>,
    ) -> Result<RequestStream> {
        if self.status() == EngineStatus::Failed {
            return Err(self.liveness.failure());
        }
        request.params.validate()?;
        let prompt = request.prompt.len();
        if prompt == 0 {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt >= self.info.context_length {
            return Err(EngineError::PromptTooLong {
                prompt,
                context: self.info.context_length,
            });
        }
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (sink, rx) = OutputSink::channel(OUTPUT_BUFFER, Arc::clone(&self.liveness));
        let sink = sink.with_bell(bell.cloned());
        self.tx
            .send(Command::Add {
                id,
                request: Box::new(request),
                arrival: Instant::now(),
                sink,
            })
            .map_err(|_| match self.status() {
                EngineStatus::Failed => self.liveness.failure(),
                _ => EngineError::EngineStopped,
            })?;
        Ok(RequestStream { id, rx })
    }

    /// Ends a request (its stream gets a last output with [`FinishReason::Abort`]).
    pub fn abort(&self, id: RequestId) {
        let _ = self.tx.send(Command::Abort { id });
    }

    /// Runs layers `0..depth` from the next step on.
    pub fn set_depth(&self, depth: usize) -> Pending<()> {
        self.ask(|reply| Command::SetDepth { depth, reply })
    }

    /// Loads layers `resident..upto` in the background (making room in the budget first);
    /// the reply comes when all are installed. With `raise_depth`, the depth becomes `upto`.
    pub fn load_layers(&self, upto: usize, raise_depth: bool) -> Pending<LoadReport> {
        self.ask(|reply| Command::LoadLayers {
            upto,
            raise_depth,
            reply,
        })
    }

    /// Keeps layers `0..keep` resident; their memory goes to the KV pool.
    pub fn drop_layers(&self, keep: usize) -> Pending<LoadReport> {
        self.ask(|reply| Command::DropLayers { keep, reply })
    }

    /// Makes the engine's memory budget `bytes` from the next step on (see
    /// [`crate::EngineCore::set_budget`]).
    pub fn set_budget(&self, bytes: u64) -> Pending<LoadReport> {
        self.ask(|reply| Command::SetBudget { bytes, reply })
    }

    /// Frees the model's layers, embedding and head and the KV pool (see
    /// [`crate::EngineCore::park`]); the next [`EngineHandle::load_layers`] holds them again.
    pub fn park(&self) -> Pending<LoadReport> {
        self.ask(|reply| Command::Park { reply })
    }

    /// Tests `probe`'s exits below the serving depth from the next step on (`None`: stop).
    /// Outputs then carry each token's first passing probed exit.
    pub fn set_probe(&self, probe: Option<ExitProbe>) {
        let _ = self.tx.send(Command::SetProbe { probe });
    }

    pub fn stats(&self) -> Pending<EngineStats> {
        self.ask(|reply| Command::Stats { reply })
    }

    /// Empties the prefix cache (see [`crate::EngineCore::clear_prefix_cache`]); the reply is
    /// the number of blocks that went back to the pool. Engines without one reply 0.
    pub fn clear_prefix_cache(&self) -> Pending<usize> {
        self.ask(|reply| Command::ClearPrefixCache { reply })
    }

    /// Aborts every request and stops the engine thread.
    pub fn shutdown(&self) -> Pending<()> {
        self.ask(|reply| Command::Shutdown { reply })
    }

    fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<Result<T>>) -> Command) -> Pending<T> {
        let (reply, rx) = oneshot::channel();
        Pending {
            rx: self.tx.send(make(reply)).is_ok().then_some(rx),
        }
    }
}

/// A background layer load in progress.
struct Loading {
    rx: mpsc::Receiver<Result<LoadedLayer>>,
    upto: usize,
    raise_depth: bool,
    report: LoadReport,
    error: Option<EngineError>,
    reply: oneshot::Sender<Result<LoadReport>>,
}

/// The engine thread.
struct Server<'t> {
    core: EngineCore,
    out: OutputProcessor<'t>,
    loading: Option<Loading>,
}

enum Flow {
    Continue,
    /// Shut down; answer once the command channel is closed, so no later command is lost
    /// in a channel nobody reads.
    Stop(oneshot::Sender<Result<()>>),
}

fn serve(core: EngineCore, tokenizer: &Tokenizer, rx: mpsc::Receiver<Command>) {
    let mut s = Server {
        core,
        out: OutputProcessor::new(tokenizer),
        loading: None,
    };
    loop {
        // Block for a command only when there is nothing to run.
        if !s.core.has_work() {
            let cmd = if s.loading.is_some() {
                match rx.recv_timeout(LOAD_POLL) {
                    Ok(c) => Some(c),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            } else {
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => break,
                }
            };
            if let Some(c) = cmd {
                if let Flow::Stop(reply) = s.command(c) {
                    drop(rx);
                    let _ = reply.send(Ok(()));
                    return;
                }
            }
        }
        while let Ok(c) = rx.try_recv() {
            if let Flow::Stop(reply) = s.command(c) {
                drop(rx);
                let _ = reply.send(Ok(()));
                return;
            }
        }
        s.poll_load();
        for id in s.out.closed() {
            s.core.abort(id);
            s.out.remove(id);
        }
        if s.core.has_work() {
            let (core, out) = (&mut s.core, &mut s.out);
            let (ended, idle) = prof::record_step(|| {
                let result = core.step();
                let (batch, tokens) = (result.batch, result.tokens);
                let _output = prof::time(Part::Output);
                ((out.process(result), batch == 0), batch, tokens)
            });
            for id in ended {
                s.core.abort(id);
            }
            if idle {
                // Nothing could run (e.g. all memory is being handed to a layer load).
                std::thread::sleep(LOAD_POLL);
            }
        }
    }
    s.stop();
}

impl Server<'_> {
    fn command(&mut self, c: Command) -> Flow {
        match c {
            Command::Add {
                id,
                request,
                arrival,
                sink,
            } => {
                let prompt = request.prompt.len();
                let stop = request.params.stop.clone();
                match self.core.add_request(id, *request) {
                    Ok(()) => self.out.add(id, prompt, &stop, arrival, sink),
                    Err(e) => {
                        let _ = sink.send(Err(e));
                    }
                }
            }
            Command::Abort { id } => {
                if self.core.abort(id) {
                    self.out.finish(id, FinishReason::Abort);
                }
            }
            Command::SetDepth { depth, reply } => {
                let _ = reply.send(self.core.set_depth(depth));
            }
            Command::LoadLayers {
                upto,
                raise_depth,
                reply,
            } => self.start_load(upto, raise_depth, reply),
            Command::DropLayers { keep, reply } => {
                let _ = reply.send(self.core.drop_layers(keep));
            }
            Command::SetBudget { bytes, reply } => {
                let _ = reply.send(self.core.set_budget(bytes));
            }
            Command::Park { reply } => {
                let _ = reply.send(self.core.park());
            }
            Command::ClearPrefixCache { reply } => {
                let _ = reply.send(Ok(self.core.clear_prefix_cache()));
            }
            Command::SetProbe { probe } => self.core.set_probe(probe),
            Command::Stats { reply } => {
                let _ = reply.send(Ok(self.core.stats()));
            }
            Command::Shutdown { reply } => {
                self.stop();
                return Flow::Stop(reply);
            }
        }
        Flow::Continue
    }

    fn start_load(
        &mut self,
        upto: usize,
        raise_depth: bool,
        reply: oneshot::Sender<Result<LoadReport>>,
    ) {
        let (job, report) = match self.core.begin_load(upto) {
            Ok(j) => j,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        for id in &report.preempted {
            tracing::info!(id = id.0, "preempted to make room for layers");
        }
        let (tx, rx) = mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("switchyard-layer-load".into())
            .spawn(move || job.run(|r| tx.send(r).is_ok()));
        if let Err(e) = spawned {
            self.core.finish_load();
            let _ = reply.send(Err(EngineError::BadConfig(format!(
                "cannot start the layer-load thread: {e}"
            ))));
            return;
        }
        self.loading = Some(Loading {
            rx,
            upto,
            raise_depth,
            report,
            error: None,
            reply,
        });
    }

    /// Installs the layers a background load has finished; completes the load when its
    /// thread is done.
    fn poll_load(&mut self) {
        let Some(l) = self.loading.as_mut() else {
            return;
        };
        loop {
            match l.rx.try_recv() {
                Ok(Ok(layer)) => match self.core.install_layer(layer) {
                    Ok(t) => l.report.layers.push(t),
                    Err(e) => l.error = Some(e),
                },
                Ok(Err(e)) => l.error = Some(e),
                Err(mpsc::TryRecvError::Empty) => return,
                Err(mpsc::TryRecvError::Disconnected) => break,
            }
        }
        let Some(l) = self.loading.take() else {
            return;
        };
        self.core.finish_load();
        let result = match l.error {
            Some(e) => Err(e),
            None if l.raise_depth => self.core.set_depth(l.upto).map(|()| l.report),
            None => Ok(l.report),
        };
        let _ = l.reply.send(result);
    }

    /// Aborts every request.
    fn stop(&mut self) {
        let ids: Vec<RequestId> = self.core.scheduler().waiting().collect();
        let running: Vec<RequestId> = self.core.scheduler().running().to_vec();
        for id in ids.into_iter().chain(running) {
            self.core.abort(id);
            self.out.finish(id, FinishReason::Abort);
        }
    }
}
