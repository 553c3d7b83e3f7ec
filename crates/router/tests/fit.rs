//! `router fit` on a hand-made matrix: the mode a hand computation picks for every class, the
//! gate's bounds changing the pick, math requests with a cached prefix kept on their own gate, a matrix without f16 refused, and the written policy
//! routing each class to its fitted mode after a round trip through TOML.

use std::collections::BTreeMap;

use switchyard_router::{
    fit, CellMeasure, Constraints, Gate, Mode, ModeMatrix, ModeSet, Oracle, PairedDelta, Policy,
    QualityMeasure, RequestFeatures, Router, RuleConfig, RulesRouter,
};

fn cell(latency_s: f64) -> CellMeasure {
    CellMeasure {
        latency_s,
        energy_j_per_token: None,
        peak_memory_bytes: 1 << 30,
        accuracy_points: None,
        quality_points: None,
    }
}

fn paired(lo: f64) -> PairedDelta {
    PairedDelta {
        n: 1000,
        delta_points: lo + 1.0,
        lo_points: lo,
        hi_points: lo + 2.0,
        only_mode: 20,
        only_baseline: 25,
        mcnemar_p: 0.55,
    }
}

/// Bits per byte, then the lower ends of GSM8K and the three multiple-choice tasks.
fn quality(bpb: f64, gsm: f64, arc: f64, hellaswag: f64, mmlu: f64) -> QualityMeasure {
    QualityMeasure {
        bits_per_byte: Some(bpb),
        bpb_bytes: Some(100_000),
        tasks: BTreeMap::from([
            ("gsm8k".into(), paired(gsm)),
            ("arc-challenge".into(), paired(arc)),
            ("hellaswag".into(), paired(hellaswag)),
            ("mmlu".into(), paired(mmlu)),
        ]),
    }
}

fn matrix() -> ModeMatrix {
    use Mode::*;
    let mut m = ModeMatrix::default();
    let rows: &[(&str, &[(Mode, f64)])] = &[
        (
            "SS",
            &[
                (F16, 1.0),
                (Int8, 0.6),
                (Q4, 0.4),
                (Q4Awq, 0.5),
                (Q4PrefixCache, 0.38),
                (Int8ContinuousBatching, 0.62),
            ],
        ),
        (
            "SL",
            &[
                (F16, 3.0),
                (Int8, 1.8),
                (Q4, 1.2),
                (Q4Awq, 1.5),
                (Q4PrefixCache, 1.25),
                (Int8ContinuousBatching, 1.75),
            ],
        ),
        (
            "LS",
            &[
                (F16, 1.5),
                (Int8, 0.9),
                (Q4, 0.7),
                (Q4Awq, 0.8),
                (Q4PrefixCache, 0.74),
                (Int8ContinuousBatching, 0.95),
            ],
        ),
        (
            "LL",
            &[
                (F16, 4.0),
                (Int8, 2.4),
                (Q4, 1.8),
                (Q4Awq, 2.1),
                (Int8ContinuousBatching, 2.5),
            ],
        ),
        (
            "batch",
            &[
                (F16, 5.0),
                (Int8, 3.0),
                (Q4, 2.6),
                (Q4Awq, 2.8),
                (Int8ContinuousBatching, 1.5),
            ],
        ),
        (
            "shared-prefix",
            &[
                (F16, 2.0),
                (Int8, 1.2),
                (Q4, 1.0),
                (Q4Awq, 1.1),
                (Q4PrefixCache, 0.5),
            ],
        ),
    ];
    for (name, modes) in rows {
        for &(mode, latency) in modes.iter() {
            m.insert(name, mode, cell(latency));
        }
    }
    let int8 = quality(0.501, -0.5, -1.0, -1.0, -1.0);
    let q4 = quality(0.56, -2.0, -1.0, -1.0, -1.0);
    m.quality = BTreeMap::from([
        (F16, quality(0.50, 0.0, 0.0, 0.0, 0.0)),
        (Int8, int8.clone()),
        (Int8ContinuousBatching, int8),
        (Q4, q4.clone()),
        (Q4PrefixCache, q4),
        (Q4Awq, quality(0.52, -3.0, -1.2, -1.4, -1.0)),
    ]);
    m
}

fn named(classes: &[(&str, Mode)]) -> Vec<(String, Mode)> {
    classes.iter().map(|(c, m)| (c.to_string(), *m)).collect()
}

fn chosen(report: &switchyard_router::FitReport) -> Vec<(String, Mode)> {
    report
        .choices
        .iter()
        .map(|c| (c.class.clone(), c.mode))
        .collect()
}

