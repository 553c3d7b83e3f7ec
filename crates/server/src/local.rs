//! A model served by a local engine: start-up, request preparation (tokenizing, context
//! checks), admission, and turning engine outputs into OpenAI responses and stream chunks.

use std::sync::Arc;

use switchyard_engine::{EngineConfig, EngineHandle, EngineInfo, EngineRequest, RequestOutput};
use switchyard_models::{LayeredModel, LoadOptions};
use switchyard_request::FinishReason;
use switchyard_tokenizer::Tokenizer;
use tokio::sync::Semaphore;

use crate::config::ModelSection;
use crate::error::ApiError;
use crate::serving::{
    response_id, Admitted, Backend, Choices, Generation, Outputs, Places, Started,
};
use crate::validate::{Prompt, ValidRequest};
use crate::ServerError;

pub struct LocalModel {
    pub name: String,
    pub handle: EngineHandle,
    pub info: EngineInfo,
    /// Requests admitted and not answered yet.
    pub(crate) in_flight: Places,
}

impl LocalModel {
    /// Loads the model and starts its engine thread (blocking: run off the async runtime).
    pub fn start(section: &ModelSection) -> Result<Self, ServerError> {
        let path = switchyard_zoo::resolve_model(section.path.as_deref().unwrap_or(&section.name))?;
        let source = switchyard_weights::open(&path)?;
        let tokenizer = Arc::new(Tokenizer::from_source(&*source)?);
        let model = LayeredModel::load(Arc::clone(&source), &LoadOptions::default())?;
        let mut cfg = EngineConfig::default();
        if let Some(b) = &section.memory_budget {
            cfg.memory_budget = switchyard_engine::kv::budget::parse_bytes(b)
                .map_err(|e| ServerError::Engine(e.into()))?;
        }
        if let Some(n) = section.max_batched_tokens {
            cfg.scheduler.max_batched_tokens = n;
        }
        if let Some(n) = section.max_num_seqs {
            cfg.scheduler.max_num_seqs = n;
        }
        if let Some(p) = section.prefix_caching {
            cfg.scheduler.prefix_caching = p;
        }
        if let Some(c) = section.chunked_prefill {
            cfg.scheduler.chunked_prefill = c;
        }
        cfg.max_model_len = section.max_model_len;
        if let Some(f) = section.kv_format {
            cfg.kv_format = f;
        }
        let handle = EngineHandle::start(model, tokenizer, cfg, &section.name)?;
        let info = handle.info().clone();
        Ok(Self {
            name: section.name.clone(),
            handle,
            info,
            in_flight: Places::default(),
        })
    }

    /// Serves `handle`'s engine under `name`.
    pub fn from_handle(name: &str, handle: EngineHandle) -> Self {
        let info = handle.info().clone();
        Self {
            name: name.to_string(),
            handle,
            info,
            in_flight: Places::default(),
        }
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.in_flight()
    }

