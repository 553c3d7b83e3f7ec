//! Where a forward step's time goes: wall time per part (products by kind, attention, K/V
//! writes, norms, sampling, scheduling, ...), summed over the process while profiling is on.
//!
//! Written here rather than as a `tracing` layer: the parts must not overlap (a span tree
//! nests, and subtracting children per span on every event costs more than the smallest
//! parts measured, a few microseconds at batch 1), and when profiling is off each part costs
//! one relaxed atomic load. Parts are timed on the thread that drives the step; a parallel
//! loop counts as its wall time, and the time its tasks computed is summed apart
//! ([`Part::ParallelBusy`]), so that the wall time lost to hand-offs and waiting can be told
//! from the work.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// One part of a step. The parts do not overlap, but for [`Part::ParallelBusy`], which sums
/// what the tasks of parallel loops computed on every thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Part {
    /// Token embedding rows.
    Embed,
    /// Quantizing a product's activations to 8-bit blocks.
    ActQuant,
    /// Attention q/k/v projections.
    QkvProj,
    /// Attention output projection.
    OutProj,
    /// MLP gate and up projections.
    GateUp,
    /// MLP down projection.
    Down,
    /// The LM head (and exit heads' translators).
    LmHead,
    /// Any other weight product.
    OtherProj,
    /// Attention over cached K/V.
    Attention,
    /// Writing K/V rows into the cache.
    KvWrite,
    /// Rotary embeddings.
    Rope,
    /// RMS norms.
    Norm,
    /// The MLP's activation and gating.
    Activation,
    /// Residual additions.
    Residual,
    /// Moving activations between tensors and buffers.
    Copy,
    /// Picking tokens from logits (penalties, softmax, draws, log-probabilities).
    Sample,
    /// The scheduler's plan and its update from the sampled tokens.
    Schedule,
    /// Turning tokens into outputs for the callers (text, stop strings, channels).
    Output,
    /// Sum over every thread of the time parallel loops' tasks computed.
    ParallelBusy,
}

impl Part {
    pub const ALL: [Part; 19] = [
        Part::Embed,
        Part::ActQuant,
        Part::QkvProj,
        Part::OutProj,
        Part::GateUp,
        Part::Down,
        Part::LmHead,
        Part::OtherProj,
        Part::Attention,
        Part::KvWrite,
        Part::Rope,
        Part::Norm,
        Part::Activation,
        Part::Residual,
        Part::Copy,
        Part::Sample,
        Part::Schedule,
        Part::Output,
        Part::ParallelBusy,
    ];

    /// The parts that run as parallel loops on the compute pool, whose tasks add to
    /// [`Part::ParallelBusy`]: the weight products and attention.
    pub const PARALLEL: [Part; 7] = [
        Part::QkvProj,
        Part::OutProj,
        Part::GateUp,
        Part::Down,
        Part::LmHead,
        Part::OtherProj,
        Part::Attention,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Part::Embed => "embed",
            Part::ActQuant => "activation_quantize",
            Part::QkvProj => "qkv_projection",
            Part::OutProj => "attention_output_projection",
            Part::GateUp => "gate_up_projection",
            Part::Down => "down_projection",
            Part::LmHead => "lm_head",
            Part::OtherProj => "other_projection",
            Part::Attention => "attention",
            Part::KvWrite => "kv_write",
            Part::Rope => "rope",
            Part::Norm => "norm",
            Part::Activation => "mlp_activation",
            Part::Residual => "residual",
            Part::Copy => "copy",
            Part::Sample => "sample",
            Part::Schedule => "schedule",
            Part::Output => "output",
            Part::ParallelBusy => "parallel_task_busy",
        }
    }

    /// The part a weight product falls in, from the weight's canonical (llama.cpp) name.
    pub fn of_weight(name: Option<&str>) -> Part {
        let Some(n) = name else {
            return Part::OtherProj;
        };
        if n.ends_with("attn_q.weight")
            || n.ends_with("attn_k.weight")
            || n.ends_with("attn_v.weight")
        {
            Part::QkvProj
        } else if n.ends_with("attn_output.weight") {
            Part::OutProj
        } else if n.ends_with("ffn_gate.weight") || n.ends_with("ffn_up.weight") {
            Part::GateUp
        } else if n.ends_with("ffn_down.weight") {
            Part::Down
        } else if n == "output.weight" || n == "token_embd.weight" {
            Part::LmHead
        } else {
            Part::OtherProj
        }
    }
}

