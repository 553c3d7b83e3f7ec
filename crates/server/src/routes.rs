//! HTTP handlers: the OpenAI endpoints, health, metrics and admin routes.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use switchyard_engine::{EngineRequest, EngineStatus, RequestOutput, RequestStream};

use crate::api::{
    now_secs, ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatLogprobs, ChatMessageOut,
    ChatResponse, ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionResponse,
    ModelCard, ModelList, PromptTokensDetails, Usage,
};
use crate::error::ApiError;
use crate::helios::{HeliosAdmission, HeliosModel};
use crate::local::{finish_str, on_blocking_pool, Admission, Finished, LocalModel};
use crate::state::{AppState, Served};
use crate::validate::{self, Endpoint, Prompt, ValidRequest};

pub async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    generate(state, Endpoint::Completions, headers, body).await
}

pub async fn chat(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    generate(state, Endpoint::Chat, headers, body).await
}

async fn generate(
    state: Arc<AppState>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (model, result) = match generate_inner(&state, endpoint, &headers, body).await {
        Ok((model, resp)) => (model, Ok(resp)),
        Err((model, e)) => (model, Err(e)),
    };
    let resp = result.unwrap_or_else(IntoResponse::into_response);
    state
        .metrics
        .requests
        .with_label_values(&[&model, endpoint.label(), resp.status().as_str()])
        .inc();
    resp
}

type Failure = (String, ApiError);

async fn generate_inner(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Body,
) -> Result<(String, Response), Failure> {
    let unknown = || "-".to_string();
    if state.shutting_down.load(Ordering::SeqCst) {
        return Err((unknown(), ApiError::ShuttingDown));
    }
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !ct.to_ascii_lowercase().starts_with("application/json") {
        return Err((unknown(), ApiError::ContentType(ct.to_string())));
    }
    let bytes = read_body(state, body).await.map_err(|e| (unknown(), e))?;
    let req = parse_body(state, endpoint, &bytes)
        .await
        .map_err(|e| (unknown(), e))?;
    let name = req.model.clone();
    let served = state
        .models
        .get(&name)
        .cloned()
        .ok_or_else(|| (unknown(), ApiError::UnknownModel(name.clone())))?;
    // Only a remote backend needs the body as sent; it is not kept for local requests.
    let forwarded = if matches!(served, Served::Remote(_)) {
        Some(bytes)
    } else {
        drop(bytes);
        None
    };
    let fail = |e: ApiError| (name.clone(), e);
    match served {
        Served::Local(m) => {
            // Admitted first: tokenizing is the costly part of a request it would refuse.
            let admission = m.admit(state.config.max_in_flight).map_err(fail)?;
            let (req, engine_req) = m
                .prepare_blocking(req, &state.tokenizing)
                .await
                .map_err(fail)?;
            let resp = serve_local(state, m, req, engine_req, admission)
                .await
                .map_err(fail)?;
            Ok((name, resp))
        }
        Served::Modes(ms) => {
            // Admitted before it is tokenized and routed, as a local model's request is.
            let _admission = ms.admit(state.config.max_in_flight).map_err(fail)?;
            let (req, engine_req, prefixes) =
                ms.prepare(req, &state.tokenizing).await.map_err(fail)?;
            let workload = headers
                .get("x-switchyard-workload")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let routed = ms.route(&engine_req, &prefixes, workload).await;
            let r = &routed.record;
            state
                .metrics
                .route_decisions
                .with_label_values(&[
                    name.as_str(),
                    r.mode.name(),
                    r.rule.as_str(),
                    if r.fallback { "true" } else { "false" },
                ])
                .inc();
            state
                .metrics
                .route_seconds
                .with_label_values(&[&name])
                .inc_by(r.decision_us / 1e6);
            let admission = routed
                .model
                .admit(state.config.max_in_flight)
                .map_err(fail)?;
            let mut resp =
                serve_local(state, Arc::clone(&routed.model), req, engine_req, admission)
                    .await
                    .map_err(fail)?;
            let route = format!(
                "rule={}; class={}; fallback={}; prompt_tokens={}; max_tokens={}; shared_prefix_tokens={}; memory_pressure={:.2}; queue_depth={}; workload={}",
                r.rule,
                r.class,
                r.fallback,
                r.features.prompt_tokens,
                r.features.max_output_tokens,
                r.features.shared_prefix_tokens,
                r.features.memory_pressure,
                r.features.queue_depth,
                r.features.workload.as_deref().unwrap_or("-"),
            );
            for (k, v) in [
                ("x-switchyard-mode", r.mode.name().to_string()),
                ("x-switchyard-route", route),
            ] {
                if let Ok(v) = header::HeaderValue::from_str(&v) {
                    resp.headers_mut().insert(k, v);
                }
            }
            Ok((name, resp))
        }
        Served::Remote(r) => {
            let admission = r.admit(state.config.max_in_flight).map_err(fail)?;
            let body = forwarded.unwrap_or_default();
            let resp = r.forward(&req, &body, admission).await.map_err(fail)?;
            Ok((name, resp))
        }
        Served::Helios(h) => {
            let admission = h.admit(state.config.max_in_flight).map_err(fail)?;
            let hreq = h.prepare(&req).map_err(fail)?;
            let timeout = Duration::from_secs(state.config.request_timeout_s);
            let resp = if req.stream {
                helios_stream_response(state.clone(), &h, req, hreq, admission, timeout)
                    .await
                    .map_err(fail)?
            } else {
                let resp = helios_response(state, &h, &req, hreq, timeout)
                    .await
                    .map_err(fail)?;
                drop(admission);
                resp
            };
            Ok((name, resp))
        }
    }
}

