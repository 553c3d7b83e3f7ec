//! `bench soak`: a running server held under mixed ShareGPT traffic for a bounded time, with an
//! optional overload burst. It owns the soak's traffic, its samples of the server process and
//! engine, and the report: how every request ended, resident memory over time and its growth,
//! K/V blocks after the final drain, latency per window, and how the server rode the burst.
//!
//! The traffic is `bench serve`'s: the same ShareGPT sample ([`BenchRequest`]), gamma/Poisson
//! arrivals ([`Arrivals`]), greedy streamed requests read by the same SSE parser
//! ([`crate::serve::sse`]). The request itself is sent by a small client of its own because a
//! refused request must say whether its 429 carried `Retry-After`, and `serve`'s records keep
//! only the status and body. Its latencies differ from `serve`'s in one way: E2E runs to
//! `[DONE]`, so a completion that ended at once (EOS first) is a completed request with a
//! latency, not a failure: a soak asks whether the server answered, not whether it wrote text.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;
use tokio::sync::mpsc;

use crate::serve::arrivals::DEFAULT_BURSTINESS;
use crate::serve::{Arrivals, BenchRequest, Endpoint, RequestRate, CLIENT_WORKER_THREADS};
use crate::{BenchError, Result};

mod client;
mod probe;
mod report;

use client::Client;
pub use probe::{metrics_url, parse_gauges, parse_status, read_rss, Gauges, Rss};
pub use report::*;

/// Resident memory and the engine's gauges are read this often.
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(1);
/// A `/metrics` scrape slower than this is left out of its sample, so that memory is still
/// read every second while the server is overloaded.
const SCRAPE_TIMEOUT: Duration = Duration::from_millis(900);
/// After the last response, how long the engine may take to report no sequence running or
/// waiting before the K/V blocks are read anyway.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);
const DRAIN_POLL: Duration = Duration::from_millis(200);
/// Share of the run left out of the memory-growth fit by default (allocator pools, lazily
/// touched weights and K/V pages settle in it).
pub const DEFAULT_WARMUP_FRACTION: f64 = 0.1;
/// Latency window of the report and plot (5 minutes: 12 points over the hour-long run).
pub const DEFAULT_WINDOW_S: f64 = 300.0;
/// `scripts/soak.sh` runs at this share of the measured saturation rate.
pub const DEFAULT_LOAD_FRACTION: f64 = 0.8;
/// Buckets of the rolling P99 that says when latency is back to normal after the burst.
pub const RECOVERY_BUCKET_S: f64 = 10.0;
/// Latency is back to normal within this factor of the P99 before the burst.
pub const RECOVERY_RATIO: f64 = 1.2;
/// `max_tokens` of the request sent before the run to check the server answers.
const TEST_REQUEST_MAX_TOKENS: usize = 8;
/// Keeps the burst's arrivals independent of the steady ones drawn from the same seed.
const BURST_SEED_SALT: u64 = 0x5eed_b075;
const MIB: f64 = 1024.0 * 1024.0;

/// What the report's derived figures mean, written into the JSON and the Markdown.
pub const DEFINITIONS: [(&str, &str); 5] = [
    (
        "fixed_overhead",
        "VmRSS of the server process when bench soak starts, before it sends any request \
         (scripts/soak.sh starts a fresh server for it): the weights the engine has read and its \
         K/V pool, which the engine allocates at start-up and whose f16 blocks are written then, \
         so they are resident; the activation workspace is reserved in the budget but only \
         touched by the first steps. Budget + overhead counts weights and K/V twice: a loose \
         ceiling, and one the server must never cross.",
    ),
    (
        "rss_growth",
        "least-squares slope of VmRSS over the samples after the warm-up, leaving out the burst \
         and its drain, in MiB per hour",
    ),
    (
        "phases",
        "requests by send time: before the burst, during it, drain (after it, until the last \
         response to a request sent during it), after (the rest); failures outside the burst \
         are those before and after",
    ),
    (
        "recovery",
        "the first 10-s bucket after the burst whose requests' P99 E2E is within 1.2x of the P99 \
         E2E of the requests sent between the warm-up and the burst; the time from the burst's \
         end to that bucket's start",
    ),
    (
        "kv_blocks_held_after_drain",
        "switchyard_kv_blocks{state=\"used\"} minus {state=\"prefix_cached\"} once the engine \
         reports no sequence running or waiting: blocks still held by requests (0 expected)",
    ),
];

