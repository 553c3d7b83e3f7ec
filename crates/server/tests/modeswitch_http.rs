//! ModeSwitch over HTTP on SmolLM2-135M: the rule router picks each request's mode from its
//! features (the workload label header, prompt and output lengths), the answer comes from
//! that mode's engine (the same greedy tokens as the mode's model run directly), a mode the
//! server does not offer falls back to f16, and every decision is visible in headers,
//! `/admin/routes` and `/metrics`.

mod common;

use std::sync::Arc;

use common::{start, MODEL};
use serde_json::{json, Value};
use switchyard_request::{Precision, SamplingParams};
use switchyard_tokenizer::Tokenizer;

const TOKENS: usize = 8;
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
    let model = switchyard_modes::precision::load(Arc::clone(&src), p, None).expect("load");
    let prompt = tok.encode(PROMPT, true, true).expect("encode");
    let params = SamplingParams {
        max_tokens: TOKENS,
        ..SamplingParams::default()
    };
    switchyard_engine::generate(&model, &tok, &prompt, &params, |_| {})
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
async fn speculative_modes_are_refused_in_the_server_config() {
    let toml = format!(
        "{}\n",
        config().replace(r#"modes = ["int8", "q4"]"#, r#"modes = ["speculative"]"#)
    );
    let err = switchyard_server::config::Config::parse(&toml)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("[modeswitch]: the speculative mode decodes one sequence at a time"),
        "{err}"
    );
}
