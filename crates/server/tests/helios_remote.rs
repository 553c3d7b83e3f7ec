//! A remote OpenAI-compatible server as a HELIOS candidate: a second Switchyard server serves
//! SmolLM2-135M over HTTP, and the HELIOS model's repository lists it (by URL, with a local
//! copy of its tokenizer) beside the same model run locally with an exit at layer 25. The
//! online evaluation serves real requests on both; the remote answers equal the model's own
//! greedy answer, and its PHT row has its measured throughput, bits per byte and every token
//! at full depth. A remote candidate whose server goes away is marked unreachable and skipped
//! (the request that found it gone is served by the other candidate), and is served again once
//! its health check passes.

use crate::common;

use crate::common::{post, served_by, start, start_detached, HELIOS_LOCAL_ENTRY, MODEL};
use serde_json::{json, Value};

const JSON: &str = "application/json";
const TOKENS: u64 = 8;
const REMOTE: &str = "smollm2-remote";

/// The repository: the remote candidate (listed as faster, so it is evaluated first) and the
/// local one.
fn manifest(dir: &tempfile::TempDir, url: &str) -> std::path::PathBuf {
    let toml = format!(
        r#"version = 1

[[model]]
name = "{REMOTE}"
url = "{url}"
remote_model = "{MODEL}"
tokenizer = "{MODEL}"
context_length = 8192
size_bytes = 98362432
layers = 30

[[model.depth]]
depth = 30
tokens_per_s = 80.0
bits_per_byte = 1.1

{HELIOS_LOCAL_ENTRY}"#
    );
    let path = dir.path().join("models.toml");
    std::fs::write(&path, toml).expect("write manifest");
    path
}

fn config(manifest: &std::path::Path) -> String {
    format!(
        r#"[server]
admin = true

[helios]
name = "helios"
manifest = "{}"
memory_budget = "512MiB"
policy = {{ evaluation = "serial", eval_requests = 1, top_k = 2, threshold = 0.5 }}
"#,
        manifest.display()
    )
}

