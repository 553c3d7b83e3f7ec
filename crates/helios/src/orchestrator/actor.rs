//! The orchestrator's thread: owns the engines' request streams, the PHT, the breach
//! counter, the drift detector and the counters, and runs evaluation → partial load →
//! remedies → re-profiling as outputs arrive.
//!
//! Engine residency calls (load, drop, depth) block this thread until the engine answers;
//! the engines keep serving meanwhile (outputs wait in their streams), and the time is what
//! the decision costs.

use std::collections::VecDeque;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use switchyard_engine::{
    Doorbell, EngineInfo, EngineRequest, EngineStatus, ExitProbe, RequestStream,
};
use switchyard_exits::confidence::passes;
use tokio::sync::mpsc as tmpsc;

use super::measure::BlockMeasure;
use super::{
    CandidateEngine, Command, Counters, HeliosOutput, HeliosPrompt, HeliosRequest,
    OrchestratorStats, ServingInfo, ShadowRound, ShadowRoundScore,
};
use crate::manifest::Manifest;
use crate::pht::{ExitHistogram, Pht};
use crate::policy::depth::coverage_depth;
use crate::policy::shadow::change_point;
use crate::policy::{
    Candidate, ConfidenceBreachCounter, Decision, DriftDetector, EvalPlan, Features, Policy,
    ProfileReason, Remedy, ReprofileClock, Serving,
};
use crate::policy::{Evaluation, SwitchGate};
use crate::shadow::{DepthNats, ScoreSettings, ShadowScore, ShadowScorer, ShadowText, Throttle};
use crate::{HeliosError, Result};
use std::collections::BTreeMap;

/// The longest the thread sleeps on its doorbell while requests stream: every output and
/// command rings it, so this only bounds how late a client that went away is noticed.
const WAKE: Duration = Duration::from_millis(20);

type Sink = tmpsc::UnboundedSender<Result<HeliosOutput>>;

struct Engine {
    name: Arc<str>,
    handle: switchyard_engine::EngineHandle,
    info: EngineInfo,
    exit_layers: Vec<usize>,
    servable: Vec<usize>,
}

struct Queued {
    request: HeliosRequest,
    sink: Sink,
}

struct Active {
    stream: RequestStream,
    sink: Sink,
    engine: usize,
    /// The evaluation block it belongs to.
    block: Option<usize>,
    /// The request again, kept while it may still be retried: sent to a remote candidate and
    /// no output back yet. Should the candidate turn out unreachable, it goes to another.
    retry: Option<HeliosRequest>,
}

struct Eval {
    reason: ProfileReason,
    plan: EvalPlan,
    /// Engine index of each block, in order.
    blocks: Vec<usize>,
    /// The block whose requests run.
    current: usize,
    done: Vec<usize>,
    queued: Vec<VecDeque<Queued>>,
    measures: Vec<BlockMeasure>,
    started: Instant,
    overhead: Duration,
}

enum Phase {
    Idle,
    Evaluating(Box<Eval>),
    Serving { serving: Serving, engine: usize },
}

pub(super) struct State {
    repo: Manifest,
    policy: Policy,
    engines: Vec<Engine>,
    /// Selected candidates, best first, each with its engine.
    candidates: Vec<(Candidate, usize)>,
    pht: Pht,
    counters: Counters,
    phase: Phase,
    active: Vec<Active>,
    /// Requests that arrived after the evaluation plan was full, until its decision.
    waiting: VecDeque<Queued>,
    clock: ReprofileClock,
    cbc: ConfidenceBreachCounter,
    drift: Option<DriftDetector>,
    /// Engines left serving running sequences after a switch; they drop their layers when
    /// those end.
    draining: Vec<usize>,
    /// Mean output tokens per request in the last evaluation (the remedy horizon).
    tokens_per_request: f64,
    /// Shadow evaluation's state (`None` under serial evaluation).
    shadow: Option<Shadow>,
    /// Shadow evaluation: the local engines' budgets together (what the caller gave them),
    /// moved to whichever engine serves (see [`State::grant`]).
    budget_total: u64,
    /// Serving another candidate because the chosen one became unreachable: back to the best
    /// of all once every candidate serves again.
    failed_over: bool,
    /// Requests waiting for their own prompt's round, in arrival order (holds).
    held: VecDeque<Held>,
    /// Rung by every request's outputs, every command and every finished shadow round.
    pub(super) bell: Doorbell,
}

/// A request held for its own prompt's round.
struct Held {
    q: Queued,
    arrived: Instant,
    /// Its prompt, until its round is sent.
    text: Option<ShadowText>,
    /// When its round was sent (the scorer runs one round at a time, so only the first
    /// held request can have one in flight).
    sent: Option<Instant>,
}

impl Held {
    /// When it stops waiting: `hold` after its round was sent, or after it arrived while
    /// its round waits for the scorer.
    fn deadline(&self, hold: Duration) -> Instant {
        self.sent.unwrap_or(self.arrived) + hold
    }
}

/// The orchestrator's side of shadow evaluation: prompts sampled for the next round, the
/// scorer thread's channels, the hysteresis and the rounds so far.
struct Shadow {
    /// Each round's texts, and whether a held request waits on it.
    tx: mpsc::Sender<(Vec<ShadowText>, bool)>,
    rx: mpsc::Receiver<RoundResult>,
    /// A round is being scored.
    busy: bool,
    /// Whether prompts are sampled at all (off when no score can change the choice).
    scoring: bool,
    pending: Vec<ShadowText>,
    /// The last `window` scored prompts, each candidate's nats on each: what a decision
    /// reads.
    recent: VecDeque<BTreeMap<String, DepthNats>>,
    gate: SwitchGate,
    rounds: Vec<ShadowRound>,
}

/// What the scorer thread sends back after a round.
struct RoundResult {
    scores: Result<Vec<ShadowScore>>,
    texts: usize,
    busy: Duration,
    slept: Duration,
    peak_bytes: usize,
}

