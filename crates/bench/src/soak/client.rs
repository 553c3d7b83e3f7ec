//! The soak's HTTP client: one streamed request sent, retried when nothing was received, and
//! timed; a 429's `Retry-After` kept.

use std::time::Instant;

use super::{parse_gauges, Failure, Gauges, SoakOptions, SoakRecord};
use crate::serve::sse::{parse_line, Line, LineSplitter};
use crate::serve::{error_chain, http_client, streamed_request, Endpoint};
use crate::{BenchError, Result};

/// Longest excerpt of an error response body kept as a failure's example.
const ERROR_BODY_CHARS: usize = 300;
/// The soak's HTTP client: one connection pool, the endpoint and the request fields.
pub(super) struct Client {
    http: reqwest::Client,
    url: reqwest::Url,
    metrics_url: reqwest::Url,
    model: String,
    endpoint: Endpoint,
    api_key: Option<String>,
}

/// How one attempt at a request ended, when it failed.
enum Attempt {
    /// The connection failed before any response: the server saw nothing, send it again.
    NoResponse(Failure),
    Failed(Failure),
}

fn failure(reason: &str, message: String) -> Failure {
    Failure {
        reason: reason.to_string(),
        status: None,
        retry_after: None,
        message,
    }
}

fn transport(e: &reqwest::Error) -> Failure {
    let reason = if e.is_timeout() {
        "timeout"
    } else {
        "transport"
    };
    failure(reason, error_chain(e))
}

/// Timings of the attempt in progress.
#[derive(Default)]
struct Timing {
    admitted: Option<Instant>,
    first_text: Option<Instant>,
    text_chunks: usize,
    completion_tokens: Option<u64>,
}

impl Client {
    pub(super) fn new(opts: &SoakOptions) -> Result<Self> {
        Ok(Self {
            http: http_client(opts.request_timeout)?,
            url: opts.url.clone(),
            metrics_url: opts.metrics_url.clone(),
            model: opts.model.clone(),
            endpoint: opts.endpoint,
            api_key: opts.api_key.clone(),
        })
    }

    /// `bench serve`'s request ([`streamed_request`]), as sent.
    fn body(&self, prompt: &str, max_tokens: usize) -> String {
        streamed_request(&self.model, self.endpoint, prompt, max_tokens).to_string()
    }

    /// The engine's gauges now; `Ok(None)` when `/metrics` has none for the model.
    pub(super) async fn gauges(&self) -> Result<Option<Gauges>> {
        let mut req = self.http.get(self.metrics_url.clone());
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        let bad = |e: reqwest::Error| {
            BenchError::Invalid(format!(
                "reading {}: {}",
                self.metrics_url,
                transport(&e).message
            ))
        };
        let text = req
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(bad)?
            .text()
            .await
            .map_err(bad)?;
        Ok(parse_gauges(&text, &self.model))
    }

    /// Sends one request and times it. Never fails: what goes wrong is in the record. A
    /// request whose connection failed before any response (a kept-alive connection the server
    /// had closed) is sent once more, as `bench serve` does.
    pub(super) async fn send(
        &self,
        prompt: &str,
        max_tokens: usize,
        run_start: Instant,
    ) -> SoakRecord {
        let body = self.body(prompt, max_tokens);
        let mut sent = Instant::now();
        let mut t = Timing::default();
        let mut retried = false;
        let mut result = self.attempt(&body, &mut t).await;
        if let Err(Attempt::NoResponse(_)) = result {
            retried = true;
            sent = Instant::now();
            t = Timing::default();
            result = self.attempt(&body, &mut t).await;
        }
        let ended = Instant::now();
        let since = |i: Instant| i.saturating_duration_since(run_start).as_secs_f64();
        let ms = |i: Instant| i.saturating_duration_since(sent).as_secs_f64() * 1e3;
        let failure = result.err().map(|a| match a {
            Attempt::NoResponse(f) | Attempt::Failed(f) => f,
        });
        let ok = failure.is_none();
        let tokens = t
            .completion_tokens
            .map_or(t.text_chunks, |n| usize::try_from(n).unwrap_or(usize::MAX));
        SoakRecord {
            start_s: since(sent),
            admitted_s: t.admitted.map(since),
            end_s: since(ended),
            ttft_ms: t.first_text.map(ms),
            e2el_ms: ok.then(|| ms(ended)),
            output_tokens: if ok { tokens } else { 0 },
            failure,
            retried,
        }
    }

    async fn attempt(&self, body: &str, t: &mut Timing) -> std::result::Result<(), Attempt> {
        let mut req = self
            .http
            .post(self.url.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string());
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        let mut resp = match req.send().await {
            Ok(r) => r,
            Err(e) if e.is_timeout() => return Err(Attempt::Failed(transport(&e))),
            Err(e) => return Err(Attempt::NoResponse(transport(&e))),
        };
        let status = resp.status();
        if !status.is_success() {
            let retry_after = resp
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
            let text = resp.text().await.unwrap_or_default();
            return Err(Attempt::Failed(Failure {
                reason: format!("http_{}", status.as_u16()),
                status: Some(status.as_u16()),
                retry_after,
                message: format!(
                    "HTTP {status}: {}",
                    text.chars().take(ERROR_BODY_CHARS).collect::<String>()
                ),
            }));
        }
        t.admitted = Some(Instant::now());
        let failed = |reason: &str, message: String| Attempt::Failed(failure(reason, message));
        let mut lines = LineSplitter::default();
        loop {
            let bytes = resp
                .chunk()
                .await
                .map_err(|e| Attempt::Failed(transport(&e)))?;
            let ended = bytes.is_none();
            let batch = match bytes {
                Some(b) => lines.push(&b[..]),
                None => std::mem::take(&mut lines).finish().into_iter().collect(),
            };
            let now = Instant::now();
            for line in batch {
                match parse_line(&line).map_err(|e| failed("stream_error", e.to_string()))? {
                    Line::Ignored => {}
                    Line::Done => return Ok(()),
                    Line::Chunk(c) => {
                        if c.has_text() {
                            t.first_text.get_or_insert(now);
                            t.text_chunks += 1;
                        }
                        if let Some(n) = c.usage.and_then(|u| u.completion_tokens) {
                            t.completion_tokens = Some(n);
                        }
                    }
                }
            }
            if ended {
                return Err(failed(
                    "no_done",
                    "the stream ended without `data: [DONE]`".into(),
                ));
            }
        }
    }
}
