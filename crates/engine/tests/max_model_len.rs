//! `max_model_len` caps the sequences an engine serves below the model's context: the
//! activation workspace of an engine without chunked prefill is sized for the cap, prompts at
//! the cap are refused with the cap in the message, and a cap above the context is the context.

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use switchyard_engine::kv::activation_bytes;
use switchyard_engine::{
    EngineConfig, EngineCore, EngineError, EngineRequest, RequestId, SchedulerConfig,
};
use switchyard_models::{LayeredModel, LoadOptions};
use switchyard_request::SamplingParams;
use switchyard_weights::{Architecture, SyntheticSource};

const SEQS: usize = 2;

fn core(max_model_len: Option<usize>) -> Result<EngineCore, EngineError> {
    let spec = SyntheticSource::tiny_spec(Architecture::Llama);
    let src = Arc::new(SyntheticSource::new(spec, 5, GgmlDType::F32).expect("synthetic model"));
    let model = LayeredModel::load(src, &LoadOptions::default()).expect("load");
    let cfg = EngineConfig {
        memory_budget: 64 << 20,
        scheduler: SchedulerConfig {
            max_batched_tokens: 4,
            max_num_seqs: SEQS,
            chunked_prefill: false,
            ..SchedulerConfig::default()
        },
        max_model_len,
        ..EngineConfig::default()
    };
    EngineCore::new(model, vec![0], cfg)
}

#[test]
fn the_cap_sizes_the_workspace_and_refuses_longer_prompts() {
    let full = core(None).expect("engine");
    let spec = full.model().spec().clone();
    let context = spec.context_length;
    assert!(
        context > 16,
        "the synthetic context ({context}) is too short for this test"
    );
    let cap = context / 4;
    let capped = core(Some(cap)).expect("engine");

    assert_eq!(full.scheduler().context(), context);
    assert_eq!(capped.scheduler().context(), cap);
    assert_eq!(
        full.stats().memory.workspace_bytes,
        activation_bytes(&spec, context, SEQS) as u64
    );
    assert_eq!(
        capped.stats().memory.workspace_bytes,
        activation_bytes(&spec, cap, SEQS) as u64
    );
    assert!(capped.stats().kv_blocks_total > full.stats().kv_blocks_total);

    let mut capped = capped;
    let req = |n: usize| EngineRequest {
        prompt: vec![1; n],
        params: SamplingParams::greedy(4),
    };
    match capped.add_request(RequestId(0), req(cap)) {
        Err(EngineError::PromptTooLong { prompt, context }) => {
            assert_eq!((prompt, context), (cap, cap))
        }
        other => panic!("expected PromptTooLong, got {other:?}"),
    }
    capped
        .add_request(RequestId(1), req(cap - 1))
        .expect("a prompt under the cap");

    // A cap over the context changes nothing; a cap under 2 is refused.
    let over = core(Some(context * 2)).expect("engine");
    assert_eq!(over.scheduler().context(), context);
    let Err(err) = core(Some(1)) else {
        panic!("a cap of 1 was accepted")
    };
    assert_eq!(
        err.to_string(),
        "invalid engine configuration: max_model_len must be at least 2 (one prompt token and one output), got 1"
    );
}
