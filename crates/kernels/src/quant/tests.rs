//! Kernels against the scalar reference (bit for bit) and against an f64 product of the
//! dequantized weights (within the activation-rounding bound), for every type and odd shapes.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};

use super::*;
use crate::cpu::available_levels;

const TYPES: [GgmlDType; 6] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q8_0,
    GgmlDType::Q4K,
    GgmlDType::Q6K,
];

fn random(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn quantized(dtype: GgmlDType, n: usize, k: usize, seed: u64) -> QTensor {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let w = Tensor::from_vec(random(&mut rng, n * k), (n, k), &Device::Cpu).unwrap();
    QTensor::quantize(&w, dtype).unwrap()
}

#[test]
fn dequantized_rows_equal_ggml() {
    // 19 rows repack on the caller's thread; 300 (a ragged last panel) on the pool.
    for (dtype, (n, k)) in TYPES
        .iter()
        .flat_map(|&t| [(t, (19, 512)), (t, (300, 512))])
    {
        let q = quantized(dtype, n, k, 1);
        let want: Vec<Vec<f32>> = q.dequantize(&Device::Cpu).unwrap().to_vec2().unwrap();
        let p = PackedWeight::from_qtensor(&q).unwrap().unwrap();
        assert_eq!(Some(p.bytes()), PackedWeight::planned_bytes(dtype, n, k));
        for (r, want) in want.iter().enumerate() {
            let mut got = vec![0f32; k];
            p.dequantize_row(r, &mut got);
            assert_eq!(&got, want, "{dtype:?} {n} x {k} row {r}");
        }
    }
}

#[test]
fn every_level_equals_the_scalar_reference_and_the_bound() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for dtype in TYPES {
        let k_options: &[usize] = if matches!(dtype, GgmlDType::Q4K | GgmlDType::Q6K) {
            &[256, 768]
        } else {
            &[32, 96, 576]
        };
        for &k in k_options {
            // Every row count of a tile (1 to 12 on AVX-512, 8 elsewhere), a tile and one
            // row, and a tile and a half (the kernels specialize on the count).
            let shapes = [
                (1, 1),
                (16, 2),
                (17, 3),
                (16, 4),
                (513, 5),
                (20, 6),
                (48, 7),
            ];
            for (n, rows) in shapes.into_iter().chain([
                (33, 8),
                (40, 9),
                (16, 10),
                (17, 11),
                (16, 12),
                (20, 13),
                (33, 18),
            ]) {
                let q = quantized(dtype, n, k, (n * k) as u64);
                let p = PackedWeight::from_qtensor(&q).unwrap().unwrap();
                let x = random(&mut rng, rows * k);
                let mut reference = vec![0f32; rows * n];
                p.matmul_at(SimdLevel::Scalar, &x, rows, &mut reference);
                for level in available_levels() {
                    let mut got = vec![0f32; rows * n];
                    p.matmul_at(level, &x, rows, &mut got);
                    assert_eq!(
                        got, reference,
                        "{dtype:?} {level:?} n {n} k {k} rows {rows}"
                    );
                }
                // One row alone equals the same row among others (batch invariance).
                if rows > 1 {
                    let mut one = vec![0f32; n];
                    p.matmul(&x[k..2 * k], 1, &mut one);
                    assert_eq!(&one[..], &reference[n..2 * n], "{dtype:?} single row");
                }
                check_bound(&p, &x, rows, &reference, dtype);
            }
        }
    }
}

/// |ours - exact| <= sum over activation blocks of (d_x / 2) * sum |w| + float slack, where
/// d_x = amax / 127 is the block's quantization step: rounding moves each activation by at most
/// half a step.
fn check_bound(p: &PackedWeight, x: &[f32], rows: usize, got: &[f32], dtype: GgmlDType) {
    let (n, k) = (p.rows(), p.cols());
    let mut w = vec![0f32; k];
    for j in 0..n {
        p.dequantize_row(j, &mut w);
        for i in 0..rows {
            let xi = &x[i * k..(i + 1) * k];
            let exact: f64 = xi.iter().zip(&w).map(|(&a, &b)| a as f64 * b as f64).sum();
            let mut bound = 0f64;
            let mut mag = 0f64;
            for b in 0..k / ACT_BLOCK {
                let xb = &xi[b * ACT_BLOCK..(b + 1) * ACT_BLOCK];
                let step = xb.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / 127.0;
                let wb = &w[b * ACT_BLOCK..(b + 1) * ACT_BLOCK];
                bound += step / 2.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>();
                mag += xb
                    .iter()
                    .zip(wb)
                    .map(|(a, b)| (a * b).abs() as f64)
                    .sum::<f64>();
            }
            let slack = 1e-5 * mag + 1e-6;
            let err = (got[i * n + j] as f64 - exact).abs();
            assert!(
                err <= bound * 1.0001 + slack,
                "{dtype:?} ({i},{j}): err {err} > bound {bound}"
            );
        }
    }
}

