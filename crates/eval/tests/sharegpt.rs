//! The zoo's ShareGPT file, read record by record up to its cut-off tail, and vLLM's sampling
//! filters applied with smollm2's tokenizer.

use switchyard_eval::sharegpt::{
    records, sample_requests, SampleOptions, MAX_PROMPT_TOKENS, MAX_TOTAL_TOKENS,
    MIN_OUTPUT_TOKENS, MIN_PROMPT_TOKENS,
};
use switchyard_tokenizer::Tokenizer;

#[test]
fn the_cut_off_file_reads_to_its_last_whole_record_and_samples_by_vllms_rules() {
    let data = switchyard_zoo::ensure("sharegpt").expect("dataset");
    let model = switchyard_zoo::ensure("smollm2-135m-instruct").expect("model");
    let src = switchyard_weights::open(model).expect("open");
    let tok = Tokenizer::from_source(&*src).expect("tokenizer");

    let mut recs = records(&data).expect("open");
    let first = recs.next().expect("a record").expect("valid");
    assert_eq!(first.id, "QWJhYvA_0");
    assert_eq!(first.conversations[0].from, "human");
    let rest = recs.by_ref().filter(|r| r.is_ok()).count();
    // The catalog says about 17,670 complete conversations.
    assert_eq!(1 + rest, 17_671);
    assert_eq!(recs.records_read(), 17_671);
    assert!(recs.truncated());

    let opts = |n| SampleOptions {
        num_prompts: n,
        seed: 0,
    };
    let s = sample_requests(&data, &tok, &opts(40)).expect("sample");
    assert_eq!(
        (s.records, s.truncated, s.requests.len()),
        (17_671, true, 40)
    );
    assert!(s.examined >= 40);
    for r in &s.requests {
        let p = r.prompt_tokens.len();
        assert!((MIN_PROMPT_TOKENS..=MAX_PROMPT_TOKENS).contains(&p), "{p}");
        assert!(r.output_len >= MIN_OUTPUT_TOKENS);
        assert!(p + r.output_len <= MAX_TOTAL_TOKENS);
        assert_eq!(
            r.prompt_tokens,
            tok.encode(&r.prompt, true, false).expect("encode")
        );
    }
    // The same seed gives the same order: a smaller sample is a prefix of a larger one.
    let small = sample_requests(&data, &tok, &opts(10)).expect("sample");
    assert_eq!(small.requests[..], s.requests[..10]);
}
