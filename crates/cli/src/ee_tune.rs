//! `switchyard ee-tune`: exit heads trained on the frozen model (EE-Tuning), with exit probes,
//! scored against the logit lens and the ridge fit on held-out text.

use std::path::PathBuf;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use switchyard_exit_training::calibrate::{default_every, exit_depths};
use switchyard_exit_training::corpus::Corpus;
use switchyard_exit_training::tune::run::{ee_tune, TuneConfig, TuneProgress, TuneTarget};
use switchyard_exits::heads::{model_ref, HeadKind};
use switchyard_exits::{file, fingerprint};
use switchyard_models::LoadOptions;

use crate::load::load_model;
use crate::output::write_json;

#[derive(Args)]
pub struct EeTuneArgs {
    /// Model name (see `switchyard models list`) or path to a GGUF file or model folder.
    #[arg(long, default_value = switchyard_zoo::DEFAULT_MODEL)]
    model: String,
    /// Exit depths, comma-separated (layers run before each exit; default: every
    /// n_layers / 8 layers).
    #[arg(long, value_delimiter = ',')]
    exits: Option<Vec<usize>>,
    /// `affine` (from the ridge solution), `mlp` (affine plus a residual MLP) or `block` (a
    /// transformer layer copied from the model's last, with its own K/V per sequence; trained
    /// one whole document per step).
    #[arg(long, default_value = "affine", value_parser = ["affine", "mlp", "block"])]
    head: String,
    /// `sharegpt`, another zoo dataset, or a text or ShareGPT JSON file.
    #[arg(long, default_value = "sharegpt")]
    corpus: String,
    /// Training rows (token positions).
    #[arg(long, default_value_t = switchyard_exit_training::tune::run::DEFAULT_TOKENS)]
    tokens: usize,
    /// Held-out rows scored.
    #[arg(long, default_value_t = switchyard_exit_training::tune::run::DEFAULT_EVAL_TOKENS)]
    eval_tokens: usize,
    #[arg(long, default_value_t = switchyard_exit_training::tune::run::DEFAULT_EPOCHS)]
    epochs: usize,
    #[arg(long, default_value_t = switchyard_exit_training::tune::run::DEFAULT_BATCH)]
    batch: usize,
    #[arg(long, default_value_t = switchyard_exit_training::tune::DEFAULT_LR)]
    lr: f64,
    /// Weight of the next token's cross-entropy added to the KL loss.
    #[arg(long, default_value_t = 0.0)]
    ce_weight: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where to write the heads (default: `<model>.exits.<head>.safetensors` beside the
    /// model; pass the model's `.exits.safetensors` to make them the default heads).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Start over instead of resuming the finished exits of an interrupted run with the
    /// same settings.
    #[arg(long)]
    restart: bool,
    /// Write the tables as Markdown to FILE (they always go to stderr).
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Write the report as JSON to FILE (stdout when omitted).
    #[arg(long, value_name = "FILE", num_args = 0..=1)]
    json: Option<Option<PathBuf>>,
}

pub fn run(a: EeTuneArgs) -> anyhow::Result<()> {
    let kind = match a.head.as_str() {
        "mlp" => HeadKind::Mlp,
        "affine" => HeadKind::Affine,
        "block" => HeadKind::Block,
        other => anyhow::bail!("--head {other}: use affine, mlp or block"),
    };
    let model_path = switchyard_zoo::resolve_model(&a.model)?;
    let loaded = load_model(&a.model, &LoadOptions::default())?;
    let n = loaded.model.n_layers();
    let fp = fingerprint::fingerprint(&model_path)?;
    let corpus = Corpus::resolve(&a.corpus)?;
    let depths = a
        .exits
        .clone()
        .unwrap_or_else(|| exit_depths(n, default_every(n)));
    let cfg = TuneConfig {
        tokens: a.tokens,
        eval_tokens: a.eval_tokens,
        epochs: a.epochs,
        batch: a.batch,
        lr: a.lr,
        ce_weight: a.ce_weight,
        seed: a.seed,
        ..TuneConfig::new(depths, kind)
    };
    let out = a.out.clone().unwrap_or_else(|| {
        file::sibling(
            &model_path,
            &format!(".exits.{}.safetensors", kind.as_str()),
        )
    });
    let checkpoint_dir = file::sibling(&out, ".ckpt");
    if a.restart && checkpoint_dir.exists() {
        std::fs::remove_dir_all(&checkpoint_dir)?;
    }
    eprintln!(
        "training {} heads at depths {:?} of {} on {} rows of {} ({} epochs, seed {})",
        kind.as_str(),
        cfg.depths,
        n,
        cfg.tokens,
        corpus.name(),
        cfg.epochs,
        cfg.seed
    );
    let target = TuneTarget {
        model: &loaded.model,
        tokenizer: &loaded.tokenizer,
        model_ref: model_ref(&loaded.model, &a.model, fp.sha256, fp.bytes),
        cache_dir: switchyard_zoo::home().join("tmp").join("ee-tune"),
        checkpoint_dir: Some(checkpoint_dir),
    };
    let pb = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{msg} {bar:40} {pos}/{len} ({per_sec}, eta {eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let started = std::time::Instant::now();
    let (heads, report) = ee_tune(&target, &corpus, &cfg, |p| match p {
        TuneProgress::Cache { split, rows, total } => {
            pb.set_message(format!("caching {split} hidden states"));
            pb.set_length(total as u64);
            pb.set_position(rows as u64);
        }
        TuneProgress::Train {
            depth,
            epoch,
            step,
            steps,
            loss,
        } => {
            pb.set_message(format!(
                "depth {depth} epoch {}/{} loss {loss:.3}",
                epoch + 1,
                cfg.epochs
            ));
            pb.set_length(steps as u64);
            pb.set_position(step as u64);
        }
        // `suspend` + `eprintln!`, not `pb.println`: the bar (and its `println`) is hidden when
        // stderr is not a terminal, which left redirected logs without any per-exit line.
        TuneProgress::Resumed { depth } => {
            pb.suspend(|| eprintln!("depth {depth}: resumed from its checkpoint"));
        }
        TuneProgress::Scored { depth } => {
            let s = started.elapsed().as_secs_f64();
            pb.suspend(|| eprintln!("depth {depth}: trained and scored ({s:.0} s into the run)"));
        }
    })?;
    pb.finish_and_clear();
    file::save(&heads, &out)?;
    let md = report.markdown();
    eprintln!("{md}");
    if let Some(p) = &a.markdown {
        std::fs::write(p, &md)?;
    }
    eprintln!("wrote {}", out.display());
    write_json(&a.json, &report)
}
