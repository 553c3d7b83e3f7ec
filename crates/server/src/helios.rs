//! The HELIOS orchestrator as one served model: its candidate engines started from the
//! repository manifest, each local one inside an equal share of the memory budget, each
//! remote one streaming from its server, and requests turned into orchestrator requests (text
//! or chat, tokenized by whichever candidate serves them).

use std::sync::Arc;

use switchyard_engine::{EngineConfig, EngineCore, EngineHandle};
use switchyard_helios::manifest::{Manifest, Source};
use switchyard_helios::orchestrator::{CandidateEngine, HeliosPrompt, HeliosRequest, Orchestrator};
use switchyard_helios::policy::{Evaluation, Policy};
use switchyard_helios::shadow::ShadowScorer;
use switchyard_models::{LayeredModel, LoadOptions};
use switchyard_tokenizer::Tokenizer;

use crate::config::HeliosSection;
use crate::error::ApiError;
use crate::serving::{
    before_deadline, helios_api_error, response_id, Admitted, Backend, Generation, Outputs, Places,
    Started,
};
use crate::validate::{Prompt, ValidRequest};
use crate::ServerError;

pub struct HeliosModel {
    pub name: String,
    pub orchestrator: Orchestrator,
    pub engines: Vec<EngineHandle>,
    /// The smallest context of the candidates: a request must fit whichever serves it.
    pub context_length: usize,
    in_flight: Places,
}

fn helios_err(e: switchyard_helios::HeliosError) -> ServerError {
    ServerError::Backend {
        name: "helios".into(),
        detail: e.to_string(),
    }
}

impl HeliosModel {
    /// Loads every local model of the manifest and starts the orchestrator (blocking: run off
    /// the async runtime).
    pub fn start(section: &HeliosSection) -> Result<Self, ServerError> {
        let repo = Manifest::load(std::path::Path::new(&section.manifest)).map_err(helios_err)?;
        let local: Vec<_> = repo.models().iter().filter(|m| !m.is_remote()).collect();
        let total = match &section.memory_budget {
            Some(b) => switchyard_engine::kv::budget::parse_bytes(b)
                .map_err(|e| ServerError::Engine(e.into()))?,
            None => switchyard_engine::DEFAULT_MEMORY_BUDGET * local.len().max(1) as u64,
        };
        let share = total / local.len().max(1) as u64;
        let mut engines = Vec::new();
        let shadow = section.policy.evaluation == Evaluation::Shadow;
        let mut scorers = Vec::new();
        for m in &local {
            let Source::Local { path } = m.source() else {
                continue;
            };
            let path = switchyard_zoo::resolve_model(path)?;
            let source = switchyard_weights::open(&path)?;
            let tokenizer = Arc::new(Tokenizer::from_source(&*source)?);
            let model = LayeredModel::load(Arc::clone(&source), &LoadOptions::default())?;
            let heads = switchyard_helios::shadow::candidate_heads(m, &path, &model)
                .map_err(|e| backend(&m.name, e))?;
            if shadow {
                let scorer =
                    ShadowScorer::open(m, &path, Arc::clone(&source), Arc::clone(&tokenizer))
                        .map_err(|e| backend(&m.name, e))?;
                scorers.push(scorer);
            }
            let cfg = EngineConfig {
                memory_budget: share,
                ..EngineConfig::default()
            };
            let eog = switchyard_engine::end_of_generation_tokens(&tokenizer);
            let core = EngineCore::with_exit(model, Box::new(heads), eog, cfg)?;
            let handle = EngineHandle::spawn(core, tokenizer, &m.name)?;
            engines.push(CandidateEngine {
                name: m.name.clone(),
                handle,
            });
        }
        // Remote candidates stream from their servers and take no local memory.
        for m in repo.models().iter().filter(|m| m.is_remote()) {
            let handle = switchyard_helios::remote::remote_candidate(m).map_err(helios_err)?;
            engines.push(CandidateEngine {
                name: m.name.clone(),
                handle,
            });
        }
        let policy =
            Policy::new(section.policy.clone(), section.slo.clone(), share).map_err(helios_err)?;
        let handles: Vec<EngineHandle> = engines.iter().map(|e| e.handle.clone()).collect();
        let context_length = handles
            .iter()
            .map(|h| h.info().context_length)
            .min()
            .unwrap_or(0);
        let orchestrator =
            Orchestrator::start_with_scorers(repo, policy, engines, scorers).map_err(helios_err)?;
        Ok(Self {
            name: section.name.clone(),
            orchestrator,
            engines: handles,
            context_length,
            in_flight: Places::default(),
        })
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.in_flight()
    }

