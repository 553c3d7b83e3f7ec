//! [`PagedKv`]: one sequence's KV cache as a block table per layer, read by the model as one
//! chunk per block.
//!
//! Memory is taken from the [`BlockPool`] only in [`PagedKv::reserve`], all or nothing, before
//! the step that writes it; [`SeqKv::write`] into positions that were not reserved is an error.
//! A layer's table starts with the blocks shared through the prefix cache (read-only, behind an
//! `Arc`) and continues with blocks the sequence owns. In 8-bit blocks a write quantizes each
//! row on the way in (one scale per position and key/value head, so a row's bytes depend on
//! that row alone) and reads hand attention the 8-bit rows as they are.

use std::ops::Range;
use std::sync::Arc;

use half::slice::HalfFloatSliceExt;
use switchyard_models::kv::{quantize_kv_int8, F16Rows, Int8Rows};
use switchyard_models::{KvChunk, SeqKv};

use super::format::BlockLayout;
use super::pool::{Block, BlockData, BlockId, BlockPool};
use super::KvError;

/// One link of the prefix cache's hash chain: with a serial, it names a shared block's entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// Where a sequence's shared blocks go when it lets go of them: the prefix cache, which
/// implements this. A trait, so that the block table does not depend on the cache that
/// shares blocks into it.
pub trait SharedBlocks {
    /// The sequence drops its reference to `block`, shared as entry (`hash`, `serial`) of
    /// `layer`; a block nobody holds any more returns to `pool`.
    fn unref(
        &mut self,
        layer: usize,
        hash: BlockHash,
        serial: u64,
        block: Arc<Block>,
        pool: &mut BlockPool,
    );
}

/// One entry of a block table.
pub(super) enum Slot {
    Owned(Block),
    /// A full block published to the prefix cache; `hash` and `serial` name its cache entry.
    Shared {
        block: Arc<Block>,
        hash: BlockHash,
        serial: u64,
    },
    /// Only while a slot's block is being moved (never seen outside one call).
    Vacant,
}

impl Slot {
    fn block(&self) -> Option<&Block> {
        match self {
            Slot::Owned(b) => Some(b),
            Slot::Shared { block, .. } => Some(block),
            Slot::Vacant => None,
        }
    }
}

/// One layer's blocks and how many positions of them are written.
#[derive(Default)]
pub(super) struct Table {
    pub(super) slots: Vec<Slot>,
    /// Positions written (`0..len` readable).
    pub(super) len: usize,
    /// The first `shared` slots are [`Slot::Shared`], the rest [`Slot::Owned`].
    pub(super) shared: usize,
}

/// Whether a sequence owns a block or shares it through the prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    Owned,
    Shared,
}

/// A block in a sequence's tables, for accounting and checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRef {
    pub layer: usize,
    /// Position of the block in the layer's table (it holds positions `index * block_tokens..`).
    pub index: usize,
    pub id: BlockId,
    pub sharing: Sharing,
}

/// One sequence's paged KV cache.
pub struct PagedKv {
    layout: BlockLayout,
    tables: Vec<Table>,
}

impl std::fmt::Debug for PagedKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedKv")
            .field("layout", &self.layout)
            .field(
                "lens",
                &self.tables.iter().map(|t| t.len).collect::<Vec<_>>(),
            )
            .field("owned_blocks", &self.owned_blocks())
            .field("shared_blocks", &self.shared_blocks())
            .finish()
    }
}

impl PagedKv {
    /// An empty f32 cache for a model of `n_layers` layers; no blocks are taken until
    /// [`PagedKv::reserve`].
    pub fn new(n_layers: usize, row: usize, block_tokens: usize) -> Self {
        Self::with_layout(n_layers, BlockLayout::f32(row, block_tokens))
    }

    /// An empty cache of blocks laid out as `layout`.
    pub fn with_layout(n_layers: usize, layout: BlockLayout) -> Self {
        Self {
            layout,
            tables: (0..n_layers).map(|_| Table::default()).collect(),
        }
    }

