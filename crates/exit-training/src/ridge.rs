//! Ridge regression in closed form from streamed sufficient statistics: `XᵀX`, `XᵀY`, the
//! column sums and `Σ‖y‖²`, accumulated in f64 while tokens stream by, so memory does not
//! depend on how many tokens are seen. Solving centres the statistics (the bias is not
//! penalised), adds `λI` and factorises with Cholesky.
//!
//! `λ` is relative: `λ = λ_rel · tr(Cov(X))/d`, the mean per-dimension spread of the inputs, so
//! one `λ_rel` means the same amount of shrinkage whatever the scale of a layer's hidden states
//! (they grow with depth by orders of magnitude).

use candle_core::{DType, Device, Tensor};
use nalgebra::{DMatrix, DVector};

pub use switchyard_exits::heads::Affine;
use switchyard_exits::Result;

/// Sufficient statistics of a least-squares problem `y ≈ A x + b`.
#[derive(Debug, Clone)]
pub struct RidgeStats {
    d_in: usize,
    d_out: usize,
    n: u64,
    /// `[d_in, d_in]`, f64.
    xtx: Tensor,
    /// `[d_in, d_out]`, f64.
    xty: Tensor,
    /// Column sums, f64.
    sx: Tensor,
    sy: Tensor,
    yy: f64,
}

impl RidgeStats {
    pub fn new(d_in: usize, d_out: usize, device: &Device) -> Result<Self> {
        Ok(Self {
            d_in,
            d_out,
            n: 0,
            xtx: Tensor::zeros((d_in, d_in), DType::F64, device)?,
            xty: Tensor::zeros((d_in, d_out), DType::F64, device)?,
            sx: Tensor::zeros(d_in, DType::F64, device)?,
            sy: Tensor::zeros(d_out, DType::F64, device)?,
            yy: 0.0,
        })
    }

    /// Rows seen.
    pub fn n(&self) -> u64 {
        self.n
    }

    /// Adds the rows of `x` `[rows, d_in]` and `y` `[rows, d_out]` (any float type).
    pub fn add(&mut self, x: &Tensor, y: &Tensor) -> Result<()> {
        let rows = x.dim(0)?;
        if rows == 0 {
            return Ok(());
        }
        let x = x.to_dtype(DType::F64)?;
        let y = y.to_dtype(DType::F64)?;
        let xt = x.t()?;
        self.xtx = (&self.xtx + xt.matmul(&x)?)?;
        self.xty = (&self.xty + xt.matmul(&y)?)?;
        self.sx = (&self.sx + x.sum(0)?)?;
        self.sy = (&self.sy + y.sum(0)?)?;
        self.yy += y.sqr()?.sum_all()?.to_scalar::<f64>()?;
        self.n += rows as u64;
        Ok(())
    }

    /// Adds another accumulator's rows.
    pub fn merge(&mut self, o: &RidgeStats) -> Result<()> {
        self.xtx = (&self.xtx + &o.xtx)?;
        self.xty = (&self.xty + &o.xty)?;
        self.sx = (&self.sx + &o.sx)?;
        self.sy = (&self.sy + &o.sy)?;
        self.yy += o.yy;
        self.n += o.n;
        Ok(())
    }

    fn parts(&self) -> Result<Parts> {
        let mat = |t: &Tensor, r: usize, c: usize| -> Result<DMatrix<f64>> {
            Ok(DMatrix::from_row_slice(
                r,
                c,
                &t.flatten_all()?.to_vec1::<f64>()?,
            ))
        };
        Ok(Parts {
            xtx: mat(&self.xtx, self.d_in, self.d_in)?,
            xty: mat(&self.xty, self.d_in, self.d_out)?,
            sx: DVector::from_vec(self.sx.to_vec1::<f64>()?),
            sy: DVector::from_vec(self.sy.to_vec1::<f64>()?),
        })
    }

