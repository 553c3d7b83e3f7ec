//! Multiple-choice accuracy: each choice's summed log-likelihood after the item's context, the
//! argmax taken as the answer (lm-eval's `acc`), and the same per continuation byte
//! (`acc_norm`).

use serde::Serialize;
use switchyard_tokenizer::Tokenizer;

use super::interval::wilson95;
use super::loglik::{encode_pair, LogLikelihood};
use super::tasks::McItem;
use crate::Result;

/// One item's scores.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ItemScore {
    /// Summed log-likelihood of each choice, nats.
    pub loglikelihoods_nats: Vec<f64>,
    /// UTF-8 bytes of each choice's continuation (leading space included).
    pub choice_bytes: Vec<usize>,
    /// Argmax of the log-likelihood (the first on a tie, as numpy's argmax).
    pub pred: usize,
    /// Argmax of the log-likelihood per continuation byte.
    pub pred_norm: usize,
    pub gold: usize,
}

impl ItemScore {
    pub fn correct(&self) -> bool {
        self.pred == self.gold
    }

    pub fn correct_norm(&self) -> bool {
        self.pred_norm == self.gold
    }
}

/// Accuracy over a list of items, plain and length-normalised.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct McScore {
    pub n: usize,
    pub correct: usize,
    /// Fraction in `[0, 1]`.
    pub accuracy: f64,
    /// Wilson 95% interval of `accuracy`.
    pub ci95: (f64, f64),
    /// Whether each item was answered correctly, in input order (for paired comparisons).
    pub per_item: Vec<bool>,
    /// The same with the answer chosen per continuation byte (lm-eval's `acc_norm`).
    pub correct_norm: usize,
    pub accuracy_norm: f64,
    pub ci95_norm: (f64, f64),
    pub per_item_norm: Vec<bool>,
}

impl McScore {
    /// Totals of already scored items.
    pub fn from_items(items: &[ItemScore]) -> Self {
        let per_item: Vec<bool> = items.iter().map(ItemScore::correct).collect();
        let per_item_norm: Vec<bool> = items.iter().map(ItemScore::correct_norm).collect();
        let n = items.len();
        let correct = per_item.iter().filter(|&&c| c).count();
        let correct_norm = per_item_norm.iter().filter(|&&c| c).count();
        let frac = |k: usize| if n == 0 { 0.0 } else { k as f64 / n as f64 };
        Self {
            n,
            correct,
            accuracy: frac(correct),
            ci95: wilson95(correct, n),
            per_item,
            correct_norm,
            accuracy_norm: frac(correct_norm),
            ci95_norm: wilson95(correct_norm, n),
            per_item_norm,
        }
    }
}

/// Index of the largest value, the first of equals.
fn argmax(xs: impl IntoIterator<Item = f64>) -> usize {
    let mut best = (0, f64::NEG_INFINITY);
    for (i, x) in xs.into_iter().enumerate() {
        if x > best.1 {
            best = (i, x);
        }
    }
    best.0
}

/// Scores one item: every choice's log-likelihood after the item's context.
///
/// `acc_norm` divides by the continuation's UTF-8 bytes, the unit bits-per-byte uses
/// everywhere else here; lm-eval divides by Python's `len`, i.e. characters, the same number
/// for ASCII choices (all of ARC-Challenge and MMLU's letters, nearly all of HellaSwag).
pub fn score_item<L: LogLikelihood + ?Sized>(
    item: &McItem,
    ll: &mut L,
    tokenizer: &Tokenizer,
) -> Result<ItemScore> {
    let _span = tracing::debug_span!("score_item", id = %item.id).entered();
    let mut lls = Vec::with_capacity(item.choices.len());
    for choice in &item.choices {
        let (ctx, cont) = encode_pair(tokenizer, &item.context, choice)?;
        lls.push(ll.loglikelihood(&ctx, &cont)?);
    }
    let bytes: Vec<usize> = item.choices.iter().map(String::len).collect();
    let pred = argmax(lls.iter().copied());
    let pred_norm = argmax(lls.iter().zip(&bytes).map(|(&l, &b)| l / b.max(1) as f64));
    Ok(ItemScore {
        loglikelihoods_nats: lls,
        choice_bytes: bytes,
        pred,
        pred_norm,
        gold: item.gold,
    })
}

/// Scores every item (in order) and totals them.
pub fn score_mc<L: LogLikelihood + ?Sized>(
    items: &[McItem],
    ll: &mut L,
    tokenizer: &Tokenizer,
) -> Result<McScore> {
    let _span = tracing::info_span!("score_mc", items = items.len()).entered();
    let scored = items
        .iter()
        .map(|item| score_item(item, ll, tokenizer))
        .collect::<Result<Vec<_>>>()?;
    Ok(McScore::from_items(&scored))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_first_of_equals() {
        assert_eq!(argmax([1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax([-5.0, -1.0]), 1);
        assert_eq!(argmax([]), 0);
    }

    #[test]
    fn totals_of_scored_items() {
        let item = |pred, pred_norm| ItemScore {
            loglikelihoods_nats: vec![],
            choice_bytes: vec![],
            pred,
            pred_norm,
            gold: 1,
        };
        let s = McScore::from_items(&[item(1, 0), item(0, 1), item(1, 1), item(2, 2)]);
        assert_eq!((s.n, s.correct, s.correct_norm), (4, 2, 2));
        assert_eq!(s.per_item, [true, false, true, false]);
        assert_eq!(s.per_item_norm, [false, true, true, false]);
        assert_eq!((s.accuracy, s.ci95), (0.5, wilson95(2, 4)));
    }
}