    /// An empty cache laid out like `pool`'s blocks.
    pub fn for_pool(pool: &BlockPool, n_layers: usize) -> Self {
        Self::with_layout(n_layers, pool.layout())
    }

    pub fn n_layers(&self) -> usize {
        self.tables.len()
    }

    pub fn layout(&self) -> BlockLayout {
        self.layout
    }

    pub fn row(&self) -> usize {
        self.layout.row
    }

    pub fn block_tokens(&self) -> usize {
        self.layout.block_tokens
    }

    /// Positions of `layer` that blocks are reserved for (0 for a layer with no blocks).
    pub fn capacity(&self, layer: usize) -> usize {
        self.tables
            .get(layer)
            .map_or(0, |t| t.slots.len() * self.layout.block_tokens)
    }

    /// Leading positions of `layer` held in blocks shared through the prefix cache.
    pub fn shared_len(&self, layer: usize) -> usize {
        self.tables
            .get(layer)
            .map_or(0, |t| t.shared * self.layout.block_tokens)
    }

    /// Blocks [`PagedKv::reserve`] would take from the pool for `layers` and `len`.
    pub fn blocks_needed(&self, layers: Range<usize>, len: usize) -> usize {
        let per_layer = len.div_ceil(self.layout.block_tokens);
        layers
            .map(|l| {
                let have = self.tables.get(l).map_or(0, |t| t.slots.len());
                per_layer.saturating_sub(have)
            })
            .sum()
    }

    /// Takes blocks from `pool` so positions `0..len` fit in every layer of `layers`. All or
    /// nothing: when the pool has fewer free blocks than needed, nothing is taken.
    pub fn reserve(
        &mut self,
        pool: &mut BlockPool,
        layers: Range<usize>,
        len: usize,
    ) -> Result<(), KvError> {
        self.check_layers(&layers)?;
        if pool.layout() != self.layout {
            return Err(KvError::LayoutMismatch {
                row: self.layout.row,
                block_tokens: self.layout.block_tokens,
                format: self.layout.format,
                pool_row: pool.row(),
                pool_block_tokens: pool.block_tokens(),
                pool_format: pool.format(),
            });
        }
        let needed = self.blocks_needed(layers.clone(), len);
        if needed == 0 {
            return Ok(());
        }
        let _span = tracing::trace_span!("kv_reserve", needed, len).entered();
        let free = pool.free_blocks();
        if needed > free {
            return Err(KvError::OutOfBlocks { needed, free });
        }
        let per_layer = len.div_ceil(self.layout.block_tokens);
        for l in layers {
            let t = &mut self.tables[l];
            while t.slots.len() < per_layer {
                let block = pool
                    .allocate()
                    .ok_or(KvError::OutOfBlocks { needed, free })?;
                t.slots.push(Slot::Owned(block));
            }
        }
        Ok(())
    }

    /// Forgets every position at or after `len` in all layers. Blocks stay reserved, so the
    /// positions can be written again (speculative decoding rolls back this way), except those
    /// in shared blocks: publish only positions that will not be rolled back.
    pub fn truncate(&mut self, len: usize) {
        for t in &mut self.tables {
            t.len = t.len.min(len);
        }
    }

    /// Returns every owned block to `pool` and drops this sequence's references to shared
    /// ones (a shared block the cache no longer holds goes back to the pool with its last
    /// reference). The sequence is empty afterwards and can be reused.
    pub fn release(&mut self, pool: &mut BlockPool, cache: &mut impl SharedBlocks) {
        let n = self.tables.len();
        self.release_layers(pool, cache, 0..n);
    }

