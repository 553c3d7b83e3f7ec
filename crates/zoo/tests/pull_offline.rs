//! The real pull path (pip, archives, assembly, verification, locking) against a local package
//! index built in a temp folder: `pip download --no-index --find-links DIR`, no network.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};

use anyhow::{ensure, Context};
use sha2::{Digest, Sha256};
use switchyard_zoo::cache::{partial_path, sidecar_path};
use switchyard_zoo::{
    ArchiveKind, Asset, AssetKind, Cache, Outcome, Part, PullOptions, Pulled, ZooError,
};

const VERSION: &str = "0.1.0";
const QUIET: PullOptions = PullOptions { quiet: true };

/// Part 1 spans more than one 1 MiB copy buffer; the others are small and odd-sized.
const PART1_LEN: usize = (1 << 20) + (1 << 19) + 7;
const PART2_LEN: usize = 70_001;
const PART3_LINES: usize = 2_000;

/// Deterministic bytes (xorshift64), different for each seed.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn leak<T>(v: T) -> &'static T {
    Box::leak(Box::new(v))
}

fn leak_str(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

/// A find-links folder holding two wheels and one sdist, plus an empty cache beside it.
struct Fixture {
    _tmp: tempfile::TempDir,
    index: PathBuf,
    home: PathBuf,
    part1: Vec<u8>,
    part2: Vec<u8>,
    part3: Vec<u8>,
}

impl Fixture {
    fn new() -> anyhow::Result<Fixture> {
        let tmp = tempfile::tempdir()?;
        let index = tmp.path().join("index");
        let home = tmp.path().join("home");
        fs::create_dir_all(&index)?;
        let part1 = noise(1, PART1_LEN);
        let part2 = noise(2, PART2_LEN);
        let part3: Vec<u8> = (0..PART3_LINES)
            .flat_map(|i| format!("line {i}: to be, or not to be\n").into_bytes())
            .collect();
        write_wheel(
            &index,
            "zoo-test-part1",
            &[("zoo_test_part1/data/part01.bin", &part1)],
        )?;
        write_wheel(
            &index,
            "zoo-test-part2",
            &[
                ("zoo_test_part2/__init__.py", b""),
                ("zoo_test_part2/data/part02.bin", &part2),
            ],
        )?;
        write_sdist(
            &index,
            "zoo-test-sdist",
            &[("zoo_test_sdist-0.1.0/texts/part03.txt", &part3)],
        )?;
        Ok(Fixture {
            _tmp: tmp,
            index,
            home,
            part1,
            part2,
            part3,
        })
    }

    /// A cache in the fixture's home whose pip only sees the local index.
    fn cache(&self) -> Cache {
        Cache::new(&self.home).with_pip_args([
            "--no-index".into(),
            "--find-links".into(),
            self.index.clone().into_os_string(),
        ])
    }

    /// A cache whose pip cannot even start: pulls through it must not need pip.
    fn cache_without_python(&self) -> Cache {
        Cache::new(&self.home).with_python("/nonexistent/python3")
    }

    fn wheel1(&self) -> Part {
        wheel("zoo-test-part1", "zoo_test_part1/data/part01.bin")
    }

    fn wheel2(&self) -> Part {
        wheel("zoo-test-part2", "zoo_test_part2/data/part02.bin")
    }

    fn sdist3(&self) -> Part {
        Part {
            package: "zoo-test-sdist",
            version: VERSION,
            member: "zoo_test_sdist-0.1.0/texts/part03.txt",
            archive: ArchiveKind::Sdist,
        }
    }

    fn tmp_entries(&self) -> anyhow::Result<Vec<PathBuf>> {
        let tmp = self.home.join("tmp");
        if !tmp.exists() {
            return Ok(Vec::new());
        }
        Ok(fs::read_dir(tmp)?
            .map(|e| e.map(|e| e.path()))
            .collect::<Result<_, _>>()?)
    }
}

fn wheel(package: &'static str, member: &'static str) -> Part {
    Part {
        package,
        version: VERSION,
        member,
        archive: ArchiveKind::Wheel,
    }
}

/// An asset made of `parts` whose catalog size and hash are those of `content`.
fn asset(name: &str, parts: Vec<Part>, content: &[u8]) -> &'static Asset {
    leak(Asset {
        name: leak_str(name.to_string()),
        kind: AssetKind::Dataset,
        file_name: leak_str(format!("{name}.bin")),
        size: content.len() as u64,
        sha256: leak_str(sha256_hex(content)),
        parts: Box::leak(parts.into_boxed_slice()),
        description: "test asset",
        architecture: None,
    })
}

