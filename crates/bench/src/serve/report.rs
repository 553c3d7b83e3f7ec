//! The report of a serving run: its setup, its figures (JSON) and the Markdown summary.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use super::arrivals::RequestRate;
use super::client::RequestRecord;
use super::metrics::{Metrics, Slos};
use super::Endpoint;

/// Distinct error messages kept in a report (each with its count).
pub const MAX_ERROR_KINDS: usize = 10;

/// One error message and how many requests failed with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErrorCount {
    pub message: String,
    pub count: usize,
}

/// A serving benchmark run.
#[derive(Debug, Clone, Serialize)]
pub struct ServeReport {
    /// Seconds since the Unix epoch when the run started.
    pub date_unix_s: u64,
    /// The endpoint requests went to.
    pub url: String,
    pub endpoint: Endpoint,
    pub model: String,
    pub tokenizer: String,
    pub dataset: String,
    pub num_prompts: usize,
    pub request_rate: RequestRate,
    pub burstiness: f64,
    /// `null`: no limit.
    pub max_concurrency: Option<usize>,
    pub seed: u64,
    pub ignore_eos: bool,
    /// Fields added to every request body, when any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra_body: Option<serde_json::Value>,
    pub goodput_slos: Slos,
    #[serde(flatten)]
    pub metrics: Metrics,
    /// Most requests in flight at once (between sending and the end of the response).
    pub peak_concurrent_requests: usize,
    /// Requests by the server's last `finish_reason` (`none`: the stream gave none, as when
    /// a server cuts a stream short).
    pub finish_reasons: BTreeMap<String, usize>,
    /// The first distinct error messages, most frequent first.
    pub errors: Vec<ErrorCount>,
    /// Every request, with `--save-requests`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests: Option<Vec<RequestRecord>>,
}

/// Most records whose `[start_ms, end_ms)` overlap.
pub fn peak_concurrency(records: &[RequestRecord]) -> usize {
    // Ends sort before starts at the same instant: back-to-back requests do not overlap.
    let mut events: Vec<(f64, i32)> = records
        .iter()
        .flat_map(|r| [(r.start_ms, 1), (r.end_ms, -1)])
        .collect();
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut now, mut peak) = (0i64, 0i64);
    for (_, d) in events {
        now += i64::from(d);
        peak = peak.max(now);
    }
    usize::try_from(peak).unwrap_or(0)
}

/// Requests by finish reason, `none` for those without one.
pub fn finish_reasons(records: &[RequestRecord]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for r in records {
        let reason = r.finish_reason.as_deref().unwrap_or("none");
        *counts.entry(reason.to_string()).or_insert(0) += 1;
    }
    counts
}

/// The distinct error messages, most frequent first (ties in order of first appearance),
/// at most [`MAX_ERROR_KINDS`].
pub fn error_counts(records: &[RequestRecord]) -> Vec<ErrorCount> {
    let mut counts: Vec<ErrorCount> = Vec::new();
    for msg in records.iter().filter_map(|r| r.error.as_deref()) {
        match counts.iter_mut().find(|c| c.message == msg) {
            Some(c) => c.count += 1,
            None => counts.push(ErrorCount {
                message: msg.to_string(),
                count: 1,
            }),
        }
    }
    counts.sort_by_key(|c| std::cmp::Reverse(c.count));
    counts.truncate(MAX_ERROR_KINDS);
    counts
}

fn num(x: f64, decimals: usize) -> String {
    if x.is_finite() {
        format!("{x:.decimals$}")
    } else {
        "n/a".to_string()
    }
}

