//! The HELIOS orchestrator: one endpoint over several candidate engines that keeps choosing
//! the model and the exit depth that serve the current traffic best.
//!
//! It runs the loop of the paper over real traffic:
//!
//! 1. **Online evaluation**: the next `eval_requests` requests go to each TopK candidate in
//!    turn, one candidate's block after the other (serially), each candidate loaded to full
//!    depth with its exits probed ([`switchyard_engine::ExitProbe`]); their outputs are the
//!    responses. Each block fills the candidate's PHT row: output tokens per second, bits per
//!    byte of the generated text, the exit-depth histogram, the measured layer-load time.
//! 2. **Greedy partial load**: the policy picks the model and the depth its histogram covers;
//!    that engine keeps only those layers (the rest of its budget goes to the KV pool), the
//!    others keep one layer.
//! 3. **Confidence Breach Counter**: every token served at the partial depth feeds the
//!    counter with its exit confidence; when it fires, the policy chooses **extend** (the
//!    engine loads more layers and recomputes the missing K/V of running sequences) or
//!    **switch** (another candidate's partial load serves new requests).
//! 4. **Re-profiling** every RI requests, or earlier when the drift detector fires.
//!
//! Running sequences on a switch *drain*: they finish on the model that started them, and
//! that model drops its layers once they are done. Moving them would re-prefill their prompt
//! and output on the new model (a whole prompt of compute per sequence, and a response
//! written by two models with two tokenizers); draining costs only the old model's memory
//! until they end, which its own budget share already holds. Both counts are kept
//! ([`Counters::switch_drained`], [`Counters::switch_moved`], always 0 under this policy).
//!
//! Memory: every candidate engine lives inside its own memory budget, given by the caller
//! (for example equal shares of one budget). Under serial evaluation the orchestrator never
//! moves memory between them, so the sum of the shares bounds the whole. Under shadow
//! evaluation the engines that do not serve are parked (no layer, embedding, head or KV
//! pool) and the sum follows the serving engine: the others keep what they hold plus the K/V
//! their draining sequences need to finish, the scorers' peak is set aside, and the serving
//! engine gets the rest.
//!
//! The actor sleeps on a [`switchyard_engine::Doorbell`] that every request's outputs, every
//! command and every finished shadow round rings, so it wakes when something moved rather
//! than on a timer.
//!
//! The orchestrator is an actor: one thread owns the PHT, the counters and the engines'
//! request streams; [`Orchestrator`] is its cloneable handle. Remote candidates come to it as
//! engine handles too ([`crate::remote`]): full depth only, no local memory, no layer loads,
//! and each token's probability as its confidence.

mod actor;
pub mod measure;

use std::sync::{mpsc, Arc};

use serde::Serialize;
use switchyard_engine::{Completion, Doorbell, EngineHandle, RequestOutput};
use switchyard_request::SamplingParams;
use switchyard_tokenizer::ChatMessage;
use tokio::sync::{mpsc as tmpsc, oneshot};

use crate::manifest::Manifest;
use crate::pht::Pht;
use crate::policy::{Policy, Serving};
use crate::shadow::ShadowScorer;
use crate::{HeliosError, Result};

/// One candidate's engine. Its exit head must cover the repository entry's exit layers, and
/// its memory budget is the candidate's share.
#[derive(Debug, Clone)]
pub struct CandidateEngine {
    /// The repository name.
    pub name: String,
    pub handle: EngineHandle,
}

/// A request as the orchestrator takes it: text, tokenized by whichever candidate serves it.
#[derive(Debug, Clone, PartialEq)]
pub struct HeliosRequest {
    pub prompt: HeliosPrompt,
    /// `max_tokens` is capped to the room the serving model's context leaves.
    pub params: SamplingParams,
    /// The answer that followed this prompt, where the caller has one (a trace's next turn):
    /// shadow scoring scores it after the prompt and reports it apart. Never used to choose.
    pub reference: Option<String>,
}

impl HeliosRequest {
    pub fn new(prompt: HeliosPrompt, params: SamplingParams) -> Self {
        Self {
            prompt,
            params,
            reference: None,
        }
    }
}

