//! The paged KV cache on a real model (smollm2-135m-instruct): logits equal the dense cache's
//! bit for bit, and a prefix shared through the prefix cache is not recomputed.

use std::sync::Arc;

use switchyard_engine::kv::{BlockPool, KvError, PagedKv, PrefixCache, BLOCK_TOKENS};
use switchyard_models::{DenseKv, ForwardBatch, LayeredModel, LoadOptions, SeqKv};

fn load() -> LayeredModel {
    let path = switchyard_zoo::ensure("smollm2-135m-instruct").expect("model");
    let src = switchyard_weights::open(path).expect("open");
    LayeredModel::load(Arc::clone(&src), &LoadOptions::default()).expect("load")
}

/// Fixed ids spread over the vocabulary (as the model tests use).
fn fixed_tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 100 + (i * 7919 + 13 + salt * 104_729) % 5000)
        .collect()
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Runs the model and counts the tokens it was given.
struct Runner<'m> {
    model: &'m LayeredModel,
    tokens_forwarded: usize,
}

impl Runner<'_> {
    fn forward(&mut self, kv: &mut dyn SeqKv, start: usize, tokens: &[u32]) -> Vec<Vec<f32>> {
        self.tokens_forwarded += tokens.len();
        let mut batch = ForwardBatch::single(kv, start, tokens.len());
        self.model
            .forward(tokens, &mut batch)
            .expect("forward")
            .to_vec2()
            .expect("logits")
    }

    /// Prefill of `tokens[start..]` (positions before `start` are cached) then `steps` greedy
    /// decode steps: every logits row, and the decoded tokens.
    fn generate(
        &mut self,
        kv: &mut dyn SeqKv,
        tokens: &[u32],
        start: usize,
        steps: usize,
    ) -> (Vec<Vec<f32>>, Vec<u32>) {
        let mut rows = self.forward(kv, start, &tokens[start..]);
        let mut out = Vec::new();
        for _ in 0..steps {
            let next = argmax(rows.last().expect("a row"));
            out.push(next);
            let pos = tokens.len() + out.len() - 1;
            rows.extend(self.forward(kv, pos, &[next]));
        }
        (rows, out)
    }
}

#[test]
fn paged_logits_equal_dense_logits_bit_for_bit() {
    let model = load();
    let (n_layers, row) = (model.n_layers(), model.spec().kv_row_len());
    let prompt = fixed_tokens(45, 0);
    let steps = 10;
    let mut run = Runner {
        model: &model,
        tokens_forwarded: 0,
    };

    let mut dense = DenseKv::new(n_layers, row);
    let (dense_rows, dense_out) = run.generate(&mut dense, &prompt, 0, steps);

    // Exactly the blocks 55 positions need in every layer: ceil(55 / 16) = 4 per layer.
    let per_layer = (prompt.len() + steps).div_ceil(BLOCK_TOKENS);
    assert_eq!(per_layer, 4);
    let mut pool = BlockPool::new(row, BLOCK_TOKENS, per_layer * n_layers);
    let mut cache = PrefixCache::new(BLOCK_TOKENS);
    let mut paged = PagedKv::for_pool(&pool, n_layers);
    let mut reserved_at = Vec::new();
    // Reserve before each step, as a scheduler does; the model only sees `SeqKv`.
    let mut grow = |pool: &mut BlockPool, kv: &mut PagedKv, len: usize| {
        let before = pool.used_blocks();
        kv.reserve(pool, 0..n_layers, len).expect("reserve");
        if pool.used_blocks() > before {
            reserved_at.push((len, pool.used_blocks()));
        }
    };
    grow(&mut pool, &mut paged, prompt.len());
    let mut paged_rows = run.forward(&mut paged, 0, &prompt);
    let mut paged_out = Vec::new();
    for _ in 0..steps {
        let next = argmax(paged_rows.last().expect("a row"));
        paged_out.push(next);
        let pos = prompt.len() + paged_out.len() - 1;
        grow(&mut pool, &mut paged, pos + 1);
        paged_rows.extend(run.forward(&mut paged, pos, &[next]));
    }

    assert_eq!(paged_out, dense_out);
    assert_eq!(paged_rows.len(), 45 + steps);
    assert_eq!(paged_rows.len(), dense_rows.len());
    for (i, (p, d)) in paged_rows.iter().zip(&dense_rows).enumerate() {
        assert!(
            p.iter().zip(d).all(|(a, b)| a.to_bits() == b.to_bits()),
            "row {i} differs"
        );
    }
    // 3 blocks per layer for the prompt, the 4th when position 48 is written.
    assert_eq!(reserved_at, vec![(45, 3 * n_layers), (49, 4 * n_layers)]);
    assert_eq!((pool.used_blocks(), pool.free_blocks()), (4 * n_layers, 0));
    assert_eq!(paged.len(0), 55);
    let chunks = paged.chunks(n_layers - 1, 55).expect("chunks");
    assert_eq!(
        chunks.iter().map(|c| c.tokens).collect::<Vec<_>>(),
        vec![16, 16, 16, 7]
    );
    // The pool is full: position 64 needs a fifth block per layer.
    assert_eq!(
        paged.reserve(&mut pool, 0..n_layers, 65),
        Err(KvError::OutOfBlocks {
            needed: n_layers,
            free: 0
        })
    );
    // Writing past the reservation is an error from the model, not a panic: 10 more tokens
    // would need positions 55..65, 64 are reserved.
    let more = fixed_tokens(10, 2);
    let mut batch = ForwardBatch::single(&mut paged, 55, more.len());
    let err = model
        .forward(&more, &mut batch)
        .expect_err("unreserved write")
        .to_string();
    assert!(
        err.contains("write of positions 55..65 in layer 0 goes beyond the 64 reserved positions"),
        "{err}"
    );
    assert_eq!(paged.len(0), 55);

    paged.release(&mut pool, &mut cache);
    assert_eq!((pool.used_blocks(), pool.free_blocks()), (0, 4 * n_layers));
    assert_eq!(run.tokens_forwarded, 2 * (45 + steps));
}

