//! ModeSwitch over HTTP on SmolLM2-135M: the rule router picks each request's mode from its
//! features (the workload label header, prompt and output lengths), the answer comes from
//! that mode's engine (the same greedy tokens as the mode's model run directly), a mode the
//! server does not offer falls back to f16, and every decision is visible in headers,
//! `/admin/routes` and `/metrics`. The speculative modes are served over HTTP too (SmolLM2
//! drafting for itself; Qwen2.5-Coder 0.5B drafting for 1.5B) with the f16 engine's greedy
//! text and log-probabilities.

use crate::common;

use std::sync::Arc;

use crate::common::{start, MODEL};
use serde_json::{json, Value};
use switchyard_request::{Precision, SamplingParams};
use switchyard_tokenizer::Tokenizer;

const TOKENS: usize = 8;
/// Log-probabilities of the speculative modes against the f16 engine's: the verifier runs
/// several positions in one forward, whose f16 products round differently from one-row steps
/// (measured up to 0.011 on SmolLM2; the tokens are identical).
const LOGPROB_TOL: f64 = 0.02;
const PROMPT: &str = "The capital of France is";

fn config() -> String {
    format!(
        r#"[server]
admin = true

[modeswitch]
name = "modes"
path = "{MODEL}"
modes = ["int8", "q4"]
mode_budget = "1GiB"
"#
    )
}

async fn complete(base: &str, workload: Option<&str>) -> (u16, reqwest::header::HeaderMap, Value) {
    let mut r = common::client()
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body(
            json!({"model": "modes", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0})
                .to_string(),
        );
    if let Some(w) = workload {
        r = r.header("x-switchyard-workload", w);
    }
    let resp = r.send().await.expect("sent");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.json().await.unwrap_or(Value::Null);
    (status, headers, body)
}

fn header<'h>(h: &'h reqwest::header::HeaderMap, k: &str) -> &'h str {
    h.get(k).and_then(|v| v.to_str().ok()).unwrap_or("")
}