/// How the steady request rate was given.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RateSpec {
    PerSecond(f64),
    /// `fraction` of a measured saturation rate (completed requests/s of `bench serve
    /// --request-rate inf`).
    OfSaturation {
        saturation: f64,
        fraction: f64,
    },
}

/// An overload burst: requests at `rate` per second, on top of the steady ones, from `at_s`
/// for `length_s` seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Burst {
    pub at_s: f64,
    pub length_s: f64,
    pub rate: f64,
}

impl Burst {
    pub fn end_s(&self) -> f64 {
        self.at_s + self.length_s
    }
}

/// The run as asked for, before it is checked.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanInput {
    pub rate: RateSpec,
    pub duration_s: f64,
    /// Default: [`DEFAULT_WARMUP_FRACTION`] of the duration.
    pub warmup_s: Option<f64>,
    /// Default: [`DEFAULT_WINDOW_S`].
    pub window_s: Option<f64>,
    pub burst: Option<Burst>,
}

/// A checked run: positive finite rates and lengths, a warm-up shorter than the run, a burst
/// that ends within it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SoakPlan {
    request_rate: f64,
    saturation_rate: Option<f64>,
    load_fraction: Option<f64>,
    duration_s: f64,
    warmup_s: f64,
    window_s: f64,
    burst: Option<Burst>,
}

fn positive(what: &str, x: f64) -> Result<f64> {
    if x.is_finite() && x > 0.0 {
        Ok(x)
    } else {
        Err(BenchError::Invalid(format!(
            "{what} must be a positive number, not {x}"
        )))
    }
}

impl SoakPlan {
    pub fn new(input: PlanInput) -> Result<Self> {
        let (request_rate, saturation_rate, load_fraction) = match input.rate {
            RateSpec::PerSecond(r) => (positive("the request rate", r)?, None, None),
            RateSpec::OfSaturation {
                saturation,
                fraction,
            } => {
                let s = positive("the saturation rate", saturation)?;
                let f = positive("the load fraction", fraction)?;
                (s * f, Some(s), Some(f))
            }
        };
        let duration_s = positive("the duration", input.duration_s)?;
        let warmup_s = input
            .warmup_s
            .unwrap_or(duration_s * DEFAULT_WARMUP_FRACTION);
        if !(warmup_s.is_finite() && (0.0..duration_s).contains(&warmup_s)) {
            return Err(BenchError::Invalid(format!(
                "the warm-up ({warmup_s} s) must be at least 0 and shorter than the run ({duration_s} s)"
            )));
        }
        let window_s = positive("the window", input.window_s.unwrap_or(DEFAULT_WINDOW_S))?;
        if let Some(b) = &input.burst {
            positive("the burst rate", b.rate)?;
            positive("the burst length", b.length_s)?;
            if !(b.at_s.is_finite() && b.at_s >= 0.0 && b.end_s() <= duration_s) {
                return Err(BenchError::Invalid(format!(
                    "the burst ({} s to {} s) must lie within the run (0 to {duration_s} s)",
                    b.at_s,
                    b.end_s()
                )));
            }
        }
        Ok(Self {
            request_rate,
            saturation_rate,
            load_fraction,
            duration_s,
            warmup_s,
            window_s,
            burst: input.burst,
        })
    }

    pub fn request_rate(&self) -> f64 {
        self.request_rate
    }

    pub fn duration_s(&self) -> f64 {
        self.duration_s
    }

    pub fn burst(&self) -> Option<&Burst> {
        self.burst.as_ref()
    }

    /// Send times in seconds from the start, sorted: a Poisson process at the request rate
    /// over the run, and one at the burst rate over the burst.
    pub fn arrivals(&self, seed: u64) -> Vec<f64> {
        let mut times = poisson(self.request_rate, 0.0, self.duration_s, seed);
        if let Some(b) = &self.burst {
            times.extend(poisson(b.rate, b.at_s, b.end_s(), seed ^ BURST_SEED_SALT));
            times.sort_by(f64::total_cmp);
        }
        times
    }
}