#[test]
fn shared_prefix_is_reused_and_gives_the_cold_logits() {
    let model = load();
    let (n_layers, row) = (model.n_layers(), model.spec().kv_row_len());
    let layers = 0..n_layers;
    let steps = 5;
    let a = fixed_tokens(45, 0);
    // B: A's first 32 tokens (two full blocks), then 8 of its own.
    let mut b = a[..32].to_vec();
    b.extend(fixed_tokens(8, 1));
    assert_ne!(b[32..], a[32..40]);

    let mut pool = BlockPool::new(row, BLOCK_TOKENS, 12 * n_layers);
    let mut cache = PrefixCache::new(BLOCK_TOKENS);
    let mut run = Runner {
        model: &model,
        tokens_forwarded: 0,
    };

    // A: computed cold, its full blocks published.
    let mut kv_a = PagedKv::for_pool(&pool, n_layers);
    assert_eq!(cache.lookup(&a, layers.clone()), 0);
    kv_a.reserve(&mut pool, layers.clone(), a.len())
        .expect("reserve");
    run.forward(&mut kv_a, 0, &a);
    assert_eq!(cache.publish(&mut kv_a, &a, layers.clone()), 2 * n_layers);
    assert_eq!(kv_a.shared_blocks(), 2 * n_layers);
    assert_eq!(pool.used_blocks(), 3 * n_layers);

    // B, warm: 2 blocks from the cache, only its last 8 tokens through the model.
    let mut kv_b = PagedKv::for_pool(&pool, n_layers);
    let hit = cache.lookup(&b, layers.clone());
    assert_eq!(hit, 2);
    cache
        .attach(&mut kv_b, &b, layers.clone(), hit)
        .expect("attach");
    assert_eq!(kv_b.len(0), 32);
    assert_eq!(
        kv_b.blocks_needed(layers.clone(), b.len() + steps),
        n_layers
    );
    let before = run.tokens_forwarded;
    kv_b.reserve(&mut pool, layers.clone(), b.len() + steps)
        .expect("reserve");
    let (warm_rows, warm_out) = run.generate(&mut kv_b, &b, hit * BLOCK_TOKENS, steps);
    assert_eq!(run.tokens_forwarded - before, 8 + steps);
    assert_eq!(
        pool.used_blocks(),
        4 * n_layers,
        "B took one block per layer"
    );
    assert_eq!((cache.hits_tokens(), cache.queried_tokens()), (32, 45 + 40));

    // B, cold: all 40 tokens through the model in a cache of its own.
    let mut cold = DenseKv::new(n_layers, row);
    let before = run.tokens_forwarded;
    let (cold_rows, cold_out) = run.generate(&mut cold, &b, 0, steps);
    assert_eq!(run.tokens_forwarded - before, 40 + steps);

    assert_eq!(warm_out, cold_out);
    let cold_tail = &cold_rows[32..];
    assert_eq!(warm_rows.len(), cold_tail.len());
    for (i, (w, c)) in warm_rows.iter().zip(cold_tail).enumerate() {
        assert!(
            w.iter().zip(c).all(|(x, y)| x.to_bits() == y.to_bits()),
            "row {} differs",
            32 + i
        );
    }

    kv_a.release(&mut pool, &mut cache);
    kv_b.release(&mut pool, &mut cache);
    assert_eq!(
        pool.used_blocks(),
        2 * n_layers,
        "only the cached prefix is left"
    );
    assert_eq!(cache.evict_into(&mut pool, usize::MAX), 2 * n_layers);
    assert_eq!(pool.used_blocks(), 0);
}