/// The scorer thread: scores each round's texts with every candidate in turn, sharing one
/// throttle so that their total stays within `share`. A round that a held request waits on
/// (`true` with its texts) runs without sleeping; its compute counts in the share used.
fn run_scorer(
    mut scorers: Vec<ShadowScorer>,
    settings: ScoreSettings,
    share: f64,
    rx: mpsc::Receiver<(Vec<ShadowText>, bool)>,
    tx: mpsc::Sender<RoundResult>,
    bell: Doorbell,
) {
    let mut throttle = Throttle::new(share);
    let fixed: usize = scorers.iter().map(ShadowScorer::resident_bytes).sum();
    while let Ok((texts, held)) = rx.recv() {
        let mut unthrottled = Throttle::new(1.0);
        let active = if held {
            &mut unthrottled
        } else {
            &mut throttle
        };
        let before = *active;
        let mut peak = 0usize;
        let scores: Result<Vec<ShadowScore>> = scorers
            .iter_mut()
            .map(|s| {
                let out = s.score(&texts, &settings, active)?;
                // A layer and a head slice are never held together.
                let weights = out.peak_layer_bytes.max(out.peak_head_bytes);
                peak = peak.max(weights + out.peak_activation_bytes);
                Ok(out)
            })
            .collect();
        let result = RoundResult {
            scores,
            texts: texts.len(),
            busy: active.busy - before.busy,
            slept: active.slept - before.slept,
            peak_bytes: fixed + peak,
        };
        if tx.send(result).is_err() {
            return;
        }
        bell.ring();
    }
}

impl State {
    pub(super) fn new(
        repo: Manifest,
        policy: Policy,
        given: Vec<CandidateEngine>,
        scorers: Vec<ShadowScorer>,
    ) -> Result<Self> {
        let shadow_mode = policy.config.evaluation == Evaluation::Shadow;
        let bell = Doorbell::new();
        // Shadow evaluation judges quality on the traffic, not on the profile text: the
        // selection does not apply the bound to the offline bits per byte.
        let selection = if shadow_mode {
            let mut unbounded = policy.clone();
            unbounded.slo.max_bits_per_byte_increase = None;
            unbounded.select_candidates(&repo)?
        } else {
            policy.select_candidates(&repo)?
        };
        let mut engines = Vec::new();
        let mut candidates = Vec::new();
        for c in selection.candidates {
            let Some(ce) = given.iter().find(|e| e.name == c.model()) else {
                tracing::warn!(
                    model = c.model(),
                    "HELIOS candidate without a local engine: skipped"
                );
                continue;
            };
            let Some(entry) = repo.get(c.model()) else {
                continue;
            };
            let info = ce.handle.info().clone();
            if info.n_layers != entry.layers {
                return Err(HeliosError::Orchestrator(format!(
                    "{}: the repository says {} layers, the engine's model has {}",
                    entry.name, entry.layers, info.n_layers
                )));
            }
            candidates.push((c, engines.len()));
            engines.push(Engine {
                name: Arc::from(entry.name.as_str()),
                handle: ce.handle.clone(),
                info,
                exit_layers: entry.exit_layers.clone(),
                servable: entry.servable_depths().collect(),
            });
        }
        if candidates.is_empty() {
            return Err(HeliosError::Orchestrator(
                "no selected candidate has a local engine".into(),
            ));
        }
        let mut budget_total = 0;
        if shadow_mode {
            for e in engines.iter().filter(|e| !is_remote(&repo, &e.name)) {
                budget_total += e.handle.stats().wait()?.memory.budget_bytes;
            }
        }
        // Nothing is served before the first evaluation. Under serial evaluation every
        // engine keeps one layer (each serves its block in turn); under shadow evaluation
        // every engine is parked (no layer, embedding, head or KV pool) until it serves.
        for e in &engines {
            if shadow_mode {
                e.handle.park().wait()?;
            } else {
                e.handle.drop_layers(1).wait()?;
            }
        }
        // Without a quality bound (and with the quality-bound depth rule) the choice is the
        // best point by offline speed at full depth, which no score can change: scoring
        // would only take compute and memory from serving, so the scorers are dropped.
        let scoring = shadow_mode
            && (policy.slo.max_bits_per_byte_increase.is_some()
                || policy.config.depth_rule == crate::policy::DepthRule::Coverage);
        if shadow_mode && !scoring {
            tracing::info!("HELIOS shadow: no quality bound in the SLO, so no score can change the choice; scoring is off");
        }
        let scorers = if scoring { scorers } else { Vec::new() };
        let fixed: usize = scorers.iter().map(ShadowScorer::resident_bytes).sum();
        let shadow = if shadow_mode {
            Some(start_scorer(
                &repo,
                &policy,
                &candidates,
                scorers,
                scoring,
                bell.clone(),
            )?)
        } else {
            None
        };
        let cfg = &policy.config;
        let mut state = Self {
            pht: Pht::new(cfg.threshold),
            clock: ReprofileClock::new(cfg.reprofile_interval),
            cbc: ConfidenceBreachCounter::new(cfg.cbc_window, cfg.cbc_max),
            repo,
            policy,
            engines,
            candidates,
            counters: Counters::default(),
            phase: Phase::Idle,
            active: Vec::new(),
            waiting: VecDeque::new(),
            drift: None,
            draining: Vec::new(),
            tokens_per_request: 0.0,
            shadow,
            budget_total,
            failed_over: false,
            held: VecDeque::new(),
            bell,
        };
        if state.shadow.is_some() {
            // The scorers' embeddings, norms and heads are held from the start.
            state.counters.shadow_peak_bytes = fixed as u64;
            state.serve_first()?;
        }
        Ok(state)
    }

    /// Shadow evaluation's first choice, from the repository's offline telemetry: loaded to
    /// its depth and served from the first request.
    fn serve_first(&mut self) -> Result<()> {
        let cands: Vec<Candidate> = self.candidates.iter().map(|c| c.0.clone()).collect();
        let p = self
            .policy
            .choose_shadow(&self.repo, &cands, &BTreeMap::new())?;
        let engine = self
            .engine_index(&p.model)
            .ok_or_else(|| HeliosError::Orchestrator(format!("{} has no engine", p.model)))?;
        let t = Instant::now();
        self.grant(engine);
        self.engines[engine]
            .handle
            .load_layers(p.depth, true)
            .wait()?;
        let serving = Serving {
            model: p.model.clone(),
            depth: p.depth,
        };
        tracing::info!(model = %serving.model, depth = p.depth, "HELIOS shadow: first choice from offline telemetry");
        self.counters.profile_seconds += t.elapsed().as_secs_f64();
        self.serve(serving, engine);
        Ok(())
    }

    pub(super) fn candidate_names(&self) -> Vec<String> {
        self.candidates
            .iter()
            .map(|(c, _)| c.model().to_string())
            .collect()
    }

    fn stats(&self) -> OrchestratorStats {
        let (serving, evaluating) = match &self.phase {
            Phase::Idle => (None, None),
            Phase::Evaluating(e) => (
                None,
                e.blocks
                    .get(e.current)
                    .map(|&i| self.engines[i].name.to_string()),
            ),
            Phase::Serving { serving, .. } => (Some(ServingInfo::from(serving)), None),
        };
        OrchestratorStats {
            serving,
            evaluating,
            candidates: self.candidate_names(),
            counters: self.counters.clone(),
            pht: self.pht.clone(),
            shadow_rounds: self
                .shadow
                .as_ref()
                .map(|s| s.rounds.clone())
                .unwrap_or_default(),
        }
    }

