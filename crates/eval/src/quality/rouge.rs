//! ROUGE-L (Lin, 2004) between two texts, as Google's `rouge-score` package computes its
//! `rougeL` without stemming: the longest common subsequence of the two token lists, precision
//! LCS/|candidate|, recall LCS/|reference|, and their harmonic mean (F with β = 1).
//!
//! Written here rather than taken from a crate: the one crate that reproduces `rouge-score`
//! (`rougers` 0.2) needs Rust 1.88, above this workspace's declared 1.85, and brings ICU's
//! case-mapping and property tables for its Unicode tokenizers; sentence-level ROUGE-L with
//! the `rouge-score` tokenizer is the few lines below.

use serde::Serialize;

/// Precision, recall and F1 of one ROUGE-L comparison, each in `[0, 1]`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RougeScore {
    pub precision: f64,
    pub recall: f64,
    pub fmeasure: f64,
}

/// `rouge-score`'s tokenizer: lowercase, every character outside `[a-z0-9]` separates tokens.
/// Text in other scripts yields no tokens, exactly as in `rouge-score`.
pub fn rouge_tokens(text: &str) -> Vec<String> {
    text.to_lowercase()
        .split(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit()))
        .filter(|t| !t.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Length of the longest common subsequence, in O(|a|·|b|) time and O(|b|) memory.
fn lcs_len<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    let mut prev = vec![0usize; b.len() + 1];
    let mut cur = vec![0usize; b.len() + 1];
    for x in a {
        for (j, y) in b.iter().enumerate() {
            cur[j + 1] = if x == y {
                prev[j] + 1
            } else {
                prev[j + 1].max(cur[j])
            };
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

/// ROUGE-L precision, recall and F1 of `candidate` against `reference`. Either text without
/// tokens scores 0 on all three (as `rouge-score` does).
pub fn rouge_l_score(candidate: &str, reference: &str) -> RougeScore {
    let c = rouge_tokens(candidate);
    let r = rouge_tokens(reference);
    if c.is_empty() || r.is_empty() {
        return RougeScore {
            precision: 0.0,
            recall: 0.0,
            fmeasure: 0.0,
        };
    }
    let lcs = lcs_len(&c, &r) as f64;
    let precision = lcs / c.len() as f64;
    let recall = lcs / r.len() as f64;
    let fmeasure = if precision + recall > 0.0 {
        2.0 * precision * recall / (precision + recall)
    } else {
        0.0
    };
    RougeScore {
        precision,
        recall,
        fmeasure,
    }
}

/// ROUGE-L F-measure of `candidate` against `reference`.
pub fn rouge_l(candidate: &str, reference: &str) -> f64 {
    rouge_l_score(candidate, reference).fmeasure
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_lowercase_alphanumeric_runs() {
        assert_eq!(
            rouge_tokens("The cat's mat, 2nd-hand!  Café"),
            ["the", "cat", "s", "mat", "2nd", "hand", "caf"]
        );
        assert!(rouge_tokens(" ,.; ").is_empty());
    }

    #[test]
    fn lcs_of_small_lists() {
        assert_eq!(lcs_len(&[1, 2, 3, 4], &[2, 4, 3]), 2);
        assert_eq!(lcs_len::<u8>(&[], &[1]), 0);
        assert_eq!(lcs_len(b"ABCBDAB", b"BDCABA"), 4);
    }
}
