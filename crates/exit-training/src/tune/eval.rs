//! Held-out scores of an exit head: top-1 agreement with the final layer, KL, bits per byte of
//! the true next token, expected calibration error, the share of tokens that can exit at a
//! given precision (ranked by the exit's max probability, or by the exit probe), and AUROCs.

use candle_core::{Tensor, D};
use serde::Serialize;

use super::{probe_scores, Frozen};
use switchyard_exits::heads::{ExitHead, ExitProbe};
use switchyard_exits::Result;

/// Precisions at which the exitable share is reported.
pub const PRECISIONS: &[f64] = &[0.85, 0.90, 0.95];
/// Bins of the expected calibration error.
pub const ECE_BINS: usize = 10;
/// Rows sent through the vocabulary head at once.
pub const EVAL_ROWS: usize = 64;

/// Per-row observations of one head on held-out rows.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    /// The exit's top-1 equals the final layer's.
    pub agree: Vec<bool>,
    pub max_prob: Vec<f32>,
    /// KL(final ‖ exit), nats.
    pub kl: Vec<f32>,
    /// `-ln p_exit(next token)`, nats.
    pub nll: Vec<f32>,
    /// `-ln p_final(next token)`, nats.
    pub nll_final: Vec<f32>,
    /// The probe's probability, when there is a probe.
    pub probe: Option<Vec<f32>>,
}

/// Runs `head` (and its probe) over held-out exit rows `x` against the final rows.
pub fn observe(
    head: &ExitHead,
    probe: Option<&ExitProbe>,
    frozen: &Frozen,
    x: &Tensor,
    last: &Tensor,
    next: &[u32],
) -> Result<Observed> {
    let rows = x.dim(0)?;
    let mut o = Observed {
        probe: probe.map(|_| Vec::with_capacity(rows)),
        ..Observed::default()
    };
    for lo in (0..rows).step_by(EVAL_ROWS) {
        let n = EVAL_ROWS.min(rows - lo);
        let z = frozen.norm(&head.translate(&x.narrow(0, lo, n)?)?)?;
        let logp = candle_nn::ops::log_softmax(&frozen.logits(&z)?, D::Minus1)?;
        let tlogp = frozen.log_probs(&last.narrow(0, lo, n)?)?;
        let idx = Tensor::from_slice(&next[lo..lo + n], (n, 1), x.device())?;
        let kl = (tlogp.exp()? * (&tlogp - &logp)?)?.sum(D::Minus1)?;
        o.kl.extend(kl.to_vec1::<f32>()?);
        o.nll.extend(
            logp.gather(&idx, 1)?
                .neg()?
                .flatten_all()?
                .to_vec1::<f32>()?,
        );
        o.nll_final.extend(
            tlogp
                .gather(&idx, 1)?
                .neg()?
                .flatten_all()?
                .to_vec1::<f32>()?,
        );
        let a = logp.argmax(D::Minus1)?.to_vec1::<u32>()?;
        let b = tlogp.argmax(D::Minus1)?.to_vec1::<u32>()?;
        o.agree.extend(a.iter().zip(&b).map(|(a, b)| a == b));
        o.max_prob
            .extend(logp.max(D::Minus1)?.exp()?.to_vec1::<f32>()?);
        if let (Some(p), Some(s)) = (probe, o.probe.as_mut()) {
            s.extend(probe_scores(p, &z)?);
        }
    }
    Ok(o)
}

/// One head's held-out row of the study.
#[derive(Debug, Clone, Serialize)]
pub struct HeadScores {
    pub depth: usize,
    /// `lens`, `ridge`, `affine` or `mlp`.
    pub head: String,
    /// Top-1 agreement with the final layer: also the oracle upper bound of the share of
    /// tokens this exit could serve without changing the output.
    pub agreement: f64,
    pub kl_nats: f64,
    pub bits_per_byte: f64,
    /// Expected calibration error of max probability as a predictor of agreement.
    pub ece: f64,
    /// Share of tokens that can exit with the given precision (of [`PRECISIONS`]), ranking
    /// tokens by the exit's max probability.
    pub exit_share_max_prob: Vec<f64>,
    /// The same, ranking by the probe's score.
    pub exit_share_probe: Option<Vec<f64>>,
    pub auroc_max_prob: f64,
    pub auroc_probe: Option<f64>,
}