    /// [`PagedKv::release`] for `layers` only (their layer weights were dropped). Layers past
    /// the cache's are ignored.
    pub fn release_layers(
        &mut self,
        pool: &mut BlockPool,
        cache: &mut impl SharedBlocks,
        layers: Range<usize>,
    ) {
        let _span = tracing::trace_span!("kv_release").entered();
        let end = layers.end.min(self.tables.len());
        for l in layers.start.min(end)..end {
            let t = &mut self.tables[l];
            // Tail first: the cache's LRU then evicts a chain's last blocks before its first
            // ones, which more sequences share (vLLM frees in the same order).
            while let Some(slot) = t.slots.pop() {
                match slot {
                    Slot::Owned(b) => pool.release(b),
                    Slot::Shared {
                        block,
                        hash,
                        serial,
                    } => cache.unref(l, hash, serial, block, pool),
                    Slot::Vacant => {}
                }
            }
            t.len = 0;
            t.shared = 0;
        }
    }

    /// Blocks this sequence owns (not shared), over all layers.
    pub fn owned_blocks(&self) -> usize {
        self.tables.iter().map(|t| t.slots.len() - t.shared).sum()
    }

    /// Blocks this sequence shares through the prefix cache, over all layers.
    pub fn shared_blocks(&self) -> usize {
        self.tables.iter().map(|t| t.shared).sum()
    }

