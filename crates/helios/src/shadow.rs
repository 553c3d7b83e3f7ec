//! Shadow scoring: what each candidate would make of the live traffic, measured without
//! serving it.
//!
//! A [`ShadowScorer`] holds one candidate's final norm and exit heads, and no layer, token
//! embedding or LM head. To score a batch of texts it streams the model through the layered
//! model's load/forward/drop seam: each token's embedding row is read from the file; layer
//! `l` is loaded, the whole batch runs through it (teacher forcing: every text is a prefill,
//! nothing is sampled), its K/V are freed and the layer is dropped before layer `l + 1` is
//! loaded; and at every exit depth on the way up (and at full depth) the hidden states go
//! through that depth's exit head and then the LM head one slice of the vocabulary at a
//! time, each row's softmax folded slice by slice ([`RowFold`]). So scoring needs one layer
//! or one head slice plus the batch's hidden states, whatever the model's size, and gives,
//! from one pass:
//!
//! * bits per byte of the same text at every depth: the quality per depth, measured on the
//!   text every other candidate scores too (bytes, not tokens, so it is fair across
//!   tokenizers);
//! * the exit histogram (the first depth whose confidence passes the threshold, per token);
//! * prefill throughput.
//!
//! Each text is a request's prompt (the domain signal) and, where the caller has one, a
//! reference answer scored after it (its nats are kept apart). Nothing a candidate generated
//! is ever scored: a model's own output favours the model that wrote it.
//!
//! Scoring runs beside serving, so it is throttled: after each unit of work (one layer over
//! the batch) the scorer sleeps long enough that its busy time stays within `share` of the
//! wall time ([`Throttle`]).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use serde::Serialize;
use switchyard_exits::confidence::{passes, ConfidenceMeasure, TokenStats};
use switchyard_exits::ExitHeads;
use switchyard_models::{DenseKv, ForwardBatch, LayeredModel, LoadOptions, SeqChunk, SeqKv};
use switchyard_tokenizer::Tokenizer;
use switchyard_weights::WeightSource;

use crate::manifest::{ExitHeadsKind, ModelEntry};

use crate::pht::ExitHistogram;
use crate::{HeliosError, Result};

/// Rows sent through a slice of the LM head at once (bounds the logits buffer to rows ×
/// [`switchyard_models::HEAD_SLICE_ROWS`] f32).
const HEAD_ROWS: usize = 256;

/// One text to score: a prompt, and the answer that followed it where the trace has one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShadowText {
    pub prompt: String,
    pub reference: Option<String>,
}

/// Nats summed at each scored depth over some bytes of text.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DepthNats {
    /// UTF-8 bytes of the scored tokens' text.
    pub bytes: u64,
    /// Tokens scored (the candidate's own tokenizer: not comparable across candidates).
    pub tokens: u64,
    /// `(depth, Σ -ln p)`, depth increasing, full depth last.
    pub nats: Vec<(usize, f64)>,
}

impl DepthNats {
    fn new(depths: &[usize]) -> Self {
        Self {
            bytes: 0,
            tokens: 0,
            nats: depths.iter().map(|&d| (d, 0.0)).collect(),
        }
    }

    /// Bits per byte at `depth`, if it was scored and some bytes were.
    pub fn bits_per_byte(&self, depth: usize) -> Option<f64> {
        if self.bytes == 0 {
            return None;
        }
        let &(_, n) = self.nats.iter().find(|(d, _)| *d == depth)?;
        Some(n / std::f64::consts::LN_2 / self.bytes as f64)
    }

    /// Adds `other`'s counts (same depths).
    pub fn merge(&mut self, other: &DepthNats) {
        if self.nats.is_empty() {
            *self = other.clone();
            return;
        }
        self.bytes += other.bytes;
        self.tokens += other.tokens;
        for (mine, theirs) in self.nats.iter_mut().zip(&other.nats) {
            if mine.0 == theirs.0 {
                mine.1 += theirs.1;
            }
        }
    }
}