/// The greedy answer of the model at `p`, run directly.
fn direct(p: Precision) -> String {
    let path = switchyard_zoo::ensure(MODEL).expect("model");
    let src = switchyard_weights::open(&path).expect("open");
    let tok = Tokenizer::from_source(&*src).expect("tokenizer");
    let model =
        switchyard_modes::precision::load(Arc::clone(&src), p, Default::default()).expect("load");
    let prompt = tok.encode(PROMPT, true, true).expect("encode");
    let params = SamplingParams {
        max_tokens: TOKENS,
        ..SamplingParams::default()
    };
    // The modes serve from the engine's default f16 K/V blocks.
    let kv =
        switchyard_models::DenseKv::rounded_to_f16(model.n_layers(), model.spec().kv_row_len());
    switchyard_engine::generate_with_cache(&model, &tok, &prompt, &params, kv, |_| {})
        .expect("generate")
        .text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_picks_each_requests_mode_and_shows_why() {
    let s = start(&config()).await;

    // A synthetic-shape label goes to 4-bit (rule 4 of the paper's order).
    let (st, h, body) = complete(&s.base, Some("SS")).await;
    assert_eq!(st, 200, "{body}");
    assert_eq!(header(&h, "x-switchyard-mode"), "q4");
    assert!(
        header(&h, "x-switchyard-route").starts_with("rule=4:synthetic-shape; class="),
        "{h:?}"
    );
    assert!(header(&h, "x-switchyard-route").contains("fallback=false"));
    let q4_text = body["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(body["model"], "modes");
    assert_eq!(body["usage"]["completion_tokens"], TOKENS);

    // No label, a short prompt and output: everything else goes to int8 (rule 7).
    let (st, h, body) = complete(&s.base, None).await;
    assert_eq!(st, 200, "{body}");
    assert_eq!(header(&h, "x-switchyard-mode"), "int8");
    assert!(
        header(&h, "x-switchyard-route").starts_with("rule=7:default"),
        "{h:?}"
    );
    let int8_text = body["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string();

    // Math goes to speculative decoding (rule 5), which this server does not offer: f16.
    let (st, h, body) = complete(&s.base, Some("gsm8k")).await;
    assert_eq!(st, 200, "{body}");
    assert_eq!(header(&h, "x-switchyard-mode"), "f16");
    assert!(
        header(&h, "x-switchyard-route").contains("fallback=true"),
        "{h:?}"
    );

    // Each answer is its mode's own: the same greedy text as that precision run directly.
    let (q4, int8) =
        tokio::task::spawn_blocking(|| (direct(Precision::Q4), direct(Precision::Int8)))
            .await
            .expect("direct runs");
    assert_eq!(q4_text, q4);
    assert_eq!(int8_text, int8);

    // The decisions with their features, newest last.
    let routes: Value = common::client()
        .get(format!("{}/admin/routes", s.base))
        .send()
        .await
        .expect("sent")
        .json()
        .await
        .expect("json");
    let list = routes["modes"].as_array().cloned().unwrap_or_default();
    let modes: Vec<&str> = list.iter().filter_map(|r| r["mode"].as_str()).collect();
    assert_eq!(modes, ["q4", "int8", "f16"]);
    assert_eq!(list[0]["features"]["workload"], "SS");
    assert_eq!(list[0]["features"]["max_output_tokens"], TOKENS);
    assert!(list[0]["features"]["prompt_tokens"].as_u64().unwrap_or(0) > 0);
    assert_eq!(list[2]["rule"], "5:decode-heavy");

    // And counted in /metrics.
    let metrics = common::client()
        .get(format!("{}/metrics", s.base))
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("text");
    let count = |mode: &str| {
        metrics
            .lines()
            .find(|l| {
                l.starts_with("switchyard_route_decisions_total")
                    && l.contains(&format!("mode=\"{mode}\""))
                    && l.contains("model=\"modes\"")
            })
            .and_then(|l| l.rsplit(' ').next())
            .map(str::to_string)
    };
    assert_eq!(count("q4").as_deref(), Some("1"), "{metrics}");
    assert_eq!(count("int8").as_deref(), Some("1"));
    assert_eq!(count("f16").as_deref(), Some("1"));
    assert!(metrics.contains("switchyard_route_decision_seconds_total{model=\"modes\"}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_needs_a_draft_and_self_speculative_needs_exit_heads() {
    let toml = format!(
        "{}\n",
        config().replace(r#"modes = ["int8", "q4"]"#, r#"modes = ["speculative"]"#)
    );
    let err = switchyard_server::config::Config::parse(&toml)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "[modeswitch]: the speculative mode needs `draft`, a model with the same tokenizer"
    );

    let missing = std::env::temp_dir().join("switchyard-no-such-heads.safetensors");
    let toml = config().replace(
        r#"modes = ["int8", "q4"]"#,
        &format!(
            "modes = [\"self-speculative\"]\nexit_heads = {:?}",
            missing.display().to_string()
        ),
    );
    let err = common::start_error(&toml).await;
    assert!(
        err.contains(&format!(
            "self-speculative needs exit heads: none at {}",
            missing.display()
        )),
        "{err}"
    );
}

/// Completes `prompt` greedily on `model` for exactly `tokens` tokens (end-of-generation
/// ignored), streamed or whole; returns the status, the headers, the text and the token
/// log-probabilities.
async fn ask(
    base: &str,
    model: &str,
    prompt: &str,
    tokens: usize,
    workload: Option<&str>,
    stream: bool,
) -> (u16, reqwest::header::HeaderMap, String, Vec<f64>) {
    let mut r = common::client()
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body(
            json!({"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                   "logprobs": 0, "stream": stream, "ignore_eos": true})
            .to_string(),
        );
    if let Some(w) = workload {
        r = r.header("x-switchyard-workload", w);
    }
    let resp = r.send().await.expect("sent");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.text().await.unwrap_or_default();
    let chunks: Vec<Value> = if stream {
        body.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .filter_map(|d| serde_json::from_str(d).ok())
            .collect()
    } else {
        vec![serde_json::from_str(&body).unwrap_or(Value::Null)]
    };
    assert_eq!(status, 200, "{body}");
    let mut text = String::new();
    let mut logprobs = Vec::new();
    for c in &chunks {
        let choice = &c["choices"][0];
        text.push_str(choice["text"].as_str().unwrap_or_default());
        if let Some(l) = choice["logprobs"]["token_logprobs"].as_array() {
            logprobs.extend(l.iter().filter_map(Value::as_f64));
        }
    }
    (status, headers, text, logprobs)
}

/// Self-speculation (SmolLM2 drafting from its own layer 21) over HTTP: the same greedy text
/// and log-probabilities as the f16 engine, streamed and whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn self_speculative_requests_are_served_over_http() {
    use switchyard_exits::heads::model_ref;
    use switchyard_exits::{file, fingerprint, ExitHead, ExitHeads};

    const DEPTH: usize = 21;
    const N: usize = 24;
    let dir = tempfile::tempdir().expect("tempdir");
    let heads_path = dir.path().join("smollm2.exits.safetensors");
    {
        let path = switchyard_zoo::ensure(MODEL).expect("model");
        let src = switchyard_weights::open(&path).expect("open");
        let model =
            switchyard_models::LayeredModel::load(src, &switchyard_models::LoadOptions::default())
                .expect("load");
        let fp = fingerprint::fingerprint(&path).expect("fingerprint");
        let mut meta = ExitHeads::logit_lens(&model, MODEL, &[DEPTH])
            .expect("lens")
            .meta()
            .clone();
        meta.model = model_ref(&model, MODEL, fp.sha256, fp.bytes);
        let heads = ExitHeads::new(meta, [(DEPTH, ExitHead::Identity)].into()).expect("heads");
        file::save(&heads, &heads_path).expect("save");
    }
    let toml = format!(
        r#"[server]
admin = true

[modeswitch]
name = "self"
path = "{MODEL}"
modes = ["self-speculative"]
exit_heads = {heads:?}
draft_depth = {DEPTH}
mode_budget = "1GiB"

[[router.rules]]
id = "chat"
when = {{ workload = ["chat"] }}
mode = "self-speculative"

[[router.rules]]
id = "default"
when = "always"
mode = "f16"
"#,
        heads = heads_path.display().to_string()
    );
    let s = start(&toml).await;
    let prompt = "Once upon a time, in a small village by the sea,";
    let (_, h, f16_text, f16_lp) = ask(&s.base, "self", prompt, N, None, false).await;
    assert_eq!(header(&h, "x-switchyard-mode"), "f16");
    assert_eq!(f16_lp.len(), N);
    for stream in [false, true] {
        let (_, h, text, lp) = ask(&s.base, "self", prompt, N, Some("chat"), stream).await;
        assert_eq!(header(&h, "x-switchyard-mode"), "self-speculative");
        assert!(
            header(&h, "x-switchyard-route").starts_with("rule=1:chat"),
            "{h:?}"
        );
        assert_eq!(text, f16_text, "stream: {stream}");
        assert_eq!(lp.len(), N, "stream: {stream}, text {text:?}");
        for (a, b) in lp.iter().zip(&f16_lp) {
            assert!((a - b).abs() < LOGPROB_TOL, "logprobs {lp:?} vs {f16_lp:?}");
        }
    }
}

/// Speculative decoding over HTTP: Qwen2.5-Coder 0.5B drafting for 1.5B, routed by the
/// default policy's math rule; the greedy text equals the 1.5B f16 engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_requests_are_served_over_http() {
    const N: usize = 16;
    let toml = r#"[server]
admin = true

[modeswitch]
name = "coder"
path = "qwen2.5-coder-1.5b-instruct"
modes = ["speculative"]
draft = "qwen2.5-coder-0.5b-instruct"
mode_budget = "6GiB"
memory_budget = "12GiB"
max_model_len = 512
# Loading the 1.5B target in f16 beside its draft takes 30-50 s on 2 busy cores; the
# routing, not the load time, is under test.
load_wait_s = 240
"#;
    let s = start(toml).await;
    let prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n";
    // No label: the default rule's int8 is not offered, so f16 serves it.
    let (_, h, f16_text, f16_lp) = ask(&s.base, "coder", prompt, N, None, false).await;
    assert_eq!(f16_lp.len(), N);
    assert_eq!(header(&h, "x-switchyard-mode"), "f16");
    let (_, h, text, lp) = ask(&s.base, "coder", prompt, N, Some("gsm8k"), true).await;
    assert_eq!(header(&h, "x-switchyard-mode"), "speculative", "{h:?}");
    assert!(
        header(&h, "x-switchyard-route").starts_with("rule=5:decode-heavy"),
        "{h:?}"
    );
    assert_eq!(text, f16_text);
    assert_eq!(lp.len(), N);
    for (a, b) in lp.iter().zip(&f16_lp) {
        assert!((a - b).abs() < LOGPROB_TOL, "logprobs {lp:?} vs {f16_lp:?}");
    }

    // A prompt over max_model_len is refused with the cap in the message.
    let long = "x ".repeat(600);
    let resp = common::client()
        .post(format!("{}/v1/completions", s.base))
        .header("content-type", "application/json")
        .body(json!({"model": "coder", "prompt": long, "max_tokens": 4}).to_string())
        .send()
        .await
        .expect("sent");
    assert_eq!(resp.status().as_u16(), 400);
    let body = resp.text().await.unwrap_or_default();
    assert!(
        body.contains("this model's maximum context length is 512 tokens"),
        "{body}"
    );
}

/// A learned router saved by `bench router --save-routers` routes instead of the rules: here a
/// decision tree trained to send synthetic-shape traffic to q4 and everything else to int8.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saved_learned_router_routes_requests() {
    use switchyard_router::{LearnedKind, LearnedRouter, Mode, RequestFeatures};

    let mut examples = Vec::new();
    for (i, label) in [Some("SS"), Some("LL"), None, Some("chat"), Some("mmlu")]
        .into_iter()
        .enumerate()
    {
        for n in 0..20 {
            let f = RequestFeatures {
                prompt_tokens: 4 + 13 * n + i,
                max_output_tokens: 8 + n,
                workload: label.map(str::to_string),
                ..RequestFeatures::default()
            };
            let mode = if label.is_some_and(|l| l.len() == 2) {
                Mode::Q4
            } else {
                Mode::Int8
            };
            examples.push((f, mode));
        }
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tree.json");
    LearnedRouter::train(LearnedKind::Tree, &examples, 3)
        .expect("train")
        .save(&path)
        .expect("save");

    let toml = config().replace(
        "mode_budget = \"1GiB\"",
        &format!(
            "mode_budget = \"1GiB\"\nlearned_router = {:?}",
            path.display().to_string()
        ),
    );
    let s = start(&toml).await;
    let (st, h, body) = complete(&s.base, Some("SS")).await;
    assert_eq!(st, 200, "{body}");
    assert_eq!(header(&h, "x-switchyard-mode"), "q4");
    assert!(
        header(&h, "x-switchyard-route").starts_with("rule=tree;"),
        "{h:?}"
    );
    let (st, h, body) = complete(&s.base, None).await;
    assert_eq!(st, 200, "{body}");
    assert_eq!(header(&h, "x-switchyard-mode"), "int8");

    // A file that is not a router stops start-up with the file named.
    std::fs::write(&path, "{}").expect("write");
    let err = common::start_error(&toml).await;
    assert!(
        err.contains(&format!(
            "[modeswitch]: learned router file {}: not a learned router",
            path.display()
        )),
        "{err}"
    );
}

/// A policy `switchyard router fit` writes, read through `[router] policy_file`: each class of
/// request is routed to the mode fitted for it, and the header names the fitted rule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fitted_policy_file_routes_each_class_to_its_fitted_mode() {
    use std::collections::BTreeMap;
    use switchyard_router::{
        fit, CellMeasure, Constraints, Gate, Mode, ModeMatrix, PairedDelta, QualityMeasure,
        RuleConfig,
    };
    // q4 fastest everywhere, int8 next. q4 keeps bits per byte within +5 % and the
    // multiple-choice tasks, but not GSM8K; the gate judges interactive requests on bits per
    // byte alone, so q4 serves interactive and multiple-choice requests and int8 the rest.
    let mut m = ModeMatrix::default();
    for (cell, f16) in [
        ("SS", 1.0),
        ("SL", 3.0),
        ("LS", 1.5),
        ("LL", 4.0),
        ("batch", 5.0),
    ] {
        for (mode, share) in [(Mode::F16, 1.0), (Mode::Int8, 0.6), (Mode::Q4, 0.4)] {
            let measure = CellMeasure {
                latency_s: f16 * share,
                energy_j_per_token: None,
                peak_memory_bytes: 1 << 28,
                accuracy_points: None,
                quality_points: None,
            };
            m.insert(cell, mode, measure);
        }
    }
    let quality = |bpb: f64, gsm_lo: f64| QualityMeasure {
        bits_per_byte: Some(bpb),
        bpb_bytes: Some(100_000),
        tasks: ["gsm8k", "arc-challenge", "hellaswag", "mmlu"]
            .iter()
            .map(|t| {
                let lo = if *t == "gsm8k" { gsm_lo } else { -1.0 };
                let d = PairedDelta {
                    n: 500,
                    delta_points: lo + 1.0,
                    lo_points: lo,
                    hi_points: lo + 2.0,
                    only_mode: 5,
                    only_baseline: 6,
                    mcnemar_p: 1.0,
                };
                (t.to_string(), d)
            })
            .collect(),
    };
    m.quality = BTreeMap::from([
        (Mode::F16, quality(0.50, 0.0)),
        (Mode::Int8, quality(0.501, -0.5)),
        (Mode::Q4, quality(0.52, -3.0)),
    ]);
    let mut gate = Gate::default();
    gate.tasks.insert("interactive".into(), Vec::new());
    let report = fit(&m, &Constraints::default(), &gate, RuleConfig::default()).expect("fit");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("policy.toml");
    std::fs::write(&file, report.policy_toml("a test matrix").expect("toml")).expect("write");

    let toml = format!(
        "{}\n[router]\npolicy_file = {:?}\n",
        config(),
        file.display().to_string()
    );
    let cfg = switchyard_server::config::Config::parse(&toml).expect("parses");
    assert_eq!(cfg.router_policy().expect("policy"), report.policy);
    let s = start(&toml).await;
    let long_prompt = "The quick brown fox jumps over the lazy dog. ".repeat(60);
    // (workload label, prompt, max_tokens, mode, rule); the matrix has no shared-prefix or
    // memory-pressure cell, so the fit wrote no rule for them. Rule 1 is
    // `multiple-choice/batch` (q4: multiple-choice requests in a full queue), which one
    // request at a time does not reach.
    assert_eq!(report.policy.rules()[0].id, "multiple-choice/batch");
    let cases = [
        (Some("batch"), PROMPT.to_string(), 4, "int8", "2:batch"),
        (Some("gsm8k"), PROMPT.to_string(), 4, "int8", "3:math"),
        (
            Some("mmlu"),
            PROMPT.to_string(),
            1,
            "q4",
            "4:multiple-choice",
        ),
        (None, long_prompt, 4, "int8", "5:prefill-heavy"),
        (None, PROMPT.to_string(), 128, "int8", "6:decode-heavy"),
        (None, PROMPT.to_string(), 4, "q4", "7:interactive"),
    ];
    for (workload, prompt, max_tokens, mode, rule) in cases {
        let mut r = common::client()
            .post(format!("{}/v1/completions", s.base))
            .header("content-type", "application/json")
            .body(
                json!({"model": "modes", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0})
                .to_string(),
            );
        if let Some(w) = workload {
            r = r.header("x-switchyard-workload", w);
        }
        let resp = r.send().await.expect("sent");
        assert_eq!(resp.status().as_u16(), 200, "{rule}");
        let h = resp.headers().clone();
        assert_eq!(header(&h, "x-switchyard-mode"), mode, "{rule}: {h:?}");
        assert!(
            header(&h, "x-switchyard-route").starts_with(&format!("rule={rule};")),
            "{rule}: {h:?}"
        );
    }

    // A policy file beside inline rules, or one that is missing, is refused with the reason.
    let both = format!("{toml}id = \"x\"\n");
    let err = switchyard_server::config::Config::parse(&both)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "[router]: policy_file and inline router settings are both given; keep one"
    );
    let missing = toml.replace("policy.toml", "absent.toml");
    let err = switchyard_server::config::Config::parse(&missing)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("[router] policy_file ") && err.contains("absent.toml: "),
        "{err}"
    );
}
