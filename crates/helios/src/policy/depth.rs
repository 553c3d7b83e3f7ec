//! How deep to load, from an exit histogram (HELIOS step 3: only the layers most likely
//! needed, e.g. 6 of OPT-1.3B's 24).

use crate::pht::ExitHistogram;

/// Slack for shares computed as ratios of counts (a share of exactly 0.7 must meet 0.7).
const SHARE_EPS: f64 = 1e-12;

/// The smallest of `servable` (increasing depths a partial load may stop at; the last is full
/// depth) at or below which at least `share` of the histogram's tokens exit. Full depth when
/// no smaller one covers enough, or when nothing was measured.
pub fn coverage_depth(hist: &ExitHistogram, servable: &[usize], share: f64) -> usize {
    let full = servable.last().copied().unwrap_or(0);
    if hist.is_empty() {
        return full;
    }
    servable
        .iter()
        .copied()
        .find(|&d| hist.share_at_or_below(d) + SHARE_EPS >= share)
        .unwrap_or(full)
}

/// Where an extend goes from `current`: the smallest servable depth above it that covers
/// `share` of the tokens that did not exit by `current` (the high-exit tokens the breaches
/// are about). When the histogram has no tokens beyond `current` it cannot tell, so the next
/// servable depth. `None` at full depth.
pub fn extend_target(
    hist: &ExitHistogram,
    servable: &[usize],
    current: usize,
    share: f64,
) -> Option<usize> {
    let above: Vec<usize> = servable.iter().copied().filter(|&d| d > current).collect();
    let first = *above.first()?;
    let below = hist.at_or_below(current);
    let beyond = hist.total() - below;
    if beyond == 0 {
        return Some(first);
    }
    let full = above.last().copied().unwrap_or(first);
    Some(
        above
            .iter()
            .copied()
            .find(|&d| (hist.at_or_below(d) - below) as f64 / beyond as f64 + SHARE_EPS >= share)
            .unwrap_or(full),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// HELIOS's OPT-1.3B: 74% of tokens exit within the first 6 of 24 layers.
    fn opt_1_3b() -> ExitHistogram {
        ExitHistogram::from_counts([(6, 74), (12, 10), (18, 6), (24, 10)])
    }

    const SERVABLE: &[usize] = &[6, 12, 18, 24];

    #[test]
    fn smallest_exit_covering_the_share() {
        let h = opt_1_3b();
        assert_eq!(coverage_depth(&h, SERVABLE, 0.7), 6, "74% ≥ 70%");
        assert_eq!(
            coverage_depth(&h, SERVABLE, 0.74),
            6,
            "exactly 74% covers 74%"
        );
        assert_eq!(coverage_depth(&h, SERVABLE, 0.75), 12, "84% at 12");
        assert_eq!(coverage_depth(&h, SERVABLE, 0.85), 18, "90% at 18");
        assert_eq!(coverage_depth(&h, SERVABLE, 0.95), 24);
        assert_eq!(coverage_depth(&h, SERVABLE, 1.0), 24);
        assert_eq!(coverage_depth(&ExitHistogram::new(), SERVABLE, 0.7), 24);
        // Bins between servable depths count toward the next servable one.
        let h = ExitHistogram::from_counts([(3, 50), (9, 30), (24, 20)]);
        assert_eq!(coverage_depth(&h, SERVABLE, 0.5), 6);
        assert_eq!(coverage_depth(&h, SERVABLE, 0.8), 12);
    }

    #[test]
    fn extend_covers_the_tokens_beyond_the_current_depth() {
        let h = opt_1_3b();
        // 26 tokens beyond 6: 10 by 12 (38%), 16 by 18 (62%), all by 24.
        assert_eq!(extend_target(&h, SERVABLE, 6, 0.3), Some(12));
        assert_eq!(extend_target(&h, SERVABLE, 6, 0.6), Some(18));
        assert_eq!(extend_target(&h, SERVABLE, 6, 0.7), Some(24));
        assert_eq!(extend_target(&h, SERVABLE, 24, 0.7), None, "full depth");
        let easy = ExitHistogram::from_counts([(6, 100)]);
        assert_eq!(
            extend_target(&easy, SERVABLE, 6, 0.7),
            Some(12),
            "stale profile: one step"
        );
    }
}