/// Bodies up to this size are parsed where they arrive; a larger one is parsed on the
/// blocking pool. Parsing a 1 MiB prompt takes about a millisecond, and hundreds of them at
/// once on the runtime's few workers would hold up `/health` and every stream behind them.
const PARSE_INLINE_BYTES: usize = 64 << 10;

async fn parse_body(
    state: &AppState,
    endpoint: Endpoint,
    bytes: &axum::body::Bytes,
) -> Result<ValidRequest, ApiError> {
    if bytes.len() <= PARSE_INLINE_BYTES {
        return validate::parse(endpoint, bytes);
    }
    let bytes = bytes.clone();
    on_blocking_pool(&state.tokenizing, move || validate::parse(endpoint, &bytes)).await?
}

/// The request body, at most `max_body_bytes` of it, within `body_timeout_s`.
async fn read_body(state: &AppState, body: Body) -> Result<axum::body::Bytes, ApiError> {
    let limit = state.config.max_body_bytes;
    let secs = state.config.body_timeout_s;
    tokio::time::timeout(Duration::from_secs(secs), axum::body::to_bytes(body, limit))
        .await
        .map_err(|_| ApiError::BodyTimeout(secs))?
        .map_err(|_| ApiError::TooLarge { limit })
}

/// Sends an admitted, prepared request to a local engine and answers it, streamed or whole.
async fn serve_local(
    state: &Arc<AppState>,
    m: Arc<LocalModel>,
    req: ValidRequest,
    engine_req: EngineRequest,
    admission: Admission,
) -> Result<Response, ApiError> {
    let choices = Choices::start(&m, engine_req, req.n)?;
    let timeout = Duration::from_secs(state.config.request_timeout_s);
    if req.stream {
        Ok(stream_response(
            state.clone(),
            m,
            req,
            choices,
            admission,
            timeout,
        ))
    } else {
        full_response(state, &m, &req, choices, admission, timeout).await
    }
}

