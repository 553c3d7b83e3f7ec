//! EE-Tuning: exit heads trained on a frozen model (Pan et al., the EE-LLM authors' recipe).
//!
//! The backbone never changes, so its hidden states at the exit depths and at the last layer
//! are computed once and cached ([`cache`]). A head at depth `d` is then trained to make the
//! exit's distribution match the final layer's: the loss is KL(final ‖ exit), optionally plus
//! the next token's cross-entropy, through the model's own final norm and LM head, both
//! frozen. Head kinds: `affine` (initialised from the ridge solution, the tuned lens), `mlp`
//! (the same affine map plus a residual MLP whose output starts at zero), so training starts
//! from the closed-form fit and can only move away from it by lowering the loss; and `block`
//! (a transformer layer copied from the model's last, [`switchyard_exits::block`]), trained on whole
//! cached documents, one document per step, since it attends over its sequence.
//!
//! The vocabulary projection dominates the cost (`d_model × vocab` per row, forward and
//! backward), and candle's autograd would also form the gradient of the frozen `[vocab,
//! d_model]` matrix at every step. The step therefore differentiates the loss by hand as far
//! as the final norm's output `z` — `∂L/∂logits = p_exit − p_final + w_ce (p_exit − onehot)`,
//! then `∂L/∂z = ∂L/∂logits · W_head` — and lets autograd carry `Σ z ⊙ stop(∂L/∂z)` back
//! through the norm and the head's parameters: the same gradient at two vocabulary-sized
//! products per step instead of four. A finite-difference test checks it.
//!
//! After a head, a CALM-style exit probe ([`switchyard_exits::heads::ExitProbe`]) is fitted by logistic
//! regression on the exit's normed state, to predict whether the exit's top-1 equals the
//! final layer's without paying for the vocabulary head. [`eval`] scores every head on
//! held-out rows; [`run`] ties it together for `switchyard ee-tune`.

pub mod cache;
pub mod cost;
pub mod eval;
pub mod run;

use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use switchyard_models::LayeredModel;

use switchyard_exits::block::{BlockConfig, BlockHead, PARTS};
use switchyard_exits::heads::{rms, sigmoid, ExitHead, ExitProbe, HeadKind};
use switchyard_exits::Result;

/// The model's final norm and LM head in f32, frozen: what every exit shares.
pub struct Frozen {
    /// `[d_model]`.
    pub norm_weight: Tensor,
    pub eps: f64,
    /// `[vocab, d_model]`.
    pub head: Tensor,
}

impl Frozen {
    pub fn from_model(model: &LayeredModel) -> Result<Self> {
        let (w, eps) = model.final_norm_parts();
        Ok(Self {
            norm_weight: w.to_dtype(DType::F32)?,
            eps: f64::from(eps),
            head: model.lm_head_f32()?,
        })
    }

    /// The final RMS norm in differentiable operations.
    pub fn norm(&self, h: &Tensor) -> Result<Tensor> {
        switchyard_exits::block::rms_norm(h, &self.norm_weight, self.eps)
    }

    /// Logits `[rows, vocab]` of normed rows.
    pub fn logits(&self, normed: &Tensor) -> Result<Tensor> {
        Ok(normed.matmul(&self.head.t()?)?)
    }

    /// Log-probabilities of hidden rows taken at the last layer (before the final norm).
    pub fn log_probs(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::log_softmax(
            &self.logits(&self.norm(hidden)?)?,
            D::Minus1,
        )?)
    }
}

/// A head's parameters as trainable variables.
pub struct Trainable {
    kind: HeadKind,
    params: Params,
}

enum Params {
    /// An affine map, plus a residual MLP for the `mlp` kind.
    Rows {
        a_t: Var,
        b: Var,
        mlp: Option<(Var, Var, Var)>,
    },
    /// A transformer layer, in [`PARTS`] order.
    Block { cfg: BlockConfig, vars: Vec<Var> },
}

/// Checkpoint names of a row-wise head's parameters, in [`Trainable::vars`] order.
const PARAM_NAMES: [&str; 5] = ["a_t", "b", "w1_t", "b1", "w2_t"];

/// Learning rate of AdamW for the heads.
pub const DEFAULT_LR: f64 = 1e-4;
/// Hidden width of an MLP head, as a multiple of `d_model`.
pub const MLP_WIDTH_FACTOR: usize = 1;

