//! GGUF v2/v3 reader over a memory map: header, metadata and tensor index, validated up front.
//!
//! candle has a GGUF reader (`candle_core::quantized::gguf_file`), but it reads through
//! `std::io::Read`, allocates whatever a length field asks for before checking it against the
//! file, and does not check that tensor data lies inside the file. A truncated or corrupt file
//! from a user must give an error that names the problem, never an abort on a huge allocation,
//! so the header is parsed here against the mapped bytes. Tensor payloads are handed to candle
//! (`QStorage::from_data`) unchanged; candle's writer is used for writing GGUF.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;
use memmap2::Mmap;

use crate::metadata::{MetaValue, Metadata};
use crate::{Result, TensorMeta, WeightsError};

/// "GGUF" read as a little-endian u32.
const GGUF_MAGIC: u32 = 0x4655_4747;
/// Default alignment of the tensor data section (GGUF spec), unless `general.alignment` says otherwise.
const DEFAULT_ALIGNMENT: u64 = 32;
/// Nested metadata arrays deeper than this are refused (the spec allows nesting; real files use one level).
const MAX_ARRAY_DEPTH: usize = 4;
/// GGUF tensors have at most 4 dimensions (ggml's GGML_MAX_DIMS).
const MAX_DIMS: u32 = 4;

/// Maps ggml's type ids (ggml.h `enum ggml_type`) to candle's dtype.
pub fn ggml_dtype_from_id(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// One tensor's entry in the index: where its bytes are and how to read them.
#[derive(Debug, Clone)]
pub struct GgufTensor {
    pub name: String,
    pub dtype: GgmlDType,
    /// Row-major shape, outermost first (GGUF stores dimensions innermost first).
    pub shape: Vec<usize>,
    /// Absolute byte offset of the tensor data in the file.
    pub offset: usize,
    pub n_bytes: usize,
}

/// An open, validated GGUF file. Tensor data stays in the page cache until `load` copies it.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    version: u32,
    metadata: Metadata,
    tensors: Vec<GgufTensor>,
    by_name: BTreeMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|source| WeightsError::Io {
            path: path.clone(),
            source,
        })?;
        // SAFETY: the map is read-only and the file is never written through it. Another
        // process truncating the file while it is mapped would fault on access; that is the
        // same contract llama.cpp and candle's mmap loaders have, and the header is validated
        // against the length seen at open.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|source| WeightsError::Io {
            path: path.clone(),
            source,
        })?;
        let parsed = parse(&mmap).map_err(|e| e.at_path(&path))?;
        let by_name = parsed
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(Self {
            path,
            mmap,
            version: parsed.version,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            by_name,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    pub fn tensors(&self) -> &[GgufTensor] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensor> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    pub fn meta(&self, name: &str) -> Option<TensorMeta> {
        self.tensor_info(name).map(|t| TensorMeta {
            dtype: t.dtype,
            shape: t.shape.clone(),
            n_bytes: t.n_bytes,
        })
    }

    /// A tensor's entry and its raw bytes, borrowed from the map.
    fn entry(&self, name: &str) -> Result<(&GgufTensor, &[u8])> {
        let t = self
            .tensor_info(name)
            .ok_or_else(|| WeightsError::MissingTensor {
                name: name.to_string(),
                source_desc: self.path.display().to_string(),
            })?;
        Ok((t, &self.mmap[t.offset..t.offset + t.n_bytes]))
    }

    /// The raw bytes of a tensor, borrowed from the map.
    pub fn raw(&self, name: &str) -> Result<&[u8]> {
        Ok(self.entry(name)?.1)
    }

    /// Copies one tensor out of the map into an owned candle tensor on `device`.
    pub fn load(&self, name: &str, device: &Device) -> Result<QTensor> {
        let (t, bytes) = self.entry(name)?;
        qtensor_from_bytes(bytes, t.dtype, &t.shape, device)
    }

    /// Copies rows `rows` of a matrix out of the map (only their bytes are read).
    pub fn load_rows(
        &self,
        name: &str,
        rows: std::ops::Range<usize>,
        device: &Device,
    ) -> Result<QTensor> {
        let (t, bytes) = self.entry(name)?;
        crate::rows_from_bytes(bytes, t.dtype, &t.shape, rows, device)
            .map_err(|e| e.named(name, &self.path.display().to_string()))
    }
}

/// Builds a candle `QTensor` from little-endian bytes of `dtype`. candle reinterprets the bytes
/// as a slice of blocks and asserts their alignment, so misaligned input is copied first.
pub fn qtensor_from_bytes(
    bytes: &[u8],
    dtype: GgmlDType,
    shape: &[usize],
    device: &Device,
) -> Result<QTensor> {
    let expected = tensor_bytes(dtype, shape).ok_or_else(|| WeightsError::BadTensorShape {
        path: PathBuf::new(),
        name: String::new(),
        detail: format!("{shape:?} is not a whole number of {dtype:?} blocks"),
    })?;
    if bytes.len() != expected {
        return Err(WeightsError::BadTensorShape {
            path: PathBuf::new(),
            name: String::new(),
            detail: format!(
                "{} bytes given, {expected} expected for {dtype:?} {shape:?}",
                bytes.len()
            ),
        });
    }
    // Every block type candle knows has alignment <= 8 (f32 and f16 fields).
    let storage = if (bytes.as_ptr() as usize).is_multiple_of(8) {
        QStorage::from_data(std::borrow::Cow::Borrowed(bytes), device, dtype)?
    } else {
        let mut aligned = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: `aligned` owns at least `bytes.len()` initialised bytes; u8 has no alignment.
        let dst =
            unsafe { std::slice::from_raw_parts_mut(aligned.as_mut_ptr() as *mut u8, bytes.len()) };
        dst.copy_from_slice(bytes);
        QStorage::from_data(std::borrow::Cow::Borrowed(&*dst), device, dtype)?
    };
    Ok(QTensor::new(storage, shape.to_vec())?)
}

/// Bytes taken by a tensor of `dtype` and `shape`, or None when the innermost dimension is not a
/// whole number of blocks or the size overflows.
pub fn tensor_bytes(dtype: GgmlDType, shape: &[usize]) -> Option<usize> {
    let n: usize = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))?;
    let inner = shape.last().copied().unwrap_or(1);
    let block = dtype.block_size();
    if !inner.is_multiple_of(block) {
        return None;
    }
    (n / block).checked_mul(dtype.type_size())
}

