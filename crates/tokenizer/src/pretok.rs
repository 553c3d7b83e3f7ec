//! Byte-level BPE pre-tokenizers: llama.cpp's regex lists per `tokenizer.ggml.pre`.
//!
//! The regexes are copied from llama.cpp's `src/llama-vocab.cpp` (`llm_tokenizer_bpe`). llama.cpp
//! applies a type's regexes one after the other, each splitting the pieces the previous one left
//! and keeping the unmatched gaps as pieces of their own; a chain of `Split(Isolated)`
//! pre-tokenizers does exactly that. Candle's `from_gguf` knows none of this and falls back to
//! GPT-2 rules (with an added leading space) for SmolLM2, which is why this table exists.

use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::error::{Result, TokenizerError};

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const DIGIT: &str = r"\p{N}";

/// How llama.cpp treats one `tokenizer.ggml.pre` family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PreTokenizerSpec {
    pub regexes: &'static [&'static str],
    /// Whole pre-tokenized words found in the vocabulary skip merging (llama3).
    pub ignore_merges: bool,
    /// llama.cpp's `clean_spaces`: detokenizing removes spaces before `?!.,` and some `'`.
    pub clean_spaces: bool,
    /// Default for `add_bos_token` when the metadata does not say.
    pub add_bos: bool,
}

const fn spec(regexes: &'static [&'static str], clean_spaces: bool) -> PreTokenizerSpec {
    PreTokenizerSpec {
        regexes,
        ignore_merges: false,
        clean_spaces,
        add_bos: false,
    }
}

const DEFAULT_REGEXES: &[&str] = &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"];
const STARCODER_REGEXES: &[&str] = &[DIGIT, GPT2];

/// `(names, spec)`, in llama.cpp's grouping.
const FAMILIES: &[(&[&str], PreTokenizerSpec)] = &[
    (&["default"], spec(DEFAULT_REGEXES, true)),
    (
        &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ],
        PreTokenizerSpec {
            regexes: &[LLAMA3],
            ignore_merges: true,
            clean_spaces: true,
            add_bos: true,
        },
    ),
    (&["dbrx", "smaug-bpe"], spec(&[LLAMA3], true)),
    (
        &[
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "mpt",
            "olmo",
            "jais",
            "exaone4",
        ],
        spec(&[GPT2], true),
    ),
    (&["trillion", "granite-docling"], spec(&[GPT2], false)),
    (
        &[
            "starcoder",
            "refact",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        spec(STARCODER_REGEXES, true),
    ),
    (&["smollm", "command-r"], spec(STARCODER_REGEXES, false)),
    (
        &[
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "hunyuan",
            "solar-open",
        ],
        spec(&[QWEN2], false),
    ),
    (&["stablelm2", "megrez"], spec(&[QWEN2], true)),
];

/// The spec for a `tokenizer.ggml.pre` value; a missing value means llama.cpp's "default".
pub(crate) fn lookup(pre: Option<&str>) -> Result<PreTokenizerSpec> {
    let name = match pre {
        None | Some("") => {
            tracing::warn!("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' regexes");
            "default"
        }
        Some(p) => p,
    };
    FAMILIES
        .iter()
        .find(|(names, _)| names.contains(&name))
        .map(|&(_, spec)| spec)
        .ok_or_else(|| TokenizerError::UnsupportedPreTokenizer {
            pre: name.to_string(),
            known: FAMILIES
                .iter()
                .flat_map(|(names, _)| names.iter().copied())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// The `tokenizers` pre-tokenizer for `spec`: each regex as an isolating split, then the
/// GPT-2 byte-to-unicode mapping (with no regex of its own and no added prefix space).
pub(crate) fn build(spec: &PreTokenizerSpec) -> Result<PreTokenizerWrapper> {
    let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(spec.regexes.len() + 1);
    for re in spec.regexes {
        let split = Split::new(
            SplitPattern::Regex((*re).to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| TokenizerError::engine("compiling a pre-tokenizer regex", e))?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());
    Ok(Sequence::new(steps).into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zoo_families_resolve() {
        let smollm = lookup(Some("smollm")).expect("smollm is known");
        assert_eq!(smollm.regexes, STARCODER_REGEXES);
        assert!(!smollm.clean_spaces);
        let qwen = lookup(Some("qwen2")).expect("qwen2 is known");
        assert_eq!(qwen.regexes, &[QWEN2]);
        assert!(
            lookup(Some("llama3"))
                .expect("llama3 is known")
                .ignore_merges
        );
        assert_eq!(
            lookup(None).expect("default is known").regexes,
            DEFAULT_REGEXES
        );
        assert!(matches!(
            lookup(Some("no-such-pre")),
            Err(TokenizerError::UnsupportedPreTokenizer { .. })
        ));
    }

    #[test]
    fn every_regex_compiles() {
        for (_, spec) in FAMILIES {
            build(spec).expect("regexes compile");
        }
    }
}
