//! `bench serve` against a fake OpenAI-compatible server started inside the test: a small
//! HTTP/1.1 server on loopback that streams a scripted number of chunks with scripted delays,
//! fails on request, and counts what it receives. Every timing is asserted against the
//! script, every count exactly.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use switchyard_bench::serve::{
    benchmark, endpoint_url, Arrivals, BenchRequest, Endpoint, RequestRate, ServeOptions,
    ServeReport, Slos, TokenCount, DEFAULT_REQUEST_TIMEOUT,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Slack allowed above a scripted delay (timer and scheduling jitter on a loaded machine).
/// Lower bounds need none: nothing can arrive before the server sent it.
const SLACK_MS: f64 = 50.0;

/// Timing tests run one at a time so that they do not slow each other down.
static TIMING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What the fake server saw.
#[derive(Default)]
struct Seen {
    bodies: Mutex<Vec<Value>>,
    /// Connections closed without a response (`close` and `closefirst`).
    closed: AtomicUsize,
    in_flight: AtomicUsize,
    peak_in_flight: AtomicUsize,
}

/// How to answer one request, read from its prompt: `key=value` pairs separated by `;`.
/// `mode` is `ok` (default), `500`, `drop` (close after two chunks), `bad` (a malformed
/// line), `nodone` (end cleanly without `[DONE]`), `empty` (`[DONE]` with no text), `close`
/// (close the connection without a response), `closefirst` (`close` for the server's first
/// such request, `ok` after it).
struct Script {
    mode: String,
    first_ms: u64,
    gap_ms: u64,
    chunks: usize,
    /// `usage.completion_tokens` to report (none when 0).
    usage: u64,
}

impl Script {
    fn parse(prompt: &str) -> Self {
        let mut s = Script {
            mode: "ok".into(),
            first_ms: 0,
            gap_ms: 0,
            chunks: 1,
            usage: 0,
        };
        for kv in prompt.split(';') {
            let Some((k, v)) = kv.split_once('=') else {
                continue;
            };
            let n = v.parse::<u64>().unwrap_or(0);
            match k {
                "mode" => s.mode = v.to_string(),
                "first_ms" => s.first_ms = n,
                "gap_ms" => s.gap_ms = n,
                "chunks" => s.chunks = n as usize,
                "usage" => s.usage = n,
                _ => {}
            }
        }
        s
    }
}

async fn start_server() -> (String, Arc<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen = Arc::new(Seen::default());
    let s = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let s = Arc::clone(&s);
            tokio::spawn(async move {
                let _ = serve_one(sock, s).await;
            });
        }
    });
    (format!("http://{addr}"), seen)
}

/// Reads one request (headers, then a Content-Length body) and answers it.
async fn serve_one(mut sock: TcpStream, seen: Arc<Seen>) -> std::io::Result<()> {
    sock.set_nodelay(true)?;
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let head_end = loop {
        let n = sock.read(&mut tmp).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = sock.read(&mut tmp).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    let body: Value = serde_json::from_slice(&buf[head_end..head_end + len]).unwrap_or_default();
    let chat = head.starts_with("post /v1/chat/completions");
    let prompt = if chat {
        body["messages"][0]["content"].as_str().unwrap_or_default()
    } else {
        body["prompt"].as_str().unwrap_or_default()
    }
    .to_string();
    seen.bodies.lock().expect("lock").push(body);
    let script = Script::parse(&prompt);
    let close = match script.mode.as_str() {
        "close" => true,
        "closefirst" => seen.closed.load(Ordering::SeqCst) == 0,
        _ => false,
    };
    if close {
        seen.closed.fetch_add(1, Ordering::SeqCst);
        return sock.shutdown().await;
    }
    let now = seen.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    seen.peak_in_flight.fetch_max(now, Ordering::SeqCst);
    let mut guard = InFlight(Some(&seen.in_flight));
    answer(&mut sock, &script, chat, &mut guard).await
}

/// One request in flight at the server, until released (before `[DONE]`, so that a client
/// slot freed by `[DONE]` never overlaps it) or dropped.
struct InFlight<'a>(Option<&'a AtomicUsize>);