impl Trainable {
    /// A head of `kind` starting from `init`. Row-wise kinds start from an affine head (or
    /// identity), the MLP part's first layer drawn from `seed` and its output layer zero, so
    /// the head starts as `init`; a block starts from `init`'s block (a copy of a layer).
    pub fn new(kind: HeadKind, init: &ExitHead, d: usize, seed: u64, dev: &Device) -> Result<Self> {
        if kind == HeadKind::Block {
            let ExitHead::Block(b) = init else {
                return Err(switchyard_exits::ExitsError::Invalid(
                    "a block head starts from a block (a copy of a model layer)".into(),
                ));
            };
            let vars = b
                .params
                .iter()
                .map(Var::from_tensor)
                .collect::<candle_core::Result<Vec<_>>>()?;
            return Ok(Self {
                kind,
                params: Params::Block {
                    cfg: b.cfg.clone(),
                    vars,
                },
            });
        }
        let (a_t, b) = match init {
            ExitHead::Affine { weight_t, bias } | ExitHead::Mlp { weight_t, bias, .. } => {
                (weight_t.clone(), bias.clone())
            }
            ExitHead::Identity | ExitHead::Block(_) => (
                Tensor::eye(d, DType::F32, dev)?,
                Tensor::zeros(d, DType::F32, dev)?,
            ),
        };
        let mlp = match kind {
            HeadKind::Mlp => {
                let h = d * MLP_WIDTH_FACTOR;
                let mut rng = StdRng::seed_from_u64(seed);
                let bound = 1.0 / (d as f32).sqrt();
                let w1: Vec<f32> = (0..d * h)
                    .map(|_| rng.random_range(-bound..bound))
                    .collect();
                Some((
                    Var::from_tensor(&Tensor::from_vec(w1, (d, h), dev)?)?,
                    Var::zeros(h, DType::F32, dev)?,
                    Var::zeros((h, d), DType::F32, dev)?,
                ))
            }
            _ => None,
        };
        Ok(Self {
            kind,
            params: Params::Rows {
                a_t: Var::from_tensor(&a_t.to_dtype(DType::F32)?)?,
                b: Var::from_tensor(&b.to_dtype(DType::F32)?)?,
                mlp,
            },
        })
    }

    pub fn kind(&self) -> HeadKind {
        self.kind
    }

    pub fn vars(&self) -> Vec<Var> {
        match &self.params {
            Params::Rows { a_t, b, mlp } => {
                let mut v = vec![a_t.clone(), b.clone()];
                if let Some((w1, b1, w2)) = mlp {
                    v.extend([w1.clone(), b1.clone(), w2.clone()]);
                }
                v
            }
            Params::Block { vars, .. } => vars.clone(),
        }
    }

    /// The head on hidden rows `[rows, d_model]`, tracked for autograd. A block head takes
    /// the rows as one sequence from position 0.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match &self.params {
            Params::Rows { a_t, b, mlp } => {
                let lin = x.matmul(a_t.as_tensor())?.broadcast_add(b.as_tensor())?;
                Ok(match mlp {
                    None => lin,
                    Some((w1, b1, w2)) => {
                        let mid = rms(x)?
                            .matmul(w1.as_tensor())?
                            .broadcast_add(b1.as_tensor())?
                            .silu()?;
                        (lin + mid.matmul(w2.as_tensor())?)?
                    }
                })
            }
            Params::Block { cfg, vars } => {
                let block = BlockHead {
                    cfg: cfg.clone(),
                    params: vars.iter().map(|v| v.as_tensor().clone()).collect(),
                };
                block.forward(x, 0, None)
            }
        }
    }

    /// A copy of the trained head, outside the graph (`copy` alone would record the copy,
    /// and everything computed from the head would then carry a graph back to the variables).
    pub fn to_head(&self) -> Result<ExitHead> {
        let t = |v: &Var| v.as_tensor().copy().map(|c| c.detach());
        Ok(match &self.params {
            Params::Rows {
                a_t,
                b,
                mlp: Some((w1, b1, w2)),
            } if self.kind == HeadKind::Mlp => ExitHead::Mlp {
                weight_t: t(a_t)?,
                bias: t(b)?,
                w1_t: t(w1)?,
                b1: t(b1)?,
                w2_t: t(w2)?,
            },
            Params::Rows { a_t, b, .. } => ExitHead::Affine {
                weight_t: t(a_t)?,
                bias: t(b)?,
            },
            Params::Block { cfg, vars } => ExitHead::Block(Box::new(BlockHead {
                cfg: cfg.clone(),
                params: vars.iter().map(t).collect::<candle_core::Result<_>>()?,
            })),
        })
    }

    fn names(&self) -> Vec<String> {
        match &self.params {
            Params::Rows { .. } => PARAM_NAMES.iter().map(|n| n.to_string()).collect(),
            Params::Block { .. } => PARTS.iter().map(|n| format!("block.{n}")).collect(),
        }
    }

    /// Named copies of the parameters, for a checkpoint.
    pub fn tensors(&self) -> Result<Vec<(String, Tensor)>> {
        self.names()
            .into_iter()
            .zip(self.vars())
            .map(|(n, v)| Ok((n, v.as_tensor().copy()?.detach())))
            .collect()
    }

    /// Restores tensors written by [`Trainable::tensors`].
    pub fn restore(&self, tensors: &std::collections::HashMap<String, Tensor>) -> Result<()> {
        for (n, v) in self.names().iter().zip(self.vars()) {
            let t = tensors.get(n).ok_or_else(|| {
                switchyard_exits::ExitsError::Invalid(format!("checkpoint has no tensor {n}"))
            })?;
            v.set(t)?;
        }
        Ok(())
    }
}

