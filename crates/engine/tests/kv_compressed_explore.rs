//! TEMPORARY exploration: which half and which group size drives the 8-bit KV error.
use candle_core::Tensor;
use std::sync::Arc;
use switchyard_engine::sampler::{argmax, log_softmax_at};
use switchyard_models::{DenseKv, ForwardBatch, KvChunk, LayeredModel, LoadOptions, SeqKv};
use switchyard_tokenizer::Tokenizer;

struct Fake {
    inner: DenseKv,
    k_group: usize,
    v_group: usize,
}
fn fq(x: &[f32], g: usize) -> Vec<f32> {
    if g == 0 {
        return x.to_vec();
    }
    if g == 1 {
        return x
            .iter()
            .map(|v| {
                let b = v.to_bits();
                f32::from_bits((b + 0x0FFF + ((b >> 13) & 1)) & !0x1FFF)
            })
            .collect();
    }
    if g == 2 {
        return x
            .iter()
            .map(|v| v * (1.0 + 1.0 / (1u32 << 20) as f32))
            .collect();
    }
    let mut out = Vec::with_capacity(x.len());
    for c in x.chunks(g) {
        let amax = c.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = amax / 127.0;
        for &v in c {
            out.push(if s == 0.0 {
                0.0
            } else {
                (v / s).round().clamp(-127.0, 127.0) * s
            });
        }
    }
    out
}
impl SeqKv for Fake {
    fn write(
        &mut self,
        layer: usize,
        start: usize,
        k: &[f32],
        v: &[f32],
    ) -> switchyard_models::Result<()> {
        self.inner
            .write(layer, start, &fq(k, self.k_group), &fq(v, self.v_group))
    }
    fn chunks(&self, layer: usize, len: usize) -> switchyard_models::Result<Vec<KvChunk<'_>>> {
        self.inner.chunks(layer, len)
    }
    fn len(&self, layer: usize) -> usize {
        self.inner.len(layer)
    }
}
fn logits(model: &LayeredModel, kv: &mut dyn SeqKv, start: usize, tokens: &[u32]) -> Vec<f32> {
    let x = model.embed(tokens).unwrap();
    let mut batch = ForwardBatch::single(kv, start, tokens.len());
    let h = model
        .forward_layers(x, 0..model.n_layers(), &mut batch)
        .unwrap();
    let last: Tensor = h.narrow(0, tokens.len() - 1, 1).unwrap();
    model
        .logits(&last)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}
#[test]
fn explore() {
    let path = switchyard_zoo::ensure("smollm2-135m-instruct").unwrap();
    let src = switchyard_weights::open(path).unwrap();
    let tok = Tokenizer::from_source(&*src).unwrap();
    let fmt = if std::env::var("SY_F32W").is_ok() {
        switchyard_models::WeightFormat::F32
    } else {
        switchyard_models::WeightFormat::AsStored
    };
    let model = LayeredModel::load(
        Arc::clone(&src),
        &LoadOptions {
            format: fmt,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    let spec = model.spec().clone();
    let texts = [
        "The capital of France is",
        "Write a short poem about the sea.",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "The three primary colors are",
    ];
    // reference greedy tokens with f32 cache
    let mut refs = Vec::new();
    for t in texts {
        let p = tok.encode(t, true, false).unwrap();
        let mut kv = DenseKv::new(spec.n_layers, spec.kv_row_len());
        let mut l = logits(&model, &mut kv, 0, &p);
        let mut gen = Vec::new();
        for i in 0..32 {
            let t = argmax(&l) as u32;
            gen.push(t);
            l = logits(&model, &mut kv, p.len() + i, &[t]);
        }
        refs.push((p, gen));
    }
    let hd = spec.head_dim;
    for (kg, vg) in [(2, 2), (1, 1), (hd, hd), (hd, 0), (0, hd), (32, 32)] {
        let (mut sum, mut max, mut n, mut flips) = (0f64, 0f32, 0, 0);
        for (p, gen) in &refs {
            let mut kv = Fake {
                inner: DenseKv::new(spec.n_layers, spec.kv_row_len()),
                k_group: kg,
                v_group: vg,
            };
            let mut kr = DenseKv::new(spec.n_layers, spec.kv_row_len());
            let mut l = logits(&model, &mut kv, 0, p);
            let mut lr = logits(&model, &mut kr, 0, p);
            for (i, &t) in gen.iter().enumerate() {
                let d = (log_softmax_at(&l, t as usize) - log_softmax_at(&lr, t as usize)).abs();
                sum += d as f64;
                max = max.max(d);
                n += 1;
                if argmax(&l) != t as usize {
                    flips += 1;
                }
                l = logits(&model, &mut kv, p.len() + i, &[t]);
                lr = logits(&model, &mut kr, p.len() + i, &[t]);
            }
        }
        eprintln!("K group {kg:>3} V group {vg:>3}: mean |dlogp| {:.4} max {:.4} argmax flips {flips}/{n}", sum / n as f64, max);
    }
}
