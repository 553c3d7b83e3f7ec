//! The exit study: how well each exit predicts the final layer, on held-out text.
//!
//! [`collect`] runs each document once at full depth, reads every exit through the tuned heads
//! and through the logit lens, and keeps a small record per token (agreement with the final
//! argmax, confidence, KL to the final distribution). [`StudyReport::from_records`] turns the
//! records into the tables HELIOS's observations are about:
//!
//! * per exit: top-1 agreement and mean KL, tuned lens vs logit lens;
//! * Observation 2: agreement split by confidence bucket, and among tokens below each
//!   threshold ("even unconfident early tokens usually equal the final token");
//! * Observation 1 (one model): at each threshold, the share of tokens that would exit at or
//!   before each depth;
//! * Observation 1 (two models, [`PairReport`]): of the tokens the small model cannot exit
//!   early, the share the large one can, and the joint early-exit share.

use std::fmt::Write as _;
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;
use switchyard_models::LayeredModel;
use switchyard_tokenizer::Tokenizer;

use switchyard_exit_training::calibrate::{hidden_states, SKIP_POSITIONS};
use switchyard_exit_training::corpus::{Corpus, Split};
use switchyard_exits::confidence::{
    kl_from_log_p, log_softmax, token_stats, ConfidenceMeasure, TokenStats,
};
use switchyard_exits::heads::ExitHeads;
use switchyard_exits::{ExitsError, Result};

/// Thresholds of the cumulative exit distribution and of Observation 2 (HELIOS's range).
pub const THRESHOLDS: &[f32] = &[0.5, 0.6, 0.7, 0.8, 0.9, 0.95];
/// Confidence buckets of width 0.1.
pub const BUCKETS: usize = 10;
/// Default number of held-out token positions studied.
pub const DEFAULT_TOKENS: usize = 4096;
/// Rows sent through the LM head at once (bounds the logits buffers to rows × vocab f32).
const HEAD_ROWS: usize = 64;
/// Depth fractions that count as "early" in the two-model complementarity (HELIOS: 6 of 24
/// and 9 of 32 layers, about a quarter; a half as a second point).
pub const EARLY_FRACTIONS: &[f64] = &[0.25, 0.5];

/// One exit's view of one token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExitObs {
    /// Argmax equals the final layer's.
    pub agree: bool,
    pub max_prob: f32,
    pub margin: f32,
    /// KL(final ‖ exit), nats.
    pub kl: f32,
}

impl ExitObs {
    pub fn confidence(&self, m: ConfidenceMeasure) -> f32 {
        match m {
            ConfidenceMeasure::MaxProb => self.max_prob,
            ConfidenceMeasure::Margin => self.margin,
        }
    }
}

/// One token position: each exit through the tuned heads and through the logit lens, in the
/// order of [`StudyData::depths`].
#[derive(Debug, Clone)]
pub struct TokenRecord {
    pub token: u32,
    pub final_argmax: u32,
    pub tuned: Vec<ExitObs>,
    pub lens: Vec<ExitObs>,
}

#[derive(Debug, Clone)]
pub struct StudyData {
    pub model: String,
    pub n_layers: usize,
    pub depths: Vec<usize>,
    pub corpus: String,
    pub split: String,
    pub documents: usize,
    pub records: Vec<TokenRecord>,
    pub seconds: f64,
}

/// A model under study: its name, its heads and its tokenizer.
#[derive(Clone, Copy)]
pub struct StudyModel<'a> {
    pub model: &'a LayeredModel,
    pub name: &'a str,
    pub heads: &'a ExitHeads,
    pub tokenizer: &'a Tokenizer,
}