/// Loss of one batch, mean per row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchLoss {
    /// KL(final ‖ exit), nats.
    pub kl: f64,
    /// Cross-entropy of the next token under the exit, nats.
    pub ce: f64,
    /// `kl + ce_weight · ce`, what is minimised.
    pub total: f64,
}

/// One batch: exit-depth rows, the final layer's log-probabilities for the scored ones, and
/// their next tokens (`[rows]` u32).
pub struct Batch<'a> {
    pub x: &'a Tensor,
    pub target_log_probs: &'a Tensor,
    pub next: &'a Tensor,
    /// Rows of the head's output before the scored ones: 0 for row-wise heads; 1 for a block
    /// head fed a whole document, whose position-0 row is attended to but not scored.
    pub offset: usize,
}

/// The loss of `head` on `batch`, and the normed exit state with the loss's gradient with
/// respect to it (see the module notes).
fn loss_and_grad(
    head: &Trainable,
    frozen: &Frozen,
    batch: &Batch<'_>,
    ce_weight: f64,
) -> Result<(BatchLoss, Tensor, Tensor)> {
    let scored = batch.next.dim(0)?;
    let rows = scored as f64;
    let y = head.forward(batch.x)?;
    let y = if y.dim(0)? == scored {
        y
    } else {
        y.narrow(0, batch.offset, scored)?
    };
    let z = frozen.norm(&y)?;
    let logp = candle_nn::ops::log_softmax(&frozen.logits(&z.detach())?, D::Minus1)?;
    let p = logp.exp()?;
    let pt = batch.target_log_probs.exp()?;
    let kl = (&pt * (batch.target_log_probs - &logp)?)?
        .sum_all()?
        .to_scalar::<f32>()? as f64
        / rows;
    let idx = batch.next.to_dtype(DType::U32)?.unsqueeze(1)?;
    let ce = -(logp.gather(&idx, 1)?.sum_all()?.to_scalar::<f32>()? as f64) / rows;
    // ∂L/∂logits, summed over rows and divided by their number.
    let g = ((&p * (1.0 + ce_weight))? - &pt)?;
    let g = if ce_weight != 0.0 {
        let minus = Tensor::full(-(ce_weight as f32), (idx.dim(0)?, 1), idx.device())?;
        g.scatter_add(&idx, &minus, 1)?
    } else {
        g
    };
    let gz = (g.matmul(&frozen.head)? / rows)?;
    Ok((
        BatchLoss {
            kl,
            ce,
            total: kl + ce_weight * ce,
        },
        z,
        gz,
    ))
}

/// The loss of `head` on `batch` without a step.
pub fn batch_loss(
    head: &Trainable,
    frozen: &Frozen,
    batch: &Batch<'_>,
    ce_weight: f64,
) -> Result<BatchLoss> {
    Ok(loss_and_grad(head, frozen, batch, ce_weight)?.0)
}

