//! The soak's report: requests by phase and window, memory and its growth, K/V after the
//! drain, the burst, as Markdown, JSON and PNG plots.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::{
    Burst, Measurements, Sample, SoakOptions, SoakPlan, SoakRecord, DEFINITIONS, MIB,
    RECOVERY_BUCKET_S, RECOVERY_RATIO,
};
use crate::serve::Endpoint;
use crate::{BenchError, Result};
use switchyard_eval::stats::percentile;

/// Most points of the resident-memory line in the plot (a run of an hour has 3,600 samples).
const PLOT_POINTS: usize = 720;
/// Requests sent in one stretch of the run and how they ended.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PhaseCounts {
    pub from_s: f64,
    pub to_s: f64,
    pub sent: usize,
    pub completed: usize,
    pub failed: usize,
    pub http_429: usize,
    /// Of the 429s: those with a `Retry-After` header.
    pub http_429_with_retry_after: usize,
    /// Failures other than 429.
    pub other_failures: usize,
}

impl PhaseCounts {
    fn of(records: &[SoakRecord], from_s: f64, to_s: f64) -> Self {
        let mut c = Self {
            from_s,
            to_s,
            ..Self::default()
        };
        for r in records
            .iter()
            .filter(|r| (from_s..to_s).contains(&r.start_s))
        {
            c.sent += 1;
            if r.ok() {
                c.completed += 1;
            } else {
                c.failed += 1;
                if r.is_429() {
                    c.http_429 += 1;
                    c.http_429_with_retry_after += usize::from(r.has_retry_after());
                } else {
                    c.other_failures += 1;
                }
            }
        }
        c
    }
}

/// The overload burst and how the server rode it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BurstReport {
    pub at_s: f64,
    pub end_s: f64,
    pub rate: f64,
    /// The last response to a request sent during the burst.
    pub drained_at_s: f64,
    pub before: PhaseCounts,
    pub during: PhaseCounts,
    pub drain: PhaseCounts,
    pub after: PhaseCounts,
    /// Failed requests before the burst and after its drain.
    pub failures_outside: usize,
    /// Highest VmRSS sampled during the burst.
    pub max_rss_during_mib: Option<f64>,
    /// Highest VmRSS sampled after the burst's end.
    pub max_rss_after_mib: Option<f64>,
    /// P99 E2E of the requests sent between the warm-up and the burst.
    pub pre_burst_e2el_p99_ms: f64,
    /// From the burst's end until latency was back to normal; `None`: not within the run.
    pub recovered_after_s: Option<f64>,
}

/// Resident memory of the server over the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryReport {
    /// The fixed overhead (see `definitions`).
    pub startup_rss_mib: f64,
    pub startup_rss_anon_mib: f64,
    pub startup_rss_file_mib: f64,
    /// Requests the server had answered before the soak (0 for a fresh server).
    pub server_requests_before_soak: u64,
    pub memory_budget_mib: Option<f64>,
    pub budget_weights_mib: Option<f64>,
    pub budget_kv_pool_mib: Option<f64>,
    pub budget_workspace_mib: Option<f64>,
    pub budget_plus_overhead_mib: Option<f64>,
    pub max_rss_mib: f64,
    pub end_rss_mib: Option<f64>,
    pub within_budget_plus_overhead: Option<bool>,
    pub rss_growth_mib_per_hour: Option<f64>,
    pub growth_fit_samples: usize,
    pub samples: usize,
    /// Whether the server process was gone at some sample.
    pub server_exited: bool,
}

/// K/V blocks of the engine.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KvReport {
    pub blocks_total: u64,
    pub max_used: u64,
    pub used_after_drain: Option<u64>,
    pub prefix_cached_after_drain: Option<u64>,
    pub held_after_drain: Option<u64>,
    /// The engine reported no sequence running or waiting within the drain timeout.
    pub drained: bool,
    pub drain_wait_s: f64,
}

/// Requests of the whole run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Totals {
    pub scheduled: usize,
    pub sent: usize,
    pub completed: usize,
    /// Completed without text (EOS first).
    pub empty_completions: usize,
    pub failed: usize,
    pub retried: usize,
    pub output_tokens: usize,
    /// Most requests admitted at once as the client saw them (success status received,
    /// response not ended). A response ends here a moment after the server gave its place
    /// back, so this can exceed the server's limit by the requests that crossed that moment.
    pub peak_admitted: usize,
    /// Most requests the server admitted at once, from its `/metrics` after the drain
    /// (`switchyard_requests_in_flight_max`, since the server started; `None` without it).
    pub server_peak_admitted: Option<u64>,
}

