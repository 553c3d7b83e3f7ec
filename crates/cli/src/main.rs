//! The `switchyard` command line: model fetching, generation, evaluation and benchmarks.
//!
//! Human-readable output goes to stderr; `--json [FILE]` writes machine-readable results to
//! FILE (stdout when omitted); generated text goes to stdout.

mod bench;
mod bench_helios;
mod bench_modes;
mod bench_serve;
mod bench_soak;
mod ee_tune;
mod eval;
mod exits;
mod generate;
mod load;
mod models;
mod offline;
mod output;
mod profile;
mod router;
mod serve;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "switchyard",
    version,
    about = "An LLM inference server that serves each request the best way"
)]
struct Cli {
    /// Worker threads for model compute (default: all cores).
    #[arg(long, global = true, env = "SWITCHYARD_THREADS")]
    threads: Option<usize>,
    /// Log more (-v: debug, -vv: trace). RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Fetch and list the built-in models and datasets.
    #[command(subcommand)]
    Models(models::ModelsCommand),
    /// Generate text from a prompt, streamed to stdout.
    Generate(generate::GenerateArgs),
    /// Measure quality.
    #[command(subcommand)]
    Eval(eval::EvalCommand),
    /// Measure speed.
    #[command(subcommand)]
    Bench(Box<bench::BenchCommand>),
    /// Fit the ModeSwitch router's policy to a measured mode matrix.
    #[command(subcommand)]
    Router(router::RouterCommand),
    /// Serve models over the OpenAI API (HTTP).
    Serve(serve::ServeArgs),
    /// Fit exit heads (tuned lens) for a model by ridge regression over a corpus.
    Calibrate(exits::CalibrateArgs),
    /// Measure a model's telemetry per exit depth (the HELIOS repository entry).
    Profile(profile::ProfileArgs),
    /// Train exit heads on the frozen model (EE-Tuning) with exit probes, and score them.
    EeTune(ee_tune::EeTuneArgs),
}

fn main() {
    let cli = Cli::parse();
    init_tracing(cli.verbose);
    if !switchyard_kernels::mem::tune_for_inference() {
        tracing::debug!("allocator thresholds left as they are (not glibc)");
    }
    let threads = init_threads(cli.threads);
    let result = match cli.command {
        Command::Models(c) => models::run(c),
        Command::Generate(a) => generate::run(a),
        Command::Eval(c) => eval::run(c),
        Command::Router(c) => router::run(c),
        Command::Bench(c) => bench::run(*c, threads),
        Command::Serve(a) => serve::run(a),
        Command::Calibrate(a) => exits::run_calibrate(a),
        Command::Profile(a) => profile::run(a, threads),
        Command::EeTune(a) => ee_tune::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn init_tracing(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Colours only on a terminal: a log collector reading a pipe gets plain `key=value`.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .init();
}

/// Sets the compute thread count before any thread pool starts; returns it.
fn init_threads(threads: Option<usize>) -> usize {
    let n = threads
        .filter(|&n| n > 0)
        .or_else(|| std::env::var("RAYON_NUM_THREADS").ok()?.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    // Both rayon and candle's GEMM read this; nothing has started a pool yet.
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    n
}
