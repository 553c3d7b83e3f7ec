//! Loading a model at a mode's weight precision.
//!
//! The zoo's files hold 4/5-bit blocks (the only form the models ship in here), so every
//! precision starts from those values: `f32` and `f16` dequantize them exactly (f16 rounds
//! them), `int8` and `q4` re-quantize them to Q8_0 and to Q4_K/Q4_0. Differences between
//! modes are therefore the serving precision's, measured against `f32` of the same values,
//! not against the original training checkpoint (which is not available here).

use std::sync::Arc;

use switchyard_models::{LayeredModel, LoadOptions, QuantTarget, WeightFormat};
use switchyard_request::Precision;
use switchyard_weights::WeightSource;

use crate::awq::{scaled_source, AwqCalibration};
use crate::gptq::{gptq_source, GptqCalibration};
use crate::{ModesError, Result};

/// Relative RMS error of a product `x Wᵀ` with the weight held at each precision, against
/// f32, on Gaussian weights and activations (measured by this crate's tests). Per tensor type:
/// the bound a layer's output error stays under before any model-level accumulation.
pub const PRODUCT_TOL_F16: f32 = 1e-3;
pub const PRODUCT_TOL_Q8_0: f32 = 2e-2;
pub const PRODUCT_TOL_Q4_K: f32 = 0.12;
pub const PRODUCT_TOL_Q4_0: f32 = 0.15;

/// Logit error of a whole model at each precision against f32 of the same file, as the RMS
/// difference over all positions and vocabulary entries divided by f32's logit standard
/// deviation (measured on SmolLM2-135M by this crate's tests).
pub const LOGIT_TOL_F16: f32 = 5e-3;
pub const LOGIT_TOL_INT8: f32 = 0.08;
pub const LOGIT_TOL_Q4: f32 = 0.45;

/// The loader's weight format for `p` (the activation-aware variant loads scaled weights
/// through the same format as `q4`; GPTQ's blocks are already in it and load as they are).
pub fn weight_format(p: Precision) -> WeightFormat {
    match p {
        Precision::F16 => WeightFormat::F16,
        Precision::F32 => WeightFormat::F32,
        Precision::Int8 => WeightFormat::Quantized(QuantTarget::Q8_0),
        Precision::Q4 | Precision::Q4Awq | Precision::Q4Gptq => {
            WeightFormat::Quantized(QuantTarget::Q4)
        }
    }
}

/// What the calibrated precisions need, made once per model (see [`crate::assets`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Calibrations<'a> {
    /// For `q4-awq` (see [`crate::awq::calibrate`]).
    pub awq: Option<&'a AwqCalibration>,
    /// For `q4-gptq` (see [`crate::gptq::calibrate`]).
    pub gptq: Option<&'a GptqCalibration>,
}

/// Loads `source` at precision `p`. `calibrations` must hold the calibration of the same
/// source that `p` needs, if any.
pub fn load(
    source: Arc<dyn WeightSource>,
    p: Precision,
    calibrations: Calibrations<'_>,
) -> Result<LayeredModel> {
    let opts = LoadOptions {
        layers: None,
        format: weight_format(p),
    };
    let source: Arc<dyn WeightSource> = match (p, calibrations.awq, calibrations.gptq) {
        (Precision::Q4Awq, Some(c), _) => Arc::new(scaled_source(source, c)?),
        (Precision::Q4Awq, None, _) => {
            return Err(ModesError::Invalid(
                "the q4-awq precision needs an activation-aware calibration of the model".into(),
            ))
        }
        (Precision::Q4Gptq, _, Some(c)) => Arc::new(gptq_source(source, c)),
        (Precision::Q4Gptq, _, None) => {
            return Err(ModesError::Invalid(
                "the q4-gptq precision needs a GPTQ calibration of the model".into(),
            ))
        }
        _ => source,
    };
    Ok(LayeredModel::load(source, &opts)?)
}

