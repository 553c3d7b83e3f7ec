//! Weight sources: where a model's tensors and hyperparameters come from.
//!
//! Every source (GGUF file, Hugging Face safetensors folder, in-memory synthetic model) speaks
//! the same canonical tensor names (llama.cpp's: `blk.3.attn_q.weight`) and describes the model
//! with one [`ModelSpec`]. The file format stops here: model code never sees it.

pub mod gguf;
pub mod metadata;
pub mod names;
pub mod requantize;
pub mod safetensors_dir;
pub mod spec;
pub mod synthetic;

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;

pub use gguf::GgufFile;
pub use metadata::{MetaValue, Metadata};
pub use safetensors_dir::SafetensorsDir;
pub use spec::{Activation, Architecture, ModelSpec, RopeStyle};
pub use synthetic::SyntheticSource;

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a GGUF file (magic bytes {magic:02x?}, expected \"GGUF\")")]
    NotGguf { path: PathBuf, magic: [u8; 4] },
    #[error("{path}: GGUF version {version} is not supported (2 and 3 are)")]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error("{path} is truncated: reading {what} at byte {offset} needs {needed} bytes, but the file has {file_len}")]
    Truncated {
        path: PathBuf,
        what: String,
        offset: u64,
        needed: u64,
        file_len: u64,
    },
    #[error("{path} is corrupt at byte {offset}: {detail}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        detail: String,
    },
    #[error("{path}: tensor {name:?} data [{start}, {end}) lies past the end of the file ({file_len} bytes); the file is truncated or corrupt")]
    TensorOutOfBounds {
        path: PathBuf,
        name: String,
        start: u64,
        end: u64,
        file_len: u64,
    },
    #[error("{path}: tensor {name:?} has ggml type id {type_id}, which is not supported")]
    UnknownTensorType {
        path: PathBuf,
        name: String,
        type_id: u32,
    },
    #[error("{path}: tensor {name:?} has a bad shape: {detail}")]
    BadTensorShape {
        path: PathBuf,
        name: String,
        detail: String,
    },
    #[error("{path}: {source}")]
    InFile {
        path: PathBuf,
        source: Box<WeightsError>,
    },
    #[error("tensor {name:?} is missing from {source_desc}")]
    MissingTensor { name: String, source_desc: String },
    #[error("metadata key {key:?} is missing")]
    MissingMetadata { key: String },
    #[error("metadata key {key:?} should be a {expected}, found a {found}")]
    WrongMetadataType {
        key: String,
        expected: &'static str,
        found: &'static str,
    },
    #[error("architecture {0:?} is not supported (llama, qwen2 and gemma3 are)")]
    UnsupportedArchitecture(String),
    #[error("bad model configuration: {0}")]
    BadConfig(String),
    #[error("{path}: {detail}")]
    Safetensors { path: PathBuf, detail: String },
    #[error("{path} is neither a GGUF file nor a folder with config.json and *.safetensors")]
    UnknownFormat { path: PathBuf },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl WeightsError {
    /// Fills in the file path on errors raised while parsing a byte buffer.
    pub(crate) fn at_path(self, p: &Path) -> Self {
        let p = p.to_path_buf();
        match self {
            WeightsError::NotGguf { magic, .. } => WeightsError::NotGguf { path: p, magic },
            WeightsError::UnsupportedVersion { version, .. } => {
                WeightsError::UnsupportedVersion { path: p, version }
            }
            WeightsError::Truncated {
                what,
                offset,
                needed,
                file_len,
                ..
            } => WeightsError::Truncated {
                path: p,
                what,
                offset,
                needed,
                file_len,
            },
            WeightsError::Corrupt { offset, detail, .. } => WeightsError::Corrupt {
                path: p,
                offset,
                detail,
            },
            WeightsError::TensorOutOfBounds {
                name,
                start,
                end,
                file_len,
                ..
            } => WeightsError::TensorOutOfBounds {
                path: p,
                name,
                start,
                end,
                file_len,
            },
            WeightsError::UnknownTensorType { name, type_id, .. } => {
                WeightsError::UnknownTensorType {
                    path: p,
                    name,
                    type_id,
                }
            }
            WeightsError::BadTensorShape { name, detail, .. } => WeightsError::BadTensorShape {
                path: p,
                name,
                detail,
            },
            other => other,
        }
    }
}

