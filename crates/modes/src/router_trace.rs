//! The router under traffic: a mixed trace with Poisson arrivals replayed against every mode's
//! engine at once, once per router, so that batching, queueing and the cost of splitting
//! traffic across engines (which share the cores) all count.
//!
//! Classes of the trace (the mix is configurable):
//! - `chat`: a 128-token prompt, 32 tokens out (interactive);
//! - `long-generation`: a 128-token prompt, 128 out (decode-heavy);
//! - `shared-prefix`: one 512-token system prefix and a 64-token turn, 32 out;
//! - `long-prompt`: a 1,024-token prompt, 32 out (prefill-heavy);
//! - `math`: a GSM8K question in its 8-shot prompt, 128 out, labelled `gsm8k`;
//! - `multiple-choice`: an MMLU question, 1 token out (the letter), labelled `mmlu`.
//!
//! Each request is routed at its arrival from its features, with the number of requests then
//! in flight as the queue depth, and served in the chosen mode's engine. Outputs are forced to
//! their length (`ignore_eos`), so every router serves the same tokens.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{rngs::StdRng, Rng, SeedableRng};
use rand_distr::{Distribution, Exp};
use serde::Serialize;
use switchyard_engine::{EngineHandle, EngineRequest};
use switchyard_eval::quality::{self, McTask, Pick};
use switchyard_eval::stats::{median, percentile};
use switchyard_request::{Mode, SamplingParams};
use switchyard_router::{ModeSet, Oracle, PrefixIndex, RequestFeatures, Router};

use crate::bench::sharegpt_tokens;
use crate::serve::ModeAssets;
use crate::{ModesError, Result};

/// A class of the trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TraceClass {
    Chat,
    LongGeneration,
    SharedPrefix,
    LongPrompt,
    Math,
    MultipleChoice,
}

impl TraceClass {
    pub const ALL: [TraceClass; 6] = [
        TraceClass::Chat,
        TraceClass::LongGeneration,
        TraceClass::SharedPrefix,
        TraceClass::LongPrompt,
        TraceClass::Math,
        TraceClass::MultipleChoice,
    ];

    pub fn name(self) -> &'static str {
        match self {
            TraceClass::Chat => "chat",
            TraceClass::LongGeneration => "long-generation",
            TraceClass::SharedPrefix => "shared-prefix",
            TraceClass::LongPrompt => "long-prompt",
            TraceClass::Math => "math",
            TraceClass::MultipleChoice => "multiple-choice",
        }
    }

    /// Parses `name=weight,...` (weights need not sum to 1).
    pub fn parse_mix(text: &str) -> Result<Vec<(TraceClass, f64)>> {
        let mut out = Vec::new();
        for part in text.split(',').filter(|p| !p.trim().is_empty()) {
            let (name, weight) = part.split_once('=').ok_or_else(|| {
                ModesError::Invalid(format!("trace mix entry {part:?}: expected class=weight"))
            })?;
            let class = TraceClass::ALL
                .into_iter()
                .find(|c| c.name() == name.trim())
                .ok_or_else(|| {
                    ModesError::Invalid(format!(
                        "unknown trace class {name:?}; known: chat, long-generation, shared-prefix, long-prompt, math, multiple-choice"
                    ))
                })?;
            let w: f64 = weight.trim().parse().map_err(|_| {
                ModesError::Invalid(format!("trace mix weight {weight:?} is not a number"))
            })?;
            if !(w.is_finite() && w >= 0.0) {
                return Err(ModesError::Invalid(format!(
                    "trace mix weight of {name} must be non-negative, got {w}"
                )));
            }
            out.push((class, w));
        }
        if out.iter().map(|(_, w)| w).sum::<f64>() <= 0.0 {
            return Err(ModesError::Invalid(
                "the trace mix has no class with a positive weight".into(),
            ));
        }
        Ok(out)
    }
}

/// The default mix: latency-sensitive chat and shared-prefix traffic with some long
/// generations and long prompts, and quality-sensitive math and multiple-choice requests.
pub const DEFAULT_MIX: &str =
    "chat=0.3,long-generation=0.15,shared-prefix=0.2,long-prompt=0.1,math=0.1,multiple-choice=0.15";

