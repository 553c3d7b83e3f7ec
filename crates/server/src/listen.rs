//! The accept loop: bounded connections and bounded time to send a request's head.
//!
//! `axum::serve` sets neither, so a client that opens connections and sends nothing (or a
//! header a byte at a time: slowloris) would hold sockets and tasks without end. Here, as
//! nginx's `worker_connections` and `client_header_timeout` do:
//! - at most `max_connections` connections are open; one over the limit is answered at once
//!   with 503, `Retry-After` and `Connection: close`, and closed;
//! - a connection has `header_timeout_s` to send a request's whole head, which also bounds how
//!   long an idle keep-alive connection is kept (hyper's HTTP/1 header read timeout);
//! - the request body has its own limit (`body_timeout_s`, in the handlers), and a reader that
//!   stops reading a stream its own (`write_timeout_s` and the engine's output buffer).
//!
//! Shutdown stops accepting, lets open connections finish their requests (graceful), and
//! returns once they have.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::error::RETRY_AFTER_SECS;
use crate::metrics::Metrics;

/// How long a refused connection may take to send its request head before the 503 (a client
/// that gets an answer before it has sent its request may not read it).
const REFUSED_HEAD_WAIT: Duration = Duration::from_secs(2);
/// Most bytes of a refused connection's request read before the 503 is written.
const REFUSED_HEAD_BYTES: usize = 16 << 10;
/// How long a refused connection is drained after the 503, so that closing it does not reset
/// the connection before the client has read the answer.
const REFUSED_DRAIN: Duration = Duration::from_millis(500);
/// Refusals answered at once; connections over the limit beyond these are closed unanswered,
/// so that a flood of connections cannot pile up refusal tasks either.
const MAX_REFUSING: usize = 64;
/// Pause after an accept error that is not the client's (out of file descriptors), so the
/// loop does not spin while the process is at its limit.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The limits the accept loop enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub header_timeout: Duration,
}

impl ConnectionLimits {
    pub fn of(server: &crate::config::ServerSection) -> Self {
        Self {
            max_connections: server.max_connections,
            header_timeout: Duration::from_secs(server.header_timeout_s),
        }
    }
}

/// The answer to a connection over the limit.
fn refusal() -> Vec<u8> {
    let body = format!(
        "{{\"error\":{{\"message\":\"the server has its maximum number of open connections; \
         retry after {RETRY_AFTER_SECS} s\",\"type\":\"server_overloaded\",\"param\":null,\
         \"code\":503}}}}"
    );
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: {RETRY_AFTER_SECS}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Reads the request head (bounded in time and bytes), answers with the refusal, then drains
/// what else the client sent for a moment before closing.
async fn refuse(mut stream: TcpStream) {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(REFUSED_HEAD_WAIT, async {
        while head.len() < REFUSED_HEAD_BYTES && !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    if stream.write_all(&refusal()).await.is_err() {
        return;
    }
    let _ = stream.shutdown().await;
    let _ = tokio::time::timeout(REFUSED_DRAIN, async {
        while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// Serves `app` on `listener` under `limits` until `shutdown` completes, then waits for the
/// open connections to finish their requests.
pub async fn serve_connections(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    metrics: Option<Metrics>,
    shutdown: impl Future<Output = ()>,
) {
    // HTTP/1.1 only, as uvicorn (vLLM) and llama.cpp's server speak: detecting HTTP/2 first
    // reads the connection's first bytes with no time limit, which is what slowloris needs.
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let graceful = GracefulShutdown::new();
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Errors of one connection (reset before accept) say nothing about the
                    // listener; others (EMFILE) pass once connections close.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            if let Some(m) = &metrics {
                m.connections_closed.with_label_values(&["limit"]).inc();
            }
            tracing::warn!(
                limit = limits.max_connections,
                "connection refused: at the connection limit"
            );
            if let Ok(slot) = Arc::clone(&refusing).try_acquire_owned() {
                tokio::spawn(async move {
                    refuse(stream).await;
                    drop(slot);
                });
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let conn = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        let metrics = metrics.clone();
        if let Some(m) = &metrics {
            m.connections_open.inc();
        }
        tokio::spawn(async move {
            let result = conn.await;
            if let Some(m) = &metrics {
                m.connections_open.dec();
                let timed_out = result.as_ref().err().is_some_and(hyper::Error::is_timeout);
                if timed_out {
                    m.connections_closed
                        .with_label_values(&["header_timeout"])
                        .inc();
                }
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}
