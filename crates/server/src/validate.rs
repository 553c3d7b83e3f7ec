//! Validation at the edge: a raw JSON body becomes a [`ValidRequest`] or an [`ApiError`] that
//! names the offending field. Nothing past this module sees unchecked input.

use serde_json::{Map, Value};
use switchyard_request::{
    Guide, SamplingParams, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_OPENAI_PENALTY,
    MAX_REPETITION_PENALTY, MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES, MAX_STOP_TOKEN_IDS,
    MIN_REPETITION_PENALTY,
};
use switchyard_tokenizer::ChatMessage;

use crate::error::ApiError;

/// OpenAI's default `max_tokens` for legacy completions.
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;
/// OpenAI's temperature range.
pub const MAX_TEMPERATURE: f64 = 2.0;
/// Most log-probability alternatives a client may ask for (vLLM's limit on both endpoints;
/// OpenAI's legacy completions stop at 5).
pub const MAX_LOGPROBS: u64 = switchyard_request::MAX_TOP_LOGPROBS as u64;
/// Most choices per request.
pub const MAX_N: u64 = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    pub fn path(&self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }

    pub fn label(&self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::Chat => "chat",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Chat(Vec<ChatMessage>),
}

/// A request every later stage may trust. `max_tokens` is `None` when the client left it to
/// the server (chat: the rest of the context).
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRequest {
    pub endpoint: Endpoint,
    pub model: String,
    pub prompt: Prompt,
    pub params: SamplingParams,
    pub max_tokens: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    /// Log-probabilities are returned (their alternatives: `params.top_logprobs`).
    pub logprobs: bool,
    /// Choices to generate from the one prompt (`n`).
    pub n: usize,
    /// Completions' `echo`: the prompt's text comes back before the completion.
    pub echo: bool,
    /// Chat `tools` and `tool_choice` (`None` without tools).
    pub tools: Option<crate::tools::Tools>,
    /// vLLM's `return_tokens_as_token_ids`: log-probability listings name each token as
    /// `token_id:<id>` instead of its text, so a client can recover the exact ids.
    pub tokens_as_ids: bool,
}