#[test]
fn fit_picks_what_a_hand_computation_picks_for_every_class() {
    let report = fit(
        &matrix(),
        &Constraints::default(),
        &Gate::default(),
        RuleConfig::default(),
    )
    .unwrap();
    // By hand, default gate (bits per byte +5 %, lower ends above −1.5 points):
    // - q4 and q4+prefix-cache fail everywhere on bits per byte (+12 %);
    // - q4-awq (+4 %) fails every class judged on GSM8K (lower end −3.0) but passes
    //   multiple-choice (−1.2, −1.4, −1.0);
    // - int8 and int8+continuous-batching pass everywhere.
    // Then per class the fastest passing mode by the summed latency of its cells:
    // batch: int8+cb 1.5 < int8 3.0; shared-prefix: int8 1.2 (q4+pc 0.5, q4 1.0, q4-awq 1.1
    // refused); math (SL+LL): int8 4.2 (q4 3.0, q4-awq 3.6 refused; q4+pc lacks LL);
    // multiple-choice (SS+LS): q4-awq 1.3 (q4 1.1, q4+pc 1.12 refused); prefill-heavy (LS):
    // int8 0.9; decode-heavy (SL+LL): int8 4.2; interactive (SS): int8 0.6.
    // Math and multiple-choice requests in the situations, judged on their own tasks: in batch
    // both pick int8+cb (the batch choice, no rule of their own); in shared-prefix math picks
    // int8 (the same) but multiple-choice picks q4-awq 1.1 (q4+pc, q4 refused), so a
    // `multiple-choice/shared-prefix` rule goes before the shared-prefix one.
    let want = named(&[
        ("batch", Mode::Int8ContinuousBatching),
        ("multiple-choice/shared-prefix", Mode::Q4Awq),
        ("shared-prefix", Mode::Int8),
        ("math", Mode::Int8),
        ("multiple-choice", Mode::Q4Awq),
        ("prefill-heavy", Mode::Int8),
        ("decode-heavy", Mode::Int8),
        ("interactive", Mode::Int8),
    ]);
    assert_eq!(chosen(&report), want);
    let mc_sp = &report.choices[1];
    assert!((mc_sp.latency_s - 1.1).abs() < 1e-12);
    let refused: Vec<Mode> = mc_sp.refused.iter().map(|(m, _)| *m).collect();
    assert_eq!(refused, [Mode::Q4PrefixCache, Mode::Q4]);
    let sp = &report.choices[2];
    assert!((sp.latency_s - 1.2).abs() < 1e-12 && sp.f16_latency_s == Some(2.0));
    let refused: Vec<Mode> = sp.refused.iter().map(|(m, _)| *m).collect();
    assert_eq!(refused, [Mode::Q4PrefixCache, Mode::Q4, Mode::Q4Awq]);
    assert_eq!(
        sp.refused[2].1,
        ["gsm8k: paired 95 % interval reaches -3.00 points (bound −1.5)"]
    );
    let mc = &report.choices[4];
    assert!((mc.latency_s - 1.3).abs() < 1e-12, "{}", mc.latency_s);
    assert_eq!(
        report.skipped,
        [(
            "memory-pressure".to_string(),
            "the matrix has no memory-pressure cell (f16 must be measured there)".to_string()
        )]
    );
    // One mode for every class: int8 (int8+continuous-batching lacks the shared-prefix cell).
    // Summed over the classes' cells: batch 3.0, multiple-choice/shared-prefix 1.2,
    // shared-prefix 1.2, math 4.2, multiple-choice 1.5, prefill-heavy 0.9, decode-heavy 4.2,
    // interactive 0.6 = 16.8 s; the fitted modes: 1.5 + 1.1 + 1.2 + 4.2 + 1.3 + 0.9 + 4.2 +
    // 0.6 = 15.0 s.
    let (mode, t) = report.best_fixed.unwrap();
    assert_eq!(mode, Mode::Int8);
    assert!((t - 16.8).abs() < 1e-9, "{t}");
    assert!((report.fitted_latency_s - 15.0).abs() < 1e-9);
    let last = report.policy.rules().last().unwrap();
    assert_eq!((last.id.as_str(), last.mode), ("default", Mode::F16));

    // A looser bits-per-byte bound lets q4 (GSM8K lower end −2.0) serve multiple-choice, and
    // still not the classes judged on GSM8K.
    let loose = Gate {
        max_bpb_increase: 0.15,
        ..Gate::default()
    };
    let report = fit(
        &matrix(),
        &Constraints::default(),
        &loose,
        RuleConfig::default(),
    )
    .unwrap();
    let modes: BTreeMap<String, Mode> = chosen(&report).into_iter().collect();
    assert_eq!(modes["multiple-choice"], Mode::Q4);
    assert_eq!(modes["interactive"], Mode::Int8);
}

