//! Prometheus metrics: request counts by status, latency histograms, token counters, and the
//! engines' queue, memory and prefix-cache state (refreshed at each scrape).

use prometheus::{
    CounterVec, Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};
use switchyard_engine::EngineStats;

/// Latency buckets in seconds, from 5 ms to 2 minutes (vLLM's TTFT buckets, extended).
const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 120.0,
];
/// Per-token latency buckets in seconds.
const TOKEN_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5,
];

#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub ttft: HistogramVec,
    pub tpot: HistogramVec,
    pub e2e: HistogramVec,
    pub prompt_tokens: IntCounterVec,
    pub generation_tokens: IntCounterVec,
    pub aborted: IntCounterVec,
    in_flight: GaugeVec,
    in_flight_max: GaugeVec,
    /// 1 while every engine thread of a local model serves, 0 once one stopped or failed.
    pub engine_up: GaugeVec,
    running: GaugeVec,
    waiting: GaugeVec,
    memory: GaugeVec,
    kv_blocks: GaugeVec,
    prefix_hit_rate: GaugeVec,
    prefix_tokens: CounterVec,
    constrained_tokens: CounterVec,
    constrained_seconds: CounterVec,
    depth: GaugeVec,
    preemptions: GaugeVec,
    helios_decisions: GaugeVec,
    helios_seconds: GaugeVec,
    /// ModeSwitch routing decisions by chosen mode, rule and whether it fell back.
    pub route_decisions: IntCounterVec,
    /// Time spent deciding (the router alone), summed.
    pub route_seconds: CounterVec,
    /// Open client connections.
    pub connections_open: IntGauge,
    /// Connections the server closed itself, by reason (`limit`: refused at the connection
    /// limit; `header_timeout`: no whole request head in time).
    pub connections_closed: IntCounterVec,
}