#[derive(Debug, Clone)]
pub struct TraceOptions {
    pub requests: usize,
    /// Mean arrivals per second.
    pub rate: f64,
    pub mix: Vec<(TraceClass, f64)>,
    pub seed: u64,
    /// Fixed modes to replay (empty: every one that passes the gate for every class).
    pub fixed: Vec<Mode>,
    /// Other routers to replay, by kind (`rules`, `fitted`, `learned`, `oracle`; empty: all).
    pub routers: Vec<String>,
    /// Replays per router (at least 1). Round `r` replays the routers in turn, the order
    /// rotated by `r`, so that no router always runs first or last on a drifting machine.
    pub repeats: usize,
}

/// The kinds of router `TraceOptions::routers` names, besides fixed modes.
pub const ROUTER_KINDS: [&str; 4] = ["rules", "fitted", "learned", "oracle"];

impl TraceOptions {
    /// Refuses zero repeats and unknown router kinds.
    pub fn validate(&self) -> Result<()> {
        if self.repeats == 0 {
            return Err(ModesError::Invalid(
                "trace repeats must be at least 1".into(),
            ));
        }
        if let Some(k) = self
            .routers
            .iter()
            .find(|k| !ROUTER_KINDS.contains(&k.as_str()))
        {
            return Err(ModesError::Invalid(format!(
                "unknown router kind {k:?}; known: {} (fixed modes: --trace-fixed)",
                ROUTER_KINDS.join(", ")
            )));
        }
        Ok(())
    }

    /// Whether a router of this kind is replayed (fixed modes are chosen elsewhere).
    pub fn replays_kind(&self, kind: &str) -> bool {
        kind == "fixed" || self.routers.is_empty() || self.routers.iter().any(|k| k == kind)
    }
}

/// One request of the trace.
#[derive(Debug, Clone)]
pub struct TraceRequest {
    pub at_s: f64,
    pub class: TraceClass,
    pub prompt: Vec<u32>,
    pub output: usize,
    label: Option<&'static str>,
    /// Block-aligned prompt tokens an earlier request of the trace had ([`PrefixIndex`]).
    shared_prefix: usize,
}

impl TraceRequest {
    /// What the router sees of this request on arrival, with `queue_depth` requests in flight.
    pub fn features(&self, queue_depth: usize) -> RequestFeatures {
        RequestFeatures {
            prompt_tokens: self.prompt.len(),
            max_output_tokens: self.output,
            expected_output_tokens: None,
            shared_prefix_tokens: self.shared_prefix,
            memory_pressure: 0.0,
            queue_depth,
            workload: self.label.map(str::to_string),
        }
    }
}

