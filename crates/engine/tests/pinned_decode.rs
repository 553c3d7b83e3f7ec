//! Greedy decoding of 64 tokens on every zoo model (SmolLM2-135M as its file ships and
//! re-quantized to Q8_0, Qwen2.5-Coder-0.5B and 1.5B, Gemma 3 270M), pinned: the text and the
//! summed log-probability of the tokens, as the kernels gave them when pinned. A kernel change
//! that keeps every result bit for bit passes; one that moves any model's arithmetic shows
//! here as another text or another sum (the sum is held to 1e-3 nats, room for a libm's
//! last bit, not for a changed kernel).
//!
//! Pinned once per instruction set: the AVX-512 kernels (attention's fused multiply-adds among
//! them) round differently from the AVX2 ones, which keep the portable arithmetic, so a model
//! decodes its own text on each. The AVX2 pins were taken on an AMD EPYC (Zen 3).

use std::sync::Arc;

use switchyard_engine::generate::last_logits;
use switchyard_engine::sampler::{argmax, log_softmax_at};
use switchyard_models::{DenseKv, LayeredModel, LoadOptions};
use switchyard_tokenizer::Tokenizer;
use switchyard_weights::GgufFile;

const PROMPT: &str = "The first printing presses in Europe";
const TOKENS: usize = 64;

/// The model at `path`: 64 greedy tokens after [`PROMPT`] (end tokens included, no stop),
/// their text, and the sum of their log-probabilities.
fn decode(path: &std::path::Path) -> (String, f64) {
    let src = switchyard_weights::open(path).expect("open");
    let tok = Tokenizer::from_source(&*src).expect("tokenizer");
    let m = LayeredModel::load(Arc::clone(&src), &LoadOptions::default()).expect("load");
    let prompt = tok.encode(PROMPT, true, false).expect("encode");
    let mut kv = DenseKv::new(m.n_layers(), m.spec().kv_row_len());
    let mut logits = last_logits(&m, &mut kv, 0, &prompt).expect("prompt");
    let (mut ids, mut sum) = (Vec::new(), 0f64);
    for _ in 0..TOKENS {
        let id = argmax(&logits);
        sum += f64::from(log_softmax_at(&logits, id));
        ids.push(id as u32);
        let at = prompt.len() + ids.len() - 1;
        logits = last_logits(&m, &mut kv, at, &[id as u32]).expect("step");
    }
    (tok.decode(&ids, false).expect("decode"), sum)
}

/// A pinned result on the AVX-512 kernels and on the AVX2 ones: (text, log-probability sum).
type Pins<'a> = [(&'a str, f64); 2];

fn check(name: &str, path: &std::path::Path, pins: Pins<'_>) {
    use switchyard_kernels::cpu::{simd_level, SimdLevel};
    let (text, sum) = match simd_level() {
        SimdLevel::Avx512 => pins[0],
        SimdLevel::Avx2 => pins[1],
        SimdLevel::Scalar => panic!("{name}: no output is pinned for the scalar kernels"),
    };
    let (got, got_sum) = decode(path);
    eprintln!("{name}: {got:?} {got_sum:.6}");
    assert_eq!(got, text, "{name}: text");
    assert!(
        (got_sum - sum).abs() < 1e-3,
        "{name}: log-probability sum {got_sum} against {sum}"
    );
}

#[test]
fn smollm2_decodes_its_pinned_64_tokens() {
    let path = switchyard_zoo::ensure("smollm2-135m-instruct").expect("model");
    check(
        "smollm2",
        &path,
        [
            (
                " began in 1450, and the first in the Americas began in 1487.\n\nThe first printing press was invented by Johannes Brahms in 1786, and it was used to print music. It was a revolutionary invention that revolutionized the way people read and write. It",
                -60.505604,
            ),
            (
                " were made in 1880.\n\nThe first printing press was invented by Johannes Brahms in 1780.\n\nThe first printing press was invented by Alessandro Bresci in 1800.\n\nThe first printing press was invented by Alessandro Bres",
                -49.178226,
            ),
        ],
    );
    // The same model re-quantized to Q8_0 (the file the llama.cpp comparison also reads).
    let q8 = switchyard_zoo::home()
        .join("derived")
        .join("smollm2-135m-instruct.q8_0.gguf");
    if !q8.exists() {
        std::fs::create_dir_all(q8.parent().expect("derived folder")).expect("mkdir");
        let src = GgufFile::open(&path).expect("open");
        switchyard_weights::requantize::requantize(
            &src,
            &q8,
            candle_core::quantized::GgmlDType::Q8_0,
            |_, _| {},
        )
        .expect("requantize");
    }
    check(
        "smollm2 q8_0",
        &q8,
        [
            (
                " were made in 1880.\n\nThe first printing press was invented by Johannes Brahms in 1780.\n\nThe first printing press was invented by Alessandro Bianchi in 1782.\n\nThe first printing press was invented by Alessandro Bian",
                -48.952885,
            ),
            (
                " began in 1550. The first printing press was invented by Johannes Brahms in 1780. The first printing press was invented by Alessandro Bresci in 1800. The first printing press was invented by Alessandro Bresci in 1800",
                -46.478286,
            ),
        ],
    );
}

#[test]
fn qwen_coders_decode_their_pinned_64_tokens() {
    for (name, pins) in [
        (
            "qwen2.5-coder-0.5b-instruct",
            [
                (
                    " were in 1840. In 1845, the first printing presses in Europe were in 1846. In 1847, the first printing presses in Europe were in 1848. In 1849, the first printing presses in Europe were",
                    -24.560360,
                ),
                (
                    " were in 1840. In 1845, the first printing presses in Europe were in 1846. In 1847, the first printing presses in Europe were in 1848. In 1849, the first printing presses in Europe were",
                    -24.461861,
                ),
            ],
        ),
        (
            "qwen2.5-coder-1.5b-instruct",
            [
                (
                    " were invented in the 15th century. The first printing press in England was invented by William Caxton in 1476. The first printing press in France was invented by Jean-François Millet in 1534. The first printing press in Germany was invented by Johannes Gutenberg in",
                    -30.128773,
                ),
                (
                    " were invented in the 15th century. The first printing press in England was invented by William Caxton in 1476. The first printing press in France was invented by Jean Cézanne in 1837. The first printing press in Germany was invented by Johann Gutenberg in ",
                    -30.886361,
                ),
            ],
        ),
    ] {
        let path = switchyard_zoo::ensure(name).expect("model");
        check(name, &path, pins);
    }
}

#[test]
fn gemma3_decodes_its_pinned_64_tokens() {
    let path = switchyard_zoo::ensure("gemma3-270m").expect("model");
    check(
        "gemma3-270m",
        &path,
        [
            (
                " were built in the 15th century. The first printing press was a movable type machine that was used to print books and documents. The first printing press was used to print books and documents. The first printing press was a movable type machine that was used to print books and documents. The first printing press was a",
                -47.256402,
            ),
            (
                " were built in the 14th century. The first printing press was built in the 14th century in the city of Mainz, Germany. The first printing press was built in 1400. The first printing press was built in 1400. The first printing press was built in",
                -50.761195,
            ),
        ],
    );
}
