//! Input that used to hang, starve or poison the server: each test attacks a server over a
//! tiny random model (see `common::synthetic`) and checks that the attack is refused or cut
//! off within a bound while `/health` keeps answering.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::synthetic;
use switchyard_engine::{DecodedToken, EngineHandle, EngineInfo, EngineRequest, SequentialDecoder};
use switchyard_request::{FinishReason, Mode};
use switchyard_server::config::Config;
use switchyard_server::modeswitch::{load_local, ModeLoader, ModeSwitchModel};
use switchyard_server::state::Served;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The model name every test serves.
const MODEL: &str = "synthetic";

/// Held by the tests that time `/health` or connection closes, so that they do not share the
/// two cores with each other's floods of connections.
static TIMED: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn timed() -> std::sync::MutexGuard<'static, ()> {
    TIMED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A client that sends the headers and part of a body, then nothing, gets 408 once
/// `body_timeout_s` has passed instead of holding its handler for ever.
#[test]
fn a_body_that_never_arrives_times_out() {
    let server = synthetic::serve(
        "[server]\nbody_timeout_s = 1",
        vec![(MODEL, synthetic::engine(MODEL, None))],
    );
    let addr = server.base.trim_start_matches("http://").to_string();
    synthetic::client_runtime().block_on(async {
        let mut s = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        s.write_all(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
              content-length: 100\r\n\r\n{\"model\":",
        )
        .await
        .expect("send");
        let t0 = Instant::now();
        let mut buf = vec![0; 4096];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("answered within 5 s")
            .expect("read");
        let took = t0.elapsed();
        let text = String::from_utf8_lossy(&buf[..n]);
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        assert!(
            text.contains("the request body did not arrive within 1 s"),
            "{text}"
        );
        assert!(
            took >= Duration::from_millis(900) && took < Duration::from_secs(2),
            "{took:?}"
        );
    });
}

/// Whether the server closed `s`: a read gives end of file (or a reset) within `limit`.
async fn closed_within(s: &mut tokio::net::TcpStream, limit: Duration) -> bool {
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// The value of `name` in the server's `/metrics` text (0 when absent).
async fn metric(base: &str, name: &str) -> f64 {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Slowloris: connections that send nothing, or a request head a few bytes at a time, are
/// closed once `header_timeout_s` has passed, counted, and never block `/health`.
#[test]
fn idle_and_dripping_connections_are_closed_after_the_header_timeout() {
    let _timed = timed();
    const IDLE: usize = 20;
    const DRIPPING: usize = 20;
    let server = synthetic::serve(
        "[server]\nheader_timeout_s = 1",
        vec![(MODEL, synthetic::engine(MODEL, None))],
    );
    let base = server.base.clone();
    let addr = base.trim_start_matches("http://").to_string();
    synthetic::client_runtime().block_on(async {
        let t0 = Instant::now();
        let mut idle = Vec::new();
        for _ in 0..IDLE {
            idle.push(
                tokio::net::TcpStream::connect(&addr)
                    .await
                    .expect("connect"),
            );
        }
        let dripping: Vec<_> = (0..DRIPPING)
            .map(|_| {
                let addr = addr.clone();
                tokio::spawn(async move {
                    let mut s = tokio::net::TcpStream::connect(&addr)
                        .await
                        .expect("connect");
                    let head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-pad: ";
                    s.write_all(head).await.expect("send");
                    // One more header byte every 100 ms, never the end of the head.
                    let started = Instant::now();
                    loop {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        if s.write_all(b"a").await.is_err() {
                            return started.elapsed();
                        }
                        if started.elapsed() > Duration::from_secs(10) {
                            panic!("a dripping connection was kept for 10 s");
                        }
                    }
                })
            })
            .collect();
        // `/health` answers at once during the attack.
        let health = reqwest::get(format!("{base}/health"))
            .await
            .expect("health");
        assert_eq!(health.status().as_u16(), 200);
        assert!(
            t0.elapsed() < Duration::from_millis(900),
            "{:?}",
            t0.elapsed()
        );
        for s in &mut idle {
            assert!(
                closed_within(s, Duration::from_secs(3)).await,
                "idle connection kept"
            );
        }
        let idle_closed = t0.elapsed();
        assert!(
            idle_closed >= Duration::from_millis(900) && idle_closed < Duration::from_secs(3),
            "{idle_closed:?}"
        );
        for d in dripping {
            let kept = d.await.expect("dripping task");
            // Closed after about a second; the write that notices comes up to 100 ms (plus a
            // reset's round trip) later.
            assert!(kept < Duration::from_millis(2500), "{kept:?}");
        }
        let closed = metric(
            &base,
            "switchyard_connections_closed_total{reason=\"header_timeout\"}",
        )
        .await;
        assert_eq!(closed, (IDLE + DRIPPING) as f64);
    });
}

/// Connections over `max_connections` get 503 with `Retry-After` at once (not a hang), the
/// connections within it are served, and a place freed is taken again.
#[test]
fn connections_over_the_limit_get_503_and_freed_places_serve() {
    let _timed = timed();
    const LIMIT: usize = 4;
    let server = synthetic::serve(
        &format!("[server]\nmax_connections = {LIMIT}\nheader_timeout_s = 30"),
        vec![(MODEL, synthetic::engine(MODEL, None))],
    );
    let base = server.base.clone();
    let addr = base.trim_start_matches("http://").to_string();
    synthetic::client_runtime().block_on(async {
        let mut held = Vec::new();
        for _ in 0..LIMIT {
            held.push(
                tokio::net::TcpStream::connect(&addr)
                    .await
                    .expect("connect"),
            );
        }
        // Accepted connections are counted as the loop takes them.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .expect("client");
        let t0 = Instant::now();
        let refused = client
            .get(format!("{base}/health"))
            .send()
            .await
            .expect("an answer, not a hang");
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        assert_eq!(refused.status().as_u16(), 503);
        assert_eq!(
            refused
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok()),
            Some("1")
        );
        let body: serde_json::Value = refused.json().await.expect("JSON error");
        assert_eq!(
            body["error"]["message"],
            "the server has its maximum number of open connections; retry after 1 s"
        );
        // One place freed: the next connection is served.
        drop(held.pop());
        tokio::time::sleep(Duration::from_millis(200)).await;
        let ok = client
            .get(format!("{base}/v1/models"))
            .send()
            .await
            .expect("served");
        assert_eq!(ok.status().as_u16(), 200);
        drop(held);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            metric(
                &base,
                "switchyard_connections_closed_total{reason=\"limit\"}"
            )
            .await,
            1.0
        );
        // The scrape's own connection is the only one open, once the server has seen the
        // earlier ones (the previous scrape's included) close.
        let t0 = Instant::now();
        let mut open = metric(&base, "switchyard_connections_open").await;
        while open != 1.0 && t0.elapsed() < Duration::from_secs(3) {
            tokio::time::sleep(Duration::from_millis(50)).await;
            open = metric(&base, "switchyard_connections_open").await;
        }
        assert_eq!(open, 1.0, "after {:?}", t0.elapsed());
    });
}

/// A chat template that passes the load-time check (one "Hello" message) but loops 10^10
/// times when a message says "spin".
const SPIN_TEMPLATE: &str = "{% for m in messages %}{% if m.content == 'spin' %}\
    {% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}\
    {% endif %}{{ m.content }}{% endfor %}";
/// How long `/health` may take to answer while an attack runs.
const HEALTH_BOUND: Duration = Duration::from_millis(500);
/// How often `/health` is asked during an attack, and when a probe gives up.
const PROBE_EVERY: Duration = Duration::from_millis(50);
const PROBE_GIVE_UP: Duration = Duration::from_secs(5);

/// Posts `body` as JSON to `path`: status and body (`None` when there was no answer within
/// `limit`).
async fn post_json(
    client: &reqwest::Client,
    url: String,
    body: &serde_json::Value,
) -> Option<(u16, serde_json::Value)> {
    let resp = client.post(url).json(body).send().await.ok()?;
    let status = resp.status().as_u16();
    let body = resp.json().await.unwrap_or(serde_json::Value::Null);
    Some((status, body))
}

/// Messages in each hostile chat: their fuel (100,000 + 1,000 each) is about half a second
/// of rendering, all of it spent spinning.
const SPIN_MESSAGES: usize = 20_000;

/// Twice as many "spin" chats as the runtime has workers, at once. Before, each held a worker
/// for ever (no fuel) and `/health` stopped answering; with fuel alone, each still held a
/// worker for half a second. Now they run out of fuel on the blocking pool and get 400.
#[test]
fn a_hostile_chat_template_is_stopped_while_health_answers() {
    let server = synthetic::serve(
        "",
        vec![(MODEL, synthetic::engine(MODEL, Some(SPIN_TEMPLATE)))],
    );
    let base = server.base.clone();
    synthetic::client_runtime().block_on(async {
        let client = synthetic::client(Duration::from_secs(10));
        let messages = vec![serde_json::json!({"role": "user", "content": "spin"}); SPIN_MESSAGES];
        let body = serde_json::json!({"model": MODEL, "messages": messages, "max_tokens": 1});
        let attack = synthetic::all_at_once(2 * synthetic::WORKERS, |_| {
            post_json(&client, format!("{base}/v1/chat/completions"), &body)
        });
        let (worst, (took, answers)) =
            synthetic::health_during(&base, PROBE_EVERY, PROBE_GIVE_UP, attack).await;
        println!(
            "hostile template: /health answered within {worst:?}; the chats ended after {took:?}"
        );
        for a in answers {
            let (status, body) = a.expect("the chat was answered");
            assert_eq!(status, 400, "{body}");
            assert_eq!(
                body["error"]["message"],
                "chat template failed: it ran past 20100000 instructions (100000 plus 1000 per message, 20000 messages)"
            );
        }
        assert!(took < Duration::from_secs(5), "{took:?}");
        assert!(worst < HEALTH_BOUND, "/health took {worst:?}");
    });
}

/// A prompt token that makes [`Fragile`] panic.
const PANIC_TOKEN: u32 = 7;

/// A decoder with a bug: it panics when the prompt holds [`PANIC_TOKEN`], killing its engine
/// thread; otherwise it answers one token.
struct Fragile;

impl SequentialDecoder for Fragile {
    fn generate(
        &mut self,
        request: &EngineRequest,
        emit: &mut dyn FnMut(Option<DecodedToken>, &str) -> bool,
    ) -> switchyard_engine::Result<FinishReason> {
        assert!(
            !request.prompt.contains(&PANIC_TOKEN),
            "a decoder bug (the test's deliberate panic)"
        );
        emit(
            Some(DecodedToken {
                token: 40,
                logprob: -0.5,
            }),
            "I",
        );
        emit(None, "");
        Ok(FinishReason::Length)
    }

    fn weights_bytes(&self) -> u64 {
        0
    }
}

fn fragile_engine(name: &str) -> EngineHandle {
    let info = EngineInfo::new(
        name,
        1,
        synthetic::CONTEXT,
        synthetic::VOCAB,
        Arc::new(synthetic::tokenizer(None)),
    );
    EngineHandle::spawn_sequential(Box::new(Fragile), info, 1 << 20).expect("decoder thread")
}

async fn get(client: &reqwest::Client, url: String) -> (u16, String) {
    let resp = client.get(url).send().await.expect("answered");
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap_or_default())
}