/// Latency of the completed requests sent in a stretch of the run, in milliseconds (NaN,
/// `null` in JSON, when none completed).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Window {
    pub start_s: f64,
    pub end_s: f64,
    pub sent: usize,
    pub completed: usize,
    pub failed: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub e2el_p50_ms: f64,
    pub e2el_p99_ms: f64,
    /// Whether the window overlaps the burst.
    pub burst: bool,
}

impl Window {
    fn of(records: &[SoakRecord], start_s: f64, end_s: f64, burst: Option<&Burst>) -> Self {
        let inside: Vec<&SoakRecord> = records
            .iter()
            .filter(|r| (start_s..end_s).contains(&r.start_s))
            .collect();
        let ok: Vec<&&SoakRecord> = inside.iter().filter(|r| r.ok()).collect();
        let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
        let e2el: Vec<f64> = ok.iter().filter_map(|r| r.e2el_ms).collect();
        Self {
            start_s,
            end_s,
            sent: inside.len(),
            completed: ok.len(),
            failed: inside.len() - ok.len(),
            ttft_p50_ms: percentile(&ttft, 50.0),
            ttft_p99_ms: percentile(&ttft, 99.0),
            e2el_p50_ms: percentile(&e2el, 50.0),
            e2el_p99_ms: percentile(&e2el, 99.0),
            burst: burst.is_some_and(|b| start_s < b.end_s() && b.at_s < end_s),
        }
    }
}

/// A soak run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SoakReport {
    pub date_unix_s: u64,
    pub url: String,
    pub metrics_url: String,
    pub endpoint: Endpoint,
    pub model: String,
    pub tokenizer: String,
    pub dataset: String,
    pub distinct_prompts: usize,
    pub max_tokens_cap: Option<usize>,
    pub seed: u64,
    pub server_pid: u32,
    pub plan: SoakPlan,
    pub requests: Totals,
    pub failure_reasons: BTreeMap<String, usize>,
    /// The first message of each failure reason.
    pub failure_examples: BTreeMap<String, String>,
    /// The whole run's latency.
    pub latency: Window,
    pub burst: Option<BurstReport>,
    pub memory: MemoryReport,
    pub kv_blocks: KvReport,
    pub windows: Vec<Window>,
    /// [`RECOVERY_BUCKET_S`] buckets, aligned on the burst's end (on 0 without a burst).
    pub buckets: Vec<Window>,
    pub timeline: Vec<Sample>,
    pub definitions: BTreeMap<String, String>,
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB
}

/// Least-squares slope of `points` (y per x); `None` for fewer than two distinct x.
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

/// Most records whose `[admitted_s, end_s)` overlap.
fn peak_admitted(records: &[SoakRecord]) -> usize {
    // Ends sort before starts at the same instant: back-to-back requests do not overlap.
    let mut events: Vec<(f64, i64)> = records
        .iter()
        .filter_map(|r| r.admitted_s.map(|a| [(a, 1), (r.end_s, -1)]))
        .flatten()
        .collect();
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut now, mut peak) = (0i64, 0i64);
    for (_, d) in events {
        now += d;
        peak = peak.max(now);
    }
    usize::try_from(peak).unwrap_or(0)
}

/// Stretches of `len` seconds covering `[0, end)` with one boundary at `anchor`.
pub(super) fn grid(anchor: f64, len: f64, end: f64) -> Vec<(f64, f64)> {
    let mut start = anchor - (anchor / len).floor() * len;
    let mut out = Vec::new();
    if start > 0.0 {
        out.push((0.0, start));
    }
    while start < end {
        out.push((start, (start + len).min(end)));
        start += len;
    }
    out
}

fn max_rss(samples: &[Sample], keep: impl Fn(f64) -> bool) -> Option<f64> {
    samples
        .iter()
        .filter(|s| keep(s.t_s))
        .filter_map(|s| s.rss_mib)
        .reduce(f64::max)
}

