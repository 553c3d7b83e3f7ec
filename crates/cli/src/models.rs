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
    }
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
