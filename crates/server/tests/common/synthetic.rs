//! A server over tiny random models, for tests about serving under hostile input rather than
//! about text: engines start in milliseconds, and the server runs on a runtime of its own with
//! two workers, as `switchyard serve` does, so a test's client is never starved with it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::quantized::GgmlDType;
use switchyard_engine::{EngineConfig, EngineHandle, SchedulerConfig};
use switchyard_models::{LayeredModel, LoadOptions};
use switchyard_server::config::Config;
use switchyard_server::local::LocalModel;
use switchyard_server::state::{AppState, Served};
use switchyard_tokenizer::Tokenizer;
use switchyard_weights::{Architecture, MetaValue, Metadata, SyntheticSource};

/// Tokens of the synthetic vocabulary.
pub const VOCAB: usize = 256;
/// Positions the synthetic model attends over.
pub const CONTEXT: usize = 4096;
/// Control tokens `<|c0|>`, `<|c1|>`, ... in the vocabulary (a real model has tens to
/// thousands): each is searched for in a prompt whose special tokens are parsed.
pub const CONTROL_TOKENS: usize = 64;
/// Worker threads of the server's runtime (`switchyard serve`'s).
pub const WORKERS: usize = 2;

/// A SentencePiece vocabulary: `<unk> <s> </s>`, `▁`, every printable ASCII character (so
/// any ASCII text tokenizes, one token a character), [`CONTROL_TOKENS`] control tokens, and
/// filler pieces up to [`VOCAB`].
pub fn tokenizer(chat_template: Option<&str>) -> Tokenizer {
    let mut pieces: Vec<(String, i32)> = vec![
        ("<unk>".into(), 2),
        ("<s>".into(), 3),
        ("</s>".into(), 3),
        ("\u{2581}".into(), 1),
    ];
    pieces.extend((0x21u8..0x7f).map(|c| ((c as char).to_string(), 1)));
    pieces.extend((0..CONTROL_TOKENS).map(|i| (format!("<|c{i}|>"), 3)));
    let filler = VOCAB - pieces.len();
    pieces.extend((0..filler).map(|i| (format!("\u{2581}w{i}"), 1)));
    let mut md = Metadata::new(BTreeMap::new());
    md.insert("tokenizer.ggml.model", MetaValue::String("llama".into()));
    md.insert(
        "tokenizer.ggml.tokens",
        MetaValue::Array(
            pieces
                .iter()
                .map(|(p, _)| MetaValue::String(p.clone()))
                .collect(),
        ),
    );
    md.insert(
        "tokenizer.ggml.token_type",
        MetaValue::Array(pieces.iter().map(|&(_, t)| MetaValue::I32(t)).collect()),
    );
    if let Some(t) = chat_template {
        md.insert("tokenizer.chat_template", MetaValue::String(t.into()));
    }
    Tokenizer::from_gguf_metadata(&md).expect("synthetic tokenizer")
}

/// A 4-layer, width-64 random llama with [`VOCAB`] tokens and a [`CONTEXT`]-position
/// context, behind an engine with a 128 MiB budget and no prefix cache (a finished request's
/// blocks are all free again).
pub fn engine(name: &str, chat_template: Option<&str>) -> EngineHandle {
    let mut spec = SyntheticSource::tiny_spec(Architecture::Llama);
    spec.vocab_size = VOCAB;
    spec.context_length = CONTEXT;
    let src = SyntheticSource::new(spec, 11, GgmlDType::F32).expect("synthetic model");
    let model = LayeredModel::load(Arc::new(src), &LoadOptions::default()).expect("load");
    let cfg = EngineConfig {
        memory_budget: 128 << 20,
        scheduler: SchedulerConfig {
            prefix_caching: false,
            ..SchedulerConfig::default()
        },
        ..EngineConfig::default()
    };
    EngineHandle::start(model, Arc::new(tokenizer(chat_template)), cfg, name).expect("engine")
}

