//! The streamed body of an OpenAI-compatible completion: bytes split into lines across
//! network chunks, `data:` payloads read as completion chunks, `[DONE]`.
//!
//! One `data:` line is one event, as every OpenAI-compatible server sends them (vLLM,
//! llama.cpp, TGI, SGLang); multi-line SSE events are not joined.

use serde::Deserialize;

/// Splits a byte stream into lines (`\n` or `\r\n`), holding a partial line until its end
/// arrives.
#[derive(Debug, Default)]
pub struct LineSplitter {
    partial: Vec<u8>,
}

impl LineSplitter {
    /// Appends `bytes`; returns the lines they complete, without their line ends.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut lines = Vec::new();
        let mut rest = bytes;
        while let Some(i) = rest.iter().position(|&b| b == b'\n') {
            self.partial.extend_from_slice(&rest[..i]);
            let mut line = std::mem::take(&mut self.partial);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            lines.push(line);
            rest = &rest[i + 1..];
        }
        self.partial.extend_from_slice(rest);
        lines
    }

    /// The last line when the stream ended without a line end.
    pub fn finish(self) -> Option<Vec<u8>> {
        (!self.partial.is_empty()).then_some(self.partial)
    }
}

/// What one line of the stream says.
#[derive(Debug, Clone, PartialEq)]
pub enum Line {
    /// An empty line, a comment (`: ping`) or another SSE field (`event:`, `id:`, `retry:`).
    Ignored,
    /// `data: [DONE]`: the server finished the response.
    Done,
    Chunk(Chunk),
}

/// What a completion chunk carries that the benchmark measures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Chunk {
    /// Generated text: `choices[0].text` (completions) or `choices[0].delta.content` /
    /// `reasoning_content` (chat). `None` for chunks without text (role announcements, the
    /// finish-reason chunk, the usage chunk).
    pub text: Option<String>,
    /// `choices[0].finish_reason` (`length`, `stop`, ...) on the chunk that ends the choice.
    pub finish_reason: Option<String>,
    pub usage: Option<Usage>,
}

impl Chunk {
    /// Whether the chunk carries generated text, i.e. counts as a token for TTFT and ITL.
    pub fn has_text(&self) -> bool {
        self.text.as_deref().is_some_and(|t| !t.is_empty())
    }
}

/// The `usage` object (`stream_options.include_usage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: Option<u64>,
    #[serde(default)]
    pub completion_tokens: Option<u64>,
}

/// Why a line could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    #[error("stream line is not UTF-8: {line:?}")]
    NotUtf8 { line: String },
    #[error("malformed data line ({reason}): {line}")]
    Malformed { reason: String, line: String },
    #[error("server error in stream: {message}")]
    Server { message: String },
}

/// Longest excerpt of a bad line kept in an error.
const EXCERPT_CHARS: usize = 200;

#[derive(Deserialize)]
struct WireChunk {
    #[serde(default)]
    choices: Option<Vec<WireChoice>>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct WireChoice {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    finish_reason: Option<String>,
    #[serde(default)]
    delta: Option<WireDelta>,
}

#[derive(Deserialize)]
struct WireDelta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
}

/// Reads one line of the stream (without its line end).
pub fn parse_line(line: &[u8]) -> Result<Line, LineError> {
    let line = std::str::from_utf8(line).map_err(|_| LineError::NotUtf8 {
        line: excerpt(&String::from_utf8_lossy(line)),
    })?;
    // SSE: "data:" with an optional single space; other fields and comments carry nothing.
    let Some(payload) = line.strip_prefix("data:") else {
        return Ok(Line::Ignored);
    };
    let payload = payload.strip_prefix(' ').unwrap_or(payload).trim_end();
    if payload == "[DONE]" {
        return Ok(Line::Done);
    }
    let wire: WireChunk = serde_json::from_str(payload).map_err(|e| LineError::Malformed {
        reason: e.to_string(),
        line: excerpt(line),
    })?;
    if let Some(error) = wire.error.filter(|e| !e.is_null()) {
        let message = match &error {
            serde_json::Value::String(s) => s.clone(),
            v => v
                .get("message")
                .and_then(|m| m.as_str())
                .map_or_else(|| v.to_string(), str::to_owned),
        };
        return Err(LineError::Server {
            message: excerpt(&message),
        });
    }
    let choice = wire.choices.as_deref().and_then(<[WireChoice]>::first);
    let text = choice.and_then(|c| {
        c.text.clone().or_else(|| {
            let d = c.delta.as_ref()?;
            match (&d.content, &d.reasoning_content) {
                (Some(c), _) if !c.is_empty() => Some(c.clone()),
                (_, Some(r)) if !r.is_empty() => Some(r.clone()),
                (c, _) => c.clone(),
            }
        })
    });
    Ok(Line::Chunk(Chunk {
        text,
        finish_reason: choice.and_then(|c| c.finish_reason.clone()),
        usage: wire.usage,
    }))
}

