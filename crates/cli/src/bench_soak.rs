//! `switchyard bench soak`: a running server held under ShareGPT traffic for a bounded time,
//! with an optional overload burst; a progress bar over the duration on stderr, the Markdown
//! summary on stdout, the report as JSON and PNG.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use switchyard_bench::serve::{endpoint_url, Endpoint};
use switchyard_bench::soak::{
    metrics_url, run_soak, Burst, PlanInput, RateSpec, SoakOptions, SoakPlan, DEFAULT_LOAD_FRACTION,
};
use switchyard_eval::sharegpt::DEFAULT_SEED;

use crate::bench_serve::{load_tokenizer, sharegpt_prompts, EndpointArg};
use crate::output::write_report;

/// Distinct prompts sampled (vLLM's `--num-prompts` default); the run cycles through them.
const DEFAULT_NUM_PROMPTS: usize = 1000;
/// The server's own request timeout (`[server] request_timeout_s`).
const DEFAULT_REQUEST_TIMEOUT_S: u64 = 600;

#[derive(Args)]
pub struct SoakArgs {
    /// The server: http://HOST:PORT (or .../v1, or a full .../completions URL).
    #[arg(long)]
    url: String,
    /// The server's process id, whose resident memory is read from /proc/PID/status.
    #[arg(long)]
    server_pid: u32,
    /// The server's Prometheus endpoint (default: /metrics on --url's host).
    #[arg(long)]
    metrics_url: Option<String>,
    /// The model name sent in every request.
    #[arg(long)]
    model: String,
    /// The tokenizer that samples the prompts: a zoo model name or a GGUF / model folder
    /// path (default: --model).
    #[arg(long)]
    tokenizer: Option<String>,
    /// The ShareGPT JSON file, or the zoo dataset's name.
    #[arg(long, default_value = "sharegpt")]
    dataset_path: String,
    /// Distinct prompts sampled from the dataset; the run cycles through them.
    #[arg(long, default_value_t = DEFAULT_NUM_PROMPTS)]
    num_prompts: usize,
    /// Cap on max_tokens (default: each dataset answer's length).
    #[arg(long)]
    max_tokens: Option<usize>,
    #[arg(long, value_enum, default_value_t = EndpointArg::Completions)]
    endpoint: EndpointArg,
    /// Requests per second (Poisson arrivals).
    #[arg(
        long,
        required_unless_present = "saturation_rate",
        conflicts_with = "saturation_rate"
    )]
    request_rate: Option<f64>,
    /// The server's saturation rate in requests/s (completed requests/s of `bench serve
    /// --request-rate inf`); the run sends --load-fraction of it.
    #[arg(long)]
    saturation_rate: Option<f64>,
    #[arg(long, default_value_t = DEFAULT_LOAD_FRACTION, requires = "saturation_rate")]
    load_fraction: f64,
    /// Seconds of traffic (the figure run is 3600).
    #[arg(long)]
    duration_s: f64,
    /// Seconds left out of the memory-growth fit (default: 10% of the duration).
    #[arg(long)]
    warmup_s: Option<f64>,
    /// Latency windows in seconds (default 300).
    #[arg(long)]
    window_s: Option<f64>,
    /// When the overload burst starts, in seconds from the start.
    #[arg(long, requires_all = ["burst_s", "burst_rate"])]
    burst_at_s: Option<f64>,
    /// How long the burst lasts, in seconds.
    #[arg(long, requires = "burst_at_s")]
    burst_s: Option<f64>,
    /// Requests per second of the burst, on top of the steady ones (e.g. 10x saturation).
    #[arg(long, requires = "burst_at_s")]
    burst_rate: Option<f64>,
    /// Seeds the prompt sample and the arrival times.
    #[arg(long, default_value_t = DEFAULT_SEED)]
    seed: u64,
    /// Seconds before a request counts as failed.
    #[arg(long, default_value_t = DEFAULT_REQUEST_TIMEOUT_S)]
    request_timeout_s: u64,
    /// Sent as Authorization: Bearer KEY.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Write the report as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Write the Markdown summary to FILE.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
    /// Draw resident memory to FILE.png and P99 latency per window to FILE-latency.png.
    #[arg(long, value_name = "FILE.png")]
    plot: Option<PathBuf>,
}

