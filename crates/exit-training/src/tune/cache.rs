//! The hidden-state cache of `ee-tune`: the backbone is frozen, so the hidden states at the
//! exit depths and at the last layer are computed once per corpus split and kept in a
//! memory-mapped file; every epoch (and every later run with the same model, corpus and
//! depths) reads rows from it instead of running the model again.
//!
//! Three files per cache: `<key>.f32`, rows of `(depths + 1) × d_model` little-endian f32
//! (each exit depth's hidden state, then the last layer's, before the final norm), one per
//! predicting position; `<key>.first.f32`, the same for each document's position 0, which
//! predicts nothing scored but which a block head attends to; and `<key>.json`, a
//! [`CacheMeta`] that is written last, so a cache interrupted while being written has no
//! metadata and is rebuilt. Rows keep document order, and the metadata records each
//! document's row count, so a block head can be trained on whole sequences.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use switchyard_models::LayeredModel;
use switchyard_tokenizer::Tokenizer;

use crate::calibrate::{hidden_states, SKIP_POSITIONS};

// A document is its position-0 row followed by its cached rows, which start right after it.
const _: () = assert!(SKIP_POSITIONS == 1);
use crate::corpus::{Corpus, Split};
use switchyard_exits::{ExitsError, Result};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheMeta {
    /// SHA-256 of the model file: a cache is never read for another model.
    pub model_sha256: String,
    pub corpus: String,
    pub split: String,
    pub depths: Vec<usize>,
    pub d_model: usize,
    pub doc_tokens: usize,
    pub rows: usize,
    pub documents: usize,
    /// Rows of each document, in order (row positions `1..=n` of the document).
    pub doc_rows: Vec<usize>,
    /// The next token of each row (what the row predicts).
    pub next_tokens: Vec<u32>,
    /// UTF-8 bytes of the text the rows predict (bits per byte).
    pub bytes: u64,
}

/// A hidden-state cache, memory-mapped.
pub struct HiddenCache {
    pub meta: CacheMeta,
    map: memmap2::Mmap,
    first: memmap2::Mmap,
    /// First row of each document.
    doc_start: Vec<usize>,
}

/// What a cache is for.
pub struct CacheKey<'a> {
    pub model_sha256: &'a str,
    pub corpus: &'a Corpus,
    pub split: Split,
    pub depths: &'a [usize],
    pub doc_tokens: usize,
    pub rows: usize,
}

impl CacheKey<'_> {
    fn stem(&self) -> String {
        let depths: Vec<String> = self.depths.iter().map(usize::to_string).collect();
        format!(
            "{}-{}-{:?}-d{}-t{}-r{}",
            &self.model_sha256[..self.model_sha256.len().min(16)],
            self.corpus.name().replace(['/', '.'], "_"),
            self.split,
            depths.join("_"),
            self.doc_tokens,
            self.rows
        )
    }

    fn split_name(&self) -> String {
        format!("{:?}", self.split).to_lowercase()
    }
}

impl HiddenCache {
    /// Opens the cache for `key` in `dir`, building it first when it is missing or stale;
    /// `progress(rows_done, rows)` while building.
    pub fn open_or_build(
        dir: &Path,
        key: &CacheKey<'_>,
        model: &LayeredModel,
        tokenizer: &Tokenizer,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(ExitsError::io(dir))?;
        let stem = key.stem();
        let data = dir.join(format!("{stem}.f32"));
        let first = dir.join(format!("{stem}.first.f32"));
        let meta_path = dir.join(format!("{stem}.json"));
        if let Some(c) = Self::open(&data, &first, &meta_path, key)? {
            progress(c.meta.rows, c.meta.rows);
            return Ok(c);
        }
        let meta = build(&data, &first, key, model, tokenizer, &mut progress)?;
        let json = serde_json::to_vec(&meta)
            .map_err(|e| ExitsError::Internal(format!("cache metadata as JSON: {e}")))?;
        std::fs::write(&meta_path, json).map_err(ExitsError::io(&meta_path))?;
        Self::open(&data, &first, &meta_path, key)?
            .ok_or_else(|| ExitsError::Internal(format!("{} vanished", data.display())))
    }