    fn submit(&mut self, q: Queued) {
        self.counters.requests += 1;
        let hold_ms = self.policy.config.shadow.hold_ms;
        let mut hold = None;
        if let Some(sh) = self.shadow.as_mut().filter(|sh| sh.scoring) {
            let every = self.policy.config.shadow.sample_every as u64;
            if (self.counters.requests - 1).is_multiple_of(every) {
                let references = self.policy.config.shadow.references;
                let text = ShadowText {
                    prompt: q.request.prompt.scored_text(),
                    reference: q.request.reference.clone().filter(|_| references),
                };
                if hold_ms == 0 {
                    sh.pending.push(text);
                } else if matches!(self.phase, Phase::Serving { .. }) {
                    // Held only while serving: an evaluation routes by its own plan.
                    hold = Some(text);
                } else {
                    self.counters.shadow_texts_skipped += 1;
                }
            }
            if hold.is_none() {
                self.send_round();
            }
        }
        match hold {
            Some(text) => {
                self.counters.held_requests += 1;
                self.held.push_back(Held {
                    q,
                    arrived: Instant::now(),
                    text: Some(text),
                    sent: None,
                });
                self.send_held_round();
            }
            None => self.route(q, true),
        }
    }

    /// Sends the first held request's prompt as a round of its own (unthrottled) if the
    /// scorer is free; routes it at once if the scorer cannot take it.
    fn send_held_round(&mut self) {
        if self.shadow.as_ref().is_none_or(|sh| sh.busy) {
            return;
        }
        let Some(text) = self.held.front_mut().and_then(|h| h.text.take()) else {
            return;
        };
        if let Some(sh) = self.shadow.as_mut() {
            sh.pending.push(text);
        }
        self.send_round_now(true);
        if self.shadow.as_ref().is_some_and(|sh| sh.busy) {
            if let Some(h) = self.held.front_mut() {
                h.sent = Some(Instant::now());
            }
        } else if let Some(h) = self.held.pop_front() {
            self.release(h, false);
        }
    }

    /// A round is back: the held request it was sent for goes to what it chose, and the next
    /// held request's round goes out.
    fn release_held(&mut self) {
        if self.held.front().is_some_and(|h| h.sent.is_some()) {
            if let Some(h) = self.held.pop_front() {
                self.release(h, false);
            }
        }
        self.send_held_round();
    }

    /// Routes a held request to the current choice, counting its wait.
    fn release(&mut self, h: Held, timed_out: bool) {
        self.counters.hold_timeouts += u64::from(timed_out);
        self.counters.hold_seconds += h.arrived.elapsed().as_secs_f64();
        self.route(h.q, true);
    }

