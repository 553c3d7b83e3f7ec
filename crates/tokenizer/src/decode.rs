//! Token ids back to text: llama.cpp's `token_to_piece` and `detokenize`, and a streaming decoder.

use std::sync::OnceLock;

use crate::error::Result;
use crate::spm::{parse_byte_token, SPACE_MARK};
use crate::vocab::{TokenAttr, Vocab};
use crate::Tokenizer;

/// How normal tokens spell their bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PieceStyle {
    /// GPT-2 byte-to-unicode mapping (byte-level BPE).
    ByteLevel,
    /// UTF-8 text with spaces written as `▁` (SentencePiece).
    SpaceMarked,
}

/// First code point past the GPT-2 byte alphabet (256 bytes, 68 of them moved up past 255).
const BYTE_LEVEL_LIMIT: usize = 256 + 68;

/// GPT-2's printable bytes, which map to the code point of the same value.
fn is_printable_byte(b: u32) -> bool {
    (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
}

/// Inverse of GPT-2's `bytes_to_unicode`, indexed by code point.
fn byte_level_table() -> &'static [Option<u8>; BYTE_LEVEL_LIMIT] {
    static TABLE: OnceLock<[Option<u8>; BYTE_LEVEL_LIMIT]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = [None; BYTE_LEVEL_LIMIT];
        let mut shifted = 0usize;
        for b in 0..=255u8 {
            if is_printable_byte(b as u32) {
                table[b as usize] = Some(b);
            } else {
                table[256 + shifted] = Some(b);
                shifted += 1;
            }
        }
        table
    })
}

