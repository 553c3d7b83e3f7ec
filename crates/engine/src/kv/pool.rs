//! [`BlockPool`]: every KV block's memory, allocated up front and handed out as owned [`Block`]s.
//!
//! A block holds `block_tokens` positions of one layer: all K rows, then all V rows, each row
//! `n_kv_heads * head_dim` values, stored as the pool's [`BlockLayout`] says (f32, or i8 with
//! per-position scales). The pool allocates its blocks when it is created (and in
//! [`BlockPool::grow`]), in one huge-page region per call (see [`super::slab`]); `allocate` and
//! `release` only move blocks between the free list and their owners, so serving never
//! allocates KV memory. `grow` and `shrink` change the pool's
//! memory when residency changes (layers loaded or dropped), never per step.

use std::sync::atomic::{AtomicU32, Ordering};

use super::format::{BlockLayout, KvFormat};
use super::slab::Slab;

/// Positions per block.
pub const BLOCK_TOKENS: usize = 16; // vLLM's default block size

/// Tells pools apart, so a block can only return to the pool that made it.
static NEXT_POOL: AtomicU32 = AtomicU32::new(0);

/// A block's identity: which pool made it and its serial number there. Never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId {
    pub pool: u32,
    pub index: u64,
}

/// A block's memory, in its pool's format.
pub enum BlockData {
    /// `2 * block_tokens * row` f32: K rows `[0, block_tokens * row)`, then V rows.
    F32(Slab<f32>),
    /// As `F32`, in half floats.
    F16(Slab<half::f16>),
    Int8(Int8Block),
}

/// An 8-bit block: values and scales, K first then V in each (see
/// [`switchyard_models::kv::Int8Rows`] for what they mean).
pub struct Int8Block {
    /// `2 * block_tokens * row` i8: K rows, then V rows.
    pub values: Slab<i8>,
    /// `2 * block_tokens * n_kv_heads` f32: K scales by position and head, then V scales.
    pub scales: Slab<f32>,
}

/// One block's memory. Only a pool makes blocks; a block is owned by exactly one place at a
/// time (the pool's free list, a sequence's table, or an `Arc` shared through the prefix
/// cache).
pub struct Block {
    id: BlockId,
    data: BlockData,
}

impl Block {
    pub fn id(&self) -> BlockId {
        self.id
    }

    pub fn data(&self) -> &BlockData {
        &self.data
    }

    pub fn data_mut(&mut self) -> &mut BlockData {
        &mut self.data
    }
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (format, values) = match &self.data {
            BlockData::F32(d) => (KvFormat::F32, d.len()),
            BlockData::F16(d) => (KvFormat::F16, d.len()),
            BlockData::Int8(b) => (KvFormat::Int8, b.values.len()),
        };
        f.debug_struct("Block")
            .field("id", &self.id)
            .field("format", &format)
            .field("values", &values)
            .finish()
    }
}

/// A fixed set of equally sized KV blocks and the free list among them.
#[derive(Debug)]
pub struct BlockPool {
    id: u32,
    layout: BlockLayout,
    free: Vec<Block>,
    total: usize,
    next_index: u64,
}

impl BlockPool {
    /// A pool of `n_blocks` f32 blocks of `block_tokens` positions of `row` values, all
    /// allocated now.
    ///
    /// # Panics
    /// When `row` or `block_tokens` is zero (a model spec that passed validation never gives
    /// either).
    pub fn new(row: usize, block_tokens: usize, n_blocks: usize) -> Self {
        Self::with_layout(BlockLayout::f32(row, block_tokens), n_blocks)
    }

    /// A pool of `n_blocks` blocks laid out as `layout`, all allocated now.
    pub fn with_layout(layout: BlockLayout, n_blocks: usize) -> Self {
        let mut pool = Self {
            id: NEXT_POOL.fetch_add(1, Ordering::Relaxed),
            layout,
            free: Vec::new(),
            total: 0,
            next_index: 0,
        };
        pool.grow(n_blocks);
        pool
    }

    pub fn layout(&self) -> BlockLayout {
        self.layout
    }

