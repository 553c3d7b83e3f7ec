//! PNG plots of the exit study, drawn with [`switchyard_charts`] (without a system font they
//! have no text, and the Markdown report names the series).

use std::path::{Path, PathBuf};

pub use switchyard_charts::{fonts_available, Chart, Series, SeriesLabelPosition};

/// [`switchyard_charts::line_chart`], its error as this crate's.
pub fn line_chart(path: &Path, chart: &Chart<'_>, text: bool) -> Result<()> {
    switchyard_charts::line_chart(path, chart, text).map_err(|e| ExitsError::Plot {
        path: e.path,
        detail: e.detail,
    })
}

use crate::study::{PairReport, StudyReport, BUCKETS};
use switchyard_exits::{ExitsError, Result};

fn finite(points: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    points.into_iter().filter(|(_, y)| y.is_finite()).collect()
}

/// The study's four plots in `dir`; returns their paths.
pub fn plot_study(r: &StudyReport, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(ExitsError::io(dir))?;
    let text = fonts_available();
    let stem = file_stem(&r.model, &r.corpus);
    let x = (0.0, r.n_layers as f64);
    let mut out = Vec::new();

    let agreement = [
        Series {
            name: "tuned lens (affine)".into(),
            points: r
                .layers
                .iter()
                .map(|l| (l.depth as f64, 100.0 * l.agreement_tuned))
                .collect(),
        },
        Series {
            name: "logit lens (identity)".into(),
            points: r
                .layers
                .iter()
                .map(|l| (l.depth as f64, 100.0 * l.agreement_lens))
                .collect(),
        },
    ];
    let title = format!(
        "{}: top-1 agreement with the final layer ({})",
        r.model, r.corpus
    );
    let p = dir.join(format!("{stem}-agreement.png"));
    line_chart(
        &p,
        &Chart {
            title: &title,
            x_label: "exit depth (layers run)",
            y_label: "agreement (%)",
            x,
            y: (0.0, 100.0),
            series: &agreement,
            legend: SeriesLabelPosition::UpperLeft,
        },
        text,
    )?;
    out.push(p);

    let kl_max = r
        .layers
        .iter()
        .flat_map(|l| [l.mean_kl_tuned_nats, l.mean_kl_lens_nats])
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max)
        .max(1e-3);
    let kl = [
        Series {
            name: "tuned lens (affine)".into(),
            points: finite(
                r.layers
                    .iter()
                    .map(|l| (l.depth as f64, l.mean_kl_tuned_nats))
                    .collect(),
            ),
        },
        Series {
            name: "logit lens (identity)".into(),
            points: finite(
                r.layers
                    .iter()
                    .map(|l| (l.depth as f64, l.mean_kl_lens_nats))
                    .collect(),
            ),
        },
    ];
    let title = format!("{}: mean KL(final || exit) ({})", r.model, r.corpus);
    let p = dir.join(format!("{stem}-kl.png"));
    line_chart(
        &p,
        &Chart {
            title: &title,
            x_label: "exit depth (layers run)",
            y_label: "KL (nats)",
            x,
            y: (0.0, kl_max * 1.05),
            series: &kl,
            legend: SeriesLabelPosition::UpperRight,
        },
        text,
    )?;
    out.push(p);

    let cumulative: Vec<Series> = r
        .cumulative
        .iter()
        .map(|c| Series {
            name: format!("threshold {}", c.threshold),
            points: r
                .depths
                .iter()
                .zip(&c.exit_share_at_or_before)
                .map(|(&d, &v)| (d as f64, 100.0 * v))
                .chain([(r.n_layers as f64, 100.0)])
                .collect(),
        })
        .collect();
    let title = format!(
        "{}: tokens exited at or before each depth ({})",
        r.model, r.corpus
    );
    let p = dir.join(format!("{stem}-cumulative-exits.png"));
    line_chart(
        &p,
        &Chart {
            title: &title,
            x_label: "depth (layers run)",
            y_label: "tokens exited (%)",
            x,
            y: (0.0, 100.0),
            series: &cumulative,
            legend: SeriesLabelPosition::UpperLeft,
        },
        text,
    )?;
    out.push(p);

    let buckets: Vec<Series> = r
        .depths
        .iter()
        .map(|&d| Series {
            name: format!("depth {d}"),
            points: finite(
                r.buckets
                    .iter()
                    .filter(|b| b.depth == d && b.tokens > 0)
                    .map(|b| ((b.lo + b.hi) as f64 / 2.0, 100.0 * b.agreement))
                    .collect(),
            ),
        })
        .collect();
    let title = format!("{}: agreement by exit confidence ({})", r.model, r.corpus);
    let p = dir.join(format!("{stem}-confidence-buckets.png"));
    line_chart(
        &p,
        &Chart {
            title: &title,
            x_label: &format!(
                "confidence ({}), bucket of width {}",
                r.confidence.as_str(),
                1.0 / BUCKETS as f64
            ),
            y_label: "agreement with final (%)",
            x: (0.0, 1.0),
            y: (0.0, 100.0),
            series: &buckets,
            legend: SeriesLabelPosition::UpperLeft,
        },
        text,
    )?;
    out.push(p);
    Ok(out)
}

