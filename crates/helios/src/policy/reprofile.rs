//! When to re-profile: every RI requests (HELIOS step 4), and earlier when the drift detector
//! sees the traffic's exit distribution move away from the one the last profile measured.
//!
//! HELIOS has no drift detector; its own analysis names the gap (with a large RI, drift goes
//! unnoticed until the counter fires, and a workload that became *easier* never makes it fire
//! at all, so the model keeps running layers it no longer needs). The detector compares the
//! exit distribution of the last `window` served tokens with the profile's, over the exits
//! the server checks while serving at its depth plus one bin for tokens that breached there:
//!
//! * total-variation distance `½ Σ |p - q|` above `tv_bound`, or
//! * breach rate (the last bin) differing from the profile's by more than
//!   `breach_rate_bound`, which catches a shift confined to that bin earlier than the TV
//!   bound when many bins are checked.
//!
//! With a full window of 256 tokens the standard error of a rate near 0.3 is about 0.03, so
//! the default bounds (0.2 and 0.15) sit at five standard errors or more: noise alone does
//! not trigger them.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::pht::ExitHistogram;
use crate::{HeliosError, Result};

/// Tokens the drift detector compares (ours; see the module doc for the sizing).
pub const DRIFT_WINDOW: usize = 256;
/// Total-variation distance that counts as drift (ours).
pub const DRIFT_TV_BOUND: f64 = 0.2;
/// Change of the breach rate that counts as drift (ours).
pub const DRIFT_BREACH_RATE_BOUND: f64 = 0.15;

/// Counts served requests and says when RI of them have passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReprofileClock {
    interval: usize,
    served: usize,
}

impl ReprofileClock {
    pub fn new(interval: usize) -> Self {
        Self {
            interval: interval.max(1),
            served: 0,
        }
    }

    /// Counts one finished request (evaluation requests are not counted: they are the
    /// profile); `true` when a re-profile is due.
    pub fn on_request_done(&mut self) -> bool {
        self.served += 1;
        self.is_due()
    }

    pub fn is_due(&self) -> bool {
        self.served >= self.interval
    }

    /// Requests left before the next re-profile.
    pub fn remaining(&self) -> usize {
        self.interval.saturating_sub(self.served)
    }

