//! `switchyard eval ppl`: perplexity and bits per byte of a text.

use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use switchyard_engine::ScoreOptions;
use switchyard_models::LoadOptions;

use crate::load::{load_model, resolve_text};
use crate::output::write_json;

#[derive(Subcommand)]
pub enum EvalCommand {
    /// Perplexity and bits per UTF-8 byte of a whole text file.
    Ppl(PplArgs),
    /// The exit study: agreement, confidence and exit depth at each exit layer.
    Exits(crate::exits::EvalExitsArgs),
}

#[derive(Args)]
pub struct PplArgs {
    #[arg(long, default_value = switchyard_zoo::DEFAULT_MODEL)]
    model: String,
    /// A text file, or a dataset name from `switchyard models list` (e.g. shakespeare).
    #[arg(long)]
    file: String,
    /// Most input tokens per forward pass (default: min(1024, context)).
    #[arg(long, default_value_t = 0)]
    window: usize,
    /// New tokens scored per window (default: half the window).
    #[arg(long, default_value_t = 0)]
    stride: usize,
    /// How the pass holds K/V: f32 (exact) or f16 (as the serving engine's f16 blocks).
    #[arg(long, default_value = "f32")]
    kv_format: switchyard_engine::KvFormat,
    /// Write the result as JSON to FILE (stdout when omitted).
    #[arg(long, value_name = "FILE", num_args = 0..=1)]
    json: Option<Option<std::path::PathBuf>>,
}

#[derive(Serialize)]
struct PplReport {
    model: String,
    file: String,
    tokens_scored: usize,
    bytes_scored: usize,
    bos_added: bool,
    window_tokens: usize,
    stride_tokens: usize,
    kv_format: switchyard_engine::KvFormat,
    mean_nll_nats: f64,
    perplexity: f64,
    bits_per_byte: f64,
    seconds: f64,
}

pub fn run(cmd: EvalCommand) -> anyhow::Result<()> {
    match cmd {
        EvalCommand::Ppl(a) => ppl(a),
        EvalCommand::Exits(a) => crate::exits::run_eval_exits(a),
    }
}

fn ppl(a: PplArgs) -> anyhow::Result<()> {
    let path = resolve_text(&a.file)?;
    let bytes = std::fs::read(&path)?;
    let text = String::from_utf8(bytes)
        .map_err(|e| anyhow::anyhow!("{} is not valid UTF-8: {e}", path.display()))?;
    let loaded = load_model(&a.model, &LoadOptions::default())?;
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("scoring {bar:40} {pos}/{len} tokens ({per_sec}, eta {eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let t0 = std::time::Instant::now();
    let opts = ScoreOptions {
        window: a.window,
        stride: a.stride,
        kv_format: a.kv_format,
    };
    let s = switchyard_engine::score_text(
        &loaded.model,
        &loaded.tokenizer,
        &text,
        opts,
        |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        },
    )?;
    bar.finish_and_clear();
    let report = PplReport {
        model: loaded.name,
        file: path.display().to_string(),
        tokens_scored: s.tokens_scored,
        bytes_scored: s.bytes_scored,
        bos_added: s.bos_added,
        window_tokens: s.window,
        stride_tokens: s.stride,
        kv_format: a.kv_format,
        mean_nll_nats: s.mean_nll_nats,
        perplexity: s.perplexity,
        bits_per_byte: s.bits_per_byte,
        seconds: t0.elapsed().as_secs_f64(),
    };
    eprintln!(
        "{}: {} tokens scored ({} bytes), mean NLL {:.4} nats, perplexity {:.3}, {:.4} bits per byte",
        report.file, report.tokens_scored, report.bytes_scored, report.mean_nll_nats, report.perplexity, report.bits_per_byte
    );
    write_json(&a.json, &report)
}