/// An engine whose thread panicked is reported down by `/health` (503, with each model's
/// state) and by the `switchyard_engine_up` gauge; its requests get 503 saying why, and the
/// other model keeps serving.
#[test]
fn a_panicking_engine_makes_health_report_the_model_down() {
    let server = synthetic::serve(
        "",
        vec![
            (MODEL, synthetic::engine(MODEL, None)),
            ("fragile", fragile_engine("fragile")),
        ],
    );
    let base = server.base.clone();
    synthetic::client_runtime().block_on(async {
        let client = reqwest::Client::new();
        let (status, _) = get(&client, format!("{base}/health")).await;
        assert_eq!(status, 200);
        let completion = |model: &str, token: u32| {
            serde_json::json!({"model": model, "prompt": [5, token], "max_tokens": 1})
        };
        let url = format!("{base}/v1/completions");
        let (status, body) = post_json(&client, url.clone(), &completion("fragile", 5))
            .await
            .expect("answered");
        assert_eq!((status, body["choices"][0]["text"].as_str()), (200, Some("I")));

        let down = |(status, body): (u16, serde_json::Value)| {
            assert_eq!(status, 503, "{body}");
            assert_eq!(
                body["error"]["message"],
                "the engine of `fragile` failed and is down: its thread panicked"
            );
        };
        let panics = completion("fragile", PANIC_TOKEN);
        down(post_json(&client, url.clone(), &panics).await.expect("answered"));

        let (status, body) = get(&client, format!("{base}/health")).await;
        assert_eq!(status, 503, "{body}");
        let health: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(
            health,
            serde_json::json!({
                "status": "unhealthy",
                "models": {"fragile": {"state": "failed"}, MODEL: {"state": "running"}},
            })
        );
        let (_, metrics) = get(&client, format!("{base}/metrics")).await;
        assert!(
            metrics.contains("switchyard_engine_up{model=\"fragile\"} 0"),
            "{metrics}"
        );
        assert!(
            metrics.contains(&format!("switchyard_engine_up{{model=\"{MODEL}\"}} 1")),
            "{metrics}"
        );

        let after = completion("fragile", 5);
        down(post_json(&client, url.clone(), &after).await.expect("answered"));
        let (status, _) = post_json(&client, url, &completion(MODEL, 5))
            .await
            .expect("answered");
        assert_eq!(status, 200);
    });
}