/// Gradients of the batch loss with respect to the head's parameters, in [`Trainable::vars`]
/// order.
pub fn gradients(
    head: &Trainable,
    frozen: &Frozen,
    batch: &Batch<'_>,
    ce_weight: f64,
) -> Result<Vec<Tensor>> {
    let (_, z, gz) = loss_and_grad(head, frozen, batch, ce_weight)?;
    let grads = (z * gz.detach())?.sum_all()?.backward()?;
    head.vars()
        .iter()
        .map(|v| {
            grads.get(v.as_tensor()).cloned().ok_or_else(|| {
                switchyard_exits::ExitsError::Internal("a head parameter has no gradient".into())
            })
        })
        .collect()
}

/// One AdamW step on `batch`; returns the loss before the step.
pub fn train_step(
    head: &Trainable,
    opt: &mut AdamW,
    frozen: &Frozen,
    batch: &Batch<'_>,
    ce_weight: f64,
) -> Result<BatchLoss> {
    let (loss, z, gz) = loss_and_grad(head, frozen, batch, ce_weight)?;
    opt.backward_step(&(z * gz.detach())?.sum_all()?)?;
    Ok(loss)
}

/// AdamW over the head's parameters.
pub fn optimizer(head: &Trainable, lr: f64) -> Result<AdamW> {
    Ok(AdamW::new(
        head.vars(),
        ParamsAdamW {
            lr,
            weight_decay: 0.0,
            ..ParamsAdamW::default()
        },
    )?)
}

/// A shuffled order of `rows` for one epoch, the same for the same seed.
pub fn epoch_order(rows: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..rows).collect();
    let mut rng = StdRng::seed_from_u64(seed);
    for i in (1..rows).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    order
}

/// Fits an exit probe by logistic regression: `features` `[rows, d_model]` (the exit's normed
/// states), `labels` 1 where the exit's top-1 equals the final one's. Features are standardised
/// while training and the scaling folded back into the weights.
pub fn fit_probe(
    features: &Tensor,
    labels: &[f32],
    epochs: usize,
    batch: usize,
    seed: u64,
) -> Result<ExitProbe> {
    let features = &features.detach();
    let dev = features.device();
    let (rows, d) = features.dims2()?;
    let mean = features.mean_keepdim(0)?;
    let centred = features.broadcast_sub(&mean)?;
    let std = (centred.sqr()?.mean_keepdim(0)? + 1e-6)?.sqrt()?;
    let xs = centred.broadcast_div(&std)?;
    let y = Tensor::from_slice(labels, rows, dev)?;
    let w = Var::zeros((d, 1), DType::F32, dev)?;
    let b = Var::zeros(1, DType::F32, dev)?;
    let mut opt = AdamW::new(
        vec![w.clone(), b.clone()],
        ParamsAdamW {
            lr: 1e-2,
            weight_decay: 1e-4,
            ..ParamsAdamW::default()
        },
    )?;
    for epoch in 0..epochs {
        let order = epoch_order(rows, seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9));
        for chunk in order.chunks(batch.max(1)) {
            let idx = Tensor::from_vec(
                chunk.iter().map(|&i| i as u32).collect::<Vec<_>>(),
                chunk.len(),
                dev,
            )?;
            let xb = xs.index_select(&idx, 0)?;
            let yb = y.index_select(&idx, 0)?;
            let s = xb
                .matmul(w.as_tensor())?
                .broadcast_add(b.as_tensor())?
                .flatten_all()?;
            // Mean of softplus(s) − y·s, the logistic loss, written stably.
            let softplus = (s.relu()? + ((s.abs()?.neg()?.exp()? + 1.0)?.log()?))?;
            let loss = (softplus - (s * yb)?)?.mean_all()?;
            opt.backward_step(&loss)?;
        }
    }
    // σ(w·(x−μ)/σ + b) = σ((w/σ)·x + b − Σ w μ/σ).
    let w_folded = w.as_tensor().broadcast_div(&std.t()?)?;
    let b_folded = (b.as_tensor() - mean.matmul(&w_folded)?.flatten_all()?)?;
    Ok(ExitProbe {
        weight: w_folded.detach(),
        bias: b_folded.detach(),
    })
}

