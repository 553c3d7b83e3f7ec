//! The three systems over the trace (vanilla, the EE-LLM baseline, the orchestrator), each
//! run timed from its first submission, and a run's requests summed into its report.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use switchyard_engine::{
    Completion, EngineConfig, EngineHandle, EngineRequest, EngineStats, RequestStream,
};
use switchyard_eval::stats::Percentiles;
use switchyard_exit_study::baseline::{generate_early_exit, EeContext};
use switchyard_exit_study::{ExitPolicy, KvFix};
use switchyard_exits::ConfidenceMeasure;

use super::{
    greedy, secs, BenchCandidate, Decisions, DepthCount, HeliosBenchContext, HeliosBenchOptions,
    Job, RequestRecord, SystemReport, POLL, STATS_EVERY, WARM_UP,
};
use crate::orchestrator::{
    CandidateEngine, HeliosOutput, HeliosPrompt, HeliosRequest, HeliosStream, Orchestrator,
    ShadowRound,
};
use crate::pht::Pht;
use crate::policy::{Evaluation, Policy, PolicyConfig};
use crate::{HeliosError, Result};

/// Peaks of the memory stats over a run.
#[derive(Debug, Clone, Copy, Default)]
struct MemoryPeaks {
    resident: u64,
    weights: u64,
    kv_used: u64,
}

impl MemoryPeaks {
    /// Records one sample: the stats of every engine at about the same time.
    fn sample(&mut self, stats: &[EngineStats]) {
        let sum = |f: fn(&EngineStats) -> u64| stats.iter().map(f).sum::<u64>();
        self.resident = self.resident.max(sum(|s| {
            s.memory.weights_bytes + s.memory.kv_used_bytes + s.memory.workspace_bytes
        }));
        self.weights = self.weights.max(sum(|s| s.memory.weights_bytes));
        self.kv_used = self.kv_used.max(sum(|s| s.memory.kv_used_bytes));
    }
}

fn sample_stats(engines: &[EngineHandle], peaks: &mut MemoryPeaks) -> Result<()> {
    let stats = engines
        .iter()
        .map(|h| Ok(h.stats().wait()?))
        .collect::<Result<Vec<_>>>()?;
    peaks.sample(&stats);
    Ok(())
}

fn warm_up(h: &EngineHandle, job: &Job) -> Result<()> {
    h.add_request(EngineRequest {
        prompt: job.prompt.iter().copied().take(WARM_UP.0).collect(),
        params: greedy(WARM_UP.1),
    })?
    .wait()?;
    Ok(())
}

/// A finished request; TTFT and latency count from its arrival `arrival_s` after `t0`.
fn record(
    model: &str,
    c: &Completion,
    depths: Vec<usize>,
    t0: Instant,
    arrival_s: f64,
) -> RequestRecord {
    let since = |t: Instant| secs(t.saturating_duration_since(t0));
    RequestRecord {
        model: model.to_string(),
        prompt_tokens: c.prompt_tokens,
        output_tokens: c.token_ids.len(),
        token_ids: c.token_ids.clone(),
        depths,
        output_bytes: c.text.len(),
        output_nats: -c.logprobs.iter().map(|&l| f64::from(l)).sum::<f64>(),
        ttft_s: c.first_token_at.map(|t| (since(t) - arrival_s).max(0.0)),
        tpot_s: c.tpot().map(secs),
        latency_s: (since(c.finished_at) - arrival_s).max(0.0),
        arrival_s,
        finished_s: since(c.finished_at),
    }
}

