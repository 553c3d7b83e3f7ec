//! [`PrefixCache`]: full KV blocks shared across sequences, keyed by a hash chain of their
//! tokens (vLLM's automatic prefix caching), evicted least recently used.
//!
//! Block `i` of a token sequence is named by `h_i = H(h_{i-1}, tokens of block i)` (with a
//! fixed root for `h_{-1}`) and a layer: a block holds one layer's K/V, so it is reusable only
//! for that layer, and a prefix counts as cached only when every layer asked for has it.
//!
//! A hash never decides alone. Each entry keeps its block's tokens and the serial number of
//! its parent entry (serials are never reused), and a lookup walks the chain from the first
//! block, checking both: an entry is accepted only if it was published as the child of the
//! exact entry accepted for the previous block. By induction the accepted entries hold K/V
//! computed for exactly the looked-up tokens, so a hash collision can cost a cache miss but
//! can never return another sequence's K/V.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::ops::Range;
use std::sync::Arc;

use super::paged::{BlockHash, PagedKv, SharedBlocks, Slot};
use super::pool::{Block, BlockId, BlockPool};
use super::KvError;

/// `h_{-1}`: the chain's fixed root ("SWITCHYD").
const ROOT: BlockHash = BlockHash(0x5357_4954_4348_5944);

type Key = (BlockHash, usize);

struct Entry {
    block: Arc<Block>,
    tokens: Box<[u32]>,
    /// Serial of the entry for the previous block of the same layer (`None` for block 0).
    parent: Option<u64>,
    serial: u64,
    /// Last time a holder let go of the block (or it was published): the LRU key.
    tick: u64,
}

/// Shared, read-only full blocks, by hash chain and layer. One per model: the hash does not
/// name the model.
pub struct PrefixCache {
    block_tokens: usize,
    /// All ones, except in tests that force collisions.
    hash_mask: u64,
    entries: HashMap<Key, Entry>,
    /// Every entry by its tick, oldest first.
    lru: BTreeMap<u64, Key>,
    clock: u64,
    next_serial: u64,
    hits_tokens: u64,
    queried_tokens: u64,
}

impl std::fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixCache")
            .field("block_tokens", &self.block_tokens)
            .field("blocks", &self.entries.len())
            .field("evictable", &self.evictable_blocks())
            .field("hits_tokens", &self.hits_tokens)
            .field("queried_tokens", &self.queried_tokens)
            .finish()
    }
}

impl PrefixCache {
    /// An empty cache for blocks of `block_tokens` positions.
    pub fn new(block_tokens: usize) -> Self {
        Self::with_hash_bits(block_tokens, 64)
    }

