//! Structured outputs on real models over HTTP: `response_format` (`json_object`,
//! `json_schema`) and vLLM's `guided_regex`, `guided_choice` and `guided_grammar`, enforced
//! by constrained decoding. Every output is checked by an independent validator (the
//! `jsonschema` crate, the `regex` syntax of the guide, exact set membership).

use crate::common;

use crate::common::{post, sse_data, start};
use futures::future::join_all;
use serde_json::{json, Value};

const JSON: &str = "application/json";

/// Nested objects, enums, arrays, bounded strings and integers.
fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 24},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}
                },
                "required": ["city", "zip"],
                "additionalProperties": false
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}
        },
        "required": ["name", "age", "role", "address", "tags"],
        "additionalProperties": false
    })
}

const PEOPLE: [&str; 10] = [
    "a retired sailor",
    "a young violinist",
    "a chess champion",
    "a baker from Lyon",
    "a software engineer",
    "a marathon runner",
    "a beekeeper",
    "a school teacher",
    "an astronaut",
    "a librarian",
];
const ASKS: [&str; 5] = [
    "Describe {} as JSON.",
    "Invent a profile for {}.",
    "Give me a record for {}.",
    "Fill in the form for {}.",
    "Make up details about {}.",
];

/// 50 different prompts.
fn prompts() -> Vec<String> {
    ASKS.iter()
        .flat_map(|a| PEOPLE.iter().map(move |p| a.replace("{}", p)))
        .collect()
}