/// Parses and checks a request body for `endpoint`.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<ValidRequest, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::Malformed(format!("the request body is not valid UTF-8: {e}")))?;
    let raw: Value = serde_json::from_str(text)
        .map_err(|e| ApiError::Malformed(format!("the request body is not valid JSON: {e}")))?;
    let obj = raw
        .as_object()
        .ok_or_else(|| ApiError::Malformed("the request body must be a JSON object".into()))?;
    let f = Fields(obj);

    let model = f
        .string("model")?
        .ok_or_else(|| ApiError::invalid("model", "`model` is required"))?;
    let prompt = match endpoint {
        Endpoint::Completions => completion_prompt(obj.get("prompt"))?,
        Endpoint::Chat => Prompt::Chat(messages(obj.get("messages"))?),
    };
    let n = f.uint("n")?.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::invalid(
            "n",
            format!("`n` must be between 1 and {MAX_N}, got {n}"),
        ));
    }
    if let Some(b) = f.uint("best_of")? {
        if b != n {
            return Err(ApiError::unsupported(
                "best_of",
                format!(
                    "`best_of` must equal `n` ({n}): ranking extra candidates is not supported"
                ),
            ));
        }
    }
    let presence_penalty = openai_penalty(&f, "presence_penalty")?;
    let frequency_penalty = openai_penalty(&f, "frequency_penalty")?;
    let echo = f.bool("echo")?.unwrap_or(false);
    if echo && endpoint == Endpoint::Chat {
        return Err(ApiError::invalid(
            "echo",
            "`echo` applies to /v1/completions only",
        ));
    }
    let logit_bias = logit_bias(obj.get("logit_bias"))?;
    let min_p = f.number("min_p")?.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::invalid(
            "min_p",
            format!("`min_p` must be between 0 and 1, got {min_p}"),
        ));
    }
    let min_tokens = f.uint("min_tokens")?.unwrap_or(0);
    let stop_token_ids = token_ids(obj.get("stop_token_ids"), "stop_token_ids")?;
    if stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(ApiError::invalid(
            "stop_token_ids",
            format!(
                "at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {}",
                stop_token_ids.len()
            ),
        ));
    }
    let guide = guide(obj)?;
    let tools = crate::tools::parse(obj)?;
    if tools.is_some() && endpoint != Endpoint::Chat {
        return Err(ApiError::invalid(
            "tools",
            "`tools` applies to /v1/chat/completions only",
        ));
    }
    if let (Some(t), Some(_)) = (&tools, &guide) {
        if matches!(
            t.choice,
            crate::tools::ToolChoice::Required | crate::tools::ToolChoice::Named(_)
        ) {
            return Err(ApiError::invalid(
                "tool_choice",
                "a required tool call already fixes the output's form; drop the output constraint",
            ));
        }
    }
    for key in ["suffix", "functions"] {
        match obj.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::Object(m)) if m.is_empty() => {}
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(_) => {
                return Err(ApiError::unsupported(
                    key,
                    format!("`{key}` is not supported"),
                ))
            }
        }
    }

    // `max_completion_tokens` (OpenAI's newer name) wins over `max_tokens` on both endpoints.
    let asked = match f.uint("max_completion_tokens")? {
        Some(v) => Some(v),
        None => f.uint("max_tokens")?,
    };
    let max_tokens = match endpoint {
        Endpoint::Completions => Some(asked.unwrap_or(DEFAULT_COMPLETION_MAX_TOKENS as u64)),
        Endpoint::Chat => asked,
    };
    if max_tokens == Some(0) {
        return Err(ApiError::invalid(
            "max_tokens",
            "`max_tokens` must be at least 1",
        ));
    }
    let max_tokens = max_tokens
        .map(|v| {
            usize::try_from(v).map_err(|_| {
                ApiError::invalid("max_tokens", format!("`max_tokens` = {v} is too large"))
            })
        })
        .transpose()?;

    let temperature = f.number("temperature")?.unwrap_or(1.0);
    if !(0.0..=MAX_TEMPERATURE).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature",
            format!("`temperature` must be between 0 and {MAX_TEMPERATURE}, got {temperature}"),
        ));
    }
    let top_p = f.number("top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            "top_p",
            format!("`top_p` must be in (0, 1], got {top_p}"),
        ));
    }
    let top_k = match obj.get("top_k") {
        None | Some(Value::Null) => 0,
        Some(v) => match v.as_i64() {
            Some(k) if k <= 0 => 0,
            Some(k) => k as usize,
            None => return Err(ApiError::invalid("top_k", "`top_k` must be an integer")),
        },
    };
    let repetition_penalty = f.number("repetition_penalty")?.unwrap_or(1.0);
    let penalties = MIN_REPETITION_PENALTY as f64..=MAX_REPETITION_PENALTY as f64;
    if !penalties.contains(&repetition_penalty) {
        return Err(ApiError::invalid(
            "repetition_penalty",
            format!(
                "`repetition_penalty` must be between {MIN_REPETITION_PENALTY} and {MAX_REPETITION_PENALTY}, got {repetition_penalty}"
            ),
        ));
    }
    let seed = match obj.get("seed") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .or_else(|| v.as_i64().map(|s| s as u64))
                .ok_or_else(|| ApiError::invalid("seed", "`seed` must be an integer"))?,
        ),
    };
    let stop = stops(obj.get("stop"))?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::invalid(
                    "stream_options",
                    "`stream_options` is only allowed with `stream: true`",
                ));
            }
            match o.get("include_usage") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ApiError::invalid(
                        "stream_options.include_usage",
                        "`include_usage` must be a boolean",
                    ))
                }
            }
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stream_options",
                "`stream_options` must be an object",
            ))
        }
    };
    // Completions: `logprobs: k` asks for the sampled token and k alternatives. Chat:
    // `logprobs: true` turns them on, `top_logprobs: k` asks for k alternatives.
    let (logprobs, top_logprobs) = match endpoint {
        Endpoint::Completions => match f.uint("logprobs")? {
            None => (false, 0),
            Some(n) if n <= MAX_LOGPROBS => (true, n),
            Some(n) => {
                return Err(ApiError::invalid(
                    "logprobs",
                    format!("`logprobs` must be at most {MAX_LOGPROBS}, got {n}"),
                ))
            }
        },
        Endpoint::Chat => {
            let on = f.bool("logprobs")?.unwrap_or(false);
            let top = f.uint("top_logprobs")?;
            match top {
                Some(t) if t > MAX_LOGPROBS => {
                    return Err(ApiError::invalid(
                        "top_logprobs",
                        format!("`top_logprobs` must be at most {MAX_LOGPROBS}, got {t}"),
                    ))
                }
                Some(t) if t > 0 && !on => {
                    return Err(ApiError::invalid(
                        "top_logprobs",
                        "`top_logprobs` requires `logprobs: true`",
                    ))
                }
                _ => {}
            }
            (on, top.unwrap_or(0))
        }
    };
    if logprobs && stream && tools.as_ref().is_some_and(|t| t.parses_calls()) {
        return Err(ApiError::unsupported(
            "logprobs",
            "a streamed answer with tools holds text back while it parses tool calls, so per-token log-probabilities would not line up with its deltas; they are not streamed with it",
        ));
    }
    if echo && logprobs {
        return Err(ApiError::unsupported(
            "echo",
            "`echo` with `logprobs` is not supported: prompt log-probabilities are not computed",
        ));
    }
    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    let tokens_as_ids = f.bool("return_tokens_as_token_ids")?.unwrap_or(false);

    let params = SamplingParams {
        // Chat without `max_tokens`: the rest of the context, set once the prompt is tokenized.
        max_tokens: max_tokens
            .unwrap_or(1)
            .max(usize::try_from(min_tokens).unwrap_or(usize::MAX)),
        temperature: temperature as f32,
        top_k,
        top_p: top_p as f32,
        repetition_penalty: repetition_penalty as f32,
        seed,
        stop,
        ignore_eos,
        presence_penalty,
        frequency_penalty,
        logit_bias,
        min_p: min_p as f32,
        min_tokens: usize::try_from(min_tokens).unwrap_or(usize::MAX),
        stop_token_ids,
        top_logprobs: top_logprobs as usize,
        report_logprobs: logprobs,
        guide,
    };
    if let Some(m) = max_tokens {
        if params.min_tokens > m {
            return Err(ApiError::invalid(
                "min_tokens",
                format!(
                    "`min_tokens` ({}) must not exceed `max_tokens` ({m})",
                    params.min_tokens
                ),
            ));
        }
    }
    params
        .validate()
        .map_err(|e| ApiError::invalid("sampling", e.to_string()))?;
    Ok(ValidRequest {
        endpoint,
        model,
        prompt,
        params,
        max_tokens,
        stream,
        include_usage,
        logprobs,
        n: n as usize,
        echo,
        tools,
        tokens_as_ids,
    })
}

