//! llama.cpp's SentencePiece (SPM) tokenizer: greedy highest-score bigram merging.
//!
//! Why not Hugging Face's BPE with merges derived from the scores (what its SentencePiece
//! converter does, and what `save_hf` writes for other tools)? On gemma3-270m it gave llama.cpp's
//! ids on every input tried (the 3,600 llama.cpp references this crate was checked against, and
//! ~700,000 random strings run through both merge rules), but it cannot match by construction.
//! SPM ranks a candidate pair by the score of the token it makes and breaks ties leftmost; BPE
//! ranks by merge-list index, and the converter lists every split of a token as its own merge.
//! When one token can be made at two places from different splits (`[ab, c, a, bc]` -> `abc`
//! twice), BPE takes whichever split is listed first, SPM the leftmost one, and the merges that
//! follow can differ. Tokens whose scores tie (Gemma's byte tokens at 0.0 and its first normal
//! token at -0.0; control and user-defined tokens at -1000) get an arbitrary order in a merge
//! list. The algorithm is short, so it is reimplemented here and matches by construction.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::error::{Result, TokenizerError};
use crate::vocab::Vocab;

/// The SentencePiece word-boundary marker that stands for a space inside tokens.
pub(crate) const SPACE_MARK: char = '\u{2581}';

#[derive(Debug, Clone)]
pub(crate) struct SpmModel {
    /// Merge priority of the token with each id; `None` means merges never produce it.
    scores: Vec<Option<f32>>,
    /// `<0xNN>` token for each byte, used for text no token covers.
    byte_tokens: Box<[Option<u32>; 256]>,
    unk: Option<u32>,
}

#[derive(Debug, Clone, Copy)]
struct Symbol {
    prev: Option<usize>,
    next: Option<usize>,
    start: usize,
    len: usize,
}

#[derive(Debug, Clone, Copy)]
struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Bigram {
    /// Max-heap order: higher score first, then the leftmost pair. Scores compare as C++
    /// floats do (`-0.0 == 0.0`), not with `total_cmp`, to keep llama.cpp's ties.
    fn cmp(&self, other: &Self) -> Ordering {
        let by_score = if self.score < other.score {
            Ordering::Less
        } else if self.score > other.score {
            Ordering::Greater
        } else {
            Ordering::Equal
        };
        by_score.then_with(|| other.left.cmp(&self.left))
    }
}

/// Byte-fallback token text for `b`, as SentencePiece spells it.
pub(crate) fn byte_token_text(b: u8) -> String {
    format!("<0x{b:02X}>")
}

/// Parses `<0xNN>` back into its byte.
pub(crate) fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

