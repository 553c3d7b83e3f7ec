//! Rotary position embeddings applied in place to rows of heads, for arbitrary positions.
//!
//! Each token of a batch carries its own position (sequences of a batch are at different
//! offsets), so the tables are built per batch for the positions it holds, in f64 then rounded.

use switchyard_weights::RopeStyle;

/// cos/sin of `position * theta^(-2i/d)` for each token of a batch, `d/2` values per token.
#[derive(Debug, Clone)]
pub struct RopeTable {
    pub theta: f64,
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(theta: f64, head_dim: usize, positions: &[usize]) -> Self {
        let half = head_dim / 2;
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| theta.powf(-((2 * i) as f64) / head_dim as f64))
            .collect();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for f in &inv_freq {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Self {
            theta,
            half,
            cos,
            sin,
        }
    }

    /// Rotates `x`, laid out `[tokens][heads][head_dim]`, in place.
    pub fn apply(&self, x: &mut [f32], heads: usize, style: RopeStyle) {
        let hd = self.half * 2;
        for (t, token) in x.chunks_exact_mut(heads * hd).enumerate() {
            let cos = &self.cos[t * self.half..(t + 1) * self.half];
            let sin = &self.sin[t * self.half..(t + 1) * self.half];
            for head in token.chunks_exact_mut(hd) {
                match style {
                    RopeStyle::Interleaved => {
                        for (i, pair) in head.chunks_exact_mut(2).enumerate() {
                            let (a, b) = (pair[0], pair[1]);
                            pair[0] = a * cos[i] - b * sin[i];
                            pair[1] = a * sin[i] + b * cos[i];
                        }
                    }
                    RopeStyle::HalfSplit => {
                        let (lo, hi) = head.split_at_mut(self.half);
                        for i in 0..self.half {
                            let (a, b) = (lo[i], hi[i]);
                            lo[i] = a * cos[i] - b * sin[i];
                            hi[i] = a * sin[i] + b * cos[i];
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_preserves_norm_and_position_zero_is_identity() {
        let table = RopeTable::new(10_000.0, 4, &[0, 3]);
        let mut x = vec![1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0];
        table.apply(&mut x, 1, RopeStyle::HalfSplit);
        assert_eq!(&x[..4], &[1.0, 2.0, 3.0, 4.0]);
        let n0: f32 = [1.0f32, 2.0, 3.0, 4.0].iter().map(|v| v * v).sum();
        let n1: f32 = x[4..].iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-5);
        // pair (x0, x2) rotated by 3 rad at frequency 1
        let (c, s) = (3f32.cos(), 3f32.sin());
        assert!((x[4] - (1.0 * c - 3.0 * s)).abs() < 1e-6);
        assert!((x[6] - (1.0 * s + 3.0 * c)).abs() < 1e-6);
        let mut y = vec![1.0, 2.0, 3.0, 4.0];
        RopeTable::new(10_000.0, 4, &[3]).apply(&mut y, 1, RopeStyle::Interleaved);
        assert!((y[0] - (1.0 * c - 2.0 * s)).abs() < 1e-6);
        assert!((y[1] - (1.0 * s + 2.0 * c)).abs() < 1e-6);
    }
}
