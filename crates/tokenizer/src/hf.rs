//! Hugging Face tokenizer folders: reading `tokenizer.json` (+ `tokenizer_config.json`) and
//! writing them back out so that a GGUF model's tokenizer travels with its safetensors export.
//!
//! Either way the result follows llama.cpp's rules, as `convert_hf_to_gguf.py` would carry them:
//! added tokens marked `special` are control tokens, the others user-defined; special tokens are
//! split out by [`crate::vocab::Vocab::partition`], not by `tokenizers`' added vocabulary.
//! Byte-level files run through their own `tokenizers` pipeline (normalizer and pre-tokenizer
//! included). SentencePiece-style files (BPE with byte fallback over `▁`-escaped text) run
//! through [`SpmModel`], with no normalization beyond the escaping (llama.cpp applies none);
//! their merge list stands in for the scores it was derived from: a token's score is minus the
//! rank of the first merge that makes it, which orders tokens exactly as the scores did wherever
//! scores differ.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{json, Value};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper};

use crate::error::{Result, TokenizerError};
use crate::specials::{self, DeclaredIds};
use crate::spm::{parse_byte_token, SpmModel, SPACE_MARK};
use crate::vocab::{TokenAttr, Vocab};
use crate::{ChatTemplate, Engine, Tokenizer};

const TOKENIZER_JSON: &str = "tokenizer.json";
const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
/// Newer `transformers` versions keep the chat template in its own file.
const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// The parts of `tokenizer.json` that `tokenizers` does not expose.
#[derive(Deserialize)]
struct RawTokenizer {
    #[serde(default)]
    normalizer: Option<Value>,
    #[serde(default)]
    pre_tokenizer: Option<Value>,
    #[serde(default)]
    decoder: Option<Value>,
    #[serde(default)]
    post_processor: Option<Value>,
    model: RawModel,
}

#[derive(Deserialize)]
struct RawModel {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    byte_fallback: bool,
    #[serde(default)]
    unk_token: Option<String>,
    #[serde(default)]
    merges: Vec<RawMerge>,
}

/// `tokenizers` writes merges as `["a", "b"]` now and as `"a b"` before 0.20.
#[derive(Deserialize)]
#[serde(untagged)]
enum RawMerge {
    Pair(String, String),
    Joined(String),
}

impl RawMerge {
    fn parts(&self) -> Option<(&str, &str)> {
        match self {
            RawMerge::Pair(a, b) => Some((a, b)),
            RawMerge::Joined(s) => s.split_once(' '),
        }
    }
}

/// Every JSON object in `v` (itself included) whose `"type"` is `kind`, at any depth, so that
/// components nested in `Sequence`s are found too.
fn components<'a>(v: &'a Value, kind: &str, found: &mut Vec<&'a Value>) {
    match v {
        Value::Object(map) => {
            if map.get("type").and_then(Value::as_str) == Some(kind) {
                found.push(v);
            }
            map.values().for_each(|x| components(x, kind, found));
        }
        Value::Array(items) => items.iter().for_each(|x| components(x, kind, found)),
        _ => {}
    }
}

fn find<'a>(v: Option<&'a Value>, kind: &str) -> Vec<&'a Value> {
    let mut found = Vec::new();
    if let Some(v) = v {
        components(v, kind, &mut found);
    }
    found
}

/// How a SentencePiece-style file escapes spaces, if it does.
struct SpaceMarking {
    add_space_prefix: bool,
}

