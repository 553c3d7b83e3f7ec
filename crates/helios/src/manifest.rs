//! The model repository: a TOML manifest of candidate models with their offline telemetry,
//! validated once into a [`Manifest`] the policy can trust.
//!
//! ```toml
//! version = 1
//!
//! [[model]]
//! name = "smollm2-135m-instruct"    # a zoo name; `path` may name a GGUF file or a folder
//! size_bytes = 98362432
//! layers = 30
//! exit_layers = [15]
//! exit_heads = "tuned"
//!
//! [[model.depth]]
//! depth = 15
//! tokens_per_s = 61.0
//! bits_per_byte = 2.91
//! memory_bytes = 58000000
//!
//! [[model.depth]]
//! depth = 30
//! tokens_per_s = 38.5
//! bits_per_byte = 1.07
//! memory_bytes = 98000000
//!
//! [[model]]
//! name = "big-remote"
//! url = "http://10.0.0.7:8000"      # any OpenAI-compatible server
//! remote_model = "meta-llama/Llama-3.1-8B-Instruct"
//! tokenizer = "/models/llama-3.1-8b-instruct"  # a local copy of its tokenizer
//! context_length = 8192
//! size_bytes = 16000000000
//! layers = 32
//!
//! [[model.depth]]
//! depth = 32
//! tokens_per_s = 40.0
//! bits_per_byte = 0.62
//! ```
//!
//! `switchyard profile --model M --json` writes one `[[model]]` entry (as JSON). Unknown keys
//! are errors, so a typo never falls back to a default silently.

use std::path::Path;

use serde::{Deserialize, Serialize};
use switchyard_exits::ConfidenceMeasure;

use crate::pht::ExitHistogram;
use crate::{HeliosError, Result};

/// The manifest format this build reads.
pub const MANIFEST_VERSION: u32 = 1;

/// One model at one exit depth.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DepthTelemetry {
    /// Layers run before the exit (the model's layer count for full depth).
    pub depth: usize,
    /// Decode tokens per second at batch 1, only layers `0..depth` run.
    pub tokens_per_s: f64,
    /// Milliseconds to the first token of the profile prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// Bits per UTF-8 byte, every token emitted at this depth (teacher forcing).
    pub bits_per_byte: f64,
    /// Weights resident with layers `0..depth` loaded: embeddings, final norm and LM head,
    /// the layers, and the exit head at this depth. 0 for a remote model.
    #[serde(default)]
    pub memory_bytes: u64,
    /// K/V bytes one token position takes at this depth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_bytes_per_token: Option<u64>,
    /// Energy per generated token, where a power meter measured it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub joules_per_token: Option<f64>,
}

impl DepthTelemetry {
    /// Milliseconds per output token.
    pub fn tpot_ms(&self) -> f64 {
        1000.0 / self.tokens_per_s
    }
}

/// How a model's exits turn hidden states into logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExitHeadsKind {
    /// Calibrated heads (`switchyard calibrate`).
    Tuned,
    /// The model's own final norm and LM head at every depth.
    LogitLens,
}

/// How the telemetry of an entry was measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileInfo {
    /// The text scored by teacher forcing (a zoo dataset or a file).
    pub text: String,
    pub scored_tokens: usize,
    pub scored_bytes: usize,
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    /// Repetitions of each throughput measurement (the medians are reported).
    pub runs: usize,
    pub threads: usize,
    /// Confidence threshold of `exit_histogram`.
    pub threshold: f32,
    pub confidence: ConfidenceMeasure,
    /// Teacher-forced tokens per first exit whose confidence passed the threshold (full depth
    /// when none did), every layer computed: the offline exit profile.
    pub exit_histogram: ExitHistogram,
    pub seconds: f64,
}

