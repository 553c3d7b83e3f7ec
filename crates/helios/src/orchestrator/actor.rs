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

use switchyard_engine::{EngineInfo, EngineRequest, ExitProbe, RequestStream};
use switchyard_exits::confidence::passes;
use tokio::sync::mpsc as tmpsc;

use super::measure::BlockMeasure;
use super::{
    CandidateEngine, Command, Counters, HeliosOutput, HeliosPrompt, HeliosRequest,
    OrchestratorStats, ServingInfo,
};
use crate::manifest::Manifest;
use crate::pht::{ExitHistogram, Pht};
use crate::policy::depth::coverage_depth;
use crate::policy::{
    Candidate, ConfidenceBreachCounter, Decision, DriftDetector, EvalPlan, Features, Policy,
    ProfileReason, Remedy, ReprofileClock, Serving,
};
use crate::{HeliosError, Result};

/// How long the thread waits for a command while requests stream (outputs are polled in
/// between).
const POLL: Duration = Duration::from_micros(500);

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
}

impl State {
    pub(super) fn new(repo: Manifest, policy: Policy, given: Vec<CandidateEngine>) -> Result<Self> {
        let selection = policy.select_candidates(&repo)?;
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
        // Nothing is served before the first evaluation: every engine keeps one layer.
        for e in &engines {
            e.handle.drop_layers(1).wait()?;
        }
        let cfg = &policy.config;
        Ok(Self {
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
        })
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
        }
    }

    fn submit(&mut self, q: Queued) {
        self.counters.requests += 1;
        if matches!(self.phase, Phase::Idle) {
            self.start_eval(ProfileReason::Initial);
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
                    self.dispatch(q, self.eval_engine(b), Some(b));
                } else {
                    e.queued[b].push_back(q);
                }
            }
            Phase::Serving { engine, .. } => {
                let engine = *engine;
                self.dispatch(q, engine, None);
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
        let e = &self.engines[i];
        let added = tokenize(&e.info, &q.request.prompt).and_then(|prompt| {
            let room = e.info.context_length.saturating_sub(prompt.len()).max(1);
            let mut params = q.request.params.clone();
            params.max_tokens = params.max_tokens.min(room);
            Ok(e.handle.add_request(EngineRequest { prompt, params })?)
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
                        let _ = self.active[i].sink.send(Err(e.into()));
                        finished = true;
                    }
                }
                if finished {
                    break;
                }
            }
            if finished {
                let a = self.active.swap_remove(i);
                self.request_done(&a);
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
        let blocks: Vec<usize> = self.candidates.iter().map(|c| c.1).collect();
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
        let cands: Vec<Candidate> = self.candidates.iter().map(|c| c.0.clone()).collect();
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
            if let Err(err) = self.engines[i].handle.drop_layers(1).wait() {
                tracing::error!(model = %self.engines[i].name, error = %err, "cannot drop drained layers");
            }
            tracing::info!(model = %self.engines[i].name, "HELIOS drained");
        }
    }
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
    loop {
        let cmd = if !connected {
            if s.active.is_empty() {
                break;
            }
            std::thread::sleep(POLL);
            None
        } else if s.active.is_empty() {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => break,
            }
        } else {
            match rx.recv_timeout(POLL) {
                Ok(c) => Some(c),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    connected = false;
                    None
                }
            }
        };
        let mut next = cmd;
        while let Some(c) = next {
            match c {
                Command::Submit { request, sink, .. } => s.submit(Queued { request, sink }),
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
        while s.poll() {}
    }
}
