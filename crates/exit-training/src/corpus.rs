//! Calibration and evaluation text: ShareGPT conversations or a plain text file, cut into
//! token documents, with a fixed held-out split.
//!
//! Document `i` (the `i`-th usable ShareGPT conversation, or the `i`-th chunk of a text file)
//! is held out for evaluation when `i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1`; calibration uses
//! the others. The rule depends only on the file, so `calibrate` and `eval exits` agree on it
//! without sharing state.
//!
//! The zoo's ShareGPT file is one JSON array cut off mid-record. It is read here by a minimal
//! streaming splitter (top-level objects found by brace depth outside strings, each parsed
//! with serde), which stops quietly at the cut; the whole 125 MB is never loaded.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use switchyard_tokenizer::{ChatMessage, Tokenizer};

use switchyard_exits::{ExitsError, Result};

/// One document in `HELD_OUT_EVERY` is held out from calibration.
pub const HELD_OUT_EVERY: usize = 10;
/// Default cap on tokens taken from one document: long enough for realistic attention context,
/// short enough that a calibration budget spans many conversations.
pub const DEFAULT_DOC_TOKENS: usize = 512;

/// Which documents to take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Calibration,
    HeldOut,
    All,
}

impl Split {
    pub fn takes(self, index: usize) -> bool {
        let held = index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1;
        match self {
            Split::Calibration => !held,
            Split::HeldOut => held,
            Split::All => true,
        }
    }
}

/// Where documents come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Corpus {
    /// A ShareGPT JSON array (`[{"conversations": [{"from", "value"}, ...]}, ...]`).
    ShareGpt { name: String, path: PathBuf },
    /// Plain UTF-8 text, cut into chunks.
    Text { name: String, path: PathBuf },
}

/// A run of tokens from one conversation or text chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Document {
    /// Position in the corpus (all documents, held out or not).
    pub index: usize,
    pub tokens: Vec<u32>,
}

impl Corpus {
    /// A zoo dataset name (`sharegpt`, `shakespeare`, `milton`) or a file path. A file whose
    /// first non-blank byte is `[` is read as ShareGPT.
    pub fn resolve(name_or_path: &str) -> Result<Corpus> {
        let p = Path::new(name_or_path);
        let path = if p.exists() {
            p.to_path_buf()
        } else {
            match switchyard_zoo::find(name_or_path) {
                Some(a) if a.kind == switchyard_zoo::AssetKind::Dataset => {
                    switchyard_zoo::ensure(name_or_path)?
                }
                _ => {
                    return Err(ExitsError::Invalid(format!(
                        "{name_or_path} is neither a file nor a zoo dataset (sharegpt, shakespeare, milton)"
                    )))
                }
            }
        };
        let name = name_or_path.to_string();
        let mut head = [0u8; 64];
        let n = File::open(&path)
            .and_then(|mut f| f.read(&mut head))
            .map_err(ExitsError::io(&path))?;
        let first = head[..n].iter().find(|b| !b.is_ascii_whitespace());
        Ok(if first == Some(&b'[') {
            Corpus::ShareGpt { name, path }
        } else {
            Corpus::Text { name, path }
        })
    }

    pub fn name(&self) -> &str {
        match self {
            Corpus::ShareGpt { name, .. } | Corpus::Text { name, .. } => name,
        }
    }

    pub fn path(&self) -> &Path {
        match self {
            Corpus::ShareGpt { path, .. } | Corpus::Text { path, .. } => path,
        }
    }

    /// The documents of `split`, tokenized for `tokenizer`, each cut to `max_tokens`.
    pub fn documents<'t>(
        &self,
        tokenizer: &'t Tokenizer,
        split: Split,
        max_tokens: usize,
    ) -> Result<Box<dyn Iterator<Item = Result<Document>> + 't>> {
        let max_tokens = max_tokens.max(2);
        match self {
            Corpus::ShareGpt { path, .. } => {
                let file = File::open(path).map_err(ExitsError::io(path))?;
                let records = ShareGptRecords::new(BufReader::new(file), path.clone());
                let docs = records
                    .filter(|r| !matches!(r, Ok(c) if c.is_empty()))
                    .enumerate()
                    .filter(move |(i, _)| split.takes(*i))
                    .map(move |(index, conv)| {
                        let mut tokens = render_conversation(tokenizer, &conv?)?;
                        tokens.truncate(max_tokens);
                        Ok(Document { index, tokens })
                    });
                Ok(Box::new(docs))
            }
            Corpus::Text { path, .. } => {
                let bytes = std::fs::read(path).map_err(ExitsError::io(path))?;
                let text = String::from_utf8(bytes).map_err(|e| {
                    ExitsError::Invalid(format!("{} is not UTF-8: {e}", path.display()))
                })?;
                let ids = tokenizer.encode(&text, false, false)?;
                let bos = tokenizer.bos_id().filter(|_| tokenizer.adds_bos());
                let body = max_tokens - usize::from(bos.is_some());
                let docs: Vec<Document> = ids
                    .chunks(body)
                    .enumerate()
                    .filter(|(i, c)| split.takes(*i) && c.len() >= 2)
                    .map(|(index, c)| Document {
                        index,
                        tokens: bos.into_iter().chain(c.iter().copied()).collect(),
                    })
                    .collect();
                Ok(Box::new(docs.into_iter().map(Ok)))
            }
        }
    }
}

