//! `switchyard bench modes`: the mode × workload matrix of one model.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use switchyard_exits::file;
use switchyard_modes::bench::{self, ModesBenchOptions};
use switchyard_modes::gptq::GptqSettings;
use switchyard_modes::router_trace::{TraceClass, TraceOptions};
use switchyard_modes::serve::{ModeAssets, DEFAULT_SPEC_K};
use switchyard_modes::{assets, bench::ModesReport};
use switchyard_request::{Mode, Precision};
use switchyard_router::Gate;
use switchyard_tokenizer::Tokenizer;

use crate::output::write_json;

#[derive(Args)]
pub struct BenchModesArgs {
    #[arg(long, default_value = switchyard_zoo::DEFAULT_MODEL)]
    model: String,
    /// Modes to measure (comma-separated; default all). f16 is always measured: every ratio
    /// is taken against it.
    #[arg(long, value_delimiter = ',')]
    modes: Option<Vec<Mode>>,
    /// Draft model of the `speculative` mode (same tokenizer as --model).
    #[arg(long)]
    draft: Option<String>,
    /// Exit heads of `self-speculative` (default: `<model>.exits.safetensors`).
    #[arg(long)]
    heads: Option<PathBuf>,
    /// Exit depth `self-speculative` drafts from (default: 3/4 of the layers).
    #[arg(long)]
    draft_depth: Option<usize>,
    /// Tokens drafted per round by the speculative modes.
    #[arg(long, default_value_t = DEFAULT_SPEC_K)]
    spec_k: usize,
    /// Longest sequence (prompt + output) each engine serves, below the model's context: the
    /// workspace of modes without chunked prefill is sized for it.
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Requests per shape workload (SS, SL, LS, LL).
    #[arg(long, default_value_t = 3)]
    requests: usize,
    #[arg(long, default_value_t = 16)]
    batch_requests: usize,
    /// Workloads to run (comma-separated; default all): SS, SL, LS, LL, shared-prefix,
    /// memory-pressure, batch.
    #[arg(long, value_delimiter = ',')]
    workloads: Option<Vec<String>>,
    /// Memory budget of each mode, MiB.
    #[arg(long, default_value_t = 2048)]
    budget_mib: u64,
    /// Share of the budget claimed by something else in the memory-pressure workload.
    #[arg(long, default_value_t = 0.7)]
    pressure_claim: f64,
    /// Items per multiple-choice task (ARC-Challenge, HellaSwag, MMLU).
    #[arg(long, default_value_t = 20)]
    mc_items: usize,
    #[arg(long, default_value_t = 5)]
    gsm8k_items: usize,
    /// Tokens of held-out ShareGPT text each precision's bits per byte is measured on
    /// (32,768 tokens are about 120,000 bytes for SmolLM2's tokenizer).
    #[arg(long, default_value_t = 32_768)]
    bpb_tokens: usize,
    /// GPTQ's dampening, as a fraction of the Hessian's mean diagonal (`q4-gptq`).
    #[arg(long, default_value_t = GptqSettings::default().damp)]
    gptq_damp: f64,
    /// GPTQ's calibration documents (ShareGPT calibration split, 256 tokens each).
    #[arg(long, default_value_t = GptqSettings::default().docs)]
    gptq_docs: usize,
    /// Run GPTQ on `q4-awq`'s activation-aware scaled weights.
    #[arg(long)]
    gptq_awq_scales: bool,
    /// Visit GPTQ's columns in order, each block's grid taken from the weights as GPTQ
    /// reaches it, instead of act-order (with the order chosen per matrix, the order kept on
    /// a tie).
    #[arg(long)]
    gptq_no_act_order: bool,
    /// Take every matrix group's Hessian on the float layer's inputs, instead of quantizing a
    /// layer's groups in turn, each on the inputs the quantized groups before it give
    /// (GPTQ's "true sequential", the default).
    #[arg(long)]
    gptq_no_true_sequential: bool,
    /// With act-order, take the block grids from the original weights, instead of choosing
    /// each when GPTQ first reaches one of its columns, from the weights as they stand then.
    #[arg(long)]
    gptq_static_groups: bool,
    /// Quantize every matrix in one order (act-order, or columns with
    /// `--gptq-no-act-order`), instead of running both and keeping the one with the lower
    /// output error on further calibration documents that no Hessian is fitted to.
    #[arg(long)]
    gptq_fixed_order: bool,
    /// Measure only the latency cells and take every mode's quality (bits per byte,
    /// accuracies, paired intervals) from FILE, a report of this command for the same model:
    /// to fit a router to another machine's speeds without measuring quality again.
    #[arg(long, value_name = "FILE")]
    quality_from: Option<PathBuf>,
    /// Write the report as JSON to FILE (stdout when omitted).
    #[arg(long, value_name = "FILE", num_args = 0..=1)]
    json: Option<Option<PathBuf>>,
    /// Also write the Markdown report to FILE.
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Write PNG charts into DIR.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Measure nothing: read a report this command wrote (JSON) and write its Markdown and
    /// charts again.
    #[arg(long, value_name = "FILE")]
    render: Option<PathBuf>,
}

