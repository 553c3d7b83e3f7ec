//! `switchyard bench engine`.

use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use switchyard_bench::engine::{bench_engine, EngineBenchOptions};
use switchyard_models::LoadOptions;

use crate::load::load_model;
use crate::output::write_json;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Prompt and decode tokens/s at batch 1 (median of several runs).
    Engine(EngineArgs),
}

#[derive(Args)]
pub struct EngineArgs {
    #[arg(long, default_value = switchyard_zoo::DEFAULT_MODEL)]
    model: String,
    #[arg(long, default_value_t = switchyard_bench::engine::DEFAULT_PROMPT_TOKENS)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = switchyard_bench::engine::DEFAULT_DECODE_TOKENS)]
    decode_tokens: usize,
    #[arg(long, default_value_t = switchyard_bench::engine::DEFAULT_RUNS)]
    runs: usize,
    /// Run only the first N layers and read logits there (fixed-depth decoding).
    #[arg(long)]
    depth: Option<usize>,
    /// Write the result as JSON to FILE (stdout when omitted).
    #[arg(long, value_name = "FILE", num_args = 0..=1)]
    json: Option<Option<std::path::PathBuf>>,
}

pub fn run(cmd: BenchCommand, threads: usize) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Engine(a) => engine(a, threads),
    }
}

fn engine(a: EngineArgs, threads: usize) -> anyhow::Result<()> {
    let opts = LoadOptions {
        layers: a.depth,
        ..LoadOptions::default()
    };
    let loaded = load_model(&a.model, &opts)?;
    let bar = ProgressBar::new(a.runs as u64).with_style(
        ProgressStyle::with_template("bench {bar:30} run {pos}/{len} ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let bopts = EngineBenchOptions {
        prompt_tokens: a.prompt_tokens,
        decode_tokens: a.decode_tokens,
        runs: a.runs,
        depth: a.depth,
    };
    let r = bench_engine(
        &loaded.model,
        &loaded.tokenizer,
        &loaded.name,
        &bopts,
        threads,
        |i, _| bar.set_position(i as u64),
    )?;
    bar.finish_and_clear();
    eprintln!(
        "{} ({} threads, depth {}/{}): prompt {} tokens: {:.1} tokens/s | decode {} tokens: {:.1} tokens/s (median of {})",
        r.model, r.threads, r.depth, r.n_layers, r.prompt_tokens, r.prompt_tokens_per_s, r.decode_tokens, r.decode_tokens_per_s, r.runs
    );
    write_json(&a.json, &r)
}