    /// Every block in the tables, layer by layer.
    pub fn blocks(&self) -> impl Iterator<Item = BlockRef> + '_ {
        self.tables.iter().enumerate().flat_map(|(layer, t)| {
            t.slots.iter().enumerate().filter_map(move |(index, s)| {
                let sharing = match s {
                    Slot::Owned(_) => Sharing::Owned,
                    Slot::Shared { .. } => Sharing::Shared,
                    Slot::Vacant => return None,
                };
                s.block().map(|b| BlockRef {
                    layer,
                    index,
                    id: b.id(),
                    sharing,
                })
            })
        })
    }

    /// [`SeqKv::write`] with the cache's own error.
    pub fn write_rows(
        &mut self,
        layer: usize,
        start: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), KvError> {
        let BlockLayout {
            row,
            head_dim,
            block_tokens: bt,
            ..
        } = self.layout;
        let heads = self.layout.heads();
        let n_layers = self.tables.len();
        let t = self
            .tables
            .get_mut(layer)
            .ok_or(KvError::NoSuchLayer { layer, n_layers })?;
        if start > t.len || k.len() != v.len() || !k.len().is_multiple_of(row) {
            return Err(KvError::BadWrite {
                layer,
                start,
                stored: t.len,
                values: k.len(),
                row,
            });
        }
        let n = k.len() / row;
        if n == 0 {
            return Ok(());
        }
        let end = start + n;
        let reserved = t.slots.len() * bt;
        if end > reserved {
            return Err(KvError::BeyondReserved {
                layer,
                start,
                end,
                reserved,
            });
        }
        if start < t.shared * bt {
            return Err(KvError::WriteShared {
                layer,
                position: start,
            });
        }
        let mut pos = start;
        while pos < end {
            let (b, off) = (pos / bt, pos % bt);
            let take = (bt - off).min(end - pos);
            let Slot::Owned(block) = &mut t.slots[b] else {
                return Err(KvError::WriteShared {
                    layer,
                    position: pos,
                });
            };
            let src = (pos - start) * row..(pos - start + take) * row;
            let dst = off * row..(off + take) * row;
            let vdst = bt * row + dst.start..bt * row + dst.end;
            match block.data_mut() {
                BlockData::F32(data) => {
                    data[dst].copy_from_slice(&k[src.clone()]);
                    data[vdst].copy_from_slice(&v[src]);
                }
                BlockData::F16(data) => {
                    // Round to nearest, ties to even (F16C where the CPU has it).
                    data[dst].convert_from_f32_slice(&k[src.clone()]);
                    data[vdst].convert_from_f32_slice(&v[src]);
                }
                BlockData::Int8(b) => {
                    let sdst = off * heads..(off + take) * heads;
                    let vsdst = bt * heads + sdst.start..bt * heads + sdst.end;
                    let (values, scales) = (&mut b.values, &mut b.scales);
                    quantize_kv_int8(
                        &k[src.clone()],
                        head_dim,
                        &mut values[dst],
                        &mut scales[sdst],
                    );
                    quantize_kv_int8(&v[src], head_dim, &mut values[vdst], &mut scales[vsdst]);
                }
            }
            pos += take;
        }
        t.len = t.len.max(end);
        Ok(())
    }

    /// [`SeqKv::chunks`] with the cache's own error: one chunk per block, the last one partial.
    pub fn chunk_list(&self, layer: usize, len: usize) -> Result<Vec<KvChunk<'_>>, KvError> {
        let (row, bt, heads) = (
            self.layout.row,
            self.layout.block_tokens,
            self.layout.heads(),
        );
        let t = self.tables.get(layer).ok_or(KvError::NoSuchLayer {
            layer,
            n_layers: self.tables.len(),
        })?;
        if len > t.len {
            return Err(KvError::Missing {
                layer,
                len,
                stored: t.len,
            });
        }
        let n_blocks = len.div_ceil(bt);
        let mut out = Vec::with_capacity(n_blocks);
        for (b, slot) in t.slots[..n_blocks].iter().enumerate() {
            let tokens = bt.min(len - b * bt);
            let (k, v) = (0..tokens * row, bt * row..(bt + tokens) * row);
            out.push(match slot.block().map(Block::data) {
                Some(BlockData::F32(data)) => KvChunk::f32(&data[k], &data[v], tokens),
                Some(BlockData::F16(data)) => KvChunk::f16(
                    F16Rows {
                        k: &data[k],
                        v: &data[v],
                    },
                    tokens,
                ),
                Some(BlockData::Int8(d)) => KvChunk::int8(
                    Int8Rows {
                        k: &d.values[k],
                        v: &d.values[v],
                        k_scales: &d.scales[..tokens * heads],
                        v_scales: &d.scales[bt * heads..(bt + tokens) * heads],
                    },
                    tokens,
                ),
                // Never seen outside a call that moves a block; attention refuses an empty
                // chunk rather than reading it.
                None => KvChunk::f32(&[], &[], tokens),
            });
        }
        Ok(out)
    }

    fn check_layers(&self, layers: &Range<usize>) -> Result<(), KvError> {
        if layers.end > self.tables.len() || layers.start > layers.end {
            return Err(KvError::NoSuchLayers {
                start: layers.start,
                end: layers.end,
                n_layers: self.tables.len(),
            });
        }
        Ok(())
    }

    pub(super) fn table(&self, layer: usize) -> Option<&Table> {
        self.tables.get(layer)
    }

    pub(super) fn table_mut(&mut self, layer: usize) -> Option<&mut Table> {
        self.tables.get_mut(layer)
    }

    pub(super) fn check_layer_range(&self, layers: &Range<usize>) -> Result<(), KvError> {
        self.check_layers(layers)
    }
}

impl Drop for PagedKv {
    fn drop(&mut self) {
        let held = self.owned_blocks() + self.shared_blocks();
        if held > 0 {
            tracing::warn!(
                held,
                "PagedKv dropped holding blocks; call release() to return them to the pool"
            );
        }
    }
}

impl SeqKv for PagedKv {
    fn write(
        &mut self,
        layer: usize,
        start: usize,
        k: &[f32],
        v: &[f32],
    ) -> switchyard_models::Result<()> {
        Ok(self.write_rows(layer, start, k, v)?)
    }

