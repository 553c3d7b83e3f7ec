//! [`Sequence`]: one request's tokens and block tables as the scheduler tracks them.

use crate::kv::PagedKv;
use crate::RequestId;

/// What the scheduler needs to know of a new request (validated by the caller).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewSequence {
    pub prompt: Vec<u32>,
    /// Most tokens to generate (at least 1).
    pub max_tokens: usize,
    /// Keep going past end-of-generation tokens.
    pub ignore_eos: bool,
}

/// Where a sequence is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    /// Not admitted (or preempted): holds no KV blocks.
    Waiting,
    /// Admitted: holds blocks for what it has computed and is scheduled every step it can be.
    Running,
}

/// One request in the scheduler.
#[derive(Debug)]
pub struct Sequence {
    pub(super) id: RequestId,
    /// Prompt, then every generated token (the last one not yet run through the model).
    pub(super) tokens: Vec<u32>,
    pub(super) prompt_len: usize,
    /// Already capped so that prompt + output fit the context.
    pub(super) max_tokens: usize,
    pub(super) ignore_eos: bool,
    pub(super) kv: PagedKv,
    pub(super) status: SeqStatus,
    /// Positions ever computed: a position below it is being recomputed.
    pub(super) high_water: usize,
    /// Prompt tokens found in the prefix cache at the last admission.
    pub(super) cached_tokens: usize,
    pub(super) preemptions: usize,
}

impl Sequence {
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Prompt and generated tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    /// Generated tokens so far.
    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    pub fn status(&self) -> SeqStatus {
        self.status
    }

    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }

    pub fn preemptions(&self) -> usize {
        self.preemptions
    }

    pub fn kv(&self) -> &PagedKv {
        &self.kv
    }

    /// Positions whose K/V every layer of `0..depth` holds: where the next chunk starts.
    pub fn computed(&self, depth: usize) -> usize {
        use switchyard_models::SeqKv;
        (0..depth)
            .map(|l| self.kv.len(l))
            .min()
            .unwrap_or(0)
            .min(self.tokens.len())
    }
}
