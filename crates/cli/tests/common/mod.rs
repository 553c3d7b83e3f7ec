//! Helpers the CLI's process tests share.

use std::io::{BufRead, BufReader, Lines};
use std::process::{Child, ChildStderr};
use std::time::{Duration, Instant};

/// Reads a spawned `switchyard serve`'s stderr (piped) until it says where it listens, within
/// 180 s; returns that address and the rest of the log.
pub fn listening_addr(child: &mut Child) -> (String, Lines<BufReader<ChildStderr>>) {
    let stderr = child.stderr.take().expect("stderr piped");
    let mut lines = BufReader::new(stderr).lines();
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        assert!(Instant::now() < deadline, "server did not start");
        let line = lines.next().expect("server output").expect("line");
        if let Some(rest) = line.split("listening on http://").nth(1) {
            return (rest.trim().to_string(), lines);
        }
    }
}
