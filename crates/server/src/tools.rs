//! Tool calling (OpenAI's `tools` / `tool_choice`): the tool list is rendered by the model's
//! own chat template, and the model's tool-call format — Qwen's and Hermes'
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` — is parsed back into
//! `tool_calls`. `tool_choice` `required` or a named function constrains the output to that
//! format with the functions' parameter schemas (a Lark grammar with inline JSON schemas).
//!
//! Streamed, [`CallStreamer`] turns the text as it arrives into OpenAI's deltas: content as
//! it comes, each call's name once its `"name"` is complete, then its arguments piece by
//! piece, as vLLM's Hermes parser streams them. A call's arguments are its raw JSON text, so
//! the streamed pieces join to exactly the string the non-streamed answer carries.

use serde_json::{json, Map, Value};
use switchyard_request::Guide;
use switchyard_tokenizer::Tokenizer;

use crate::error::ApiError;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// A request's tools and how it lets the model use them.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// `[{"type": "function", "function": {"name", "description"?, "parameters"?}}]`.
    pub list: Value,
    pub choice: ToolChoice,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// The model answers in text; tools are not shown to it.
    None,
    /// The model decides; a call in its output is parsed.
    Auto,
    /// The output is one call to one of the tools.
    Required,
    /// The output is one call to this function.
    Named(String),
}

impl Tools {
    /// The tools the template renders (none under `tool_choice: "none"`).
    pub fn rendered(&self) -> Option<&Value> {
        (self.choice != ToolChoice::None).then_some(&self.list)
    }

    /// Whether the output is parsed for calls.
    pub fn parses_calls(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The output constraint for `required` and a named function; `None` otherwise.
    pub fn guide(&self, tokenizer: &Tokenizer) -> Option<Guide> {
        let functions: Vec<&Value> = self
            .list
            .as_array()?
            .iter()
            .map(|t| &t["function"])
            .filter(|f| match &self.choice {
                ToolChoice::Required => true,
                ToolChoice::Named(n) => f["name"].as_str() == Some(n.as_str()),
                _ => false,
            })
            .collect();
        if functions.is_empty() {
            return None;
        }
        let calls: Vec<Value> = functions
            .iter()
            .map(|f| {
                let params = match &f["parameters"] {
                    Value::Object(p) if !p.is_empty() => Value::Object(p.clone()),
                    _ => json!({"type": "object"}),
                };
                json!({
                    "type": "object",
                    "properties": {"name": {"const": f["name"]}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = json!({
            "x-guidance": switchyard_grammar::json_layout(),
            "anyOf": calls,
        });
        // The call markers as special tokens where the vocabulary has them (Qwen's), as text
        // otherwise.
        let marker = |m: &str| match tokenizer.special_token_id(m) {
            Some(_) => m.to_string(),
            None => serde_json::to_string(m).unwrap_or_default(),
        };
        Some(Guide::Lark(format!(
            "start: {} \"\\n\" call \"\\n\" {}\ncall: %json {}\n",
            marker(OPEN),
            marker(CLOSE),
            schema
        )))
    }
}

/// `tools` and `tool_choice` of a chat request (`None` without tools).
pub fn parse(obj: &Map<String, Value>) -> Result<Option<Tools>, ApiError> {
    let list = match obj.get("tools") {
        None | Some(Value::Null) => {
            return match obj.get("tool_choice") {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) if s == "none" || s == "auto" => Ok(None),
                Some(_) => Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice` needs `tools`",
                )),
            }
        }
        Some(Value::Array(a)) if a.is_empty() => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(ApiError::invalid(
                "tools",
                "`tools` must be an array of function tools",
            ))
        }
    };
    let mut names = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let at = format!("tools[{i}]");
        if t["type"].as_str() != Some("function") {
            return Err(ApiError::invalid(
                &at,
                format!("`{at}.type` must be \"function\""),
            ));
        }
        let name = t["function"]["name"]
            .as_str()
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                ApiError::invalid(
                    &format!("{at}.function.name"),
                    format!("`{at}.function.name` must be a non-empty string"),
                )
            })?;
        match &t["function"]["parameters"] {
            Value::Null | Value::Object(_) => {}
            _ => {
                return Err(ApiError::invalid(
                    &format!("{at}.function.parameters"),
                    "function parameters must be a JSON schema object",
                ))
            }
        }
        names.push(name.to_string());
    }
    let choice = match obj.get("tool_choice") {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "unknown `tool_choice` {other:?}: use none, auto, required or a function"
                    ),
                ))
            }
        },
        Some(v) => {
            let name = v["function"]["name"].as_str().ok_or_else(|| {
                ApiError::invalid(
                    "tool_choice",
                    "`tool_choice` must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                )
            })?;
            if !names.iter().any(|n| n == name) {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` names {name:?}, which is not among `tools`"),
                ));
            }
            ToolChoice::Named(name.to_string())
        }
    };
    Ok(Some(Tools {
        list: Value::Array(list.clone()),
        choice,
    }))
}

/// An assistant turn's `tool_calls` as templates read them: arguments given as a JSON string
/// become the object they encode.
pub fn history_calls(calls: &Value, at: &str) -> Result<Value, ApiError> {
    let list = calls
        .as_array()
        .ok_or_else(|| ApiError::invalid(at, format!("`{at}` must be an array of tool calls")))?;
    let calls = list
        .iter()
        .map(|c| {
            let mut c = c.clone();
            if let Some(args) = c["function"]["arguments"].as_str() {
                let parsed: Value = serde_json::from_str(args).map_err(|e| {
                    ApiError::invalid(at, format!("tool call arguments are not JSON: {e}"))
                })?;
                c["function"]["arguments"] = parsed;
            }
            Ok(c)
        })
        .collect::<Result<Vec<Value>, ApiError>>()?;
    Ok(Value::Array(calls))
}

/// An output split into its text and its tool calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    /// Text outside the calls, trimmed; `None` when there is none.
    pub content: Option<String>,
    /// OpenAI's `tool_calls`: `{"id", "type": "function", "function": {"name", "arguments"}}`
    /// with the arguments as a JSON string.
    pub calls: Vec<Value>,
}

/// A call block's body as the model wrote it: the arguments kept as their raw JSON text.
#[derive(serde::Deserialize)]
struct RawCall<'a> {
    name: String,
    #[serde(borrow, default)]
    arguments: Option<&'a serde_json::value::RawValue>,
}

/// The (name, arguments) of a call block's body, if it is a JSON object with a `name`. The
/// arguments are their JSON text as written (a string's value when given as a string, `{}`
/// when absent), so the streamed pieces join to the same text.
fn parse_call(body: &str) -> Option<(String, String)> {
    let call: RawCall = serde_json::from_str(body.trim()).ok()?;
    let args = match call.arguments.map(|r| r.get()) {
        None | Some("null") => "{}".to_string(),
        Some(raw) if raw.starts_with('"') => serde_json::from_str::<String>(raw).ok()?,
        Some(raw) => raw.to_string(),
    };
    Some((call.name, args))
}

fn call_id(id_base: &str, index: usize) -> String {
    format!("call_{id_base}_{index}")
}

/// Splits `text` at every well-formed `<tool_call>` block whose body is a JSON object with a
/// `name`; anything else stays text. `id_base` makes the call ids unique.
pub fn parse_output(text: &str, id_base: &str) -> Parsed {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        let after = &rest[start + OPEN.len()..];
        let Some(end) = after.find(CLOSE) else {
            break;
        };
        match parse_call(&after[..end]) {
            Some((name, args)) => {
                content.push_str(&rest[..start]);
                calls.push(json!({
                    "id": call_id(id_base, calls.len()),
                    "type": "function",
                    "function": {"name": name, "arguments": args},
                }));
            }
            None => content.push_str(&rest[..start + OPEN.len() + end + CLOSE.len()]),
        }
        rest = &after[end + CLOSE.len()..];
    }
    content.push_str(rest);
    let content = content.trim();
    Parsed {
        content: (!content.is_empty()).then(|| content.to_string()),
        calls,
    }
}

/// One piece of a streamed answer with tools in play.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamDelta {
    Content(String),
    /// A call begins: its index among the answer's calls, its id and the function's name.
    CallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// More of call `index`'s arguments text.
    Arguments {
        index: usize,
        text: String,
    },
}

#[derive(Debug, Clone, PartialEq)]
enum Mode {
    /// Outside a call.
    Text,
    /// After `<tool_call>`, before the arguments begin.
    Head,
    /// Inside call `index`'s arguments, `sent` bytes of them out.
    Args { index: usize, sent: usize },
    /// A block whose head is not `{"name": "...", "arguments": `: held whole until it closes,
    /// then parsed as the non-streamed answer parses it.
    Block,
}

/// How a block's head reads so far.
enum Head {
    /// It may still become `{"name": "...", "arguments": `.
    Incomplete,
    /// It cannot.
    Other,
    /// It is one: the name, and the bytes the head takes.
    Call(String, usize),
}

/// Matches `{"name": "<name>", "arguments": ` (any whitespace between tokens) at the start of
/// `b`, a prefix of it, or neither.
fn match_head(b: &str) -> Head {
    let bytes = b.as_bytes();
    let mut at = 0;
    let skip_ws = |at: &mut usize| {
        while *at < bytes.len() && bytes[*at].is_ascii_whitespace() {
            *at += 1;
        }
    };
    // Expects `lit` at `at`: Some(true) matched, Some(false) the input ends inside it, None not.
    let expect = |at: &mut usize, lit: &str| -> Option<bool> {
        let rest = &bytes[*at..];
        let n = rest.len().min(lit.len());
        if rest[..n] != lit.as_bytes()[..n] {
            return None;
        }
        *at += n;
        Some(n == lit.len())
    };
    let mut name = None;
    for step in ["{", "\"name\"", ":", "STRING", ",", "\"arguments\"", ":"] {
        skip_ws(&mut at);
        if at == bytes.len() {
            return Head::Incomplete;
        }
        if step == "STRING" {
            if bytes[at] != b'"' {
                return Head::Other;
            }
            // The closing quote is the first one not escaped.
            let mut end = at + 1;
            let mut escaped = false;
            while end < bytes.len() && (escaped || bytes[end] != b'"') {
                escaped = !escaped && bytes[end] == b'\\';
                end += 1;
            }
            if end == bytes.len() {
                return Head::Incomplete;
            }
            match serde_json::from_str::<String>(&b[at..=end]) {
                Ok(n) => name = Some(n),
                Err(_) => return Head::Other,
            }
            at = end + 1;
            continue;
        }
        match expect(&mut at, step) {
            None => return Head::Other,
            Some(false) => return Head::Incomplete,
            Some(true) => {}
        }
    }
    skip_ws(&mut at);
    if at == bytes.len() {
        return Head::Incomplete;
    }
    match name {
        Some(n) => Head::Call(n, at),
        None => Head::Other,
    }
}

/// The length of the longest suffix of `text` that is a proper prefix of `tag` (a tag that
/// may be arriving), on a character boundary.
fn partial_tag(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && text.ends_with(&tag[..n]))
        .unwrap_or(0)
}

/// Turns one choice's text, as it arrives, into [`StreamDelta`]s. Content is trimmed as the
/// non-streamed answer's is (leading and trailing whitespace held back), so the content
/// pieces join to its `content`, and the calls to its `tool_calls`. A block that is not a call
/// comes out as text once it closes; an unclosed one at the end, too. A call cut off by the
/// end (max tokens) keeps what was sent of it: streamed pieces cannot be taken back.
#[derive(Debug)]
pub struct CallStreamer {
    id_base: String,
    mode: Mode,
    /// Text not yet consumed: after the last tag in `Text`, the block's body otherwise.
    buf: String,
    /// Whitespace held back until more content follows it.
    held_ws: String,
    content_started: bool,
    calls: usize,
}

impl CallStreamer {
    pub fn new(id_base: &str) -> Self {
        Self {
            id_base: id_base.to_string(),
            mode: Mode::Text,
            buf: String::new(),
            held_ws: String::new(),
            content_started: false,
            calls: 0,
        }
    }

    /// Calls begun so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    fn content(&mut self, text: &str, out: &mut Vec<StreamDelta>) {
        let body = text.trim_end();
        let trailing = &text[body.len()..];
        let body = if self.content_started {
            body
        } else {
            body.trim_start()
        };
        if body.is_empty() {
            if self.content_started {
                self.held_ws.push_str(trailing);
            }
            return;
        }
        let mut piece = std::mem::take(&mut self.held_ws);
        piece.push_str(body);
        out.push(StreamDelta::Content(piece));
        self.held_ws = trailing.to_string();
        self.content_started = true;
    }

    fn start_call(&mut self, name: String, out: &mut Vec<StreamDelta>) -> usize {
        let index = self.calls;
        self.calls += 1;
        out.push(StreamDelta::CallStart {
            index,
            id: call_id(&self.id_base, index),
            name,
        });
        index
    }

    /// Feeds the next piece of text; returns what can be sent now.
    pub fn feed(&mut self, text: &str) -> Vec<StreamDelta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.mode.clone() {
                Mode::Text => match self.buf.find(OPEN) {
                    Some(p) => {
                        let before = self.buf[..p].to_string();
                        self.content(&before, &mut out);
                        self.buf.drain(..p + OPEN.len());
                        self.mode = Mode::Head;
                    }
                    None => {
                        let keep = partial_tag(&self.buf, OPEN);
                        let ready: String = self.buf.drain(..self.buf.len() - keep).collect();
                        self.content(&ready, &mut out);
                        return out;
                    }
                },
                Mode::Head => {
                    let head = match self.buf.find(CLOSE) {
                        // A closed block is parsed whole.
                        Some(_) => Head::Other,
                        None => match_head(&self.buf),
                    };
                    match head {
                        Head::Incomplete => return out,
                        Head::Other => self.mode = Mode::Block,
                        // Arguments given as a JSON string are sent decoded, so whole.
                        Head::Call(_, len) if self.buf[len..].starts_with('"') => {
                            self.mode = Mode::Block
                        }
                        Head::Call(name, len) => {
                            let index = self.start_call(name, &mut out);
                            self.buf.drain(..len);
                            self.mode = Mode::Args { index, sent: 0 };
                        }
                    }
                }
                Mode::Args { index, sent } => match self.buf.find(CLOSE) {
                    Some(c) => {
                        let body = self.buf[..c].trim_end();
                        let args = body.strip_suffix('}').map_or(body, str::trim_end);
                        if args.len() > sent && args.is_char_boundary(sent) {
                            out.push(StreamDelta::Arguments {
                                index,
                                text: args[sent..].to_string(),
                            });
                        }
                        self.buf.drain(..c + CLOSE.len());
                        self.mode = Mode::Text;
                    }
                    None => {
                        // Everything before the last `}` (which may close the call's object)
                        // and any tag that may be arriving is the arguments' for sure.
                        let end = self.buf.len() - partial_tag(&self.buf, CLOSE);
                        let end = self.buf[..end].rfind('}').unwrap_or(end);
                        let ready = self.buf[..end].trim_end().len();
                        if ready > sent {
                            out.push(StreamDelta::Arguments {
                                index,
                                text: self.buf[sent..ready].to_string(),
                            });
                            self.mode = Mode::Args { index, sent: ready };
                        }
                        return out;
                    }
                },
                Mode::Block => match self.buf.find(CLOSE) {
                    Some(c) => {
                        let block: String = self.buf.drain(..c + CLOSE.len()).collect();
                        match parse_call(&block[..c]) {
                            Some((name, args)) => {
                                let index = self.start_call(name, &mut out);
                                out.push(StreamDelta::Arguments { index, text: args });
                            }
                            None => self.content(&format!("{OPEN}{block}"), &mut out),
                        }
                        self.mode = Mode::Text;
                    }
                    None => return out,
                },
            }
        }
    }

    /// The end of the choice: what was held back goes out.
    pub fn finish(&mut self) -> Vec<StreamDelta> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        match self.mode.clone() {
            Mode::Text => self.content(&rest, &mut out),
            Mode::Head | Mode::Block => self.content(&format!("{OPEN}{rest}"), &mut out),
            Mode::Args { index, sent } => {
                let args = rest.trim_end();
                if args.len() > sent && args.is_char_boundary(sent) {
                    out.push(StreamDelta::Arguments {
                        index,
                        text: args[sent..].to_string(),
                    });
                }
            }
        }
        self.mode = Mode::Text;
        self.held_ws.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_parsed_out_of_the_text() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let p = parse_output(text, "x");
        assert_eq!(p.content.as_deref(), Some("Let me check."));
        assert_eq!(
            p.calls,
            vec![json!({"id": "call_x_0", "type": "function",
                        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}})]
        );
        // A block that is not a call stays text; so does an unclosed one.
        let p = parse_output("<tool_call>oops</tool_call> and <tool_call>{", "x");
        assert!(p.calls.is_empty());
        assert_eq!(
            p.content.as_deref(),
            Some("<tool_call>oops</tool_call> and <tool_call>{")
        );
        assert_eq!(parse_output("  ", "x").content, None);
    }

    #[test]
    fn tool_choice_is_checked() {
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
        let obj = |choice: Value| {
            json!({"tools": tools, "tool_choice": choice})
                .as_object()
                .cloned()
                .unwrap_or_default()
        };
        assert_eq!(
            parse(&obj(json!("required"))).unwrap().unwrap().choice,
            ToolChoice::Required
        );
        assert_eq!(
            parse(&obj(json!({"type": "function", "function": {"name": "f"}})))
                .unwrap()
                .unwrap()
                .choice,
            ToolChoice::Named("f".into())
        );
        let e = parse(&obj(json!({"type": "function", "function": {"name": "g"}}))).unwrap_err();
        assert_eq!(
            e.to_string(),
            "`tool_choice` names \"g\", which is not among `tools`"
        );
        let e = parse(&obj(json!("always"))).unwrap_err();
        assert!(e.to_string().starts_with("unknown `tool_choice`"));
    }

    /// Feeds `text` in pieces of `step` bytes (on character boundaries) and joins the deltas
    /// back into (content, calls as (id, name, arguments)), with the number of argument pieces.
    fn stream(text: &str, step: usize) -> (Option<String>, Vec<(String, String, String)>, usize) {
        let mut s = CallStreamer::new("x");
        let mut deltas = Vec::new();
        let mut at = 0;
        while at < text.len() {
            let mut end = (at + step).min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            deltas.extend(s.feed(&text[at..end]));
            at = end;
        }
        deltas.extend(s.finish());
        let mut content = String::new();
        let mut calls: Vec<(String, String, String)> = Vec::new();
        let mut pieces = 0;
        for d in deltas {
            match d {
                StreamDelta::Content(c) => content.push_str(&c),
                StreamDelta::CallStart { index, id, name } => {
                    assert_eq!(index, calls.len());
                    calls.push((id, name, String::new()));
                }
                StreamDelta::Arguments { index, text } => {
                    assert!(!text.is_empty());
                    calls[index].2.push_str(&text);
                    pieces += 1;
                }
            }
        }
        ((!content.is_empty()).then_some(content), calls, pieces)
    }

    fn expected(text: &str) -> (Option<String>, Vec<(String, String, String)>) {
        let p = parse_output(text, "x");
        let calls = p
            .calls
            .iter()
            .map(|c| {
                let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
                (
                    s(&c["id"]),
                    s(&c["function"]["name"]),
                    s(&c["function"]["arguments"]),
                )
            })
            .collect();
        (p.content, calls)
    }

    #[test]
    fn streamed_calls_join_to_the_parsed_answer() {
        let texts = [
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>",
            "Let me check.\n\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"q\": {\"x\": [1, {\"y\": \"}\"}]} }}\n</tool_call>\nand\n<tool_call>{\"name\":\"b\",\"arguments\":{}}</tool_call>  ",
            "  no calls here, but a < sign and <tool_ and a tag at the end <tool_c",
            "<tool_call>oops</tool_call> then <tool_call>{\"arguments\": {}, \"name\": \"late\"}</tool_call> end",
            "text <tool_call>{\"name\": \"never closed\"",
            "<tool_call>{\"name\": \"s\", \"arguments\": \"{\\\"as\\\": \\\"string\\\"}\"}</tool_call>",
            "é<tool_call>{\"name\": \"ü\\\"q\", \"arguments\": {\"k\": \"☃\"}}</tool_call>ö ",
        ];
        for text in texts {
            let want = expected(text);
            for step in [1, 2, 3, 5, 8, 1000] {
                let (content, calls, _) = stream(text, step);
                assert_eq!((content, calls), want, "{text:?} in pieces of {step}");
            }
        }
        // Token by token, the arguments go out in pieces as they arrive.
        let (_, calls, pieces) = stream(texts[0], 2);
        assert_eq!(calls[0].1, "get_weather");
        assert_eq!(calls[0].2, "{\"city\": \"Paris\", \"unit\": \"celsius\"}");
        assert!(pieces >= 10, "{pieces} pieces");
    }

    #[test]
    fn heads_are_matched_piece_by_piece() {
        assert!(matches!(match_head(""), Head::Incomplete));
        assert!(matches!(match_head(" {\"na"), Head::Incomplete));
        assert!(matches!(
            match_head("{\"name\": \"f\\\"g"),
            Head::Incomplete
        ));
        assert!(matches!(
            match_head("{\"name\": \"f\", \"arguments\":"),
            Head::Incomplete
        ));
        assert!(matches!(match_head("{\"arguments\": {}"), Head::Other));
        assert!(matches!(match_head("[1]"), Head::Other));
        match match_head("{ \"name\" : \"f\\\"g\" , \"arguments\" : {\"a\"") {
            Head::Call(name, len) => {
                assert_eq!(name, "f\"g");
                assert_eq!(len, 34);
            }
            _ => panic!("a call's head"),
        }
        assert_eq!(partial_tag("abc <tool", OPEN), 5);
        assert_eq!(partial_tag("abc", OPEN), 0);
        assert_eq!(partial_tag("}</", CLOSE), 2);
    }
}
