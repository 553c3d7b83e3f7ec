//! Serving one request in one mode: the engine configuration each mode stands for, and a
//! uniform `run` over engine-served and speculative modes.
//!
//! Engine modes share one engine implementation and differ only in its settings:
//! - precision modes (`f16`, `f32`, `int8`, `q4`, `q4-awq`) serve one request at a time, with
//!   no prefix cache and no chunked prefill: the fixed baseline configuration at each
//!   precision;
//! - `prefix-cache`, `chunked-prefill`, `continuous-batching` and `kv-compressed` turn one
//!   feature on over f16 weights; the hybrids combine a precision with one feature.
//!
//! Speculative modes decode one sequence at a time with a draft and a verifier (draft and
//! verify are not batched across requests); requests routed to them queue for the decoder.
//! CUDA graphs, one of the paper's modes, have no CPU counterpart and are not offered.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use switchyard_engine::{EngineConfig, EngineHandle, EngineRequest, KvFormat, SchedulerConfig};
use switchyard_exits::ExitHeads;
use switchyard_models::LayeredModel;
use switchyard_request::{Mode, SamplingParams};
use switchyard_tokenizer::Tokenizer;
use switchyard_weights::WeightSource;

use crate::awq::AwqCalibration;
use crate::self_speculative::SelfSpeculativeDecoder;
use crate::speculative::SpeculativeDecoder;
use crate::{precision, ModesError, Result};

/// Draft length of the speculative modes.
pub const DEFAULT_SPEC_K: usize = 4;

/// The engine settings of an engine-served mode under `budget` bytes.
pub fn engine_config(mode: Mode, budget: u64) -> EngineConfig {
    EngineConfig {
        memory_budget: budget,
        scheduler: SchedulerConfig {
            max_num_seqs: if mode.continuous_batching() {
                switchyard_engine::scheduler::DEFAULT_MAX_NUM_SEQS
            } else {
                1
            },
            chunked_prefill: mode.chunked_prefill(),
            prefix_caching: mode.prefix_cache(),
            ..SchedulerConfig::default()
        },
        kv_format: if mode.kv_compressed() {
            KvFormat::Int8
        } else {
            KvFormat::F32
        },
        ..EngineConfig::default()
    }
}

/// What a model needs for every mode.
#[derive(Clone)]
pub struct ModeAssets {
    pub name: String,
    pub source: Arc<dyn WeightSource>,
    pub tokenizer: Arc<Tokenizer>,
    /// Draft model of `speculative` (same tokenizer).
    pub draft: Option<Arc<dyn WeightSource>>,
    /// Exit heads of `self-speculative`, and the depth it drafts from.
    pub heads: Option<(Arc<ExitHeads>, usize)>,
    /// Calibration of `q4-awq`.
    pub awq: Option<Arc<AwqCalibration>>,
    pub spec_k: usize,
}

/// A mode ready to serve.
pub enum ModeServer {
    Engine(EngineHandle),
    /// Draft and target; the lock serves one sequence at a time.
    Speculative {
        draft: Box<LayeredModel>,
        target: Box<LayeredModel>,
        k: usize,
        lock: Mutex<()>,
    },
    SelfSpeculative {
        model: Box<LayeredModel>,
        heads: Arc<ExitHeads>,
        depth: usize,
        k: usize,
        lock: Mutex<()>,
    },
}

/// One request's result in any mode.
#[derive(Debug, Clone)]
pub struct Served {
    pub tokens: Vec<u32>,
    pub text: String,
    pub latency_s: f64,
    /// Drafted and accepted tokens (speculative modes).
    pub drafted: usize,
    pub accepted: usize,
}

