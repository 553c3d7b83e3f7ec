//! Stop strings over streamed text: text that might be the start of a stop string is held
//! back until the next piece shows whether it is, so a stop string is never partly emitted.

/// What to do with a newly generated piece of text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopOutcome {
    /// Emit this text (possibly empty) and continue.
    Continue(String),
    /// Emit this text (what came before the stop string) and finish.
    Stopped(String),
}

#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
        }
    }

    pub fn push(&mut self, piece: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome::Continue(piece.to_string());
        }
        self.held.push_str(piece);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let out = self.held[..at].to_string();
            self.held.clear();
            return StopOutcome::Stopped(out);
        }
        // Longest suffix of `held` that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopOutcome::Continue(out)
    }

    /// Text still held back when generation ends for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let max = (stop.len() - 1).min(text.len());
    (1..=max)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && stop
                    .as_bytes()
                    .starts_with(&text.as_bytes()[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopOutcome::Continue(t) => out.push_str(&t),
                StopOutcome::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_across_pieces_is_never_emitted() {
        assert_eq!(
            run(&["\n\nUser:"], &["Hi", " there", "\n", "\nUs", "er:", " x"]),
            ("Hi there".into(), true)
        );
        assert_eq!(run(&["END"], &["abcE", "N", "D"]), ("abc".into(), true));
        // A false start is released once it can no longer match.
        assert_eq!(
            run(&["END"], &["abcE", "Nx", "y"]),
            ("abcENxy".into(), false)
        );
        // Earliest of several stop strings wins.
        assert_eq!(run(&["cd", "b"], &["abcd"]), ("a".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
    }
}