/// The outputs of a request's `n` choices from one engine, tagged with their index, in one
/// bounded channel (a client that stops reading still holds the engine back).
///
/// Choice 0 is sent first; the others once its first output is in, so that its prompt's
/// blocks are in the prefix cache and they compute only the prompt's last partial block.
/// Dropping this aborts every choice still running.
struct Choices {
    id: switchyard_engine::RequestId,
    n: usize,
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
    fn start(model: &LocalModel, req: EngineRequest, n: usize) -> Result<Self, ApiError> {
        let first = model.handle.add_request(choice_request(&req, 0))?;
        let id = first.id();
        let (tx, rx) = tokio::sync::mpsc::channel(STREAM_BUFFER);
        let handle = model.handle.clone();
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
            n,
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

/// Runs a request through the HELIOS orchestrator and responds once; the response's `model`
/// is the HELIOS name, and the serving candidate is in the `x-switchyard-served-by` header.
async fn helios_response(
    state: &Arc<AppState>,
    h: &Arc<HeliosModel>,
    req: &ValidRequest,
    hreq: switchyard_helios::orchestrator::HeliosRequest,
    timeout: Duration,
) -> Result<Response, ApiError> {
    let internal = |e: switchyard_helios::HeliosError| ApiError::Internal(e.to_string());
    let mut stream = h.orchestrator.submit(hreq).map_err(internal)?;
    let mut outputs: Vec<RequestOutput> = Vec::new();
    let mut served_by = String::new();
    let collect = async {
        while let Some(o) = stream.next().await {
            let o = o.map_err(helios_api_error)?;
            served_by = o.model.to_string();
            let last = o.output.finish_reason.is_some();
            outputs.push(o.output);
            if last {
                return Ok(());
            }
        }
        Err(ApiError::ShuttingDown)
    };
    within_timeout(state, &h.name, timeout, collect).await?;
    let last = outputs
        .last()
        .ok_or_else(|| ApiError::Internal("the orchestrator returned no output".into()))?;
    let finished = Finished::from_output(last);
    record(state, &h.name, &finished);
    let finish = last.finish_reason.map(finish_str).map(str::to_string);
    let text: String = outputs.iter().map(|o| o.text.as_str()).collect();
    let usage = Usage::new(
        finished.prompt_tokens,
        finished.output_tokens,
        finished.cached_tokens,
    );
    let id = format!("{}-h{}", prefix(req.endpoint), last.id);
    let text = format!("{}{text}", echo_text(req, None));
    let choice = ChoiceOut {
        text,
        finish,
        completion_logprobs: None,
        chat_logprobs: None,
    };
    let mut resp = choices_response(req, id, vec![choice], usage);
    if let Ok(v) = header::HeaderValue::from_str(&served_by) {
        resp.headers_mut().insert("x-switchyard-served-by", v);
    }
    Ok(resp)
}

/// Runs `collect` under the request timeout; a timeout is counted and becomes 504.
async fn within_timeout(
    state: &AppState,
    model: &str,
    timeout: Duration,
    collect: impl std::future::Future<Output = Result<(), ApiError>>,
) -> Result<(), ApiError> {
    match tokio::time::timeout(timeout, collect).await {
        Ok(r) => r,
        Err(_) => {
            state
                .metrics
                .aborted
                .with_label_values(&[model, "timeout"])
                .inc();
            Err(ApiError::Timeout(timeout.as_secs()))
        }
    }
}

/// One finished choice of a complete response.
struct ChoiceOut {
    text: String,
    finish: Option<String>,
    completion_logprobs: Option<CompletionLogprobs>,
    chat_logprobs: Option<ChatLogprobs>,
}

/// A complete (non-streamed) response, in the endpoint's shape.
fn choices_response(
    req: &ValidRequest,
    id: String,
    choices: Vec<ChoiceOut>,
    usage: Usage,
) -> Response {
    let created = now_secs();
    match req.endpoint {
        Endpoint::Completions => Json(CompletionResponse {
            id,
            object: "text_completion".into(),
            created,
            model: req.model.clone(),
            choices: choices
                .into_iter()
                .enumerate()
                .map(|(index, c)| CompletionChoice {
                    index,
                    text: c.text,
                    logprobs: c.completion_logprobs,
                    finish_reason: c.finish,
                })
                .collect(),
            usage: Some(usage),
        })
        .into_response(),
        Endpoint::Chat => {
            let choices = choices
                .into_iter()
                .enumerate()
                .map(|(index, c)| {
                    let (message, finish) =
                        assistant_message(req, c.text, c.finish, &format!("{id}_{index}"));
                    ChatChoice {
                        index,
                        message,
                        logprobs: c.chat_logprobs,
                        finish_reason: finish,
                    }
                })
                .collect();
            Json(ChatResponse {
                id,
                object: "chat.completion".into(),
                created,
                model: req.model.clone(),
                choices,
                usage,
            })
            .into_response()
        }
    }
}

/// The assistant's message for `text`: with tools in play, the tool calls in it are parsed
/// out and a finished answer that holds calls ends with `tool_calls`.
fn assistant_message(
    req: &ValidRequest,
    text: String,
    finish: Option<String>,
    id_base: &str,
) -> (ChatMessageOut, Option<String>) {
    match req.tools.as_ref().filter(|t| t.parses_calls()) {
        None => (
            ChatMessageOut {
                role: "assistant".into(),
                content: Some(text),
                tool_calls: None,
            },
            finish,
        ),
        Some(_) => {
            let parsed = crate::tools::parse_output(&text, &id_base.replace('-', ""));
            let calls = (!parsed.calls.is_empty()).then_some(parsed.calls);
            let finish = match (&calls, finish.as_deref()) {
                (Some(_), Some("stop")) => Some("tool_calls".to_string()),
                _ => finish,
            };
            (
                ChatMessageOut {
                    role: "assistant".into(),
                    content: parsed.content,
                    tool_calls: calls,
                },
                finish,
            )
        }
    }
}

/// Completions' `echo`: the prompt's text (token-id prompts decoded by `model`); empty
/// without `echo`.
fn echo_text(req: &ValidRequest, model: Option<&LocalModel>) -> String {
    if !req.echo {
        return String::new();
    }
    match (&req.prompt, model) {
        (Prompt::Text(t), _) => t.clone(),
        (Prompt::Tokens(ids), Some(m)) => m.info.tokenizer.decode(ids, false).unwrap_or_default(),
        _ => String::new(),
    }
}

fn record(state: &AppState, model: &str, f: &Finished) {
    let m = &state.metrics;
    m.prompt_tokens
        .with_label_values(&[model])
        .inc_by(f.prompt_tokens as u64);
    m.generation_tokens
        .with_label_values(&[model])
        .inc_by(f.output_tokens as u64);
    if let Some(t) = f.ttft_s {
        m.ttft.with_label_values(&[model]).observe(t);
    }
    if let Some(t) = f.tpot_s() {
        m.tpot.with_label_values(&[model]).observe(t);
    }
    m.e2e.with_label_values(&[model]).observe(f.e2e_s);
}

/// Collects every choice's whole answer, then responds once.
async fn full_response(
    state: &Arc<AppState>,
    model: &Arc<LocalModel>,
    req: &ValidRequest,
    mut choices: Choices,
    _admission: Admission,
    timeout: Duration,
) -> Result<Response, ApiError> {
    let id = format!("{}-{}", prefix(req.endpoint), choices.id);
    let n = choices.n;
    let mut outputs: Vec<Vec<RequestOutput>> = vec![Vec::new(); n];
    let collect = async {
        let mut open = n;
        while let Some((i, o)) = choices.next().await {
            let o = o?;
            let last = o.finish_reason.is_some();
            if let Some(list) = outputs.get_mut(i) {
                list.push(o);
            }
            if last {
                open -= 1;
                if open == 0 {
                    return Ok(());
                }
            }
        }
        Err(ApiError::ShuttingDown)
    };
    within_timeout(state, &model.name, timeout, collect).await?;
    let echo = echo_text(req, Some(model));
    let mut usage = Usage::new(0, 0, 0);
    let mut out = Vec::with_capacity(n);
    for (i, outputs) in outputs.iter().enumerate() {
        let last = outputs
            .last()
            .ok_or_else(|| ApiError::Internal("the engine returned no output".into()))?;
        let finished = Finished::from_output(last);
        record(state, &model.name, &finished);
        if i == 0 {
            usage = Usage::new(finished.prompt_tokens, 0, finished.cached_tokens);
        }
        usage.completion_tokens += finished.output_tokens;
        usage.total_tokens += finished.output_tokens;
        let text: String = outputs.iter().map(|o| o.text.as_str()).collect();
        let tokens = Tokens::gather(outputs);
        let (completion_logprobs, chat_logprobs) = match (req.logprobs, req.endpoint) {
            (false, _) => (None, None),
            (true, Endpoint::Completions) => (
                Some(completion_logprobs(
                    model,
                    &tokens,
                    echo.len(),
                    req.tokens_as_ids,
                )),
                None,
            ),
            (true, Endpoint::Chat) => (None, Some(chat_logprobs(model, &tokens))),
        };
        out.push(ChoiceOut {
            text: format!("{echo}{text}"),
            finish: last.finish_reason.map(finish_str).map(str::to_string),
            completion_logprobs,
            chat_logprobs,
        });
    }
    Ok(choices_response(req, id, out, usage))
}

/// Sampled tokens with their log-probabilities and alternatives.
struct Tokens<'a> {
    ids: Vec<u32>,
    logprobs: Vec<f32>,
    top: Vec<&'a [(u32, f32)]>,
}

impl<'a> Tokens<'a> {
    fn gather(outputs: &'a [RequestOutput]) -> Self {
        let mut t = Tokens {
            ids: Vec::new(),
            logprobs: Vec::new(),
            top: Vec::new(),
        };
        for o in outputs {
            t.extend(o);
        }
        t
    }