#[derive(Debug)]
struct Parsed {
    version: u32,
    metadata: Metadata,
    tensors: Vec<GgufTensor>,
}

/// A bounds-checked little-endian cursor: every read names what it was reading.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(WeightsError::Truncated {
                path: PathBuf::new(),
                what: what.to_string(),
                offset: self.pos as u64,
                needed: n as u64,
                file_len: self.buf.len() as u64,
            }),
        }
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &str) -> Result<u16> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A count or length that must fit in what is left of the file, `min_item` bytes per item.
    fn len(&mut self, what: &str, min_item: usize) -> Result<usize> {
        let at = self.pos;
        let n = self.u64(what)?;
        let fits = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(min_item.max(1)).map(|b| (n, b)))
            .filter(|&(_, b)| b <= self.remaining());
        match fits {
            Some((n, _)) => Ok(n),
            None => Err(WeightsError::Corrupt {
                path: PathBuf::new(),
                offset: at as u64,
                detail: format!(
                    "{what} is {n}, more than the {} bytes left in the file could hold; the file is truncated or corrupt",
                    self.remaining()
                ),
            }),
        }
    }

    fn str(&mut self, what: &str) -> Result<&'a str> {
        let at = self.pos;
        let n = self.len(what, 1)?;
        let bytes = self.take(n, what)?;
        std::str::from_utf8(bytes).map_err(|_| WeightsError::Corrupt {
            path: PathBuf::new(),
            offset: at as u64,
            detail: format!("{what} is not valid UTF-8"),
        })
    }

    fn string(&mut self, what: &str) -> Result<String> {
        self.str(what).map(str::to_string)
    }

    /// An array's element type and length (checked against the bytes left).
    fn array_header(&mut self, key: &str, depth: usize) -> Result<(u32, usize)> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(WeightsError::Corrupt {
                path: PathBuf::new(),
                offset: self.pos as u64,
                detail: format!("metadata {key:?} nests arrays deeper than {MAX_ARRAY_DEPTH}"),
            });
        }
        let elem_type = self.u32(key)?;
        let min_item = match (scalar_size(elem_type), elem_type) {
            (Some(size), _) => size,
            // A string's length, an array's element type and length.
            (None, 8) => 8,
            (None, 9) => 12,
            (None, other) => {
                return Err(WeightsError::Corrupt {
                    path: PathBuf::new(),
                    offset: self.pos as u64,
                    detail: format!("metadata {key:?} has unknown array element type {other}"),
                })
            }
        };
        Ok((elem_type, self.len(key, min_item)?))
    }
}

