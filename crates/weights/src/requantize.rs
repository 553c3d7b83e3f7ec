//! Writing a GGUF file whose weight matrices are re-quantized to another ggml type (e.g. the
//! Q8_0 twin of a Q4_1 file), so the same model can be compared across quantizations and with
//! other engines on identical files. candle's GGUF writer does the writing.

use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::Device;

use crate::gguf::GgufFile;
use crate::metadata::MetaValue;
use crate::{Result, WeightsError};

/// llama.cpp's `general.file_type` value for a file mostly in `dtype`.
fn file_type(dtype: GgmlDType) -> Option<u32> {
    Some(match dtype {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q8_0 => 7,
        GgmlDType::Q5_0 => 8,
        GgmlDType::Q4K => 15,
        GgmlDType::Q6K => 18,
        _ => return None,
    })
}

fn to_candle(v: &MetaValue) -> gguf_file::Value {
    use gguf_file::Value as V;
    match v {
        MetaValue::U8(x) => V::U8(*x),
        MetaValue::I8(x) => V::I8(*x),
        MetaValue::U16(x) => V::U16(*x),
        MetaValue::I16(x) => V::I16(*x),
        MetaValue::U32(x) => V::U32(*x),
        MetaValue::I32(x) => V::I32(*x),
        MetaValue::U64(x) => V::U64(*x),
        MetaValue::I64(x) => V::I64(*x),
        MetaValue::F32(x) => V::F32(*x),
        MetaValue::F64(x) => V::F64(*x),
        MetaValue::Bool(x) => V::Bool(*x),
        MetaValue::String(x) => V::String(x.clone()),
        MetaValue::Array(a) => V::Array(a.iter().map(to_candle).collect()),
    }
}

/// Re-quantizes every 2-D weight matrix of `src` whose rows fit `target`'s blocks (norms and
/// other vectors stay as they are) and writes the result to `out` (via `out.partial`, renamed
/// when complete). `progress(done, total)` is called per tensor.
pub fn requantize(
    src: &GgufFile,
    out: &Path,
    target: GgmlDType,
    mut progress: impl FnMut(usize, usize),
) -> Result<()> {
    let ftype = file_type(target)
        .ok_or_else(|| WeightsError::BadConfig(format!("cannot re-quantize to {target:?}")))?;
    let mut metadata: Vec<(String, gguf_file::Value)> = src
        .metadata()
        .iter()
        .filter(|(k, _)| k.as_str() != "general.file_type")
        .map(|(k, v)| (k.clone(), to_candle(v)))
        .collect();
    metadata.push(("general.file_type".into(), gguf_file::Value::U32(ftype)));
    let total = src.tensors().len();
    let mut tensors: Vec<(String, QTensor)> = Vec::with_capacity(total);
    for (i, t) in src.tensors().iter().enumerate() {
        let q = src.load(&t.name, &Device::Cpu)?;
        let fits = t.shape.len() == 2 && t.shape[1] % target.block_size() == 0;
        let q = if fits && t.dtype != target {
            QTensor::quantize(&q.dequantize(&Device::Cpu)?, target)?
        } else {
            q
        };
        tensors.push((t.name.clone(), q));
        progress(i + 1, total);
    }
    let partial = out.with_extension("partial");
    let io = |e: std::io::Error| WeightsError::Io {
        path: partial.clone(),
        source: e,
    };
    let mut f = std::io::BufWriter::new(std::fs::File::create(&partial).map_err(io)?);
    let md: Vec<(&str, &gguf_file::Value)> =
        metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &md, &ts)?;
    use std::io::Write;
    f.flush().map_err(io)?;
    drop(f);
    std::fs::rename(&partial, out).map_err(|e| WeightsError::Io {
        path: out.to_path_buf(),
        source: e,
    })?;
    Ok(())
}
