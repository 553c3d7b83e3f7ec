//! A model served by a remote OpenAI-compatible server (vLLM, SGLang, llama.cpp's server,
//! another Switchyard): requests are forwarded with the remote model name, streams are relayed
//! byte for byte, failures become OpenAI errors, and a background task health-checks it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::TryStreamExt;

use crate::config::{BackendSection, DEFAULT_HEALTH_INTERVAL_S, DEFAULT_REQUEST_TIMEOUT_S};
use crate::error::ApiError;
use crate::validate::ValidRequest;

/// Time allowed to open a connection to a backend.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

pub struct RemoteModel {
    pub name: String,
    url: String,
    remote_model: String,
    api_key: Option<String>,
    client: reqwest::Client,
    healthy: AtomicBool,
    health_interval: Duration,
    timeout_s: u64,
    in_flight: AtomicUsize,
}

/// Counts a forwarded request as in flight until dropped.
pub struct RemoteAdmission {
    model: Arc<RemoteModel>,
}

impl Drop for RemoteAdmission {
    fn drop(&mut self) {
        self.model.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
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
        Ok(Self {
            name: section.name.clone(),
            url: section.url.trim_end_matches('/').to_string(),
            remote_model: section
                .model
                .clone()
                .unwrap_or_else(|| section.name.clone()),
            api_key: section.api_key.clone(),
            client,
            healthy: AtomicBool::new(true),
            health_interval: Duration::from_secs(
                section
                    .health_interval_s
                    .unwrap_or(DEFAULT_HEALTH_INTERVAL_S),
            ),
            timeout_s,
            in_flight: AtomicUsize::new(0),
        })
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::SeqCst)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    pub fn admit(self: &Arc<Self>, limit: usize) -> Result<RemoteAdmission, ApiError> {
        let prev = self.in_flight.fetch_add(1, Ordering::SeqCst);
        if prev >= limit {
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::Overloaded(prev));
        }
        Ok(RemoteAdmission {
            model: Arc::clone(self),
        })
    }

    fn unavailable(&self, detail: impl Into<String>) -> ApiError {
        ApiError::BackendUnavailable {
            model: self.name.clone(),
            detail: detail.into(),
        }
    }

    /// Forwards the request: `body` as the client sent it (fields this server does not know
    /// included), with the remote's model name. A streamed answer is relayed unchanged as it
    /// arrives.
    pub async fn forward(
        self: &Arc<Self>,
        req: &ValidRequest,
        body: &[u8],
        admission: RemoteAdmission,
    ) -> Result<Response, ApiError> {
        if !self.is_healthy() {
            return Err(self.unavailable("the last health check failed"));
        }
        let mut body: serde_json::Value = serde_json::from_slice(body)
            .map_err(|e| ApiError::Malformed(format!("the request body is not valid JSON: {e}")))?;
        if let Some(o) = body.as_object_mut() {
            o.insert("model".into(), self.remote_model.clone().into());
        }
        let mut r = self
            .client
            .post(format!("{}{}", self.url, req.endpoint.path()))
            .json(&body);
        if let Some(k) = &self.api_key {
            r = r.bearer_auth(k);
        }
        let resp = r.send().await.map_err(|e| {
            if e.is_timeout() {
                ApiError::Timeout(self.timeout_s)
            } else {
                self.unavailable(e.to_string())
            }
        })?;
        let status =
            StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        let content_type = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .cloned()
            .unwrap_or(header::HeaderValue::from_static("application/json"));
        let stream = resp
            .bytes_stream()
            .map_err(std::io::Error::other)
            .inspect_ok(move |_| {
                // Keeps the request counted until the relayed stream ends or is dropped.
                let _ = &admission;
            });
        let mut out = Body::from_stream(stream).into_response();
        *out.status_mut() = status;
        out.headers_mut().insert(header::CONTENT_TYPE, content_type);
        Ok(out)
    }

    /// Whether the remote answers its model list: the health check.
    async fn check(&self) -> bool {
        let mut r = self.client.get(format!("{}/v1/models", self.url));
        if let Some(k) = &self.api_key {
            r = r.bearer_auth(k);
        }
        matches!(r.timeout(CONNECT_TIMEOUT).send().await, Ok(resp) if resp.status().is_success())
    }

    /// Health-checks the backend every `health_interval` until the process ends.
    pub async fn health_loop(self: Arc<Self>) {
        loop {
            let ok = self.check().await;
            if ok != self.healthy.swap(ok, Ordering::SeqCst) {
                if ok {
                    tracing::info!(backend = %self.name, "backend is healthy again");
                } else {
                    tracing::warn!(backend = %self.name, url = %self.url, "backend health check failed");
                }
            }
            tokio::time::sleep(self.health_interval).await;
        }
    }
}
