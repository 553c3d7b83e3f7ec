//! `bench step`: where one batched decode step's time goes, at several batch sizes and
//! contexts, beside the ceilings this machine reaches (read bandwidth and the int8 kernel's
//! multiply-accumulates per second, measured by the same tool).
//!
//! Each cell serves `batch` requests whose prompts are `context` tokens of Hamlet (each from
//! its own offset, prefix caching off, so no two share K/V) through the serving engine, with
//! the kernels' profile on ([`switchyard_kernels::prof`]). The engine records every step; the
//! cell's figures are the means over the first `steps` steps in which all `batch` sequences
//! decode one token each, so prompt chunks and the first and last steps are left out.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use switchyard_engine::kv::BlockLayout;
use switchyard_engine::{EngineConfig, EngineHandle, EngineRequest, KvFormat, RequestStream};
use switchyard_kernels::prof::{self, Part, StepRecord};
use switchyard_models::LayeredModel;
use switchyard_request::SamplingParams;
use switchyard_tokenizer::Tokenizer;

use crate::{BenchError, Result};

/// The grid: batch 1 to 64 at two contexts.
pub const DEFAULT_BATCHES: &[usize] = &[1, 8, 32, 64];
pub const DEFAULT_CONTEXTS: &[usize] = &[256, 1024];
/// Decode steps averaged per cell.
pub const DEFAULT_STEPS: usize = 8;
/// Bytes read for the bandwidth ceiling: far past any cache.
const READ_BYTES: usize = 1 << 30;
/// Longest wait for a cell's steps (a stuck engine fails the cell instead of hanging).
const CELL_TIMEOUT: Duration = Duration::from_secs(1800);

#[derive(Debug, Clone)]
pub struct StepBenchOptions {
    pub batches: Vec<usize>,
    pub contexts: Vec<usize>,
    pub steps: usize,
    pub memory_budget: u64,
    pub kv_format: KvFormat,
}

impl Default for StepBenchOptions {
    fn default() -> Self {
        Self {
            batches: DEFAULT_BATCHES.to_vec(),
            contexts: DEFAULT_CONTEXTS.to_vec(),
            steps: DEFAULT_STEPS,
            memory_budget: 8 << 30,
            kv_format: KvFormat::F32,
        }
    }
}

/// What this machine reaches, measured here.
#[derive(Debug, Clone, Serialize)]
pub struct Ceilings {
    pub threads: usize,
    /// Best of several reads of a buffer of `read_bytes` split over the threads.
    pub read_bytes: usize,
    pub read_gb_per_s: f64,
    /// Multiply-accumulates per second of the Q8_0 kernel on weights that fit in cache
    /// (`int8_weight_bytes`), over `int8_rows` activation rows: the compute ceiling of the
    /// products.
    pub int8_weight_bytes: usize,
    pub int8_rows: usize,
    pub int8_gmacs_per_s: f64,
}

