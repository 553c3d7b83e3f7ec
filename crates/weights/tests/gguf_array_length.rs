//! A metadata array whose length was corrupted to a value the rest of a large file could hold
//! is refused without allocating for it: the reader checks the whole header's structure before
//! it builds any value. Before, it reserved 32-byte values for every claimed item (up to 32
//! times the bytes left) and then read the tensor data as array items.
//!
//! Its own test binary: the peak resident set it asserts is the process's.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use switchyard_weights::GgufFile;

/// The tensor data that follows the header: 64 MiB of zeros (a sparse file, no disk used).
const DATA_BYTES: u64 = 64 << 20;
/// The corrupted length: less than the bytes left, so it passes the check against them.
const CORRUPT_LEN: u64 = 60_000_000;
/// What opening may add to the peak resident set (the header pages it reads, the index).
const RSS_SLACK_KIB: u64 = 16 << 10;
const QUICK: Duration = Duration::from_secs(1);

fn push_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

/// A GGUF v3 file: a 16-byte `u8` array whose length field sits at the returned offset, a
/// name, and one f32 tensor of [`DATA_BYTES`].
fn write_file(path: &Path, array_len: u64) -> usize {
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes()); // tensors
    b.extend_from_slice(&2u64.to_le_bytes()); // metadata entries
    push_str(&mut b, "test.bytes");
    b.extend_from_slice(&9u32.to_le_bytes()); // array
    b.extend_from_slice(&0u32.to_le_bytes()); // of u8
    let len_at = b.len();
    b.extend_from_slice(&array_len.to_le_bytes());
    b.extend_from_slice(&[7u8; 16]);
    push_str(&mut b, "general.name");
    b.extend_from_slice(&8u32.to_le_bytes());
    push_str(&mut b, "tiny");
    push_str(&mut b, "w");
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&(DATA_BYTES / 4).to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes()); // F32
    b.extend_from_slice(&0u64.to_le_bytes());
    while b.len() % 32 != 0 {
        b.push(0);
    }
    let mut f = File::create(path).expect("create");
    f.write_all(&b).expect("write");
    f.set_len(b.len() as u64 + DATA_BYTES).expect("extend");
    len_at
}

/// The process's peak resident set in KiB (Linux's `VmHWM`).
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

#[cfg(target_os = "linux")]
#[test]
fn a_corrupted_array_length_in_a_large_file_is_refused_without_allocating() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = dir.path().join("good.gguf");
    write_file(&good, 16);
    let f = GgufFile::open(&good).expect("the uncorrupted file opens");
    assert_eq!(f.metadata().get_str("general.name").ok(), Some("tiny"));
    assert_eq!(f.tensors()[0].n_bytes as u64, DATA_BYTES);
    drop(f);

    let bad = dir.path().join("bad.gguf");
    let len_at = write_file(&bad, CORRUPT_LEN);
    let before = peak_rss_kib();
    let t0 = Instant::now();
    let err = GgufFile::open(&bad)
        .expect_err("the corrupted file is refused")
        .to_string();
    let took = t0.elapsed();
    let grown = peak_rss_kib() - before;
    assert!(err.contains("is corrupt at byte"), "{err}");
    assert!(
        grown < RSS_SLACK_KIB,
        "the peak resident set grew by {grown} KiB refusing a length at byte {len_at}"
    );
    assert!(took < QUICK, "refusing took {took:?}");
}
