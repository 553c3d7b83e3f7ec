//! Random arrivals, prompt lengths, aborts, steps and residency changes against the serving
//! engine on a small synthetic model: after every operation the accounted bytes stay inside
//! the budget, the pool's used blocks are exactly the sequences' own blocks plus the prefix
//! cache's, blocks exist only for the layers in use, and every request ends exactly once.

use std::collections::HashSet;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use proptest::prelude::*;
use switchyard_engine::kv::{activation_bytes, MemoryBudget, BLOCK_TOKENS};
use switchyard_engine::scheduler::{AdmissionPolicy, SeqStatus};
use switchyard_engine::{
    EngineConfig, EngineCore, EngineError, EngineRequest, RequestId, SchedulerConfig,
};
use switchyard_models::{LayeredModel, LoadOptions};
use switchyard_request::SamplingParams;
use switchyard_weights::{Architecture, SyntheticSource, WeightSource};

const N_LAYERS: usize = 4;
/// KV blocks left beside all four layers (6 blocks, 96 positions, per layer).
const BLOCKS_AT_FULL_DEPTH: u64 = 24;
const SCHED: SchedulerConfig = SchedulerConfig {
    max_batched_tokens: 32,
    max_num_seqs: 6,
    chunked_prefill: true,
    prefix_caching: true,
    admission: AdmissionPolicy::Optimistic,
};

#[derive(Debug, Clone)]
enum Op {
    Add {
        family: u8,
        len: usize,
        max: usize,
        seed: u32,
    },
    Abort {
        idx: usize,
    },
    Step {
        n: usize,
    },
    Load {
        upto: usize,
        raise: bool,
    },
    Drop {
        keep: usize,
    },
    Depth {
        d: usize,
    },
    /// A budget of the starting one plus `extra` blocks (growing or shrinking the pool).
    Budget {
        extra: u64,
    },
    /// Park the engine (refused while requests are in it).
    Park,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 1usize..110, 1usize..40, any::<u32>())
            .prop_map(|(family, len, max, seed)| Op::Add { family, len, max, seed }),
        1 => any::<usize>().prop_map(|idx| Op::Abort { idx }),
        6 => (1usize..5).prop_map(|n| Op::Step { n }),
        1 => (1usize..=N_LAYERS, any::<bool>()).prop_map(|(upto, raise)| Op::Load { upto, raise }),
        1 => (1usize..=N_LAYERS).prop_map(|keep| Op::Drop { keep }),
        1 => (1usize..=N_LAYERS).prop_map(|d| Op::Depth { d }),
        1 => (0u64..=8).prop_map(|extra| Op::Budget { extra }),
        1 => Just(Op::Park),
    ]
}

fn source() -> Arc<dyn WeightSource> {
    let spec = SyntheticSource::tiny_spec(Architecture::Llama);
    Arc::new(SyntheticSource::new(spec, 5, GgmlDType::F32).expect("synthetic model"))
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (seed.wrapping_mul(2_654_435_761).wrapping_add(i * 40_503) >> 7) % 256)
        .collect()
}

struct World {
    core: EngineCore,
    budget: MemoryBudget,
    start_budget: u64,
    workspace: u64,
    block_bytes: u64,
    families: [Vec<u32>; 3],
    next: u64,
    live: HashSet<RequestId>,
    ended: HashSet<RequestId>,
    refused: usize,
    preempted_or_recomputed: u64,
}

impl World {
    fn new() -> Self {
        let src = source();
        let full = LayeredModel::load(Arc::clone(&src), &LoadOptions::default()).expect("load");
        let spec = full.spec().clone();
        let workspace =
            activation_bytes(&spec, SCHED.max_batched_tokens, SCHED.max_num_seqs) as u64;
        // K and V, 2 bytes a value in the default f16 blocks.
        let block_bytes = (2 * BLOCK_TOKENS * spec.kv_row_len() * 2) as u64;
        let budget =
            full.resident_bytes().total() as u64 + workspace + BLOCKS_AT_FULL_DEPTH * block_bytes;
        let half = LayeredModel::load(
            src,
            &LoadOptions {
                layers: Some(2),
                ..LoadOptions::default()
            },
        )
        .expect("load");
        let cfg = EngineConfig {
            memory_budget: budget,
            scheduler: SCHED,
            ..EngineConfig::default()
        };
        Self {
            core: EngineCore::new(half, vec![0], cfg).expect("engine"),
            budget: MemoryBudget::new(budget),
            start_budget: budget,
            workspace,
            block_bytes,
            families: [tokens(1, 32), tokens(2, 32), tokens(3, 32)],
            next: 0,
            live: HashSet::new(),
            ended: HashSet::new(),
            refused: 0,
            preempted_or_recomputed: 0,
        }
    }

