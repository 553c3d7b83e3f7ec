//! Quantized kernels end to end against candle's quantized references (see
//! `common/reference.rs`). A separate binary, because candle reads its dequantize switch from
//! the process environment.

use crate::common::reference::check_quantized;

#[test]
fn smollm2_quantized_kernels_match_quantized_llama() {
    check_quantized("smollm2-135m-instruct");
}

#[test]
fn qwen2_quantized_kernels_match_quantized_qwen2() {
    check_quantized("qwen2.5-coder-0.5b-instruct");
}
