//! One benchmark request against an OpenAI-compatible server, timed as vLLM's
//! `benchmark_serving` client times it: TTFT at the first chunk with generated text, one
//! inter-token latency per later text chunk, end-to-end latency at the last text chunk.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::sse::{parse_line, Line, LineError, LineSplitter, Usage};
use super::{BenchRequest, Endpoint, ServeOptions};
use crate::{BenchError, Result};

/// Longest excerpt of an error response body kept in a failure.
const ERROR_BODY_CHARS: usize = 300;

/// Why a request counts as failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestFailure {
    #[error("HTTP {status}: {body}")]
    Status { status: u16, body: String },
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Transport(String),
    #[error(transparent)]
    Line(#[from] LineError),
    #[error("the stream ended before any generated text (finish reason {})", .finish_reason.as_deref().unwrap_or("none"))]
    NoText { finish_reason: Option<String> },
    #[error("the stream ended without `data: [DONE]`")]
    NoDone,
    #[error("the request task ended without a result")]
    Lost,
}

/// Where a request's output-token count comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenSource {
    /// `usage.completion_tokens` of the stream's usage chunk.
    Usage,
    /// The number of chunks that carried text (servers without `stream_options`).
    Chunks,
}

/// The raw timings of one request.
#[derive(Debug, Clone)]
pub(crate) struct Measured {
    pub sent: Instant,
    /// Arrival of each chunk that carried text.
    pub text_at: Vec<Instant>,
    pub usage: Option<Usage>,
    /// The last `finish_reason` the stream gave.
    pub finish_reason: Option<String>,
    pub ended: Instant,
    pub failure: Option<RequestFailure>,
    /// The first attempt failed before any response (a kept-alive connection the server had
    /// closed) and the request was sent again on a new connection.
    pub retried: bool,
}

/// One request as the report keeps it (`--save-requests`); times in milliseconds from the
/// start of the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestRecord {
    pub index: usize,
    /// Prompt tokens by the benchmark's tokenizer (BOS included when the model adds one).
    pub prompt_tokens: usize,
    /// `max_tokens` sent: the dataset answer's length.
    pub max_tokens: usize,
    pub success: bool,
    pub error: Option<String>,
    /// When the request arrived (its scheduled send time, before any concurrency limit).
    pub arrival_ms: f64,
    /// When it was sent.
    pub start_ms: f64,
    /// When its response ended (`[DONE]` or the failure).
    pub end_ms: f64,
    pub ttft_ms: Option<f64>,
    pub e2el_ms: Option<f64>,
    /// (E2E - TTFT) / (output tokens - 1), for more than one output token.
    pub tpot_ms: Option<f64>,
    pub itl_ms: Vec<f64>,
    pub output_tokens: usize,
    pub output_tokens_from: TokenSource,
    pub text_chunks: usize,
    /// The server's `finish_reason` (`length`: `max_tokens` reached, `stop`: EOS or a stop
    /// string).
    pub finish_reason: Option<String>,
    /// `usage.prompt_tokens` as the server counted them, when it sent usage.
    pub server_prompt_tokens: Option<u64>,
    /// Sent a second time after its first connection failed before any response.
    pub retried: bool,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl RequestRecord {
    /// The record of request `index` of `req`, arrived at `arrival`, for a run started at
    /// `start`.
    pub(crate) fn new(
        index: usize,
        req: &BenchRequest,
        start: Instant,
        arrival: Instant,
        m: &Measured,
    ) -> Self {
        let since = |t: Instant| ms(t.saturating_duration_since(start));
        let ttft = m
            .text_at
            .first()
            .map(|t| t.saturating_duration_since(m.sent));
        let e2el = m
            .text_at
            .last()
            .map(|t| t.saturating_duration_since(m.sent));
        let usage_tokens = m.usage.and_then(|u| u.completion_tokens);
        let (output_tokens, output_tokens_from) = match usage_tokens {
            Some(n) => (usize::try_from(n).unwrap_or(usize::MAX), TokenSource::Usage),
            None => (m.text_at.len(), TokenSource::Chunks),
        };
        let success = m.failure.is_none();
        let tpot_ms = match (ttft, e2el) {
            (Some(t), Some(e)) if success && output_tokens > 1 => {
                Some(ms(e.saturating_sub(t)) / (output_tokens - 1) as f64)
            }
            _ => None,
        };
        Self {
            index,
            prompt_tokens: req.prompt_tokens,
            max_tokens: req.output_len,
            success,
            error: m.failure.as_ref().map(ToString::to_string),
            arrival_ms: since(arrival),
            start_ms: since(m.sent),
            end_ms: since(m.ended),
            ttft_ms: ttft.map(ms),
            e2el_ms: e2el.map(ms),
            tpot_ms,
            itl_ms: m
                .text_at
                .windows(2)
                .map(|w| ms(w[1].saturating_duration_since(w[0])))
                .collect(),
            output_tokens: if success { output_tokens } else { 0 },
            output_tokens_from,
            text_chunks: m.text_at.len(),
            finish_reason: m.finish_reason.clone(),
            server_prompt_tokens: m.usage.and_then(|u| u.prompt_tokens),
            retried: m.retried,
        }
    }

    /// A request whose task produced nothing (it cannot happen short of a panic).
    pub(crate) fn lost(index: usize, req: &BenchRequest, start: Instant) -> Self {
        let now = Instant::now();
        let m = Measured {
            sent: now,
            text_at: Vec::new(),
            usage: None,
            finish_reason: None,
            ended: now,
            failure: Some(RequestFailure::Lost),
            retried: false,
        };
        Self::new(index, req, start, now, &m)
    }
}