    fn of(o: &'a RequestOutput) -> Self {
        Self::gather(std::slice::from_ref(o))
    }

    fn extend(&mut self, o: &'a RequestOutput) {
        self.ids.extend_from_slice(&o.token_ids);
        self.logprobs.extend_from_slice(&o.logprobs);
        for i in 0..o.token_ids.len() {
            self.top
                .push(o.top_logprobs.get(i).map_or(&[][..], Vec::as_slice));
        }
    }
}

/// `cmpl-`/`chatcmpl-` plus a per-process tag, so ids stay unique across restarts.
fn prefix(e: Endpoint) -> String {
    static TAG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let tag = TAG.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("{:x}{:x}", nanos & 0xffff_ffff, std::process::id())
    });
    match e {
        Endpoint::Completions => format!("cmpl-{tag}"),
        Endpoint::Chat => format!("chatcmpl-{tag}"),
    }
}

/// Legacy completions log-probabilities: each sampled token, its log-probability, and a map
/// of it and its alternatives (`logprobs: k`) to theirs. Offsets count from `offset` bytes.
fn completion_logprobs(
    model: &LocalModel,
    tokens: &Tokens,
    offset: usize,
    tokens_as_ids: bool,
) -> CompletionLogprobs {
    let name = |id: u32, piece: &str| {
        if tokens_as_ids {
            format!("token_id:{id}")
        } else {
            piece.to_string()
        }
    };
    let mut out = CompletionLogprobs::default();
    let mut at = offset;
    for ((&id, &lp), alts) in tokens.ids.iter().zip(&tokens.logprobs).zip(&tokens.top) {
        let piece = model.piece(id);
        let mut top = serde_json::Map::new();
        top.insert(name(id, &piece), f32_json(lp));
        for &(alt, alp) in alts.iter() {
            top.entry(name(alt, &model.piece(alt)))
                .or_insert_with(|| f32_json(alp));
        }
        out.text_offset.push(at);
        at += piece.len();
        out.tokens.push(name(id, &piece));
        out.token_logprobs.push(lp);
        out.top_logprobs.push(top);
    }
    out
}

/// An f32 as JSON with the digits serde writes for a plain f32 field (−1.7074178, not the
/// f64 widening −1.7074178457260132), so that a value listed twice reads the same.
fn f32_json(x: f32) -> Value {
    x.to_string()
        .parse::<f64>()
        .ok()
        .and_then(serde_json::Number::from_f64)
        .map_or(Value::Null, Value::Number)
}

fn chat_logprobs(model: &LocalModel, tokens: &Tokens) -> ChatLogprobs {
    ChatLogprobs {
        content: tokens
            .ids
            .iter()
            .zip(&tokens.logprobs)
            .zip(&tokens.top)
            .map(|((&id, &lp), alts)| {
                let token = model.piece(id);
                ChatTokenLogprob {
                    bytes: token.as_bytes().to_vec(),
                    token,
                    logprob: lp,
                    top_logprobs: alts
                        .iter()
                        .map(|&(alt, alp)| {
                            let piece = model.piece(alt);
                            json!({"token": piece, "logprob": f32_json(alp), "bytes": piece.as_bytes()})
                        })
                        .collect(),
                }
            })
            .collect(),
    }
}

/// Where a stream's outputs come from: one engine, or the HELIOS orchestrator (which picks
/// the serving candidate itself). Each holds its admission until the stream is dropped.
enum Upstream {
    Engine {
        model: Arc<LocalModel>,
        choices: Choices,
        _admission: Admission,
    },
    Helios {
        stream: switchyard_helios::orchestrator::HeliosStream,
        _admission: HeliosAdmission,
    },
}

impl Upstream {
    /// The next output and the index of its choice.
    async fn next(&mut self) -> Option<(usize, Result<RequestOutput, ApiError>)> {
        match self {
            Upstream::Engine { choices, .. } => choices.next().await,
            Upstream::Helios { stream, .. } => Some((
                0,
                stream
                    .next()
                    .await?
                    .map(|o| o.output)
                    .map_err(helios_api_error),
            )),
        }
    }

    /// The engine's model, for token pieces (log-probabilities); HELIOS refuses those.
    fn local(&self) -> Option<&LocalModel> {
        match self {
            Upstream::Engine { model, .. } => Some(model),
            Upstream::Helios { .. } => None,
        }
    }
}

fn helios_api_error(e: switchyard_helios::HeliosError) -> ApiError {
    match e {
        switchyard_helios::HeliosError::Engine(e) => ApiError::from(e),
        other => ApiError::Internal(other.to_string()),
    }
}

/// Events a streamed response holds for a client that has not taken them yet. The client's
/// socket buffers hold more; once both are full, the client has `write_timeout_s` to read.
pub const STREAM_BUFFER: usize = 16;

/// State of one server-sent-event stream. Dropping it before the end (the client went away,
/// or stopped reading) drops the upstream stream, which aborts the request and frees its KV
/// blocks.
struct StreamState {
    state: Arc<AppState>,
    /// The served model's name (metrics).
    name: String,
    req: ValidRequest,
    upstream: Upstream,
    /// An output read before the response started (HELIOS: to learn the serving candidate).
    pending: Option<RequestOutput>,
    deadline: tokio::time::Instant,
    id: String,
    created: u64,
    /// Per choice: whether its first chunk (role, echoed prompt) went out.
    started: Vec<bool>,
    /// Per choice: text bytes sent so far (completion log-probability offsets).
    offset: Vec<usize>,
    /// Choices not finished yet.
    open: usize,
    /// Prompt tokens, cached prompt tokens and output tokens of the finished choices.
    usage: Usage,
    /// The echoed prompt (completions' `echo`), sent in each choice's first chunk.
    echo: String,
    /// Per choice, with tools in play: its text turned into content and tool-call deltas as
    /// it arrives.
    calls: Vec<crate::tools::CallStreamer>,
    /// Events left to send after the last token: usage, [DONE].
    tail: Vec<Event>,
    finished: bool,
    /// Why the stream ends early if it is dropped unfinished (metrics).
    abort_reason: &'static str,
}

