//! The server's TOML configuration. Unknown keys are errors, so a typo never silently falls
//! back to a default.

use std::path::Path;

use serde::Deserialize;

/// vLLM's default port.
pub const DEFAULT_PORT: u16 = 8000;
pub const DEFAULT_HOST: &str = "127.0.0.1";
/// Request bodies above this are refused with 413 (1 MiB holds ~250k tokens of text).
pub const DEFAULT_MAX_BODY_BYTES: usize = 1 << 20;
/// Requests admitted per model (running + queued); more get 429.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 256;
/// A request running longer than this is aborted (10 minutes).
pub const DEFAULT_REQUEST_TIMEOUT_S: u64 = 600;
/// How long SIGINT/SIGTERM waits for running requests before exiting.
pub const DEFAULT_SHUTDOWN_GRACE_S: u64 = 30;
/// How often remote backends are health-checked.
pub const DEFAULT_HEALTH_INTERVAL_S: u64 = 10;
/// A request body must arrive within this (nginx's `client_body_timeout` is 60 s; 30 s still
/// carries the default 1 MiB limit at under 300 kbit/s).
pub const DEFAULT_BODY_TIMEOUT_S: u64 = 30;
/// A streamed response whose client has not taken an event for this long is aborted (nginx's
/// `send_timeout` is 60 s; a streaming client reads as events come).
pub const DEFAULT_WRITE_TIMEOUT_S: u64 = 30;
/// A connection must send a request's whole head within this, which also ends idle keep-alive
/// connections (hyper's default header timeout; nginx's `client_header_timeout` is 60 s).
pub const DEFAULT_HEADER_TIMEOUT_S: u64 = 30;
/// Open connections at most; more are answered 503 and closed. Under the usual 1,024 file
/// descriptors a process may hold, with room for model files and backend connections.
pub const DEFAULT_MAX_CONNECTIONS: usize = 900;
/// How long a ModeSwitch request waits for its mode to load before it is served in f16 while
/// the load goes on (a q4 load takes seconds; an AWQ or GPTQ calibration, minutes).
pub const DEFAULT_LOAD_WAIT_S: u64 = 30;
/// Longest timeout or interval accepted, in seconds: a day is longer than any request should
/// wait, and far from where `Instant + Duration` overflows.
pub const MAX_TIMEOUT_S: u64 = 86_400;
/// Most stop strings a request may carry.
pub const MAX_STOP: usize = switchyard_request::MAX_STOP_STRINGS;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub server: ServerSection,
    #[serde(default)]
    pub models: Vec<ModelSection>,
    #[serde(default)]
    pub backends: Vec<BackendSection>,
    /// HELIOS: several local models served under one name (see [`HeliosSection`]).
    #[serde(default)]
    pub helios: Option<HeliosSection>,
    /// ModeSwitch: one model served in the mode the router picks per request.
    #[serde(default)]
    pub modeswitch: Option<ModeSwitchSection>,
    /// The router's policy (classifier thresholds and ordered rules), as
    /// `switchyard_router::DEFAULT_POLICY_TOML` documents; the paper's policy when absent.
    /// `policy_file = "policy.toml"` (alone in the table) reads it from a file instead, such as
    /// the one `switchyard router fit` writes (a relative path is taken from the working
    /// directory).
    #[serde(default)]
    pub router: Option<toml::Table>,
}

