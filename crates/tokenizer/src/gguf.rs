//! Tokenizers from GGUF `tokenizer.ggml.*` metadata, following llama.cpp's `llama_vocab::load`.

use std::collections::HashSet;

use switchyard_weights::Metadata;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::BPE;

use crate::error::{Result, TokenizerError};
use crate::pretok::{self, PreTokenizerSpec};
use crate::specials::{self, DeclaredIds};
use crate::spm::SpmModel;
use crate::vocab::{TokenAttr, Vocab};
use crate::{ChatTemplate, Engine, Tokenizer};

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
const KEY_ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

/// The kinds of tokenizer llama.cpp's `tokenizer.ggml.model` names that this crate builds.
enum ModelKind {
    /// "llama": SentencePiece with scores and `<0xNN>` byte fallback.
    Spm,
    /// "gpt2": byte-level BPE with merges and a pre-tokenizer chosen by `tokenizer.ggml.pre`.
    ByteLevelBpe(PreTokenizerSpec),
}

/// llama.cpp's defaults for a model kind, used when the metadata does not say.
struct Defaults {
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    add_bos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
}

impl ModelKind {
    fn defaults(&self) -> Defaults {
        match self {
            ModelKind::Spm => Defaults {
                bos: Some(1),
                eos: Some(2),
                unk: Some(0),
                add_bos: true,
                add_space_prefix: true,
                clean_spaces: false,
            },
            // llama.cpp really does default BPE's BOS and EOS to id 11.
            ModelKind::ByteLevelBpe(spec) => Defaults {
                bos: Some(11),
                eos: Some(11),
                unk: None,
                add_bos: spec.add_bos,
                add_space_prefix: false,
                clean_spaces: spec.clean_spaces,
            },
        }
    }
}

/// A special-token id key: the key's value when present and in range, else the default.
fn declared_id(
    md: &Metadata,
    key: &str,
    default: Option<u32>,
    n_vocab: usize,
) -> Result<Option<u32>> {
    let default = default.filter(|&d| (d as usize) < n_vocab);
    match md.opt_usize(key)? {
        Some(id) if id < n_vocab => Ok(u32::try_from(id).ok()),
        Some(id) => {
            tracing::warn!(
                key,
                id,
                n_vocab,
                "special token id out of range; using the default"
            );
            Ok(default)
        }
        None => Ok(default),
    }
}

pub(crate) fn from_metadata(md: &Metadata) -> Result<Tokenizer> {
    let _span = tracing::debug_span!("tokenizer_from_gguf").entered();
    let model = md.get_str(KEY_MODEL)?;
    let kind = match model {
        "llama" => ModelKind::Spm,
        "gpt2" => ModelKind::ByteLevelBpe(pretok::lookup(md.opt_str(KEY_PRE)?)?),
        other => {
            return Err(TokenizerError::UnsupportedModel {
                model: other.to_string(),
            })
        }
    };
    let defaults = kind.defaults();

    let pieces: Vec<String> = md
        .get_str_array(KEY_TOKENS)?
        .into_iter()
        .map(str::to_owned)
        .collect();
    let n = pieces.len();
    let attrs = if md.contains(KEY_TOKEN_TYPE) {
        let types = md.get_i64_array(KEY_TOKEN_TYPE)?;
        if types.len() < n {
            return Err(TokenizerError::LengthMismatch {
                key: KEY_TOKEN_TYPE,
                found: types.len(),
                expected: n,
            });
        }
        types[..n]
            .iter()
            .map(|&t| TokenAttr::from_gguf_type(t))
            .collect()
    } else {
        vec![TokenAttr::NORMAL; n]
    };
    let mut vocab = Vocab::new(pieces, attrs)?;

    let key = |name: &str| format!("tokenizer.ggml.{name}_token_id");
    let declared = DeclaredIds {
        bos: declared_id(md, &key("bos"), defaults.bos, n)?,
        eos: declared_id(md, &key("eos"), defaults.eos, n)?,
        eot: declared_id(md, &key("eot"), None, n)?,
        eom: declared_id(md, &key("eom"), None, n)?,
        fim_pad: declared_id(md, &key("fim_pad"), None, n)?,
        fim_rep: declared_id(md, &key("fim_rep"), None, n)?,
        fim_sep: declared_id(md, &key("fim_sep"), None, n)?,
    };
    let unk = declared_id(md, "tokenizer.ggml.unknown_token_id", defaults.unk, n)?;
    let add_bos = md.opt_bool(KEY_ADD_BOS)?.unwrap_or(defaults.add_bos);
    let add_eos = md.opt_bool(KEY_ADD_EOS)?.unwrap_or(false);
    let add_space_prefix = md
        .opt_bool(KEY_ADD_SPACE_PREFIX)?
        .unwrap_or(defaults.add_space_prefix);
    let specials = specials::resolve(&mut vocab, &declared, add_bos, add_eos);

    let engine = match kind {
        ModelKind::Spm => {
            let scores: Vec<Option<f32>> = if md.contains(KEY_SCORES) {
                let scores = md.get_f32_array(KEY_SCORES)?;
                if scores.len() < n {
                    return Err(TokenizerError::LengthMismatch {
                        key: KEY_SCORES,
                        found: scores.len(),
                        expected: n,
                    });
                }
                scores[..n].iter().map(|&s| Some(s)).collect()
            } else {
                vec![Some(0.0); n]
            };
            Engine::Spm(SpmModel::new(&vocab, scores, unk))
        }
        ModelKind::ByteLevelBpe(spec) => {
            let merges = md.get_str_array(KEY_MERGES)?;
            Engine::ByteLevelBpe(Box::new(byte_level_engine(&vocab, &merges, &spec)?))
        }
    };

    Tokenizer {
        vocab,
        engine,
        specials,
        add_space_prefix,
        clean_spaces: defaults.clean_spaces,
        chat_template: md
            .opt_str(KEY_CHAT_TEMPLATE)?
            .map(|t| ChatTemplate::new(t.to_owned()))
            .transpose()?,
    }
    .with_checked_chat_template()
}