/// One candidate model, as the manifest states it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    /// The name the repository, the PHT and clients know the model by.
    pub name: String,
    /// Zoo name, GGUF file or model folder of a local model (default: `name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Base URL of a remote OpenAI-compatible server; makes the model remote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// The model's name on the remote server (default: `name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_model: Option<String>,
    /// A remote model's tokenizer, as a local zoo name, GGUF file or folder: prompts are
    /// tokenized here and sent as token ids. Needed to serve the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    /// A remote model's context length (prompt + output), when it is smaller than the
    /// tokenizer's model states or unknown to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_length: Option<usize>,
    /// Bytes of the model file(s).
    pub size_bytes: u64,
    pub layers: usize,
    /// Depths with an exit head, increasing, each below `layers`.
    #[serde(default)]
    pub exit_layers: Vec<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_heads: Option<ExitHeadsKind>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<ProfileInfo>,
    /// Telemetry per depth, increasing; full depth included.
    #[serde(rename = "depth")]
    pub depths: Vec<DepthTelemetry>,
}

/// Where a model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source<'a> {
    /// A local engine over a zoo name, GGUF file or model folder.
    Local { path: &'a str },
    /// A remote OpenAI-compatible server.
    Remote { url: &'a str, model: &'a str },
}

impl ModelEntry {
    pub fn source(&self) -> Source<'_> {
        match &self.url {
            Some(url) => Source::Remote {
                url,
                model: self.remote_model.as_deref().unwrap_or(&self.name),
            },
            None => Source::Local {
                path: self.path.as_deref().unwrap_or(&self.name),
            },
        }
    }

    pub fn is_remote(&self) -> bool {
        self.url.is_some()
    }

    /// Telemetry at `depth`, if the entry has it.
    pub fn at(&self, depth: usize) -> Option<&DepthTelemetry> {
        self.depths.iter().find(|d| d.depth == depth)
    }

    /// Telemetry at full depth (a valid entry always has it).
    pub fn full(&self) -> Option<&DepthTelemetry> {
        self.at(self.layers)
    }

    /// Depths a partial load may stop at: the exit layers, then full depth.
    pub fn servable_depths(&self) -> impl Iterator<Item = usize> + '_ {
        self.exit_layers
            .iter()
            .copied()
            .chain(std::iter::once(self.layers))
    }

    /// Every rule a manifest entry must satisfy; `Err` says which one broke.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.name.trim().is_empty() {
            return Err("the name is empty".into());
        }
        if self.url.is_some() && self.path.is_some() {
            return Err(
                "give either `path` (a local model) or `url` (a remote one), not both".into(),
            );
        }
        if self.url.is_none() && self.remote_model.is_some() {
            return Err("`remote_model` needs `url`".into());
        }
        if self.url.is_none() && (self.tokenizer.is_some() || self.context_length.is_some()) {
            return Err(
                "`tokenizer` and `context_length` describe a remote model; they need `url`".into(),
            );
        }
        if let Some(url) = &self.url {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(format!("url {url:?} must start with http:// or https://"));
            }
        }
        if self.layers == 0 {
            return Err("`layers` must be at least 1".into());
        }
        if self.is_remote() && !self.exit_layers.is_empty() {
            return Err(
                "a remote model cannot be partially loaded; leave `exit_layers` empty".into(),
            );
        }
        if let Some(w) = self.exit_layers.windows(2).find(|w| w[0] >= w[1]) {
            return Err(format!(
                "`exit_layers` must increase, got {} then {}",
                w[0], w[1]
            ));
        }
        if let Some(&d) = self
            .exit_layers
            .iter()
            .find(|&&d| d == 0 || d >= self.layers)
        {
            return Err(format!(
                "exit layer {d} must be between 1 and {} (the model has {} layers)",
                self.layers - 1,
                self.layers
            ));
        }
        if let Some(w) = self.depths.windows(2).find(|w| w[0].depth >= w[1].depth) {
            return Err(format!(
                "[[model.depth]] entries must have increasing depths, got {} then {}",
                w[0].depth, w[1].depth
            ));
        }
        for t in &self.depths {
            check_depth(self, t)?;
        }
        if self.full().is_none() {
            return Err(format!(
                "no telemetry at full depth (depth = {}); every model needs it as its quality \
                 reference",
                self.layers
            ));
        }
        if let Some(w) = self
            .depths
            .windows(2)
            .find(|w| w[0].memory_bytes > w[1].memory_bytes)
        {
            return Err(format!(
                "memory_bytes falls from {} at depth {} to {} at depth {}; more layers cannot take \
                 less memory",
                w[0].memory_bytes, w[0].depth, w[1].memory_bytes, w[1].depth
            ));
        }
        Ok(())
    }
}

