//! A model served by a remote OpenAI-compatible server (vLLM, SGLang, llama.cpp's server,
//! another Switchyard), or by several replicas of one: requests are forwarded with the remote
//! model name to the healthy replica with the fewest requests in flight, streams are relayed
//! unchanged event by event, a request that fails before any of its answer came back is
//! retried once on another replica, failures become OpenAI errors naming the backend (an
//! error event when a stream breaks off), and a background task health-checks every replica
//! (one that fails is skipped until it passes again).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;

use crate::config::{BackendSection, DEFAULT_HEALTH_INTERVAL_S, DEFAULT_REQUEST_TIMEOUT_S};
use crate::error::ApiError;
use crate::serving::{Admitted, Backend, Place, Places, Started};
use crate::validate::ValidRequest;

/// Time allowed to open a connection to a backend.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// One URL of a backend, with its own health and load.
struct Replica {
    url: String,
    healthy: AtomicBool,
    /// Requests forwarded to it and not finished (relayed streams included).
    in_flight: AtomicUsize,
}

/// Counts a request against its replica until dropped.
struct ReplicaLoad {
    model: Arc<RemoteModel>,
    replica: usize,
}

impl ReplicaLoad {
    /// The error for a replica whose answer broke off after its head: the request's time
    /// ran out, or the replica failed (reset, closed, killed) and is marked down until its
    /// health check passes again.
    fn failed(&self, e: &reqwest::Error) -> ApiError {
        if e.is_timeout() {
            return ApiError::Timeout(self.model.timeout_s);
        }
        // reqwest's message is "error decoding response body"; the cause is in the chain.
        let mut why = e.to_string();
        let mut source = std::error::Error::source(e);
        while let Some(s) = source {
            why.push_str(": ");
            why.push_str(&s.to_string());
            source = s.source();
        }
        let url = &self.model.replicas[self.replica].url;
        self.model.mark_down(self.replica, &why);
        self.model
            .unavailable(format!("replica {url} failed mid-answer: {why}"))
    }
}

