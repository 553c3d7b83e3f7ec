//! Input that used to hang, starve or poison the server: each test attacks a server over a
//! tiny random model (see `common::synthetic`) and checks that the attack is refused or cut
//! off within a bound while `/health` keeps answering.

mod common;

use std::time::{Duration, Instant};

use common::synthetic;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The model name every test serves.
const MODEL: &str = "synthetic";

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