/// Streams admitted at once (the server's `max_in_flight` in the test).
const SLOTS: usize = 4;
/// Tokens each non-reading client asks for: far more events than the socket buffers hold.
const LONG_OUTPUT: usize = 3000;

/// The status of a one-token completion of the synthetic model.
async fn one_token(client: &reqwest::Client, base: &str) -> u16 {
    let body = serde_json::json!({"model": MODEL, "prompt": [5], "max_tokens": 1});
    post_json(client, format!("{base}/v1/completions"), &body)
        .await
        .map_or(0, |(status, _)| status)
}

/// Opens a connection whose receive buffer is as small as the kernel allows, sends a streamed
/// completion request and never reads the answer.
async fn non_reading_client(addr: std::net::SocketAddr) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(1024).expect("SO_RCVBUF");
    let mut s = socket.connect(addr).await.expect("connect");
    let body = serde_json::json!({
        "model": MODEL, "prompt": [5, 6, 7], "max_tokens": LONG_OUTPUT,
        "ignore_eos": true, "stream": true, "logprobs": 1,
    })
    .to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.expect("send");
    s.write_all(body.as_bytes()).await.expect("send");
    s
}

/// Clients that never read their streams fill every admission slot. Before, they held the
/// slots for as long as they kept the connections open, and every other request got 429; now
/// each is cut off `write_timeout_s` after its buffer filled: the request is aborted (its K/V
/// blocks freed), its slot released and the abort counted.
#[test]
fn a_client_that_never_reads_is_cut_off_and_its_kv_freed() {
    let server = synthetic::serve_with_send_buffer(
        &format!("[server]\nmax_in_flight = {SLOTS}\nwrite_timeout_s = 1"),
        vec![(MODEL, synthetic::engine(MODEL, None))],
        Some(4096),
    );
    let base = server.base.clone();
    let addr: std::net::SocketAddr = base.trim_start_matches("http://").parse().expect("address");
    let served = match server.state.models.get(MODEL) {
        Some(Served::Local(m)) => Arc::clone(m),
        _ => panic!("the model is served locally"),
    };
    synthetic::client_runtime().block_on(async {
        let client = reqwest::Client::new();
        let attack = async {
            let mut clients = Vec::new();
            for _ in 0..SLOTS {
                clients.push(non_reading_client(addr).await);
            }
            // Every slot taken: the next request is refused.
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert_eq!(one_token(&client, &base).await, 429);
            let t0 = Instant::now();
            while served.in_flight() > 0 && t0.elapsed() < Duration::from_secs(5) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (t0.elapsed(), served.in_flight(), clients)
        };
        let (worst, (took, in_flight, clients)) =
            synthetic::health_during(&base, PROBE_EVERY, PROBE_GIVE_UP, attack).await;
        println!(
            "non-reading clients: /health answered within {worst:?}; their slots were free {took:?} after the 429"
        );
        assert_eq!(in_flight, 0, "slots still held after {took:?}");
        let stats = served.handle.stats().recv().await.expect("stats");
        assert_eq!((stats.running, stats.kv_blocks_used), (0, 0));
        assert_eq!(one_token(&client, &base).await, 200);
        let (_, metrics) = get(&client, format!("{base}/metrics")).await;
        assert!(
            metrics.contains(&format!(
                "switchyard_aborted_requests_total{{model=\"{MODEL}\",reason=\"write_timeout\"}} {SLOTS}"
            )),
            "{metrics}"
        );
        assert!(worst < HEALTH_BOUND, "/health took {worst:?}");
        drop(clients);
    });
}

