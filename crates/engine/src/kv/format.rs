//! [`KvFormat`] and [`BlockLayout`]: how a KV block stores its positions, and what it weighs.
//!
//! Bytes per position and layer, with `row = n_kv_heads * head_dim` values for K and as many
//! for V:
//!
//! ```text
//! F32   2 * row * 4                     the values the model computed, bit for bit
//! F16   2 * row * 2                     each value rounded to the nearest half
//! Int8  2 * (row + n_kv_heads * 4)      i8 values + one f32 scale per (position, kv head)
//! ```
//!
//! smollm2-135m (3 kv heads x 64): F32 1536 bytes, Int8 2 * (192 + 12) = 408 bytes per
//! position and layer, 3.76x fewer than F32 and 1.88x fewer than an f16 cache would take
//! (768); a 16-position block is 24,576 or 6,528 bytes. The scale is per position, not per
//! block, because blocks fill one position at a time while decoding (see
//! [`switchyard_models::kv::Int8Rows`]).

use serde::{Deserialize, Serialize};
use switchyard_weights::ModelSpec;

const F32_BYTES: usize = std::mem::size_of::<f32>();
const F16_BYTES: usize = std::mem::size_of::<half::f16>();

/// How KV blocks store K and V (the `kv-compressed` mode is [`KvFormat::Int8`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvFormat {
    /// f32 values, as computed: results are those of a dense f32 cache, bit for bit.
    F32,
    /// Half floats, the default: each value the nearest f16 to the f32 one (relative error
    /// at most 2^-11 in the normal range), half the bytes of f32 to store and to read.
    /// Measured on SmolLM2: -0.004 % bits per byte on Paradise Lost against f32, and the
    /// attention of one decode step over 64 sequences of 1,024 positions 7.9 -> 5.9 ms per
    /// layer (`paged_decode_attention_timing` in `switchyard_models::attention`).
    #[default]
    F16,
    /// i8 values with one f32 scale per (position, key/value head), absmax / 127: each value
    /// within half a scale step of the f32 one.
    Int8,
}

impl KvFormat {
    pub fn name(self) -> &'static str {
        match self {
            KvFormat::F32 => "f32",
            KvFormat::F16 => "f16",
            KvFormat::Int8 => "int8",
        }
    }
}

impl std::str::FromStr for KvFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(KvFormat::F32),
            "f16" => Ok(KvFormat::F16),
            "int8" => Ok(KvFormat::Int8),
            other => Err(format!("unknown K/V format `{other}` (f32, f16 or int8)")),
        }
    }
}

impl std::fmt::Display for KvFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The shape of every block of a pool: positions per block, values per position, format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockLayout {
    /// Values per position of K (and of V): `n_kv_heads * head_dim`.
    pub row: usize,
    /// Values sharing one scale in [`KvFormat::Int8`] (one key/value head); equal to `row` in
    /// [`KvFormat::F32`], which has no scales.
    pub head_dim: usize,
    pub block_tokens: usize,
    pub format: KvFormat,
}

impl BlockLayout {
    /// # Panics
    /// When `row`, `head_dim` or `block_tokens` is zero, or `head_dim` does not divide `row`
    /// (a model spec that passed validation never gives either).
    pub fn new(row: usize, head_dim: usize, block_tokens: usize, format: KvFormat) -> Self {
        assert!(
            row > 0 && head_dim > 0 && block_tokens > 0 && row.is_multiple_of(head_dim),
            "a KV block needs positive sizes and whole heads: row {row}, head {head_dim}, block {block_tokens}"
        );
        let head_dim = match format {
            KvFormat::F32 | KvFormat::F16 => row,
            KvFormat::Int8 => head_dim,
        };
        Self {
            row,
            head_dim,
            block_tokens,
            format,
        }
    }

    /// f32 blocks of `block_tokens` positions of `row` values.
    pub fn f32(row: usize, block_tokens: usize) -> Self {
        Self::new(row, row, block_tokens, KvFormat::F32)
    }

    /// Blocks for `spec`'s key/value rows.
    pub fn for_spec(spec: &ModelSpec, block_tokens: usize, format: KvFormat) -> Self {
        Self::new(spec.kv_row_len(), spec.head_dim, block_tokens, format)
    }

    /// Scales per position of K (and of V) in [`KvFormat::Int8`].
    pub fn heads(&self) -> usize {
        self.row / self.head_dim
    }

    /// Bytes one position of one layer takes, K and V.
    pub fn bytes_per_token(&self) -> usize {
        match self.format {
            KvFormat::F32 => 2 * self.row * F32_BYTES,
            KvFormat::F16 => 2 * self.row * F16_BYTES,
            KvFormat::Int8 => 2 * (self.row + self.heads() * F32_BYTES),
        }
    }

    pub fn block_bytes(&self) -> usize {
        self.block_tokens * self.bytes_per_token()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_per_token_and_block_for_smollm2() {
        // 3 kv heads x 64.
        let f32 = BlockLayout::new(192, 64, 16, KvFormat::F32);
        let int8 = BlockLayout::new(192, 64, 16, KvFormat::Int8);
        assert_eq!(f32, BlockLayout::f32(192, 16));
        assert_eq!((f32.bytes_per_token(), f32.block_bytes()), (1536, 24_576));
        assert_eq!((int8.bytes_per_token(), int8.block_bytes()), (408, 6528));
        assert_eq!(int8.heads(), 3);
        let f16 = BlockLayout::new(192, 64, 16, KvFormat::F16);
        assert_eq!((f16.bytes_per_token(), f16.block_bytes()), (768, 12_288));
        // An f16 cache would take 2 bytes a value.
        let f16_bytes_per_token = 2 * 192 * 2;
        let vs_f32 = f32.bytes_per_token() as f64 / int8.bytes_per_token() as f64;
        let vs_f16 = f16_bytes_per_token as f64 / int8.bytes_per_token() as f64;
        assert_eq!(
            (format!("{vs_f32:.3}"), format!("{vs_f16:.3}")),
            ("3.765".into(), "1.882".into())
        );
        assert_eq!(KvFormat::default(), KvFormat::F16);
    }
}