impl Drop for StreamState {
    fn drop(&mut self) {
        if !self.finished {
            self.state
                .metrics
                .aborted
                .with_label_values(&[&self.name, self.abort_reason])
                .inc();
        }
    }
}

impl StreamState {
    fn new(
        state: Arc<AppState>,
        name: String,
        req: ValidRequest,
        upstream: Upstream,
        id: String,
        deadline: tokio::time::Instant,
    ) -> Self {
        let n = req.n;
        let echo = echo_text(&req, upstream.local());
        let calls = (0..n)
            .map(|i| crate::tools::CallStreamer::new(&format!("{id}_{i}").replace('-', "")))
            .collect();
        Self {
            state,
            name,
            req,
            upstream,
            pending: None,
            deadline,
            id,
            created: now_secs(),
            started: vec![false; n],
            offset: vec![0; n],
            open: n,
            usage: Usage::new(0, 0, 0),
            echo,
            calls,
            tail: Vec::new(),
            finished: false,
            abort_reason: "client_disconnect",
        }
    }

    /// The response: events come through a [`STREAM_BUFFER`]-event buffer from a task of
    /// their own, so the deadline runs whether the client reads or not, and a client that
    /// takes nothing for `write_timeout_s` while the buffer is full is cut off. Either way the
    /// task ends, which aborts the request (its K/V blocks are freed) and releases its place.
    fn into_response(mut self) -> Response {
        let (tx, rx) = tokio::sync::mpsc::channel(STREAM_BUFFER);
        let write_timeout = Duration::from_secs(self.state.config.write_timeout_s);
        // The request's span (its id) goes with the task, so its log lines carry the id.
        tokio::spawn(tracing::Instrument::in_current_span(async move {
            while let Some(event) = self.next_event().await {
                match tokio::time::timeout(write_timeout, tx.send(Ok(event))).await {
                    Ok(Ok(())) => {}
                    // The response was dropped: the client went away.
                    Ok(Err(_)) => return,
                    Err(_) => return self.stalled(),
                }
            }
        }));
        Sse::new(tokio_stream::wrappers::ReceiverStream::<
            Result<Event, Infallible>,
        >::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
    }
}

fn stream_response(
    state: Arc<AppState>,
    model: Arc<LocalModel>,
    req: ValidRequest,
    choices: Choices,
    admission: Admission,
    timeout: Duration,
) -> Response {
    let id = format!("{}-{}", prefix(req.endpoint), choices.id);
    let name = model.name.clone();
    let upstream = Upstream::Engine {
        model,
        choices,
        _admission: admission,
    };
    let deadline = tokio::time::Instant::now() + timeout;
    StreamState::new(state, name, req, upstream, id, deadline).into_response()
}

/// Streams a HELIOS request. The response starts once the first output is in, so that the
/// `x-switchyard-served-by` header can name the candidate serving it (the orchestrator picks
/// it when the request reaches the front of its queue); an error before that is a plain error
/// response.
async fn helios_stream_response(
    state: Arc<AppState>,
    h: &Arc<HeliosModel>,
    req: ValidRequest,
    hreq: switchyard_helios::orchestrator::HeliosRequest,
    admission: HeliosAdmission,
    timeout: Duration,
) -> Result<Response, ApiError> {
    let mut stream = h
        .orchestrator
        .submit(hreq)
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut first = None;
    within_timeout(&state, &h.name, timeout, async {
        match stream.next().await {
            Some(o) => {
                first = Some(o.map_err(helios_api_error)?);
                Ok(())
            }
            None => Err(ApiError::ShuttingDown),
        }
    })
    .await?;
    let first = first.ok_or(ApiError::ShuttingDown)?;
    let served_by = first.model.to_string();
    let id = format!("{}-h{}", prefix(req.endpoint), first.output.id);
    let upstream = Upstream::Helios {
        stream,
        _admission: admission,
    };
    let mut st = StreamState::new(state, h.name.clone(), req, upstream, id, deadline);
    st.pending = Some(first.output);
    let mut resp = st.into_response();
    if let Ok(v) = header::HeaderValue::from_str(&served_by) {
        resp.headers_mut().insert("x-switchyard-served-by", v);
    }
    Ok(resp)
}

impl StreamState {
    /// The next event: a chunk, an error, the usage chunk or `[DONE]`; `None` after `[DONE]`.
    async fn next_event(&mut self) -> Option<Event> {
        if let Some(e) = self.tail.pop() {
            return Some(e);
        }
        if self.finished {
            return None;
        }
        let next = match self.pending.take() {
            Some(o) => Ok(Some((0, Ok(o)))),
            None => tokio::time::timeout_at(self.deadline, self.upstream.next()).await,
        };
        let (index, out) = match next {
            Ok(Some((i, Ok(o)))) => (i, o),
            Ok(Some((_, Err(e)))) => return Some(self.end_with(&e)),
            Ok(None) => return Some(self.end_with(&ApiError::ShuttingDown)),
            Err(_) => {
                self.state
                    .metrics
                    .aborted
                    .with_label_values(&[&self.name, "timeout"])
                    .inc();
                let e = ApiError::Timeout(self.state.config.request_timeout_s);
                return Some(self.end_with(&e));
            }
        };
        let event = chunk(self, index, &out);
        if out.finish_reason.is_some() {
            let finished = Finished::from_output(&out);
            record(&self.state, &self.name, &finished);
            if index == 0 {
                self.usage.prompt_tokens = finished.prompt_tokens;
                self.usage.total_tokens += finished.prompt_tokens;
                self.usage.prompt_tokens_details = Some(PromptTokensDetails {
                    cached_tokens: finished.cached_tokens,
                });
            }
            self.usage.completion_tokens += finished.output_tokens;
            self.usage.total_tokens += finished.output_tokens;
            self.open = self.open.saturating_sub(1);
        }
        if self.open == 0 {
            self.finished = true;
            // Sent in reverse order of pushing: usage (if asked), then [DONE].
            self.tail.push(Event::default().data("[DONE]"));
            if self.req.include_usage {
                self.tail
                    .push(json_event(&usage_chunk(self, self.usage.clone())));
            }
        }
        Some(event)
    }