/// The structured-output constraint: OpenAI's `response_format` (`json_object`,
/// `json_schema`) or one of vLLM's `guided_json`, `guided_regex`, `guided_choice`,
/// `guided_grammar`; at most one.
fn guide(obj: &Map<String, Value>) -> Result<Option<Guide>, ApiError> {
    let set = |key: &str| !matches!(obj.get(key), None | Some(Value::Null));
    let keys = [
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ];
    let given: Vec<&str> = keys.iter().copied().filter(|k| set(k)).collect();
    if given.len() > 1 {
        return Err(ApiError::invalid(
            given[1],
            format!("give one output constraint, not {}", given.join(" and ")),
        ));
    }
    let Some(&key) = given.first() else {
        return Ok(None);
    };
    let v = &obj[key];
    let guide = match key {
        "response_format" => {
            let kind = v.get("type").and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid(
                    "response_format.type",
                    "`response_format` must be an object with a `type`: text, json_object or json_schema",
                )
            })?;
            match kind {
                "text" => return Ok(None),
                "json_object" => Guide::JsonObject,
                "json_schema" => {
                    let schema = v
                        .get("json_schema")
                        .and_then(|j| j.get("schema"))
                        .filter(|s| s.is_object() || s.is_boolean())
                        .ok_or_else(|| {
                            ApiError::invalid(
                                "response_format.json_schema.schema",
                                "`response_format.json_schema.schema` must be a JSON schema object",
                            )
                        })?;
                    Guide::JsonSchema(schema.clone())
                }
                other => {
                    return Err(ApiError::invalid(
                        "response_format.type",
                        format!("unknown `response_format.type` {other:?}: use text, json_object or json_schema"),
                    ))
                }
            }
        }
        "guided_json" => match v {
            Value::String(text) => Guide::JsonSchema(serde_json::from_str(text).map_err(|e| {
                ApiError::invalid("guided_json", format!("`guided_json` is not JSON: {e}"))
            })?),
            Value::Object(_) | Value::Bool(_) => Guide::JsonSchema(v.clone()),
            _ => {
                return Err(ApiError::invalid(
                    "guided_json",
                    "`guided_json` must be a JSON schema",
                ))
            }
        },
        "guided_regex" => Guide::Regex(
            v.as_str()
                .ok_or_else(|| {
                    ApiError::invalid("guided_regex", "`guided_regex` must be a string")
                })?
                .to_string(),
        ),
        "guided_choice" => Guide::Choice(
            v.as_array()
                .and_then(|a| {
                    a.iter()
                        .map(|c| c.as_str().map(str::to_string))
                        .collect::<Option<Vec<String>>>()
                })
                .ok_or_else(|| {
                    ApiError::invalid(
                        "guided_choice",
                        "`guided_choice` must be an array of strings",
                    )
                })?,
        ),
        _ => Guide::Lark(
            v.as_str()
                .ok_or_else(|| {
                    ApiError::invalid("guided_grammar", "`guided_grammar` must be a string")
                })?
                .to_string(),
        ),
    };
    Ok(Some(guide))
}