impl SpmModel {
    pub fn new(vocab: &Vocab, scores: Vec<Option<f32>>, unk: Option<u32>) -> Self {
        let mut byte_tokens = Box::new([None; 256]);
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            let b = b as u8;
            // llama.cpp's byte_to_token: the <0xNN> token, else the byte itself as a token.
            *slot = vocab.id(&byte_token_text(b)).or_else(|| {
                let single = [b];
                std::str::from_utf8(&single).ok().and_then(|s| vocab.id(s))
            });
        }
        SpmModel {
            scores,
            byte_tokens,
            unk,
        }
    }

    pub fn unk(&self) -> Option<u32> {
        self.unk
    }

    pub fn score(&self, id: u32) -> Option<f32> {
        self.scores.get(id as usize).copied().flatten()
    }

    /// Tokenizes `text`, which must already have spaces escaped as [`SPACE_MARK`].
    pub fn encode(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            symbols.push(Symbol {
                prev: i.checked_sub(1),
                next: None,
                start,
                len: c.len_utf8(),
            });
            if i > 0 {
                symbols[i - 1].next = Some(i);
            }
        }
        if symbols.is_empty() {
            return Ok(());
        }

        let mut queue = BinaryHeap::new();
        for i in 1..symbols.len() {
            self.push_bigram(vocab, text, &symbols, i - 1, i, &mut queue);
        }

        while let Some(bigram) = queue.pop() {
            let (l, r) = (symbols[bigram.left], symbols[bigram.right]);
            // Stale entry: one side has already been merged into something else.
            if l.len == 0 || r.len == 0 || l.len + r.len != bigram.size {
                continue;
            }
            symbols[bigram.left].len += r.len;
            symbols[bigram.right].len = 0;
            symbols[bigram.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(bigram.left);
            }
            if let Some(p) = l.prev {
                self.push_bigram(vocab, text, &symbols, p, bigram.left, &mut queue);
            }
            if let Some(n) = r.next {
                self.push_bigram(vocab, text, &symbols, bigram.left, n, &mut queue);
            }
        }

        let mut cursor = Some(0);
        while let Some(i) = cursor {
            let sym = symbols[i];
            let piece = &text[sym.start..sym.start + sym.len];
            match vocab.id(piece) {
                Some(id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        let id = self.byte_tokens[b as usize]
                            .or(self.unk)
                            .ok_or(TokenizerError::NoByteToken { byte: b })?;
                        out.push(id);
                    }
                }
            }
            cursor = sym.next;
        }
        Ok(())
    }

    fn push_bigram(
        &self,
        vocab: &Vocab,
        text: &str,
        symbols: &[Symbol],
        left: usize,
        right: usize,
        queue: &mut BinaryHeap<Bigram>,
    ) {
        let start = symbols[left].start;
        let size = symbols[left].len + symbols[right].len;
        let Some(id) = vocab.id(&text[start..start + size]) else {
            return;
        };
        let Some(score) = self.score(id) else {
            return;
        };
        queue.push(Bigram {
            left,
            right,
            score,
            size,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::TokenAttr;

    fn model(entries: &[(&str, f32)]) -> (Vocab, SpmModel) {
        let mut pieces: Vec<String> = entries.iter().map(|(p, _)| p.to_string()).collect();
        let mut scores: Vec<Option<f32>> = entries.iter().map(|&(_, s)| Some(s)).collect();
        for b in 0..=255u8 {
            pieces.push(byte_token_text(b));
            scores.push(Some(0.0));
        }
        let mut attrs = vec![TokenAttr::NORMAL; entries.len()];
        attrs.extend(std::iter::repeat_n(TokenAttr::BYTE, 256));
        let vocab = Vocab::new(pieces, attrs).expect("valid vocab");
        let spm = SpmModel::new(&vocab, scores, None);
        (vocab, spm)
    }

    fn encode(vocab: &Vocab, spm: &SpmModel, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        spm.encode(vocab, text, &mut out).expect("encodes");
        out
    }

    #[test]
    fn highest_score_merges_first() {
        // "abc": "ab" (-1) beats "bc" (-2), then "abc" needs "ab"+"c".
        let (v, spm) = model(&[
            ("a", -10.0),
            ("b", -10.0),
            ("c", -10.0),
            ("ab", -1.0),
            ("bc", -2.0),
        ]);
        assert_eq!(encode(&v, &spm, "abc"), vec![3, 2]);
        let (v, spm) = model(&[
            ("a", -10.0),
            ("b", -10.0),
            ("c", -10.0),
            ("ab", -3.0),
            ("bc", -2.0),
        ]);
        assert_eq!(encode(&v, &spm, "abc"), vec![0, 4]);
    }

    #[test]
    fn ties_merge_leftmost_first() {
        // "aaa": both "aa" pairs tie; the left one wins, leaving "a" on the right.
        let (v, spm) = model(&[("a", -10.0), ("aa", -1.0)]);
        assert_eq!(encode(&v, &spm, "aaa"), vec![1, 0]);
    }

    #[test]
    fn unknown_characters_fall_back_to_bytes() {
        let (v, spm) = model(&[("a", -1.0)]);
        let ids = encode(&v, &spm, "aé");
        let e_acute = "é".as_bytes();
        assert_eq!(
            ids,
            vec![
                0,
                v.id(&byte_token_text(e_acute[0])).expect("byte token"),
                v.id(&byte_token_text(e_acute[1])).expect("byte token"),
            ]
        );
    }

    #[test]
    fn byte_token_text_round_trips() {
        assert_eq!(byte_token_text(0x0a), "<0x0A>");
        assert_eq!(parse_byte_token("<0x0A>"), Some(0x0a));
        assert_eq!(parse_byte_token("<0xFF>"), Some(0xff));
        assert_eq!(parse_byte_token("<0x0>"), None);
        assert_eq!(parse_byte_token("0x0A"), None);
    }
}