fn check_depth(e: &ModelEntry, t: &DepthTelemetry) -> std::result::Result<(), String> {
    let d = t.depth;
    if d != e.layers && !e.exit_layers.contains(&d) {
        return Err(format!(
            "telemetry at depth {d}, which is neither an exit layer {:?} nor full depth {}",
            e.exit_layers, e.layers
        ));
    }
    let positive = |v: f64| v.is_finite() && v > 0.0;
    if !positive(t.tokens_per_s) {
        return Err(format!(
            "depth {d}: tokens_per_s must be positive and finite, got {}",
            t.tokens_per_s
        ));
    }
    if !(t.bits_per_byte.is_finite() && t.bits_per_byte >= 0.0) {
        return Err(format!(
            "depth {d}: bits_per_byte must be finite and not negative, got {}",
            t.bits_per_byte
        ));
    }
    if let Some(v) = t.ttft_ms.filter(|&v| !positive(v)) {
        return Err(format!(
            "depth {d}: ttft_ms must be positive and finite, got {v}"
        ));
    }
    if let Some(v) = t.joules_per_token.filter(|&v| !positive(v)) {
        return Err(format!(
            "depth {d}: joules_per_token must be positive and finite, got {v}"
        ));
    }
    if !e.is_remote() && t.memory_bytes == 0 {
        return Err(format!(
            "depth {d}: memory_bytes is missing or 0 (a local model holds its weights)"
        ));
    }
    Ok(())
}

/// The manifest file as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ManifestFile {
    version: u32,
    #[serde(default, rename = "model")]
    models: Vec<ModelEntry>,
}

/// A validated model repository: at least one model, unique names, every entry consistent.
#[derive(Debug, Clone, PartialEq)]
pub struct Manifest {
    models: Vec<ModelEntry>,
}

impl Manifest {
    /// Validates `models` (`origin` names them in errors: a path, or "manifest").
    pub fn new(models: Vec<ModelEntry>, origin: &str) -> Result<Self> {
        if models.is_empty() {
            return Err(HeliosError::Manifest {
                origin: origin.into(),
                message: "the repository has no [[model]]".into(),
            });
        }
        for (i, m) in models.iter().enumerate() {
            m.check().map_err(|message| HeliosError::ManifestModel {
                origin: origin.into(),
                model: m.name.clone(),
                message,
            })?;
            if models[..i].iter().any(|o| o.name == m.name) {
                return Err(HeliosError::ManifestModel {
                    origin: origin.into(),
                    model: m.name.clone(),
                    message: "the name appears twice".into(),
                });
            }
        }
        Ok(Self { models })
    }

    /// Parses and validates TOML text.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self> {
        let file: ManifestFile = toml::from_str(text).map_err(|e| HeliosError::ManifestSyntax {
            origin: origin.into(),
            message: e.to_string(),
        })?;
        if file.version != MANIFEST_VERSION {
            return Err(HeliosError::Manifest {
                origin: origin.into(),
                message: format!(
                    "version {} is not supported (this build reads version {MANIFEST_VERSION})",
                    file.version
                ),
            });
        }
        Self::new(file.models, origin)
    }

    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| HeliosError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_toml(&text, &path.display().to_string())
    }

    /// The manifest as TOML (what [`Manifest::from_toml`] reads back).
    pub fn to_toml(&self) -> Result<String> {
        let file = ManifestFile {
            version: MANIFEST_VERSION,
            models: self.models.clone(),
        };
        toml::to_string(&file).map_err(|e| HeliosError::Manifest {
            origin: "manifest".into(),
            message: format!("cannot write TOML: {e}"),
        })
    }

    pub fn models(&self) -> &[ModelEntry] {
        &self.models
    }

    pub fn get(&self, name: &str) -> Option<&ModelEntry> {
        self.models.iter().find(|m| m.name == name)
    }

    /// Adds `entry`, or replaces the model of the same name (a fresh profile), revalidating.
    pub fn upsert(&self, entry: ModelEntry) -> Result<Self> {
        let mut models = self.models.clone();
        match models.iter_mut().find(|m| m.name == entry.name) {
            Some(m) => *m = entry,
            None => models.push(entry),
        }
        Self::new(models, "manifest")
    }

    /// The lowest full-depth bits per byte in the repository: the quality reference of
    /// `slo.max_bits_per_byte_increase`.
    pub fn best_full_depth_bits_per_byte(&self) -> f64 {
        self.models
            .iter()
            .filter_map(|m| m.full().map(|t| t.bits_per_byte))
            .fold(f64::INFINITY, f64::min)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) const EXAMPLE: &str = r#"
