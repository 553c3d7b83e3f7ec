//! `bench helios` on real models (SmolLM2-135M as the vanilla model and the EE-LLM baseline,
//! SmolLM2-135M and Qwen2.5-Coder-0.5B as HELIOS's candidates), 4 prompts of 16 tokens: the
//! report's sums equal the sums over its requests, shares are shares, bits per byte follow
//! from the log-probabilities, vanilla's tokens are the engine's greedy tokens for the same
//! prompts; HELIOS with shadow evaluation and no quality bound serves the fastest candidate
//! without scoring anything, and HELIOS with serial evaluation evaluated each candidate on
//! one request.

use std::sync::Arc;

use switchyard_engine::{EngineConfig, EngineHandle, EngineRequest};
use switchyard_eval::sharegpt::{Sample, SampledRequest};
use switchyard_helios::bench::{
    entry_without_telemetry, run_bench_helios, BenchCandidate, HeliosBenchContext,
    HeliosBenchOptions, SystemReport,
};
use switchyard_helios::manifest::Manifest;
use switchyard_helios::policy::{PolicyConfig, Slo};
use switchyard_models::{LayeredModel, LoadOptions};
use switchyard_request::SamplingParams;

const SMOL: &str = "smollm2-135m-instruct";
const QWEN: &str = "qwen2.5-coder-0.5b-instruct";
const TOKENS: usize = 16;
/// Qwen's weights and 2,048 K/V positions need about 540 MB: 1 GiB per candidate.
const BUDGET: u64 = 2 << 30;

const PROMPTS: [(&str, usize); 4] = [
    (
        "Explain why the sky appears blue at noon and red at sunset.",
        TOKENS,
    ),
    ("Write a short poem about the sea.", TOKENS),
    ("List three facts about octopuses.", 9),
    ("What is the capital of France?", TOKENS),
];

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// The arithmetic every system's report must satisfy.
fn check_sums(s: &SystemReport) {
    let name = &s.system;
    assert_eq!(s.requests, PROMPTS.len(), "{name}");
    let per: usize = s.per_request.iter().map(|r| r.output_tokens).sum();
    assert_eq!(s.output_tokens, per, "{name}: output tokens");
    for (r, (_, n)) in s.per_request.iter().zip(PROMPTS) {
        assert_eq!(r.output_tokens, n, "{name}: end of generation is ignored");
        assert_eq!(r.token_ids.len(), n, "{name}");
        assert_eq!(r.depths.len(), n, "{name}: one depth per token");
        let ttft = r.ttft_s.expect("a first token");
        assert!(
            ttft > 0.0 && ttft <= r.latency_s,
            "{name}: {ttft} {}",
            r.latency_s
        );
    }
    let counted: u64 = s.depth_counts.iter().map(|c| c.tokens).sum();
    assert_eq!(counted, s.output_tokens as u64, "{name}: depth histogram");
    let by_model: u64 = s.tokens_by_model.values().sum();
    assert_eq!(by_model, s.output_tokens as u64, "{name}: tokens by model");
    assert!(s
        .depth_counts
        .iter()
        .all(|c| c.depth >= 1 && c.depth <= c.layers));
    let full: u64 = s
        .depth_counts
        .iter()
        .filter(|c| c.depth == c.layers)
        .map(|c| c.tokens)
        .sum();
    assert_eq!(full, s.tokens_at_full_depth, "{name}");
    assert!(s.tokens_at_earliest_exit + s.tokens_at_full_depth <= s.output_tokens as u64);
    let n = s.output_tokens as f64;
    assert!(close(s.full_depth_share, full as f64 / n), "{name}");
    assert!(close(
        s.earliest_exit_share,
        s.tokens_at_earliest_exit as f64 / n
    ));
    for share in [
        s.full_depth_share,
        s.earliest_exit_share,
        s.mean_depth_fraction,
    ] {
        assert!((0.0..=1.0).contains(&share), "{name}: {share}");
    }
    assert!(s.earliest_exit_share + s.full_depth_share <= 1.0 + 1e-12);
    assert!(close(s.output_tokens_per_s, n / s.duration_s), "{name}");
    let latest = s
        .per_request
        .iter()
        .map(|r| r.latency_s)
        .fold(0.0, f64::max);
    assert!(close(s.duration_s, latest));
    assert!(s.ttft_s.p50 <= s.ttft_s.p99 + 1e-12 && s.tpot_s.p50 <= s.tpot_s.p99 + 1e-12);
    let bytes: usize = s.per_request.iter().map(|r| r.output_bytes).sum();
    let nats: f64 = s.per_request.iter().map(|r| r.output_nats).sum();
    assert_eq!(s.output_bytes, bytes as u64);
    assert!(
        bytes > 0 && nats >= 0.0,
        "{name}: {bytes} bytes, {nats} nats"
    );
    assert!(close(
        s.bits_per_byte,
        nats / std::f64::consts::LN_2 / bytes as f64
    ));
    assert!(
        s.largest_batch >= 1 && s.largest_batch <= PROMPTS.len(),
        "{name}"
    );
    assert!(s.peak_weights_bytes > 0 && s.peak_weights_bytes <= s.peak_resident_bytes);
    assert!(s.peak_resident_bytes <= BUDGET, "{name}");
}

