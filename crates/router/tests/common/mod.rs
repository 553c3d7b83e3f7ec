//! Fixtures shared by the integration tests and the `decide` benchmark: an illustrative mode
//! matrix and a seeded generator of request features. The matrix numbers are made up to have
//! the paper's shape (4-bit fastest on the grid, speculative on long outputs, 4-bit dropping
//! accuracy on benchmarks); they are not measurements.
#![allow(dead_code)]

use switchyard_router::{CellMeasure, Mode, ModeMatrix, RequestFeatures};

const GB: u64 = 1 << 30;

/// A measure without energy or quality.
pub fn measure(latency_s: f64, memory_gb: u64, accuracy: Option<f64>) -> CellMeasure {
    CellMeasure {
        latency_s,
        energy_j_per_token: None,
        peak_memory_bytes: memory_gb * GB,
        accuracy_points: accuracy,
        quality_points: None,
    }
}

/// An illustrative matrix over the grid shapes, the situational cells and two benchmarks.
pub fn example_matrix() -> ModeMatrix {
    let mut m = ModeMatrix::default();
    // (mode, latency s, peak memory GB, accuracy points)
    type Row = (Mode, f64, u64, Option<f64>);
    let rows: &[(&str, &[Row])] = &[
        (
            "SS",
            &[
                (Mode::F16, 1.00, 16, None),
                (Mode::Int8, 0.70, 9, None),
                (Mode::Q4, 0.45, 5, None),
                (Mode::Q4Awq, 0.50, 5, None),
                (Mode::Speculative, 0.80, 17, None),
            ],
        ),
        (
            "SL",
            &[
                (Mode::F16, 3.00, 16, None),
                (Mode::Int8, 2.10, 9, None),
                (Mode::Q4, 1.50, 5, None),
                (Mode::Speculative, 1.20, 17, None),
            ],
        ),
        (
            "LS",
            &[
                (Mode::F16, 1.50, 17, None),
                (Mode::Int8, 1.00, 10, None),
                (Mode::Q4, 0.70, 6, None),
                (Mode::ChunkedPrefill, 1.20, 17, None),
            ],
        ),
        (
            "LL",
            &[
                (Mode::F16, 4.00, 17, None),
                (Mode::Int8, 2.80, 10, None),
                (Mode::Q4, 1.90, 6, None),
                (Mode::Speculative, 2.20, 18, None),
            ],
        ),
        (
            "shared-prefix",
            &[
                (Mode::F16, 2.00, 16, None),
                (Mode::PrefixCache, 1.10, 16, None),
                (Mode::Q4PrefixCache, 0.60, 5, None),
                (Mode::Q4, 0.90, 5, None),
            ],
        ),
        (
            "memory-pressure",
            &[
                (Mode::F16, 5.00, 30, None),
                (Mode::Int8, 3.00, 20, None),
                (Mode::Q4, 2.00, 14, None),
                (Mode::KvCompressed, 3.50, 24, None),
            ],
        ),
        (
            "batch",
            &[
                (Mode::F16, 8.00, 20, None),
                (Mode::ContinuousBatching, 3.00, 22, None),
                (Mode::Int8ContinuousBatching, 2.00, 14, None),
                (Mode::Q4, 4.00, 6, None),
            ],
        ),
        (
            "gsm8k",
            &[
                (Mode::F16, 6.00, 16, Some(80.0)),
                (Mode::Int8, 4.00, 9, Some(79.5)),
                (Mode::Q4, 2.50, 5, Some(77.0)),
                (Mode::Speculative, 3.00, 17, Some(80.0)),
            ],
        ),
        (
            "mmlu",
            &[
                (Mode::F16, 1.20, 16, Some(68.0)),
                (Mode::Int8, 0.80, 9, Some(67.5)),
                (Mode::Q4, 0.60, 5, Some(65.9)),
                (Mode::Speculative, 1.30, 17, Some(68.0)),
            ],
        ),
    ];
    for (cell, modes) in rows {
        for &(mode, latency, memory, accuracy) in modes.iter() {
            m.insert(cell, mode, measure(latency, memory, accuracy));
        }
    }
    m
}

/// SplitMix64: a tiny seeded generator, so the fixtures never change with a dependency.
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// `n` requests drawn from a mix of the paper's workloads: grid shapes (labelled half the
/// time), shared-prefix chat, math, multiple-choice, batch and memory-pressure traffic, over a
/// background of light queueing and memory use.
pub fn requests(n: usize, seed: u64) -> Vec<RequestFeatures> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| {
            let mut f = RequestFeatures {
                memory_pressure: rng.unit() * 0.6,
                queue_depth: rng.range(0, 6),
                ..Default::default()
            };
            match rng.range(0, 6) {
                0 => {
                    let (prompt, output, label) = [
                        (128, 32, "SS"),
                        (128, 128, "SL"),
                        (1024, 32, "LS"),
                        (1024, 128, "LL"),
                    ][rng.range(0, 3)];
                    f.prompt_tokens = rng.range(prompt * 3 / 4, prompt * 5 / 4);
                    f.max_output_tokens = output;
                    if rng.range(0, 1) == 0 {
                        f.workload = Some(label.into());
                    }
                }
                1 => {
                    f.prompt_tokens = rng.range(200, 1500);
                    f.max_output_tokens = rng.range(32, 256);
                    f.shared_prefix_tokens = rng.range(0, f.prompt_tokens);
                    f.workload = Some("chat".into());
                }
                2 => {
                    f.prompt_tokens = rng.range(100, 300);
                    f.max_output_tokens = 256;
                    f.workload = Some("gsm8k".into());
                }
                3 => {
                    f.prompt_tokens = rng.range(400, 1200);
                    f.max_output_tokens = rng.range(8, 32);
                    f.workload = Some(["mmlu", "arc", "hellaswag"][rng.range(0, 2)].into());
                }
                4 => {
                    f.prompt_tokens = rng.range(100, 1000);
                    f.max_output_tokens = rng.range(16, 256);
                    f.queue_depth = rng.range(8, 32);
                }
                5 => {
                    f.prompt_tokens = rng.range(1500, 4000);
                    f.max_output_tokens = rng.range(32, 128);
                    f.memory_pressure = 0.8 + rng.unit() * 0.19;
                }
                _ => {
                    f.prompt_tokens = rng.range(16, 2000);
                    f.max_output_tokens = rng.range(8, 512);
                }
            }
            f
        })
        .collect()
}
