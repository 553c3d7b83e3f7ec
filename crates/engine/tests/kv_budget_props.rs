//! Random operation sequences against the KV pool, paged sequences, prefix cache and memory
//! budget: after every operation the block and byte accounting adds up, the budget holds, no
//! block has two owners unless shared through an `Arc`, and every sequence reads back the K/V
//! of exactly its own tokens.

use std::collections::{HashMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};

use proptest::prelude::*;
use switchyard_engine::kv::{
    BlockId, BlockPool, KvError, MemoryBudget, PagedKv, PrefixCache, Sharing,
};
use switchyard_models::SeqKv;

const N_LAYERS: usize = 4;
const ROW: usize = 2;
/// Small blocks so that short sequences cross many block boundaries.
const BT: usize = 4;
const BLOCK_BYTES: u64 = (2 * BT * ROW * 4) as u64;
const BASE_WEIGHTS: u64 = 1_000;
const LAYER_WEIGHTS: u64 = 4 * BLOCK_BYTES;
const WORKSPACE: u64 = 500;
/// Blocks left at full depth; each dropped layer frees 4 more.
const BLOCKS_AT_FULL_DEPTH: u64 = 16;
const BUDGET: u64 =
    BASE_WEIGHTS + WORKSPACE + N_LAYERS as u64 * LAYER_WEIGHTS + BLOCKS_AT_FULL_DEPTH * BLOCK_BYTES;
/// Prompts share one of a few 12-token (3-block) prefixes.
const FAMILY_PREFIX: usize = 12;

#[derive(Debug, Clone)]
enum Op {
    New { family: u8, len: usize, seed: u32 },
    Extend { idx: usize, add: usize, seed: u32 },
    Truncate { idx: usize, by: usize },
    Publish { idx: usize },
    Release { idx: usize },
    Evict { n: usize },
    Depth { d: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 1usize..24, any::<u32>()).prop_map(|(family, len, seed)| Op::New { family, len, seed }),
        3 => (any::<usize>(), 1usize..8, any::<u32>()).prop_map(|(idx, add, seed)| Op::Extend { idx, add, seed }),
        1 => (any::<usize>(), 1usize..6).prop_map(|(idx, by)| Op::Truncate { idx, by }),
        3 => any::<usize>().prop_map(|idx| Op::Publish { idx }),
        2 => any::<usize>().prop_map(|idx| Op::Release { idx }),
        1 => (0usize..10).prop_map(|n| Op::Evict { n }),
        1 => (1usize..=N_LAYERS).prop_map(|d| Op::Depth { d }),
    ]
}

/// The K (and V) value of position `pos` of `layer`: a function of the whole prefix, so a
/// block holding another prefix's K/V reads back wrong.
fn value(tokens: &[u32], pos: usize, layer: usize) -> f32 {
    let mut h = DefaultHasher::new();
    tokens[..=pos].hash(&mut h);
    layer.hash(&mut h);
    (h.finish() % 1_000_003) as f32
}

fn tokens_from(seed: u32, n: usize) -> Vec<u32> {
    // Two symbols: random tails still share blocks now and then.
    (0..n as u64)
        .map(|i| {
            let mut x = u64::from(seed)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add(i.wrapping_mul(0xBF58_476D_1CE4_E5B9));
            x ^= x >> 29;
            x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
            ((x >> 32) % 2) as u32
        })
        .collect()
}

struct Seq {
    kv: PagedKv,
    tokens: Vec<u32>,
}

/// How often each path was taken.
#[derive(Debug, Default, PartialEq, Eq)]
struct Stats {
    admitted: usize,
    out_of_blocks: usize,
    extend_refused: usize,
    hit_blocks: usize,
    published: usize,
    preempted: usize,
    evicted: usize,
}

struct World {
    stats: Stats,
    pool: BlockPool,
    cache: PrefixCache,
    budget: MemoryBudget,
    depth: usize,
    seqs: Vec<Seq>,
    families: [Vec<u32>; 3],
}

