//! The official OpenAI Python client against the server, and /metrics through the Prometheus
//! client's text-format parser; structured outputs and tool calls through the official client
//! and LangChain's `ChatOpenAI` (all installed into a cached virtualenv on first use).

use std::path::PathBuf;
use std::process::Command;

use crate::common::{start, MODEL};

/// Pinned versions of the Python clients the test drives.
const CLIENTS: &[&str] = &[
    "openai==3.57.0",
    "prometheus_client==0.26.0",
    "jsonschema==4.26.0",
    "langchain-core==1.8.3",
    "langchain-openai==1.7.4",
];

/// A virtualenv with the clients, under the Switchyard cache (made once, under a file lock).
fn client_python() -> PathBuf {
    let dir = switchyard_zoo::home().join("venvs").join("test-clients");
    std::fs::create_dir_all(dir.parent().unwrap_or(&dir)).expect("cache dir");
    let lock_path = dir.with_extension("lock");
    let lock = std::fs::File::create(&lock_path).expect("lock file");
    fs4::fs_std::FileExt::lock_exclusive(&lock).expect("lock");
    let python = dir.join("bin").join("python");
    let stamp = dir.join(".installed");
    let want = CLIENTS.join(" ");
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(want.as_str()) {
        let st = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&dir)
            .status()
            .expect("python3 -m venv");
        assert!(st.success(), "creating the virtualenv failed");
        let st = Command::new(&python)
            .args(["-m", "pip", "install", "--quiet"])
            .args(CLIENTS)
            .status()
            .expect("pip install");
        assert!(st.success(), "installing {want} failed");
        std::fs::write(&stamp, &want).expect("stamp");
    }
    python
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_client_and_prometheus_parser() {
    let python = tokio::task::spawn_blocking(client_python)
        .await
        .expect("venv");
    let s = start("").await;
    // Expected prompt token counts from the model's own tokenizer.
    let info = match s.state.models.get(MODEL) {
        Some(switchyard_server::state::Served::Local(m)) => m.info.clone(),
        _ => panic!("local model missing"),
    };
    let tok = &info.tokenizer;
    let completion = tok
        .encode("The capital of France is", true, true)
        .expect("encode")
        .len();
    let chat_text = tok
        .apply_chat_template(
            &[switchyard_tokenizer::ChatMessage::new(
                "user",
                "Name a color.",
            )],
            true,
        )
        .expect("template");
    let chat = tok.encode(&chat_text, true, true).expect("encode").len();
    let expected = serde_json::json!({"completion": completion, "chat": chat}).to_string();
    run_checks(
        python,
        "openai_client.py",
        vec![s.base.clone(), MODEL.into(), expected],
    )
    .await;
}

/// Runs `tests/python/<script>` with `args`; its checks passed when it printed "ok" alone.
async fn run_checks(python: PathBuf, script: &str, args: Vec<String>) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python")
        .join(script);
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .args(args)
            .output()
            .expect("python runs")
    })
    .await
    .expect("join");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python checks failed:\n{stdout}\n{stderr}"
    );
    assert_eq!(stdout.trim(), "ok");
}

const QWEN: &str = "qwen2.5-coder-0.5b-instruct";

/// Structured outputs (50 schema-bound prompts on each model, half streamed, all in flight at
/// once; json_object; the client's `parse` with a Pydantic model; guided regex and choice)
/// and a tool-call round trip (streamed deltas joined to the same call), through the official
/// client; then LangChain's structured output and tool round trip, plain and streamed. The
/// checks are in `tests/python/clients_structured.py`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_client_and_langchain_structured_outputs_and_tools() {
    let python = tokio::task::spawn_blocking(client_python)
        .await
        .expect("venv");
    let s = start(&format!(
        "[[models]]\nname = \"{QWEN}\"\nmemory_budget = \"1GiB\"\n[[models]]\nname = \"{MODEL}\"\nmemory_budget = \"1GiB\"\n"
    ))
    .await;
    let args = vec![s.base.clone(), MODEL.into(), QWEN.into()];
    run_checks(python, "clients_structured.py", args).await;
}
