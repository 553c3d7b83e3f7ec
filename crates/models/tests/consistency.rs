//! Self-consistency of the layered model on synthetic weights: cached step-by-step decoding,
//! one-shot prefill and chunked prefill give the same logits.

use crate::common;

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use switchyard_models::{DenseKv, ForwardBatch, LayeredModel, LoadOptions, SeqKv};
use switchyard_weights::{Architecture, SyntheticSource, WeightSource};

fn synthetic(arch: Architecture) -> LayeredModel {
    let spec = SyntheticSource::tiny_spec(arch);
    let src: Arc<dyn WeightSource> =
        Arc::new(SyntheticSource::new(spec, 3, GgmlDType::F32).unwrap());
    LayeredModel::load(src, &LoadOptions::default()).unwrap()
}

fn logits_one_shot(m: &LayeredModel, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut kv = DenseKv::new(m.n_layers(), m.spec().kv_row_len());
    let mut b = ForwardBatch::single(&mut kv, 0, tokens.len());
    m.forward(tokens, &mut b).unwrap().to_vec2().unwrap()
}

fn logits_chunked(m: &LayeredModel, tokens: &[u32], chunk: usize) -> Vec<Vec<f32>> {
    let mut kv = DenseKv::new(m.n_layers(), m.spec().kv_row_len());
    let mut out = Vec::new();
    for (i, c) in tokens.chunks(chunk).enumerate() {
        let mut b = ForwardBatch::single(&mut kv, i * chunk, c.len());
        out.extend(m.forward(c, &mut b).unwrap().to_vec2::<f32>().unwrap());
    }
    out
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn cached_decoding_equals_recomputation() {
    for arch in [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Gemma3,
    ] {
        let m = synthetic(arch);
        let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 256).collect();
        let full = logits_one_shot(&m, &tokens);
        for chunk in [1, 3, 16] {
            let c = logits_chunked(&m, &tokens, chunk);
            let d = max_diff(&full, &c);
            assert!(d < 1e-4, "{arch:?} chunk {chunk}: max diff {d}");
        }
    }
}

/// On a real quantized model: KV-cached decoding and chunked prefill give the same logits as
/// recomputing the whole sequence in one pass.
#[test]
fn smollm2_cached_decoding_equals_recomputation() {
    let src = switchyard_weights::open(common::model_path("smollm2-135m-instruct")).unwrap();
    let m = LayeredModel::load(src, &LoadOptions::default()).unwrap();
    let tokens = common::fixed_tokens(48);
    let full = logits_one_shot(&m, &tokens);
    for chunk in [1, 5, 17] {
        let c = logits_chunked(&m, &tokens, chunk);
        let d = max_diff(&full, &c);
        eprintln!("chunk {chunk}: max diff {d:e}");
        assert!(d < 1e-4, "chunk {chunk}: max diff {d}");
    }
}

