//! `switchyard bench serve`: measures any OpenAI-compatible server (Switchyard's, vLLM,
//! llama.cpp's) the way vLLM's `benchmark_serving` does; a progress bar on stderr, the
//! Markdown summary on stdout, the full report as JSON.

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use switchyard_bench::serve::synthetic::{
    synthetic_requests, SyntheticOptions, DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN,
};
use switchyard_bench::serve::{
    endpoint_url, run_serve, Arrivals, BenchRequest, Endpoint, RequestRate, ServeOptions, Slos,
    DEFAULT_REQUEST_TIMEOUT,
};
use switchyard_eval::sharegpt::{sample_requests, SampleOptions, DEFAULT_SEED};
use switchyard_tokenizer::Tokenizer;

use crate::load::resolve_text;
use crate::output::write_report;

/// vLLM's `--num-prompts` default.
const DEFAULT_NUM_PROMPTS: usize = 1000;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Dataset {
    /// First exchange of ShareGPT conversations, vLLM's filters (see --dataset-path).
    Sharegpt,
    /// Random-token prompts of --input-len tokens asking for --output-len tokens.
    Synthetic,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EndpointArg {
    /// POST /v1/completions
    Completions,
    /// POST /v1/chat/completions (the prompt as one user message)
    Chat,
}

#[derive(Args)]
pub struct ServeArgs {
    /// The server: http://HOST:PORT (or .../v1, or a full .../completions URL).
    #[arg(long)]
    url: String,
    /// The model name sent in every request.
    #[arg(long)]
    model: String,
    /// The tokenizer that counts prompt and answer tokens: a zoo model name or a GGUF /
    /// model folder path (default: --model, when that is one).
    #[arg(long)]
    tokenizer: Option<String>,
    #[arg(long, value_enum, default_value_t = Dataset::Sharegpt)]
    dataset: Dataset,
    /// The ShareGPT JSON file, or the zoo dataset's name.
    #[arg(long, default_value = "sharegpt")]
    dataset_path: String,
    #[arg(long, default_value_t = DEFAULT_NUM_PROMPTS)]
    num_prompts: usize,
    /// Requests per second, or inf to send them all at once.
    #[arg(long, default_value = "inf", value_parser = parse_rate)]
    request_rate: RequestRate,
    /// Gamma shape of the inter-arrival times: 1 is Poisson, lower is burstier.
    #[arg(long, default_value_t = switchyard_bench::serve::arrivals::DEFAULT_BURSTINESS)]
    burstiness: f64,
    /// Most requests in flight at once (later arrivals wait).
    #[arg(long)]
    max_concurrency: Option<NonZeroUsize>,
    /// Seeds the dataset sample and the arrival times.
    #[arg(long, default_value_t = DEFAULT_SEED)]
    seed: u64,
    /// Synthetic prompt length in tokens.
    #[arg(long, default_value_t = DEFAULT_INPUT_LEN)]
    input_len: usize,
    /// Synthetic output length in tokens.
    #[arg(long, default_value_t = DEFAULT_OUTPUT_LEN)]
    output_len: usize,
    #[arg(long, value_enum, default_value_t = EndpointArg::Completions)]
    endpoint: EndpointArg,
    /// Send ignore_eos: true, so every request generates its full length.
    #[arg(long)]
    ignore_eos: bool,
    /// A JSON object merged into every request body, e.g.
    /// '{"response_format": {"type": "json_object"}}' to measure constrained decoding.
    #[arg(long, value_name = "JSON")]
    extra_body: Option<String>,
    /// Service-level objectives for goodput, KEY:MS with KEY ttft, tpot or e2el
    /// (repeatable: --goodput ttft:500 tpot:50).
    #[arg(long, value_name = "KEY:MS", num_args = 1..)]
    goodput: Vec<String>,
    /// Seconds before a request counts as failed.
    #[arg(long, default_value_t = DEFAULT_REQUEST_TIMEOUT.as_secs())]
    request_timeout_s: u64,
    /// Sent as Authorization: Bearer KEY.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Skip the short request sent first to check the server answers.
    #[arg(long)]
    no_test_request: bool,
    /// Keep every request's timings in the JSON report.
    #[arg(long)]
    save_requests: bool,
    /// Write the report as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Also write the Markdown summary to FILE.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
}

fn parse_rate(s: &str) -> Result<RequestRate, String> {
    s.parse()
        .map_err(|e: switchyard_bench::BenchError| e.to_string())
}

pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    if a.num_prompts == 0 {
        anyhow::bail!("--num-prompts must be at least 1");
    }
    let endpoint = match a.endpoint {
        EndpointArg::Completions => Endpoint::Completions,
        EndpointArg::Chat => Endpoint::Chat,
    };
    let tokenizer_name = a.tokenizer.clone().unwrap_or_else(|| a.model.clone());
    let opts = ServeOptions {
        url: endpoint_url(&a.url, endpoint)?,
        endpoint,
        model: a.model.clone(),
        arrivals: Arrivals::new(a.request_rate, a.burstiness)?,
        max_concurrency: a.max_concurrency,
        seed: a.seed,
        ignore_eos: a.ignore_eos,
        extra_body: match &a.extra_body {
            None => serde_json::Map::new(),
            Some(text) => match serde_json::from_str(text)? {
                serde_json::Value::Object(m) => m,
                _ => anyhow::bail!("--extra-body must be a JSON object"),
            },
        },
        slos: Slos::parse(&a.goodput)?,
        request_timeout: Duration::from_secs(a.request_timeout_s.max(1)),
        api_key: a.api_key.clone(),
        test_request: !a.no_test_request,
        save_requests: a.save_requests,
        dataset: match a.dataset {
            Dataset::Sharegpt => a.dataset_path.clone(),
            Dataset::Synthetic => format!("synthetic ({} in, {} out)", a.input_len, a.output_len),
        },
        tokenizer: tokenizer_name.clone(),
    };
    let tokenizer = load_tokenizer(&tokenizer_name, a.tokenizer.is_some())?;
    let requests = prompts(&a, &tokenizer)?;
    eprintln!(
        "sending {} requests to {} at request rate {}{}",
        requests.len(),
        opts.url,
        opts.arrivals.request_rate(),
        a.max_concurrency
            .map_or(String::new(), |c| format!(", at most {c} at once"))
    );
    let bar = ProgressBar::new(requests.len() as u64).with_style(
        ProgressStyle::with_template(
            "bench serve {bar:30} {pos}/{len} requests, {msg} ({elapsed})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message("0 failed");
    let report = run_serve(&requests, &opts, |p| {
        bar.set_position(p.done as u64);
        bar.set_message(format!("{} failed", p.failed));
    })?;
    bar.finish_and_clear();
    write_report(
        &report.markdown(),
        &report,
        a.markdown.as_ref(),
        a.json.as_ref(),
    )
}

/// The tokenizer of `name` (a zoo model or a model file), which counts the prompts' tokens;
/// `explicit` when the user named it with `--tokenizer`.
pub(crate) fn load_tokenizer(name: &str, explicit: bool) -> anyhow::Result<Tokenizer> {
    let path = switchyard_zoo::resolve_model(name).map_err(|e| {
        if explicit {
            anyhow::Error::new(e)
        } else {
            anyhow::anyhow!(
                "--model {name} is not a zoo model or a model file, so it cannot count tokens: \
                 pass --tokenizer NAME|PATH ({e})"
            )
        }
    })?;
    let source =
        switchyard_weights::open(&path).with_context(|| format!("opening {}", path.display()))?;
    Tokenizer::from_source(&*source)
        .with_context(|| format!("reading the tokenizer of {}", path.display()))
}

fn prompts(a: &ServeArgs, tokenizer: &Tokenizer) -> anyhow::Result<Vec<BenchRequest>> {
    match a.dataset {
        Dataset::Sharegpt => sharegpt_prompts(&a.dataset_path, tokenizer, a.num_prompts, a.seed),
        Dataset::Synthetic => Ok(synthetic_requests(
            tokenizer,
            &SyntheticOptions {
                num_prompts: a.num_prompts,
                input_len: a.input_len,
                output_len: a.output_len,
                seed: a.seed,
            },
        )?),
    }
}

/// `num_prompts` first exchanges of the ShareGPT file at `path` (a path or URL), sampled with
/// vLLM's filters; fewer when fewer pass them, an error when none does.
pub(crate) fn sharegpt_prompts(
    path: &str,
    tokenizer: &Tokenizer,
    num_prompts: usize,
    seed: u64,
) -> anyhow::Result<Vec<BenchRequest>> {
    let data = resolve_text(path)?;
    let sample = sample_requests(&data, tokenizer, &SampleOptions { num_prompts, seed })
        .with_context(|| format!("sampling prompts from {}", data.display()))?;
    anyhow::ensure!(
        !sample.requests.is_empty(),
        "no ShareGPT prompt in {} passed the filters",
        data.display()
    );
    if sample.requests.len() < num_prompts {
        eprintln!(
            "only {} of {} records pass the filters",
            sample.requests.len(),
            sample.records
        );
    }
    Ok(sample.requests.iter().map(BenchRequest::from).collect())
}
