//! A corrupt or truncated GGUF file gives an error that names the problem, never a panic:
//! truncated copies, patched header fields and random byte flips of the real smollm2 file.
//!
//! The header is walked here independently of the reader, to find the fields to patch and the
//! numbers the errors must state. Opening validates only the header and where each tensor's data
//! lies, never the data itself, so the patched copies are the real header followed by a sparse
//! (zero) data region of the real length: the only problem in each file is the patch.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use switchyard_weights::GgufFile;

const MODEL: &str = "smollm2-135m-instruct";
/// GGUF's default data alignment (smollm2 has no `general.alignment`).
const ALIGNMENT: usize = 32;
/// The header of smollm2 ends well inside this many bytes (it is about 1.7 MiB).
const HEADER_READ: usize = 4 << 20;
/// A refused length must come back at once: nothing proportional to the length may happen.
const QUICK: Duration = Duration::from_secs(1);
/// Random single-byte corruptions, all inside this many leading bytes of the header.
const FLIPS: usize = 200;
const FLIP_REGION: usize = 64 << 10;
const FLIP_SEED: u64 = 0x5EED_0F67;

/// One metadata entry: where its value starts and, for arrays, where each element starts.
struct Kv {
    key: String,
    value_at: usize,
    items: Vec<usize>,
}

/// One tensor-index entry and the positions of its fields.
struct TensorInfo {
    name: String,
    at: usize,
    n_dims_at: usize,
    type_at: usize,
    offset_at: usize,
    rel: u64,
    n_bytes: u64,
}

/// The real file's header bytes and layout.
struct Layout {
    path: PathBuf,
    file_len: u64,
    /// Bytes `[0, data_start)`: header, metadata and tensor index.
    header: Vec<u8>,
    n_tensors: u64,
    kv: Vec<Kv>,
    index_at: usize,
    tensors: Vec<TensorInfo>,
    data_start: u64,
}

impl Layout {
    fn kv(&self, key: &str) -> &Kv {
        match self.kv.iter().find(|k| k.key == key) {
            Some(k) => k,
            None => panic!("{key} is not in the test file"),
        }
    }