impl HeliosPrompt {
    /// The text shadow scoring reads: the prompt, or the chat's message contents one per
    /// line (no template: every candidate scores the same bytes).
    pub fn scored_text(&self) -> String {
        match self {
            Self::Text(t) => t.clone(),
            Self::Chat(messages) => messages
                .iter()
                .map(|m| m.content.as_str())
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum HeliosPrompt {
    Text(String),
    /// Rendered with the serving model's own chat template.
    Chat(Vec<ChatMessage>),
}

/// One output of a request, and who served it.
#[derive(Debug, Clone, PartialEq)]
pub struct HeliosOutput {
    pub model: Arc<str>,
    /// Whether the request was part of an online evaluation.
    pub evaluation: bool,
    pub output: RequestOutput,
}

/// A whole request.
#[derive(Debug, Clone, PartialEq)]
pub struct HeliosCompletion {
    pub model: Arc<str>,
    pub evaluation: bool,
    /// Depth of each output token.
    pub depths: Vec<usize>,
    pub completion: Completion,
}

/// One request's outputs; dropping it aborts the request.
#[derive(Debug)]
pub struct HeliosStream {
    rx: tmpsc::UnboundedReceiver<Result<HeliosOutput>>,
}

impl HeliosStream {
    pub async fn next(&mut self) -> Option<Result<HeliosOutput>> {
        self.rx.recv().await
    }

    /// Blocks for the next output. Must not be called from inside an async runtime.
    pub fn blocking_next(&mut self) -> Option<Result<HeliosOutput>> {
        self.rx.blocking_recv()
    }

    /// The next output if one is ready, without waiting; an error when the orchestrator
    /// dropped the stream before its last output.
    pub fn try_next(&mut self) -> Option<Result<HeliosOutput>> {
        match self.rx.try_recv() {
            Ok(o) => Some(o),
            Err(tmpsc::error::TryRecvError::Empty) => None,
            Err(tmpsc::error::TryRecvError::Disconnected) => Some(Err(HeliosError::Orchestrator(
                "the orchestrator stopped".into(),
            ))),
        }
    }

    /// Blocks until the request ends and gathers it.
    pub fn wait(mut self) -> Result<HeliosCompletion> {
        let mut outputs = Vec::new();
        let mut depths = Vec::new();
        let mut who = None;
        while let Some(o) = self.blocking_next() {
            let o = o?;
            depths.extend(std::iter::repeat_n(
                o.output.depth,
                o.output.token_ids.len(),
            ));
            who.get_or_insert((Arc::clone(&o.model), o.evaluation));
            let last = o.output.finish_reason.is_some();
            outputs.push(o.output);
            if last {
                break;
            }
        }
        let stopped = || HeliosError::Orchestrator("the orchestrator stopped".into());
        let (model, evaluation) = who.ok_or_else(stopped)?;
        Ok(HeliosCompletion {
            model,
            evaluation,
            depths,
            completion: Completion::gather(outputs).ok_or_else(stopped)?,
        })
    }
}

/// Decisions taken and what they cost, since the start.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Counters {
    /// Online evaluations finished (the first one and every re-profile).
    pub profiles: u64,
    /// Layer loads, drops and the decision of those evaluations.
    pub profile_seconds: f64,
    /// Wall time from each evaluation's start to its decision (its requests are served in
    /// that time, so this is not all overhead).
    pub profile_wall_seconds: f64,
    /// Of `profiles`, those after the first: RI reached or drift.
    pub reprofiles: u64,
    /// Of `reprofiles`, those the drift detector started.
    pub drift_reprofiles: u64,
    pub extends: u64,
    pub extend_seconds: f64,
    pub switches: u64,
    pub switch_seconds: f64,
    /// Waiting for the old model's running requests before a switch (`drain_first`).
    pub switch_drain_seconds: f64,
    /// Most weight bytes the old model still held when the new one had loaded, over the
    /// switches (under `drain_first` only its final norm, which a parked model keeps).
    pub switch_overlap_bytes: u64,
    /// Running sequences left to finish on the old model at a switch.
    pub switch_drained: u64,
    /// Running sequences moved to the new model at a switch (0: this orchestrator drains).
    pub switch_moved: u64,
    /// Times the Confidence Breach Counter fired.
    pub cbc_fired: u64,
    /// Times it fired with no remedy available (full depth and no other candidate fits).
    pub cbc_unremedied: u64,
    /// Tokens the counter saw, and those below the threshold.
    pub tokens_observed: u64,
    pub tokens_breached: u64,
    pub requests: u64,
    pub evaluation_requests: u64,
    /// Moves off a serving candidate that became unreachable, and back once it served again.
    pub failovers: u64,
    pub failbacks: u64,
    /// Requests sent again to another candidate: their remote one was unreachable before
    /// any of the answer came back.
    pub retried: u64,
    /// Shadow evaluation: scoring rounds finished, prompts scored per candidate, the
    /// scorer's compute and sleep, and the share of time it computed.
    pub shadow_rounds: u64,
    pub shadow_texts: u64,
    /// Sampled prompts never scored: newer ones displaced them while the scorer was busy.
    pub shadow_texts_skipped: u64,
    pub shadow_busy_seconds: f64,
    pub shadow_slept_seconds: f64,
    pub shadow_share_used: f64,
    /// Rounds that failed (logged; serving goes on).
    pub shadow_errors: u64,
    /// The most bytes the scorers held at once: every scorer's embedding, norm, head and exit
    /// heads, plus the largest one layer and batch of activations.
    pub shadow_peak_bytes: u64,
    /// Rounds whose texts were other traffic than the window before them (the window
    /// restarted there), and switches made at once on them because the serving choice broke
    /// the quality bound on the new traffic.
    pub shadow_change_points: u64,
    pub shadow_urgent_switches: u64,
    /// Requests held for their own prompt's round before routing, the time they waited in
    /// all, and holds that ran out before the round came back.
    pub held_requests: u64,
    pub hold_seconds: f64,
    pub hold_timeouts: u64,
}

/// One shadow scoring round and what it decided.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ShadowRound {
    /// Requests submitted when the round's result arrived.
    pub at_request: u64,
    pub serving: ServingInfo,
    /// The round's best choice (`None` when none fits).
    pub best: Option<ServingInfo>,
    pub switched: bool,
    /// The round's texts were other traffic than the window before them.
    pub change_point: bool,
    /// Per candidate: prompt bits per byte at each scored depth, and of the references.
    pub scores: Vec<ShadowRoundScore>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ShadowRoundScore {
    pub model: String,
    pub prompt_bytes: u64,
    /// `(depth, bits per byte)` of the prompts.
    pub prompt_bits_per_byte: Vec<(usize, f64)>,
    pub reference_bytes: u64,
    /// `(depth, bits per byte)` of the references (empty without references).
    pub reference_bits_per_byte: Vec<(usize, f64)>,
    pub prefill_tokens_per_s: f64,
}

/// What the orchestrator is doing.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OrchestratorStats {
    /// `None` before the first evaluation ended.
    pub serving: Option<ServingInfo>,
    /// The candidate whose evaluation block runs, if any.
    pub evaluating: Option<String>,
    pub candidates: Vec<String>,
    pub counters: Counters,
    pub pht: Pht,
    /// Shadow evaluation's rounds, in order.
    pub shadow_rounds: Vec<ShadowRound>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServingInfo {
    pub model: String,
    pub depth: usize,
}

impl From<&Serving> for ServingInfo {
    fn from(s: &Serving) -> Self {
        Self {
            model: s.model.clone(),
            depth: s.depth,
        }
    }
}

enum Command {
    Submit {
        request: Box<HeliosRequest>,
        sink: tmpsc::UnboundedSender<Result<HeliosOutput>>,
    },
    Stats {
        reply: oneshot::Sender<OrchestratorStats>,
    },
    Shutdown {
        reply: oneshot::Sender<()>,
    },
}

/// The handle to a running orchestrator; clone it freely.
#[derive(Debug, Clone)]
pub struct Orchestrator {
    tx: mpsc::Sender<Command>,
    /// The actor's doorbell, rung after each command.
    bell: Doorbell,
    candidates: Arc<[String]>,
}

impl Orchestrator {
    /// Selects the TopK candidates of `repo` under `policy` among `engines` (a candidate
    /// without an engine is skipped), drops every engine to one layer and starts the actor.
    /// The first request starts the first online evaluation.
    pub fn start(repo: Manifest, policy: Policy, engines: Vec<CandidateEngine>) -> Result<Self> {
        Self::start_with_scorers(repo, policy, engines, Vec::new())
    }

    /// [`Orchestrator::start`] with the local candidates' shadow scorers, which shadow
    /// evaluation needs (one per local candidate; remote candidates cannot be scored and are
    /// left out of its choice once scores exist).
    pub fn start_with_scorers(
        repo: Manifest,
        policy: Policy,
        engines: Vec<CandidateEngine>,
        scorers: Vec<ShadowScorer>,
    ) -> Result<Self> {
        let state = actor::State::new(repo, policy, engines, scorers)?;
        let candidates: Arc<[String]> = state.candidate_names().into();
        let bell = state.bell.clone();
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("switchyard-helios".into())
            .spawn(move || actor::run(state, rx))
            .map_err(|e| {
                HeliosError::Orchestrator(format!("cannot start the orchestrator thread: {e}"))
            })?;
        Ok(Self {
            tx,
            bell,
            candidates,
        })
    }

    /// The candidates it evaluates, best first by offline telemetry.
    pub fn candidates(&self) -> &[String] {
        &self.candidates
    }

    /// Queues a request; its outputs arrive on the returned stream (an error as the first
    /// item when no candidate can take it).
    pub fn submit(&self, request: HeliosRequest) -> Result<HeliosStream> {
        let (sink, rx) = tmpsc::unbounded_channel();
        self.send(Command::Submit {
            request: Box::new(request),
            sink,
        })?;
        Ok(HeliosStream { rx })
    }

    /// A snapshot of the PHT, the decision counters and what is served.
    pub async fn stats(&self) -> Result<OrchestratorStats> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Stats { reply })?;
        rx.await
            .map_err(|_| HeliosError::Orchestrator("the orchestrator stopped".into()))
    }

    /// [`Orchestrator::stats`] from plain threads.
    pub fn stats_blocking(&self) -> Result<OrchestratorStats> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Stats { reply })?;
        rx.blocking_recv()
            .map_err(|_| HeliosError::Orchestrator("the orchestrator stopped".into()))
    }

    /// Aborts every request and stops the actor (the engines are the caller's to stop).
    pub fn shutdown_blocking(&self) {
        let (reply, rx) = oneshot::channel();
        if self.send(Command::Shutdown { reply }).is_ok() {
            let _ = rx.blocking_recv();
        }
    }

    fn send(&self, c: Command) -> Result<()> {
        self.tx
            .send(c)
            .map_err(|_| HeliosError::Orchestrator("the orchestrator stopped".into()))?;
        self.bell.ring();
        Ok(())
    }
}
