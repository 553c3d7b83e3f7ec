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
//! [`ModeServer::into_handle`] puts them behind the same [`EngineHandle`] as engine modes
//! (see `switchyard_engine::sequential`), which is how the server streams and aborts them.
//! CUDA graphs, one of the paper's modes, have no CPU counterpart and are not offered.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use switchyard_engine::{
    DecodedToken, EngineConfig, EngineHandle, EngineInfo, EngineRequest, KvFormat, SchedulerConfig,
    SequentialDecoder,
};
use switchyard_exits::ExitHeads;
use switchyard_models::LayeredModel;
use switchyard_request::{FinishReason, Mode, SamplingParams};
use switchyard_tokenizer::Tokenizer;
use switchyard_weights::WeightSource;

use crate::awq::AwqCalibration;
use crate::gptq::GptqCalibration;
use crate::precision::Calibrations;
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
            KvFormat::default()
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
    /// Calibration of `q4-gptq` (and its prefix-cache hybrid).
    pub gptq: Option<Arc<GptqCalibration>>,
    pub spec_k: usize,
    /// Longest sequence served (see [`EngineConfig::max_model_len`]); `None`: the model's
    /// context.
    pub max_model_len: Option<usize>,
}

impl ModeAssets {
    /// The calibrations held, for [`precision::load`].
    pub fn calibrations(&self) -> Calibrations<'_> {
        Calibrations {
            awq: self.awq.as_deref(),
            gptq: self.gptq.as_deref(),
        }
    }
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
        let model = precision::load(Arc::clone(&assets.source), p, assets.calibrations())?;
        match mode {
            Mode::Speculative => {
                let draft_src = assets.draft.as_ref().ok_or_else(|| {
                    ModesError::Invalid(format!(
                        "speculative mode needs a draft model for {}",
                        assets.name
                    ))
                })?;
                let draft = precision::load(Arc::clone(draft_src), p, Calibrations::default())?;
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
                EngineConfig {
                    max_model_len: assets.max_model_len,
                    ..engine_config(mode, budget)
                },
                &assets.name,
            )?)),
        }
    }

    /// `mode`'s engine with continuous batching, chunked prefill and the prefix cache on,
    /// whatever the mode's own settings: for scoring many generations at once. Greedy tokens do not depend on the
    /// batch (the engine's tests assert it bit for bit), so its answers are the mode's own.
    /// `None` for the speculative modes, which decode one sequence at a time.
    pub fn batched(mode: Mode, assets: &ModeAssets, budget: u64) -> Result<Option<EngineHandle>> {
        if mode.speculative() {
            return Ok(None);
        }
        let model = precision::load(
            Arc::clone(&assets.source),
            mode.precision(),
            assets.calibrations(),
        )?;
        let mut config = EngineConfig {
            max_model_len: assets.max_model_len,
            ..engine_config(mode, budget)
        };
        config.scheduler.max_num_seqs = switchyard_engine::scheduler::DEFAULT_MAX_NUM_SEQS;
        // Without chunking, a prompt longer than a step's token budget (GSM8K's 8-shot prompts)
        // runs only in a step of its own, so such requests would still go one at a time.
        // Chunking does not change results either (engine tests, bit for bit).
        config.scheduler.chunked_prefill = true;
        // GSM8K's prompts share their 8 shots (about 900 tokens): with the prefix cache they
        // are computed once, not once per item, and a hit gives the cold logits (engine tests),
        // so the answers are the same either way.
        config.scheduler.prefix_caching = true;
        Ok(Some(EngineHandle::start(
            model,
            Arc::clone(&assets.tokenizer),
            config,
            &assets.name,
        )?))
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

    /// The mode behind an [`EngineHandle`]: engine modes as they are, speculative modes on a
    /// thread that serves their requests one after another. `budget` is what its statistics
    /// report as the memory budget.
    pub fn into_handle(self, assets: &ModeAssets, budget: u64) -> Result<EngineHandle> {
        let tokenizer = Arc::clone(&assets.tokenizer);
        let info = |m: &LayeredModel| {
            EngineInfo::new(
                assets.name.clone(),
                m.n_layers(),
                assets
                    .max_model_len
                    .map_or(m.spec().context_length, |c| c.min(m.spec().context_length)),
                m.spec().vocab_size,
                Arc::clone(&tokenizer),
            )
        };
        let (decoder, info): (Box<dyn SequentialDecoder>, EngineInfo) = match self {
            Self::Engine(h) => return Ok(h),
            Self::Speculative {
                draft, target, k, ..
            } => {
                let info = info(&target);
                (
                    Box::new(SpeculativeServing {
                        draft,
                        target,
                        k,
                        tokenizer,
                    }),
                    info,
                )
            }
            Self::SelfSpeculative {
                model,
                heads,
                depth,
                k,
                ..
            } => {
                let info = info(&model);
                (
                    Box::new(SelfSpeculativeServing {
                        model,
                        heads,
                        depth,
                        k,
                        tokenizer,
                    }),
                    info,
                )
            }
        };
        Ok(EngineHandle::spawn_sequential(decoder, info, budget)?)
    }

    pub fn engine(&self) -> Option<&EngineHandle> {
        match self {
            Self::Engine(h) => Some(h),
            _ => None,
        }
    }
}

/// `speculative` behind an engine handle.
struct SpeculativeServing {
    draft: Box<LayeredModel>,
    target: Box<LayeredModel>,
    k: usize,
    tokenizer: Arc<Tokenizer>,
}

impl SequentialDecoder for SpeculativeServing {
    fn generate(
        &mut self,
        request: &EngineRequest,
        emit: &mut dyn FnMut(Option<DecodedToken>, &str) -> bool,
    ) -> switchyard_engine::Result<FinishReason> {
        let g = SpeculativeDecoder::new(&self.draft, &self.target)
            .and_then(|d| d.with_draft_len(self.k))
            .and_then(|d| d.generate_with(&self.tokenizer, &request.prompt, &request.params, emit))
            .map_err(into_engine_error)?;
        tracing::debug!(
            drafted = g.stats.drafted,
            accepted = g.stats.accepted,
            "speculative request done"
        );
        Ok(g.generation.finish_reason)
    }

    fn weights_bytes(&self) -> u64 {
        [&self.draft, &self.target]
            .iter()
            .map(|m| m.resident_bytes().total() as u64)
            .sum()
    }
}

/// `self-speculative` behind an engine handle.
struct SelfSpeculativeServing {
    model: Box<LayeredModel>,
    heads: Arc<ExitHeads>,
    depth: usize,
    k: usize,
    tokenizer: Arc<Tokenizer>,
}

impl SequentialDecoder for SelfSpeculativeServing {
    fn generate(
        &mut self,
        request: &EngineRequest,
        emit: &mut dyn FnMut(Option<DecodedToken>, &str) -> bool,
    ) -> switchyard_engine::Result<FinishReason> {
        let g = SelfSpeculativeDecoder::new(&self.model, &self.heads, self.depth)
            .and_then(|d| d.with_draft_len(self.k))
            .and_then(|d| d.generate_with(&self.tokenizer, &request.prompt, &request.params, emit))
            .map_err(into_engine_error)?;
        Ok(g.generation.finish_reason)
    }

    fn weights_bytes(&self) -> u64 {
        self.model.resident_bytes().total() as u64
    }
}

/// The engine's error for a decoder's: its own kinds as they are, the rest as a failed step.
fn into_engine_error(e: ModesError) -> switchyard_engine::EngineError {
    match e {
        ModesError::Engine(e) => *e,
        other => switchyard_engine::EngineError::StepFailed(other.to_string()),
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
