//! The key/value cache seen by the model: per sequence, per layer, rows of `n_kv_heads * head_dim`
//! values, one row per position, exposed as a list of contiguous chunks.
//!
//! Chunks are how one attention kernel serves both a dense per-sequence cache (one chunk) and a
//! paged cache (one chunk per block) without copying the cache into a contiguous buffer. A
//! chunk's rows are f32, f16 ([`F16Rows`], each value the nearest half of the f32 one), or
//! 8-bit with one f32 scale per (position, key/value head) ([`Int8Rows`], written by
//! [`quantize_kv_int8`]); attention reads each directly.

use crate::{ModelError, Result};

/// Largest magnitude of an 8-bit K/V value. Symmetric: -128 is never written, so a value and
/// its negation quantize alike.
pub const KV_INT8_MAX: i8 = 127;

/// A run of consecutive positions: `tokens` rows of K and of V, f32 (`k`, `v`), f16 (`f16`)
/// or 8-bit (`int8`).
#[derive(Debug, Clone, Copy)]
pub struct KvChunk<'a> {
    /// f32 K rows, `tokens * row` values; empty in an f16 or 8-bit chunk.
    pub k: &'a [f32],
    /// f32 V rows, like `k`.
    pub v: &'a [f32],
    pub tokens: usize,
    /// The rows of an f16 chunk; `None` otherwise.
    pub f16: Option<F16Rows<'a>>,
    /// The rows of an 8-bit chunk; `None` otherwise.
    pub int8: Option<Int8Rows<'a>>,
}

impl<'a> KvChunk<'a> {
    /// An f32 chunk of `tokens` rows.
    pub fn f32(k: &'a [f32], v: &'a [f32], tokens: usize) -> Self {
        Self {
            k,
            v,
            tokens,
            f16: None,
            int8: None,
        }
    }

    /// An f16 chunk of `tokens` rows.
    pub fn f16(rows: F16Rows<'a>, tokens: usize) -> Self {
        Self {
            k: &[],
            v: &[],
            tokens,
            f16: Some(rows),
            int8: None,
        }
    }

    /// An 8-bit chunk of `tokens` rows.
    pub fn int8(rows: Int8Rows<'a>, tokens: usize) -> Self {
        Self {
            k: &[],
            v: &[],
            tokens,
            f16: None,
            int8: Some(rows),
        }
    }
}

/// K and V rows stored as IEEE half floats, each the f32 value rounded to the nearest half
/// (ties to even): within 2^-11 of it relatively in the normal range. Every value is rounded
/// alone, so what a position holds depends only on that position (batch invariance holds as
/// in f32).
#[derive(Debug, Clone, Copy)]
pub struct F16Rows<'a> {
    /// `tokens * row` values.
    pub k: &'a [half::f16],
    pub v: &'a [half::f16],
}

/// K and V rows stored as i8 with one f32 scale per (position, key/value head): value `i` of
/// head `h` at position `t` is `k[t * row + h * head_dim + i] as f32 * k_scales[t * n_kv_heads
/// + h]` (the same for V), where `row = n_kv_heads * head_dim`.
///
/// A scale belongs to one position, not to a block: a block is filled position by position
/// while decoding, and a block-wide scale that grew with a new position would requantize the
/// ones already stored. Per position, what a row holds depends only on that row, so chunked
/// prefill, batching and recomputation store the same bytes (batch invariance holds in 8-bit
/// as in f32).
#[derive(Debug, Clone, Copy)]
pub struct Int8Rows<'a> {
    /// `tokens * row` values.
    pub k: &'a [i8],
    pub v: &'a [i8],
    /// `tokens * n_kv_heads` scales.
    pub k_scales: &'a [f32],
    pub v_scales: &'a [f32],
}

