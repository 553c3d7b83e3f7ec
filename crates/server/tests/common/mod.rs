//! An in-process server on a free loopback port, for the HTTP tests; [`synthetic`] serves
//! tiny random models instead of the zoo's.
#![allow(dead_code)]

pub mod synthetic;

use std::sync::Arc;

use switchyard_server::config::Config;
use switchyard_server::state::AppState;

pub const MODEL: &str = "smollm2-135m-instruct";

/// The test model as a HELIOS repository entry: an exit at layer 25 of 30 through the logit
/// lens, with telemetry of the right order for this machine.
pub const HELIOS_LOCAL_ENTRY: &str = r#"[[model]]
name = "smollm2-135m-instruct"
size_bytes = 98362432
layers = 30
exit_layers = [25]
exit_heads = "logit-lens"

[[model.depth]]
depth = 25
tokens_per_s = 66.0
bits_per_byte = 1.6
memory_bytes = 82000000

[[model.depth]]
depth = 30
tokens_per_s = 55.0
bits_per_byte = 1.1
memory_bytes = 98362432
"#;

/// The candidate a HELIOS response names in `x-switchyard-served-by`.
pub fn served_by(headers: &reqwest::header::HeaderMap) -> Option<&str> {
    headers
        .get("x-switchyard-served-by")
        .and_then(|v| v.to_str().ok())
}

pub struct TestServer {
    pub base: String,
    pub state: Arc<AppState>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A server for `toml` (the `[[models]]` entry for the test model is added when absent).
pub async fn start(toml: &str) -> TestServer {
    start_at(toml, "127.0.0.1:0").await
}

/// [`start`] on the address `addr` (`host:port`).
pub async fn start_at(toml: &str, addr: &str) -> TestServer {
    let toml = if toml.contains("[[models]]") || toml.contains("[[backends]]") {
        toml.to_string()
    } else {
        format!("{toml}\n[[models]]\nname = \"{MODEL}\"\nmemory_budget = \"256MiB\"\n")
    };
    let cfg = Config::parse(&toml).expect("test config");
    let state = switchyard_server::build_state(&cfg)
        .await
        .expect("engines start");
    let listener = tokio::net::TcpListener::bind(addr).await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let app = switchyard_server::router(state.clone());
    let task = tokio::spawn(switchyard_server::listen::serve_connections(
        listener,
        app,
        switchyard_server::listen::ConnectionLimits::of(&state.config),
        Some(state.metrics.clone()),
        std::future::pending(),
    ));
    TestServer {
        base: format!("http://{addr}"),
        state,
        task,
    }
}

/// A server on a runtime of its own, as if in another process: [`Detached::kill`] drops that
/// runtime, which ends every connection it had open at once.
pub struct Detached {
    pub base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Detached {
    pub fn kill(mut self) {
        self.end();
    }

    fn end(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Detached {
    fn drop(&mut self) {
        self.end();
    }
}

/// [`start_at`] on a runtime of its own thread; returns once it listens.
pub fn start_detached(toml: &str, addr: &str) -> Detached {
    let (toml, addr) = (toml.to_string(), addr.to_string());
    let (started, base) = std::sync::mpsc::channel();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let server = start_at(&toml, &addr).await;
            let _ = started.send(server.base.clone());
            let _ = stopped.await;
        });
        // The runtime drops here, and every connection task with it.
    });
    let base = base.recv().expect("the detached server started");
    Detached {
        base,
        stop: Some(stop),
        thread: Some(thread),
    }
}

/// Why a server with configuration `toml` fails to start (empty when it starts).
pub async fn start_error(toml: &str) -> String {
    let cfg = Config::parse(toml).expect("the configuration parses");
    switchyard_server::build_state(&cfg)
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
}

/// `GET /admin/stats` (the server must have `admin = true`), every model's entry.
pub async fn admin_stats(base: &str) -> serde_json::Value {
    client()
        .get(format!("{base}/admin/stats"))
        .send()
        .await
        .expect("stats")
        .json()
        .await
        .expect("stats JSON")
}

pub fn client() -> reqwest::Client {
    reqwest::Client::new()
}

/// The body of `GET path` as text.
pub async fn get_text(base: &str, path: &str) -> String {
    client()
        .get(format!("{base}{path}"))
        .send()
        .await
        .expect("request sent")
        .text()
        .await
        .expect("body")
}

/// Posts JSON text to `path`; returns status, headers and the body as JSON (Null if not JSON).
pub async fn post(
    base: &str,
    path: &str,
    body: impl Into<reqwest::Body>,
    content_type: &str,
    key: Option<&str>,
) -> (u16, reqwest::header::HeaderMap, serde_json::Value) {
    let mut r = client()
        .post(format!("{base}{path}"))
        .header("content-type", content_type)
        .body(body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let resp = r.send().await.expect("request sent");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await.unwrap_or_default();
    (
        status,
        headers,
        serde_json::from_str(&text).unwrap_or(serde_json::Value::Null),
    )
}

/// The `data:` payloads of a server-sent-event body.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

/// A streamed `/v1/completions` request.
pub struct Streamed {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    /// The chunks' texts joined.
    pub text: String,
    /// Every event before `[DONE]`, parsed.
    pub chunks: Vec<serde_json::Value>,
}

/// Posts a streamed completion request; the stream must end with `[DONE]`.
pub async fn stream_completion(base: &str, body: serde_json::Value) -> Streamed {
    let resp = client()
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("sent");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.text().await.expect("body");
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    let chunks: Vec<serde_json::Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("chunk is JSON"))
        .collect();
    let text = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    Streamed {
        status,
        headers,
        text,
        chunks,
    }
}

/// A streamed completion that must succeed: its text and chunks.
pub async fn streamed_text(
    base: &str,
    body: serde_json::Value,
) -> (String, Vec<serde_json::Value>) {
    let s = stream_completion(base, body).await;
    assert_eq!(s.status, 200);
    (s.text, s.chunks)
}

/// `base` with `extra`'s fields added (a request body and its per-case parameters).
pub fn merged(mut base: serde_json::Value, extra: &serde_json::Value) -> serde_json::Value {
    if let (Some(b), Some(e)) = (base.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    base
}