/// ModeSwitch: one model served under one name in several inference modes; the rule router
/// picks each request's mode from its features before generation.
///
/// ```toml
/// [modeswitch]
/// name = "smollm2-modes"
/// path = "smollm2-135m-instruct"
/// modes = ["f16", "int8", "q4", "q4+prefix-cache", "int8+continuous-batching"]
/// mode_budget = "1GiB"      # each mode's engine: weights + KV pool + workspace
/// memory_budget = "3GiB"    # all loaded modes together; least recently used are evicted
/// # draft = "qwen2.5-coder-0.5b-instruct"  # `speculative`: a draft with the same tokenizer
/// # exit_heads = "model.exits.safetensors" # `self-speculative` (default: beside the model)
/// # learned_router = "routers/tree.json"    # instead of the [router] rules
/// ```
///
/// Speculative modes decode one request at a time (queued in arrival order); `q4-awq` is
/// calibrated when first loaded; `q4-gptq` is read from the GPTQ cache, or made when first
/// loaded and cached.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModeSwitchSection {
    pub name: String,
    /// Zoo name, GGUF file or Hugging Face folder (default: `name`).
    pub path: Option<String>,
    /// The modes offered (f16, the fallback, is always offered).
    pub modes: Vec<switchyard_request::Mode>,
    pub mode_budget: Option<String>,
    pub memory_budget: Option<String>,
    /// Draft model of `speculative` (zoo name, GGUF file or folder; same tokenizer).
    pub draft: Option<String>,
    /// Exit heads of `self-speculative` (default: `<model>.exits.safetensors`).
    pub exit_heads: Option<std::path::PathBuf>,
    /// Exit layer `self-speculative` drafts from (default: the exit nearest 3/4 of the depth).
    pub draft_depth: Option<usize>,
    /// Tokens drafted per round by the speculative modes.
    pub draft_len: Option<usize>,
    /// Longest sequence (prompt + output) served, below the model's context (vLLM's
    /// `max_model_len`): modes without chunked prefill size their workspace for it.
    pub max_model_len: Option<usize>,
    /// Route with a learned router (a file `switchyard bench router --save-routers` wrote)
    /// instead of the rule policy.
    pub learned_router: Option<std::path::PathBuf>,
    /// Seconds a request waits for its mode to load before it is served in f16 (the load
    /// goes on in the background). Default [`DEFAULT_LOAD_WAIT_S`].
    pub load_wait_s: Option<u64>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSection {
    pub host: String,
    pub port: u16,
    /// Bearer keys accepted on `/v1` and `/admin` (none: open).
    pub api_keys: Vec<String>,
    /// Serve the `/admin` routes.
    pub admin: bool,
    pub max_body_bytes: usize,
    pub max_in_flight: usize,
    pub request_timeout_s: u64,
    /// Seconds a client has to send the whole request body (408 after).
    pub body_timeout_s: u64,
    /// Seconds a streamed response waits for a client that does not read before it aborts
    /// the request (freeing its K/V blocks and its place).
    pub write_timeout_s: u64,
    /// Seconds a connection has to send a request's head (and an idle keep-alive connection
    /// is kept); the connection is closed after.
    pub header_timeout_s: u64,
    /// Open connections at most: one more is answered 503 with `Retry-After` and closed.
    pub max_connections: usize,
    pub shutdown_grace_s: u64,
    /// Origins a browser may call the API from (CORS), e.g. `["https://app.example"]`, or
    /// `["*"]` for any. Empty (the default): no CORS headers, so browsers refuse
    /// cross-origin calls.
    pub cors_allowed_origins: Vec<String>,
}

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            host: DEFAULT_HOST.into(),
            port: DEFAULT_PORT,
            api_keys: Vec::new(),
            admin: false,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            request_timeout_s: DEFAULT_REQUEST_TIMEOUT_S,
            body_timeout_s: DEFAULT_BODY_TIMEOUT_S,
            write_timeout_s: DEFAULT_WRITE_TIMEOUT_S,
            header_timeout_s: DEFAULT_HEADER_TIMEOUT_S,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            shutdown_grace_s: DEFAULT_SHUTDOWN_GRACE_S,
            cors_allowed_origins: Vec::new(),
        }
    }
}

/// A model served by a local engine.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// The name clients ask for.
    pub name: String,
    /// Zoo name, GGUF file or Hugging Face folder (default: `name`).
    pub path: Option<String>,
    /// e.g. "2GiB" (default: the engine's).
    pub memory_budget: Option<String>,
    pub max_batched_tokens: Option<usize>,
    pub max_num_seqs: Option<usize>,
    pub prefix_caching: Option<bool>,
    pub chunked_prefill: Option<bool>,
    /// Longest sequence (prompt + output) served, below the model's context.
    pub max_model_len: Option<usize>,
    /// K/V block format: "f16" (the default), "f32" or "int8".
    pub kv_format: Option<switchyard_engine::KvFormat>,
}