impl World {
    fn new() -> Self {
        let depth = 2;
        let budget = MemoryBudget::new(BUDGET);
        let plan = budget
            .plan(Self::weights_at(depth), WORKSPACE, BLOCK_BYTES)
            .expect("plan");
        assert_eq!(plan.kv_blocks, 24);
        let families = [
            tokens_from(11, FAMILY_PREFIX),
            tokens_from(22, FAMILY_PREFIX),
            tokens_from(33, FAMILY_PREFIX),
        ];
        for (i, f) in families.iter().enumerate() {
            for g in &families[i + 1..] {
                assert_ne!(f[..BT], g[..BT], "families differ in their first block");
            }
        }
        Self {
            stats: Stats::default(),
            pool: BlockPool::new(ROW, BT, plan.kv_blocks),
            cache: PrefixCache::new(BT),
            budget,
            depth,
            seqs: Vec::new(),
            families,
        }
    }

    fn weights_at(depth: usize) -> u64 {
        BASE_WEIGHTS + depth as u64 * LAYER_WEIGHTS
    }

    fn planned_blocks(&self, depth: usize) -> usize {
        self.budget
            .plan(Self::weights_at(depth), WORKSPACE, BLOCK_BYTES)
            .expect("plan")
            .kv_blocks
    }

    /// Writes positions `kv.len(l)..tokens.len()` of every resident layer.
    fn compute(seq: &mut Seq, depth: usize) -> usize {
        let mut written = 0;
        for l in 0..depth {
            let start = seq.kv.len(l);
            let k: Vec<f32> = (start..seq.tokens.len())
                .flat_map(|p| [value(&seq.tokens, p, l); ROW])
                .collect();
            seq.kv.write(l, start, &k, &k).expect("write");
            written += seq.tokens.len() - start;
        }
        written
    }

    /// Makes room for `needed` blocks by evicting the prefix cache; whether they fit.
    fn make_room(&mut self, needed: usize) -> bool {
        let free = self.pool.free_blocks();
        if needed > free {
            let evictable = self.cache.evictable_blocks();
            let got = self.cache.evict_into(&mut self.pool, needed - free);
            assert_eq!(got, (needed - free).min(evictable));
            self.stats.evicted += got;
        }
        needed <= self.pool.free_blocks()
    }

