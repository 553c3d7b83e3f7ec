//! Writing results: JSON to a file or stdout.

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
