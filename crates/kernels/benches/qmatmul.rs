//! Criterion benchmark of the quantized products on the zoo's shapes: this crate's kernels
//! against candle's, for one activation row (decode) and 64 rows (prompt processing), and the
//! K-quant shapes of Qwen2.5-Coder-1.5B's Q4_K_M file at 512 rows (a prompt pass; ours only).
//! Throughput is counted as 2 x multiply-accumulates.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use switchyard_kernels::quant::PackedWeight;

/// (type, out features, in features): smollm2 attention/MLP and head, qwen2.5-0.5b MLP.
const SHAPES: [(GgmlDType, usize, usize); 6] = [
    (GgmlDType::Q4_1, 576, 576),
    (GgmlDType::Q4_1, 1536, 576),
    (GgmlDType::Q8_0, 49152, 576),
    (GgmlDType::Q5_0, 4864, 896),
    (GgmlDType::Q4K, 896, 4864),
    (GgmlDType::Q6K, 896, 4864),
];

/// A random `[n, k]` matrix quantized to `dtype`, and its packed form.
fn weights(dtype: GgmlDType, n: usize, k: usize) -> (QTensor, PackedWeight) {
    let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, dtype).unwrap();
    let packed = PackedWeight::from_qtensor(&q).unwrap().unwrap();
    (q, packed)
}

/// One group: ours on `rows` random activation rows, and candle's when given.
fn product(c: &mut Criterion, packed: &PackedWeight, candle: Option<&QMatMul>, rows: usize) {
    let (n, k) = (packed.rows(), packed.cols());
    let x = Tensor::randn(0f32, 1.0, (rows, k), &Device::Cpu).unwrap();
    let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
    let mut out = vec![0f32; rows * n];
    let mut g = c.benchmark_group(format!("{:?}_{n}x{k}_rows{rows}", packed.dtype()));
    g.throughput(Throughput::Elements((2 * rows * n * k) as u64));
    g.sample_size(if rows > 64 { 10 } else { 20 });
    g.bench_function(BenchmarkId::new("switchyard", rows), |b| {
        b.iter(|| packed.matmul(&xs, rows, &mut out))
    });
    if let Some(candle) = candle {
        g.bench_function(BenchmarkId::new("candle", rows), |b| {
            b.iter(|| candle.forward(&x).unwrap())
        });
    }
    g.finish();
}

fn bench(c: &mut Criterion) {
    for (dtype, n, k) in SHAPES {
        let (q, packed) = weights(dtype, n, k);
        let candle = QMatMul::from_qtensor(q).unwrap();
        for rows in [1usize, 64] {
            product(c, &packed, Some(&candle), rows);
        }
    }
}

/// (type, out features, in features): Qwen2.5-Coder-1.5B's attention, MLP up and down.
const PROMPT_SHAPES: [(GgmlDType, usize, usize); 4] = [
    (GgmlDType::Q4K, 1536, 1536),
    (GgmlDType::Q4K, 8960, 1536),
    (GgmlDType::Q4K, 1536, 8960),
    (GgmlDType::Q6K, 1536, 8960),
];

fn bench_prompt(c: &mut Criterion) {
    for (dtype, n, k) in PROMPT_SHAPES {
        product(c, &weights(dtype, n, k).1, None, 512);
    }
}

criterion_group!(benches, bench, bench_prompt);
criterion_main!(benches);
