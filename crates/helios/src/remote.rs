//! A remote OpenAI-compatible server as a HELIOS candidate: an engine handle whose requests
//! are streamed from the server's `/v1/completions`.
//!
//! The orchestrator tokenizes every request with the serving candidate's tokenizer (chat
//! template included), so a remote candidate needs a local copy of its model's tokenizer
//! (the manifest's `tokenizer`): the prompt is sent as token ids, which OpenAI's completions
//! API accepts, and the server renders nothing a second time. Each output token comes back
//! with its log-probability (`logprobs: 1`), which gives the PHT its bits per byte and the
//! breach counter its confidence (the sampled token's probability: under greedy decoding the
//! largest softmax probability, the engine's own measure). Token ids come back too where the
//! server honours vLLM's `return_tokens_as_token_ids` (Switchyard's server does); otherwise
//! each token's text is encoded with the local tokenizer.
//!
//! A remote model is served at its full depth only (see `switchyard_engine::external`): it
//! takes no local memory, its evaluation block loads nothing, and a breach can only be
//! remedied by switching away from it.
//!
//! Each request runs on a thread of its own with a blocking HTTP client; a client that goes
//! away (its stream dropped) or an abort closes the connection, which ends the request on the
//! server too.
//!
//! A request that cannot reach the server (refused, reset, cut off mid-stream) marks the
//! candidate [`EngineStatus::Unreachable`](switchyard_engine::EngineStatus), and so does a
//! failed health check (`GET /v1/models` every [`HEALTH_INTERVAL`]); the orchestrator skips
//! it until a check passes again.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use switchyard_engine::output::OutputSink;
use switchyard_engine::{
    EngineError, EngineHandle, EngineInfo, EngineRequest, Reachability, RequestBackend, RequestId,
    RequestOutput,
};
use switchyard_request::FinishReason;
use switchyard_tokenizer::Tokenizer;

use crate::manifest::{ModelEntry, Source};
use crate::{HeliosError, Result};

/// Longest wait for the server to accept a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest error body quoted in an error.
const ERROR_BODY_CHARS: usize = 300;
/// How often the server is health-checked.
pub const HEALTH_INTERVAL: Duration = Duration::from_secs(1);

/// The requests a remote candidate streams.
pub struct RemoteBackend {
    target: Arc<Target>,
    running: Arc<Mutex<HashMap<RequestId, Arc<AtomicBool>>>>,
}

/// The server a remote candidate's requests go to, shared by all of them.
struct Target {
    name: String,
    /// The server's root URL, and its completions endpoint.
    url: String,
    endpoint: String,
    model: String,
    client: reqwest::blocking::Client,
    tokenizer: Arc<Tokenizer>,
    n_layers: usize,
    /// The handle's status, set once the handle is spawned.
    reachability: OnceLock<Reachability>,
}

impl Target {
    /// Marks the server unreachable or reachable again, and says so in the log once.
    fn reachable(&self, ok: bool, why: &str) {
        let Some(r) = self.reachability.get() else {
            return;
        };
        if r.set(ok) {
            if ok {
                tracing::warn!(model = %self.name, url = %self.url, "remote candidate is reachable again");
            } else {
                tracing::warn!(model = %self.name, url = %self.url, reason = why, "remote candidate marked unreachable");
            }
        }
    }

    /// Whether the server answers its model list.
    fn check(&self) -> bool {
        let resp = self
            .client
            .get(format!("{}/v1/models", self.url))
            .timeout(CONNECT_TIMEOUT)
            .send();
        matches!(resp, Ok(r) if r.status().is_success())
    }
}

/// Health-checks the server every [`HEALTH_INTERVAL`] until the candidate is dropped.
fn health_loop(target: Weak<Target>) {
    loop {
        std::thread::sleep(HEALTH_INTERVAL);
        let Some(t) = target.upgrade() else {
            return;
        };
        let ok = t.check();
        t.reachable(ok, "the health check failed");
    }
}

/// Starts an engine handle over the remote candidate `entry`.
pub fn remote_candidate(entry: &ModelEntry) -> Result<EngineHandle> {
    let Source::Remote { url, model } = entry.source() else {
        return Err(HeliosError::Orchestrator(format!(
            "{} is not a remote model",
            entry.name
        )));
    };
    let Some(tok) = &entry.tokenizer else {
        return Err(HeliosError::Orchestrator(format!(
            "remote candidate {}: the manifest needs `tokenizer`, a local copy of its model's tokenizer (zoo name, GGUF file or folder), to send the prompt as token ids",
            entry.name
        )));
    };
    let source = switchyard_weights::open(switchyard_zoo::resolve_model(tok)?)
        .map_err(|e| HeliosError::Orchestrator(format!("remote candidate {}: {e}", entry.name)))?;
    let tokenizer = Arc::new(Tokenizer::from_source(&*source)?);
    let client = reqwest::blocking::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(None)
        .build()
        .map_err(|e| HeliosError::Orchestrator(format!("HTTP client: {e}")))?;
    let info = EngineInfo::new(
        entry.name.clone(),
        entry.layers,
        entry.context_length.unwrap_or(usize::MAX),
        tokenizer.vocab_size(),
        Arc::clone(&tokenizer),
    );
    let backend = RemoteBackend {
        target: Arc::new(Target {
            name: entry.name.clone(),
            url: url.trim_end_matches('/').to_string(),
            endpoint: format!("{}/v1/completions", url.trim_end_matches('/')),
            model: model.to_string(),
            client,
            tokenizer,
            n_layers: entry.layers,
            reachability: OnceLock::new(),
        }),
        running: Arc::default(),
    };
    Ok(EngineHandle::spawn_backend(Box::new(backend), info)?)
}