/// Quantizes rows of `head_dim`-value groups: for each group of `src`, `scale = max|x| / 127`
/// into `scales` and `round(x / scale)` into `q` (`q.len() == src.len()`, `scales.len() ==
/// src.len() / head_dim`). Dequantized, `q * scale` is within `scale / 2` of `x` (up to the
/// f32 rounding of `x / scale`); an all-zero group gets scale 0. Non-finite inputs are not
/// representable: a group holding one gets a non-finite scale.
///
/// # Panics
/// When the lengths do not match (a caller bug: the cache sizes both from the same row).
pub fn quantize_kv_int8(src: &[f32], head_dim: usize, q: &mut [i8], scales: &mut [f32]) {
    assert!(
        head_dim > 0 && q.len() == src.len() && scales.len() * head_dim == src.len(),
        "quantize {} values in groups of {head_dim} into {} values and {} scales",
        src.len(),
        q.len(),
        scales.len()
    );
    let max = f32::from(KV_INT8_MAX);
    for ((x, q), scale) in src
        .chunks_exact(head_dim)
        .zip(q.chunks_exact_mut(head_dim))
        .zip(scales.iter_mut())
    {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        *scale = amax / max;
        if amax == 0.0 {
            q.fill(0);
            continue;
        }
        for (q, &x) in q.iter_mut().zip(x) {
            // `as` saturates; the clamp keeps -128 out should rounding reach past 127.
            *q = (x / *scale).round().clamp(-max, max) as i8;
        }
    }
}

/// One sequence's cache, as the model reads and writes it.
pub trait SeqKv: Send + Sync {
    /// Stores K and V rows for positions `start..start + n` of `layer` (`k.len() == n * row`).
    /// `start` may be below the stored length (overwrite, e.g. recomputation) but not above it;
    /// a cache may refuse to overwrite positions it shares with other sequences.
    fn write(&mut self, layer: usize, start: usize, k: &[f32], v: &[f32]) -> Result<()>;
    /// Positions `0..len` of `layer`, in order.
    fn chunks(&self, layer: usize, len: usize) -> Result<Vec<KvChunk<'_>>>;
    /// Number of positions stored for `layer`.
    fn len(&self, layer: usize) -> usize;
}

/// A contiguous, growable f32 cache for one sequence: the simplest [`SeqKv`].
#[derive(Debug, Clone)]
pub struct DenseKv {
    row: usize,
    layers: Vec<(Vec<f32>, Vec<f32>)>,
    /// Rounds every value to the nearest half float as it is stored.
    half: bool,
}

impl DenseKv {
    pub fn new(n_layers: usize, row: usize) -> Self {
        Self {
            row,
            layers: vec![(Vec::new(), Vec::new()); n_layers],
            half: false,
        }
    }

    /// A cache that holds exactly what f16 blocks would: each value is rounded to the nearest
    /// half float on the way in (widening it back to f32 is exact), so attention reads the
    /// values a paged f16 cache gives it. The reference for the serving engine's default
    /// format, and how a score measures that format on text.
    pub fn rounded_to_f16(n_layers: usize, row: usize) -> Self {
        Self {
            half: true,
            ..Self::new(n_layers, row)
        }
    }

    /// Drops every position at or after `len` in all layers.
    pub fn truncate(&mut self, len: usize) {
        for (k, v) in &mut self.layers {
            k.truncate(len * self.row);
            v.truncate(len * self.row);
        }
    }

    /// Frees every position of `layer` (a pass that streams layers needs each layer's K/V
    /// only while it runs).
    pub fn clear_layer(&mut self, layer: usize) {
        if let Some((k, v)) = self.layers.get_mut(layer) {
            *k = Vec::new();
            *v = Vec::new();
        }
    }

    /// Bytes held by all layers.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|(k, v)| (k.len() + v.len()) * std::mem::size_of::<f32>())
            .sum()
    }
}

impl SeqKv for DenseKv {
    fn write(&mut self, layer: usize, start: usize, k: &[f32], v: &[f32]) -> Result<()> {
        let row = self.row;
        let n_layers = self.layers.len();
        let (ks, vs) = self
            .layers
            .get_mut(layer)
            .ok_or(ModelError::KvLayer { layer, n_layers })?;
        let stored = ks.len() / row;
        if start > stored || k.len() != v.len() || !k.len().is_multiple_of(row) {
            return Err(ModelError::KvWrite {
                layer,
                start,
                stored,
                values: k.len(),
                row,
            });
        }
        let at = start * row;
        let overlap = (ks.len() - at).min(k.len());
        ks[at..at + overlap].copy_from_slice(&k[..overlap]);
        vs[at..at + overlap].copy_from_slice(&v[..overlap]);
        ks.extend_from_slice(&k[overlap..]);
        vs.extend_from_slice(&v[overlap..]);
        if self.half {
            for x in ks[at..].iter_mut().chain(vs[at..].iter_mut()) {
                *x = half::f16::from_f32(*x).to_f32();
            }
        }
        Ok(())
    }

