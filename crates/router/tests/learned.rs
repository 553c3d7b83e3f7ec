//! Learned routers imitating the oracle on a fixed, seeded workload: exact held-out accuracy
//! (training is deterministic), a floor the imitation must clear, and the edge cases of
//! training.

use crate::common;

use switchyard_router::{
    Constraints, Example, LearnedKind, LearnedRouter, Mode, ModeSet, Oracle, RequestFeatures,
    Router, RouterError,
};

const TRAIN_SEED: u64 = 1;
const TEST_SEED: u64 = 2;
const MODEL_SEED: u64 = 7;

fn datasets() -> (Vec<Example>, Vec<Example>) {
    let oracle = Oracle::new(common::example_matrix(), Constraints::default()).unwrap();
    (
        oracle.label(&common::requests(400, TRAIN_SEED)),
        oracle.label(&common::requests(200, TEST_SEED)),
    )
}

#[test]
fn learned_routers_reproduce_their_held_out_accuracy() {
    let (train, test) = datasets();
    let modes: ModeSet = train.iter().map(|(_, m)| *m).collect();
    assert_eq!(
        modes.iter().collect::<Vec<_>>(),
        vec![
            Mode::Int8,
            Mode::Q4,
            Mode::Speculative,
            Mode::Q4PrefixCache,
            Mode::Int8ContinuousBatching
        ],
        "the oracle uses five modes on this workload"
    );
    // (kind, exact held-out accuracy, floor it must clear).
    let expected = [
        (LearnedKind::Tree, 0.92, 0.9),
        (LearnedKind::Forest, 0.945, 0.9),
        (LearnedKind::Logistic, 0.895, 0.85),
    ];
    for (kind, accuracy, floor) in expected {
        let router = LearnedRouter::train(kind, &train, MODEL_SEED).unwrap();
        let measured = router.accuracy(&test);
        assert_eq!(measured, accuracy, "{kind:?}");
        assert!(measured >= floor, "{kind:?}: {measured} < {floor}");
    }
}

#[test]
fn training_is_deterministic_for_a_seed() {
    let (train, test) = datasets();
    for kind in LearnedKind::ALL {
        let a = LearnedRouter::train(kind, &train, MODEL_SEED).unwrap();
        let b = LearnedRouter::train(kind, &train, MODEL_SEED).unwrap();
        let modes = |r: &LearnedRouter| test.iter().map(|(f, _)| r.predict(f)).collect::<Vec<_>>();
        assert_eq!(modes(&a), modes(&b), "{kind:?}");
    }
}

#[test]
fn learned_decisions_name_the_learner_and_fall_back() {
    let (train, _) = datasets();
    let router = LearnedRouter::train(LearnedKind::Tree, &train, MODEL_SEED).unwrap();
    assert_eq!(router.name(), "tree");
    let math = RequestFeatures {
        prompt_tokens: 200,
        max_output_tokens: 256,
        workload: Some("gsm8k".into()),
        ..Default::default()
    };
    let d = router.route(&math);
    assert_eq!(
        (d.mode, d.rule.as_str(), d.fallback),
        (Mode::Speculative, "tree", false)
    );
    let d = router.route_among(&math, ModeSet::all().without(Mode::Speculative));
    assert_eq!((d.mode, d.fallback), (Mode::F16, true));
}

#[test]
fn logistic_router_keeps_its_standardisation() {
    let data: Vec<_> = [
        (100, Mode::Int8),
        (200, Mode::Int8),
        (300, Mode::Q4),
        (400, Mode::Q4),
    ]
    .into_iter()
    .map(|(prompt, mode)| {
        let f = RequestFeatures {
            prompt_tokens: prompt,
            max_output_tokens: 32,
            ..Default::default()
        };
        (f, mode)
    })
    .collect();
    let router = LearnedRouter::train(LearnedKind::Logistic, &data, 0).unwrap();
    let s = router.standardizer().unwrap();
    assert_eq!(s.means[0], 250.0);
    assert_eq!(s.stds[0], 12_500f64.sqrt());
    assert_eq!(
        (s.means[1], s.stds[1]),
        (32.0, 1.0),
        "a constant column is left unscaled"
    );
    assert_eq!(router.accuracy(&data), 1.0);
    let tree = LearnedRouter::train(LearnedKind::Tree, &data, 0).unwrap();
    assert!(tree.standardizer().is_none());
}

#[test]
fn degenerate_training_sets() {
    let err = LearnedRouter::train(LearnedKind::Forest, &[], 0).unwrap_err();
    assert!(matches!(err, RouterError::EmptyTrainingSet));
    assert_eq!(err.to_string(), "learned router: the training set is empty");
    let one_mode = vec![(RequestFeatures::default(), Mode::Q4); 3];
    for kind in LearnedKind::ALL {
        let router = LearnedRouter::train(kind, &one_mode, 0).unwrap();
        let d = router.route(&RequestFeatures {
            prompt_tokens: 5000,
            ..Default::default()
        });
        assert_eq!(
            (d.mode, d.rule.as_str()),
            (Mode::Q4, kind.name()),
            "{kind:?}"
        );
        assert_eq!(router.accuracy(&[]), 0.0);
    }
}

#[test]
fn saved_routers_reload_with_the_same_decisions() {
    let (train, test) = datasets();
    let dir = tempfile::tempdir().unwrap();
    for kind in LearnedKind::ALL {
        let router = LearnedRouter::train(kind, &train, MODEL_SEED).unwrap();
        let path = dir.path().join(format!("{}.json", kind.name()));
        router.save(&path).unwrap();
        let loaded = LearnedRouter::load(&path).unwrap();
        assert_eq!(loaded.kind(), kind);
        assert_eq!(loaded.name(), kind.name());
        for (f, _) in &test {
            assert_eq!(loaded.predict(f), router.predict(f), "{kind:?}");
        }
        assert_eq!(loaded.accuracy(&test), router.accuracy(&test));
        assert_eq!(loaded.standardizer(), router.standardizer());
    }
}

#[test]
fn router_files_that_cannot_be_used_are_refused() {
    let (train, _) = datasets();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tree.json");
    LearnedRouter::train(LearnedKind::Tree, &train, MODEL_SEED)
        .unwrap()
        .save(&path)
        .unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let shown = path.display().to_string();
    let err = |text: &str| {
        std::fs::write(&path, text).unwrap();
        LearnedRouter::load(&path).unwrap_err().to_string()
    };

    let truncated = err(&text[..text.len() / 2]);
    assert!(
        truncated.starts_with(&format!(
            "learned router file {shown}: not a learned router: "
        )),
        "{truncated}"
    );
    assert_eq!(
        err(&text.replacen("\"format_version\":1", "\"format_version\":9", 1)),
        format!("learned router file {shown}: format version 9 (this build reads 1)")
    );
    let other_features = err(&text.replacen("\"prompt_tokens\"", "\"prompt_chars\"", 1));
    assert!(
        other_features.starts_with(&format!(
            "learned router file {shown}: trained on features [\"prompt_chars\""
        )),
        "{other_features}"
    );
    let missing = dir.path().join("none.json");
    assert!(LearnedRouter::load(&missing)
        .unwrap_err()
        .to_string()
        .starts_with(&format!("learned router file {}: ", missing.display())));
}
