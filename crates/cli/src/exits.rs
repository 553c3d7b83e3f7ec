//! Early exit on the command line: `calibrate`, `eval exits`, `bench exits` and
//! `generate --early-exit per-token`.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use switchyard_exit_study::bench::{bench_exits, BenchTarget, ExitBenchOptions};
use switchyard_exit_study::study::{self, PairReport, StudyModel, StudyReport};
use switchyard_exit_study::{ExitPolicy, KvFix};
use switchyard_exit_training::calibrate::{
    calibrate, default_every, exit_depths, CalibrationConfig, CalibrationTarget,
};
use switchyard_exit_training::corpus::{Corpus, Split};
use switchyard_exit_training::tune::cost::CheckCost;
use switchyard_exits::heads::model_ref;
use switchyard_exits::{file, fingerprint, ConfidenceMeasure, ExitHeads};
use switchyard_models::LoadOptions;
use switchyard_request::SamplingParams;

use crate::load::{load_model, resolve_text, Loaded};
use crate::output::write_json;

fn bar(template: &str) -> ProgressBar {
    ProgressBar::new(0).with_style(
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()),
    )
}

fn measure(s: &str) -> anyhow::Result<ConfidenceMeasure> {
    ConfidenceMeasure::parse(s)
        .ok_or_else(|| anyhow::anyhow!("unknown confidence {s:?}: max-prob or margin"))
}

/// An exit decision: a confidence measure, or `probe` (the exit probes of `ee-tune` heads;
/// the threshold then applies to the probe's probability).
fn decision(s: &str) -> anyhow::Result<(ConfidenceMeasure, bool)> {
    match s {
        "probe" => Ok((ConfidenceMeasure::MaxProb, true)),
        other => Ok((measure(other)?, false)),
    }
}

fn kv_fix(s: &str) -> anyhow::Result<KvFix> {
    KvFix::parse(s).ok_or_else(|| anyhow::anyhow!("unknown KV fix {s:?}: recompute or propagate"))
}

