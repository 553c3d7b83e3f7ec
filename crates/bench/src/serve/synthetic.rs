//! Synthetic serving traffic, like vLLM's `random` dataset: prompts of random token ids
//! detokenized to text, re-tokenized and adjusted until they have the asked length, with a
//! fixed output length.

use rand::{Rng, SeedableRng};
use switchyard_tokenizer::Tokenizer;

use super::BenchRequest;
use crate::{BenchError, Result};

/// vLLM's `--random-input-len` default.
pub const DEFAULT_INPUT_LEN: usize = 1024;
/// vLLM's `--random-output-len` default.
pub const DEFAULT_OUTPUT_LEN: usize = 128;
/// Decode / re-encode rounds before settling for the nearest length (vLLM's
/// `gen_prompt_decode_to_target_len` tries 10).
const MAX_ADJUST_ROUNDS: usize = 10;

/// What to generate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntheticOptions {
    pub num_prompts: usize,
    /// Prompt tokens, BOS included when the model adds one.
    pub input_len: usize,
    pub output_len: usize,
    pub seed: u64,
}

/// `num_prompts` random prompts. A prompt's `prompt_tokens` is the length of its text
/// re-tokenized, which equals `input_len` unless a few rounds of adjusting did not get there
/// (detokenized random ids can merge into fewer tokens or split into more).
pub fn synthetic_requests(tok: &Tokenizer, opts: &SyntheticOptions) -> Result<Vec<BenchRequest>> {
    let bos = usize::from(tok.adds_bos() && tok.bos_id().is_some());
    if opts.input_len <= bos || opts.output_len == 0 {
        return Err(BenchError::Invalid(format!(
            "synthetic prompts need an input length over {bos} and an output length over 0 (got {} and {})",
            opts.input_len, opts.output_len
        )));
    }
    let vocab = u32::try_from(tok.vocab_size())
        .map_err(|_| BenchError::Invalid("vocabulary too large".into()))?;
    if vocab == 0 {
        return Err(BenchError::Invalid(
            "the tokenizer has no vocabulary".into(),
        ));
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(opts.seed);
    let target = opts.input_len - bos;
    (0..opts.num_prompts)
        .map(|_| {
            let mut ids: Vec<u32> = (0..target).map(|_| rng.random_range(0..vocab)).collect();
            let mut best: Option<(String, usize)> = None;
            for _ in 0..MAX_ADJUST_ROUNDS {
                let text = tok.decode(&ids, true)?;
                let again = tok.encode(&text, false, false)?;
                let closer = best
                    .as_ref()
                    .is_none_or(|(_, n)| again.len().abs_diff(target) < n.abs_diff(target));
                if closer {
                    best = Some((text, again.len()));
                }
                if again.len() == target {
                    break;
                }
                ids = again;
                if ids.len() > target {
                    ids.truncate(target);
                } else {
                    ids.extend((ids.len()..target).map(|_| rng.random_range(0..vocab)));
                }
            }
            let (prompt, n) = best.unwrap_or_default();
            Ok(BenchRequest {
                prompt,
                prompt_tokens: n + bos,
                output_len: opts.output_len,
            })
        })
        .collect()
}