/// The HELIOS orchestrator over the local models of a repository, served as one model name.
///
/// ```toml
/// [helios]
/// name = "helios"                  # the name clients ask for
/// manifest = "models.toml"         # the repository, `switchyard profile` telemetry
/// memory_budget = "4GiB"           # all candidate engines together (see below)
/// slo = { objective = "throughput", max_bits_per_byte_increase = 0.3 }
/// policy = { evaluation = "shadow", shadow = { share = 0.1, window = 6, sample_every = 4 } }
/// ```
///
/// `evaluation = "shadow"` (the default) serves every request with the chosen candidate and
/// scores sampled prompts with the others, streaming their layers (`exit_stride`: exit depths
/// read every k-th scored position); the engines that do not serve are parked, holding
/// nothing, and the budget follows the serving one. `"serial"` is HELIOS's evaluation in
/// blocks of requests (`eval_requests`, `reprofile_interval`, the breach counter), each
/// engine in an equal share of the budget. Each candidate engine uses its calibrated exit heads when the manifest says `exit_heads =
/// "tuned"` (the file beside the model), the logit lens otherwise.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HeliosSection {
    pub name: String,
    /// Path of the repository manifest (TOML).
    pub manifest: String,
    /// Total bytes for all candidates, e.g. "4GiB" (default: the engine default per
    /// candidate); each candidate engine gets an equal share and the policy fits candidates
    /// to that share.
    pub memory_budget: Option<String>,
    #[serde(default)]
    pub slo: switchyard_helios::policy::Slo,
    /// The policy's tunables (see [`switchyard_helios::policy::PolicyConfig`]).
    #[serde(default)]
    pub policy: switchyard_helios::policy::PolicyConfig,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Any OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, another Switchyard).
    Openai,
}

/// A model served by a remote OpenAI-compatible server.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BackendSection {
    pub kind: BackendKind,
    /// The name clients ask for here.
    pub name: String,
    /// Base URL, e.g. "http://10.0.0.7:8000" (the `/v1/...` paths are appended).
    pub url: Option<String>,
    /// Several replicas of the same model instead of one `url`: each request goes to the
    /// healthy one with the fewest requests in flight.
    pub urls: Option<Vec<String>>,
    /// The model name on the remote server (default: `name`).
    pub model: Option<String>,
    pub api_key: Option<String>,
    pub timeout_s: Option<u64>,
    pub health_interval_s: Option<u64>,
}