/// One candidate's scores on one batch of texts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ShadowScore {
    pub model: String,
    pub texts: usize,
    /// The prompts.
    pub prompt: DepthNats,
    /// Each text's prompt alone, in the order the texts were given (a text too short to
    /// score has no bytes): what a decision over a sliding window of texts adds up.
    #[serde(skip)]
    pub per_prompt: Vec<DepthNats>,
    /// The reference answers, scored after their prompts (empty when none was given).
    pub reference: DepthNats,
    /// Per prompt token, the first scored depth whose confidence passes the threshold.
    pub exits: ExitHistogram,
    /// Time spent computing, and the prefill rate over it (tokens of prompt and reference).
    pub busy_s: f64,
    pub prefill_tokens_per_s: f64,
    /// Wall time of the batch, sleeps included.
    pub wall_s: f64,
    /// The most layers resident at once while scoring, and their bytes.
    pub peak_layers_resident: usize,
    pub peak_layer_bytes: usize,
    /// The most bytes of the LM head held at once (one vocabulary slice).
    pub peak_head_bytes: usize,
    /// The most bytes of hidden states and K/V held at once for the batch.
    pub peak_activation_bytes: usize,
}

/// Keeps a worker's busy time within `share` of the wall time: after `busy` of work it
/// sleeps `busy × (1 − share) / share`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Throttle {
    share: f64,
    pub busy: Duration,
    pub slept: Duration,
}

impl Throttle {
    /// `share` in (0, 1]; 1 never sleeps.
    pub fn new(share: f64) -> Self {
        Self {
            share: share.clamp(f64::MIN_POSITIVE, 1.0),
            busy: Duration::ZERO,
            slept: Duration::ZERO,
        }
    }

    /// Records `busy` and returns how long to sleep now.
    pub fn after(&mut self, busy: Duration) -> Duration {
        self.busy += busy;
        let sleep = busy.mul_f64((1.0 - self.share) / self.share);
        self.slept += sleep;
        sleep
    }

    /// Busy time over busy plus sleep so far.
    pub fn share_used(&self) -> f64 {
        let total = (self.busy + self.slept).as_secs_f64();
        if total == 0.0 {
            0.0
        } else {
            self.busy.as_secs_f64() / total
        }
    }
}

/// What the scorer runs with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreSettings {
    /// Exit confidence threshold of the histogram.
    pub threshold: f32,
    pub measure: ConfidenceMeasure,
    /// Most bytes of each prompt and each reference scored (cut at a character boundary, the
    /// same text for every candidate).
    pub max_text_bytes: usize,
    /// Exit depths read every `exit_stride`-th position of each prompt and each reference
    /// (their first position always); full depth reads every position. An exit depth's nats
    /// are then full depth's plus the measured difference on those positions, scaled up to
    /// all of them: a paired estimate, at a `1 / exit_stride` share of the LM-head work that
    /// dominates scoring. 1 reads every position at every depth.
    pub exit_stride: usize,
}

/// One row's softmax over the vocabulary, folded one slice at a time: the running maximum
/// and Σ exp(logit − maximum), the second largest logit and the target's logit. Finishes to
/// the same negative log-likelihood and top-two statistics as a pass over the whole row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowFold {
    max: f32,
    argmax: u32,
    second: f32,
    /// Σ exp(l − max) over the logits seen.
    sum: f64,
    target: u32,
    target_logit: Option<f32>,
}

impl RowFold {
    pub fn new(target: u32) -> Self {
        Self {
            max: f32::NEG_INFINITY,
            argmax: 0,
            second: f32::NEG_INFINITY,
            sum: 0.0,
            target,
            target_logit: None,
        }
    }

    /// Folds the logits of token ids `first..first + logits.len()`.
    pub fn add(&mut self, first: usize, logits: &[f32]) {
        let slice_max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if slice_max > self.max && self.max.is_finite() {
            // The sum so far was relative to the old maximum.
            self.sum *= (f64::from(self.max) - f64::from(slice_max)).exp();
        }
        for (i, &l) in logits.iter().enumerate() {
            self.top(first + i, l);
        }
        // Vectorized exp (within 3e-7 relative), summed in f64: the vocabulary's sweep is
        // most of a scorer's head time.
        self.sum += switchyard_kernels::fastmath::sum_exp(logits, self.max);
        let t = self.target as usize;
        if (first..first + logits.len()).contains(&t) {
            self.target_logit = Some(logits[t - first]);
        }
    }