    /// The client took nothing for `write_timeout_s`: dropping the stream now counts it so.
    fn stalled(&mut self) {
        self.abort_reason = "write_timeout";
    }

    /// Ends the stream with `e`'s error event, then `[DONE]`.
    fn end_with(&mut self, e: &ApiError) -> Event {
        self.finished = true;
        self.tail.push(Event::default().data("[DONE]"));
        json_event(&e.body())
    }
}

fn json_event<T: serde::Serialize>(v: &T) -> Event {
    Event::default().data(serde_json::to_string(v).unwrap_or_else(|_| "{}".into()))
}

/// One chunk's content and OpenAI `tool_calls` deltas from what a [`CallStreamer`] gave: a
/// call's first delta carries its id, type and name, the others more of its arguments.
///
/// [`CallStreamer`]: crate::tools::CallStreamer
fn tool_deltas(deltas: Vec<crate::tools::StreamDelta>) -> (Option<String>, Option<Vec<Value>>) {
    use crate::tools::StreamDelta;
    let mut content: Option<String> = None;
    let mut calls: Vec<Value> = Vec::new();
    for d in deltas {
        match d {
            StreamDelta::Content(c) => content.get_or_insert_with(String::new).push_str(&c),
            StreamDelta::CallStart { index, id, name } => calls.push(json!({
                "index": index, "id": id, "type": "function",
                "function": {"name": name, "arguments": ""},
            })),
            StreamDelta::Arguments { index, text } => match calls.last_mut() {
                Some(last) if last["index"] == json!(index) => {
                    let joined = format!(
                        "{}{text}",
                        last["function"]["arguments"].as_str().unwrap_or_default()
                    );
                    last["function"]["arguments"] = json!(joined);
                }
                _ => calls.push(json!({"index": index, "function": {"arguments": text}})),
            },
        }
    }
    (content, (!calls.is_empty()).then_some(calls))
}

fn usage_chunk(st: &StreamState, usage: Usage) -> Value {
    let object = match st.req.endpoint {
        Endpoint::Completions => "text_completion",
        Endpoint::Chat => "chat.completion.chunk",
    };
    json!({
        "id": st.id,
        "object": object,
        "created": st.created,
        "model": st.req.model,
        "choices": [],
        "usage": usage,
    })
}

fn chunk(st: &mut StreamState, index: usize, o: &RequestOutput) -> Event {
    let finish = o.finish_reason.map(finish_str).map(str::to_string);
    let first = !st.started.get(index).copied().unwrap_or(true);
    if let Some(s) = st.started.get_mut(index) {
        *s = true;
    }
    match st.req.endpoint {
        Endpoint::Completions => {
            let echo = if first { st.echo.as_str() } else { "" };
            let offset = st.offset.get(index).copied().unwrap_or(0) + echo.len();
            let logprobs = st
                .upstream
                .local()
                .filter(|_| st.req.logprobs)
                .map(|m| completion_logprobs(m, &Tokens::of(o), offset, st.req.tokens_as_ids));
            if let Some(at) = st.offset.get_mut(index) {
                *at += echo.len() + o.text.len();
            }
            json_event(&CompletionResponse {
                id: st.id.clone(),
                object: "text_completion".into(),
                created: st.created,
                model: st.req.model.clone(),
                choices: vec![CompletionChoice {
                    index,
                    text: format!("{echo}{}", o.text),
                    logprobs,
                    finish_reason: finish,
                }],
                usage: None,
            })
        }
        Endpoint::Chat if st.req.tools.as_ref().is_some_and(|t| t.parses_calls()) => {
            let Some(streamer) = st.calls.get_mut(index) else {
                return Event::default().comment("");
            };
            let mut deltas = streamer.feed(&o.text);
            if o.finish_reason.is_some() {
                deltas.extend(streamer.finish());
            }
            let finish = match finish.as_deref() {
                Some("stop") if streamer.calls() > 0 => Some("tool_calls".to_string()),
                _ => finish,
            };
            if deltas.is_empty() && finish.is_none() && !first {
                // Text held back (a tag may be arriving): a comment keeps the stream moving.
                return Event::default().comment("");
            }
            let (content, calls) = tool_deltas(deltas);
            json_event(&ChatChunk {
                id: st.id.clone(),
                object: "chat.completion.chunk".into(),
                created: st.created,
                model: st.req.model.clone(),
                choices: vec![ChatChunkChoice {
                    index,
                    delta: ChatDelta {
                        role: first.then(|| "assistant".to_string()),
                        content,
                        tool_calls: calls,
                    },
                    logprobs: None,
                    finish_reason: finish,
                }],
                usage: None,
            })
        }
        Endpoint::Chat => {
            let role = first.then(|| "assistant".to_string());
            json_event(&ChatChunk {
                id: st.id.clone(),
                object: "chat.completion.chunk".into(),
                created: st.created,
                model: st.req.model.clone(),
                choices: vec![ChatChunkChoice {
                    index,
                    delta: ChatDelta {
                        role,
                        content: Some(o.text.clone()),
                        tool_calls: None,
                    },
                    logprobs: st
                        .upstream
                        .local()
                        .filter(|_| st.req.logprobs)
                        .map(|m| chat_logprobs(m, &Tokens::of(o))),
                    finish_reason: finish,
                }],
                usage: None,
            })
        }
    }
}

/// vLLM's `/tokenize`: `{"model", "prompt", "add_special_tokens"?}` or `{"model", "messages",
/// "add_generation_prompt"?}` → `{"count", "max_model_len", "tokens"}`.
pub async fn tokenize(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let result: Result<Value, ApiError> = async {
        let (v, m) = tokenizer_request(&state, body).await?;
        let flag = |key: &str, default: bool| match v.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(ApiError::invalid(key, format!("`{key}` must be a boolean"))),
        };
        let tokens = match (v.get("prompt"), v.get("messages")) {
            (Some(Value::String(text)), None) => {
                let special = flag("add_special_tokens", true)?;
                let text = text.clone();
                let m = Arc::clone(&m);
                on_blocking_pool(&state.tokenizing, move || {
                    m.info
                        .tokenizer
                        .encode(&text, special, true)
                        .map_err(|e| ApiError::invalid("prompt", e.to_string()))
                })
                .await??
            }
            (None, Some(_)) => {
                let messages = validate::messages(v.get("messages"))?;
                let generation = flag("add_generation_prompt", true)?;
                let m = Arc::clone(&m);
                on_blocking_pool(&state.tokenizing, move || {
                    m.encode_chat(&messages, None, generation)
                })
                .await??
            }
            _ => {
                return Err(ApiError::invalid(
                    "prompt",
                    "send either `prompt` (a string) or `messages`",
                ))
            }
        };
        Ok(json!({
            "count": tokens.len(),
            "max_model_len": m.info.context_length,
            "tokens": tokens,
        }))
    }
    .await;
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// vLLM's `/detokenize`: `{"model", "tokens"}` → `{"prompt"}`.
pub async fn detokenize(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let result: Result<Value, ApiError> = async {
        let (v, m) = tokenizer_request(&state, body).await?;
        let ids: Vec<u32> = match v.get("tokens") {
            Some(Value::Array(items)) => items
                .iter()
                .map(|x| x.as_u64().and_then(|i| u32::try_from(i).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| {
                    ApiError::invalid("tokens", "`tokens` must be an array of token ids")
                })?,
            _ => {
                return Err(ApiError::invalid(
                    "tokens",
                    "`tokens` is required: an array of token ids",
                ))
            }
        };
        let vocab = m.info.vocab_size;
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(ApiError::invalid(
                "tokens",
                format!("token id {bad} is outside the vocabulary of {vocab}"),
            ));
        }
        let text = m
            .info
            .tokenizer
            .decode(&ids, false)
            .map_err(|e| ApiError::invalid("tokens", e.to_string()))?;
        Ok(json!({ "prompt": text }))
    }
    .await;
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// The body of a tokenizer request and the local model whose tokenizer it names (a
/// ModeSwitch model's modes share their base model's).
async fn tokenizer_request(
    state: &AppState,
    body: Body,
) -> Result<(Value, Arc<LocalModel>), ApiError> {
    let bytes = read_body(state, body).await?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::Malformed(format!("the request body is not valid JSON: {e}")))?;
    let name = v
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid("model", "`model` is required and must be a string"))?;
    match state.models.get(name) {
        Some(Served::Local(m)) => Ok((v.clone(), Arc::clone(m))),
        Some(Served::Modes(ms)) => Ok((v.clone(), Arc::clone(&ms.base))),
        Some(Served::Helios(_)) => Err(ApiError::unsupported(
            "model",
            "the HELIOS model picks the serving model per request; it has no one tokenizer",
        )),
        Some(Served::Remote(_)) => Err(ApiError::unsupported(
            "model",
            "a remote backend's tokenizer is not known here; ask the backend",
        )),
        None => Err(ApiError::UnknownModel(name.to_string())),
    }
}

