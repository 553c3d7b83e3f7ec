//! `switchyard serve` as a process: SIGTERM while requests stream lets them finish, refuses
//! new work, and exits 0.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

/// A streamed completion over a raw HTTP/1.1 connection; returns the whole response text.
fn stream_completion(addr: &str, max_tokens: usize) -> String {
    let body = format!(
        r#"{{"model":"smollm2-135m-instruct","prompt":"Count slowly:","max_tokens":{max_tokens},"ignore_eos":true,"stream":true}}"#
    );
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

#[test]
fn sigterm_drains_running_streams_and_exits_zero() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["serve", "--port", "0", "--memory-budget", "256MiB"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn switchyard serve");
    let (addr, lines) = common::listening_addr(&mut child);
    let streams: Vec<_> = (0..2)
        .map(|_| {
            let a = addr.clone();
            std::thread::spawn(move || stream_completion(&a, 48))
        })
        .collect();
    // Let both streams start, then ask the server to stop.
    std::thread::sleep(Duration::from_millis(700));
    let st = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(st.success());
    for s in streams {
        let text = s.join().expect("stream thread");
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        let chunks = text.matches("\"text\":").count();
        assert_eq!(chunks, 48, "every token of a running request arrived");
        assert!(text.contains("data: [DONE]"), "stream finished: {text}");
    }
    // Drain stderr so the child never blocks on a full pipe, then check the exit status.
    let rest = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>());
    let status = child.wait().expect("wait");
    let log = rest.join().unwrap_or_default().join("\n");
    assert!(status.success(), "exit status {status:?}\n{log}");
    assert!(log.contains("switchyard stopped"), "{log}");
}