/// Bytes of a fixed-size metadata value type; `None` for strings, arrays and unknown types.
fn scalar_size(value_type: u32) -> Option<usize> {
    match value_type {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

fn parse(buf: &[u8]) -> Result<Parsed> {
    let mut c = Cursor { buf, pos: 0 };
    let magic = c.u32("magic")?;
    if magic != GGUF_MAGIC {
        return Err(WeightsError::NotGguf {
            path: PathBuf::new(),
            magic: magic.to_le_bytes(),
        });
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(WeightsError::UnsupportedVersion {
            path: PathBuf::new(),
            version,
        });
    }
    // Each tensor info is at least name length + n_dims + type + offset = 24 bytes.
    let n_tensors = c.len("tensor count", 24)?;
    // Each key/value pair is at least key length + value type = 12 bytes.
    let n_kv = c.len("metadata count", 12)?;

    // The metadata is walked twice: first only checking its structure, with the tensor index
    // after it, then building it. A corrupted length that the bytes left could hold (the
    // tensor data follows) breaks the structure after it, so it is refused before anything is
    // allocated for it; once the header holds together, every item an array claims is there.
    let metadata_at = c.pos;
    for _ in 0..n_kv {
        let key = c.str("metadata key")?;
        let value_type = c.u32("metadata value type")?;
        skip_value(&mut c, value_type, key, 0)?;
    }

    let mut tensors = Vec::with_capacity(n_tensors);
    let mut names = std::collections::HashSet::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let at = c.pos;
        let name = c.string("tensor name")?;
        let n_dims = c.u32("tensor dimension count")?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(WeightsError::Corrupt {
                path: PathBuf::new(),
                offset: at as u64,
                detail: format!(
                    "tensor {name:?} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)"
                ),
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = c.u64("tensor dimension")?;
            let d = usize::try_from(d).map_err(|_| WeightsError::BadTensorShape {
                path: PathBuf::new(),
                name: name.clone(),
                detail: format!("dimension {d} does not fit in memory"),
            })?;
            dims.push(d);
        }
        let type_id = c.u32("tensor type")?;
        let dtype = ggml_dtype_from_id(type_id).ok_or_else(|| WeightsError::UnknownTensorType {
            path: PathBuf::new(),
            name: name.clone(),
            type_id,
        })?;
        let offset = c.u64("tensor offset")?;
        dims.reverse();
        let n_bytes = tensor_bytes(dtype, &dims).ok_or_else(|| WeightsError::BadTensorShape {
            path: PathBuf::new(),
            name: name.clone(),
            detail: format!("{dims:?} is not a whole number of {dtype:?} blocks"),
        })?;
        if !names.insert(name.clone()) {
            return Err(WeightsError::Corrupt {
                path: PathBuf::new(),
                offset: at as u64,
                detail: format!("tensor {name:?} appears twice"),
            });
        }
        tensors.push((name, dtype, dims, offset, n_bytes));
    }

    let index_end = c.pos;
    let mut c = Cursor {
        buf,
        pos: metadata_at,
    };
    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = c.string("metadata key")?;
        let value_type = c.u32("metadata value type")?;
        let value = read_value(&mut c, value_type, &key, 0)?;
        metadata.insert(key, value);
    }
    let metadata = Metadata::new(metadata);

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() => a,
            _ => {
                return Err(WeightsError::Corrupt {
                    path: PathBuf::new(),
                    offset: 0,
                    detail: format!("general.alignment {v:?} is not a power of two"),
                })
            }
        },
    };
    let data_start = (index_end as u64).div_ceil(alignment) * alignment;
    let file_len = buf.len() as u64;

    let mut out = Vec::with_capacity(tensors.len());
    for (name, dtype, shape, rel, n_bytes) in tensors {
        let start = data_start.checked_add(rel);
        let end = start.and_then(|s| s.checked_add(n_bytes as u64));
        match (start, end) {
            (Some(start), Some(end)) if end <= file_len => out.push(GgufTensor {
                name,
                dtype,
                shape,
                offset: start as usize,
                n_bytes,
            }),
            _ => {
                return Err(WeightsError::TensorOutOfBounds {
                    path: PathBuf::new(),
                    name,
                    start: data_start.saturating_add(rel),
                    end: data_start
                        .saturating_add(rel)
                        .saturating_add(n_bytes as u64),
                    file_len,
                })
            }
        }
    }
    Ok(Parsed {
        version,
        metadata,
        tensors: out,
    })
}

