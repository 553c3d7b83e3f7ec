//! The hidden-state cache of `ee-tune`: the backbone is frozen, so the hidden states at the
//! exit depths and at the last layer are computed once per corpus split and kept in a
//! memory-mapped file; every epoch (and every later run with the same model, corpus and
//! depths) reads rows from it instead of running the model again.
//!
//! Two files per cache: `<key>.f32`, rows of `(depths + 1) × d_model` little-endian f32 (each
//! exit depth's hidden state, then the last layer's, before the final norm), and
//! `<key>.json`, a [`CacheMeta`] that is written last, so a cache interrupted while being
//! written has no metadata and is rebuilt.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use switchyard_models::LayeredModel;
use switchyard_tokenizer::Tokenizer;

use crate::calibrate::{hidden_states, SKIP_POSITIONS};
use crate::corpus::{Corpus, Split};
use crate::{ExitsError, Result};

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
    /// The next token of each row (what the row predicts).
    pub next_tokens: Vec<u32>,
    /// UTF-8 bytes of the text the rows predict (bits per byte).
    pub bytes: u64,
}

/// A hidden-state cache, memory-mapped.
pub struct HiddenCache {
    pub meta: CacheMeta,
    map: memmap2::Mmap,
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
        let meta_path = dir.join(format!("{stem}.json"));
        if let Some(c) = Self::open(&data, &meta_path, key)? {
            progress(c.meta.rows, c.meta.rows);
            return Ok(c);
        }
        let meta = build(&data, key, model, tokenizer, &mut progress)?;
        let json = serde_json::to_vec(&meta)
            .map_err(|e| ExitsError::Internal(format!("cache metadata as JSON: {e}")))?;
        std::fs::write(&meta_path, json).map_err(ExitsError::io(&meta_path))?;
        Self::open(&data, &meta_path, key)?
            .ok_or_else(|| ExitsError::Internal(format!("{} vanished", data.display())))
    }

    fn open(data: &Path, meta_path: &Path, key: &CacheKey<'_>) -> Result<Option<Self>> {
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
        if map.len() != want || meta.next_tokens.len() != meta.rows {
            return Ok(None);
        }
        Ok(Some(Self { meta, map }))
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
        progress(rows, key.rows);
    }
    w.flush().map_err(ExitsError::io(&tmp))?;
    drop(w);
    if rows == 0 {
        return Err(ExitsError::EmptyCorpus {
            corpus: key.corpus.name().to_string(),
        });
    }
    std::fs::rename(&tmp, data).map_err(ExitsError::io(data))?;
    Ok(CacheMeta {
        model_sha256: key.model_sha256.to_string(),
        corpus: key.corpus.name().to_string(),
        split: key.split_name(),
        depths: key.depths.to_vec(),
        d_model: d,
        doc_tokens: key.doc_tokens,
        rows,
        documents,
        next_tokens,
        bytes,
    })
}