/// `presence_penalty` / `frequency_penalty`: OpenAI's range, −2 to 2.
fn openai_penalty(f: &Fields, key: &str) -> Result<f32, ApiError> {
    let v = f.number(key)?.unwrap_or(0.0);
    if !(-(MAX_OPENAI_PENALTY as f64)..=MAX_OPENAI_PENALTY as f64).contains(&v) {
        return Err(ApiError::invalid(
            key,
            format!(
                "`{key}` must be between -{MAX_OPENAI_PENALTY} and {MAX_OPENAI_PENALTY}, got {v}"
            ),
        ));
    }
    Ok(v as f32)
}

/// OpenAI's `logit_bias`: an object from token id (as a string) to a bias in [−100, 100].
fn logit_bias(v: Option<&Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let map = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(_) => {
            return Err(ApiError::invalid(
                "logit_bias",
                "`logit_bias` must be an object from token ids to numbers",
            ))
        }
    };
    if map.len() > MAX_LOGIT_BIAS_ENTRIES {
        return Err(ApiError::invalid(
            "logit_bias",
            format!(
                "`logit_bias` may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {}",
                map.len()
            ),
        ));
    }
    map.iter()
        .map(|(k, v)| {
            let token: u32 = k.trim().parse().map_err(|_| {
                ApiError::invalid(
                    "logit_bias",
                    format!("`logit_bias` keys must be token ids, got {k:?}"),
                )
            })?;
            let bias = v.as_f64().filter(|b| b.abs() <= MAX_LOGIT_BIAS as f64).ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!(
                        "`logit_bias` values must be numbers between -{MAX_LOGIT_BIAS} and {MAX_LOGIT_BIAS}, got {v} for token {token}"
                    ),
                )
            })?;
            Ok((token, bias as f32))
        })
        .collect()
}

/// An optional array of token ids.
fn token_ids(v: Option<&Value>, key: &str) -> Result<Vec<u32>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|i| u32::try_from(i).ok())
                    .ok_or_else(|| {
                        ApiError::invalid(key, format!("`{key}` must be an array of token ids"))
                    })
            })
            .collect(),
        Some(_) => Err(ApiError::invalid(
            key,
            format!("`{key}` must be an array of token ids"),
        )),
    }
}

/// Typed getters that say which field has the wrong type.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn string(&self, key: &str) -> Result<Option<String>, ApiError> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(ApiError::invalid(key, format!("`{key}` must be a string"))),
        }
    }

    fn number(&self, key: &str) -> Result<Option<f64>, ApiError> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(_) => Err(ApiError::invalid(key, format!("`{key}` must be a number"))),
        }
    }

    fn uint(&self, key: &str) -> Result<Option<u64>, ApiError> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => match (n.as_u64(), n.as_i64()) {
                (Some(v), _) => Ok(Some(v)),
                (None, Some(v)) => Err(ApiError::invalid(
                    key,
                    format!("`{key}` must not be negative, got {v}"),
                )),
                _ => Err(ApiError::invalid(
                    key,
                    format!("`{key}` must be an integer"),
                )),
            },
            Some(_) => Err(ApiError::invalid(
                key,
                format!("`{key}` must be an integer"),
            )),
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(ApiError::invalid(key, format!("`{key}` must be a boolean"))),
        }
    }
}

