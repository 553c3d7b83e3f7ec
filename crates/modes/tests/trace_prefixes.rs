//! The router trace's shared-prefix feature on SmolLM2's tokenizer: every request's shared
//! prefix equals the longest prefix it has in common with an earlier request's prompt, in whole
//! 16-token blocks (a brute-force reference, no hashing), so GSM8K questions after the first,
//! whose 8 shots repeat, are shared-prefix requests as the server would see them.

use switchyard_modes::router_trace::{self, TraceClass, TraceOptions};
use switchyard_router::{Class, RuleConfig};

#[test]
fn trace_requests_see_the_prefixes_earlier_ones_left() -> anyhow::Result<()> {
    let assets = crate::common::smollm2(None)?;
    let opts = TraceOptions {
        requests: 12,
        rate: 1.0,
        mix: TraceClass::parse_mix("math=0.4,shared-prefix=0.3,chat=0.3")?,
        seed: 3,
        fixed: Vec::new(),
        routers: Vec::new(),
        repeats: 1,
    };
    let trace = router_trace::build(&assets, &opts)?;
    let classifier = RuleConfig::default();
    let mut math_seen = 0;
    for (i, r) in trace.iter().enumerate() {
        let want = trace[..i]
            .iter()
            .map(|e| {
                e.prompt
                    .iter()
                    .zip(&r.prompt)
                    .take_while(|(a, b)| a == b)
                    .count()
            })
            .max()
            .unwrap_or(0)
            / 16
            * 16;
        let f = r.features(0);
        assert_eq!(f.shared_prefix_tokens, want, "request {i} ({:?})", r.class);
        match r.class {
            TraceClass::Math => {
                // The 8 shots are several hundred tokens, most of the prompt.
                if math_seen > 0 {
                    assert!(want >= 512, "request {i}: {want} of {}", r.prompt.len());
                    assert_eq!(classifier.classify(&f), Class::SharedPrefix);
                } else {
                    assert_eq!(want, 0);
                }
                math_seen += 1;
            }
            TraceClass::Chat => assert_eq!(want, 0, "request {i}"),
            _ => {}
        }
    }
    assert!(math_seen >= 2, "the trace drew {math_seen} math requests");
    Ok(())
}
