//! Responses built from a [`Generation`], the same way whichever backend produced it: a whole
//! answer in the endpoint's shape, or a stream of server-sent events, with the request's
//! log-probabilities, tool calls, echo, usage and metrics.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::http::header;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use switchyard_engine::RequestOutput;
use switchyard_tokenizer::Tokenizer;

use crate::api::{
    now_secs, ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatLogprobs, ChatMessageOut,
    ChatResponse, ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionResponse,
    PromptTokensDetails, Usage,
};
use crate::error::ApiError;
use crate::local::{finish_str, Finished};
use crate::serving::{before_deadline, Generation, STREAM_BUFFER};
use crate::state::AppState;
use crate::validate::{Endpoint, Prompt, ValidRequest};

/// The response to a started generation, whole or streamed as the request asked, with the
/// backend's headers.
pub async fn respond(state: &Arc<AppState>, mut g: Generation) -> Result<Response, ApiError> {
    let headers = std::mem::take(&mut g.headers);
    let mut resp = if g.req.stream {
        StreamState::new(Arc::clone(state), g).into_response()
    } else {
        full_response(state, g).await?
    };
    for (k, v) in headers {
        if let Ok(v) = header::HeaderValue::from_str(&v) {
            resp.headers_mut().insert(k, v);
        }
    }
    Ok(resp)
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
fn echo_text(req: &ValidRequest, vocabulary: Option<&Tokenizer>) -> String {
    if !req.echo {
        return String::new();
    }
    match (&req.prompt, vocabulary) {
        (Prompt::Text(t), _) => t.clone(),
        (Prompt::Tokens(ids), Some(t)) => t.decode(ids, false).unwrap_or_default(),
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
async fn full_response(state: &Arc<AppState>, mut g: Generation) -> Result<Response, ApiError> {
    let n = g.choices();
    let mut outputs: Vec<Vec<RequestOutput>> = vec![Vec::new(); n];
    let (name, deadline) = (g.name.clone(), g.deadline);
    let collect = async {
        let mut open = n;
        while let Some((i, o)) = g.next().await {
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
    let timeout_s = state.config.request_timeout_s;
    before_deadline(&state.metrics, timeout_s, &name, deadline, collect).await?;
    let req = &g.req;
    let model = g.vocabulary.as_deref();
    let echo = echo_text(req, model);
    let mut usage = Usage::new(0, 0, 0);
    let mut out = Vec::with_capacity(n);
    for (i, outputs) in outputs.iter().enumerate() {
        let last = outputs
            .last()
            .ok_or_else(|| ApiError::Internal("the engine returned no output".into()))?;
        let finished = Finished::from_output(last);
        record(state, &g.name, &finished);
        if i == 0 {
            usage = Usage::new(finished.prompt_tokens, 0, finished.cached_tokens);
        }
        usage.completion_tokens += finished.output_tokens;
        usage.total_tokens += finished.output_tokens;
        let text: String = outputs.iter().map(|o| o.text.as_str()).collect();
        let tokens = Tokens::gather(outputs);
        let (completion_logprobs, chat_logprobs) = match (model, req.logprobs, req.endpoint) {
            (None, _, _) | (_, false, _) => (None, None),
            (Some(m), true, Endpoint::Completions) => (
                Some(completion_logprobs(
                    m,
                    &tokens,
                    echo.len(),
                    req.tokens_as_ids,
                )),
                None,
            ),
            (Some(m), true, Endpoint::Chat) => (None, Some(chat_logprobs(m, &tokens))),
        };
        out.push(ChoiceOut {
            text: format!("{echo}{text}"),
            finish: last.finish_reason.map(finish_str).map(str::to_string),
            completion_logprobs,
            chat_logprobs,
        });
    }
    Ok(choices_response(req, g.id.clone(), out, usage))
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

/// Legacy completions log-probabilities: each sampled token, its log-probability, and a map
/// of it and its alternatives (`logprobs: k`) to theirs. Offsets count from `offset` bytes.
fn completion_logprobs(
    model: &Tokenizer,
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
        let text = piece(model, id);
        let mut top = serde_json::Map::new();
        top.insert(name(id, &text), f32_json(lp));
        for &(alt, alp) in alts.iter() {
            top.entry(name(alt, &piece(model, alt)))
                .or_insert_with(|| f32_json(alp));
        }
        out.text_offset.push(at);
        at += text.len();
        out.tokens.push(name(id, &text));
        out.token_logprobs.push(lp);
        out.top_logprobs.push(top);
    }
    out
}

/// Text of one token for log-probability listings.
fn piece(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id], false).unwrap_or_default()
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

fn chat_logprobs(model: &Tokenizer, tokens: &Tokens) -> ChatLogprobs {
    ChatLogprobs {
        content: tokens
            .ids
            .iter()
            .zip(&tokens.logprobs)
            .zip(&tokens.top)
            .map(|((&id, &lp), alts)| {
                let token = piece(model, id);
                ChatTokenLogprob {
                    bytes: token.as_bytes().to_vec(),
                    token,
                    logprob: lp,
                    top_logprobs: alts
                        .iter()
                        .map(|&(alt, alp)| {
                            let text = piece(model, alt);
                            json!({"token": text, "logprob": f32_json(alp), "bytes": text.as_bytes()})
                        })
                        .collect(),
                }
            })
            .collect(),
    }
}

/// State of one server-sent-event stream. Dropping it before the end (the client went away,
/// or stopped reading) drops the upstream stream, which aborts the request and frees its KV
/// blocks.
struct StreamState {
    state: Arc<AppState>,
    /// The request's outputs, its name (metrics), id and request.
    g: Generation,
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
                .with_label_values(&[&self.g.name, self.abort_reason])
                .inc();
        }
    }
}

impl StreamState {
    fn new(state: Arc<AppState>, g: Generation) -> Self {
        let n = g.choices();
        let echo = echo_text(&g.req, g.vocabulary.as_deref());
        let calls = (0..n)
            .map(|i| crate::tools::CallStreamer::new(&format!("{}_{i}", g.id).replace('-', "")))
            .collect();
        Self {
            state,
            g,
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

impl StreamState {
    /// The next event: a chunk, an error, the usage chunk or `[DONE]`; `None` after `[DONE]`.
    async fn next_event(&mut self) -> Option<Event> {
        if let Some(e) = self.tail.pop() {
            return Some(e);
        }
        if self.finished {
            return None;
        }
        let next = tokio::time::timeout_at(self.g.deadline, self.g.next()).await;
        let (index, out) = match next {
            Ok(Some((i, Ok(o)))) => (i, o),
            Ok(Some((_, Err(e)))) => return Some(self.end_with(&e)),
            Ok(None) => return Some(self.end_with(&ApiError::ShuttingDown)),
            Err(_) => {
                self.state
                    .metrics
                    .aborted
                    .with_label_values(&[&self.g.name, "timeout"])
                    .inc();
                let e = ApiError::Timeout(self.state.config.request_timeout_s);
                return Some(self.end_with(&e));
            }
        };
        let event = chunk(self, index, &out);
        if out.finish_reason.is_some() {
            let finished = Finished::from_output(&out);
            record(&self.state, &self.g.name, &finished);
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
            if self.g.req.include_usage {
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
    let object = match st.g.req.endpoint {
        Endpoint::Completions => "text_completion",
        Endpoint::Chat => "chat.completion.chunk",
    };
    json!({
        "id": st.g.id,
        "object": object,
        "created": st.created,
        "model": st.g.req.model,
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
    match st.g.req.endpoint {
        Endpoint::Completions => {
            let echo = if first { st.echo.as_str() } else { "" };
            let offset = st.offset.get(index).copied().unwrap_or(0) + echo.len();
            let logprobs = st
                .g
                .vocabulary
                .as_deref()
                .filter(|_| st.g.req.logprobs)
                .map(|m| completion_logprobs(m, &Tokens::of(o), offset, st.g.req.tokens_as_ids));
            if let Some(at) = st.offset.get_mut(index) {
                *at += echo.len() + o.text.len();
            }
            json_event(&CompletionResponse {
                id: st.g.id.clone(),
                object: "text_completion".into(),
                created: st.created,
                model: st.g.req.model.clone(),
                choices: vec![CompletionChoice {
                    index,
                    text: format!("{echo}{}", o.text),
                    logprobs,
                    finish_reason: finish,
                }],
                usage: None,
            })
        }
        Endpoint::Chat if st.g.req.tools.as_ref().is_some_and(|t| t.parses_calls()) => {
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
            let (content, tool_calls) = tool_deltas(deltas);
            let delta = ChatDelta {
                role: first.then(|| "assistant".to_string()),
                content,
                tool_calls,
            };
            chat_chunk(st, index, delta, None, finish)
        }
        Endpoint::Chat => {
            let delta = ChatDelta {
                role: first.then(|| "assistant".to_string()),
                content: Some(o.text.clone()),
                tool_calls: None,
            };
            let logprobs =
                st.g.vocabulary
                    .as_deref()
                    .filter(|_| st.g.req.logprobs)
                    .map(|m| chat_logprobs(m, &Tokens::of(o)));
            chat_chunk(st, index, delta, logprobs, finish)
        }
    }
}

/// One chat stream chunk: choice `index`'s delta.
fn chat_chunk(
    st: &StreamState,
    index: usize,
    delta: ChatDelta,
    logprobs: Option<ChatLogprobs>,
    finish_reason: Option<String>,
) -> Event {
    json_event(&ChatChunk {
        id: st.g.id.clone(),
        object: "chat.completion.chunk".into(),
        created: st.created,
        model: st.g.req.model.clone(),
        choices: vec![ChatChunkChoice {
            index,
            delta,
            logprobs,
            finish_reason,
        }],
        usage: None,
    })
}
