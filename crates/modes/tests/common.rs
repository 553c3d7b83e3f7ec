//! Set-up shared by the suite's real-model tests.

use std::sync::Arc;

use switchyard_modes::serve::{ModeAssets, DEFAULT_SPEC_K};
use switchyard_tokenizer::Tokenizer;

/// SmolLM2-135M-Instruct's assets (fetched into the cache on first use), without a draft,
/// exit heads or calibrations.
pub fn smollm2(max_model_len: Option<usize>) -> anyhow::Result<ModeAssets> {
    let name = "smollm2-135m-instruct";
    let source = switchyard_weights::open(&switchyard_zoo::ensure(name)?)?;
    let tokenizer = Arc::new(Tokenizer::from_source(&*source)?);
    Ok(ModeAssets {
        name: name.into(),
        source,
        tokenizer,
        draft: None,
        heads: None,
        awq: None,
        gptq: None,
        spec_k: DEFAULT_SPEC_K,
        max_model_len,
    })
}
