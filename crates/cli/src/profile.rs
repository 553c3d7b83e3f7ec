//! `switchyard profile`: a model's offline telemetry per exit depth (decode throughput, bits
//! per byte, weight memory), the entry HELIOS's model repository holds.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use switchyard_exit_training::calibrate::{default_every, exit_depths};
use switchyard_exits::{file, fingerprint, ConfidenceMeasure, ExitHeads};
use switchyard_helios::manifest::Manifest;
use switchyard_helios::profile::{self, Profile, ProfileOptions, ProfileTarget, ProfileText};
use switchyard_models::LoadOptions;

use crate::load::{load_model, resolve_text, Loaded};
use crate::output::write_json;

#[derive(Args)]
pub struct ProfileArgs {
    /// Model name (see `switchyard models list`) or path to a GGUF file or model folder.
    #[arg(long)]
    model: String,
    /// Exit heads file (default: `<model>.exits.safetensors`, as `switchyard calibrate`
    /// writes). Without one, exits read the logit lens (at --depths, or every n_layers / 8
    /// layers).
    #[arg(long)]
    heads: Option<PathBuf>,
    /// Exit depths to profile (default: every head); full depth is always added.
    #[arg(long, value_delimiter = ',')]
    depths: Option<Vec<usize>>,
    /// Text for the prompt and for teacher-forced scoring: a zoo dataset or a file.
    #[arg(long, default_value = profile::DEFAULT_TEXT)]
    text: String,
    /// Tokens of the text scored by teacher forcing.
    #[arg(long, default_value_t = profile::DEFAULT_SCORED_TOKENS)]
    tokens: usize,
    #[arg(long, default_value_t = profile::DEFAULT_PROMPT_TOKENS)]
    prompt_tokens: usize,
    /// Tokens generated per throughput run.
    #[arg(long, default_value_t = profile::DEFAULT_DECODE_TOKENS)]
    decode_tokens: usize,
    /// Throughput runs per depth (medians are reported).
    #[arg(long, default_value_t = profile::DEFAULT_RUNS)]
    runs: usize,
    /// Confidence threshold of the offline exit histogram.
    #[arg(long, default_value_t = switchyard_helios::policy::DEFAULT_THRESHOLD)]
    threshold: f32,
    #[arg(long, default_value = "max-prob", value_parser = ["max-prob", "margin"])]
    confidence: String,
    /// Add the entry to this TOML manifest (created when missing; a model of the same name is
    /// replaced).
    #[arg(long, value_name = "FILE")]
    manifest: Option<PathBuf>,
    /// Write the manifest entry as JSON to FILE (stdout when omitted).
    #[arg(long, value_name = "FILE", num_args = 0..=1)]
    json: Option<Option<PathBuf>>,
}

/// The heads at `path` or beside the model, or the logit lens when there are none.
fn heads_for(
    name: &str,
    model_path: &Path,
    loaded: &Loaded,
    a: &ProfileArgs,
) -> anyhow::Result<ExitHeads> {
    let path = a
        .heads
        .clone()
        .unwrap_or_else(|| file::default_heads_path(model_path));
    if path.exists() {
        let fp = fingerprint::fingerprint(model_path)?;
        eprintln!("exit heads: {}", path.display());
        return Ok(file::load(&path, &loaded.model, &fp)?);
    }
    if a.heads.is_some() {
        anyhow::bail!("no exit heads at {}", path.display());
    }
    let n = loaded.model.n_layers();
    // The logit lens has a head at every depth: the asked ones, or the default spacing.
    let depths = match &a.depths {
        Some(d) => d.iter().copied().filter(|&d| d < n).collect(),
        None => exit_depths(n, default_every(n)),
    };
    eprintln!(
        "no exit heads at {}: profiling the logit lens at depths {depths:?} (run `switchyard \
         calibrate --model {name}` for tuned heads)",
        path.display()
    );
    Ok(ExitHeads::logit_lens(&loaded.model, name, &depths)?)
}

/// The repository name and path of `--model`: a zoo name as it is, a path by its file stem.
fn repo_name(model: &str) -> (String, Option<String>) {
    if switchyard_zoo::find(model).is_some() {
        return (model.to_string(), None);
    }
    let p = Path::new(model.trim_end_matches('/'));
    let stem = p
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| model.to_string());
    (stem, Some(model.to_string()))
}