pub fn run(a: SoakArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.num_prompts > 0, "--num-prompts must be at least 1");
    anyhow::ensure!(a.max_tokens != Some(0), "--max-tokens must be at least 1");
    let rate = match (a.request_rate, a.saturation_rate) {
        (Some(r), _) => RateSpec::PerSecond(r),
        (None, Some(saturation)) => RateSpec::OfSaturation {
            saturation,
            fraction: a.load_fraction,
        },
        (None, None) => anyhow::bail!("give --request-rate or --saturation-rate"),
    };
    let burst = match (a.burst_at_s, a.burst_s, a.burst_rate) {
        (Some(at_s), Some(length_s), Some(rate)) => Some(Burst {
            at_s,
            length_s,
            rate,
        }),
        (None, None, None) => None,
        _ => anyhow::bail!("a burst needs --burst-at-s, --burst-s and --burst-rate"),
    };
    let plan = SoakPlan::new(PlanInput {
        rate,
        duration_s: a.duration_s,
        warmup_s: a.warmup_s,
        window_s: a.window_s,
        burst,
    })?;
    let endpoint = match a.endpoint {
        EndpointArg::Completions => Endpoint::Completions,
        EndpointArg::Chat => Endpoint::Chat,
    };
    let url = endpoint_url(&a.url, endpoint)?;
    let metrics_url = metrics_url(&a.url, a.metrics_url.as_deref())?;
    let tokenizer_name = a.tokenizer.clone().unwrap_or_else(|| a.model.clone());
    let tokenizer = load_tokenizer(&tokenizer_name, a.tokenizer.is_some())?;
    let prompts = sharegpt_prompts(&a.dataset_path, &tokenizer, a.num_prompts, a.seed)?;
    let opts = SoakOptions {
        url,
        metrics_url,
        endpoint,
        model: a.model.clone(),
        server_pid: a.server_pid,
        plan,
        max_tokens: a.max_tokens,
        seed: a.seed,
        request_timeout: Duration::from_secs(a.request_timeout_s.max(1)),
        api_key: a.api_key.clone(),
        dataset: a.dataset_path.clone(),
        tokenizer: tokenizer_name,
    };
    eprintln!(
        "soaking {} (pid {}) for {} s at {:.3} req/s{}",
        opts.url,
        opts.server_pid,
        opts.plan.duration_s(),
        opts.plan.request_rate(),
        opts.plan.burst().map_or(String::new(), |b| format!(
            ", burst of {} req/s from {} s for {} s",
            b.rate, b.at_s, b.length_s
        ))
    );
    let duration = opts.plan.duration_s();
    let bar = ProgressBar::new(duration.ceil() as u64).with_style(
        ProgressStyle::with_template("bench soak {bar:30} {pos}/{len} s, {msg} ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let report = run_soak(&prompts, &opts, |p| {
        bar.set_position(p.elapsed_s.min(duration) as u64);
        let draining = if p.elapsed_s > duration {
            format!(", draining {}", p.sent - p.completed - p.failed)
        } else {
            String::new()
        };
        bar.set_message(format!(
            "{}/{} sent, {} completed, {} failed{draining}",
            p.sent, p.scheduled, p.completed, p.failed
        ));
    })?;
    bar.finish_and_clear();
    write_report(
        &report.markdown(),
        &report,
        a.markdown.as_ref(),
        a.json.as_ref(),
    )?;
    if let Some(path) = &a.plot {
        for p in report.plot(path)? {
            eprintln!("wrote {}", p.display());
        }
    }
    Ok(())
}