impl RequestBackend for RemoteBackend {
    fn start(&mut self, id: RequestId, request: EngineRequest, arrival: Instant, sink: OutputSink) {
        let stop = Arc::new(AtomicBool::new(false));
        if let Ok(mut r) = self.running.lock() {
            r.insert(id, Arc::clone(&stop));
        }
        let call = Call {
            id,
            target: Arc::clone(&self.target),
            stop,
        };
        let running = Arc::clone(&self.running);
        let spawned = std::thread::Builder::new()
            .name("switchyard-remote".into())
            .spawn(move || {
                call.run(&request, arrival, &sink);
                if let Ok(mut r) = running.lock() {
                    r.remove(&id);
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a remote request thread");
            if let Ok(mut r) = self.running.lock() {
                r.remove(&id);
            }
        }
    }

    fn abort(&mut self, id: RequestId) {
        if let Some(flag) = self.running.lock().ok().and_then(|r| r.get(&id).cloned()) {
            flag.store(true, Ordering::SeqCst);
        }
    }

    fn abort_all(&mut self) {
        if let Ok(r) = self.running.lock() {
            for flag in r.values() {
                flag.store(true, Ordering::SeqCst);
            }
        }
    }

    fn running(&self) -> usize {
        self.running.lock().map_or(0, |r| r.len())
    }

    fn watch(&mut self, reachability: Reachability) {
        let _ = self.target.reachability.set(reachability);
        let target = Arc::downgrade(&self.target);
        let started = std::thread::Builder::new()
            .name("switchyard-remote-health".into())
            .spawn(move || health_loop(target));
        if let Err(e) = started {
            tracing::error!(model = %self.target.name, error = %e, "cannot start the health check");
        }
    }
}

/// One request's HTTP call.
struct Call {
    id: RequestId,
    target: Arc<Target>,
    stop: Arc<AtomicBool>,
}

/// What the stream has produced so far.
struct Progress {
    output_tokens: usize,
    first_token_at: Option<Instant>,
}

impl Call {
    fn body(&self, request: &EngineRequest) -> Value {
        let p = &request.params;
        let mut body = json!({
            "model": self.target.model,
            "prompt": request.prompt,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "stream": true,
            "logprobs": 1,
            "return_tokens_as_token_ids": true,
        });
        if let Some(o) = body.as_object_mut() {
            if p.top_k > 0 {
                o.insert("top_k".into(), json!(p.top_k));
            }
            if p.repetition_penalty != 1.0 {
                o.insert("repetition_penalty".into(), json!(p.repetition_penalty));
            }
            if let Some(seed) = p.seed {
                o.insert("seed".into(), json!(seed));
            }
            if !p.stop.is_empty() {
                o.insert("stop".into(), json!(p.stop));
            }
            if p.ignore_eos {
                o.insert("ignore_eos".into(), json!(true));
            }
            // The rest of the sampling parameters, under their OpenAI / vLLM names, when set.
            if p.presence_penalty != 0.0 {
                o.insert("presence_penalty".into(), json!(p.presence_penalty));
            }
            if p.frequency_penalty != 0.0 {
                o.insert("frequency_penalty".into(), json!(p.frequency_penalty));
            }
            if p.min_p > 0.0 {
                o.insert("min_p".into(), json!(p.min_p));
            }
            if p.min_tokens > 0 {
                o.insert("min_tokens".into(), json!(p.min_tokens));
            }
            if !p.logit_bias.is_empty() {
                let bias: serde_json::Map<String, Value> = p
                    .logit_bias
                    .iter()
                    .map(|(t, b)| (t.to_string(), json!(b)))
                    .collect();
                o.insert("logit_bias".into(), Value::Object(bias));
            }
            if !p.stop_token_ids.is_empty() {
                o.insert("stop_token_ids".into(), json!(p.stop_token_ids));
            }
        }
        body
    }

    fn run(&self, request: &EngineRequest, arrival: Instant, sink: &OutputSink) {
        let mut progress = Progress {
            output_tokens: 0,
            first_token_at: None,
        };
        let finish = match self.stream(request, arrival, sink, &mut progress) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(model = %self.target.name, error = %e, "remote request failed");
                let _ = sink.send(Err(e));
                return;
            }
        };
        let now = Instant::now();
        let _ = sink.send(Ok(RequestOutput {
            id: self.id,
            token_ids: Vec::new(),
            logprobs: Vec::new(),
            top_logprobs: Vec::new(),
            confidences: Vec::new(),
            probe_exits: Vec::new(),
            depth: self.target.n_layers,
            text: String::new(),
            finish_reason: Some(finish),
            prompt_tokens: request.prompt.len(),
            output_tokens: progress.output_tokens,
            cached_tokens: 0,
            arrival,
            first_token_at: progress.first_token_at,
            at: now,
        }));
    }

