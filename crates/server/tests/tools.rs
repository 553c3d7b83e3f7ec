//! Tool calls on Qwen2.5-Coder-0.5B-Instruct over HTTP: the tools rendered by the model's own
//! template, a forced call parsed back into `tool_calls` (non-streamed and streamed, the same
//! call), the `tool` turn rendered in the history and a final answer after it; a model whose
//! template has no tools gets a 400.

use crate::common;

use crate::common::{post, sse_data, start};
use serde_json::{json, Value};

const JSON: &str = "application/json";
const QWEN: &str = "qwen2.5-coder-0.5b-instruct";

fn weather_tool() -> Value {
    json!([{"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 40},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": false}
    }}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_call_round_trip_on_qwen() {
    let s = start(&format!(
        "[[models]]\nname = \"{QWEN}\"\nmemory_budget = \"1GiB\"\n[[models]]\nname = \"{}\"\nmemory_budget = \"256MiB\"\n",
        common::MODEL
    ))
    .await;
    let user = json!({"role": "user", "content": "What is the weather in Paris right now?"});
    let body = json!({
        "model": QWEN, "messages": [user], "tools": weather_tool(),
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 80, "temperature": 0,
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
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert!(choice["message"]["content"].is_null(), "{v}");
    let calls = choice["message"]["tool_calls"]
        .as_array()
        .expect("tool_calls");
    assert_eq!(calls.len(), 1);
    let call = &calls[0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().expect("string"))
        .expect("arguments are JSON");
    assert!(
        args["city"].as_str().is_some_and(|c| !c.is_empty()),
        "{args}"
    );
    assert!(["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap_or("")));
    let id = call["id"].as_str().expect("id").to_string();

    // Streamed: the deltas reassemble to the same call.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let text = common::client()
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&streamed)
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("body");
    let mut name = String::new();
    let mut arguments = String::new();
    let mut finish = Value::Null;
    let mut pieces = 0;
    for d in sse_data(&text).iter().filter(|d| *d != "[DONE]") {
        let c: Value = serde_json::from_str(d).expect("chunk");
        let choice = &c["choices"][0];
        for tc in choice["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            assert_eq!(tc["index"], 0);
            // The id, type and name come once, in the call's first delta.
            assert_eq!(tc["id"].is_string(), name.is_empty(), "{tc}");
            name.push_str(tc["function"]["name"].as_str().unwrap_or(""));
            let piece = tc["function"]["arguments"].as_str().unwrap_or("");
            pieces += usize::from(!piece.is_empty());
            arguments.push_str(piece);
        }
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
    }
    assert_eq!(finish, "tool_calls");
    assert_eq!(name, "get_weather");
    // Streamed as the tokens come, not whole at the end.
    assert!(pieces >= 5, "the arguments came in {pieces} pieces");
    assert_eq!(
        arguments,
        call["function"]["arguments"].as_str().unwrap_or("")
    );

    // The tool's answer goes back; the model answers in text.
    let history = json!([
        user,
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": id, "content": "{\"temperature\": 21, \"sky\": \"clear\"}"},
    ]);
    let (st, _, v) = post(
        &s.base,
        "/v1/chat/completions",
        json!({"model": QWEN, "messages": history, "tools": weather_tool(),
               "tool_choice": "none", "max_tokens": 60, "temperature": 0})
        .to_string(),
        JSON,
        None,
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
    assert!(answer.contains("21"), "{answer}");
    assert!(v["choices"][0]["message"]["tool_calls"].is_null());

    // The history renders the call and the tool turn through the template.
    let (_, _, t) = post(
        &s.base,
        "/tokenize",
        json!({"model": QWEN, "messages": history}).to_string(),
        JSON,
        None,
    )
    .await;
    let ids = t["tokens"].clone();
    let (_, _, d) = post(
        &s.base,
        "/detokenize",
        json!({"model": QWEN, "tokens": ids}).to_string(),
        JSON,
        None,
    )
    .await;
    let rendered = d["prompt"].as_str().unwrap_or("");
    assert!(
        rendered.contains("<tool_call>\n{\"name\": \"get_weather\""),
        "{rendered}"
    );
    assert!(
        rendered.contains("<tool_response>\n{\"temperature\": 21"),
        "{rendered}"
    );

    // SmolLM2's template has no tools: a 400 that says so.
    let (st, _, v) = post(
        &s.base,
        "/v1/chat/completions",
        json!({"model": common::MODEL, "messages": [{"role": "user", "content": "hi"}],
               "tools": weather_tool()})
        .to_string(),
        JSON,
        None,
    )
    .await;
    assert_eq!(st, 400, "{v}");
    assert_eq!(
        v["error"]["message"],
        format!(
            "the chat template of `{}` does not render tools",
            common::MODEL
        )
    );
}