/// A gate that judges shared-prefix and batch requests on bits per byte and the
/// multiple-choice tasks only (a user's `[router.gate.tasks]`): the shared-prefix rule may then
/// pick a mode that fails GSM8K, and math requests with a cached prefix get a rule of their own.
#[test]
fn math_requests_with_a_cached_prefix_keep_their_gate() {
    let mc = ["arc-challenge", "hellaswag", "mmlu"]
        .map(String::from)
        .to_vec();
    let mut gate = Gate::default();
    gate.tasks.insert("shared-prefix".into(), mc.clone());
    gate.tasks.insert("batch".into(), mc);
    let report = fit(
        &matrix(),
        &Constraints::default(),
        &gate,
        RuleConfig::default(),
    )
    .unwrap();
    // By hand: shared-prefix judged on bits per byte and multiple choice: q4+pc and q4 fail
    // bits per byte (+12 %), q4-awq (+4 %, lower ends −1.2/−1.4/−1.0) passes at 1.1. Math
    // there: q4-awq fails GSM8K (−3.0), int8 1.2. Multiple-choice there: q4-awq, the same.
    // Batch: int8+cb 1.5 for all three.
    let want = named(&[
        ("batch", Mode::Int8ContinuousBatching),
        ("math/shared-prefix", Mode::Int8),
        ("shared-prefix", Mode::Q4Awq),
        ("math", Mode::Int8),
        ("multiple-choice", Mode::Q4Awq),
        ("prefill-heavy", Mode::Int8),
        ("decode-heavy", Mode::Int8),
        ("interactive", Mode::Int8),
    ]);
    assert_eq!(chosen(&report), want);
    let router = RulesRouter::new(report.policy.clone());
    let cached = |out: usize, label: Option<&str>| RequestFeatures {
        prompt_tokens: 900,
        max_output_tokens: out,
        shared_prefix_tokens: 768,
        workload: label.map(str::to_string),
        ..Default::default()
    };
    let d = router.route_among(&cached(128, Some("gsm8k")), ModeSet::all());
    assert_eq!(
        (d.mode, d.rule.as_str()),
        (Mode::Int8, "2:math/shared-prefix")
    );
    let d = router.route_among(&cached(32, None), ModeSet::all());
    assert_eq!((d.mode, d.rule.as_str()), (Mode::Q4Awq, "3:shared-prefix"));
    let back = Policy::from_toml(&report.policy_toml("a hand-made matrix").unwrap()).unwrap();
    assert_eq!(back, report.policy);
}

/// A workload f16 cannot run (its prompts do not fit f16's memory): the matrix says why, the
/// class gets the fastest mode that runs there and passes the gate, and without the reason
/// the matrix is refused as before.
#[test]
fn a_cell_f16_cannot_run_gets_the_fastest_passing_mode_that_runs() {
    let mut m = matrix();
    for (mode, latency) in [(Mode::Int8, 6.0), (Mode::Q4, 4.0), (Mode::Q4Awq, 5.0)] {
        m.insert("memory-pressure", mode, cell(latency));
    }
    let fitted =
        |m: &ModeMatrix, c: &Constraints| fit(m, c, &Gate::default(), RuleConfig::default());
    assert_eq!(
        fitted(&m, &Constraints::default()).unwrap_err().to_string(),
        "mode matrix cell \"memory-pressure\": no f16 (baseline) measure to compare against"
    );
    let why = "the prompt needs 1920 KV blocks; the pool holds 1441";
    m.baseline_failed
        .insert("memory-pressure".into(), why.into());
    let report = fitted(&m, &Constraints::default()).unwrap();
    // By hand: memory-pressure judged on every task: q4 4.0 fails bits per byte, q4-awq 5.0
    // fails GSM8K, int8 6.0 passes. Multiple-choice there: q4-awq 5.0 (q4 refused); math there:
    // int8, the same as the class's own.
    let modes: Vec<(String, Mode)> = chosen(&report)
        .into_iter()
        .filter(|(c, _)| c.contains("memory-pressure"))
        .collect();
    assert_eq!(
        modes,
        named(&[
            ("multiple-choice/memory-pressure", Mode::Q4Awq),
            ("memory-pressure", Mode::Int8),
        ])
    );
    assert!(report.skipped.is_empty(), "{:?}", report.skipped);
    let mp = report
        .choices
        .iter()
        .find(|c| c.class == "memory-pressure")
        .unwrap();
    assert_eq!((mp.latency_s, mp.f16_latency_s), (6.0, None));
    assert!(report
        .markdown()
        .contains("| memory-pressure | memory-pressure | int8 | 6.000 | cannot run | — |"));
    // The memory-pressure rule comes after batch and shared-prefix and before math.
    let ids: Vec<&str> = report
        .policy
        .rules()
        .iter()
        .map(|r| r.id.as_str())
        .collect();
    assert_eq!(
        ids[3..6],
        ["multiple-choice/memory-pressure", "memory-pressure", "math"]
    );
    // The oracle judges the same way there: the gate and the memory limit, no f16 to compare.
    let oracle = Oracle::new(m.clone(), Constraints::default())
        .unwrap()
        .with_gate(Gate::default())
        .unwrap();
    assert!(oracle.admits("memory-pressure", "memory-pressure", Mode::Int8));
    assert!(!oracle.admits("memory-pressure", "memory-pressure", Mode::Q4));
    assert!(oracle.admits("memory-pressure", "multiple-choice", Mode::Q4Awq));
    assert!(!oracle.admits("memory-pressure", "memory-pressure", Mode::F16));

    // A memory limit no mode there keeps: no rule, and the report says why.
    for mode in [Mode::Int8, Mode::Q4, Mode::Q4Awq] {
        let mut c = cell(1.0);
        c.peak_memory_bytes = 3 << 30;
        m.insert("memory-pressure", mode, c);
    }
    let tight = Constraints {
        memory_limit_bytes: Some(2 << 30),
        ..Constraints::default()
    };
    let report = fitted(&m, &tight).unwrap();
    let unserved = format!(
        "no mode that runs there passes the gate, and f16 cannot run there (memory-pressure: {why})"
    );
    assert_eq!(
        report.skipped,
        [
            ("math/memory-pressure".to_string(), unserved.clone()),
            (
                "multiple-choice/memory-pressure".to_string(),
                unserved.clone()
            ),
            ("memory-pressure".to_string(), unserved),
        ]
    );
    // f16 listed as failed where it has a measure is a contradiction.
    m.insert("memory-pressure", Mode::F16, cell(9.0));
    assert_eq!(
        fitted(&m, &Constraints::default()).unwrap_err().to_string(),
        "mode matrix cell \"memory-pressure\": holds a f16 measure but lists it as failed"
    );
}

