//! `bench kernels`: every (tensor type, shape) the zoo's models use, multiplied by the portable
//! scalar reference, candle's quantized kernel and Switchyard's kernel, side by side in one run.
//! Weights are the real tensors read from the model files.

use std::time::Instant;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use serde::Serialize;
use switchyard_kernels::cpu::{simd_level, SimdLevel};
use switchyard_kernels::quant::PackedWeight;
use switchyard_weights::GgufFile;

use crate::{BenchError, Result};
use switchyard_eval::stats::median;

/// Minimum measuring time per kernel and case.
pub const MIN_SECONDS: f64 = 0.2;
/// Activation rows: one (decode) and a prompt chunk.
pub const DEFAULT_ROWS: [usize; 2] = [1, 64];

/// One distinct (type, shape) and a tensor of a model file that has it.
#[derive(Debug, Clone, Serialize)]
pub struct Shape {
    pub model: String,
    pub tensor: String,
    pub dtype: String,
    pub out_features: usize,
    pub in_features: usize,
    /// Bytes of the tensor in the file (what one pass over the weights reads).
    pub weight_bytes: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Measure {
    pub seconds: f64,
    pub gflops: f64,
    pub weight_gb_per_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct KernelCase {
    #[serde(flatten)]
    pub shape: Shape,
    pub rows: usize,
    pub scalar_reference: Measure,
    pub candle: Measure,
    /// Dequantize the whole matrix to f32, then candle's f32 GEMM (the alternative prompt path).
    pub dequantize_then_gemm: Measure,
    pub switchyard: Measure,
    /// switchyard GFLOP/s over candle's.
    pub speedup_vs_candle: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct KernelReport {
    pub simd_level: String,
    pub threads: usize,
    pub cases: Vec<KernelCase>,
}

/// Distinct 2-D (type, shape) pairs of the given model files that Switchyard's kernels take.
pub fn model_shapes(models: &[(String, std::path::PathBuf)]) -> Result<Vec<Shape>> {
    let mut out: Vec<Shape> = Vec::new();
    for (name, path) in models {
        let f = GgufFile::open(path).map_err(|e| BenchError::Invalid(e.to_string()))?;
        for t in f.tensors() {
            let &[n, k] = t.shape.as_slice() else {
                continue;
            };
            if PackedWeight::planned_bytes(t.dtype, n, k).is_none() {
                continue;
            }
            let dtype = format!("{:?}", t.dtype);
            if out
                .iter()
                .any(|s| s.dtype == dtype && s.out_features == n && s.in_features == k)
            {
                continue;
            }
            out.push(Shape {
                model: name.clone(),
                tensor: t.name.clone(),
                dtype,
                out_features: n,
                in_features: k,
                weight_bytes: t.n_bytes,
            });
        }
    }
    Ok(out)
}

/// Measures one shape at `rows` activation rows with all three kernels.
pub fn bench_case(path: &std::path::Path, shape: &Shape, rows: usize) -> Result<KernelCase> {
    let err = |e: candle_core::Error| BenchError::Invalid(e.to_string());
    let f = GgufFile::open(path).map_err(|e| BenchError::Invalid(e.to_string()))?;
    let q: QTensor = f
        .load(&shape.tensor, &Device::Cpu)
        .map_err(|e| BenchError::Invalid(e.to_string()))?;
    let (n, k) = (shape.out_features, shape.in_features);
    let packed = PackedWeight::from_qtensor(&q)
        .map_err(err)?
        .ok_or_else(|| BenchError::Invalid(format!("{} has no kernel", shape.dtype)))?;
    let dense_src = f
        .load(&shape.tensor, &Device::Cpu)
        .map_err(|e| BenchError::Invalid(e.to_string()))?;
    let candle = QMatMul::from_qtensor(q).map_err(err)?;
    let x = Tensor::randn(0f32, 1.0, (rows, k), &Device::Cpu).map_err(err)?;
    let xs: Vec<f32> = x.flatten_all().and_then(|t| t.to_vec1()).map_err(err)?;
    let mut out = vec![0f32; rows * n];
    let flops = 2.0 * (rows * n * k) as f64;
    let measure = |secs: f64| Measure {
        seconds: secs,
        gflops: flops / secs / 1e9,
        weight_gb_per_s: shape.weight_bytes as f64 / secs / 1e9,
    };
    let scalar = time(|| packed.matmul_at(SimdLevel::Scalar, &xs, rows, &mut out));
    let ours = time(|| packed.matmul(&xs, rows, &mut out));
    let theirs = time(|| {
        let _ = candle.forward(&x);
    });
    let dense = time(|| {
        let _ = dense_src
            .dequantize(&Device::Cpu)
            .and_then(|w| x.matmul(&w.t()?));
    });
    Ok(KernelCase {
        shape: shape.clone(),
        rows,
        scalar_reference: measure(scalar),
        candle: measure(theirs),
        dequantize_then_gemm: measure(dense),
        switchyard: measure(ours),
        speedup_vs_candle: theirs / ours,
    })
}

/// Median seconds per call, after one warm-up call, over at least `MIN_SECONDS` and 3 calls.
fn time(mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut runs = Vec::new();
    while runs.len() < 3 || start.elapsed().as_secs_f64() < MIN_SECONDS {
        let t = Instant::now();
        f();
        runs.push(t.elapsed().as_secs_f64());
    }
    median(&runs)
}

pub fn level_name() -> &'static str {
    simd_level().as_str()
}
