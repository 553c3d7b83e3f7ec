//! ModeSwitch over HTTP: one model under one name, served in the inference mode the rule
//! router picks for each request from its features, before generation.
//!
//! Each offered mode is an engine of its own (precision and engine settings, see
//! `switchyard_modes::serve`), loaded on first use and evicted least-recently-used when the
//! loaded modes would exceed the memory budget. f16, the fallback, is loaded at start-up and
//! never evicted: a mode that fails to load, or cannot get room, falls back to it.
//!
//! The speculative modes run behind the same engine handle, one request at a time in arrival
//! order (their draft/verify rounds are not batched across requests). `q4-awq` is calibrated
//! on ShareGPT's calibration split when first loaded, and the calibration is kept for later
//! loads.
//!
//! Features known at request time: prompt tokens (after the chat template), requested output
//! tokens, shared-prefix tokens (the longest block-aligned prefix of this prompt seen in an
//! earlier one), memory pressure (the share of the f16 engine's KV pool in use), queue depth
//! (requests in flight), and the workload label the client may send in the
//! `x-switchyard-workload` header. The decision and its features are returned in the
//! `x-switchyard-mode` and `x-switchyard-route` headers, listed at `GET /admin/routes`, and
//! counted in /metrics.

use std::collections::{HashSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use switchyard_engine::EngineRequest;
use switchyard_modes::awq::AwqCalibration;
use switchyard_modes::gptq::{GptqCalibration, GptqSettings};
use switchyard_modes::serve::{ModeAssets, ModeServer, DEFAULT_SPEC_K};
use switchyard_request::{Mode, Precision};
use switchyard_router::{
    Decision, LearnedRouter, ModeSet, Policy, RequestFeatures, Router, RulesRouter,
};
use switchyard_tokenizer::Tokenizer;

use crate::config::ModeSwitchSection;
use crate::local::LocalModel;
use crate::ServerError;

/// Each mode's engine budget when the section gives none.
pub const DEFAULT_MODE_BUDGET: u64 = 1 << 30;
/// Decisions kept for `/admin/routes`.
pub const RECENT_ROUTES: usize = 256;
/// Prompt prefixes are remembered at multiples of this many tokens (the KV block size).
pub const PREFIX_GRAIN: usize = 16;
/// How long routing waits for the engine's memory figures before using the last ones.
pub const PRESSURE_TIMEOUT_MS: u64 = 20;
/// Prefix hashes remembered (oldest forgotten first).
pub const PREFIX_MEMORY: usize = 65_536;

/// One routing decision as `/admin/routes` lists it.
#[derive(Debug, Clone, Serialize)]
pub struct RouteRecord {
    pub unix_ms: u128,
    pub mode: Mode,
    pub rule: String,
    pub class: String,
    pub fallback: bool,
    /// Why the request fell back, when it did after the decision (load failure, no room).
    pub fallback_reason: Option<String>,
    pub decision_us: f64,
    pub features: RequestFeatures,
}

struct Loaded {
    mode: Mode,
    model: Arc<LocalModel>,
    last_used: Instant,
}

/// Hashes of block-aligned prompt prefixes seen before.
#[derive(Default)]
struct PrefixIndex {
    seen: HashSet<u64>,
    order: VecDeque<u64>,
}

impl PrefixIndex {
    fn hash(tokens: &[u32]) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        tokens.hash(&mut h);
        h.finish()
    }

    /// The longest block-aligned prefix of `prompt` seen before; then remembers `prompt`'s.
    fn observe(&mut self, prompt: &[u32]) -> usize {
        let mut shared = 0;
        let mut n = PREFIX_GRAIN;
        while n <= prompt.len() {
            let h = Self::hash(&prompt[..n]);
            if self.seen.contains(&h) {
                shared = n;
            } else {
                self.seen.insert(h);
                self.order.push_back(h);
                if self.order.len() > PREFIX_MEMORY {
                    if let Some(old) = self.order.pop_front() {
                        self.seen.remove(&old);
                    }
                }
            }
            n += PREFIX_GRAIN;
        }
        shared
    }
}

