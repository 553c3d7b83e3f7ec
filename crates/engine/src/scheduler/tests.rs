//! The scheduler driven directly, with a stand-in for the model: every scheduled position of
//! every layer in use gets a K value that depends on the whole prefix, and the sampled token
//! is a function of everything the sequence's cache holds, so a chunk that skips, repeats or
//! misplaces a position changes the tokens.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use switchyard_models::SeqKv;

use super::*;
use crate::kv::RerunKv;

const BT: usize = 4;
const CONTEXT: usize = 64;

fn cfg(budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_batched_tokens: budget,
        max_num_seqs: 16,
        chunked_prefill: true,
        prefix_caching: false,
        admission: AdmissionPolicy::Optimistic,
    }
}

fn scheduler(cfg: SchedulerConfig, blocks: usize, layers: usize) -> Scheduler {
    Scheduler::new(cfg, BlockPool::new(1, BT, blocks), layers, layers, CONTEXT).expect("scheduler")
}

fn value(tokens: &[u32], pos: usize, layer: usize) -> f32 {
    let mut h = DefaultHasher::new();
    tokens[..=pos].hash(&mut h);
    layer.hash(&mut h);
    (h.finish() % 10_007) as f32
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 31 + salt * 7) % 97).collect()
}

fn add(s: &mut Scheduler, id: u64, prompt: Vec<u32>, max_tokens: usize) {
    s.add(
        RequestId(id),
        NewSequence {
            prompt,
            max_tokens,
            ignore_eos: false,
        },
    )
    .expect("add");
}

/// One step with the stand-in model; returns what was scheduled and the updates.
fn step(s: &mut Scheduler) -> (SchedulerOutput, Vec<SeqUpdate>) {
    let out = s.schedule();
    let depth = s.depth();
    let tokens: Vec<Vec<u32>> = out
        .scheduled
        .iter()
        .map(|sc| s.sequence(sc.id).expect("scheduled").tokens().to_vec())
        .collect();
    let kvs = s.kv_batch(&out);
    assert_eq!(kvs.len(), out.scheduled.len());
    let mut sampled = Vec::new();
    for ((kv, sc), toks) in kvs.into_iter().zip(&out.scheduled).zip(&tokens) {
        let mut re = RerunKv::new(kv);
        for l in 0..depth {
            let k: Vec<f32> = (sc.start..sc.start + sc.n)
                .map(|p| value(toks, p, l))
                .collect();
            re.write(l, sc.start, &k, &k).expect("write");
        }
        if sc.sample {
            let len = sc.start + sc.n;
            let mut h = DefaultHasher::new();
            for l in 0..depth {
                for c in re.chunks(l, len).expect("chunks") {
                    for x in c.k {
                        x.to_bits().hash(&mut h);
                    }
                }
            }
            sampled.push(SampledToken {
                id: sc.id,
                token: (h.finish() % 1000) as u32,
                logprob: 0.0,
                end_of_generation: false,
                stop_token: false,
            });
        }
    }
    let up = s.update_from_output(&out, &sampled);
    (out, up)
}

fn sched(id: u64, start: usize, n: usize, sample: bool) -> ScheduledSeq {
    ScheduledSeq {
        id: RequestId(id),
        start,
        n,
        sample,
    }
}

/// Runs until nothing is left; every sequence's output tokens.
fn run_all(s: &mut Scheduler, outputs: &mut HashMap<u64, Vec<u32>>) {
    for _ in 0..1000 {
        if !s.has_work() {
            return;
        }
        let (_, up) = step(s);
        for u in up {
            if let Some(t) = u.token {
                outputs.entry(u.id.0).or_default().push(t);
            }
        }
    }
    panic!("did not finish");
}