/// Runs the held-out documents of `corpus` (all of it when `split` is [`Split::All`]) through
/// `model` until `max_tokens` positions are recorded; `progress(done, max)` after each document.
pub fn collect(
    m: &StudyModel<'_>,
    corpus: &Corpus,
    split: Split,
    max_tokens: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<StudyData> {
    let StudyModel {
        model,
        name,
        heads,
        tokenizer,
    } = *m;
    let t0 = Instant::now();
    let depths = heads.depths();
    let mut records = Vec::new();
    let mut documents = 0;
    let docs = corpus.documents(
        tokenizer,
        split,
        switchyard_exit_training::corpus::DEFAULT_DOC_TOKENS,
    )?;
    for doc in docs {
        if records.len() >= max_tokens {
            break;
        }
        let mut doc = doc?;
        doc.tokens
            .truncate(max_tokens - records.len() + SKIP_POSITIONS);
        if doc.tokens.len() <= SKIP_POSITIONS {
            continue;
        }
        let _span = tracing::debug_span!("study_doc", index = doc.index).entered();
        records.extend(document_records(model, heads, &depths, &doc.tokens)?);
        documents += 1;
        progress(records.len(), max_tokens);
    }
    if records.is_empty() {
        return Err(ExitsError::EmptyCorpus {
            corpus: corpus.name().to_string(),
        });
    }
    Ok(StudyData {
        model: name.to_string(),
        n_layers: model.n_layers(),
        depths,
        corpus: corpus.name().to_string(),
        split: format!("{split:?}").to_lowercase(),
        documents,
        records,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

fn document_records(
    model: &LayeredModel,
    heads: &ExitHeads,
    depths: &[usize],
    tokens: &[u32],
) -> Result<Vec<TokenRecord>> {
    let (inputs, last) = hidden_states(model, tokens, depths)?;
    let n = tokens.len();
    let mut out = Vec::with_capacity(n - SKIP_POSITIONS);
    let mut r = SKIP_POSITIONS;
    while r < n {
        let rows = HEAD_ROWS.min(n - r);
        let fin = rows_of(&model.logits(&last.narrow(0, r, rows)?)?)?;
        let fin: Vec<(TokenStats, Vec<f64>)> = fin
            .par_iter()
            .map(|l| (token_stats(l), log_softmax(l)))
            .collect();
        let mut recs: Vec<TokenRecord> = (0..rows)
            .map(|i| TokenRecord {
                token: tokens[r + i],
                final_argmax: fin[i].0.argmax,
                tuned: Vec::with_capacity(depths.len()),
                lens: Vec::with_capacity(depths.len()),
            })
            .collect();
        for (&d, x) in depths.iter().zip(&inputs) {
            let h = x.narrow(0, r, rows)?;
            let tuned = observe(&fin, &rows_of(&heads.logits(model, d, &h)?)?);
            let lens = observe(&fin, &rows_of(&model.logits(&h)?)?);
            for (rec, (t, l)) in recs.iter_mut().zip(tuned.into_iter().zip(lens)) {
                rec.tuned.push(t);
                rec.lens.push(l);
            }
        }
        out.extend(recs);
        r += rows;
    }
    Ok(out)
}

fn rows_of(t: &candle_core::Tensor) -> Result<Vec<Vec<f32>>> {
    Ok(t.to_vec2::<f32>()?)
}

fn observe(fin: &[(TokenStats, Vec<f64>)], exit: &[Vec<f32>]) -> Vec<ExitObs> {
    fin.par_iter()
        .zip(exit.par_iter())
        .map(|((fs, log_p), q)| {
            let s = token_stats(q);
            ExitObs {
                agree: s.argmax == fs.argmax,
                max_prob: s.max_prob,
                margin: s.margin,
                kl: kl_from_log_p(log_p, q) as f32,
            }
        })
        .collect()
}

/// Per exit depth: tuned lens vs logit lens.
#[derive(Debug, Clone, Serialize)]
pub struct LayerRow {
    pub depth: usize,
    pub agreement_tuned: f64,
    pub agreement_lens: f64,
    pub mean_kl_tuned_nats: f64,
    pub mean_kl_lens_nats: f64,
    pub mean_confidence_tuned: f64,
    pub mean_confidence_lens: f64,
}

/// Tuned-lens tokens whose confidence lies in `[lo, hi)` at one depth.
#[derive(Debug, Clone, Serialize)]
pub struct BucketRow {
    pub depth: usize,
    pub lo: f32,
    pub hi: f32,
    pub tokens: usize,
    /// Share of them whose argmax equals the final layer's (NaN when none).
    pub agreement: f64,
}

/// Observation 2: tuned-lens tokens below a threshold at one depth.
#[derive(Debug, Clone, Serialize)]
pub struct BelowRow {
    pub depth: usize,
    pub threshold: f32,
    /// Share of all tokens that fall below the threshold here.
    pub share_below: f64,
    /// Of those, the share whose argmax still equals the final layer's.
    pub agreement_below: f64,
}

/// Observation 1 for one model at one threshold (tuned heads, first passing exit).
#[derive(Debug, Clone, Serialize)]
pub struct CumulativeRow {
    pub threshold: f32,
    /// Share of tokens exiting at or before each depth of [`StudyReport::depths`].
    pub exit_share_at_or_before: Vec<f64>,
    /// Share that passes no exit (full depth).
    pub full_depth_share: f64,
    /// Of the tokens that exit early, the share whose exit argmax equals the final layer's.
    pub exited_agreement: f64,
    /// Mean layers run per token (exit depth, or all layers).
    pub mean_depth: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct StudyReport {
    pub model: String,
    pub corpus: String,
    pub split: String,
    pub documents: usize,
    pub tokens: usize,
    pub n_layers: usize,
    pub depths: Vec<usize>,
    pub confidence: ConfidenceMeasure,
    pub seconds: f64,
    pub layers: Vec<LayerRow>,
    pub buckets: Vec<BucketRow>,
    pub below: Vec<BelowRow>,
    pub cumulative: Vec<CumulativeRow>,
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        f64::NAN
    } else {
        s / n as f64
    }
}

/// Index in `depths` of the first exit passing `threshold`, per token.
pub fn first_exits(data: &StudyData, threshold: f32, m: ConfidenceMeasure) -> Vec<Option<usize>> {
    data.records
        .iter()
        .map(|r| {
            r.tuned
                .iter()
                .position(|o| switchyard_exits::confidence::passes(o.confidence(m), threshold))
        })
        .collect()
}

impl StudyReport {
    pub fn from_records(data: &StudyData, m: ConfidenceMeasure) -> Self {
        let recs = &data.records;
        let nd = data.depths.len();
        let n = recs.len();
        let layers = (0..nd)
            .map(|i| LayerRow {
                depth: data.depths[i],
                agreement_tuned: mean(recs.iter().map(|r| f64::from(u8::from(r.tuned[i].agree)))),
                agreement_lens: mean(recs.iter().map(|r| f64::from(u8::from(r.lens[i].agree)))),
                mean_kl_tuned_nats: mean(recs.iter().map(|r| r.tuned[i].kl as f64)),
                mean_kl_lens_nats: mean(recs.iter().map(|r| r.lens[i].kl as f64)),
                mean_confidence_tuned: mean(recs.iter().map(|r| r.tuned[i].confidence(m) as f64)),
                mean_confidence_lens: mean(recs.iter().map(|r| r.lens[i].confidence(m) as f64)),
            })
            .collect();
        let mut buckets = Vec::new();
        let mut below = Vec::new();
        for i in 0..nd {
            let depth = data.depths[i];
            for b in 0..BUCKETS {
                let (lo, hi) = (b as f32 / BUCKETS as f32, (b + 1) as f32 / BUCKETS as f32);
                let inside: Vec<bool> = recs
                    .iter()
                    .map(|r| &r.tuned[i])
                    .filter(|o| {
                        let c = o.confidence(m);
                        c >= lo && (c < hi || (b + 1 == BUCKETS && c <= hi))
                    })
                    .map(|o| o.agree)
                    .collect();
                buckets.push(BucketRow {
                    depth,
                    lo,
                    hi,
                    tokens: inside.len(),
                    agreement: mean(inside.iter().map(|&a| f64::from(u8::from(a)))),
                });
            }
            for &t in THRESHOLDS {
                let under: Vec<bool> = recs
                    .iter()
                    .map(|r| &r.tuned[i])
                    .filter(|o| !switchyard_exits::confidence::passes(o.confidence(m), t))
                    .map(|o| o.agree)
                    .collect();
                below.push(BelowRow {
                    depth,
                    threshold: t,
                    share_below: under.len() as f64 / n.max(1) as f64,
                    agreement_below: mean(under.iter().map(|&a| f64::from(u8::from(a)))),
                });
            }
        }
        let cumulative = THRESHOLDS
            .iter()
            .map(|&t| {
                let first = first_exits(data, t, m);
                let mut counts = vec![0usize; nd];
                for &f in first.iter().flatten() {
                    counts[f] += 1;
                }
                let mut acc = 0;
                let cum: Vec<f64> = counts
                    .iter()
                    .map(|c| {
                        acc += c;
                        acc as f64 / n.max(1) as f64
                    })
                    .collect();
                let exited_agree = mean(
                    first
                        .iter()
                        .zip(recs)
                        .filter_map(|(f, r)| f.map(|i| f64::from(u8::from(r.tuned[i].agree)))),
                );
                let mean_depth = mean(
                    first
                        .iter()
                        .map(|f| f.map_or(data.n_layers, |i| data.depths[i]) as f64),
                );
                CumulativeRow {
                    threshold: t,
                    full_depth_share: 1.0 - cum.last().copied().unwrap_or(0.0),
                    exit_share_at_or_before: cum,
                    exited_agreement: exited_agree,
                    mean_depth,
                }
            })
            .collect();
        StudyReport {
            model: data.model.clone(),
            corpus: data.corpus.clone(),
            split: data.split.clone(),
            documents: data.documents,
            tokens: n,
            n_layers: data.n_layers,
            depths: data.depths.clone(),
            confidence: m,
            seconds: data.seconds,
            layers,
            buckets,
            below,
            cumulative,
        }
    }

    /// The report as Markdown tables.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "### Exit study: {} on {} ({} split, {} documents, {} tokens, confidence {})\n",
            self.model,
            self.corpus,
            self.split,
            self.documents,
            self.tokens,
            self.confidence.as_str()
        );
        let _ = writeln!(
            s,
            "| depth | top-1 agreement tuned | top-1 agreement logit lens | KL tuned (nats) | KL logit lens (nats) | mean confidence tuned |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|");
        for r in &self.layers {
            let _ = writeln!(
                s,
                "| {}/{} | {} | {} | {:.3} | {:.3} | {:.3} |",
                r.depth,
                self.n_layers,
                pct(r.agreement_tuned),
                pct(r.agreement_lens),
                r.mean_kl_tuned_nats,
                r.mean_kl_lens_nats,
                r.mean_confidence_tuned
            );
        }
        let _ = writeln!(
            s,
            "\n**Observation 2** (tuned heads): share of tokens below the threshold, and of those the share whose argmax equals the final layer's.\n"
        );
        let _ = write!(s, "| depth |");
        for t in THRESHOLDS {
            let _ = write!(s, " below {t}: share / agree |");
        }
        let _ = writeln!(s);
        let _ = writeln!(s, "|---|{}", "---|".repeat(THRESHOLDS.len()));
        for d in &self.depths {
            let _ = write!(s, "| {d} |");
            for r in self.below.iter().filter(|r| r.depth == *d) {
                let _ = write!(s, " {} / {} |", pct(r.share_below), pct(r.agreement_below));
            }
            let _ = writeln!(s);
        }
        let _ = writeln!(
            s,
            "\nAgreement by confidence bucket (tuned heads; tokens in bucket in parentheses):\n"
        );
        let _ = write!(s, "| depth |");
        for b in 0..BUCKETS {
            let _ = write!(
                s,
                " [{:.1},{:.1}) |",
                b as f32 / 10.0,
                (b + 1) as f32 / 10.0
            );
        }
        let _ = writeln!(s);
        let _ = writeln!(s, "|---|{}", "---|".repeat(BUCKETS));
        for d in &self.depths {
            let _ = write!(s, "| {d} |");
            for r in self.buckets.iter().filter(|r| r.depth == *d) {
                let _ = write!(s, " {} ({}) |", pct(r.agreement), r.tokens);
            }
            let _ = writeln!(s);
        }
        let _ = writeln!(
            s,
            "\n**Observation 1** (tuned heads): share of tokens exiting at or before each depth (first exit whose confidence passes the threshold).\n"
        );
        let _ = write!(s, "| threshold |");
        for d in &self.depths {
            let _ = write!(s, " ≤{d} |");
        }
        let _ = writeln!(s, " full depth | exited tokens agreeing | mean depth |");
        let _ = writeln!(s, "|---|{}---|---|---|", "---|".repeat(self.depths.len()));
        for r in &self.cumulative {
            let _ = write!(s, "| {} |", r.threshold);
            for v in &r.exit_share_at_or_before {
                let _ = write!(s, " {} |", pct(*v));
            }
            let _ = writeln!(
                s,
                " {} | {} | {:.1} |",
                pct(r.full_depth_share),
                pct(r.exited_agreement),
                r.mean_depth
            );
        }
        s
    }
}

fn pct(x: f64) -> String {
    if x.is_nan() {
        "–".into()
    } else {
        format!("{:.1}%", 100.0 * x)
    }
}

/// One row of the two-model complementarity.
#[derive(Debug, Clone, Serialize)]
pub struct PairRow {
    pub threshold: f32,
    pub early_fraction: f64,
    /// Deepest exit of each model counted as early.
    pub small_early_depth: usize,
    pub large_early_depth: usize,
    /// Share of tokens the small model exits at or before its early depth.
    pub small_early_share: f64,
    /// Share the large model exits early on its own.
    pub large_early_share: f64,
    /// Of the tokens the small model cannot exit early, the share the large one can.
    pub large_early_share_of_rest: f64,
    /// Tokens at least one of the two exits early.
    pub joint_early_share: f64,
}

/// Observation 1 across two models reading the same tokens.
#[derive(Debug, Clone, Serialize)]
pub struct PairReport {
    pub small: String,
    pub large: String,
    pub tokens: usize,
    pub confidence: ConfidenceMeasure,
    pub rows: Vec<PairRow>,
}

/// The deepest depth index at or below `fraction` of the layers (the first exit if none).
fn early_index(depths: &[usize], n_layers: usize, fraction: f64) -> usize {
    let limit = (fraction * n_layers as f64).round() as usize;
    depths.iter().rposition(|&d| d <= limit).unwrap_or(0)
}

impl PairReport {
    /// Both studies must have read the same tokens (same tokenizer, same documents).
    pub fn new(small: &StudyData, large: &StudyData, m: ConfidenceMeasure) -> Result<Self> {
        let same = small.records.len() == large.records.len()
            && small
                .records
                .iter()
                .zip(&large.records)
                .all(|(a, b)| a.token == b.token);
        if !same {
            return Err(ExitsError::Invalid(format!(
                "{} and {} did not read the same tokens; complementarity needs one tokenizer",
                small.model, large.model
            )));
        }
        if small.depths.is_empty() || large.depths.is_empty() {
            return Err(ExitsError::Invalid("both models need exit heads".into()));
        }
        let n = small.records.len();
        let mut rows = Vec::new();
        for &t in THRESHOLDS {
            let fs = first_exits(small, t, m);
            let fl = first_exits(large, t, m);
            for &frac in EARLY_FRACTIONS {
                let si = early_index(&small.depths, small.n_layers, frac);
                let li = early_index(&large.depths, large.n_layers, frac);
                let s_early: Vec<bool> = fs.iter().map(|f| f.is_some_and(|i| i <= si)).collect();
                let l_early: Vec<bool> = fl.iter().map(|f| f.is_some_and(|i| i <= li)).collect();
                let rest = s_early.iter().filter(|&&e| !e).count();
                let rescued = s_early
                    .iter()
                    .zip(&l_early)
                    .filter(|(&s, &l)| !s && l)
                    .count();
                let s_count = s_early.iter().filter(|&&e| e).count();
                rows.push(PairRow {
                    threshold: t,
                    early_fraction: frac,
                    small_early_depth: small.depths[si],
                    large_early_depth: large.depths[li],
                    small_early_share: s_count as f64 / n as f64,
                    large_early_share: l_early.iter().filter(|&&e| e).count() as f64 / n as f64,
                    large_early_share_of_rest: if rest == 0 {
                        f64::NAN
                    } else {
                        rescued as f64 / rest as f64
                    },
                    joint_early_share: (s_count + rescued) as f64 / n as f64,
                });
            }
        }
        Ok(Self {
            small: small.model.clone(),
            large: large.model.clone(),
            tokens: n,
            confidence: m,
            rows,
        })
    }

    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "### Complementarity: {} then {} ({} tokens, confidence {})\n",
            self.small,
            self.large,
            self.tokens,
            self.confidence.as_str()
        );
        let _ = writeln!(s, "| threshold | early = depth ≤ | small exits early | large exits early (alone) | large exits early, of the small's rest | joint early-exit share |");
        let _ = writeln!(s, "|---|---|---|---|---|---|");
        for r in &self.rows {
            let _ = writeln!(
                s,
                "| {} | {} / {} | {} | {} | {} | {} |",
                r.threshold,
                r.small_early_depth,
                r.large_early_depth,
                pct(r.small_early_share),
                pct(r.large_early_share),
                pct(r.large_early_share_of_rest),
                pct(r.joint_early_share)
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(agree: bool, p: f32) -> ExitObs {
        ExitObs {
            agree,
            max_prob: p,
            margin: p / 2.0,
            kl: 1.0 - p,
        }
    }

    fn data(name: &str, conf: &[[f32; 2]], agree: &[[bool; 2]]) -> StudyData {
        StudyData {
            model: name.into(),
            n_layers: 8,
            depths: vec![2, 4],
            corpus: "t".into(),
            split: "all".into(),
            documents: 1,
            records: conf
                .iter()
                .zip(agree)
                .enumerate()
                .map(|(i, (c, a))| TokenRecord {
                    token: i as u32,
                    final_argmax: 0,
                    tuned: vec![obs(a[0], c[0]), obs(a[1], c[1])],
                    lens: vec![obs(false, 0.1), obs(a[1], 0.2)],
                })
                .collect(),
            seconds: 0.0,
        }
    }

    #[test]
    fn tables_count_what_they_say() {
        let d = data(
            "a",
            &[[0.95, 0.99], [0.3, 0.85], [0.2, 0.4], [0.55, 0.7]],
            &[[true, true], [true, true], [false, true], [false, false]],
        );
        let r = StudyReport::from_records(&d, ConfidenceMeasure::MaxProb);
        assert_eq!(r.layers[0].agreement_tuned, 0.5);
        assert_eq!(r.layers[0].agreement_lens, 0.0);
        assert_eq!(r.layers[1].agreement_tuned, 0.75);
        // Threshold 0.5: depth 2 exits tokens 0 and 3; depth 4 adds token 1.
        let c = &r.cumulative[0];
        assert_eq!(c.threshold, 0.5);
        assert_eq!(c.exit_share_at_or_before, vec![0.5, 0.75]);
        assert_eq!(c.full_depth_share, 0.25);
        // exited: token 0 (agree at depth 2), 3 (disagree at 2), 1 (agree at 4)
        assert!((c.exited_agreement - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(c.mean_depth, (2.0 + 4.0 + 8.0 + 2.0) / 4.0);
        // Observation 2 at depth 2, threshold 0.5: tokens 1, 2 below; one agrees.
        let b = r
            .below
            .iter()
            .find(|b| b.depth == 2 && b.threshold == 0.5)
            .unwrap();
        assert_eq!((b.share_below, b.agreement_below), (0.5, 0.5));
        let bucket = r
            .buckets
            .iter()
            .find(|b| b.depth == 2 && b.lo == 0.9)
            .unwrap();
        assert_eq!((bucket.tokens, bucket.agreement), (1, 1.0));
        assert!(r.markdown().contains("| 2/8 | 50.0% | 0.0% |"));
    }

    #[test]
    fn complementarity_counts_the_rescued_tokens() {
        let small = data(
            "s",
            &[[0.9, 0.9], [0.1, 0.1], [0.1, 0.1], [0.1, 0.9]],
            &[[true; 2]; 4],
        );
        let large = data(
            "l",
            &[[0.1, 0.1], [0.9, 0.9], [0.1, 0.1], [0.1, 0.1]],
            &[[true; 2]; 4],
        );
        let p = PairReport::new(&small, &large, ConfidenceMeasure::MaxProb).unwrap();
        // early fraction 0.25 of 8 layers = depth 2 (index 0) for both.
        let r = &p.rows[0];
        assert_eq!((r.threshold, r.early_fraction), (0.5, 0.25));
        assert_eq!(r.small_early_share, 0.25);
        assert!((r.large_early_share_of_rest - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(r.joint_early_share, 0.5);
        // early fraction 0.5 = depth 4: the small model also exits token 3.
        assert_eq!(p.rows[1].small_early_share, 0.5);
        assert_eq!(p.rows[1].joint_early_share, 0.75);
        let other = data("x", &[[0.1, 0.1]], &[[true; 2]]);
        assert!(PairReport::new(&small, &other, ConfidenceMeasure::MaxProb).is_err());
    }
}
