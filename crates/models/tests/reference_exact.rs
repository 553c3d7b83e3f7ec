//! Architecture math against independent implementations, on the files' exact weight values
//! (see `common/reference.rs`). This binary runs candle's references with dequantized weights.

use crate::common::reference::check_exact_weights;

#[test]
fn smollm2_exact_weights_match_quantized_llama() {
    check_exact_weights("smollm2-135m-instruct");
}

#[test]
fn qwen2_exact_weights_match_quantized_qwen2() {
    check_exact_weights("qwen2.5-coder-0.5b-instruct");
}

#[test]
fn gemma3_exact_weights_match_candle_gemma3() {
    check_exact_weights("gemma3-270m");
}