    /// Values per position and layer (`n_kv_heads * head_dim`).
    pub fn row(&self) -> usize {
        self.layout.row
    }

    pub fn block_tokens(&self) -> usize {
        self.layout.block_tokens
    }

    pub fn format(&self) -> KvFormat {
        self.layout.format
    }

    /// K and V values in one block, whatever their format.
    pub fn block_len(&self) -> usize {
        2 * self.layout.block_tokens * self.layout.row
    }

    pub fn block_bytes(&self) -> usize {
        self.layout.block_bytes()
    }

    pub fn total_blocks(&self) -> usize {
        self.total
    }

    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks handed out and not yet returned (in sequences' tables or the prefix cache).
    pub fn used_blocks(&self) -> usize {
        self.total - self.free.len()
    }

    /// Bytes of every block the pool has allocated, used or free.
    pub fn bytes_total(&self) -> usize {
        self.total * self.block_bytes()
    }

    pub fn bytes_used(&self) -> usize {
        self.used_blocks() * self.block_bytes()
    }

    pub fn bytes_free(&self) -> usize {
        self.free_blocks() * self.block_bytes()
    }

    /// A free block, or `None` when all are in use. Its contents are whatever its last owner
    /// wrote; a [`crate::kv::PagedKv`] only reads positions it has written.
    pub fn allocate(&mut self) -> Option<Block> {
        self.free.pop()
    }

    /// Returns a block to the free list. A block made by another pool is a caller bug: it is
    /// dropped (its memory freed) and this pool's counts are left as they were.
    pub fn release(&mut self, block: Block) {
        if block.id.pool != self.id {
            debug_assert!(false, "block {:?} released into pool {}", block.id, self.id);
            tracing::error!(block = ?block.id, pool = self.id, "block released into the wrong pool");
            return;
        }
        self.free.push(block);
    }

    /// Allocates `n` more blocks (a residency change freed memory for them).
    pub fn grow(&mut self, n: usize) {
        let _span = tracing::debug_span!("kv_pool_grow", n, total = self.total).entered();
        let len = self.block_len();
        let scales = 2 * self.layout.block_tokens * self.layout.heads();
        self.free.reserve(n);
        let data: Vec<BlockData> = match self.layout.format {
            KvFormat::F32 => Slab::many(n, len).into_iter().map(BlockData::F32).collect(),
            KvFormat::F16 => Slab::many(n, len).into_iter().map(BlockData::F16).collect(),
            KvFormat::Int8 => Slab::many(n, len)
                .into_iter()
                .zip(Slab::many(n, scales))
                .map(|(values, scales)| BlockData::Int8(Int8Block { values, scales }))
                .collect(),
        };
        // The free list hands out its last block first: pushed in reverse, a fresh region's
        // blocks go out in address order.
        let first = self.next_index;
        self.next_index += n as u64;
        for (i, data) in data.into_iter().enumerate().rev() {
            self.free.push(Block {
                id: BlockId {
                    pool: self.id,
                    index: first + i as u64,
                },
                data,
            });
        }
        self.total += n;
    }

    /// Frees the memory of up to `n` free blocks (used blocks are never touched) and returns
    /// how many were freed. To free more, release sequences or evict the prefix cache first.
    pub fn shrink(&mut self, n: usize) -> usize {
        let _span = tracing::debug_span!("kv_pool_shrink", n, total = self.total).entered();
        let k = n.min(self.free.len());
        self.free.truncate(self.free.len() - k);
        self.free.shrink_to_fit();
        self.total -= k;
        k
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accounting_follows_allocate_release_grow_shrink() {
        // 3 kv heads x 64 = row 192 (smollm2): 2 * 16 * 192 * 4 bytes = 24 KiB per block.
        let mut pool = BlockPool::new(192, BLOCK_TOKENS, 4);
        assert_eq!(pool.block_len(), 6144);
        assert_eq!(pool.block_bytes(), 24_576);
        assert_eq!(
            (pool.total_blocks(), pool.free_blocks(), pool.used_blocks()),
            (4, 4, 0)
        );
        assert_eq!(pool.bytes_total(), 4 * 24_576);
        assert_eq!(pool.bytes_used(), 0);

        let a = pool.allocate().expect("block");
        let b = pool.allocate().expect("block");
        assert_ne!(a.id(), b.id());
        assert!(matches!(a.data(), BlockData::F32(d) if d.len() == 6144));
        assert_eq!((pool.free_blocks(), pool.used_blocks()), (2, 2));
        assert_eq!(pool.bytes_used(), 2 * 24_576);
        assert_eq!(pool.bytes_free(), 2 * 24_576);

        // Only free blocks can be shrunk away.
        assert_eq!(pool.shrink(5), 2);
        assert_eq!(
            (pool.total_blocks(), pool.free_blocks(), pool.used_blocks()),
            (2, 0, 2)
        );
        assert!(pool.allocate().is_none());

        pool.release(a);
        assert_eq!((pool.free_blocks(), pool.used_blocks()), (1, 1));
        pool.grow(3);
        assert_eq!(
            (pool.total_blocks(), pool.free_blocks(), pool.used_blocks()),
            (5, 4, 1)
        );
        pool.release(b);
        assert_eq!((pool.total_blocks(), pool.free_blocks()), (5, 5));
        assert_eq!(pool.bytes_total(), 5 * 24_576);
    }

    #[test]
    fn ids_are_never_reused() {
        let mut pool = BlockPool::new(2, 4, 2);
        let mut held = Vec::new();
        for _ in 0..3 {
            pool.shrink(1);
            pool.grow(2);
            while let Some(b) = pool.allocate() {
                held.push(b);
            }
        }
        let mut seen: Vec<BlockId> = held.iter().map(Block::id).collect();
        let n = seen.len();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), n);
        assert_eq!(n, 2 - 1 + 2 + 2 + 2);
        assert_eq!(pool.used_blocks(), n);
        for b in held {
            pool.release(b);
        }
        assert_eq!(pool.free_blocks(), n);
    }

