//! The sequences of one forward step, each with its K/V cache and positions.

use crate::kv::SeqKv;

/// One sequence's share of a forward batch: `n` tokens at positions `start..start + n`.
pub struct SeqChunk<'a> {
    pub start: usize,
    pub n: usize,
    pub kv: &'a mut dyn SeqKv,
}

/// The sequences of one forward step. Hidden states passed with it hold their tokens in the
/// same order: all tokens of the first sequence, then the second, and so on.
pub struct ForwardBatch<'a> {
    pub seqs: Vec<SeqChunk<'a>>,
}

impl<'a> ForwardBatch<'a> {
    pub fn new(seqs: Vec<SeqChunk<'a>>) -> Self {
        Self { seqs }
    }

    /// A batch of one sequence.
    pub fn single(kv: &'a mut dyn SeqKv, start: usize, n: usize) -> Self {
        Self::new(vec![SeqChunk { start, n, kv }])
    }

    pub fn total_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.n).sum()
    }

    /// The position of every token, in batch order.
    pub fn positions(&self) -> Vec<usize> {
        self.seqs
            .iter()
            .flat_map(|s| s.start..s.start + s.n)
            .collect()
    }
}