    /// Releases the held requests whose hold ran out; `true` if any did. One whose round is
    /// in flight goes unscored; that round still counts when it is back.
    fn hold_expired(&mut self) -> bool {
        let hold = Duration::from_millis(self.policy.config.shadow.hold_ms);
        let now = Instant::now();
        if !self.held.iter().any(|h| h.deadline(hold) <= now) {
            return false;
        }
        let (expired, kept): (VecDeque<Held>, VecDeque<Held>) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|h| h.deadline(hold) <= now);
        self.held = kept;
        for h in expired {
            self.release(h, true);
        }
        true
    }

    /// Hands `q` to the serving candidate, or to the evaluation; `retry` when it may be sent
    /// once more should its candidate turn out unreachable.
    fn route(&mut self, q: Queued, retry: bool) {
        if matches!(self.phase, Phase::Idle) {
            self.start_eval(ProfileReason::Initial);
        }
        if matches!(self.phase, Phase::Serving { .. }) {
            self.fail_over_or_back();
        }
        match &mut self.phase {
            Phase::Idle => {
                let _ = q.sink.send(Err(HeliosError::Orchestrator(
                    "no candidate could be evaluated".into(),
                )));
            }
            Phase::Evaluating(e) => {
                let Some(model) = e.plan.assign().map(str::to_string) else {
                    self.waiting.push_back(q);
                    return;
                };
                let Some(b) = e
                    .blocks
                    .iter()
                    .position(|&i| *self.engines[i].name == *model)
                else {
                    self.waiting.push_back(q);
                    return;
                };
                if b == e.current {
                    self.dispatch_with(q, self.eval_engine(b), Some(b), retry);
                } else {
                    e.queued[b].push_back(q);
                }
            }
            Phase::Serving { engine, .. } => {
                let engine = *engine;
                self.dispatch_with(q, engine, None, retry);
            }
        }
    }

    /// Whether engine `i` serves: running, and for a remote candidate, reachable.
    fn reachable(&self, i: usize) -> bool {
        self.engines[i].handle.status() == EngineStatus::Running
    }

    /// The candidates whose engines serve (all of them when none does, so that the error a
    /// request then gets names the failure).
    fn live(&self) -> Vec<&(Candidate, usize)> {
        let live: Vec<_> = self
            .candidates
            .iter()
            .filter(|c| self.reachable(c.1))
            .collect();
        if live.is_empty() {
            self.candidates.iter().collect()
        } else {
            live
        }
    }

    fn live_candidates(&self) -> Vec<Candidate> {
        self.live().into_iter().map(|c| c.0.clone()).collect()
    }

    /// The choice among the candidates that serve now: by the shadow scores' offline
    /// telemetry or by the PHT, as the evaluation in use chooses.
    fn choose_live(&self) -> Option<Serving> {
        let cands = self.live_candidates();
        let chosen = if self.shadow.is_some() {
            self.policy
                .choose_shadow(&self.repo, &cands, &BTreeMap::new())
        } else {
            self.policy.choose_serving(&self.repo, &cands, &self.pht)
        };
        match chosen {
            Ok(p) => Some(Serving {
                model: p.model,
                depth: p.depth,
            }),
            Err(err) => {
                tracing::warn!(error = %err, "HELIOS: no reachable candidate fits");
                None
            }
        }
    }

    /// While serving: moves off a candidate that became unreachable to the best one that
    /// serves, and once every candidate serves again, back to the best of all.
    fn fail_over_or_back(&mut self) {
        let Phase::Serving { serving, engine } = &self.phase else {
            return;
        };
        let (current, engine) = (serving.clone(), *engine);
        let lost = !self.reachable(engine);
        let recovered = self.failed_over && self.candidates.iter().all(|c| self.reachable(c.1));
        if !lost && !recovered {
            return;
        }
        let Some(best) = self.choose_live() else {
            return;
        };
        if recovered {
            self.failed_over = false;
        }
        if best == current {
            return;
        }
        tracing::warn!(
            from = %current.model,
            to = %best.model,
            depth = best.depth,
            reason = if lost { "unreachable" } else { "reachable again" },
            "HELIOS: serving another candidate"
        );
        if self.move_to(best) {
            if lost {
                self.failed_over = true;
                self.counters.failovers += 1;
            } else {
                self.counters.failbacks += 1;
            }
        }
    }

    fn eval_engine(&self, b: usize) -> usize {
        match &self.phase {
            Phase::Evaluating(e) => e.blocks[b],
            _ => 0,
        }
    }

    /// Tokenizes for engine `i` and hands the request to it.
    fn dispatch(&mut self, q: Queued, i: usize, block: Option<usize>) {
        self.dispatch_with(q, i, block, true);
    }

    /// [`State::dispatch`]; `retry` when the request may go to another candidate should a
    /// remote one turn out unreachable before it answers.
    fn dispatch_with(&mut self, q: Queued, i: usize, block: Option<usize>, retry: bool) {
        let remote = is_remote(&self.repo, &self.engines[i].name);
        let keep = (retry && remote).then(|| q.request.clone());
        let e = &self.engines[i];
        let added = tokenize(&e.info, &q.request.prompt).and_then(|prompt| {
            let room = e.info.context_length.saturating_sub(prompt.len()).max(1);
            let mut params = q.request.params.clone();
            params.max_tokens = params.max_tokens.min(room);
            // The serial evaluation scores what each candidate generates by its
            // log-probabilities, so they must be exact even where the client asked for none.
            params.report_logprobs |= block.is_some();
            Ok(e.handle
                .add_request_with_bell(EngineRequest { prompt, params }, Some(&self.bell))?)
        });
        if let (Some(b), Phase::Evaluating(ev)) = (block, &mut self.phase) {
            self.counters.evaluation_requests += 1;
            ev.measures[b].begin_request(Instant::now());
        }
        match added {
            Ok(stream) => self.active.push(Active {
                stream,
                sink: q.sink,
                engine: i,
                block,
                retry: keep,
            }),
            Err(err) => {
                let _ = q.sink.send(Err(err));
                if let Some(b) = block {
                    self.block_request_done(b);
                }
            }
        }
    }

    /// Moves every available output to its client; `true` when any moved.
    fn poll(&mut self) -> bool {
        let mut progressed = false;
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].sink.is_closed() {
                // The client went away: dropping the engine stream aborts the request.
                let a = self.active.swap_remove(i);
                self.request_done(&a);
                progressed = true;
                continue;
            }
            let mut finished = false;
            while let Some(o) = self.active[i].stream.try_next() {
                progressed = true;
                match o {
                    Ok(o) => {
                        finished = o.finish_reason.is_some();
                        self.active[i].retry = None;
                        self.observe(i, &o);
                        let a = &self.active[i];
                        let out = HeliosOutput {
                            model: Arc::clone(&self.engines[a.engine].name),
                            evaluation: a.block.is_some(),
                            output: o,
                        };
                        let _ = a.sink.send(Ok(out));
                    }
                    Err(e) => {
                        finished = true;
                        let engine = self.active[i].engine;
                        if self.active[i].retry.is_some() && !self.reachable(engine) {
                            // Nothing of it reached the client: it goes to another candidate.
                            tracing::warn!(model = %self.engines[engine].name, error = %e, "HELIOS: remote candidate unreachable, the request goes to another");
                        } else {
                            self.active[i].retry = None;
                            let _ = self.active[i].sink.send(Err(e.into()));
                        }
                    }
                }
                if finished {
                    break;
                }
            }
            if finished {
                let mut a = self.active.swap_remove(i);
                self.request_done(&a);
                if let Some(request) = a.retry.take() {
                    self.counters.retried += 1;
                    self.route(
                        Queued {
                            request,
                            sink: a.sink,
                        },
                        false,
                    );
                }
            } else {
                i += 1;
            }
        }
        self.release_drained();
        progressed
    }

    /// Feeds one output to the evaluation's measures, or to the breach counter and the drift
    /// detector; acts on what they say.
    fn observe(&mut self, i: usize, o: &switchyard_engine::RequestOutput) {
        let a = &self.active[i];
        let threshold = self.policy.config.threshold;
        if let (Some(b), Phase::Evaluating(e)) = (a.block, &mut self.phase) {
            let exits: Vec<usize> = o
                .probe_exits
                .iter()
                .map(|x| x.map_or(o.depth, usize::from))
                .collect();
            e.measures[b].record_tokens(&o.logprobs, &exits, &o.text);
            return;
        }
        let Phase::Serving { serving, engine } = &self.phase else {
            return;
        };
        // Shadow evaluation decides on scores of the traffic, not on the serving model's
        // confidence in its own output.
        if self.shadow.is_some() {
            return;
        }
        if a.engine != *engine || o.depth != serving.depth {
            return;
        }
        let depth = serving.depth;
        let mut fired = false;
        let mut drift = None;
        for &c in &o.confidences {
            let breached = !passes(c, threshold);
            self.counters.tokens_observed += 1;
            self.counters.tokens_breached += u64::from(breached);
            if self.cbc.observe(breached) {
                self.counters.cbc_fired += 1;
                fired = true;
            }
            if let Some(d) = self.drift.as_mut() {
                if let Some(found) = d.observe((!breached).then_some(depth)) {
                    drift = Some(found);
                }
            }
            if fired || drift.is_some() {
                break;
            }
        }
        if fired || drift.is_some() {
            self.decide(fired, drift);
        }
    }

    fn request_done(&mut self, a: &Active) {
        match a.block {
            Some(b) => self.block_request_done(b),
            None => {
                if self.shadow.is_some() {
                    return;
                }
                if self.clock.on_request_done() && matches!(self.phase, Phase::Serving { .. }) {
                    self.decide(false, None);
                }
            }
        }
    }

    /// The policy at a decision point, and the action it chose.
    fn decide(&mut self, cbc_fired: bool, drift: Option<crate::policy::Drift>) {
        let Phase::Serving { serving, .. } = &self.phase else {
            return;
        };
        let features = Features {
            serving: Some(serving.clone()),
            cbc_fired,
            reprofile_due: self.clock.is_due(),
            drift,
            horizon_tokens: self.clock.remaining() as f64 * self.tokens_per_request,
        };
        match self.policy.decide(&features, &self.repo, &self.pht) {
            Decision::Continue => {
                if cbc_fired {
                    self.counters.cbc_unremedied += 1;
                    tracing::info!(serving = ?features.serving, "HELIOS breach: no remedy available");
                }
            }
            Decision::Profile(reason) => self.start_eval(reason),
            Decision::Remedy(r) => self.remedy(r),
        }
    }

    fn start_eval(&mut self, reason: ProfileReason) {
        let started = Instant::now();
        tracing::info!(?reason, "HELIOS online evaluation starts");
        // A remote candidate that cannot be reached is not evaluated.
        let blocks: Vec<usize> = self.live().into_iter().map(|c| c.1).collect();
        let names = blocks
            .iter()
            .map(|&i| self.engines[i].name.to_string())
            .collect();
        let n = blocks.len();
        self.cbc.clear();
        self.drift = None;
        // The serving model's running sequences finish where they are.
        if let Phase::Serving { engine, .. } = self.phase {
            self.draining.push(engine);
        }
        self.phase = Phase::Evaluating(Box::new(Eval {
            reason,
            plan: EvalPlan::new(names, self.policy.config.eval_requests),
            blocks,
            current: 0,
            done: vec![0; n],
            queued: (0..n).map(|_| VecDeque::new()).collect(),
            measures: vec![BlockMeasure::default(); n],
            started,
            overhead: Duration::ZERO,
        }));
        self.activate_block(0);
    }

    /// Loads block `b`'s candidate to full depth with its exits probed, and hands it the
    /// requests queued for it.
    fn activate_block(&mut self, b: usize) {
        let Phase::Evaluating(e) = &mut self.phase else {
            return;
        };
        let i = e.blocks[b];
        e.current = b;
        let eng = &self.engines[i];
        let t = Instant::now();
        match eng.handle.load_layers(eng.info.n_layers, true).wait() {
            Ok(report) if !report.layers.is_empty() => {
                let secs: f64 = report.layers.iter().map(|l| l.secs).sum();
                e.measures[b].load_ms_per_layer = Some(secs * 1000.0 / report.layers.len() as f64);
            }
            Ok(_) => {}
            Err(err) => {
                tracing::error!(model = %eng.name, error = %err, "cannot load for evaluation")
            }
        }
        eng.handle.set_probe(Some(ExitProbe {
            depths: eng.exit_layers.clone(),
            threshold: self.policy.config.threshold,
        }));
        e.overhead += t.elapsed();
        self.draining.retain(|&d| d != i);
        tracing::info!(model = %eng.name, block = b, "HELIOS evaluation block");
        let queued: Vec<Queued> = e.queued[b].drain(..).collect();
        for q in queued {
            self.dispatch(q, i, Some(b));
        }
    }

    fn block_request_done(&mut self, b: usize) {
        let Phase::Evaluating(e) = &mut self.phase else {
            return;
        };
        e.done[b] += 1;
        e.measures[b].end_request(Instant::now());
        if b != e.current || e.done[b] < self.policy.config.eval_requests {
            return;
        }
        let i = e.blocks[b];
        self.engines[i].handle.set_probe(None);
        if b + 1 < e.blocks.len() {
            self.activate_block(b + 1);
        } else {
            self.finish_eval();
        }
    }

    /// Writes the PHT rows, picks the model and depth, and moves to serving.
    fn finish_eval(&mut self) {
        let Phase::Evaluating(e) = std::mem::replace(&mut self.phase, Phase::Idle) else {
            return;
        };
        let t = Instant::now();
        let coverage = self.policy.config.exit_coverage;
        let mut tokens = 0.0;
        for (b, &i) in e.blocks.iter().enumerate() {
            let eng = &self.engines[i];
            let m = &e.measures[b];
            tokens += m.tokens_per_request();
            let fallback = self
                .pht
                .of_model(&eng.name)
                .map(|r| f64::from(r.extend_ms_per_layer))
                .next()
                .unwrap_or(0.0);
            let switch_depth = coverage_depth(&m.exits, &eng.servable, coverage);
            let row = m.row(&eng.name, eng.info.n_layers, switch_depth, fallback);
            tracing::info!(
                model = %eng.name,
                tokens_per_s = row.tokens_per_s,
                bits_per_byte = row.bits_per_byte,
                exits = ?row.exits.bins(),
                "HELIOS PHT row"
            );
            self.pht.upsert(row);
        }
        self.tokens_per_request = tokens / e.blocks.len().max(1) as f64;
        let cands = self.live_candidates();
        let (engine, depth) = match self.policy.choose_serving(&self.repo, &cands, &self.pht) {
            Ok(p) => (self.engine_index(&p.model).unwrap_or(e.blocks[0]), p.depth),
            Err(err) => {
                let i = e.blocks[0];
                tracing::warn!(error = %err, "no candidate fits after evaluation: serving the first at full depth");
                (i, self.engines[i].info.n_layers)
            }
        };
        let eng = &self.engines[engine];
        if let Err(err) = eng.handle.drop_layers(depth).wait() {
            tracing::error!(model = %eng.name, error = %err, "cannot drop to the partial load");
        }
        let busy: Vec<usize> = self.active.iter().map(|a| a.engine).collect();
        for (j, other) in self.engines.iter().enumerate() {
            if j == engine {
                continue;
            }
            if busy.contains(&j) {
                if !self.draining.contains(&j) {
                    self.draining.push(j);
                }
            } else if let Err(err) = other.handle.drop_layers(1).wait() {
                tracing::error!(model = %other.name, error = %err, "cannot drop layers");
            }
        }
        self.draining.retain(|&d| d != engine);
        let overhead = e.overhead + t.elapsed();
        let c = &mut self.counters;
        c.profiles += 1;
        c.profile_seconds += overhead.as_secs_f64();
        c.profile_wall_seconds += e.started.elapsed().as_secs_f64();
        if e.reason != ProfileReason::Initial {
            c.reprofiles += 1;
        }
        if matches!(e.reason, ProfileReason::Drift(_)) {
            c.drift_reprofiles += 1;
        }
        let serving = Serving {
            model: self.engines[engine].name.to_string(),
            depth,
        };
        tracing::info!(
            reason = ?e.reason,
            model = %serving.model,
            depth,
            overhead_ms = overhead.as_secs_f64() * 1000.0,
            "HELIOS profile: greedy partial load"
        );
        self.clock.reset();
        self.serve(serving, engine);
        let waiting: Vec<Queued> = self.waiting.drain(..).collect();
        for q in waiting {
            self.dispatch(q, engine, None);
        }
    }

    /// Serving with `serving` from now on: a fresh breach window and drift reference.
    fn serve(&mut self, serving: Serving, engine: usize) {
        self.cbc.clear();
        let hist = self
            .pht
            .of_model(&serving.model)
            .fold(ExitHistogram::new(), |mut h, r| {
                h.merge(&r.exits);
                h
            });
        self.drift = DriftDetector::new(self.policy.config.drift.clone(), &hist, &[serving.depth])
            .map_err(|e| tracing::debug!(error = %e, "no drift reference"))
            .ok();
        self.phase = Phase::Serving { serving, engine };
    }

    fn engine_index(&self, name: &str) -> Option<usize> {
        self.engines.iter().position(|e| &*e.name == name)
    }

    fn remedy(&mut self, r: Remedy) {
        let Phase::Serving { serving, engine } = &self.phase else {
            return;
        };
        let (serving, engine) = (serving.clone(), *engine);
        let t = Instant::now();
        match r {
            Remedy::Extend { to, cost_ms, .. } => {
                let eng = &self.engines[engine];
                if let Err(err) = eng.handle.load_layers(to, true).wait() {
                    tracing::error!(model = %eng.name, to, error = %err, "extend failed");
                    self.counters.cbc_unremedied += 1;
                    return;
                }
                let secs = t.elapsed().as_secs_f64();
                self.counters.extends += 1;
                self.counters.extend_seconds += secs;
                tracing::info!(
                    model = %eng.name,
                    from = serving.depth,
                    to,
                    estimated_ms = cost_ms,
                    load_ms = secs * 1000.0,
                    "HELIOS extend"
                );
                let model = serving.model;
                self.serve(Serving { model, depth: to }, engine);
            }
            Remedy::Switch {
                to, depth, cost_ms, ..
            } => {
                let Some(target) = self.engine_index(&to) else {
                    self.counters.cbc_unremedied += 1;
                    return;
                };
                let eng = &self.engines[target];
                let done = eng
                    .handle
                    .load_layers(depth, false)
                    .wait()
                    .and_then(|_| eng.handle.set_depth(depth).wait());
                if let Err(err) = done {
                    tracing::error!(model = %eng.name, depth, error = %err, "switch failed");
                    self.counters.cbc_unremedied += 1;
                    return;
                }
                let running = self.active.iter().filter(|a| a.engine == engine).count();
                let overlap = match self.engines[engine].handle.stats().wait() {
                    Ok(st) => st.memory.weights_bytes,
                    Err(_) => 0,
                };
                self.counters.switch_overlap_bytes =
                    self.counters.switch_overlap_bytes.max(overlap);
                self.counters.switches += 1;
                self.counters.switch_drained += running as u64;
                self.draining.retain(|&d| d != target);
                if !self.draining.contains(&engine) {
                    self.draining.push(engine);
                }
                let secs = t.elapsed().as_secs_f64();
                self.counters.switch_seconds += secs;
                tracing::info!(
                    from = %serving.model,
                    to = %eng.name,
                    depth,
                    drained = running,
                    estimated_ms = cost_ms,
                    load_ms = secs * 1000.0,
                    "HELIOS switch"
                );
                self.serve(Serving { model: to, depth }, target);
            }
        }
    }

    /// Sends the sampled prompts to the scorer when a round's worth is ready and the scorer
    /// is free.
    fn send_round(&mut self) {
        let round = self.policy.config.shadow.round;
        if self
            .shadow
            .as_ref()
            .is_some_and(|sh| !sh.busy && sh.pending.len() >= round)
        {
            self.send_round_now(false);
        }
    }

    /// Sends the newest sampled prompts (at most a round's worth) to the scorer if it is
    /// free, however few they are; `held` when a request waits on the round.
    fn send_round_now(&mut self, held: bool) {
        let round = self.policy.config.shadow.round;
        let Some(sh) = self.shadow.as_mut() else {
            return;
        };
        if sh.busy || sh.pending.is_empty() {
            return;
        }
        // The newest texts: a round scores the traffic as it is now. Texts that arrived while
        // the scorer was busy and that newer ones displaced are skipped, and counted.
        let stale = sh.pending.len().saturating_sub(round);
        sh.pending.drain(..stale);
        self.counters.shadow_texts_skipped += stale as u64;
        let texts: Vec<ShadowText> = sh.pending.drain(..).collect();
        if sh.tx.send((texts, held)).is_ok() {
            sh.busy = true;
        }
    }

    /// Takes a finished round, if any: counts it, and switches when the hysteresis lets the
    /// round's choice through. `true` when a round was taken.
    fn poll_shadow(&mut self) -> bool {
        let Some(sh) = self.shadow.as_mut() else {
            return false;
        };
        let r = match sh.rx.try_recv() {
            Ok(r) => r,
            Err(_) => return false,
        };
        sh.busy = false;
        let c = &mut self.counters;
        c.shadow_busy_seconds += r.busy.as_secs_f64();
        c.shadow_slept_seconds += r.slept.as_secs_f64();
        let total = c.shadow_busy_seconds + c.shadow_slept_seconds;
        c.shadow_share_used = if total > 0.0 {
            c.shadow_busy_seconds / total
        } else {
            0.0
        };
        let grew = r.peak_bytes as u64 > c.shadow_peak_bytes;
        c.shadow_peak_bytes = c.shadow_peak_bytes.max(r.peak_bytes as u64);
        if grew {
            // The serving engine's grant leaves room for what the scorer now holds.
            if let Phase::Serving { engine, .. } = self.phase {
                self.grant(engine);
            }
        }
        let c = &mut self.counters;
        let scores = match r.scores {
            Ok(s) => s,
            Err(err) => {
                c.shadow_errors += 1;
                tracing::error!(error = %err, "HELIOS shadow round failed");
                self.release_held();
                self.send_round();
                return true;
            }
        };
        c.shadow_rounds += 1;
        c.shadow_texts += r.texts as u64;
        let window = self.policy.config.shadow.window;
        // The round's own prompts against the window before them: other traffic restarts
        // the window (and the hysteresis) from this round.
        let newest: BTreeMap<String, DepthNats> = scores
            .iter()
            .map(|s| (s.model.clone(), s.prompt.clone()))
            .collect();
        let sh = self.shadow.as_mut().expect("shadow state checked above");
        let changed = self
            .policy
            .config
            .shadow
            .change_margin
            .is_some_and(|m| change_point(&self.repo, &window_nats(&sh.recent), &newest, m));
        if changed {
            sh.recent.clear();
            sh.gate = SwitchGate::new(self.policy.config.shadow.switch_after);
            self.counters.shadow_change_points += 1;
        }
        let by_model = slide_window(&mut sh.recent, window, scores, r.texts);
        let Phase::Serving { serving, .. } = &self.phase else {
            self.release_held();
            self.send_round();
            return true;
        };
        let current = serving.clone();
        let cands = self.live_candidates();
        let best = match self.policy.choose_shadow(&self.repo, &cands, &by_model) {
            Ok(p) => Some(Serving {
                model: p.model,
                depth: p.depth,
            }),
            Err(err) => {
                tracing::warn!(error = %err, "HELIOS shadow round: no candidate fits");
                None
            }
        };
        let mut switched = false;
        if let Some(b) = &best {
            // New traffic that the serving choice serves beyond the bound is left at once.
            let urgent =
                *b != current && changed && self.policy.breaks_bound(&self.repo, &current, &newest);
            let sh = self.shadow.as_mut().expect("shadow state checked above");
            let agreed = sh.gate.propose(&current, b);
            if urgent || agreed {
                switched = self.move_to(b.clone());
                if switched && !agreed {
                    self.counters.shadow_urgent_switches += 1;
                    let sh = self.shadow.as_mut().expect("shadow state checked above");
                    sh.gate = SwitchGate::new(self.policy.config.shadow.switch_after);
                }
            }
        }
        // Requests held for this round go to what it chose.
        self.release_held();
        let round = ShadowRound {
            at_request: self.counters.requests,
            serving: ServingInfo::from(&current),
            best: best.as_ref().map(ServingInfo::from),
            switched,
            change_point: changed,
            scores: by_model.values().map(round_score).collect(),
        };
        tracing::info!(
            serving = %current.model,
            depth = current.depth,
            best = ?round.best,
            switched,
            change_point = changed,
            "HELIOS shadow round"
        );
        if let Some(sh) = self.shadow.as_mut() {
            sh.rounds.push(round);
        }
        self.send_round();
        true
    }

    /// Serves `target` from now on: another depth of the serving model (loading or dropping
    /// layers), or another model (the old one drains). `true` when it happened.
    fn move_to(&mut self, target: Serving) -> bool {
        let Phase::Serving { serving, engine } = &self.phase else {
            return false;
        };
        let (from, engine) = (serving.clone(), *engine);
        let t = Instant::now();
        if target.model == from.model {
            let eng = &self.engines[engine];
            let done = if target.depth > from.depth {
                eng.handle.load_layers(target.depth, true).wait().map(drop)
            } else {
                eng.handle.drop_layers(target.depth).wait().map(drop)
            };
            if let Err(err) = done {
                tracing::error!(model = %eng.name, depth = target.depth, error = %err, "depth change failed");
                return false;
            }
            self.counters.extends += u64::from(target.depth > from.depth);
            self.counters.extend_seconds += t.elapsed().as_secs_f64();
            tracing::info!(model = %eng.name, from = from.depth, to = target.depth, "HELIOS shadow: depth change");
            self.serve(target, engine);
            return true;
        }
        if self.policy.config.shadow.drain_first {
            self.drain(engine);
        }
        if let Some(target) = self.engine_index(&target.model) {
            self.grant(target);
        }
        // Measured, not estimated: the switch's load time is counted as it happens.
        let cost_ms = 0.0;
        self.remedy(Remedy::Switch {
            from: from.model.clone(),
            to: target.model.clone(),
            depth: target.depth,
            cost_ms,
        });
        matches!(&self.phase, Phase::Serving { serving, .. } if *serving == target)
    }

    /// Serves `engine`'s running requests to their end, then releases its layers (the
    /// shadow's `drain_first`, before another model loads). New requests wait in the command
    /// queue meanwhile; the time is counted in `switch_drain_seconds`.
    fn drain(&mut self, engine: usize) {
        let t = Instant::now();
        loop {
            let seen = self.bell.rings();
            self.poll();
            if !self.active.iter().any(|a| a.engine == engine) {
                break;
            }
            self.bell.wait_past(seen, WAKE);
        }
        self.counters.switch_drain_seconds += t.elapsed().as_secs_f64();
        if let Err(err) = self.engines[engine].handle.park().wait() {
            tracing::error!(model = %self.engines[engine].name, error = %err, "cannot release the drained model");
        }
    }

    /// Shadow evaluation: moves memory to engine `to`. Every other local engine keeps what
    /// it holds (weights and workspace, nothing when parked) plus the K/V its sequences need
    /// to finish (a drained engine's requests end where they started), never more than it
    /// has now; `to` gets the rest of the caller's total less what the scorers hold, so the
    /// engines together never exceed what the caller gave them. (Serial evaluation keeps
    /// the caller's equal shares: there every candidate serves in turn.)
    fn grant(&mut self, to: usize) {
        if self.shadow.is_none() || self.budget_total == 0 {
            return;
        }
        let mut others = 0u64;
        for (j, e) in self.engines.iter().enumerate() {
            if j == to || is_remote(&self.repo, &e.name) {
                continue;
            }
            let keep = match e.handle.stats().wait() {
                Ok(st) => {
                    let m = &st.memory;
                    let kv = m.kv_used_bytes.max(m.kv_to_finish_bytes);
                    (m.weights_bytes + m.workspace_bytes + kv).min(m.budget_bytes)
                }
                Err(err) => {
                    tracing::error!(model = %e.name, error = %err, "no stats: its budget stays");
                    return;
                }
            };
            match e.handle.set_budget(keep).wait() {
                Ok(_) => others += keep,
                Err(err) => {
                    tracing::error!(model = %e.name, error = %err, "cannot shrink its budget");
                    return;
                }
            }
        }
        let rest = self
            .budget_total
            .saturating_sub(others)
            .saturating_sub(self.counters.shadow_peak_bytes);
        let e = &self.engines[to];
        match e.handle.set_budget(rest).wait() {
            Ok(_) => tracing::info!(model = %e.name, bytes = rest, "HELIOS shadow: budget granted"),
            Err(err) => tracing::error!(model = %e.name, error = %err, "cannot grant the budget"),
        }
    }

    /// Drops the layers of drained engines whose last sequence ended.
    fn release_drained(&mut self) {
        let (serving, evaluating) = match &self.phase {
            Phase::Serving { engine, .. } => (Some(*engine), None),
            Phase::Evaluating(e) => (None, e.blocks.get(e.current).copied()),
            Phase::Idle => (None, None),
        };
        let mut k = 0;
        while k < self.draining.len() {
            let i = self.draining[k];
            if Some(i) == serving || Some(i) == evaluating {
                self.draining.swap_remove(k);
                continue;
            }
            if self.active.iter().any(|a| a.engine == i) {
                k += 1;
                continue;
            }
            self.draining.swap_remove(k);
            let later_block =
                matches!(&self.phase, Phase::Evaluating(e) if e.blocks[e.current..].contains(&i));
            if later_block {
                continue;
            }
            // Under shadow evaluation a drained engine holds nothing until it serves again.
            let released = match self.shadow {
                Some(_) => self.engines[i].handle.park().wait(),
                None => self.engines[i].handle.drop_layers(1).wait(),
            };
            if let Err(err) = released {
                tracing::error!(model = %self.engines[i].name, error = %err, "cannot drop drained layers");
            }
            tracing::info!(model = %self.engines[i].name, "HELIOS drained");
            if let Some(s) = serving {
                self.grant(s);
            }
        }
    }
}