pub type Result<T> = std::result::Result<T, WeightsError>;

/// What a source knows about a tensor without loading it.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorMeta {
    pub dtype: GgmlDType,
    pub shape: Vec<usize>,
    /// Bytes the tensor takes once resident (its storage size in `dtype`).
    pub n_bytes: usize,
}

/// Where a source's tokenizer lives.
#[derive(Debug, Clone)]
pub enum TokenizerOrigin {
    /// `tokenizer.ggml.*` keys of the GGUF metadata.
    GgufMetadata,
    /// A Hugging Face `tokenizer.json`, with `tokenizer_config.json` beside it when present.
    HuggingFace {
        tokenizer_json: PathBuf,
        tokenizer_config: Option<PathBuf>,
    },
    /// No tokenizer (synthetic models).
    None,
}

/// A provider of a model's tensors under canonical names.
pub trait WeightSource: Send + Sync + std::fmt::Debug {
    /// Human-readable origin (a path) for error messages.
    fn description(&self) -> String;
    fn spec(&self) -> &ModelSpec;
    /// Raw key/value metadata (GGUF keys; for other sources, what they could map).
    fn metadata(&self) -> &Metadata;
    fn tensor_meta(&self, name: &str) -> Option<TensorMeta>;
    /// Copies the tensor into memory on `device`, in its stored type.
    fn load(&self, name: &str, device: &Device) -> Result<QTensor>;
    fn tokenizer_origin(&self) -> TokenizerOrigin;
    /// Path of the file or folder this came from, when there is one.
    fn path(&self) -> Option<&Path>;

    fn require(&self, name: &str) -> Result<QTensor> {
        self.load(name, &Device::Cpu)
    }

    /// Rows `rows` (along the first dimension) of a matrix, in its stored type: what
    /// streaming an embedding's lookups or an LM head in vocabulary chunks reads. The default
    /// copies the whole tensor and keeps those rows; a source over a mapped file copies only
    /// their bytes.
    fn load_rows(&self, name: &str, rows: Range<usize>, device: &Device) -> Result<QTensor> {
        let whole = self.load(name, device)?;
        let data = whole.data()?;
        rows_from_bytes(&data, whole.dtype(), whole.shape().dims(), rows, device)
            .map_err(|e| e.named(name, &self.description()))
    }
}

/// Rows `rows` of a row-major `[n, cols]` tensor of `dtype` whose bytes are `bytes`.
pub fn rows_from_bytes(
    bytes: &[u8],
    dtype: GgmlDType,
    shape: &[usize],
    rows: Range<usize>,
    device: &Device,
) -> Result<QTensor> {
    let bad = |detail: String| WeightsError::BadTensorShape {
        path: PathBuf::new(),
        name: String::new(),
        detail,
    };
    let &[n, cols] = shape else {
        return Err(bad(format!("rows of a {}-dimensional tensor", shape.len())));
    };
    if rows.start > rows.end || rows.end > n {
        return Err(bad(format!("rows {rows:?} of a tensor of {n} rows")));
    }
    let row_bytes = gguf::tensor_bytes(dtype, &[1, cols]).ok_or_else(|| {
        bad(format!(
            "{cols} columns are not a whole number of {dtype:?} blocks"
        ))
    })?;
    let (start, end) = (rows.start * row_bytes, rows.end * row_bytes);
    let slice = bytes
        .get(start..end)
        .ok_or_else(|| bad(format!("{} bytes hold fewer than {n} rows", bytes.len())))?;
    gguf::qtensor_from_bytes(slice, dtype, &[rows.len(), cols], device)
}

impl WeightsError {
    /// Fills in the tensor and source of a shape error raised without them.
    pub(crate) fn named(self, name: &str, source: &str) -> Self {
        match self {
            Self::BadTensorShape { path, detail, .. } if path.as_os_str().is_empty() => {
                Self::BadTensorShape {
                    path: PathBuf::from(source),
                    name: name.to_string(),
                    detail,
                }
            }
            other => other,
        }
    }
}

/// Opens a GGUF file or a safetensors folder, whichever `path` is.
pub fn open(path: impl AsRef<Path>) -> Result<Arc<dyn WeightSource>> {
    let path = path.as_ref();
    if path.is_dir() {
        return Ok(Arc::new(SafetensorsDir::open(path)?));
    }
    if !path.exists() {
        return Err(WeightsError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or folder"),
        });
    }
    Ok(Arc::new(gguf_source::GgufSource::open(path)?))
}