#[test]
fn chunked_prefill_shares_steps_with_decode() {
    let mut s = scheduler(cfg(8), 64, 2);
    add(&mut s, 1, prompt(3, 1), 10);
    assert_eq!(step(&mut s).0.scheduled, vec![sched(1, 0, 3, true)]);
    add(&mut s, 2, prompt(20, 2), 10);
    let plan: Vec<Vec<ScheduledSeq>> = (0..4).map(|_| step(&mut s).0.scheduled).collect();
    assert_eq!(
        plan,
        vec![
            vec![sched(1, 3, 1, true), sched(2, 0, 7, false)],
            vec![sched(1, 4, 1, true), sched(2, 7, 7, false)],
            vec![sched(1, 5, 1, true), sched(2, 14, 6, true)],
            vec![sched(1, 6, 1, true), sched(2, 20, 1, true)],
        ]
    );
    let c = *s.counters();
    assert_eq!(
        (
            c.prompt_tokens_computed,
            c.decode_tokens_computed,
            c.recomputed_tokens
        ),
        (23, 5, 0)
    );
    assert_eq!((c.largest_batch, c.largest_step_tokens, c.steps), (2, 8, 5));
}

#[test]
fn chunking_off_runs_a_long_prompt_whole_and_alone() {
    let mut s = scheduler(
        SchedulerConfig {
            chunked_prefill: false,
            ..cfg(8)
        },
        64,
        1,
    );
    add(&mut s, 1, prompt(3, 1), 10);
    add(&mut s, 2, prompt(20, 2), 10);
    // 3 fit the budget, then 20 do not fit the 5 left: 2 waits.
    assert_eq!(step(&mut s).0.scheduled, vec![sched(1, 0, 3, true)]);
    assert_eq!(step(&mut s).0.scheduled, vec![sched(1, 3, 1, true)]);
    let mut s = scheduler(
        SchedulerConfig {
            chunked_prefill: false,
            ..cfg(8)
        },
        64,
        1,
    );
    add(&mut s, 2, prompt(20, 2), 10);
    assert_eq!(step(&mut s).0.scheduled, vec![sched(2, 0, 20, true)]);
    assert_eq!(s.config().max_step_tokens(CONTEXT), CONTEXT);
}

#[test]
fn admission_waits_for_blocks_then_joins() {
    // 2 layers, 8 blocks: A's 12 tokens take 6, B's 8 would take 4 more.
    let mut s = scheduler(cfg(64), 8, 2);
    add(&mut s, 1, prompt(12, 1), 1);
    add(&mut s, 2, prompt(8, 2), 1);
    let (out, up) = step(&mut s);
    assert_eq!(out.scheduled, vec![sched(1, 0, 12, true)]);
    assert_eq!(s.waiting().collect::<Vec<_>>(), vec![RequestId(2)]);
    assert_eq!(up[0].finish, Some(FinishReason::Length));
    assert_eq!(
        s.pool().used_blocks(),
        0,
        "a finished sequence frees its blocks"
    );
    assert_eq!(step(&mut s).0.scheduled, vec![sched(2, 0, 8, true)]);
    assert!(!s.has_work());
}

#[test]
fn decode_out_of_blocks_preempts_the_newest_and_recomputes_it() {
    let mut alone = HashMap::new();
    for id in [1, 2] {
        let mut s = scheduler(cfg(64), 64, 2);
        add(&mut s, id, prompt(4, id as u32), 8);
        run_all(&mut s, &mut alone);
    }
    // 8 blocks: both fit at first (4 blocks), both grow into a second block per layer at
    // position 4 (8 blocks), and the first to reach position 8 needs a third.
    let mut s = scheduler(cfg(64), 8, 2);
    add(&mut s, 1, prompt(4, 1), 8);
    add(&mut s, 2, prompt(4, 2), 8);
    let mut together: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut preempted_at = Vec::new();
    for i in 0..100 {
        if !s.has_work() {
            break;
        }
        let (out, up) = step(&mut s);
        if !out.preempted.is_empty() {
            preempted_at.push((i, out.preempted.clone(), out.scheduled.clone()));
        }
        for u in up {
            if let Some(t) = u.token {
                together.entry(u.id.0).or_default().push(t);
            }
        }
    }
    // Step 5 runs position 8 of A: B (newest) goes back to waiting, A runs alone.
    assert_eq!(
        preempted_at,
        vec![(5, vec![RequestId(2)], vec![sched(1, 8, 1, true)])]
    );
    assert_eq!(together, alone);
    assert_eq!(together[&1].len(), 8);
    let c = s.counters();
    assert_eq!(c.preemptions, 1);
    // B had 4 prompt + 4 generated positions computed when preempted; all 8 ran again.
    assert_eq!(c.recomputed_tokens, 8);
    assert_eq!(s.pool().used_blocks(), 0);
}