/// A minimal wheel pip accepts: the members plus a `.dist-info` with METADATA and WHEEL.
fn write_wheel(index: &Path, package: &str, members: &[(&str, &[u8])]) -> anyhow::Result<()> {
    let dist = package.replace('-', "_");
    let path = index.join(format!("{dist}-{VERSION}-py3-none-any.whl"));
    let mut zip = zip::ZipWriter::new(File::create(path)?);
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    let info = format!("{dist}-{VERSION}.dist-info");
    let metadata = format!("Metadata-Version: 2.1\nName: {package}\nVersion: {VERSION}\n");
    let wheel =
        "Wheel-Version: 1.0\nGenerator: zoo-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n";
    let meta_files = [
        (format!("{info}/METADATA"), metadata.as_bytes()),
        (format!("{info}/WHEEL"), wheel.as_bytes()),
        (format!("{info}/RECORD"), &b""[..]),
    ];
    for (name, data) in members
        .iter()
        .map(|(n, d)| (n.to_string(), *d))
        .chain(meta_files)
    {
        zip.start_file(name, opts)?;
        zip.write_all(data)?;
    }
    zip.finish()?;
    Ok(())
}

/// An sdist whose in-tree PEP 517 backend answers pip's metadata query, so pip needs neither
/// setuptools nor the network to "build" it.
fn write_sdist(index: &Path, package: &str, members: &[(&str, &[u8])]) -> anyhow::Result<()> {
    let dist = package.replace('-', "_");
    let root = format!("{dist}-{VERSION}");
    let pyproject = "[build-system]\nrequires = []\nbuild-backend = \"zoo_backend\"\n\
                     backend-path = [\".\"]\n";
    let metadata = format!("Metadata-Version: 2.1\nName: {package}\nVersion: {VERSION}\n");
    let backend = format!(
        r#"import os

def get_requires_for_build_wheel(config_settings=None):
    return []

def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    info = "{dist}-{VERSION}.dist-info"
    os.makedirs(os.path.join(metadata_directory, info), exist_ok=True)
    with open(os.path.join(metadata_directory, info, "METADATA"), "w") as f:
        f.write({metadata:?})
    return info

def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    raise RuntimeError("pip download never builds the wheel")
"#
    );
    let files = [
        (format!("{root}/PKG-INFO"), metadata.as_bytes()),
        (format!("{root}/pyproject.toml"), pyproject.as_bytes()),
        (format!("{root}/zoo_backend.py"), backend.as_bytes()),
    ];
    let gz = flate2::write::GzEncoder::new(
        File::create(index.join(format!("{root}.tar.gz")))?,
        flate2::Compression::default(),
    );
    let mut tar = tar::Builder::new(gz);
    for (name, data) in files
        .into_iter()
        .chain(members.iter().map(|(n, d)| (n.to_string(), *d)))
    {
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        tar.append_data(&mut header, name, data)?;
    }
    tar.into_inner()?.finish()?;
    Ok(())
}

fn mtime(path: &Path) -> anyhow::Result<std::time::SystemTime> {
    Ok(fs::metadata(path)?.modified()?)
}

#[test]
fn split_wheel_and_sdist_parts_are_assembled_in_order_and_a_second_pull_is_a_no_op(
) -> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let content = [&fx.part1[..], &fx.part2, &fx.part3].concat();
    let asset = asset(
        "split",
        vec![fx.wheel1(), fx.wheel2(), fx.sdist3()],
        &content,
    );
    let cache = fx.cache();
    assert!(!cache.is_present(asset));

    let pulled = cache.pull_detailed(asset, &QUIET)?;
    let path = fx.home.join("data/split.bin");
    assert_eq!(
        pulled,
        Pulled {
            path: path.clone(),
            outcome: Outcome::Downloaded
        }
    );
    let got = fs::read(&path)?;
    assert_eq!(got.len(), PART1_LEN + PART2_LEN + fx.part3.len());
    assert!(
        got == content,
        "parts must be concatenated in catalog order"
    );
    assert_eq!(
        fs::read_to_string(sidecar_path(&path))?,
        format!("{}  split.bin\n", sha256_hex(&content))
    );
    assert!(cache.is_present(asset));
    assert!(!partial_path(&path).exists());
    assert_eq!(
        fx.tmp_entries()?,
        Vec::<PathBuf>::new(),
        "download folders left"
    );

    // Present now: the second pull must neither run pip nor touch the file.
    let before = mtime(&path)?;
    let again = fx.cache_without_python().pull_detailed(asset, &QUIET)?;
    assert_eq!(again.outcome, Outcome::AlreadyPresent);
    assert_eq!(again.path, path);
    assert_eq!(mtime(&path)?, before);
    Ok(())
}

