//! Chat prompts: the model's own Jinja chat template, rendered the way Hugging Face renders it.
//!
//! The template comes from a model file, so rendering is bounded: by fuel (minijinja's count of
//! executed instructions), by the size of the output, and by the nesting depth. The template is
//! compiled once, when the tokenizer loads; a syntax error is reported then.

use std::io::Write;

use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TokenizerError};

/// Instructions a render may run: this much for the template's own work, plus
/// [`CHAT_TEMPLATE_FUEL_PER_MESSAGE`] for each message (a template walks the messages once).
/// minijinja runs about 40 million instructions a second on one core here, so a runaway loop
/// stops within milliseconds, and the ~36,000 empty messages a 1 MiB body can hold get about
/// one second.
pub const CHAT_TEMPLATE_FUEL: u64 = 100_000;
pub const CHAT_TEMPLATE_FUEL_PER_MESSAGE: u64 = 1_000;
/// Longest rendered prompt in bytes: four times the server's default request-body limit (1 MiB).
/// A template adds markup around the messages, not megabytes.
pub const MAX_CHAT_PROMPT_BYTES: usize = 4 << 20;
/// Deepest nesting of template frames (a macro call takes about five). minijinja's default,
/// 500, lets a recursive macro run 100 calls deep; real chat templates nest a few levels.
pub const CHAT_TEMPLATE_RECURSION: usize = 100;

/// Most items a printed sequence or map may have (`{{ ['x'] * 10**12 }}` would print for
/// ever: printing one value is one instruction, so fuel does not bound it).
pub const MAX_PRINTED_ITEMS: usize = 100_000;

/// The name the compiled template has in its environment.
const NAME: &str = "chat";

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's tool calls, as templates read them: a list of
    /// `{"type": "function", "function": {"name", "arguments": {...}}}` with the arguments as
    /// an object (OpenAI sends them as a JSON string; Hugging Face templates expect a mapping).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` turn's call id and function name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// A compiled chat template with Hugging Face's settings: `trim_blocks` and `lstrip_blocks`
/// on, Python string methods (via minijinja-contrib's pycompat) and `raise_exception`
/// available.
#[derive(Clone)]
pub(crate) struct ChatTemplate {
    source: String,
    env: Environment<'static>,
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is an error here.
    pub(crate) fn new(source: String) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_recursion_limit(CHAT_TEMPLATE_RECURSION);
        env.set_formatter(|out, state, value| {
            if value.as_str().is_none() && value.len().is_some_and(|n| n > MAX_PRINTED_ITEMS) {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("a value of more than {MAX_PRINTED_ITEMS} items cannot be printed"),
                ));
            }
            minijinja::escape_formatter(out, state, value)
        });
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(NAME, source.clone())
            .map_err(describe)?;
        Ok(Self { source, env })
    }

    pub(crate) fn source(&self) -> &str {
        &self.source
    }

    /// Renders the conversation within the fuel, output and nesting limits.
    pub(crate) fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String> {
        let fuel = CHAT_TEMPLATE_FUEL
            .saturating_add(CHAT_TEMPLATE_FUEL_PER_MESSAGE.saturating_mul(messages.len() as u64));
        let mut env = self.env.clone();
        env.set_fuel(Some(fuel));
        let template = env.get_template(NAME).map_err(describe)?;
        let mut out = Capped::default();
        let rendered = template.render_captured_to(
            context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => add_generation_prompt,
                bos_token => bos_token,
                eos_token => eos_token,
            },
            &mut out,
        );
        match rendered {
            Ok(_) => String::from_utf8(out.bytes).map_err(|e| TokenizerError::ChatTemplate {
                detail: format!("its output is not UTF-8: {e}"),
            }),
            Err(_) if out.overflowed => Err(TokenizerError::ChatTemplate {
                detail: format!("its output passed {MAX_CHAT_PROMPT_BYTES} bytes"),
            }),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(TokenizerError::ChatTemplate {
                detail: format!(
                    "it ran past {fuel} instructions ({CHAT_TEMPLATE_FUEL} plus {CHAT_TEMPLATE_FUEL_PER_MESSAGE} per message, {} message{})",
                    messages.len(),
                    if messages.len() == 1 { "" } else { "s" }
                ),
            }),
            Err(e) => Err(describe(e)),
        }
    }
}

/// The rendered bytes, refusing to grow past [`MAX_CHAT_PROMPT_BYTES`] (the refusal ends the
/// render).
#[derive(Default)]
struct Capped {
    bytes: Vec<u8>,
    overflowed: bool,
}