impl InFlight<'_> {
    fn release(&mut self) {
        if let Some(n) = self.0.take() {
            n.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

async fn chunk(sock: &mut TcpStream, data: &str) -> std::io::Result<()> {
    let event = format!("data: {data}\n\n");
    let framed = format!("{:x}\r\n{event}\r\n", event.len());
    sock.write_all(framed.as_bytes()).await?;
    sock.flush().await
}

async fn answer(
    sock: &mut TcpStream,
    s: &Script,
    chat: bool,
    in_flight: &mut InFlight<'_>,
) -> std::io::Result<()> {
    if s.mode == "500" {
        let body = r#"{"error":{"message":"scripted failure"}}"#;
        let head = format!(
            "HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        return sock.write_all(head.as_bytes()).await;
    }
    sock.write_all(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n",
    )
    .await?;
    if chat {
        // A role announcement right away: not a token.
        chunk(
            sock,
            r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#,
        )
        .await?;
    }
    // An SSE comment, split across two HTTP chunks.
    sock.write_all(b"3\r\n: p\r\n5\r\ning\n\n\r\n").await?;
    let text = |i: usize| {
        if chat {
            format!(r#"{{"choices":[{{"delta":{{"content":"t{i}"}}}}]}}"#)
        } else {
            format!(r#"{{"choices":[{{"text":"t{i}","finish_reason":null}}]}}"#)
        }
    };
    if s.mode != "empty" {
        for i in 0..s.chunks {
            let wait = if i == 0 { s.first_ms } else { s.gap_ms };
            tokio::time::sleep(Duration::from_millis(wait)).await;
            if s.mode == "drop" && i == 2 {
                return sock.shutdown().await;
            }
            if s.mode == "bad" && i == 1 {
                chunk(sock, r#"{"choices": [ {"text": "#).await?;
            }
            chunk(sock, &text(i)).await?;
        }
    }
    chunk(
        sock,
        r#"{"choices":[{"text":"","finish_reason":"length"}]}"#,
    )
    .await?;
    if s.usage > 0 {
        let u = format!(
            r#"{{"choices":[],"usage":{{"prompt_tokens":3,"completion_tokens":{},"total_tokens":9}}}}"#,
            s.usage
        );
        chunk(sock, &u).await?;
    }
    in_flight.release();
    if s.mode != "nodone" {
        chunk(sock, "[DONE]").await?;
    }
    sock.write_all(b"0\r\n\r\n").await?;
    sock.flush().await
}

fn options(url: &str, rate: RequestRate) -> ServeOptions {
    ServeOptions {
        url: endpoint_url(url, Endpoint::Completions).expect("url"),
        endpoint: Endpoint::Completions,
        model: "fake-model".into(),
        arrivals: Arrivals::new(rate, 1.0).expect("arrivals"),
        max_concurrency: None,
        seed: 0,
        ignore_eos: false,
        extra_body: serde_json::Map::new(),
        slos: Slos::default(),
        request_timeout: DEFAULT_REQUEST_TIMEOUT,
        api_key: None,
        test_request: false,
        save_requests: true,
        dataset: "scripted".into(),
        tokenizer: "none".into(),
    }
}

fn requests(prompt: &str, n: usize) -> Vec<BenchRequest> {
    (0..n)
        .map(|i| BenchRequest {
            prompt: prompt.to_string(),
            prompt_tokens: 10 + i,
            output_len: 16,
        })
        .collect()
}

async fn run(reqs: &[BenchRequest], opts: &ServeOptions) -> ServeReport {
    let mut last = None;
    let r = benchmark(reqs, opts, |p| last = Some(p))
        .await
        .expect("benchmark runs");
    let last = last.expect("progress was reported");
    assert_eq!((last.done, last.total), (reqs.len(), reqs.len()));
    assert_eq!(last.failed, r.metrics.failed);
    r
}

/// `x` is at least `lo` and at most `want + SLACK_MS`.
fn within(x: f64, lo: f64, want: f64, what: &str) {
    assert!(
        x >= lo && x <= want + SLACK_MS,
        "{what}: {x:.2} ms, scripted {want} ms"
    );
}

/// The identities that hold for every completed request, whatever the load: ITLs add up to
/// E2E - TTFT, and TPOT is that over the output tokens less one.
fn assert_identities(r: &ServeReport) {
    for x in r.requests.as_deref().unwrap_or_default() {
        let (Some(ttft), Some(e2el)) = (x.ttft_ms, x.e2el_ms) else {
            continue;
        };
        let itl: f64 = x.itl_ms.iter().sum();
        assert!((itl - (e2el - ttft)).abs() < 1e-6, "{x:?}");
        assert_eq!(x.itl_ms.len(), x.text_chunks - 1);
        if x.output_tokens > 1 {
            let tpot = (e2el - ttft) / (x.output_tokens - 1) as f64;
            assert!(x.tpot_ms.is_some_and(|t| (t - tpot).abs() < 1e-9), "{x:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timings_tokens_and_throughput_follow_the_stream() {
    let _serial = TIMING.lock().await;
    let (url, seen) = start_server().await;
    // 100 ms to the first token, then 4 more 30 ms apart; usage reports the 5 tokens.
    let reqs = requests("first_ms=100;gap_ms=30;chunks=5;usage=5", 6);
    let mut opts = options(&url, RequestRate::Infinite);
    opts.slos = Slos::parse(&["ttft:1000", "e2el:1"]).expect("slos");
    let r = run(&reqs, &opts).await;
    let m = &r.metrics;
    assert_eq!((m.completed, m.failed), (6, 0));
    assert_eq!(m.total_output_tokens, 30);
    assert_eq!(m.total_input_tokens, (10..16).sum::<usize>());
    assert_eq!(m.output_tokens_from, TokenCount::Usage);
    // TTFT and E2E can only be later than scripted; the medians are within the slack.
    let records = r.requests.as_ref().expect("saved");
    assert!(
        records.iter().all(|x| x.ttft_ms >= Some(100.0)),
        "{records:?}"
    );
    assert!(
        records.iter().all(|x| x.e2el_ms >= Some(220.0)),
        "{records:?}"
    );
    within(m.ttft_ms.median, 100.0, 100.0, "median TTFT");
    within(m.e2el_ms.median, 220.0, 220.0, "median E2E");
    within(m.itl_ms.median, 15.0, 30.0, "median ITL");
    within(m.tpot_ms.median, 15.0, 30.0, "median TPOT");
    assert_identities(&r);
    assert!(records
        .iter()
        .all(|x| x.itl_ms.len() == 4 && x.text_chunks == 5));
    assert!(records.iter().all(|x| x.server_prompt_tokens == Some(3)));
    assert!(records
        .iter()
        .all(|x| x.finish_reason.as_deref() == Some("length")));
    // Throughput is per second of the whole run, which lasts at least one request.
    assert!(m.duration_s >= 0.22);
    assert!((m.request_throughput - 6.0 / m.duration_s).abs() < 1e-9);
    assert!((m.output_throughput - 30.0 / m.duration_s).abs() < 1e-9);
    let total = (30 + m.total_input_tokens) as f64 / m.duration_s;
    assert!((m.total_token_throughput - total).abs() < 1e-9);
    // All at once: every request overlapped.
    assert_eq!(r.peak_concurrent_requests, 6);
    // No request ends within 1 ms, so none is good.
    assert_eq!(m.request_goodput, Some(0.0));

    // vLLM's request body.
    let bodies = seen.bodies.lock().expect("lock").clone();
    assert_eq!(bodies.len(), 6);
    let b = &bodies[0];
    assert_eq!(b["model"], "fake-model");
    assert_eq!(b["max_tokens"], 16);
    assert_eq!(b["temperature"], 0.0);
    assert_eq!(b["stream"], true);
    assert_eq!(b["stream_options"]["include_usage"], true);
    assert!(b.get("ignore_eos").is_none());

    // The report under vLLM's keys, and the Markdown summary.
    let json = serde_json::to_value(&r).expect("json");
    for key in [
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "duration_s",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "median_tpot_ms",
        "std_itl_ms",
        "p90_e2el_ms",
        "p99_ttft_ms",
    ] {
        assert!(json[key].is_number(), "{key}: {}", json[key]);
    }
    assert_eq!(json["request_rate"], "inf");
    assert_eq!(json["requests"].as_array().map(Vec::len), Some(6));
    let md = r.markdown();
    assert!(md.contains("| Successful requests | 6 |"), "{md}");
    assert!(
        md.contains("| Total generated tokens (from usage) | 30 |"),
        "{md}"
    );
    assert!(md.contains("| TTFT |"), "{md}");
    assert!(md.contains("| Finish reasons | length 6 |"), "{md}");
    assert_eq!(json["finish_reasons"]["length"], 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_usage_chunks_are_tokens_and_with_it_tpot_divides_by_tokens() {
    let _serial = TIMING.lock().await;
    let (url, _) = start_server().await;
    let opts = options(&url, RequestRate::Infinite);
    let r = run(&requests("first_ms=20;gap_ms=20;chunks=4", 2), &opts).await;
    assert_eq!(r.metrics.total_output_tokens, 8);
    assert_eq!(r.metrics.output_tokens_from, TokenCount::Chunks);
    assert_identities(&r);
    within(r.metrics.tpot_ms.median, 10.0, 20.0, "TPOT from chunks");
    // Two tokens per chunk: 8 tokens in 4 chunks, TPOT = (E2E - TTFT) / 7 (60 ms / 7 as
    // scripted), ITL stays per chunk.
    let r = run(
        &requests("first_ms=20;gap_ms=20;chunks=4;usage=8", 2),
        &opts,
    )
    .await;
    assert_eq!(r.metrics.total_output_tokens, 16);
    assert_eq!(r.metrics.output_tokens_from, TokenCount::Usage);
    assert_identities(&r);
    within(
        r.metrics.tpot_ms.median,
        30.0 / 7.0,
        60.0 / 7.0,
        "TPOT from usage",
    );
    within(r.metrics.itl_ms.median, 10.0, 20.0, "ITL per chunk");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_role_chunks_are_not_tokens() {
    let _serial = TIMING.lock().await;
    let (url, seen) = start_server().await;
    let mut opts = options(&url, RequestRate::Infinite);
    opts.endpoint = Endpoint::Chat;
    opts.url = endpoint_url(&url, Endpoint::Chat).expect("url");
    opts.ignore_eos = true;
    let r = run(&requests("first_ms=80;gap_ms=10;chunks=3", 2), &opts).await;
    assert_eq!((r.metrics.completed, r.metrics.total_output_tokens), (2, 6));
    // The role chunk comes at once; TTFT waits for the first content.
    assert!(r.metrics.ttft_ms.mean >= 80.0, "{}", r.metrics.ttft_ms.mean);
    let b = &seen.bodies.lock().expect("lock")[0];
    assert_eq!(b["messages"][0]["role"], "user");
    assert_eq!(b["max_completion_tokens"], 16);
    assert_eq!(b["ignore_eos"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_requests_are_counted_with_their_errors() {
    let (url, _) = start_server().await;
    let mut reqs = requests("chunks=3;gap_ms=1", 3);
    for (mode, n) in [
        ("500", 3),
        ("drop", 2),
        ("bad", 1),
        ("nodone", 1),
        ("empty", 1),
    ] {
        reqs.extend(requests(&format!("mode={mode};chunks=4;gap_ms=1"), n));
    }
    let r = run(&reqs, &options(&url, RequestRate::Infinite)).await;
    let m = &r.metrics;
    assert_eq!((m.completed, m.failed), (3, 8));
    // Only completed requests count.
    assert_eq!(m.total_output_tokens, 9);
    assert_eq!(m.total_input_tokens, 10 + 11 + 12);
    let count = |needle: &str| {
        r.errors
            .iter()
            .filter(|e| e.message.contains(needle))
            .map(|e| e.count)
            .sum::<usize>()
    };
    assert_eq!(count("HTTP 500"), 3, "{:?}", r.errors);
    assert_eq!(count("scripted failure"), 3);
    assert_eq!(count("malformed data line"), 1, "{:?}", r.errors);
    assert_eq!(count("without `data: [DONE]`"), 1, "{:?}", r.errors);
    assert_eq!(
        count("before any generated text (finish reason length)"),
        1,
        "{:?}",
        r.errors
    );
    // A dropped connection is a transport error (or a stream without [DONE]).
    assert_eq!(r.errors.iter().map(|e| e.count).sum::<usize>(), 8);
    let records = r.requests.as_ref().expect("saved");
    assert!(records
        .iter()
        .filter(|x| !x.success)
        .all(|x| x.error.is_some()));
    assert!(records
        .iter()
        .filter(|x| !x.success)
        .all(|x| x.output_tokens == 0));
}

/// A connection that fails before any response (a kept-alive connection the server closed)
/// is retried once on a new one, and counted; a second failure fails the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_closed_before_any_response_is_retried_once() {
    let (url, seen) = start_server().await;
    let r = run(
        &requests("mode=closefirst;chunks=2;gap_ms=1", 1),
        &options(&url, RequestRate::Infinite),
    )
    .await;
    assert_eq!(
        (r.metrics.completed, r.metrics.failed, r.metrics.retried),
        (1, 0, 1)
    );
    assert_eq!(seen.bodies.lock().expect("lock").len(), 2);
    assert_eq!(seen.closed.load(Ordering::SeqCst), 1);
    let rec = &r.requests.as_ref().expect("saved")[0];
    assert!(
        rec.retried && rec.success && rec.text_chunks == 2,
        "{rec:?}"
    );

    let (url, seen) = start_server().await;
    let r = run(
        &requests("mode=close", 2),
        &options(&url, RequestRate::Infinite),
    )
    .await;
    assert_eq!(
        (r.metrics.completed, r.metrics.failed, r.metrics.retried),
        (0, 2, 2)
    );
    assert_eq!(seen.closed.load(Ordering::SeqCst), 4);
    assert!(
        r.markdown()
            .contains("| Retried requests (connection failed before a response) | 2 |"),
        "{}",
        r.markdown()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_fails_every_request_or_the_test_request() {
    // A port that was just free: nothing listens there.
    let url = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        format!("http://{}", l.local_addr().expect("addr"))
    };
    let mut opts = options(&url, RequestRate::Infinite);
    let r = run(&requests("chunks=1", 3), &opts).await;
    assert_eq!((r.metrics.completed, r.metrics.failed), (0, 3));
    assert_eq!(r.errors.len(), 1);
    assert!(
        r.errors[0].message.contains("error sending request"),
        "{:?}",
        r.errors
    );
    assert_eq!(r.metrics.output_tokens_from, TokenCount::None);
    assert!(r.metrics.ttft_ms.mean.is_nan());
    opts.test_request = true;
    let err = benchmark(&requests("chunks=1", 3), &opts, |_| {})
        .await
        .expect_err("the test request fails");
    assert!(err.to_string().contains("test request"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poisson_arrivals_follow_the_seeded_schedule() {
    let _serial = TIMING.lock().await;
    let (url, _) = start_server().await;
    let n = 60;
    let rate = 40.0;
    let mut opts = options(&url, RequestRate::PerSecond(rate));
    opts.seed = 11;
    let r = run(&requests("chunks=1", n), &opts).await;
    assert_eq!(r.metrics.completed, n);
    let records = r.requests.as_ref().expect("saved");
    // Never before its time, and typically within the slack after it.
    let schedule = opts.arrivals.offsets(n, opts.seed);
    let mut late = Vec::new();
    for (rec, want) in records.iter().zip(&schedule) {
        let want = want.as_secs_f64() * 1e3;
        assert!(
            rec.arrival_ms >= want - 0.5,
            "request {}: arrived at {:.1} ms, scheduled {want:.1} ms",
            rec.index,
            rec.arrival_ms
        );
        late.push(rec.arrival_ms - want);
    }
    late.sort_by(f64::total_cmp);
    assert!(late[n / 2] < SLACK_MS, "median lateness {} ms", late[n / 2]);
    // The mean gap is 1 / rate (25 ms) within sampling error of 59 exponential gaps.
    let last = records.last().expect("records").arrival_ms;
    let mean_gap = last / (n - 1) as f64;
    assert!(
        (mean_gap - 25.0).abs() < 25.0 * 0.3,
        "mean inter-arrival {mean_gap:.2} ms"
    );
    // Not evenly spaced: exponential gaps vary about as much as their mean.
    let gaps: Vec<f64> = records
        .windows(2)
        .map(|w| w[1].arrival_ms - w[0].arrival_ms)
        .collect();
    let sd = (gaps.iter().map(|g| (g - mean_gap).powi(2)).sum::<f64>() / gaps.len() as f64).sqrt();
    assert!(sd > mean_gap * 0.6, "sd {sd:.2} ms, mean {mean_gap:.2} ms");
    assert!(r.metrics.duration_s * 1e3 >= last);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_concurrency_caps_requests_in_flight() {
    let _serial = TIMING.lock().await;
    let (url, seen) = start_server().await;
    let mut opts = options(&url, RequestRate::Infinite);
    opts.max_concurrency = NonZeroUsize::new(3);
    let r = run(&requests("first_ms=60;chunks=1", 12), &opts).await;
    assert_eq!(r.metrics.completed, 12);
    assert_eq!(seen.peak_in_flight.load(Ordering::SeqCst), 3);
    assert_eq!(r.peak_concurrent_requests, 3);
    // Four waves of 60 ms.
    assert!(r.metrics.duration_s >= 0.24, "{}", r.metrics.duration_s);
    let records = r.requests.as_ref().expect("saved");
    // All arrived at once; later ones were sent when a slot freed, and their TTFT starts
    // then (vLLM's clock), not at arrival.
    let waited: Vec<_> = records.iter().filter(|x| x.start_ms >= 60.0).collect();
    assert_eq!(waited.len(), 9);
    let last_arrival = records.iter().map(|x| x.arrival_ms).fold(0.0, f64::max);
    assert!(waited.iter().all(|x| x.start_ms > last_arrival));
    assert!(records.iter().all(|x| x.ttft_ms >= Some(60.0)));
    within(r.metrics.ttft_ms.median, 60.0, 60.0, "TTFT from the send");
}

#[test]
fn synthetic_prompts_have_the_asked_length() {
    use switchyard_bench::serve::synthetic::{synthetic_requests, SyntheticOptions};
    let path = switchyard_zoo::ensure("smollm2-135m-instruct").expect("model");
    let source = switchyard_weights::open(&path).expect("open");
    let tok = switchyard_tokenizer::Tokenizer::from_source(&*source).expect("tokenizer");
    let opts = SyntheticOptions {
        num_prompts: 8,
        input_len: 64,
        output_len: 32,
        seed: 5,
    };
    let reqs = synthetic_requests(&tok, &opts).expect("prompts");
    assert_eq!(reqs.len(), 8);
    let bos = usize::from(tok.adds_bos() && tok.bos_id().is_some());
    for r in &reqs {
        // The recorded length is the prompt's own tokenization.
        let n = tok.encode(&r.prompt, true, false).expect("encode").len();
        assert_eq!(r.prompt_tokens, n);
        assert_eq!(r.output_len, 32);
        assert!(
            r.prompt_tokens.abs_diff(64) <= 2,
            "{} tokens",
            r.prompt_tokens
        );
        assert!(n > bos);
    }
    let exact = reqs.iter().filter(|r| r.prompt_tokens == 64).count();
    assert!(exact >= 6, "{exact} of 8 exact");
    // Seeded: the same prompts again, others for another seed.
    assert_eq!(synthetic_requests(&tok, &opts).expect("prompts"), reqs);
    let other = SyntheticOptions { seed: 6, ..opts };
    assert_ne!(synthetic_requests(&tok, &other).expect("prompts"), reqs);
}