fn is_remote(repo: &Manifest, name: &str) -> bool {
    repo.get(name).is_some_and(|m| m.is_remote())
}

/// Token ids of `prompt` for the model behind `info` (its chat template for chat).
fn tokenize(info: &EngineInfo, prompt: &HeliosPrompt) -> Result<Vec<u32>> {
    let tok = &info.tokenizer;
    Ok(match prompt {
        HeliosPrompt::Text(t) => tok.encode(t, true, true)?,
        HeliosPrompt::Chat(messages) => {
            let text = tok.apply_chat_template(messages, true)?;
            let has_bos = tok
                .bos_id()
                .and_then(|b| tok.id_to_piece(b))
                .is_some_and(|b| text.starts_with(&b));
            tok.encode(&text, !has_bos, true)?
        }
    })
}

pub(super) fn run(mut s: State, rx: mpsc::Receiver<Command>) {
    let mut connected = true;
    // Rings before this count were seen: every output they announced has been polled.
    let mut seen = s.bell.rings();
    loop {
        let cmd = if !connected {
            if s.active.is_empty() {
                break;
            }
            s.bell.wait_past(seen, WAKE);
            None
        } else if s.active.is_empty()
            && s.held.is_empty()
            && !s.shadow.as_ref().is_some_and(|sh| sh.busy)
        {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => break,
            }
        } else {
            let mut got = rx.try_recv();
            if matches!(got, Err(mpsc::TryRecvError::Empty)) {
                s.bell.wait_past(seen, WAKE);
                got = rx.try_recv();
            }
            match got {
                Ok(c) => Some(c),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => {
                    connected = false;
                    None
                }
            }
        };
        let mut next = cmd;
        while let Some(c) = next {
            match c {
                Command::Submit { request, sink, .. } => s.submit(Queued {
                    request: *request,
                    sink,
                }),
                Command::Stats { reply } => {
                    let _ = reply.send(s.stats());
                }
                Command::Shutdown { reply } => {
                    // Dropping the streams aborts the requests in their engines.
                    s.active.clear();
                    let _ = reply.send(());
                    return;
                }
            }
            next = if connected { rx.try_recv().ok() } else { None };
        }
        seen = s.bell.rings();
        while s.poll() | s.poll_shadow() | s.hold_expired() {}
    }
}