fn read_value(c: &mut Cursor<'_>, value_type: u32, key: &str, depth: usize) -> Result<MetaValue> {
    let what = key;
    Ok(match value_type {
        0 => MetaValue::U8(c.u8(what)?),
        1 => MetaValue::I8(c.u8(what)? as i8),
        2 => MetaValue::U16(c.u16(what)?),
        3 => MetaValue::I16(c.u16(what)? as i16),
        4 => MetaValue::U32(c.u32(what)?),
        5 => MetaValue::I32(c.u32(what)? as i32),
        6 => MetaValue::F32(f32::from_bits(c.u32(what)?)),
        7 => MetaValue::Bool(c.u8(what)? != 0),
        8 => MetaValue::String(c.string(what)?),
        9 => {
            let (elem_type, n) = c.array_header(key, depth)?;
            let mut items = Vec::new();
            items
                .try_reserve_exact(n)
                .map_err(|_| WeightsError::Corrupt {
                    path: PathBuf::new(),
                    offset: c.pos as u64,
                    detail: format!("metadata {key:?} has {n} items, more than memory holds"),
                })?;
            for _ in 0..n {
                items.push(read_value(c, elem_type, key, depth + 1)?);
            }
            MetaValue::Array(items)
        }
        10 => MetaValue::U64(c.u64(what)?),
        11 => MetaValue::I64(c.u64(what)? as i64),
        12 => MetaValue::F64(f64::from_bits(c.u64(what)?)),
        other => return Err(unknown_value_type(c, key, other)),
    })
}

/// Steps over one value without building it (the structural walk of [`parse`]).
fn skip_value(c: &mut Cursor<'_>, value_type: u32, key: &str, depth: usize) -> Result<()> {
    match (scalar_size(value_type), value_type) {
        (Some(size), _) => {
            c.take(size, key)?;
        }
        (None, 8) => {
            c.str(key)?;
        }
        (None, 9) => {
            let (elem_type, n) = c.array_header(key, depth)?;
            match scalar_size(elem_type) {
                // `array_header` checked that n items of this size fit in the bytes left.
                Some(size) => {
                    c.take(n * size, key)?;
                }
                None => {
                    for _ in 0..n {
                        skip_value(c, elem_type, key, depth + 1)?;
                    }
                }
            }
        }
        (None, other) => return Err(unknown_value_type(c, key, other)),
    }
    Ok(())
}