/// Prompts sent at once, and the bytes of each.
const BIG_PROMPTS: usize = 300;
const PROMPT_BYTES: usize = 1 << 20;
/// Requests the server admits at once in that test.
const BIG_PROMPT_SLOTS: usize = 8;

/// 300 prompts of 1 MiB at once. Before, each was tokenized on the runtime's two workers
/// before admission, and `/health` waited behind all of them; now a prompt is tokenized only
/// once admitted, on the blocking pool, and the rest are refused with 429 at once.
#[test]
fn three_hundred_prompts_of_one_mib_do_not_delay_health() {
    let _timed = timed();
    let server = synthetic::serve(
        &format!(
            "[server]\nmax_in_flight = {BIG_PROMPT_SLOTS}\nmax_body_bytes = {}",
            2 * PROMPT_BYTES
        ),
        vec![(MODEL, synthetic::engine(MODEL, None))],
    );
    let base = server.base.clone();
    synthetic::client_runtime().block_on(async {
        let client = synthetic::client(Duration::from_secs(60));
        let words = "lorem ipsum dolor sit amet, consectetur adipiscing elit ";
        let prompt: String = words.repeat(PROMPT_BYTES / words.len() + 1)[..PROMPT_BYTES].into();
        let body = axum::body::Bytes::from(
            serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}).to_string(),
        );
        let attack = synthetic::all_at_once(BIG_PROMPTS, |_| async {
            let resp = client
                .post(format!("{base}/v1/completions"))
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
                .await
                .ok()?;
            let status = resp.status().as_u16();
            let body: serde_json::Value = resp.json().await.ok()?;
            Some((status, body))
        });
        let (worst, (took, answers)) =
            synthetic::health_during(&base, PROBE_EVERY, PROBE_GIVE_UP, attack).await;
        let answers: Vec<(u16, serde_json::Value)> =
            answers.into_iter().map(|a| a.expect("answered")).collect();
        let tokenized = answers.iter().filter(|(s, _)| *s == 400).count();
        let refused = answers.iter().filter(|(s, _)| *s == 429).count();
        println!(
            "{BIG_PROMPTS} prompts of 1 MiB: /health answered within {worst:?}; {tokenized} tokenized, {refused} refused, all answered after {took:?}"
        );
        assert_eq!(tokenized + refused, BIG_PROMPTS);
        assert!(tokenized >= BIG_PROMPT_SLOTS, "{tokenized}");
        let (_, body) = answers.iter().find(|(s, _)| *s == 400).expect("one tokenized");
        assert_eq!(
            body["error"]["message"],
            format!(
                "this model's maximum context length is {} tokens, but the prompt has {} tokens",
                synthetic::CONTEXT,
                // One token a byte, plus the leading space mark and BOS.
                PROMPT_BYTES + 2
            )
        );
        assert!(worst < HEALTH_BOUND, "/health took {worst:?}");
    });
}