fn space_marking(raw: &RawTokenizer) -> Option<SpaceMarking> {
    let mark = SPACE_MARK.to_string();
    let replaces_spaces = find(raw.normalizer.as_ref(), "Replace").iter().any(|r| {
        r.pointer("/pattern/String").and_then(Value::as_str) == Some(" ")
            && r.get("content").and_then(Value::as_str) == Some(mark.as_str())
    });
    let prepends = find(raw.normalizer.as_ref(), "Prepend")
        .iter()
        .any(|p| p.get("prepend").and_then(Value::as_str) == Some(mark.as_str()));
    let metaspace = find(raw.pre_tokenizer.as_ref(), "Metaspace");
    let metaspace_prefix = metaspace.iter().any(|m| {
        let scheme = m.get("prepend_scheme").and_then(Value::as_str);
        let legacy = m.get("add_prefix_space").and_then(Value::as_bool);
        matches!(scheme, Some("always" | "first")) || (scheme.is_none() && legacy != Some(false))
    });
    (replaces_spaces || !metaspace.is_empty()).then_some(SpaceMarking {
        add_space_prefix: prepends || metaspace_prefix,
    })
}

fn is_byte_level(raw: &RawTokenizer) -> bool {
    !find(raw.pre_tokenizer.as_ref(), "ByteLevel").is_empty()
        || !find(raw.decoder.as_ref(), "ByteLevel").is_empty()
}

/// `"<s>"` or `{"content": "<s>", ...}`, as `tokenizer_config.json` spells special tokens.
fn token_text(v: Option<&Value>) -> Option<&str> {
    match v? {
        Value::String(s) => Some(s),
        Value::Object(map) => map.get("content").and_then(Value::as_str),
        _ => None,
    }
}