#[derive(Debug, Deserialize)]
struct Record {
    #[serde(default)]
    conversations: Vec<Turn>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Turn {
    pub from: String,
    pub value: String,
}

/// ShareGPT's role names in chat-template terms; `None` for roles a template cannot take.
fn chat_role(from: &str) -> Option<&'static str> {
    match from {
        "human" | "user" => Some("user"),
        "gpt" | "chatgpt" | "bard" | "assistant" => Some("assistant"),
        "system" => Some("system"),
        _ => None,
    }
}

/// The conversation as the model would see it served: through its chat template when it has
/// one (and the template accepts the turns), else as `role: text` paragraphs.
pub fn render_conversation(tokenizer: &Tokenizer, turns: &[Turn]) -> Result<Vec<u32>> {
    let msgs: Vec<ChatMessage> = turns
        .iter()
        .filter_map(|t| chat_role(&t.from).map(|r| ChatMessage::new(r, t.value.clone())))
        .collect();
    if tokenizer.chat_template().is_some() && !msgs.is_empty() {
        if let Ok(text) = tokenizer.apply_chat_template(&msgs, false) {
            let has_bos = tokenizer
                .bos_id()
                .and_then(|b| tokenizer.id_to_piece(b))
                .is_some_and(|b| text.starts_with(&b));
            return Ok(tokenizer.encode(&text, !has_bos, true)?);
        }
    }
    let text: String = turns
        .iter()
        .map(|t| format!("{}: {}\n\n", t.from, t.value))
        .collect();
    Ok(tokenizer.encode(&text, true, false)?)
}

/// The conversations of a ShareGPT JSON array, read one record at a time; ends quietly at a
/// record cut off by the end of the file.
pub struct ShareGptRecords<R: BufRead> {
    bytes: std::io::Bytes<R>,
    path: PathBuf,
    started: bool,
    done: bool,
}

impl<R: BufRead> ShareGptRecords<R> {
    pub fn new(reader: R, path: PathBuf) -> Self {
        Self {
            bytes: reader.bytes(),
            path,
            started: false,
            done: false,
        }
    }

    fn byte(&mut self) -> Result<Option<u8>> {
        match self.bytes.next() {
            None => Ok(None),
            Some(r) => r.map(Some).map_err(ExitsError::io(&self.path)),
        }
    }

    /// The bytes of the next top-level object, `None` at the end of the array or file.
    fn next_object(&mut self) -> Result<Option<Vec<u8>>> {
        if !self.started {
            loop {
                match self.byte()? {
                    None => return Ok(None),
                    Some(b'[') => break,
                    Some(b) if b.is_ascii_whitespace() => {}
                    Some(b) => {
                        return Err(ExitsError::Invalid(format!(
                            "{}: expected a JSON array, found {:?}",
                            self.path.display(),
                            b as char
                        )))
                    }
                }
            }
            self.started = true;
        }
        loop {
            match self.byte()? {
                None | Some(b']') => return Ok(None),
                Some(b'{') => break,
                Some(_) => {}
            }
        }
        let mut obj = vec![b'{'];
        let (mut depth, mut in_str, mut esc) = (1usize, false, false);
        while depth > 0 {
            let Some(b) = self.byte()? else {
                return Ok(None); // cut off mid-record
            };
            obj.push(b);
            if in_str {
                match (esc, b) {
                    (true, _) => esc = false,
                    (false, b'\\') => esc = true,
                    (false, b'"') => in_str = false,
                    _ => {}
                }
            } else {
                match b {
                    b'"' => in_str = true,
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => depth -= 1,
                    _ => {}
                }
            }
        }
        Ok(Some(obj))
    }
}

impl<R: BufRead> Iterator for ShareGptRecords<R> {
    /// A conversation's turns (empty for a record without any).
    type Item = Result<Vec<Turn>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        match self.next_object() {
            Ok(Some(obj)) => Some(
                serde_json::from_slice::<Record>(&obj)
                    .map(|r| r.conversations)
                    .map_err(|e| {
                        ExitsError::Invalid(format!("{}: bad record: {e}", self.path.display()))
                    }),
            ),
            Ok(None) => {
                self.done = true;
                None
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_split_and_a_cut_record_ends_the_stream() {
        let json =
            br#" [ {"id": "a", "conversations": [{"from": "human", "value": "hi {there} \" ]"},
            {"from": "gpt", "value": "yo"}]}, {"id": "b", "conversations": []},
            {"id": "c", "conversations": [{"from": "human", "value": "cut"#;
        let recs: Vec<Vec<Turn>> = ShareGptRecords::new(&json[..], PathBuf::from("t.json"))
            .collect::<Result<_>>()
            .unwrap();
        assert_eq!(recs.len(), 2);
        assert_eq!(recs[0][0].value, "hi {there} \" ]");
        assert_eq!(recs[0][1].from, "gpt");
        assert!(recs[1].is_empty());
    }

    #[test]
    fn the_held_out_split_is_every_tenth_document() {
        let held: Vec<usize> = (0..30).filter(|&i| Split::HeldOut.takes(i)).collect();
        assert_eq!(held, vec![9, 19, 29]);
        assert_eq!((0..30).filter(|&i| Split::Calibration.takes(i)).count(), 27);
        assert!((0..30).all(|i| Split::All.takes(i)));
    }
}
