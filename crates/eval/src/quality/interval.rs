//! 95% intervals: the Wilson score interval for one accuracy, and a paired interval for the
//! difference between two modes scored on the same items.

/// The two-sided 95% standard normal quantile, Φ⁻¹(0.975).
pub const Z95: f64 = 1.959_963_984_540_054;

/// Wilson score interval for `correct` successes out of `n`, as fractions in `[0, 1]`.
///
/// Wilson rather than the normal ("Wald") interval because benchmark accuracies of small
/// models sit near 0 or near chance on a few hundred items, where Wald's interval collapses to
/// a point at 0 and can leave `[0, 1]`. With `n == 0` nothing is known: `(0, 1)`.
pub fn wilson95(correct: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let n_f = n as f64;
    let p = correct.min(n) as f64 / n_f;
    let z2 = Z95 * Z95;
    let denom = 1.0 + z2 / n_f;
    let center = (p + z2 / (2.0 * n_f)) / denom;
    let half = Z95 / denom * (p * (1.0 - p) / n_f + z2 / (4.0 * n_f * n_f)).sqrt();
    // At 0 and n the bounds are exactly 0 and 1; rounding would leave 1 - 1e-16.
    let lo = if correct == 0 { 0.0 } else { center - half };
    let hi = if correct >= n { 1.0 } else { center + half };
    (lo.max(0.0), hi.min(1.0))
}

/// Mean of `a[i] - b[i]` over the same items, with its 95% interval, all in percentage points:
/// `(mean, lo, hi)`. Positive means `a` answered more items correctly.
///
/// The normal approximation on the per-item differences (each −1, 0 or +1): mean ± z · s/√n
/// with `s` the sample standard deviation. Pairing removes the item-difficulty variance two
/// independent Wilson intervals would carry, so small differences between modes become
/// visible on a few hundred items. When every difference is equal (e.g. the modes agree on
/// every item) `s` is 0 and the interval is the point; with fewer than two items `lo` and
/// `hi` are NaN (no spread can be estimated).
///
/// # Panics
/// When `a` and `b` differ in length: they must be the same items, in the same order.
pub fn paired_diff95(a: &[bool], b: &[bool]) -> (f64, f64, f64) {
    assert_eq!(
        a.len(),
        b.len(),
        "paired_diff95 needs the same items for both modes"
    );
    let n = a.len();
    if n == 0 {
        return (0.0, f64::NAN, f64::NAN);
    }
    let d: Vec<f64> = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| f64::from(u8::from(x)) - f64::from(u8::from(y)))
        .collect();
    let Some((mean, se)) = crate::stats::mean_and_se(&d) else {
        return (100.0 * d[0], f64::NAN, f64::NAN);
    };
    let half = Z95 * se;
    (100.0 * mean, 100.0 * (mean - half), 100.0 * (mean + half))
}

/// McNemar's exact test of two modes scored on the same items: only the discordant items
/// count (`only_a`: `a` right and `b` wrong; `only_b`: the reverse).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct McNemar {
    pub only_a: usize,
    pub only_b: usize,
    /// Two-sided p-value of "both modes are equally likely to win a discordant item".
    pub p_value: f64,
}

/// McNemar's test on the same items in the same order, in its exact (binomial) form: under
/// the null hypothesis each of the `n = only_a + only_b` discordant items goes either way with
/// probability ½, so `p = min(1, 2 · P(X ≤ min(only_a, only_b)))` for `X ~ Bin(n, ½)`. Exact
/// rather than the χ² approximation because a good quantized mode leaves few discordant
/// items, where χ² is unreliable. No discordant item: `p = 1`.
///
/// # Panics
/// When `a` and `b` differ in length (see [`paired_diff95`]).
pub fn mcnemar(a: &[bool], b: &[bool]) -> McNemar {
    assert_eq!(
        a.len(),
        b.len(),
        "mcnemar needs the same items for both modes"
    );
    let only_a = a.iter().zip(b).filter(|(&x, &y)| x && !y).count();
    let only_b = a.iter().zip(b).filter(|(&x, &y)| !x && y).count();
    McNemar {
        only_a,
        only_b,
        p_value: mcnemar_p(only_a, only_b),
    }
}

