//! What one candidate's block of an online evaluation measured, turned into its PHT row.
//!
//! Quality is bits per UTF-8 byte of the text the candidate generated, under the candidate
//! itself: the sum of the sampled tokens' negative log-probabilities (in bits) over the bytes
//! of their text. Bytes make it comparable across tokenizers (per-token perplexity is not).
//! Under greedy sampling it measures how sure the model was of what it said, the online
//! analogue of the profile's teacher-forced bits per byte.

use std::time::{Duration, Instant};

use crate::pht::{ExitHistogram, PhtRow};

/// Accumulates one candidate's evaluation requests.
#[derive(Debug, Clone, Default)]
pub struct BlockMeasure {
    /// Output tokens.
    pub tokens: u64,
    /// UTF-8 bytes of their text.
    pub bytes: u64,
    /// Sum of `-ln p` of the output tokens.
    pub nats: f64,
    /// First passing exit of each output token (full depth when none passed).
    pub exits: ExitHistogram,
    pub requests: u32,
    /// Requests of the block in flight, and since when at least one has been.
    in_flight: u32,
    busy_since: Option<Instant>,
    /// Time with at least one request in flight: throughput counts only that, so gaps
    /// between requests (no traffic) do not make a candidate look slow.
    busy: Duration,
    /// Milliseconds per layer the block's layer load took (`None` when nothing was loaded).
    pub load_ms_per_layer: Option<f64>,
}

impl BlockMeasure {
    /// Records output tokens with their log-probabilities and first passing exits, and the
    /// text they decoded to.
    pub fn record_tokens(&mut self, logprobs: &[f32], exits: &[usize], text: &str) {
        self.tokens += logprobs.len() as u64;
        self.nats -= logprobs.iter().map(|&l| f64::from(l)).sum::<f64>();
        for &d in exits {
            self.exits.record(d);
        }
        self.bytes += text.len() as u64;
    }

    /// A request of the block was handed to its engine.
    pub fn begin_request(&mut self, at: Instant) {
        self.requests += 1;
        if self.in_flight == 0 {
            self.busy_since = Some(at);
        }
        self.in_flight += 1;
    }

    /// A request of the block ended.
    pub fn end_request(&mut self, at: Instant) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if self.in_flight == 0 {
            if let Some(s) = self.busy_since.take() {
                self.busy += at.saturating_duration_since(s);
            }
        }
    }

    /// Time with at least one request of the block in flight.
    pub fn busy(&self) -> Duration {
        self.busy
    }

    pub fn tokens_per_s(&self) -> f64 {
        let s = self.busy().as_secs_f64();
        if s > 0.0 {
            self.tokens as f64 / s
        } else {
            0.0
        }
    }

    /// Bits per byte of the generated text (0 when no byte was generated).
    pub fn bits_per_byte(&self) -> f64 {
        if self.bytes == 0 {
            0.0
        } else {
            self.nats / std::f64::consts::LN_2 / self.bytes as f64
        }
    }

    /// Mean output tokens per request.
    pub fn tokens_per_request(&self) -> f64 {
        self.tokens as f64 / f64::from(self.requests.max(1))
    }

    /// The PHT row of `model` measured at `depth`. `switch_depth`: the depth a switch to this
    /// model would load, priced at the measured per-layer load time; `fallback_ms_per_layer`
    /// is used when this block loaded nothing (the previous row's value).
    pub fn row(
        &self,
        model: &str,
        depth: usize,
        switch_depth: usize,
        fallback_ms_per_layer: f64,
    ) -> PhtRow {
        let per_layer = self.load_ms_per_layer.unwrap_or(fallback_ms_per_layer);
        PhtRow {
            model: model.to_string(),
            depth: u16::try_from(depth).unwrap_or(u16::MAX),
            tokens_per_s: self.tokens_per_s() as f32,
            bits_per_byte: self.bits_per_byte() as f32,
            exits: self.exits.clone(),
            extend_ms_per_layer: per_layer as f32,
            switch_ms: (per_layer * switch_depth as f64) as f32,
            requests: self.requests,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_per_byte_throughput_and_histogram_add_up() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut m = BlockMeasure::default();
        // Two overlapping requests (0-600 ms, 400-700 ms), a gap, then an empty one
        // (2000-2300 ms): 1 s busy.
        m.begin_request(ms(0));
        m.begin_request(ms(400));
        m.end_request(ms(600));
        m.end_request(ms(700));
        m.begin_request(ms(2000));
        m.end_request(ms(2300));
        // Two tokens of probability 1/2 and 1/4 (1 + 2 bits) over the 3 bytes "abc".
        let lp = [0.5f32.ln(), 0.25f32.ln()];
        m.record_tokens(&lp, &[6, 24], "ab");
        m.record_tokens(&[], &[], "c");
        assert_eq!(m.busy(), Duration::from_millis(1000));
        assert!(
            (m.bits_per_byte() - 1.0).abs() < 1e-6,
            "{}",
            m.bits_per_byte()
        );
        assert!((m.tokens_per_s() - 2.0).abs() < 1e-9);
        assert_eq!(m.exits.bins(), &[(6, 1), (24, 1)]);
        assert!((m.tokens_per_request() - 2.0 / 3.0).abs() < 1e-12);
        m.load_ms_per_layer = Some(4.0);
        let r = m.row("m", 24, 6, 99.0);
        assert_eq!((r.depth, r.requests), (24, 3));
        assert_eq!((r.extend_ms_per_layer, r.switch_ms), (4.0, 24.0));
        m.load_ms_per_layer = None;
        assert_eq!(m.row("m", 24, 6, 3.0).switch_ms, 18.0);
    }

    #[test]
    fn an_empty_block_measures_zero_not_nan() {
        let m = BlockMeasure::default();
        assert_eq!((m.tokens_per_s(), m.bits_per_byte()), (0.0, 0.0));
    }
}