/// The best single model at full depth with continuous batching and the whole budget.
pub(super) fn run_vanilla(
    c: &BenchCandidate,
    jobs: &[Job],
    opts: &HeliosBenchOptions,
) -> Result<SystemReport> {
    let cfg = EngineConfig {
        memory_budget: opts.memory_budget,
        ..opts.engine.clone()
    };
    let h = EngineHandle::start(c.load()?, Arc::clone(&c.tokenizer), cfg, &c.entry.name)?;
    warm_up(&h, &jobs[0])?;
    let engines = [h.clone()];
    let mut peaks = MemoryPeaks::default();
    let t0 = Instant::now();
    let mut streams: Vec<Option<RequestStream>> = jobs.iter().map(|_| None).collect();
    let mut outputs = vec![Vec::new(); streams.len()];
    let mut done = vec![false; streams.len()];
    let mut n_done = 0;
    let mut last_stats = Instant::now();
    sample_stats(&engines, &mut peaks)?;
    while n_done < streams.len() {
        let mut any = false;
        for (j, slot) in jobs.iter().zip(streams.iter_mut()) {
            if slot.is_none() && secs(t0.elapsed()) >= j.arrival_s {
                *slot = Some(h.add_request(EngineRequest {
                    prompt: j.prompt.clone(),
                    params: greedy(j.output_len),
                })?);
                any = true;
            }
        }
        for (i, s) in streams.iter_mut().enumerate() {
            let Some(s) = s.as_mut() else { continue };
            while !done[i] {
                let Some(o) = s.try_next() else { break };
                let o = o?;
                any = true;
                done[i] = o.finish_reason.is_some();
                n_done += usize::from(done[i]);
                outputs[i].push(o);
            }
        }
        if last_stats.elapsed() >= STATS_EVERY {
            sample_stats(&engines, &mut peaks)?;
            last_stats = Instant::now();
        }
        if !any {
            std::thread::sleep(POLL);
        }
    }
    let end = h.stats().wait()?;
    h.shutdown().wait()?;
    let layers = c.entry.layers;
    let per_request = outputs
        .into_iter()
        .zip(jobs)
        .map(|(o, j)| {
            let c2 = Completion::gather(o)
                .ok_or_else(|| HeliosError::Orchestrator("a stream ended early".into()))?;
            Ok(record(
                &c.entry.name,
                &c2,
                vec![layers; c2.token_ids.len()],
                t0,
                j.arrival_s,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let earliest = c.entry.exit_layers.first().copied().unwrap_or(layers);
    Ok(system_report(
        "vanilla",
        per_request,
        &|_| (earliest, layers),
        Resources {
            largest_batch: end.counters.largest_batch,
            peaks,
            budget: opts.memory_budget,
            decisions: None,
        },
    ))
}

/// Per-token early exit on every layer of the model, one request after the other.
pub(super) fn run_ee_llm(
    c: &BenchCandidate,
    jobs: &[Job],
    opts: &HeliosBenchOptions,
) -> Result<SystemReport> {
    let model = c.load()?;
    let heads = c.heads(&model)?;
    let policy = ExitPolicy {
        threshold: opts.policy.threshold,
        measure: ConfidenceMeasure::MaxProb,
        depths: heads.depths(),
        probe: false,
    };
    let ee = EeContext {
        model: &model,
        heads: &heads,
        policy: &policy,
        fix: KvFix::Recompute,
    };
    let tok = &c.tokenizer;
    let warm: Vec<u32> = jobs[0].prompt.iter().copied().take(WARM_UP.0).collect();
    generate_early_exit(&ee, tok, &warm, &greedy(WARM_UP.1), |_| {})?;
    let layers = model.n_layers();
    let kv_row_bytes = (2 * model.spec().kv_row_len() * 4 * layers) as u64;
    let weights = model.resident_bytes().total() as u64;
    let mut longest = 0usize;
    let t0 = Instant::now();
    let mut per_request = Vec::with_capacity(jobs.len());
    for j in jobs {
        let start = Instant::now();
        let g = generate_early_exit(&ee, tok, &j.prompt, &greedy(j.output_len), |_| {})?;
        let end = Instant::now();
        longest = longest.max(j.prompt.len() + g.tokens.len());
        let ttft = secs(start.saturating_duration_since(t0)) + g.prompt_secs;
        per_request.push(RequestRecord {
            model: c.entry.name.clone(),
            prompt_tokens: g.prompt_tokens,
            output_tokens: g.tokens.len(),
            output_bytes: g.text.len(),
            output_nats: -g.logprobs.iter().map(|&l| f64::from(l)).sum::<f64>(),
            ttft_s: (!g.tokens.is_empty()).then_some(ttft),
            tpot_s: (g.tokens.len() > 1).then(|| g.decode_secs / (g.tokens.len() - 1) as f64),
            latency_s: secs(end.saturating_duration_since(t0)),
            arrival_s: 0.0,
            finished_s: secs(end.saturating_duration_since(t0)),
            token_ids: g.tokens,
            depths: g.depths,
        });
    }
    let kv = kv_row_bytes * longest as u64;
    let peaks = MemoryPeaks {
        resident: weights + kv,
        weights,
        kv_used: kv,
    };
    let earliest = heads.depths().first().copied().unwrap_or(layers);
    Ok(system_report(
        "EE-LLM",
        per_request,
        &|_| (earliest, layers),
        Resources {
            largest_batch: 1,
            peaks,
            budget: opts.memory_budget,
            decisions: None,
        },
    ))
}

/// The orchestrator over every opened candidate, each engine in an equal share of the budget.
pub(super) fn run_helios(
    ctx: &HeliosBenchContext<'_>,
    jobs: &[Job],
    opts: &HeliosBenchOptions,
    policy: &PolicyConfig,
) -> Result<(SystemReport, Pht, Vec<ShadowRound>)> {
    let share = opts.memory_budget / ctx.candidates.len().max(1) as u64;
    let cfg = EngineConfig {
        memory_budget: share,
        ..opts.engine.clone()
    };
    let mut engines = Vec::with_capacity(ctx.candidates.len());
    for c in ctx.candidates {
        let h = c.engine(&cfg)?;
        let warm: Vec<u32> = c
            .tokenizer
            .encode(&jobs[0].text, true, false)?
            .into_iter()
            .take(WARM_UP.0)
            .collect();
        h.add_request(EngineRequest {
            prompt: warm,
            params: greedy(WARM_UP.1),
        })?
        .wait()?;
        engines.push(CandidateEngine {
            name: c.entry.name.clone(),
            handle: h,
        });
    }
    let handles: Vec<EngineHandle> = engines.iter().map(|e| e.handle.clone()).collect();
    let scorers = match policy.evaluation {
        Evaluation::Shadow => ctx
            .candidates
            .iter()
            .map(BenchCandidate::scorer)
            .collect::<Result<Vec<_>>>()?,
        Evaluation::Serial => Vec::new(),
    };
    let system = match policy.evaluation {
        Evaluation::Shadow => "HELIOS shadow",
        Evaluation::Serial => "HELIOS serial",
    };
    let policy = Policy::new(policy.clone(), opts.slo.clone(), share)?;
    let o = Orchestrator::start_with_scorers(ctx.repo.clone(), policy, engines, scorers)?;
    let result = drive_helios(&o, &handles, jobs);
    let stats = o.stats_blocking();
    o.shutdown_blocking();
    let rounds = stats
        .as_ref()
        .map(|s| s.shadow_rounds.clone())
        .unwrap_or_default();
    let ends = handles
        .iter()
        .map(|h| Ok(h.stats().wait()?))
        .collect::<Result<Vec<_>>>();
    for h in &handles {
        let _ = h.shutdown().wait();
    }
    let (per_request, mut peaks) = result?;
    let stats = stats?;
    // The scorers live beside the engines: their peak counts on top of the engines' (an
    // upper bound, since the two peaks need not coincide).
    peaks.resident += stats.counters.shadow_peak_bytes;
    let ends = ends?;
    // The warm-up's batch of one is below any run's largest batch, so it does not count.
    let largest_batch = ends
        .iter()
        .map(|e| e.counters.largest_batch)
        .max()
        .unwrap_or(0);
    let depths = |m: &str| {
        ctx.repo.get(m).map_or((usize::MAX, usize::MAX), |e| {
            (e.exit_layers.first().copied().unwrap_or(e.layers), e.layers)
        })
    };
    let report = system_report(
        system,
        per_request,
        &depths,
        Resources {
            largest_batch,
            peaks,
            budget: opts.memory_budget,
            decisions: Some(Decisions::from(&stats.counters)),
        },
    );
    Ok((report, stats.pht, rounds))
}

/// Submits every job at once and reads every stream to its end.
fn drive_helios(
    o: &Orchestrator,
    engines: &[EngineHandle],
    jobs: &[Job],
) -> Result<(Vec<RequestRecord>, MemoryPeaks)> {
    let mut peaks = MemoryPeaks::default();
    let t0 = Instant::now();
    let mut streams: Vec<Option<HeliosStream>> = jobs.iter().map(|_| None).collect();
    let mut outputs: Vec<Vec<HeliosOutput>> = vec![Vec::new(); streams.len()];
    let mut done = vec![false; streams.len()];
    let mut n_done = 0;
    let mut last_stats = Instant::now();
    sample_stats(engines, &mut peaks)?;
    while n_done < streams.len() {
        let mut any = false;
        for (j, slot) in jobs.iter().zip(streams.iter_mut()) {
            if slot.is_none() && secs(t0.elapsed()) >= j.arrival_s {
                *slot = Some(o.submit(HeliosRequest {
                    prompt: HeliosPrompt::Text(j.text.clone()),
                    params: greedy(j.output_len),
                    reference: j.reference.clone(),
                })?);
                any = true;
            }
        }
        for (i, s) in streams.iter_mut().enumerate() {
            let Some(s) = s.as_mut() else { continue };
            while !done[i] {
                let Some(out) = s.try_next() else { break };
                let out = out?;
                any = true;
                done[i] = out.output.finish_reason.is_some();
                n_done += usize::from(done[i]);
                outputs[i].push(out);
            }
        }
        if last_stats.elapsed() >= STATS_EVERY {
            sample_stats(engines, &mut peaks)?;
            last_stats = Instant::now();
        }
        if !any {
            std::thread::sleep(POLL);
        }
    }
    let records = outputs
        .into_iter()
        .zip(jobs)
        .map(|(outs, j)| {
            let model = outs
                .first()
                .map(|o| o.model.to_string())
                .unwrap_or_default();
            let depths: Vec<usize> = outs
                .iter()
                .flat_map(|o| std::iter::repeat_n(o.output.depth, o.output.token_ids.len()))
                .collect();
            let c = Completion::gather(outs.into_iter().map(|o| o.output))
                .ok_or_else(|| HeliosError::Orchestrator("a stream ended early".into()))?;
            Ok(record(&model, &c, depths, t0, j.arrival_s))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((records, peaks))
}

/// What a system held and decided over its run.
struct Resources {
    largest_batch: usize,
    peaks: MemoryPeaks,
    budget: u64,
    decisions: Option<Decisions>,
}

/// Sums a system's requests into its report. `depths(model)`: the serving model's earliest
/// exit layer and its layer count.
fn system_report(
    system: &str,
    per_request: Vec<RequestRecord>,
    depths: &dyn Fn(&str) -> (usize, usize),
    res: Resources,
) -> SystemReport {
    let layers = |m: &str| depths(m).1;
    let output_tokens: usize = per_request.iter().map(|r| r.output_tokens).sum();
    let prompt_tokens: usize = per_request.iter().map(|r| r.prompt_tokens).sum();
    let duration = per_request.iter().map(|r| r.finished_s).fold(0.0, f64::max);
    let mut counts: BTreeMap<(String, usize), u64> = BTreeMap::new();
    let mut by_model: BTreeMap<String, u64> = BTreeMap::new();
    let (mut at_earliest, mut at_full, mut depth_frac) = (0u64, 0u64, 0f64);
    for r in &per_request {
        let (e, n) = depths(&r.model);
        for &d in &r.depths {
            *counts.entry((r.model.clone(), d)).or_default() += 1;
            at_earliest += u64::from(d == e);
            at_full += u64::from(d == n);
            depth_frac += d as f64 / n.max(1) as f64;
        }
        *by_model.entry(r.model.clone()).or_default() += r.output_tokens as u64;
    }
    let share = |x: u64| x as f64 / output_tokens.max(1) as f64;
    let output_bytes: u64 = per_request.iter().map(|r| r.output_bytes as u64).sum();
    let output_nats: f64 = per_request.iter().map(|r| r.output_nats).sum();
    let col = |f: fn(&RequestRecord) -> Option<f64>| -> Vec<f64> {
        per_request.iter().filter_map(f).collect()
    };
    SystemReport {
        system: system.to_string(),
        requests: per_request.len(),
        prompt_tokens,
        output_tokens,
        duration_s: duration,
        output_tokens_per_s: output_tokens as f64 / duration,
        ttft_s: Percentiles::of(&col(|r| r.ttft_s)),
        tpot_s: Percentiles::of(&col(|r| r.tpot_s)),
        latency_s: Percentiles::of(&col(|r| Some(r.latency_s))),
        tokens_at_earliest_exit: at_earliest,
        tokens_at_full_depth: at_full,
        earliest_exit_share: share(at_earliest),
        full_depth_share: share(at_full),
        mean_depth_fraction: depth_frac / output_tokens.max(1) as f64,
        depth_counts: counts
            .into_iter()
            .map(|((model, depth), tokens)| DepthCount {
                layers: layers(&model),
                model,
                depth,
                tokens,
            })
            .collect(),
        tokens_by_model: by_model,
        largest_batch: res.largest_batch,
        peak_resident_bytes: res.peaks.resident,
        peak_weights_bytes: res.peaks.weights,
        peak_kv_used_bytes: res.peaks.kv_used,
        memory_budget_bytes: res.budget,
        output_bytes,
        output_nats,
        bits_per_byte: if output_bytes == 0 {
            0.0
        } else {
            output_nats / std::f64::consts::LN_2 / output_bytes as f64
        },
        bits_per_byte_vs_full: 0.0,
        tokens_equal_to_vanilla: None,
        decisions: res.decisions,
        per_request,
    }
}