/// Arrivals of a Poisson process at `rate` from `from` until before `to`.
fn poisson(rate: f64, from: f64, to: f64, seed: u64) -> Vec<f64> {
    let mean = rate * (to - from);
    // Six standard deviations past the mean: the process nearly never runs out before `to`.
    let n = (mean + 6.0 * mean.sqrt() + 16.0).ceil() as usize;
    let Ok(arrivals) = Arrivals::new(RequestRate::PerSecond(rate), DEFAULT_BURSTINESS) else {
        return Vec::new();
    };
    arrivals
        .offsets(n, seed)
        .into_iter()
        .map(|d| from + d.as_secs_f64())
        .take_while(|&t| t < to)
        .collect()
}

/// How to reach the server and what to send.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    /// The completions endpoint ([`crate::serve::endpoint_url`]).
    pub url: reqwest::Url,
    /// The server's Prometheus endpoint.
    pub metrics_url: reqwest::Url,
    pub endpoint: Endpoint,
    pub model: String,
    /// The server process, whose `/proc/<pid>/status` is sampled (same machine).
    pub server_pid: u32,
    pub plan: SoakPlan,
    /// `max_tokens` is the dataset answer's length, at most this.
    pub max_tokens: Option<usize>,
    pub seed: u64,
    pub request_timeout: Duration,
    pub api_key: Option<String>,
    /// Recorded in the report: where the prompts came from and what counted their tokens.
    pub dataset: String,
    pub tokenizer: String,
}

/// Progress, reported every [`SAMPLE_INTERVAL`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    pub elapsed_s: f64,
    pub scheduled: usize,
    pub sent: usize,
    pub completed: usize,
    pub failed: usize,
}

/// Why a request failed: a short key the report counts by, and an example message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// `http_429`, `http_503`, ..., `timeout`, `transport`, `stream_error`, `no_done`.
    pub reason: String,
    pub status: Option<u16>,
    /// The `Retry-After` header of an error response.
    pub retry_after: Option<String>,
    pub message: String,
}

/// One request of the run; times in seconds from its start.
#[derive(Debug, Clone, PartialEq)]
pub struct SoakRecord {
    pub start_s: f64,
    /// When a success status arrived: the server admitted the request.
    pub admitted_s: Option<f64>,
    pub end_s: f64,
    /// To the first chunk with text (none for an empty completion).
    pub ttft_ms: Option<f64>,
    /// To `[DONE]`, for a completed request.
    pub e2el_ms: Option<f64>,
    pub output_tokens: usize,
    pub failure: Option<Failure>,
    /// Sent a second time after its connection failed before any response.
    pub retried: bool,
}

impl SoakRecord {
    pub fn ok(&self) -> bool {
        self.failure.is_none()
    }

    fn is_429(&self) -> bool {
        self.failure.as_ref().is_some_and(|f| f.status == Some(429))
    }

    fn has_retry_after(&self) -> bool {
        self.failure.as_ref().is_some_and(|f| {
            f.retry_after
                .as_deref()
                .is_some_and(|v| !v.trim().is_empty())
        })
    }
}

/// One resident-memory sample, with the engine's gauges when `/metrics` answered in time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Sample {
    pub t_s: f64,
    /// `None` once the process is gone.
    pub rss_mib: Option<f64>,
    pub kv_blocks_used: Option<u64>,
    pub running: Option<u64>,
    pub waiting: Option<u64>,
}

/// Everything a run measured, before it is summed up.
#[derive(Debug, Clone, PartialEq)]
pub struct Measurements {
    pub startup_rss: Rss,
    pub startup_gauges: Gauges,
    pub records: Vec<SoakRecord>,
    pub samples: Vec<Sample>,
    pub scheduled: usize,
    /// The engine's gauges after the drain (`None`: `/metrics` did not answer).
    pub final_gauges: Option<Gauges>,
    /// Whether the engine reported no sequence running or waiting within [`DRAIN_TIMEOUT`].
    pub drained: bool,
    /// From the last response to the gauges read after the drain.
    pub drain_wait_s: f64,
    pub date_unix_s: u64,
}