    /// Restarts the count (a profile just finished, periodic or early).
    pub fn reset(&mut self) {
        self.served = 0;
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DriftConfig {
    pub window: usize,
    pub tv_bound: f64,
    pub breach_rate_bound: f64,
}

impl Default for DriftConfig {
    fn default() -> Self {
        Self {
            window: DRIFT_WINDOW,
            tv_bound: DRIFT_TV_BOUND,
            breach_rate_bound: DRIFT_BREACH_RATE_BOUND,
        }
    }
}

impl DriftConfig {
    pub fn validate(&self) -> Result<()> {
        if self.window == 0 {
            return Err(HeliosError::Config(
                "drift.window must be at least 1".into(),
            ));
        }
        for (name, v) in [
            ("drift.tv_bound", self.tv_bound),
            ("drift.breach_rate_bound", self.breach_rate_bound),
        ] {
            if !(v > 0.0 && v <= 1.0) {
                return Err(HeliosError::Config(format!(
                    "{name} must be in (0, 1], got {v}"
                )));
            }
        }
        Ok(())
    }
}

/// Why the detector fired.
#[derive(Debug, Clone, PartialEq)]
pub enum Drift {
    /// The exit distribution moved by this total-variation distance.
    ExitDistribution { tv: f64 },
    /// The share of breaching tokens moved from the profile's to the observed.
    BreachRate { reference: f64, observed: f64 },
}

/// Compares the exit distribution of recent tokens with a profile's.
#[derive(Debug, Clone, PartialEq)]
pub struct DriftDetector {
    cfg: DriftConfig,
    /// Exit depths checked while serving, increasing; bin `checked.len()` is the breach bin.
    checked: Vec<usize>,
    reference: Vec<f64>,
    recent: VecDeque<usize>,
    counts: Vec<u64>,
}

impl DriftDetector {
    /// A detector for serving with exits checked at `checked` (increasing; the last is the
    /// serving depth), against `profile`, the exit histogram of the last profile. A profile
    /// bin between two checked depths counts toward the deeper one (a token that could exit
    /// at 5 exits at the check at 6); bins beyond the last check are breaches.
    pub fn new(cfg: DriftConfig, profile: &ExitHistogram, checked: &[usize]) -> Result<Self> {
        cfg.validate()?;
        if checked.is_empty() || checked.windows(2).any(|w| w[0] >= w[1]) {
            return Err(HeliosError::Config(format!(
                "the checked exits must be a non-empty increasing list, got {checked:?}"
            )));
        }
        let total = profile.total();
        if total == 0 {
            return Err(HeliosError::Config(
                "the drift reference is an empty exit histogram".into(),
            ));
        }
        let mut counts = vec![0u64; checked.len() + 1];
        for &(d, c) in profile.bins() {
            counts[checked.partition_point(|&x| x < d)] += c;
        }
        let reference = counts.iter().map(|&c| c as f64 / total as f64).collect();
        Ok(Self {
            counts: vec![0; checked.len() + 1],
            cfg,
            checked: checked.to_vec(),
            reference,
            recent: VecDeque::new(),
        })
    }

    /// Records one served token: the checked depth it exited at, or `None` for a breach
    /// (no check passed). `Some` when the window is full and the distribution has drifted.
    pub fn observe(&mut self, exit: Option<usize>) -> Option<Drift> {
        let bin = match exit {
            Some(d) => self.checked.partition_point(|&x| x < d),
            None => self.checked.len(),
        };
        if self.recent.len() == self.cfg.window {
            if let Some(old) = self.recent.pop_front() {
                self.counts[old] -= 1;
            }
        }
        self.recent.push_back(bin);
        self.counts[bin] += 1;
        if self.recent.len() < self.cfg.window {
            return None;
        }
        self.check()
    }

    /// The observed distribution of the window.
    pub fn observed(&self) -> Vec<f64> {
        let n = self.recent.len().max(1) as f64;
        self.counts.iter().map(|&c| c as f64 / n).collect()
    }

    pub fn reference(&self) -> &[f64] {
        &self.reference
    }

    /// Total-variation distance between the window and the reference.
    pub fn tv_distance(&self) -> f64 {
        0.5 * self
            .observed()
            .iter()
            .zip(&self.reference)
            .map(|(p, q)| (p - q).abs())
            .sum::<f64>()
    }

    fn check(&self) -> Option<Drift> {
        let last = self.reference.len() - 1;
        let (reference, observed) = (self.reference[last], self.observed()[last]);
        if (observed - reference).abs() > self.cfg.breach_rate_bound {
            return Some(Drift::BreachRate {
                reference,
                observed,
            });
        }
        let tv = self.tv_distance();
        (tv > self.cfg.tv_bound).then_some(Drift::ExitDistribution { tv })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ri_counts_served_requests() {
        let mut c = ReprofileClock::new(150);
        for i in 1..150 {
            assert!(!c.on_request_done(), "request {i}");
        }
        assert_eq!(c.remaining(), 1);
        assert!(c.on_request_done());
        assert!(c.is_due());
        assert!(c.on_request_done(), "stays due until reset");
        c.reset();
        assert_eq!((c.is_due(), c.remaining()), (false, 150));
    }

    fn cfg(window: usize) -> DriftConfig {
        DriftConfig {
            window,
            ..DriftConfig::default()
        }
    }

    /// Profile: of 100 tokens, 50 exit at 3, 20 at 6, 30 deeper (9, 12): serving at 6 with
    /// checks at 3 and 6 gives the reference [0.5, 0.2, 0.3].
    fn profile() -> ExitHistogram {
        ExitHistogram::from_counts([(3, 50), (6, 20), (9, 10), (12, 20)])
    }

    fn feed(d: &mut DriftDetector, pattern: &[Option<usize>], n: usize) -> Option<Drift> {
        let mut last = None;
        for i in 0..n {
            last = d.observe(pattern[i % pattern.len()]);
            if last.is_some() {
                return last;
            }
        }
        last
    }

    #[test]
    fn reference_bins_follow_the_checked_exits() {
        let d = DriftDetector::new(cfg(10), &profile(), &[3, 6]).unwrap();
        assert_eq!(d.reference(), &[0.5, 0.2, 0.3]);
        // Checking only the serving depth: 70% pass, 30% breach.
        let d = DriftDetector::new(cfg(10), &profile(), &[6]).unwrap();
        assert_eq!(d.reference(), &[0.7, 0.3]);
        // A profile bin between checks counts toward the deeper check.
        let d = DriftDetector::new(
            cfg(10),
            &ExitHistogram::from_counts([(2, 1), (5, 1)]),
            &[3, 6],
        )
        .unwrap();
        assert_eq!(d.reference(), &[0.5, 0.5, 0.0]);
        assert!(DriftDetector::new(cfg(10), &ExitHistogram::new(), &[6]).is_err());
        assert!(DriftDetector::new(cfg(10), &profile(), &[6, 3]).is_err());
    }

    #[test]
    fn traffic_like_the_profile_does_not_drift() {
        let mut d = DriftDetector::new(cfg(100), &profile(), &[3, 6]).unwrap();
        // Exactly the reference mix, 5 exits at 3, 2 at 6, 3 breaches per 10 tokens.
        let same = [
            Some(3),
            Some(6),
            None,
            Some(3),
            Some(3),
            None,
            Some(6),
            Some(3),
            None,
            Some(3),
        ];
        assert_eq!(feed(&mut d, &same, 10_000), None);
        assert!(d.tv_distance() < 1e-12);
    }

    #[test]
    fn harder_traffic_drifts_on_the_breach_rate() {
        let mut d = DriftDetector::new(cfg(100), &profile(), &[3, 6]).unwrap();
        // 50% breaches instead of 30%: not enough for the CBC (more than 50 of 100), a
        // 0.2 shift for the detector.
        let harder = [
            Some(3),
            None,
            Some(3),
            None,
            Some(6),
            None,
            Some(3),
            None,
            Some(3),
            None,
        ];
        match feed(&mut d, &harder, 100) {
            Some(Drift::BreachRate {
                reference,
                observed,
            }) => {
                assert!((reference - 0.3).abs() < 1e-12);
                assert!((observed - 0.5).abs() < 1e-12);
            }
            other => panic!("expected a breach-rate drift, got {other:?}"),
        }
    }

    #[test]
    fn easier_traffic_drifts_on_the_distribution() {
        let mut d = DriftDetector::new(cfg(100), &profile(), &[3, 6]).unwrap();
        // 80% at 3, none at 6, 20% breaches: the breach rate moves by 0.1 (below 0.15), the
        // distribution by ½ (|0.8 - 0.5| + |0 - 0.2| + |0.2 - 0.3|) = 0.3.
        let easier = [
            Some(3),
            Some(3),
            Some(3),
            Some(3),
            None,
            Some(3),
            Some(3),
            Some(3),
            Some(3),
            None,
        ];
        match feed(&mut d, &easier, 100) {
            Some(Drift::ExitDistribution { tv }) => assert!((tv - 0.3).abs() < 1e-12, "{tv}"),
            other => panic!("expected a distribution drift, got {other:?}"),
        }
    }

    #[test]
    fn nothing_fires_before_the_window_is_full() {
        let mut d = DriftDetector::new(cfg(100), &profile(), &[3, 6]).unwrap();
        assert_eq!(
            feed(&mut d, &[None], 99),
            None,
            "99 breaches, window not full"
        );
        assert!(d.observe(None).is_some(), "the 100th");
    }
}