/// One (batch, context) cell: means over its decode steps.
#[derive(Debug, Clone, Serialize)]
pub struct StepCell {
    pub batch: usize,
    pub context: usize,
    pub steps: usize,
    pub step_ms: f64,
    pub output_tokens_per_s: f64,
    /// Milliseconds per step of each part (the parts do not overlap).
    pub parts_ms: BTreeMap<String, f64>,
    /// The step's wall time the parts do not cover.
    pub other_ms: f64,
    /// Time the tasks of parallel loops computed, summed over threads, per step.
    pub parallel_task_ms: f64,
    /// Wall time of the parallel parts (products and attention) beyond their task time
    /// split evenly over the threads: hand-offs, waiting and imbalance.
    pub parallel_wait_ms: f64,
    /// Weight bytes one step reads (every resident matrix once), and K/V bytes (every
    /// sequence's cache at every layer).
    pub weight_bytes: u64,
    pub kv_bytes: u64,
    /// (weights + K/V) / step time, and its share of the read ceiling.
    pub achieved_gb_per_s: f64,
    pub share_of_read_ceiling: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepBenchReport {
    pub model: String,
    pub threads: usize,
    pub kv_format: KvFormat,
    pub kernels: String,
    pub ceilings: Ceilings,
    pub cells: Vec<StepCell>,
}

/// Measures the ceilings and every cell; `on_cell(label)` reports progress.
pub fn bench_step(
    load: &dyn Fn() -> Result<LayeredModel>,
    tokenizer: &Arc<Tokenizer>,
    name: &str,
    threads: usize,
    opts: &StepBenchOptions,
    mut on_cell: impl FnMut(&str),
) -> Result<StepBenchReport> {
    if opts.batches.iter().chain(&opts.contexts).any(|&x| x == 0) || opts.steps == 0 {
        return Err(BenchError::Invalid(
            "batches, contexts and steps must be positive".into(),
        ));
    }
    on_cell("ceilings: read bandwidth and int8 kernel throughput");
    let ceilings = measure_ceilings(threads)?;
    let mut cells = Vec::new();
    for &context in &opts.contexts {
        for &batch in &opts.batches {
            on_cell(&format!("batch {batch}, context {context}"));
            cells.push(run_cell(
                load()?,
                tokenizer,
                name,
                batch,
                context,
                opts,
                &ceilings,
            )?);
        }
    }
    Ok(StepBenchReport {
        model: name.to_string(),
        threads,
        kv_format: opts.kv_format,
        kernels: if std::env::var(switchyard_kernels::KERNELS_ENV).is_ok_and(|v| v == "candle") {
            "candle".into()
        } else {
            "switchyard".into()
        },
        ceilings,
        cells,
    })
}

fn run_cell(
    model: LayeredModel,
    tokenizer: &Arc<Tokenizer>,
    name: &str,
    batch: usize,
    context: usize,
    opts: &StepBenchOptions,
    ceilings: &Ceilings,
) -> Result<StepCell> {
    let n_layers = model.n_layers();
    let kv_per_token = BlockLayout::for_spec(model.spec(), 1, opts.kv_format).bytes_per_token();
    let weight_bytes = model.resident_bytes().total() as u64;
    let mut cfg = EngineConfig {
        memory_budget: opts.memory_budget,
        kv_format: opts.kv_format,
        ..EngineConfig::default()
    };
    cfg.scheduler.prefix_caching = false;
    let budget_tokens = cfg.scheduler.max_batched_tokens.max(1);
    // Early sequences decode while later ones take their prompts: every request must still
    // be running when the last prompt is done, and `steps` full steps after it.
    let prefill_steps = (batch * context).div_ceil(budget_tokens) + batch;
    let max_tokens = prefill_steps + opts.steps + 4;
    let source = crate::engine::prompt_tokens(tokenizer, context + 997 * batch)?;
    let handle = EngineHandle::start(model, Arc::clone(tokenizer), cfg, name)?;
    prof::start();
    let result = (|| {
        let mut streams: Vec<RequestStream> = (0..batch)
            .map(|i| {
                let at = 997 * i;
                handle.add_request(EngineRequest {
                    prompt: source[at..at + context].to_vec(),
                    params: SamplingParams {
                        ignore_eos: true,
                        ..SamplingParams::greedy(max_tokens)
                    },
                })
            })
            .collect::<std::result::Result<_, _>>()?;
        let t0 = Instant::now();
        let mut finished = 0;
        loop {
            for s in &mut streams {
                while let Some(o) = s.try_next() {
                    if o?.finish_reason.is_some() {
                        finished += 1;
                    }
                }
            }
            let full = full_decode_steps(&prof::steps(), batch);
            if full.len() >= opts.steps {
                return Ok(full[..opts.steps].to_vec());
            }
            if finished == batch {
                // Every request ran to its end without `steps` steps of all of them at once:
                // the budget's K/V pool could not hold them together.
                return Err(BenchError::Invalid(format!(
                    "batch {batch}, context {context}: {} full decode steps before the requests \
                     ended; {batch} sequences of up to {} positions do not fit the memory budget \
                     together (raise --memory-budget)",
                    full.len(),
                    context + max_tokens
                )));
            }
            if t0.elapsed() > CELL_TIMEOUT {
                return Err(BenchError::Invalid(format!(
                    "batch {batch}, context {context}: {} full decode steps after {:?}",
                    full.len(),
                    CELL_TIMEOUT
                )));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    })();
    prof::stop();
    let _ = handle.shutdown().wait();
    let steps = result?;
    let n = steps.len() as f64;
    let mean = |f: &dyn Fn(&StepRecord) -> f64| steps.iter().map(f).sum::<f64>() / n;
    let step_s = mean(&|s| s.wall_s);
    let part_s = |p: Part| mean(&|s| s.parts[p as usize]);
    let mut parts_ms = BTreeMap::new();
    let mut covered = 0.0;
    for &p in Part::ALL.iter().filter(|&&p| p != Part::ParallelBusy) {
        let v = part_s(p);
        covered += v;
        parts_ms.insert(p.name().to_string(), v * 1e3);
    }
    let parallel_wall: f64 = Part::PARALLEL.iter().map(|&p| part_s(p)).sum();
    let busy = part_s(Part::ParallelBusy);
    // Positions held during the measured steps: the prompt and the tokens decoded so far
    // (about the prefill's steps for the first sequences; the context is the floor).
    let kv_bytes = (batch * context * n_layers * kv_per_token) as u64;
    let bytes = (weight_bytes + kv_bytes) as f64;
    Ok(StepCell {
        batch,
        context,
        steps: steps.len(),
        step_ms: step_s * 1e3,
        output_tokens_per_s: batch as f64 / step_s,
        parts_ms,
        other_ms: (step_s - covered).max(0.0) * 1e3,
        parallel_task_ms: busy * 1e3,
        parallel_wait_ms: (parallel_wall - busy / ceilings.threads.max(1) as f64).max(0.0) * 1e3,
        weight_bytes,
        kv_bytes,
        achieved_gb_per_s: bytes / step_s / 1e9,
        share_of_read_ceiling: bytes / step_s / 1e9 / ceilings.read_gb_per_s,
    })
}

/// The recorded steps in which `batch` sequences each decoded one token.
fn full_decode_steps(steps: &[StepRecord], batch: usize) -> Vec<StepRecord> {
    steps
        .iter()
        .filter(|s| s.batch == batch && s.tokens == batch)
        .cloned()
        .collect()
}

/// The read bandwidth and the int8 kernel's throughput on this machine.
pub fn measure_ceilings(threads: usize) -> Result<Ceilings> {
    let threads = threads.max(1);
    let words = READ_BYTES / 8;
    // Filled, so every page is resident before the timed reads.
    let buf: Vec<u64> = (0..words as u64).collect();
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        let sum = std::thread::scope(|s| {
            let parts: Vec<_> = buf
                .chunks(words.div_ceil(threads))
                .map(|c| s.spawn(move || read_sum(c)))
                .collect();
            parts
                .into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0u64, u64::wrapping_add)
        });
        std::hint::black_box(sum);
        best = best.min(t.elapsed().as_secs_f64());
    }
    let (weight_bytes, rows, gmacs) = int8_throughput()?;
    Ok(Ceilings {
        threads,
        read_bytes: READ_BYTES,
        read_gb_per_s: READ_BYTES as f64 / best / 1e9,
        int8_weight_bytes: weight_bytes,
        int8_rows: rows,
        int8_gmacs_per_s: gmacs,
    })
}

/// Sums `words` eight lanes at a time (so the compiler keeps several loads in flight).
fn read_sum(words: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut chunks = words.chunks_exact(8);
    for c in &mut chunks {
        for (a, w) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(*w);
        }
    }
    let tail: u64 = chunks.remainder().iter().fold(0, |a, w| a.wrapping_add(*w));
    acc.iter().fold(tail, |a, w| a.wrapping_add(*w))
}