pub fn run(a: BenchModesArgs, threads: usize) -> anyhow::Result<()> {
    let mut modes = a.modes.clone().unwrap_or_else(|| Mode::ALL.to_vec());
    if !modes.contains(&Mode::F16) {
        modes.insert(0, Mode::F16);
    }
    let r: ModesReport = match &a.render {
        Some(path) => read_report(path)?,
        None => {
            let mut opts = options(&a, modes.clone());
            if let Some(path) = &a.quality_from {
                opts.quality_from = Some(bench::BorrowedQuality {
                    source: path.display().to_string(),
                    report: read_report(path)?,
                });
            }
            let assets = assets(&a, &modes)?;
            let started = std::time::Instant::now();
            bench::run(&assets, threads, &opts, |m| {
                eprintln!("[{:>6.0} s] {m}", started.elapsed().as_secs_f64())
            })?
        }
    };
    let md = r.markdown();
    eprintln!("{md}");
    if let Some(p) = &a.markdown {
        std::fs::write(p, &md).with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(dir) = &a.plot {
        for p in r.plot(dir)? {
            eprintln!("wrote {}", p.display());
        }
    }
    write_json(&a.json, &r)
}

#[derive(Args)]
pub struct BenchRouterArgs {
    /// The matrix `bench modes --json` wrote for the same model (and the same options).
    #[arg(long)]
    matrix: PathBuf,
    /// Save the learned routers into DIR (`tree.json`, `forest.json`, `logistic.json`), for
    /// the server's `[modeswitch] learned_router`.
    #[arg(long, value_name = "DIR")]
    save_routers: Option<PathBuf>,
    /// Requests of the Poisson trace every router is also replayed on (0: no trace).
    #[arg(long, default_value_t = 200)]
    trace_requests: usize,
    /// Mean arrivals per second of the trace.
    #[arg(long, default_value_t = 1.0)]
    trace_rate: f64,
    /// Class mix of the trace: chat, long-generation, shared-prefix, long-prompt, math,
    /// multiple-choice, as `class=weight,...`.
    #[arg(long, default_value = switchyard_modes::router_trace::DEFAULT_MIX)]
    trace_mix: String,
    #[arg(long, default_value_t = 1)]
    trace_seed: u64,
    /// Fixed modes replayed on the trace (comma-separated; default: every fixed mode that
    /// passes the gate for every class of the one-at-a-time table).
    #[arg(long, value_delimiter = ',')]
    trace_fixed: Option<Vec<Mode>>,
    /// Other routers replayed on the trace, by kind: rules, fitted, learned, oracle
    /// (comma-separated; default: all).
    #[arg(long, value_delimiter = ',')]
    trace_routers: Option<Vec<String>>,
    /// Replays of the trace per router, in rounds with the order rotated, so that the
    /// report can give each router's spread and round-by-round speedups.
    #[arg(long, default_value_t = 1)]
    trace_repeats: usize,
    #[command(flatten)]
    gate: GateArgs,
    #[command(flatten)]
    modes: BenchModesArgs,
}

/// The quality gate's bounds (`[router.gate]`).
#[derive(Args)]
pub struct GateArgs {
    /// Read the gate from the `[router.gate]` table of this TOML file (the flags below
    /// override its bounds).
    #[arg(long, value_name = "FILE")]
    gate: Option<PathBuf>,
    /// Largest relative bits-per-byte increase over f16 (0.05 = +5 %).
    #[arg(long)]
    max_bpb_increase: Option<f64>,
    /// The lower end of each paired 95 % accuracy interval must be above minus this.
    #[arg(long)]
    max_accuracy_drop: Option<f64>,
}

impl GateArgs {
    pub fn gate(&self) -> anyhow::Result<Gate> {
        #[derive(serde::Deserialize)]
        struct File {
            router: Table,
        }
        #[derive(serde::Deserialize)]
        struct Table {
            #[serde(default)]
            gate: Gate,
        }
        let mut gate = match &self.gate {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading {}", p.display()))?;
                toml::from_str::<File>(&text)
                    .with_context(|| format!("{}: [router.gate]", p.display()))?
                    .router
                    .gate
            }
            None => Gate::default(),
        };
        if let Some(b) = self.max_bpb_increase {
            gate.max_bpb_increase = b;
        }
        if let Some(d) = self.max_accuracy_drop {
            gate.max_accuracy_drop_points = d;
        }
        gate.validate()?;
        Ok(gate)
    }
}