pub async fn models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    let created = now_secs();
    let data = state
        .models
        .iter()
        .map(|(name, s)| ModelCard {
            id: name.clone(),
            object: "model".into(),
            created,
            owned_by: match s {
                Served::Local(_) => "switchyard".into(),
                Served::Remote(_) => "remote".into(),
                Served::Helios(_) => "switchyard-helios".into(),
                Served::Modes(_) => "switchyard-modeswitch".into(),
            },
            max_model_len: match s {
                Served::Local(m) => Some(m.info.context_length),
                Served::Remote(_) => None,
                Served::Helios(h) => Some(h.context_length),
                Served::Modes(m) => Some(m.base.info.context_length),
            },
        })
        .collect();
    Json(ModelList {
        object: "list".into(),
        data,
    })
}

/// `{"status": "ok" | "unhealthy" | "shutting_down", "models": {NAME: {"state": STATE}}}`,
/// with 503 unless ok. A local model's state is its engine thread's (`running`, `stopped`, or
/// `failed` after a panic; HELIOS: its worst candidate engine's), and one stopped or failed
/// makes the instance unhealthy, so that a load balancer stops sending it traffic. A remote
/// backend is `reachable` or `unreachable` by its last health check, and so is a HELIOS remote
/// candidate (`unreachable`), reported but not counted: it is not this instance's failure.
pub async fn health(State(state): State<Arc<AppState>>) -> Response {
    let mut down = false;
    let models: serde_json::Map<String, Value> = state
        .models
        .iter()
        .map(|(name, s)| {
            let st = match s {
                Served::Remote(r) if r.is_healthy() => "reachable",
                Served::Remote(_) => "unreachable",
                local => {
                    let engine = engine_status(&state, name, local);
                    down |= engine >= EngineStatus::Stopped;
                    engine.as_str()
                }
            };
            (name.clone(), json!({ "state": st }))
        })
        .collect();
    let (code, status) = if state.shutting_down.load(Ordering::SeqCst) {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting_down")
    } else if down {
        (StatusCode::SERVICE_UNAVAILABLE, "unhealthy")
    } else {
        (StatusCode::OK, "ok")
    };
    (code, Json(json!({"status": status, "models": models}))).into_response()
}