impl Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > MAX_CHAT_PROMPT_BYTES {
            self.overflowed = true;
            return Err(std::io::Error::other("the chat prompt is too long"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A minijinja error with its chain of causes.
fn describe(e: Error) -> TokenizerError {
    let mut detail = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        detail.push_str(&format!(": {s}"));
        source = s.source();
    }
    TokenizerError::ChatTemplate { detail }
}

/// Compiles and renders `template` once (tests).
#[cfg(test)]
fn render(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    ChatTemplate::new(template.to_string())?.render(
        messages,
        None,
        add_generation_prompt,
        bos_token,
        eos_token,
    )
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn renders_with_hf_whitespace_rules_and_python_methods() {
        let t = "{% for m in messages %}\n  {{ m.role.upper() }}: {{ m['content'].strip() }}\n{% endfor %}\
                 {% if add_generation_prompt %}{{ bos_token }}>{% endif %}";
        let out = render(
            t,
            &[ChatMessage::new("user", "  hi  ")],
            true,
            "<s>",
            "</s>",
        )
        .expect("renders");
        assert_eq!(out, "  USER: hi\n<s>>");
    }

    /// Why rendering `template` fails, on a thread, so that a test of a template that never
    /// ends fails instead of hanging.
    fn render_error(template: &str, limit: Duration) -> TokenizerError {
        let (tx, rx) = std::sync::mpsc::channel();
        let template = template.to_string();
        std::thread::spawn(move || {
            let _ = tx.send(render(
                &template,
                &[ChatMessage::new("user", "hi")],
                true,
                "",
                "",
            ));
        });
        match rx.recv_timeout(limit) {
            Ok(Ok(text)) => panic!("rendered {} bytes", text.len()),
            Ok(Err(e)) => e,
            Err(_) => panic!("rendering did not end within {limit:?}"),
        }
    }

    /// 10^10 loop iterations: the fuel ends them at once.
    #[test]
    fn a_template_that_loops_for_ever_runs_out_of_fuel() {
        let t = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}";
        let t0 = Instant::now();
        let err = render_error(t, Duration::from_secs(10));
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        assert_eq!(
            err.to_string(),
            "chat template failed: it ran past 101000 instructions (100000 plus 1000 per message, 1 message)"
        );
    }

    /// 200 MB of output stops at the cap.
    #[test]
    fn output_past_the_cap_is_refused() {
        let t = "{% for i in range(200) %}{{ 'x' * 1000000 }}{% endfor %}";
        let err = render_error(t, Duration::from_secs(10));
        assert_eq!(
            err.to_string(),
            "chat template failed: its output passed 4194304 bytes"
        );
    }

    /// A macro calling itself 30 deep (about 150 levels) passes the limit.
    #[test]
    fn deep_recursion_is_refused() {
        let t = "{% macro f(n) %}{% if n < 30 %}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}";
        let err = render_error(t, Duration::from_secs(10));
        assert!(
            err.to_string().contains("recursion limit exceeded"),
            "{err}"
        );
    }

    #[test]
    fn raise_exception_surfaces_its_message() {
        let t = "{{ raise_exception('roles must alternate') }}";
        let err = render(t, &[], false, "", "").expect_err("template raises");
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }

    /// One repetition asking for a terabyte is refused before it allocates.
    #[test]
    fn a_huge_string_repetition_is_refused() {
        for t in [
            "{{ 'x' * 1000000000000 }}",
            "{{ 'ab' * 9223372036854775807 }}",
            "{{ ['x'] * 1000000000000 }}",
            "{{ range(1000000000) }}",
        ] {
            let err = render_error(t, Duration::from_secs(10));
            assert!(
                err.to_string().starts_with("chat template failed"),
                "{t}: {err}"
            );
        }
    }

    mod hostile {
        use super::*;
        use proptest::prelude::*;

        /// Pieces of Jinja that cost: loops up to 10^9, repetitions, recursion, nesting,
        /// filters over the messages, and plain or broken syntax.
        fn fragment() -> impl Strategy<Value = String> {
            let n = prop_oneof![Just(0u64), 1u64..100, Just(100_000), Just(1_000_000_000)];
            prop_oneof![
                n.clone().prop_map(|n| format!("{{% for i in range({n}) %}}x{{% endfor %}}")),
                n.clone().prop_map(|n| format!("{{{{ 'ab' * {n} }}}}")),
                n.clone().prop_map(|n| format!("{{{{ ({n} ~ 'q') | length }}}}")),
                n.prop_map(|n| format!(
                    "{{% macro f(k) %}}{{% if k < {n} %}}{{{{ f(k + 1) }}}}{{% endif %}}{{% endmacro %}}{{{{ f(0) }}}}"
                )),
                Just("{% for m in messages %}{{ m.role }}: {{ m.content | upper }}{% endfor %}".to_string()),
                Just("{{ messages[0]['content'] * 3 }}".to_string()),
                // Not here: a string doubled by `~` in a loop (`{% set s.x = s.x ~ s.x %}` in
                // a namespace) grows past any memory within its fuel, and minijinja has no
                // bound on concatenation (its repetition, `*`, stops at 100 MB).
                Just("{{ raise_exception('no') }}".to_string()),
                Just("{% if %}".to_string()),
                Just("{{".to_string()),
                Just("{% endfor %}".to_string()),
                "[ -~]{0,12}".prop_map(|s| s.to_string()),
            ]
        }

        fn template() -> impl Strategy<Value = String> {
            prop::collection::vec(fragment(), 1..5).prop_map(|parts| parts.concat())
        }

        proptest! {
            // CI-sized; `PROPTEST_CASES=1000000` for the long run (reports/README.md).
            #![proptest_config(ProptestConfig {
                cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(256),
                failure_persistence: None,
                ..ProptestConfig::default()
            })]

            /// Any template compiles or is refused; one that compiles renders or fails within
            /// its bounds: output at most MAX_CHAT_PROMPT_BYTES, never a panic or a hang.
            #[test]
            fn any_template_renders_within_its_bounds(t in template(), content in "\\PC{0,40}") {
                let started = Instant::now();
                let messages = [ChatMessage::new("user", content)];
                match ChatTemplate::new(t.clone()) {
                    Err(e) => prop_assert!(e.to_string().starts_with("chat template"), "{e}"),
                    Ok(c) => match c.render(&messages, None, true, "<s>", "</s>") {
                        Ok(out) => prop_assert!(out.len() <= MAX_CHAT_PROMPT_BYTES),
                        Err(e) => prop_assert!(e.to_string().starts_with("chat template"), "{e}"),
                    },
                }
                prop_assert!(started.elapsed() < Duration::from_secs(5), "{t}: {:?}", started.elapsed());
            }
        }
    }
}