/// Runs the soak on a runtime of its own ([`CLIENT_WORKER_THREADS`] workers).
pub fn run_soak(
    prompts: &[BenchRequest],
    opts: &SoakOptions,
    progress: impl FnMut(Progress),
) -> Result<SoakReport> {
    if prompts.is_empty() {
        return Err(BenchError::Invalid("no prompts to send".into()));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(CLIENT_WORKER_THREADS)
        .enable_all()
        .build()
        .map_err(|e| BenchError::Invalid(format!("starting the client runtime: {e}")))?;
    let m = rt.block_on(measure(prompts, opts, progress))?;
    Ok(SoakReport::new(opts, prompts.len(), &m))
}

/// Counts shared by the request tasks and the sampler.
#[derive(Default)]
struct Counters {
    sent: AtomicUsize,
    completed: AtomicUsize,
    failed: AtomicUsize,
}

async fn measure(
    prompts: &[BenchRequest],
    opts: &SoakOptions,
    mut progress: impl FnMut(Progress),
) -> Result<Measurements> {
    let client = Arc::new(Client::new(opts)?);
    // The overhead is read before this run sends anything.
    let startup_rss = read_rss(opts.server_pid).map_err(|e| {
        BenchError::Invalid(format!(
            "--server-pid {}: {e} (is the server running on this machine?)",
            opts.server_pid
        ))
    })?;
    let startup_gauges = client.gauges().await?.ok_or_else(|| {
        BenchError::Invalid(format!(
            "{} has no switchyard_kv_blocks for model {:?}: is it a Switchyard server \
             serving that model?",
            opts.metrics_url, opts.model
        ))
    })?;
    let first = &prompts[0];
    let test = client
        .send(&first.prompt, TEST_REQUEST_MAX_TOKENS, Instant::now())
        .await;
    if let Some(f) = test.failure {
        return Err(BenchError::Invalid(format!(
            "the test request to {} failed: {}",
            opts.url, f.message
        )));
    }

    let times = opts.plan.arrivals(opts.seed);
    let scheduled = times.len();
    let date_unix_s = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let counters = Arc::new(Counters::default());
    let finished = AtomicBool::new(false);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let start = Instant::now();
    let dispatch = {
        let (client, counters) = (Arc::clone(&client), Arc::clone(&counters));
        async move {
            for (i, t) in times.iter().enumerate() {
                tokio::time::sleep_until((start + Duration::from_secs_f64(*t)).into()).await;
                let req = &prompts[i % prompts.len()];
                let max_tokens = opts
                    .max_tokens
                    .map_or(req.output_len, |m| m.min(req.output_len));
                let (client, counters, tx) =
                    (Arc::clone(&client), Arc::clone(&counters), tx.clone());
                let prompt = req.prompt.clone();
                counters.sent.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(async move {
                    let r = client.send(&prompt, max_tokens, start).await;
                    let done = if r.ok() {
                        &counters.completed
                    } else {
                        &counters.failed
                    };
                    done.fetch_add(1, Ordering::Relaxed);
                    // The receiver lives until every sender is gone.
                    let _ = tx.send(r);
                });
            }
        }
    };
    let collect = async {
        let mut records = Vec::with_capacity(scheduled);
        while let Some(r) = rx.recv().await {
            records.push(r);
        }
        finished.store(true, Ordering::Relaxed);
        records
    };
    let sampler = async {
        let mut samples = Vec::new();
        let mut tick = tokio::time::interval(SAMPLE_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !finished.load(Ordering::Relaxed) {
            tick.tick().await;
            samples.push(sample(&client, opts.server_pid, start).await);
            progress(Progress {
                elapsed_s: start.elapsed().as_secs_f64(),
                scheduled,
                sent: counters.sent.load(Ordering::Relaxed),
                completed: counters.completed.load(Ordering::Relaxed),
                failed: counters.failed.load(Ordering::Relaxed),
            });
        }
        samples
    };
    let ((), mut records, mut samples) = tokio::join!(dispatch, collect, sampler);
    records.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));

    let last_response = Instant::now();
    let deadline = last_response + DRAIN_TIMEOUT;
    let (final_gauges, drained) = loop {
        let g = client.gauges().await.ok().flatten();
        let idle = g.is_some_and(|g| g.running == 0 && g.waiting == 0);
        if idle || Instant::now() >= deadline {
            break (g, idle);
        }
        tokio::time::sleep(DRAIN_POLL).await;
    };
    let drain_wait_s = last_response.elapsed().as_secs_f64();
    samples.push(sample(&client, opts.server_pid, start).await);
    Ok(Measurements {
        startup_rss,
        startup_gauges,
        records,
        samples,
        scheduled,
        final_gauges,
        drained,
        drain_wait_s,
        date_unix_s,
    })
}