/// `(weight bytes, rows, GMAC/s)` of the Q8_0 kernel on a cache-resident weight (2.1 MiB:
/// in L3 at least). A product of 512 x 1024 by 32 rows was too short to be a ceiling on an
/// AMD EPYC (AVX2): its fixed costs (activation quantization, two hand-offs to the pool) held
/// it to 30 GMAC/s; this size measured 58 GMAC/s in the next run on the same machine.
fn int8_throughput() -> Result<(usize, usize, f64)> {
    use candle_core::quantized::{GgmlDType, QTensor};
    const N: usize = 2048;
    const K: usize = 1024;
    const ROWS: usize = 64;
    let err = |e: candle_core::Error| BenchError::Invalid(format!("int8 ceiling: {e}"));
    let values: Vec<f32> = (0..N * K)
        .map(|i| ((i * 7919) % 255) as f32 - 127.0)
        .collect();
    let w =
        candle_core::Tensor::from_vec(values, (N, K), &candle_core::Device::Cpu).map_err(err)?;
    let q = QTensor::quantize(&w, GgmlDType::Q8_0).map_err(err)?;
    let packed = switchyard_kernels::quant::PackedWeight::from_qtensor(&q)
        .map_err(err)?
        .ok_or_else(|| BenchError::Invalid("Q8_0 has no packed kernel".into()))?;
    let x: Vec<f32> = (0..ROWS * K)
        .map(|i| ((i % 97) as f32 - 48.0) / 17.0)
        .collect();
    let mut out = vec![0f32; ROWS * N];
    let t = Instant::now();
    let mut n = 0usize;
    while t.elapsed() < Duration::from_millis(600) || n < 8 {
        packed.matmul(&x, ROWS, &mut out);
        n += 1;
    }
    let secs = t.elapsed().as_secs_f64();
    Ok((packed.bytes(), ROWS, (n * N * K * ROWS) as f64 / secs / 1e9))
}