/// Builds the trace: classes drawn by the mix, exponential gaps at `rate`, prompts from
/// ShareGPT (distinct per request), GSM8K and MMLU.
pub fn build(assets: &ModeAssets, opts: &TraceOptions) -> Result<Vec<TraceRequest>> {
    if !(opts.rate.is_finite() && opts.rate > 0.0) {
        return Err(ModesError::Invalid(format!(
            "the trace rate must be positive, got {}",
            opts.rate
        )));
    }
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let total: f64 = opts.mix.iter().map(|(_, w)| w).sum();
    let classes: Vec<TraceClass> = (0..opts.requests)
        .map(|_| {
            let mut x = rng.random_range(0.0..total);
            for &(c, w) in &opts.mix {
                if x < w {
                    return c;
                }
                x -= w;
            }
            opts.mix[opts.mix.len() - 1].0
        })
        .collect();
    let count = |c: TraceClass| classes.iter().filter(|&&x| x == c).count();
    let tok = &assets.tokenizer;
    let need = 512
        + 128 * (count(TraceClass::Chat) + count(TraceClass::LongGeneration))
        + 64 * count(TraceClass::SharedPrefix)
        + 1024 * count(TraceClass::LongPrompt);
    let stream = sharegpt_tokens(tok, need.max(1))?;
    let mut at = 0;
    let mut take = |n: usize| {
        let p = stream[at..at + n].to_vec();
        at += n;
        p
    };
    let prefix = take(512);
    let mut gsm = quality::load_gsm8k(count(TraceClass::Math), Pick::First)?.into_iter();
    let mut mmlu = quality::load_mc(
        McTask::Mmlu,
        count(TraceClass::MultipleChoice),
        Pick::Seeded(7),
    )?
    .into_iter();
    let gaps = Exp::new(opts.rate).map_err(|e| ModesError::Invalid(e.to_string()))?;
    let mut clock = 0.0;
    let mut seen = PrefixIndex::default();
    let mut out = Vec::with_capacity(classes.len());
    for class in classes {
        let (prompt, output, label) = match class {
            TraceClass::Chat => (take(128), 32, None),
            TraceClass::LongGeneration => (take(128), 128, None),
            TraceClass::SharedPrefix => {
                (prefix.iter().copied().chain(take(64)).collect(), 32, None)
            }
            TraceClass::LongPrompt => (take(1024), 32, None),
            TraceClass::Math => {
                let item = gsm
                    .next()
                    .ok_or_else(|| ModesError::Invalid("GSM8K ran out of items".into()))?;
                (tok.encode(&item.prompt, true, false)?, 128, Some("gsm8k"))
            }
            TraceClass::MultipleChoice => {
                let item = mmlu
                    .next()
                    .ok_or_else(|| ModesError::Invalid("MMLU ran out of items".into()))?;
                (tok.encode(&item.context, true, false)?, 1, Some("mmlu"))
            }
        };
        // As the server sees it: the block-aligned prefix an earlier arrival's prompt had.
        let shared = seen.observe_prompt(&prompt);
        out.push(TraceRequest {
            at_s: clock,
            class,
            prompt,
            output,
            label,
            shared_prefix: shared,
        });
        clock += gaps.sample(&mut rng);
    }
    Ok(out)
}

/// One router's replay of the trace.
#[derive(Debug, Clone, Serialize)]
pub struct TraceRow {
    pub router: String,
    pub kind: String,
    /// Which round of the replays (0-based).
    pub replay: usize,
    pub requests: usize,
    pub failed: usize,
    pub mean_latency_s: f64,
    pub p50_latency_s: f64,
    pub p99_latency_s: f64,
    pub mean_ttft_s: f64,
    /// Output tokens over the replay's wall time (first arrival to last completion).
    pub output_tokens_per_s: f64,
    pub duration_s: f64,
    /// Requests served in a mode that fails the gate or a constraint for their class.
    pub violations: usize,
    pub modes_chosen: BTreeMap<String, usize>,
    /// Each request's mode, in trace order (what two routers' replays are compared by).
    pub decisions: Vec<Mode>,
    /// Per trace class: (requests, mean, P50, P99 latency in seconds).
    pub by_class: BTreeMap<String, (usize, f64, f64, f64)>,
    /// Largest number of requests in flight at an arrival.
    pub max_in_flight: usize,
}