/// A template string, or the `default` one of a list of named templates.
fn chat_template_from_config(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| named.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

fn read(path: &Path) -> Result<String> {
    fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn format_error(path: &Path, detail: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::HfFormat {
        path: path.to_path_buf(),
        detail: detail.to_string(),
    }
}

/// Most ids a vocabulary may skip: enough for padding, not for a stray id near `u32::MAX`.
const MAX_ID_GAP: usize = 1 << 16;

/// Dense id -> text table from `tokenizers`' vocabulary; ids it skips get placeholder texts.
/// `None` when the ids are too sparse to lay out densely.
fn pieces_by_id(vocab: HashMap<String, u32>) -> Option<(Vec<String>, Vec<bool>)> {
    let n = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
    if n > vocab.len() + MAX_ID_GAP {
        return None;
    }
    let mut pieces = vec![String::new(); n];
    let mut present = vec![false; n];
    for (text, id) in vocab {
        pieces[id as usize] = text;
        present[id as usize] = true;
    }
    for (i, piece) in pieces.iter_mut().enumerate() {
        if !present[i] {
            *piece = format!("[UNUSED_{i}]");
        }
    }
    Some((pieces, present))
}

pub(crate) fn load(tokenizer_json: &Path, tokenizer_config: Option<&Path>) -> Result<Tokenizer> {
    let _span =
        tracing::debug_span!("tokenizer_from_hf", path = %tokenizer_json.display()).entered();
    let text = read(tokenizer_json)?;
    let hf: tokenizers::Tokenizer = text.parse().map_err(|e| format_error(tokenizer_json, e))?;
    let raw: RawTokenizer =
        serde_json::from_str(&text).map_err(|e| format_error(tokenizer_json, e))?;
    drop(text);

    let unsupported = |kind: &str| TokenizerError::UnsupportedHfModel {
        path: tokenizer_json.to_path_buf(),
        kind: kind.to_string(),
    };
    if !matches!(hf.get_model(), ModelWrapper::BPE(_)) {
        return Err(unsupported(raw.model.kind.as_deref().unwrap_or("unknown")));
    }
    let marking = if raw.model.byte_fallback {
        space_marking(&raw)
    } else {
        None
    };
    if marking.is_none() && !is_byte_level(&raw) {
        return Err(unsupported(
            "BPE without byte-level encoding or byte fallback",
        ));
    }

    let (pieces, present) = pieces_by_id(hf.get_vocab(true)).ok_or_else(|| {
        format_error(tokenizer_json, "token ids leave most of their range unused")
    })?;
    let mut attrs: Vec<TokenAttr> = present
        .iter()
        .map(|&p| {
            if p {
                TokenAttr::NORMAL
            } else {
                TokenAttr::UNUSED
            }
        })
        .collect();
    if marking.is_some() {
        for (attr, piece) in attrs.iter_mut().zip(&pieces) {
            if parse_byte_token(piece).is_some() {
                *attr = TokenAttr::BYTE;
            }
        }
    }
    if let Some(attr) = raw
        .model
        .unk_token
        .as_deref()
        .and_then(|unk| hf.token_to_id(unk))
        .and_then(|id| attrs.get_mut(id as usize))
    {
        *attr = TokenAttr::UNKNOWN;
    }
    for (id, added) in hf.get_added_tokens_decoder() {
        if let Some(attr) = attrs.get_mut(id as usize) {
            *attr = if added.special {
                TokenAttr::CONTROL
            } else {
                TokenAttr::USER_DEFINED
            };
        }
    }
    let mut vocab = Vocab::new(pieces, attrs)?;

    let config: Value = match tokenizer_config {
        Some(p) => serde_json::from_str(&read(p)?).map_err(|e| format_error(p, e))?,
        None => json!({}),
    };
    let chat_template = match chat_template_from_config(&config) {
        Some(t) => Some(t),
        None => {
            let dir = tokenizer_config
                .unwrap_or(tokenizer_json)
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_default();
            let file = dir.join(CHAT_TEMPLATE_FILE);
            if file.is_file() {
                Some(read(&file)?)
            } else {
                None
            }
        }
    };
    let bos_text = token_text(config.get("bos_token"));
    let eos_text = token_text(config.get("eos_token"));
    let declared = DeclaredIds {
        bos: bos_text.and_then(|t| vocab.id(t)),
        eos: eos_text.and_then(|t| vocab.id(t)),
        ..Default::default()
    };
    let template_adds_bos = || {
        let first = raw
            .post_processor
            .as_ref()
            .and_then(|p| find(Some(p), "TemplateProcessing").first().copied())
            .and_then(|t| t.pointer("/single/0/SpecialToken/id"))
            .and_then(Value::as_str);
        first.is_some() && first == bos_text
    };
    let add_bos = config
        .get("add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or_else(|| template_adds_bos() || marking.is_some());
    let add_eos = config
        .get("add_eos_token")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let clean_spaces = config
        .get("clean_up_tokenization_spaces")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let specials = specials::resolve(&mut vocab, &declared, add_bos, add_eos);

    let (engine, add_space_prefix) = match marking {
        Some(marking) => {
            let mut scores: Vec<Option<f32>> = vec![None; vocab.len()];
            for (rank, merge) in raw.model.merges.iter().enumerate() {
                let Some((a, b)) = merge.parts() else {
                    continue;
                };
                if let Some(id) = vocab.id(&format!("{a}{b}")) {
                    let slot = &mut scores[id as usize];
                    if slot.is_none() {
                        *slot = Some(-(rank as f32));
                    }
                }
            }
            let unk = raw.model.unk_token.as_deref().and_then(|t| vocab.id(t));
            (
                Engine::Spm(SpmModel::new(&vocab, scores, unk)),
                marking.add_space_prefix,
            )
        }
        None => (
            Engine::ByteLevelBpe(Box::new(without_added_tokens(&hf)?)),
            false,
        ),
    };

    Tokenizer {
        vocab,
        engine,
        specials,
        add_space_prefix,
        clean_spaces,
        chat_template: chat_template.map(ChatTemplate::new).transpose()?,
    }
    .with_checked_chat_template()
}

/// The same pipeline minus the added vocabulary, which [`Vocab::partition`] replaces.
fn without_added_tokens(hf: &tokenizers::Tokenizer) -> Result<tokenizers::Tokenizer> {
    let mut t = tokenizers::Tokenizer::new(hf.get_model().clone());
    t.with_normalizer(hf.get_normalizer().cloned())
        .map_err(|e| TokenizerError::engine("copying the normalizer", e))?;
    t.with_pre_tokenizer(hf.get_pre_tokenizer().cloned());
    t.with_decoder(hf.get_decoder().cloned());
    Ok(t)
}

/// The merges Hugging Face's SentencePiece converter derives from scores: every split of a
/// token into two tokens, best-scoring token first.
fn spm_merges(vocab: &Vocab, spm: &SpmModel) -> Vec<(String, String)> {
    let mut found: Vec<(f32, u32, usize, u32, u32)> = Vec::new();
    for (id, piece) in vocab.pieces().iter().enumerate() {
        let id = id as u32;
        let Some(score) = spm.score(id) else {
            continue;
        };
        // `-0.0` and `0.0` must tie, as they do for llama.cpp.
        let score = if score == 0.0 { 0.0 } else { score };
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(li), Some(ri)) = (vocab.id(l), vocab.id(r)) {
                found.push((score, id, at, li, ri));
            }
        }
    }
    found.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    found
        .into_iter()
        .filter_map(|(_, _, _, l, r)| {
            Some((vocab.piece(l)?.to_owned(), vocab.piece(r)?.to_owned()))
        })
        .collect()
}

/// A post-processor that prepends BOS, for Hugging Face consumers of the saved file (this crate
/// reads `add_bos_token` from `tokenizer_config.json` instead).
fn bos_template(tok: &Tokenizer) -> Option<TemplateProcessing> {
    let bos = tok.specials.bos.filter(|_| tok.specials.add_bos)?;
    let text = tok.vocab.piece(bos)?;
    // The template syntax splits on whitespace and ':', so such BOS texts cannot be written.
    if text.contains(|c: char| c == ':' || c.is_whitespace()) {
        return None;
    }
    let single = vec![text.to_owned(), "$A:0".to_owned()];
    let pair = vec![
        text.to_owned(),
        "$A:0".to_owned(),
        format!("{text}:1"),
        "$B:1".to_owned(),
    ];
    let built = TemplateProcessing::builder()
        .try_single(single)
        .and_then(|b| b.try_pair(pair))
        .map_err(|e| e.to_string())
        .and_then(|b| {
            b.special_tokens(vec![(text.to_owned(), bos)])
                .build()
                .map_err(|e| e.to_string())
        });
    match built {
        Ok(p) => Some(p),
        Err(detail) => {
            tracing::warn!(%detail, "no BOS post-processor; tokenizer.json will not add BOS");
            None
        }
    }
}

/// The `tokenizers` pipeline equivalent to `tok`, for other Hugging Face consumers.
fn hf_pipeline(tok: &Tokenizer) -> Result<tokenizers::Tokenizer> {
    let mut hf = match &tok.engine {
        Engine::ByteLevelBpe(engine) => (**engine).clone(),
        Engine::Spm(spm) => {
            let map: ahash::AHashMap<String, u32> = tok
                .vocab
                .pieces()
                .iter()
                .enumerate()
                .map(|(i, p)| (p.clone(), i as u32))
                .collect();
            let mut builder = BPE::builder()
                .vocab_and_merges(map, spm_merges(&tok.vocab, spm))
                .byte_fallback(true)
                .fuse_unk(true);
            if let Some(unk) = spm.unk().and_then(|id| tok.vocab.piece(id)) {
                builder = builder.unk_token(unk.to_owned());
            }
            let bpe = builder
                .build()
                .map_err(|e| TokenizerError::engine("building the BPE model", e))?;
            let mut hf = tokenizers::Tokenizer::new(bpe);
            let mark = SPACE_MARK.to_string();
            let replace = Replace::new(" ", mark.as_str())
                .map_err(|e| TokenizerError::engine("building the space normalizer", e))?;
            let normalizer: NormalizerWrapper = if tok.add_space_prefix {
                NormalizerSequence::new(vec![Prepend::new(mark.clone()).into(), replace.into()])
                    .into()
            } else {
                replace.into()
            };
            hf.with_normalizer(Some(normalizer))
                .map_err(|e| TokenizerError::engine("setting the space normalizer", e))?;
            let unmark = DecoderWrapper::Replace(
                Replace::new(mark.as_str(), " ")
                    .map_err(|e| TokenizerError::engine("building the space decoder", e))?,
            );
            let mut steps: Vec<DecoderWrapper> =
                vec![unmark, ByteFallback::new().into(), Fuse::new().into()];
            if tok.add_space_prefix {
                steps.push(Strip::new(' ', 1, 0).into());
            }
            hf.with_decoder(Some(DecoderSequence::new(steps)));
            hf
        }
    };

    if let Some(processor) = bos_template(tok) {
        hf.with_post_processor(Some(processor));
    }

    let mut special = Vec::new();
    let mut user_defined = Vec::new();
    for id in 0..tok.vocab.len() as u32 {
        let (Some(attr), Some(text)) = (tok.vocab.attr(id), tok.vocab.piece(id)) else {
            continue;
        };
        if attr.is_hidden() {
            special.push(AddedToken::from(text, true).normalized(false));
        } else if attr.has(TokenAttr::USER_DEFINED) {
            user_defined.push(AddedToken::from(text, false).normalized(false));
        }
    }
    hf.add_special_tokens(special)
        .map_err(|e| TokenizerError::engine("adding special tokens", e))?;
    hf.add_tokens(user_defined)
        .map_err(|e| TokenizerError::engine("adding user-defined tokens", e))?;
    Ok(hf)
}

pub(crate) fn save(tok: &Tokenizer, dir: &Path) -> Result<()> {
    let _span = tracing::debug_span!("tokenizer_save_hf", dir = %dir.display()).entered();
    let io = |path: PathBuf| move |source| TokenizerError::Io { path, source };
    fs::create_dir_all(dir).map_err(io(dir.to_path_buf()))?;

    let hf = hf_pipeline(tok)?;
    let json_path = dir.join(TOKENIZER_JSON);
    hf.save(&json_path, false)
        .map_err(|e| format_error(&json_path, e))?;

    let piece = |id: Option<u32>| id.and_then(|i| tok.vocab.piece(i)).map(str::to_owned);
    let mut config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tok.specials.add_bos,
        "add_eos_token": tok.specials.add_eos,
        "bos_token": piece(tok.specials.bos),
        "eos_token": piece(tok.specials.eos),
        "clean_up_tokenization_spaces": tok.clean_spaces,
    });
    if let (Some(template), Some(map)) = (tok.chat_template(), config.as_object_mut()) {
        map.insert("chat_template".into(), Value::String(template.to_string()));
    }
    let config_path = dir.join(TOKENIZER_CONFIG);
    let text = serde_json::to_string_pretty(&config).map_err(|e| format_error(&config_path, e))?;
    fs::write(&config_path, text).map_err(io(config_path.clone()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nested_components() {
        let normalizer = json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
        ]});
        let raw = RawTokenizer {
            normalizer: Some(normalizer),
            pre_tokenizer: None,
            decoder: None,
            post_processor: None,
            model: RawModel {
                kind: Some("BPE".into()),
                byte_fallback: true,
                unk_token: None,
                merges: vec![],
            },
        };
        let marking = space_marking(&raw).expect("space-marked");
        assert!(marking.add_space_prefix);
        assert!(!is_byte_level(&raw));
    }

    #[test]
    fn config_token_spellings() {
        let config = json!({"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>",
                            "chat_template": [{"name": "tool_use", "template": "t"},
                                              {"name": "default", "template": "d"}]});
        assert_eq!(token_text(config.get("bos_token")), Some("<s>"));
        assert_eq!(token_text(config.get("eos_token")), Some("</s>"));
        assert_eq!(token_text(config.get("pad_token")), None);
        assert_eq!(chat_template_from_config(&config).as_deref(), Some("d"));
    }

    #[test]
    fn merges_parse_in_both_spellings() {
        let merges: Vec<RawMerge> =
            serde_json::from_value(json!([["a", "b"], "c d"])).expect("parses");
        let parts: Vec<_> = merges.iter().filter_map(RawMerge::parts).collect();
        assert_eq!(parts, vec![("a", "b"), ("c", "d")]);
    }
}