    fn top(&mut self, id: usize, l: f32) {
        if l > self.max {
            self.second = self.max;
            self.max = l;
            self.argmax = id as u32;
        } else if l > self.second {
            self.second = l;
        }
    }

    /// `-ln p(target)` (infinite when the target was never seen) and the top two.
    pub fn finish(&self) -> (f64, TokenStats) {
        let max = f64::from(self.max);
        let z = self.sum;
        let nll = match self.target_logit {
            Some(l) => z.ln() + max - f64::from(l),
            None => f64::INFINITY,
        };
        let p1 = 1.0 / z;
        let p2 = if self.second.is_finite() {
            (f64::from(self.second) - max).exp() / z
        } else {
            0.0
        };
        let stats = TokenStats {
            argmax: self.argmax,
            max_prob: p1 as f32,
            margin: (p1 - p2) as f32,
        };
        (nll, stats)
    }
}

/// One candidate's scorer: the model with no layer resident, its tokenizer and exit heads.
pub struct ShadowScorer {
    name: String,
    model: LayeredModel,
    tokenizer: Arc<Tokenizer>,
    heads: ExitHeads,
    /// The depths scored: every exit head's and full depth.
    depths: Vec<usize>,
}

impl std::fmt::Debug for ShadowScorer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShadowScorer")
            .field("name", &self.name)
            .field("depths", &self.depths)
            .finish()
    }
}

