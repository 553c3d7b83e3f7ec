//! Tokenizers that give the same ids as llama.cpp's, built from GGUF metadata or from a Hugging
//! Face `tokenizer.json`.
//!
//! Encoding follows llama.cpp's `llama_vocab::tokenize`: special tokens are cut out of the text
//! first ([`vocab::Vocab::partition`]), then each text fragment goes through the model's
//! tokenizer: byte-level BPE (GPT-2 style, pre-tokenized with llama.cpp's regexes for the
//! model's `tokenizer.ggml.pre`) through the `tokenizers` crate, or SentencePiece merging
//! ([`spm`]) reimplemented to match llama.cpp's merge order. Decoding follows
//! `llama_vocab::detokenize`. Chat prompts come from the model's own Jinja template.
//!
//! API boundary: token ids and text in, token ids and text out; nothing here knows about
//! tensors or devices.

mod chat;
mod decode;
mod error;
mod gguf;
mod hf;
mod pretok;
mod specials;
mod spm;
mod vocab;

use std::path::Path;

use switchyard_weights::{Metadata, TokenizerOrigin, WeightSource};

pub use chat::{
    ChatMessage, CHAT_TEMPLATE_FUEL, CHAT_TEMPLATE_FUEL_PER_MESSAGE, CHAT_TEMPLATE_RECURSION,
    MAX_CHAT_PROMPT_BYTES,
};
pub use decode::StreamDecoder;
pub use error::{Result, TokenizerError};

use chat::ChatTemplate;
use decode::PieceStyle;
use specials::Specials;
use spm::{SpmModel, SPACE_MARK};
use vocab::{Fragment, Vocab};

/// What turns a text fragment (special tokens already split out) into ids.
#[derive(Clone)]
enum Engine {
    /// Byte-level BPE in `tokenizers`, with no added tokens of its own.
    ByteLevelBpe(Box<tokenizers::Tokenizer>),
    /// llama.cpp's SentencePiece merging.
    Spm(SpmModel),
}

/// A model's tokenizer. It is `Send + Sync`: share one behind `&` or `Arc` (cloning copies the
/// whole vocabulary).
#[derive(Clone)]
pub struct Tokenizer {
    vocab: Vocab,
    engine: Engine,
    specials: Specials,
    /// SentencePiece: a space goes in front of text that starts the input or follows a special
    /// token, and comes off the first token when decoding.
    add_space_prefix: bool,
    /// llama.cpp's `clean_spaces` detokenizer pass (see [`decode::clean_spaces`]).
    clean_spaces: bool,
    chat_template: Option<ChatTemplate>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.engine {
            Engine::ByteLevelBpe(_) => "byte-level BPE",
            Engine::Spm(_) => "SentencePiece",
        };
        f.debug_struct("Tokenizer")
            .field("kind", &kind)
            .field("vocab_size", &self.vocab.len())
            .field("bos", &self.specials.bos)
            .field("eos", &self.specials.eos)
            .field("add_bos", &self.specials.add_bos)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

impl Tokenizer {
    /// The tokenizer a weight source carries: its GGUF metadata or its `tokenizer.json`.
    pub fn from_source(source: &dyn WeightSource) -> Result<Self> {
        match source.tokenizer_origin() {
            TokenizerOrigin::GgufMetadata => Self::from_gguf_metadata(source.metadata()),
            TokenizerOrigin::HuggingFace {
                tokenizer_json,
                tokenizer_config,
            } => Self::from_hf_files(&tokenizer_json, tokenizer_config.as_deref()),
            TokenizerOrigin::None => Err(TokenizerError::NoTokenizer {
                source_desc: source.description(),
            }),
        }
    }

    /// llama.cpp's tokenizer from `tokenizer.ggml.*` keys ("gpt2" byte-level BPE or "llama"
    /// SentencePiece) and `tokenizer.chat_template`.
    pub fn from_gguf_metadata(md: &Metadata) -> Result<Self> {
        gguf::from_metadata(md)
    }

    /// A Hugging Face `tokenizer.json` (byte-level BPE, or SentencePiece-style BPE with byte
    /// fallback), with BOS/EOS, `add_bos_token` and the chat template from
    /// `tokenizer_config.json` (or a `chat_template.jinja` beside it).
    pub fn from_hf_files(tokenizer_json: &Path, tokenizer_config: Option<&Path>) -> Result<Self> {
        hf::load(tokenizer_json, tokenizer_config)
    }