impl BackendSection {
    /// Every URL of the backend: `url` alone, or each of `urls`.
    pub fn replica_urls(&self) -> Vec<String> {
        match (&self.url, &self.urls) {
            (Some(u), _) => vec![u.clone()],
            (None, Some(us)) => us.clone(),
            (None, None) => Vec::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse {
        path: std::path::PathBuf,
        message: String,
    },
    #[error("{0}")]
    Invalid(String),
}

impl Config {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.to_path_buf(),
                message,
            },
            other => other,
        })
    }

    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: "<config>".into(),
            message: e.to_string(),
        })?;
        cfg.check()?;
        Ok(cfg)
    }

    /// The router policy of `[router]`, or the paper's when the file has none.
    pub fn router_policy(&self) -> Result<switchyard_router::Policy, ConfigError> {
        match &self.router {
            None => Ok(switchyard_router::Policy::default()),
            Some(t) if t.contains_key("policy_file") => {
                let path = match (t.get("policy_file"), t.len()) {
                    (Some(toml::Value::String(p)), 1) => std::path::PathBuf::from(p),
                    (Some(toml::Value::String(_)), _) => return Err(ConfigError::Invalid(
                        "[router]: policy_file and inline router settings are both given; keep one"
                            .into(),
                    )),
                    _ => {
                        return Err(ConfigError::Invalid(
                            "[router]: policy_file must be a path (a string)".into(),
                        ))
                    }
                };
                let text = std::fs::read_to_string(&path).map_err(|e| {
                    ConfigError::Invalid(format!("[router] policy_file {}: {e}", path.display()))
                })?;
                switchyard_router::Policy::from_toml(&text).map_err(|e| {
                    ConfigError::Invalid(format!("[router] policy_file {}: {e}", path.display()))
                })
            }
            Some(t) => {
                let mut wrapper = toml::Table::new();
                wrapper.insert("router".into(), toml::Value::Table(t.clone()));
                let text = toml::to_string(&wrapper)
                    .map_err(|e| ConfigError::Invalid(format!("[router]: {e}")))?;
                switchyard_router::Policy::from_toml(&text)
                    .map_err(|e| ConfigError::Invalid(format!("[router]: {e}")))
            }
        }
    }

    /// The default model from the zoo on localhost: what `switchyard serve` runs with no config.
    pub fn default_model() -> Self {
        Self {
            server: ServerSection::default(),
            models: vec![ModelSection {
                name: switchyard_zoo::DEFAULT_MODEL.into(),
                path: None,
                memory_budget: None,
                max_batched_tokens: None,
                max_num_seqs: None,
                prefix_caching: None,
                chunked_prefill: None,
                max_model_len: None,
                kv_format: None,
            }],
            backends: Vec::new(),
            helios: None,
            modeswitch: None,
            router: None,
        }
    }

    fn check(&self) -> Result<(), ConfigError> {
        let mut names: Vec<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
        names.extend(self.backends.iter().map(|b| b.name.as_str()));
        if let Some(h) = &self.helios {
            names.push(h.name.as_str());
            h.slo
                .validate()
                .and_then(|()| h.policy.validate())
                .map_err(|e| ConfigError::Invalid(format!("[helios]: {e}")))?;
        }
        if let Some(m) = &self.modeswitch {
            names.push(m.name.as_str());
            if m.modes.contains(&switchyard_request::Mode::Speculative) && m.draft.is_none() {
                return Err(ConfigError::Invalid(
                    "[modeswitch]: the speculative mode needs `draft`, a model with the same tokenizer".into(),
                ));
            }
            if m.draft_len == Some(0) {
                return Err(ConfigError::Invalid(
                    "[modeswitch]: draft_len must be at least 1".into(),
                ));
            }
            if let Some(w) = m.load_wait_s {
                seconds("[modeswitch]: load_wait_s", w)?;
            }
        }
        if self.router.is_some() {
            self.router_policy()?;
        }
        if names.is_empty() {
            return Err(ConfigError::Invalid(
                "the configuration serves no model: add a [[models]] or [[backends]] entry".into(),
            ));
        }
        let mut sorted = names.clone();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(ConfigError::Invalid(format!(
                "model name {:?} is served twice",
                w[0]
            )));
        }
        for b in &self.backends {
            match (&b.url, &b.urls) {
                (Some(_), Some(_)) => {
                    return Err(ConfigError::Invalid(format!(
                        "backend {:?}: give `url` or `urls`, not both",
                        b.name
                    )))
                }
                (None, None) => {
                    return Err(ConfigError::Invalid(format!(
                        "backend {:?}: `url` (or `urls` for replicas) is required",
                        b.name
                    )))
                }
                (None, Some(u)) if u.is_empty() => {
                    return Err(ConfigError::Invalid(format!(
                        "backend {:?}: `urls` is empty",
                        b.name
                    )))
                }
                _ => {}
            }
            if let Some(u) = b
                .replica_urls()
                .into_iter()
                .find(|u| !(u.starts_with("http://") || u.starts_with("https://")))
            {
                return Err(ConfigError::Invalid(format!(
                    "backend {:?}: url {u:?} must start with http:// or https://",
                    b.name
                )));
            }
        }
        if self.server.max_in_flight == 0
            || self.server.max_body_bytes == 0
            || self.server.max_connections == 0
        {
            return Err(ConfigError::Invalid(
                "server.max_in_flight, server.max_body_bytes and server.max_connections must be \
                 positive"
                    .into(),
            ));
        }
        seconds("server.request_timeout_s", self.server.request_timeout_s)?;
        seconds("server.body_timeout_s", self.server.body_timeout_s)?;
        seconds("server.write_timeout_s", self.server.write_timeout_s)?;
        seconds("server.header_timeout_s", self.server.header_timeout_s)?;
        for b in &self.backends {
            for (key, value) in [
                ("timeout_s", b.timeout_s),
                ("health_interval_s", b.health_interval_s),
            ] {
                if let Some(v) = value {
                    seconds(&format!("backend {:?}: {key}", b.name), v)?;
                }
            }
        }
        Ok(())
    }
}

