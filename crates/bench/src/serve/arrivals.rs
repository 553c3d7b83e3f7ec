//! When requests arrive: all at t = 0 (request rate `inf`) or gamma-distributed gaps with
//! shape = burstiness and mean 1/rate (burstiness 1 is a Poisson process), as vLLM's
//! `benchmark_serving` schedules them.

use std::str::FromStr;
use std::time::Duration;

use rand::SeedableRng;
use rand_distr::{Distribution, Gamma};

use crate::{BenchError, Result};

/// vLLM's default `--burstiness`: a Poisson process.
pub const DEFAULT_BURSTINESS: f64 = 1.0;

/// Requests per second, validated: `inf` or a positive finite number.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RequestRate {
    /// Every request is sent at t = 0.
    Infinite,
    PerSecond(f64),
}

impl FromStr for RequestRate {
    type Err = BenchError;

    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("inf") || s.eq_ignore_ascii_case("infinity") {
            return Ok(Self::Infinite);
        }
        match s.parse::<f64>() {
            Ok(r) if r.is_infinite() && r > 0.0 => Ok(Self::Infinite),
            Ok(r) if r.is_finite() && r > 0.0 => Ok(Self::PerSecond(r)),
            _ => Err(BenchError::Invalid(format!(
                "request rate {s:?}: expected a positive number of requests per second or inf"
            ))),
        }
    }
}

impl std::fmt::Display for RequestRate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Infinite => f.write_str("inf"),
            Self::PerSecond(r) => write!(f, "{r}"),
        }
    }
}

/// Written as vLLM writes it: a number, or the string `"inf"`.
impl serde::Serialize for RequestRate {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Self::Infinite => s.serialize_str("inf"),
            Self::PerSecond(r) => s.serialize_f64(*r),
        }
    }
}

/// An arrival process: rate and burstiness, both validated.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Arrivals {
    request_rate: RequestRate,
    burstiness: f64,
}

impl Arrivals {
    /// `burstiness` is the gamma shape: 1 is Poisson, below 1 burstier, above 1 more even.
    pub fn new(request_rate: RequestRate, burstiness: f64) -> Result<Self> {
        if !(burstiness.is_finite() && burstiness > 0.0) {
            return Err(BenchError::Invalid(format!(
                "burstiness {burstiness}: expected a positive number"
            )));
        }
        Ok(Self {
            request_rate,
            burstiness,
        })
    }

    pub fn request_rate(&self) -> RequestRate {
        self.request_rate
    }

    pub fn burstiness(&self) -> f64 {
        self.burstiness
    }

    /// When each of `n` requests arrives, from the start of the run: the first at 0, then
    /// cumulative gaps drawn from Gamma(shape = burstiness, scale = 1 / (rate * burstiness)),
    /// seeded (vLLM's `get_request` sleeps one gap after each request it yields).
    pub fn offsets(&self, n: usize, seed: u64) -> Vec<Duration> {
        let RequestRate::PerSecond(rate) = self.request_rate else {
            return vec![Duration::ZERO; n];
        };
        let scale = 1.0 / (rate * self.burstiness);
        // Both parameters are positive and finite, so Gamma::new cannot fail; fall back to
        // even spacing rather than panic all the same.
        let gamma = Gamma::new(self.burstiness, scale).ok();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut t = 0.0f64;
        (0..n)
            .map(|i| {
                if i > 0 {
                    t += gamma.as_ref().map_or(1.0 / rate, |g| g.sample(&mut rng));
                }
                Duration::from_secs_f64(t)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaps(a: &Arrivals, n: usize, seed: u64) -> Vec<f64> {
        let t = a.offsets(n, seed);
        t.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).collect()
    }

    fn mean_and_cv(xs: &[f64]) -> (f64, f64) {
        let n = xs.len() as f64;
        let mean = xs.iter().sum::<f64>() / n;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
        (mean, var.sqrt() / mean)
    }

    #[test]
    fn rates_parse_and_reject_nonsense() {
        assert_eq!(
            "inf".parse::<RequestRate>().ok(),
            Some(RequestRate::Infinite)
        );
        assert_eq!(
            "INF".parse::<RequestRate>().ok(),
            Some(RequestRate::Infinite)
        );
        assert_eq!(
            "2.5".parse::<RequestRate>().ok(),
            Some(RequestRate::PerSecond(2.5))
        );
        for bad in ["0", "-1", "nan", "fast", ""] {
            assert!(bad.parse::<RequestRate>().is_err(), "{bad}");
        }
        assert!(Arrivals::new(RequestRate::Infinite, 0.0).is_err());
        assert!(Arrivals::new(RequestRate::Infinite, f64::NAN).is_err());
        assert_eq!(
            serde_json::to_string(&RequestRate::Infinite)
                .ok()
                .as_deref(),
            Some("\"inf\"")
        );
    }

    #[test]
    fn infinite_rate_sends_everything_at_zero() {
        let a = Arrivals::new(RequestRate::Infinite, 1.0).expect("valid");
        assert_eq!(a.offsets(5, 0), vec![Duration::ZERO; 5]);
    }

    #[test]
    fn poisson_gaps_have_mean_one_over_rate_and_unit_cv() {
        let a = Arrivals::new(RequestRate::PerSecond(4.0), DEFAULT_BURSTINESS).expect("valid");
        let (mean, cv) = mean_and_cv(&gaps(&a, 20_001, 7));
        assert!((mean - 0.25).abs() < 0.25 * 0.03, "mean {mean}");
        assert!((cv - 1.0).abs() < 0.03, "cv {cv}");
        assert_eq!(a.offsets(3, 7)[0], Duration::ZERO);
        // Seeded: the same seed gives the same schedule, another seed another one.
        assert_eq!(a.offsets(50, 7), a.offsets(50, 7));
        assert_ne!(a.offsets(50, 7), a.offsets(50, 8));
    }

    #[test]
    fn burstiness_sets_the_gap_spread_at_the_same_mean() {
        // Gamma(k, 1/(rate k)): mean 1/rate, coefficient of variation 1/sqrt(k).
        for k in [0.25, 4.0] {
            let a = Arrivals::new(RequestRate::PerSecond(10.0), k).expect("valid");
            let (mean, cv) = mean_and_cv(&gaps(&a, 40_001, 1));
            assert!((mean - 0.1).abs() < 0.1 * 0.05, "k {k}: mean {mean}");
            let want = 1.0 / f64::sqrt(k);
            assert!(
                (cv - want).abs() < want * 0.05,
                "k {k}: cv {cv}, want {want}"
            );
        }
    }
}
