//! The vocabulary: token texts, their llama.cpp attributes, and cutting special tokens out of text.

use std::collections::HashMap;

use crate::error::{Result, TokenizerError};

/// llama.cpp's per-token attribute bits (`llama_token_attr`), the subset this crate acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct TokenAttr(u8);

impl TokenAttr {
    pub const UNDEFINED: TokenAttr = TokenAttr(0);
    pub const UNKNOWN: TokenAttr = TokenAttr(1 << 0);
    pub const UNUSED: TokenAttr = TokenAttr(1 << 1);
    pub const NORMAL: TokenAttr = TokenAttr(1 << 2);
    pub const CONTROL: TokenAttr = TokenAttr(1 << 3);
    pub const USER_DEFINED: TokenAttr = TokenAttr(1 << 4);
    pub const BYTE: TokenAttr = TokenAttr(1 << 5);

    /// Maps a GGUF `tokenizer.ggml.token_type` value (llama.cpp's `llama_token_type`).
    pub fn from_gguf_type(t: i64) -> TokenAttr {
        match t {
            1 => TokenAttr::NORMAL,
            2 => TokenAttr::UNKNOWN,
            3 => TokenAttr::CONTROL,
            4 => TokenAttr::USER_DEFINED,
            5 => TokenAttr::UNUSED,
            6 => TokenAttr::BYTE,
            _ => TokenAttr::UNDEFINED,
        }
    }

    pub fn has(self, other: TokenAttr) -> bool {
        self.0 & other.0 != 0
    }

    pub fn with(self, other: TokenAttr) -> TokenAttr {
        TokenAttr(self.0 | other.0)
    }

    /// Tokens llama.cpp splits out of text before running the tokenizer model.
    pub fn is_special(self) -> bool {
        self.has(
            TokenAttr::CONTROL
                .with(TokenAttr::USER_DEFINED)
                .with(TokenAttr::UNKNOWN),
        )
    }

    /// Tokens rendered as nothing unless the caller asks for special tokens.
    pub fn is_hidden(self) -> bool {
        self.has(TokenAttr::CONTROL.with(TokenAttr::UNKNOWN))
    }
}

/// A piece of input text after special tokens have been split out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment<'t> {
    Token(u32),
    Text(&'t str),
}

#[derive(Debug, Clone)]
pub(crate) struct Vocab {
    pieces: Vec<String>,
    attrs: Vec<TokenAttr>,
    ids: HashMap<String, u32>,
    /// Special tokens, longest text first: the order llama.cpp matches them in.
    special_cache: Vec<u32>,
}

impl Vocab {
    /// Empty texts become `[EMPTY_<id>]`, as in llama.cpp, so that every token can be looked up.
    pub fn new(mut pieces: Vec<String>, attrs: Vec<TokenAttr>) -> Result<Self> {
        if pieces.is_empty() {
            return Err(TokenizerError::EmptyVocabulary);
        }
        if attrs.len() != pieces.len() {
            return Err(TokenizerError::LengthMismatch {
                key: "token attributes",
                found: attrs.len(),
                expected: pieces.len(),
            });
        }
        let mut ids = HashMap::with_capacity(pieces.len());
        for (i, piece) in pieces.iter_mut().enumerate() {
            if piece.is_empty() {
                tracing::warn!(id = i, "empty token text in the vocabulary");
                *piece = format!("[EMPTY_{i}]");
            }
            let id = u32::try_from(i).map_err(|_| TokenizerError::LengthMismatch {
                key: "tokenizer.ggml.tokens",
                found: i,
                expected: u32::MAX as usize,
            })?;
            if let Some(first) = ids.insert(piece.clone(), id) {
                return Err(TokenizerError::DuplicateToken {
                    text: piece.clone(),
                    first,
                    second: id,
                });
            }
        }
        let mut vocab = Vocab {
            pieces,
            attrs,
            ids,
            special_cache: Vec::new(),
        };
        vocab.rebuild_special_cache();
        Ok(vocab)
    }

    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    pub fn id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    pub fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    pub fn pieces(&self) -> &[String] {
        &self.pieces
    }

    pub fn attr(&self, id: u32) -> Option<TokenAttr> {
        self.attrs.get(id as usize).copied()
    }