    /// The orchestrator's request. Whatever names token ids (token-id prompts,
    /// log-probabilities, `logit_bias`, `stop_token_ids`) is refused: the serving model, hence
    /// the vocabulary, is chosen later. So is `n` > 1: its choices could be served by
    /// different candidates.
    pub fn prepare(&self, req: &ValidRequest) -> Result<HeliosRequest, ApiError> {
        const NO_VOCABULARY: &str =
            "the HELIOS model picks the serving model per request; its tokens have no fixed vocabulary";
        if req.logprobs {
            return Err(ApiError::unsupported("logprobs", NO_VOCABULARY));
        }
        if !req.params.logit_bias.is_empty() {
            return Err(ApiError::unsupported("logit_bias", NO_VOCABULARY));
        }
        if !req.params.stop_token_ids.is_empty() {
            return Err(ApiError::unsupported("stop_token_ids", NO_VOCABULARY));
        }
        if req.tools.is_some() {
            return Err(ApiError::unsupported(
                "tools",
                "the HELIOS candidates render and format tool calls each their own way; send tools to a plain model",
            ));
        }
        if req.n > 1 {
            return Err(ApiError::unsupported(
                "n",
                "the HELIOS model serves one choice per request (choices could land on different models)",
            ));
        }
        let prompt = match &req.prompt {
            Prompt::Text(t) => HeliosPrompt::Text(t.clone()),
            Prompt::Chat(m) => HeliosPrompt::Chat(m.clone()),
            Prompt::Tokens(_) => {
                return Err(ApiError::unsupported(
                    "prompt",
                    "token ids depend on the serving model; send text",
                ))
            }
        };
        let mut params = req.params.clone();
        params.max_tokens = req.max_tokens.unwrap_or(self.context_length);
        Ok(HeliosRequest::new(prompt, params))
    }
}

fn backend(name: &str, e: impl std::fmt::Display) -> ServerError {
    ServerError::Backend {
        name: name.to_string(),
        detail: e.to_string(),
    }
}

impl Backend for HeliosModel {
    /// The answer starts once the first output is in, so that the `x-switchyard-served-by`
    /// header can name the candidate serving it (the orchestrator picks it when the request
    /// reaches the front of its queue); an error before that is a plain error response.
    fn places(&self) -> &Places {
        &self.in_flight
    }

    async fn start(self: &Arc<Self>, a: Admitted<'_>) -> Result<Started, ApiError> {
        let (admission, req, ctx) = (a.place, a.req, a.ctx);
        let hreq = self.prepare(&req)?;
        let mut stream = self
            .orchestrator
            .submit(hreq)
            .map_err(|e| ApiError::Internal(e.to_string()))?;
        let first = before_deadline(
            ctx.metrics,
            ctx.timeout_s,
            &self.name,
            ctx.deadline,
            async {
                match stream.next().await {
                    Some(o) => o.map_err(helios_api_error),
                    None => Err(ApiError::ShuttingDown),
                }
            },
        )
        .await?;
        let id = response_id(req.endpoint, format!("h{}", first.output.id));
        let served_by = first.model.to_string();
        let g = Generation::new(
            req,
            self.name.clone(),
            id,
            Outputs::Helios(stream),
            ctx.deadline,
        );
        Ok(Started::Generated(Box::new(
            g.with_pending(first.output)
                .with_header("x-switchyard-served-by", served_by)
                .holding(admission),
        )))
    }
}
