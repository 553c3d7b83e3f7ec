//! PNG plots of the exit study (plotters, bitmap backend).
//!
//! Text needs a font, and this crate ships none: the first TrueType font found on the system
//! (DejaVu Sans or Liberation Sans where present, else any `.ttf` under the usual font folders)
//! is registered with plotters' `ab_glyph` renderer at run time. Without one, the plots are
//! drawn without any text (lines and grid only) and the Markdown report names the series.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::study::{PairReport, StudyReport, BUCKETS};
use crate::{ExitsError, Result};

const SIZE: (u32, u32) = (900, 560);
const FONT_FAMILY: &str = "sans-serif";
const PREFERRED_FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];
const FONT_DIRS: &[&str] = &["/usr/share/fonts", "/usr/local/share/fonts"];

/// Registers a system font once; whether text can be drawn.
pub fn fonts_available() -> bool {
    static FONT: OnceLock<bool> = OnceLock::new();
    *FONT.get_or_init(|| {
        let Some(path) = find_font() else {
            tracing::warn!("no TrueType font found; plots are drawn without text");
            return false;
        };
        let Ok(bytes) = std::fs::read(&path) else {
            return false;
        };
        // plotters keeps fonts for the life of the process; this runs once.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, bytes).is_ok()
    })
}

fn find_font() -> Option<PathBuf> {
    if let Some(p) = PREFERRED_FONTS.iter().map(Path::new).find(|p| p.is_file()) {
        return Some(p.to_path_buf());
    }
    let mut stack: Vec<PathBuf> = FONT_DIRS.iter().map(PathBuf::from).collect();
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for p in paths {
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|e| e.eq_ignore_ascii_case("ttf")) {
                return Some(p);
            }
        }
    }
    None
}

/// One line of a chart.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// A line chart.
pub struct Chart<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub x: (f64, f64),
    pub y: (f64, f64),
    pub series: &'a [Series],
    /// Where the legend goes (the corner the lines leave empty).
    pub legend: SeriesLabelPosition,
}

const COLORS: &[RGBColor] = &[
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Draws `chart` to the PNG `path`; with `text` false, no caption, labels or legend.
pub fn line_chart(path: &Path, chart: &Chart<'_>, text: bool) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| ExitsError::Plot {
        path: path.to_path_buf(),
        detail: e.to_string(),
    };
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if text {
        builder
            .caption(chart.title, (FONT_FAMILY, 22))
            .x_label_area_size(45)
            .y_label_area_size(60);
    }
    let mut ctx = builder
        .build_cartesian_2d(chart.x.0..chart.x.1, chart.y.0..chart.y.1)
        .map_err(|e| err(&e))?;
    let mut mesh = ctx.configure_mesh();
    if text {
        mesh.x_desc(chart.x_label)
            .y_desc(chart.y_label)
            .label_style((FONT_FAMILY, 15));
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(|e| err(&e))?;
    for (i, s) in chart.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let drawn = ctx
            .draw_series(LineSeries::new(
                s.points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| err(&e))?;
        if text {
            drawn
                .label(s.name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        ctx.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| err(&e))?;
    }
    if text && chart.series.len() > 1 {
        ctx.configure_series_labels()
            .position(chart.legend.clone())
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font((FONT_FAMILY, 14))
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

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