version = 1

[[model]]
name = "smollm2-135m-instruct"
size_bytes = 98362432
layers = 30
exit_layers = [15]
exit_heads = "tuned"

[[model.depth]]
depth = 15
tokens_per_s = 61.0
ttft_ms = 40.0
bits_per_byte = 2.91
memory_bytes = 58000000
kv_bytes_per_token = 11520

[[model.depth]]
depth = 30
tokens_per_s = 38.5
ttft_ms = 70.0
bits_per_byte = 1.07
memory_bytes = 98000000
kv_bytes_per_token = 23040

[[model]]
name = "big-remote"
url = "http://10.0.0.7:8000"
remote_model = "meta-llama/Llama-3.1-8B-Instruct"
size_bytes = 16000000000
layers = 32

[[model.depth]]
depth = 32
tokens_per_s = 40.0
bits_per_byte = 0.62
"#;

    fn err(text: &str) -> String {
        Manifest::from_toml(text, "repo.toml")
            .expect_err("the manifest must be refused")
            .to_string()
    }

    /// `EXAMPLE` with `from` replaced by `to` (which must occur).
    fn edit(from: &str, to: &str) -> String {
        assert!(EXAMPLE.contains(from), "{from:?} is not in the example");
        EXAMPLE.replacen(from, to, 1)
    }

    #[test]
    fn the_example_parses_and_round_trips() {
        let m = Manifest::from_toml(EXAMPLE, "repo.toml").unwrap();
        assert_eq!(m.models().len(), 2);
        let s = m.get("smollm2-135m-instruct").unwrap();
        assert_eq!(
            s.source(),
            Source::Local {
                path: "smollm2-135m-instruct"
            }
        );
        assert_eq!(s.servable_depths().collect::<Vec<_>>(), vec![15, 30]);
        assert_eq!(s.full().map(|t| t.memory_bytes), Some(98_000_000));
        assert!((s.at(15).unwrap().tpot_ms() - 1000.0 / 61.0).abs() < 1e-12);
        let r = m.get("big-remote").unwrap();
        assert_eq!(
            r.source(),
            Source::Remote {
                url: "http://10.0.0.7:8000",
                model: "meta-llama/Llama-3.1-8B-Instruct"
            }
        );
        assert_eq!(r.full().map(|t| t.memory_bytes), Some(0));
        assert_eq!(m.best_full_depth_bits_per_byte(), 0.62);
        let again = Manifest::from_toml(&m.to_toml().unwrap(), "again").unwrap();
        assert_eq!(again, m);
    }

    #[test]
    fn syntax_and_unknown_keys_are_refused_with_the_key_named() {
        let e = err(&edit("layers = 30", "layers = 30\nlayer_count = 30"));
        assert!(e.contains("repo.toml") && e.contains("layer_count"), "{e}");
        let e = err(&edit("tokens_per_s = 61.0", "tokens_per_sec = 61.0"));
        assert!(e.contains("tokens_per_sec"), "{e}");
        let e = err(&edit("layers = 30", "layers = \"thirty\""));
        assert!(e.contains("layers") || e.contains("integer"), "{e}");
        let e = err(&edit("exit_heads = \"tuned\"", "exit_heads = \"magic\""));
        assert!(e.contains("magic"), "{e}");
        let e = err("version = 1\n[[model]\n");
        assert!(e.contains("repo.toml"), "{e}");
    }

    #[test]
    fn version_and_empty_repository_are_refused() {
        assert!(err(&edit("version = 1", "version = 7")).contains("version 7"));
        assert!(err(&edit("version = 1\n", "")).contains("version"));
        assert!(err("version = 1\n").contains("no [[model]]"));
    }

    #[test]
    fn inconsistent_models_are_refused_with_the_reason() {
        let cases: &[(&str, &str, &str)] = &[
            ("layers = 30", "layers = 0", "at least 1"),
            (
                "exit_layers = [15]",
                "exit_layers = [15, 30]",
                "between 1 and 29",
            ),
            (
                "exit_layers = [15]",
                "exit_layers = [0, 15]",
                "between 1 and 29",
            ),
            (
                "exit_layers = [15]",
                "exit_layers = [15, 15]",
                "must increase",
            ),
            ("depth = 15\n", "depth = 12\n", "neither an exit layer"),
            ("depth = 30\n", "depth = 15\n", "increasing depths"),
            (
                "tokens_per_s = 61.0",
                "tokens_per_s = 0.0",
                "tokens_per_s must be positive",
            ),
            (
                "tokens_per_s = 61.0",
                "tokens_per_s = nan",
                "tokens_per_s must be positive",
            ),
            (
                "bits_per_byte = 2.91",
                "bits_per_byte = -1.0",
                "bits_per_byte must be finite",
            ),
            (
                "ttft_ms = 40.0",
                "ttft_ms = -3.0",
                "ttft_ms must be positive",
            ),
            (
                "memory_bytes = 58000000",
                "memory_bytes = 0",
                "memory_bytes is missing",
            ),
            (
                "memory_bytes = 58000000",
                "memory_bytes = 99000000",
                "more layers cannot take less memory",
            ),
            (
                "name = \"smollm2-135m-instruct\"",
                "name = \" \"",
                "name is empty",
            ),
            (
                "name = \"big-remote\"",
                "name = \"smollm2-135m-instruct\"",
                "appears twice",
            ),
            (
                "url = \"http://10.0.0.7:8000\"",
                "url = \"10.0.0.7:8000\"",
                "must start with http",
            ),
            (
                "layers = 32",
                "layers = 32\nexit_layers = [8]",
                "cannot be partially loaded",
            ),
            (
                "url = \"http://10.0.0.7:8000\"\n",
                "",
                "`remote_model` needs `url`",
            ),
            (
                "url = \"http://10.0.0.7:8000\"",
                "url = \"http://x\"\npath = \"m.gguf\"",
                "not both",
            ),
        ];
        for (from, to, want) in cases {
            let e = err(&edit(from, to));
            assert!(e.contains(want), "{from:?} -> {to:?}: {e}");
        }
        // Full depth missing: drop the smollm2 depth-30 table.
        let start = EXAMPLE.find("[[model.depth]]\ndepth = 30").unwrap();
        let end = EXAMPLE.find("[[model]]\nname = \"big-remote\"").unwrap();
        let text = format!("{}{}", &EXAMPLE[..start], &EXAMPLE[end..]);
        let e = err(&text);
        assert!(
            e.contains("smollm2-135m-instruct") && e.contains("no telemetry at full depth"),
            "{e}"
        );
    }

    #[test]
    fn upsert_replaces_by_name_and_revalidates() {
        let m = Manifest::from_toml(EXAMPLE, "repo.toml").unwrap();
        let mut s = m.get("smollm2-135m-instruct").unwrap().clone();
        s.size_bytes = 1;
        let m2 = m.upsert(s.clone()).unwrap();
        assert_eq!(m2.models().len(), 2);
        assert_eq!(m2.get("smollm2-135m-instruct").unwrap().size_bytes, 1);
        s.depths.clear();
        assert!(m.upsert(s).is_err());
    }
}
