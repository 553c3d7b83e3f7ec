//! The SHA-256 that keys exit heads to a model file, computed at most once per file version.
//!
//! A zoo model that is present has been verified against the catalog, so the catalog's hash is
//! its hash (no reading). Any other file is hashed once and the result cached beside it in
//! `<model>.exits-sha256.json`, keyed by size and modification time: a gigabyte model is not
//! re-hashed on every start, and a changed file (new size or mtime) is hashed again. A model
//! folder (safetensors) hashes its regular files in name order, each as name, length, bytes.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{ExitsError, Result};

/// `model` with `suffix` appended to its last component (a trailing `/` of a folder dropped).
pub fn sibling(model: &Path, suffix: &str) -> PathBuf {
    let s = model.as_os_str().to_string_lossy();
    let trimmed = s.trim_end_matches('/');
    PathBuf::from(format!("{trimmed}{suffix}"))
}

/// A model's identity as the heads file records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    pub sha256: String,
    /// Bytes hashed (all files of a folder).
    pub bytes: u64,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct CachedHash {
    bytes: u64,
    mtime_ns: u128,
    sha256: String,
}

/// Where the hash of a non-zoo model is cached.
pub fn hash_cache_path(model: &Path) -> PathBuf {
    sibling(model, ".exits-sha256.json")
}

/// The model's fingerprint: the zoo catalog's verified hash, the cached hash when size and
/// mtime still match, or a fresh hash (then cached; a failure to write the cache is logged,
/// not fatal).
pub fn fingerprint(model: &Path) -> Result<Fingerprint> {
    if let Some(f) = zoo_fingerprint(model) {
        return Ok(f);
    }
    let (bytes, mtime_ns) = size_and_mtime(model)?;
    let cache = hash_cache_path(model);
    if let Some(c) = fs::read(&cache)
        .ok()
        .and_then(|b| serde_json::from_slice::<CachedHash>(&b).ok())
        .filter(|c| c.bytes == bytes && c.mtime_ns == mtime_ns)
    {
        return Ok(Fingerprint {
            sha256: c.sha256,
            bytes,
        });
    }
    let _span = tracing::info_span!("hash_model", path = %model.display()).entered();
    let sha256 = hash_path(model)?;
    let entry = CachedHash {
        bytes,
        mtime_ns,
        sha256: sha256.clone(),
    };
    if let Ok(text) = serde_json::to_vec_pretty(&entry) {
        if let Err(e) = fs::write(&cache, text) {
            tracing::warn!(path = %cache.display(), error = %e, "cannot cache the model hash");
        }
    }
    Ok(Fingerprint { sha256, bytes })
}

/// The catalog hash of a present zoo model at `path`.
fn zoo_fingerprint(path: &Path) -> Option<Fingerprint> {
    let want = fs::canonicalize(path).ok()?;
    switchyard_zoo::catalog()
        .iter()
        .filter(|a| a.kind == switchyard_zoo::AssetKind::Model)
        .find(|a| {
            fs::canonicalize(switchyard_zoo::path_of(a)).is_ok_and(|p| p == want)
                && switchyard_zoo::is_present(a)
        })
        .map(|a| Fingerprint {
            sha256: a.sha256.to_string(),
            bytes: a.size,
        })
}

fn files_of(path: &Path) -> Result<Vec<PathBuf>> {
    let meta = fs::metadata(path).map_err(ExitsError::io(path))?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files: Vec<PathBuf> = fs::read_dir(path)
        .map_err(ExitsError::io(path))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    Ok(files)
}

fn size_and_mtime(path: &Path) -> Result<(u64, u128)> {
    let (mut bytes, mut mtime) = (0u64, 0u128);
    for f in files_of(path)? {
        let m = fs::metadata(&f).map_err(ExitsError::io(&f))?;
        bytes += m.len();
        let t = m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        mtime = mtime.max(t);
    }
    Ok((bytes, mtime))
}

/// SHA-256 of a file, or of a folder's files (name, length, bytes each, in name order).
pub fn hash_path(path: &Path) -> Result<String> {
    let is_dir = fs::metadata(path).map_err(ExitsError::io(path))?.is_dir();
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for f in files_of(path)? {
        let mut file = fs::File::open(&f).map_err(ExitsError::io(&f))?;
        if is_dir {
            let name = f.file_name().map(|n| n.to_string_lossy().into_owned());
            h.update(name.unwrap_or_default().as_bytes());
            h.update([0u8]);
            let len = file.metadata().map_err(ExitsError::io(&f))?.len();
            h.update(len.to_le_bytes());
        }
        loop {
            let n = file.read(&mut buf).map_err(ExitsError::io(&f))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    Ok(hex::encode(h.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_file_is_hashed_once_and_rehashed_when_it_changes() -> Result<()> {
        let dir = tempfile::tempdir().map_err(ExitsError::io("tempdir"))?;
        let model = dir.path().join("m.gguf");
        fs::write(&model, b"abc").map_err(ExitsError::io(&model))?;
        let f = fingerprint(&model)?;
        // sha256("abc")
        assert_eq!(
            f.sha256,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(f.bytes, 3);
        assert!(hash_cache_path(&model).exists());
        // A cached entry is trusted while size and mtime match: poison it to prove no re-hash.
        let cache = hash_cache_path(&model);
        let mut c: CachedHash = serde_json::from_slice(&fs::read(&cache).unwrap()).unwrap();
        c.sha256 = "cached".into();
        fs::write(&cache, serde_json::to_vec(&c).unwrap()).unwrap();
        assert_eq!(fingerprint(&model)?.sha256, "cached");
        // A different size invalidates it.
        fs::write(&model, b"abcd").map_err(ExitsError::io(&model))?;
        assert_eq!(
            fingerprint(&model)?.sha256,
            "88d4266fd4e6338d13b845fcf289579d209c897823b9217da3e161936f031589"
        );
        Ok(())
    }

    #[test]
    fn folders_hash_their_files_in_order() -> Result<()> {
        let dir = tempfile::tempdir().map_err(ExitsError::io("tempdir"))?;
        let m = dir.path().join("model");
        fs::create_dir(&m).map_err(ExitsError::io(&m))?;
        fs::write(m.join("b.safetensors"), b"2").map_err(ExitsError::io(&m))?;
        fs::write(m.join("a.json"), b"1").map_err(ExitsError::io(&m))?;
        let a = hash_path(&m)?;
        fs::write(m.join("a.json"), b"3").map_err(ExitsError::io(&m))?;
        assert_ne!(a, hash_path(&m)?);
        Ok(())
    }
}