fn write_text(path: &Option<PathBuf>, text: &str) -> anyhow::Result<()> {
    if let Some(p) = path {
        std::fs::write(p, text).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

#[derive(Args)]
pub struct CalibrateArgs {
    /// Model name (see `switchyard models list`) or path to a GGUF file or model folder.
    #[arg(long, default_value = switchyard_zoo::DEFAULT_MODEL)]
    model: String,
    /// `sharegpt`, another zoo dataset, or a text or ShareGPT JSON file.
    #[arg(long, default_value = "sharegpt")]
    corpus: String,
    /// Token positions to calibrate on.
    #[arg(long, default_value_t = switchyard_exit_training::calibrate::DEFAULT_TOKENS)]
    tokens: usize,
    /// An exit every K layers (default: n_layers / 8).
    #[arg(long, value_name = "K", conflicts_with = "depths")]
    every: Option<usize>,
    /// Exit depths, comma-separated (layers run before each exit).
    #[arg(long, value_delimiter = ',')]
    depths: Option<Vec<usize>>,
    /// Most tokens taken from one conversation or text chunk.
    #[arg(long, default_value_t = switchyard_exit_training::corpus::DEFAULT_DOC_TOKENS)]
    doc_tokens: usize,
    /// Where to write the heads (default: `<model>.exits.safetensors` beside the model).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write the heads' metadata as JSON to FILE (stdout when omitted).
    #[arg(long, value_name = "FILE", num_args = 0..=1)]
    json: Option<Option<PathBuf>>,
}

pub fn run_calibrate(a: CalibrateArgs) -> anyhow::Result<()> {
    let model_path = switchyard_zoo::resolve_model(&a.model)?;
    let loaded = load_model(&a.model, &LoadOptions::default())?;
    let n_layers = loaded.model.n_layers();
    let fp = fingerprint::fingerprint(&model_path)?;
    let corpus = Corpus::resolve(&a.corpus)?;
    let depths = match a.depths {
        Some(d) => d,
        None => exit_depths(n_layers, a.every.unwrap_or_else(|| default_every(n_layers))),
    };
    let cfg = CalibrationConfig {
        depths,
        max_tokens: a.tokens,
        doc_tokens: a.doc_tokens,
        ..CalibrationConfig::new(n_layers)
    };
    eprintln!(
        "calibrating exits at depths {:?} of {} on {} tokens of {}",
        cfg.depths,
        n_layers,
        cfg.max_tokens,
        corpus.name()
    );
    let pb = bar("calibrate {bar:40} {pos}/{len} tokens ({per_sec}, eta {eta})");
    pb.set_length(cfg.max_tokens as u64);
    let mref = model_ref(&loaded.model, &a.model, fp.sha256, fp.bytes);
    let target = CalibrationTarget {
        model: &loaded.model,
        tokenizer: &loaded.tokenizer,
        model_ref: mref,
    };
    let heads = calibrate(&target, &corpus, &cfg, |p| pb.set_position(p.tokens))?;
    pb.finish_and_clear();
    let out = a
        .out
        .unwrap_or_else(|| file::default_heads_path(&model_path));
    file::save(&heads, &out)?;
    let meta = heads.meta();
    if let Some(c) = &meta.calibration {
        eprintln!(
            "{} tokens from {} documents in {:.1} s ({:.0} tokens/s)",
            c.tokens,
            c.sequences,
            c.seconds,
            c.tokens as f64 / c.seconds
        );
    }
    eprintln!("depth  lambda_rel  R² affine  R² identity (validation)");
    for h in &meta.heads {
        let f = |x: Option<f64>| x.map_or("–".to_string(), |v| format!("{v:.3}"));
        eprintln!(
            "{:>5}  {:>10}  {:>9}  {:>11}",
            h.depth,
            h.lambda_rel.map_or("–".into(), |l| format!("{l:e}")),
            f(h.validation_r2),
            f(h.validation_r2_identity)
        );
    }
    eprintln!("wrote {}", out.display());
    write_json(&a.json, meta)
}

/// Which heads to read exits through.
#[derive(Args, Clone)]
pub struct HeadsArgs {
    /// Exit heads file (default: `<model>.exits.safetensors`, as `switchyard calibrate` writes).
    #[arg(long)]
    heads: Option<PathBuf>,
    /// `tuned`: the calibrated heads; `identity`: the logit lens (at --exits, or every
    /// n_layers / 8 layers).
    #[arg(long, default_value = "tuned", value_parser = ["tuned", "identity"])]
    lens: String,
}

fn open_heads(
    name: &str,
    loaded: &Loaded,
    a: &HeadsArgs,
    exits: Option<&[usize]>,
) -> anyhow::Result<ExitHeads> {
    let model = &loaded.model;
    if a.lens == "identity" {
        let n = model.n_layers();
        let depths = exits.map_or_else(|| exit_depths(n, default_every(n)), <[usize]>::to_vec);
        return Ok(ExitHeads::logit_lens(model, name, &depths)?);
    }
    let model_path = switchyard_zoo::resolve_model(name)?;
    let path = a
        .heads
        .clone()
        .unwrap_or_else(|| file::default_heads_path(&model_path));
    if !path.exists() {
        anyhow::bail!(
            "no exit heads at {}; run `switchyard calibrate --model {name}` first, or pass \
             --lens identity for the logit lens",
            path.display()
        );
    }
    let fp = fingerprint::fingerprint(&model_path)?;
    Ok(file::load(&path, model, &fp)?)
}

#[derive(Args)]
pub struct EvalExitsArgs {
    #[arg(long, default_value = switchyard_zoo::DEFAULT_MODEL)]
    model: String,
    /// `sharegpt` (its held-out conversations when the heads were calibrated on it), another
    /// zoo dataset, or a file.
    #[arg(long, default_value = "sharegpt")]
    file: String,
    /// A second model with the same tokenizer: also report complementarity (Observation 1
    /// across models), with --model as the small one.
    #[arg(long)]
    pair: Option<String>,
    /// Exit heads of --pair (default: beside it).
    #[arg(long)]
    pair_heads: Option<PathBuf>,
    /// Token positions studied.
    #[arg(long, default_value_t = study::DEFAULT_TOKENS)]
    tokens: usize,
    #[arg(long, default_value = "max-prob", value_parser = ["max-prob", "margin"])]
    confidence: String,
    #[command(flatten)]
    heads: HeadsArgs,
    /// Write the tables as Markdown to FILE (they always go to stderr).
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Write PNG plots into DIR.
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
    /// Also score these heads files (e.g. `ee-tune` output) side by side with the logit lens
    /// on held-out rows of --file: agreement, KL, bits per byte, ECE, exitable share at
    /// 85/90/95% precision, AUROCs, the exit check's cost, and the measured time of a batch-1
    /// decode step to each exit with its check next to the full-depth step. Repeatable.
    #[arg(long = "head", value_name = "FILE")]
    head_files: Vec<PathBuf>,
    /// Write the result as JSON to FILE (stdout when omitted).
    #[arg(long, value_name = "FILE", num_args = 0..=1)]
    json: Option<Option<PathBuf>>,
}

#[derive(Serialize)]
struct EvalExitsReport {
    studies: Vec<StudyReport>,
    pair: Option<PairReport>,
    heads: Option<HeadsComparison>,
    plots: Vec<String>,
}

/// `eval exits --head`: heads files scored side by side.
#[derive(Serialize)]
struct HeadsComparison {
    files: Vec<String>,
    full_depth_bits_per_byte: f64,
    rows: Vec<switchyard_exit_training::tune::eval::HeadScores>,
    /// Per head: its exit check alone, a decode step to its exit with the check, and the
    /// full-depth step (milliseconds at batch 1).
    check_costs: Vec<CheckCost>,
}

impl HeadsComparison {
    fn markdown(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "### Exit heads side by side (held-out; full depth {:.4} bits per byte)\n",
            self.full_depth_bits_per_byte
        );
        s.push_str(&switchyard_exit_training::tune::eval::scores_table(
            &self.rows,
            self.full_depth_bits_per_byte,
        ));
        if !self.check_costs.is_empty() {
            s.push('\n');
            s.push_str(&CheckCost::table_header(&[]));
            for c in &self.check_costs {
                let _ = writeln!(s, "{}|", c.cells());
            }
        }
        s
    }
}

/// Scores `files` (heads for `name`) side by side on held-out rows of `corpus`.
fn compare_heads(
    name: &str,
    files: &[PathBuf],
    corpus: &Corpus,
    tokens: usize,
) -> anyhow::Result<HeadsComparison> {
    let loaded = load_model(name, &LoadOptions::default())?;
    let model_path = switchyard_zoo::resolve_model(name)?;
    let fp = fingerprint::fingerprint(&model_path)?;
    let sets = files
        .iter()
        .map(|f| Ok(file::load(f, &loaded.model, &fp)?))
        .collect::<anyhow::Result<Vec<ExitHeads>>>()?;
    let named: Vec<(String, &ExitHeads)> = files
        .iter()
        .zip(&sets)
        .map(|(f, h)| {
            let stem = f.file_name().map_or_else(
                || f.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
            (stem, h)
        })
        .collect();
    let target = switchyard_exit_training::tune::run::TuneTarget {
        model: &loaded.model,
        tokenizer: &loaded.tokenizer,
        model_ref: model_ref(&loaded.model, name, fp.sha256, fp.bytes),
        cache_dir: switchyard_zoo::home().join("tmp").join("ee-tune"),
        checkpoint_dir: None,
    };
    let pb = bar("caching held-out hidden states {bar:40} {pos}/{len} ({eta})");
    let (rows, check_costs, full) = switchyard_exit_training::tune::run::score_heads(
        &target,
        corpus,
        &named,
        tokens,
        switchyard_exit_training::corpus::DEFAULT_DOC_TOKENS,
        |done, total| {
            pb.set_length(total as u64);
            pb.set_position(done as u64);
        },
    )?;
    pb.finish_and_clear();
    Ok(HeadsComparison {
        files: files.iter().map(|f| f.display().to_string()).collect(),
        full_depth_bits_per_byte: full,
        rows,
        check_costs,
    })
}

pub fn run_eval_exits(a: EvalExitsArgs) -> anyhow::Result<()> {
    let m = measure(&a.confidence)?;
    let corpus = Corpus::resolve(&a.file)?;
    let mut studies = Vec::new();
    let mut data = Vec::new();
    let mut models = vec![(a.model.clone(), a.heads.clone())];
    if let Some(p) = &a.pair {
        models.push((
            p.clone(),
            HeadsArgs {
                heads: a.pair_heads.clone(),
                lens: a.heads.lens.clone(),
            },
        ));
    }
    for (name, heads_args) in &models {
        let loaded = load_model(name, &LoadOptions::default())?;
        let heads = open_heads(name, &loaded, heads_args, None)?;
        let split = held_out_split(&heads, &corpus);
        eprintln!(
            "studying {name} on {} ({:?} split) at depths {:?}",
            corpus.name(),
            split,
            heads.depths()
        );
        let pb = bar("study {bar:40} {pos}/{len} tokens ({per_sec}, eta {eta})");
        let sm = StudyModel {
            model: &loaded.model,
            name,
            heads: &heads,
            tokenizer: &loaded.tokenizer,
        };
        let d = study::collect(&sm, &corpus, split, a.tokens, |done, total| {
            pb.set_length(total as u64);
            pb.set_position(done as u64);
        })?;
        pb.finish_and_clear();
        let r = StudyReport::from_records(&d, m);
        eprintln!("{}", r.markdown());
        studies.push(r);
        data.push(d);
    }
    let pair = match data.as_slice() {
        [small, large] => {
            let p = PairReport::new(small, large, m)?;
            eprintln!("{}", p.markdown());
            Some(p)
        }
        _ => None,
    };
    let mut md: String = studies.iter().map(StudyReport::markdown).collect();
    if let Some(p) = &pair {
        md.push_str(&p.markdown());
    }
    let heads = if a.head_files.is_empty() {
        None
    } else {
        let c = compare_heads(&a.model, &a.head_files, &corpus, a.tokens)?;
        eprintln!("{}", c.markdown());
        md.push_str(&c.markdown());
        Some(c)
    };
    write_text(&a.markdown, &md)?;
    let mut plots = Vec::new();
    if let Some(dir) = &a.plot {
        for r in &studies {
            plots.extend(switchyard_exit_study::plot::plot_study(r, dir)?);
        }
        if let Some(p) = &pair {
            plots.push(switchyard_exit_study::plot::plot_pair(p, dir)?);
        }
        if !switchyard_charts::fonts_available() {
            eprintln!("no TrueType font on this machine: plots have no text; see the tables");
        }
        for p in &plots {
            eprintln!("wrote {}", p.display());
        }
    }
    write_json(
        &a.json,
        &EvalExitsReport {
            studies,
            pair,
            heads,
            plots: plots.iter().map(|p| p.display().to_string()).collect(),
        },
    )
}

/// Held-out documents when the heads were calibrated on this corpus, all of it otherwise.
fn held_out_split(heads: &ExitHeads, corpus: &Corpus) -> Split {
    let Some(c) = &heads.meta().calibration else {
        return Split::All;
    };
    let same_path = Corpus::resolve(&c.corpus)
        .ok()
        .is_some_and(|cal| same_file(cal.path(), corpus.path()));
    if c.corpus == corpus.name() || same_path {
        Split::HeldOut
    } else {
        Split::All
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

#[derive(Args)]
pub struct BenchExitsArgs {
    #[arg(long, default_value = switchyard_zoo::DEFAULT_MODEL)]
    model: String,
    /// Text for the prompt and for teacher-forced scoring: a file or a zoo dataset.
    #[arg(long, default_value = "shakespeare")]
    file: String,
    #[arg(long, value_delimiter = ',', default_values_t = switchyard_exit_study::bench::DEFAULT_THRESHOLDS.to_vec())]
    thresholds: Vec<f32>,
    /// KV fixes to measure: recompute, propagate.
    #[arg(long, value_delimiter = ',', default_values_t = ["recompute".to_string(), "propagate".to_string()])]
    exit_kv: Vec<String>,
    /// Exit decision: max-prob, margin, or probe (the exit probes of `ee-tune` heads).
    #[arg(long, default_value = "max-prob", value_parser = ["max-prob", "margin", "probe"])]
    confidence: String,
    /// Exit depths checked (default: every head).
    #[arg(long, value_delimiter = ',')]
    exits: Option<Vec<usize>>,
    #[arg(long, default_value_t = switchyard_exit_study::bench::DEFAULT_PROMPT_TOKENS)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = switchyard_exit_study::bench::DEFAULT_GENERATE_TOKENS)]
    generate_tokens: usize,
    /// Tokens of the file scored by teacher forcing.
    #[arg(long, default_value_t = switchyard_exit_study::bench::DEFAULT_FORCED_TOKENS)]
    forced_tokens: usize,
    /// Repetitions of every configuration (tokens/s and speed-ups are medians).
    #[arg(long, default_value_t = switchyard_exit_study::bench::DEFAULT_RUNS)]
    runs: usize,
    #[command(flatten)]
    heads: HeadsArgs,
    /// Write the table as Markdown to FILE (it always goes to stderr).
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Write the result as JSON to FILE (stdout when omitted).
    #[arg(long, value_name = "FILE", num_args = 0..=1)]
    json: Option<Option<PathBuf>>,
}

pub fn run_bench_exits(a: BenchExitsArgs, threads: usize) -> anyhow::Result<()> {
    let path = resolve_text(&a.file)?;
    let text = String::from_utf8(std::fs::read(&path)?)
        .map_err(|e| anyhow::anyhow!("{} is not valid UTF-8: {e}", path.display()))?;
    let loaded = load_model(&a.model, &LoadOptions::default())?;
    let heads = open_heads(&a.model, &loaded, &a.heads, a.exits.as_deref())?;
    let opts = ExitBenchOptions {
        thresholds: a.thresholds,
        fixes: a
            .exit_kv
            .iter()
            .map(|s| kv_fix(s))
            .collect::<anyhow::Result<_>>()?,
        measure: decision(&a.confidence)?.0,
        probe: decision(&a.confidence)?.1,
        depths: a.exits,
        prompt_tokens: a.prompt_tokens,
        generate_tokens: a.generate_tokens,
        forced_tokens: a.forced_tokens,
        runs: a.runs,
    };
    let target = BenchTarget {
        model: &loaded.model,
        name: &a.model,
        heads: &heads,
        tokenizer: &loaded.tokenizer,
        threads,
    };
    let pb = bar("bench exits {spinner} {msg} ({elapsed})");
    pb.enable_steady_tick(std::time::Duration::from_millis(200));
    let r = bench_exits(&target, &path.display().to_string(), &text, &opts, |s| {
        pb.set_message(s.to_string())
    })?;
    pb.finish_and_clear();
    let md = r.markdown();
    eprintln!("{md}");
    write_text(&a.markdown, &md)?;
    write_json(&a.json, &r)
}

/// `generate --early-exit per-token`: the EE-LLM baseline at batch 1.
#[derive(Args, Clone)]
pub struct EarlyExitArgs {
    /// Early-exit mode: `per-token` (EE-LLM: each token exits at the first exit whose
    /// confidence passes --threshold; all layers loaded, batch 1).
    #[arg(long, value_name = "MODE", value_parser = ["per-token"])]
    early_exit: Option<String>,
    /// Confidence an exit must exceed (1.0: never exit; 0: always at the first exit).
    #[arg(long, default_value_t = 0.8, requires = "early_exit")]
    threshold: f32,
    /// How skipped layers get K/V: recompute (EE-LLM) or propagate (CALM).
    #[arg(long, default_value = "recompute", value_parser = ["recompute", "propagate"], requires = "early_exit")]
    exit_kv: String,
    /// Exit decision: max-prob, margin, or probe (the exit probes of `ee-tune` heads).
    #[arg(long, default_value = "max-prob", value_parser = ["max-prob", "margin", "probe"], requires = "early_exit")]
    confidence: String,
    /// Exit depths checked (default: every head).
    #[arg(long, value_delimiter = ',', requires = "early_exit")]
    exits: Option<Vec<usize>>,
    #[command(flatten)]
    heads: HeadsArgs,
}

impl EarlyExitArgs {
    pub fn enabled(&self) -> bool {
        self.early_exit.is_some()
    }
}

/// Generates with per-token early exit; text to stdout, speed and exit depths to stderr.
pub fn generate(
    name: &str,
    loaded: &Loaded,
    prompt: &[u32],
    params: &SamplingParams,
    a: &EarlyExitArgs,
) -> anyhow::Result<()> {
    let heads = open_heads(name, loaded, &a.heads, a.exits.as_deref())?;
    let (measure, probe) = decision(&a.confidence)?;
    let policy = ExitPolicy {
        threshold: a.threshold,
        measure,
        depths: a.exits.clone().unwrap_or_else(|| heads.depths()),
        probe,
    };
    let ctx = switchyard_exit_study::baseline::EeContext {
        model: &loaded.model,
        heads: &heads,
        policy: &policy,
        fix: kv_fix(&a.exit_kv)?,
    };
    let mut stdout = std::io::stdout().lock();
    let g = switchyard_exit_study::baseline::generate_early_exit(
        &ctx,
        &loaded.tokenizer,
        prompt,
        params,
        |t| {
            // A closed pipe (e.g. `| head`) ends output, not the process.
            let _ = stdout.write_all(t.as_bytes());
            let _ = stdout.flush();
        },
    )?;
    let _ = writeln!(stdout);
    let hist: Vec<String> = g
        .counters
        .depth_histogram
        .iter()
        .map(|(d, c)| format!("{d}: {c}"))
        .collect();
    eprintln!(
        "prompt: {} tokens in {:.2} s | decode: {} tokens, {:.1} tokens/s | finish: {:?}",
        g.prompt_tokens,
        g.prompt_secs,
        g.tokens.len(),
        g.decode_tokens_per_s(),
        g.finish_reason
    );
    eprintln!(
        "early exit (threshold {}, {}, {}): mean depth {:.1} of {}; tokens per depth: {}",
        a.threshold,
        a.confidence,
        a.exit_kv,
        g.depths.iter().sum::<usize>() as f64 / g.depths.len().max(1) as f64,
        loaded.model.n_layers(),
        hist.join(", ")
    );
    Ok(())
}