/// The complementarity plot in `dir`.
pub fn plot_pair(r: &PairReport, dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(ExitsError::io(dir))?;
    let text = fonts_available();
    let mut series = Vec::new();
    let mut fractions: Vec<f64> = r.rows.iter().map(|x| x.early_fraction).collect();
    fractions.sort_by(f64::total_cmp);
    fractions.dedup();
    for f in fractions {
        let rows: Vec<_> = r.rows.iter().filter(|x| x.early_fraction == f).collect();
        let pts = |g: &dyn Fn(&crate::study::PairRow) -> f64| {
            finite(
                rows.iter()
                    .map(|x| (x.threshold as f64, 100.0 * g(x)))
                    .collect(),
            )
        };
        series.push(Series {
            name: format!("{} alone, early ≤{}", r.small, rows[0].small_early_depth),
            points: pts(&|x| x.small_early_share),
        });
        series.push(Series {
            name: format!(
                "joint, early ≤{}/{}",
                rows[0].small_early_depth, rows[0].large_early_depth
            ),
            points: pts(&|x| x.joint_early_share),
        });
    }
    let title = format!("early-exit share: {} + {}", r.small, r.large);
    let p = dir.join(format!(
        "{}-complementarity.png",
        file_stem(&r.small, &r.large)
    ));
    line_chart(
        &p,
        &Chart {
            title: &title,
            x_label: "confidence threshold",
            y_label: "tokens exiting early (%)",
            x: (0.45, 1.0),
            y: (0.0, 100.0),
            series: &series,
            legend: SeriesLabelPosition::UpperRight,
        },
        text,
    )?;
    Ok(p)
}

fn file_stem(a: &str, b: &str) -> String {
    let clean = |s: &str| -> String {
        let base = Path::new(s)
            .file_name()
            .map_or_else(|| s.to_string(), |n| n.to_string_lossy().into_owned());
        base.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    };
    format!("{}-{}", clean(a), clean(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_written_with_and_without_text() -> Result<()> {
        let dir = tempfile::tempdir().map_err(ExitsError::io("tempdir"))?;
        let series = [Series {
            name: "a".into(),
            points: vec![(1.0, 10.0), (2.0, 30.0), (3.0, 20.0)],
        }];
        let chart = Chart {
            title: "t",
            x_label: "x",
            y_label: "y",
            x: (0.0, 4.0),
            y: (0.0, 40.0),
            series: &series,
            legend: SeriesLabelPosition::UpperLeft,
        };
        let plain = dir.path().join("plain.png");
        line_chart(&plain, &chart, false)?;
        let png = std::fs::read(&plain).map_err(ExitsError::io(&plain))?;
        assert_eq!(&png[1..4], b"PNG");
        if fonts_available() {
            let with_text = dir.path().join("text.png");
            line_chart(&with_text, &chart, true)?;
            assert!(with_text.exists());
        }
        Ok(())
    }
}