    fn apply(&mut self, op: &Op) {
        let live = self.seqs.len();
        match *op {
            Op::New { family, len, seed } => {
                let mut tokens = self.families[family as usize].clone();
                tokens.truncate(len);
                tokens.extend(tokens_from(seed, len.saturating_sub(FAMILY_PREFIX)));
                let mut kv = PagedKv::for_pool(&self.pool, N_LAYERS);
                let hit = self.cache.lookup(&tokens, 0..self.depth);
                self.stats.hit_blocks += hit;
                assert!(
                    hit * BT < tokens.len(),
                    "the last token's block is never reused"
                );
                self.cache
                    .attach(&mut kv, &tokens, 0..self.depth, hit)
                    .expect("attach what lookup found");
                let needed = kv.blocks_needed(0..self.depth, tokens.len());
                if self.make_room(needed) {
                    kv.reserve(&mut self.pool, 0..self.depth, tokens.len())
                        .expect("reserve");
                    let mut seq = Seq { kv, tokens };
                    let written = Self::compute(&mut seq, self.depth);
                    self.stats.admitted += 1;
                    assert_eq!(written, self.depth * (seq.tokens.len() - hit * BT));
                    self.seqs.push(seq);
                } else {
                    self.stats.out_of_blocks += 1;
                    let (used, free) = (self.pool.used_blocks(), self.pool.free_blocks());
                    assert_eq!(
                        kv.reserve(&mut self.pool, 0..self.depth, tokens.len()),
                        Err(KvError::OutOfBlocks { needed, free })
                    );
                    assert_eq!(
                        self.pool.used_blocks(),
                        used,
                        "a failed reserve took blocks"
                    );
                    kv.release(&mut self.pool, &mut self.cache);
                }
            }
            Op::Extend { idx, add, seed } if live > 0 => {
                let depth = self.depth;
                let i = idx % live;
                let new_len = self.seqs[i].tokens.len() + add;
                let needed = self.seqs[i].kv.blocks_needed(0..depth, new_len);
                if self.make_room(needed) {
                    let seq = &mut self.seqs[i];
                    seq.kv
                        .reserve(&mut self.pool, 0..depth, new_len)
                        .expect("reserve");
                    seq.tokens.extend(tokens_from(seed, add));
                    Self::compute(seq, depth);
                } else {
                    self.stats.extend_refused += 1;
                    let before = self.pool.used_blocks();
                    assert!(self.seqs[i]
                        .kv
                        .reserve(&mut self.pool, 0..depth, new_len)
                        .is_err());
                    assert_eq!(self.pool.used_blocks(), before);
                }
            }
            Op::Truncate { idx, by } if live > 0 => {
                // Roll back only unpublished positions, as a scheduler must.
                let seq = &mut self.seqs[idx % live];
                let shared = (0..N_LAYERS)
                    .map(|l| seq.kv.shared_len(l))
                    .max()
                    .unwrap_or(0);
                let len = seq.tokens.len().saturating_sub(by).max(shared);
                seq.kv.truncate(len);
                seq.tokens.truncate(len);
            }
            Op::Publish { idx } if live > 0 => {
                let seq = &mut self.seqs[idx % live];
                let before = seq.kv.shared_blocks();
                let n = self.cache.publish(&mut seq.kv, &seq.tokens, 0..self.depth);
                assert_eq!(seq.kv.shared_blocks(), before + n);
                self.stats.published += n;
            }
            Op::Release { idx } if live > 0 => {
                let mut seq = self.seqs.swap_remove(idx % live);
                seq.kv.release(&mut self.pool, &mut self.cache);
                assert_eq!(seq.kv.owned_blocks() + seq.kv.shared_blocks(), 0);
            }
            Op::Evict { n } => {
                let evictable = self.cache.evictable_blocks();
                let free = self.pool.free_blocks();
                let got = self.cache.evict_into(&mut self.pool, n);
                assert_eq!(got, n.min(evictable));
                self.stats.evicted += got;
                assert_eq!(self.pool.free_blocks(), free + got);
            }
            Op::Depth { d } if d > self.depth => {
                // Load layers: first give their memory back from the KV pool (free blocks,
                // then the prefix cache, then preempt the newest sequences).
                let target = self.planned_blocks(d);
                loop {
                    let excess = self.pool.total_blocks().saturating_sub(target);
                    if excess == 0 {
                        break;
                    }
                    if self.pool.shrink(excess) > 0 {
                        continue;
                    }
                    let got = self.cache.evict_into(&mut self.pool, excess);
                    if got > 0 {
                        self.stats.evicted += got;
                        continue;
                    }
                    self.stats.preempted += 1;
                    let mut seq = self.seqs.pop().expect("a sequence holds the blocks");
                    seq.kv.release(&mut self.pool, &mut self.cache);
                }
                assert_eq!(self.pool.total_blocks(), target);
                self.depth = d;
            }
            Op::Depth { d } if d < self.depth => {
                // Drop layers: their blocks go back, then the freed weight memory becomes KV.
                for seq in &mut self.seqs {
                    seq.kv
                        .release_layers(&mut self.pool, &mut self.cache, d..N_LAYERS);
                }
                self.depth = d;
                let target = self.planned_blocks(d);
                self.pool.grow(target - self.pool.total_blocks());
            }
            _ => {}
        }
    }

