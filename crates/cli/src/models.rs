//! `switchyard models pull|list`.

use clap::{Args, Subcommand};
use serde::Serialize;
use switchyard_zoo::{AssetKind, PullOptions};

use crate::output::write_json;

#[derive(Subcommand)]
pub enum ModelsCommand {
    /// Fetch models (and datasets) into the cache. With no names, the default model.
    Pull(PullArgs),
    /// Show every known model and dataset, its size and whether it is present.
    List(ListArgs),
    /// Write a copy of a GGUF model with its weight matrices re-quantized to another type.
    Requantize(RequantizeArgs),
}

#[derive(Args)]
pub struct RequantizeArgs {
    /// Model name or GGUF path.
    #[arg(long)]
    model: String,
    /// Target type: q4_0, q4_1, q5_0, q8_0, q4_k, q6_k, f16 or f32.
    #[arg(long)]
    to: String,
    /// Output GGUF file.
    #[arg(long)]
    out: std::path::PathBuf,
}

#[derive(Args)]
pub struct PullArgs {
    /// Model or dataset names (see `switchyard models list`).
    names: Vec<String>,
    /// Every model and dataset in the catalog.
    #[arg(long, conflicts_with = "names")]
    all: bool,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(Args)]
pub struct ListArgs {
    /// Write the list as JSON to FILE (stdout when omitted).
    #[arg(long, value_name = "FILE", num_args = 0..=1)]
    json: Option<Option<std::path::PathBuf>>,
}

pub fn run(cmd: ModelsCommand) -> anyhow::Result<()> {
    match cmd {
        ModelsCommand::Pull(a) => pull(a),
        ModelsCommand::List(a) => list(a),
        ModelsCommand::Requantize(a) => requantize(a),
    }
}

fn requantize(a: RequantizeArgs) -> anyhow::Result<()> {
    use candle_core::quantized::GgmlDType;
    let target = match a.to.to_ascii_lowercase().as_str() {
        "q4_0" => GgmlDType::Q4_0,
        "q4_1" => GgmlDType::Q4_1,
        "q5_0" => GgmlDType::Q5_0,
        "q8_0" => GgmlDType::Q8_0,
        "q4_k" => GgmlDType::Q4K,
        "q6_k" => GgmlDType::Q6K,
        "f16" => GgmlDType::F16,
        "f32" => GgmlDType::F32,
        other => anyhow::bail!(
            "unknown type {other:?}; one of q4_0, q4_1, q5_0, q8_0, q4_k, q6_k, f16, f32"
        ),
    };
    let path = switchyard_zoo::resolve_model(&a.model)?;
    let src = switchyard_weights::GgufFile::open(&path)?;
    let bar = indicatif::ProgressBar::new(src.tensors().len() as u64).with_style(
        indicatif::ProgressStyle::with_template("requantize {bar:40} {pos}/{len} tensors")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    switchyard_weights::requantize::requantize(&src, &a.out, target, |done, _| {
        bar.set_position(done as u64)
    })?;
    bar.finish_and_clear();
    let size = std::fs::metadata(&a.out).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "wrote {} ({:.1} MB, {target:?})",
        a.out.display(),
        size as f64 / 1e6
    );
    Ok(())
}

fn pull(a: PullArgs) -> anyhow::Result<()> {
    let names: Vec<String> = if a.all {
        switchyard_zoo::catalog()
            .iter()
            .map(|x| x.name.to_string())
            .collect()
    } else if a.names.is_empty() {
        vec![switchyard_zoo::DEFAULT_MODEL.to_string()]
    } else {
        a.names
    };
    // Check every name before fetching anything.
    let assets = names
        .iter()
        .map(|n| {
            switchyard_zoo::find(n).ok_or_else(|| {
                anyhow::anyhow!(
                    "unknown model or dataset {n:?}; known: {}",
                    switchyard_zoo::catalog()
                        .iter()
                        .map(|x| x.name)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    for asset in assets {
        let present = switchyard_zoo::is_present(asset);
        let path = switchyard_zoo::pull(asset, &PullOptions { quiet: a.quiet })?;
        eprintln!(
            "{} {}: {}",
            if present { "present" } else { "fetched" },
            asset.name,
            path.display()
        );
    }
    Ok(())
}

#[derive(Serialize)]
struct Row {
    name: &'static str,
    kind: &'static str,
    size_bytes: u64,
    present: bool,
    path: String,
    description: &'static str,
}

fn list(a: ListArgs) -> anyhow::Result<()> {
    let rows: Vec<Row> = switchyard_zoo::status()
        .into_iter()
        .map(|s| Row {
            name: s.name,
            kind: match s.kind {
                AssetKind::Model => "model",
                AssetKind::Dataset => "dataset",
            },
            size_bytes: s.size,
            present: s.present,
            path: s.path.display().to_string(),
            description: s.architecture.unwrap_or(s.description),
        })
        .collect();
    if a.json.is_some() {
        return write_json(&a.json, &rows);
    }
    eprintln!("cache: {}", switchyard_zoo::home().display());
    println!(
        "{:<30} {:<8} {:>10}  {:<8} description",
        "name", "kind", "size", "present"
    );
    for r in rows {
        let default = if r.name == switchyard_zoo::DEFAULT_MODEL {
            " (default)"
        } else {
            ""
        };
        println!(
            "{:<30} {:<8} {:>7.1} MB  {:<8} {}{}",
            r.name,
            r.kind,
            r.size_bytes as f64 / 1e6,
            if r.present { "yes" } else { "no" },
            r.description,
            default
        );
    }
    Ok(())
}