    fn tensor(&self, name: &str) -> &TensorInfo {
        match self.tensors.iter().find(|t| t.name == name) {
            Some(t) => t,
            None => panic!("{name} is not in the test file"),
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Position after a value of GGUF type `ty` at `at`; array element positions go to `items`.
fn skip_value(b: &[u8], at: usize, ty: u32, items: &mut Vec<usize>) -> usize {
    match ty {
        0 | 1 | 7 => at + 1,
        2 | 3 => at + 2,
        4..=6 => at + 4,
        10..=12 => at + 8,
        8 => at + 8 + u64_at(b, at) as usize,
        9 => {
            let elem = u32_at(b, at);
            let n = u64_at(b, at + 4);
            let mut p = at + 12;
            for _ in 0..n {
                items.push(p);
                p = skip_value(b, p, elem, &mut Vec::new());
            }
            p
        }
        other => panic!("value type {other} at byte {at} of the test file"),
    }
}

/// Storage bytes of `n` elements of the ggml types smollm2 uses.
fn storage_bytes(type_id: u32, n: u64) -> u64 {
    match type_id {
        0 => 4 * n,       // F32
        3 => n / 32 * 20, // Q4_1: 32 values in 2 f16 + 16 bytes
        8 => n / 32 * 34, // Q8_0: 32 values in 1 f16 + 32 bytes
        other => panic!("ggml type {other} in the test file"),
    }
}

fn layout() -> &'static Layout {
    static LAYOUT: OnceLock<Layout> = OnceLock::new();
    LAYOUT.get_or_init(|| {
        let path = switchyard_zoo::ensure(MODEL).expect("the zoo has smollm2");
        let mut file = File::open(&path).expect("model file opens");
        let file_len = file.metadata().expect("model file metadata").len();
        let mut b = vec![0u8; HEADER_READ];
        file.read_exact(&mut b)
            .expect("model file is bigger than 4 MiB");

        let n_tensors = u64_at(&b, 8);
        let n_kv = u64_at(&b, 16);
        let mut p = 24;
        let mut kv = Vec::new();
        for _ in 0..n_kv {
            let key_len = u64_at(&b, p) as usize;
            let key = String::from_utf8(b[p + 8..p + 8 + key_len].to_vec()).expect("UTF-8 key");
            let ty = u32_at(&b, p + 8 + key_len);
            let value_at = p + 12 + key_len;
            let mut items = Vec::new();
            p = skip_value(&b, value_at, ty, &mut items);
            kv.push(Kv {
                key,
                value_at,
                items,
            });
        }
        let index_at = p;
        let mut tensors = Vec::new();
        for _ in 0..n_tensors {
            let at = p;
            let name_len = u64_at(&b, p) as usize;
            let name = String::from_utf8(b[p + 8..p + 8 + name_len].to_vec()).expect("UTF-8 name");
            let n_dims_at = p + 8 + name_len;
            let n_dims = u32_at(&b, n_dims_at) as usize;
            let n: u64 = (0..n_dims)
                .map(|d| u64_at(&b, n_dims_at + 4 + 8 * d))
                .product();
            let type_at = n_dims_at + 4 + 8 * n_dims;
            let type_id = u32_at(&b, type_at);
            let offset_at = type_at + 4;
            tensors.push(TensorInfo {
                name,
                at,
                n_dims_at,
                type_at,
                offset_at,
                rel: u64_at(&b, offset_at),
                n_bytes: storage_bytes(type_id, n),
            });
            p = offset_at + 8;
        }
        let data_start = p.div_ceil(ALIGNMENT) * ALIGNMENT;
        b.truncate(data_start);
        Layout {
            path,
            file_len,
            header: b,
            n_tensors,
            kv,
            index_at,
            tensors,
            data_start: data_start as u64,
        }
    })
}

/// Opens `path`, asserting that it neither panics nor succeeds; returns the error's text.
fn open_err(path: &Path) -> String {
    match catch_unwind(AssertUnwindSafe(|| switchyard_weights::open(path))) {
        Ok(Ok(src)) => panic!("{} opened: {:?}", path.display(), src.spec()),
        Ok(Err(e)) => e.to_string(),
        Err(_) => panic!("opening {} panicked", path.display()),
    }
}

/// The real header with `patches` applied, then zeros up to the real file length.
fn patched_copy(dir: &Path, name: &str, patches: &[(usize, &[u8])]) -> PathBuf {
    let l = layout();
    let mut header = l.header.clone();
    for &(at, bytes) in patches {
        header[at..at + bytes.len()].copy_from_slice(bytes);
    }
    let path = dir.join(name);
    let mut f = File::create(&path).expect("create patched copy");
    f.write_all(&header).expect("write header");
    f.set_len(l.file_len).expect("extend to the real length");
    path
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

/// The walk above and the reader agree on the real file, so the positions patched below are
/// the fields they claim to be.
#[test]
fn reader_agrees_with_the_test_layout() {
    let l = layout();
    assert_eq!(l.file_len, 98_362_432);
    assert_eq!(l.n_tensors, 272);
    assert_eq!(l.kv.len(), 33);
    assert_eq!(l.index_at, 1_769_507);
    assert_eq!(l.data_start, 1_785_664);
    let f = GgufFile::open(&l.path).expect("the real file opens");
    assert_eq!(f.version(), 3);
    assert_eq!(f.tensors().len(), l.tensors.len());
    for (got, want) in f.tensors().iter().zip(&l.tensors) {
        assert_eq!(got.name, want.name);
        assert_eq!(got.offset as u64, l.data_start + want.rel, "{}", want.name);
        assert_eq!(got.n_bytes as u64, want.n_bytes, "{}", want.name);
    }
    let last = &l.tensors[l.tensors.len() - 1];
    assert_eq!(l.data_start + last.rel + last.n_bytes, l.file_len);
    assert_eq!(l.kv("tokenizer.ggml.tokens").items.len(), 49_152);
    assert_eq!(l.kv("tokenizer.ggml.merges").items.len(), 48_900);

    // The sparse patched copies open like the real file when nothing is patched.
    let dir = tempdir();
    let copy = patched_copy(dir.path(), "unpatched.gguf", &[]);
    let src = switchyard_weights::open(&copy).expect("unpatched copy opens");
    assert_eq!(src.spec().n_layers, 30);
    assert_eq!(src.spec().vocab_size, 49_152);
}

/// Truncates the file at `path` at each cut in turn (longest first) and checks the error: a
/// wanted text that starts with the path is the whole message, any other must occur in it.
fn check_cuts(path: &Path, cuts: &[(u64, Vec<String>)]) {
    let p = path.display().to_string();
    let f = OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open copy");
    let mut failures = Vec::new();
    for (cut, wants) in cuts {
        f.set_len(*cut).expect("truncate the copy");
        let err = open_err(path);
        for want in wants {
            let ok = if want.starts_with(&p) {
                &err == want
            } else {
                err.contains(want.as_str())
            };
            if !ok {
                failures.push(format!("cut at {cut}: {err:?} does not match {want:?}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Cuts a real copy shorter and shorter: every cut is an error saying the file is truncated,
/// with the byte counts and what was being read (or which tensor's data is missing).
#[test]
fn truncated_copies_name_what_was_cut() {
    let l = layout();
    let dir = tempdir();
    let path = dir.path().join("cut.gguf");
    std::fs::copy(&l.path, &path).expect("copy the model");
    let p = path.display().to_string();

    let mut cuts: Vec<(u64, Vec<String>)> = Vec::new();
    // In the tensor data, and right where it starts: the first tensor in index order whose
    // data does not fit is named.
    for cut in [l.file_len / 2, l.data_start] {
        let t = l
            .tensors
            .iter()
            .find(|t| l.data_start + t.rel + t.n_bytes > cut)
            .expect("a tensor past the cut");
        let start = l.data_start + t.rel;
        cuts.push((
            cut,
            vec![format!(
                "{p}: tensor {:?} data [{start}, {}) lies past the end of the file ({cut} bytes); the file is truncated or corrupt",
                t.name,
                start + t.n_bytes
            )],
        ));
    }
    // In the tensor index, inside one tensor's offset field.
    let k_info = l.tensor("blk.3.attn_k.weight");
    let cut = k_info.offset_at as u64 + 3;
    cuts.push((
        cut,
        vec![format!(
            "{p} is truncated: reading tensor offset at byte {} needs 8 bytes, but the file has {cut}",
            k_info.offset_at
        )],
    ));
    // In the metadata, inside the length of a token string (late enough in the list that the
    // 49152 strings could still fit in what is left).
    let tokens = l.kv("tokenizer.ggml.tokens");
    let late_token = *tokens
        .items
        .iter()
        .find(|&&at| at > tokens.value_at + 12 + 49_152 * 8)
        .expect("a token past the count check");
    let cut = late_token as u64 + 3;
    cuts.push((
        cut,
        vec![format!(
            "{p} is truncated: reading tokenizer.ggml.tokens at byte {late_token} needs 8 bytes, but the file has {cut}"
        )],
    ));
    cuts.push((
        10,
        vec![format!(
            "{p} is truncated: reading tensor count at byte 8 needs 8 bytes, but the file has 10"
        )],
    ));
    cuts.push((
        4,
        vec![format!(
            "{p} is truncated: reading version at byte 4 needs 4 bytes, but the file has 4"
        )],
    ));
    for n in [3, 0] {
        cuts.push((
            n,
            vec![format!(
                "{p} is truncated: reading magic at byte 0 needs 4 bytes, but the file has {n}"
            )],
        ));
    }
    check_cuts(&path, &cuts);
}

/// Cuts that leave a count or length larger than the bytes after it: refused by the count
/// check before anything is read, and the message must still say the file may be truncated,
/// with the count, the bytes left and what was being read.
#[test]
fn truncation_inside_a_counted_section_says_truncated() {
    let l = layout();
    let dir = tempdir();
    let path = dir.path().join("cut.gguf");
    std::fs::write(&path, &l.header).expect("write the header");

    let mut cuts: Vec<(u64, Vec<String>)> = Vec::new();
    // Inside a tensor's name: its length (19) is more than what is left.
    let k_info = l.tensor("blk.3.attn_k.weight");
    cuts.push((
        k_info.at as u64 + 8 + 5,
        vec![
            "truncated".into(),
            format!(
                "corrupt at byte {}: tensor name is 19, more than the 5 bytes left",
                k_info.at
            ),
        ],
    ));
    // Early in the token list: too few bytes left for 49152 strings of 8 or more bytes.
    let tokens = l.kv("tokenizer.ggml.tokens");
    let cut = tokens.items[1000] as u64 + 3;
    let left = cut - (tokens.value_at as u64 + 12);
    cuts.push((
        cut,
        vec![
            "truncated".into(),
            format!(
                "corrupt at byte {}: tokenizer.ggml.tokens is 49152, more than the {left} bytes left",
                tokens.value_at + 4
            ),
        ],
    ));
    // Right after the fixed header: 272 tensor infos cannot fit in the 8 bytes left.
    cuts.push((
        24,
        vec![
            "truncated".into(),
            "corrupt at byte 8: tensor count is 272, more than the 8 bytes left".into(),
        ],
    ));
    check_cuts(&path, &cuts);
}

#[test]
fn wrong_magic_is_not_a_gguf_file() {
    let dir = tempdir();
    let path = patched_copy(dir.path(), "ggml.gguf", &[(0, b"GGML")]);
    assert_eq!(
        open_err(&path),
        format!(
            "{} is not a GGUF file (magic bytes [47, 47, 4d, 4c], expected \"GGUF\")",
            path.display()
        )
    );
}

#[test]
fn unsupported_versions_are_refused() {
    let dir = tempdir();
    for version in [0u32, 1, 4, 99] {
        let path = patched_copy(
            dir.path(),
            &format!("v{version}.gguf"),
            &[(4, &version.to_le_bytes())],
        );
        assert_eq!(
            open_err(&path),
            format!(
                "{}: GGUF version {version} is not supported (2 and 3 are)",
                path.display()
            )
        );
    }
}

/// A tensor whose offset points past the end is named with the byte range it claims.
#[test]
fn tensor_offset_past_the_end_names_the_tensor() {
    let l = layout();
    let dir = tempdir();
    let t = l.tensor("blk.10.attn_k.weight");
    let past = l.file_len;
    let path = patched_copy(
        dir.path(),
        "past.gguf",
        &[(t.offset_at, &past.to_le_bytes())],
    );
    let start = l.data_start + past;
    assert_eq!(
        open_err(&path),
        format!(
            "{}: tensor \"blk.10.attn_k.weight\" data [{start}, {}) lies past the end of the file ({} bytes); the file is truncated or corrupt",
            path.display(),
            start + t.n_bytes,
            l.file_len
        )
    );
    // An offset whose sum with the data start overflows is the same error, not a panic.
    let path = patched_copy(
        dir.path(),
        "overflow.gguf",
        &[(t.offset_at, &u64::MAX.to_le_bytes())],
    );
    assert_eq!(
        open_err(&path),
        format!(
            "{}: tensor \"blk.10.attn_k.weight\" data [{max}, {max}) lies past the end of the file ({} bytes); the file is truncated or corrupt",
            path.display(),
            l.file_len,
            max = u64::MAX
        )
    );
    // One byte short of fitting: the last tensor moved up by one byte.
    let last = &l.tensors[l.tensors.len() - 1];
    let rel = last.rel + 1;
    let path = patched_copy(
        dir.path(),
        "by-one.gguf",
        &[(last.offset_at, &rel.to_le_bytes())],
    );
    let err = open_err(&path);
    assert!(
        err.contains(&format!(
            "tensor \"output_norm.weight\" data [{}, {}) lies past the end of the file ({} bytes)",
            l.data_start + rel,
            l.file_len + 1,
            l.file_len
        )),
        "{err}"
    );
}

/// Absurd lengths and counts are refused against the bytes left, before any allocation.
#[test]
fn absurd_lengths_are_refused_without_allocating() {
    let l = layout();
    let dir = tempdir();
    let name_at = l.kv("general.name").value_at;
    let tokens_len_at = l.kv("tokenizer.ggml.tokens").value_at + 4;
    let huge = 1u64 << 40;
    let cases: Vec<(&str, usize, u64, String)> = vec![
        (
            "string",
            name_at,
            huge,
            format!(
                "is corrupt at byte {name_at}: general.name is {huge}, more than the {} bytes left in the file could hold",
                l.file_len - name_at as u64 - 8
            ),
        ),
        (
            "string-max",
            name_at,
            u64::MAX,
            format!("general.name is {}, more than the", u64::MAX),
        ),
        (
            "array",
            tokens_len_at,
            huge,
            format!(
                "is corrupt at byte {tokens_len_at}: tokenizer.ggml.tokens is {huge}, more than the {} bytes left in the file could hold",
                l.file_len - tokens_len_at as u64 - 8
            ),
        ),
        (
            "array-max",
            tokens_len_at,
            u64::MAX,
            format!("tokenizer.ggml.tokens is {}, more than the", u64::MAX),
        ),
        (
            "tensor-count",
            8,
            u64::MAX,
            format!(
                "is corrupt at byte 8: tensor count is {}, more than the {} bytes left in the file could hold",
                u64::MAX,
                l.file_len - 16
            ),
        ),
        (
            "metadata-count",
            16,
            huge,
            format!(
                "is corrupt at byte 16: metadata count is {huge}, more than the {} bytes left in the file could hold",
                l.file_len - 24
            ),
        ),
    ];
    for (name, at, value, want) in cases {
        let path = patched_copy(
            dir.path(),
            &format!("{name}.gguf"),
            &[(at, &value.to_le_bytes())],
        );
        let t0 = Instant::now();
        let err = open_err(&path);
        let took = t0.elapsed();
        assert!(
            err.starts_with(&path.display().to_string()) && err.contains(&want),
            "{name}: {err:?} does not contain {want:?}"
        );
        assert!(took < QUICK, "{name}: refusing took {took:?}");
    }
}

#[test]
fn unknown_tensor_type_names_the_tensor_and_the_id() {
    let l = layout();
    let dir = tempdir();
    let t = l.tensor("blk.0.ffn_down.weight");
    // 4 and 5 are ggml's removed Q4_2/Q4_3; 16 is IQ2_XXS, which candle cannot hold.
    for type_id in [4u32, 16, 99, u32::MAX] {
        let path = patched_copy(
            dir.path(),
            &format!("type{type_id}.gguf"),
            &[(t.type_at, &type_id.to_le_bytes())],
        );
        let err = open_err(&path);
        assert!(
            err.contains(&format!(
                "tensor \"blk.0.ffn_down.weight\" has ggml type id {type_id}, which is not supported"
            )),
            "{err}"
        );
    }
}

/// Other index corruptions: a dimension count out of range and a duplicated tensor name.
#[test]
fn bad_tensor_index_entries_are_named() {
    let l = layout();
    let dir = tempdir();
    let t = l.tensor("blk.0.ffn_down.weight");
    for n_dims in [0u32, 5] {
        let path = patched_copy(
            dir.path(),
            &format!("dims{n_dims}.gguf"),
            &[(t.n_dims_at, &n_dims.to_le_bytes())],
        );
        assert_eq!(
            open_err(&path),
            format!(
                "{} is corrupt at byte {}: tensor \"blk.0.ffn_down.weight\" has {n_dims} dimensions (1 to 4 allowed)",
                path.display(),
                t.at
            )
        );
    }
    // "blk.1.attn_k.weight" renamed "blk.0.attn_k.weight" (same length).
    let dup = l.tensor("blk.1.attn_k.weight");
    let path = patched_copy(dir.path(), "dup.gguf", &[(dup.at + 8 + 4, b"0")]);
    assert_eq!(
        open_err(&path),
        format!(
            "{} is corrupt at byte {}: tensor \"blk.0.attn_k.weight\" appears twice",
            path.display(),
            dup.at
        )
    );
    // A metadata key that is not UTF-8.
    let key_at = l.kv("general.name").value_at - 4 - "general.name".len();
    let path = patched_copy(dir.path(), "utf8.gguf", &[(key_at, &[0xff])]);
    assert_eq!(
        open_err(&path),
        format!(
            "{} is corrupt at byte {}: metadata key is not valid UTF-8",
            path.display(),
            key_at - 8
        )
    );
}

#[test]
fn folder_without_config_is_an_unknown_format() {
    let dir = tempdir();
    std::fs::write(dir.path().join("model.safetensors"), b"").expect("write file");
    assert_eq!(
        open_err(dir.path()),
        format!(
            "{} is neither a GGUF file nor a folder with config.json and *.safetensors",
            dir.path().display()
        )
    );
}

#[test]
fn missing_path_cannot_be_read() {
    let dir = tempdir();
    let path = dir.path().join("no-such-model.gguf");
    assert_eq!(
        open_err(&path),
        format!("cannot read {}: no such file or folder", path.display())
    );
}

/// 200 seeded single-byte corruptions of the first 64 KiB: each open succeeds or fails with an
/// error, never a panic.
#[test]
fn random_byte_flips_never_panic() {
    let l = layout();
    let dir = tempdir();
    let path = patched_copy(dir.path(), "flipped.gguf", &[]);
    let mut f = OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open copy");
    let mut rng = StdRng::seed_from_u64(FLIP_SEED);
    let (mut opened, mut refused) = (0, 0);
    let mut panics = Vec::new();
    for _ in 0..FLIPS {
        let at = rng.random_range(0..FLIP_REGION);
        let flip = rng.random_range(1..=255u8);
        let byte = l.header[at] ^ flip;
        f.seek(SeekFrom::Start(at as u64)).expect("seek");
        f.write_all(&[byte]).expect("write flip");
        match catch_unwind(AssertUnwindSafe(|| switchyard_weights::open(&path))) {
            Ok(Ok(_)) => opened += 1,
            Ok(Err(e)) => {
                assert!(!e.to_string().is_empty());
                refused += 1;
            }
            Err(_) => panics.push(format!("byte {at} = {byte:#04x}")),
        }
        f.seek(SeekFrom::Start(at as u64)).expect("seek");
        f.write_all(&[l.header[at]]).expect("restore byte");
    }
    eprintln!("{FLIPS} flips: {opened} opened, {refused} refused");
    assert!(panics.is_empty(), "panicked on: {}", panics.join(", "));
    assert_eq!(opened + refused, FLIPS);
    // Most flips land in token text and still parse; the header fields and string lengths
    // among them must be refused.
    assert!(
        refused > 0 && opened > 0,
        "{opened} opened, {refused} refused"
    );
}