/// Number of parts.
pub const N: usize = Part::ALL.len();

static ON: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];
static CALLS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];

/// Whether parts are being timed.
#[inline(always)]
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Starts timing parts (from zero).
pub fn start() {
    reset();
    ON.store(true, Ordering::Relaxed);
}

/// Stops timing; the totals stay readable.
pub fn stop() {
    ON.store(false, Ordering::Relaxed);
}

/// Zeroes every total and forgets the steps recorded.
pub fn reset() {
    for (n, c) in NANOS.iter().zip(&CALLS) {
        n.store(0, Ordering::Relaxed);
        c.store(0, Ordering::Relaxed);
    }
    if let Ok(mut steps) = STEPS.lock() {
        steps.clear();
    }
}

/// Seconds and calls of each part since [`start`].
pub fn totals() -> Vec<(Part, f64, u64)> {
    Part::ALL
        .iter()
        .map(|&p| {
            (
                p,
                NANOS[p as usize].load(Ordering::Relaxed) as f64 * 1e-9,
                CALLS[p as usize].load(Ordering::Relaxed),
            )
        })
        .collect()
}

/// Every part's nanoseconds so far.
pub fn snapshot() -> [u64; N] {
    std::array::from_fn(|i| NANOS[i].load(Ordering::Relaxed))
}

/// One engine step while profiling was on: its size, wall time and what each part took.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRecord {
    /// Sequences and tokens in the step.
    pub batch: usize,
    pub tokens: usize,
    pub wall_s: f64,
    /// Seconds per part, in [`Part::ALL`] order.
    pub parts: Vec<f64>,
}

static STEPS: Mutex<Vec<StepRecord>> = Mutex::new(Vec::new());

/// Times one step (`f` returns its batch and token counts) and keeps its record, while
/// profiling is on; runs `f` alone otherwise.
pub fn record_step<R>(f: impl FnOnce() -> (R, usize, usize)) -> R {
    if !enabled() {
        return f().0;
    }
    let (t, before) = (Instant::now(), snapshot());
    let (r, batch, tokens) = f();
    let wall_s = t.elapsed().as_secs_f64();
    let after = snapshot();
    let parts = before
        .iter()
        .zip(&after)
        .map(|(b, a)| a.saturating_sub(*b) as f64 * 1e-9)
        .collect();
    if let Ok(mut steps) = STEPS.lock() {
        steps.push(StepRecord {
            batch,
            tokens,
            wall_s,
            parts,
        });
    }
    r
}

/// The steps recorded since [`start`].
pub fn steps() -> Vec<StepRecord> {
    STEPS.lock().map(|s| s.clone()).unwrap_or_default()
}

/// Adds `nanos` to `part`.
#[inline]
pub fn add(part: Part, nanos: u64) {
    NANOS[part as usize].fetch_add(nanos, Ordering::Relaxed);
    CALLS[part as usize].fetch_add(1, Ordering::Relaxed);
}

/// Times a scope as `part` while profiling is on (nothing otherwise).
#[must_use = "the part is timed until the guard drops"]
pub struct Timer {
    part: Part,
    start: Option<Instant>,
}

impl Drop for Timer {
    fn drop(&mut self) {
        if let Some(t) = self.start {
            add(self.part, t.elapsed().as_nanos() as u64);
        }
    }
}

/// Times the rest of the scope as `part`.
#[inline(always)]
pub fn time(part: Part) -> Timer {
    Timer {
        part,
        start: enabled().then(Instant::now),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_fall_in_their_parts() {
        assert_eq!(Part::of_weight(Some("blk.3.attn_k.weight")), Part::QkvProj);
        assert_eq!(
            Part::of_weight(Some("blk.3.attn_output.weight")),
            Part::OutProj
        );
        assert_eq!(Part::of_weight(Some("blk.0.ffn_up.weight")), Part::GateUp);
        assert_eq!(Part::of_weight(Some("blk.0.ffn_down.weight")), Part::Down);
        assert_eq!(Part::of_weight(Some("output.weight")), Part::LmHead);
        assert_eq!(Part::of_weight(Some("token_embd.weight")), Part::LmHead);
        assert_eq!(Part::of_weight(None), Part::OtherProj);
        assert_eq!(Part::ALL.len(), N);
        for (i, p) in Part::ALL.iter().enumerate() {
            assert_eq!(*p as usize, i, "{p:?}");
        }
    }
}
