//! Chat prompts: the model's own Jinja chat template, rendered the way Hugging Face renders it.

use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TokenizerError};

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Renders `template` with Hugging Face's settings: `trim_blocks` and `lstrip_blocks` on,
/// Python string methods (via minijinja-contrib's pycompat) and `raise_exception` available.
pub(crate) fn render(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |message: String| -> std::result::Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        },
    );
    let describe = |e: Error| {
        let mut detail = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            detail.push_str(&format!(": {s}"));
            source = s.source();
        }
        TokenizerError::ChatTemplate { detail }
    };
    let tmpl = env.template_from_str(template).map_err(describe)?;
    tmpl.render(context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token,
        eos_token => eos_token,
    })
    .map_err(describe)
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn raise_exception_surfaces_its_message() {
        let t = "{{ raise_exception('roles must alternate') }}";
        let err = render(t, &[], false, "", "").expect_err("template raises");
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }
}