    #[test]
    fn release_keeps_block_contents_until_overwritten() {
        let mut pool = BlockPool::new(1, 2, 1);
        let mut b = pool.allocate().expect("block");
        let BlockData::F32(d) = b.data_mut() else {
            panic!("an f32 pool makes f32 blocks");
        };
        d.copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
        let id = b.id();
        pool.release(b);
        let b = pool.allocate().expect("block");
        assert_eq!(b.id(), id);
        assert!(matches!(b.data(), BlockData::F32(d) if **d == [1.0, 2.0, 3.0, 4.0]));
    }

    #[test]
    fn int8_blocks_are_a_quarter_plus_scales() {
        // smollm2: 3 kv heads x 64, 16 positions.
        let layout = BlockLayout::new(192, 64, BLOCK_TOKENS, KvFormat::Int8);
        let mut pool = BlockPool::with_layout(layout, 3);
        assert_eq!(pool.block_len(), 6144);
        assert_eq!(pool.block_bytes(), 6144 + 2 * 16 * 3 * 4);
        assert_eq!(pool.block_bytes(), 6528);
        assert_eq!(pool.bytes_total(), 3 * 6528);
        let b = pool.allocate().expect("block");
        match b.data() {
            BlockData::Int8(d) => assert_eq!((d.values.len(), d.scales.len()), (6144, 96)),
            _ => panic!("an 8-bit pool makes 8-bit blocks"),
        }
        assert_eq!(pool.bytes_used(), 6528);
        pool.release(b);
        assert_eq!(BlockPool::new(192, BLOCK_TOKENS, 1).block_bytes(), 24_576);
    }

    #[test]
    fn f16_blocks_are_half_of_f32() {
        let layout = BlockLayout::new(192, 64, BLOCK_TOKENS, KvFormat::F16);
        let mut pool = BlockPool::with_layout(layout, 2);
        assert_eq!(pool.block_len(), 6144);
        assert_eq!(pool.block_bytes(), 12_288);
        let b = pool.allocate().expect("block");
        assert!(matches!(b.data(), BlockData::F16(d) if d.len() == 6144));
        assert_eq!(pool.bytes_used(), 12_288);
        pool.release(b);
    }
}
