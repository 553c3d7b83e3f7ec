//! Masks computed ahead with `Constraint::prepare` (as the engine does for every constrained
//! row of a step at once, on the compute pool) equal the masks computed when the logits are
//! masked, position by position along a valid output, on SmolLM2's real vocabulary.

use std::sync::Arc;

use serde_json::json;
use switchyard_grammar::GrammarCompiler;
use switchyard_request::Guide;
use switchyard_tokenizer::Tokenizer;
use switchyard_weights::WeightSource;

#[test]
fn prepared_masks_equal_masks_computed_in_place() {
    let path = switchyard_zoo::ensure("smollm2-135m-instruct").expect("model");
    let src: Arc<dyn WeightSource> = switchyard_weights::open(&path).expect("weights");
    let tok = Arc::new(Tokenizer::from_source(&*src).expect("tokenizer"));
    let compiler = GrammarCompiler::new(Arc::clone(&tok));
    let guide = Guide::JsonSchema(json!({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20},
                       "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3}},
        "required": ["name", "tags"], "additionalProperties": false
    }));
    let mut ahead = compiler.compile(&guide).expect("compiles");
    let mut in_place = compiler.compile(&guide).expect("compiles");
    let text = r#"{"name":"Ada Lovelace","tags":["bb","a"]}"#;
    let ids = tok.encode(text, false, false).expect("encode");
    let vocab = 49_152;
    let mut counts = Vec::new();
    for (pos, &id) in ids.iter().enumerate() {
        ahead.prepare();
        let mut a = vec![0.0f32; vocab];
        let mut b = vec![0.0f32; vocab];
        ahead.mask(&mut a).expect("mask");
        in_place.mask(&mut b).expect("mask");
        let allowed: Vec<usize> = (0..vocab).filter(|&i| a[i] == 0.0).collect();
        assert_eq!(
            allowed,
            (0..vocab).filter(|&i| b[i] == 0.0).collect::<Vec<_>>(),
            "position {pos}"
        );
        assert!(
            allowed.contains(&(id as usize)),
            "the text's token {id} is allowed at {pos}"
        );
        counts.push(allowed.len());
        ahead.advance(id).expect("advance");
        in_place.advance(id).expect("advance");
    }
    // The masks do constrain: a handful of tokens where the schema fixes the text (a key, a
    // bracket), most of the vocabulary inside the free string.
    let (least, most) = (counts.iter().min(), counts.iter().max());
    assert!(least.is_some_and(|&n| n < 50), "{counts:?}");
    assert!(most.is_some_and(|&n| n > 10_000), "{counts:?}");
    // A mask prepared before a token is consumed is not reused after it.
    let mut c = compiler.compile(&guide).expect("compiles");
    let mut fresh = compiler.compile(&guide).expect("compiles");
    c.prepare();
    c.advance(ids[0]).expect("advance");
    fresh.advance(ids[0]).expect("advance");
    let (mut after, mut want) = (vec![0.0f32; vocab], vec![0.0f32; vocab]);
    c.mask(&mut after).expect("mask");
    fresh.mask(&mut want).expect("mask");
    assert_eq!(after, want);
    let mut first = vec![0.0f32; vocab];
    compiler
        .compile(&guide)
        .expect("compiles")
        .mask(&mut first)
        .expect("mask");
    assert_ne!(
        after, first,
        "the second position's mask differs from the first's"
    );
}