/// The zoo model the ModeSwitch test routes between modes of.
const ZOO_MODEL: &str = "smollm2-135m-instruct";

/// ModeSwitch over the zoo model offering int8 and q4, whose q4 engine is built only once the
/// test sends on `gate`: a mode load that takes as long as the test wants.
fn gated_modeswitch(gate: std::sync::mpsc::Receiver<()>) -> Arc<ModeSwitchModel> {
    let cfg = Config::parse(&format!(
        "[modeswitch]\nname = \"modes\"\npath = \"{ZOO_MODEL}\"\nmodes = [\"int8\", \"q4\"]\n\
         mode_budget = \"1GiB\"\nload_wait_s = 1\n"
    ))
    .expect("config");
    let section = cfg.modeswitch.clone().expect("[modeswitch]");
    let policy = cfg.router_policy().expect("policy");
    let gate = std::sync::Mutex::new(gate);
    let loader: ModeLoader = Arc::new(move |name, mode, assets, budget| {
        if mode == Mode::Q4 {
            let _ = gate.lock().map(|g| g.recv());
        }
        load_local(name, mode, assets, budget)
    });
    Arc::new(ModeSwitchModel::start_with_loader(&section, policy, loader).expect("ModeSwitch"))
}

/// A completion for the ModeSwitch model with a workload label: status, the serving mode,
/// the route header.
async fn routed(client: &reqwest::Client, base: &str, workload: &str) -> (u16, String, String) {
    let resp = client
        .post(format!("{base}/v1/completions"))
        .header("x-switchyard-workload", workload)
        .json(&serde_json::json!({
            "model": "modes", "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0,
        }))
        .send()
        .await
        .expect("answered");
    let header = |k: &str| {
        resp.headers()
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    (
        resp.status().as_u16(),
        header("x-switchyard-mode"),
        header("x-switchyard-route"),
    )
}

/// A request routed to q4 starts q4's load, which takes as long as the test holds its gate.
/// Before, the load held the lock on every mode: a request the router sends to f16 (loaded at
/// start) waited behind it. Now it is served at once; the q4 request waits `load_wait_s` for
/// the load, then is served in f16 while the load goes on, and later q4 requests get q4.
#[test]
fn a_request_for_a_loaded_mode_completes_while_another_mode_loads() {
    let (release, gate) = std::sync::mpsc::channel();
    let modes = gated_modeswitch(gate);
    let server = synthetic::serve_models(
        "[server]\nadmin = true",
        [("modes".to_string(), Served::Modes(modes))].into(),
    );
    let base = server.base.clone();
    synthetic::client_runtime().block_on(async {
        let client = synthetic::client(Duration::from_secs(5));
        // Synthetic-shape traffic goes to q4 (rule 4), whose load now starts.
        let waiting = tokio::spawn({
            let (client, base) = (client.clone(), base.clone());
            async move { routed(&client, &base, "SS").await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;

        // Math goes to speculative decoding, not offered here: f16, loaded at start.
        let t0 = Instant::now();
        let (status, mode, _) = routed(&client, &base, "gsm8k").await;
        let took = t0.elapsed();
        println!("ModeSwitch: an f16 request took {took:?} while q4 was loading");
        assert_eq!((status, mode.as_str()), (200, "f16"));
        assert!(took < Duration::from_secs(2), "{took:?}");

        let (status, mode, route) = waiting.await.expect("the q4 request");
        assert_eq!((status, mode.as_str()), (200, "f16"), "{route}");
        assert!(route.contains("fallback=true"), "{route}");
        let routes: serde_json::Value = client
            .get(format!("{base}/admin/routes"))
            .send()
            .await
            .expect("routes")
            .json()
            .await
            .expect("JSON");
        let waited = routes["modes"]
            .as_array()
            .and_then(|l| l.iter().find(|r| r["features"]["workload"] == "SS"))
            .cloned()
            .unwrap_or_default();
        assert_eq!(
            waited["fallback_reason"], "q4 is still loading (waited 1 s)",
            "{routes}"
        );

        release.send(()).expect("the gate is open");
        let t0 = Instant::now();
        loop {
            let (status, mode, _) = routed(&client, &base, "SS").await;
            assert_eq!(status, 200);
            if mode == "q4" {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "q4 never loaded");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
}
