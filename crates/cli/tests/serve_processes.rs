//! `switchyard serve` as processes. A remote backend of three replicas, each its own process,
//! behind a fourth one: requests spread over the replicas by load; one replica killed (SIGKILL)
//! while requests run on it loses none of the requests that had not started streaming (they
//! are retried on another replica), ends the one streaming from it with an error event naming
//! the backend and the replica, is marked down and skipped, and is used again once a process
//! serves on its address again. And API keys never reach the log, even at trace level.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const MODEL: &str = "smollm2-135m-instruct";
/// Tokens of each stream that runs while a replica is killed: enough to outlast the kill.
const STREAM_TOKENS: usize = 256;

/// A `switchyard serve` process and its address; killed when dropped.
struct Server {
    child: Child,
    addr: String,
    /// Keeps reading the server's log so it never blocks on a full pipe.
    log: Option<JoinHandle<Vec<String>>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Kills the server and returns what it logged.
    fn stop(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let lines = self.log.take().map(|h| h.join().unwrap_or_default());
        lines.unwrap_or_default().join("\n")
    }
}

fn serve(args: &[&str]) -> Server {
    serve_with(args, &[])
}

fn serve_with(args: &[&str], env: &[(&str, &str)]) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .arg("serve")
        .args(args)
        .arg("--admin")
        .envs(env.iter().copied())
        // One compute thread each: four servers share two cores.
        .env("SWITCHYARD_THREADS", "1")
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn switchyard serve");
    let (addr, lines) = common::listening_addr(&mut child);
    let log = std::thread::spawn(move || lines.map_while(Result::ok).collect());
    Server {
        child,
        addr,
        log: Some(log),
    }
}

fn replica(port: &str) -> Server {
    serve(&[
        "--port",
        port,
        "--memory-budget",
        "256MiB",
        "--model",
        MODEL,
    ])
}

/// One HTTP/1.1 exchange on a fresh connection: (status, body).
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    http_with(addr, method, path, body, "")
}

/// The same with extra header lines (each ending in `\r\n`).
fn http_with(addr: &str, method: &str, path: &str, body: &str, headers: &str) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return (0, String::new());
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(300)));
    let sent = write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    if sent.is_err() {
        return (0, String::new());
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    (status, body)
}

/// The payload of a chunked HTTP/1.1 body (relayed answers are streamed).
fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}

fn completion(addr: &str, max_tokens: usize) -> (u16, String) {
    let body = format!(
        r#"{{"model":"pool","prompt":"Count slowly:","max_tokens":{max_tokens},"ignore_eos":true}}"#
    );
    http(addr, "POST", "/v1/completions", &body)
}

/// A streamed completion through the front server, on its own thread: says on `started` once
/// the first event came back, and returns the stream's `data:` payloads.
fn stream(
    front: &str,
    max_tokens: usize,
    started: std::sync::mpsc::Sender<()>,
) -> JoinHandle<Vec<String>> {
    let addr = front.to_string();
    std::thread::spawn(move || {
        let body = format!(
            r#"{{"model":"pool","prompt":"Count slowly:","max_tokens":{max_tokens},"ignore_eos":true,"stream":true,"stream_options":{{"include_usage":true}}}}"#
        );
        let Ok(mut s) = TcpStream::connect(&addr) else {
            return Vec::new();
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(300)));
        let sent = write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        if sent.is_err() {
            return Vec::new();
        }
        let mut raw = Vec::new();
        let mut buf = [0u8; 4096];
        let mut told = false;
        while let Ok(n @ 1..) = s.read(&mut buf) {
            raw.extend_from_slice(&buf[..n]);
            if !told && raw.windows(5).any(|w| w == b"data:") {
                let _ = started.send(());
                told = true;
            }
        }
        let text = String::from_utf8_lossy(&raw);
        let (_, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        dechunk(body)
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    })
}

/// `n` completions sent together through the front server.
fn burst(front: &str, n: usize, max_tokens: usize) -> Vec<JoinHandle<(u16, String)>> {
    (0..n)
        .map(|_| {
            let a = front.to_string();
            std::thread::spawn(move || completion(&a, max_tokens))
        })
        .collect()
}