/// Packed matrices are as large as the file's tensors (Q4_K: 2 bytes more per 256 weights for
/// its sub-block scales stored unpacked), and `planned_bytes` predicts them exactly.
#[test]
fn packed_size_matches_ggml() {
    for dtype in TYPES {
        let (n, k) = (48, 512);
        let q = quantized(dtype, n, k, 3);
        let p = PackedWeight::from_qtensor(&q).unwrap().unwrap();
        assert_eq!(Some(p.bytes()), PackedWeight::planned_bytes(dtype, n, k));
        let ggml = q.storage_size_in_bytes();
        match dtype {
            GgmlDType::Q4K => assert_eq!(p.bytes(), ggml + n * (k / 256) * 4),
            _ => assert_eq!(p.bytes(), ggml, "{dtype:?}"),
        }
    }
}

/// Several weights multiplied together (one activation quantization, one parallel loop) give
/// each weight's own product bit for bit, also when their sub-blocks differ (Q4_1's 32 vs
/// Q4_K's 32-of-256 vs Q6_K's 16) and the group falls back to separate products.
#[test]
fn grouped_products_equal_separate_products() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let k = 512;
    let groups: [&[(GgmlDType, usize)]; 3] = [
        &[
            (GgmlDType::Q4_1, 576),
            (GgmlDType::Q4_1, 192),
            (GgmlDType::Q4_1, 200),
        ],
        &[
            (GgmlDType::Q8_0, 40),
            (GgmlDType::Q4_0, 33),
            (GgmlDType::Q5_0, 16),
        ],
        &[
            (GgmlDType::Q4K, 48),
            (GgmlDType::Q6K, 17),
            (GgmlDType::Q8_0, 64),
        ],
    ];
    for group in groups {
        let ws: Vec<PackedWeight> = group
            .iter()
            .enumerate()
            .map(|(i, &(dtype, n))| {
                PackedWeight::from_qtensor(&quantized(dtype, n, k, 100 + i as u64))
                    .unwrap()
                    .unwrap()
            })
            .collect();
        let refs: Vec<&PackedWeight> = ws.iter().collect();
        for rows in [1, 3, 9] {
            let x = random(&mut rng, rows * k);
            for level in available_levels() {
                let mut outs: Vec<Vec<f32>> =
                    ws.iter().map(|w| vec![0f32; rows * w.rows()]).collect();
                let mut views: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
                matmul_many_at(level, &refs, &x, rows, &mut views);
                for (w, got) in ws.iter().zip(&outs) {
                    let mut want = vec![0f32; rows * w.rows()];
                    w.matmul_at(SimdLevel::Scalar, &x, rows, &mut want);
                    assert_eq!(
                        got,
                        &want,
                        "{:?} n {} rows {rows} {level:?}",
                        w.dtype(),
                        w.rows()
                    );
                }
            }
        }
    }
}

/// The vectorized activation quantization gives the scalar codes, scales and sub-block sums
/// bit for bit: random rows, an all-zero block, values at the rounding ties, large and tiny
/// magnitudes, infinities and NaN.
#[test]
fn activation_quantization_matches_the_scalar_rows() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let k = 512;
    let mut rows: Vec<Vec<f32>> = (0..20).map(|_| random(&mut rng, k)).collect();
    let mut special = random(&mut rng, k);
    special[..32].fill(0.0);
    for (i, v) in special[32..64].iter_mut().enumerate() {
        // x * 127 / 1.0 lands on halves: ties go to even.
        *v = (i as f32 - 16.0 + 0.5) / 127.0;
    }
    special[40] = 1.0;
    special[64] = f32::NAN;
    special[100] = f32::INFINITY;
    special[130] = -f32::INFINITY;
    special[160..192].iter_mut().for_each(|v| *v *= 1e30);
    special[192..224].iter_mut().for_each(|v| *v *= 1e-30);
    rows.push(special);
    for level in available_levels() {
        for sub in [16, 32] {
            for x in &rows {
                let (mut q, mut d, mut s) = (vec![0i8; k], vec![0f32; k / 32], vec![0f32; k / sub]);
                quantize_row_summed(level, x, &mut q, &mut d, &mut s, sub);
                let (mut wq, mut wd) = (vec![0i8; k], vec![0f32; k / 32]);
                quantize_row(x, &mut wq, &mut wd);
                let ws: Vec<f32> = wq
                    .chunks_exact(sub)
                    .map(|c| c.iter().map(|&v| v as i32).sum::<i32>() as f32)
                    .collect();
                assert_eq!(q, wq, "{level:?} sub {sub}");
                assert!(
                    d.iter().zip(&wd).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{level:?} sub {sub}: {d:?} vs {wd:?}"
                );
                assert_eq!(s, ws, "{level:?} sub {sub}");
            }
        }
    }
}