    pub fn checked(&self, id: u32) -> Result<()> {
        if (id as usize) < self.pieces.len() {
            Ok(())
        } else {
            Err(TokenizerError::UnknownTokenId {
                id,
                vocab_size: self.pieces.len(),
            })
        }
    }

    /// Replaces a token's attributes; callers must call [`Vocab::rebuild_special_cache`] after.
    pub fn set_attr(&mut self, id: u32, attr: TokenAttr) {
        if let Some(a) = self.attrs.get_mut(id as usize) {
            *a = attr;
        }
    }

    pub fn rebuild_special_cache(&mut self) {
        let mut cache: Vec<u32> = (0..self.pieces.len() as u32)
            .filter(|&id| self.attrs[id as usize].is_special())
            .collect();
        // llama.cpp sorts by length only (std::sort, unstable); ties by id keep this deterministic.
        cache.sort_by(|&a, &b| {
            self.pieces[b as usize]
                .len()
                .cmp(&self.pieces[a as usize].len())
                .then(a.cmp(&b))
        });
        self.special_cache = cache;
    }

    /// llama.cpp's `tokenizer_st_partition`: for each special token, longest first, cut every
    /// occurrence out of the remaining text. Control (and unknown) tokens are cut only when
    /// `parse_special`; user-defined tokens always are, as in Hugging Face's added tokens.
    pub fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut fragments = Vec::new();
        if text.is_empty() {
            return fragments;
        }
        fragments.push(Fragment::Text(text));
        for &id in &self.special_cache {
            let attr = self.attrs[id as usize];
            if !parse_special && attr.is_hidden() {
                continue;
            }
            let needle = self.pieces[id as usize].as_str();
            let mut next = Vec::with_capacity(fragments.len());
            for fragment in fragments {
                let Fragment::Text(mut rest) = fragment else {
                    next.push(fragment);
                    continue;
                };
                // Matching a valid UTF-8 needle in valid UTF-8 text always lands on char
                // boundaries, so slicing here cannot split a character.
                while let Some(at) = rest.find(needle) {
                    if at > 0 {
                        next.push(Fragment::Text(&rest[..at]));
                    }
                    next.push(Fragment::Token(id));
                    rest = &rest[at + needle.len()..];
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            fragments = next;
        }
        fragments
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab() -> Vocab {
        let pieces = ["a", "<s>", "<|im_start|>", "<|im", "  ", "b"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let attrs = vec![
            TokenAttr::NORMAL,
            TokenAttr::CONTROL,
            TokenAttr::CONTROL,
            TokenAttr::CONTROL,
            TokenAttr::USER_DEFINED,
            TokenAttr::NORMAL,
        ];
        Vocab::new(pieces, attrs).expect("valid vocab")
    }

    #[test]
    fn longest_special_wins_and_text_between_is_kept() {
        let v = vocab();
        let f = v.partition("x<|im_start|>a  b<s>", true);
        assert_eq!(
            f,
            vec![
                Fragment::Text("x"),
                Fragment::Token(2),
                Fragment::Text("a"),
                Fragment::Token(4),
                Fragment::Text("b"),
                Fragment::Token(1),
            ]
        );
    }

    #[test]
    fn control_tokens_stay_text_without_parse_special_but_user_defined_split() {
        let v = vocab();
        let f = v.partition("<s>a  b", false);
        assert_eq!(
            f,
            vec![
                Fragment::Text("<s>a"),
                Fragment::Token(4),
                Fragment::Text("b")
            ]
        );
    }

    #[test]
    fn duplicate_and_empty_tokens() {
        let dup = Vocab::new(
            vec!["a".into(), "a".into()],
            vec![TokenAttr::NORMAL, TokenAttr::NORMAL],
        );
        assert!(matches!(
            dup,
            Err(TokenizerError::DuplicateToken {
                first: 0,
                second: 1,
                ..
            })
        ));
        let v = Vocab::new(
            vec!["a".into(), String::new()],
            vec![TokenAttr::NORMAL, TokenAttr::CONTROL],
        )
        .expect("valid vocab");
        assert_eq!(v.piece(1), Some("[EMPTY_1]"));
        assert!(v.partition("", true).is_empty());
    }
}