/// Completions a replica answered with 200, from its own /metrics.
fn served(addr: &str) -> f64 {
    let (_, text) = http(addr, "GET", "/metrics", "");
    text.lines()
        .filter(|l| {
            l.starts_with("switchyard_requests_total{")
                && l.contains("route=\"completions\"")
                && l.contains("status=\"200\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The front's view of its replicas: (url, healthy) from /admin/stats.
fn replica_health(front: &str) -> Vec<(String, bool)> {
    let (_, body) = http(front, "GET", "/admin/stats", "");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    v["pool"]["replicas"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            (
                r["url"].as_str().unwrap_or_default().to_string(),
                r["healthy"].as_bool().unwrap_or(false),
            )
        })
        .collect()
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn replicas_share_the_load_and_a_killed_one_loses_no_request() {
    let mut replicas: Vec<Server> = (0..3).map(|_| replica("0")).collect();
    let urls: Vec<String> = replicas
        .iter()
        .map(|r| format!("\"http://{}\"", r.addr))
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("front.toml");
    std::fs::write(
        &config,
        format!(
            "[[backends]]\nkind = \"openai\"\nname = \"pool\"\nmodel = \"{MODEL}\"\nurls = [{}]\nhealth_interval_s = 1\n",
            urls.join(", ")
        ),
    )
    .expect("config");
    let front = serve(&["--config", &config.to_string_lossy(), "--port", "0"]);
    let f = front.addr.clone();
    let addrs: Vec<String> = replicas.iter().map(|r| r.addr.clone()).collect();
    wait_for("every replica is healthy", || {
        let h = replica_health(&f);
        h.len() == 3 && h.iter().all(|(_, ok)| *ok)
    });

    // Twelve at once: each replica takes a share (the least loaded one gets the next).
    for (i, h) in burst(&f, 12, 8).into_iter().enumerate() {
        let (status, body) = h.join().expect("request thread");
        assert_eq!(status, 200, "request {i}: {body}");
    }
    let counts: Vec<f64> = addrs.iter().map(|a| served(a)).collect();
    assert_eq!(counts.iter().sum::<f64>(), 12.0, "{counts:?}");
    assert!(counts.iter().all(|&c| c >= 2.0), "load spread {counts:?}");

    // Kill the second replica while requests run on every replica: none is lost that had not
    // started streaming. One stream on each replica first, one after the other so that each
    // goes to the least loaded (an idle) replica.
    let (started, first_events) = std::sync::mpsc::channel();
    let streams: Vec<_> = (0..3)
        .map(|_| {
            let h = stream(&f, STREAM_TOKENS, started.clone());
            first_events
                .recv_timeout(Duration::from_secs(120))
                .expect("the stream's first event");
            h
        })
        .collect();
    let running = burst(&f, 12, 48);
    wait_for("the second replica is busy", || {
        let (_, text) = http(&addrs[1], "GET", "/metrics", "");
        text.lines().any(|l| {
            l.starts_with("switchyard_requests_in_flight{") && !l.trim_end().ends_with(" 0")
        })
    });
    let killed = replicas.remove(1);
    drop(killed);
    for (i, h) in running.into_iter().enumerate() {
        let (status, body) = h.join().expect("request thread");
        assert_eq!(status, 200, "request {i} after the kill: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(v["usage"]["completion_tokens"], 48, "{v}");
    }
    // The stream from the killed replica ends with an error event naming the backend and the
    // replica, then [DONE]; the other two run to their end.
    let ended: Vec<Vec<String>> = streams
        .into_iter()
        .map(|h| h.join().expect("stream thread"))
        .collect();
    let broken = format!(
        "the backend for `pool` is unavailable: replica http://{} failed mid-answer",
        addrs[1]
    );
    let mut outcomes = Vec::new();
    for events in &ended {
        assert_eq!(
            events.last().map(String::as_str),
            Some("[DONE]"),
            "{events:?}"
        );
        let chunks: Vec<serde_json::Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).expect("every relayed event is whole JSON"))
            .collect();
        let last = chunks.last().expect("an event before [DONE]");
        if let Some(message) = last["error"]["message"].as_str() {
            assert!(message.starts_with(&broken), "{message}");
            assert_eq!(last["error"]["type"], "service_unavailable");
            outcomes.push("error");
        } else {
            assert_eq!(
                last["usage"]["completion_tokens"], STREAM_TOKENS,
                "{events:?}"
            );
            assert!(
                chunks
                    .iter()
                    .any(|c| c["choices"][0]["finish_reason"] == "length"),
                "{events:?}"
            );
            outcomes.push("complete");
        }
    }
    outcomes.sort_unstable();
    assert_eq!(outcomes, ["complete", "complete", "error"]);
    let health = replica_health(&f);
    assert_eq!(
        health
            .iter()
            .map(|(u, ok)| (u.ends_with(&addrs[1]), *ok))
            .collect::<Vec<_>>(),
        vec![(false, true), (true, false), (false, true)],
        "{health:?}"
    );

    // While it is down every request goes to the other two.
    let before: Vec<f64> = [&addrs[0], &addrs[2]].iter().map(|a| served(a)).collect();
    for h in burst(&f, 6, 8) {
        assert_eq!(h.join().expect("request thread").0, 200);
    }
    let after: Vec<f64> = [&addrs[0], &addrs[2]].iter().map(|a| served(a)).collect();
    assert_eq!(after.iter().sum::<f64>() - before.iter().sum::<f64>(), 6.0);

    // A process on its address again: marked up by the health check, and used.
    let port = addrs[1].rsplit(':').next().expect("port").to_string();
    let back = replica(&port);
    assert_eq!(back.addr, addrs[1]);
    wait_for("the replica is healthy again", || {
        replica_health(&f).iter().all(|(_, ok)| *ok)
    });
    for h in burst(&f, 9, 8) {
        assert_eq!(h.join().expect("request thread").0, 200);
    }
    assert!(
        served(&back.addr) >= 1.0,
        "the restarted replica serves again"
    );
    // The front says what it did: the replica marked down, requests retried, back up.
    let log = front.stop();
    for what in [
        "replica marked down",
        "retrying on another replica",
        "replica is healthy again",
    ] {
        assert!(log.contains(what), "no {what:?} in the front's log:\n{log}");
    }
    // A request's log lines carry its id.
    assert!(
        log.lines()
            .any(|l| l.contains("retrying on another replica") && l.contains("request_id=")),
        "{log}"
    );
}

#[test]
fn api_keys_never_reach_the_log() {
    const KEY: &str = "sk-switchyard-test-8f3c2a91";
    const WRONG: &str = "sk-wrong-77d0e4b6";
    // Everything logged, from every crate.
    let server = serve_with(
        &["--port", "0", "--memory-budget", "256MiB", "--api-key", KEY],
        &[("RUST_LOG", "trace")],
    );
    let body = format!(r#"{{"model":"{MODEL}","prompt":"Hi","max_tokens":2}}"#);
    let good = format!("Authorization: Bearer {KEY}\r\n");
    let bad = format!("Authorization: Bearer {WRONG}\r\n");
    assert_eq!(
        http_with(&server.addr, "POST", "/v1/completions", &body, &good).0,
        200
    );
    assert_eq!(
        http_with(&server.addr, "POST", "/v1/completions", &body, &bad).0,
        401
    );
    assert_eq!(
        http_with(&server.addr, "GET", "/admin/stats", "", &bad).0,
        401
    );
    assert_eq!(
        http_with(&server.addr, "GET", "/admin/stats", "", &good).0,
        200
    );
    let log = server.stop();
    assert!(log.contains(" TRACE "), "trace logging is on:\n{log}");
    for secret in [KEY, WRONG, "8f3c2a91", "77d0e4b6"] {
        assert!(!log.contains(secret), "{secret} is in the log");
    }
}