/// `text` cut to at most `max` bytes at a character boundary.
pub fn cut_text(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// A repository entry's exit heads for `model` (loaded from `path`): its calibrated heads
/// beside the model file, or the logit lens at its exit layers; row-wise, as HELIOS needs.
pub fn candidate_heads(entry: &ModelEntry, path: &Path, model: &LayeredModel) -> Result<ExitHeads> {
    let heads = match entry.exit_heads {
        Some(ExitHeadsKind::Tuned) => {
            let fp = switchyard_exits::fingerprint::fingerprint(path)?;
            let file = switchyard_exits::file::default_heads_path(path);
            switchyard_exits::file::load(&file, model, &fp)?
        }
        _ => ExitHeads::logit_lens(model, &entry.name, &entry.exit_layers)?,
    };
    heads.require_row_wise("HELIOS")?;
    Ok(heads)
}

impl ShadowScorer {
    /// The scorer of a local repository entry whose weights are `source` (opened from
    /// `path`): the model with no layer resident, and the entry's exit heads.
    pub fn open(
        entry: &ModelEntry,
        path: &Path,
        source: Arc<dyn WeightSource>,
        tokenizer: Arc<Tokenizer>,
    ) -> Result<Self> {
        let model = LayeredModel::load(
            source,
            &LoadOptions {
                layers: Some(0),
                ..LoadOptions::default()
            },
        )?;
        let heads = candidate_heads(entry, path, &model)?;
        Self::new(&entry.name, model, tokenizer, heads)
    }

    /// `model` is best loaded with no layer (`LoadOptions { layers: Some(0), .. }`): the
    /// scorer drops its layers, embedding and head, and streams them. `heads` are the candidate's exit heads, row-wise.
    pub fn new(
        name: &str,
        mut model: LayeredModel,
        tokenizer: Arc<Tokenizer>,
        heads: ExitHeads,
    ) -> Result<Self> {
        heads.require_row_wise("shadow scoring")?;
        for l in model.resident_layers() {
            model.drop_layer(l);
        }
        model.drop_io();
        let n = model.n_layers();
        let mut depths: Vec<usize> = heads.depths().into_iter().filter(|&d| d < n).collect();
        depths.push(n);
        Ok(Self {
            name: name.to_string(),
            model,
            tokenizer,
            heads,
            depths,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn depths(&self) -> &[usize] {
        &self.depths
    }

    /// Bytes it holds between batches (the final norm and the exit heads).
    pub fn resident_bytes(&self) -> usize {
        self.model.resident_bytes().total()
            + self.heads.iter().map(|(_, h)| h.bytes()).sum::<usize>()
    }

    /// Scores `texts` at every depth, streaming the layers; `throttle` paces the work.
    pub fn score(
        &mut self,
        texts: &[ShadowText],
        settings: &ScoreSettings,
        throttle: &mut Throttle,
    ) -> Result<ShadowScore> {
        let wall = Instant::now();
        let busy0 = throttle.busy;
        let mut work = Instant::now();
        let pause = |throttle: &mut Throttle, work: &mut Instant| {
            let sleep = throttle.after(work.elapsed());
            if !sleep.is_zero() {
                std::thread::sleep(sleep);
            }
            *work = Instant::now();
        };
        let seqs = self.tokenize(texts, settings.max_text_bytes)?;
        let n_layers = self.model.n_layers();
        let row = self.model.spec().kv_row_len();
        let mut out = ShadowScore {
            model: self.name.clone(),
            texts: seqs.len(),
            prompt: DepthNats::new(&self.depths),
            per_prompt: texts.iter().map(|_| DepthNats::default()).collect(),
            reference: DepthNats::new(&self.depths),
            exits: ExitHistogram::new(),
            busy_s: 0.0,
            prefill_tokens_per_s: 0.0,
            wall_s: 0.0,
            peak_layers_resident: 0,
            peak_layer_bytes: 0,
            peak_head_bytes: 0,
            peak_activation_bytes: 0,
        };
        for s in &seqs {
            out.prompt.bytes += s.prompt_bytes as u64;
            out.prompt.tokens += s.prompt_targets as u64;
            out.per_prompt[s.text] = DepthNats {
                bytes: s.prompt_bytes as u64,
                tokens: s.prompt_targets as u64,
                nats: self.depths.iter().map(|&d| (d, 0.0)).collect(),
            };
            out.reference.bytes += s.reference_bytes as u64;
            out.reference.tokens += (s.ids.len() - 1 - s.prompt_targets) as u64;
        }
        if seqs.is_empty() {
            return Ok(out);
        }
        let inputs: Vec<u32> = seqs
            .iter()
            .flat_map(|s| s.ids[..s.ids.len() - 1].iter().copied())
            .collect();
        let rows = inputs.len();
        let mut h = self.model.embed(&inputs)?;
        let mut kvs: Vec<DenseKv> = seqs.iter().map(|_| DenseKv::new(n_layers, row)).collect();
        let sampled = sampled_rows(&seqs, settings.exit_stride);
        let every: Vec<usize> = (0..rows).collect();
        // Per scored depth, in order: (NLL, top-two statistics) of each row read there
        // (the sampled rows at exits, every row at full depth).
        // Per scored depth, in order: the normed rows read there and their targets.
        let mut normed: Vec<(Tensor, Vec<u32>)> = Vec::with_capacity(self.depths.len());
        let hidden_bytes = h.elem_count() * h.dtype().size_in_bytes();
        let mut next_depth = 0;
        for l in 0..n_layers {
            self.model.load_layer(l)?;
            out.peak_layers_resident = out
                .peak_layers_resident
                .max(self.model.resident_layers().len());
            out.peak_layer_bytes = out.peak_layer_bytes.max(self.model.resident_bytes().layers);
            let mut batch = ForwardBatch::new(
                kvs.iter_mut()
                    .zip(&seqs)
                    .map(|(kv, s)| SeqChunk {
                        start: 0,
                        n: s.ids.len() - 1,
                        kv: kv as &mut dyn SeqKv,
                    })
                    .collect(),
            );
            h = self.model.forward_layers(h, l..l + 1, &mut batch)?;
            let kv_bytes: usize = kvs.iter().map(DenseKv::bytes).sum();
            out.peak_activation_bytes = out.peak_activation_bytes.max(hidden_bytes + kv_bytes);
            for kv in &mut kvs {
                kv.clear_layer(l);
            }
            self.model.drop_layer(l);
            pause(throttle, &mut work);
            if self.depths.get(next_depth) == Some(&(l + 1)) {
                let which = if l + 1 == n_layers { &every } else { &sampled };
                let targets: Vec<u32> = which.iter().map(|&r| target_of(&seqs, r)).collect();
                normed.push((self.normed_rows(next_depth, &h, which)?, targets));
                let held: usize = normed.iter().map(|(t, _)| t.elem_count() * 4).sum();
                out.peak_activation_bytes = out
                    .peak_activation_bytes
                    .max(hidden_bytes + kv_bytes + held);
                next_depth += 1;
            }
        }
        drop(kvs);
        let folds = self.read_head(&normed, &mut out, &mut || pause(throttle, &mut work))?;
        let read: Vec<Vec<(f64, TokenStats)>> = folds
            .iter()
            .map(|f| f.iter().map(RowFold::finish).collect())
            .collect();
        self.record(&read, &seqs, &sampled, settings, &mut out);
        let busy = (throttle.busy - busy0).as_secs_f64();
        out.busy_s = busy;
        out.prefill_tokens_per_s = rows as f64 / busy.max(f64::MIN_POSITIVE);
        out.wall_s = wall.elapsed().as_secs_f64();
        Ok(out)
    }

    /// Rows `which` of `h` through depth `self.depths[i]`'s exit head and the final norm.
    fn normed_rows(&self, i: usize, h: &Tensor, which: &[usize]) -> Result<Tensor> {
        let picked = if which.len() == h.dims()[0] {
            h.clone()
        } else {
            let idx: Vec<u32> = which.iter().map(|&r| r as u32).collect();
            h.index_select(&Tensor::new(idx, h.device())?, 0)?
        };
        Ok(self.heads.normed(&self.model, self.depths[i], &picked)?)
    }

    /// Folds the softmax of every depth's normed rows in one sweep of the LM head, one
    /// vocabulary slice at a time over `HEAD_ROWS` rows at a time (the head is read once,
    /// whatever the number of depths). `after_slice` runs after each slice (the throttle's
    /// pause).
    fn read_head(
        &self,
        normed: &[(Tensor, Vec<u32>)],
        out: &mut ShadowScore,
        after_slice: &mut dyn FnMut(),
    ) -> Result<Vec<Vec<RowFold>>> {
        let mut folds: Vec<Vec<RowFold>> = normed
            .iter()
            .map(|(_, targets)| targets.iter().map(|&t| RowFold::new(t)).collect())
            .collect();
        // Each part: (depth index, first row, rows).
        let mut parts = Vec::new();
        let mut index = Vec::new();
        for (i, (rows, _)) in normed.iter().enumerate() {
            let n = rows.dims()[0];
            for r in (0..n).step_by(HEAD_ROWS) {
                parts.push(rows.narrow(0, r, HEAD_ROWS.min(n - r))?);
                index.push((i, r));
            }
        }
        let last = parts.len().saturating_sub(1);
        let largest = parts.iter().map(|p| p.dims()[0]).max().unwrap_or(0);
        let logits_bytes = largest * switchyard_models::HEAD_SLICE_ROWS * 4;
        let held: usize = normed.iter().map(|(t, _)| t.elem_count() * 4).sum();
        out.peak_activation_bytes = out.peak_activation_bytes.max(held + logits_bytes);
        let peak = self.model.lm_head_slices(&parts, |part, first, logits| {
            let (i, r) = index[part];
            let logits: Vec<Vec<f32>> = logits.to_vec2()?;
            for (k, row) in logits.iter().enumerate() {
                folds[i][r + k].add(first, row);
            }
            if part == last {
                after_slice();
            }
            Ok(())
        })?;
        out.peak_head_bytes = out.peak_head_bytes.max(peak);
        Ok(folds)
    }

    /// Adds up what each depth read (`read[i]` for `self.depths[i]`: the `sampled` rows at
    /// exit depths, every row at full depth): each segment's (prompt's, reference's) nats at
    /// full depth, each exit depth's nats as full depth's plus the measured difference on
    /// the segment's sampled rows scaled to all its rows, and the first passing depth of
    /// each sampled prompt row in the exit histogram.
    fn record(
        &self,
        read: &[Vec<(f64, TokenStats)>],
        seqs: &[Tokenized],
        sampled: &[usize],
        settings: &ScoreSettings,
        out: &mut ShadowScore,
    ) {
        let Some((full, exits)) = read.split_last() else {
            return;
        };
        let n_layers = self.model.n_layers();
        let mut k = 0;
        for (s, range) in seqs.iter().zip(row_ranges(seqs)) {
            let split = range.start + s.prompt_targets;
            for (seg, nats) in [
                (range.start..split, &mut out.prompt.nats),
                (split..range.end, &mut out.reference.nats),
            ] {
                if seg.is_empty() {
                    continue;
                }
                let full_nats: f64 = full[seg.clone()].iter().map(|r| r.0).sum();
                let first = k;
                while k < sampled.len() && sampled[k] < seg.end {
                    k += 1;
                }
                let rows = &sampled[first..k];
                let scale = seg.len() as f64 / rows.len().max(1) as f64;
                // The segment's nats at each scored depth, full depth last.
                let seg_nats: Vec<f64> = exits
                    .iter()
                    .map(|exit| {
                        let diff: f64 = (first..k)
                            .zip(rows)
                            .map(|(j, &r)| exit[j].0 - full[r].0)
                            .sum();
                        full_nats + scale * diff
                    })
                    .chain(std::iter::once(full_nats))
                    .collect();
                for (total, n) in nats.iter_mut().zip(&seg_nats) {
                    total.1 += n;
                }
                if seg.start != range.start {
                    continue;
                }
                for (total, n) in out.per_prompt[s.text].nats.iter_mut().zip(&seg_nats) {
                    total.1 += n;
                }
                // The prompt's sampled rows: the exit histogram.
                for j in first..k {
                    let passed = exits
                        .iter()
                        .position(|e| passes(settings.measure.of(&e[j].1), settings.threshold));
                    out.exits
                        .record(passed.map_or(n_layers, |i| self.depths[i]));
                }
            }
        }
    }

    fn tokenize(&self, texts: &[ShadowText], max_bytes: usize) -> Result<Vec<Tokenized>> {
        let tok = &self.tokenizer;
        let context = self.model.spec().context_length;
        let mut out = Vec::with_capacity(texts.len());
        for (text, t) in texts.iter().enumerate() {
            let prompt = cut_text(&t.prompt, max_bytes);
            let mut ids = tok.encode(prompt, true, false)?;
            let bos_added = tok.adds_bos() && ids.first() == tok.bos_id().as_ref();
            // As `switchyard eval ppl` counts: the whole text when a BOS was prepended,
            // otherwise all but the first token's text.
            let prompt_bytes = if bos_added {
                prompt.len()
            } else {
                match ids.first() {
                    Some(&first) => prompt
                        .len()
                        .saturating_sub(tok.decode(&[first], false)?.len()),
                    None => 0,
                }
            };
            if ids.len() < 2 {
                continue;
            }
            let prompt_targets = ids.len() - 1;
            let mut reference_bytes = 0;
            if let Some(r) = &t.reference {
                let r = cut_text(r, max_bytes);
                let rid = tok.encode(r, false, false)?;
                if !rid.is_empty() {
                    reference_bytes = r.len();
                    ids.extend(rid);
                }
            }
            if ids.len() > context {
                return Err(HeliosError::Profile(format!(
                    "{}: a shadow text of {} tokens exceeds the context of {context}; lower \
                     max_text_bytes",
                    self.name,
                    ids.len()
                )));
            }
            out.push(Tokenized {
                text,
                ids,
                prompt_targets,
                prompt_bytes,
                reference_bytes,
            });
        }
        Ok(out)
    }
}

/// A text as one candidate's tokens.
struct Tokenized {
    /// Index of the text among those given.
    text: usize,
    /// Prompt tokens (BOS first when the model adds one), then the reference's.
    ids: Vec<u32>,
    /// Targets `ids[1..=prompt_targets]` belong to the prompt, the rest to the reference.
    prompt_targets: usize,
    prompt_bytes: usize,
    reference_bytes: usize,
}

/// The rows exit depths read: every `stride`-th row of each sequence's prompt and of its
/// reference, each segment's first row always, in increasing order.
fn sampled_rows(seqs: &[Tokenized], stride: usize) -> Vec<usize> {
    let stride = stride.max(1);
    let mut out = Vec::new();
    for (s, range) in seqs.iter().zip(row_ranges(seqs)) {
        let split = range.start + s.prompt_targets;
        out.extend((range.start..split).step_by(stride));
        out.extend((split..range.end).step_by(stride));
    }
    out
}

/// The target of batch row `r`: the token after it in its sequence.
fn target_of(seqs: &[Tokenized], r: usize) -> u32 {
    let mut at = r;
    for s in seqs {
        let n = s.ids.len() - 1;
        if at < n {
            return s.ids[at + 1];
        }
        at -= n;
    }
    0
}

/// Each sequence's rows in the batch (its inputs, all but its last token).
fn row_ranges(seqs: &[Tokenized]) -> Vec<std::ops::Range<usize>> {
    let mut at = 0;
    seqs.iter()
        .map(|s| {
            let r = at..at + s.ids.len() - 1;
            at = r.end;
            r
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttle_keeps_the_share() {
        let mut t = Throttle::new(0.25);
        let s = t.after(Duration::from_millis(10));
        assert_eq!(s, Duration::from_millis(30));
        t.after(Duration::from_millis(30));
        assert!((t.share_used() - 0.25).abs() < 1e-9);
        let mut full = Throttle::new(1.0);
        assert_eq!(full.after(Duration::from_millis(5)), Duration::ZERO);
        assert_eq!(full.share_used(), 1.0);
        assert_eq!(Throttle::new(0.5).share_used(), 0.0);
    }

    /// Folding a row slice by slice gives what one pass over the whole row gives.
    #[test]
    fn a_folded_row_equals_the_whole_row() {
        let row: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919 % 1009) as f32 / 50.0 - 10.0) * if i % 3 == 0 { 1.5 } else { 1.0 })
            .collect();
        for target in [0u32, 17, 999] {
            let (want_nll, want) = crate::profile::nll_and_stats(&row, target);
            for slice in [1000, 333, 64, 1] {
                let mut f = RowFold::new(target);
                for (k, chunk) in row.chunks(slice).enumerate() {
                    f.add(k * slice, chunk);
                }
                let (nll, got) = f.finish();
                assert!(
                    (nll - want_nll).abs() < 1e-6,
                    "slice {slice}: {nll} vs {want_nll}"
                );
                assert_eq!(got.argmax, want.argmax);
                assert!((got.max_prob - want.max_prob).abs() < 1e-6);
                assert!((got.margin - want.margin).abs() < 1e-6);
            }
        }
        let mut f = RowFold::new(5000);
        f.add(0, &row);
        assert_eq!(
            f.finish().0,
            f64::INFINITY,
            "a target outside the vocabulary"
        );
    }

    #[test]
    fn texts_are_cut_at_character_boundaries() {
        assert_eq!(cut_text("héllo", 2), "h");
        assert_eq!(cut_text("héllo", 3), "hé");
        assert_eq!(cut_text("abc", 10), "abc");
    }

    #[test]
    fn depth_nats_give_bits_per_byte_and_merge() {
        let mut a = DepthNats::new(&[10, 30]);
        a.bytes = 100;
        a.nats = vec![(10, 100.0 * std::f64::consts::LN_2), (30, 50.0)];
        assert!((a.bits_per_byte(10).unwrap() - 1.0).abs() < 1e-12);
        assert_eq!(a.bits_per_byte(20), None);
        let b = a.clone();
        a.merge(&b);
        assert_eq!(a.bytes, 200);
        assert!((a.bits_per_byte(10).unwrap() - 1.0).abs() < 1e-12);
        let mut empty = DepthNats::default();
        empty.merge(&b);
        assert_eq!(empty, b);
        assert_eq!(DepthNats::new(&[1]).bits_per_byte(1), None);
    }
}