    /// For tests: keeps only the low `bits` bits of every hash, so collisions are common.
    /// Results must be the same as with full hashes, only with fewer hits.
    #[doc(hidden)]
    pub fn with_hash_bits(block_tokens: usize, bits: u32) -> Self {
        Self {
            block_tokens: block_tokens.max(1),
            hash_mask: if bits >= 64 {
                u64::MAX
            } else {
                (1 << bits) - 1
            },
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            clock: 0,
            next_serial: 0,
            hits_tokens: 0,
            queried_tokens: 0,
        }
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// `h_i` from `h_{i-1}` and block `i`'s tokens (SipHash with fixed keys: the same in every
    /// run of one build).
    pub fn chain_hash(&self, parent: BlockHash, block: &[u32]) -> BlockHash {
        let mut h = DefaultHasher::new();
        parent.0.hash(&mut h);
        block.hash(&mut h);
        BlockHash(h.finish() & self.hash_mask)
    }

    /// The chain over the full blocks of `tokens` (a trailing partial block has no hash).
    pub fn block_hashes(&self, tokens: &[u32]) -> Vec<BlockHash> {
        let mut h = ROOT;
        tokens
            .chunks_exact(self.block_tokens)
            .map(|b| {
                h = self.chain_hash(h, b);
                h
            })
            .collect()
    }

    /// Blocks in the cache (each one layer's block).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Blocks only the cache holds: what [`PrefixCache::evict_into`] can free.
    pub fn evictable_blocks(&self) -> usize {
        self.entries
            .values()
            .filter(|e| Arc::strong_count(&e.block) == 1)
            .count()
    }

    /// Ids of every cached block.
    pub fn block_ids(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.entries.values().map(|e| e.block.id())
    }

    /// Prompt tokens whose K/V were found cached, over all [`PrefixCache::lookup`]s.
    pub fn hits_tokens(&self) -> u64 {
        self.hits_tokens
    }

    /// Prompt tokens looked up, over all [`PrefixCache::lookup`]s.
    pub fn queried_tokens(&self) -> u64 {
        self.queried_tokens
    }

    /// `hits_tokens / queried_tokens` (0 before any lookup).
    pub fn hit_rate(&self) -> f64 {
        if self.queried_tokens == 0 {
            0.0
        } else {
            self.hits_tokens as f64 / self.queried_tokens as f64
        }
    }

    /// Number of leading full blocks of `tokens` cached for every layer of `layers`, never
    /// counting the block that holds the last token (the model must compute at least one
    /// position to produce logits; vLLM stops at the same place). Counts toward the hit rate:
    /// call it once per admitted request; [`PrefixCache::probe`] does the same without counting.
    pub fn lookup(&mut self, tokens: &[u32], layers: Range<usize>) -> usize {
        let n = self.probe(tokens, layers);
        self.queried_tokens += tokens.len() as u64;
        self.hits_tokens += (n * self.block_tokens) as u64;
        n
    }

    /// Counts one lookup of `queried` prompt tokens of which `hit_blocks` full blocks were
    /// found: what [`PrefixCache::lookup`] adds, for callers that [`PrefixCache::probe`]d first
    /// and count only once the request is admitted (a request that waits is probed again).
    pub fn record_lookup(&mut self, queried: usize, hit_blocks: usize) {
        self.queried_tokens += queried as u64;
        self.hits_tokens += (hit_blocks * self.block_tokens) as u64;
    }

    /// [`PrefixCache::lookup`] without touching the hit-rate counters.
    pub fn probe(&self, tokens: &[u32], layers: Range<usize>) -> usize {
        if layers.is_empty() {
            return 0;
        }
        let mut walk = ChainWalk::new(tokens, layers.len());
        let max = self.max_reusable(tokens);
        for i in 0..max {
            if walk.step(self, i, &layers, |_, _, _| {}).is_err() {
                return i;
            }
        }
        max
    }

    /// Shares the first `n_blocks` cached blocks of `tokens` (as counted by
    /// [`PrefixCache::lookup`]) into the empty tables of `layers` of `kv`, which then hold
    /// positions `0..n_blocks * block_tokens` without taking a block from the pool. All or
    /// nothing.
    pub fn attach(
        &mut self,
        kv: &mut PagedKv,
        tokens: &[u32],
        layers: Range<usize>,
        n_blocks: usize,
    ) -> Result<(), KvError> {
        kv.check_layer_range(&layers)?;
        if kv.block_tokens() != self.block_tokens {
            return Err(KvError::LayoutMismatch {
                row: kv.row(),
                block_tokens: kv.block_tokens(),
                format: kv.layout().format,
                pool_row: kv.row(),
                pool_block_tokens: self.block_tokens,
                pool_format: kv.layout().format,
            });
        }
        if n_blocks == 0 || layers.is_empty() {
            return Ok(());
        }
        let _span = tracing::trace_span!("prefix_attach", n_blocks).entered();
        let max = self.max_reusable(tokens);
        if n_blocks > max {
            return Err(KvError::NotCached {
                layer: layers.start,
                block: max,
            });
        }
        for l in layers.clone() {
            if let Some(t) = kv.table(l) {
                if !t.slots.is_empty() || t.len > 0 {
                    return Err(KvError::AttachToNonEmpty {
                        layer: l,
                        blocks: t.slots.len(),
                    });
                }
            }
        }
        let mut picked = Vec::with_capacity(n_blocks * layers.len());
        let mut walk = ChainWalk::new(tokens, layers.len());
        for i in 0..n_blocks {
            walk.step(self, i, &layers, |l, h, e| {
                picked.push((l, h, e.serial, Arc::clone(&e.block)));
            })?;
        }
        let bt = self.block_tokens;
        for (l, hash, serial, block) in picked {
            if let Some(t) = kv.table_mut(l) {
                t.slots.push(Slot::Shared {
                    block,
                    hash,
                    serial,
                });
                t.shared += 1;
                t.len = t.shared * bt;
            }
        }
        Ok(())
    }

    /// Moves the full, written blocks of `layers` of `kv` (whose positions hold `tokens`) into
    /// the cache, in chain order; returns how many blocks were published. The caller must
    /// pass the tokens `kv` was computed from, and only positions that will not be rolled
    /// back (published blocks are read-only). A block whose key is already taken (the same
    /// prefix published by another sequence, or a collision) stays owned, and so do the
    /// blocks after it. A sequence with another block size publishes nothing.
    pub fn publish(&mut self, kv: &mut PagedKv, tokens: &[u32], layers: Range<usize>) -> usize {
        let bt = self.block_tokens;
        if kv.block_tokens() != bt {
            return 0;
        }
        let end = layers.end.min(kv.n_layers());
        let mut published = 0;
        for l in layers.start.min(end)..end {
            let Some(t) = kv.table_mut(l) else { continue };
            let full = (t.len.min(tokens.len()) / bt).min(t.slots.len());
            let mut i = t.shared;
            let (mut h, mut parent) = match i.checked_sub(1).map(|p| &t.slots[p]) {
                None => (ROOT, None),
                Some(Slot::Shared { hash, serial, .. }) => (*hash, Some(*serial)),
                Some(_) => continue,
            };
            while i < full {
                // The parent must still be cached: a child of an entry that is gone could
                // never be found again.
                if let Some(p) = parent {
                    if self.entries.get(&(h, l)).is_none_or(|e| e.serial != p) {
                        break;
                    }
                }
                let block_tokens = &tokens[i * bt..(i + 1) * bt];
                h = self.chain_hash(h, block_tokens);
                let key = (h, l);
                if self.entries.contains_key(&key) {
                    break;
                }
                let block = match std::mem::replace(&mut t.slots[i], Slot::Vacant) {
                    Slot::Owned(b) => Arc::new(b),
                    other => {
                        t.slots[i] = other;
                        break;
                    }
                };
                let serial = self.next_serial;
                self.next_serial += 1;
                let tick = self.tick();
                self.entries.insert(
                    key,
                    Entry {
                        block: Arc::clone(&block),
                        tokens: block_tokens.into(),
                        parent,
                        serial,
                        tick,
                    },
                );
                self.lru.insert(tick, key);
                t.slots[i] = Slot::Shared {
                    block,
                    hash: h,
                    serial,
                };
                t.shared = i + 1;
                parent = Some(serial);
                i += 1;
                published += 1;
            }
        }
        published
    }

    /// Frees up to `n` blocks that only the cache holds, least recently released first, into
    /// `pool`; returns how many were freed.
    pub fn evict_into(&mut self, pool: &mut BlockPool, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        let _span = tracing::debug_span!("prefix_evict", n).entered();
        let victims: Vec<(u64, Key)> = self
            .lru
            .iter()
            .filter(|(_, key)| {
                self.entries
                    .get(key)
                    .is_some_and(|e| Arc::strong_count(&e.block) == 1)
            })
            .take(n)
            .map(|(&tick, &key)| (tick, key))
            .collect();
        let mut freed = 0;
        for (tick, key) in victims {
            self.lru.remove(&tick);
            if let Some(e) = self.entries.remove(&key) {
                // With `&mut self` nobody can clone the last reference meanwhile; if it were
                // shared after all, its last holder returns it through `unref`.
                if let Ok(b) = Arc::try_unwrap(e.block) {
                    pool.release(b);
                    freed += 1;
                }
            }
        }
        freed
    }

    /// Frees every block of `layers` that only the cache holds (those layers stopped running:
    /// their blocks must not outlive them); returns how many were freed. Blocks a sequence
    /// still shares stay.
    pub fn evict_layers_into(&mut self, pool: &mut BlockPool, layers: Range<usize>) -> usize {
        let victims: Vec<Key> = self
            .entries
            .iter()
            .filter(|(key, e)| layers.contains(&key.1) && Arc::strong_count(&e.block) == 1)
            .map(|(&key, _)| key)
            .collect();
        let mut freed = 0;
        for key in victims {
            if let Some(e) = self.entries.remove(&key) {
                self.lru.remove(&e.tick);
                if let Ok(b) = Arc::try_unwrap(e.block) {
                    pool.release(b);
                    freed += 1;
                }
            }
        }
        freed
    }

    /// Drops every entry: blocks only the cache held go back to `pool`; blocks sequences
    /// still share go back when the last of them releases.
    pub fn clear(&mut self, pool: &mut BlockPool) {
        self.lru.clear();
        for (_, e) in self.entries.drain() {
            if let Ok(b) = Arc::try_unwrap(e.block) {
                pool.release(b);
            }
        }
    }

    fn tick(&mut self) -> u64 {
        let t = self.clock;
        self.clock += 1;
        t
    }

    /// Full blocks of `tokens` that may be reused: all but the one holding the last token.
    fn max_reusable(&self, tokens: &[u32]) -> usize {
        tokens.len().saturating_sub(1) / self.block_tokens
    }
}

impl SharedBlocks for PrefixCache {
    /// A sequence lets go of a shared block: the entry, if it is still this block's, becomes
    /// the most recently used; a block the cache no longer holds returns to `pool` with its
    /// last reference.
    fn unref(
        &mut self,
        layer: usize,
        hash: BlockHash,
        serial: u64,
        block: Arc<Block>,
        pool: &mut BlockPool,
    ) {
        let key = (hash, layer);
        let tick = self.clock;
        match self.entries.get_mut(&key) {
            Some(e) if e.serial == serial => {
                drop(block);
                self.lru.remove(&e.tick);
                e.tick = tick;
                self.lru.insert(tick, key);
                self.clock += 1;
            }
            _ => {
                if let Ok(b) = Arc::try_unwrap(block) {
                    pool.release(b);
                }
            }
        }
    }
}

impl Drop for PrefixCache {
    fn drop(&mut self) {
        if !self.entries.is_empty() {
            tracing::warn!(
                blocks = self.entries.len(),
                "PrefixCache dropped holding blocks; call clear() to return them to the pool"
            );
        }
    }
}

/// Verification state of one walk down the chain: the hash so far and, per layer, the serial
/// of the entry accepted for the previous block.
struct ChainWalk<'t> {
    tokens: &'t [u32],
    hash: BlockHash,
    parents: Vec<Option<u64>>,
}

