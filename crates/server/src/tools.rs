//! Tool calling (OpenAI's `tools` / `tool_choice`): the tool list is rendered by the model's
//! own chat template, and the model's tool-call format — Qwen's and Hermes'
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` — is parsed back into
//! `tool_calls`. `tool_choice` `required` or a named function constrains the output to that
//! format with the functions' parameter schemas (a Lark grammar with inline JSON schemas).

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
        let body: Option<Value> = serde_json::from_str(after[..end].trim()).ok();
        match body.as_ref().and_then(|b| Some((b["name"].as_str()?, b))) {
            Some((name, b)) => {
                content.push_str(&rest[..start]);
                let args = match &b["arguments"] {
                    Value::Null => "{}".to_string(),
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                calls.push(json!({
                    "id": format!("call_{id_base}_{}", calls.len()),
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
                        "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}})]
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
}