/// A timeout or interval must be 1 to [`MAX_TIMEOUT_S`] seconds.
fn seconds(what: &str, value: u64) -> Result<(), ConfigError> {
    if (1..=MAX_TIMEOUT_S).contains(&value) {
        Ok(())
    } else {
        Err(ConfigError::Invalid(format!(
            "{what} must be between 1 and {MAX_TIMEOUT_S} seconds, got {value}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example shipped in the repository parses and names the engine's defaults.
    #[test]
    fn the_example_config_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/serve.toml");
        let cfg = Config::load(&path).unwrap();
        assert_eq!(cfg.server.port, DEFAULT_PORT);
        assert_eq!(cfg.server.max_in_flight, DEFAULT_MAX_IN_FLIGHT);
        assert_eq!(cfg.models.len(), 1);
        assert_eq!(cfg.models[0].name, switchyard_zoo::DEFAULT_MODEL);
        assert_eq!(cfg.models[0].memory_budget.as_deref(), Some("2GiB"));
        assert_eq!(
            cfg.models[0].kv_format,
            Some(switchyard_engine::KvFormat::default())
        );
        assert!(cfg.backends.is_empty());
    }

    /// The example's commented ModeSwitch block, uncommented, parses with its router policy.
    #[test]
    fn the_example_modeswitch_block_parses_with_its_policy() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/serve.toml");
        let text = std::fs::read_to_string(path).unwrap();
        let start = text.find("# [modeswitch]").unwrap();
        let block: String = text[start..]
            .lines()
            .filter_map(|l| l.strip_prefix("# "))
            .filter(|l| l.starts_with('[') || l.contains(" = "))
            .map(|l| format!("{l}\n"))
            .collect();
        let cfg = Config::parse(&block).unwrap();
        let m = cfg.modeswitch.as_ref().unwrap();
        assert_eq!(m.modes.len(), 5);
        assert_eq!(m.mode_budget.as_deref(), Some("1GiB"));
        let policy = cfg.router_policy().unwrap();
        let ids: Vec<&str> = policy.rules().iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["batch", "default"]);
        let bad = block.replace("mode = \"int8\"", "mode = \"int3\"");
        let err = Config::parse(&bad).unwrap_err().to_string();
        assert!(
            err.starts_with("[router]: rule 2 (\"default\"): unknown mode \"int3\""),
            "{err}"
        );
    }

    #[test]
    fn the_helios_section_parses_validates_and_refuses_unknown_keys() {
        let cfg = Config::parse(
            r#"
            [helios]
            name = "helios"
            manifest = "models.toml"
            memory_budget = "4GiB"
            slo = { objective = "latency", tpot_ms = 50.0 }
            policy = { top_k = 2, eval_requests = 3, reprofile_interval = 50 }
            "#,
        )
        .unwrap();
        let h = cfg.helios.unwrap();
        assert_eq!((h.policy.top_k, h.policy.eval_requests), (2, 3));
        assert_eq!((h.policy.reprofile_interval, h.policy.cbc_max), (50, 50));
        assert_eq!(h.slo.tpot_ms, Some(50.0));
        let typo = "[helios]\nname = \"h\"\nmanifest = \"m\"\nbudget = \"1GiB\"";
        assert!(Config::parse(typo).is_err());
        let bad = "[helios]\nname = \"h\"\nmanifest = \"m\"\npolicy = { cbc_max = 100 }";
        let e = Config::parse(bad).unwrap_err().to_string();
        assert!(e.contains("cbc_max"), "{e}");
        let twice = "[helios]\nname = \"m\"\nmanifest = \"x\"\n[[models]]\nname = \"m\"";
        assert!(Config::parse(twice).is_err());
        let shadow = "[helios]\nname = \"h\"\nmanifest = \"m\"\n[helios.policy.shadow]\n\
                      round = 1\nchange_margin = 0.3\nhold_ms = 5000\ndrain_first = true";
        let s = Config::parse(shadow).unwrap().helios.unwrap().policy.shadow;
        assert_eq!((s.round, s.change_margin, s.hold_ms), (1, Some(0.3), 5000));
        assert!(s.drain_first);
        let margin = "[helios]\nname = \"h\"\nmanifest = \"m\"\npolicy = { shadow = { change_margin = -1.0 } }";
        let e = Config::parse(margin).unwrap_err().to_string();
        assert!(e.contains("shadow.change_margin must be a positive"), "{e}");
    }

    /// Timeouts and intervals of 0 would never wait (or spin), and one near `u64::MAX` seconds
    /// overflowed `Instant + Duration` on the first streamed request.
    #[test]
    fn timeouts_and_intervals_outside_their_range_are_refused() {
        let model = "[[models]]\nname = \"m\"\n";
        let backend =
            "[[backends]]\nkind = \"openai\"\nname = \"r\"\nurl = \"http://127.0.0.1:9\"\n";
        let cases = [
            (
                format!("[server]\nrequest_timeout_s = 0\n{model}"),
                "server.request_timeout_s must be between 1 and 86400 seconds, got 0",
            ),
            (
                format!("[server]\nrequest_timeout_s = 9223372036854775807\n{model}"),
                "server.request_timeout_s must be between 1 and 86400 seconds, got 9223372036854775807",
            ),
            (
                format!("[server]\nbody_timeout_s = 0\n{model}"),
                "server.body_timeout_s must be between 1 and 86400 seconds, got 0",
            ),
            (
                format!("[server]\nwrite_timeout_s = 0\n{model}"),
                "server.write_timeout_s must be between 1 and 86400 seconds, got 0",
            ),
            (
                "[modeswitch]\nname = \"x\"\nmodes = []\nload_wait_s = 0\n".to_string(),
                "[modeswitch]: load_wait_s must be between 1 and 86400 seconds, got 0",
            ),
            (
                format!("{backend}health_interval_s = 0\n"),
                "backend \"r\": health_interval_s must be between 1 and 86400 seconds, got 0",
            ),
            (
                format!("{backend}timeout_s = 0\n"),
                "backend \"r\": timeout_s must be between 1 and 86400 seconds, got 0",
            ),
            (
                format!("{backend}timeout_s = 86401\n"),
                "backend \"r\": timeout_s must be between 1 and 86400 seconds, got 86401",
            ),
        ];
        for (toml, want) in cases {
            let err = Config::parse(&toml).err().map(|e| e.to_string());
            assert_eq!(err.as_deref(), Some(want), "{toml}");
        }
        let cfg = Config::parse(&format!(
            "[server]\nrequest_timeout_s = 86400\nbody_timeout_s = 5\n{model}"
        ))
        .expect("the bounds are allowed");
        assert_eq!(
            (cfg.server.request_timeout_s, cfg.server.body_timeout_s),
            (86_400, 5)
        );
    }

    #[test]
    fn parses_and_refuses_unknown_keys() {
        let cfg = Config::parse(
            r#"
            [server]
            port = 9000
            api_keys = ["k1"]
            [[models]]
            name = "smollm2-135m-instruct"
            memory_budget = "1GiB"
            [[backends]]
            kind = "openai"
            name = "remote"
            url = "http://127.0.0.1:9001"
            "#,
        )
        .unwrap();
        assert_eq!(cfg.server.port, 9000);
        assert_eq!(cfg.server.host, DEFAULT_HOST);
        assert_eq!(cfg.models[0].memory_budget.as_deref(), Some("1GiB"));
        assert_eq!(cfg.backends[0].kind, BackendKind::Openai);

        let err = Config::parse("[server]\nprot = 1\n[[models]]\nname = \"m\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `prot`"), "{err}");
        let err = Config::parse("[[models]]\nname = \"m\"\nkv_format = \"f8\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown variant `f8`"), "{err}");
        let err = Config::parse("[server]\nport = 1\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("serves no model"), "{err}");
        let err = Config::parse("[[models]]\nname = \"m\"\n[[models]]\nname = \"m\"\n")
            .unwrap_err()
            .to_string();
        assert_eq!(err, "model name \"m\" is served twice");
        let err =
            Config::parse("[[backends]]\nkind = \"openai\"\nname = \"r\"\nurl = \"ftp://x\"\n")
                .unwrap_err()
                .to_string();
        assert!(err.contains("must start with http://"), "{err}");
        let backend = |urls: &str| {
            Config::parse(&format!(
                "[[backends]]\nkind = \"openai\"\nname = \"r\"\n{urls}\n"
            ))
        };
        let cfg = backend("urls = [\"http://a:1\", \"https://b:2/\"]").expect("replicas");
        assert_eq!(
            cfg.backends[0].replica_urls(),
            vec!["http://a:1".to_string(), "https://b:2/".to_string()]
        );
        for (urls, want) in [
            (
                "url = \"http://a\"\nurls = [\"http://b\"]",
                "backend \"r\": give `url` or `urls`, not both",
            ),
            (
                "",
                "backend \"r\": `url` (or `urls` for replicas) is required",
            ),
            ("urls = []", "backend \"r\": `urls` is empty"),
            (
                "urls = [\"http://a\", \"b:1\"]",
                "backend \"r\": url \"b:1\" must start with http:// or https://",
            ),
        ] {
            let err = backend(urls).unwrap_err().to_string();
            assert_eq!(err, want);
        }
    }
}