#[test]
fn prompts_that_can_never_run_are_refused() {
    let mut s = scheduler(cfg(64), 8, 2);
    let new = |n| NewSequence {
        prompt: prompt(n, 0),
        max_tokens: 4,
        ignore_eos: false,
    };
    let err = |s: &mut Scheduler, id, n| s.add(RequestId(id), new(n)).unwrap_err().to_string();
    assert_eq!(err(&mut s, 1, 0), "the prompt is empty");
    assert_eq!(
        err(&mut s, 1, 64),
        "the prompt has 64 tokens; the model's context holds 64, leaving no room to generate"
    );
    // 17 tokens = 5 blocks per layer, 10 in all, the pool has 8.
    assert!(matches!(
        s.add(RequestId(1), new(17)),
        Err(EngineError::PromptExceedsMemory {
            prompt: 17,
            blocks_needed: 10,
            pool_blocks: 8,
            depth: 2
        })
    ));
    s.add(RequestId(1), new(16)).expect("16 tokens fit exactly");
    assert!(matches!(
        s.add(RequestId(1), new(3)),
        Err(EngineError::DuplicateRequest { id: RequestId(1) })
    ));
    assert_eq!(s.waiting().count(), 1);
}

#[test]
fn a_sequence_that_outgrows_the_whole_pool_finishes_with_length() {
    // 4 blocks, 2 layers: positions 0..8 fit; position 8 can never.
    let mut s = scheduler(cfg(64), 4, 2);
    add(&mut s, 1, prompt(4, 1), 100);
    let mut outputs = HashMap::new();
    let mut ended = Vec::new();
    for _ in 0..20 {
        if !s.has_work() {
            break;
        }
        let (out, up) = step(&mut s);
        ended.extend(out.ended);
        for u in up {
            outputs.entry(u.id.0).or_insert_with(Vec::new).push(u.token);
        }
    }
    assert_eq!(
        ended,
        vec![(RequestId(1), SeqEnd::Finished(FinishReason::Length))]
    );
    // Tokens for positions 4..=8 were sampled (the one at 8 could not be fed).
    assert_eq!(outputs[&1].len(), 5);
    assert_eq!(s.pool().used_blocks(), 0);
}

#[test]
fn prefix_hit_skips_the_cached_blocks() {
    let mut s = scheduler(
        SchedulerConfig {
            prefix_caching: true,
            ..cfg(64)
        },
        64,
        2,
    );
    let a = prompt(10, 1);
    let mut b = a[..8].to_vec();
    b.extend([90, 91]);
    add(&mut s, 1, a.clone(), 1);
    assert_eq!(step(&mut s).0.scheduled, vec![sched(1, 0, 10, true)]);
    // A finished; its two full blocks per layer stay cached.
    assert_eq!(s.cache().len(), 4);
    add(&mut s, 2, b, 1);
    add(&mut s, 3, a, 1);
    assert_eq!(
        step(&mut s).0.scheduled,
        vec![sched(2, 8, 2, true), sched(3, 8, 2, true)]
    );
    assert_eq!(
        (s.cache().hits_tokens(), s.cache().queried_tokens()),
        (16, 30)
    );
    assert_eq!(s.counters().prompt_tokens_computed, 14);
}

#[test]
fn lowering_the_depth_frees_layers_and_raising_it_recomputes() {
    let mut s = scheduler(cfg(64), 64, 3);
    add(&mut s, 1, prompt(6, 1), 20);
    step(&mut s);
    step(&mut s);
    // 7 positions in 2 blocks per layer, 3 layers.
    assert_eq!(s.pool().used_blocks(), 6);
    s.set_depth(1).expect("depth");
    assert_eq!(s.pool().used_blocks(), 2);
    assert_eq!(step(&mut s).0.scheduled, vec![sched(1, 7, 1, true)]);
    s.set_depth(3).expect("depth");
    // Layers 1 and 2 hold nothing: all 9 positions run again (only they store them).
    assert_eq!(step(&mut s).0.scheduled, vec![sched(1, 0, 9, true)]);
    assert_eq!(s.pool().used_blocks(), 9);
    let c = s.counters();
    assert_eq!(
        (
            c.prompt_tokens_computed,
            c.decode_tokens_computed,
            c.recomputed_tokens
        ),
        (6, 3, 8)
    );
    assert!(matches!(
        s.set_depth(4),
        Err(EngineError::BadDepth {
            depth: 4,
            n_layers: 3
        })
    ));
}

