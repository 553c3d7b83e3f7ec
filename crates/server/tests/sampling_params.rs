//! The OpenAI / vLLM sampling parameters on a real model (smollm2-135m-instruct) over HTTP:
//! `logit_bias`, presence and frequency penalties, `top_logprobs` / `logprobs: k`, `n`,
//! `min_tokens`, `stop_token_ids`, `echo`, `max_completion_tokens`, and vLLM's `/tokenize`
//! and `/detokenize`. Every check is a number: exact token ids, or log-probabilities within
//! 1e-4 of a transformation computed from the server's own unbiased output.

use crate::common;

use crate::common::{post, sse_data, start, MODEL};
use serde_json::{json, Value};

const JSON: &str = "application/json";
/// Under 16 tokens: no full K/V block is cached between requests, so two requests over this
/// prompt compute their logits the same way, bit for bit.
const PROMPT: &str = "The capital of France is";

async fn completion(base: &str, body: Value) -> Value {
    let (st, _, v) = post(base, "/v1/completions", body.to_string(), JSON, None).await;
    assert_eq!(st, 200, "{v}");
    v
}

/// Position `pos`'s alternatives as (token id, log-probability), most likely first.
fn alternatives(v: &Value, pos: usize) -> Vec<(u32, f64)> {
    let top = v["choices"][0]["logprobs"]["top_logprobs"][pos]
        .as_object()
        .expect("top_logprobs map");
    let mut out: Vec<(u32, f64)> = top
        .iter()
        .map(|(k, lp)| {
            let id = k
                .strip_prefix("token_id:")
                .and_then(|i| i.parse().ok())
                .expect("token_id:N");
            (id, lp.as_f64().expect("number"))
        })
        .collect();
    out.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    out
}

fn sampled_ids(v: &Value) -> Vec<u32> {
    v["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| {
            t.as_str()
                .and_then(|s| s.strip_prefix("token_id:"))
                .and_then(|i| i.parse().ok())
                .expect("token_id:N")
        })
        .collect()
}

fn greedy(max_tokens: usize, extra: Value) -> Value {
    let body = json!({
        "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": 20, "return_tokens_as_token_ids": true,
    });
    common::merged(body, &extra)
}

/// Biasing tokens by b changes every log-probability to lp + b_i − log Σ_j p_j e^{b_j}; for
/// biases on tokens of the unbiased top 20, that is computable from the unbiased listing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_and_penalties_move_logprobs_exactly_as_the_reference() {
    let s = start("").await;
    let plain = completion(&s.base, greedy(2, json!({}))).await;
    let top = alternatives(&plain, 0);
    assert_eq!(top.len(), 20);
    let first = sampled_ids(&plain)[0];
    assert_eq!(first, top[0].0, "greedy takes the most likely token");

    // logit_bias: ban the greedy token, lift the fifth.
    let (ban, lift) = (top[0].0, top[4].0);
    let biased = completion(
        &s.base,
        greedy(
            1,
            json!({"logit_bias": {ban.to_string(): -100, lift.to_string(): 1.5}}),
        ),
    )
    .await;
    let p = |i: usize| top[i].1.exp();
    let log_z = (1.0 - p(0) - p(4) + p(0) * (-100f64).exp() + p(4) * 1.5f64.exp()).ln();
    let want = |id: u32, lp: f64| {
        let b = if id == ban {
            -100.0
        } else if id == lift {
            1.5
        } else {
            0.0
        };
        lp + b - log_z
    };
    let got = alternatives(&biased, 0);
    assert!(got.iter().all(|&(id, _)| id != ban), "a -100 bias bans");
    for &(id, lp) in &top[1..] {
        let g = got.iter().find(|a| a.0 == id).map(|a| a.1);
        if let Some(g) = g {
            assert!(
                (g - want(id, lp)).abs() < 1e-4,
                "token {id}: {g} vs {}",
                want(id, lp)
            );
        }
    }
    let next = sampled_ids(&biased)[0];
    let best = top[1..]
        .iter()
        .map(|&(id, lp)| (id, want(id, lp)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .expect("alternatives");
    assert_eq!(next, best.0, "greedy under the bias");

    // Presence and frequency penalties: nothing changes at the first position (no output yet);
    // at the second, the first token's logit drops by presence + frequency × 1.
    let penalized = completion(
        &s.base,
        greedy(
            2,
            json!({"presence_penalty": 0.7, "frequency_penalty": 0.4}),
        ),
    )
    .await;
    for (a, b) in alternatives(&plain, 0)
        .iter()
        .zip(alternatives(&penalized, 0))
    {
        assert_eq!(a.0, b.0);
        assert!((a.1 - b.1).abs() < 1e-6, "{a:?} vs {b:?}");
    }
    assert_eq!(sampled_ids(&penalized)[0], first);
    let second = alternatives(&plain, 1);
    let delta = 1.1f64;
    if let Some(&(_, lp_first)) = second.iter().find(|a| a.0 == first) {
        let p_first = lp_first.exp();
        let log_z = (1.0 - p_first + p_first * (-delta).exp()).ln();
        let got = alternatives(&penalized, 1);
        for &(id, lp) in &second {
            let want = lp - if id == first { delta } else { 0.0 } - log_z;
            if let Some(g) = got.iter().find(|a| a.0 == id) {
                assert!((g.1 - want).abs() < 1e-4, "token {id}: {} vs {want}", g.1);
            }
        }
    } else {
        // Not among the 20: every listed token moves by the same −log Z ≥ 0 shift.
        let got = alternatives(&penalized, 1);
        let shift = got[0].1 - second[0].1;
        assert!(shift >= -1e-6);
        for (a, b) in second.iter().zip(&got) {
            assert_eq!(a.0, b.0);
            assert!((b.1 - a.1 - shift).abs() < 1e-4);
        }
    }
    // The sampled token's log-probability is its entry in the listing.
    let lp0 = plain["choices"][0]["logprobs"]["token_logprobs"][0]
        .as_f64()
        .expect("logprob");
    assert!((lp0 - top[0].1).abs() < 1e-9);
    let mass: f64 = top.iter().map(|a| a.1.exp()).sum();
    assert!(mass <= 1.0 + 1e-6, "{mass}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_top_logprobs_list_the_alternatives() {
    let s = start("").await;
    let body = json!({
        "model": MODEL, "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 3, "temperature": 0, "logprobs": true, "top_logprobs": 5,
    });
    let (st, _, v) = post(
        &s.base,
        "/v1/chat/completions",
        body.to_string(),
        JSON,
        None,
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("content");
    assert_eq!(content.len(), 3);
    for c in content {
        let alts = c["top_logprobs"].as_array().expect("top_logprobs");
        assert_eq!(alts.len(), 5, "{c}");
        // Greedy: the sampled token is the first alternative, with the same numbers.
        assert_eq!(alts[0]["token"], c["token"]);
        assert_eq!(alts[0]["logprob"], c["logprob"]);
        let lps: Vec<f64> = alts.iter().filter_map(|a| a["logprob"].as_f64()).collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]), "{lps:?}");
        let bytes: Vec<u8> = alts[1]["bytes"]
            .as_array()
            .expect("bytes")
            .iter()
            .filter_map(|b| b.as_u64().map(|b| b as u8))
            .collect();
        assert_eq!(
            Some(String::from_utf8_lossy(&bytes).as_ref()),
            alts[1]["token"].as_str()
        );
    }
}

