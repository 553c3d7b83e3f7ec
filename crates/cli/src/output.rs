//! Writing results: JSON to a file or stdout; a benchmark's Markdown summary and JSON report.

use std::path::PathBuf;

use anyhow::Context;
use serde::Serialize;

/// `--json [FILE]`: `None` (flag absent), `Some(None)` (stdout) or `Some(Some(path))`.
pub type JsonTarget = Option<Option<PathBuf>>;

pub fn write_json<T: Serialize>(target: &JsonTarget, value: &T) -> anyhow::Result<()> {
    let Some(target) = target else {
        return Ok(());
    };
    let text = serde_json::to_string_pretty(value)?;
    match target {
        Some(path) => {
            std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
        }
        None => {
            println!("{text}");
            Ok(())
        }
    }
}

/// A benchmark's summary on stdout and, when asked for, in a Markdown file; its whole report
/// as JSON.
pub fn write_report<T: Serialize>(
    markdown: &str,
    report: &T,
    markdown_path: Option<&PathBuf>,
    json_path: Option<&PathBuf>,
) -> anyhow::Result<()> {
    print!("{markdown}");
    if let Some(path) = markdown_path {
        std::fs::write(path, markdown).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = json_path {
        let text = serde_json::to_string_pretty(report)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
