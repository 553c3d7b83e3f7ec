//! The `.partial` file an asset is assembled into: written, counted and hashed in one pass, and
//! removed again unless the pull that owns it completes.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use indicatif::ProgressBar;
use sha2::{Digest, Sha256};

use crate::error::{Result, ZooError};

/// Write buffer of the `.partial` file.
const WRITE_BUF_BYTES: usize = 1 << 20;
/// Read size when hashing a file already on disk.
const HASH_BUF_BYTES: usize = 1 << 20;

/// Appends bytes to a `.partial` file while hashing and counting them. Dropping it without
/// [`Sink::finish`] deletes the file, so an error midway leaves nothing behind.
pub(crate) struct Sink {
    path: PathBuf,
    out: Option<BufWriter<File>>,
    hasher: Sha256,
    len: u64,
    progress: ProgressBar,
}

impl Sink {
    /// Creates (or truncates a stale) `path`.
    pub(crate) fn create(path: &Path, progress: ProgressBar) -> Result<Sink> {
        let file = File::create(path).map_err(ZooError::io(path))?;
        Ok(Sink {
            path: path.to_path_buf(),
            out: Some(BufWriter::with_capacity(WRITE_BUF_BYTES, file)),
            hasher: Sha256::new(),
            len: 0,
            progress,
        })
    }

    pub(crate) fn write(&mut self, bytes: &[u8]) -> Result<()> {
        if let Some(out) = self.out.as_mut() {
            out.write_all(bytes).map_err(ZooError::io(&self.path))?;
        }
        self.hasher.update(bytes);
        self.len += bytes.len() as u64;
        self.progress.inc(bytes.len() as u64);
        Ok(())
    }

    /// Flushes and syncs the file to disk; returns its path, length and SHA-256 (lowercase
    /// hex). The file stays; the caller renames or removes it.
    pub(crate) fn finish(mut self) -> Result<(PathBuf, u64, String)> {
        if let Some(out) = self.out.take() {
            let file = out
                .into_inner()
                .map_err(|e| ZooError::io(&self.path)(e.into_error()))?;
            file.sync_all().map_err(ZooError::io(&self.path))?;
        }
        let digest = hex::encode(std::mem::take(&mut self.hasher).finalize());
        let path = std::mem::take(&mut self.path);
        Ok((path, self.len, digest))
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        // `finish` empties `path`; any other drop is an abandoned assembly.
        if !self.path.as_os_str().is_empty() {
            self.out.take();
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// SHA-256 (lowercase hex) and length of a file on disk, advancing `progress` as it reads.
pub(crate) fn hash_file(path: &Path, progress: &ProgressBar) -> Result<(u64, String)> {
    let mut file = File::open(path).map_err(ZooError::io(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; HASH_BUF_BYTES];
    let mut len = 0u64;
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ZooError::io(path)(e)),
        };
        hasher.update(&buf[..n]);
        len += n as u64;
        progress.inc(n as u64);
    }
    Ok((len, hex::encode(hasher.finalize())))
}

#[cfg(test)]
mod tests {
    use super::*;

    // SHA-256 of "abc" (FIPS 180-2, appendix B.1).
    const ABC_SHA256: &str = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

    #[test]
    fn sink_hashes_what_it_writes_in_pieces() -> Result<()> {
        let dir = tempfile::tempdir().map_err(ZooError::io("tempdir"))?;
        let path = dir.path().join("x.partial");
        let mut sink = Sink::create(&path, ProgressBar::hidden())?;
        sink.write(b"a")?;
        sink.write(b"bc")?;
        let (p, len, sha) = sink.finish()?;
        assert_eq!(
            (p.as_path(), len, sha.as_str()),
            (path.as_path(), 3, ABC_SHA256)
        );
        assert_eq!(std::fs::read(&path).map_err(ZooError::io(&path))?, b"abc");
        assert_eq!(
            hash_file(&path, &ProgressBar::hidden())?,
            (3, ABC_SHA256.into())
        );
        Ok(())
    }

    #[test]
    fn an_abandoned_sink_deletes_its_file() -> Result<()> {
        let dir = tempfile::tempdir().map_err(ZooError::io("tempdir"))?;
        let path = dir.path().join("x.partial");
        let mut sink = Sink::create(&path, ProgressBar::hidden())?;
        sink.write(b"half a model")?;
        assert!(path.exists());
        drop(sink);
        assert!(!path.exists());
        Ok(())
    }
}
