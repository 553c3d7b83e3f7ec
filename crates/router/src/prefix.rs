//! The shared-prefix feature: how much of a prompt's beginning an earlier prompt already had,
//! in whole KV blocks, which is what a prefix cache could reuse. The server and the router
//! benchmarks compute it the same way, from the prompts they have seen.

use std::collections::{HashSet, VecDeque};
use std::hash::{Hash, Hasher};

/// Prompt prefixes are remembered at multiples of this many tokens (the KV block size).
pub const PREFIX_GRAIN: usize = 16;
/// Prefix hashes remembered (oldest forgotten first).
pub const PREFIX_MEMORY: usize = 65_536;

/// Hashes of block-aligned prompt prefixes seen before.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    seen: HashSet<u64>,
    order: VecDeque<u64>,
}

impl PrefixIndex {
    /// The hash of each block-aligned prefix of `prompt` ([`PREFIX_GRAIN`] tokens, twice
    /// that, ...). Each extends the hash of the one before, so the prompt is hashed once.
    pub fn hashes(prompt: &[u32]) -> Vec<u64> {
        let mut previous = 0u64;
        prompt
            .chunks_exact(PREFIX_GRAIN)
            .map(|grain| {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                previous.hash(&mut h);
                grain.hash(&mut h);
                previous = h.finish();
                previous
            })
            .collect()
    }

    /// The longest block-aligned prefix seen before, of a prompt with these prefix
    /// [`PrefixIndex::hashes`]; then remembers them.
    pub fn observe(&mut self, hashes: &[u64]) -> usize {
        let mut shared = 0;
        for (i, &h) in hashes.iter().enumerate() {
            if self.seen.contains(&h) {
                shared = (i + 1) * PREFIX_GRAIN;
            } else {
                self.seen.insert(h);
                self.order.push_back(h);
                if self.order.len() > PREFIX_MEMORY {
                    if let Some(old) = self.order.pop_front() {
                        self.seen.remove(&old);
                    }
                }
            }
        }
        shared
    }

    /// [`PrefixIndex::observe`] for a prompt not hashed yet.
    pub fn observe_prompt(&mut self, prompt: &[u32]) -> usize {
        self.observe(&Self::hashes(prompt))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_block_aligned_shared_prefixes() {
        let mut p = PrefixIndex::default();
        let a: Vec<u32> = (0..100).collect();
        assert_eq!(p.observe_prompt(&a), 0);
        // Same first 40 tokens: 32 of them are in whole 16-token grains.
        let mut b: Vec<u32> = (0..40).collect();
        b.extend(1000..1060);
        assert_eq!(p.observe_prompt(&b), 32);
        assert_eq!(p.observe_prompt(&a), 96);
        assert_eq!(p.observe_prompt(&[7; 15]), 0);
        // Equal grains after different ones are not a shared prefix.
        let mut c: Vec<u32> = (500..516).collect();
        c.extend(16..32);
        assert_eq!(p.observe_prompt(&c), 0);
    }

    /// A prompt of 65,536 tokens has 4,096 block-aligned prefixes, one hash each; seen again,
    /// all of it is shared. Past [`PREFIX_MEMORY`] hashes the oldest are forgotten.
    #[test]
    fn long_prompts_and_forgetting() {
        let long: Vec<u32> = (0..65_536).collect();
        assert_eq!(PrefixIndex::hashes(&long).len(), 4_096);
        let mut p = PrefixIndex::default();
        assert_eq!(p.observe_prompt(&long), 0);
        assert_eq!(p.observe_prompt(&long), 65_536);
        // 16 more prompts of 4,096 grains each push the first one's hashes out.
        for k in 1..=16u32 {
            let other: Vec<u32> = (0..65_536).map(|t| t + k * 100_000).collect();
            assert_eq!(p.observe_prompt(&other), 0);
        }
        assert_eq!(p.order.len(), PREFIX_MEMORY);
        assert_eq!(p.observe_prompt(&long), 0);
    }
}