/// Splits a GGUF merge line the way llama.cpp does: at the first space after the first byte.
fn split_merge(line: &str) -> Option<(&str, &str)> {
    let at = line.as_bytes().iter().skip(1).position(|&b| b == b' ')? + 1;
    Some((&line[..at], &line[at + 1..]))
}

/// The `tokenizers` BPE for a byte-level vocabulary, with no added tokens: special tokens are
/// split out before it runs (see [`Vocab::partition`]).
pub(crate) fn byte_level_engine(
    vocab: &Vocab,
    merges: &[&str],
    spec: &PreTokenizerSpec,
) -> Result<tokenizers::Tokenizer> {
    let mut seen = HashSet::with_capacity(merges.len());
    let mut pairs = Vec::with_capacity(merges.len());
    let mut skipped = 0usize;
    for line in merges {
        let Some((a, b)) = split_merge(line) else {
            skipped += 1;
            continue;
        };
        // llama.cpp keeps the first rank of a repeated pair; `tokenizers` would keep the last.
        if !seen.insert((a, b)) {
            continue;
        }
        let merged = format!("{a}{b}");
        if vocab.id(a).is_none() || vocab.id(b).is_none() || vocab.id(&merged).is_none() {
            // Unreachable in llama.cpp too: BPE symbols are always vocabulary tokens.
            skipped += 1;
            continue;
        }
        pairs.push((a.to_owned(), b.to_owned()));
    }
    if skipped > 0 {
        tracing::warn!(
            skipped,
            "merges that cannot apply to this vocabulary were dropped"
        );
    }
    let map: ahash::AHashMap<String, u32> = vocab
        .pieces()
        .iter()
        .enumerate()
        .map(|(i, p)| (p.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(map, pairs)
        .ignore_merges(spec.ignore_merges)
        .build()
        .map_err(|e| TokenizerError::engine("building the BPE model", e))?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(pretok::build(spec)?));
    tok.with_decoder(Some(ByteLevel::default()));
    Ok(tok)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SentencePiece vocabulary `<unk> <s> </s> a b` with `template` as its chat template.
    fn metadata_with_template(template: &str) -> Metadata {
        use switchyard_weights::MetaValue;
        let pieces = ["<unk>", "<s>", "</s>", "a", "b"];
        let mut md = Metadata::new(Default::default());
        md.insert("tokenizer.ggml.model", MetaValue::String("llama".into()));
        md.insert(
            "tokenizer.ggml.tokens",
            MetaValue::Array(
                pieces
                    .iter()
                    .map(|p| MetaValue::String(p.to_string()))
                    .collect(),
            ),
        );
        md.insert(
            "tokenizer.ggml.token_type",
            MetaValue::Array([2, 3, 3, 1, 1].map(MetaValue::I32).to_vec()),
        );
        md.insert(KEY_CHAT_TEMPLATE, MetaValue::String(template.into()));
        md
    }

    /// A template that cannot render one message within its limits, or does not compile, is
    /// refused when the tokenizer loads.
    #[test]
    fn a_bad_chat_template_is_refused_at_load() {
        let ok = from_metadata(&metadata_with_template(
            "{% for m in messages %}{{ m.content }}{% endfor %}",
        ))
        .expect("loads");
        assert_eq!(
            ok.apply_chat_template(&[crate::ChatMessage::new("user", "ab")], true)
                .ok()
                .as_deref(),
            Some("ab")
        );
        let hang =
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}";
        let err = from_metadata(&metadata_with_template(hang))
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("chat template failed: on a one-message conversation at load time, it ran past 101000 instructions (100000 plus 1000 per message, 1 message)")
        );
        let err = from_metadata(&metadata_with_template("{% for m in messages %}"))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.starts_with("chat template failed: syntax error"),
            "{err}"
        );
    }

    #[test]
    fn merges_split_at_first_space_after_first_byte() {
        assert_eq!(split_merge("Ġ t"), Some(("Ġ", "t")));
        assert_eq!(split_merge("  Ġ"), Some((" ", "Ġ")));
        assert_eq!(split_merge("ab"), None);
    }
}