/// `n` = 4 with a seed: four choices, the same four again, and the prompt's full blocks
/// computed once (the other choices find them in the prefix cache).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_are_reproducible_and_share_the_prompt() {
    let s = start("[server]\nadmin = true\n").await;
    // 40 tokens or so: two full blocks of 16 and a partial one.
    let prompt = "Once upon a time, in a small village by the sea, there lived an old fisherman \
                  who had a daughter. Every morning he went out in his boat, and every evening";
    let prompt_tokens = {
        let (_, _, v) = post(
            &s.base,
            "/tokenize",
            json!({"model": MODEL, "prompt": prompt}).to_string(),
            JSON,
            None,
        )
        .await;
        v["count"].as_u64().expect("count") as usize
    };
    assert!(prompt_tokens > 32, "{prompt_tokens}");
    let computed = |stats: &Value| {
        stats[MODEL]["counters"]["prompt_tokens_computed"]
            .as_u64()
            .expect("counter")
    };
    let stats = || common::admin_stats(&s.base);
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 1.0,
                      "seed": 11, "n": 4});
    let before = computed(&stats().await);
    let a = completion(&s.base, body.clone()).await;
    let after = computed(&stats().await);
    let texts = |v: &Value| -> Vec<String> {
        let choices = v["choices"].as_array().expect("choices");
        assert_eq!(choices.len(), 4);
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(c["index"], i);
        }
        choices
            .iter()
            .map(|c| c["text"].as_str().expect("text").to_string())
            .collect()
    };
    let ta = texts(&a);
    let distinct: std::collections::BTreeSet<&String> = ta.iter().collect();
    assert!(distinct.len() > 1, "{ta:?}");
    assert_eq!(a["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(a["usage"]["completion_tokens"], 32);
    // Choice 0 computes the prompt; the other three only its last, partial block.
    let tail = prompt_tokens % 16;
    assert_eq!(after - before, (prompt_tokens + 3 * tail) as u64);
    // Same seed, same choices; choice i is the single request with seed 11 + i.
    let b = completion(&s.base, body.clone()).await;
    assert_eq!(texts(&b), ta);
    let mut one = body.clone();
    one["n"] = json!(1);
    one["seed"] = json!(13);
    let c = completion(&s.base, one).await;
    assert_eq!(c["choices"][0]["text"].as_str(), Some(ta[2].as_str()));

    // Streamed: the chunks of each index join to that choice's text.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let text = common::client()
        .post(format!("{}/v1/completions", s.base))
        .json(&streamed)
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("body");
    let data = sse_data(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let mut joined = vec![String::new(); 4];
    let mut usage = Value::Null;
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).expect("chunk");
        if let Some(c) = v["choices"].as_array().and_then(|c| c.first()) {
            let i = c["index"].as_u64().expect("index") as usize;
            joined[i].push_str(c["text"].as_str().unwrap_or(""));
        } else {
            usage = v["usage"].clone();
        }
    }
    assert_eq!(joined, ta);
    assert_eq!(usage["completion_tokens"], 32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_tokens_stop_token_ids_echo_and_max_completion_tokens() {
    let s = start("").await;
    // Greedy reference: 12 tokens.
    let plain = completion(&s.base, greedy(12, json!({}))).await;
    let ids = sampled_ids(&plain);
    assert_eq!(ids.len(), 12);
    // stop_token_ids: generation ends before the first occurrence of the chosen id, which is
    // not output, with finish_reason "stop".
    let stop_at = 3;
    let id = ids[stop_at];
    let first = ids.iter().position(|&t| t == id).expect("present");
    let v = completion(&s.base, greedy(12, json!({"stop_token_ids": [id]}))).await;
    assert_eq!(sampled_ids(&v), ids[..first].to_vec());
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // Even with ignore_eos.
    let v = completion(
        &s.base,
        greedy(12, json!({"stop_token_ids": [id], "ignore_eos": true})),
    )
    .await;
    assert_eq!(sampled_ids(&v).len(), first);

    // min_tokens: a chat answer that ends on its own goes on to at least min_tokens tokens.
    let chat = |extra: Value| {
        let b = json!({"model": MODEL, "messages": [{"role": "user", "content": "Say OK."}],
                       "max_tokens": 60, "temperature": 0});
        common::merged(b, &extra).to_string()
    };
    let (_, _, short) = post(&s.base, "/v1/chat/completions", chat(json!({})), JSON, None).await;
    let n = short["usage"]["completion_tokens"]
        .as_u64()
        .expect("tokens");
    assert_eq!(short["choices"][0]["finish_reason"], "stop", "{short}");
    assert!(n < 50, "{short}");
    let (_, _, long) = post(
        &s.base,
        "/v1/chat/completions",
        chat(json!({"min_tokens": n + 5})),
        JSON,
        None,
    )
    .await;
    let m = long["usage"]["completion_tokens"].as_u64().expect("tokens");
    assert!(m >= n + 5, "{m} < {} in {long}", n + 5);

    // echo: the prompt's text comes first; max_completion_tokens wins over max_tokens.
    let v = completion(
        &s.base,
        json!({"model": MODEL, "prompt": PROMPT, "echo": true, "max_tokens": 9,
               "max_completion_tokens": 4, "temperature": 0}),
    )
    .await;
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(
        v["choices"][0]["text"].as_str(),
        Some(format!("{PROMPT} Paris.\n\n").as_str())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize_round_trip() {
    let s = start("").await;
    let (st, _, v) = post(
        &s.base,
        "/tokenize",
        json!({"model": MODEL, "prompt": "Hello, world!"}).to_string(),
        JSON,
        None,
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let tokens = v["tokens"].clone();
    assert_eq!(v["count"], tokens.as_array().map_or(0, Vec::len));
    assert_eq!(v["max_model_len"], 8192);
    // SmolLM2's tokenizer: no BOS is added; "Hello", ",", " world", "!".
    assert_eq!(tokens, json!([19556, 28, 905, 17]));
    let (st, _, v) = post(
        &s.base,
        "/detokenize",
        json!({"model": MODEL, "tokens": tokens}).to_string(),
        JSON,
        None,
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["prompt"], "Hello, world!");
    // A chat: the template's tokens, ending with the assistant turn's header.
    let (_, _, v) = post(
        &s.base,
        "/tokenize",
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}).to_string(),
        JSON,
        None,
    )
    .await;
    let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).expect("ids");
    let (_, _, text) = post(
        &s.base,
        "/detokenize",
        json!({"model": MODEL, "tokens": ids}).to_string(),
        JSON,
        None,
    )
    .await;
    let text = text["prompt"].as_str().expect("text");
    assert!(text.ends_with("<|im_start|>assistant\n"), "{text:?}");
    // Errors name the field.
    for (path, body, status) in [
        ("/tokenize", json!({"model": MODEL}), 422),
        ("/tokenize", json!({"model": "nope", "prompt": "x"}), 404),
        (
            "/detokenize",
            json!({"model": MODEL, "tokens": [1, 10_000_000]}),
            422,
        ),
        ("/detokenize", json!({"model": MODEL, "tokens": "abc"}), 422),
    ] {
        let (st, _, v) = post(&s.base, path, body.to_string(), JSON, None).await;
        assert_eq!(st, status, "{path} {body}: {v}");
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
}