    /// The ridge solution for relative `λ` (see the module docs); `None` when the system is not
    /// positive definite (too few rows for `λ_rel = 0`).
    pub fn solve(&self, lambda_rel: f64) -> Result<Option<Affine>> {
        if self.n == 0 {
            return Ok(None);
        }
        let p = self.parts()?;
        let n = self.n as f64;
        let mx = &p.sx / n;
        let my = &p.sy / n;
        let mut cxx = p.xtx - (&mx * mx.transpose()) * n;
        let cxy = p.xty - (&mx * my.transpose()) * n;
        let scale = cxx.trace() / self.d_in as f64;
        let lambda = lambda_rel * if scale > 0.0 { scale } else { 1.0 };
        for i in 0..self.d_in {
            cxx[(i, i)] += lambda;
        }
        let Some(chol) = cxx.cholesky() else {
            return Ok(None);
        };
        // W: [d_in, d_out], y = Wᵀ x + b.
        let w = chol.solve(&cxy);
        let b = my - w.transpose() * mx;
        let a = w.transpose();
        let mut weight = Vec::with_capacity(self.d_in * self.d_out);
        for i in 0..self.d_out {
            weight.extend(a.row(i).iter().copied());
        }
        Ok(Some(Affine {
            d_in: self.d_in,
            d_out: self.d_out,
            weight,
            bias: b.iter().copied().collect(),
            lambda_rel,
        }))
    }

    /// `Σ ‖A x + b − y‖²` over the rows seen, from the statistics alone.
    pub fn sse(&self, a: &Affine) -> Result<f64> {
        let p = self.parts()?;
        let am = DMatrix::from_row_slice(a.d_out, a.d_in, &a.weight);
        let b = DVector::from_column_slice(&a.bias);
        let n = self.n as f64;
        let quad = (&am * &p.xtx).component_mul(&am).sum();
        let cross = (&am * &p.xty).trace();
        let lin_x = 2.0 * b.dot(&(&am * &p.sx));
        Ok(quad + lin_x + n * b.dot(&b) - 2.0 * cross - 2.0 * b.dot(&p.sy) + self.yy)
    }

    /// `Σ ‖x − y‖²`: the error of the identity map (the logit lens), when `d_in == d_out`.
    pub fn identity_sse(&self) -> Result<f64> {
        let p = self.parts()?;
        Ok(p.xtx.trace() - 2.0 * p.xty.trace() + self.yy)
    }

    /// `Σ ‖y − ȳ‖²`: the error of predicting the mean (for R²).
    pub fn sst(&self) -> Result<f64> {
        if self.n == 0 {
            return Ok(0.0);
        }
        let sy = self.sy.to_vec1::<f64>()?;
        let s2: f64 = sy.iter().map(|v| v * v).sum();
        Ok(self.yy - s2 / self.n as f64)
    }
}

struct Parts {
    xtx: DMatrix<f64>,
    xty: DMatrix<f64>,
    sx: DVector<f64>,
    sy: DVector<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Gaussian elimination with partial pivoting, independent of nalgebra.
    fn solve_dense(mut a: Vec<Vec<f64>>, mut b: Vec<Vec<f64>>) -> Vec<Vec<f64>> {
        let n = a.len();
        for c in 0..n {
            let p = (c..n)
                .max_by(|&i, &j| a[i][c].abs().total_cmp(&a[j][c].abs()))
                .unwrap();
            a.swap(c, p);
            b.swap(c, p);
            let (pivot, pivot_b) = (a[c].clone(), b[c].clone());
            for r in (0..n).filter(|&r| r != c) {
                let f = a[r][c] / pivot[c];
                for (x, p) in a[r].iter_mut().zip(&pivot) {
                    *x -= f * p;
                }
                for (x, p) in b[r].iter_mut().zip(&pivot_b) {
                    *x -= f * p;
                }
            }
        }
        (0..n)
            .map(|i| b[i].iter().map(|v| v / a[i][i]).collect())
            .collect()
    }

