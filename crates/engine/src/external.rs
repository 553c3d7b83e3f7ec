//! An engine handle over a backend that serves requests by itself, such as a remote
//! OpenAI-compatible server: the handle's protocol stays the same, so a controller that drives
//! local engines (HELIOS) can drive it too.
//!
//! Such a backend serves at its full depth only: loading layers succeeds with nothing to load,
//! dropping layers frees nothing locally, a depth other than the full one is refused, and
//! exit probes are ignored (its outputs report no probed exit).

use std::sync::{mpsc, Arc};
use std::time::Instant;

use crate::core::EngineRequest;
use crate::handle::{Command, EngineHandle, EngineInfo, Reachability};
use crate::output::OutputSink;
use crate::residency::LoadReport;
use crate::sequential::{stats_of, Shape};
use crate::status::Liveness;
use crate::{EngineError, RequestId, Result};

/// Something that serves requests on its own threads.
pub trait RequestBackend: Send + 'static {
    /// Begins serving `request`. Its outputs go to `sink`, the last one with a finish reason
    /// (or an error); a closed sink means the client went away and the request should end.
    fn start(&mut self, id: RequestId, request: EngineRequest, arrival: Instant, sink: OutputSink);

    /// Ends `id` early; its last output then has `FinishReason::Abort`.
    fn abort(&mut self, id: RequestId);

    /// Ends every request.
    fn abort_all(&mut self);

    /// Requests in flight.
    fn running(&self) -> usize;

    /// Called once before the first request with the means to mark the handle unreachable
    /// and reachable again (a backend that serves through a server it can lose).
    fn watch(&mut self, _reachability: Reachability) {}
}

impl EngineHandle {
    /// Serves `backend` behind an engine handle; `info.n_layers` is its only depth.
    pub fn spawn_backend(mut backend: Box<dyn RequestBackend>, info: EngineInfo) -> Result<Self> {
        let shape = Shape {
            n_layers: info.n_layers,
            memory_budget: 0,
            weights_bytes: 0,
        };
        let liveness = Arc::new(Liveness::new(&info.model));
        backend.watch(Reachability(Arc::clone(&liveness)));
        Self::run_with(liveness, "switchyard-backend", info, move |rx| {
            serve(backend, shape, &rx)
        })
    }
}

fn serve(mut backend: Box<dyn RequestBackend>, shape: Shape, rx: &mpsc::Receiver<Command>) {
    while let Ok(c) = rx.recv() {
        match c {
            Command::Add {
                id,
                request,
                arrival,
                sink,
            } => backend.start(id, *request, arrival, sink),
            Command::Abort { id } => backend.abort(id),
            Command::SetDepth { depth, reply } => {
                let _ = reply.send(if depth == shape.n_layers {
                    Ok(())
                } else {
                    Err(EngineError::BadConfig(format!(
                        "this backend serves at its full depth ({}) only, not {depth}",
                        shape.n_layers
                    )))
                });
            }
            Command::LoadLayers { reply, .. }
            | Command::DropLayers { reply, .. }
            | Command::SetBudget { reply, .. }
            | Command::Park { reply } => {
                let _ = reply.send(Ok(LoadReport::default()));
            }
            Command::ClearPrefixCache { reply } => {
                let _ = reply.send(Ok(0));
            }
            Command::SetProbe { .. } => {}
            Command::Stats { reply } => {
                let _ = reply.send(Ok(stats_of(&shape, backend.running(), 0)));
            }
            Command::Shutdown { reply } => {
                backend.abort_all();
                drop(backend);
                let _ = reply.send(Ok(()));
                return;
            }
        }
    }
    backend.abort_all();
}
