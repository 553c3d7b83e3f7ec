//! Confidence at an exit (max softmax probability, EE-LLM's test; top-1/top-2 margin) and the
//! distances between an exit's distribution and the final layer's.

use serde::{Deserialize, Serialize};

/// How confident an exit is in its top token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ConfidenceMeasure {
    /// The top token's softmax probability (EE-LLM's exit test).
    #[default]
    MaxProb,
    /// Top-1 minus top-2 softmax probability.
    Margin,
}

impl ConfidenceMeasure {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "max-prob" | "maxprob" | "max_prob" => Some(Self::MaxProb),
            "margin" => Some(Self::Margin),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::MaxProb => "max-prob",
            Self::Margin => "margin",
        }
    }

    pub fn of(self, s: &TokenStats) -> f32 {
        match self {
            Self::MaxProb => s.max_prob,
            Self::Margin => s.margin,
        }
    }
}

/// The top of one softmax distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenStats {
    pub argmax: u32,
    pub max_prob: f32,
    /// Top-1 minus top-2 probability.
    pub margin: f32,
}

impl TokenStats {
    pub fn confidence(&self, m: ConfidenceMeasure) -> f32 {
        m.of(self)
    }
}

/// Whether an exit with `confidence` passes `threshold`. Strict, so that threshold 1.0 never
/// exits (a probability cannot exceed 1) and threshold 0 always does (a softmax probability is
/// positive).
pub fn passes(confidence: f32, threshold: f32) -> bool {
    confidence > threshold
}

/// Argmax (first on ties), max probability and margin of `softmax(logits)`.
pub fn token_stats(logits: &[f32]) -> TokenStats {
    let (mut i1, mut l1, mut l2) = (0usize, f32::NEG_INFINITY, f32::NEG_INFINITY);
    for (i, &l) in logits.iter().enumerate() {
        if l > l1 {
            l2 = l1;
            l1 = l;
            i1 = i;
        } else if l > l2 {
            l2 = l;
        }
    }
    let z: f64 = logits.iter().map(|&l| ((l - l1) as f64).exp()).sum();
    let p1 = 1.0 / z;
    let p2 = if l2.is_finite() {
        ((l2 - l1) as f64).exp() / z
    } else {
        0.0
    };
    TokenStats {
        argmax: i1 as u32,
        max_prob: p1 as f32,
        margin: (p1 - p2) as f32,
    }
}

/// `ln softmax(logits)`, in f64.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits
        .iter()
        .map(|&l| (l as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    logits.iter().map(|&l| l as f64 - lse).collect()
}

/// `-ln softmax(logits)[target]`.
pub fn nll(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits
        .iter()
        .map(|&l| (l as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    logits
        .get(target as usize)
        .map_or(f64::INFINITY, |&l| lse - l as f64)
}

/// `KL(p || q)` in nats, with `p` given as log-probabilities (the final layer's, computed once
/// per token) and `q` as logits (an exit's).
pub fn kl_from_log_p(log_p: &[f64], q_logits: &[f32]) -> f64 {
    let log_q = log_softmax(q_logits);
    log_p
        .iter()
        .zip(&log_q)
        .map(|(&lp, &lq)| {
            if lp > -700.0 {
                lp.exp() * (lp - lq)
            } else {
                0.0
            }
        })
        .sum::<f64>()
        .max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_of_a_known_distribution() {
        // softmax([ln 0.5, ln 0.3, ln 0.2]) = [0.5, 0.3, 0.2]
        let l = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let s = token_stats(&l);
        assert_eq!(s.argmax, 0);
        assert!((s.max_prob - 0.5).abs() < 1e-6);
        assert!((s.margin - 0.2).abs() < 1e-6);
        assert_eq!(ConfidenceMeasure::Margin.of(&s), s.margin);
        let s = token_stats(&[1.0, 3.0, 3.0]);
        assert_eq!(s.argmax, 1, "first on ties");
        assert!(s.margin.abs() < 1e-7);
        assert!((nll(&l, 1) - -(0.3f64.ln())).abs() < 1e-6);
    }

    #[test]
    fn kl_is_zero_for_equal_and_matches_the_formula() {
        let p = [0.1f32, 2.0, -1.0, 0.5];
        let lp = log_softmax(&p);
        assert!(kl_from_log_p(&lp, &p).abs() < 1e-12);
        let q = [1.0f32, 0.0, 0.0, 0.0];
        let lq = log_softmax(&q);
        let want: f64 = lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum();
        assert!((kl_from_log_p(&lp, &q) - want).abs() < 1e-12);
        // Shifting logits changes nothing.
        let q2: Vec<f32> = q.iter().map(|x| x + 7.0).collect();
        assert!((kl_from_log_p(&lp, &q2) - want).abs() < 1e-6);
    }

    #[test]
    fn thresholds_zero_and_one_are_always_and_never() {
        let s = token_stats(&[100.0, -100.0]);
        assert_eq!(s.max_prob, 1.0);
        assert!(!passes(s.max_prob, 1.0));
        let s = token_stats(&[0.0; 8]);
        assert!(passes(s.max_prob, 0.0));
        assert_eq!(
            ConfidenceMeasure::parse("margin"),
            Some(ConfidenceMeasure::Margin)
        );
        assert_eq!(ConfidenceMeasure::parse("x"), None);
    }
}
