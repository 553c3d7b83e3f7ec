//! A model file damaged in the cache after its pull is refused before it is used, never loaded
//! into a wrong answer: the real smollm2 file, copied into a temporary cache, corrupted at
//! random offsets (header and tensor data alike, the size unchanged so that the file still
//! counts as present), then resolved the way `switchyard serve` resolves a catalog name.
//!
//! Each variant must come back as [`ZooError::Corrupt`] naming the file, the expected and the
//! found hash and the command that replaces it, with the file's record removed. The header's
//! own parsing of corrupt bytes (without a hash to compare) is covered by the `weights` crate's
//! `corrupt_gguf` tests and its property tests.
//!
//! `SWITCHYARD_CORRUPT_VARIANTS` sets the number of variants: 250 by default (about 17 s), 1,000
//! for the reliability report (about 70 s).

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, ensure, Context};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use switchyard_zoo::cache::sidecar_path;
use switchyard_zoo::{Asset, Cache, PullOptions, ZooError};

const MODEL: &str = "smollm2-135m-instruct";
const DEFAULT_VARIANTS: usize = 250;
const SEED: u64 = 0xC0_22_07;
const QUIET: PullOptions = PullOptions { quiet: true };

fn variants() -> usize {
    std::env::var("SWITCHYARD_CORRUPT_VARIANTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_VARIANTS)
}

fn write_record(path: &Path, sha256: &str) -> anyhow::Result<()> {
    let name = path.file_name().context("file name")?.to_string_lossy();
    fs::write(sidecar_path(path), format!("{sha256}  {name}\n"))?;
    Ok(())
}

/// A temporary cache holding a verified copy of the real model file. It has no interpreter, so
/// nothing in these tests can download.
fn cache_with_a_copy() -> anyhow::Result<(&'static Asset, tempfile::TempDir, Cache, PathBuf)> {
    let asset = switchyard_zoo::find(MODEL).context("catalog entry")?;
    let real = switchyard_zoo::ensure(MODEL)?;
    let dir = tempfile::tempdir()?;
    let cache = Cache::new(dir.path()).with_python("/nonexistent/python3");
    let path = cache.path_of(asset);
    fs::create_dir_all(path.parent().context("models folder")?)?;
    fs::copy(&real, &path)?;
    write_record(&path, asset.sha256)?;
    Ok((asset, dir, cache, path))
}

#[test]
fn corrupted_cached_model_files_are_refused_by_sha256() -> anyhow::Result<()> {
    let (asset, _dir, cache, path) = cache_with_a_copy()?;
    ensure!(cache.pull_verified(asset, &QUIET)? == path);

    let file = OpenOptions::new().read(true).write(true).open(&path)?;
    let len = file.metadata()?.len();
    let mut rng = StdRng::seed_from_u64(SEED);
    let n = variants();
    let start = Instant::now();
    let mut in_header = 0;
    for v in 0..n {
        // A quarter of the variants hit the first 2 MiB (magic, metadata, tensor index), the
        // rest anywhere; 1 to 8 bytes, each changed to a different value.
        let at = if v % 4 == 0 {
            rng.random_range(0..(2u64 << 20).min(len))
        } else {
            rng.random_range(0..len)
        };
        let width = rng.random_range(1..=8u64).min(len - at) as usize;
        let mut original = vec![0u8; width];
        file.read_exact_at(&mut original, at)?;
        let damaged: Vec<u8> = original
            .iter()
            .map(|b| b ^ rng.random_range(1..=255u8))
            .collect();
        file.write_all_at(&damaged, at)?;
        in_header += usize::from(at < 2 << 20);

        match cache.pull_verified(asset, &QUIET) {
            Err(ZooError::Corrupt {
                asset: name,
                path: p,
                expected,
                actual,
            }) => {
                ensure!(
                    name == MODEL && p == path,
                    "variant {v}: names {name} {p:?}"
                );
                ensure!(expected == asset.sha256 && actual != expected && actual.len() == 64);
            }
            Err(e) => bail!("variant {v} (offset {at}, {width} bytes): other error {e}"),
            Ok(_) => bail!("variant {v} (offset {at}, {width} bytes) was accepted"),
        }
        ensure!(
            !sidecar_path(&path).exists(),
            "variant {v}: the record of a corrupt file must be removed"
        );
        file.write_all_at(&original, at)?;
        write_record(&path, asset.sha256)?;
    }
    eprintln!(
        "{n} corrupt variants ({in_header} in the header region) refused in {:.1} s",
        start.elapsed().as_secs_f64()
    );

    // Restored, the file is accepted again.
    ensure!(cache.pull_verified(asset, &QUIET)? == path);

    // The message tells the user what happened and what to run.
    file.write_all_at(&[0xAB], len / 2)?;
    let message = match cache.pull_verified(asset, &QUIET) {
        Err(e) => e.to_string(),
        Ok(_) => bail!("a corrupt file was accepted"),
    };
    for part in [
        "does not match the catalog's SHA-256",
        asset.sha256,
        "switchyard models pull smollm2-135m-instruct",
    ] {
        ensure!(message.contains(part), "{part:?} missing from: {message}");
    }
    // With its record gone, the next pull hashes the file again and replaces it (here it
    // cannot download, and says so; the damaged file is gone, not served).
    match cache.pull_verified(asset, &QUIET) {
        Err(ZooError::PythonMissing { .. }) => {}
        other => bail!("expected a fresh download to be attempted, got {other:?}"),
    }
    ensure!(!path.exists(), "the damaged file must be removed");
    Ok(())
}

#[test]
fn a_truncated_cached_model_file_is_not_present_and_is_replaced() -> anyhow::Result<()> {
    let (asset, _dir, cache, path) = cache_with_a_copy()?;
    let file = OpenOptions::new().write(true).open(&path)?;
    file.set_len(asset.size / 3)?;
    ensure!(!cache.is_present(asset));
    match cache.pull_verified(asset, &QUIET) {
        Err(ZooError::PythonMissing { .. }) => {}
        other => bail!("expected a fresh download to be attempted, got {other:?}"),
    }
    ensure!(!path.exists(), "the truncated file must be removed");
    Ok(())
}
