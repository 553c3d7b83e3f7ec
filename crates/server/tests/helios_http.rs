//! The HELIOS model over HTTP, on SmolLM2-135M with a logit-lens exit at layer 25: the online
//! evaluation answers a real request, the greedy partial load serves the next ones, streamed
//! and non-streamed alike (the same tokens for the same greedy request), the serving
//! candidate is named in a header, and the PHT and the decision counters are visible at
//! `/admin/pht` and `/metrics`. With shadow evaluation (the default) every request is served
//! by the chosen candidate, and the sampled prompts' scores show at `/admin/stats` and
//! `/metrics`.

use crate::common;

use crate::common::{post, served_by, start, HELIOS_LOCAL_ENTRY, MODEL};
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

/// The server config: HELIOS over the manifest in `dir`, with `settings` (TOML lines).
fn config(dir: &tempfile::TempDir, settings: &str) -> String {
    let path = dir.path().join("models.toml");
    format!(
        r#"[server]
admin = true

[helios]
name = "helios"
manifest = "{}"
memory_budget = "512MiB"
{settings}
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
    let s = start(&config(
        &dir,
        r#"policy = { evaluation = "serial", eval_requests = 1, threshold = 0.5 }"#,
    ))
    .await;

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
    let pht = common::get_text(&s.base, "/admin/pht").await;
    assert!(pht.len() < 1024, "{pht}");
    let pht: Value = serde_json::from_str(&pht).expect("PHT is JSON");
    let rows = pht["rows"].as_array().cloned().unwrap_or_default();
    assert_eq!(rows.len(), 1, "{pht}");
    assert_eq!(rows[0]["m"], MODEL);
    assert!(rows[0]["tps"].as_f64().unwrap_or(0.0) > 0.0, "{pht}");

    let metrics = common::get_text(&s.base, "/metrics").await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helios_shadow_serves_every_request_and_scores_the_prompts() {
    let dir = manifest();
    let toml = config(
        &dir,
        "slo = { max_bits_per_byte_increase = 0.3 }\n\
         policy = { shadow = { share = 1.0, sample_every = 1, window = 2 } }",
    );
    let s = start(&toml).await;
    let mut answers = Vec::new();
    for _ in 0..2 {
        let (st, headers, body) = post(
            &s.base,
            "/v1/completions",
            request(false).to_string(),
            JSON,
            None,
        )
        .await;
        assert_eq!(st, 200, "{body}");
        assert_eq!(served_by(&headers), Some(MODEL));
        answers.push(body["choices"][0]["text"].clone());
    }
    // The plain model beside it gives the same greedy answer: no evaluation block.
    let mut plain = request(false);
    plain["model"] = json!(MODEL);
    let (st, _, direct) = post(&s.base, "/v1/completions", plain.to_string(), JSON, None).await;
    assert_eq!(st, 200, "{direct}");
    assert_eq!(answers[0], direct["choices"][0]["text"]);
    assert_eq!(answers[1], direct["choices"][0]["text"]);

    // One round of the two prompts, scored at the exit (25) and at full depth (30).
    let mut stats = Value::Null;
    for _ in 0..600 {
        stats =
            serde_json::from_str(&common::get_text(&s.base, "/admin/stats").await).expect("JSON");
        if stats["helios"]["counters"]["shadow_rounds"] == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let h = &stats["helios"];
    assert_eq!(h["counters"]["shadow_rounds"], 1, "{stats}");
    assert_eq!(h["counters"]["shadow_texts"], 2, "{stats}");
    assert_eq!(h["counters"]["evaluation_requests"], 0, "{stats}");
    let score = &h["shadow_rounds"][0]["scores"][0];
    assert_eq!(score["model"], MODEL);
    let depths: Vec<u64> = score["prompt_bits_per_byte"]
        .as_array()
        .expect("depths")
        .iter()
        .filter_map(|d| d[0].as_u64())
        .collect();
    assert_eq!(depths, vec![25, 30], "{score}");
    // "The capital of France is" twice: 48 bytes, less each first token without a BOS.
    let bytes = score["prompt_bytes"].as_u64().expect("bytes");
    assert!((40..=48).contains(&bytes), "{score}");

    let metrics = common::get_text(&s.base, "/metrics").await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("switchyard_helios_decisions{")
                && l.contains("kind=\"shadow_round\"")
                && l.ends_with(" 1")),
        "{metrics}"
    );
}
