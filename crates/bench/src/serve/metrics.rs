//! The figures of a serving run, computed from its request records as vLLM's
//! `benchmark_serving` computes them (`calculate_metrics`), under vLLM's names.

use std::str::FromStr;
use std::time::Duration;

use serde::ser::SerializeMap;
use serde::Serialize;

use super::client::{RequestRecord, TokenSource};
use crate::{BenchError, Result};
use switchyard_eval::stats::{median, percentile};

/// The percentiles reported for every latency (vLLM reports 99 by default; 90 is the other
/// one published figures quote).
pub const PERCENTILES: [f64; 2] = [90.0, 99.0];

/// Mean, median, population standard deviation (numpy's `std`) and percentiles of a latency,
/// in milliseconds; NaN (`null` in JSON) when nothing was measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Distribution {
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Distribution {
    pub fn of(xs: &[f64]) -> Self {
        if xs.is_empty() {
            return Self {
                mean: f64::NAN,
                median: f64::NAN,
                std: f64::NAN,
                p90: f64::NAN,
                p99: f64::NAN,
            };
        }
        let n = xs.len() as f64;
        let mean = xs.iter().sum::<f64>() / n;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
        Self {
            mean,
            median: median(xs),
            std: var.sqrt(),
            p90: percentile(xs, PERCENTILES[0]),
            p99: percentile(xs, PERCENTILES[1]),
        }
    }

    fn fields(&self) -> [(&'static str, f64); 5] {
        [
            ("mean", self.mean),
            ("median", self.median),
            ("std", self.std),
            ("p90", self.p90),
            ("p99", self.p99),
        ]
    }
}

/// Service-level objectives for goodput (vLLM's `--goodput ttft:MS tpot:MS e2el:MS`): a
/// completed request is good when it meets every one given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Slos {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2el_ms: Option<f64>,
}

impl Slos {
    pub fn is_empty(&self) -> bool {
        self.ttft_ms.is_none() && self.tpot_ms.is_none() && self.e2el_ms.is_none()
    }

    /// Parses `KEY:MS` items (`ttft`, `tpot`, `e2el`); a later item for a key replaces an
    /// earlier one.
    pub fn parse<S: AsRef<str>>(items: &[S]) -> Result<Self> {
        let mut slos = Self::default();
        for item in items {
            let item = item.as_ref();
            let bad = |why: &str| BenchError::Invalid(format!("goodput SLO {item:?}: {why}"));
            let (key, value) = item
                .split_once(':')
                .ok_or_else(|| bad("expected KEY:MILLISECONDS, e.g. ttft:200"))?;
            let ms = f64::from_str(value.trim())
                .ok()
                .filter(|v| v.is_finite() && *v > 0.0)
                .ok_or_else(|| bad("the milliseconds must be a positive number"))?;
            match key.trim() {
                "ttft" => slos.ttft_ms = Some(ms),
                "tpot" => slos.tpot_ms = Some(ms),
                "e2el" => slos.e2el_ms = Some(ms),
                _ => return Err(bad("the key must be ttft, tpot or e2el")),
            }
        }
        Ok(slos)
    }

    /// vLLM: every given SLO >= the request's value; a request of one output token has TPOT 0.
    fn met_by(&self, r: &RequestRecord) -> bool {
        let within = |slo: Option<f64>, v: Option<f64>| slo.is_none_or(|s| v.unwrap_or(0.0) <= s);
        within(self.ttft_ms, r.ttft_ms)
            && within(self.tpot_ms, r.tpot_ms)
            && within(self.e2el_ms, r.e2el_ms)
    }
}

/// Where the run's output-token counts came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenCount {
    /// Every completed request reported `usage`.
    Usage,
    /// No completed request reported `usage`: text chunks were counted.
    Chunks,
    /// Some of each.
    Mixed,
    /// Nothing completed.
    None,
}

