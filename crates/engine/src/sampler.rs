//! Picks the next token from logits: repetition penalty, then greedy, or temperature, top-k
//! and top-p followed by a draw from a seeded generator.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use switchyard_request::SamplingParams;

/// The chosen token and its log-probability under the model's own (unmodified) distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
    /// The largest probability of that distribution (the exit confidence).
    pub max_prob: f32,
}

#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    /// `params` must be valid ([`SamplingParams::validate`]).
    pub fn new(params: &SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Self {
            params: params.clone(),
            rng,
        }
    }

    /// `history`: prompt and generated tokens so far (for the repetition penalty).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Sampled {
        let _span = tracing::trace_span!("sample").entered();
        // One pass for the maximum (and the greedy token), one vectorized pass for the
        // normalizer; the logits are copied only when a penalty changes them.
        let (first, max) = argmax_max(logits);
        let z = normalizer(logits, max);
        let token = match (
            self.params.is_greedy(),
            self.params.repetition_penalty == 1.0,
        ) {
            (true, true) => first,
            (true, false) => argmax(&self.penalized(logits, history)),
            (false, _) => {
                let l = self.penalized(logits, history);
                self.draw(&l)
            }
        };
        Sampled {
            token: token as u32,
            logprob: ((logits[token] - max) as f64 - z.ln()) as f32,
            max_prob: confidence(z),
        }
    }

    /// `logits` with the repetition penalty applied to every token in `history`.
    fn penalized(&self, logits: &[f32], history: &[u32]) -> Vec<f32> {
        let penalty = self.params.repetition_penalty;
        let mut l = logits.to_vec();
        if penalty != 1.0 {
            let mut seen = vec![false; l.len()];
            for &t in history {
                let i = t as usize;
                if i < l.len() && !seen[i] {
                    seen[i] = true;
                    l[i] = if l[i] > 0.0 {
                        l[i] / penalty
                    } else {
                        l[i] * penalty
                    };
                }
            }
        }
        l
    }

    /// The candidates a draw picks from (token ids) and their probabilities, after
    /// temperature, top-k and top-p.
    fn distribution(&self, l: &[f32]) -> (Vec<usize>, Vec<f64>) {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        // Candidates in descending logit order when a cut is needed; all tokens otherwise.
        let mut idx: Vec<usize> = (0..l.len()).collect();
        let by_logit = |a: &usize, b: &usize| l[*b].total_cmp(&l[*a]).then(a.cmp(b));
        if p.top_k > 0 && p.top_k < idx.len() {
            idx.select_nth_unstable_by(p.top_k - 1, by_logit);
            idx.truncate(p.top_k);
        }
        if p.top_p < 1.0 || p.top_k > 0 {
            idx.sort_unstable_by(by_logit);
        }
        let max = idx.iter().map(|&i| l[i]).fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<f64> = idx
            .iter()
            .map(|&i| (((l[i] - max) * inv_t) as f64).exp())
            .collect();
        let z: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= z);
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            let mut keep = probs.len();
            for (n, x) in probs.iter().enumerate() {
                cum += x;
                if cum >= p.top_p as f64 {
                    keep = n + 1;
                    break;
                }
            }
            probs.truncate(keep);
            idx.truncate(keep);
        }
        (idx, probs)
    }

    fn draw(&mut self, l: &[f32]) -> usize {
        let (idx, probs) = self.distribution(l);
        let total: f64 = probs.iter().sum();
        let mut u = self.rng.random::<f64>() * total;
        for (n, x) in probs.iter().enumerate() {
            u -= x;
            if u <= 0.0 {
                return idx[n];
            }
        }
        idx[probs.len() - 1]
    }
}

/// Index of the largest value (the first on ties).
pub fn argmax(v: &[f32]) -> usize {
    argmax_max(v).0
}

/// Index of the largest value (the first on ties) and the value (−∞ for an empty row).
fn argmax_max(v: &[f32]) -> (usize, f32) {
    let mut best = 0;
    let mut max = f32::NEG_INFINITY;
    for (i, &x) in v.iter().enumerate() {
        if x > max || i == 0 {
            best = i;
            max = x;
        }
    }
    (best, max)
}

/// Σ exp(l − max) over the row, for its maximum `max`: through the kernels' vectorized exp
/// when `max` is finite (relative error below 3e-7 per term, summed in f64), else term by term.
fn normalizer(logits: &[f32], max: f32) -> f64 {
    if max.is_finite() {
        switchyard_kernels::fastmath::sum_exp(logits, max)
    } else {
        logits.iter().map(|&x| ((x - max) as f64).exp()).sum()
    }
}

/// The largest probability of a row whose normalizer is `z`.
fn confidence(z: f64) -> f32 {
    if z > 0.0 && z.is_finite() {
        (1.0 / z) as f32
    } else {
        0.0
    }
}

/// `log softmax(logits)[i]`, the normalizer summed in f64.
pub fn log_softmax_at(logits: &[f32], i: usize) -> f32 {
    let (_, max) = argmax_max(logits);
    let z = normalizer(logits, max);
    ((logits[i] - max) as f64 - z.ln()) as f32
}

