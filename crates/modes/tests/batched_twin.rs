//! `ModeServer::batched`, which `bench modes` answers GSM8K on: on SmolLM2, its answers to
//! GSM8K questions sent together equal, token for token, the mode's own engine answering them
//! one at a time (f16, on the f16 kernel, and int8), with the shared 8 shots read from the
//! twin's prefix cache.

use switchyard_engine::EngineRequest;
use switchyard_eval::quality::{self, Pick};
use switchyard_modes::serve::ModeServer;
use switchyard_request::{Mode, SamplingParams};

#[test]
fn gsm8k_answers_sent_together_equal_the_modes_own_one_at_a_time() -> anyhow::Result<()> {
    let assets = crate::common::smollm2(Some(2048))?;
    let tokenizer = &assets.tokenizer;
    let params = SamplingParams {
        max_tokens: 24,
        ..SamplingParams::default()
    };
    let prompts = quality::load_gsm8k(3, Pick::First)?
        .iter()
        .map(|item| tokenizer.encode(&item.prompt, true, false))
        .collect::<Result<Vec<_>, _>>()?;
    let budget = 2 << 30;
    for mode in [Mode::F16, Mode::Int8] {
        let alone = ModeServer::load(mode, &assets, budget)?;
        let want = prompts
            .iter()
            .map(|p| Ok(alone.run(tokenizer, p, &params)?.tokens))
            .collect::<anyhow::Result<Vec<_>>>()?;
        drop(alone);
        let twin = ModeServer::batched(mode, &assets, budget)?.expect("an engine mode");
        let streams = prompts
            .iter()
            .map(|p| {
                twin.add_request(EngineRequest {
                    prompt: p.clone(),
                    params: params.clone(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let got = streams
            .into_iter()
            .map(|s| Ok(s.wait()?.token_ids))
            .collect::<anyhow::Result<Vec<_>>>()?;
        assert_eq!(got, want, "{mode}");
        assert!(want.iter().all(|t| t.len() == 24), "{mode}: {want:?}");
        let stats = twin.stats().wait()?;
        assert!(stats.counters.largest_batch >= 2, "{mode}");
        // The later questions read the 8 shots from the prefix cache.
        assert!(
            stats.prefix_cache_hit_tokens >= 512,
            "{mode}: {} cached prompt tokens",
            stats.prefix_cache_hit_tokens
        );
    }
    // Speculative modes have no batched twin.
    assert!(ModeServer::batched(Mode::SelfSpeculative, &assets, budget)?.is_none());
    Ok(())
}
