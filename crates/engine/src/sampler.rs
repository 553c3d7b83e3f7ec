//! Picks the next token from logits. The order follows vLLM's: `min_tokens` bans the end
//! tokens, then `logit_bias`, the repetition penalty (prompt and output) and OpenAI's presence
//! and frequency penalties (output only) change the logits; then greedy, or temperature,
//! min-p, top-k and top-p followed by a draw from a seeded generator.
//!
//! Reported log-probabilities (the sampled token's and the `top_logprobs` alternatives) are
//! the log-softmax of the logits after those changes and before temperature: the distribution
//! the request asked the model to sample from, at temperature 1.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use switchyard_grammar::{Constraint, GrammarError};
use switchyard_request::SamplingParams;

/// The chosen token and its log-probability (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
    /// The largest probability of the model's own distribution (the exit confidence).
    pub max_prob: f32,
    /// The `top_logprobs` most likely tokens and their log-probabilities, most likely first
    /// (ties by token id); empty unless the request asked for them.
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    /// Banned while fewer than `min_tokens` tokens exist: the model's end-of-generation
    /// tokens and the request's `stop_token_ids`.
    end_tokens: Vec<u32>,
    rng: StdRng,
    /// Time spent on this row's constraint beyond what an unconstrained row's draw costs.
    constraint_time: Duration,
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
            end_tokens: params.stop_token_ids.clone(),
            rng,
            constraint_time: Duration::ZERO,
        }
    }

    /// The model's end-of-generation tokens, banned (with `stop_token_ids`) until
    /// `min_tokens` tokens have been generated.
    pub fn with_end_tokens(mut self, end_of_generation: &[u32]) -> Self {
        self.end_tokens.extend_from_slice(end_of_generation);
        self.end_tokens.sort_unstable();
        self.end_tokens.dedup();
        self
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// `tokens`: the prompt and the tokens generated so far; the first `prompt_len` of them
    /// are the prompt (penalties other than the repetition penalty look at the output only).
    pub fn sample(&mut self, logits: &[f32], tokens: &[u32], prompt_len: usize) -> Sampled {
        let processed = self
            .params
            .processes_logits()
            .then(|| self.processed(logits, tokens, prompt_len));
        self.sample_from(logits, processed.as_deref())
    }

    /// [`Sampler::sample`] under a structured-output constraint: tokens it does not allow are
    /// masked out (after bias and penalties), and the sampled token advances it.
    ///
    /// Where the result cannot differ, the token is drawn before any mask and only checked
    /// against the constraint ([`Constraint::allows`], one token through the parser instead
    /// of the whole vocabulary); a mask is computed only when the check refuses it. That is
    /// exact for greedy rows (the unmasked argmax, when allowed, is the masked argmax,
    /// ties included) and for plain temperature sampling: a draw from p kept when it falls in
    /// the allowed set A, otherwise a draw from p restricted to A, yields p(t)/p(A), the masked
    /// distribution, which is rejection sampling's argument. Top-k, top-p and min-p cut the
    /// distribution after masking, so rows with them always mask. So do rows whose
    /// log-probabilities are read, which must be normalized over A. The second return says
    /// whether a mask was computed.
    pub fn sample_constrained(
        &mut self,
        logits: &[f32],
        tokens: &[u32],
        prompt_len: usize,
        constraint: &mut Constraint,
    ) -> Result<(Sampled, bool), GrammarError> {
        // The guide itself changes nothing before the mask: without bias or penalties the
        // drawn-first row samples the model's logits in place, as an unconstrained row does,
        // and a copy is made only for a mask.
        let adjusted = self
            .params
            .processes_logits()
            .then(|| self.processed(logits, tokens, prompt_len));
        // What an unconstrained row would not do is timed (`take_constraint_seconds`): the
        // check and the advance, and for a mask the copy, the mask and the draw over the
        // masked row. A row that masks without drawing first has that draw counted too,
        // though an unconstrained row would draw once as well: an upper bound there.
        let mut refused_at = None;
        if self.may_sample_before_mask() {
            let s = self.sample_from(logits, adjusted.as_deref());
            let checked = Instant::now();
            if constraint.allows(s.token)? {
                constraint.advance(s.token)?;
                self.constraint_time += checked.elapsed();
                return Ok((s, false));
            }
            refused_at = Some(checked);
        }
        let start = refused_at.unwrap_or_else(Instant::now);
        let mut l = adjusted.unwrap_or_else(|| logits.to_vec());
        constraint.mask(&mut l)?;
        let s = self.sample_from(logits, Some(&l));
        constraint.advance(s.token)?;
        self.constraint_time += start.elapsed();
        Ok((s, true))
    }

    /// Seconds spent on the constraint in [`Sampler::sample_constrained`] since the last
    /// call, beyond an unconstrained draw.
    pub fn take_constraint_seconds(&mut self) -> f64 {
        std::mem::take(&mut self.constraint_time).as_secs_f64()
    }

    /// See [`Sampler::sample_constrained`].
    pub(crate) fn may_sample_before_mask(&self) -> bool {
        let p = &self.params;
        !p.report_logprobs
            && p.top_logprobs == 0
            && (p.is_greedy() || (p.top_k == 0 && p.top_p >= 1.0 && p.min_p <= 0.0))
    }

    /// Samples from `processed` (the changed logits) or, when nothing changed them, `logits`.
    fn sample_from(&mut self, logits: &[f32], processed: Option<&[f32]>) -> Sampled {
        let _span = tracing::trace_span!("sample").entered();
        let l = processed.unwrap_or(logits);
        // One pass for the maximum (and the greedy token), one vectorized pass for the
        // normalizer.
        let (first, max) = argmax_max(l);
        let z = normalizer(l, max);
        let token = if self.params.is_greedy() {
            first
        } else {
            self.draw(l)
        };
        let log_z = z.ln();
        let max_prob = match processed {
            None => confidence(z),
            Some(_) => max_prob(logits),
        };
        Sampled {
            token: token as u32,
            logprob: ((l[token] - max) as f64 - log_z) as f32,
            max_prob,
            top: top_logprobs(l, self.params.top_logprobs, max, log_z),
        }
    }

    /// `logits` after the `min_tokens` ban, `logit_bias` and the penalties.
    fn processed(&self, logits: &[f32], tokens: &[u32], prompt_len: usize) -> Vec<f32> {
        let p = &self.params;
        let mut l = logits.to_vec();
        let output = tokens
            .get(prompt_len.min(tokens.len())..)
            .unwrap_or_default();
        if output.len() < p.min_tokens {
            for &t in &self.end_tokens {
                if let Some(x) = l.get_mut(t as usize) {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        for &(t, bias) in &p.logit_bias {
            if let Some(x) = l.get_mut(t as usize) {
                *x += bias;
            }
        }
        if p.repetition_penalty != 1.0 {
            let penalty = p.repetition_penalty;
            let mut seen = vec![false; l.len()];
            for &t in tokens {
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
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let mut counts: HashMap<u32, u32> = HashMap::new();
            for &t in output {
                *counts.entry(t).or_default() += 1;
            }
            for (t, c) in counts {
                if let Some(x) = l.get_mut(t as usize) {
                    *x -= p.presence_penalty + p.frequency_penalty * c as f32;
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
        if p.min_p > 0.0 {
            // Relative to the most likely token, whose unnormalized weight is exp(0) = 1.
            let floor = p.min_p as f64;
            let mut n = 0;
            for k in 0..idx.len() {
                if probs[k] >= floor {
                    idx[n] = idx[k];
                    probs[n] = probs[k];
                    n += 1;
                }
            }
            idx.truncate(n);
            probs.truncate(n);
        }
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

/// Index of the largest value (the first on ties) and the value (−∞ for an empty row). A NaN
/// in the first place is the answer; anywhere else a NaN never wins (`x > max` is false).
///
/// The maximum is taken over 16 independent lanes, which the compiler turns into vector
/// compares, and then the first index holding it is looked up: a scalar loop that carries the
/// index through every comparison runs about 8x slower over a 49,152-token vocabulary, and
/// the sampler runs this once per row of every step.
fn argmax_max(v: &[f32]) -> (usize, f32) {
    const LANES: usize = 16;
    let Some(&first) = v.first() else {
        return (0, f32::NEG_INFINITY);
    };
    if first.is_nan() {
        return (0, first);
    }
    let mut lanes = [first; LANES];
    let chunks = v.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            if x > *m {
                *m = x;
            }
        }
    }
    let mut max = first;
    for &x in lanes.iter().chain(rest) {
        if x > max {
            max = x;
        }
    }
    // `==` also finds a −0.0 for a 0.0 maximum; the value returned is the row's own.
    let best = v.iter().position(|&x| x == max).unwrap_or(0);
    (best, v[best])
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

/// The `n` largest entries of `l` as (token, log-probability), largest first (ties by id),
/// for the row's maximum `max` and log-normalizer `log_z`.
fn top_logprobs(l: &[f32], n: usize, max: f32, log_z: f64) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let by_logit = |a: &usize, b: &usize| l[*b].total_cmp(&l[*a]).then(a.cmp(b));
    let mut idx: Vec<usize> = (0..l.len()).collect();
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, by_logit);
        idx.truncate(n);
    }
    idx.sort_unstable_by(by_logit);
    idx.into_iter()
        .map(|i| (i as u32, ((l[i] - max) as f64 - log_z) as f32))
        .collect()
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

    /// The scalar rule `argmax_max` must keep: the first strictly larger value wins, the
    /// first element is always taken.
    fn argmax_reference(v: &[f32]) -> (usize, f32) {
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

    #[test]
    fn lane_argmax_equals_the_scalar_rule() {
        let mut rng = StdRng::seed_from_u64(7);
        let specials = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, 0.0, -0.0, 1.0];
        let mut checked = 0;
        for len in [0usize, 1, 2, 15, 16, 17, 33, 100, 49_152] {
            for _ in 0..40 {
                let mut v: Vec<f32> = (0..len)
                    .map(|_| (rng.random_range(-8i32..8) as f32) / 4.0)
                    .collect();
                for _ in 0..rng.random_range(0..4usize) {
                    if len > 0 {
                        let i = rng.random_range(0..len);
                        v[i] = specials[rng.random_range(0..specials.len())];
                    }
                }
                let (i, m) = argmax_max(&v);
                let (ri, rm) = argmax_reference(&v);
                assert_eq!(i, ri, "{v:?}");
                assert_eq!(m.to_bits(), rm.to_bits(), "{v:?}");
                checked += 1;
            }
        }
        assert_eq!(checked, 360);
        // Ties keep the first; a 0.0 maximum after a −0.0 is the −0.0's place and value.
        assert_eq!(argmax_max(&[-1.0, -0.0, 0.0]), (1, -0.0));
        assert_eq!(argmax_max(&[]).0, 0);
        assert!(argmax_max(&[f32::NAN, 3.0]).1.is_nan());
    }

    #[test]
    fn greedy_takes_argmax_and_reports_logprob() {
        let mut s = Sampler::new(&SamplingParams::greedy(1));
        let out = s.sample(&[0.0, 2.0, 1.0], &[], 0);
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
                .map(|_| s.sample(&logits, &[], 0).token)
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
            assert!(s.sample(&logits, &[], 0).token <= 1);
        }
        // softmax: 0.47, 0.43, 0.06, ... top_p 0.5 keeps two tokens, 0.4 keeps one.
        let mut s = Sampler::new(&params(|p| p.top_p = 0.4));
        for _ in 0..200 {
            assert_eq!(s.sample(&logits, &[], 0).token, 0);
        }
        let mut s = Sampler::new(&params(|p| p.top_p = 0.5));
        let mut seen = [0; 5];
        for _ in 0..400 {
            seen[s.sample(&logits, &[], 0).token as usize] += 1;
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
            c[s.sample(&logits, &[], 0).token as usize] += 1;
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
            c[s.sample(&logits, &[], 0).token as usize] += 1;
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
            assert_eq!(s.sample(&logits, &[], 0).token, 1);
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
            let l = s.processed(&logits, &[0, 1, 2, 3, 4], 0);
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
        assert_eq!(s.sample(&logits, &[0, 2], 0).token, 0);
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut s = Sampler::new(&SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::greedy(1)
        });
        // 4.0 / 2 = 2.0 < 3.0
        assert_eq!(s.sample(&[4.0, 3.0, -1.0], &[0], 0).token, 1);
        // negative logits are multiplied: -1 * 2 = -2, token 2 stays last
        assert_eq!(s.sample(&[-3.0, -4.0, -1.0], &[2], 0).token, 2);
        assert_eq!(s.sample(&[-3.0, -4.0, -1.0], &[2, 0], 0).token, 2);
    }

    /// OpenAI's definitions: presence subtracts once per generated token seen, frequency
    /// once per occurrence; prompt tokens are not counted.
    #[test]
    fn presence_and_frequency_penalties_follow_openai() {
        let logits = [1.0f32, 2.0, 3.0, 4.0];
        let s = Sampler::new(&params(|p| {
            p.presence_penalty = 0.5;
            p.frequency_penalty = 0.25;
        }));
        // Prompt [3, 3]; output [1, 2, 2].
        let l = s.processed(&logits, &[3, 3, 1, 2, 2], 2);
        assert_eq!(l, vec![1.0, 2.0 - 0.5 - 0.25, 3.0 - 0.5 - 0.5, 4.0]);
        // Negative values encourage repetition.
        let s = Sampler::new(&params(|p| p.presence_penalty = -1.0));
        assert_eq!(s.processed(&logits, &[0], 0), vec![2.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn logit_bias_adds_and_minus_100_bans() {
        let logits = [5.0f32, 1.0, 0.0];
        let mut s = Sampler::new(&params(|p| {
            p.temperature = 0.0;
            p.logit_bias = vec![(0, -100.0), (2, 0.5)];
        }));
        let out = s.sample(&logits, &[], 0);
        assert_eq!(out.token, 1);
        let l = s.processed(&logits, &[], 0);
        assert_eq!(l, vec![-95.0, 1.0, 0.5]);
        // The reported log-probability is under the biased distribution.
        let z = (l.iter().map(|&x| (x as f64 - 1.0).exp()).sum::<f64>()).ln();
        assert!((out.logprob as f64 - (0.0 - z)).abs() < 1e-6);
        // Sampled: the banned token never comes up.
        let mut s = Sampler::new(&params(|p| p.logit_bias = vec![(0, -100.0)]));
        assert!((0..500).all(|_| s.sample(&logits, &[], 0).token != 0));
    }

    #[test]
    fn min_tokens_bans_end_tokens_until_reached() {
        let logits = [0.0f32, 9.0, 1.0, 8.0];
        let mk = || {
            Sampler::new(&params(|p| {
                p.temperature = 0.0;
                p.min_tokens = 2;
                p.stop_token_ids = vec![3];
            }))
            .with_end_tokens(&[1])
        };
        // Prompt of one token; 0 and 1 generated: 1 and 3 are banned, 2 wins.
        assert_eq!(mk().sample(&logits, &[7], 1).token, 2);
        assert_eq!(mk().sample(&logits, &[7, 2], 1).token, 2);
        assert_eq!(mk().sample(&logits, &[7, 2, 2], 1).token, 1);
    }

    #[test]
    fn min_p_keeps_tokens_near_the_best() {
        // Probabilities 0.5, 0.3, 0.2 relative to the best: 1, 0.6, 0.4.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let mut s = Sampler::new(&params(|p| p.min_p = 0.5));
        let mut seen = [0; 3];
        for _ in 0..400 {
            seen[s.sample(&logits, &[], 0).token as usize] += 1;
        }
        assert!(seen[0] > 0 && seen[1] > 0 && seen[2] == 0, "{seen:?}");
    }

    #[test]
    fn top_logprobs_are_the_log_softmax_in_order() {
        let logits: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919) % 1009) as f32 / 97.0)
            .collect();
        let mut s = Sampler::new(&params(|p| p.top_logprobs = 5));
        let out = s.sample(&logits, &[], 0);
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let z: f64 = logits.iter().map(|&x| (x as f64 - m).exp()).sum();
        let lsm = |i: usize| logits[i] as f64 - m - z.ln();
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|a, b| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b)));
        assert_eq!(out.top.len(), 5);
        for (k, &(t, lp)) in out.top.iter().enumerate() {
            assert_eq!(t as usize, order[k]);
            assert!((lp as f64 - lsm(order[k])).abs() < 1e-5, "{k}: {lp}");
        }
        assert!((out.logprob as f64 - lsm(out.token as usize)).abs() < 1e-5);
    }
}