/// The HTTP client of a run: one connection pool, the endpoint and the request body fields.
pub(crate) struct Client {
    http: reqwest::Client,
    url: reqwest::Url,
    model: String,
    endpoint: Endpoint,
    ignore_eos: bool,
    extra_body: serde_json::Map<String, serde_json::Value>,
    api_key: Option<String>,
    timeout: Duration,
}

impl Client {
    pub fn new(opts: &ServeOptions) -> Result<Self> {
        Ok(Self {
            http: http_client(opts.request_timeout)?,
            url: opts.url.clone(),
            model: opts.model.clone(),
            endpoint: opts.endpoint,
            ignore_eos: opts.ignore_eos,
            extra_body: opts.extra_body.clone(),
            api_key: opts.api_key.clone(),
            timeout: opts.request_timeout,
        })
    }

    /// vLLM's request ([`streamed_request`]); `ignore_eos` only when set.
    fn body(&self, prompt: &str, max_tokens: usize) -> serde_json::Value {
        let mut body = streamed_request(&self.model, self.endpoint, prompt, max_tokens);
        if self.ignore_eos {
            body["ignore_eos"] = true.into();
        }
        if let Some(b) = body.as_object_mut() {
            b.extend(self.extra_body.clone());
        }
        body
    }

    /// Sends one request and times its stream. Never fails: what goes wrong is recorded.
    ///
    /// A request whose connection fails before any response arrives is sent once more: a
    /// kept-alive connection the server closed between requests fails that way (hyper's
    /// "connection closed before message completed"), and the server has then seen nothing
    /// of the request. Browsers and most HTTP clients retry that case the same way; the
    /// request's times count from the second send, and the report counts the retries.
    pub async fn measure(&self, prompt: &str, max_tokens: usize) -> Measured {
        let body = self.body(prompt, max_tokens);
        let mut m = Measured {
            sent: Instant::now(),
            text_at: Vec::new(),
            usage: None,
            finish_reason: None,
            ended: Instant::now(),
            failure: None,
            retried: false,
        };
        m.failure = match self.stream(&body, &mut m).await {
            Err(Attempt::NoResponse(_)) => {
                m.retried = true;
                self.stream(&body, &mut m).await.err().map(Attempt::failure)
            }
            r => r.err().map(Attempt::failure),
        };
        m.ended = Instant::now();
        m
    }

    async fn stream(
        &self,
        body: &serde_json::Value,
        m: &mut Measured,
    ) -> std::result::Result<(), Attempt> {
        let mut req = self
            .http
            .post(self.url.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string());
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        m.sent = Instant::now();
        let mut resp = match req.send().await {
            Ok(r) => r,
            Err(e) if !e.is_timeout() => return Err(Attempt::NoResponse(self.transport(&e))),
            Err(e) => return Err(Attempt::Failed(self.transport(&e))),
        };
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(Attempt::Failed(RequestFailure::Status {
                status: status.as_u16(),
                body: text.chars().take(ERROR_BODY_CHARS).collect(),
            }));
        }
        let mut lines = LineSplitter::default();
        loop {
            let bytes = resp
                .chunk()
                .await
                .map_err(|e| Attempt::Failed(self.transport(&e)))?;
            let now = Instant::now();
            let (batch, ended) = match bytes {
                Some(b) => (lines.push(&b[..]), false),
                None => (
                    std::mem::take(&mut lines).finish().into_iter().collect(),
                    true,
                ),
            };
            for line in batch {
                tracing::trace!(line = %String::from_utf8_lossy(&line), "stream");
                match parse_line(&line).map_err(|e| Attempt::Failed(e.into()))? {
                    Line::Ignored => {}
                    Line::Done => return finished(m).map_err(Attempt::Failed),
                    Line::Chunk(c) => {
                        if c.has_text() {
                            m.text_at.push(now);
                        }
                        if c.usage.is_some() {
                            m.usage = c.usage;
                        }
                        if c.finish_reason.is_some() {
                            m.finish_reason = c.finish_reason;
                        }
                    }
                }
            }
            if ended {
                return Err(Attempt::Failed(if m.text_at.is_empty() {
                    RequestFailure::NoText {
                        finish_reason: m.finish_reason.clone(),
                    }
                } else {
                    RequestFailure::NoDone
                }));
            }
        }
    }

    fn transport(&self, e: &reqwest::Error) -> RequestFailure {
        if e.is_timeout() {
            return RequestFailure::Timeout(self.timeout);
        }
        RequestFailure::Transport(error_chain(e))
    }
}