impl StepBenchReport {
    pub fn markdown(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let c = &self.ceilings;
        let _ = writeln!(
            s,
            "### Where a decode step's time goes: {}, {} threads, K/V {:?}, {} kernels\n\n\
             Ceilings measured here: read {:.1} GB/s ({} MiB buffer over {} threads); int8 \
             kernel {:.1} GMAC/s (Q8_0, {} KiB of weights in cache, {} rows).\n",
            self.model,
            self.threads,
            self.kv_format,
            self.kernels,
            c.read_gb_per_s,
            c.read_bytes >> 20,
            c.threads,
            c.int8_gmacs_per_s,
            c.int8_weight_bytes >> 10,
            c.int8_rows,
        );
        let names: Vec<&str> = self
            .cells
            .first()
            .map(|c| c.parts_ms.keys().map(String::as_str).collect())
            .unwrap_or_default();
        let _ = writeln!(
            s,
            "| batch | context | step ms | tok/s | {} | other | parallel wait | GB/s (share of ceiling) |",
            names.join(" | ")
        );
        let _ = writeln!(
            s,
            "|---|---|---|---|{}---|---|---|",
            "---|".repeat(names.len())
        );
        for cell in &self.cells {
            let parts: Vec<String> = names
                .iter()
                .map(|n| format!("{:.2}", cell.parts_ms.get(*n).copied().unwrap_or(0.0)))
                .collect();
            let _ = writeln!(
                s,
                "| {} | {} | {:.2} | {:.1} | {} | {:.2} | {:.2} | {:.1} ({:.0}%) |",
                cell.batch,
                cell.context,
                cell.step_ms,
                cell.output_tokens_per_s,
                parts.join(" | "),
                cell.other_ms,
                cell.parallel_wait_ms,
                cell.achieved_gb_per_s,
                100.0 * cell.share_of_read_ceiling
            );
        }
        let _ = writeln!(
            s,
            "\nParts are wall time on the thread driving the step, in milliseconds per step; they \
             do not overlap. Parallel wait: the products' and attention's wall time beyond their \
             tasks' time split evenly over the threads. GB/s: the step's weight and K/V bytes \
             over its time."
        );
        s
    }

    /// `step.png`: one stacked bar of parts per cell.
    pub fn plot(&self, dir: &Path) -> Result<PathBuf> {
        use switchyard_charts::{fonts_available, stacked_bars, Bar, StackedBars};
        std::fs::create_dir_all(dir).map_err(|source| BenchError::io(dir, source))?;
        let mut segments: Vec<String> = self
            .cells
            .first()
            .map(|c| c.parts_ms.keys().cloned().collect())
            .unwrap_or_default();
        segments.push("other".into());
        let bars: Vec<Bar> = self
            .cells
            .iter()
            .map(|c| Bar {
                label: format!("b{} c{}", c.batch, c.context),
                values: c
                    .parts_ms
                    .values()
                    .map(|v| v / c.batch as f64)
                    .chain(std::iter::once(c.other_ms / c.batch as f64))
                    .collect(),
            })
            .collect();
        let path = dir.join("step.png");
        let title = format!("{}: decode step time per sequence", self.model);
        stacked_bars(
            &path,
            &StackedBars {
                title: &title,
                x_label: "ms per step / batch",
                segments: &segments,
                bars: &bars,
            },
            fonts_available(),
        )
        .map_err(|e| BenchError::Invalid(e.to_string()))?;
        Ok(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_steps_where_every_sequence_decodes_count() {
        let rec = |batch, tokens| StepRecord {
            batch,
            tokens,
            wall_s: 1.0,
            parts: vec![0.0; prof::N],
        };
        let steps = [rec(2, 512), rec(4, 260), rec(4, 4), rec(3, 3), rec(4, 4)];
        let full = full_decode_steps(&steps, 4);
        assert_eq!(full.len(), 2);
        assert!(full.iter().all(|s| s.batch == 4 && s.tokens == 4));
    }

    #[test]
    fn the_read_sum_adds_every_word() {
        let words: Vec<u64> = (1..=1001).collect();
        assert_eq!(read_sum(&words), 1001 * 1002 / 2);
    }
}