fn must<T>(r: prometheus::Result<T>) -> T {
    // Metric definitions are static: a failure here is a programming error caught by tests.
    r.unwrap_or_else(|e| panic!("invalid metric definition: {e}"))
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let hist = |name: &str, help: &str, buckets: &[f64]| {
            let h = must(HistogramVec::new(
                HistogramOpts::new(name, help).buckets(buckets.to_vec()),
                &["model"],
            ));
            must(registry.register(Box::new(h.clone())));
            h
        };
        let icounter = |name: &str, help: &str, labels: &[&str]| {
            let c = must(IntCounterVec::new(Opts::new(name, help), labels));
            must(registry.register(Box::new(c.clone())));
            c
        };
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = must(GaugeVec::new(Opts::new(name, help), labels));
            must(registry.register(Box::new(g.clone())));
            g
        };
        let prefix_tokens = must(CounterVec::new(
            Opts::new(
                "switchyard_prefix_cache_tokens_total",
                "Prompt tokens looked up in / served from the prefix cache",
            ),
            &["model", "kind"],
        ));
        must(registry.register(Box::new(prefix_tokens.clone())));
        let constrained_tokens = must(CounterVec::new(
            Opts::new(
                "switchyard_constrained_tokens_total",
                "Structured-output tokens sampled, by whether the constraint's full mask was \
                 computed (`masked`) or the drawn token was checked alone (`checked`)",
            ),
            &["model", "kind"],
        ));
        must(registry.register(Box::new(constrained_tokens.clone())));
        let constrained_seconds = must(CounterVec::new(
            Opts::new(
                "switchyard_constrained_seconds_total",
                "Seconds spent on structured-output constraints beyond an unconstrained row's \
                 draw (`constraint`: masks, token checks, parser advances), and the wall time \
                 of the engine steps that sampled a constrained row (`step`); their ratio is \
                 the share of those steps that constraints cost",
            ),
            &["model", "kind"],
        ));
        must(registry.register(Box::new(constrained_seconds.clone())));
        let route_seconds = must(CounterVec::new(
            Opts::new(
                "switchyard_route_decision_seconds_total",
                "Time the ModeSwitch router spent deciding, summed over requests",
            ),
            &["model"],
        ));
        must(registry.register(Box::new(route_seconds.clone())));
        let connections_open = must(IntGauge::new(
            "switchyard_connections_open",
            "Open client connections",
        ));
        must(registry.register(Box::new(connections_open.clone())));
        Self {
            connections_open,
            connections_closed: icounter(
                "switchyard_connections_closed_total",
                "Connections the server closed itself, by reason (limit, header_timeout)",
                &["reason"],
            ),
            route_decisions: icounter(
                "switchyard_route_decisions_total",
                "ModeSwitch routing decisions by mode, rule and fallback",
                &["model", "mode", "rule", "fallback"],
            ),
            route_seconds,
            requests: icounter(
                "switchyard_requests_total",
                "HTTP requests by route and status code",
                &["model", "route", "status"],
            ),
            ttft: hist(
                "switchyard_time_to_first_token_seconds",
                "Time from request arrival to its first token",
                LATENCY_BUCKETS,
            ),
            tpot: hist(
                "switchyard_time_per_output_token_seconds",
                "Mean time per output token after the first, per request",
                TOKEN_BUCKETS,
            ),
            e2e: hist(
                "switchyard_e2e_request_latency_seconds",
                "Time from request arrival to its last token",
                LATENCY_BUCKETS,
            ),
            prompt_tokens: icounter(
                "switchyard_prompt_tokens_total",
                "Prompt tokens processed",
                &["model"],
            ),
            generation_tokens: icounter(
                "switchyard_generation_tokens_total",
                "Tokens generated",
                &["model"],
            ),
            aborted: icounter(
                "switchyard_aborted_requests_total",
                "Requests ended before completion, by reason",
                &["model", "reason"],
            ),
            in_flight: gauge(
                "switchyard_requests_in_flight",
                "Requests admitted by the HTTP layer and not yet finished",
                &["model"],
            ),
            in_flight_max: gauge(
                "switchyard_requests_in_flight_max",
                "Most requests admitted at once since the server started (at most max_in_flight)",
                &["model"],
            ),
            engine_up: gauge(
                "switchyard_engine_up",
                "1 while every engine thread of the model serves, 0 once one stopped or failed (a panic)",
                &["model"],
            ),
            running: gauge(
                "switchyard_num_requests_running",
                "Sequences in the engine's running batch",
                &["model"],
            ),
            waiting: gauge(
                "switchyard_num_requests_waiting",
                "Sequences queued in the engine",
                &["model"],
            ),
            memory: gauge(
                "switchyard_memory_bytes",
                "Memory-budget accounting by category",
                &["model", "category"],
            ),
            kv_blocks: gauge(
                "switchyard_kv_blocks",
                "KV-cache blocks by state",
                &["model", "state"],
            ),
            prefix_hit_rate: gauge(
                "switchyard_prefix_cache_hit_rate",
                "Share of looked-up prompt tokens served from the prefix cache",
                &["model"],
            ),
            prefix_tokens,
            constrained_tokens,
            constrained_seconds,
            depth: gauge(
                "switchyard_depth_layers",
                "Layers every token runs through (fixed-depth exit)",
                &["model"],
            ),
            preemptions: gauge(
                "switchyard_preemptions",
                "Sequences preempted (and recomputed later) since start",
                &["model"],
            ),
            helios_decisions: gauge(
                "switchyard_helios_decisions",
                "HELIOS decisions since start, by kind (profile, reprofile, extend, switch, cbc_fired, switch_drained)",
                &["model", "kind"],
            ),
            helios_seconds: gauge(
                "switchyard_helios_decision_seconds",
                "Seconds HELIOS decisions cost since start, by kind (profile, extend, switch)",
                &["model", "kind"],
            ),
            registry,
        }
    }

    /// Copies the HELIOS orchestrator's decision counters into the gauges.
    pub fn observe_helios(&self, model: &str, c: &switchyard_helios::orchestrator::Counters) {
        for (kind, v) in [
            ("profile", c.profiles),
            ("reprofile", c.reprofiles),
            ("drift_reprofile", c.drift_reprofiles),
            ("extend", c.extends),
            ("switch", c.switches),
            ("cbc_fired", c.cbc_fired),
            ("switch_drained", c.switch_drained),
            ("switch_moved", c.switch_moved),
            ("shadow_round", c.shadow_rounds),
            ("shadow_error", c.shadow_errors),
            ("shadow_change_point", c.shadow_change_points),
            ("shadow_urgent_switch", c.shadow_urgent_switches),
            ("held_request", c.held_requests),
            ("hold_timeout", c.hold_timeouts),
        ] {
            self.helios_decisions
                .with_label_values(&[model, kind])
                .set(v as f64);
        }
        for (kind, v) in [
            ("profile", c.profile_seconds),
            ("extend", c.extend_seconds),
            ("switch", c.switch_seconds),
            ("shadow_scoring", c.shadow_busy_seconds),
            ("hold", c.hold_seconds),
        ] {
            self.helios_seconds.with_label_values(&[model, kind]).set(v);
        }
    }

    /// The requests a model's backend holds now and the most it has held at once.
    pub fn observe_places(&self, model: &str, now: usize, peak: usize) {
        self.in_flight.with_label_values(&[model]).set(now as f64);
        self.in_flight_max
            .with_label_values(&[model])
            .set(peak as f64);
    }

    /// Copies an engine's state into the gauges.
    pub fn observe_engine(&self, model: &str, s: &EngineStats) {
        self.running
            .with_label_values(&[model])
            .set(s.running as f64);
        self.waiting
            .with_label_values(&[model])
            .set(s.waiting as f64);
        let m = &s.memory;
        for (cat, v) in [
            ("budget", m.budget_bytes),
            ("weights", m.weights_bytes),
            ("kv_used", m.kv_used_bytes),
            ("kv_free", m.kv_free_bytes),
            ("workspace", m.workspace_bytes),
        ] {
            self.memory.with_label_values(&[model, cat]).set(v as f64);
        }
        for (state, v) in [
            ("used", s.kv_blocks_used),
            ("free", s.kv_blocks_free),
            ("prefix_cached", s.prefix_cached_blocks),
        ] {
            self.kv_blocks
                .with_label_values(&[model, state])
                .set(v as f64);
        }
        self.prefix_hit_rate
            .with_label_values(&[model])
            .set(s.prefix_cache_hit_rate);
        for (kind, v) in [
            ("hit", s.prefix_cache_hit_tokens),
            ("queried", s.prefix_cache_queried_tokens),
        ] {
            raise_to(
                &self.prefix_tokens.with_label_values(&[model, kind]),
                v as f64,
            );
        }
        let k = &s.constrained;
        for (kind, v) in [
            ("masked", k.masked),
            ("checked", k.tokens.saturating_sub(k.masked)),
        ] {
            raise_to(
                &self.constrained_tokens.with_label_values(&[model, kind]),
                v as f64,
            );
        }
        for (kind, v) in [("constraint", k.seconds), ("step", k.step_seconds)] {
            raise_to(
                &self.constrained_seconds.with_label_values(&[model, kind]),
                v,
            );
        }
        self.depth.with_label_values(&[model]).set(s.depth as f64);
        self.preemptions
            .with_label_values(&[model])
            .set(s.counters.preemptions as f64);
    }

    /// The Prometheus text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::error!("encoding metrics failed: {e}");
        }
        String::from_utf8_lossy(&buf).into_owned()
    }
}

/// Moves a counter up to an engine's running total (engines count; the counter follows).
fn raise_to(counter: &prometheus::Counter, total: f64) {
    let delta = total - counter.get();
    if delta > 0.0 {
        counter.inc_by(delta);
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