fn completion_prompt(v: Option<&Value>) -> Result<Prompt, ApiError> {
    match v {
        None | Some(Value::Null) => Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(items)) => {
            if items.is_empty() {
                return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
            }
            if items.iter().all(Value::is_string) {
                if items.len() > 1 {
                    return Err(ApiError::unsupported(
                        "prompt",
                        "batched prompts are not supported; send one prompt per request",
                    ));
                }
                return Ok(Prompt::Text(
                    items[0].as_str().unwrap_or_default().to_string(),
                ));
            }
            let ids: Option<Vec<u32>> = items
                .iter()
                .map(|x| x.as_u64().and_then(|i| u32::try_from(i).ok()))
                .collect();
            ids.map(Prompt::Tokens).ok_or_else(|| {
                ApiError::invalid(
                    "prompt",
                    "`prompt` must be a string, an array of one string, or an array of token ids",
                )
            })
        }
        Some(_) => Err(ApiError::invalid(
            "prompt",
            "`prompt` must be a string, an array of one string, or an array of token ids",
        )),
    }
}

pub(crate) fn messages(v: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match v {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("messages", "`messages` is required"))
        }
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::invalid("messages", "`messages` must be an array")),
    };
    if items.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must not be empty",
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let at = format!("messages[{i}]");
            let o = m
                .as_object()
                .ok_or_else(|| ApiError::invalid(&at, format!("`{at}` must be an object")))?;
            let role = match o.get("role") {
                Some(Value::String(r))
                    if matches!(
                        r.as_str(),
                        "system" | "user" | "assistant" | "developer" | "tool"
                    ) =>
                {
                    r.clone()
                }
                Some(Value::String(r)) => {
                    return Err(ApiError::invalid(
                        &format!("{at}.role"),
                        format!("unknown role {r:?}"),
                    ))
                }
                _ => {
                    return Err(ApiError::invalid(
                        &format!("{at}.role"),
                        format!("`{at}.role` is required and must be a string"),
                    ))
                }
            };
            let content = match o.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None if role == "assistant" => String::new(),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (
                            p.get("type").and_then(Value::as_str),
                            p.get("text").and_then(Value::as_str),
                        ) {
                            (Some("text"), Some(t)) => text.push_str(t),
                            (Some(kind), _) => {
                                return Err(ApiError::unsupported(
                                    &format!("{at}.content[{j}]"),
                                    format!("content parts of type {kind:?} are not supported"),
                                ))
                            }
                            _ => {
                                return Err(ApiError::invalid(
                                    &format!("{at}.content[{j}]"),
                                    "a content part needs `type` and `text`",
                                ))
                            }
                        }
                    }
                    text
                }
                _ => {
                    return Err(ApiError::invalid(
                        &format!("{at}.content"),
                        format!("`{at}.content` must be a string or an array of text parts"),
                    ))
                }
            };
            let mut message = ChatMessage::new(role, content);
            if let Some(calls) = o.get("tool_calls").filter(|c| !c.is_null()) {
                message.tool_calls = Some(crate::tools::history_calls(
                    calls,
                    &format!("{at}.tool_calls"),
                )?);
            }
            message.tool_call_id = o
                .get("tool_call_id")
                .and_then(Value::as_str)
                .map(str::to_string);
            message.name = o.get("name").and_then(Value::as_str).map(str::to_string);
            Ok(message)
        })
        .collect()
}