pub struct ModeSwitchModel {
    pub name: String,
    assets: ModeAssets,
    offered: ModeSet,
    router: Box<dyn Router>,
    mode_budget: u64,
    total_budget: u64,
    /// f16: tokenizes and validates every request, and serves fallbacks.
    pub base: Arc<LocalModel>,
    engines: tokio::sync::Mutex<Vec<Loaded>>,
    /// `q4-awq`'s calibration, made on its first load.
    awq: Mutex<Option<Arc<AwqCalibration>>>,
    /// `q4-gptq`'s blocks, read from the cache or made on its first load.
    gptq: Mutex<Option<Arc<GptqCalibration>>>,
    prefixes: Mutex<PrefixIndex>,
    recent: Mutex<VecDeque<RouteRecord>>,
    in_flight: AtomicUsize,
    /// Last memory pressure read from the f16 engine (f64 bits).
    last_pressure: std::sync::atomic::AtomicU64,
}

/// A routed request: the engine to run it on and the decision's headers.
pub struct Routed {
    pub model: Arc<LocalModel>,
    pub record: RouteRecord,
}

impl ModeSwitchModel {
    /// Opens the model and starts the f16 engine (blocking: run off the async runtime).
    pub fn start(section: &ModeSwitchSection, policy: Policy) -> Result<Self, ServerError> {
        let path = switchyard_zoo::resolve_model(section.path.as_deref().unwrap_or(&section.name))?;
        let source = switchyard_weights::open(&path)?;
        let tokenizer = Arc::new(Tokenizer::from_source(&*source)?);
        let parse = |s: &Option<String>, default: u64| -> Result<u64, ServerError> {
            match s {
                Some(b) => switchyard_engine::kv::budget::parse_bytes(b)
                    .map_err(|e| ServerError::Engine(e.into())),
                None => Ok(default),
            }
        };
        let mut offered: ModeSet = section.modes.iter().copied().collect();
        offered.insert(Mode::F16);
        let mode_budget = parse(&section.mode_budget, DEFAULT_MODE_BUDGET)?;
        let total_budget = parse(
            &section.memory_budget,
            mode_budget * offered.iter().count() as u64,
        )?;
        if total_budget < mode_budget {
            return Err(invalid(format!(
                "[modeswitch]: memory_budget ({total_budget} bytes) is below one mode's budget ({mode_budget})"
            )));
        }
        let draft = match (&section.draft, offered.contains(Mode::Speculative)) {
            (Some(d), true) => {
                let draft = switchyard_weights::open(switchyard_zoo::resolve_model(d)?)?;
                let dt = Tokenizer::from_source(&*draft)?;
                if dt.vocab_size() != tokenizer.vocab_size() {
                    return Err(invalid(format!(
                        "[modeswitch]: draft {d:?} has a tokenizer of {} tokens, the model one of {}; speculative decoding needs the same tokenizer",
                        dt.vocab_size(),
                        tokenizer.vocab_size()
                    )));
                }
                Some(draft)
            }
            _ => None,
        };
        let heads = if offered.contains(Mode::SelfSpeculative) {
            let heads_path = section
                .exit_heads
                .clone()
                .unwrap_or_else(|| switchyard_exits::file::default_heads_path(&path));
            let (heads, depth) = switchyard_modes::assets::self_speculative_heads(
                &path,
                Arc::clone(&source),
                &heads_path,
                section.draft_depth,
            )
            .map_err(|e| invalid(format!("[modeswitch]: {e}")))?;
            Some((heads, depth))
        } else {
            None
        };
        let router: Box<dyn Router> = match &section.learned_router {
            Some(p) => {
                let r =
                    LearnedRouter::load(p).map_err(|e| invalid(format!("[modeswitch]: {e}")))?;
                tracing::info!(model = %section.name, router = %r.name(), file = %p.display(), "routing with a learned router");
                Box::new(r)
            }
            None => Box::new(RulesRouter::new(policy)),
        };
        let assets = ModeAssets {
            name: section.name.clone(),
            source,
            tokenizer,
            draft,
            heads,
            awq: None,
            gptq: None,
            spec_k: section.draft_len.unwrap_or(DEFAULT_SPEC_K),
            max_model_len: section.max_model_len,
        };
        let base = Arc::new(load_local(&section.name, Mode::F16, &assets, mode_budget)?);
        Ok(Self {
            name: section.name.clone(),
            assets,
            offered,
            router,
            mode_budget,
            total_budget,
            engines: tokio::sync::Mutex::new(vec![Loaded {
                mode: Mode::F16,
                model: Arc::clone(&base),
                last_used: Instant::now(),
            }]),
            base,
            awq: Mutex::default(),
            gptq: Mutex::default(),
            prefixes: Mutex::default(),
            recent: Mutex::default(),
            in_flight: AtomicUsize::new(0),
            last_pressure: std::sync::atomic::AtomicU64::new(0),
        })
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// The most recent decisions, newest last.
    pub fn recent_routes(&self) -> Vec<RouteRecord> {
        self.recent
            .lock()
            .map(|r| r.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Routes a prepared request and returns the engine that serves it (loading the mode if
    /// needed, evicting the least recently used idle mode for room).
    pub async fn route(&self, req: &EngineRequest, workload: Option<String>) -> Routed {
        let shared = self
            .prefixes
            .lock()
            .map(|mut p| p.observe(&req.prompt))
            .unwrap_or(0);
        let features = RequestFeatures {
            prompt_tokens: req.prompt.len(),
            max_output_tokens: req.params.max_tokens,
            expected_output_tokens: None,
            shared_prefix_tokens: shared,
            memory_pressure: self.memory_pressure().await,
            queue_depth: self.in_flight(),
            workload,
        };
        let t0 = Instant::now();
        let decision: Decision = self.router.route_among(&features, self.offered);
        let decision_us = t0.elapsed().as_secs_f64() * 1e6;
        let (model, fallback_reason) = match self.engine(decision.mode).await {
            Ok(m) => (m, None),
            Err(why) => {
                tracing::warn!(model = %self.name, mode = %decision.mode, %why, "mode unavailable; serving in f16");
                (Arc::clone(&self.base), Some(why))
            }
        };
        let record = RouteRecord {
            unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis()),
            mode: if fallback_reason.is_some() {
                Mode::F16
            } else {
                decision.mode
            },
            rule: decision.rule.clone(),
            class: format!("{:?}", decision.class),
            fallback: decision.fallback || fallback_reason.is_some(),
            fallback_reason,
            decision_us,
            features,
        };
        if let Ok(mut r) = self.recent.lock() {
            r.push_back(record.clone());
            while r.len() > RECENT_ROUTES {
                r.pop_front();
            }
        }
        Routed { model, record }
    }

    /// The share of the f16 engine's KV pool in use (the serving memory the budget leaves for
    /// sequences), asked of the engine with a short timeout; the last known value otherwise.
    async fn memory_pressure(&self) -> f64 {
        let asked = tokio::time::timeout(
            std::time::Duration::from_millis(PRESSURE_TIMEOUT_MS),
            self.base.handle.stats().recv(),
        )
        .await;
        if let Ok(Ok(s)) = asked {
            let total = s.kv_blocks_total.max(1) as f64;
            let p = s.kv_blocks_used as f64 / total;
            self.last_pressure.store(p.to_bits(), Ordering::Relaxed);
            return p;
        }
        f64::from_bits(self.last_pressure.load(Ordering::Relaxed))
    }

    /// The engine of `mode`, loading it on first use.
    async fn engine(&self, mode: Mode) -> Result<Arc<LocalModel>, String> {
        let mut engines = self.engines.lock().await;
        if let Some(l) = engines.iter_mut().find(|l| l.mode == mode) {
            l.last_used = Instant::now();
            return Ok(Arc::clone(&l.model));
        }
        // Room: evict idle modes, least recently used first (never f16).
        while (engines.len() as u64 + 1) * self.mode_budget > self.total_budget {
            let victim = engines
                .iter()
                .enumerate()
                .filter(|(_, l)| l.mode != Mode::F16 && l.model.in_flight() == 0)
                .min_by_key(|(_, l)| l.last_used)
                .map(|(i, _)| i);
            let Some(i) = victim else {
                return Err(format!(
                    "no room for {mode} in the {} -byte budget: every loaded mode is busy",
                    self.total_budget
                ));
            };
            let evicted = engines.remove(i);
            tracing::info!(model = %self.name, mode = %evicted.mode, "mode evicted (least recently used)");
            let _ = evicted.model.handle.shutdown().recv().await;
        }
        let (name, mut assets, budget) = (self.name.clone(), self.assets.clone(), self.mode_budget);
        if mode == Mode::Q4Awq {
            assets.awq = Some(self.awq_calibration().await?);
        }
        if mode.precision() == Precision::Q4Gptq {
            assets.gptq = Some(self.gptq_calibration().await?);
        }
        let t0 = Instant::now();
        let local = tokio::task::spawn_blocking(move || load_local(&name, mode, &assets, budget))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        tracing::info!(model = %self.name, %mode, seconds = t0.elapsed().as_secs_f64(), "mode loaded");
        let local = Arc::new(local);
        engines.push(Loaded {
            mode,
            model: Arc::clone(&local),
            last_used: Instant::now(),
        });
        Ok(local)
    }

    /// `q4-awq`'s calibration, made on first use (called with the engines locked, so once).
    async fn awq_calibration(&self) -> Result<Arc<AwqCalibration>, String> {
        if let Some(c) = self.awq.lock().ok().and_then(|c| c.clone()) {
            return Ok(c);
        }
        let (source, tokenizer) = (
            Arc::clone(&self.assets.source),
            Arc::clone(&self.assets.tokenizer),
        );
        let t0 = Instant::now();
        let c = tokio::task::spawn_blocking(move || {
            switchyard_modes::assets::calibrate_awq(source, &tokenizer, |_, _| {})
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("q4-awq calibration: {e}"))?;
        tracing::info!(model = %self.name, seconds = t0.elapsed().as_secs_f64(), tokens = c.calibration_tokens, "q4-awq calibrated");
        let c = Arc::new(c);
        if let Ok(mut slot) = self.awq.lock() {
            *slot = Some(Arc::clone(&c));
        }
        Ok(c)
    }

    /// `q4-gptq`'s blocks: from the GPTQ cache, or made on first use and cached (called with
    /// the engines locked, so once).
    async fn gptq_calibration(&self) -> Result<Arc<GptqCalibration>, String> {
        if let Some(c) = self.gptq.lock().ok().and_then(|c| c.clone()) {
            return Ok(c);
        }
        let (source, tokenizer) = (
            Arc::clone(&self.assets.source),
            Arc::clone(&self.assets.tokenizer),
        );
        let t0 = Instant::now();
        let (c, cached) = tokio::task::spawn_blocking(move || {
            switchyard_modes::assets::calibrate_gptq(
                source,
                &tokenizer,
                &GptqSettings::default(),
                &switchyard_modes::assets::gptq_cache_dir(),
                |_, _| {},
            )
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("q4-gptq calibration: {e}"))?;
        tracing::info!(model = %self.name, seconds = t0.elapsed().as_secs_f64(), tokens = c.calibration_tokens, cached, "q4-gptq ready");
        let c = Arc::new(c);
        if let Ok(mut slot) = self.gptq.lock() {
            *slot = Some(Arc::clone(&c));
        }
        Ok(c)
    }

    /// Counts a request in flight until the returned guard drops.
    pub fn enter(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(Arc::clone(self))
    }
}

pub struct InFlight(Arc<ModeSwitchModel>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

fn load_local(
    name: &str,
    mode: Mode,
    assets: &ModeAssets,
    budget: u64,
) -> Result<LocalModel, ServerError> {
    ModeServer::load(mode, assets, budget)
        .and_then(|m| m.into_handle(assets, budget))
        .map(|handle| LocalModel::from_handle(name, handle))
        .map_err(|e| ServerError::Backend {
            name: name.into(),
            detail: format!("{mode}: {e}"),
        })
}

fn invalid(msg: String) -> ServerError {
    ServerError::Config(crate::config::ConfigError::Invalid(msg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_index_finds_block_aligned_shared_prefixes() {
        let mut p = PrefixIndex::default();
        let a: Vec<u32> = (0..100).collect();
        assert_eq!(p.observe(&a), 0);
        // Same first 40 tokens: 32 of them are in whole 16-token grains.
        let mut b: Vec<u32> = (0..40).collect();
        b.extend(1000..1060);
        assert_eq!(p.observe(&b), 32);
        assert_eq!(p.observe(&a), 96);
        assert_eq!(p.observe(&[7; 15]), 0);
    }
}
