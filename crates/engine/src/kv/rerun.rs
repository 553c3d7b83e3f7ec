//! [`RerunKv`]: a sequence's paged cache as one step of the engine writes it, where positions
//! that are already stored may be run through the layers again without being written twice.
//!
//! The engine runs every scheduled token through all layers `0..depth`. Usually each layer
//! stores exactly the new positions. After the depth is raised, the new layers lack K/V for
//! earlier positions while the old layers have them: the engine then re-runs those positions
//! from the embeddings through all layers (the hidden state at the old depth was not kept),
//! and only the layers that lack them store them. Positions below a layer's stored length
//! hold K/V computed from the same tokens by the same row-independent kernels (see the batch
//! invariance note in `switchyard_models::attention`), so skipping the write loses nothing;
//! it also leaves blocks shared through the prefix cache (read-only) untouched.

use switchyard_models::{KvChunk, SeqKv};

use super::PagedKv;

/// Writes only positions at or past each layer's stored length; reads as the wrapped cache.
pub struct RerunKv<'a> {
    kv: &'a mut PagedKv,
}

impl<'a> RerunKv<'a> {
    pub fn new(kv: &'a mut PagedKv) -> Self {
        Self { kv }
    }
}

impl SeqKv for RerunKv<'_> {
    fn write(
        &mut self,
        layer: usize,
        start: usize,
        k: &[f32],
        v: &[f32],
    ) -> switchyard_models::Result<()> {
        let row = self.kv.row();
        let stored = self.kv.len(layer);
        let n = k.len() / row.max(1);
        if start >= stored || k.len() != v.len() || !k.len().is_multiple_of(row) {
            return self.kv.write(layer, start, k, v);
        }
        let end = start + n;
        if end <= stored {
            return Ok(());
        }
        let skip = (stored - start) * row;
        self.kv.write(layer, stored, &k[skip..], &v[skip..])
    }

    fn chunks(&self, layer: usize, len: usize) -> switchyard_models::Result<Vec<KvChunk<'_>>> {
        self.kv.chunks(layer, len)
    }

    fn len(&self, layer: usize) -> usize {
        self.kv.len(layer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{BlockPool, PrefixCache};

    fn rows(from: usize, to: usize, base: f32) -> Vec<f32> {
        (from..to).map(|p| base + p as f32).collect()
    }

    #[test]
    fn writes_only_what_is_missing() {
        let mut pool = BlockPool::new(1, 4, 8);
        let mut cache = PrefixCache::new(4);
        let mut kv = PagedKv::for_pool(&pool, 2);
        kv.reserve(&mut pool, 0..2, 10).expect("reserve");
        kv.write(0, 0, &rows(0, 6, 0.0), &rows(0, 6, 0.0))
            .expect("write");
        let mut re = RerunKv::new(&mut kv);
        // Layer 0 has 0..6: a re-run of 0..10 keeps 0..6 and stores 6..10.
        re.write(0, 0, &rows(0, 10, 100.0), &rows(0, 10, 100.0))
            .expect("rerun");
        // Layer 1 is empty: everything is stored.
        re.write(1, 0, &rows(0, 10, 200.0), &rows(0, 10, 200.0))
            .expect("rerun");
        // Entirely stored already: nothing happens.
        re.write(0, 2, &rows(2, 4, 900.0), &rows(2, 4, 900.0))
            .expect("rerun");
        assert_eq!((re.len(0), re.len(1)), (10, 10));
        let k0: Vec<f32> = kv
            .chunks(0, 10)
            .expect("chunks")
            .iter()
            .flat_map(|c| c.k.to_vec())
            .collect();
        let mut want = rows(0, 6, 0.0);
        want.extend(rows(6, 10, 100.0));
        assert_eq!(k0, want);
        let k1: Vec<f32> = kv
            .chunks(1, 10)
            .expect("chunks")
            .iter()
            .flat_map(|c| c.k.to_vec())
            .collect();
        assert_eq!(k1, rows(0, 10, 200.0));
        // A gap is still an error.
        let mut re = RerunKv::new(&mut kv);
        assert!(re.write(1, 11, &[1.0], &[1.0]).is_err());
        kv.release(&mut pool, &mut cache);
    }
}
