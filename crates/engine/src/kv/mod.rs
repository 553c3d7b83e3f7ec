//! Paged KV cache: block pool, per-sequence block tables, prefix cache, memory budget.
//!
//! The pieces, and who owns what:
//!
//! * [`BlockPool`] owns every KV block's memory, allocated up front (vLLM's block pool). A
//!   [`Block`] is an owned buffer that moves out of the pool into one sequence's table and back;
//!   nothing on the hot path allocates. Blocks hold f32 or 8-bit values ([`KvFormat`], laid
//!   out as [`BlockLayout`] says); nothing else in the cache depends on which.
//! * [`PagedKv`] is one sequence's cache: a block table per layer, implementing the model's
//!   [`switchyard_models::SeqKv`]. Blocks exist only for the layers the sequence runs.
//! * [`PrefixCache`] keeps full blocks keyed by a hash chain of their tokens (vLLM's automatic
//!   prefix caching). A published block becomes an `Arc<Block>`, read-only, shared by the cache
//!   and any sequence that attached it; blocks only the cache still holds are evicted LRU.
//! * [`MemoryBudget`] splits a byte budget into weights, activation workspace and KV blocks.
//!
//! Every block is in exactly one place: the pool's free list, one sequence's table (owned), or
//! behind an `Arc` held by the prefix cache and/or sequences. The pool counts a block as used
//! from `allocate` until it comes back through `release`, so `used + free == total` always.

pub mod budget;
pub mod format;
pub mod paged;
pub mod pool;
pub mod prefix;
pub mod rerun;
pub mod slab;

pub use budget::{activation_bytes, parse_bytes, BudgetPlan, MemoryBudget, Usage};
pub use format::{BlockLayout, KvFormat};
pub use paged::{BlockHash, BlockRef, PagedKv, SharedBlocks, Sharing};
pub use pool::{Block, BlockData, BlockId, BlockPool, Int8Block, BLOCK_TOKENS};
pub use prefix::PrefixCache;
pub use rerun::RerunKv;

/// What can go wrong in the KV cache and its memory budget.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("out of KV blocks: {needed} needed, {free} free")]
    OutOfBlocks { needed: usize, free: usize },
    #[error("write of positions {start}..{end} in layer {layer} goes beyond the {reserved} reserved positions; reserve them first")]
    BeyondReserved {
        layer: usize,
        start: usize,
        end: usize,
        reserved: usize,
    },
    #[error("write at position {position} of layer {layer} falls in a block shared through the prefix cache (read-only)")]
    WriteShared { layer: usize, position: usize },
    #[error("cache write at position {start} of layer {layer} with {values} values (row {row}) is invalid: {stored} positions stored")]
    BadWrite {
        layer: usize,
        start: usize,
        stored: usize,
        values: usize,
        row: usize,
    },
    #[error("cache of layer {layer} holds {stored} positions, {len} asked for")]
    Missing {
        layer: usize,
        len: usize,
        stored: usize,
    },
    #[error("cache has {n_layers} layers, layer {layer} was asked for")]
    NoSuchLayer { layer: usize, n_layers: usize },
    #[error("layers {start}..{end} are outside the cache's {n_layers} layers")]
    NoSuchLayers {
        start: usize,
        end: usize,
        n_layers: usize,
    },
    #[error("sequence blocks hold {block_tokens} positions of {row} {format} values, the pool's (or prefix cache's) {pool_block_tokens} of {pool_row} {pool_format}")]
    LayoutMismatch {
        row: usize,
        block_tokens: usize,
        format: KvFormat,
        pool_row: usize,
        pool_block_tokens: usize,
        pool_format: KvFormat,
    },
    #[error(
        "layer {layer} already holds {blocks} blocks; prefix blocks attach only to an empty table"
    )]
    AttachToNonEmpty { layer: usize, blocks: usize },
    #[error("block {block} of layer {layer} is not in the prefix cache for these tokens")]
    NotCached { layer: usize, block: usize },
    #[error("memory budget of {total} bytes is too small: weights {weights} + activation workspace {workspace} bytes leave no room for one {block_bytes}-byte KV block (short by {shortfall} bytes)")]
    BudgetTooSmall {
        total: u64,
        weights: u64,
        workspace: u64,
        block_bytes: u64,
        shortfall: u64,
    },
    #[error("memory in use ({used} bytes: weights {weights} + KV {kv} + workspace {workspace}) exceeds the budget of {total} bytes")]
    OverBudget {
        used: u64,
        weights: u64,
        kv: u64,
        workspace: u64,
        total: u64,
    },
    #[error("bad byte size {input:?}: {reason}")]
    BadBytes { input: String, reason: &'static str },
}

impl From<KvError> for switchyard_models::ModelError {
    fn from(e: KvError) -> Self {
        use switchyard_models::ModelError;
        match e {
            KvError::BadWrite {
                layer,
                start,
                stored,
                values,
                row,
            } => ModelError::KvWrite {
                layer,
                start,
                stored,
                values,
                row,
            },
            KvError::NoSuchLayer { layer, n_layers } => ModelError::KvLayer { layer, n_layers },
            KvError::Missing { layer, len, stored } => ModelError::KvMissing { layer, len, stored },
            // A paged cache's own failures (writes past the reservation, into shared blocks)
            // keep their type: the scheduler downcasts them.
            other => ModelError::Kv(Box::new(other)),
        }
    }
}