    fn check(&self) {
        let pool = &self.pool;
        assert_eq!(pool.used_blocks() + pool.free_blocks(), pool.total_blocks());

        let cached: HashSet<BlockId> = self.cache.block_ids().collect();
        assert_eq!(cached.len(), self.cache.len());
        let mut owned: HashSet<BlockId> = HashSet::new();
        let mut shared: HashMap<BlockId, usize> = HashMap::new();
        for seq in &self.seqs {
            for r in seq.kv.blocks() {
                match r.sharing {
                    Sharing::Owned => assert!(owned.insert(r.id), "block {:?} owned twice", r.id),
                    Sharing::Shared => *shared.entry(r.id).or_default() += 1,
                }
            }
        }
        assert!(
            owned
                .iter()
                .all(|id| !shared.contains_key(id) && !cached.contains(id)),
            "an owned block is also shared"
        );
        // Every shared block is cached (the cache evicts only blocks no sequence holds).
        assert!(shared.keys().all(|id| cached.contains(id)));
        let cache_only = cached.iter().filter(|id| !shared.contains_key(id)).count();
        assert_eq!(self.cache.evictable_blocks(), cache_only);
        let owned_blocks: usize = self.seqs.iter().map(|s| s.kv.owned_blocks()).sum();
        assert_eq!(owned_blocks, owned.len());
        // Used = blocks sequences own + distinct shared blocks (all held by the cache).
        assert_eq!(pool.used_blocks(), owned.len() + cached.len());
        assert_eq!(
            pool.bytes_used() as u64,
            (owned.len() + cached.len()) as u64 * BLOCK_BYTES
        );

        let usage = self
            .budget
            .usage(Self::weights_at(self.depth), pool, WORKSPACE);
        assert_eq!(usage.check(), Ok(()));
        assert!(usage.weights + usage.kv_total() + usage.workspace <= usage.total);
        assert_eq!(usage.kv_used, pool.bytes_used() as u64);

        // Every sequence reads back its own tokens' K/V, nothing beyond the resident depth.
        for seq in &self.seqs {
            for l in 0..N_LAYERS {
                let len = seq.kv.len(l);
                if l >= self.depth {
                    assert_eq!((len, seq.kv.capacity(l)), (0, 0));
                    continue;
                }
                assert!(len <= seq.tokens.len());
                let chunks = seq.kv.chunks(l, len).expect("chunks");
                let k: Vec<f32> = chunks.iter().flat_map(|c| c.k.iter().copied()).collect();
                for p in 0..len {
                    assert_eq!(k[p * ROW], value(&seq.tokens, p, l), "layer {l} pos {p}");
                }
            }
        }
    }

    fn shutdown(mut self) {
        for mut seq in self.seqs.drain(..) {
            seq.kv.release(&mut self.pool, &mut self.cache);
        }
        self.cache.clear(&mut self.pool);
        assert_eq!(self.pool.used_blocks(), 0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn accounting_holds_after_every_operation(ops in prop::collection::vec(op(), 1..80)) {
        let mut world = World::new();
        world.check();
        for op in &ops {
            world.apply(op);
            world.check();
        }
        world.shutdown();
    }
}

/// A fixed run through every operation, so the paths above are known to be taken.
#[test]
fn scripted_run_takes_every_path() {
    let mut w = World::new();
    let script = [
        // depth 2, 24 blocks: 10 blocks, all published
        Op::New {
            family: 0,
            len: 20,
            seed: 1,
        },
        Op::Publish { idx: 0 },
        // shares the family prefix (3 blocks per layer), owns 2 per layer
        Op::New {
            family: 0,
            len: 18,
            seed: 2,
        },
        Op::Extend {
            idx: 1,
            add: 5,
            seed: 3,
        },
        Op::Truncate { idx: 1, by: 3 },
        // 12 blocks wanted, 8 free, nothing evictable
        Op::New {
            family: 1,
            len: 23,
            seed: 4,
        },
        // 16 blocks at full depth: the 8 free ones go
        Op::Depth { d: 4 },
        // 14 more blocks wanted, none free
        Op::Extend {
            idx: 0,
            add: 2,
            seed: 5,
        },
        Op::Release { idx: 0 },
        Op::Evict { n: 3 },
        // 28 blocks at depth 1
        Op::Depth { d: 1 },
        Op::New {
            family: 0,
            len: 23,
            seed: 6,
        },
        Op::New {
            family: 1,
            len: 23,
            seed: 7,
        },
        Op::New {
            family: 2,
            len: 23,
            seed: 8,
        },
        // back to 16 blocks: evict, then preempt
        Op::Depth { d: 4 },
    ];
    for op in &script {
        w.apply(op);
        w.check();
    }
    assert_eq!(
        w.stats,
        Stats {
            admitted: 5,
            out_of_blocks: 1,
            extend_refused: 1,
            // 3 prefix blocks for each of the two later family-0 prompts
            hit_blocks: 6,
            published: 10,
            preempted: 1,
            evicted: 7,
        }
    );
    assert_eq!(w.cache.hits_tokens(), 4 * 6);
    assert_eq!(w.pool.total_blocks(), w.planned_blocks(4));
    assert_eq!(w.pool.total_blocks(), 16);
    w.shutdown();
}