    fn step(&mut self) {
        let r = self.core.step();
        for (id, e) in r.failed {
            // Only a queued prompt that the pool no longer holds (after layers were loaded)
            // may fail.
            assert!(
                matches!(e, EngineError::PromptExceedsMemory { .. }),
                "{id}: {e}"
            );
            assert!(
                self.live.remove(&id),
                "{id} failed twice or was never added"
            );
            assert!(self.ended.insert(id));
        }
        for o in r.outputs {
            assert!(
                self.live.contains(&o.id),
                "output for {} after it ended",
                o.id
            );
            if o.finish.is_some() {
                self.live.remove(&o.id);
                assert!(self.ended.insert(o.id));
            }
        }
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Add {
                family,
                len,
                max,
                seed,
            } => {
                let mut prompt = self.families[family as usize].clone();
                prompt.truncate(len);
                prompt.extend(tokens(seed, len.saturating_sub(32)));
                let id = RequestId(self.next);
                self.next += 1;
                let params = SamplingParams {
                    ignore_eos: seed % 2 == 0,
                    ..SamplingParams::greedy(max)
                };
                match self.core.add_request(id, EngineRequest { prompt, params }) {
                    Ok(()) => {
                        self.live.insert(id);
                    }
                    Err(EngineError::PromptExceedsMemory { .. }) => self.refused += 1,
                    Err(EngineError::Parked) => assert!(self.core.is_parked()),
                    Err(e) => panic!("unexpected refusal: {e}"),
                }
            }
            Op::Abort { idx } if !self.live.is_empty() => {
                let mut ids: Vec<RequestId> = self.live.iter().copied().collect();
                ids.sort();
                let id = ids[idx % ids.len()];
                assert!(self.core.abort(id));
                self.live.remove(&id);
                self.ended.insert(id);
            }
            Op::Step { n } => {
                for _ in 0..n {
                    self.step();
                    self.check();
                }
            }
            Op::Load { upto, raise } => {
                let resident = self.core.resident_layers();
                let report = self
                    .core
                    .load_layers_now(upto)
                    .expect("the budget holds all layers");
                assert_eq!(report.layers.len(), upto.saturating_sub(resident));
                self.preempted_or_recomputed += report.preempted.len() as u64;
                if raise {
                    self.core.set_depth(upto.max(resident)).expect("resident");
                }
            }
            Op::Drop { keep } => {
                let before = self.core.resident_layers();
                self.core.drop_layers(keep).expect("drop");
                assert_eq!(self.core.resident_layers(), keep.min(before));
                assert!(self.core.depth() <= keep);
            }
            Op::Budget { extra } => {
                let bytes = self.start_budget + extra * self.block_bytes;
                self.core.set_budget(bytes).expect("above the weights");
                self.budget = MemoryBudget::new(bytes);
            }
            Op::Park => match self.core.park() {
                Ok(_) => {
                    assert!(self.core.is_parked());
                    assert_eq!(self.core.resident_layers(), 0);
                }
                Err(e) => {
                    assert!(self.core.has_work(), "{e}");
                    assert!(
                        e.to_string().starts_with(
                            "invalid engine configuration: cannot park an engine that holds"
                        ),
                        "{e}"
                    );
                }
            },
            Op::Depth { d } => match self.core.set_depth(d) {
                Ok(()) => assert_eq!(self.core.depth(), d),
                Err(EngineError::DepthNotResident { .. }) => {
                    assert!(d > self.core.resident_layers())
                }
                Err(e) => panic!("{e}"),
            },
            _ => {}
        }
    }

    fn check(&self) {
        let core = &self.core;
        let usage = core.usage();
        usage.check().expect("inside the budget");
        let weights = core.model().resident_bytes().total() as u64;
        assert_eq!(usage.weights, weights);
        let sched = core.scheduler();
        let pool = sched.pool();
        assert_eq!(pool.used_blocks() + pool.free_blocks(), pool.total_blocks());
        if core.is_parked() {
            // Nothing but the final norm: no layer, no pool, no workspace.
            assert_eq!(weights, core.model().spec().d_model as u64 * 4);
            assert_eq!(usage.workspace, 0);
            assert_eq!(pool.total_blocks(), 0);
        } else {
            assert_eq!(usage.workspace, self.workspace);
            // The pool is exactly what the budget leaves beside the weights and the workspace.
            let plan = self
                .budget
                .plan(weights, self.workspace, self.block_bytes)
                .expect("plan");
            assert_eq!(pool.total_blocks(), plan.kv_blocks);
        }
        // Used blocks = blocks sequences own + blocks the prefix cache holds (shared or not).
        let depth = core.depth();
        let mut owned = 0;
        let ids: Vec<RequestId> = sched
            .running()
            .iter()
            .copied()
            .chain(sched.waiting())
            .collect();
        assert_eq!(ids.len(), self.live.len());
        for id in ids {
            assert!(self.live.contains(&id));
            let seq = sched.sequence(id).expect("sequence");
            owned += seq.kv().owned_blocks();
            for l in depth..N_LAYERS {
                assert_eq!(
                    seq.kv().capacity(l),
                    0,
                    "{id} holds blocks of unused layer {l}"
                );
            }
            if seq.status() == SeqStatus::Waiting {
                assert_eq!(seq.kv().owned_blocks() + seq.kv().shared_blocks(), 0);
            }
        }
        assert_eq!(pool.used_blocks(), owned + sched.cache().len());
        let s = core.stats();
        let m = s.memory;
        assert_eq!(
            m.in_use_bytes,
            m.weights_bytes + m.kv_used_bytes + m.kv_free_bytes + m.workspace_bytes
        );
        assert_eq!(
            m.kv_used_bytes,
            pool.used_blocks() as u64 * self.block_bytes
        );
        assert!(m.in_use_bytes <= m.budget_bytes);
    }

    fn drain(&mut self) {
        for _ in 0..5_000 {
            if !self.core.has_work() {
                break;
            }
            self.step();
            self.check();
        }
        assert!(self.live.is_empty(), "never finished: {:?}", self.live);
        let sched = self.core.scheduler();
        assert_eq!(sched.pool().used_blocks(), sched.cache().len());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn the_budget_holds_after_every_step(ops in prop::collection::vec(op(), 1..60)) {
        let mut w = World::new();
        w.check();
        for op in &ops {
            w.apply(op);
            w.check();
        }
        w.drain();
    }
}