/// The worst status of a local model's engine threads (a remote backend has none here:
/// running); refreshes its `switchyard_engine_up` gauge.
fn engine_status(state: &AppState, name: &str, served: &Served) -> EngineStatus {
    let status = match served {
        Served::Local(m) => m.handle.status(),
        Served::Modes(m) => m.base.handle.status(),
        Served::Helios(h) => h
            .engines
            .iter()
            .map(|e| e.status())
            .max()
            .unwrap_or(EngineStatus::Running),
        Served::Remote(_) => return EngineStatus::Running,
    };
    let up = if status < EngineStatus::Stopped {
        1.0
    } else {
        0.0
    };
    state.metrics.engine_up.with_label_values(&[name]).set(up);
    status
}

/// Refreshes the engine gauges, then renders every metric.
pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    for (name, s) in &state.models {
        engine_status(&state, name, s);
        match s {
            Served::Local(m) => {
                state
                    .metrics
                    .in_flight
                    .with_label_values(&[name])
                    .set(m.in_flight() as f64);
                if let Ok(Ok(stats)) =
                    tokio::time::timeout(Duration::from_secs(2), m.handle.stats().recv()).await
                {
                    state.metrics.observe_engine(name, &stats);
                }
            }
            Served::Remote(r) => {
                state
                    .metrics
                    .in_flight
                    .with_label_values(&[name])
                    .set(r.in_flight() as f64);
            }
            Served::Helios(h) => {
                state
                    .metrics
                    .in_flight
                    .with_label_values(&[name])
                    .set(h.in_flight() as f64);
                if let Ok(Ok(s)) =
                    tokio::time::timeout(Duration::from_secs(2), h.orchestrator.stats()).await
                {
                    state.metrics.observe_helios(name, &s.counters);
                }
            }
            Served::Modes(m) => {
                state
                    .metrics
                    .in_flight
                    .with_label_values(&[name])
                    .set(m.in_flight() as f64);
            }
        }
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

/// Every local engine's state (memory by category, queues, counters, layer loads).
pub async fn admin_stats(State(state): State<Arc<AppState>>) -> Response {
    let mut out = BTreeMap::new();
    for (name, s) in &state.models {
        let v = match s {
            Served::Local(m) => match m.handle.stats().recv().await {
                Ok(stats) => serde_json::to_value(stats).unwrap_or(Value::Null),
                Err(e) => json!({"error": e.to_string()}),
            },
            Served::Remote(r) => {
                json!({"remote": true, "healthy": r.is_healthy(), "in_flight": r.in_flight(),
                       "replicas": r.replicas()})
            }
            Served::Helios(h) => match h.orchestrator.stats().await {
                Ok(stats) => serde_json::to_value(stats).unwrap_or(Value::Null),
                Err(e) => json!({"error": e.to_string()}),
            },
            Served::Modes(m) => {
                json!({"in_flight": m.in_flight(), "routes": m.recent_routes().len()})
            }
        };
        out.insert(name.clone(), v);
    }
    Json(out).into_response()
}

/// `{"model": NAME, "depth": N}`: every sequence of that engine exits at layer N from the next
/// step on (its first N layers must be resident).
pub async fn admin_depth(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let result: Result<Value, ApiError> = async {
        let bytes = read_body(&state, body).await?;
        let v: Value = serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::Malformed(format!("the request body is not valid JSON: {e}")))?;
        let name = v
            .get("model")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::invalid("model", "`model` is required"))?;
        let depth = v
            .get("depth")
            .and_then(Value::as_u64)
            .ok_or_else(|| ApiError::invalid("depth", "`depth` must be a positive integer"))?;
        match state.models.get(name) {
            Some(Served::Local(m)) => {
                m.handle
                    .set_depth(depth as usize)
                    .recv()
                    .await
                    .map_err(|e| ApiError::invalid("depth", e.to_string()))?;
                Ok(json!({"model": name, "depth": depth}))
            }
            Some(Served::Remote(_)) => Err(ApiError::unsupported(
                "model",
                "remote models have no depth here",
            )),
            Some(Served::Helios(_)) => Err(ApiError::unsupported(
                "model",
                "the HELIOS orchestrator chooses its own depth",
            )),
            Some(Served::Modes(_)) => Err(ApiError::unsupported(
                "model",
                "a ModeSwitch model serves every request at full depth",
            )),
            None => Err(ApiError::UnknownModel(name.to_string())),
        }
    }
    .await;
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// The Performance History Table of the HELIOS model, in its compact JSON form (404 when no
/// `[helios]` section is served).
pub async fn admin_pht(State(state): State<Arc<AppState>>) -> Response {
    for s in state.models.values() {
        if let Served::Helios(h) = s {
            return match h.orchestrator.stats().await {
                Ok(stats) => Json(stats.pht).into_response(),
                Err(e) => ApiError::Internal(e.to_string()).into_response(),
            };
        }
    }
    ApiError::UnknownModel("helios".into()).into_response()
}

/// The ModeSwitch models' most recent routing decisions with their features, newest last.
pub async fn admin_routes(State(state): State<Arc<AppState>>) -> Response {
    let mut out = BTreeMap::new();
    for (name, s) in &state.models {
        if let Served::Modes(m) = s {
            out.insert(name.clone(), m.recent_routes());
        }
    }
    Json(out).into_response()
}
