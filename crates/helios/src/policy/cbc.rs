//! The Confidence Breach Counter (HELIOS's accuracy safeguard): over a sliding window of the
//! last generated tokens, count those whose exit confidence was below the threshold; fire when
//! more than the maximum breached. Occasional breaches are tolerated, because a greedy exit
//! is usually right even when unconfident (HELIOS's Observation 2).

use std::collections::VecDeque;

/// A sliding window of breach flags and their count.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfidenceBreachCounter {
    window: usize,
    max: usize,
    flags: VecDeque<bool>,
    breaches: usize,
    /// Tokens observed since the last reset, fired or not.
    seen: u64,
    fired: u64,
}

impl ConfidenceBreachCounter {
    /// Fires when more than `max` of the last `window` tokens breached (HELIOS: 50 of 100).
    pub fn new(window: usize, max: usize) -> Self {
        Self {
            window: window.max(1),
            max,
            flags: VecDeque::with_capacity(window.max(1)),
            breaches: 0,
            seen: 0,
            fired: 0,
        }
    }

    /// Records one generated token; `true` when the counter fires. Firing clears the window:
    /// the remedy changes the model or depth, so breaches counted before it say nothing about
    /// what comes after.
    pub fn observe(&mut self, breached: bool) -> bool {
        if self.flags.len() == self.window && self.flags.pop_front() == Some(true) {
            self.breaches -= 1;
        }
        self.flags.push_back(breached);
        self.breaches += usize::from(breached);
        self.seen += 1;
        if self.breaches > self.max {
            self.fired += 1;
            self.clear();
            return true;
        }
        false
    }

    /// Records a token by its confidence against `threshold` (breach: not above it, the
    /// complement of the exit test).
    pub fn observe_confidence(&mut self, confidence: f32, threshold: f32) -> bool {
        self.observe(!switchyard_exits::confidence::passes(confidence, threshold))
    }

    /// Empties the window (after a switch, extend or re-profile).
    pub fn clear(&mut self) {
        self.flags.clear();
        self.breaches = 0;
    }

    /// Breaches in the current window.
    pub fn breaches(&self) -> usize {
        self.breaches
    }

    /// Tokens in the current window.
    pub fn len(&self) -> usize {
        self.flags.len()
    }

    pub fn is_empty(&self) -> bool {
        self.flags.is_empty()
    }

    /// Times fired since creation.
    pub fn fired(&self) -> u64 {
        self.fired
    }

    /// Tokens observed since creation.
    pub fn seen(&self) -> u64 {
        self.seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{CBC_MAX, CBC_WINDOW};

    #[test]
    fn fires_on_the_51st_breach_within_100_tokens() {
        let mut c = ConfidenceBreachCounter::new(CBC_WINDOW, CBC_MAX);
        for i in 0..50 {
            assert!(!c.observe(true), "token {i}");
        }
        assert_eq!(c.breaches(), 50);
        for _ in 0..49 {
            assert!(!c.observe(false));
        }
        assert_eq!((c.len(), c.breaches()), (99, 50));
        assert!(c.observe(true), "51 of 100");
        assert_eq!((c.len(), c.breaches(), c.fired()), (0, 0, 1));
    }

    #[test]
    fn breaches_slide_out_of_the_window() {
        let mut c = ConfidenceBreachCounter::new(CBC_WINDOW, CBC_MAX);
        // 50 breaches, then 50 passes: the window is full with exactly 50.
        for _ in 0..50 {
            c.observe(true);
        }
        for _ in 0..50 {
            c.observe(false);
        }
        assert_eq!((c.len(), c.breaches()), (100, 50));
        // Each new breach pushes an old breach out: never more than 50.
        for _ in 0..50 {
            assert!(!c.observe(true));
            assert_eq!(c.breaches(), 50);
        }
        // The window now holds 50 passes then 50 breaches; a breach replacing a pass fires.
        assert!(c.observe(true));
        assert_eq!(c.seen(), 151);
    }

    #[test]
    fn alternating_half_breaches_never_fire_and_confidence_maps_to_breach() {
        let mut c = ConfidenceBreachCounter::new(CBC_WINDOW, CBC_MAX);
        for i in 0..10_000 {
            assert!(!c.observe(i % 2 == 0));
        }
        assert_eq!(c.fired(), 0);
        let mut c = ConfidenceBreachCounter::new(4, 1);
        assert!(!c.observe_confidence(0.9, 0.8));
        assert!(
            !c.observe_confidence(0.8, 0.8),
            "equal to the threshold is a breach"
        );
        assert!(c.observe_confidence(0.1, 0.8), "2 of 4 > 1");
    }
}