    /// Tokenizes `text`.
    ///
    /// `add_bos`: add the special tokens the model's metadata asks for (BOS when
    /// `add_bos_token` is set, or by llama.cpp's default for the tokenizer type when absent;
    /// EOS for the rare models that set `add_eos_token`) — llama.cpp's `add_special`.
    /// `parse_special`: turn control-token text such as `<|im_start|>` into its id rather than
    /// tokenizing it as text. User-defined tokens are always matched, as in llama.cpp.
    pub fn encode(&self, text: &str, add_bos: bool, parse_special: bool) -> Result<Vec<u32>> {
        let _span = tracing::trace_span!("encode", bytes = text.len()).entered();
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_bos && self.specials.add_bos {
            out.extend(self.specials.bos);
        }
        let mut after_special = true;
        for fragment in self.vocab.partition(text, parse_special) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(t) => {
                    self.encode_fragment(t, after_special, &mut out)?;
                    after_special = false;
                }
            }
        }
        if add_bos && self.specials.add_eos {
            out.extend(self.specials.eos);
        }
        Ok(out)
    }

    fn encode_fragment(&self, text: &str, after_special: bool, out: &mut Vec<u32>) -> Result<()> {
        match &self.engine {
            Engine::ByteLevelBpe(hf) => {
                let encoding = hf
                    .encode_fast(text, false)
                    .map_err(|e| TokenizerError::engine("encoding text", e))?;
                out.extend_from_slice(encoding.get_ids());
                Ok(())
            }
            Engine::Spm(spm) => {
                let mut escaped = String::with_capacity(text.len() + 4);
                if self.add_space_prefix && after_special {
                    escaped.push(SPACE_MARK);
                }
                for c in text.chars() {
                    escaped.push(if c == ' ' { SPACE_MARK } else { c });
                }
                spm.encode(&self.vocab, &escaped, out)
            }
        }
    }

    /// Text for `ids`, as llama.cpp's `detokenize`. `skip_special` drops control tokens (and a
    /// leading BOS / trailing EOS the model adds itself); otherwise they appear as their text.
    /// Bytes that do not form UTF-8 come out as U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let bytes = self.decode_bytes(ids, skip_special)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// An incremental decoder for generated tokens (control tokens render as nothing).
    pub fn stream(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self)
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.specials.bos
    }

    /// Whether `encode(.., add_bos = true, ..)` puts BOS in front.
    pub fn adds_bos(&self) -> bool {
        self.specials.add_bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.specials.eos
    }

    /// EOS, end-of-turn and the other tokens llama.cpp stops generation on
    /// (`<|im_end|>`, `<|endoftext|>`, `<end_of_turn>`, FIM padding, ...).
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.specials.eog.contains(&id)
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The token's text as the vocabulary stores it (byte-level BPE tokens spell a space `Ġ`,
    /// SentencePiece ones `▁`); `None` past the end of the vocabulary.
    pub fn id_to_piece(&self, id: u32) -> Option<String> {
        self.vocab.piece(id).map(str::to_owned)
    }

    /// Whether the chat template renders tool definitions (it reads a `tools` variable).
    pub fn chat_template_supports_tools(&self) -> bool {
        self.chat_template
            .as_ref()
            .is_some_and(|t| t.source().contains("tools"))
    }

    /// The id of `text` when it is one control or user-defined token (such as Qwen's
    /// `<tool_call>`), which the tokenizer splits out of text whole.
    pub fn special_token_id(&self, text: &str) -> Option<u32> {
        self.vocab
            .id(text)
            .filter(|&id| self.vocab.attr(id).is_some_and(|a| a.is_special()))
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_ref().map(ChatTemplate::source)
    }

    /// Renders the model's chat template with `messages`, `add_generation_prompt`, `bos_token`
    /// and `eos_token`, as Hugging Face and llama-cpp-python do (`trim_blocks`,
    /// `lstrip_blocks`, Python string methods, `raise_exception`). Tokenize the result with
    /// `parse_special = true`. A model without a template gives
    /// [`TokenizerError::NoChatTemplate`]. Rendering is bounded ([`CHAT_TEMPLATE_FUEL`],
    /// [`MAX_CHAT_PROMPT_BYTES`], [`CHAT_TEMPLATE_RECURSION`]); a template past a bound is an
    /// error.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.apply_chat_template_with_tools(messages, None, add_generation_prompt)
    }

    /// [`Tokenizer::apply_chat_template`] with OpenAI-style `tools` (a list of
    /// `{"type": "function", "function": {...}}`) given to the template as `tools`.
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or(TokenizerError::NoChatTemplate)?;
        let text = |id: Option<u32>| id.and_then(|i| self.vocab.piece(i)).unwrap_or_default();
        template.render(
            messages,
            tools,
            add_generation_prompt,
            text(self.specials.bos),
            text(self.specials.eos),
        )
    }

    /// Renders a one-message conversation, so that a template that cannot (a syntax error, a
    /// loop that never ends, output without end) is refused when the model loads instead of
    /// failing every chat request.
    fn with_checked_chat_template(self) -> Result<Self> {
        if self.chat_template.is_some() {
            self.apply_chat_template(&[ChatMessage::new("user", "Hello")], true)
                .map_err(|e| match e {
                    TokenizerError::ChatTemplate { detail } => TokenizerError::ChatTemplate {
                        detail: format!("on a one-message conversation at load time, {detail}"),
                    },
                    other => other,
                })?;
        }
        Ok(self)
    }

    /// Writes `tokenizer.json` and `tokenizer_config.json` into `dir` (created if missing) so
    /// that [`Tokenizer::from_hf_files`] on them gives the same ids. The `tokenizer.json` is a
    /// regular `tokenizers` file that other Hugging Face tools can load too.
    pub fn save_hf(&self, dir: &Path) -> Result<()> {
        hf::save(self, dir)
    }

    fn style(&self) -> PieceStyle {
        match self.engine {
            Engine::ByteLevelBpe(_) => PieceStyle::ByteLevel,
            Engine::Spm(_) => PieceStyle::SpaceMarked,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_is_shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
        assert_send_sync::<TokenizerError>();
    }
}
