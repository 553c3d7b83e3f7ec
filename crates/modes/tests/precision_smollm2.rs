//! Precision modes on a real model (SmolLM2-135M): each precision's logits against f32 of the
//! same file, within the named bounds; activation-aware 4-bit against plain 4-bit.

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use switchyard_exit_training::corpus::{Corpus, Split};
use switchyard_models::{DenseKv, ForwardBatch, LayeredModel, QuantTarget};
use switchyard_modes::awq::{self, AwqCalibration};
use switchyard_modes::precision::{
    self, relative_rms, LOGIT_TOL_F16, LOGIT_TOL_INT8, LOGIT_TOL_Q4,
};
use switchyard_request::Precision;
use switchyard_tokenizer::Tokenizer;

const MODEL: &str = "smollm2-135m-instruct";

fn logits(model: &LayeredModel, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
    let spec = model.spec();
    let mut kv = DenseKv::new(spec.n_layers, spec.n_kv_heads * spec.head_dim);
    let logits = model.forward(tokens, &mut ForwardBatch::single(&mut kv, 0, tokens.len()))?;
    Ok(logits.flatten_all()?.to_vec1()?)
}

fn docs(
    tokenizer: &Tokenizer,
    split: Split,
    n: usize,
    len: usize,
) -> anyhow::Result<Vec<Vec<u32>>> {
    let corpus = Corpus::resolve("sharegpt")?;
    let mut out = Vec::new();
    for d in corpus.documents(tokenizer, split, len)? {
        let d = d?;
        if d.tokens.len() == len {
            out.push(d.tokens);
        }
        if out.len() == n {
            break;
        }
    }
    Ok(out)
}

#[test]
fn precisions_stay_within_their_logit_bounds_and_awq_beats_plain_q4() -> anyhow::Result<()> {
    let path = switchyard_zoo::ensure(MODEL)?;
    let src = switchyard_weights::open(&path)?;
    let tokenizer = Tokenizer::from_source(&*src)?;
    let held_out = docs(&tokenizer, Split::HeldOut, 2, 96)?;
    let calibration = docs(&tokenizer, Split::Calibration, 4, 256)?;
    assert_eq!((held_out.len(), calibration.len()), (2, 4));

    let cal: AwqCalibration =
        awq::calibrate(Arc::clone(&src), &calibration, QuantTarget::Q4, |_, _| {})?;
    let (plain, scaled) = cal.total_error();
    eprintln!("awq calibration product error: plain {plain:.4e}, scaled {scaled:.4e}");
    assert!(
        scaled <= plain,
        "the search includes alpha 0, so it never does worse"
    );
    assert!(
        scaled < 0.9 * plain,
        "the scales reduce the calibration error by over 10%"
    );
    assert_eq!(cal.choices.len(), 3 * 30);

    let reference = precision::load(Arc::clone(&src), Precision::F32, Default::default())?;
    let mut errors = Vec::new();
    for p in [
        Precision::F16,
        Precision::Int8,
        Precision::Q4,
        Precision::Q4Awq,
    ] {
        let calibrations = precision::Calibrations {
            awq: Some(&cal),
            gptq: None,
        };
        let model = precision::load(Arc::clone(&src), p, calibrations)?;
        let mut err = 0.0;
        for doc in &held_out {
            err += relative_rms(&logits(&model, doc)?, &logits(&reference, doc)?)
                / held_out.len() as f32;
        }
        let bytes = model.resident_bytes().total();
        eprintln!(
            "{}: relative logit rms {err:.4e}, {bytes} weight bytes",
            p.name()
        );
        errors.push((p, err, bytes));
    }
    let err = |p| {
        errors
            .iter()
            .find(|e| e.0 == p)
            .map(|e| e.1)
            .unwrap_or(f32::NAN)
    };
    let bytes = |p| errors.iter().find(|e| e.0 == p).map(|e| e.2).unwrap_or(0);
    assert!(err(Precision::F16) < LOGIT_TOL_F16);
    assert!(err(Precision::Int8) < LOGIT_TOL_INT8);
    assert!(err(Precision::Q4) < LOGIT_TOL_Q4);
    assert!(err(Precision::Q4Awq) < LOGIT_TOL_Q4);
    assert!(
        err(Precision::F16) < err(Precision::Int8) && err(Precision::Int8) < err(Precision::Q4)
    );
    assert!(
        err(Precision::Q4Awq) < err(Precision::Q4),
        "activation-aware scales lower the held-out logit error"
    );
    // 4-bit layers take about half of 8-bit's bytes; f16 dense is the largest.
    assert!(
        bytes(Precision::Q4) < bytes(Precision::Int8)
            && bytes(Precision::Int8) < bytes(Precision::F16)
    );
    assert_eq!(bytes(Precision::Q4), bytes(Precision::Q4Awq));
    let _ = GgmlDType::Q4_0;
    Ok(())
}