#[test]
fn fit_refuses_a_matrix_without_f16() {
    let mut m = matrix();
    m.cells.get_mut("LS").unwrap().remove(&Mode::F16);
    let err = fit(
        &m,
        &Constraints::default(),
        &Gate::default(),
        RuleConfig::default(),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "mode matrix cell \"LS\": no f16 (baseline) measure to compare against"
    );
    let mut m = matrix();
    m.quality.remove(&Mode::F16);
    let err = fit(
        &m,
        &Constraints::default(),
        &Gate::default(),
        RuleConfig::default(),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "mode matrix: quality has no f16 (baseline) entry to compare against"
    );
}

#[test]
fn the_fitted_policy_round_trips_and_routes_each_class_to_its_mode() {
    let report = fit(
        &matrix(),
        &Constraints::default(),
        &Gate::default(),
        RuleConfig::default(),
    )
    .unwrap();
    let text = report.policy_toml("a hand-made matrix").unwrap();
    assert!(text.starts_with("# ModeSwitch policy fitted by `switchyard router fit`"));
    let back = Policy::from_toml(&text).unwrap();
    assert_eq!(back, report.policy);
    assert_eq!(back.gate(), Some(&Gate::default()));
    let router = RulesRouter::new(back);
    let f = |prompt: usize, out: usize, label: Option<&str>| RequestFeatures {
        prompt_tokens: prompt,
        max_output_tokens: out,
        workload: label.map(str::to_string),
        ..Default::default()
    };
    let cases = [
        (
            f(100, 32, Some("batch")),
            Mode::Int8ContinuousBatching,
            "1:batch",
        ),
        (
            RequestFeatures {
                shared_prefix_tokens: 512,
                ..f(600, 1, Some("mmlu"))
            },
            Mode::Q4Awq,
            "2:multiple-choice/shared-prefix",
        ),
        (
            RequestFeatures {
                shared_prefix_tokens: 512,
                ..f(600, 32, None)
            },
            Mode::Int8,
            "3:shared-prefix",
        ),
        (
            RequestFeatures {
                shared_prefix_tokens: 512,
                ..f(600, 128, Some("gsm8k"))
            },
            Mode::Int8,
            "3:shared-prefix",
        ),
        (f(200, 256, Some("gsm8k")), Mode::Int8, "4:math"),
        (f(300, 1, Some("mmlu")), Mode::Q4Awq, "5:multiple-choice"),
        (f(1024, 32, None), Mode::Int8, "6:prefill-heavy"),
        (f(100, 256, None), Mode::Int8, "7:decode-heavy"),
        (f(100, 32, None), Mode::Int8, "8:interactive"),
    ];
    for (features, mode, rule) in cases {
        let d = router.route_among(&features, ModeSet::all());
        assert_eq!((d.mode, d.rule.as_str()), (mode, rule), "{features:?}");
    }
}
