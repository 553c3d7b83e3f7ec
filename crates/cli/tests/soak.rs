//! `switchyard bench soak` against a real `switchyard serve` process on SmolLM2, CI-sized: 40 s
//! of ShareGPT traffic at 1 request/s with a 4-s burst at 40 requests/s into a server that
//! admits 8 at a time. After the burst nothing fails (before it, at most a few 429s on a busy
//! machine); in it every failure is a 429 with Retry-After; no K/V block is held after the
//! drain; the JSON, Markdown and PNG files carry the figures.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Instant;

const MODEL: &str = "smollm2-135m-instruct";
/// The server's admission limit: the burst must overflow it.
const MAX_IN_FLIGHT: u64 = 8;
const DURATION_S: f64 = 40.0;
const WINDOW_S: f64 = 10.0;
const BURST_AT_S: f64 = 15.0;
const BURST_S: f64 = 4.0;
/// About 45% of this server's saturation (~4.6 requests/s at 16 tokens on two cores) is 2
/// requests/s; 1 leaves room for a machine shared with a build, so that a 429 outside the
/// burst means a leak, not a busy neighbour.
const REQUEST_RATE: f64 = 1.0;
const BURST_RATE: f64 = 40.0;

/// A `switchyard serve` process; killed when dropped.
struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(config: &std::path::Path) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["serve", "--config"])
        .arg(config)
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn switchyard serve");
    let (addr, lines) = common::listening_addr(&mut child);
    // Keeps reading the log so the server never blocks on a full pipe.
    std::thread::spawn(move || lines.map_while(Result::ok).for_each(drop));
    Server { child, addr }
}

fn phase<'a>(report: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    &report["burst"][name]
}

fn count(v: &serde_json::Value) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("expected a count, got {v}"))
}

fn png_size(path: &std::path::Path) -> (u32, u32) {
    let png = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{}", path.display());
    let be = |i: usize| u32::from_be_bytes([png[i], png[i + 1], png[i + 2], png[i + 3]]);
    // The IHDR chunk comes first: width and height after its length and type.
    assert_eq!(&png[12..16], b"IHDR");
    (be(16), be(20))
}