pub fn run(a: ProfileArgs, threads: usize) -> anyhow::Result<()> {
    let measure = ConfidenceMeasure::parse(&a.confidence).ok_or_else(|| {
        anyhow::anyhow!("unknown confidence {:?}: max-prob or margin", a.confidence)
    })?;
    let text_path = resolve_text(&a.text)?;
    let text = std::fs::read_to_string(&text_path)
        .with_context(|| format!("reading {} as UTF-8 text", text_path.display()))?;
    let model_path = switchyard_zoo::resolve_model(&a.model)?;
    let loaded = load_model(&a.model, &LoadOptions::default())?;
    let heads = heads_for(&a.model, &model_path, &loaded, &a)?;
    let n_layers = loaded.model.n_layers();
    let mut depths = a.depths.clone().unwrap_or_else(|| heads.depths());
    depths.retain(|&d| d != n_layers);
    depths.sort_unstable();
    depths.dedup();
    depths.push(n_layers);
    let (name, path) = repo_name(&a.model);
    let size_bytes = fingerprint::fingerprint(&model_path)?.bytes;
    let opts = ProfileOptions {
        depths,
        scored_tokens: a.tokens,
        prompt_tokens: a.prompt_tokens,
        decode_tokens: a.decode_tokens,
        runs: a.runs,
        threshold: a.threshold,
        measure,
    };
    eprintln!(
        "profiling {name} at depths {:?} of {n_layers} on {} ({} tokens scored, {} runs of {} tokens, {threads} threads)",
        opts.depths, a.text, opts.scored_tokens, opts.runs, opts.decode_tokens
    );
    let target = ProfileTarget {
        model: &loaded.model,
        tokenizer: &loaded.tokenizer,
        heads: &heads,
        name: &name,
        path: path.as_deref(),
        size_bytes,
        threads,
    };
    let pb = ProgressBar::new_spinner().with_style(
        ProgressStyle::with_template("profile {spinner} {msg} ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    pb.enable_steady_tick(std::time::Duration::from_millis(200));
    let p = profile::profile(
        &target,
        &ProfileText {
            name: &a.text,
            text: &text,
        },
        &opts,
        |s| pb.set_message(s.to_string()),
    )?;
    pb.finish_and_clear();
    eprintln!("{}", table(&p));
    if let Some(m) = &a.manifest {
        let repo = if m.exists() {
            Manifest::load(m)?.upsert(p.entry.clone())?
        } else {
            Manifest::new(vec![p.entry.clone()], &m.display().to_string())?
        };
        std::fs::write(m, repo.to_toml()?).with_context(|| format!("writing {}", m.display()))?;
        eprintln!("wrote {} to {}", name, m.display());
    }
    write_json(&a.json, &p.entry)
}

fn table(p: &Profile) -> String {
    use std::fmt::Write as _;
    let e = &p.entry;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| depth | decode tokens/s | TTFT ms | bits/byte | weights MB | KV bytes/token | tokens exiting by here | argmax = full |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    let hist = e.profile.as_ref().map(|p| &p.exit_histogram);
    for t in &e.depths {
        let share = hist.map_or(0.0, |h| h.share_at_or_below(t.depth));
        let agree = p
            .argmax_agreement
            .iter()
            .find(|(d, _)| *d == t.depth)
            .map_or("–".to_string(), |(_, a)| format!("{:.1}%", 100.0 * a));
        let _ = writeln!(
            s,
            "| {} | {:.2} | {:.1} | {:.4} | {:.1} | {} | {:.1}% | {} |",
            t.depth,
            t.tokens_per_s,
            t.ttft_ms.unwrap_or(f64::NAN),
            t.bits_per_byte,
            t.memory_bytes as f64 / 1e6,
            t.kv_bytes_per_token.unwrap_or(0),
            100.0 * share,
            agree
        );
    }
    if let Some(info) = &e.profile {
        let _ = write!(
            s,
            "\n{} tokens ({} bytes) scored; exit histogram at {} {}: {:?}; {:.1} s",
            info.scored_tokens,
            info.scored_bytes,
            info.confidence.as_str(),
            info.threshold,
            info.exit_histogram.bins(),
            info.seconds
        );
    }
    s
}
