//! The oracle on a hand-made matrix: the fastest admissible mode, each constraint rejecting
//! what it should, the f16 fallback, the request-to-cell mapping, and matrix validation.

use switchyard_router::{
    CellMeasure, Class, Constraints, Decision, Mode, ModeMatrix, ModeSet, Oracle, RequestFeatures,
    Router,
};

const GB: u64 = 1 << 30;

fn m(latency_s: f64, memory_gb: u64) -> CellMeasure {
    CellMeasure {
        latency_s,
        energy_j_per_token: None,
        peak_memory_bytes: memory_gb * GB,
        accuracy_points: None,
        quality_points: None,
    }
}

fn acc(latency_s: f64, accuracy: Option<f64>) -> CellMeasure {
    CellMeasure {
        accuracy_points: accuracy,
        ..m(latency_s, 16)
    }
}

fn energy(latency_s: f64, joules: Option<f64>) -> CellMeasure {
    CellMeasure {
        energy_j_per_token: joules,
        ..m(latency_s, 16)
    }
}

fn matrix() -> ModeMatrix {
    let mut x = ModeMatrix::default();
    x.insert("SS", Mode::F16, m(1.0, 16));
    x.insert("SS", Mode::Int8, m(0.7, 9));
    x.insert("SS", Mode::Q4, m(0.5, 5));
    // Accuracy gate: q4 is fastest but 2 points down; q4-awq is exactly 1.5 down; chunked
    // prefill was never scored; speculative gains accuracy.
    x.insert("mmlu", Mode::F16, acc(1.0, Some(70.0)));
    x.insert("mmlu", Mode::Q4, acc(0.5, Some(68.0)));
    x.insert("mmlu", Mode::ChunkedPrefill, acc(0.55, None));
    x.insert("mmlu", Mode::Q4Awq, acc(0.6, Some(68.5)));
    x.insert("mmlu", Mode::Int8, acc(0.7, Some(69.0)));
    x.insert("mmlu", Mode::Speculative, acc(0.9, Some(71.5)));
    // Memory: speculative is fastest but needs the most memory.
    x.insert("LL", Mode::F16, m(4.0, 17));
    x.insert("LL", Mode::Speculative, m(1.5, 18));
    x.insert("LL", Mode::Q4, m(2.0, 6));
    // Energy: speculative is fastest but burns 1.2x the energy; int8 has no energy reading.
    x.insert("SL", Mode::F16, energy(3.0, Some(2.0)));
    x.insert("SL", Mode::Speculative, energy(1.2, Some(2.4)));
    x.insert("SL", Mode::Int8, energy(1.3, None));
    x.insert("SL", Mode::Q4, energy(1.5, Some(0.9)));
    // Everything loses accuracy: only f16 passes.
    x.insert("gpqa", Mode::F16, acc(1.0, Some(40.0)));
    x.insert("gpqa", Mode::Int8, acc(0.7, Some(37.0)));
    x.insert("gpqa", Mode::Q4, acc(0.5, Some(35.0)));
    x.insert("batch", Mode::F16, m(8.0, 20));
    x.insert("batch", Mode::Int8ContinuousBatching, m(2.0, 14));
    x.insert("memory-pressure", Mode::F16, m(5.0, 30));
    x.insert("memory-pressure", Mode::KvCompressed, m(3.5, 24));
    x
}

fn oracle(constraints: Constraints) -> Oracle {
    Oracle::new(matrix(), constraints).unwrap()
}

fn labelled(prompt: usize, output: usize, label: &str) -> RequestFeatures {
    RequestFeatures {
        prompt_tokens: prompt,
        max_output_tokens: output,
        workload: Some(label.into()),
        ..Default::default()
    }
}

#[test]
fn fastest_mode_within_the_accuracy_gate_wins() {
    let o = oracle(Constraints::default());
    let mmlu = labelled(800, 16, "mmlu");
    assert_eq!(
        o.route(&mmlu),
        Decision {
            mode: Mode::Q4Awq,
            rule: "oracle".into(),
            class: Class::PrefillHeavy,
            fallback: false,
        },
        "q4 (-2.0 points) and the unscored chunked prefill are rejected; -1.5 passes"
    );
    let d = o.route_among(&mmlu, ModeSet::all().without(Mode::Q4Awq));
    assert_eq!((d.mode, d.fallback), (Mode::Int8, false));
    let loose = oracle(Constraints {
        max_accuracy_drop_points: 2.0,
        ..Default::default()
    });
    assert_eq!(loose.route(&mmlu).mode, Mode::Q4);
    assert_eq!(o.route(&labelled(128, 32, "SS")).mode, Mode::Q4);
}

#[test]
fn memory_limit_is_respected() {
    let ll = labelled(1024, 128, "LL");
    assert_eq!(
        oracle(Constraints::default()).route(&ll).mode,
        Mode::Speculative
    );
    let capped = oracle(Constraints {
        memory_limit_bytes: Some(17 * GB),
        ..Default::default()
    });
    assert_eq!(capped.route(&ll).mode, Mode::Q4);
}

