//! ModeSwitch over HTTP: one model under one name, served in the inference mode the rule
//! router picks for each request from its features, before generation.
//!
//! Each offered mode is an engine of its own (precision and engine settings, see
//! `switchyard_modes::serve`), loaded on first use and evicted least-recently-used when the
//! loaded modes would exceed the memory budget. f16, the fallback, is loaded at start-up and
//! never evicted: a mode that fails to load, or cannot get room, falls back to it.
//!
//! A load runs in the background: requests for loaded modes never wait for it, a request for
//! the loading mode waits at most `load_wait_s` and is then served in f16 while the load goes
//! on, and a mode whose engine thread failed is loaded again on its next request.
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

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use switchyard_engine::{EngineRequest, EngineStatus};
use switchyard_modes::awq::AwqCalibration;
use switchyard_modes::gptq::{GptqCalibration, GptqSettings};
use switchyard_modes::serve::{ModeAssets, ModeServer, DEFAULT_SPEC_K};
use switchyard_request::{Mode, Precision};
use switchyard_router::{
    Decision, LearnedRouter, ModeSet, Policy, PrefixIndex, RequestFeatures, Router, RulesRouter,
};
use switchyard_tokenizer::Tokenizer;
use tokio::sync::{watch, OnceCell, Semaphore};

use crate::config::{ModeSwitchSection, DEFAULT_LOAD_WAIT_S};
use crate::error::ApiError;
use crate::local::{on_blocking_pool, LocalModel};
use crate::serving::{Admitted, Backend, Places, Started};
use crate::validate::ValidRequest;
use crate::ServerError;

/// Each mode's engine budget when the section gives none.
pub const DEFAULT_MODE_BUDGET: u64 = 1 << 30;
/// Decisions kept for `/admin/routes`.
pub const RECENT_ROUTES: usize = 256;
/// How long routing waits for the engine's memory figures before using the last ones.
pub const PRESSURE_TIMEOUT_MS: u64 = 20;

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

/// The outcome of a mode's load, once it has one.
type LoadOutcome = Option<Result<Arc<LocalModel>, String>>;

/// One mode's engine, or its load in progress.
struct Slot {
    mode: Mode,
    engine: Engine,
}

enum Engine {
    Loaded {
        model: Arc<LocalModel>,
        last_used: Instant,
    },
    /// Says how the background load ended.
    Loading(watch::Receiver<LoadOutcome>),
}

/// Builds one mode's engine from the model's assets within a budget (blocking):
/// [`load_local`], or a stand-in in tests.
pub type ModeLoader =
    Arc<dyn Fn(&str, Mode, &ModeAssets, u64) -> Result<LocalModel, ServerError> + Send + Sync>;

