//! The Performance History Table (PHT): what the online evaluation measured for each candidate
//! (model, depth), and the exit-depth histogram it is built from.
//!
//! The table is small by design (HELIOS keeps it under 1 KB): one row per candidate, floats as
//! `f32`, the histogram as `[depth, tokens]` pairs of its non-empty bins only. It serializes
//! to compact JSON with short keys, the form `GET /admin/pht` shows.

use serde::{Deserialize, Serialize};

use crate::{HeliosError, Result};

/// HELIOS's size bound for the serialized table of 3 candidates.
pub const PHT_MAX_BYTES: usize = 1024;

/// Tokens per exit depth: for each token, the first exit layer whose confidence passed the
/// threshold, or the model's full depth when none did. Bins are kept sorted by depth.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<(usize, u64)>", into = "Vec<(usize, u64)>")]
pub struct ExitHistogram {
    bins: Vec<(usize, u64)>,
}

impl ExitHistogram {
    pub fn new() -> Self {
        Self::default()
    }

    /// From `(depth, tokens)` pairs in any order; a depth given twice adds up.
    pub fn from_counts(counts: impl IntoIterator<Item = (usize, u64)>) -> Self {
        let mut h = Self::new();
        for (d, c) in counts {
            h.add(d, c);
        }
        h
    }

    /// Counts one token that exited at `depth`.
    pub fn record(&mut self, depth: usize) {
        self.add(depth, 1);
    }

    pub fn add(&mut self, depth: usize, tokens: u64) {
        if tokens == 0 {
            return;
        }
        match self.bins.binary_search_by_key(&depth, |b| b.0) {
            Ok(i) => self.bins[i].1 += tokens,
            Err(i) => self.bins.insert(i, (depth, tokens)),
        }
    }

    /// Adds every bin of `other`.
    pub fn merge(&mut self, other: &ExitHistogram) {
        for &(d, c) in &other.bins {
            self.add(d, c);
        }
    }

    /// Non-empty bins `(depth, tokens)`, by increasing depth.
    pub fn bins(&self) -> &[(usize, u64)] {
        &self.bins
    }

    pub fn total(&self) -> u64 {
        self.bins.iter().map(|b| b.1).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.bins.is_empty()
    }

    /// Tokens that exited at `depth` or before.
    pub fn at_or_below(&self, depth: usize) -> u64 {
        self.bins
            .iter()
            .take_while(|b| b.0 <= depth)
            .map(|b| b.1)
            .sum()
    }

    /// Share of tokens that exited at `depth` or before (0 for an empty histogram).
    pub fn share_at_or_below(&self, depth: usize) -> f64 {
        match self.total() {
            0 => 0.0,
            t => self.at_or_below(depth) as f64 / t as f64,
        }
    }

    /// The deepest bin, if any.
    pub fn max_depth(&self) -> Option<usize> {
        self.bins.last().map(|b| b.0)
    }
}

impl TryFrom<Vec<(usize, u64)>> for ExitHistogram {
    type Error = String;

    fn try_from(v: Vec<(usize, u64)>) -> std::result::Result<Self, String> {
        if let Some(w) = v.windows(2).find(|w| w[0].0 >= w[1].0) {
            return Err(format!(
                "exit histogram depths must increase, got {} then {}",
                w[0].0, w[1].0
            ));
        }
        Ok(Self::from_counts(v))
    }
}

impl From<ExitHistogram> for Vec<(usize, u64)> {
    fn from(h: ExitHistogram) -> Self {
        h.bins
    }
}

/// One candidate's online measurements.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PhtRow {
    /// Repository name of the model.
    #[serde(rename = "m")]
    pub model: String,
    /// Layers run while it was measured.
    #[serde(rename = "d")]
    pub depth: u16,
    /// Output tokens per second.
    #[serde(rename = "tps")]
    pub tokens_per_s: f32,
    /// Bits per UTF-8 byte of what it served (comparable across tokenizers).
    #[serde(rename = "bpb")]
    pub bits_per_byte: f32,
    /// Exit-depth histogram at the table's confidence threshold.
    #[serde(rename = "h")]
    pub exits: ExitHistogram,
    /// Milliseconds to load one more layer of this model (extend).
    #[serde(rename = "ext")]
    pub extend_ms_per_layer: f32,
    /// Milliseconds to move serving to this model at its depth (switch).
    #[serde(rename = "sw")]
    pub switch_ms: f32,
    /// Requests the row was measured on.
    #[serde(rename = "n")]
    pub requests: u32,
}

/// The Performance History Table.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pht {
    /// Confidence threshold the exit histograms were counted at.
    #[serde(rename = "thr")]
    pub threshold: f32,
    rows: Vec<PhtRow>,
}

impl Pht {
    pub fn new(threshold: f32) -> Self {
        Self {
            threshold,
            rows: Vec::new(),
        }
    }