#[test]
fn bench_helios_report_adds_up_on_real_models() {
    let entries = vec![
        entry_without_telemetry(SMOL).expect("smollm2"),
        entry_without_telemetry(QWEN).expect("qwen"),
    ];
    let repo = Manifest::new(entries, "test").expect("manifest");
    let candidates: Vec<BenchCandidate> = repo
        .models()
        .iter()
        .map(|m| BenchCandidate::open(m).expect("open").expect("local"))
        .collect();
    let smol = &candidates[0];
    let requests = PROMPTS
        .iter()
        .map(|(p, n)| SampledRequest {
            prompt: p.to_string(),
            prompt_tokens: smol.tokenizer.encode(p, true, false).expect("encode"),
            output_len: *n,
            answer: String::new(),
        })
        .collect::<Vec<_>>();
    let sample = Sample {
        requests: requests.clone(),
        records: PROMPTS.len(),
        truncated: false,
        examined: PROMPTS.len(),
    };
    let opts = HeliosBenchOptions {
        memory_budget: BUDGET,
        engine: EngineConfig::default(),
        policy: PolicyConfig {
            eval_requests: 1,
            ..PolicyConfig::default()
        },
        slo: Slo::default(),
        vanilla: Some(SMOL.into()),
        baseline_prompts: None,
        max_tokens: Some(TOKENS),
        ablation: false,
        serial: true,
        repeats: 2,
    };
    let ctx = HeliosBenchContext {
        repo: &repo,
        candidates: &candidates,
        dataset: "test prompts",
        sample: &sample,
        threads: 0,
    };
    let mut phases = Vec::new();
    let r = run_bench_helios(&ctx, &opts, |p| phases.push(p.to_string())).expect("bench");
    assert_eq!(phases.len(), 5, "{phases:?}");
    assert_eq!(phases[4], "repeat 2 of 2", "{phases:?}");
    for s in [&r.vanilla, &r.ee_llm, &r.helios] {
        check_sums(s);
    }

    // Vanilla: full depth only, the engine's greedy tokens.
    let v = &r.vanilla;
    assert_eq!(r.vanilla_model, SMOL);
    assert_eq!((v.full_depth_share, v.earliest_exit_share), (1.0, 0.0));
    assert_eq!(v.bits_per_byte_vs_full, 0.0);
    let reference = EngineHandle::start(
        LayeredModel::load(Arc::clone(&smol.source), &LoadOptions::default()).expect("load"),
        Arc::clone(&smol.tokenizer),
        EngineConfig {
            memory_budget: BUDGET,
            ..EngineConfig::default()
        },
        SMOL,
    )
    .expect("reference engine");
    for (rec, req) in v.per_request.iter().zip(&requests) {
        let direct = reference
            .add_request(EngineRequest {
                prompt: req.prompt_tokens.clone(),
                params: SamplingParams {
                    ignore_eos: true,
                    ..SamplingParams::greedy(req.output_len)
                },
            })
            .expect("add")
            .wait()
            .expect("direct");
        assert_eq!(rec.token_ids, direct.token_ids, "{:?}", req.prompt);
        assert_eq!(rec.prompt_tokens, req.prompt_tokens.len());
    }
    let _ = reference.shutdown().wait();
    assert_eq!(v.tokens_equal_to_vanilla, Some(v.output_tokens as u64));

    // EE-LLM: batch 1, every layer, depths among its exits and full depth.
    let e = &r.ee_llm;
    assert_eq!(e.largest_batch, 1);
    let smol_entry = &candidates[0].entry;
    assert!(e
        .depth_counts
        .iter()
        .all(|c| c.depth == smol_entry.layers || smol_entry.exit_layers.contains(&c.depth)));
    let equal = e.tokens_equal_to_vanilla.expect("same model as vanilla");
    assert!(equal <= e.output_tokens as u64);
    assert!(close(
        e.bits_per_byte_vs_full,
        e.bits_per_byte - v.bits_per_byte
    ));

    // HELIOS shadow, no quality bound: the fastest candidate by telemetry serves everything
    // at full depth, and nothing is scored (no score could change that choice).
    let h = &r.helios;
    assert_eq!(h.system, "HELIOS shadow");
    let d = h.decisions.as_ref().expect("HELIOS decisions");
    assert_eq!(
        (d.evaluation_requests, d.shadow_rounds, d.switches),
        (0, 0, 0)
    );
    assert_eq!(h.tokens_by_model.len(), 1, "{:?}", h.tokens_by_model);
    assert!(h.per_request.iter().all(|q| q.model == SMOL));
    assert_eq!(h.full_depth_share, 1.0);
    assert!(close(
        h.bits_per_byte_vs_full,
        h.bits_per_byte - v.bits_per_byte
    ));
    assert!(close(
        r.helios_vs_ee_llm_throughput,
        h.output_tokens_per_s / e.output_tokens_per_s
    ));
    assert!(r.shadow_rounds.is_empty());

    // HELIOS serial: one evaluation request per candidate, both candidates served tokens.
    let h = r.helios_serial.as_ref().expect("the serial run");
    check_sums(h);
    assert_eq!(h.system, "HELIOS serial");
    let d = h.decisions.as_ref().expect("HELIOS decisions");
    assert_eq!(d.evaluation_requests, 2);
    assert!(d.profiles >= 1 && d.profile_seconds >= 0.0);
    assert_eq!(h.tokens_by_model.len(), 2, "{:?}", h.tokens_by_model);
    assert!(h
        .per_request
        .iter()
        .all(|q| q.model == SMOL || q.model == QWEN));
    assert_eq!(r.pht.rows().len(), 2);

    // Repeats: the first pair is the table's, the second ran HELIOS first; the median of two
    // ratios is their mean.
    assert_eq!(r.pairs.len(), 2);
    assert_eq!(
        (r.pairs[0].first.as_str(), r.pairs[1].first.as_str()),
        ("vanilla", "HELIOS")
    );
    assert!(close(
        r.pairs[0].helios_output_tokens_per_s,
        r.helios.output_tokens_per_s
    ));
    let (a, b) = (
        r.pairs[0].helios_vs_vanilla_throughput,
        r.pairs[1].helios_vs_vanilla_throughput,
    );
    assert!(close(r.helios_vs_vanilla_throughput_median, (a + b) / 2.0));

    let md = r.markdown();
    assert!(md.contains("median of the pairs"), "{md}");
    for row in [
        "| vanilla | 4 |",
        "| EE-LLM | 4 |",
        "| HELIOS shadow | 4 |",
        "| HELIOS serial | 4 |",
    ] {
        assert!(md.contains(row), "{md}");
    }
}