/// `switchyard bench router`: the mixed workload under fixed f16, rules, learned routers
/// and the oracle.
pub fn run_router(a: BenchRouterArgs, _threads: usize) -> anyhow::Result<()> {
    if a.modes.quality_from.is_some() {
        anyhow::bail!("--quality-from belongs to `bench modes`: `bench router` takes every mode's quality from --matrix");
    }
    let matrix = read_report(&a.matrix)?;
    let modes: Vec<Mode> = matrix.quality.iter().map(|q| q.mode).collect();
    let assets = assets(&a.modes, &modes)?;
    let opts = options(&a.modes, modes);
    let started = std::time::Instant::now();
    if let Some(dir) = &a.save_routers {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let gate = a.gate.gate()?;
    let trace = TraceOptions {
        requests: a.trace_requests,
        rate: a.trace_rate,
        mix: TraceClass::parse_mix(&a.trace_mix)?,
        seed: a.trace_seed,
        fixed: a.trace_fixed.clone().unwrap_or_default(),
        routers: a.trace_routers.clone().unwrap_or_default(),
        repeats: a.trace_repeats,
    };
    trace.validate()?;
    let r = switchyard_modes::router_bench::run(
        &assets,
        &matrix,
        &opts,
        &gate,
        Some(&trace),
        a.save_routers.as_deref(),
        |m| eprintln!("[{:>6.0} s] {m}", started.elapsed().as_secs_f64()),
    )?;
    let md = r.markdown();
    eprintln!("{md}");
    if let Some(p) = &a.modes.markdown {
        std::fs::write(p, &md).with_context(|| format!("writing {}", p.display()))?;
    }
    write_json(&a.modes.json, &r)
}

fn read_report(path: &std::path::Path) -> anyhow::Result<ModesReport> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{} is not a bench modes report", path.display()))
}

fn options(a: &BenchModesArgs, modes: Vec<Mode>) -> ModesBenchOptions {
    ModesBenchOptions {
        modes,
        requests: a.requests,
        batch_requests: a.batch_requests,
        budget: a.budget_mib << 20,
        pressure_claim: a.pressure_claim,
        mc_items: a.mc_items,
        gsm8k_items: a.gsm8k_items,
        bpb_tokens: a.bpb_tokens,
        only: a.workloads.clone().unwrap_or_default(),
        quality_from: None,
    }
}