fn unknown_value_type(c: &Cursor<'_>, key: &str, value_type: u32) -> WeightsError {
    WeightsError::Corrupt {
        path: PathBuf::new(),
        offset: c.pos as u64,
        detail: format!("metadata {key:?} has unknown value type {value_type}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds GGUF bytes in memory: one metadata string and one f32 tensor of 8 values.
    fn tiny_file() -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&GGUF_MAGIC.to_le_bytes());
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes()); // tensors
        b.extend_from_slice(&1u64.to_le_bytes()); // kv
        let key = b"general.name";
        b.extend_from_slice(&(key.len() as u64).to_le_bytes());
        b.extend_from_slice(key);
        b.extend_from_slice(&8u32.to_le_bytes());
        let val = b"tiny";
        b.extend_from_slice(&(val.len() as u64).to_le_bytes());
        b.extend_from_slice(val);
        let name = b"w";
        b.extend_from_slice(&(name.len() as u64).to_le_bytes());
        b.extend_from_slice(name);
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&4u64.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes()); // F32
        b.extend_from_slice(&0u64.to_le_bytes());
        while b.len() % 32 != 0 {
            b.push(0);
        }
        for i in 0..8 {
            b.extend_from_slice(&(i as f32).to_le_bytes());
        }
        b
    }

    #[test]
    fn parses_in_memory_file() {
        let buf = tiny_file();
        let p = parse(&buf).unwrap();
        assert_eq!(p.version, 3);
        assert_eq!(p.metadata.get_str("general.name").unwrap(), "tiny");
        assert_eq!(p.tensors.len(), 1);
        assert_eq!(p.tensors[0].shape, vec![2, 4]);
        assert_eq!(p.tensors[0].n_bytes, 32);
        assert_eq!(p.tensors[0].offset, buf.len() - 32);
    }

    #[test]
    fn every_truncation_is_an_error() {
        let buf = tiny_file();
        for cut in 0..buf.len() {
            let err = parse(&buf[..cut]).err();
            assert!(err.is_some(), "truncated at {cut} parsed");
        }
    }

    #[test]
    fn huge_length_is_refused_without_allocating() {
        let mut buf = tiny_file();
        // The key length of the first metadata entry sits right after the 24-byte header.
        buf[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        let err = parse(&buf).unwrap_err().to_string();
        assert!(
            err.contains("metadata key is 18446744073709551615"),
            "{err}"
        );
    }

    #[test]
    fn block_sizes() {
        assert_eq!(tensor_bytes(GgmlDType::Q4_1, &[3, 64]), Some(3 * 2 * 20));
        assert_eq!(tensor_bytes(GgmlDType::Q8_0, &[1, 33]), None);
        assert_eq!(tensor_bytes(GgmlDType::Q4K, &[2, 256]), Some(2 * 144));
        assert_eq!(tensor_bytes(GgmlDType::Q6K, &[1, 512]), Some(2 * 210));
    }

    mod hostile {
        use super::*;
        use proptest::prelude::*;
        use proptest::sample::Index;

        proptest! {
            // CI-sized; `PROPTEST_CASES=1000000` for the long run (reports/README.md).
            #![proptest_config(ProptestConfig {
                cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(1024),
                failure_persistence: None,
                ..ProptestConfig::default()
            })]

            /// A valid file with bytes and 8-byte fields overwritten, and maybe cut: it parses
            /// or is refused, never panics; what parses points inside the file.
            #[test]
            fn mutated_files_parse_or_fail_cleanly(
                bytes in prop::collection::vec((any::<Index>(), any::<u8>()), 0..8),
                words in prop::collection::vec(
                    (any::<Index>(), prop_oneof![Just(u64::MAX), Just(1u64 << 40), 0u64..64, any::<u64>()]),
                    0..3,
                ),
                cut in prop::option::of(any::<Index>()),
            ) {
                let mut buf = tiny_file();
                for (at, b) in bytes {
                    let n = buf.len();
                    buf[at.index(n)] = b;
                }
                for (at, w) in words {
                    let start = at.index(buf.len() - 8);
                    buf[start..start + 8].copy_from_slice(&w.to_le_bytes());
                }
                if let Some(c) = cut {
                    let n = buf.len();
                    buf.truncate(c.index(n + 1));
                }
                if let Ok(p) = parse(&buf) {
                    for t in &p.tensors {
                        let end = t.offset.checked_add(t.n_bytes);
                        prop_assert!(end.is_some_and(|e| e <= buf.len()), "{t:?} in {} bytes", buf.len());
                    }
                }
            }

            /// Random bytes after a valid magic and version.
            #[test]
            fn random_headers_fail_cleanly(tail in prop::collection::vec(any::<u8>(), 0..512)) {
                let mut buf = GGUF_MAGIC.to_le_bytes().to_vec();
                buf.extend_from_slice(&3u32.to_le_bytes());
                buf.extend_from_slice(&tail);
                let _ = parse(&buf);
            }
        }
    }
}
