//! Scores a text under a model: mean negative log-likelihood, perplexity and bits per UTF-8
//! byte, the quality measure every comparison in Switchyard uses (bits per byte is comparable
//! across tokenizers; per-token perplexity is not).
//!
//! Long texts are scored with a sliding window: each window of at most `window` input tokens
//! scores only its last `stride` targets, so every target after the first has at least
//! `window - stride` tokens of context (except at the start).
//!
//! The K/V the scoring pass attends to can be held as a serving engine holds them
//! ([`ScoreOptions::kv_format`]), so the quality cost of a cache format is measured on text.

use candle_core::{DType, Tensor, D};
use switchyard_models::{DenseKv, ForwardBatch, LayeredModel};
use switchyard_tokenizer::Tokenizer;

use crate::kv::KvFormat;
use crate::{EngineError, Result};

/// Rows sent through the LM head at once (bounds the logits buffer: rows x vocab f32).
const HEAD_ROWS: usize = 256;

#[derive(Debug, Clone, Copy)]
pub struct ScoreOptions {
    /// Most input tokens per forward pass (0: the smaller of 1024 and the context length).
    pub window: usize,
    /// New targets scored per window (0: half the window).
    pub stride: usize,
    /// How the pass holds its K/V: f32 (exact) or f16 (each value rounded to the nearest
    /// half, as the engine's f16 blocks store it; attention then reads the same values the
    /// engine would). 8-bit K/V is not scored here.
    pub kv_format: KvFormat,
}

/// Exact f32 K/V by default, not the serving engine's f16: a score is the model's own
/// reference figure unless a cache format is asked for (f16 moves a 26-token sentence's total
/// by 0.6 %, a long text's bits per byte by under 0.01 %).
impl Default for ScoreOptions {
    fn default() -> Self {
        Self {
            window: 0,
            stride: 0,
            kv_format: KvFormat::F32,
        }
    }
}

/// Default scoring window (tokens).
pub const DEFAULT_WINDOW: usize = 1024;

#[derive(Debug, Clone, PartialEq)]
pub struct Score {
    /// Tokens whose probability was scored (all but the first).
    pub tokens_scored: usize,
    pub total_nll_nats: f64,
    pub mean_nll_nats: f64,
    pub perplexity: f64,
    /// UTF-8 bytes of the scored tokens' text.
    pub bytes_scored: usize,
    pub bits_per_byte: f64,
    /// Whether a BOS token was prepended (only when the model's metadata asks for one).
    pub bos_added: bool,
    pub window: usize,
    pub stride: usize,
}

/// Scores `text`; `progress(done, total)` is called after each window.
pub fn score_text(
    model: &LayeredModel,
    tokenizer: &Tokenizer,
    text: &str,
    opts: ScoreOptions,
    mut progress: impl FnMut(usize, usize),
) -> Result<Score> {
    let ids = tokenizer.encode(text, true, false)?;
    let bos_added = tokenizer.adds_bos() && ids.first() == tokenizer.bos_id().as_ref();
    let n = ids.len();
    if n < 2 {
        return Err(EngineError::TooFewTokens { tokens: n });
    }
    let context = model.spec().context_length;
    let window = if opts.window == 0 {
        DEFAULT_WINDOW.min(context)
    } else {
        opts.window
    };
    let stride = if opts.stride == 0 {
        (window / 2).max(1)
    } else {
        opts.stride
    };
    if stride == 0 || stride > window || window > context {
        return Err(EngineError::BadWindow {
            window,
            stride,
            context,
        });
    }
    if opts.kv_format == KvFormat::Int8 {
        return Err(EngineError::BadConfig(
            "scoring holds K/V as f32 or f16, not 8-bit".into(),
        ));
    }

    let mut total = 0f64;
    let mut pos = 1; // next target index
    while pos < n {
        let end = (pos + if pos == 1 { window } else { stride }).min(n);
        // Inputs a..end-1 predict targets a+1..end; only pos..end are counted.
        let a = (end - 1).saturating_sub(window);
        total += window_nll(model, &ids[a..end], pos - a, opts.kv_format)?;
        pos = end;
        progress(pos - 1, n - 1);
    }
    let bytes_scored = if bos_added {
        text.len()
    } else {
        text.len()
            .saturating_sub(tokenizer.decode(&ids[..1], false)?.len())
    };
    let tokens_scored = n - 1;
    let mean = total / tokens_scored as f64;
    Ok(Score {
        tokens_scored,
        total_nll_nats: total,
        mean_nll_nats: mean,
        perplexity: mean.exp(),
        bytes_scored,
        bits_per_byte: total / std::f64::consts::LN_2 / bytes_scored.max(1) as f64,
        bos_added,
        window,
        stride,
    })
}

/// Sum of -ln p(ids[t] | ids[..t]) for t in `first..ids.len()`, in one fresh forward pass.
fn window_nll(model: &LayeredModel, ids: &[u32], first: usize, format: KvFormat) -> Result<f64> {
    let inputs = &ids[..ids.len() - 1];
    let (layers, row) = (model.n_layers(), model.spec().kv_row_len());
    let mut kv = if format == KvFormat::F16 {
        DenseKv::rounded_to_f16(layers, row)
    } else {
        DenseKv::new(layers, row)
    };
    let x = model.embed(inputs)?;
    let mut batch = ForwardBatch::single(&mut kv, 0, inputs.len());
    let h = model.forward_layers(x, 0..model.n_layers(), &mut batch)?;
    // Row r predicts ids[r + 1]; rows first-1.. are counted.
    let mut total = 0f64;
    let mut r = first - 1;
    while r < inputs.len() {
        let rows = HEAD_ROWS.min(inputs.len() - r);
        let logits = model.logits(&h.narrow(0, r, rows)?)?;
        let targets = Tensor::new(&ids[r + 1..r + 1 + rows], logits.device())?;
        let lse = log_sum_exp(&logits)?;
        let picked = logits
            .gather(&targets.unsqueeze(1)?, 1)?
            .squeeze(1)?
            .to_dtype(DType::F64)?;
        total += (lse - picked)?.sum_all()?.to_scalar::<f64>()?;
        r += rows;
    }
    Ok(total)
}

/// Row-wise log-sum-exp of `[rows, vocab]` logits, in f64.
fn log_sum_exp(logits: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?;
    let shifted = logits.broadcast_sub(&max)?.to_dtype(DType::F64)?;
    let s = shifted.exp()?.sum(D::Minus1)?.log()?;
    Ok((s + max.squeeze(1)?.to_dtype(DType::F64)?)?)
}
