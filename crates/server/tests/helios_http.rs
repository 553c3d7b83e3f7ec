//! The HELIOS model over HTTP, on SmolLM2-135M with a logit-lens exit at layer 25: the online
//! evaluation answers a real request, the greedy partial load serves the next ones, streamed
//! and non-streamed alike (the same tokens for the same greedy request), the serving
//! candidate is named in a header, and the PHT and the decision counters are visible at
//! `/admin/pht` and `/metrics`.

mod common;

use common::{post, served_by, start, HELIOS_LOCAL_ENTRY, MODEL};
use serde_json::{json, Value};

const JSON: &str = "application/json";
const TOKENS: u64 = 8;

/// A one-candidate repository (the test model, exits at 25 of 30 through the logit lens)
/// written next to the test's temporary files.
fn manifest() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    let toml = format!(
        r#"version = 1

{HELIOS_LOCAL_ENTRY}"#
    );
    std::fs::write(dir.path().join("models.toml"), toml).expect("write manifest");
    dir
}

fn config(dir: &tempfile::TempDir) -> String {
    let path = dir.path().join("models.toml");
    format!(
        r#"[server]
admin = true

[helios]
name = "helios"
manifest = "{}"
memory_budget = "512MiB"
policy = {{ eval_requests = 1, threshold = 0.5 }}
"#,
        path.display()
    )
}

fn request(stream: bool) -> Value {
    let mut r = json!({"model": "helios", "prompt": "The capital of France is",
                       "max_tokens": TOKENS, "temperature": 0, "stream": stream});
    if stream {
        r["stream_options"] = json!({"include_usage": true});
    }
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helios_serves_streamed_and_whole_answers_and_shows_its_pht() {
    let dir = manifest();
    // No `[[models]]`: the harness adds the plain test model beside the HELIOS one.
    let s = start(&config(&dir)).await;

    // The first request is the candidate's online evaluation; it is a real answer.
    let (st, headers, first) = post(
        &s.base,
        "/v1/completions",
        request(false).to_string(),
        JSON,
        None,
    )
    .await;
    assert_eq!(st, 200, "{first}");
    assert_eq!(served_by(&headers), Some(MODEL));
    assert_eq!(first["model"], "helios");
    assert_eq!(first["usage"]["completion_tokens"], TOKENS);

    // Then the partial load serves: a streamed request and the same request whole.
    let common::Streamed {
        status,
        headers,
        text,
        chunks,
    } = common::stream_completion(&s.base, request(true)).await;
    assert_eq!(status, 200);
    assert_eq!(served_by(&headers), Some(MODEL));
    assert!(chunks.iter().all(|c| c["model"] == "helios"));
    let usage = &chunks.last().expect("usage chunk")["usage"];
    assert_eq!(usage["completion_tokens"], TOKENS);
    let (st, _, whole) = post(
        &s.base,
        "/v1/completions",
        request(false).to_string(),
        JSON,
        None,
    )
    .await;
    assert_eq!(st, 200, "{whole}");
    assert_eq!(whole["choices"][0]["text"].as_str(), Some(text.as_str()));
    assert_eq!(&whole["usage"], usage);

    // Log-probabilities have no fixed vocabulary under HELIOS: a clear 400, streamed or not.
    let mut lp = request(true);
    lp["logprobs"] = json!(1);
    let (st, _, err) = post(&s.base, "/v1/completions", lp.to_string(), JSON, None).await;
    assert_eq!(st, 400);
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("vocabulary"),
        "{err}"
    );

    // The PHT holds the evaluation's row for the candidate and stays under 1 KB.
    let pht = common::client()
        .get(format!("{}/admin/pht", s.base))
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("body");
    assert!(pht.len() < 1024, "{pht}");
    let pht: Value = serde_json::from_str(&pht).expect("PHT is JSON");
    let rows = pht["rows"].as_array().cloned().unwrap_or_default();
    assert_eq!(rows.len(), 1, "{pht}");
    assert_eq!(rows[0]["m"], MODEL);
    assert!(rows[0]["tps"].as_f64().unwrap_or(0.0) > 0.0, "{pht}");

    let metrics = common::client()
        .get(format!("{}/metrics", s.base))
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("body");
    // One profile (the evaluation), counted under the HELIOS model's name.
    let profiles: Vec<f64> = metrics
        .lines()
        .filter(|l| {
            l.starts_with("switchyard_helios_decisions{")
                && l.contains("kind=\"profile\"")
                && l.contains("model=\"helios\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    assert_eq!(profiles, vec![1.0], "{metrics}");
}