fn assets(a: &BenchModesArgs, modes: &[Mode]) -> anyhow::Result<ModeAssets> {
    let path = switchyard_zoo::resolve_model(&a.model)?;
    let source = switchyard_weights::open(&path)?;
    let tokenizer = Arc::new(Tokenizer::from_source(&*source)?);
    let draft = match &a.draft {
        Some(d) => Some(switchyard_weights::open(switchyard_zoo::resolve_model(d)?)?),
        None => None,
    };
    let modes = modes.to_vec();
    if modes.contains(&Mode::Speculative) && draft.is_none() {
        eprintln!("speculative: no --draft given; its cells will say so");
    }
    let heads = if modes.contains(&Mode::SelfSpeculative) {
        let heads_path = a
            .heads
            .clone()
            .unwrap_or_else(|| file::default_heads_path(&path));
        match assets::self_speculative_heads(&path, Arc::clone(&source), &heads_path, a.draft_depth)
        {
            Ok((heads, depth)) => {
                eprintln!("self-speculative: drafting from the exit at layer {depth}");
                Some((heads, depth))
            }
            Err(e) => {
                eprintln!("self-speculative: {e}; its cells will say so");
                None
            }
        }
    } else {
        None
    };
    let awq = if modes.contains(&Mode::Q4Awq) {
        let pb = bar("AWQ calibration (layers)");
        let c = assets::calibrate_awq(Arc::clone(&source), &tokenizer, |d, n| {
            pb.set_length(n as u64);
            pb.set_position(d as u64);
        })?;
        pb.finish_and_clear();
        let (plain, scaled) = c.total_error();
        eprintln!(
            "AWQ: {} calibration tokens; product error on them {:.4e} -> {:.4e} ({:+.1}%)",
            c.calibration_tokens,
            plain,
            scaled,
            100.0 * (scaled / plain - 1.0)
        );
        Some(Arc::new(c))
    } else {
        None
    };
    let gptq = if modes.iter().any(|m| m.precision() == Precision::Q4Gptq) {
        let pb = bar("GPTQ calibration (layers)");
        let settings = GptqSettings {
            damp: a.gptq_damp,
            docs: a.gptq_docs,
            awq_scales: a.gptq_awq_scales,
            act_order: !a.gptq_no_act_order,
            true_sequential: !a.gptq_no_true_sequential,
            dynamic_groups: !a.gptq_static_groups,
            choose_order: !a.gptq_fixed_order,
            ..GptqSettings::default()
        };
        let t0 = std::time::Instant::now();
        let (c, cached) = assets::calibrate_gptq(
            Arc::clone(&source),
            &tokenizer,
            &settings,
            &assets::gptq_cache_dir(),
            |d, n| {
                pb.set_length(n as u64);
                pb.set_position(d as u64);
            },
        )?;
        pb.finish_and_clear();
        let (rtn, gptq) = c.total_error();
        let (outliers, rows) = c.outlier_rows();
        eprintln!(
            "GPTQ: {} ({:.1} s); {} calibration tokens ({outliers} of {rows} layer-input rows left out as outliers); output error on the others {:.4e} -> {:.4e} ({:+.1}%) against round-to-nearest",
            if cached { "read from the cache" } else { "calibrated" },
            t0.elapsed().as_secs_f64(),
            c.calibration_tokens,
            rtn,
            gptq,
            100.0 * (gptq / rtn - 1.0)
        );
        if c.settings.choose_order {
            let act = c.reports.iter().filter(|r| r.act_order).count();
            eprintln!(
                "GPTQ: act-order kept on {act} of {} matrices, column order on the others (the lower output error on {} selection documents)",
                c.reports.len(),
                c.settings.select_docs
            );
        }
        Some(Arc::new(c))
    } else {
        None
    };
    Ok(ModeAssets {
        name: a.model.clone(),
        source,
        tokenizer,
        draft,
        heads,
        awq,
        gptq,
        spec_k: a.spec_k,
        max_model_len: a.max_model_len,
    })
}

fn bar(msg: &'static str) -> ProgressBar {
    let pb = ProgressBar::new(0);
    pb.set_style(
        ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} [{elapsed}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.set_message(msg);
    pb
}