/// Figures of `o` over `bytes` UTF-8 bytes of predicted text.
pub fn score(depth: usize, head: &str, o: &Observed, bytes: u64) -> HeadScores {
    let labels: Vec<bool> = o.agree.clone();
    let conf: Vec<f64> = o.max_prob.iter().map(|&p| f64::from(p)).collect();
    let probe: Option<Vec<f64>> = o
        .probe
        .as_ref()
        .map(|s| s.iter().map(|&p| f64::from(p)).collect());
    let n = labels.len().max(1) as f64;
    HeadScores {
        depth,
        head: head.to_string(),
        agreement: labels.iter().filter(|&&a| a).count() as f64 / n,
        kl_nats: o.kl.iter().map(|&k| f64::from(k)).sum::<f64>() / n,
        bits_per_byte: bits_per_byte(&o.nll, bytes),
        ece: ece(&conf, &labels, ECE_BINS),
        exit_share_max_prob: PRECISIONS
            .iter()
            .map(|&p| share_at_precision(&conf, &labels, p))
            .collect(),
        exit_share_probe: probe.as_ref().map(|s| {
            PRECISIONS
                .iter()
                .map(|&p| share_at_precision(s, &labels, p))
                .collect()
        }),
        auroc_max_prob: auroc(&conf, &labels),
        auroc_probe: probe.as_ref().map(|s| auroc(s, &labels)),
    }
}

/// The Markdown table of `rows` (Δ bits per byte relative to `full_bpb`).
pub fn scores_table(rows: &[HeadScores], full_bpb: f64) -> String {
    use std::fmt::Write as _;
    let pct: Vec<String> = PRECISIONS
        .iter()
        .map(|p| format!("{:.0}%", p * 100.0))
        .collect();
    let mut s = format!(
        "| depth | head | top-1 agreement (oracle) | KL (nats) | bits/byte (Δ vs full) | ECE | exit share at {} precision, max-prob | same, probe | AUROC max-prob / probe |\n|---|---|---|---|---|---|---|---|---|\n",
        pct.join(" / ")
    );
    let shares = |v: &[f64]| -> String {
        v.iter()
            .map(|x| format!("{:.1}%", x * 100.0))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {:.1}% | {:.3} | {:.4} ({:+.1}%) | {:.3} | {} | {} | {:.3} / {} |",
            r.depth,
            r.head,
            r.agreement * 100.0,
            r.kl_nats,
            r.bits_per_byte,
            100.0 * (r.bits_per_byte / full_bpb - 1.0),
            r.ece,
            shares(&r.exit_share_max_prob),
            r.exit_share_probe.as_deref().map_or("-".into(), shares),
            r.auroc_max_prob,
            r.auroc_probe.map_or("-".into(), |a| format!("{a:.3}"))
        );
    }
    s
}

/// `Σ nll / ln 2 / bytes`.
pub fn bits_per_byte(nll: &[f32], bytes: u64) -> f64 {
    nll.iter().map(|&v| f64::from(v)).sum::<f64>() / std::f64::consts::LN_2 / bytes.max(1) as f64
}

/// Expected calibration error over `bins` equal-width confidence bins.
pub fn ece(conf: &[f64], labels: &[bool], bins: usize) -> f64 {
    let bins = bins.max(1);
    let mut sum_c = vec![0.0; bins];
    let mut sum_y = vec![0.0; bins];
    let mut count = vec![0usize; bins];
    for (&c, &y) in conf.iter().zip(labels) {
        let b = ((c * bins as f64) as usize).min(bins - 1);
        sum_c[b] += c;
        sum_y[b] += f64::from(u8::from(y));
        count[b] += 1;
    }
    let n = conf.len().max(1) as f64;
    (0..bins)
        .filter(|&b| count[b] > 0)
        .map(|b| (sum_c[b] - sum_y[b]).abs() / n)
        .sum()
}

