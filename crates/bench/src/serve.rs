//! `bench serve`: a serving benchmark client for any OpenAI-compatible server (Switchyard's,
//! vLLM, llama.cpp's, SGLang, TGI), following vLLM's `benchmark_serving` so that figures
//! compare with published ones.
//!
//! The method: requests arrive all at t = 0 or as a gamma process ([`arrivals`]), optionally
//! capped at a number in flight; each is one streamed, greedy completion whose `max_tokens` is
//! the dataset answer's length; TTFT, inter-token latency per streamed chunk, TPOT =
//! (E2E - TTFT) / (output tokens - 1) and E2E latency are timed per request (`client`), and
//! the run's throughputs, latency statistics and goodput follow vLLM's `calculate_metrics`
//! ([`metrics`]).
//!
//! Output tokens are the server's `usage.completion_tokens` when it streams usage
//! (`stream_options.include_usage`), the count of text chunks otherwise; the report says which.
//! A chunk counts as a token when it carries text: role announcements and the empty
//! finish-reason chunk some servers send do not move TTFT or add an ITL.

pub mod arrivals;
mod client;
pub mod metrics;
pub mod report;
pub mod sse;
pub mod synthetic;

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;
use tokio::sync::{mpsc, Semaphore};

pub use arrivals::{Arrivals, RequestRate};
pub(crate) use client::{error_chain, http_client, streamed_request};
pub use client::{RequestFailure, RequestRecord, TokenSource};
pub use metrics::{Distribution, Metrics, Slos, TokenCount};
pub use report::{ErrorCount, ServeReport};

use crate::{BenchError, Result};
use switchyard_eval::sharegpt::SampledRequest;

/// vLLM's client gives a request six hours (`AIOHTTP_TIMEOUT`).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(6 * 3600);
/// The client needs little CPU: two runtime workers keep timing jitter low without taking
/// cores from a server on the same machine.
pub const CLIENT_WORKER_THREADS: usize = 2;
/// `max_tokens` of the test request sent before the run (enough to see a stream work).
const TEST_REQUEST_MAX_TOKENS: usize = 8;

/// Which OpenAI API the requests use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    /// `POST /v1/completions` with the prompt as text.
    Completions,
    /// `POST /v1/chat/completions` with the prompt as one user message.
    Chat,
}

impl Endpoint {
    fn tail(self) -> &'static str {
        match self {
            Self::Completions => "completions",
            Self::Chat => "chat/completions",
        }
    }
}

/// The endpoint URL for a server address: `http://host:port` and `http://host:port/v1` get
/// `/v1/completions` (or `/v1/chat/completions`) appended; a URL that already ends in
/// `/completions` is used as it is.
pub fn endpoint_url(base: &str, endpoint: Endpoint) -> Result<reqwest::Url> {
    let bad = |why: String| BenchError::Invalid(format!("server URL {base:?}: {why}"));
    let url = reqwest::Url::parse(base.trim()).map_err(|e| bad(e.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(bad("expected an http:// or https:// URL".into()));
    }
    let path = url.path().trim_end_matches('/').to_string();
    if path.ends_with("/completions") {
        return Ok(url);
    }
    let path = if path.ends_with("/v1") {
        format!("{path}/{}", endpoint.tail())
    } else {
        format!("{path}/v1/{}", endpoint.tail())
    };
    let mut url = url;
    url.set_path(&path);
    Ok(url)
}

/// One request of the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchRequest {
    pub prompt: String,
    /// Prompt tokens by the benchmark's tokenizer (what `total_input_tokens` adds up).
    pub prompt_tokens: usize,
    /// `max_tokens`: the dataset answer's length.
    pub output_len: usize,
}

impl From<&SampledRequest> for BenchRequest {
    fn from(r: &SampledRequest) -> Self {
        Self {
            prompt: r.prompt.clone(),
            prompt_tokens: r.prompt_tokens.len(),
            output_len: r.output_len,
        }
    }
}

/// How to run the benchmark.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The endpoint URL ([`endpoint_url`]).
    pub url: reqwest::Url,
    pub endpoint: Endpoint,
    /// The `model` field of every request.
    pub model: String,
    pub arrivals: Arrivals,
    /// Most requests in flight; later arrivals wait for a slot (vLLM's `--max-concurrency`).
    pub max_concurrency: Option<NonZeroUsize>,
    /// Seeds the arrival times.
    pub seed: u64,
    /// Send `ignore_eos: true` (a vLLM extension; llama.cpp's server knows it too).
    pub ignore_eos: bool,
    /// Fields added to every request body (vLLM's `--extra-body`), e.g. a `response_format`.
    pub extra_body: serde_json::Map<String, serde_json::Value>,
    pub slos: Slos,
    pub request_timeout: Duration,
    /// Sent as `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Send one short request first and stop with its error if it fails (as vLLM does).
    pub test_request: bool,
    /// Keep every request's record in the report.
    pub save_requests: bool,
    /// Recorded in the report: where the prompts came from and what counted their tokens.
    pub dataset: String,
    pub tokenizer: String,
}

/// Progress of a run, reported as each request ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub done: usize,
    pub failed: usize,
    pub total: usize,
}