/// The assistant's text of a chat request, streamed or not.
async fn chat_text(base: &str, body: Value) -> (u16, String, Value) {
    if body["stream"] == json!(true) {
        let resp = common::client()
            .post(format!("{base}/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .expect("sent");
        let status = resp.status().as_u16();
        let text = resp.text().await.expect("body");
        let data = sse_data(&text);
        let mut out = String::new();
        let mut finish = Value::Null;
        for d in data.iter().filter(|d| *d != "[DONE]") {
            let v: Value = serde_json::from_str(d).expect("chunk");
            out.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
            if !v["choices"][0]["finish_reason"].is_null() {
                finish = v["choices"][0]["finish_reason"].clone();
            }
        }
        (status, out, finish)
    } else {
        let (st, _, v) = post(base, "/v1/chat/completions", body.to_string(), JSON, None).await;
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        (st, text, v["choices"][0]["finish_reason"].clone())
    }
}

/// 50 prompts under the schema, every other one streamed, all in flight together: every
/// output parses and validates.
async fn fifty_valid(model: &str) {
    let s = start(&format!(
        "[[models]]\nname = \"{model}\"\nmemory_budget = \"1GiB\"\n"
    ))
    .await;
    let schema = person_schema();
    let validator = jsonschema::validator_for(&schema).expect("the schema compiles");
    let requests = prompts().into_iter().enumerate().map(|(i, p)| {
        let body = json!({
            "model": model,
            "messages": [{"role": "user", "content": p}],
            "max_tokens": 200, "temperature": 0.7, "seed": i,
            "stream": i % 2 == 1,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": schema, "strict": true}},
        });
        let base = s.base.clone();
        async move { (i, chat_text(&base, body).await) }
    });
    let results = join_all(requests).await;
    assert_eq!(results.len(), 50);
    for (i, (status, text, finish)) in results {
        assert_eq!(status, 200, "{model} #{i}: {text}");
        assert_eq!(finish, "stop", "{model} #{i} was cut off: {text}");
        let v: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{model} #{i}: not JSON ({e}): {text}"));
        let errors: Vec<String> = validator.iter_errors(&v).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{model} #{i}: {errors:?} in {text}");
    }
    // The server's account of what the constraints cost, counted in the same steps.
    let metrics = common::get_text(&s.base, "/metrics").await;
    let seconds = |kind: &str| -> f64 {
        let label = format!("kind=\"{kind}\"");
        metrics
            .lines()
            .filter(|l| {
                l.starts_with("switchyard_constrained_seconds_total{") && l.contains(&label)
            })
            .find_map(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no constrained {kind} seconds in /metrics:\n{metrics}"))
    };
    let (constraint, step) = (seconds("constraint"), seconds("step"));
    assert!(
        constraint > 0.0 && constraint < step,
        "{model}: {constraint} s of {step} s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_holds_on_fifty_prompts_smollm2() {
    fifty_valid("smollm2-135m-instruct").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_holds_on_fifty_prompts_qwen_coder() {
    fifty_valid("qwen2.5-coder-0.5b-instruct").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regex_choice_grammar_and_json_object_hold_and_bad_guides_get_400() {
    let s = start("").await;
    let m = common::MODEL;
    let ask = |content: &str, extra: Value| {
        let b = json!({"model": m, "messages": [{"role": "user", "content": content}],
                       "max_tokens": 40, "temperature": 0.8});
        common::merged(b, &extra)
    };
    let phone = regex_lite(r"^[0-9]{3}-[0-9]{4}$");
    let choices = ["yes", "no", "maybe"];
    let number = regex_lite(r"^The answer is [0-9]{1,3}\.$");
    for seed in 0..6 {
        let (st, text, _) = chat_text(
            &s.base,
            ask(
                "What is your phone number?",
                json!({"guided_regex": "[0-9]{3}-[0-9]{4}", "seed": seed, "stream": seed % 2 == 0}),
            ),
        )
        .await;
        assert_eq!(st, 200);
        assert!(phone(&text), "{text:?}");
        let (_, text, _) = chat_text(
            &s.base,
            ask(
                "Is the sky green?",
                json!({"guided_choice": choices, "seed": seed}),
            ),
        )
        .await;
        assert!(choices.contains(&text.as_str()), "{text:?}");
        let grammar = "start: \"The answer is \" NUMBER \".\"\nNUMBER: /[0-9]{1,3}/\n";
        let (_, text, _) = chat_text(
            &s.base,
            ask(
                "What is 6 times 7?",
                json!({"guided_grammar": grammar, "seed": seed}),
            ),
        )
        .await;
        assert!(number(&text), "{text:?}");
        let (_, text, finish) = chat_text(
            &s.base,
            ask(
                "Give me a JSON object about a cat.",
                json!({"response_format": {"type": "json_object"}, "seed": seed, "max_tokens": 120}),
            ),
        )
        .await;
        if finish == "stop" {
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            assert!(v.is_object(), "{text}");
        } else {
            // Cut off by max_tokens: still a prefix of an object.
            assert!(text.starts_with('{'), "{text}");
        }
    }
    // Bad guides: 400 naming the problem; the server goes on.
    for (extra, status, needle) in [
        (json!({"guided_regex": "([a-z"}), 400, "invalid regex"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}),
            400,
            "invalid json_schema",
        ),
        (
            json!({"guided_grammar": "start: foo"}),
            400,
            "invalid grammar",
        ),
        (json!({"guided_choice": []}), 400, "invalid choice"),
        (
            json!({"response_format": {"type": "yaml"}}),
            422,
            "unknown `response_format.type`",
        ),
        (
            json!({"guided_regex": "a", "guided_choice": ["a"]}),
            422,
            "give one output constraint",
        ),
    ] {
        let (st, _, v) = post(
            &s.base,
            "/v1/chat/completions",
            ask("x", extra.clone()).to_string(),
            JSON,
            None,
        )
        .await;
        assert_eq!(st, status, "{extra}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{extra}: {msg}");
    }
}

/// A full-match check for the simple patterns above (digits, literal text, bounded repeats),
/// written out so the test does not reuse the grammar engine it checks.
fn regex_lite(pattern: &'static str) -> impl Fn(&str) -> bool {
    move |text: &str| match pattern {
        r"^[0-9]{3}-[0-9]{4}$" => {
            let b = text.as_bytes();
            b.len() == 8 && b[3] == b'-' && b[..3].iter().chain(&b[4..]).all(u8::is_ascii_digit)
        }
        r"^The answer is [0-9]{1,3}\.$" => text
            .strip_prefix("The answer is ")
            .and_then(|t| t.strip_suffix('.'))
            .is_some_and(|d| (1..=3).contains(&d.len()) && d.bytes().all(|c| c.is_ascii_digit())),
        _ => false,
    }
}