impl ServeReport {
    /// The summary as Markdown: the run's setup, its totals and throughputs, a latency table.
    pub fn markdown(&self) -> String {
        let m = &self.metrics;
        let mut s = String::new();
        let concurrency = self
            .max_concurrency
            .map_or_else(|| "unlimited".to_string(), |c| c.to_string());
        let _ = writeln!(s, "## Serving benchmark: {} at {}\n", self.model, self.url);
        let _ = writeln!(
            s,
            "{} prompts from {} (tokenizer {}), request rate {} (burstiness {}), max concurrency {}, seed {}{}.\n",
            self.num_prompts,
            self.dataset,
            self.tokenizer,
            self.request_rate,
            self.burstiness,
            concurrency,
            self.seed,
            if self.ignore_eos { ", ignore_eos" } else { "" }
        );
        let mut rows: Vec<(String, String)> = vec![
            ("Successful requests".into(), m.completed.to_string()),
            ("Failed requests".into(), m.failed.to_string()),
            (
                "Retried requests (connection failed before a response)".into(),
                m.retried.to_string(),
            ),
            ("Benchmark duration (s)".into(), num(m.duration_s, 2)),
            (
                "Total input tokens".into(),
                m.total_input_tokens.to_string(),
            ),
            (
                format!("Total generated tokens (from {})", token_source(self)),
                m.total_output_tokens.to_string(),
            ),
            (
                "Request throughput (req/s)".into(),
                num(m.request_throughput, 2),
            ),
        ];
        if let Some(g) = m.request_goodput {
            rows.push(("Request goodput (req/s)".into(), num(g, 2)));
        }
        rows.extend([
            (
                "Output token throughput (tok/s)".into(),
                num(m.output_throughput, 2),
            ),
            (
                "Total token throughput (tok/s)".into(),
                num(m.total_token_throughput, 2),
            ),
            (
                "Peak concurrent requests".into(),
                self.peak_concurrent_requests.to_string(),
            ),
        ]);
        let reasons: Vec<String> = self
            .finish_reasons
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        rows.push(("Finish reasons".into(), reasons.join(", ")));
        let _ = writeln!(s, "| Metric | Value |\n|---|---:|");
        for (k, v) in rows {
            let _ = writeln!(s, "| {k} | {v} |");
        }
        let _ = writeln!(
            s,
            "\n| Latency (ms) | Mean | Median | Std | P90 | P99 |\n|---|---:|---:|---:|---:|---:|"
        );
        for (name, d) in [
            ("TTFT", &m.ttft_ms),
            ("TPOT", &m.tpot_ms),
            ("ITL", &m.itl_ms),
            ("E2E", &m.e2el_ms),
        ] {
            let _ = writeln!(
                s,
                "| {name} | {} | {} | {} | {} | {} |",
                num(d.mean, 2),
                num(d.median, 2),
                num(d.std, 2),
                num(d.p90, 2),
                num(d.p99, 2)
            );
        }
        if !self.errors.is_empty() {
            let _ = writeln!(s, "\nErrors:\n");
            for e in &self.errors {
                let _ = writeln!(s, "- {} x {}", e.count, e.message.replace('\n', " "));
            }
        }
        s
    }
}

fn token_source(r: &ServeReport) -> &'static str {
    use super::metrics::TokenCount;
    match r.metrics.output_tokens_from {
        TokenCount::Usage => "usage",
        TokenCount::Chunks => "text chunks",
        TokenCount::Mixed => "usage and text chunks",
        TokenCount::None => "nothing",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::client::TokenSource;

    fn span(start_ms: f64, end_ms: f64, error: Option<&str>) -> RequestRecord {
        RequestRecord {
            index: 0,
            prompt_tokens: 1,
            max_tokens: 1,
            success: error.is_none(),
            error: error.map(str::to_owned),
            arrival_ms: start_ms,
            start_ms,
            end_ms,
            ttft_ms: None,
            e2el_ms: None,
            tpot_ms: None,
            itl_ms: Vec::new(),
            output_tokens: 0,
            output_tokens_from: TokenSource::Chunks,
            text_chunks: 0,
            finish_reason: None,
            server_prompt_tokens: None,
            retried: false,
        }
    }

    #[test]
    fn peak_concurrency_counts_overlaps() {
        let r = [
            span(0.0, 10.0, None),
            span(5.0, 15.0, None),
            span(6.0, 7.0, None),
            span(10.0, 20.0, None),
        ];
        assert_eq!(peak_concurrency(&r), 3);
        assert_eq!(
            peak_concurrency(&[span(0.0, 1.0, None), span(1.0, 2.0, None)]),
            1
        );
        assert_eq!(peak_concurrency(&[]), 0);
    }

    #[test]
    fn finish_reasons_are_counted() {
        let mut r = [
            span(0.0, 1.0, None),
            span(0.0, 1.0, None),
            span(0.0, 1.0, None),
        ];
        r[0].finish_reason = Some("length".into());
        r[1].finish_reason = Some("length".into());
        let counts = finish_reasons(&r);
        assert_eq!(counts.get("length"), Some(&2));
        assert_eq!(counts.get("none"), Some(&1));
        assert_eq!(counts.len(), 2);
    }

    #[test]
    fn errors_are_counted_by_message() {
        let r = [
            span(0.0, 1.0, Some("a")),
            span(0.0, 1.0, None),
            span(0.0, 1.0, Some("b")),
            span(0.0, 1.0, Some("b")),
        ];
        assert_eq!(
            error_counts(&r),
            vec![
                ErrorCount {
                    message: "b".into(),
                    count: 2
                },
                ErrorCount {
                    message: "a".into(),
                    count: 1
                }
            ]
        );
    }
}
