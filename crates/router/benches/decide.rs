//! The cost of one routing decision (features in, mode out) for each router: the paper measured
//! 0.0096 ms per request for its rules. Run with `cargo bench -p switchyard-router`.

#[path = "../tests/common/mod.rs"]
mod common;

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use switchyard_router::{
    Constraints, FixedRouter, LearnedKind, LearnedRouter, Mode, ModeSet, Oracle, Router,
    RulesRouter,
};

/// Requests routed per measured iteration (a mixed workload, so no branch is always taken).
const REQUESTS: usize = 64;
const TRAIN_REQUESTS: usize = 400;

fn decide(c: &mut Criterion) {
    let requests = common::requests(REQUESTS, 3);
    let oracle = match Oracle::new(common::example_matrix(), Constraints::default()) {
        Ok(o) => o,
        Err(e) => panic!("fixture matrix: {e}"),
    };
    let train = oracle.label(&common::requests(TRAIN_REQUESTS, 1));
    let mut routers: Vec<Box<dyn Router>> = vec![
        Box::new(FixedRouter::new(Mode::Int8)),
        Box::new(RulesRouter::default()),
        Box::new(oracle),
    ];
    for kind in LearnedKind::ALL {
        match LearnedRouter::train(kind, &train, 7) {
            Ok(r) => routers.push(Box::new(r)),
            Err(e) => panic!("training {kind:?}: {e}"),
        }
    }
    let available = ModeSet::all();
    let mut group = c.benchmark_group("decide");
    group.throughput(Throughput::Elements(REQUESTS as u64));
    for router in &routers {
        group.bench_function(router.name(), |b| {
            b.iter(|| {
                for f in &requests {
                    black_box(router.route_among(black_box(f), available));
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, decide);
criterion_main!(benches);