fn stops(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let list: Vec<String> = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str().map(str::to_string).ok_or_else(|| {
                    ApiError::invalid("stop", "`stop` must be a string or an array of strings")
                })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "`stop` must be a string or an array of strings",
            ))
        }
    };
    if list.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "at most {MAX_STOP_STRINGS} stop strings are allowed, got {}",
                list.len()
            ),
        ));
    }
    if let Some(s) = list
        .iter()
        .find(|s| s.is_empty() || s.len() > MAX_STOP_STRING_BYTES)
    {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "stop strings must be 1 to {MAX_STOP_STRING_BYTES} bytes long, got one of {} bytes",
                s.len()
            ),
        ));
    }
    Ok(list)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(endpoint: Endpoint, body: &str) -> (u16, String) {
        let e = parse(endpoint, body.as_bytes()).unwrap_err();
        (e.status().as_u16(), e.to_string())
    }

    #[test]
    fn good_requests_parse() {
        let r = parse(
            Endpoint::Completions,
            br#"{"model":"m","prompt":"hi","max_tokens":5,"temperature":0,"stop":["\n"],"seed":3,"stream":true,"stream_options":{"include_usage":true},"logprobs":1}"#,
        )
        .unwrap();
        assert_eq!(r.prompt, Prompt::Text("hi".into()));
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.params.seed, Some(3));
        assert!(r.stream && r.include_usage && r.logprobs);
        let r = parse(Endpoint::Completions, br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!(r.max_tokens, Some(DEFAULT_COMPLETION_MAX_TOKENS));
        let r = parse(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#,
        )
        .unwrap();
        assert_eq!(r.prompt, Prompt::Chat(vec![ChatMessage::new("user", "ab")]));
        assert_eq!(r.max_tokens, None);
        let r = parse(
            Endpoint::Completions,
            br#"{"model":"m","prompt":"x","n":3,"echo":true,"presence_penalty":0.5,"frequency_penalty":-1,"logit_bias":{"7":-100,"9":2.5},"min_p":0.1,"min_tokens":2,"stop_token_ids":[4,5],"max_completion_tokens":9}"#,
        )
        .unwrap();
        assert_eq!((r.n, r.echo, r.max_tokens), (3, true, Some(9)));
        let p = &r.params;
        assert_eq!((p.presence_penalty, p.frequency_penalty), (0.5, -1.0));
        let mut bias = p.logit_bias.clone();
        bias.sort_by_key(|b| b.0);
        assert_eq!(bias, vec![(7, -100.0), (9, 2.5)]);
        assert_eq!((p.min_p, p.min_tokens), (0.1, 2));
        assert_eq!(p.stop_token_ids, vec![4, 5]);
        let r = parse(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":3}"#,
        )
        .unwrap();
        assert!(r.logprobs);
        assert_eq!(r.params.top_logprobs, 3);
    }

    #[test]
    fn bad_requests_name_the_field() {
        use Endpoint::*;
        assert_eq!(err(Completions, "{").0, 400);
        assert_eq!(
            err(Completions, "[1]"),
            (400, "the request body must be a JSON object".into())
        );
        assert_eq!(
            err(Completions, r#"{"prompt":"x"}"#),
            (422, "`model` is required".into())
        );
        assert_eq!(
            err(Completions, r#"{"model":1,"prompt":"x"}"#),
            (422, "`model` must be a string".into())
        );
        assert_eq!(
            err(Completions, r#"{"model":"m"}"#),
            (422, "`prompt` is required".into())
        );
        assert_eq!(
            err(Completions, r#"{"model":"m","prompt":"x","max_tokens":-1}"#),
            (422, "`max_tokens` must not be negative, got -1".into())
        );
        assert_eq!(
            err(
                Completions,
                r#"{"model":"m","prompt":"x","max_tokens":"5"}"#
            ),
            (422, "`max_tokens` must be an integer".into())
        );
        assert_eq!(
            err(Completions, r#"{"model":"m","prompt":"x","temperature":3}"#),
            (422, "`temperature` must be between 0 and 2, got 3".into())
        );
        assert_eq!(
            err(
                Completions,
                r#"{"model":"m","prompt":"x","repetition_penalty":0.001}"#
            ),
            (
                422,
                "`repetition_penalty` must be between 0.01 and 100, got 0.001".into()
            )
        );
        assert_eq!(
            err(Completions, r#"{"model":"m","prompt":"x","n":0}"#),
            (422, "`n` must be between 1 and 16, got 0".into())
        );
        assert_eq!(
            err(
                Completions,
                r#"{"model":"m","prompt":"x","n":2,"best_of":3}"#
            )
            .0,
            400
        );
        assert_eq!(
            err(
                Chat,
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#
            ),
            (422, "`top_logprobs` requires `logprobs: true`".into())
        );
        assert_eq!(
            err(
                Completions,
                r#"{"model":"m","prompt":"x","logit_bias":{"abc":1}}"#
            ),
            (
                422,
                "`logit_bias` keys must be token ids, got \"abc\"".into()
            )
        );
        assert_eq!(
            err(
                Completions,
                r#"{"model":"m","prompt":"x","logit_bias":{"5":-101}}"#
            ),
            (
                422,
                "`logit_bias` values must be numbers between -100 and 100, got -101 for token 5"
                    .into()
            )
        );
        assert_eq!(
            err(
                Completions,
                r#"{"model":"m","prompt":"x","min_tokens":20,"max_tokens":4}"#
            ),
            (
                422,
                "`min_tokens` (20) must not exceed `max_tokens` (4)".into()
            )
        );
        assert_eq!(
            err(
                Chat,
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"echo":true}"#
            ),
            (422, "`echo` applies to /v1/completions only".into())
        );
        assert_eq!(
            err(Chat, r#"{"model":"m","messages":[]}"#),
            (422, "`messages` must not be empty".into())
        );
        assert_eq!(
            err(
                Chat,
                r#"{"model":"m","messages":[{"role":"wizard","content":"x"}]}"#
            ),
            (422, "unknown role \"wizard\"".into())
        );
        let many: Vec<String> = (0..1000).map(|i| format!("\"s{i}\"")).collect();
        let body = format!(
            r#"{{"model":"m","prompt":"x","stop":[{}]}}"#,
            many.join(",")
        );
        assert_eq!(
            err(Completions, &body),
            (422, "at most 16 stop strings are allowed, got 1000".into())
        );
        assert_eq!(
            err(
                Completions,
                r#"{"model":"m","prompt":"x","stream_options":{"include_usage":true}}"#
            )
            .0,
            422
        );
        assert_eq!(
            err(Completions, r#"{"model":"m","prompt":["a","b"]}"#).0,
            400
        );
        assert_eq!(
            err(
                Completions,
                r#"{"model":"m","prompt":"x","presence_penalty":2.5}"#
            ),
            (
                422,
                "`presence_penalty` must be between -2 and 2, got 2.5".into()
            )
        );
        let e = parse(Completions, b"{\"model\":\"m\",\"prompt\":\"\xff\"}").unwrap_err();
        assert_eq!(e.status().as_u16(), 400);
        assert!(e
            .to_string()
            .starts_with("the request body is not valid UTF-8"));
    }

    mod hostile {
        use super::*;
        use proptest::prelude::*;
        use serde_json::Value;

        /// Every parameter name the endpoints read, a few unknown ones, and odd spellings.
        const KEYS: &[&str] = &[
            "model",
            "prompt",
            "messages",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "stop",
            "stream",
            "stream_options",
            "n",
            "best_of",
            "logprobs",
            "top_logprobs",
            "echo",
            "ignore_eos",
            "min_tokens",
            "stop_token_ids",
            "logit_bias",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "response_format",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "tools",
            "tool_choice",
            "functions",
            "suffix",
            "user",
            "role",
            "content",
            "type",
            "json_schema",
            "schema",
            "function",
            "name",
            "",
            "\u{0}",
            "MODEL",
        ];

        fn json() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::from),
                any::<i64>().prop_map(Value::from),
                prop_oneof![Just(f64::MAX), Just(-0.0), Just(1e-300), -1e6f64..1e6].prop_map(|f| {
                    serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)
                }),
                "\\PC{0,12}".prop_map(Value::from),
                prop::sample::select(KEYS).prop_map(Value::from),
            ];
            leaf.prop_recursive(4, 48, 6, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
                    prop::collection::vec((prop::sample::select(KEYS), inner), 0..8).prop_map(
                        |kv| Value::Object(
                            kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
                        )
                    ),
                ]
            })
        }

        /// A request body: mostly an object of known keys, sometimes any JSON.
        fn body() -> impl Strategy<Value = Value> {
            prop_oneof![
                4 => prop::collection::vec((prop::sample::select(KEYS), json()), 0..10).prop_map(
                    |kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
                ),
                1 => json(),
            ]
        }

        proptest! {
            // CI-sized; `PROPTEST_CASES=1000000` for the long run (reports/README.md).
            #![proptest_config(ProptestConfig {
                cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(512),
                failure_persistence: None,
                ..ProptestConfig::default()
            })]

            /// Any JSON body is a valid request or a 4xx that says what is wrong; never a
            /// panic, never a 5xx.
            #[test]
            fn any_json_body_is_accepted_or_a_clear_4xx(b in body(), chat in any::<bool>()) {
                let endpoint = if chat { Endpoint::Chat } else { Endpoint::Completions };
                let bytes = serde_json::to_vec(&b).unwrap_or_default();
                if let Err(e) = parse(endpoint, &bytes) {
                    prop_assert!(e.status().is_client_error(), "{e} for {b}");
                    prop_assert!(!e.to_string().is_empty());
                }
            }

            /// Any bytes at all: the same.
            #[test]
            fn any_bytes_are_accepted_or_a_clear_4xx(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
                if let Err(e) = parse(Endpoint::Completions, &bytes) {
                    prop_assert!(e.status().is_client_error(), "{e}");
                }
            }
        }
    }
}