/// How one attempt at a request ended, when it failed.
enum Attempt {
    /// The connection failed before any response: the request may be sent again.
    NoResponse(RequestFailure),
    Failed(RequestFailure),
}

impl Attempt {
    fn failure(self) -> RequestFailure {
        match self {
            Attempt::NoResponse(f) | Attempt::Failed(f) => f,
        }
    }
}

/// A stream that reached `[DONE]` succeeded if it generated text.
fn finished(m: &Measured) -> std::result::Result<(), RequestFailure> {
    if m.text_at.is_empty() {
        Err(RequestFailure::NoText {
            finish_reason: m.finish_reason.clone(),
        })
    } else {
        Ok(())
    }
}

/// The benchmark clients' HTTP client: one connection pool, `timeout` a request, no Nagle.
pub(crate) fn http_client(timeout: Duration) -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(timeout)
        .tcp_nodelay(true)
        .build()
        .map_err(|e| BenchError::Invalid(format!("building the HTTP client: {e}")))
}

/// A transport error with its causes: reqwest's message names the URL, the cause (refused,
/// reset, closed) is in the chain.
pub(crate) fn error_chain(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// The request vLLM's benchmark client sends: greedy, streamed, usage asked for, the prompt as
/// the endpoint wants it.
pub(crate) fn streamed_request(
    model: &str,
    endpoint: Endpoint,
    prompt: &str,
    max_tokens: usize,
) -> serde_json::Value {
    let mut body = serde_json::json!({
        "model": model,
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    match endpoint {
        Endpoint::Completions => body["prompt"] = prompt.into(),
        Endpoint::Chat => {
            body["messages"] = serde_json::json!([{"role": "user", "content": prompt}]);
            // vLLM's chat client sends this newer name; servers that only know `max_tokens`
            // read that one.
            body["max_completion_tokens"] = max_tokens.into();
        }
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> BenchRequest {
        BenchRequest {
            prompt: "p".into(),
            prompt_tokens: 9,
            output_len: 4,
        }
    }

    #[test]
    fn record_times_follow_vllm() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let m = Measured {
            sent: at(10),
            // First text at +50 ms after sending, then 10, 20, 30 ms gaps.
            text_at: vec![at(60), at(70), at(90), at(120)],
            usage: Some(Usage {
                prompt_tokens: Some(8),
                completion_tokens: Some(7),
            }),
            finish_reason: Some("length".into()),
            ended: at(125),
            failure: None,
            retried: false,
        };
        let r = RequestRecord::new(3, &req(), start, at(5), &m);
        let close = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-6);
        assert!(close(r.ttft_ms, 50.0));
        assert!(close(r.e2el_ms, 110.0));
        // Usage says 7 tokens in 4 chunks: TPOT divides by the tokens, ITL is per chunk.
        assert!(close(r.tpot_ms, 60.0 / 6.0));
        assert_eq!(r.itl_ms.len(), 3);
        assert!(r
            .itl_ms
            .iter()
            .zip([10.0, 20.0, 30.0])
            .all(|(a, b)| (a - b).abs() < 1e-6));
        assert_eq!(
            (r.output_tokens, r.output_tokens_from),
            (7, TokenSource::Usage)
        );
        assert_eq!((r.text_chunks, r.server_prompt_tokens), (4, Some(8)));
        assert!(close(Some(r.arrival_ms), 5.0) && close(Some(r.start_ms), 10.0));
        assert!(close(Some(r.end_ms), 125.0));

        // Without usage the chunks are the tokens; a single token has no TPOT.
        let one = Measured {
            text_at: vec![at(60)],
            usage: None,
            ..m.clone()
        };
        let r = RequestRecord::new(0, &req(), start, at(5), &one);
        assert_eq!(
            (r.output_tokens, r.output_tokens_from),
            (1, TokenSource::Chunks)
        );
        assert_eq!(r.tpot_ms, None);

        // A failure keeps its message and counts no output.
        let failed = Measured {
            failure: Some(RequestFailure::NoDone),
            ..m
        };
        let r = RequestRecord::new(0, &req(), start, at(5), &failed);
        assert!(!r.success);
        assert_eq!(r.output_tokens, 0);
        assert_eq!(r.tpot_ms, None);
        assert_eq!(
            r.error.as_deref(),
            Some("the stream ended without `data: [DONE]`")
        );
    }
}