async fn sample(client: &Client, pid: u32, start: Instant) -> Sample {
    let t_s = start.elapsed().as_secs_f64();
    let rss_mib = read_rss(pid).ok().map(|r| r.vm_rss as f64 / MIB);
    let g = tokio::time::timeout(SCRAPE_TIMEOUT, client.gauges())
        .await
        .ok()
        .and_then(|r| r.ok().flatten());
    Sample {
        t_s,
        rss_mib,
        kv_blocks_used: g.map(|g| g.kv_blocks_used),
        running: g.map(|g| g.running),
        waiting: g.map(|g| g.waiting),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(burst: Option<Burst>) -> SoakPlan {
        SoakPlan::new(PlanInput {
            rate: RateSpec::PerSecond(2.0),
            duration_s: 100.0,
            warmup_s: None,
            window_s: Some(20.0),
            burst,
        })
        .expect("valid plan")
    }

    const BURST: Burst = Burst {
        at_s: 40.0,
        length_s: 10.0,
        rate: 20.0,
    };

    #[test]
    fn plans_are_checked_and_rates_derived() {
        let p = SoakPlan::new(PlanInput {
            rate: RateSpec::OfSaturation {
                saturation: 5.0,
                fraction: DEFAULT_LOAD_FRACTION,
            },
            duration_s: 3600.0,
            warmup_s: None,
            window_s: None,
            burst: None,
        })
        .expect("valid");
        assert!((p.request_rate() - 4.0).abs() < 1e-12);
        assert_eq!((p.warmup_s, p.window_s), (360.0, DEFAULT_WINDOW_S));
        let bad = |rate, warmup_s, burst| {
            SoakPlan::new(PlanInput {
                rate,
                duration_s: 60.0,
                warmup_s,
                window_s: None,
                burst,
            })
            .is_err()
        };
        let ok_rate = RateSpec::PerSecond(1.0);
        assert!(bad(RateSpec::PerSecond(0.0), None, None));
        assert!(bad(RateSpec::PerSecond(f64::NAN), None, None));
        assert!(bad(ok_rate, Some(60.0), None));
        let late = Burst {
            at_s: 55.0,
            length_s: 10.0,
            rate: 5.0,
        };
        assert!(bad(ok_rate, None, Some(late)));
        assert!(bad(ok_rate, None, Some(Burst { rate: 0.0, ..BURST })));
        assert!(!bad(ok_rate, None, Some(Burst { at_s: 50.0, ..late })));
    }

    #[test]
    fn arrivals_follow_the_rates_and_the_burst() {
        let p = plan(Some(BURST));
        let t = p.arrivals(3);
        assert!(t.windows(2).all(|w| w[0] <= w[1]), "sorted");
        assert!(t.iter().all(|&x| (0.0..100.0).contains(&x)));
        let inside = t.iter().filter(|&&x| (40.0..50.0).contains(&x)).count();
        let outside = t.len() - inside;
        // 2/s over the 90 s outside the burst; 22/s inside (steady + burst): Poisson spread.
        assert!((140..=220).contains(&outside), "{outside}");
        assert!((170..=270).contains(&inside), "{inside}");
        assert_eq!(t, p.arrivals(3));
        assert_ne!(t, p.arrivals(4));
    }

    #[test]
    fn slopes_and_grids() {
        // 1 MiB every 100 s is 36 MiB per hour.
        let pts: Vec<(f64, f64)> = (0..50)
            .map(|i| (i as f64, 300.0 + i as f64 / 100.0))
            .collect();
        assert!((slope(&pts).expect("slope") * 3600.0 - 36.0).abs() < 1e-9);
        assert_eq!(slope(&[(1.0, 2.0)]), None);
        assert_eq!(slope(&[(1.0, 2.0), (1.0, 3.0)]), None);
        assert_eq!(
            grid(0.0, 10.0, 25.0),
            vec![(0.0, 10.0), (10.0, 20.0), (20.0, 25.0)]
        );
        assert_eq!(
            grid(15.0, 10.0, 30.0),
            vec![(0.0, 5.0), (5.0, 15.0), (15.0, 25.0), (25.0, 30.0)]
        );
    }

    fn ok(start: f64, e2el_ms: f64) -> SoakRecord {
        SoakRecord {
            start_s: start,
            admitted_s: Some(start),
            end_s: start + e2el_ms / 1e3,
            ttft_ms: Some(e2el_ms / 4.0),
            e2el_ms: Some(e2el_ms),
            output_tokens: 8,
            failure: None,
            retried: false,
        }
    }

    fn refused(start: f64, retry_after: bool) -> SoakRecord {
        SoakRecord {
            start_s: start,
            admitted_s: None,
            end_s: start + 0.01,
            ttft_ms: None,
            e2el_ms: None,
            output_tokens: 0,
            failure: Some(Failure {
                reason: "http_429".into(),
                status: Some(429),
                retry_after: retry_after.then(|| "1".to_string()),
                message: "HTTP 429 Too Many Requests: full".into(),
            }),
            retried: false,
        }
    }

    fn options(plan: SoakPlan) -> SoakOptions {
        let url = |s: &str| reqwest::Url::parse(s).expect("url");
        SoakOptions {
            url: url("http://h:1/v1/completions"),
            metrics_url: url("http://h:1/metrics"),
            endpoint: Endpoint::Completions,
            model: "m".into(),
            server_pid: 1,
            plan,
            max_tokens: Some(16),
            seed: 0,
            request_timeout: Duration::from_secs(60),
            api_key: None,
            dataset: "sharegpt".into(),
            tokenizer: "m".into(),
        }
    }

    /// A run of 100 s: 100 ms requests every second, 1 s ones during the burst (40-50 s)
    /// with refusals, the last burst request ending at 53 s, 150 ms ones until 70 s, then
    /// 100 ms again; memory 300 MiB growing 1 MiB per 100 s, 400 MiB during the burst.
    fn measurements() -> Measurements {
        let mut records = Vec::new();
        for i in 0..100 {
            let t = i as f64;
            let ms = match t {
                _ if (40.0..50.0).contains(&t) => 1000.0,
                _ if (50.0..70.0).contains(&t) => 150.0,
                _ => 100.0,
            };
            records.push(ok(t + 0.5, ms));
        }
        records.push(SoakRecord {
            end_s: 53.0,
            ..ok(49.9, 3100.0)
        });
        records.extend((0..5).map(|i| refused(41.0 + i as f64, i != 2)));
        let mut empty = ok(20.2, 100.0);
        empty.ttft_ms = None;
        records.push(empty);
        records.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
        let samples = (0..=100)
            .map(|i| {
                let t = i as f64;
                let rss = if (40.0..=53.0).contains(&t) {
                    400.0
                } else {
                    300.0 + t / 100.0
                };
                Sample {
                    t_s: t,
                    rss_mib: Some(rss),
                    kv_blocks_used: Some(if (40.0..=53.0).contains(&t) { 50 } else { 4 }),
                    running: Some(1),
                    waiting: Some(0),
                }
            })
            .collect();
        let startup = Gauges {
            kv_blocks_free: 1000,
            budget_bytes: Some(256 << 20),
            ..Gauges::default()
        };
        Measurements {
            startup_rss: Rss {
                vm_rss: 300 << 20,
                anon: 200 << 20,
                file: 100 << 20,
            },
            startup_gauges: startup,
            records,
            samples,
            scheduled: 107,
            final_gauges: Some(Gauges {
                kv_blocks_used: 3,
                kv_blocks_prefix_cached: 3,
                in_flight_max: Some(2),
                ..startup
            }),
            drained: true,
            drain_wait_s: 0.3,
            date_unix_s: 0,
        }
    }

    #[test]
    fn a_run_is_summed_up_by_phase_window_and_memory() {
        let r = SoakReport::new(&options(plan(Some(BURST))), 10, &measurements());
        assert_eq!(
            (r.requests.sent, r.requests.completed, r.requests.failed),
            (107, 102, 5)
        );
        assert_eq!(r.requests.empty_completions, 1);
        assert_eq!(r.failure_reasons.get("http_429"), Some(&5));
        // The 3.1-s request overlaps the 1-s ones started at 49.5 and 50.5.
        assert_eq!(r.requests.peak_admitted, 2);
        assert_eq!(r.requests.server_peak_admitted, Some(2));

        let b = r.burst.as_ref().expect("burst");
        assert_eq!(b.drained_at_s, 53.0);
        assert_eq!((b.before.sent, b.before.failed), (41, 0));
        assert_eq!((b.during.sent, b.during.http_429), (16, 5));
        assert_eq!(b.during.http_429_with_retry_after, 4);
        assert_eq!((b.drain.sent, b.after.sent), (3, 47));
        assert_eq!(b.failures_outside, 0);
        assert_eq!(
            (b.max_rss_during_mib, b.max_rss_after_mib),
            (Some(400.0), Some(400.0))
        );
        // Pre-burst P99: every request from the warm-up (10 s) to the burst took 100 ms.
        assert!((b.pre_burst_e2el_p99_ms - 100.0).abs() < 1e-9);
        // Buckets from the burst's end (50 s): 150 ms until 70 s, back to 100 ms from 70 s.
        assert_eq!(b.recovered_after_s, Some(20.0));

        let m = &r.memory;
        assert_eq!(
            (m.startup_rss_mib, m.memory_budget_mib),
            (300.0, Some(256.0))
        );
        assert_eq!(m.budget_plus_overhead_mib, Some(556.0));
        assert_eq!(
            (m.max_rss_mib, m.within_budget_plus_overhead),
            (400.0, Some(true))
        );
        // The burst's 400 MiB is left out of the fit: 1 MiB per 100 s remains.
        let growth = m.rss_growth_mib_per_hour.expect("growth");
        assert!((growth - 36.0).abs() < 1e-6, "{growth}");
        assert_eq!(m.growth_fit_samples, 101 - 10 - 14);

        let k = &r.kv_blocks;
        assert_eq!((k.blocks_total, k.max_used), (1000, 50));
        assert_eq!((k.used_after_drain, k.held_after_drain), (Some(3), Some(0)));

        assert_eq!(r.windows.len(), 5);
        assert!(r.windows[2].burst && !r.windows[1].burst && !r.windows[3].burst);
        assert!((r.windows[0].e2el_p99_ms - 100.0).abs() < 1e-9);
        assert_eq!(r.windows[2].failed, 5);

        let json = serde_json::to_value(&r).expect("json");
        assert_eq!(json["burst"]["during"]["http_429"], 5);
        assert_eq!(json["plan"]["burst"]["rate"], 20.0);
        assert_eq!(json["kv_blocks"]["held_after_drain"], 0);
        assert!(json["definitions"]["fixed_overhead"].is_string());
        let md = r.markdown();
        assert!(
            md.contains("| burst | 40.0 | 50.0 | 16 | 11 | 5 | 5 | 4 | 0 |"),
            "{md}"
        );
        assert!(md.contains("back within 1.2x 20 s after the burst"), "{md}");
        assert!(
            md.contains("at most 2 admitted at once by the server's count (2 as the client"),
            "{md}"
        );
        assert!(md.contains("- http_429: 5 (e.g. HTTP 429"), "{md}");
    }

    #[test]
    fn plots_are_written() {
        let r = SoakReport::new(&options(plan(Some(BURST))), 10, &measurements());
        let dir = tempfile::tempdir().expect("tempdir");
        let files = r.plot(&dir.path().join("soak.png")).expect("plot");
        assert_eq!(files.len(), 2);
        assert!(files[1].ends_with("soak-latency.png"));
        for f in files {
            assert_eq!(&std::fs::read(&f).expect("png")[..4], b"\x89PNG");
        }
    }
}
