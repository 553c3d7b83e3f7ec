//! The online evaluation's plan (HELIOS step 2): the next requests go to each candidate in
//! turn, a block of `per_candidate` (default 5) per candidate, serially, so each candidate is
//! loaded once per evaluation. The requests are real traffic: their outputs are the responses.

/// Which candidate serves each of the next requests of an evaluation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvalPlan {
    candidates: Vec<String>,
    per_candidate: usize,
    /// Requests assigned so far.
    assigned: usize,
}

impl EvalPlan {
    pub fn new(candidates: Vec<String>, per_candidate: usize) -> Self {
        Self {
            candidates,
            per_candidate: per_candidate.max(1),
            assigned: 0,
        }
    }

    /// Requests the whole evaluation takes.
    pub fn len(&self) -> usize {
        self.candidates.len() * self.per_candidate
    }

    pub fn is_empty(&self) -> bool {
        self.candidates.is_empty()
    }

    /// The candidate for the next request, or `None` once every candidate had its block.
    pub fn assign(&mut self) -> Option<&str> {
        let i = self.assigned / self.per_candidate;
        let c = self.candidates.get(i)?;
        self.assigned += 1;
        Some(c)
    }

    /// The candidate the next request would go to, without assigning it.
    pub fn peek(&self) -> Option<&str> {
        self.candidates
            .get(self.assigned / self.per_candidate)
            .map(String::as_str)
    }

    pub fn is_complete(&self) -> bool {
        self.assigned >= self.len()
    }

    /// Whether the last assigned request ended `model`'s block (its PHT row can be written
    /// once that request finishes).
    pub fn block_ended(&self, model: &str) -> bool {
        self.assigned > 0
            && self.assigned.is_multiple_of(self.per_candidate)
            && self
                .candidates
                .get(self.assigned / self.per_candidate - 1)
                .is_some_and(|c| c == model)
    }

    pub fn assigned(&self) -> usize {
        self.assigned
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::DEFAULT_EVAL_REQUESTS;

    #[test]
    fn five_requests_per_candidate_in_turn() {
        let names = ["a", "b", "c"].map(String::from).to_vec();
        let mut p = EvalPlan::new(names, DEFAULT_EVAL_REQUESTS);
        assert_eq!(p.len(), 15);
        let mut got = Vec::new();
        while let Some(c) = p.assign() {
            got.push(c.to_string());
            if got.len() == 5 {
                assert!(p.block_ended("a"));
                assert!(!p.block_ended("b"));
            }
            if got.len() == 6 {
                assert!(!p.block_ended("a"));
            }
        }
        let want: Vec<String> = ["a"; 5]
            .into_iter()
            .chain(["b"; 5])
            .chain(["c"; 5])
            .map(String::from)
            .collect();
        assert_eq!(got, want);
        assert!(p.is_complete());
        assert!(p.block_ended("c"));
        assert_eq!(p.assign(), None);
        assert_eq!((p.peek(), p.assigned()), (None, 15));
        let mut empty = EvalPlan::new(Vec::new(), 5);
        assert!(empty.is_empty() && empty.is_complete() && empty.assign().is_none());
    }
}