/// The run's figures. Serialized flat, under vLLM's keys (`mean_ttft_ms`, `p99_itl_ms`, ...):
/// throughputs are per second (`request_throughput` in requests/s, `output_throughput` and
/// `total_token_throughput` in tokens/s, `request_goodput` in good requests/s).
#[derive(Debug, Clone, PartialEq)]
pub struct Metrics {
    pub completed: usize,
    pub failed: usize,
    /// Requests sent a second time after a connection failed before any response.
    pub retried: usize,
    /// Prompt tokens of the completed requests.
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub output_tokens_from: TokenCount,
    pub duration_s: f64,
    pub request_throughput: f64,
    /// `None` without SLOs.
    pub request_goodput: Option<f64>,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft_ms: Distribution,
    pub tpot_ms: Distribution,
    pub itl_ms: Distribution,
    pub e2el_ms: Distribution,
}

impl Metrics {
    /// The figures of `records` over a run of `duration`; only completed requests count
    /// towards latencies and tokens.
    pub fn compute(records: &[RequestRecord], duration: Duration, slos: &Slos) -> Self {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.success).collect();
        let total_input_tokens = ok.iter().map(|r| r.prompt_tokens).sum::<usize>();
        let total_output_tokens = ok.iter().map(|r| r.output_tokens).sum::<usize>();
        let secs = duration.as_secs_f64();
        let per_s = |x: usize| {
            if secs > 0.0 {
                x as f64 / secs
            } else {
                f64::NAN
            }
        };
        let collect = |f: fn(&RequestRecord) -> Option<f64>| -> Vec<f64> {
            ok.iter().filter_map(|r| f(r)).collect()
        };
        let itls: Vec<f64> = ok.iter().flat_map(|r| r.itl_ms.iter().copied()).collect();
        let from_usage = ok
            .iter()
            .filter(|r| r.output_tokens_from == TokenSource::Usage)
            .count();
        let output_tokens_from = match (ok.len(), from_usage) {
            (0, _) => TokenCount::None,
            (n, u) if u == n => TokenCount::Usage,
            (_, 0) => TokenCount::Chunks,
            _ => TokenCount::Mixed,
        };
        let good = ok.iter().filter(|r| slos.met_by(r)).count();
        Self {
            completed: ok.len(),
            failed: records.len() - ok.len(),
            retried: records.iter().filter(|r| r.retried).count(),
            total_input_tokens,
            total_output_tokens,
            output_tokens_from,
            duration_s: secs,
            request_throughput: per_s(ok.len()),
            request_goodput: (!slos.is_empty()).then(|| per_s(good)),
            output_throughput: per_s(total_output_tokens),
            total_token_throughput: per_s(total_input_tokens + total_output_tokens),
            ttft_ms: Distribution::of(&collect(|r| r.ttft_ms)),
            tpot_ms: Distribution::of(&collect(|r| r.tpot_ms)),
            itl_ms: Distribution::of(&itls),
            e2el_ms: Distribution::of(&collect(|r| r.e2el_ms)),
        }
    }

    /// The latencies by vLLM's metric name.
    pub fn latencies(&self) -> [(&'static str, &Distribution); 4] {
        [
            ("ttft", &self.ttft_ms),
            ("tpot", &self.tpot_ms),
            ("itl", &self.itl_ms),
            ("e2el", &self.e2el_ms),
        ]
    }
}

