//! The crate's one error type.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{source_desc} carries no tokenizer (synthetic models have none)")]
    NoTokenizer { source_desc: String },
    #[error(transparent)]
    Metadata(#[from] switchyard_weights::WeightsError),
    #[error("tokenizer model {model:?} is not supported (\"gpt2\" byte-level BPE and \"llama\" SentencePiece are)")]
    UnsupportedModel { model: String },
    #[error("pre-tokenizer {pre:?} is not supported; known: {known}")]
    UnsupportedPreTokenizer { pre: String, known: String },
    #[error("metadata key {key:?} has {found} entries, but the vocabulary has {expected} tokens")]
    LengthMismatch {
        key: &'static str,
        found: usize,
        expected: usize,
    },
    #[error("token {text:?} appears twice in the vocabulary (ids {first} and {second})")]
    DuplicateToken {
        text: String,
        first: u32,
        second: u32,
    },
    #[error("the vocabulary is empty")]
    EmptyVocabulary,
    #[error("token id {id} is out of range (the vocabulary has {vocab_size} tokens)")]
    UnknownTokenId { id: u32, vocab_size: usize },
    #[error("byte 0x{byte:02X} has no byte-fallback token (<0x{byte:02X}>) and the vocabulary has no unknown token")]
    NoByteToken { byte: u8 },
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {detail}")]
    HfFormat { path: PathBuf, detail: String },
    #[error("{path}: tokenizer model {kind:?} is not supported (byte-level BPE and SentencePiece-style BPE with byte fallback are)")]
    UnsupportedHfModel { path: PathBuf, kind: String },
    #[error("tokenizers engine failed while {context}: {detail}")]
    Engine {
        context: &'static str,
        detail: String,
    },
    #[error("this model has no chat template (no tokenizer.chat_template); it is likely a base model, not a chat-tuned one, so prompt it with plain text")]
    NoChatTemplate,
    #[error("chat template failed: {detail}")]
    ChatTemplate { detail: String },
}

impl TokenizerError {
    pub(crate) fn engine(context: &'static str, err: impl std::fmt::Display) -> Self {
        TokenizerError::Engine {
            context,
            detail: err.to_string(),
        }
    }
}

pub type Result<T> = std::result::Result<T, TokenizerError>;