impl<'t> ChainWalk<'t> {
    fn new(tokens: &'t [u32], n_layers: usize) -> Self {
        Self {
            tokens,
            hash: ROOT,
            parents: vec![None; n_layers],
        }
    }

    /// Accepts block `i` for every layer (calling `take` on each entry) or says which layer
    /// lacks it.
    fn step(
        &mut self,
        cache: &PrefixCache,
        i: usize,
        layers: &Range<usize>,
        mut take: impl FnMut(usize, BlockHash, &Entry),
    ) -> Result<(), KvError> {
        let bt = cache.block_tokens;
        let block = self
            .tokens
            .get(i * bt..(i + 1) * bt)
            .ok_or(KvError::NotCached {
                layer: layers.start,
                block: i,
            })?;
        self.hash = cache.chain_hash(self.hash, block);
        for (j, l) in layers.clone().enumerate() {
            let e = cache
                .entries
                .get(&(self.hash, l))
                .filter(|e| e.parent == self.parents[j] && *e.tokens == *block)
                .ok_or(KvError::NotCached { layer: l, block: i })?;
            self.parents[j] = Some(e.serial);
            take(l, self.hash, e);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{Sharing, BLOCK_TOKENS};
    use switchyard_models::SeqKv;

    const BT: usize = 4;
    const ROW: usize = 2;

    /// A K value that depends on the whole prefix up to and including `pos` (and the layer),
    /// so a block attached for the wrong prefix shows up as wrong values.
    fn prefix_value(tokens: &[u32], pos: usize, layer: usize) -> f32 {
        let mut h = DefaultHasher::new();
        tokens[..=pos].hash(&mut h);
        layer.hash(&mut h);
        (h.finish() % 1_000_003) as f32
    }

    /// Reserves, writes and returns a sequence holding K/V "computed" for `tokens` in `layers`,
    /// starting after whatever was attached.
    fn compute(
        pool: &mut BlockPool,
        kv: &mut PagedKv,
        tokens: &[u32],
        layers: Range<usize>,
    ) -> usize {
        kv.reserve(pool, layers.clone(), tokens.len())
            .expect("reserve");
        let mut computed = 0;
        for l in layers {
            let start = kv.len(l);
            let k: Vec<f32> = (start..tokens.len())
                .flat_map(|p| [prefix_value(tokens, p, l); ROW])
                .collect();
            kv.write(l, start, &k, &k).expect("write");
            computed = tokens.len() - start;
        }
        computed
    }

    fn check_values(kv: &PagedKv, tokens: &[u32], layer: usize) {
        let len = kv.len(layer);
        let chunks = kv.chunk_list(layer, len).expect("chunks");
        let k: Vec<f32> = chunks.iter().flat_map(|c| c.k.iter().copied()).collect();
        for p in 0..len {
            assert_eq!(
                k[p * ROW],
                prefix_value(tokens, p, layer),
                "layer {layer} position {p} holds another prefix's K"
            );
        }
    }

    #[test]
    fn hash_chain_links_blocks() {
        let cache = PrefixCache::new(BLOCK_TOKENS);
        let a: Vec<u32> = (0..40).collect();
        let h = cache.block_hashes(&a);
        assert_eq!(h.len(), 2, "the partial third block has no hash");
        assert_eq!(h[0], cache.chain_hash(ROOT, &a[..16]));
        assert_eq!(h[1], cache.chain_hash(h[0], &a[16..32]));
        // Same second block after a different first block: a different link.
        let mut b = a.clone();
        b[3] = 999;
        let hb = cache.block_hashes(&b);
        assert_ne!(hb[0], h[0]);
        assert_ne!(hb[1], h[1]);
        // Deterministic across caches (fixed-key hasher).
        assert_eq!(PrefixCache::new(BLOCK_TOKENS).block_hashes(&a), h);
        // Forced collisions keep only the low bits.
        let c = PrefixCache::with_hash_bits(BLOCK_TOKENS, 0);
        assert_eq!(c.block_hashes(&a), vec![BlockHash(0), BlockHash(0)]);
    }

    #[test]
    fn publish_lookup_attach_share_blocks_across_sequences() {
        let mut pool = BlockPool::new(ROW, BT, 40);
        let mut cache = PrefixCache::new(BT);
        let a: Vec<u32> = (100..111).collect(); // 11 tokens: 2 full blocks + 3
        let mut kva = PagedKv::for_pool(&pool, 3);
        compute(&mut pool, &mut kva, &a, 0..2);
        assert_eq!(pool.used_blocks(), 6);
        assert_eq!(cache.publish(&mut kva, &a, 0..2), 4);
        assert_eq!(cache.len(), 4);
        assert_eq!((kva.owned_blocks(), kva.shared_blocks()), (2, 4));
        assert_eq!(
            pool.used_blocks(),
            6,
            "publishing moves blocks, it takes none"
        );
        // Publishing again adds nothing.
        assert_eq!(cache.publish(&mut kva, &a, 0..2), 0);

        // B shares A's first 8 tokens.
        let mut b: Vec<u32> = a[..8].to_vec();
        b.extend([7, 7, 7]);
        assert_eq!(cache.lookup(&b, 0..2), 2);
        assert_eq!(cache.lookup(&b, 0..1), 2);
        assert_eq!(cache.lookup(&b, 1..3), 0, "layer 2 has nothing cached");
        assert_eq!(cache.lookup(&b, 0..0), 0);
        // Never the block holding the last token: 8 tokens reuse 1 block, 9 reuse 2.
        assert_eq!(cache.lookup(&a[..8], 0..2), 1);
        assert_eq!(cache.lookup(&a[..9], 0..2), 2);
        assert_eq!(cache.queried_tokens(), 11 + 11 + 11 + 11 + 8 + 9);
        assert_eq!(cache.hits_tokens(), 8 + 8 + 4 + 8);

        let mut kvb = PagedKv::for_pool(&pool, 3);
        cache.attach(&mut kvb, &b, 0..2, 2).expect("attach");
        assert_eq!((kvb.len(0), kvb.len(1), kvb.len(2)), (8, 8, 0));
        assert_eq!((kvb.shared_blocks(), kvb.owned_blocks()), (4, 0));
        assert_eq!(pool.used_blocks(), 6);
        let computed = compute(&mut pool, &mut kvb, &b, 0..2);
        assert_eq!(computed, 3, "only the tokens after the shared prefix");
        assert_eq!(pool.used_blocks(), 8);
        for l in 0..2 {
            check_values(&kvb, &b, l);
        }
        // Shared positions are read-only.
        assert_eq!(
            kvb.write_rows(0, 7, &[0.0; ROW], &[0.0; ROW]),
            Err(KvError::WriteShared {
                layer: 0,
                position: 7
            })
        );
        // Shared ids are the same blocks as A's.
        let shared: Vec<BlockId> = kvb
            .blocks()
            .filter(|r| r.sharing == Sharing::Shared)
            .map(|r| r.id)
            .collect();
        let a_shared: Vec<BlockId> = kva
            .blocks()
            .filter(|r| r.sharing == Sharing::Shared)
            .map(|r| r.id)
            .collect();
        assert_eq!(shared, a_shared);

        // Attach only into empty tables, only what is cached.
        let mut kvc = PagedKv::for_pool(&pool, 3);
        assert_eq!(
            cache.attach(&mut kvc, &b, 0..3, 1),
            Err(KvError::NotCached { layer: 2, block: 0 })
        );
        assert_eq!(kvc.shared_blocks(), 0, "a failed attach shares nothing");
        assert!(matches!(
            cache.attach(&mut kvb, &b, 0..2, 1),
            Err(KvError::AttachToNonEmpty { layer: 0, .. })
        ));
        assert!(matches!(
            cache.attach(&mut kvc, &b, 0..2, 3),
            Err(KvError::NotCached { block: 2, .. })
        ));

        // Releases: the cache keeps the 4 shared blocks, everything else returns.
        kva.release(&mut pool, &mut cache);
        kvb.release(&mut pool, &mut cache);
        assert_eq!(pool.used_blocks(), 4);
        assert_eq!(cache.evictable_blocks(), 4);
        assert_eq!(cache.evict_into(&mut pool, 10), 4);
        assert_eq!((pool.used_blocks(), cache.len()), (0, 0));
        assert_eq!(cache.lookup(&b, 0..2), 0);
    }

    #[test]
    fn eviction_is_lru_tail_first_and_spares_held_blocks() {
        let mut pool = BlockPool::new(ROW, BT, 30);
        let mut cache = PrefixCache::new(BT);
        let seq = |first: u32| -> Vec<u32> { (first..first + 9).collect() }; // 2 full blocks + 1
        let (a, b, c) = (seq(0), seq(100), seq(200));
        let mut kvs: Vec<PagedKv> = Vec::new();
        for t in [&a, &b, &c] {
            let mut kv = PagedKv::for_pool(&pool, 1);
            compute(&mut pool, &mut kv, t, 0..1);
            assert_eq!(cache.publish(&mut kv, t, 0..1), 2);
            kvs.push(kv);
        }
        // Release B, then A; C stays live.
        let mut kv_c = kvs.pop().expect("c");
        let mut kv_a = kvs.remove(0);
        let mut kv_b = kvs.remove(0);
        kv_b.release(&mut pool, &mut cache);
        kv_a.release(&mut pool, &mut cache);
        assert_eq!(cache.len(), 6);
        assert_eq!(cache.evictable_blocks(), 4);
        let used = pool.used_blocks();

        // Oldest release first, and within a sequence its tail block first.
        assert_eq!(cache.evict_into(&mut pool, 1), 1);
        assert_eq!((cache.probe(&b, 0..1), cache.probe(&a, 0..1)), (1, 2));
        assert_eq!(cache.evict_into(&mut pool, 1), 1);
        assert_eq!((cache.probe(&b, 0..1), cache.probe(&a, 0..1)), (0, 2));
        assert_eq!(cache.evict_into(&mut pool, 1), 1);
        assert_eq!(cache.probe(&a, 0..1), 1);
        assert_eq!(pool.used_blocks(), used - 3);

        // A held block is never evicted: attach A's remaining block to D, then ask for
        // everything.
        let mut kv_d = PagedKv::for_pool(&pool, 1);
        cache.attach(&mut kv_d, &a, 0..1, 1).expect("attach");
        assert_eq!(cache.evict_into(&mut pool, 100), 0);
        assert_eq!(cache.probe(&c, 0..1), 2);
        assert_eq!(cache.probe(&a, 0..1), 1);

        kv_d.release(&mut pool, &mut cache);
        kv_c.release(&mut pool, &mut cache);
        // Now C's (released last) go last: A's block, then C's tail, then C's head.
        assert_eq!(cache.evict_into(&mut pool, 1), 1);
        assert_eq!((cache.probe(&a, 0..1), cache.probe(&c, 0..1)), (0, 2));
        assert_eq!(cache.evict_into(&mut pool, 1), 1);
        assert_eq!(cache.probe(&c, 0..1), 1);
        assert_eq!(cache.evict_into(&mut pool, 5), 1);
        assert_eq!((cache.len(), pool.used_blocks()), (0, 0));
    }

    #[test]
    fn forced_collisions_never_return_another_prefix() {
        // 2-bit hashes: 4 keys per layer, so chains collide all the time.
        let mut cache = PrefixCache::with_hash_bits(BT, 2);
        let mut pool = BlockPool::new(ROW, BT, 400);

        // A collision one block deep, same block tokens, different parents: block 1 of C has
        // A's key and tokens, but hangs off C's block 0, not A's.
        let a0 = [1, 2, 3, 4];
        let ha0 = cache.chain_hash(ROOT, &a0);
        // Search A's second block and a link value `x` for C's first block such that
        // H(x, a1) == H(ha0, a1) while x differs from both of A's links.
        let (a1, x) = (0..1000u32)
            .find_map(|y| {
                let a1 = [5, 6, 7, y];
                let ha1 = cache.chain_hash(ha0, &a1);
                (0..4)
                    .map(BlockHash)
                    .find(|&x| x != ha0 && x != ha1 && cache.chain_hash(x, &a1) == ha1)
                    .map(|x| (a1, x))
            })
            .expect("colliding second links");
        let c0 = (100..10_000u32)
            .map(|t| [t, 0, 0, 0])
            .find(|c0| cache.chain_hash(ROOT, c0) == x)
            .expect("a first block hashing to x");
        let a: Vec<u32> = a0.iter().chain(&a1).chain(&[0]).copied().collect();
        let c: Vec<u32> = c0.iter().chain(&a[4..]).copied().collect();
        assert_ne!(a[..4], c[..4]);

        let mut kva = PagedKv::for_pool(&pool, 1);
        compute(&mut pool, &mut kva, &a, 0..1);
        assert_eq!(cache.publish(&mut kva, &a, 0..1), 2);
        let mut kvc = PagedKv::for_pool(&pool, 1);
        compute(&mut pool, &mut kvc, &c, 0..1);
        // C's block 1 would take A's key: only its block 0 is published.
        assert_eq!(cache.publish(&mut kvc, &c, 0..1), 1);
        assert_eq!(cache.probe(&a, 0..1), 2);
        // Tokens and key of C's block 1 match A's entry, its parent does not.
        assert_eq!(cache.probe(&c, 0..1), 1);
        kva.release(&mut pool, &mut cache);
        kvc.release(&mut pool, &mut cache);

        cache.clear(&mut pool);

        // Many random sequences over a tiny alphabet, with 4-bit hashes (16 keys per layer):
        // whatever is attached holds K/V of exactly the attaching sequence's prefix.
        let mut cache = PrefixCache::with_hash_bits(BT, 4);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut live: Vec<PagedKv> = Vec::new();
        let mut hits = 0;
        for _ in 0..300 {
            let len = 1 + (next() % 14) as usize;
            let tokens: Vec<u32> = (0..len).map(|_| (next() % 2) as u32).collect();
            let mut kv = PagedKv::for_pool(&pool, 2);
            let n = cache.lookup(&tokens, 0..2);
            hits += n;
            cache.attach(&mut kv, &tokens, 0..2, n).expect("attach");
            compute(&mut pool, &mut kv, &tokens, 0..2);
            for l in 0..2 {
                check_values(&kv, &tokens, l);
            }
            cache.publish(&mut kv, &tokens, 0..2);
            live.push(kv);
            if live.len() > 8 {
                let i = (next() % live.len() as u64) as usize;
                let mut old = live.swap_remove(i);
                old.release(&mut pool, &mut cache);
            }
            if pool.free_blocks() < 20 {
                cache.evict_into(&mut pool, 20);
            }
        }
        eprintln!("random walk: {hits} blocks reused, {} cached", cache.len());
        assert!(
            hits > 20,
            "the walk should hit the cache sometimes ({hits})"
        );
        for mut kv in live {
            kv.release(&mut pool, &mut cache);
        }
        cache.clear(&mut pool);
        assert_eq!(pool.used_blocks(), 0);
    }

    #[test]
    fn clearing_the_cache_hands_shared_blocks_to_their_last_holder() {
        let mut pool = BlockPool::new(ROW, BT, 10);
        let mut cache = PrefixCache::new(BT);
        let a: Vec<u32> = (0..9).collect();
        let mut kva = PagedKv::for_pool(&pool, 1);
        compute(&mut pool, &mut kva, &a, 0..1);
        cache.publish(&mut kva, &a, 0..1);
        let mut kvb = PagedKv::for_pool(&pool, 1);
        cache.attach(&mut kvb, &a, 0..1, 2).expect("attach");
        cache.clear(&mut pool);
        assert_eq!((cache.len(), pool.used_blocks()), (0, 3));
        kva.release(&mut pool, &mut cache);
        assert_eq!(pool.used_blocks(), 2, "B still holds the two shared blocks");
        kvb.release(&mut pool, &mut cache);
        assert_eq!(pool.used_blocks(), 0);
    }

    #[test]
    fn evicting_layers_frees_only_their_unshared_blocks() {
        let mut pool = BlockPool::new(ROW, BT, 20);
        let mut cache = PrefixCache::new(BT);
        let a: Vec<u32> = (0..9).collect();
        let mut kva = PagedKv::for_pool(&pool, 3);
        compute(&mut pool, &mut kva, &a, 0..3);
        // 2 full blocks in each of 3 layers.
        assert_eq!(cache.publish(&mut kva, &a, 0..3), 6);
        let mut kvb = PagedKv::for_pool(&pool, 3);
        cache.attach(&mut kvb, &a, 2..3, 2).expect("attach");
        kva.release(&mut pool, &mut cache);
        assert_eq!(pool.used_blocks(), 6);
        // Layers 1 and 2: layer 1's two blocks go, layer 2's are still shared by B.
        assert_eq!(cache.evict_layers_into(&mut pool, 1..3), 2);
        assert_eq!((cache.len(), pool.used_blocks()), (4, 4));
        assert_eq!(cache.probe(&a, 0..1), 2);
        assert_eq!(cache.probe(&a, 1..2), 0);
        assert_eq!(cache.probe(&a, 2..3), 2);
        kvb.release(&mut pool, &mut cache);
        assert_eq!(cache.evict_layers_into(&mut pool, 0..3), 4);
        assert_eq!((cache.len(), pool.used_blocks()), (0, 0));

        cache.record_lookup(9, 2);
        assert_eq!((cache.hits_tokens(), cache.queried_tokens()), (8, 9));
    }
}