/// Replays `trace` with `router` choosing among `engines` (every mode's engine, loaded).
/// `oracle` judges each choice against the gate for the request's class. Every replay starts
/// from empty prefix caches: the same prompts replayed again would otherwise find their
/// prefixes cached by an earlier replay (or by whatever else those engines served), and the
/// later of two routers that use a prefix-cache mode would skip prefills the earlier one paid.
pub fn replay(
    trace: &[TraceRequest],
    label: &str,
    kind: &str,
    router: &dyn Router,
    engines: &BTreeMap<Mode, EngineHandle>,
    oracle: &Oracle,
) -> Result<TraceRow> {
    let mut available = ModeSet::empty();
    for (&m, engine) in engines {
        available.insert(m);
        engine.clear_prefix_cache().wait()?;
    }
    let in_flight = Arc::new(AtomicUsize::new(0));
    let mut max_in_flight = 0;
    let start = Instant::now();
    let mut waiters = Vec::with_capacity(trace.len());
    let mut violations = 0;
    let mut refused = 0;
    let mut chosen: BTreeMap<String, usize> = BTreeMap::new();
    let mut decisions = Vec::with_capacity(trace.len());
    for r in trace {
        let due = Duration::from_secs_f64(r.at_s);
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        let depth = in_flight.load(Ordering::SeqCst);
        max_in_flight = max_in_flight.max(depth);
        let features = r.features(depth);
        let d = router.route_among(&features, available);
        *chosen.entry(d.mode.to_string()).or_default() += 1;
        decisions.push(d.mode);
        if !oracle.admits_request(&features, d.mode) || d.fallback {
            violations += 1;
        }
        let engine = engines
            .get(&d.mode)
            .ok_or_else(|| ModesError::Invalid(format!("{} is not loaded", d.mode)))?;
        let stream = match engine.add_request(EngineRequest {
            prompt: r.prompt.clone(),
            params: SamplingParams {
                max_tokens: r.output,
                ignore_eos: true,
                ..SamplingParams::default()
            },
        }) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(mode = %d.mode, "trace request refused: {e}");
                refused += 1;
                continue;
            }
        };
        in_flight.fetch_add(1, Ordering::SeqCst);
        let counter = Arc::clone(&in_flight);
        waiters.push((
            r.class,
            std::thread::spawn(move || {
                let c = stream.wait();
                counter.fetch_sub(1, Ordering::SeqCst);
                c
            }),
        ));
    }
    let mut latencies = Vec::new();
    let mut ttfts = Vec::new();
    let mut per_class: BTreeMap<TraceClass, Vec<f64>> = BTreeMap::new();
    let mut tokens = 0;
    let mut failed = refused;
    let mut last = start;
    for (class, w) in waiters {
        match w.join() {
            Ok(Ok(c)) => {
                let l = (c.finished_at - c.arrival).as_secs_f64();
                latencies.push(l);
                if let Some(t) = c.first_token_at {
                    ttfts.push((t - c.arrival).as_secs_f64());
                }
                per_class.entry(class).or_default().push(l);
                tokens += c.token_ids.len();
                last = last.max(c.finished_at);
            }
            _ => failed += 1,
        }
    }
    let duration = (last - start).as_secs_f64();
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len().max(1) as f64;
    Ok(TraceRow {
        router: label.to_string(),
        kind: kind.to_string(),
        replay: 0,
        requests: trace.len(),
        failed,
        mean_latency_s: mean(&latencies),
        p50_latency_s: median(&latencies),
        p99_latency_s: percentile(&latencies, 99.0),
        mean_ttft_s: mean(&ttfts),
        output_tokens_per_s: tokens as f64 / duration.max(1e-9),
        duration_s: duration,
        violations,
        modes_chosen: chosen,
        decisions,
        by_class: per_class
            .into_iter()
            .map(|(c, ls)| {
                (
                    c.name().to_string(),
                    (ls.len(), mean(&ls), median(&ls), percentile(&ls, 99.0)),
                )
            })
            .collect(),
        max_in_flight,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixes_parse_and_refuse_bad_entries() {
        let m = TraceClass::parse_mix(DEFAULT_MIX).unwrap();
        assert_eq!(m.len(), 6);
        assert_eq!(m[0], (TraceClass::Chat, 0.3));
        assert_eq!(
            TraceClass::parse_mix("chat=1,poetry=2")
                .unwrap_err()
                .to_string(),
            "unknown trace class \"poetry\"; known: chat, long-generation, shared-prefix, long-prompt, math, multiple-choice"
        );
        assert!(TraceClass::parse_mix("chat=0").is_err());
        assert!(TraceClass::parse_mix("chat").is_err());
        assert!(TraceClass::parse_mix("chat=-1").is_err());
    }

    #[test]
    fn trace_options_refuse_zero_repeats_and_unknown_kinds() {
        let mut o = TraceOptions {
            requests: 10,
            rate: 1.0,
            mix: TraceClass::parse_mix(DEFAULT_MIX).unwrap(),
            seed: 1,
            fixed: Vec::new(),
            routers: vec!["fitted".into(), "oracle".into()],
            repeats: 3,
        };
        o.validate().unwrap();
        assert!(o.replays_kind("fixed") && o.replays_kind("oracle"));
        assert!(!o.replays_kind("learned") && !o.replays_kind("rules"));
        o.routers.push("tree".into());
        assert_eq!(
            o.validate().unwrap_err().to_string(),
            "unknown router kind \"tree\"; known: rules, fitted, learned, oracle (fixed modes: --trace-fixed)"
        );
        o.routers.clear();
        assert!(o.replays_kind("learned"));
        o.repeats = 0;
        assert!(o.validate().is_err());
    }
}