pub struct ModeSwitchModel {
    pub name: String,
    assets: ModeAssets,
    loader: ModeLoader,
    offered: ModeSet,
    router: Box<dyn Router>,
    mode_budget: u64,
    total_budget: u64,
    /// f16: tokenizes and validates every request, and serves fallbacks.
    pub base: Arc<LocalModel>,
    /// Held only to look up or change the list, never across a load.
    engines: Mutex<Vec<Slot>>,
    /// How long a request waits for its mode to load before it is served in f16.
    load_wait: Duration,
    /// `q4-awq`'s calibration, made on its first load.
    awq: OnceCell<Arc<AwqCalibration>>,
    /// `q4-gptq`'s blocks, read from the cache or made on its first load.
    gptq: OnceCell<Arc<GptqCalibration>>,
    prefixes: Mutex<PrefixIndex>,
    recent: Mutex<VecDeque<RouteRecord>>,
    in_flight: Places,
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
        Self::start_with_loader(section, policy, Arc::new(load_local))
    }

    /// [`ModeSwitchModel::start`], building each mode's engine with `loader`.
    pub fn start_with_loader(
        section: &ModeSwitchSection,
        policy: Policy,
        loader: ModeLoader,
    ) -> Result<Self, ServerError> {
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
        let base = Arc::new(loader(&section.name, Mode::F16, &assets, mode_budget)?);
        Ok(Self {
            name: section.name.clone(),
            assets,
            loader,
            offered,
            router,
            mode_budget,
            total_budget,
            engines: Mutex::new(vec![Slot {
                mode: Mode::F16,
                engine: Engine::Loaded {
                    model: Arc::clone(&base),
                    last_used: Instant::now(),
                },
            }]),
            base,
            load_wait: Duration::from_secs(section.load_wait_s.unwrap_or(DEFAULT_LOAD_WAIT_S)),
            awq: OnceCell::new(),
            gptq: OnceCell::new(),
            prefixes: Mutex::default(),
            recent: Mutex::default(),
            in_flight: Places::default(),
            last_pressure: std::sync::atomic::AtomicU64::new(0),
        })
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.in_flight()
    }

    /// The most recent decisions, newest last.
    pub fn recent_routes(&self) -> Vec<RouteRecord> {
        self.recent
            .lock()
            .map(|r| r.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Tokenizes `req` with the f16 engine's tokenizer and hashes its prompt's prefixes, on
    /// the blocking pool once one of `places` is free.
    pub async fn prepare(
        &self,
        req: ValidRequest,
        places: &Arc<Semaphore>,
    ) -> Result<(ValidRequest, EngineRequest, Vec<u64>), ApiError> {
        let base = Arc::clone(&self.base);
        on_blocking_pool(places, move || {
            let engine_req = base.prepare(&req)?;
            let prefixes = PrefixIndex::hashes(&engine_req.prompt);
            Ok((req, engine_req, prefixes))
        })
        .await?
    }

    /// Routes a prepared request (its prompt's prefix hashes from
    /// [`ModeSwitchModel::prepare`]) and returns the engine that serves it: its mode's, once
    /// loaded (a load starts in the background, evicting the least recently used idle mode
    /// for room), or f16.
    pub async fn route(
        self: &Arc<Self>,
        req: &EngineRequest,
        prefixes: &[u64],
        workload: Option<String>,
    ) -> Routed {
        let shared = self
            .prefixes
            .lock()
            .map(|mut p| p.observe(prefixes))
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
        // Parameters only the batching sampler implements rule the speculative modes out.
        let offered = if req.params.batching_only().is_some() {
            self.offered
                .without(Mode::Speculative)
                .without(Mode::SelfSpeculative)
        } else {
            self.offered
        };
        let decision: Decision = self.router.route_among(&features, offered);
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

    /// The engine of `mode`: at once when loaded; otherwise its load (started here when none
    /// runs) is waited for at most `load_wait_s`.
    async fn engine(self: &Arc<Self>, mode: Mode) -> Result<Arc<LocalModel>, String> {
        let mut outcome = {
            let mut slots = self
                .engines
                .lock()
                .map_err(|_| "the mode list is poisoned".to_string())?;
            let at = slots.iter().position(|s| s.mode == mode);
            match at.map(|i| &mut slots[i].engine) {
                Some(Engine::Loaded { model, last_used })
                    if model.handle.status() == EngineStatus::Running =>
                {
                    *last_used = Instant::now();
                    return Ok(Arc::clone(model));
                }
                Some(Engine::Loading(outcome)) => outcome.clone(),
                Some(Engine::Loaded { .. }) => {
                    // Its engine thread failed: load it again.
                    tracing::warn!(model = %self.name, %mode, "the mode's engine is down; loading it again");
                    if let Some(i) = at {
                        slots.remove(i);
                    }
                    self.start_load(&mut slots, mode)?
                }
                None => self.start_load(&mut slots, mode)?,
            }
        };
        let waited = tokio::time::timeout(self.load_wait, outcome.wait_for(Option::is_some)).await;
        match waited {
            Ok(Ok(done)) => done
                .clone()
                .unwrap_or_else(|| Err(format!("{mode} did not load"))),
            Ok(Err(_)) => Err(format!("the load of {mode} ended without an outcome")),
            Err(_) => Err(format!(
                "{mode} is still loading (waited {} s)",
                self.load_wait.as_secs()
            )),
        }
    }

    /// Makes room for `mode` (evicting idle loaded modes, least recently used first, never
    /// f16; loads in progress count) and starts its load in the background.
    fn start_load(
        self: &Arc<Self>,
        slots: &mut Vec<Slot>,
        mode: Mode,
    ) -> Result<watch::Receiver<LoadOutcome>, String> {
        while (slots.len() as u64 + 1) * self.mode_budget > self.total_budget {
            let victim = slots
                .iter()
                .enumerate()
                .filter_map(|(i, s)| match &s.engine {
                    Engine::Loaded { model, last_used }
                        if s.mode != Mode::F16 && model.in_flight() == 0 =>
                    {
                        Some((i, *last_used))
                    }
                    _ => None,
                })
                .min_by_key(|&(_, last_used)| last_used)
                .map(|(i, _)| i);
            let Some(i) = victim else {
                return Err(format!(
                    "no room for {mode} in the {} -byte budget: every loaded mode is busy",
                    self.total_budget
                ));
            };
            let evicted = slots.remove(i);
            tracing::info!(model = %self.name, mode = %evicted.mode, "mode evicted (least recently used)");
            if let Engine::Loaded { model, .. } = evicted.engine {
                tokio::spawn(async move {
                    let _ = model.handle.shutdown().recv().await;
                });
            }
        }
        let (done, outcome) = watch::channel(None);
        slots.push(Slot {
            mode,
            engine: Engine::Loading(outcome.clone()),
        });
        tokio::spawn(Arc::clone(self).load(mode, done));
        Ok(outcome)
    }

    /// Loads `mode` (its calibration first, when it needs one), puts the engine in its slot
    /// (or frees the slot when the load failed, so that a later request tries again) and says
    /// so on `done`.
    async fn load(self: Arc<Self>, mode: Mode, done: watch::Sender<LoadOutcome>) {
        let t0 = Instant::now();
        let result = self.build(mode).await.map(Arc::new);
        match &result {
            Ok(_) => {
                tracing::info!(model = %self.name, %mode, seconds = t0.elapsed().as_secs_f64(), "mode loaded")
            }
            Err(why) => tracing::warn!(model = %self.name, %mode, %why, "mode failed to load"),
        }
        if let Ok(mut slots) = self.engines.lock() {
            if let Some(i) = slots.iter().position(|s| s.mode == mode) {
                match &result {
                    Ok(model) => {
                        slots[i].engine = Engine::Loaded {
                            model: Arc::clone(model),
                            last_used: Instant::now(),
                        }
                    }
                    Err(_) => {
                        slots.remove(i);
                    }
                }
            }
        }
        let _ = done.send(Some(result));
    }

    /// `mode`'s engine (blocking work on the blocking pool).
    async fn build(&self, mode: Mode) -> Result<LocalModel, String> {
        let (name, mut assets, budget) = (self.name.clone(), self.assets.clone(), self.mode_budget);
        if mode == Mode::Q4Awq {
            assets.awq = Some(self.awq_calibration().await?);
        }
        if mode.precision() == Precision::Q4Gptq {
            assets.gptq = Some(self.gptq_calibration().await?);
        }
        let loader = Arc::clone(&self.loader);
        tokio::task::spawn_blocking(move || loader(&name, mode, &assets, budget))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())
    }

    /// `q4-awq`'s calibration, made once, on first use.
    async fn awq_calibration(&self) -> Result<Arc<AwqCalibration>, String> {
        let (source, tokenizer) = self.calibration_inputs();
        made_once(&self.awq, &self.name, "q4-awq calibration", move || {
            let c = switchyard_modes::assets::calibrate_awq(source, &tokenizer, |_, _| {})?;
            tracing::info!(tokens = c.calibration_tokens, "q4-awq calibrated");
            Ok(c)
        })
        .await
    }

    /// `q4-gptq`'s blocks: from the GPTQ cache, or made once, on first use, and cached.
    async fn gptq_calibration(&self) -> Result<Arc<GptqCalibration>, String> {
        let (source, tokenizer) = self.calibration_inputs();
        made_once(&self.gptq, &self.name, "q4-gptq calibration", move || {
            let (c, cached) = switchyard_modes::assets::calibrate_gptq(
                source,
                &tokenizer,
                &GptqSettings::default(),
                &switchyard_modes::assets::gptq_cache_dir(),
                |_, _| {},
            )?;
            tracing::info!(tokens = c.calibration_tokens, cached, "q4-gptq ready");
            Ok(c)
        })
        .await
    }

    fn calibration_inputs(&self) -> (Arc<dyn switchyard_weights::WeightSource>, Arc<Tokenizer>) {
        (
            Arc::clone(&self.assets.source),
            Arc::clone(&self.assets.tokenizer),
        )
    }
}

impl Backend for ModeSwitchModel {
    /// Tokenized and routed here; then the routed mode's engine serves it as a local model's
    /// request, with the mode and the decision's reasons in `x-switchyard-mode` and
    /// `x-switchyard-route`.
    fn places(&self) -> &Places {
        &self.in_flight
    }

    async fn start(self: &Arc<Self>, a: Admitted<'_>) -> Result<Started, ApiError> {
        let (place, req, ctx) = (a.place, a.req, a.ctx);
        let limit = ctx.max_in_flight;
        let name = req.model.clone();
        let (req, engine_req, prefixes) = self.prepare(req, ctx.tokenizing).await?;
        let workload = ctx
            .headers
            .get("x-switchyard-workload")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let routed = self.route(&engine_req, &prefixes, workload).await;
        let r = &routed.record;
        ctx.metrics
            .route_decisions
            .with_label_values(&[
                name.as_str(),
                r.mode.name(),
                r.rule.as_str(),
                if r.fallback { "true" } else { "false" },
            ])
            .inc();
        ctx.metrics
            .route_seconds
            .with_label_values(&[&name])
            .inc_by(r.decision_us / 1e6);
        let engine_place = routed.model.in_flight.admit(limit)?;
        let route = format!(
            "rule={}; class={}; fallback={}; prompt_tokens={}; max_tokens={}; shared_prefix_tokens={}; memory_pressure={:.2}; queue_depth={}; workload={}",
            r.rule,
            r.class,
            r.fallback,
            r.features.prompt_tokens,
            r.features.max_output_tokens,
            r.features.shared_prefix_tokens,
            r.features.memory_pressure,
            r.features.queue_depth,
            r.features.workload.as_deref().unwrap_or("-"),
        );
        let mode = r.mode.name().to_string();
        let g = routed.model.generate(req, engine_req, ctx.deadline)?;
        Ok(Started::Generated(Box::new(
            g.holding(engine_place)
                .holding(place)
                .with_header("x-switchyard-mode", mode)
                .with_header("x-switchyard-route", route),
        )))
    }
}

/// `cell`'s value, made by `make` on the blocking pool the first time it is asked for (one
/// caller makes it while the others wait); `what` names it in errors and in the log line of
/// `model`.
async fn made_once<T: Send + Sync + 'static>(
    cell: &OnceCell<Arc<T>>,
    model: &str,
    what: &str,
    make: impl FnOnce() -> Result<T, switchyard_modes::ModesError> + Send + 'static,
) -> Result<Arc<T>, String> {
    cell.get_or_try_init(|| async {
        let t0 = Instant::now();
        let made = tokio::task::spawn_blocking(make)
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("{what}: {e}"))?;
        tracing::info!(%model, seconds = t0.elapsed().as_secs_f64(), "{what} made");
        Ok(Arc::new(made))
    })
    .await
    .cloned()
}

/// Builds `mode`'s engine of the model in `assets` (the [`ModeLoader`] of a server).
pub fn load_local(
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