    pub fn rows(&self) -> &[PhtRow] {
        &self.rows
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Inserts `row`, replacing the row of the same (model, depth): a re-profile overwrites
    /// what it measures again.
    pub fn upsert(&mut self, row: PhtRow) {
        match self
            .rows
            .iter_mut()
            .find(|r| r.model == row.model && r.depth == row.depth)
        {
            Some(r) => *r = row,
            None => self.rows.push(row),
        }
    }

    pub fn get(&self, model: &str, depth: usize) -> Option<&PhtRow> {
        self.rows
            .iter()
            .find(|r| r.model == model && usize::from(r.depth) == depth)
    }

    /// The rows of `model`, in insertion order.
    pub fn of_model<'a>(&'a self, model: &'a str) -> impl Iterator<Item = &'a PhtRow> + 'a {
        self.rows.iter().filter(move |r| r.model == model)
    }

    /// Distinct model names, in first-seen order.
    pub fn models(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for r in &self.rows {
            if !out.contains(&r.model.as_str()) {
                out.push(&r.model);
            }
        }
        out
    }

    /// Removes every row of `model` (it left the candidate set).
    pub fn remove_model(&mut self, model: &str) {
        self.rows.retain(|r| r.model != model);
    }

    /// The compact JSON form.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string(self).map_err(|e| HeliosError::Pht(e.to_string()))
    }

    pub fn from_json(s: &str) -> Result<Self> {
        serde_json::from_str(s).map_err(|e| HeliosError::Pht(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row as large as the zoo makes one: the longest zoo model name, a histogram with a bin
    /// at every exit of a 28-layer model plus full depth, five-digit counts and floats that
    /// need all their digits.
    fn big_row(model: &str, salt: f32) -> PhtRow {
        PhtRow {
            model: model.to_string(),
            depth: 28,
            tokens_per_s: 123.456_79 + salt,
            bits_per_byte: 0.812_345_7 + salt,
            exits: ExitHistogram::from_counts(
                [3, 6, 9, 12, 15, 18, 21, 24, 27, 28]
                    .into_iter()
                    .map(|d| (d, 12_345 + d as u64)),
            ),
            extend_ms_per_layer: 4.567_891 + salt,
            switch_ms: 1_234.567_9 + salt,
            requests: 5,
        }
    }

    #[test]
    fn three_candidates_serialize_under_one_kilobyte_and_round_trip() {
        let mut pht = Pht::new(0.8);
        pht.upsert(big_row("qwen2.5-coder-1.5b-instruct", 0.0));
        pht.upsert(big_row("qwen2.5-coder-0.5b-instruct", 0.1));
        pht.upsert(big_row("smollm2-135m-instruct", 0.2));
        let json = pht.to_json().unwrap();
        eprintln!("PHT of 3 candidates: {} bytes: {json}", json.len());
        assert!(json.len() < PHT_MAX_BYTES, "{} bytes: {json}", json.len());
        assert_eq!(Pht::from_json(&json).unwrap(), pht);
    }

    #[test]
    fn upsert_replaces_the_same_model_and_depth() {
        let mut pht = Pht::new(0.8);
        pht.upsert(big_row("a", 0.0));
        pht.upsert(big_row("b", 0.0));
        let mut again = big_row("a", 1.0);
        again.requests = 10;
        pht.upsert(again);
        assert_eq!(pht.rows().len(), 2);
        assert_eq!(pht.get("a", 28).map(|r| r.requests), Some(10));
        assert_eq!(pht.models(), vec!["a", "b"]);
        pht.remove_model("a");
        assert_eq!(pht.models(), vec!["b"]);
        assert!(pht.get("a", 28).is_none());
    }

    #[test]
    fn histogram_counts_shares_and_sorts() {
        let mut h = ExitHistogram::new();
        for d in [9, 3, 3, 30, 3, 9] {
            h.record(d);
        }
        h.add(6, 0);
        assert_eq!(h.bins(), &[(3, 3), (9, 2), (30, 1)]);
        assert_eq!(h.total(), 6);
        assert_eq!(h.at_or_below(8), 3);
        assert!((h.share_at_or_below(9) - 5.0 / 6.0).abs() < 1e-12);
        assert_eq!(ExitHistogram::new().share_at_or_below(30), 0.0);
        let mut g = ExitHistogram::from_counts([(30, 4), (3, 1)]);
        g.merge(&h);
        assert_eq!(g.bins(), &[(3, 4), (9, 2), (30, 5)]);
        assert_eq!(g.max_depth(), Some(30));
    }

    #[test]
    fn bad_json_is_an_error_that_says_why() {
        let e = Pht::from_json(r#"{"thr":0.8,"rows":[],"extra":1}"#).unwrap_err();
        assert!(e.to_string().contains("extra"), "{e}");
        let e = Pht::from_json(
            r#"{"thr":0.8,"rows":[{"m":"a","d":3,"tps":1,"bpb":1,"h":[[6,1],[3,1]],"ext":1,"sw":1,"n":1}]}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("must increase"), "{e}");
    }
}