impl Drop for ReplicaLoad {
    fn drop(&mut self) {
        if let Some(r) = self.model.replicas.get(self.replica) {
            r.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// How one attempt on one replica failed.
enum Attempt {
    /// Before any of the answer came back (connection refused or reset, or the replica
    /// answered 502/503): another replica may serve the request.
    Retryable(String),
    /// Otherwise (a timeout: the replica may still be generating).
    Final(ApiError),
}

pub struct RemoteModel {
    pub name: String,
    replicas: Vec<Replica>,
    remote_model: String,
    api_key: Option<String>,
    client: reqwest::Client,
    health_interval: Duration,
    timeout_s: u64,
    in_flight: Places,
    /// Rotates the choice among equally loaded replicas.
    turn: AtomicUsize,
}

/// A replica's state, for `/admin/stats`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReplicaStatus {
    pub url: String,
    pub healthy: bool,
    pub in_flight: usize,
}

impl RemoteModel {
    pub fn new(section: &BackendSection) -> Result<Self, ApiError> {
        let timeout_s = section.timeout_s.unwrap_or(DEFAULT_REQUEST_TIMEOUT_S);
        let timeout = Duration::from_secs(timeout_s);
        let client = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(timeout)
            .build()
            .map_err(|e| ApiError::Internal(format!("building the HTTP client: {e}")))?;
        let replicas = section
            .replica_urls()
            .into_iter()
            .map(|u| Replica {
                url: u.trim_end_matches('/').to_string(),
                healthy: AtomicBool::new(true),
                in_flight: AtomicUsize::new(0),
            })
            .collect();
        Ok(Self {
            name: section.name.clone(),
            replicas,
            remote_model: section
                .model
                .clone()
                .unwrap_or_else(|| section.name.clone()),
            api_key: section.api_key.clone(),
            client,
            health_interval: Duration::from_secs(
                section
                    .health_interval_s
                    .unwrap_or(DEFAULT_HEALTH_INTERVAL_S),
            ),
            timeout_s,
            in_flight: Places::default(),
            turn: AtomicUsize::new(0),
        })
    }

    /// Whether any replica passed its last health check.
    pub fn is_healthy(&self) -> bool {
        self.replicas
            .iter()
            .any(|r| r.healthy.load(Ordering::SeqCst))
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.in_flight()
    }

    pub fn replicas(&self) -> Vec<ReplicaStatus> {
        self.replicas
            .iter()
            .map(|r| ReplicaStatus {
                url: r.url.clone(),
                healthy: r.healthy.load(Ordering::SeqCst),
                in_flight: r.in_flight.load(Ordering::SeqCst),
            })
            .collect()
    }

    fn unavailable(&self, detail: impl Into<String>) -> ApiError {
        ApiError::BackendUnavailable {
            model: self.name.clone(),
            detail: detail.into(),
        }
    }

    /// The healthy replica with the fewest requests in flight, other than `skip`; ties go
    /// round the replicas in turn.
    fn pick(&self, skip: Option<usize>) -> Option<usize> {
        let n = self.replicas.len();
        let start = self.turn.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|k| (start + k) % n)
            .filter(|&i| Some(i) != skip && self.replicas[i].healthy.load(Ordering::SeqCst))
            .min_by_key(|&i| self.replicas[i].in_flight.load(Ordering::SeqCst))
    }

    fn mark_down(&self, i: usize, why: &str) {
        if self.replicas[i].healthy.swap(false, Ordering::SeqCst) {
            tracing::warn!(backend = %self.name, url = %self.replicas[i].url, reason = why, "replica marked down");
        }
    }

    /// One attempt on replica `i`: the answer's head, with the replica counted as loaded
    /// until the returned guard is dropped.
    async fn attempt(
        self: &Arc<Self>,
        i: usize,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<(reqwest::Response, ReplicaLoad), Attempt> {
        let replica = &self.replicas[i];
        replica.in_flight.fetch_add(1, Ordering::SeqCst);
        let load = ReplicaLoad {
            model: Arc::clone(self),
            replica: i,
        };
        let mut r = self
            .client
            .post(format!("{}{path}", replica.url))
            .json(body);
        if let Some(k) = &self.api_key {
            r = r.bearer_auth(k);
        }
        match r.send().await {
            Ok(resp)
                if matches!(
                    resp.status(),
                    reqwest::StatusCode::BAD_GATEWAY | reqwest::StatusCode::SERVICE_UNAVAILABLE
                ) =>
            {
                Err(Attempt::Retryable(format!(
                    "{} answered {}",
                    replica.url,
                    resp.status()
                )))
            }
            Ok(resp) => Ok((resp, load)),
            Err(e) if e.is_timeout() => Err(Attempt::Final(ApiError::Timeout(self.timeout_s))),
            Err(e) => {
                self.mark_down(i, &e.to_string());
                Err(Attempt::Retryable(format!("{}: {e}", replica.url)))
            }
        }
    }

    /// Forwards the request: `body` as the client sent it (fields this server does not know
    /// included), with the remote's model name, to the least loaded healthy replica. A
    /// request that fails before any of its answer came back is tried once more on another
    /// replica. A streamed answer is relayed unchanged as its events arrive; a whole one is
    /// read, then passed on.
    pub async fn forward(
        self: &Arc<Self>,
        req: &ValidRequest,
        body: &[u8],
        admission: Place,
    ) -> Result<Response, ApiError> {
        let mut body: serde_json::Value = serde_json::from_slice(body)
            .map_err(|e| ApiError::Malformed(format!("the request body is not valid JSON: {e}")))?;
        if let Some(o) = body.as_object_mut() {
            o.insert("model".into(), self.remote_model.clone().into());
        }
        let path = req.endpoint.path();
        let first = self.pick(None).ok_or_else(|| {
            self.unavailable(if self.replicas.len() == 1 {
                "the last health check failed".to_string()
            } else {
                format!(
                    "all {} replicas failed their last health check",
                    self.replicas.len()
                )
            })
        })?;
        let (resp, load) = match self.attempt(first, path, &body).await {
            Err(Attempt::Retryable(why)) => {
                let second = self
                    .pick(Some(first))
                    .ok_or_else(|| self.unavailable(why.as_str()))?;
                tracing::warn!(backend = %self.name, failed = %why, retry = %self.replicas[second].url, "retrying on another replica");
                match self.attempt(second, path, &body).await {
                    Err(Attempt::Retryable(again)) => {
                        return Err(self.unavailable(format!("{why}; then {again}")))
                    }
                    other => other,
                }
            }
            other => other,
        }
        .map_err(|a| match a {
            Attempt::Final(e) => e,
            Attempt::Retryable(why) => self.unavailable(why),
        })?;
        let status =
            StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        let content_type = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .cloned()
            .unwrap_or(header::HeaderValue::from_static("application/json"));
        let streamed = content_type
            .to_str()
            .is_ok_and(|v| v.starts_with("text/event-stream"));
        let mut out = if streamed {
            Body::from_stream(relay_events(resp, admission, load)).into_response()
        } else {
            // A whole answer is read before it is passed on, so that a replica that fails
            // while sending it still gets the client a 502 naming it, not a cut connection.
            let bytes = resp.bytes().await.map_err(|e| load.failed(&e))?;
            drop((admission, load));
            Body::from(bytes).into_response()
        };
        *out.status_mut() = status;
        out.headers_mut().insert(header::CONTENT_TYPE, content_type);
        Ok(out)
    }

    /// Whether replica `i` answers its model list: the health check.
    async fn check(&self, i: usize) -> bool {
        let mut r = self
            .client
            .get(format!("{}/v1/models", self.replicas[i].url));
        if let Some(k) = &self.api_key {
            r = r.bearer_auth(k);
        }
        matches!(r.timeout(CONNECT_TIMEOUT).send().await, Ok(resp) if resp.status().is_success())
    }

    /// Health-checks every replica every `health_interval` until the process ends: a replica
    /// that fails is skipped until it passes again.
    pub async fn health_loop(self: Arc<Self>) {
        loop {
            for i in 0..self.replicas.len() {
                let ok = self.check(i).await;
                let r = &self.replicas[i];
                if ok != r.healthy.swap(ok, Ordering::SeqCst) {
                    // Warned as the failure was, so the log that shows one shows the other.
                    if ok {
                        tracing::warn!(backend = %self.name, url = %r.url, "replica is healthy again");
                    } else {
                        tracing::warn!(backend = %self.name, url = %r.url, "replica health check failed");
                    }
                }
            }
            tokio::time::sleep(self.health_interval).await;
        }
    }
}

/// A relayed event stream is held back to the end of its last complete event, at most this
/// much of it (a backend that never ends an event is then passed on as it comes).
const MAX_PARTIAL_EVENT_BYTES: usize = 1 << 20;

/// Where the last complete server-sent event in `buf` ends: after its blank line (`\n\n`, or
/// `\r\n\r\n` from a server that ends lines so).
fn events_end(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).rposition(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = buf
        .windows(4)
        .rposition(|w| w == b"\r\n\r\n")
        .map(|i| i + 4);
    lf.max(crlf)
}

/// What a relayed event stream still holds: the replica's stream, the bytes of an event not
/// yet complete, and the request's places.
struct Relay {
    inner: futures::stream::BoxStream<'static, reqwest::Result<axum::body::Bytes>>,
    partial: Vec<u8>,
    load: ReplicaLoad,
    _admission: Place,
}

/// The replica's events relayed unchanged, whole events at a time. When the replica fails
/// mid-stream (killed, reset), the partial event it left is dropped and the stream ends as a
/// local one does on an error: an error event naming the backend and the replica, then
/// `[DONE]`; the replica is marked down.
fn relay_events(
    resp: reqwest::Response,
    admission: Place,
    load: ReplicaLoad,
) -> impl futures::Stream<Item = Result<axum::body::Bytes, std::convert::Infallible>> {
    let relay = Relay {
        inner: resp.bytes_stream().boxed(),
        partial: Vec::new(),
        load,
        _admission: admission,
    };
    futures::stream::unfold(Some(relay), |relay| async move {
        let mut r = relay?;
        loop {
            match r.inner.next().await {
                Some(Ok(bytes)) => {
                    r.partial.extend_from_slice(&bytes);
                    let end = if r.partial.len() > MAX_PARTIAL_EVENT_BYTES {
                        Some(r.partial.len())
                    } else {
                        events_end(&r.partial)
                    };
                    if let Some(end) = end {
                        let rest = r.partial.split_off(end);
                        let whole = std::mem::replace(&mut r.partial, rest);
                        return Some((Ok(whole.into()), Some(r)));
                    }
                }
                None if r.partial.is_empty() => return None,
                None => {
                    let rest = std::mem::take(&mut r.partial);
                    return Some((Ok(rest.into()), None));
                }
                Some(Err(e)) => {
                    let body = serde_json::to_string(&r.load.failed(&e).body())
                        .unwrap_or_else(|_| "{}".into());
                    let end = format!("data: {body}\n\ndata: [DONE]\n\n");
                    return Some((Ok(end.into()), None));
                }
            }
        }
    })
}

impl Backend for RemoteModel {
    fn places(&self) -> &Places {
        &self.in_flight
    }

    async fn start(self: &Arc<Self>, a: Admitted<'_>) -> Result<Started, ApiError> {
        let (admission, req, ctx) = (a.place, a.req, a.ctx);
        let resp = self.forward(&req, &ctx.body, admission).await?;
        Ok(Started::Relayed(resp))
    }
}

#[cfg(test)]
mod tests {
    use super::events_end;

    #[test]
    fn events_end_after_the_last_blank_line() {
        assert_eq!(events_end(b"data: {}\n\ndata: [DO"), Some(10));
        assert_eq!(events_end(b"data: a\n\ndata: b\n\n"), Some(18));
        assert_eq!(events_end(b"data: a\r\n\r\ndata"), Some(11));
        assert_eq!(events_end(b"data: a\ndata: b\n"), None);
        assert_eq!(events_end(b""), None);
    }
}
