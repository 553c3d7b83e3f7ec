//! PNG charts for every report (plotters, bitmap backend): line charts and stacked bars.
//!
//! Text needs a font, and Switchyard ships none: the first TrueType font found on the system
//! (DejaVu Sans or Liberation Sans where present, else any `.ttf` under the usual font folders)
//! is registered with plotters' `ab_glyph` renderer at run time. Without one, charts are drawn
//! without any text (shapes and grid only) and the reports beside them name the series.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;

pub use plotters::prelude::SeriesLabelPosition;

/// A chart that could not be drawn or written.
#[derive(Debug, thiserror::Error)]
#[error("cannot draw {path}: {detail}")]
pub struct ChartError {
    pub path: PathBuf,
    pub detail: String,
}

pub type Result<T> = std::result::Result<T, ChartError>;

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
    let err = |e: &dyn std::fmt::Display| ChartError {
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

/// One bar of a stacked bar chart: a label and one value per segment.
pub struct Bar {
    pub label: String,
    pub values: Vec<f64>,
}

/// Horizontal bars, each split into segments that add up to its length.
pub struct StackedBars<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    /// The segments' names, in the order of each bar's values.
    pub segments: &'a [String],
    pub bars: &'a [Bar],
}

/// Draws `chart` to the PNG `path`; with `text` false, no caption, labels or legend.
pub fn stacked_bars(path: &Path, chart: &StackedBars<'_>, text: bool) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| ChartError {
        path: path.to_path_buf(),
        detail: e.to_string(),
    };
    if let Some(b) = chart
        .bars
        .iter()
        .find(|b| b.values.len() != chart.segments.len())
    {
        return Err(err(&format!(
            "bar {} has {} values for {} segments",
            b.label,
            b.values.len(),
            chart.segments.len()
        )));
    }
    let longest = chart
        .bars
        .iter()
        .map(|b| b.values.iter().filter(|v| v.is_finite()).sum::<f64>())
        .fold(0.0, f64::max);
    let n = chart.bars.len().max(1);
    let height = (SIZE.1 as usize).max(120 + 36 * n) as u32;
    let root = BitMapBackend::new(path, (SIZE.0 + 200, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (plot, legend) = root.split_horizontally(SIZE.0);
    let mut builder = ChartBuilder::on(&plot);
    builder.margin(20);
    if text {
        builder
            .caption(chart.title, (FONT_FAMILY, 22))
            .x_label_area_size(45)
            .y_label_area_size(140);
    }
    let mut ctx = builder
        .build_cartesian_2d(
            0.0..(longest * 1.05).max(f64::MIN_POSITIVE),
            -0.5..n as f64 - 0.5,
        )
        .map_err(|e| err(&e))?;
    // Bar i is centred on y = i, where the axis puts its whole-number ticks.
    let labels: Vec<String> = chart.bars.iter().map(|b| b.label.clone()).collect();
    let label_of = |y: &f64| {
        let i = y.round();
        if (y - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < labels.len() {
            labels[i as usize].clone()
        } else {
            String::new()
        }
    };
    let mut mesh = ctx.configure_mesh();
    mesh.disable_y_mesh().y_labels(n);
    if text {
        mesh.x_desc(chart.x_label)
            .label_style((FONT_FAMILY, 14))
            .y_label_formatter(&label_of);
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(|e| err(&e))?;
    for (i, b) in chart.bars.iter().enumerate() {
        let (y0, y1) = (i as f64 - 0.35, i as f64 + 0.35);
        let mut x = 0.0;
        for (s, v) in b.values.iter().enumerate() {
            if !v.is_finite() || *v <= 0.0 {
                continue;
            }
            let color = COLORS[s % COLORS.len()];
            ctx.draw_series(std::iter::once(Rectangle::new(
                [(x, y0), (x + v, y1)],
                color.filled(),
            )))
            .map_err(|e| err(&e))?;
            x += v;
        }
    }
    if text {
        for (s, name) in chart.segments.iter().enumerate() {
            let color = COLORS[s % COLORS.len()];
            let y = 40 + 22 * s as i32;
            legend
                .draw(&Rectangle::new([(10, y), (24, y + 14)], color.filled()))
                .map_err(|e| err(&e))?;
            legend
                .draw(&Text::new(name.clone(), (30, y), (FONT_FAMILY, 14)))
                .map_err(|e| err(&e))?;
        }
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_written_as_png_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let text = fonts_available();
        let path = dir.path().join("bars.png");
        let segments = vec!["a".to_string(), "b".to_string()];
        let bars = [
            Bar {
                label: "one".into(),
                values: vec![1.0, 2.0],
            },
            Bar {
                label: "two".into(),
                values: vec![0.5, f64::NAN],
            },
        ];
        let chart = StackedBars {
            title: "t",
            x_label: "ms",
            segments: &segments,
            bars: &bars,
        };
        stacked_bars(&path, &chart, text).expect("bars");
        let png = std::fs::read(&path).expect("read");
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        // A bar whose values do not match the segments is refused with its name.
        let bad = [Bar {
            label: "short".into(),
            values: vec![1.0],
        }];
        let e = stacked_bars(
            &path,
            &StackedBars {
                bars: &bad,
                ..chart
            },
            text,
        )
        .unwrap_err();
        assert!(
            e.detail.contains("bar short has 1 values for 2 segments"),
            "{e}"
        );

        let line = dir.path().join("line.png");
        let series = [Series {
            name: "s".into(),
            points: vec![(0.0, 1.0), (1.0, 2.0)],
        }];
        line_chart(
            &line,
            &Chart {
                title: "t",
                x_label: "x",
                y_label: "y",
                x: (0.0, 1.0),
                y: (0.0, 2.0),
                series: &series,
                legend: SeriesLabelPosition::UpperLeft,
            },
            text,
        )
        .expect("line");
        assert_eq!(&std::fs::read(&line).expect("read")[..4], b"\x89PNG");
    }
}
