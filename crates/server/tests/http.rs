//! The HTTP server on a real model (smollm2-135m-instruct) over loopback: validation of bad
//! requests, authentication, streaming, disconnects, overload, timeouts, metrics, and a remote
//! backend relaying a second instance.

use crate::common;

use std::time::Duration;

use crate::common::{post, start, MODEL};
use futures::StreamExt;
use serde_json::{json, Value};

const JSON: &str = "application/json";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_errors_and_do_not_disturb_the_server() {
    let s = start("[server]\nmax_body_bytes = 200000\n").await;
    let long_prompt = "hello ".repeat(9000);
    let many_stops: Vec<String> = (0..1000).map(|i| format!("s{i}")).collect();
    let c = "/v1/completions";
    let ch = "/v1/chat/completions";
    // (what, path, content type, body, status, error type)
    type Case<'a> = (&'a str, &'a str, &'a str, Vec<u8>, u16, &'a str);
    let cases: Vec<Case> = vec![
        ("malformed JSON", c, JSON, b"{".to_vec(), 400, "invalid_request_error"),
        ("array body", c, JSON, b"[1,2]".to_vec(), 400, "invalid_request_error"),
        ("invalid UTF-8", c, JSON, b"{\"model\":\"\xff\"}".to_vec(), 400, "invalid_request_error"),
        ("wrong content type", c, "text/plain", br#"{"model":"m"}"#.to_vec(), 415, "invalid_request_error"),
        ("missing model", c, JSON, br#"{"prompt":"x"}"#.to_vec(), 422, "invalid_request_error"),
        ("missing prompt", c, JSON, json!({"model": MODEL}).to_string().into_bytes(), 422, "invalid_request_error"),
        ("missing messages", ch, JSON, json!({"model": MODEL}).to_string().into_bytes(), 422, "invalid_request_error"),
        ("model of wrong type", c, JSON, br#"{"model":7,"prompt":"x"}"#.to_vec(), 422, "invalid_request_error"),
        ("temperature of wrong type", c, JSON, json!({"model": MODEL, "prompt": "x", "temperature": "hot"}).to_string().into_bytes(), 422, "invalid_request_error"),
        ("negative max_tokens", c, JSON, json!({"model": MODEL, "prompt": "x", "max_tokens": -5}).to_string().into_bytes(), 422, "invalid_request_error"),
        ("huge max_tokens", c, JSON, json!({"model": MODEL, "prompt": "x", "max_tokens": 1_000_000_000u64}).to_string().into_bytes(), 400, "invalid_request_error"),
        ("unknown model", c, JSON, json!({"model": "gpt-9", "prompt": "x"}).to_string().into_bytes(), 404, "not_found_error"),
        ("prompt over the context", c, JSON, json!({"model": MODEL, "prompt": long_prompt}).to_string().into_bytes(), 400, "invalid_request_error"),
        ("body over the size limit", c, JSON, vec![b' '; 300_000], 413, "invalid_request_error"),
        ("n = 17", c, JSON, json!({"model": MODEL, "prompt": "x", "n": 17}).to_string().into_bytes(), 422, "invalid_request_error"),
        ("1,000 stop strings", c, JSON, json!({"model": MODEL, "prompt": "x", "stop": many_stops}).to_string().into_bytes(), 422, "invalid_request_error"),
        ("top_p = 0", c, JSON, json!({"model": MODEL, "prompt": "x", "top_p": 0}).to_string().into_bytes(), 422, "invalid_request_error"),
        ("stream_options without stream", c, JSON, json!({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": true}}).to_string().into_bytes(), 422, "invalid_request_error"),
        ("empty messages", ch, JSON, json!({"model": MODEL, "messages": []}).to_string().into_bytes(), 422, "invalid_request_error"),
        ("unknown role", ch, JSON, json!({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}).to_string().into_bytes(), 422, "invalid_request_error"),
        ("logprobs above 20", c, JSON, json!({"model": MODEL, "prompt": "x", "logprobs": 21}).to_string().into_bytes(), 422, "invalid_request_error"),
        ("presence_penalty above 2", c, JSON, json!({"model": MODEL, "prompt": "x", "presence_penalty": 2.5}).to_string().into_bytes(), 422, "invalid_request_error"),
        ("logit_bias outside the vocabulary", c, JSON, json!({"model": MODEL, "prompt": "x", "logit_bias": {"999999": 1}}).to_string().into_bytes(), 422, "invalid_request_error"),
        ("stop_token_ids outside the vocabulary", c, JSON, json!({"model": MODEL, "prompt": "x", "stop_token_ids": [49152]}).to_string().into_bytes(), 422, "invalid_request_error"),
        ("min_tokens above max_tokens", c, JSON, json!({"model": MODEL, "prompt": "x", "min_tokens": 9, "max_tokens": 3}).to_string().into_bytes(), 422, "invalid_request_error"),
        ("echo with logprobs", c, JSON, json!({"model": MODEL, "prompt": "x", "echo": true, "logprobs": 1}).to_string().into_bytes(), 400, "invalid_request_error"),
        ("token id outside the vocabulary", c, JSON, json!({"model": MODEL, "prompt": [1, 999_999]}).to_string().into_bytes(), 422, "invalid_request_error"),
        ("image content", ch, JSON, json!({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).to_string().into_bytes(), 400, "invalid_request_error"),
    ];
    assert!(cases.len() >= 20);
    for (what, path, ct, body, status, kind) in cases {
        let (got, _, v) = post(&s.base, path, body, ct, None).await;
        assert_eq!(got, status, "{what}: {v}");
        assert_eq!(v["error"]["type"], kind, "{what}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{what}: no message in {v}"
        );
    }
    // The server still serves a good request.
    let (got, _, v) = post(
        &s.base,
        c,
        json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).to_string(),
        JSON,
        None,
    )
    .await;
    assert_eq!(got, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(v["choices"][0]["text"], " Paris.\n\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_protect_v1_and_admin_only() {
    let s = start("[server]\napi_keys = [\"secret-key-123\"]\nadmin = true\n").await;
    let get = |path: &str, key: Option<&str>| {
        let mut r = common::client().get(format!("{}{path}", s.base));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        async move { r.send().await.map(|r| r.status().as_u16()).unwrap_or(0) }
    };
    for path in ["/v1/models", "/admin/stats"] {
        assert_eq!(get(path, None).await, 401, "{path} without a key");
        assert_eq!(
            get(path, Some("secret-key-124")).await,
            401,
            "{path} with a wrong key of the same length"
        );
        assert_eq!(
            get(path, Some("secret-key-123")).await,
            200,
            "{path} with the key"
        );
    }
    let body = json!({"model": MODEL, "prompt": "x", "max_tokens": 1}).to_string();
    let (st, h, v) = post(&s.base, "/v1/completions", body.clone(), JSON, None).await;
    assert_eq!(st, 401);
    assert_eq!(v["error"]["type"], "authentication_error");
    assert_eq!(
        h.get("www-authenticate").and_then(|v| v.to_str().ok()),
        Some("Bearer")
    );
    let (st, _, _) = post(
        &s.base,
        "/v1/completions",
        body,
        JSON,
        Some("secret-key-123"),
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(get("/health", None).await, 200);
    assert_eq!(get("/metrics", None).await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_routes_are_off_unless_enabled() {
    let s = start("").await;
    let st = common::client()
        .get(format!("{}/admin/stats", s.base))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0);
    assert_eq!(st, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_text_equals_non_streamed_for_the_same_seed() {
    let s = start("").await;
    let body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24,
                      "temperature": 0.9, "top_p": 0.95, "seed": 7, "logprobs": 0});
    let (_, _, whole) = post(&s.base, "/v1/completions", body.to_string(), JSON, None).await;
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let (text, chunks) = common::streamed_text(&s.base, sbody).await;
    assert_eq!(
        text,
        whole["choices"][0]["text"].as_str().unwrap_or_default()
    );
    let usage = &chunks.last().expect("usage chunk")["usage"];
    assert_eq!(usage, &whole["usage"]);
    // Log-probabilities: one per generated token, the same in both.
    let lp_whole = whole["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let lp_stream: Vec<Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["token_logprobs"].as_array())
        .flatten()
        .cloned()
        .collect();
    assert_eq!(lp_whole.len(), 24);
    assert_eq!(lp_stream, lp_whole);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_frees_its_blocks() {
    let s = start("[server]\nadmin = true\n").await;
    let resp = common::client()
        .post(format!("{}/v1/completions", s.base))
        .json(
            &json!({"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 2000,
                      "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .expect("sent");
    let mut body = resp.bytes_stream();
    let first = body.next().await.expect("a first chunk").expect("bytes");
    assert!(String::from_utf8_lossy(&first).contains("data: "));
    let stats = |base: String| async move { common::admin_stats(&base).await[MODEL].clone() };
    let during = stats(s.base.clone()).await;
    assert_eq!(during["running"], 1);
    drop(body);
    let mut freed = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let st = stats(s.base.clone()).await;
        // Only blocks kept by the prefix cache may remain.
        if st["running"] == 0 && st["kv_blocks_used"] == st["prefix_cached_blocks"] {
            freed = true;
            break;
        }
    }
    assert!(freed, "the sequence was not aborted");
    let metrics = common::client()
        .get(format!("{}/metrics", s.base))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(
        metrics.contains(&format!(
            "switchyard_aborted_requests_total{{model=\"{MODEL}\",reason=\"client_disconnect\"}} 1"
        )),
        "{metrics}"
    );
}

/// How a storm client leaves its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leave {
    /// Right after sending the request.
    BeforeHeaders,
    /// Once the response headers are in.
    AfterHeaders,
    /// After this many SSE events.
    AfterEvents(usize),
    /// At the end: reads the whole stream.
    Never,
}

/// Sends one streamed completion over a raw connection and leaves as `leave` says. Returns
/// whether the stream was read to its `[DONE]`.
async fn storm_client(addr: String, prompt: String, leave: Leave) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 12, "ignore_eos": true,
                      "stream": true})
    .to_string();
    let Ok(mut s) = tokio::net::TcpStream::connect(&addr).await else {
        return false;
    };
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    if s.write_all(head.as_bytes()).await.is_err() || leave == Leave::BeforeHeaders {
        return false;
    }
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&seen);
        let gone = match leave {
            Leave::AfterHeaders => text.contains("\r\n\r\n"),
            Leave::AfterEvents(k) => text.matches("data: ").count() >= k,
            _ => false,
        };
        if gone {
            return false;
        }
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => return text.contains("data: [DONE]"),
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    }
}

/// 1,000 streaming clients, most of which go away at a random point (before the headers,
/// after them, or after 1 to 8 tokens of 12), 200 at a time: afterwards no sequence runs or waits,
/// every K/V block is free (bar those the prefix cache keeps), the ones that stayed got their
/// whole stream, and the server answers a greedy request exactly as before the storm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_disconnecting_streams_leave_nothing_behind() {
    const CLIENTS: usize = 1000;
    const AT_ONCE: usize = 200;
    let s = start("[server]\nadmin = true\nmax_in_flight = 1000\n").await;
    let greedy = json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12,
                        "temperature": 0})
    .to_string();
    let before = post(&s.base, "/v1/completions", greedy.clone(), JSON, None).await;
    assert_eq!(before.0, 200, "{:?}", before.2);

    let addr = s.base.trim_start_matches("http://").to_string();
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(AT_ONCE));
    let mut rng_state = 0x5EED_u64;
    let mut tasks = Vec::new();
    let mut plan = Vec::new();
    for i in 0..CLIENTS {
        // xorshift: a fixed, varied plan.
        rng_state ^= rng_state << 13;
        rng_state ^= rng_state >> 7;
        rng_state ^= rng_state << 17;
        let leave = match rng_state % 10 {
            0 => Leave::BeforeHeaders,
            1 => Leave::AfterHeaders,
            2 => Leave::Never,
            r => Leave::AfterEvents(1 + (rng_state / 10 % 7) as usize + (r as usize % 2)),
        };
        plan.push(leave);
        let permit = std::sync::Arc::clone(&gate);
        let addr = addr.clone();
        let prompt = format!(
            "Story {i}: once upon a time, in a town called {}",
            i * 7919 % 1000
        );
        tasks.push(tokio::spawn(async move {
            let _p = permit.acquire_owned().await;
            storm_client(addr, prompt, leave).await
        }));
    }
    let mut done = 0;
    for (leave, t) in plan.iter().zip(tasks) {
        let finished = t.await.expect("client task");
        if *leave == Leave::Never {
            assert!(finished, "a client that read to the end did not get [DONE]");
            done += 1;
        }
    }
    let left = CLIENTS - done;
    let stats = || async { common::admin_stats(&s.base).await[MODEL].clone() };
    let mut st = stats().await;
    for _ in 0..100 {
        let settled = st["running"] == 0
            && st["waiting"] == 0
            && st["kv_blocks_used"] == st["prefix_cached_blocks"];
        if settled {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        st = stats().await;
    }
    assert_eq!(st["running"], 0, "{st}");
    assert_eq!(st["waiting"], 0, "{st}");
    assert_eq!(st["kv_blocks_used"], st["prefix_cached_blocks"], "{st}");
    let metrics = common::get_text(&s.base, "/metrics").await;
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or(0.0)
    };
    let aborted = value(&format!(
        "switchyard_aborted_requests_total{{model=\"{MODEL}\",reason=\"client_disconnect\"}}"
    ));
    let in_flight = value(&format!(
        "switchyard_requests_in_flight{{model=\"{MODEL}\"}}"
    ));
    eprintln!(
        "{CLIENTS} streams: {done} read to the end, {left} left early, {aborted} aborted as \
         disconnected; after: {st}"
    );
    assert_eq!(in_flight, 0.0);
    // Those that left after the headers, at least 4 tokens before the end, were cut off
    // (bar a few whose stream had been written in full when the server noticed). Those that
    // left before the headers may also have run to the end: a 12-token stream fits in the
    // response's buffer, and the closed connection shows only when it is written to.
    let before_headers = plan.iter().filter(|l| **l == Leave::BeforeHeaders).count();
    assert!(
        aborted <= left as f64 && aborted >= 0.95 * (left - before_headers) as f64,
        "{aborted} aborted of {left} that left ({before_headers} before the headers)"
    );
    let after = post(&s.base, "/v1/completions", greedy, JSON, None).await;
    assert_eq!(after.0, 200);
    assert_eq!(
        after.2["choices"][0]["text"],
        before.2["choices"][0]["text"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_gets_429_while_admitted_requests_finish() {
    let s = start("[server]\nmax_in_flight = 2\n").await;
    let body = json!({"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 32,
                      "ignore_eos": true, "temperature": 0})
    .to_string();
    let sends = (0..6).map(|_| post(&s.base, "/v1/completions", body.clone(), JSON, None));
    let results = futures::future::join_all(sends).await;
    let ok: Vec<&Value> = results
        .iter()
        .filter(|r| r.0 == 200)
        .map(|r| &r.2)
        .collect();
    let busy: Vec<_> = results.iter().filter(|r| r.0 == 429).collect();
    assert_eq!(ok.len() + busy.len(), 6, "{results:?}");
    assert!(
        !busy.is_empty() && ok.len() >= 2,
        "ok {} busy {}",
        ok.len(),
        busy.len()
    );
    for (_, h, v) in &busy {
        assert_eq!(
            h.get("retry-after").and_then(|v| v.to_str().ok()),
            Some("1")
        );
        assert_eq!(v["error"]["type"], "rate_limit_error");
    }
    for v in ok {
        assert_eq!(v["usage"]["completion_tokens"], 32);
        assert_eq!(v["choices"][0]["finish_reason"], "length");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_the_timeout_is_cut_off() {
    let s = start("[server]\nrequest_timeout_s = 1\n").await;
    let (st, _, v) = post(
        &s.base,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "x", "max_tokens": 5000, "ignore_eos": true}).to_string(),
        JSON,
        None,
    )
    .await;
    assert_eq!(st, 504, "{v}");
    assert_eq!(v["error"]["message"], "the request took longer than 1 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_backend_relays_a_second_instance_unchanged() {
    let a = start("").await;
    let b = start(&format!(
        "[[backends]]\nkind = \"openai\"\nname = \"relay\"\nurl = \"{}\"\nmodel = \"{MODEL}\"\n",
        a.base
    ))
    .await;
    let body = |model: &str| {
        json!({"model": model, "prompt": "The three primary colors are", "max_tokens": 16,
               "temperature": 0, "stream": true, "stream_options": {"include_usage": true}})
    };
    let (direct, direct_chunks) = common::streamed_text(&a.base, body(MODEL)).await;
    let (relayed, relayed_chunks) = common::streamed_text(&b.base, body("relay")).await;
    assert_eq!(relayed, direct);
    assert!(!relayed.is_empty());
    // Chunk by chunk the same content; only the per-request id and time differ.
    let strip = |c: &Value| {
        let mut c = c.clone();
        c["id"] = Value::Null;
        c["created"] = Value::Null;
        c
    };
    let d: Vec<Value> = direct_chunks.iter().map(strip).collect();
    let r: Vec<Value> = relayed_chunks.iter().map(strip).collect();
    assert_eq!(r, d);
    // /v1/models of the relay lists the remote model under its own name.
    let models: Value = common::client()
        .get(format!("{}/v1/models", b.base))
        .send()
        .await
        .expect("models")
        .json()
        .await
        .expect("json");
    assert_eq!(models["data"][0]["id"], "relay");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_backend_is_a_502() {
    let b = start(
        "[[backends]]\nkind = \"openai\"\nname = \"gone\"\nurl = \"http://127.0.0.1:9\"\nhealth_interval_s = 3600\n",
    )
    .await;
    let (st, _, v) = post(
        &b.base,
        "/v1/completions",
        json!({"model": "gone", "prompt": "x"}).to_string(),
        JSON,
        None,
    )
    .await;
    assert_eq!(st, 502, "{v}");
    assert_eq!(v["error"]["type"], "service_unavailable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_response_carries_a_request_id_and_cors_is_off_unless_configured() {
    let s = start("").await;
    let c = common::client();
    // A header's value, if the response has it.
    let header = |h: &reqwest::header::HeaderMap, name: &str| {
        h.get(name)
            .map(|v| v.to_str().unwrap_or_default().to_string())
    };
    let id_of = |r: &reqwest::Response| header(r.headers(), "x-request-id").unwrap_or_default();
    // A new UUID per request when the client sends none, on answers and errors alike.
    let a = c
        .get(format!("{}/health", s.base))
        .send()
        .await
        .expect("sent");
    let (st, headers, _) = post(&s.base, "/v1/completions", "{", JSON, None).await;
    assert_eq!(st, 400);
    let b = header(&headers, "x-request-id").unwrap_or_default();
    let uuid = |id: &str| {
        let parts: Vec<usize> = id.split('-').map(str::len).collect();
        parts == [8, 4, 4, 4, 12] && id.chars().all(|ch| ch == '-' || ch.is_ascii_hexdigit())
    };
    assert!(uuid(&id_of(&a)), "{:?}", id_of(&a));
    assert!(uuid(&b), "{b:?}");
    assert_ne!(id_of(&a), b);
    // The client's own id is kept.
    let r = c
        .post(format!("{}/v1/completions", s.base))
        .header("x-request-id", "trace-42.a_b")
        .json(&json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2}))
        .send()
        .await
        .expect("sent");
    assert_eq!(r.status(), 200);
    assert_eq!(id_of(&r), "trace-42.a_b");

    // No CORS configured: a browser's preflight and request get no CORS headers.
    let preflight = |base: String, origin: &'static str| {
        let c = c.clone();
        async move {
            c.request(
                reqwest::Method::OPTIONS,
                format!("{base}/v1/chat/completions"),
            )
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization,content-type",
            )
            .send()
            .await
            .expect("sent")
        }
    };
    let allow = |r: &reqwest::Response| header(r.headers(), "access-control-allow-origin");
    let models_from = |base: String| {
        let c = c.clone();
        async move {
            c.get(format!("{base}/v1/models"))
                .header("origin", "https://app.example")
                .send()
                .await
                .expect("sent")
        }
    };
    let r = preflight(s.base.clone(), "https://app.example").await;
    assert_eq!(allow(&r), None);
    let r = models_from(s.base.clone()).await;
    assert_eq!(r.status(), 200);
    assert_eq!(allow(&r), None);

    // Configured: the listed origin is allowed, another is not.
    let s = start("[server]\ncors_allowed_origins = [\"https://app.example\"]\n").await;
    let r = preflight(s.base.clone(), "https://app.example").await;
    assert_eq!(r.status(), 200);
    assert_eq!(allow(&r).as_deref(), Some("https://app.example"));
    let methods = header(r.headers(), "access-control-allow-methods").unwrap_or_default();
    assert!(methods.contains("POST"), "{methods}");
    let r = preflight(s.base.clone(), "https://evil.example").await;
    assert_eq!(allow(&r), None);
    let r = models_from(s.base.clone()).await;
    assert_eq!(allow(&r).as_deref(), Some("https://app.example"));
}