    fn chunks(&self, layer: usize, len: usize) -> Result<Vec<KvChunk<'_>>> {
        let (ks, vs) = self.layers.get(layer).ok_or(ModelError::KvLayer {
            layer,
            n_layers: self.layers.len(),
        })?;
        let stored = ks.len() / self.row;
        if len > stored {
            return Err(ModelError::KvMissing { layer, len, stored });
        }
        let n = len * self.row;
        Ok(vec![KvChunk::f32(&ks[..n], &vs[..n], len)])
    }

    fn len(&self, layer: usize) -> usize {
        self.layers
            .get(layer)
            .map_or(0, |(k, _)| k.len() / self.row)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_appends_and_overwrites() {
        let mut kv = DenseKv::new(2, 2);
        kv.write(1, 0, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0])
            .unwrap();
        assert_eq!(kv.len(1), 2);
        assert_eq!(kv.len(0), 0);
        kv.write(1, 1, &[9.0, 9.0, 10.0, 10.0], &[0.0; 4]).unwrap();
        let c = kv.chunks(1, 3).unwrap();
        assert_eq!(c[0].k, &[1.0, 2.0, 9.0, 9.0, 10.0, 10.0]);
        assert_eq!(c[0].v, &[5.0, 6.0, 0.0, 0.0, 0.0, 0.0]);
        assert!(kv.write(0, 1, &[1.0, 1.0], &[1.0, 1.0]).is_err());
        assert!(kv.chunks(1, 4).is_err());
        assert_eq!(kv.bytes(), 2 * 6 * 4);
    }

    /// Every value comes back within half a step of its group's scale (plus the f32 rounding
    /// of `x / scale`, at most 127 ulp of a step), over groups of very different magnitude.
    #[test]
    fn int8_round_trip_is_within_half_a_step() {
        const HD: usize = 64;
        // Slack for the f32 division inside the quantizer: |x / scale| <= 127, so its
        // rounding moves the quotient by at most 127 * 2^-24 of a step.
        const DIVISION_SLACK: f64 = 127.0 / (1u64 << 24) as f64;
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut src = Vec::new();
        for magnitude in [1e-3f64, 0.5, 1.0, 7.0, 300.0] {
            for _ in 0..HD * 4 {
                src.push(((next() * 2.0 - 1.0) * magnitude) as f32);
            }
        }
        // An all-zero group and one with a single outlier.
        src.extend([0.0f32; HD]);
        src.extend((0..HD).map(|i| if i == 5 { -40.0 } else { 0.01 * i as f32 }));
        let mut q = vec![0i8; src.len()];
        let mut scales = vec![0f32; src.len() / HD];
        quantize_kv_int8(&src, HD, &mut q, &mut scales);
        let mut worst = 0f64;
        for (g, (x, q)) in src.chunks(HD).zip(q.chunks(HD)).enumerate() {
            let s = f64::from(scales[g]);
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(scales[g], amax / 127.0, "group {g}");
            assert_eq!(
                q.iter().map(|v| v.unsigned_abs()).max(),
                Some(if amax > 0.0 { 127 } else { 0 })
            );
            assert!(q.iter().all(|&v| v != i8::MIN));
            for (&x, &q) in x.iter().zip(q) {
                let err = (f64::from(x) - f64::from(q) * s).abs();
                assert!(
                    err <= s * (0.5 + DIVISION_SLACK),
                    "group {g}: {x} -> {q} x {s}"
                );
                if s > 0.0 {
                    worst = worst.max(err / s);
                }
            }
        }
        assert!(
            worst > 0.45,
            "rounding really happened: worst {worst} of a step"
        );
        // -x quantizes to -q.
        let neg: Vec<f32> = src.iter().map(|x| -x).collect();
        let mut qn = vec![0i8; src.len()];
        let mut sn = vec![0f32; scales.len()];
        quantize_kv_int8(&neg, HD, &mut qn, &mut sn);
        assert_eq!(sn, scales);
        assert!(q.iter().zip(&qn).all(|(a, b)| *a == -*b));
    }
}