    /// Tokenizes the prompt (chat template for chat), fills in `max_tokens`, and checks that
    /// prompt and output fit the context.
    pub fn prepare(&self, req: &ValidRequest) -> Result<EngineRequest, ApiError> {
        let tok = &self.info.tokenizer;
        let context = self.info.context_length;
        let prompt = match &req.prompt {
            Prompt::Text(t) => tok
                .encode(t, true, true)
                .map_err(|e| ApiError::invalid("prompt", e.to_string()))?,
            Prompt::Tokens(ids) => {
                if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.info.vocab_size) {
                    return Err(ApiError::invalid(
                        "prompt",
                        format!(
                            "token id {bad} is outside the vocabulary of {}",
                            self.info.vocab_size
                        ),
                    ));
                }
                ids.clone()
            }
            Prompt::Chat(messages) => {
                let tools = req.tools.as_ref().and_then(|t| t.rendered());
                if tools.is_some() && !tok.chat_template_supports_tools() {
                    return Err(ApiError::unsupported(
                        "tools",
                        format!("the chat template of `{}` does not render tools", self.name),
                    ));
                }
                self.encode_chat(messages, tools, true)?
            }
        };
        if prompt.is_empty() {
            return Err(ApiError::ContextLength("the prompt is empty".into()));
        }
        if prompt.len() >= context {
            return Err(ApiError::ContextLength(format!(
                "this model's maximum context length is {context} tokens, but the prompt has {} tokens",
                prompt.len()
            )));
        }
        let room = context - prompt.len();
        let max_tokens = match req.max_tokens {
            Some(m) if m > room => {
                return Err(ApiError::ContextLength(format!(
                    "this model's maximum context length is {context} tokens; you requested {} tokens ({} in the prompt, {m} for the completion)",
                    prompt.len() + m,
                    prompt.len()
                )))
            }
            Some(m) => m,
            None => room,
        };
        let mut params = req.params.clone();
        params.max_tokens = max_tokens;
        if let Some(g) = req.tools.as_ref().and_then(|t| t.guide(tok)) {
            params.guide = Some(g);
        }
        if params.min_tokens > max_tokens {
            return Err(ApiError::ContextLength(format!(
                "`min_tokens` ({}) does not fit: the context leaves room for {max_tokens} output tokens",
                params.min_tokens
            )));
        }
        let vocab = self.info.vocab_size;
        if let Some(t) = params
            .logit_bias
            .iter()
            .map(|b| b.0)
            .find(|&t| t as usize >= vocab)
        {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("token id {t} is outside the vocabulary of {vocab}"),
            ));
        }
        if let Some(&t) = params.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid(
                "stop_token_ids",
                format!("token id {t} is outside the vocabulary of {vocab}"),
            ));
        }
        if let Some(guide) = &params.guide {
            // Compiled here too, so that a bad schema is a 400 before anything is queued.
            self.info
                .grammar
                .compile(guide)
                .map_err(|e| ApiError::Rejected {
                    param: "response_format".into(),
                    message: e.to_string(),
                })?;
        }
        Ok(EngineRequest { prompt, params })
    }

    /// A conversation through the model's chat template, as token ids (a template that writes
    /// the BOS token itself does not get a second one).
    pub fn encode_chat(
        &self,
        messages: &[switchyard_tokenizer::ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, ApiError> {
        let tok = &self.info.tokenizer;
        let text = tok
            .apply_chat_template_with_tools(messages, tools, add_generation_prompt)
            .map_err(|e| ApiError::unsupported("messages", e.to_string()))?;
        let has_bos = tok
            .bos_id()
            .and_then(|b| tok.id_to_piece(b))
            .is_some_and(|b| text.starts_with(&b));
        tok.encode(&text, !has_bos, true)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))
    }

    /// [`LocalModel::prepare`] on the blocking pool (see [`on_blocking_pool`]). The request
    /// comes back beside its engine request.
    pub async fn prepare_blocking(
        self: &Arc<Self>,
        req: ValidRequest,
        places: &Arc<Semaphore>,
    ) -> Result<(ValidRequest, EngineRequest), ApiError> {
        let m = Arc::clone(self);
        on_blocking_pool(places, move || m.prepare(&req).map(|e| (req, e))).await?
    }
}

/// Runs `work` on the blocking pool once one of `places` is free: rendering a chat template
/// and tokenizing a long prompt are CPU work that must not hold one of the runtime's few
/// workers, and a burst of them queues for the places instead of starting a thread each.
pub async fn on_blocking_pool<T: Send + 'static>(
    places: &Arc<Semaphore>,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    let place = Arc::clone(places)
        .acquire_owned()
        .await
        .map_err(|_| ApiError::ShuttingDown)?;
    tokio::task::spawn_blocking(move || {
        let done = work();
        drop(place);
        done
    })
    .await
    .map_err(|e| ApiError::Internal(format!("preparing the request failed: {e}")))
}

pub fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
    }
}

/// What a finished request reports to metrics.
pub struct Finished {
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub cached_tokens: usize,
    pub ttft_s: Option<f64>,
    pub e2e_s: f64,
}

impl Finished {
    pub fn from_output(o: &RequestOutput) -> Self {
        Self {
            prompt_tokens: o.prompt_tokens,
            output_tokens: o.output_tokens,
            cached_tokens: o.cached_tokens,
            ttft_s: o
                .first_token_at
                .map(|t| t.duration_since(o.arrival).as_secs_f64()),
            e2e_s: o.at.duration_since(o.arrival).as_secs_f64(),
        }
    }

    /// Mean seconds per output token after the first.
    pub fn tpot_s(&self) -> Option<f64> {
        let ttft = self.ttft_s?;
        (self.output_tokens > 1).then(|| (self.e2e_s - ttft) / (self.output_tokens - 1) as f64)
    }
}

impl Backend for LocalModel {
    fn places(&self) -> &Places {
        &self.in_flight
    }

    async fn start(self: &Arc<Self>, a: Admitted<'_>) -> Result<Started, ApiError> {
        let (admission, req, ctx) = (a.place, a.req, a.ctx);
        let (req, engine_req) = self.prepare_blocking(req, ctx.tokenizing).await?;
        let g = self.generate(req, engine_req, ctx.deadline)?;
        Ok(Started::Generated(Box::new(g.holding(admission))))
    }
}

impl LocalModel {
    /// Starts a prepared request's choices on this engine.
    pub(crate) fn generate(
        self: &Arc<Self>,
        req: ValidRequest,
        engine_req: EngineRequest,
        deadline: tokio::time::Instant,
    ) -> Result<Generation, ApiError> {
        let choices = Choices::start(&self.handle, engine_req, req.n)?;
        let id = response_id(req.endpoint, choices.id);
        let g = Generation::new(
            req,
            self.name.clone(),
            id,
            Outputs::Engine(choices),
            deadline,
        );
        Ok(g.with_vocabulary(Arc::clone(&self.info.tokenizer)))
    }
}
