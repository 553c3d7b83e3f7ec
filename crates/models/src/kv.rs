//! The key/value cache seen by the model: per sequence, per layer, rows of `n_kv_heads * head_dim`
//! f32 values, one row per position, exposed as a list of contiguous chunks.
//!
//! Chunks are how one attention kernel serves both a dense per-sequence cache (one chunk) and a
//! paged cache (one chunk per block) without copying the cache into a contiguous buffer.

use crate::{ModelError, Result};

/// A run of consecutive positions: `k` and `v` are `tokens * row` values each.
#[derive(Debug, Clone, Copy)]
pub struct KvChunk<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub tokens: usize,
}

/// One sequence's cache, as the model reads and writes it.
pub trait SeqKv: Send + Sync {
    /// Stores K and V rows for positions `start..start + n` of `layer` (`k.len() == n * row`).
    /// `start` may be below the stored length (overwrite, e.g. recomputation) but not above it;
    /// a cache may refuse to overwrite positions it shares with other sequences.
    fn write(&mut self, layer: usize, start: usize, k: &[f32], v: &[f32]) -> Result<()>;
    /// Positions `0..len` of `layer`, in order.
    fn chunks(&self, layer: usize, len: usize) -> Result<Vec<KvChunk<'_>>>;
    /// Number of positions stored for `layer`.
    fn len(&self, layer: usize) -> usize;
}

/// A contiguous, growable cache for one sequence: the simplest [`SeqKv`].
#[derive(Debug, Clone)]
pub struct DenseKv {
    row: usize,
    layers: Vec<(Vec<f32>, Vec<f32>)>,
}

impl DenseKv {
    pub fn new(n_layers: usize, row: usize) -> Self {
        Self {
            row,
            layers: vec![(Vec::new(), Vec::new()); n_layers],
        }
    }

    /// Drops every position at or after `len` in all layers.
    pub fn truncate(&mut self, len: usize) {
        for (k, v) in &mut self.layers {
            k.truncate(len * self.row);
            v.truncate(len * self.row);
        }
    }

    /// Bytes held by all layers.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|(k, v)| (k.len() + v.len()) * std::mem::size_of::<f32>())
            .sum()
    }
}

impl SeqKv for DenseKv {
    fn write(&mut self, layer: usize, start: usize, k: &[f32], v: &[f32]) -> Result<()> {
        let row = self.row;
        let n_layers = self.layers.len();
        let (ks, vs) = self
            .layers
            .get_mut(layer)
            .ok_or(ModelError::KvLayer { layer, n_layers })?;
        let stored = ks.len() / row;
        if start > stored || k.len() != v.len() || !k.len().is_multiple_of(row) {
            return Err(ModelError::KvWrite {
                layer,
                start,
                stored,
                values: k.len(),
                row,
            });
        }
        let at = start * row;
        let overlap = (ks.len() - at).min(k.len());
        ks[at..at + overlap].copy_from_slice(&k[..overlap]);
        vs[at..at + overlap].copy_from_slice(&v[..overlap]);
        ks.extend_from_slice(&k[overlap..]);
        vs.extend_from_slice(&v[overlap..]);
        Ok(())
    }

    fn chunks(&self, layer: usize, len: usize) -> Result<Vec<KvChunk<'_>>> {
        let (ks, vs) = self.layers.get(layer).ok_or(ModelError::KvLayer {
            layer,
            n_layers: self.layers.len(),
        })?;
        let stored = ks.len() / self.row;
        if len > stored {
            return Err(ModelError::KvMissing { layer, len, stored });
        }
        let n = len * self.row;
        Ok(vec![KvChunk {
            k: &ks[..n],
            v: &vs[..n],
            tokens: len,
        }])
    }

    fn len(&self, layer: usize) -> usize {
        self.layers
            .get(layer)
            .map_or(0, |(k, _)| k.len() / self.row)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_appends_and_overwrites() {
        let mut kv = DenseKv::new(2, 2);
        kv.write(1, 0, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0])
            .unwrap();
        assert_eq!(kv.len(1), 2);
        assert_eq!(kv.len(0), 0);
        kv.write(1, 1, &[9.0, 9.0, 10.0, 10.0], &[0.0; 4]).unwrap();
        let c = kv.chunks(1, 3).unwrap();
        assert_eq!(c[0].k, &[1.0, 2.0, 9.0, 9.0, 10.0, 10.0]);
        assert_eq!(c[0].v, &[5.0, 6.0, 0.0, 0.0, 0.0, 0.0]);
        assert!(kv.write(0, 1, &[1.0, 1.0], &[1.0, 1.0]).is_err());
        assert!(kv.chunks(1, 4).is_err());
        assert_eq!(kv.bytes(), 2 * 6 * 4);
    }
}