    fn random_problem(n: usize, d_in: usize, d_out: usize, noise: f64) -> (Vec<f64>, Vec<f64>) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let a: Vec<f64> = (0..d_in * d_out)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let mut x = Vec::new();
        let mut y = Vec::new();
        for _ in 0..n {
            let xi: Vec<f64> = (0..d_in)
                .map(|j| rng.random_range(-1.0..1.0) * (j + 1) as f64 + 3.0)
                .collect();
            for o in 0..d_out {
                let v: f64 = (0..d_in).map(|j| a[o * d_in + j] * xi[j]).sum::<f64>()
                    + 0.5 * o as f64
                    + noise * rng.random_range(-1.0..1.0);
                y.push(v);
            }
            x.extend(xi);
        }
        (x, y)
    }

    fn stats(x: &[f64], y: &[f64], n: usize, d_in: usize, d_out: usize) -> RidgeStats {
        let dev = Device::Cpu;
        let mut s = RidgeStats::new(d_in, d_out, &dev).unwrap();
        // In two batches, to exercise accumulation.
        let h = n / 3;
        for (lo, hi) in [(0, h), (h, n)] {
            let xt = Tensor::from_slice(&x[lo * d_in..hi * d_in], (hi - lo, d_in), &dev).unwrap();
            let yt =
                Tensor::from_slice(&y[lo * d_out..hi * d_out], (hi - lo, d_out), &dev).unwrap();
            s.add(&xt, &yt).unwrap();
        }
        s
    }

    #[test]
    fn ridge_matches_a_direct_dense_solve() {
        let (n, d_in, d_out) = (200, 5, 4);
        let (x, y) = random_problem(n, d_in, d_out, 0.3);
        let s = stats(&x, &y, n, d_in, d_out);
        let lambda_rel = 0.05;
        let got = s.solve(lambda_rel).unwrap().unwrap();

        // Direct: centre the data, form the normal equations, solve densely.
        let mx: Vec<f64> = (0..d_in)
            .map(|j| (0..n).map(|i| x[i * d_in + j]).sum::<f64>() / n as f64)
            .collect();
        let my: Vec<f64> = (0..d_out)
            .map(|j| (0..n).map(|i| y[i * d_out + j]).sum::<f64>() / n as f64)
            .collect();
        let mut ata = vec![vec![0.0; d_in]; d_in];
        let mut aty = vec![vec![0.0; d_out]; d_in];
        for i in 0..n {
            for r in 0..d_in {
                let xr = x[i * d_in + r] - mx[r];
                for c in 0..d_in {
                    ata[r][c] += xr * (x[i * d_in + c] - mx[c]);
                }
                for c in 0..d_out {
                    aty[r][c] += xr * (y[i * d_out + c] - my[c]);
                }
            }
        }
        let lambda = lambda_rel * (0..d_in).map(|i| ata[i][i]).sum::<f64>() / d_in as f64;
        for (i, row) in ata.iter_mut().enumerate() {
            row[i] += lambda;
        }
        let w = solve_dense(ata, aty);
        for o in 0..d_out {
            for (j, wj) in w.iter().enumerate() {
                let d = (got.weight[o * d_in + j] - wj[o]).abs();
                assert!(d < 1e-6, "A[{o}][{j}] differs by {d}");
            }
            let b = my[o] - (0..d_in).map(|j| w[j][o] * mx[j]).sum::<f64>();
            assert!((got.bias[o] - b).abs() < 1e-6, "b[{o}]");
        }

        // The SSE from statistics equals the SSE computed row by row.
        let direct: f64 = (0..n)
            .map(|i| {
                let p = got.apply(&x[i * d_in..(i + 1) * d_in]);
                p.iter()
                    .zip(&y[i * d_out..(i + 1) * d_out])
                    .map(|(a, b)| (a - b).powi(2))
                    .sum::<f64>()
            })
            .sum();
        let from_stats = s.sse(&got).unwrap();
        assert!(
            (direct - from_stats).abs() < 1e-6 * direct.max(1.0),
            "{direct} vs {from_stats}"
        );
        let sst: f64 = (0..n)
            .map(|i| {
                (0..d_out)
                    .map(|o| (y[i * d_out + o] - my[o]).powi(2))
                    .sum::<f64>()
            })
            .sum();
        assert!((s.sst().unwrap() - sst).abs() < 1e-6 * sst);
    }

    #[test]
    fn noiseless_data_is_recovered_and_identity_error_is_exact() {
        let (n, d) = (100, 4);
        let (x, y) = random_problem(n, d, d, 0.0);
        let s = stats(&x, &y, n, d, d);
        let a = s.solve(1e-12).unwrap().unwrap();
        assert!(s.sse(&a).unwrap() < 1e-6);
        for o in 0..d {
            assert!((a.bias[o] - 0.5 * o as f64).abs() < 1e-6);
        }
        let direct: f64 = x.iter().zip(&y).map(|(a, b)| (a - b).powi(2)).sum();
        assert!((s.identity_sse().unwrap() - direct).abs() < 1e-6 * direct);
    }

    #[test]
    fn too_few_rows_without_lambda_is_not_positive_definite() {
        let (x, y) = random_problem(3, 6, 2, 0.1);
        let s = stats(&x, &y, 3, 6, 2);
        assert!(s.solve(0.0).unwrap().is_none());
        assert!(s.solve(0.1).unwrap().is_some());
        let empty = RidgeStats::new(2, 2, &Device::Cpu).unwrap();
        assert!(empty.solve(0.1).unwrap().is_none());
    }
}