impl SoakReport {
    /// Sums up a run's measurements.
    pub fn new(opts: &SoakOptions, distinct_prompts: usize, m: &Measurements) -> Self {
        let plan = &opts.plan;
        let records = &m.records;
        // Windows cover the traffic's duration; the phase after the burst and the whole-run
        // figures run to the last response.
        let end_s = records
            .iter()
            .map(|r| r.end_s)
            .fold(plan.duration_s, f64::max);
        let mut failure_reasons = BTreeMap::new();
        let mut failure_examples = BTreeMap::new();
        for f in records.iter().filter_map(|r| r.failure.as_ref()) {
            *failure_reasons.entry(f.reason.clone()).or_insert(0) += 1;
            failure_examples
                .entry(f.reason.clone())
                .or_insert_with(|| f.message.clone());
        }
        let ok = records.iter().filter(|r| r.ok());
        let requests = Totals {
            scheduled: m.scheduled,
            sent: records.len(),
            completed: ok.clone().count(),
            empty_completions: ok.clone().filter(|r| r.ttft_ms.is_none()).count(),
            failed: records.iter().filter(|r| !r.ok()).count(),
            retried: records.iter().filter(|r| r.retried).count(),
            output_tokens: ok.map(|r| r.output_tokens).sum(),
            peak_admitted: peak_admitted(records),
            server_peak_admitted: m.final_gauges.as_ref().and_then(|g| g.in_flight_max),
        };

        let burst_span = plan.burst.as_ref().map(|b| {
            let drained = records
                .iter()
                .filter(|r| (b.at_s..b.end_s()).contains(&r.start_s))
                .map(|r| r.end_s)
                .fold(b.end_s(), f64::max);
            (b.at_s, drained)
        });
        let in_burst = |t: f64| burst_span.is_some_and(|(a, d)| (a..=d).contains(&t));
        let fit: Vec<(f64, f64)> = m
            .samples
            .iter()
            .filter(|s| s.t_s >= plan.warmup_s && !in_burst(s.t_s))
            .filter_map(|s| s.rss_mib.map(|r| (s.t_s, r)))
            .collect();
        let g0 = &m.startup_gauges;
        let startup_mib = mib(m.startup_rss.vm_rss);
        let budget_plus = g0.budget_bytes.map(|b| mib(b) + startup_mib);
        let max_rss_mib = max_rss(&m.samples, |_| true).unwrap_or(startup_mib);
        let memory = MemoryReport {
            startup_rss_mib: startup_mib,
            startup_rss_anon_mib: mib(m.startup_rss.anon),
            startup_rss_file_mib: mib(m.startup_rss.file),
            server_requests_before_soak: g0.requests_total,
            memory_budget_mib: g0.budget_bytes.map(mib),
            budget_weights_mib: g0.weights_bytes.map(mib),
            budget_kv_pool_mib: g0.kv_pool_bytes.map(mib),
            budget_workspace_mib: g0.workspace_bytes.map(mib),
            budget_plus_overhead_mib: budget_plus,
            max_rss_mib,
            end_rss_mib: m.samples.last().and_then(|s| s.rss_mib),
            within_budget_plus_overhead: budget_plus.map(|b| max_rss_mib <= b),
            rss_growth_mib_per_hour: slope(&fit).map(|s| s * 3600.0),
            growth_fit_samples: fit.len(),
            samples: m.samples.len(),
            server_exited: m.samples.iter().any(|s| s.rss_mib.is_none()),
        };
        let fg = m.final_gauges.as_ref();
        let kv_blocks = KvReport {
            blocks_total: g0.kv_blocks_used + g0.kv_blocks_free,
            max_used: m
                .samples
                .iter()
                .filter_map(|s| s.kv_blocks_used)
                .chain(fg.map(|g| g.kv_blocks_used))
                .max()
                .unwrap_or(0),
            used_after_drain: fg.map(|g| g.kv_blocks_used),
            prefix_cached_after_drain: fg.map(|g| g.kv_blocks_prefix_cached),
            held_after_drain: fg
                .map(|g| g.kv_blocks_used.saturating_sub(g.kv_blocks_prefix_cached)),
            drained: m.drained,
            drain_wait_s: m.drain_wait_s,
        };

        let windows: Vec<Window> = grid(0.0, plan.window_s, plan.duration_s)
            .into_iter()
            .map(|(a, b)| Window::of(records, a, b, plan.burst()))
            .collect();
        let anchor = plan.burst.as_ref().map_or(0.0, Burst::end_s);
        let buckets: Vec<Window> = grid(anchor, RECOVERY_BUCKET_S, plan.duration_s)
            .into_iter()
            .map(|(a, b)| Window::of(records, a, b, plan.burst()))
            .collect();
        let burst = plan
            .burst
            .as_ref()
            .zip(burst_span)
            .map(|(b, (_, drained))| {
                let warm = if plan.warmup_s < b.at_s {
                    plan.warmup_s
                } else {
                    0.0
                };
                let pre = Window::of(records, warm, b.at_s, None).e2el_p99_ms;
                let recovered_after_s = buckets
                    .iter()
                    .filter(|w| w.start_s >= b.end_s() && w.completed > 0)
                    .find(|w| w.e2el_p99_ms <= RECOVERY_RATIO * pre)
                    .map(|w| w.start_s - b.end_s());
                let before = PhaseCounts::of(records, 0.0, b.at_s);
                let after = PhaseCounts::of(records, drained, end_s);
                BurstReport {
                    at_s: b.at_s,
                    end_s: b.end_s(),
                    rate: b.rate,
                    drained_at_s: drained,
                    failures_outside: before.failed + after.failed,
                    before,
                    during: PhaseCounts::of(records, b.at_s, b.end_s()),
                    drain: PhaseCounts::of(records, b.end_s(), drained),
                    after,
                    max_rss_during_mib: max_rss(&m.samples, |t| (b.at_s..=b.end_s()).contains(&t)),
                    max_rss_after_mib: max_rss(&m.samples, |t| t > b.end_s()),
                    pre_burst_e2el_p99_ms: pre,
                    recovered_after_s,
                }
            });
        Self {
            date_unix_s: m.date_unix_s,
            url: opts.url.to_string(),
            metrics_url: opts.metrics_url.to_string(),
            endpoint: opts.endpoint,
            model: opts.model.clone(),
            tokenizer: opts.tokenizer.clone(),
            dataset: opts.dataset.clone(),
            distinct_prompts,
            max_tokens_cap: opts.max_tokens,
            seed: opts.seed,
            server_pid: opts.server_pid,
            plan: plan.clone(),
            requests,
            failure_reasons,
            failure_examples,
            latency: Window::of(records, 0.0, end_s, None),
            burst,
            memory,
            kv_blocks,
            windows,
            buckets,
            timeline: m.samples.clone(),
            definitions: DEFINITIONS
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    /// The summary as Markdown: the run, requests by phase, memory, K/V, latency per window.
    pub fn markdown(&self) -> String {
        let p = &self.plan;
        let mut s = String::new();
        let _ = writeln!(s, "## Soak: {} at {}\n", self.model, self.url);
        let rate = match (p.saturation_rate, p.load_fraction) {
            (Some(sat), Some(f)) => format!(
                "{:.3} req/s ({:.0}% of a saturation rate of {sat:.3} req/s)",
                p.request_rate,
                f * 100.0
            ),
            _ => format!("{:.3} req/s", p.request_rate),
        };
        let _ = writeln!(
            s,
            "{:.0} s of Poisson arrivals at {rate}, {} distinct prompts from {} (tokenizer {}), \
             max_tokens {}, warm-up {:.0} s, windows of {:.0} s, seed {}, server pid {}.\n",
            p.duration_s,
            self.distinct_prompts,
            self.dataset,
            self.tokenizer,
            self.max_tokens_cap
                .map_or("= answer length".to_string(), |m| format!("<= {m}")),
            p.warmup_s,
            p.window_s,
            self.seed,
            self.server_pid
        );
        let r = &self.requests;
        let opt = |v: Option<u64>| v.map_or("n/a".to_string(), |v| v.to_string());
        let _ = writeln!(
            s,
            "Requests: {} scheduled, {} sent, {} completed ({} empty), {} failed, {} retried; \
             {} output tokens; at most {} admitted at once by the server's count ({} as the \
             client saw the responses).\n",
            r.scheduled,
            r.sent,
            r.completed,
            r.empty_completions,
            r.failed,
            r.retried,
            r.output_tokens,
            opt(r.server_peak_admitted),
            r.peak_admitted
        );
        if !self.failure_reasons.is_empty() {
            let _ = writeln!(s, "Failures by reason:\n");
            for (reason, n) in &self.failure_reasons {
                let example = self.failure_examples.get(reason).map_or("", String::as_str);
                let _ = writeln!(s, "- {reason}: {n} (e.g. {example})");
            }
            let _ = writeln!(s);
        }
        if let Some(b) = &self.burst {
            let _ = writeln!(
                s,
                "### Burst: {:.1} req/s from {:.0} s to {:.0} s (drained at {:.1} s)\n",
                b.rate, b.at_s, b.end_s, b.drained_at_s
            );
            let _ = writeln!(
                s,
                "| Phase | From (s) | To (s) | Sent | Completed | Failed | 429 | 429 with Retry-After | Other failures |"
            );
            let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
            for (name, c) in [
                ("before", &b.before),
                ("burst", &b.during),
                ("drain", &b.drain),
                ("after", &b.after),
            ] {
                let _ = writeln!(
                    s,
                    "| {name} | {:.1} | {:.1} | {} | {} | {} | {} | {} | {} |",
                    c.from_s,
                    c.to_s,
                    c.sent,
                    c.completed,
                    c.failed,
                    c.http_429,
                    c.http_429_with_retry_after,
                    c.other_failures
                );
            }
            let _ = writeln!(
                s,
                "\nFailures outside the burst: {}. Max VmRSS during the burst {} MiB, after it {} \
                 MiB, against budget + fixed overhead {} MiB. Pre-burst P99 E2E {} ms; back \
                 within {RECOVERY_RATIO}x {}.\n",
                b.failures_outside,
                num(b.max_rss_during_mib),
                num(b.max_rss_after_mib),
                num(self.memory.budget_plus_overhead_mib),
                num(Some(b.pre_burst_e2el_p99_ms)),
                b.recovered_after_s.map_or_else(
                    || "not within the run".to_string(),
                    |t| format!("{t:.0} s after the burst"),
                )
            );
        }
        let m = &self.memory;
        let _ = writeln!(s, "### Memory (VmRSS, sampled every second)\n");
        let _ = writeln!(s, "| | MiB |\n|---|---:|");
        for (name, v) in [
            ("fixed overhead: VmRSS at start", Some(m.startup_rss_mib)),
            ("- of it anonymous", Some(m.startup_rss_anon_mib)),
            ("- of it file-backed", Some(m.startup_rss_file_mib)),
            ("memory budget", m.memory_budget_mib),
            ("- weights", m.budget_weights_mib),
            ("- K/V pool", m.budget_kv_pool_mib),
            ("- workspace", m.budget_workspace_mib),
            ("budget + fixed overhead", m.budget_plus_overhead_mib),
            ("max VmRSS", Some(m.max_rss_mib)),
            ("VmRSS at the end", m.end_rss_mib),
            ("growth after warm-up (MiB/hour)", m.rss_growth_mib_per_hour),
        ] {
            let _ = writeln!(s, "| {name} | {} |", num(v));
        }
        let _ = writeln!(
            s,
            "\n{} samples ({} in the growth fit); the server had answered {} requests before; \
             {}.\n",
            m.samples,
            m.growth_fit_samples,
            m.server_requests_before_soak,
            if m.server_exited {
                "the server process exited during the run"
            } else {
                "the server process was alive throughout"
            }
        );
        let k = &self.kv_blocks;
        let _ = writeln!(
            s,
            "K/V blocks after the drain: {} used of {} ({} in the prefix cache, {} held by \
             requests); at most {} used; engine {} after {:.1} s.\n",
            opt(k.used_after_drain),
            k.blocks_total,
            opt(k.prefix_cached_after_drain),
            opt(k.held_after_drain),
            k.max_used,
            if k.drained { "idle" } else { "still busy" },
            k.drain_wait_s
        );
        let _ = writeln!(s, "### Latency per window (ms, completed requests)\n");
        let _ = writeln!(
            s,
            "| Window (s) | Sent | Completed | Failed | P50 TTFT | P99 TTFT | P50 E2E | P99 E2E |"
        );
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|");
        let rows = self.windows.iter().map(|w| {
            let burst = if w.burst { " (burst)" } else { "" };
            (format!("{:.0}-{:.0}{burst}", w.start_s, w.end_s), w)
        });
        for (name, w) in rows.chain(std::iter::once(("whole run".to_string(), &self.latency))) {
            let _ = writeln!(
                s,
                "| {name} | {} | {} | {} | {} | {} | {} | {} |",
                w.sent,
                w.completed,
                w.failed,
                num(Some(w.ttft_p50_ms)),
                num(Some(w.ttft_p99_ms)),
                num(Some(w.e2el_p50_ms)),
                num(Some(w.e2el_p99_ms))
            );
        }
        let _ = writeln!(s, "\nDefinitions:\n");
        for (k, v) in &self.definitions {
            let _ = writeln!(s, "- {k}: {v}");
        }
        s
    }

    /// Draws the run: resident memory over time (`path`) and P99 latency per window
    /// (`<stem>-latency.png` beside it), the burst marked in both as a box over its span.
    /// Two files because the chart crate draws one panel per PNG.
    pub fn plot(&self, path: &Path) -> Result<Vec<PathBuf>> {
        use switchyard_charts::{Series, SeriesLabelPosition};
        let x = (
            0.0,
            self.timeline
                .last()
                .map_or(self.plan.duration_s, |s| s.t_s)
                .max(1.0),
        );
        let step = self.timeline.len().div_ceil(PLOT_POINTS).max(1);
        let rss: Vec<(f64, f64)> = self
            .timeline
            .iter()
            .step_by(step)
            .filter_map(|s| s.rss_mib.map(|r| (s.t_s, r)))
            .collect();
        let mut series = vec![Series {
            name: "VmRSS (MiB)".into(),
            points: rss,
        }];
        if let Some(b) = self.memory.budget_plus_overhead_mib {
            series.push(Series {
                name: "budget + fixed overhead".into(),
                points: vec![(x.0, b), (x.1, b)],
            });
        }
        let mem_path = path.to_path_buf();
        self.draw(
            &mem_path,
            "resident memory (MiB)",
            x,
            series,
            SeriesLabelPosition::LowerRight,
        )?;

        let p99 = |f: fn(&Window) -> f64, ws: &[Window]| -> Vec<(f64, f64)> {
            ws.iter()
                .filter(|w| f(w).is_finite())
                .map(|w| ((w.start_s + w.end_s) / 2.0, f(w)))
                .collect()
        };
        let series = vec![
            Series {
                name: format!("P99 E2E per {:.0}-s window", self.plan.window_s),
                points: p99(|w| w.e2el_p99_ms, &self.windows),
            },
            Series {
                name: format!("P99 TTFT per {:.0}-s window", self.plan.window_s),
                points: p99(|w| w.ttft_p99_ms, &self.windows),
            },
            Series {
                name: format!("P99 E2E per {RECOVERY_BUCKET_S:.0}-s bucket"),
                points: p99(|w| w.e2el_p99_ms, &self.buckets),
            },
        ];
        let stem = path
            .file_stem()
            .map_or_else(|| "soak".to_string(), |s| s.to_string_lossy().into_owned());
        let lat_path = path.with_file_name(format!("{stem}-latency.png"));
        self.draw(
            &lat_path,
            "P99 latency (ms)",
            x,
            series,
            SeriesLabelPosition::UpperRight,
        )?;
        Ok(vec![mem_path, lat_path])
    }

    fn draw(
        &self,
        path: &Path,
        y_label: &str,
        x: (f64, f64),
        mut series: Vec<switchyard_charts::Series>,
        legend: switchyard_charts::SeriesLabelPosition,
    ) -> Result<()> {
        use switchyard_charts::{fonts_available, line_chart, Chart, Series};
        let ys = || series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
        let top = ys().fold(0.0, f64::max).max(1.0) * 1.1;
        let y = (0.0, top);
        if let Some(b) = &self.burst {
            series.push(Series {
                name: "burst".into(),
                points: vec![(b.at_s, y.0), (b.at_s, top), (b.end_s, top), (b.end_s, y.0)],
            });
        }
        let title = format!("bench soak: {}", self.model);
        line_chart(
            path,
            &Chart {
                title: &title,
                x_label: "time (s)",
                y_label,
                x,
                y,
                series: &series,
                legend,
            },
            fonts_available(),
        )
        .map_err(|e| BenchError::Invalid(e.to_string()))
    }
}

fn num(x: Option<f64>) -> String {
    match x {
        Some(v) if v.is_finite() => format!("{v:.1}"),
        _ => "n/a".to_string(),
    }
}