fn excerpt(s: &str) -> String {
    if s.chars().count() <= EXCERPT_CHARS {
        s.to_string()
    } else {
        let cut: String = s.chars().take(EXCERPT_CHARS).collect();
        format!("{cut}...")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(line: &str) -> Chunk {
        match parse_line(line.as_bytes()) {
            Ok(Line::Chunk(c)) => c,
            other => panic!("{line}: {other:?}"),
        }
    }

    #[test]
    fn lines_are_split_across_network_chunks() {
        let mut s = LineSplitter::default();
        assert!(s.push(b"data: {\"a\"").is_empty());
        assert_eq!(
            s.push(b":1}\r\n\r\ndata: [DO"),
            vec![b"data: {\"a\":1}".to_vec(), vec![]]
        );
        assert_eq!(s.push(b"NE]\n"), vec![b"data: [DONE]".to_vec()]);
        assert!(s.push(b"tail").is_empty());
        assert_eq!(s.finish(), Some(b"tail".to_vec()));
        assert_eq!(LineSplitter::default().finish(), None);
    }

    #[test]
    fn completion_chat_usage_and_done_lines() {
        assert_eq!(
            chunk(r#"data: {"choices":[{"index":0,"text":" hello","finish_reason":null}]}"#).text,
            Some(" hello".into())
        );
        // No space after the colon is valid SSE.
        assert!(chunk(r#"data:{"choices":[{"text":"x"}]}"#).has_text());
        let end = chunk(r#"data: {"choices":[{"text":"","finish_reason":"stop"}]}"#);
        assert!(!end.has_text());
        assert_eq!(end.finish_reason.as_deref(), Some("stop"));
        let role = chunk(r#"data: {"choices":[{"delta":{"role":"assistant","content":""}}]}"#);
        assert!(!role.has_text());
        assert_eq!(
            chunk(r#"data: {"choices":[{"delta":{"content":"Hi"}}]}"#).text,
            Some("Hi".into())
        );
        assert_eq!(
            chunk(r#"data: {"choices":[{"delta":{"content":null,"reasoning_content":"think"}}]}"#)
                .text,
            Some("think".into())
        );
        let u = chunk(
            r#"data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":12,"total_tokens":19}}"#,
        );
        assert!(!u.has_text());
        assert_eq!(
            u.usage,
            Some(Usage {
                prompt_tokens: Some(7),
                completion_tokens: Some(12)
            })
        );
        assert_eq!(
            chunk(r#"data: {"choices":null,"usage":null}"#),
            Chunk::default()
        );
        assert_eq!(parse_line(b"data: [DONE]"), Ok(Line::Done));
        assert_eq!(parse_line(b"data:[DONE]  "), Ok(Line::Done));
        for ignored in ["", ": ping", "event: message", "id: 3", "retry: 10"] {
            assert_eq!(
                parse_line(ignored.as_bytes()),
                Ok(Line::Ignored),
                "{ignored}"
            );
        }
    }

    #[test]
    fn bad_lines_are_errors_not_panics() {
        assert!(matches!(
            parse_line(b"data: {\"choices\": [ {"),
            Err(LineError::Malformed { .. })
        ));
        assert!(matches!(
            parse_line(b"data: not json"),
            Err(LineError::Malformed { .. })
        ));
        assert!(matches!(
            parse_line(b"data: {\"choices\": [{\"text\": 5}]}"),
            Err(LineError::Malformed { .. })
        ));
        assert!(matches!(
            parse_line(b"data: \xff\xfe"),
            Err(LineError::NotUtf8 { .. })
        ));
        assert_eq!(
            parse_line(br#"data: {"error":{"message":"out of memory","code":500}}"#),
            Err(LineError::Server {
                message: "out of memory".into()
            })
        );
        assert_eq!(
            parse_line(br#"data: {"error":"boom"}"#),
            Err(LineError::Server {
                message: "boom".into()
            })
        );
        let long = format!("data: {{{}", "x".repeat(1000));
        match parse_line(long.as_bytes()) {
            Err(LineError::Malformed { line, .. }) => assert!(line.len() < 300),
            other => panic!("{other:?}"),
        }
    }
}