/// The largest share of tokens that, taken in decreasing order of `score`, keeps the share of
/// correct ones (`labels`) at or above `precision`.
pub fn share_at_precision(score: &[f64], labels: &[bool], precision: f64) -> f64 {
    let mut order: Vec<usize> = (0..score.len()).collect();
    order.sort_by(|&a, &b| score[b].total_cmp(&score[a]));
    let mut correct = 0usize;
    let mut best = 0usize;
    for (k, &i) in order.iter().enumerate() {
        correct += usize::from(labels[i]);
        if correct as f64 >= precision * (k + 1) as f64 {
            best = k + 1;
        }
    }
    best as f64 / score.len().max(1) as f64
}

/// Area under the ROC curve of `score` for `labels` (ties count one half); NaN without both
/// classes.
pub fn auroc(score: &[f64], labels: &[bool]) -> f64 {
    let mut order: Vec<usize> = (0..score.len()).collect();
    order.sort_by(|&a, &b| score[a].total_cmp(&score[b]));
    // Average ranks (1-based) over ties, then the Mann-Whitney statistic.
    let mut rank = vec![0.0; score.len()];
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && score[order[j + 1]] == score[order[i]] {
            j += 1;
        }
        let r = (i + j) as f64 / 2.0 + 1.0;
        for &k in &order[i..=j] {
            rank[k] = r;
        }
        i = j + 1;
    }
    let pos = labels.iter().filter(|&&y| y).count() as f64;
    let neg = labels.len() as f64 - pos;
    if pos == 0.0 || neg == 0.0 {
        return f64::NAN;
    }
    let sum_pos: f64 = rank
        .iter()
        .zip(labels)
        .filter(|(_, &y)| y)
        .map(|(r, _)| r)
        .sum();
    (sum_pos - pos * (pos + 1.0) / 2.0) / (pos * neg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auroc_of_a_perfect_a_reversed_and_a_tied_ranking() {
        let labels = [false, false, true, true];
        assert_eq!(auroc(&[0.1, 0.2, 0.8, 0.9], &labels), 1.0);
        assert_eq!(auroc(&[0.9, 0.8, 0.2, 0.1], &labels), 0.0);
        assert_eq!(auroc(&[0.5; 4], &labels), 0.5);
        assert!(auroc(&[0.5, 0.6], &[true, true]).is_nan());
    }

    #[test]
    fn share_at_precision_takes_the_longest_prefix_that_keeps_it() {
        // Ranked: T T F T F -> precisions 1, 1, 0.67, 0.75, 0.6.
        let score = [0.9, 0.8, 0.7, 0.6, 0.5];
        let labels = [true, true, false, true, false];
        assert_eq!(share_at_precision(&score, &labels, 0.75), 4.0 / 5.0);
        assert_eq!(share_at_precision(&score, &labels, 0.9), 2.0 / 5.0);
        assert_eq!(share_at_precision(&score, &labels, 0.5), 1.0);
    }

    #[test]
    fn ece_is_the_weighted_gap_between_confidence_and_accuracy() {
        // Bin 0.9: confidence 0.9 twice, one right: gap 0.4 on 2 of 4 tokens.
        // Bin 0.1: confidence 0.1 twice, none right: gap 0.1 on 2 of 4.
        let conf = [0.95, 0.95, 0.15, 0.15];
        let labels = [true, false, false, false];
        let e = ece(&conf, &labels, 10);
        assert!((e - (0.5 * 0.45 + 0.5 * 0.15)).abs() < 1e-12, "{e}");
    }

    #[test]
    fn bits_per_byte_converts_nats() {
        let nll = [std::f32::consts::LN_2; 4];
        assert!((bits_per_byte(&nll, 2) - 2.0).abs() < 1e-6);
    }
}