/// The exact two-sided p-value for `only_a` against `only_b` discordant items. The binomial
/// terms are summed in log space (`ln C(n, k) − n ln 2`), so thousands of items neither
/// overflow nor underflow to a wrong 0. Written here rather than taken from a crate: it is
/// one sum, and `statrs` would be a dependency for it alone.
pub fn mcnemar_p(only_a: usize, only_b: usize) -> f64 {
    let n = only_a + only_b;
    if n == 0 {
        return 1.0;
    }
    let k = only_a.min(only_b);
    // ln C(n, i), built incrementally: C(n, i+1) = C(n, i) · (n − i) / (i + 1).
    let mut ln_c = 0.0f64;
    let ln_half_n = -(n as f64) * std::f64::consts::LN_2;
    let mut tail = 0.0;
    for i in 0..=k {
        if i > 0 {
            ln_c += ((n - i + 1) as f64).ln() - (i as f64).ln();
        }
        tail += (ln_c + ln_half_n).exp();
    }
    (2.0 * tail).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 5e-5
    }

    #[test]
    fn wilson_matches_the_closed_form() {
        // Values from the closed form in python3 with z = 1.959963984540054.
        let (lo, hi) = wilson95(50, 100);
        assert!(close(lo, 0.4038) && close(hi, 0.5962), "{lo} {hi}");
        let (lo, hi) = wilson95(0, 10);
        assert!(lo == 0.0 && close(hi, 0.2775), "{lo} {hi}");
        let (lo, hi) = wilson95(10, 10);
        assert!(close(lo, 0.7225) && hi == 1.0, "{lo} {hi}");
        let (lo, hi) = wilson95(7, 20);
        assert!(close(lo, 0.1812) && close(hi, 0.5671), "{lo} {hi}");
        assert_eq!(wilson95(0, 0), (0.0, 1.0));
    }

    #[test]
    fn paired_interval_on_a_fixed_example() {
        let a = [
            true, true, false, true, false, true, true, false, true, true,
        ];
        let b = [
            true, false, false, true, true, false, true, false, false, true,
        ];
        // Differences 0,1,0,0,-1,1,0,0,1,0: mean 0.2, s = 0.6325 (n - 1 denominator).
        let (m, lo, hi) = paired_diff95(&a, &b);
        assert!((m - 20.0).abs() < 1e-12);
        assert!((lo - -19.1993).abs() < 5e-4, "{lo}");
        assert!((hi - 59.1993).abs() < 5e-4, "{hi}");
        // Identical modes: no difference and no spread.
        assert_eq!(paired_diff95(&a, &a), (0.0, 0.0, 0.0));
        let (m, lo, hi) = paired_diff95(&[true], &[false]);
        assert!(m == 100.0 && lo.is_nan() && hi.is_nan());
    }

    #[test]
    fn mcnemar_matches_the_exact_binomial() {
        // Reference: 2 * sum(comb(n, i) for i in range(min(b, c) + 1)) / 2**n in python3.
        for (b, c, want) in [
            (3, 1, 0.625),
            (1, 3, 0.625),
            (0, 0, 1.0),
            (5, 5, 1.0),
            (10, 2, 0.038_574_218_75),
            (0, 7, 0.015_625),
            (40, 25, 0.081_681_533_941_540_05),
            (120, 90, 0.045_114_087_864_840_73),
        ] {
            let got = mcnemar_p(b, c);
            assert!((got - want).abs() < 1e-12, "({b}, {c}): {got} vs {want}");
        }
        let a = [
            true, true, false, true, false, true, true, false, true, true,
        ];
        let b = [
            true, false, false, true, true, false, true, false, false, true,
        ];
        // Discordant: a alone right on items 2, 6, 9; b alone on item 5.
        let m = mcnemar(&a, &b);
        assert_eq!((m.only_a, m.only_b), (3, 1));
        assert_eq!(m.p_value, 0.625);
    }

    #[test]
    #[should_panic(expected = "same items")]
    fn paired_interval_refuses_different_lengths() {
        paired_diff95(&[true], &[true, false]);
    }
}
