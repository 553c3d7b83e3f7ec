//! Small statistics over repeated measurements.

/// Median of `xs` (mean of the middle two for an even count); NaN for none.
pub fn median(xs: &[f64]) -> f64 {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The `p`-th percentile (0..=100), linear interpolation between closest ranks.
pub fn percentile(xs: &[f64], p: f64) -> f64 {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let rank = (p / 100.0).clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (rank - lo as f64)
}

/// Mean, median and 99th percentile of one measure over a run.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Percentiles {
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
}

impl Percentiles {
    /// Mean, median and 99th percentile of `xs`; NaN for none.
    pub fn of(xs: &[f64]) -> Self {
        let mean = if xs.is_empty() {
            f64::NAN
        } else {
            xs.iter().sum::<f64>() / xs.len() as f64
        };
        Self {
            mean,
            p50: median(xs),
            p99: percentile(xs, 99.0),
        }
    }
}

/// The mean of `xs` and its standard error (sample standard deviation over √n); `None` for
/// fewer than two values.
pub fn mean_and_se(xs: &[f64]) -> Option<(f64, f64)> {
    let n = xs.len();
    if n < 2 {
        return None;
    }
    let mean = xs.iter().sum::<f64>() / n as f64;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    Some((mean, (var / n as f64).sqrt()))
}

/// Two-sided 95 % critical value of Student's t with `df` degrees of freedom (`df` ≥ 1).
///
/// A table to three decimals for 1–30 degrees of freedom, then the normal value: the
/// intervals it serves are over a handful of repeated runs, and `statrs` would be a
/// dependency for this one lookup.
pub fn t95(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::NAN,
        1..=30 => T[df - 1],
        _ => crate::quality::Z95,
    }
}

/// The mean of `xs` and its 95 % interval (Student's t, `n − 1` degrees of freedom):
/// `(mean, lo, hi)`. `None` for fewer than two values.
pub fn mean_interval95(xs: &[f64]) -> Option<(f64, f64, f64)> {
    let (mean, se) = mean_and_se(xs)?;
    let half = t95(xs.len() - 1) * se;
    Some((mean, mean - half, mean + half))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_percentiles() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        let xs: Vec<f64> = (1..=101).map(f64::from).collect();
        assert_eq!(percentile(&xs, 50.0), 51.0);
        assert_eq!(percentile(&xs, 99.0), 100.0);
        assert_eq!(percentile(&[1.0, 2.0], 50.0), 1.5);
    }

    #[test]
    fn percentiles_of_latencies() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = Percentiles::of(&xs);
        assert_eq!((p.mean, p.p50), (50.5, 50.5));
        assert!((p.p99 - 99.01).abs() < 1e-9);
        assert!(Percentiles::of(&[]).mean.is_nan());
    }

    #[test]
    fn t_interval_on_fixed_data() {
        assert_eq!(t95(2), 4.303);
        assert_eq!(t95(29), 2.045);
        assert_eq!(t95(500), crate::quality::Z95);
        assert!(t95(0).is_nan());
        // Mean 2, sample variance 1, n 3: half width 4.303 · sqrt(1/3) = 2.484338.
        let (m, lo, hi) = mean_interval95(&[1.0, 2.0, 3.0]).unwrap();
        assert_eq!(m, 2.0);
        assert!((lo - (2.0 - 2.484_338)).abs() < 1e-6, "{lo}");
        assert!((hi - (2.0 + 2.484_338)).abs() < 1e-6, "{hi}");
        assert!(mean_interval95(&[1.0]).is_none());
        let (m, lo, hi) = mean_interval95(&[5.0, 5.0]).unwrap();
        assert_eq!((m, lo, hi), (5.0, 5.0, 5.0));
    }
}