fn request(model: &str) -> String {
    json!({"model": model, "prompt": "The capital of France is",
           "max_tokens": TOKENS, "temperature": 0})
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_server_is_a_helios_candidate() {
    // The remote side: a plain server of the test model.
    let remote = start("").await;
    let (st, _, direct) = post(&remote.base, "/v1/completions", request(MODEL), JSON, None).await;
    assert_eq!(st, 200, "{direct}");
    let direct_text = direct["choices"][0]["text"].as_str().unwrap_or_default();
    assert_eq!(direct["usage"]["completion_tokens"], TOKENS);

    // vLLM's `return_tokens_as_token_ids`, which the remote candidate asks for: each listed
    // token is `token_id:<id>`, and the ids decode to the text.
    let mut body: Value = serde_json::from_str(&request(MODEL)).expect("json");
    body["logprobs"] = json!(1);
    body["return_tokens_as_token_ids"] = json!(true);
    let (st, _, listed) = post(
        &remote.base,
        "/v1/completions",
        body.to_string(),
        JSON,
        None,
    )
    .await;
    assert_eq!(st, 200, "{listed}");
    let ids: Vec<u32> = listed["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|t| t.as_str()?.strip_prefix("token_id:")?.parse().ok())
        .collect();
    assert_eq!(ids.len() as u64, TOKENS, "{listed}");
    let path = switchyard_zoo::ensure(MODEL).expect("model");
    let src = switchyard_weights::open(&path).expect("open");
    let tok = switchyard_tokenizer::Tokenizer::from_source(&*src).expect("tokenizer");
    assert_eq!(tok.decode(&ids, false).expect("decode"), direct_text);

    let dir = tempfile::tempdir().expect("temp dir");
    let s = start(&config(&manifest(&dir, &remote.base))).await;

    // Evaluation, first block: the remote candidate answers.
    let (st, headers, first) =
        post(&s.base, "/v1/completions", request("helios"), JSON, None).await;
    assert_eq!(st, 200, "{first}");
    assert_eq!(served_by(&headers), Some(REMOTE));
    assert_eq!(first["choices"][0]["text"].as_str(), Some(direct_text));
    assert_eq!(first["usage"]["completion_tokens"], TOKENS);

    // Second block: the local candidate, the same greedy answer.
    let (st, headers, second) =
        post(&s.base, "/v1/completions", request("helios"), JSON, None).await;
    assert_eq!(st, 200, "{second}");
    assert_eq!(served_by(&headers), Some(MODEL));
    assert_eq!(second["choices"][0]["text"].as_str(), Some(direct_text));

    // Both rows are in the PHT; the remote one at full depth, measured.
    let pht: Value = common::client()
        .get(format!("{}/admin/pht", s.base))
        .send()
        .await
        .expect("sent")
        .json()
        .await
        .expect("PHT is JSON");
    let rows = pht["rows"].as_array().cloned().unwrap_or_default();
    let row = rows
        .iter()
        .find(|r| r["m"] == REMOTE)
        .unwrap_or_else(|| panic!("no remote row: {pht}"));
    assert_eq!(row["d"], 30);
    assert!(row["tps"].as_f64().unwrap_or(0.0) > 0.0, "{pht}");
    assert!(row["bpb"].as_f64().unwrap_or(0.0) > 0.0, "{pht}");
    assert_eq!(row["h"], json!([[30, TOKENS]]), "{pht}");
    assert!(rows.iter().any(|r| r["m"] == MODEL), "{pht}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_candidate_without_a_tokenizer_or_server_is_reported() {
    let dir = tempfile::tempdir().expect("temp dir");
    // No tokenizer: start-up says what is missing.
    let path = manifest(&dir, "http://127.0.0.1:9");
    let text = std::fs::read_to_string(&path).expect("manifest");
    std::fs::write(
        &path,
        text.replace(&format!("tokenizer = \"{MODEL}\"\n"), ""),
    )
    .expect("write");
    let err = common::start_error(&config(&path)).await;
    assert!(
        err.contains(&format!(
            "remote candidate {REMOTE}: the manifest needs `tokenizer`"
        )),
        "{err}"
    );

    // A server that is not there: the request evaluated on it finds it unreachable before
    // any answer and is served by the local candidate (or the health check, a second after
    // start-up, found it first on a slow start, and the request never went to it); the remote
    // one is skipped after that.
    manifest(&dir, "http://127.0.0.1:9");
    let s = start(&config(&path)).await;
    let (st, headers, body) = post(&s.base, "/v1/completions", request("helios"), JSON, None).await;
    assert_eq!(st, 200, "{body}");
    assert_eq!(served_by(&headers), Some(MODEL));
    assert_eq!(helios_state(&s.base).await, "unreachable");
    let counters = common::admin_stats(&s.base).await["helios"]["counters"].clone();
    assert!(
        matches!(counters["retried"].as_u64(), Some(0 | 1)),
        "{counters}"
    );
    let (st, _, _) = post(&s.base, "/v1/completions", request(MODEL), JSON, None).await;
    assert_eq!(st, 200);
}

/// HELIOS's state at `/health` (the worst of its candidates).
async fn helios_state(base: &str) -> Value {
    let h: Value = serde_json::from_str(&common::get_text(base, "/health").await).expect("JSON");
    h["models"]["helios"]["state"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_remote_candidate_is_skipped_until_its_health_check_passes() {
    let remote = tokio::task::block_in_place(|| start_detached("", "127.0.0.1:0"));
    let addr = remote.base.trim_start_matches("http://").to_string();
    let dir = tempfile::tempdir().expect("temp dir");
    // Shadow evaluation without a quality bound: the first choice is the fastest by the
    // repository's telemetry, the remote one (80 tokens/s against 66).
    let toml = config(&manifest(&dir, &remote.base)).replace(
        "policy = { evaluation = \"serial\", eval_requests = 1, top_k = 2, threshold = 0.5 }",
        "policy = { top_k = 2 }",
    );
    let s = start(&toml).await;
    let served = |headers: &reqwest::header::HeaderMap| served_by(headers).map(str::to_string);
    let (st, headers, first) =
        post(&s.base, "/v1/completions", request("helios"), JSON, None).await;
    assert_eq!(st, 200, "{first}");
    assert_eq!(served(&headers).as_deref(), Some(REMOTE));
    let text = first["choices"][0]["text"].clone();

    // The remote server goes away: the next request finds it gone before any answer (or the
    // health check found it first), and is served by the local candidate, which serves from
    // then on.
    tokio::task::block_in_place(|| remote.kill());
    for _ in 0..2 {
        let (st, headers, body) =
            post(&s.base, "/v1/completions", request("helios"), JSON, None).await;
        assert_eq!(st, 200, "{body}");
        assert_eq!(served(&headers).as_deref(), Some(MODEL));
        assert_eq!(body["choices"][0]["text"], text);
    }
    assert_eq!(helios_state(&s.base).await, "unreachable");
    let health = common::get_text(&s.base, "/health").await;
    assert!(
        health.contains("\"status\":\"ok\""),
        "not this instance's failure: {health}"
    );
    let counters = common::admin_stats(&s.base).await["helios"]["counters"].clone();
    assert_eq!(
        (&counters["failovers"], &counters["failbacks"]),
        (&json!(1), &json!(0)),
        "{counters}"
    );
    // Retried unless the health check, once a second, came between the kill and the request.
    assert!(
        matches!(counters["retried"].as_u64(), Some(0 | 1)),
        "{counters}"
    );

    // A server on its address again: the health check marks it reachable, and the next
    // request goes back to it.
    let _back = tokio::task::block_in_place(|| start_detached("", &addr));
    let t0 = std::time::Instant::now();
    while helios_state(&s.base).await != "running" {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(30),
            "never reachable again"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let (st, headers, body) = post(&s.base, "/v1/completions", request("helios"), JSON, None).await;
    assert_eq!(st, 200, "{body}");
    assert_eq!(served(&headers).as_deref(), Some(REMOTE));
    assert_eq!(body["choices"][0]["text"], text);
    let counters = common::admin_stats(&s.base).await["helios"]["counters"].clone();
    assert_eq!(counters["failbacks"], 1, "{counters}");
}