/// Appends the bytes a byte-level token stands for. Characters outside the byte alphabet
/// (which llama.cpp turns into `[UNK_BYTE_..]` markers) are kept as their own UTF-8.
fn push_byte_level(piece: &str, out: &mut Vec<u8>) {
    let table = byte_level_table();
    for c in piece.chars() {
        match table.get(c as usize).copied().flatten() {
            Some(b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
}

/// Appends the bytes token `id` renders as; `special` renders control tokens as their text.
pub(crate) fn push_piece(
    vocab: &Vocab,
    style: PieceStyle,
    id: u32,
    special: bool,
    out: &mut Vec<u8>,
) -> Result<()> {
    vocab.checked(id)?;
    let (Some(attr), Some(piece)) = (vocab.attr(id), vocab.piece(id)) else {
        return Ok(());
    };
    if attr.is_hidden() && !special {
        return Ok(());
    }
    if attr.is_special() {
        out.extend_from_slice(piece.as_bytes());
    } else if attr.has(TokenAttr::NORMAL) {
        match style {
            PieceStyle::ByteLevel => push_byte_level(piece, out),
            PieceStyle::SpaceMarked => {
                let mut buf = [0u8; 4];
                for c in piece.chars() {
                    let c = if c == SPACE_MARK { ' ' } else { c };
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
            }
        }
    } else if attr.has(TokenAttr::BYTE) {
        if let Some(b) = parse_byte_token(piece) {
            out.push(b);
        }
    }
    // Unused and undefined tokens render as nothing, as in llama.cpp.
    Ok(())
}

/// llama.cpp's `clean_spaces` pass: drop the space before `?!.,`, around a lone `'`, and
/// before `'s`, `'m`, `'re` and `'ve`.
pub(crate) fn clean_spaces(text: &mut Vec<u8>) {
    let drop_space_before = |t: &[u8], i: usize| t[i - 1] == b' ' && b"?!.,".contains(&t[i]);
    let mut cleaned = Vec::with_capacity(text.len());
    for i in 0..text.len() {
        if i > 0 && drop_space_before(text, i) {
            cleaned.pop();
        }
        cleaned.push(text[i]);
    }

    // llama.cpp blanks the skipped space in place (`text[++i] = '\0'`), which stops it from
    // counting as the space before the next character; the copy here keeps that.
    let mut t = cleaned;
    let mut second = Vec::with_capacity(t.len());
    let mut i = 0;
    while i < t.len() {
        let x = t[i];
        if i > 0 && x == b'\'' && i + 1 < t.len() && t[i - 1] == b' ' && t[i + 1] == b' ' {
            second.pop();
            second.push(x);
            t[i + 1] = 0;
            i += 2;
            continue;
        }
        second.push(x);
        i += 1;
    }

    let t = second;
    let mut third = Vec::with_capacity(t.len());
    for i in 0..t.len() {
        let x = t[i];
        if i > 0 && t[i - 1] == b' ' && x == b'\'' && i + 1 < t.len() {
            let x1 = t[i + 1];
            let x2 = t.get(i + 2).copied();
            let contraction = matches!(x1, b's' | b'm')
                || (i + 2 < t.len() && matches!((x1, x2), (b'r', Some(b'e')) | (b'v', Some(b'e'))));
            if contraction {
                third.pop();
            }
        }
        third.push(x);
    }
    *text = third;
}

impl Tokenizer {
    /// Every token's own bytes, by id, as one token renders on its own in the middle of a
    /// text (no space prefix removed, no space cleaning), and whether it is a control token
    /// (rendered as its text). What a token-level grammar engine needs to know of the vocabulary.
    pub fn token_bytes(&self) -> Vec<(Vec<u8>, bool)> {
        (0..self.vocab.len() as u32)
            .map(|id| {
                let mut out = Vec::new();
                // Every id below the vocabulary's length is checked, so this cannot fail.
                let _ = push_piece(&self.vocab, self.style(), id, true, &mut out);
                let special = self.vocab.attr(id).is_some_and(|a| a.is_special());
                (out, special)
            })
            .collect()
    }

    /// llama.cpp's `detokenize(remove_special = skip, unparse_special = !skip)`, as UTF-8 with
    /// invalid sequences replaced by U+FFFD.
    pub(crate) fn decode_bytes(&self, ids: &[u32], skip_special: bool) -> Result<Vec<u8>> {
        let mut ids = ids;
        let mut remove_space = self.add_space_prefix;
        if skip_special && self.specials.add_bos {
            if let (Some(&first), Some(bos)) = (ids.first(), self.specials.bos) {
                if first == bos {
                    remove_space = false;
                    ids = &ids[1..];
                }
            }
        }
        if skip_special && self.specials.add_eos {
            if let (Some(&last), Some(eos)) = (ids.last(), self.specials.eos) {
                if last == eos {
                    ids = &ids[..ids.len() - 1];
                }
            }
        }
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let start = out.len();
            push_piece(&self.vocab, self.style(), id, !skip_special, &mut out)?;
            if remove_space && out.get(start) == Some(&b' ') {
                out.remove(start);
            }
            remove_space = false;
        }
        if self.clean_spaces {
            clean_spaces(&mut out);
        }
        Ok(out)
    }
}

/// Incremental detokenizer: text comes out as soon as it is whole UTF-8, so a token that ends
/// in the middle of a multi-byte character is held back until the rest arrives.
///
/// Control tokens render as nothing (as `decode(ids, true)` does); llama.cpp's `clean_spaces`
/// pass, which needs the whole text, is not applied (the zoo's tokenizers do not use it).
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    pending: Vec<u8>,
    seen_first: bool,
}

impl<'a> StreamDecoder<'a> {
    pub(crate) fn new(tokenizer: &'a Tokenizer) -> Self {
        StreamDecoder {
            tokenizer,
            pending: Vec::new(),
            seen_first: false,
        }
    }

    /// Adds one token; returns the text that became complete, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        let t = self.tokenizer;
        let first = !std::mem::replace(&mut self.seen_first, true);
        if first && t.specials.add_bos && t.specials.bos == Some(id) {
            // decode() drops a leading BOS and then keeps the next token's leading space.
            return Ok(None);
        }
        let start = self.pending.len();
        push_piece(&t.vocab, t.style(), id, false, &mut self.pending)?;
        if first && t.add_space_prefix && self.pending.get(start) == Some(&b' ') {
            self.pending.remove(start);
        }
        Ok(self.take_complete())
    }

    /// Returns whatever is still held back, with incomplete characters as U+FFFD.
    pub fn flush(&mut self) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        Some(text)
    }

    fn take_complete(&mut self) -> Option<String> {
        let mut text = String::new();
        let mut consumed = 0;
        loop {
            let rest = &self.pending[consumed..];
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    text.push_str(s);
                    consumed = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    text.push_str(&String::from_utf8_lossy(&rest[..valid]));
                    match e.error_len() {
                        // Truncated character at the end: wait for the next token.
                        None => {
                            consumed += valid;
                            break;
                        }
                        Some(bad) => {
                            text.push(char::REPLACEMENT_CHARACTER);
                            consumed += valid + bad;
                        }
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        (!text.is_empty()).then_some(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_alphabet_inverts() {
        let mut out = Vec::new();
        // "Ġ" is the space byte, "Ċ" the newline, "Ã©" the two UTF-8 bytes of "é".
        push_byte_level("ĠhiĊÃ©", &mut out);
        assert_eq!(out, " hi\né".as_bytes());
        let table = byte_level_table();
        assert_eq!(table.iter().flatten().count(), 256);
    }

    #[test]
    fn clean_spaces_matches_llama_cpp() {
        let mut t = b"Hello , world ! it 's a ' quote ' and we 're done .".to_vec();
        clean_spaces(&mut t);
        assert_eq!(
            String::from_utf8_lossy(&t),
            "Hello, world! it's a'quote'and we're done."
        );
        let mut t = b"don 't".to_vec();
        clean_spaces(&mut t);
        assert_eq!(t, b"don 't");
    }
}