pub struct SyntheticServer {
    pub base: String,
    pub state: Arc<AppState>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for SyntheticServer {
    fn drop(&mut self) {
        // Workers a test has shown to be stuck are left behind, not waited for.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// Serves `models` (name and engine) with the `[server]` settings of `server_toml`.
pub fn serve(server_toml: &str, models: Vec<(&str, EngineHandle)>) -> SyntheticServer {
    serve_with_send_buffer(server_toml, models, None)
}

/// [`serve`], with the send buffer of every accepted connection set to `send_buffer` bytes
/// (Linux: accepted sockets inherit it from the listener), so that a client that does not
/// read blocks the server after kilobytes rather than megabytes.
pub fn serve_with_send_buffer(
    server_toml: &str,
    models: Vec<(&str, EngineHandle)>,
    send_buffer: Option<u32>,
) -> SyntheticServer {
    let cfg = Config::parse(&format!(
        "{server_toml}\n[[models]]\nname = \"unused: the engines are given\"\n"
    ))
    .expect("test config");
    let served = models
        .into_iter()
        .map(|(name, handle)| {
            let local = Arc::new(LocalModel::from_handle(name, handle));
            (name.to_string(), Served::Local(local))
        })
        .collect();
    serve_on(AppState::new(served, cfg.server.clone()), send_buffer)
}

/// Serves `models` as they are (local engines, ModeSwitch models, ...) with the `[server]`
/// settings of `server_toml`.
pub fn serve_models(server_toml: &str, models: BTreeMap<String, Served>) -> SyntheticServer {
    let cfg = Config::parse(&format!(
        "{server_toml}\n[[models]]\nname = \"unused: the models are given\"\n"
    ))
    .expect("test config");
    serve_on(AppState::new(models, cfg.server.clone()), None)
}

fn serve_on(state: AppState, send_buffer: Option<u32>) -> SyntheticServer {
    let state = Arc::new(state);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKERS)
        .enable_all()
        .build()
        .expect("server runtime");
    let listener = runtime
        .block_on(async {
            let socket = tokio::net::TcpSocket::new_v4()?;
            if let Some(bytes) = send_buffer {
                socket.set_send_buffer_size(bytes)?;
            }
            socket.bind(([127, 0, 0, 1], 0).into())?;
            socket.listen(1024)
        })
        .expect("listen");
    let addr = listener.local_addr().expect("addr");
    let app = switchyard_server::router(state.clone());
    runtime.spawn(switchyard_server::listen::serve_connections(
        listener,
        app,
        switchyard_server::listen::ConnectionLimits::of(&state.config),
        Some(state.metrics.clone()),
        std::future::pending(),
    ));
    SyntheticServer {
        base: format!("http://{addr}"),
        state,
        runtime: Some(runtime),
    }
}

/// A client whose requests give up after `timeout`.
pub fn client(timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .expect("client")
}

/// Runs `n` requests made by `request` at once: how long until the last one ended, and what
/// each gave.
pub async fn all_at_once<T, F: std::future::Future<Output = T>>(
    n: usize,
    request: impl FnMut(usize) -> F,
) -> (Duration, Vec<T>) {
    let t0 = Instant::now();
    let answers = futures::future::join_all((0..n).map(request)).await;
    (t0.elapsed(), answers)
}

/// A client-side runtime of its own: what the tests drive requests from.
pub fn client_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("client runtime")
}

/// `/health` asked every `every` while `attack` runs, from a task of its own: the longest
/// wait for an answer (one not answered within `give_up` counts as `give_up`), and the
/// attack's result. The probe in flight when the attack ends is waited for.
pub async fn health_during<T>(
    base: &str,
    every: Duration,
    give_up: Duration,
    attack: impl std::future::Future<Output = T>,
) -> (Duration, T) {
    let client = client(give_up);
    let url = format!("{base}/health");
    let done = Arc::new(AtomicBool::new(false));
    let stop = done.clone();
    let prober = tokio::spawn(async move {
        let mut worst = Duration::ZERO;
        while !stop.load(Ordering::SeqCst) {
            let t0 = Instant::now();
            let _ = client.get(&url).send().await;
            worst = worst.max(t0.elapsed().min(give_up));
            tokio::time::sleep(every).await;
        }
        worst
    });
    let result = attack.await;
    done.store(true, Ordering::SeqCst);
    let worst = prober.await.unwrap_or(give_up);
    (worst, result)
}