/// Relative RMS difference `rms(a - b) / std(b)` over two equally long value lists.
pub fn relative_rms(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len()).max(1) as f64;
    let mean_b = b.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var_b = b
        .iter()
        .map(|&v| (f64::from(v) - mean_b).powi(2))
        .sum::<f64>()
        / n;
    let mse = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
        .sum::<f64>()
        / n;
    (mse.sqrt() / var_b.sqrt().max(f64::MIN_POSITIVE)) as f32
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{DType, Device, Tensor};
    use rand::{rngs::StdRng, SeedableRng};
    use rand_distr::{Distribution, Normal};
    use switchyard_kernels::QLinear;

    use super::*;

    fn gaussian(rows: usize, cols: usize, seed: u64) -> Tensor {
        let mut rng = StdRng::seed_from_u64(seed);
        let n = Normal::new(0.0f32, 1.0).unwrap();
        let v: Vec<f32> = (0..rows * cols).map(|_| n.sample(&mut rng)).collect();
        Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap()
    }

    /// Each tensor type's product error against f32 stays under its named bound, and the
    /// bounds are ordered as the bit widths are (so none is vacuous).
    #[test]
    fn product_error_per_tensor_type_is_within_its_bound() {
        let w = gaussian(256, 512, 1);
        let x = gaussian(16, 512, 2);
        let exact = x.matmul(&w.t().unwrap()).unwrap().flatten_all().unwrap();
        let exact: Vec<f32> = exact.to_vec1().unwrap();
        let wq = QTensor::quantize(&w, GgmlDType::F32).unwrap();
        let err = |lin: QLinear| {
            let y: Vec<f32> = lin
                .forward(&x)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            relative_rms(&y, &exact)
        };
        let f16 = err(QLinear::dense(&wq, DType::F16, None).unwrap());
        let q = |t| err(QLinear::new(QTensor::quantize(&w, t).unwrap(), None).unwrap());
        let (q8, q4k, q40) = (q(GgmlDType::Q8_0), q(GgmlDType::Q4K), q(GgmlDType::Q4_0));
        eprintln!("relative rms: f16 {f16:.2e} q8_0 {q8:.2e} q4_k {q4k:.2e} q4_0 {q40:.2e}");
        assert!(f16 < PRODUCT_TOL_F16, "f16 {f16}");
        assert!(q8 < PRODUCT_TOL_Q8_0, "q8_0 {q8}");
        assert!(q4k < PRODUCT_TOL_Q4_K, "q4_k {q4k}");
        assert!(q40 < PRODUCT_TOL_Q4_0, "q4_0 {q40}");
        assert!(f16 < q8 && q8 < q4k && q8 < q40);
        // 4-bit is really 4-bit: well above the 8-bit error.
        assert!(q4k > 4.0 * q8 && q40 > 4.0 * q8);
    }

    #[test]
    fn relative_rms_of_known_values() {
        assert_eq!(relative_rms(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]), 0.0);
        // std of [1,2,3] is sqrt(2/3); rms diff of [1,1,1] is 1.
        let r = relative_rms(&[2.0, 3.0, 4.0], &[1.0, 2.0, 3.0]);
        assert!((r - 1.0 / (2.0f32 / 3.0).sqrt()).abs() < 1e-6, "{r}");
    }

    #[test]
    fn awq_precision_without_calibration_is_refused() {
        use switchyard_weights::{Architecture, SyntheticSource};
        let spec = SyntheticSource::tiny_spec(Architecture::Llama);
        let src = SyntheticSource::new(spec, 1, GgmlDType::F32).unwrap();
        let src: Arc<dyn WeightSource> = Arc::new(src);
        let err = load(Arc::clone(&src), Precision::Q4Awq, Calibrations::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the q4-awq precision needs an activation-aware calibration of the model"
        );
        let err = load(src, Precision::Q4Gptq, Calibrations::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the q4-gptq precision needs a GPTQ calibration of the model"
        );
    }
}