/// A fixed run that goes through the interesting paths: refusal, chunking, preemption when
/// layers load, prefix hits.
#[test]
fn scripted_run_takes_every_path() {
    let mut w = World::new();
    let script = [
        Op::Load {
            upto: 4,
            raise: true,
        },
        // 96 positions per layer: 100 tokens never fit.
        Op::Add {
            family: 0,
            len: 100,
            max: 4,
            seed: 1,
        },
        Op::Drop { keep: 2 },
        Op::Add {
            family: 0,
            len: 100,
            max: 30,
            seed: 2,
        },
        Op::Add {
            family: 0,
            len: 40,
            max: 30,
            seed: 3,
        },
        Op::Add {
            family: 1,
            len: 60,
            max: 30,
            seed: 4,
        },
        Op::Step { n: 4 },
        // Back to 4 layers: the pool shrinks under the running sequences.
        Op::Load {
            upto: 4,
            raise: true,
        },
        Op::Step { n: 3 },
        Op::Add {
            family: 0,
            len: 50,
            max: 5,
            seed: 5,
        },
        Op::Step { n: 3 },
        Op::Abort { idx: 0 },
    ];
    for op in &script {
        w.apply(op);
        w.check();
    }
    w.drain();
    let s = w.core.stats();
    assert_eq!(w.refused, 1);
    assert!(s.counters.preemptions >= 1, "{:?}", s.counters);
    assert!(s.counters.recomputed_tokens > 0);
    assert!(s.prefix_cache_hit_tokens > 0);
    assert_eq!(s.counters.largest_step_tokens, 32);
    assert_eq!(w.ended.len(), 4);
}