#[test]
fn a_wrong_hash_leaves_no_file_and_says_what_it_got() -> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let good = asset("p1", vec![fx.wheel1()], &fx.part1);
    let bad = leak(Asset {
        sha256: "00000000000000000000000000000000000000000000000000000000000000ff",
        ..good.clone()
    });
    let cache = fx.cache();
    match cache.pull(bad, &QUIET) {
        Err(ZooError::HashMismatch {
            asset,
            expected,
            actual,
        }) => {
            assert_eq!(asset, "p1");
            assert_eq!(expected, bad.sha256);
            assert_eq!(actual, sha256_hex(&fx.part1));
        }
        other => anyhow::bail!("expected HashMismatch, got {other:?}"),
    }
    let path = cache.path_of(bad);
    assert!(!path.exists() && !partial_path(&path).exists() && !sidecar_path(&path).exists());
    assert!(!cache.is_present(bad) && !cache.is_present(good));
    assert_eq!(fx.tmp_entries()?, Vec::<PathBuf>::new());
    Ok(())
}

#[test]
fn a_wrong_size_is_reported_before_the_hash() -> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let good = asset("p2", vec![fx.wheel2()], &fx.part2);
    let bad = leak(Asset {
        size: good.size + 1,
        ..good.clone()
    });
    let cache = fx.cache();
    let err = cache.pull(bad, &QUIET);
    ensure!(
        matches!(
            err,
            Err(ZooError::SizeMismatch { expected, actual, .. })
                if expected == PART2_LEN as u64 + 1 && actual == PART2_LEN as u64
        ),
        "{err:?}"
    );
    assert!(!cache.path_of(bad).exists());
    assert!(!partial_path(&cache.path_of(bad)).exists());
    Ok(())
}

#[test]
fn an_interrupted_pull_is_not_present_and_is_redone() -> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let content = [&fx.part1[..], &fx.part2].concat();
    let asset = asset("two", vec![fx.wheel1(), fx.wheel2()], &content);
    let cache = fx.cache();
    let path = cache.path_of(asset);

    // What a killed pull leaves: part of the file and its download folder.
    fs::create_dir_all(path.parent().context("no parent")?)?;
    fs::write(partial_path(&path), &fx.part1)?;
    let stale = fx.home.join("tmp/two@killed");
    fs::create_dir_all(&stale)?;
    fs::write(stale.join("half.whl"), b"PK")?;
    assert!(!cache.is_present(asset));

    assert_eq!(
        cache.pull_detailed(asset, &QUIET)?.outcome,
        Outcome::Downloaded
    );
    assert!(fs::read(&path)? == content);
    assert!(!partial_path(&path).exists());
    assert!(!stale.exists(), "the killed pull's download folder stays");
    assert!(cache.is_present(asset));
    Ok(())
}

#[test]
fn a_crash_between_rename_and_sidecar_is_recovered_without_downloading() -> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let asset = asset("p1", vec![fx.wheel1()], &fx.part1);
    let cache = fx.cache();
    cache.pull(asset, &QUIET)?;
    let path = cache.path_of(asset);
    fs::remove_file(sidecar_path(&path))?;
    assert!(!cache.is_present(asset));

    let offline = fx.cache_without_python();
    assert_eq!(
        offline.pull_detailed(asset, &QUIET)?.outcome,
        Outcome::Adopted
    );
    assert!(offline.is_present(asset));

    // A same-size file with other bytes is replaced by a fresh download.
    fs::remove_file(sidecar_path(&path))?;
    let mut corrupt = fx.part1.clone();
    corrupt[12_345] ^= 0xff;
    fs::write(&path, &corrupt)?;
    assert_eq!(
        cache.pull_detailed(asset, &QUIET)?.outcome,
        Outcome::Downloaded
    );
    assert!(fs::read(&path)? == fx.part1);
    Ok(())
}

