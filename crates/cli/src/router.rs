//! `switchyard router fit`: the ModeSwitch rule policy fitted to a measured matrix.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use switchyard_modes::bench::ModesReport;
use switchyard_modes::router_bench::matrix_of;
use switchyard_router::{fit, Constraints, ModeMatrix, RuleConfig};

use crate::bench_modes::GateArgs;

#[derive(Subcommand)]
pub enum RouterCommand {
    /// Write, for each class of requests, the fastest mode that passes the quality gate on a
    /// measured matrix, as `[router]` rules the server reads (`[router] policy_file`).
    Fit(FitArgs),
}

#[derive(Args)]
pub struct FitArgs {
    /// The matrix: a `bench modes --json` report, or a mode matrix (`{"cells": ...}`).
    #[arg(long)]
    matrix: PathBuf,
    /// Where to write the policy (TOML).
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    gate: GateArgs,
}

pub fn run(c: RouterCommand) -> anyhow::Result<()> {
    match c {
        RouterCommand::Fit(a) => run_fit(a),
    }
}

/// A `bench modes` report (turned into the matrix the oracle reads) or a bare matrix.
fn read_matrix(path: &std::path::Path) -> anyhow::Result<ModeMatrix> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    if value.get("cells").is_some_and(|c| c.is_object()) {
        return Ok(ModeMatrix::from_json(&text)?);
    }
    let report: ModesReport = serde_json::from_value(value).with_context(|| {
        format!(
            "{} is neither a bench modes report nor a mode matrix",
            path.display()
        )
    })?;
    Ok(matrix_of(&report))
}

fn run_fit(a: FitArgs) -> anyhow::Result<()> {
    let matrix = read_matrix(&a.matrix)?;
    let gate = a.gate.gate()?;
    let report = fit(
        &matrix,
        &Constraints::default(),
        &gate,
        RuleConfig::default(),
    )?;
    eprintln!("{}", report.markdown());
    let text = report.policy_toml(&a.matrix.display().to_string())?;
    std::fs::write(&a.out, text).with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!("wrote {}", a.out.display());
    Ok(())
}