/// A budget moves between steps: the pool grows into it and shrinks back (preempting when the
/// running sequences hold more than is left), and a budget below the resident weights plus
/// the workspace is refused with the figures.
#[test]
fn the_budget_moves_between_steps() {
    let mut w = World::new();
    let blocks = w.core.scheduler().pool().total_blocks();
    w.apply(&Op::Budget { extra: 8 });
    w.check();
    assert_eq!(w.core.scheduler().pool().total_blocks(), blocks + 8);
    for seed in 0..4 {
        w.apply(&Op::Add {
            family: 0,
            len: 100,
            max: 30,
            seed,
        });
    }
    w.apply(&Op::Step { n: 4 });
    w.check();
    w.apply(&Op::Budget { extra: 0 });
    w.check();
    assert_eq!(w.core.scheduler().pool().total_blocks(), blocks);
    w.drain();
    let floor = w.core.weights_bytes() + w.workspace;
    let err = w.core.set_budget(floor - 1).expect_err("below the weights");
    assert!(
        err.to_string().contains(&format!(
            "below the resident weights and the workspace ({floor} bytes)"
        )),
        "{err}"
    );
    w.core.set_budget(floor).expect("exactly the weights");
    assert_eq!(w.core.scheduler().pool().total_blocks(), 0);
}

/// A parked engine holds no layer, embedding, head, pool or workspace and refuses requests;
/// loading its layers holds everything again and it answers as before.
#[test]
fn a_parked_engine_holds_nothing_and_comes_back() {
    let mut w = World::new();
    let greedy = |w: &mut World, id: u64| {
        let prompt = w.families[1].clone();
        w.core
            .add_request(
                RequestId(id),
                EngineRequest {
                    prompt,
                    params: SamplingParams {
                        ignore_eos: true,
                        ..SamplingParams::greedy(6)
                    },
                },
            )
            .expect("added");
        let mut out = Vec::new();
        while w.core.has_work() {
            out.extend(w.core.step().outputs.into_iter().filter_map(|o| o.token));
        }
        out
    };
    w.apply(&Op::Load {
        upto: 4,
        raise: true,
    });
    let before = greedy(&mut w, 900);
    assert_eq!(before.len(), 6);
    w.apply(&Op::Add {
        family: 0,
        len: 20,
        max: 3,
        seed: 1,
    });
    // 20 prompt tokens and 3 to generate, at depth 4: two blocks per layer to finish.
    let blocks = 23usize.div_ceil(BLOCK_TOKENS) * 4;
    assert_eq!(
        w.core.stats().memory.kv_to_finish_bytes,
        blocks as u64 * w.block_bytes
    );
    let err = w.core.park().expect_err("a request is queued").to_string();
    assert_eq!(
        err,
        "invalid engine configuration: cannot park an engine that holds 1 requests"
    );
    w.drain();
    let report = w.core.park().expect("idle");
    assert!(report.pool_blocks_freed > 0);
    w.check();
    let m = w.core.stats().memory;
    assert_eq!(
        (m.kv_used_bytes + m.kv_free_bytes, m.workspace_bytes),
        (0, 0)
    );
    let err = w
        .core
        .add_request(
            RequestId(901),
            EngineRequest {
                prompt: vec![1, 2, 3],
                params: SamplingParams::greedy(2),
            },
        )
        .expect_err("parked");
    assert!(matches!(err, EngineError::Parked), "{err}");
    w.apply(&Op::Load {
        upto: 4,
        raise: true,
    });
    w.check();
    assert!(!w.core.is_parked());
    assert_eq!(greedy(&mut w, 902), before);
}