/// Adds a round's per-prompt scores to the sliding window of the last `window` prompts,
/// and returns each candidate's round score with its prompt nats summed over that window
/// (the rest, such as the exit histogram and the timings, is the round's own).
fn slide_window(
    recent: &mut VecDeque<BTreeMap<String, DepthNats>>,
    window: usize,
    scores: Vec<ShadowScore>,
    texts: usize,
) -> BTreeMap<String, ShadowScore> {
    for t in 0..texts {
        recent.push_back(
            scores
                .iter()
                .filter_map(|s| Some((s.model.clone(), s.per_prompt.get(t)?.clone())))
                .collect(),
        );
    }
    while recent.len() > window.max(1) {
        recent.pop_front();
    }
    let sums = window_nats(recent);
    scores
        .into_iter()
        .map(|mut s| {
            s.prompt = sums.get(&s.model).cloned().unwrap_or_default();
            (s.model.clone(), s)
        })
        .collect()
}

/// Each model's prompt nats summed over the window's texts.
fn window_nats(recent: &VecDeque<BTreeMap<String, DepthNats>>) -> BTreeMap<String, DepthNats> {
    let mut sum: BTreeMap<String, DepthNats> = BTreeMap::new();
    for text in recent {
        for (m, n) in text.iter().filter(|(_, n)| n.bytes > 0) {
            sum.entry(m.clone()).or_default().merge(n);
        }
    }
    sum
}