    /// Streams the response into `sink`; the finish reason, or why it failed.
    fn stream(
        &self,
        request: &EngineRequest,
        arrival: Instant,
        sink: &OutputSink,
        progress: &mut Progress,
    ) -> std::result::Result<FinishReason, EngineError> {
        let failed = |what: String| {
            EngineError::StepFailed(format!("remote {}: {what}", self.target.endpoint))
        };
        let resp = self
            .target
            .client
            .post(&self.target.endpoint)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(self.body(request).to_string())
            .send()
            .map_err(|e| {
                let why = e.to_string();
                if !e.is_timeout() {
                    self.target.reachable(false, &why);
                }
                failed(why)
            })?;
        let status = resp.status();
        if !status.is_success() {
            let body: String = resp
                .text()
                .unwrap_or_default()
                .chars()
                .take(ERROR_BODY_CHARS)
                .collect();
            return Err(failed(format!("HTTP {}: {body}", status.as_u16())));
        }
        let mut finish = None;
        for line in BufReader::new(resp).lines() {
            if self.stop.load(Ordering::SeqCst) || sink.is_closed() {
                return Ok(FinishReason::Abort);
            }
            let line = line.map_err(|e| {
                let why = format!("the stream broke off: {e}");
                self.target.reachable(false, &why);
                failed(why)
            })?;
            let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                continue;
            };
            if data == "[DONE]" {
                return finish
                    .ok_or_else(|| failed("the stream ended without a finish reason".into()));
            }
            let chunk: Value = serde_json::from_str(data)
                .map_err(|e| failed(format!("a stream chunk is not JSON: {e}")))?;
            if let Some(err) = chunk.get("error") {
                return Err(failed(format!("error in stream: {err}")));
            }
            let Some(choice) = chunk["choices"].get(0) else {
                continue;
            };
            let out = self.output(choice, request, arrival, progress);
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = Some(match f {
                    "length" => FinishReason::Length,
                    "abort" => FinishReason::Abort,
                    _ => FinishReason::Stop,
                });
            }
            if (!out.token_ids.is_empty() || !out.text.is_empty()) && sink.send(Ok(out)).is_err() {
                return Ok(FinishReason::Abort);
            }
        }
        finish.ok_or_else(|| failed("the stream ended without `data: [DONE]`".into()))
    }

    /// One chunk's tokens, log-probabilities and text as an engine output.
    fn output(
        &self,
        choice: &Value,
        request: &EngineRequest,
        arrival: Instant,
        progress: &mut Progress,
    ) -> RequestOutput {
        let text = choice["text"].as_str().unwrap_or_default().to_string();
        let lp = &choice["logprobs"];
        let logprobs: Vec<f32> = lp["token_logprobs"]
            .as_array()
            .map(|a| a.iter().map(|v| v.as_f64().unwrap_or(0.0) as f32).collect())
            .unwrap_or_default();
        let token_ids: Vec<u32> = lp["tokens"]
            .as_array()
            .map(|a| {
                a.iter()
                    .flat_map(|t| self.token_ids(t.as_str().unwrap_or_default()))
                    .collect()
            })
            .unwrap_or_default();
        let now = Instant::now();
        if !token_ids.is_empty() {
            progress.first_token_at.get_or_insert(now);
        }
        progress.output_tokens += logprobs.len().max(token_ids.len());
        RequestOutput {
            id: self.id,
            confidences: logprobs.iter().map(|l| l.exp()).collect(),
            probe_exits: vec![None; logprobs.len()],
            top_logprobs: vec![Vec::new(); logprobs.len()],
            token_ids,
            logprobs,
            depth: self.target.n_layers,
            text,
            finish_reason: None,
            prompt_tokens: request.prompt.len(),
            output_tokens: progress.output_tokens,
            cached_tokens: 0,
            arrival,
            first_token_at: progress.first_token_at,
            at: now,
        }
    }

    /// A listed token's id: `token_id:<id>` as vLLM writes it, else its text encoded with the
    /// local tokenizer.
    fn token_ids(&self, token: &str) -> Vec<u32> {
        if let Some(id) = token
            .strip_prefix("token_id:")
            .and_then(|n| n.parse::<u32>().ok())
        {
            return vec![id];
        }
        self.target
            .tokenizer
            .encode(token, false, false)
            .unwrap_or_default()
    }
}
