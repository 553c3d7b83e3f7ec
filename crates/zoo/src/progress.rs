//! The progress bar a pull draws on stderr (or a hidden one when quiet).

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Redraw interval, so the spinner moves while pip downloads and the byte count stands still.
const TICK: Duration = Duration::from_millis(120);
/// Kept under 80 columns for the longest asset name: `wide_bar` takes what is left.
const TEMPLATE: &str =
    "{spinner:.green} {prefix} {msg} [{wide_bar:.cyan/blue}] {bytes}/{total_bytes} {eta}";

/// A bar over `total` bytes of asset `name`; hidden when `quiet`.
pub(crate) fn bar(name: &str, total: u64, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(TEMPLATE)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    bar.set_style(style);
    bar.set_prefix(name.to_string());
    bar.enable_steady_tick(TICK);
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_parses() {
        assert!(ProgressStyle::with_template(TEMPLATE).is_ok());
    }

    #[test]
    fn quiet_bars_are_hidden() {
        assert!(bar("x", 10, true).is_hidden());
    }
}