impl Serialize for Metrics {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        map.serialize_entry("completed", &self.completed)?;
        map.serialize_entry("failed", &self.failed)?;
        map.serialize_entry("retried", &self.retried)?;
        map.serialize_entry("total_input_tokens", &self.total_input_tokens)?;
        map.serialize_entry("total_output_tokens", &self.total_output_tokens)?;
        map.serialize_entry("output_tokens_from", &self.output_tokens_from)?;
        map.serialize_entry("duration_s", &self.duration_s)?;
        map.serialize_entry("request_throughput", &self.request_throughput)?;
        map.serialize_entry("request_goodput", &self.request_goodput)?;
        map.serialize_entry("output_throughput", &self.output_throughput)?;
        map.serialize_entry("total_token_throughput", &self.total_token_throughput)?;
        for (metric, d) in self.latencies() {
            for (stat, v) in d.fields() {
                map.serialize_entry(&format!("{stat}_{metric}_ms"), &v)?;
            }
        }
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ttft: f64, e2el: f64, out: usize, itl: &[f64]) -> RequestRecord {
        RequestRecord {
            index: 0,
            prompt_tokens: 10,
            max_tokens: out,
            success: true,
            error: None,
            arrival_ms: 0.0,
            start_ms: 0.0,
            end_ms: e2el,
            ttft_ms: Some(ttft),
            e2el_ms: Some(e2el),
            tpot_ms: (out > 1).then(|| (e2el - ttft) / (out - 1) as f64),
            itl_ms: itl.to_vec(),
            output_tokens: out,
            output_tokens_from: TokenSource::Usage,
            text_chunks: out,
            finish_reason: None,
            server_prompt_tokens: None,
            retried: false,
        }
    }

    #[test]
    fn distribution_matches_numpy() {
        // numpy: mean 2.5, median 2.5, std 1.118033988749895, p90 3.7, p99 3.97.
        let d = Distribution::of(&[4.0, 1.0, 3.0, 2.0]);
        assert_eq!((d.mean, d.median), (2.5, 2.5));
        assert!((d.std - 1.118_033_988_749_895).abs() < 1e-12);
        assert!((d.p90 - 3.7).abs() < 1e-12 && (d.p99 - 3.97).abs() < 1e-12);
        assert!(Distribution::of(&[]).mean.is_nan());
    }

    #[test]
    fn figures_of_a_run() {
        let mut failed = rec(1.0, 1.0, 0, &[]);
        failed.success = false;
        failed.output_tokens = 0;
        let records = vec![
            rec(100.0, 400.0, 4, &[100.0, 100.0, 100.0]),
            rec(300.0, 300.0, 1, &[]),
            failed,
        ];
        let slos = Slos::parse(&["ttft:200", "tpot:150"]).expect("valid");
        let m = Metrics::compute(&records, Duration::from_secs(2), &slos);
        assert_eq!((m.completed, m.failed), (2, 1));
        assert_eq!((m.total_input_tokens, m.total_output_tokens), (20, 5));
        assert_eq!(m.output_tokens_from, TokenCount::Usage);
        assert_eq!(m.request_throughput, 1.0);
        assert_eq!(m.output_throughput, 2.5);
        assert_eq!(m.total_token_throughput, 12.5);
        // Only the first meets TTFT <= 200 (the second's TPOT counts as 0).
        assert_eq!(m.request_goodput, Some(0.5));
        assert_eq!(m.ttft_ms.mean, 200.0);
        // TPOT only for the request with more than one token.
        assert_eq!(m.tpot_ms.mean, 100.0);
        assert_eq!(m.itl_ms.median, 100.0);
        assert_eq!(m.e2el_ms.median, 350.0);
        let none = Metrics::compute(&records, Duration::from_secs(2), &Slos::default());
        assert_eq!(none.request_goodput, None);

        let json = serde_json::to_value(&m).expect("serializes");
        assert_eq!(json["p99_itl_ms"], 100.0);
        assert_eq!(json["median_e2el_ms"], 350.0);
        assert_eq!(json["request_goodput"], 0.5);
        assert_eq!(json["output_tokens_from"], "usage");
        // Nothing measured is null, not a number.
        let empty = Metrics::compute(&[], Duration::from_secs(1), &Slos::default());
        let json = serde_json::to_value(&empty).expect("serializes");
        assert!(json["mean_ttft_ms"].is_null());
        assert_eq!(json["output_tokens_from"], "none");
    }

    #[test]
    fn slos_parse_and_reject() {
        let s = Slos::parse(&["ttft:200", "e2el: 1500.5"]).expect("valid");
        assert_eq!(
            s,
            Slos {
                ttft_ms: Some(200.0),
                tpot_ms: None,
                e2el_ms: Some(1500.5)
            }
        );
        assert!(Slos::parse::<&str>(&[]).expect("valid").is_empty());
        for bad in ["ttft", "ttft:-1", "ttft:0", "ttft:abc", "itl:5", "tpot:inf"] {
            assert!(Slos::parse(&[bad]).is_err(), "{bad}");
        }
    }
}