#[test]
fn the_sequence_cap_limits_the_batch() {
    let mut s = scheduler(
        SchedulerConfig {
            max_num_seqs: 2,
            ..cfg(64)
        },
        64,
        1,
    );
    for id in 1..=3 {
        add(&mut s, id, prompt(2, id as u32), 2);
    }
    let ids = |o: &SchedulerOutput| o.scheduled.iter().map(|x| x.id.0).collect::<Vec<_>>();
    assert_eq!(ids(&step(&mut s).0), vec![1, 2]);
    assert_eq!(ids(&step(&mut s).0), vec![1, 2]);
    assert_eq!(ids(&step(&mut s).0), vec![3]);
}

#[test]
fn shrinking_the_pool_frees_then_evicts_then_preempts_the_newest() {
    let mut s = scheduler(
        SchedulerConfig {
            prefix_caching: true,
            ..cfg(64)
        },
        20,
        1,
    );
    add(&mut s, 1, prompt(8, 1), 1);
    step(&mut s);
    // 2 cached blocks, 18 free.
    assert_eq!((s.cache().len(), s.pool().free_blocks()), (2, 18));
    add(&mut s, 2, prompt(8, 2), 10);
    add(&mut s, 3, prompt(8, 3), 10);
    step(&mut s);
    // 2 cached blocks of 1, 2 blocks each for 2 and 3 (published, so shared with the cache).
    assert_eq!(s.pool().used_blocks(), 2 + 2 * 2);
    assert!(s.shrink_pool_to(14).is_empty());
    assert_eq!((s.pool().total_blocks(), s.pool().free_blocks()), (14, 8));
    // 11 fewer: the 8 free, then 1's 2 cached blocks, then sequence 3 goes and one of its
    // blocks (now only cached) is evicted.
    assert_eq!(s.shrink_pool_to(3), vec![RequestId(3)]);
    assert_eq!((s.pool().total_blocks(), s.pool().used_blocks()), (3, 3));
    assert_eq!(s.cache().len(), 3);
    assert_eq!(s.waiting().collect::<Vec<_>>(), vec![RequestId(3)]);
    assert_eq!(s.counters().preemptions, 1);
    s.grow_pool_to(10);
    assert_eq!((s.pool().total_blocks(), s.pool().free_blocks()), (10, 7));
}

#[test]
fn projected_admission_waits_until_every_sequence_can_finish() {
    let mut s = scheduler(
        SchedulerConfig {
            admission: AdmissionPolicy::Projected,
            ..cfg(64)
        },
        16,
        1,
    );
    // Each grows to 4 + 20 = 24 positions: 6 blocks. Two fit in 16, a third does not, even
    // though only 2 blocks are in use when it asks.
    for id in 1..=3 {
        add(&mut s, id, prompt(4, id as u32), 20);
    }
    let ids = |o: &SchedulerOutput| o.scheduled.iter().map(|x| x.id.0).collect::<Vec<_>>();
    assert_eq!(ids(&step(&mut s).0), vec![1, 2]);
    assert_eq!(s.pool().used_blocks(), 2);
    let mut joined_at = None;
    let mut outputs = HashMap::new();
    for i in 1..100 {
        if !s.has_work() {
            break;
        }
        let (out, up) = step(&mut s);
        if joined_at.is_none() && ids(&out).contains(&3) {
            joined_at = Some(i);
        }
        for u in up {
            outputs.entry(u.id.0).or_insert_with(Vec::new).push(u.token);
        }
    }
    // 1 and 2 sample their 20th token at step 19; 3 joins the step after.
    assert_eq!(joined_at, Some(20));
    assert_eq!(s.counters().preemptions, 0);
    assert!(outputs.values().all(|o| o.len() >= 19));
}
