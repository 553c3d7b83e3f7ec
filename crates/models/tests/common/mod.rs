//! Shared helpers for the model tests: real model files and small utilities.
#![allow(dead_code)]

pub mod reference;

use std::path::PathBuf;

/// Path of a zoo model, fetched into the cache when missing.
pub fn model_path(name: &str) -> PathBuf {
    match switchyard_zoo::ensure(name) {
        Ok(p) => p,
        Err(e) => panic!("cannot fetch test model {name}: {e}"),
    }
}

/// A fixed input: ids spread over the common part of every zoo vocabulary.
pub fn fixed_tokens(n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 100 + (i * 7919 + 13) % 5000)
        .collect()
}

pub fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
            if x > bv {
                (i, x)
            } else {
                (bi, bv)
            }
        })
        .0
}

/// max |a - b| divided by the range (max - min) of `reference`.
pub fn error_of_range(got: &[f32], reference: &[f32]) -> f32 {
    let (lo, hi) = reference
        .iter()
        .fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    let diff = got
        .iter()
        .zip(reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    diff / (hi - lo)
}