#[test]
fn a_short_soak_with_a_burst_fails_only_with_429s_and_leaves_no_kv_blocks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("serve.toml");
    // No prefix cache, so that every used block after the drain would be a leak.
    std::fs::write(
        &config,
        format!(
            "[server]\nport = 0\nmax_in_flight = {MAX_IN_FLIGHT}\n\n[[models]]\nname = \"{MODEL}\"\nmemory_budget = \"256MiB\"\nprefix_caching = false\n"
        ),
    )
    .expect("config");
    let server = serve(&config);
    let (json, md, png) = (
        dir.path().join("soak.json"),
        dir.path().join("soak.md"),
        dir.path().join("soak.png"),
    );
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["bench", "soak", "--model", MODEL, "--max-tokens", "16"])
        .args(["--url", &format!("http://{}", server.addr)])
        .args(["--server-pid", &server.child.id().to_string()])
        .args(["--num-prompts", "200", "--seed", "1"])
        .args(["--request-rate", &REQUEST_RATE.to_string()])
        .args(["--duration-s", &DURATION_S.to_string()])
        .args(["--window-s", &WINDOW_S.to_string()])
        .args(["--burst-at-s", &BURST_AT_S.to_string()])
        .args(["--burst-s", &BURST_S.to_string()])
        .args(["--burst-rate", &BURST_RATE.to_string()])
        .arg("--json")
        .arg(&json)
        .arg("--markdown")
        .arg(&md)
        .arg("--plot")
        .arg(&png)
        .output()
        .expect("run bench soak");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench soak failed:\n{}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let wall = started.elapsed().as_secs_f64();
    // The traffic lasts the duration; the drain of 16-token requests takes seconds.
    assert!((DURATION_S..DURATION_S + 30.0).contains(&wall), "{wall} s");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("parse");

    // Every scheduled request was sent and ended one way or the other.
    let req = &r["requests"];
    let sent = count(&req["sent"]);
    assert_eq!(sent, count(&req["scheduled"]), "{req}");
    assert_eq!(count(&req["completed"]) + count(&req["failed"]), sent);
    // 1/s over 40 s plus 40/s over 4 s: 200 expected (Poisson spread).
    assert!((140..=260).contains(&sent), "{sent} sent");
    // The server never admitted more than its limit, and the burst filled it. This is the
    // server's own count: the client sees each response end a moment after its place was given
    // back, so its overlap can exceed the limit by the requests crossing that moment (one CI
    // run saw 10 for 8).
    assert_eq!(count(&req["server_peak_admitted"]), MAX_IN_FLIGHT, "{req}");

    // After the burst nothing fails: a place or a block lost in it would show here as 429s
    // at 1 request/s. Before it, on a machine shared with other jobs (one CI run measured a
    // pre-burst P99 of 3.7 s for these 16-token requests and refused 1 of 21), 8 Poisson
    // arrivals can meet one slow stretch: a 429 with Retry-After there is the server refusing
    // honestly, not a leak, as nothing has been overloaded yet. Only such 429s, and few of
    // them, are accepted there; every other failure anywhere outside the burst fails the test.
    let after = phase(&r, "after");
    assert_eq!(count(&after["failed"]), 0, "after: {after}");
    assert!(count(&after["completed"]) > 0, "after: {after}");
    let before = phase(&r, "before");
    assert!(count(&before["completed"]) > 0, "before: {before}");
    assert_eq!(count(&before["other_failures"]), 0, "before: {before}");
    assert_eq!(
        count(&before["failed"]),
        count(&before["http_429_with_retry_after"]),
        "before: {before}"
    );
    assert!(
        count(&before["failed"]) * 5 <= count(&before["sent"]),
        "more than a fifth refused before the burst: {before}"
    );
    assert_eq!(
        count(&r["burst"]["failures_outside"]),
        count(&before["failed"]),
        "{}",
        r["burst"]
    );
    let during = phase(&r, "during");
    assert!(
        count(&during["http_429"]) >= 20,
        "the burst did not overload the server: {during}"
    );
    for name in ["during", "drain"] {
        let p = phase(&r, name);
        assert_eq!(count(&p["other_failures"]), 0, "{name}: {p}");
        assert_eq!(count(&p["failed"]), count(&p["http_429"]), "{name}: {p}");
        assert_eq!(
            count(&p["http_429"]),
            count(&p["http_429_with_retry_after"]),
            "{name}: {p}"
        );
    }
    let reasons = r["failure_reasons"].as_object().expect("reasons");
    assert_eq!(
        reasons.keys().collect::<Vec<_>>(),
        ["http_429"],
        "{reasons:?}"
    );
    assert_eq!(count(&reasons["http_429"]), count(&req["failed"]));

    // No block held after the drain, though the sampler saw blocks in use during the run.
    let kv = &r["kv_blocks"];
    assert_eq!(kv["drained"], true, "{kv}");
    assert_eq!(count(&kv["used_after_drain"]), 0, "{kv}");
    assert_eq!(count(&kv["held_after_drain"]), 0, "{kv}");
    assert!(count(&kv["max_used"]) > 0, "{kv}");
    assert!(count(&kv["blocks_total"]) > count(&kv["max_used"]), "{kv}");

    // Memory: one sample a second from a fresh server, inside budget + overhead.
    let mem = &r["memory"];
    let samples = count(&mem["samples"]);
    assert!(
        (DURATION_S as u64 - 2..=DURATION_S as u64 + 30).contains(&samples),
        "{mem}"
    );
    assert_eq!(
        r["timeline"].as_array().map(Vec::len),
        Some(samples as usize)
    );
    assert_eq!(count(&mem["server_requests_before_soak"]), 0, "{mem}");
    assert_eq!(mem["memory_budget_mib"], 256.0, "{mem}");
    assert_eq!(mem["server_exited"], false, "{mem}");
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or_else(|| panic!("number: {v}"));
    let startup = f(&mem["startup_rss_mib"]);
    // SmolLM2's weights and its K/V pool are resident from the start.
    assert!(startup > 100.0, "{mem}");
    assert!(f(&mem["max_rss_mib"]) >= startup, "{mem}");
    assert!((f(&mem["budget_plus_overhead_mib"]) - (256.0 + startup)).abs() < 1e-6);
    assert_eq!(mem["within_budget_plus_overhead"], true, "{mem}");
    assert!(f(&mem["rss_growth_mib_per_hour"]).is_finite(), "{mem}");
    let b = &r["burst"];
    assert!(f(&b["max_rss_during_mib"]) >= startup, "{b}");
    assert!(f(&b["max_rss_after_mib"]) >= startup, "{b}");
    assert!(f(&b["pre_burst_e2el_p99_ms"]) > 0.0, "{b}");
    assert!(f(&b["drained_at_s"]) >= BURST_AT_S + BURST_S, "{b}");
    if let Some(t) = b["recovered_after_s"].as_f64() {
        assert!((0.0..DURATION_S - BURST_AT_S - BURST_S).contains(&t), "{b}");
    }

    // Latency per 10-s window: four windows that account for every request sent.
    let windows = r["windows"].as_array().expect("windows");
    assert_eq!(windows.len(), 4, "{windows:?}");
    assert_eq!(windows.iter().map(|w| count(&w["sent"])).sum::<u64>(), sent);
    let bursty: Vec<bool> = windows.iter().map(|w| w["burst"] == true).collect();
    assert_eq!(bursty, [false, true, false, false]);
    for w in windows {
        assert!(count(&w["completed"]) > 0, "{w}");
        assert!(f(&w["e2el_p99_ms"]) >= f(&w["e2el_p50_ms"]), "{w}");
    }
    assert_eq!(r["plan"]["request_rate"], REQUEST_RATE);
    assert_eq!(r["plan"]["burst"]["at_s"], BURST_AT_S);

    // The Markdown on stdout and in the file; both plots.
    let text = std::fs::read_to_string(&md).expect("markdown");
    assert_eq!(text, stdout);
    let outside = format!("Failures outside the burst: {}.", count(&before["failed"]));
    for line in [
        "### Burst: 40.0 req/s from 15 s to 19 s",
        outside.as_str(),
        "| fixed overhead: VmRSS at start |",
        "K/V blocks after the drain: 0 used",
        "| 10-20 (burst) |",
    ] {
        assert!(text.contains(line), "no {line:?} in:\n{text}");
    }
    assert_eq!(png_size(&png), (900, 560));
    assert_eq!(png_size(&dir.path().join("soak-latency.png")), (900, 560));
    // The server is still up and idle.
    drop(server);
}