    fn open(
        data: &Path,
        first_path: &Path,
        meta_path: &Path,
        key: &CacheKey<'_>,
    ) -> Result<Option<Self>> {
        let Ok(json) = std::fs::read(meta_path) else {
            return Ok(None);
        };
        let Ok(meta) = serde_json::from_slice::<CacheMeta>(&json) else {
            return Ok(None);
        };
        if meta.model_sha256 != key.model_sha256 || meta.depths != key.depths {
            return Ok(None);
        }
        let file = std::fs::File::open(data).map_err(ExitsError::io(data))?;
        // SAFETY: the cache file is only written before its metadata exists and never
        // modified afterwards; the map is read-only.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(ExitsError::io(data))?;
        let want = meta.rows * (meta.depths.len() + 1) * meta.d_model * 4;
        if map.len() != want
            || meta.next_tokens.len() != meta.rows
            || meta.doc_rows.iter().sum::<usize>() != meta.rows
        {
            return Ok(None);
        }
        let Ok(file) = std::fs::File::open(first_path) else {
            return Ok(None);
        };
        // SAFETY: as above.
        let first = unsafe { memmap2::Mmap::map(&file) }.map_err(ExitsError::io(first_path))?;
        if first.len() != meta.doc_rows.len() * (meta.depths.len() + 1) * meta.d_model * 4 {
            return Ok(None);
        }
        let doc_start = meta
            .doc_rows
            .iter()
            .scan(0, |at, &n| {
                let s = *at;
                *at += n;
                Some(s)
            })
            .collect();
        Ok(Some(Self {
            meta,
            map,
            first,
            doc_start,
        }))
    }

    pub fn rows(&self) -> usize {
        self.meta.rows
    }

    /// Rows `idx` of slot `slot` (`0..depths.len()` the exits, `depths.len()` the last
    /// layer) as a `[idx.len(), d_model]` f32 tensor.
    pub fn gather(&self, slot: usize, idx: &[usize], device: &Device) -> Result<Tensor> {
        let d = self.meta.d_model;
        let stride = (self.meta.depths.len() + 1) * d * 4;
        let mut out = Vec::with_capacity(idx.len() * d);
        for &r in idx {
            let at = r * stride + slot * d * 4;
            let bytes = self
                .map
                .get(at..at + d * 4)
                .ok_or_else(|| ExitsError::Internal(format!("cache row {r} out of range")))?;
            out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        }
        Ok(Tensor::from_vec(out, (idx.len(), d), device)?)
    }

    /// Documents in the cache.
    pub fn documents(&self) -> usize {
        self.meta.doc_rows.len()
    }

    /// Row indices of document `doc`.
    pub fn doc_rows(&self, doc: usize) -> std::ops::Range<usize> {
        let s = self.doc_start.get(doc).copied().unwrap_or(self.meta.rows);
        s..s + self.meta.doc_rows.get(doc).copied().unwrap_or(0)
    }

    /// Document `doc` at slot `slot` as one sequence from position 0 (the cached rows start at
    /// position [`SKIP_POSITIONS`], which is 1): its position-0 row,
    /// then its rows, `[1 + rows, d_model]`.
    pub fn document(&self, slot: usize, doc: usize, device: &Device) -> Result<Tensor> {
        let d = self.meta.d_model;
        let at = (doc * (self.meta.depths.len() + 1) + slot) * d * 4;
        let bytes = self
            .first
            .get(at..at + d * 4)
            .ok_or_else(|| ExitsError::Internal(format!("cache document {doc} out of range")))?;
        let first: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let first = Tensor::from_vec(first, (1, d), device)?;
        let idx: Vec<usize> = self.doc_rows(doc).collect();
        Ok(Tensor::cat(
            &[&first, &self.gather(slot, &idx, device)?],
            0,
        )?)
    }

    /// All rows of one slot.
    pub fn slot(&self, slot: usize, device: &Device) -> Result<Tensor> {
        let idx: Vec<usize> = (0..self.rows()).collect();
        self.gather(slot, &idx, device)
    }