#[test]
fn concurrent_pulls_download_once_and_agree() -> anyhow::Result<()> {
    const THREADS: usize = 4;
    let fx = Fixture::new()?;
    let content = [&fx.part2[..], &fx.part1].concat();
    let asset = asset("race", vec![fx.wheel2(), fx.wheel1()], &content);
    let start = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            // Each thread has its own Cache (and so its own lock file handle), like a process.
            let cache = fx.cache();
            let start = Arc::clone(&start);
            std::thread::spawn(move || {
                start.wait();
                cache.pull_detailed(asset, &QUIET)
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for h in handles {
        let pulled = h
            .join()
            .map_err(|_| anyhow::anyhow!("a pull thread panicked"))??;
        assert_eq!(pulled.path, fx.home.join("data/race.bin"));
        outcomes.push(pulled.outcome);
    }
    let downloads = outcomes
        .iter()
        .filter(|o| **o == Outcome::Downloaded)
        .count();
    assert_eq!(downloads, 1, "{outcomes:?}");
    assert!(fs::read(fx.home.join("data/race.bin"))? == content);
    assert!(fx.cache().is_present(asset));
    assert_eq!(fx.tmp_entries()?, Vec::<PathBuf>::new());
    Ok(())
}

#[test]
fn a_member_missing_from_the_wheel_is_named() -> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let asset = asset(
        "missing",
        vec![wheel("zoo-test-part1", "zoo_test_part1/data/part99.bin")],
        b"x",
    );
    let cache = fx.cache();
    match cache.pull(asset, &QUIET) {
        Err(ZooError::MemberMissing {
            requirement,
            member,
            ..
        }) => {
            assert_eq!(requirement, "zoo-test-part1==0.1.0");
            assert_eq!(member, "zoo_test_part1/data/part99.bin");
        }
        other => anyhow::bail!("expected MemberMissing, got {other:?}"),
    }
    assert!(!partial_path(&cache.path_of(asset)).exists());
    Ok(())
}

#[test]
fn a_pip_failure_on_a_later_part_carries_stderr_and_cleans_up() -> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let asset = asset(
        "broken",
        vec![
            fx.wheel1(),
            wheel("zoo-test-absent", "zoo_test_absent/x.bin"),
        ],
        b"never",
    );
    let cache = fx.cache();
    match cache.pull(asset, &QUIET) {
        Err(ZooError::PipFailed {
            requirement,
            stderr,
            ..
        }) => {
            assert_eq!(requirement, "zoo-test-absent==0.1.0");
            assert!(
                stderr.contains("No matching distribution found for zoo-test-absent"),
                "{stderr}"
            );
        }
        other => anyhow::bail!("expected PipFailed, got {other:?}"),
    }
    let path = cache.path_of(asset);
    assert!(!path.exists() && !partial_path(&path).exists());
    assert_eq!(fx.tmp_entries()?, Vec::<PathBuf>::new());
    Ok(())
}

#[test]
fn a_missing_python_is_reported_by_name() -> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let asset = asset("p1", vec![fx.wheel1()], &fx.part1);
    let err = fx.cache_without_python().pull(asset, &QUIET);
    match &err {
        Err(ZooError::PythonMissing { python, .. }) => {
            assert_eq!(python, "/nonexistent/python3");
        }
        other => anyhow::bail!("expected PythonMissing, got {other:?}"),
    }
    let msg = err.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("SWITCHYARD_PYTHON"), "{msg}");
    Ok(())
}

/// Environment of the child process [`child_pull`] runs in: the fixture's index and home.
const KILL_INDEX_ENV: &str = "ZOO_TEST_KILL_INDEX";
const KILL_HOME_ENV: &str = "ZOO_TEST_KILL_HOME";
/// The asset a killed pull fetches: one wheel of 96 MiB, so that pip and the assembly each
/// take long enough to be killed in.
const BIG_LEN: usize = 96 << 20;

fn big_asset(content: &[u8]) -> &'static Asset {
    asset(
        "big",
        vec![wheel("zoo-test-big", "zoo_test_big/data/big.bin")],
        content,
    )
}

