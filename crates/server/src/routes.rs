//! HTTP handlers: the OpenAI endpoints, health, metrics and admin routes. Generation goes
//! through one seam ([`crate::serving`]) for every kind of served model, and its response is
//! built once ([`crate::respond`]).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use switchyard_engine::EngineStatus;

use crate::api::{now_secs, ModelCard, ModelList};
use crate::error::ApiError;
use crate::local::{on_blocking_pool, LocalModel};
use crate::respond::respond;
use crate::serving::{RequestContext, Started};
use crate::state::{AppState, Served};
use crate::validate::{self, Endpoint, ValidRequest};

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
    let deadline =
        tokio::time::Instant::now() + Duration::from_secs(state.config.request_timeout_s);
    let name = req.model.clone();
    let served = state
        .models
        .get(&name)
        .cloned()
        .ok_or_else(|| (unknown(), ApiError::UnknownModel(name.clone())))?;
    // Only a remote backend needs the body as sent; it is not kept for the others.
    let body = if matches!(served, Served::Remote(_)) {
        bytes
    } else {
        drop(bytes);
        axum::body::Bytes::new()
    };
    let ctx = RequestContext {
        max_in_flight: state.config.max_in_flight,
        tokenizing: &state.tokenizing,
        metrics: &state.metrics,
        timeout_s: state.config.request_timeout_s,
        headers,
        body,
        deadline,
    };
    let fail = |e: ApiError| (name.clone(), e);
    let resp = match served.start(req, &ctx).await.map_err(fail)? {
        Started::Relayed(resp) => resp,
        Started::Generated(g) => respond(state, *g).await.map_err(fail)?,
    };
    Ok((name, resp))
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
        let places = s.places();
        state
            .metrics
            .observe_places(name, places.in_flight(), places.peak());
        match s {
            Served::Local(m) => {
                if let Ok(Ok(stats)) =
                    tokio::time::timeout(Duration::from_secs(2), m.handle.stats().recv()).await
                {
                    state.metrics.observe_engine(name, &stats);
                }
            }
            Served::Helios(h) => {
                if let Ok(Ok(s)) =
                    tokio::time::timeout(Duration::from_secs(2), h.orchestrator.stats()).await
                {
                    state.metrics.observe_helios(name, &s.counters);
                }
            }
            Served::Remote(_) | Served::Modes(_) => {}
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