    /// Index of `depth` among the cached exits.
    pub fn slot_of(&self, depth: usize) -> Option<usize> {
        self.meta.depths.iter().position(|&d| d == depth)
    }

    pub fn final_slot(&self) -> usize {
        self.meta.depths.len()
    }
}

fn build(
    data: &Path,
    first_path: &Path,
    key: &CacheKey<'_>,
    model: &LayeredModel,
    tokenizer: &Tokenizer,
    progress: &mut impl FnMut(usize, usize),
) -> Result<CacheMeta> {
    // A temporary name per process: two runs building the same cache at once each write their
    // own file and rename it into place (same contents), instead of one renaming the other's.
    let tmp = PathBuf::from(format!("{}.{}.tmp", data.display(), std::process::id()));
    let file = std::fs::File::create(&tmp).map_err(ExitsError::io(&tmp))?;
    let mut w = BufWriter::new(file);
    let tmp_first = PathBuf::from(format!(
        "{}.{}.tmp",
        first_path.display(),
        std::process::id()
    ));
    let first_file = std::fs::File::create(&tmp_first).map_err(ExitsError::io(&tmp_first))?;
    let mut first = BufWriter::new(first_file);
    let mut doc_rows = Vec::new();
    let d = model.spec().d_model;
    let mut rows = 0usize;
    let mut documents = 0usize;
    let mut next_tokens = Vec::with_capacity(key.rows);
    let mut bytes = 0u64;
    for doc in key.corpus.documents(tokenizer, key.split, key.doc_tokens)? {
        if rows >= key.rows {
            break;
        }
        let doc = doc?;
        if doc.tokens.len() < SKIP_POSITIONS + 2 {
            continue;
        }
        let (exits, last) = hidden_states(model, &doc.tokens, key.depths)?;
        // Row i predicts token i + 1; the first positions are skipped as in calibration.
        let take = (doc.tokens.len() - 1 - SKIP_POSITIONS).min(key.rows - rows);
        let lo = SKIP_POSITIONS;
        for t in exits.iter().chain(std::iter::once(&last)) {
            let row = t
                .narrow(0, 0, 1)?
                .to_dtype(candle_core::DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            for v in row {
                first
                    .write_all(&v.to_le_bytes())
                    .map_err(ExitsError::io(&tmp_first))?;
            }
        }
        let slots: Vec<Vec<f32>> = exits
            .iter()
            .chain(std::iter::once(&last))
            .map(|t| {
                t.narrow(0, lo, take)?
                    .to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()
            })
            .collect::<candle_core::Result<_>>()?;
        for r in 0..take {
            for s in &slots {
                for v in &s[r * d..(r + 1) * d] {
                    w.write_all(&v.to_le_bytes())
                        .map_err(ExitsError::io(&tmp))?;
                }
            }
        }
        let predicted = &doc.tokens[lo + 1..lo + 1 + take];
        next_tokens.extend_from_slice(predicted);
        bytes += tokenizer.decode(predicted, false)?.len() as u64;
        rows += take;
        documents += 1;
        doc_rows.push(take);
        progress(rows, key.rows);
    }
    w.flush().map_err(ExitsError::io(&tmp))?;
    drop(w);
    first.flush().map_err(ExitsError::io(&tmp_first))?;
    drop(first);
    if rows == 0 {
        return Err(ExitsError::EmptyCorpus {
            corpus: key.corpus.name().to_string(),
        });
    }
    std::fs::rename(&tmp, data).map_err(ExitsError::io(data))?;
    std::fs::rename(&tmp_first, first_path).map_err(ExitsError::io(first_path))?;
    Ok(CacheMeta {
        model_sha256: key.model_sha256.to_string(),
        corpus: key.corpus.name().to_string(),
        split: key.split_name(),
        depths: key.depths.to_vec(),
        d_model: d,
        doc_tokens: key.doc_tokens,
        rows,
        documents,
        doc_rows,
        next_tokens,
        bytes,
    })
}