/// Starts the scorer thread over `scorers`, which must cover every local selected candidate.
fn start_scorer(
    repo: &Manifest,
    policy: &Policy,
    candidates: &[(Candidate, usize)],
    scorers: Vec<ShadowScorer>,
    scoring: bool,
    bell: Doorbell,
) -> Result<Shadow> {
    let mut kept = Vec::new();
    let mut scorers = scorers;
    for (c, _) in candidates.iter().filter(|_| scoring) {
        let remote = repo.get(c.model()).is_some_and(|m| m.is_remote());
        if remote {
            continue;
        }
        let Some(i) = scorers.iter().position(|s| s.name() == c.model()) else {
            return Err(HeliosError::Orchestrator(format!(
                "shadow evaluation needs a scorer for {} (or set evaluation = \"serial\")",
                c.model()
            )));
        };
        kept.push(scorers.swap_remove(i));
    }
    let cfg = &policy.config;
    let settings = ScoreSettings {
        threshold: cfg.threshold,
        measure: switchyard_exits::ConfidenceMeasure::MaxProb,
        max_text_bytes: cfg.shadow.max_text_bytes,
        exit_stride: cfg.shadow.exit_stride,
    };
    let (tx, worker_rx) = mpsc::channel();
    let (worker_tx, rx) = mpsc::channel();
    let share = cfg.shadow.share;
    std::thread::Builder::new()
        .name("switchyard-helios-shadow".into())
        .spawn(move || run_scorer(kept, settings, share, worker_rx, worker_tx, bell))
        .map_err(|e| HeliosError::Orchestrator(format!("cannot start the scorer thread: {e}")))?;
    Ok(Shadow {
        tx,
        rx,
        busy: false,
        scoring,
        pending: Vec::new(),
        recent: VecDeque::new(),
        gate: SwitchGate::new(cfg.shadow.switch_after),
        rounds: Vec::new(),
    })
}

fn round_score(s: &ShadowScore) -> ShadowRoundScore {
    let bpb = |n: &crate::shadow::DepthNats| -> Vec<(usize, f64)> {
        n.nats
            .iter()
            .filter_map(|&(d, _)| n.bits_per_byte(d).map(|b| (d, b)))
            .collect()
    };
    ShadowRoundScore {
        model: s.model.clone(),
        prompt_bytes: s.prompt.bytes,
        prompt_bits_per_byte: bpb(&s.prompt),
        reference_bytes: s.reference.bytes,
        reference_bits_per_byte: bpb(&s.reference),
        prefill_tokens_per_s: s.prefill_tokens_per_s,
    }
}