/// The libtest name of [`child_pull`]: its module path without the crate (the test binary
/// holds each file of `tests/` as a module).
fn child_pull_name() -> String {
    match module_path!().split_once("::") {
        Some((_, module)) => format!("{module}::child_pull"),
        None => "child_pull".to_owned(),
    }
}

/// Run by [`a_pull_killed_with_sigkill_is_redone_and_verified`] in a child process (the test
/// binary again), which it kills; ignored otherwise.
#[test]
#[ignore = "the child half of a_pull_killed_with_sigkill_is_redone_and_verified"]
fn child_pull() -> anyhow::Result<()> {
    let (Some(index), Some(home)) = (
        std::env::var_os(KILL_INDEX_ENV),
        std::env::var_os(KILL_HOME_ENV),
    ) else {
        return Ok(());
    };
    let cache = Cache::new(home).with_pip_args(["--no-index".into(), "--find-links".into(), index]);
    cache.pull(big_asset(&noise(9, BIG_LEN)), &QUIET)?;
    Ok(())
}

/// Starts [`child_pull`] in its own process group and kills the group with SIGKILL (the pull
/// and the pip it runs, as a service manager stops a unit) once `ready` holds. Returns false
/// when the pull finished before `ready` was seen.
fn kill_pull_when(index: &Path, home: &Path, ready: impl Fn() -> bool) -> anyhow::Result<bool> {
    use std::os::unix::process::CommandExt;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["--exact", &child_pull_name(), "--ignored", "--quiet"])
        .env(KILL_INDEX_ENV, index)
        .env(KILL_HOME_ENV, home)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if ready() {
            let status = std::process::Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .status()?;
            ensure!(status.success(), "kill failed");
            let exit = child.wait()?;
            ensure!(!exit.success(), "the pull was not killed: {exit}");
            return Ok(true);
        }
        if child.try_wait()?.is_some() {
            return Ok(false);
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "no kill point in 60 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// SIGKILL during `pip download` and during the assembly of the file: each time the next pull
/// finds the lock free, clears what the killed one left, downloads again and verifies the
/// SHA-256; nothing half-written is ever present.
#[test]
fn a_pull_killed_with_sigkill_is_redone_and_verified() -> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let content = noise(9, BIG_LEN);
    write_wheel(
        &fx.index,
        "zoo-test-big",
        &[("zoo_test_big/data/big.bin", &content)],
    )?;
    let asset = big_asset(&content);
    let cache = fx.cache();
    let path = cache.path_of(asset);
    let partial = partial_path(&path);
    let tmp = fx.home.join("tmp");
    let downloading = || {
        fs::read_dir(&tmp).is_ok_and(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("big@"))
        }) && fs::metadata(&partial).is_ok_and(|m| m.len() == 0)
    };
    let assembling = || fs::metadata(&partial).is_ok_and(|m| m.len() > 0);
    let mut killed = Vec::new();
    for (point, ready) in [
        ("pip download", &downloading as &dyn Fn() -> bool),
        ("assembly", &assembling),
    ] {
        let was_killed = kill_pull_when(&fx.index, &fx.home, ready)?;
        ensure!(
            was_killed,
            "the pull finished before the {point} kill point"
        );
        ensure!(
            !cache.is_present(asset),
            "present after a kill during {point}"
        );
        killed.push((point, partial.exists(), fx.tmp_entries()?.len()));
        let pulled = cache.pull_detailed(asset, &QUIET)?;
        ensure!(pulled.outcome == Outcome::Downloaded, "{point}: {pulled:?}");
        ensure!(fs::read(&path)? == content, "{point}: wrong bytes");
        ensure!(!partial.exists(), "{point}: .partial left");
        ensure!(
            fx.tmp_entries()?.is_empty(),
            "{point}: download folder left"
        );
        ensure!(
            fs::read_to_string(sidecar_path(&path))?.starts_with(asset.sha256),
            "{point}: record"
        );
        fs::remove_file(&path)?;
        fs::remove_file(sidecar_path(&path))?;
    }
    eprintln!("killed at (point, .partial left, tmp folders left): {killed:?}");
    // Each kill left a `.partial` file and a download folder behind, which the next pull
    // neither took for the asset nor tripped over.
    ensure!(killed.iter().all(|k| k.1 && k.2 == 1), "{killed:?}");
    Ok(())
}