/// Runs the benchmark on a runtime of its own ([`CLIENT_WORKER_THREADS`] workers).
pub fn run_serve(
    requests: &[BenchRequest],
    opts: &ServeOptions,
    progress: impl FnMut(Progress),
) -> Result<ServeReport> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(CLIENT_WORKER_THREADS)
        .enable_all()
        .build()
        .map_err(|e| BenchError::Invalid(format!("starting the client runtime: {e}")))?;
    rt.block_on(benchmark(requests, opts, progress))
}

/// Runs the benchmark on the current tokio runtime. Failed requests are part of the report;
/// an error means the run could not start (bad options, or the test request failed).
pub async fn benchmark(
    requests: &[BenchRequest],
    opts: &ServeOptions,
    mut progress: impl FnMut(Progress),
) -> Result<ServeReport> {
    let Some(first) = requests.first() else {
        return Err(BenchError::Invalid("no requests to send".into()));
    };
    let client = Arc::new(client::Client::new(opts)?);
    if opts.test_request {
        let m = client
            .measure(&first.prompt, first.output_len.min(TEST_REQUEST_MAX_TOKENS))
            .await;
        // A well-formed stream that ended at once (EOS first) still shows the server works.
        if let Some(e) = m
            .failure
            .filter(|f| !matches!(f, RequestFailure::NoText { .. }))
        {
            return Err(BenchError::Invalid(format!(
                "the test request to {} failed: {e}",
                opts.url
            )));
        }
    }
    let offsets = opts.arrivals.offsets(requests.len(), opts.seed);
    let slots = opts
        .max_concurrency
        .map(|c| Arc::new(Semaphore::new(c.get())));
    let date_unix_s = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (tx, mut rx) = mpsc::unbounded_channel();
    let start = Instant::now();
    let dispatch = async move {
        for (i, (req, offset)) in requests.iter().zip(&offsets).enumerate() {
            tokio::time::sleep_until((start + *offset).into()).await;
            let arrival = Instant::now();
            let (client, slots, tx) = (Arc::clone(&client), slots.clone(), tx.clone());
            let (prompt, max_tokens) = (req.prompt.clone(), req.output_len);
            tokio::spawn(async move {
                // vLLM starts a request's clock once it holds a slot.
                let _slot = match slots {
                    Some(s) => s.acquire_owned().await.ok(),
                    None => None,
                };
                let m = client.measure(&prompt, max_tokens).await;
                // The receiver outlives every sender unless the run itself was dropped.
                let _ = tx.send((i, arrival, m));
            });
        }
    };
    let collect = async {
        let mut got: Vec<Option<RequestRecord>> = vec![None; requests.len()];
        let mut p = Progress {
            done: 0,
            failed: 0,
            total: requests.len(),
        };
        while let Some((i, arrival, m)) = rx.recv().await {
            let r = RequestRecord::new(i, &requests[i], start, arrival, &m);
            p.done += 1;
            p.failed += usize::from(!r.success);
            progress(p);
            got[i] = Some(r);
        }
        got
    };
    let ((), got) = tokio::join!(dispatch, collect);
    let duration = start.elapsed();
    let records: Vec<RequestRecord> = got
        .into_iter()
        .enumerate()
        .map(|(i, r)| r.unwrap_or_else(|| RequestRecord::lost(i, &requests[i], start)))
        .collect();
    Ok(ServeReport {
        date_unix_s,
        url: opts.url.to_string(),
        endpoint: opts.endpoint,
        model: opts.model.clone(),
        tokenizer: opts.tokenizer.clone(),
        dataset: opts.dataset.clone(),
        num_prompts: requests.len(),
        request_rate: opts.arrivals.request_rate(),
        burstiness: opts.arrivals.burstiness(),
        max_concurrency: opts.max_concurrency.map(NonZeroUsize::get),
        seed: opts.seed,
        ignore_eos: opts.ignore_eos,
        extra_body: (!opts.extra_body.is_empty())
            .then(|| serde_json::Value::Object(opts.extra_body.clone())),
        goodput_slos: opts.slos,
        metrics: Metrics::compute(&records, duration, &opts.slos),
        peak_concurrent_requests: report::peak_concurrency(&records),
        finish_reasons: report::finish_reasons(&records),
        errors: report::error_counts(&records),
        requests: opts.save_requests.then_some(records),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_urls() {
        let u = |base: &str, e| endpoint_url(base, e).map(|u| u.to_string()).ok();
        let c = Endpoint::Completions;
        assert_eq!(
            u("http://127.0.0.1:8000", c).as_deref(),
            Some("http://127.0.0.1:8000/v1/completions")
        );
        assert_eq!(
            u("http://h:1/v1/", Endpoint::Chat).as_deref(),
            Some("http://h:1/v1/chat/completions")
        );
        assert_eq!(
            u("https://h/api/v1/chat/completions", c).as_deref(),
            Some("https://h/api/v1/chat/completions")
        );
        assert_eq!(
            u("http://h/proxy", c).as_deref(),
            Some("http://h/proxy/v1/completions")
        );
        assert_eq!(u("localhost:8000", c), None);
        assert_eq!(u("ftp://h", c), None);
        assert_eq!(u("not a url", c), None);
    }
}