pub mod gguf_source {
    //! [`WeightSource`] over a [`GgufFile`].
    use super::*;

    #[derive(Debug)]
    pub struct GgufSource {
        file: GgufFile,
        spec: ModelSpec,
    }

    impl GgufSource {
        pub fn open(path: &Path) -> Result<Self> {
            let file = GgufFile::open(path)?;
            let spec = ModelSpec::from_gguf(&file).map_err(|e| WeightsError::InFile {
                path: path.to_path_buf(),
                source: Box::new(e),
            })?;
            Ok(Self { file, spec })
        }

        pub fn file(&self) -> &GgufFile {
            &self.file
        }
    }

    impl WeightSource for GgufSource {
        fn description(&self) -> String {
            self.file.path().display().to_string()
        }
        fn spec(&self) -> &ModelSpec {
            &self.spec
        }
        fn metadata(&self) -> &Metadata {
            self.file.metadata()
        }
        fn tensor_meta(&self, name: &str) -> Option<TensorMeta> {
            self.file.meta(name)
        }
        fn load(&self, name: &str, device: &Device) -> Result<QTensor> {
            self.file.load(name, device)
        }
        fn load_rows(&self, name: &str, rows: Range<usize>, device: &Device) -> Result<QTensor> {
            self.file.load_rows(name, rows, device)
        }
        fn tokenizer_origin(&self) -> TokenizerOrigin {
            TokenizerOrigin::GgufMetadata
        }
        fn path(&self) -> Option<&Path> {
            Some(self.file.path())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;

    /// Rows cut from a block-quantized matrix's bytes are the whole matrix's rows, bit for bit.
    #[test]
    fn rows_are_the_whole_matrix_rows() {
        let dev = Device::Cpu;
        let values: Vec<f32> = (0..8 * 64)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let t = Tensor::from_vec(values, (8, 64), &dev).expect("tensor");
        for dtype in [
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::F16,
            GgmlDType::F32,
        ] {
            // Q4_K blocks are 256 wide.
            let cols = if dtype == GgmlDType::Q4K { 256 } else { 64 };
            let t = t.reshape((8 * 64 / cols, cols)).expect("reshape");
            let q = QTensor::quantize(&t, dtype).expect("quantize");
            let n = t.dims()[0];
            let data = q.data().expect("bytes");
            let r = rows_from_bytes(&data, dtype, q.shape().dims(), 1..n, &dev).expect("rows");
            assert_eq!(r.shape().dims(), &[n - 1, cols]);
            let want = q
                .dequantize(&dev)
                .expect("whole")
                .narrow(0, 1, n - 1)
                .expect("narrow");
            let got = r.dequantize(&dev).expect("rows");
            let diff = (want - got).expect("sub").abs().expect("abs");
            let max: f32 = diff
                .flatten_all()
                .expect("flat")
                .max(0)
                .expect("max")
                .to_scalar()
                .expect("scalar");
            assert_eq!(max, 0.0, "{dtype:?}");
        }
    }

    #[test]
    fn rows_outside_the_matrix_are_refused() {
        let dev = Device::Cpu;
        let q = QTensor::quantize(
            &Tensor::zeros((4, 32), candle_core::DType::F32, &dev).expect("t"),
            GgmlDType::Q8_0,
        )
        .expect("quantize");
        let data = q.data().expect("bytes");
        let err = rows_from_bytes(&data, GgmlDType::Q8_0, &[4, 32], 2..5, &dev)
            .expect_err("past the end")
            .to_string();
        assert!(err.contains("rows 2..5 of a tensor of 4 rows"), "{err}");
        let err = rows_from_bytes(&data, GgmlDType::Q8_0, &[128], 0..1, &dev)
            .expect_err("one dimension")
            .to_string();
        assert!(err.contains("rows of a 1-dimensional tensor"), "{err}");
        let err = rows_from_bytes(&data[..40], GgmlDType::Q8_0, &[4, 32], 0..4, &dev)
            .expect_err("short")
            .to_string();
        assert!(err.contains("40 bytes hold fewer than 4 rows"), "{err}");
    }
}