/// The largest softmax probability of `logits`.
pub fn max_prob(logits: &[f32]) -> f32 {
    let (_, max) = argmax_max(logits);
    confidence(normalizer(logits, max))
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_request::{MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, SAMPLING_EPS};

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams {
            temperature: 1.0,
            seed: Some(42),
            ..SamplingParams::default()
        };
        f(&mut p);
        p
    }

    #[test]
    fn greedy_takes_argmax_and_reports_logprob() {
        let mut s = Sampler::new(&SamplingParams::greedy(1));
        let out = s.sample(&[0.0, 2.0, 1.0], &[]);
        assert_eq!(out.token, 1);
        let z = (0f64.exp() + 2f64.exp() + 1f64.exp()).ln();
        assert!((out.logprob as f64 - (2.0 - z)).abs() < 1e-6);
    }

    #[test]
    fn same_seed_same_draws() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let draws = |seed| {
            let mut s = Sampler::new(&params(|p| p.seed = Some(seed)));
            (0..40)
                .map(|_| s.sample(&logits, &[]).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(draws(7), draws(7));
        assert_ne!(draws(7), draws(8));
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [3.0f32, 2.9, 1.0, 0.5, -1.0];
        let mut s = Sampler::new(&params(|p| p.top_k = 2));
        for _ in 0..200 {
            assert!(s.sample(&logits, &[]).token <= 1);
        }
        // softmax: 0.47, 0.43, 0.06, ... top_p 0.5 keeps two tokens, 0.4 keeps one.
        let mut s = Sampler::new(&params(|p| p.top_p = 0.4));
        for _ in 0..200 {
            assert_eq!(s.sample(&logits, &[]).token, 0);
        }
        let mut s = Sampler::new(&params(|p| p.top_p = 0.5));
        let mut seen = [0; 5];
        for _ in 0..400 {
            seen[s.sample(&logits, &[]).token as usize] += 1;
        }
        assert!(
            seen[0] > 0 && seen[1] > 0 && seen[2..].iter().all(|&c| c == 0),
            "{seen:?}"
        );
    }

    #[test]
    fn draws_follow_the_distribution() {
        // p = softmax([ln 1, ln 2, ln 7]) = [0.1, 0.2, 0.7]
        let logits = [0f32, 2f32.ln(), 7f32.ln()];
        let mut s = Sampler::new(&params(|_| {}));
        let n = 20_000;
        let mut c = [0usize; 3];
        for _ in 0..n {
            c[s.sample(&logits, &[]).token as usize] += 1;
        }
        for (i, want) in [0.1, 0.2, 0.7].iter().enumerate() {
            let got = c[i] as f64 / n as f64;
            // 5 standard errors of a binomial proportion.
            let se = (want * (1.0 - want) / n as f64).sqrt();
            assert!((got - want).abs() < 5.0 * se, "token {i}: {got} vs {want}");
        }
        // Temperature 0.5 squares the odds: [1, 4, 49] / 54.
        let mut s = Sampler::new(&params(|p| p.temperature = 0.5));
        let mut c = [0usize; 3];
        for _ in 0..n {
            c[s.sample(&logits, &[]).token as usize] += 1;
        }
        let want = 49.0 / 54.0;
        let got = c[2] as f64 / n as f64;
        assert!((got - want).abs() < 5.0 * (want * (1.0 - want) / n as f64).sqrt());
    }

    /// 1 / 1e-40 is infinite in f32: without the epsilon every logit became NaN and every
    /// draw returned the last token id.
    #[test]
    fn a_temperature_below_the_epsilon_samples_the_greedy_token() {
        let logits = [0.5f32, 3.0, 1.0, -2.0];
        let mut s = Sampler::new(&params(|p| p.temperature = 1e-40));
        for _ in 0..50 {
            assert_eq!(s.sample(&logits, &[]).token, 1);
        }
    }

    /// At the smallest temperature and the strongest penalties allowed, the logits a draw
    /// uses stay finite and its probabilities sum to 1.
    #[test]
    fn the_bounds_keep_logits_finite() {
        let logits = [80.0f32, -75.0, 79.5, 0.0, -1e4];
        for penalty in [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY] {
            let p = params(|p| {
                p.temperature = SAMPLING_EPS;
                p.repetition_penalty = penalty;
            });
            p.validate().expect("the bounds are valid");
            let s = Sampler::new(&p);
            let l = s.penalized(&logits, &[0, 1, 2, 3, 4]);
            assert!(l.iter().all(|x| x.is_finite()), "{penalty}: {l:?}");
            let (_, probs) = s.distribution(&l);
            assert!(probs.iter().all(|x| x.is_finite()), "{penalty}: {probs:?}");
            assert!((probs.iter().sum::<f64>() - 1.0).abs() < 1e-9, "{probs:?}");
        }
        // 80 / 0.01 = 8000 beats 79.5 / 0.01 = 7950: the draw is the greedy token.
        let mut s = Sampler::new(&params(|p| {
            p.temperature = SAMPLING_EPS;
            p.repetition_penalty = MIN_REPETITION_PENALTY;
        }));
        assert_eq!(s.sample(&logits, &[0, 2]).token, 0);
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut s = Sampler::new(&SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::greedy(1)
        });
        // 4.0 / 2 = 2.0 < 3.0
        assert_eq!(s.sample(&[4.0, 3.0, -1.0], &[0]).token, 1);
        // negative logits are multiplied: -1 * 2 = -2, token 2 stays last
        assert_eq!(s.sample(&[-3.0, -4.0, -1.0], &[2]).token, 2);
        assert_eq!(s.sample(&[-3.0, -4.0, -1.0], &[2, 0]).token, 2);
    }
}