/// Loading only the first N layers gives the full model's hidden state at layer N, and the
/// resident layer bytes are exactly N/L of all layers' (every smollm2 layer has the same
/// tensor types).
#[test]
fn smollm2_partial_load_matches_full_model() {
    let src = switchyard_weights::open(common::model_path("smollm2-135m-instruct")).unwrap();
    let full = LayeredModel::load(Arc::clone(&src), &LoadOptions::default()).unwrap();
    let n = 10;
    let partial = LayeredModel::load(
        Arc::clone(&src),
        &LoadOptions {
            layers: Some(n),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(partial.resident_layers(), (0..n).collect::<Vec<_>>());
    let l = full.n_layers();
    let all = full.resident_bytes().layers;
    let part = partial.resident_bytes().layers;
    assert_eq!(part * l, all * n, "resident {part} of {all} bytes");
    let from_file: usize = (0..n).map(|i| full.layer_bytes(i)).sum();
    assert_eq!(part, from_file);
    assert_eq!(
        full.resident_bytes().embedding,
        partial.resident_bytes().embedding
    );

    let tokens = common::fixed_tokens(20);
    let hidden = |m: &LayeredModel| {
        let mut kv = DenseKv::new(m.n_layers(), m.spec().kv_row_len());
        let mut b = ForwardBatch::single(&mut kv, 0, tokens.len());
        let x = m.embed(&tokens).unwrap();
        m.forward_layers(x, 0..n, &mut b)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap()
    };
    assert_eq!(hidden(&full), hidden(&partial));

    // Layer n is not resident in the partial model: a clear error naming it.
    let mut kv = DenseKv::new(l, partial.spec().kv_row_len());
    let mut b = ForwardBatch::single(&mut kv, 0, 2);
    let x = partial.embed(&tokens[..2]).unwrap();
    let err = partial
        .forward_layers(x, 0..n + 1, &mut b)
        .unwrap_err()
        .to_string();
    assert!(err.contains(&format!("layer {n} is not resident")), "{err}");
}

/// Running layers 0..k now and k..L later for the same positions equals running 0..L at once.
#[test]
fn split_layer_ranges_compose() {
    let m = synthetic(Architecture::Qwen2);
    let tokens: Vec<u32> = (0..12).map(|i| (i * 11 + 3) % 256).collect();
    let full = logits_one_shot(&m, &tokens);
    let mut kv = DenseKv::new(m.n_layers(), m.spec().kv_row_len());
    let x = m.embed(&tokens).unwrap();
    let h = {
        let mut b = ForwardBatch::single(&mut kv, 0, tokens.len());
        m.forward_layers(x, 0..2, &mut b).unwrap()
    };
    let h = {
        let mut b = ForwardBatch::single(&mut kv, 0, tokens.len());
        m.forward_layers(h, 2..m.n_layers(), &mut b).unwrap()
    };
    let split: Vec<Vec<f32>> = m.logits(&h).unwrap().to_vec2().unwrap();
    assert_eq!(full, split);
}

/// Two sequences in one batch give each the logits it gets alone.
#[test]
fn batched_sequences_equal_solo_runs() {
    let m = synthetic(Architecture::Gemma3);
    let a: Vec<u32> = (0..13).map(|i| (i * 7 + 1) % 256).collect();
    let b: Vec<u32> = (0..5).map(|i| (i * 29 + 2) % 256).collect();
    let solo_a = logits_one_shot(&m, &a);
    let solo_b = logits_one_shot(&m, &b);
    let mut kva = DenseKv::new(m.n_layers(), m.spec().kv_row_len());
    let mut kvb = DenseKv::new(m.n_layers(), m.spec().kv_row_len());
    let mut batch = ForwardBatch::new(vec![
        switchyard_models::SeqChunk {
            start: 0,
            n: a.len(),
            kv: &mut kva,
        },
        switchyard_models::SeqChunk {
            start: 0,
            n: b.len(),
            kv: &mut kvb,
        },
    ]);
    let tokens: Vec<u32> = a.iter().chain(&b).copied().collect();
    let both: Vec<Vec<f32>> = m.forward(&tokens, &mut batch).unwrap().to_vec2().unwrap();
    assert!(max_diff(&both[..a.len()], &solo_a) < 1e-5);
    assert!(max_diff(&both[a.len()..], &solo_b) < 1e-5);
}

/// `write_kv_layers` writes, at every layer, exactly the K/V the full block would write for the
/// same input (checked per layer, so every layer sees the same `x`), and nothing else.
#[test]
fn kv_only_write_equals_the_full_blocks_kv() {
    for arch in [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Gemma3,
    ] {
        let m = synthetic(arch);
        let row = m.spec().kv_row_len();
        let tokens: Vec<u32> = (0..9).map(|i| (i * 53 + 11) % 256).collect();
        let (prefix, tail) = tokens.split_at(6);
        let mut base = DenseKv::new(m.n_layers(), row);
        let mut b = ForwardBatch::single(&mut base, 0, prefix.len());
        m.forward(prefix, &mut b).unwrap();
        // Some hidden state for the tail positions: their embeddings after one layer.
        let x = m.embed(tail).unwrap();
        let mut scratch = base.clone();
        let mut b = ForwardBatch::single(&mut scratch, prefix.len(), tail.len());
        let x = m.forward_layers(x, 0..1, &mut b).unwrap();

        let mut kv_only = base.clone();
        let mut b = ForwardBatch::single(&mut kv_only, prefix.len(), tail.len());
        m.write_kv_layers(&x, 1..m.n_layers(), &mut b).unwrap();
        assert_eq!(kv_only.len(0), prefix.len(), "{arch:?}: layer 0 untouched");
        for l in 1..m.n_layers() {
            let mut full = base.clone();
            let mut b = ForwardBatch::single(&mut full, prefix.len(), tail.len());
            m.forward_layers(x.clone(), l..l + 1, &mut b).unwrap();
            let n = tokens.len();
            let (want, got) = (
                &full.chunks(l, n).unwrap()[0],
                &kv_only.chunks(l, n).unwrap()[0],
            );
            assert_eq!(want.k, got.k, "{arch:?} layer {l}: K");
            assert_eq!(want.v, got.v, "{arch:?} layer {l}: V");
        }
    }
}

/// With the embedding and the LM head dropped, lookups and the head are read from the
/// source (the head in vocabulary slices): the same logits, and only the final norm held.
#[test]
fn streamed_embedding_and_head_give_the_held_logits() {
    for arch in [Architecture::Llama, Architecture::Qwen2] {
        let mut spec = SyntheticSource::tiny_spec(arch);
        // Three slices of the head, the last one short.
        spec.vocab_size = 2 * switchyard_models::HEAD_SLICE_ROWS + 100;
        let src: Arc<dyn WeightSource> =
            Arc::new(SyntheticSource::new(spec, 5, GgmlDType::Q8_0).unwrap());
        let mut m = LayeredModel::load(src, &LoadOptions::default()).unwrap();
        let tokens: Vec<u32> = (0..24).map(|i| (i * 1009 + 3) % 16_484).collect();
        let held = logits_one_shot(&m, &tokens);
        let held_bytes = m.resident_bytes();
        m.drop_io();
        assert!(!m.io_resident());
        let dropped = m.resident_bytes();
        assert_eq!(dropped.embedding, 0, "{arch:?}");
        assert_eq!(
            dropped.head,
            m.spec().d_model * 4,
            "{arch:?}: the final norm only"
        );
        assert_eq!(dropped.layers, held_bytes.layers);
        let streamed = logits_one_shot(&m, &tokens);
        assert_eq!(streamed[0].len(), m.spec().vocab_size);
        let d = max_diff(&held, &streamed);
        assert_eq!(d, 0.0, "{arch:?}: max diff {d}");
        let mut starts = Vec::new();
        let h = m.embed(&tokens[..3]).unwrap();
        let parts = [h.narrow(0, 0, 2).unwrap(), h.narrow(0, 2, 1).unwrap()];
        let peak = m
            .lm_head_slices(&parts, |part, start, logits| {
                starts.push((part, start, logits.dims().to_vec()));
                Ok(())
            })
            .unwrap();
        let slice = switchyard_models::HEAD_SLICE_ROWS;
        let want: Vec<(usize, usize, Vec<usize>)> = [(0, slice), (slice, slice), (2 * slice, 100)]
            .into_iter()
            .flat_map(|(start, n)| [(0, start, vec![2, n]), (1, start, vec![1, n])])
            .collect();
        assert_eq!(starts, want);
        // One slice of 8,192 rows of 64 Q8_0 values (two 34-byte blocks each) at most.
        assert!(peak > 0 && peak <= slice * 2 * 34 * 2, "{peak}");
        m.load_io().unwrap();
        assert_eq!(m.resident_bytes(), held_bytes);
        assert_eq!(max_diff(&held, &logits_one_shot(&m, &tokens)), 0.0);
    }
}