/// The probe's probabilities for features `[rows, d_model]`.
pub fn probe_scores(probe: &ExitProbe, features: &Tensor) -> Result<Vec<f32>> {
    let s = features.matmul(&probe.weight)?.broadcast_add(&probe.bias)?;
    Ok(sigmoid(&s)?.flatten_all()?.to_vec1::<f32>()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uniform(n: usize, scale: f32, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-scale..scale)).collect()
    }

    fn tensor(rows: usize, cols: usize, scale: f32, seed: u64) -> Tensor {
        Tensor::from_vec(
            uniform(rows * cols, scale, seed),
            (rows, cols),
            &Device::Cpu,
        )
        .expect("tensor")
    }

    /// A final norm with unit scale and a random `[vocab, d]` head.
    fn frozen(d: usize, vocab: usize) -> Frozen {
        Frozen {
            norm_weight: Tensor::ones(d, DType::F32, &Device::Cpu).expect("ones"),
            eps: 1e-6,
            head: tensor(vocab, d, 1.0, 7),
        }
    }

    /// The final layer's rows as a known affine function of the exit's rows.
    fn known_map(x: &Tensor, d: usize) -> Tensor {
        let a = (tensor(d, d, 0.6, 11) + Tensor::eye(d, DType::F32, &Device::Cpu).expect("eye"))
            .expect("a");
        let b = tensor(1, d, 0.3, 12);
        x.matmul(&a).expect("xa").broadcast_add(&b).expect("xa+b")
    }

    fn next_tokens(rows: usize, vocab: usize) -> Tensor {
        let v: Vec<u32> = (0..rows).map(|i| (i * 7 % vocab) as u32).collect();
        Tensor::from_vec(v, rows, &Device::Cpu).expect("next")
    }

    #[test]
    fn one_step_on_a_fixed_batch_lowers_the_loss_the_same_way_twice() -> Result<()> {
        let (d, vocab, rows) = (8, 40, 32);
        let f = frozen(d, vocab);
        let x = tensor(rows, d, 1.0, 1);
        let t = f.log_probs(&known_map(&x, d))?;
        let next = next_tokens(rows, vocab);
        let batch = Batch {
            x: &x,
            target_log_probs: &t,
            next: &next,
            offset: 0,
        };
        let run = || -> Result<(BatchLoss, BatchLoss, Vec<f32>)> {
            let h = Trainable::new(HeadKind::Mlp, &ExitHead::Identity, d, 3, &Device::Cpu)?;
            let mut opt = optimizer(&h, 1e-2)?;
            let before = train_step(&h, &mut opt, &f, &batch, 0.5)?;
            let after = batch_loss(&h, &f, &batch, 0.5)?;
            let w = h.vars()[0].as_tensor().flatten_all()?.to_vec1::<f32>()?;
            Ok((before, after, w))
        };
        let (b1, a1, w1) = run()?;
        let (b2, a2, w2) = run()?;
        assert!(a1.total < b1.total, "{b1:?} -> {a1:?}");
        assert_eq!((b1, a1), (b2, a2));
        assert_eq!(w1, w2);
        Ok(())
    }

    #[test]
    fn gradients_match_finite_differences() -> Result<()> {
        let (d, vocab, rows) = (6, 20, 8);
        let f = frozen(d, vocab);
        let x = tensor(rows, d, 1.0, 2);
        let t = f.log_probs(&tensor(rows, d, 1.0, 3))?;
        let next = next_tokens(rows, vocab);
        let batch = Batch {
            x: &x,
            target_log_probs: &t,
            next: &next,
            offset: 0,
        };
        let init = ExitHead::Affine {
            weight_t: tensor(d, d, 0.5, 4),
            bias: tensor(1, d, 0.5, 5).flatten_all()?,
        };
        let h = Trainable::new(HeadKind::Mlp, &init, d, 6, &Device::Cpu)?;
        // A non-zero output layer, so the MLP's first layer has a gradient too.
        h.vars()[4].set(&tensor(d, d, 0.5, 8))?;
        assert_gradients_match(&h, &f, &batch, 0.7)
    }

    /// The gradient of every parameter of `h` at its first, middle and last entry matches a
    /// central finite difference of the batch loss.
    fn assert_gradients_match(h: &Trainable, f: &Frozen, batch: &Batch<'_>, ce: f64) -> Result<()> {
        let grads = gradients(h, f, batch, ce)?;
        let eps = 1e-2f32;
        for (k, var) in h.vars().iter().enumerate() {
            let base = var.as_tensor().copy()?;
            let flat = base.flatten_all()?.to_vec1::<f32>()?;
            let g = grads[k].flatten_all()?.to_vec1::<f32>()?;
            for i in [0, flat.len() / 2, flat.len() - 1] {
                let at = |delta: f32| -> Result<f64> {
                    let mut v = flat.clone();
                    v[i] += delta;
                    var.set(&Tensor::from_vec(v, base.shape(), &Device::Cpu)?)?;
                    Ok(batch_loss(h, f, batch, ce)?.total)
                };
                let fd = (at(eps)? - at(-eps)?) / (2.0 * f64::from(eps));
                var.set(&base)?;
                let an = f64::from(g[i]);
                assert!(
                    (fd - an).abs() <= 2e-3 + 2e-2 * an.abs(),
                    "parameter {k} ({}) [{i}]: finite difference {fd}, gradient {an}",
                    h.names()[k]
                );
            }
        }
        Ok(())
    }

    /// Trains a head from the identity on rows whose final state is a known affine map of
    /// the exit's; returns held-out top-1 agreement.
    fn agreement_after_training(kind: HeadKind) -> Result<f64> {
        let (d, vocab) = (16, 64);
        let f = frozen(d, vocab);
        let x = tensor(3000, d, 1.0, 21);
        let last = known_map(&x, d);
        let (train_x, test_x) = (x.narrow(0, 0, 2500)?, x.narrow(0, 2500, 500)?);
        let (train_y, test_y) = (last.narrow(0, 0, 2500)?, last.narrow(0, 2500, 500)?);
        let next = next_tokens(2500, vocab);
        let h = Trainable::new(kind, &ExitHead::Identity, d, 9, &Device::Cpu)?;
        let mut opt = optimizer(&h, 1e-2)?;
        for epoch in 0..60 {
            for chunk in epoch_order(2500, epoch).chunks(100) {
                let idx = Tensor::from_vec(
                    chunk.iter().map(|&i| i as u32).collect::<Vec<_>>(),
                    chunk.len(),
                    &Device::Cpu,
                )?;
                let xb = train_x.index_select(&idx, 0)?;
                let tb = f.log_probs(&train_y.index_select(&idx, 0)?)?;
                let nb = next.index_select(&idx, 0)?;
                let batch = Batch {
                    x: &xb,
                    target_log_probs: &tb,
                    next: &nb,
                    offset: 0,
                };
                train_step(&h, &mut opt, &f, &batch, 0.0)?;
            }
        }
        let exit = f
            .logits(&f.norm(&h.forward(&test_x)?)?)?
            .argmax(D::Minus1)?
            .to_vec1::<u32>()?;
        let fin = f
            .logits(&f.norm(&test_y)?)?
            .argmax(D::Minus1)?
            .to_vec1::<u32>()?;
        let same = exit.iter().zip(&fin).filter(|(a, b)| a == b).count();
        Ok(same as f64 / exit.len() as f64)
    }

    #[test]
    fn trained_heads_learn_a_known_map_to_99_percent_agreement() -> Result<()> {
        for kind in [HeadKind::Affine, HeadKind::Mlp] {
            let a = agreement_after_training(kind)?;
            assert!(a >= 0.99, "{}: agreement {a}", kind.as_str());
        }
        Ok(())
    }

    fn block_cfg() -> BlockConfig {
        BlockConfig {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 4,
            ffn_dim: 12,
            rope_theta: 10_000.0,
            rope_style: switchyard_weights::RopeStyle::HalfSplit,
            norm_eps: 1e-6,
            init_layer: 0,
        }
    }

    #[test]
    fn block_gradients_match_finite_differences() -> Result<()> {
        let (d, vocab, rows) = (8, 20, 6);
        let f = frozen(d, vocab);
        let init = BlockHead::seeded(block_cfg(), d, 1.0, 4, &Device::Cpu)?;
        let h = Trainable::new(
            HeadKind::Block,
            &ExitHead::Block(Box::new(init)),
            d,
            0,
            &Device::Cpu,
        )?;
        // One sequence of `rows + 1` positions; the first is attended to, not scored.
        let x = tensor(rows + 1, d, 1.0, 2);
        let t = f.log_probs(&tensor(rows, d, 1.0, 3))?;
        let next = next_tokens(rows, vocab);
        let batch = Batch {
            x: &x,
            target_log_probs: &t,
            next: &next,
            offset: 1,
        };
        assert_gradients_match(&h, &f, &batch, 0.5)
    }

    #[test]
    fn a_trained_block_learns_a_known_block_to_99_percent_agreement() -> Result<()> {
        let (d, vocab, len) = (16, 64, 12);
        let f = frozen(d, vocab);
        // The final state is a known block of the exit's; training starts from a block with
        // the same shape whose weights are off by about half their size (as a real block head
        // starts from the model's last layer, not from the map it must learn).
        let teacher = BlockHead::seeded(block_cfg(), d, 1.0, 41, &Device::Cpu)?;
        let noise = BlockHead::seeded(block_cfg(), d, 0.5, 42, &Device::Cpu)?;
        let start = BlockHead {
            cfg: block_cfg(),
            params: teacher
                .params
                .iter()
                .zip(&noise.params)
                .map(|(t, n)| {
                    if t.rank() == 1 && t.dims() == [d] {
                        Ok(t.clone())
                    } else {
                        t + n
                    }
                })
                .collect::<candle_core::Result<_>>()?,
        };
        let h = Trainable::new(
            HeadKind::Block,
            &ExitHead::Block(Box::new(start)),
            d,
            0,
            &Device::Cpu,
        )?;
        let seqs: Vec<Tensor> = (0..240).map(|i| tensor(len, d, 1.0, 100 + i)).collect();
        let finals: Vec<Tensor> = seqs
            .iter()
            .map(|x| teacher.forward(x, 0, None))
            .collect::<Result<_>>()?;
        let next = next_tokens(len - 1, vocab);
        let agreement = |h: &Trainable| -> Result<f64> {
            let (mut same, mut total) = (0, 0);
            for i in 200..240 {
                let a = f
                    .logits(&f.norm(&h.forward(&seqs[i])?)?)?
                    .argmax(D::Minus1)?
                    .to_vec1::<u32>()?;
                let b = f
                    .logits(&f.norm(&finals[i])?)?
                    .argmax(D::Minus1)?
                    .to_vec1::<u32>()?;
                same += a.iter().zip(&b).filter(|(x, y)| x == y).count();
                total += a.len();
            }
            Ok(same as f64 / total as f64)
        };
        let before = agreement(&h)?;
        let mut opt = optimizer(&h, 3e-3)?;
        for epoch in 0..40 {
            // Step decay: 3e-3, then 1e-3 and 3e-4 for the last ten epochs each.
            if epoch == 20 || epoch == 30 {
                opt.set_learning_rate(opt.learning_rate() * 0.3);
            }
            for i in epoch_order(200, epoch) {
                let t = f.log_probs(&finals[i].narrow(0, 1, len - 1)?)?;
                let batch = Batch {
                    x: &seqs[i],
                    target_log_probs: &t,
                    next: &next,
                    offset: 1,
                };
                train_step(&h, &mut opt, &f, &batch, 0.0)?;
            }
        }
        let after = agreement(&h)?;
        assert!(
            before < 0.9,
            "the starting block already agrees on {before}"
        );
        assert!(after >= 0.99, "held-out agreement {before} -> {after}");
        Ok(())
    }

    #[test]
    fn the_probe_separates_a_linearly_separable_label() -> Result<()> {
        let x = tensor(2000, 8, 1.0, 31);
        let col: Vec<f32> = x.narrow(1, 3, 1)?.flatten_all()?.to_vec1()?;
        // Shifted and scaled features: the fold back of the standardisation must be right.
        let shifted = ((x * 5.0)? + 2.0)?;
        let labels: Vec<f32> = col.iter().map(|&v| f32::from(u8::from(v > 0.1))).collect();
        let p = fit_probe(&shifted, &labels, 20, 128, 1)?;
        let s = probe_scores(&p, &shifted)?;
        let right = s
            .iter()
            .zip(&labels)
            .filter(|(s, l)| (**s > 0.5) == (**l > 0.5))
            .count();
        assert!(right as f64 / 2000.0 > 0.97, "{right} of 2000");
        Ok(())
    }
}