impl ModeServer {
    /// Loads `mode` for `assets` under `budget` bytes (engine modes: weights + KV pool +
    /// workspace must fit; speculative modes: the weights).
    pub fn load(mode: Mode, assets: &ModeAssets, budget: u64) -> Result<Self> {
        let p = mode.precision();
        let model = precision::load(Arc::clone(&assets.source), p, assets.awq.as_deref())?;
        match mode {
            Mode::Speculative => {
                let draft_src = assets.draft.as_ref().ok_or_else(|| {
                    ModesError::Invalid(format!(
                        "speculative mode needs a draft model for {}",
                        assets.name
                    ))
                })?;
                let draft = precision::load(Arc::clone(draft_src), p, None)?;
                check_fits(&[&model, &draft], budget)?;
                SpeculativeDecoder::new(&draft, &model)?.with_draft_len(assets.spec_k)?;
                Ok(Self::Speculative {
                    draft: Box::new(draft),
                    target: Box::new(model),
                    k: assets.spec_k,
                    lock: Mutex::new(()),
                })
            }
            Mode::SelfSpeculative => {
                let (heads, depth) = assets.heads.clone().ok_or_else(|| {
                    ModesError::Invalid(format!(
                        "self-speculative mode needs exit heads for {}",
                        assets.name
                    ))
                })?;
                check_fits(&[&model], budget)?;
                SelfSpeculativeDecoder::new(&model, &heads, depth)?
                    .with_draft_len(assets.spec_k)?;
                Ok(Self::SelfSpeculative {
                    model: Box::new(model),
                    heads,
                    depth,
                    k: assets.spec_k,
                    lock: Mutex::new(()),
                })
            }
            _ => Ok(Self::Engine(EngineHandle::start(
                model,
                Arc::clone(&assets.tokenizer),
                engine_config(mode, budget),
                &assets.name,
            )?)),
        }
    }

    /// Serves one request to completion.
    pub fn run(
        &self,
        tokenizer: &Tokenizer,
        prompt: &[u32],
        params: &SamplingParams,
    ) -> Result<Served> {
        let t0 = Instant::now();
        match self {
            Self::Engine(h) => {
                let c = h
                    .add_request(EngineRequest {
                        prompt: prompt.to_vec(),
                        params: params.clone(),
                    })?
                    .wait()?;
                Ok(Served {
                    tokens: c.token_ids,
                    text: c.text,
                    latency_s: (c.finished_at - c.arrival).as_secs_f64(),
                    drafted: 0,
                    accepted: 0,
                })
            }
            Self::Speculative {
                draft,
                target,
                k,
                lock,
            } => {
                let _one = lock.lock().map_err(|_| poisoned())?;
                let g = SpeculativeDecoder::new(draft, target)?
                    .with_draft_len(*k)?
                    .generate(tokenizer, prompt, params, |_| {})?;
                Ok(spec_served(g, t0))
            }
            Self::SelfSpeculative {
                model,
                heads,
                depth,
                k,
                lock,
            } => {
                let _one = lock.lock().map_err(|_| poisoned())?;
                let g = SelfSpeculativeDecoder::new(model, heads, *depth)?
                    .with_draft_len(*k)?
                    .generate(tokenizer, prompt, params, |_| {})?;
                Ok(spec_served(g, t0))
            }
        }
    }

    /// Bytes of weights the mode holds (speculative modes: draft and target).
    pub fn weights_bytes(&self) -> u64 {
        let bytes = |m: &LayeredModel| m.resident_bytes().total() as u64;
        match self {
            Self::Engine(_) => 0,
            Self::Speculative { draft, target, .. } => bytes(draft) + bytes(target),
            Self::SelfSpeculative { model, .. } => bytes(model),
        }
    }

    pub fn engine(&self) -> Option<&EngineHandle> {
        match self {
            Self::Engine(h) => Some(h),
            _ => None,
        }
    }
}

fn poisoned() -> ModesError {
    ModesError::Invalid(
        "a speculative request panicked earlier; the decoder lock is poisoned".into(),
    )
}

fn spec_served(g: crate::speculative::SpecGeneration, t0: Instant) -> Served {
    Served {
        tokens: g.generation.tokens,
        text: g.generation.text,
        latency_s: t0.elapsed().as_secs_f64(),
        drafted: g.stats.drafted,
        accepted: g.stats.accepted,
    }
}

fn check_fits(models: &[&LayeredModel], budget: u64) -> Result<()> {
    let bytes: u64 = models
        .iter()
        .map(|m| m.resident_bytes().total() as u64)
        .sum();
    if bytes > budget {
        return Err(ModesError::Invalid(format!(
            "the weights take {bytes} bytes, over the {budget}-byte budget"
        )));
    }
    Ok(())
}
