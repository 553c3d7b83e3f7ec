//! The portable scalar kernels (forced with SWITCHYARD_FORCE_SCALAR=1, as on a CPU without
//! AVX2/AVX-512) run the real model end to end and agree with candle's reference like the SIMD
//! kernels do. A separate binary: the kernel level is fixed once per process.

mod common;

use switchyard_kernels::cpu::{simd_level, SimdLevel, FORCE_SCALAR_ENV};

#[test]
fn scalar_kernels_match_quantized_llama() {
    // Set before any kernel runs in this process (this binary has one test).
    std::env::set_var(FORCE_SCALAR_ENV, "1");
    assert_eq!(simd_level(), SimdLevel::Scalar);
    common::reference::check_quantized("smollm2-135m-instruct");
}
