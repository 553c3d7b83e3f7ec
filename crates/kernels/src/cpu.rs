//! Which SIMD instruction set the CPU kernels use, detected once at run time.
//!
//! `SWITCHYARD_FORCE_SCALAR=1` forces the portable scalar code, so the fallback that is the
//! reference for every kernel is exercised on machines that have AVX-512 too. AMX is never used:
//! the CPUs of some virtual machines report it but fault on its instructions.

use std::sync::OnceLock;

/// Environment switch that forces the scalar kernels.
pub const FORCE_SCALAR_ENV: &str = "SWITCHYARD_FORCE_SCALAR";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    Scalar,
    /// AVX2 with FMA and F16C (256-bit).
    Avx2,
    /// AVX-512 Foundation, Byte/Word and VNNI (512-bit integer dot products).
    Avx512,
}

impl SimdLevel {
    pub fn as_str(&self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        }
    }
}

/// The level every kernel dispatches on (fixed for the life of the process, so results are
/// reproducible run to run on one machine).
pub fn simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        if std::env::var(FORCE_SCALAR_ENV).is_ok_and(|v| !v.is_empty() && v != "0") {
            return SimdLevel::Scalar;
        }
        detect()
    })
}

#[cfg(target_arch = "x86_64")]
fn detect() -> SimdLevel {
    // Every level runs the ones below it, so AVX-512 is taken only with AVX2's features too.
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    if avx2
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
    {
        SimdLevel::Avx512
    } else if avx2 {
        SimdLevel::Avx2
    } else {
        SimdLevel::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> SimdLevel {
    SimdLevel::Scalar
}

/// Every level this CPU can run, scalar first (for tests that compare them).
pub fn available_levels() -> Vec<SimdLevel> {
    let best = detect();
    [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512]
        .into_iter()
        .filter(|&l| l <= best)
        .collect()
}