    fn chunks(&self, layer: usize, len: usize) -> switchyard_models::Result<Vec<KvChunk<'_>>> {
        Ok(self.chunk_list(layer, len)?)
    }

    fn len(&self, layer: usize) -> usize {
        self.tables.get(layer).map_or(0, |t| t.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::BLOCK_TOKENS;

    const ROW: usize = 3;

    /// These tests share no block, so nothing comes back through the cache.
    struct NoCache;

    impl SharedBlocks for NoCache {
        fn unref(&mut self, _: usize, _: BlockHash, _: u64, _: Arc<Block>, _: &mut BlockPool) {
            panic!("no block of these tests is shared");
        }
    }

    /// Distinct values for position `p` of `layer`: K = 1000 l + 10 p + c, V negated.
    fn rows(layer: usize, range: Range<usize>) -> (Vec<f32>, Vec<f32>) {
        let k: Vec<f32> = range
            .flat_map(|p| (0..ROW).map(move |c| (1000 * layer + 10 * p + c) as f32))
            .collect();
        let v = k.iter().map(|x| -x).collect();
        (k, v)
    }

    fn gather(kv: &PagedKv, layer: usize, len: usize) -> (Vec<f32>, Vec<f32>, Vec<usize>) {
        let chunks = kv.chunk_list(layer, len).expect("chunks");
        let k = chunks.iter().flat_map(|c| c.k.iter().copied()).collect();
        let v = chunks.iter().flat_map(|c| c.v.iter().copied()).collect();
        (k, v, chunks.iter().map(|c| c.tokens).collect())
    }

    #[test]
    fn reserve_is_all_or_nothing() {
        let mut pool = BlockPool::new(ROW, BLOCK_TOKENS, 5);
        let mut cache = NoCache;
        let mut kv = PagedKv::for_pool(&pool, 4);
        // 33 positions = 3 blocks per layer; 2 layers = 6 > 5 free.
        assert_eq!(kv.blocks_needed(0..2, 33), 6);
        assert_eq!(
            kv.reserve(&mut pool, 0..2, 33),
            Err(KvError::OutOfBlocks { needed: 6, free: 5 })
        );
        assert_eq!((pool.free_blocks(), kv.owned_blocks()), (5, 0));
        assert_eq!(kv.capacity(0), 0);

        kv.reserve(&mut pool, 0..2, 20).expect("reserve");
        assert_eq!((pool.free_blocks(), kv.owned_blocks()), (1, 4));
        assert_eq!(
            (kv.capacity(0), kv.capacity(1), kv.capacity(2)),
            (32, 32, 0)
        );
        // Already covered: takes nothing.
        assert_eq!(kv.blocks_needed(0..2, 32), 0);
        kv.reserve(&mut pool, 0..2, 32).expect("reserve");
        assert_eq!(pool.free_blocks(), 1);
        // One more block per layer for 2 layers: 2 > 1, nothing taken.
        assert_eq!(kv.blocks_needed(0..2, 33), 2);
        assert!(kv.reserve(&mut pool, 0..2, 33).is_err());
        assert_eq!((pool.free_blocks(), kv.owned_blocks()), (1, 4));
        assert_eq!(
            kv.reserve(&mut pool, 2..5, 1),
            Err(KvError::NoSuchLayers {
                start: 2,
                end: 5,
                n_layers: 4
            })
        );
        kv.release(&mut pool, &mut cache);
        assert_eq!((pool.free_blocks(), pool.used_blocks()), (5, 0));
    }

    #[test]
    fn write_and_chunks_round_trip_across_blocks() {
        let mut pool = BlockPool::new(ROW, BLOCK_TOKENS, 8);
        let mut cache = NoCache;
        let mut kv = PagedKv::for_pool(&pool, 2);
        kv.reserve(&mut pool, 0..2, 45).expect("reserve");
        assert_eq!(pool.used_blocks(), 6);
        // Layer 1 in one write, layer 0 in pieces that straddle block boundaries.
        let (k, v) = rows(1, 0..45);
        kv.write(1, 0, &k, &v).expect("write");
        for r in [0..5, 5..17, 17..40, 40..45] {
            let (k, v) = rows(0, r.clone());
            kv.write(0, r.start, &k, &v).expect("write");
            assert_eq!(kv.len(0), r.end);
        }
        for layer in 0..2 {
            let (k, v, tokens) = gather(&kv, layer, 45);
            assert_eq!((k, v), rows(layer, 0..45));
            assert_eq!(tokens, vec![16, 16, 13]);
            let (k, _, tokens) = gather(&kv, layer, 20);
            assert_eq!(k, rows(layer, 0..20).0);
            assert_eq!(tokens, vec![16, 4]);
        }
        assert!(kv.chunk_list(0, 0).expect("chunks").is_empty());
        assert_eq!(
            kv.chunk_list(0, 46).err(),
            Some(KvError::Missing {
                layer: 0,
                len: 46,
                stored: 45
            })
        );
        // Overwrite inside (recomputation): the length stays.
        let (k, v) = rows(7, 10..20);
        kv.write(0, 10, &k, &v).expect("overwrite");
        assert_eq!(kv.len(0), 45);
        let (got, _, _) = gather(&kv, 0, 45);
        assert_eq!(&got[10 * ROW..20 * ROW], &k[..]);
        assert_eq!(&got[20 * ROW..], &rows(0, 20..45).0[..]);
        kv.release(&mut pool, &mut cache);
        assert_eq!(pool.used_blocks(), 0);
    }

    #[test]
    fn writes_outside_the_reservation_are_errors() {
        let mut pool = BlockPool::new(ROW, BLOCK_TOKENS, 2);
        let mut cache = NoCache;
        let mut kv = PagedKv::for_pool(&pool, 2);
        let (k, v) = rows(0, 0..20);
        // Nothing reserved yet.
        assert_eq!(
            kv.write_rows(0, 0, &k, &v),
            Err(KvError::BeyondReserved {
                layer: 0,
                start: 0,
                end: 20,
                reserved: 0
            })
        );
        kv.reserve(&mut pool, 0..1, 16).expect("reserve");
        assert_eq!(
            kv.write_rows(0, 0, &k, &v),
            Err(KvError::BeyondReserved {
                layer: 0,
                start: 0,
                end: 20,
                reserved: 16
            })
        );
        assert_eq!(kv.len(0), 0, "a failed write stores nothing");
        assert_eq!(pool.free_blocks(), 1, "a failed write allocates nothing");
        // Gaps, mismatched K/V, partial rows and unknown layers.
        assert!(matches!(
            kv.write_rows(0, 1, &k[..ROW], &v[..ROW]),
            Err(KvError::BadWrite { stored: 0, .. })
        ));
        assert!(matches!(
            kv.write_rows(0, 0, &k[..ROW], &v[..2 * ROW]),
            Err(KvError::BadWrite { .. })
        ));
        assert!(matches!(
            kv.write_rows(0, 0, &k[..ROW - 1], &v[..ROW - 1]),
            Err(KvError::BadWrite { .. })
        ));
        assert_eq!(
            kv.write_rows(2, 0, &k[..ROW], &v[..ROW]),
            Err(KvError::NoSuchLayer {
                layer: 2,
                n_layers: 2
            })
        );
        // Through the model's trait the same failures are model errors with the message.
        let e = SeqKv::write(&mut kv, 0, 0, &k, &v).unwrap_err().to_string();
        assert!(e.contains("beyond the 16 reserved positions"), "{e}");
        kv.release(&mut pool, &mut cache);
    }

    #[test]
    fn truncate_then_rewrite() {
        let mut pool = BlockPool::new(ROW, BLOCK_TOKENS, 4);
        let mut cache = NoCache;
        let mut kv = PagedKv::for_pool(&pool, 2);
        kv.reserve(&mut pool, 0..2, 30).expect("reserve");
        for l in 0..2 {
            let (k, v) = rows(l, 0..30);
            kv.write(l, 0, &k, &v).expect("write");
        }
        kv.truncate(18);
        assert_eq!((kv.len(0), kv.len(1)), (18, 18));
        assert_eq!(kv.capacity(0), 32, "blocks stay reserved");
        assert_eq!(pool.used_blocks(), 4);
        assert!(kv.chunk_list(0, 19).is_err());
        // Accepting different tokens after a rollback: rewrite 18..25.
        let (k, v) = rows(9, 18..25);
        kv.write(0, 18, &k, &v).expect("rewrite");
        let (got, _, tokens) = gather(&kv, 0, 25);
        assert_eq!(tokens, vec![16, 9]);
        assert_eq!(&got[..18 * ROW], &rows(0, 0..18).0[..]);
        assert_eq!(&got[18 * ROW..], &k[..]);
        kv.truncate(40);
        assert_eq!((kv.len(0), kv.len(1)), (25, 18), "truncate never extends");
        kv.release(&mut pool, &mut cache);
        assert_eq!(pool.used_blocks(), 0);
    }

    #[test]
    fn release_returns_every_block() {
        let mut pool = BlockPool::new(ROW, BLOCK_TOKENS, 20);
        let mut cache = NoCache;
        let mut a = PagedKv::for_pool(&pool, 3);
        let mut b = PagedKv::for_pool(&pool, 3);
        a.reserve(&mut pool, 0..3, 40).expect("reserve");
        b.reserve(&mut pool, 0..1, 100).expect("reserve");
        assert_eq!((a.owned_blocks(), b.owned_blocks()), (9, 7));
        assert_eq!(pool.used_blocks(), 16);
        let ids: Vec<BlockId> = a.blocks().chain(b.blocks()).map(|r| r.id).collect();
        let mut dedup = ids.clone();
        dedup.sort();
        dedup.dedup();
        assert_eq!(dedup.len(), 16);

        a.release_layers(&mut pool, &mut cache, 1..3);
        assert_eq!((a.owned_blocks(), pool.used_blocks()), (3, 10));
        assert_eq!((a.capacity(0), a.capacity(1)), (48, 0));
        a.release(&mut pool, &mut cache);
        b.release(&mut pool, &mut cache);
        assert_eq!((pool.used_blocks(), pool.free_blocks()), (0, 20));
        assert_eq!(a.blocks().count() + b.blocks().count(), 0);
        // A released sequence is reusable.
        a.reserve(&mut pool, 0..1, 1).expect("reserve");
        assert_eq!(pool.used_blocks(), 1);
        a.release(&mut pool, &mut cache);
    }

    #[test]
    fn pool_layout_must_match() {
        let mut pool = BlockPool::new(ROW + 1, BLOCK_TOKENS, 2);
        let mut kv = PagedKv::new(1, ROW, BLOCK_TOKENS);
        assert!(matches!(
            kv.reserve(&mut pool, 0..1, 1),
            Err(KvError::LayoutMismatch { .. })
        ));
        assert_eq!(pool.free_blocks(), 2);
    }

    /// 8-bit blocks: every row is quantized on its own (so a row's bytes do not depend on
    /// how the writes were split), reads give the 8-bit rows block by block, and dequantized
    /// they are within half a step of what was written.
    #[test]
    fn int8_blocks_quantize_each_row_alone() {
        use crate::kv::KvFormat;
        use switchyard_models::kv::Int8Rows;
        const HD: usize = 4;
        const HEADS: usize = 2;
        let layout = BlockLayout::new(HD * HEADS, HD, BLOCK_TOKENS, KvFormat::Int8);
        let mut pool = BlockPool::with_layout(layout, 8);
        let mut cache = NoCache;
        let mut kv = PagedKv::for_pool(&pool, 2);
        assert_eq!(kv.layout(), layout);
        kv.reserve(&mut pool, 0..2, 45).expect("reserve");
        // Values of very different size per head and position.
        let k: Vec<f32> = (0..45 * HD * HEADS)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * (1.0 + (i / HD % 7) as f32 * 3.0))
            .collect();
        let v: Vec<f32> = k.iter().map(|x| -0.01 * x).collect();
        kv.write(1, 0, &k, &v).expect("write");
        for r in [0..1, 1..17, 17..40, 40..45] {
            let span = r.start * HD * HEADS..r.end * HD * HEADS;
            kv.write(0, r.start, &k[span.clone()], &v[span])
                .expect("write");
        }
        let rows = |kv: &PagedKv, layer| -> (Vec<i8>, Vec<f32>, Vec<usize>) {
            let chunks = kv.chunk_list(layer, 45).expect("chunks");
            let mut q = Vec::new();
            let mut scales = Vec::new();
            for c in &chunks {
                assert!(c.k.is_empty() && c.v.is_empty());
                let Int8Rows {
                    k,
                    k_scales,
                    v,
                    v_scales,
                    ..
                } = c.int8.expect("8-bit chunk");
                assert_eq!(
                    (k.len(), v.len()),
                    (c.tokens * HD * HEADS, c.tokens * HD * HEADS)
                );
                assert_eq!(
                    (k_scales.len(), v_scales.len()),
                    (c.tokens * HEADS, c.tokens * HEADS)
                );
                q.extend(k.iter().chain(v));
                scales.extend(k_scales.iter().chain(v_scales));
            }
            (q, scales, chunks.iter().map(|c| c.tokens).collect())
        };
        let (q0, s0, tokens) = rows(&kv, 0);
        assert_eq!(rows(&kv, 1), (q0.clone(), s0.clone(), tokens.clone()));
        assert_eq!(tokens, vec![16, 16, 13]);
        // Dequantize K of layer 0 and compare with what was written.
        let chunks = kv.chunk_list(0, 45).expect("chunks");
        let mut pos = 0;
        for c in &chunks {
            let r = c.int8.expect("8-bit chunk");
            for t in 0..c.tokens {
                for h in 0..HEADS {
                    let scale = r.k_scales[t * HEADS + h];
                    for i in 0..HD {
                        let x = k[(pos + t) * HD * HEADS + h * HD + i];
                        let y = f32::from(r.k[t * HD * HEADS + h * HD + i]) * scale;
                        assert!(
                            (x - y).abs() <= scale * 0.5001,
                            "{x} vs {y} (scale {scale})"
                        );
                    }
                }
            }
            pos += c.tokens;
        }
        // Overwriting a row changes that row only.
        let span = 20 * HD * HEADS..21 * HD * HEADS;
        let bigger: Vec<f32> = k[span.clone()].iter().map(|x| x * 10.0).collect();
        kv.write(0, 20, &bigger, &v[span]).expect("overwrite");
        let (q, s, _) = rows(&kv, 0);
        let changed: Vec<usize> = (0..s.len()).filter(|&i| s[i] != s0[i]).collect();
        // Scales are laid out per block: K then V, 16 positions x 2 heads each; position 20
        // is the second block's 5th, its K scales at 64 + 4 * 2.
        assert_eq!(changed, vec![64 + 8, 64 + 9]);
        assert_eq!(q, q0, "the same integers at ten times the scale");
        assert_eq!(pool.block_bytes(), 16 * 2 * (8 + 2 * 4));
        kv.release(&mut pool, &mut cache);
        assert_eq!(pool.used_blocks(), 0);
    }

    #[test]
    fn formats_must_match() {
        use crate::kv::KvFormat;
        let mut pool =
            BlockPool::with_layout(BlockLayout::new(8, 4, BLOCK_TOKENS, KvFormat::Int8), 2);
        let mut kv = PagedKv::new(1, 8, BLOCK_TOKENS);
        let e = kv.reserve(&mut pool, 0..1, 1).unwrap_err();
        assert_eq!(
            e.to_string(),
            "sequence blocks hold 16 positions of 8 f32 values, the pool's (or prefix cache's) 16 of 8 int8"
        );
        assert_eq!(pool.free_blocks(), 2);
    }
}