#[test]
fn energy_ratio_is_checked_where_both_were_measured() {
    let sl = labelled(128, 128, "SL");
    assert_eq!(
        oracle(Constraints::default()).route(&sl).mode,
        Mode::Speculative
    );
    let frugal = oracle(Constraints {
        max_energy_ratio: Some(1.0),
        ..Default::default()
    });
    assert_eq!(
        frugal.route(&sl).mode,
        Mode::Int8,
        "no reading, no energy verdict"
    );
    let d = frugal.route_among(&sl, ModeSet::all().without(Mode::Int8));
    assert_eq!(d.mode, Mode::Q4);
}

#[test]
fn f16_when_nothing_else_passes_and_as_fallback_when_nothing_does() {
    let gpqa = labelled(300, 16, "gpqa");
    let d = oracle(Constraints::default()).route(&gpqa);
    assert_eq!(
        (d.mode, d.fallback),
        (Mode::F16, false),
        "f16 passes against itself"
    );
    let tight = oracle(Constraints {
        memory_limit_bytes: Some(GB),
        ..Default::default()
    });
    let d = tight.route(&gpqa);
    assert_eq!(
        (d.mode, d.fallback),
        (Mode::F16, true),
        "nothing fits: emergency f16"
    );
    let d = oracle(Constraints::default()).route_among(&gpqa, ModeSet::empty());
    assert_eq!((d.mode, d.fallback), (Mode::F16, true));
}

#[test]
fn requests_map_to_cells() {
    let o = oracle(Constraints::default());
    let plain = |prompt, output| RequestFeatures {
        prompt_tokens: prompt,
        max_output_tokens: output,
        ..Default::default()
    };
    let cases: Vec<(&str, RequestFeatures, &str)> = vec![
        ("label, any case", labelled(10, 10, "MMLU"), "mmlu"),
        ("unknown label: shape LL", labelled(1024, 256, "arc"), "LL"),
        (
            "batch by queue depth",
            RequestFeatures {
                queue_depth: 9,
                ..plain(128, 32)
            },
            "batch",
        ),
        (
            "memory pressure",
            RequestFeatures {
                memory_pressure: 0.9,
                ..plain(2048, 64)
            },
            "memory-pressure",
        ),
        (
            "shared prefix without its cell: shape",
            RequestFeatures {
                shared_prefix_tokens: 100,
                ..plain(128, 32)
            },
            "SS",
        ),
        ("SL by lengths", plain(200, 100), "SL"),
        ("LS missing: nearest is SS", plain(800, 16), "SS"),
        (
            "LS missing, long-ish output: nearest is LL",
            plain(600, 60),
            "LL",
        ),
    ];
    for (name, f, cell) in cases {
        assert_eq!(o.cell_for(&f), Some(cell), "{name}");
    }
}

#[test]
fn matrix_json_round_trips() {
    let text = matrix().to_json().unwrap();
    assert!(text.contains(r#""q4-awq": {"#));
    assert_eq!(ModeMatrix::from_json(&text).unwrap(), matrix());
    let small = r#"{"cells": {"SS": {"f16": {"latency_s": 1.0, "peak_memory_bytes": 100},
        "q4": {"latency_s": 0.5, "peak_memory_bytes": 40, "energy_j_per_token": 0.3}}}}"#;
    let parsed = ModeMatrix::from_json(small).unwrap();
    assert_eq!(parsed.cells["SS"][&Mode::Q4].energy_j_per_token, Some(0.3));
    assert_eq!(parsed.cells["SS"][&Mode::F16].accuracy_points, None);
}

#[test]
fn invalid_matrices_and_constraints_are_refused() {
    let cases = [
        (
            r#"{"cells": {"SS": {"q4": {"latency_s": 0.5, "peak_memory_bytes": 1}}}}"#,
            r#"mode matrix cell "SS": no f16 (baseline) measure to compare against"#,
        ),
        (
            r#"{"cells": {"SS": {"f16": {"latency_s": -1.0, "peak_memory_bytes": 1}}}}"#,
            r#"mode matrix cell "SS": f16: latency_s must be positive and finite, got -1"#,
        ),
        (r#"{"cells": {}}"#, "mode matrix: the matrix has no cells"),
    ];
    for (json, message) in cases {
        assert_eq!(
            ModeMatrix::from_json(json).unwrap_err().to_string(),
            message
        );
    }
    let unknown = r#"{"cells": {"SS": {"fp8": {"latency_s": 1.0, "peak_memory_bytes": 1}}}}"#;
    let err = ModeMatrix::from_json(unknown).unwrap_err().to_string();
    assert!(
        err.starts_with("mode matrix: unknown mode \"fp8\"; known modes: f16, f32, int8"),
        "{err}"
    );
    let err = Oracle::new(
        matrix(),
        Constraints {
            max_accuracy_drop_points: -1.0,
            ..Default::default()
        },
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "max_accuracy_drop_points must be non-negative and finite, got -1"
    );
}
