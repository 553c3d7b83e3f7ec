//! [`LayeredModel`]: a model whose layers are loaded, run and dropped one by one.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use switchyard_kernels::QLinear;
use switchyard_weights::{names, Architecture, ModelSpec, WeightSource};

use crate::block::{check_rows, Block, LayerCtx, RmsNorm, TensorLoader, WeightFormat};
use crate::config::ArchConfig;
use crate::rope::RopeTable;
use crate::{gemma3, llama, ModelError, Result};

pub use crate::batch::{ForwardBatch, SeqChunk};

/// What [`LayeredModel::run_layers`] does at each layer.
#[derive(Debug, Clone, Copy)]
enum LayerPass {
    /// The whole block; its output feeds the next layer.
    Full,
    /// Only the block's K/V write, from the same input at every layer.
    KvOnly,
}

#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Load only the first `n` layers (all when `None`).
    pub layers: Option<usize>,
    /// How matrix weights are held (the LM head included).
    pub format: WeightFormat,
}

/// Bytes of weights held in memory, by part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ResidentBytes {
    pub embedding: usize,
    /// LM head when it is not the embedding matrix, plus the final norm.
    pub head: usize,
    pub layers: usize,
}

impl ResidentBytes {
    pub fn total(&self) -> usize {
        self.embedding + self.head + self.layers
    }
}

pub struct LayeredModel {
    source: Arc<dyn WeightSource>,
    cfg: ArchConfig,
    device: Device,
    format: WeightFormat,
    /// Token embeddings, in their stored type (lookups dequantize exactly); `None` after
    /// [`LayeredModel::drop_io`], when lookups read their rows from the source.
    embedding: Option<QLinear>,
    /// Whether `head` shares the embedding's weight.
    head_is_embedding: bool,
    layers: Vec<Option<Arc<dyn Block>>>,
    final_norm: RmsNorm,
    /// `None` after [`LayeredModel::drop_io`], when the head is read in vocabulary slices.
    head: Option<QLinear>,
}

/// Vocabulary rows of the LM head read at once when it is streamed from the source.
pub const HEAD_SLICE_ROWS: usize = 8192;

impl std::fmt::Debug for LayeredModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayeredModel")
            .field("source", &self.source.description())
            .field("architecture", &self.cfg.spec.architecture)
            .field("resident_layers", &self.resident_layers())
            .finish()
    }
}

/// The token embedding and the LM head of `ld`'s source, and whether the head is the
/// embedding's own weight (tied, as stored).
fn load_io(ld: &TensorLoader<'_>, format: WeightFormat) -> Result<(QLinear, QLinear, bool)> {
    let spec = ld.src.spec();
    let embedding = QLinear::new(ld.src.load(names::TOKEN_EMBD, ld.device)?, None)?;
    let head_is_embedding = spec.tied_embeddings && format == WeightFormat::AsStored;
    let head = match (spec.tied_embeddings, head_is_embedding) {
        (_, true) => embedding.clone(),
        (true, false) => ld.head(names::TOKEN_EMBD)?,
        (false, _) => ld.head(names::OUTPUT)?,
    };
    Ok((embedding, head, head_is_embedding))
}

/// Architecture defaults for a spec.
pub fn arch_config(spec: &ModelSpec) -> ArchConfig {
    match spec.architecture {
        Architecture::Llama | Architecture::Qwen2 => llama::config(spec),
        Architecture::Gemma3 => gemma3::config(spec),
    }
}

/// Loads layer `l` of `source`; callable from any thread (residency changes load in the
/// background and install between steps).
pub fn load_block(ld: &TensorLoader<'_>, cfg: &ArchConfig, l: usize) -> Result<Arc<dyn Block>> {
    if l >= cfg.spec.n_layers {
        return Err(ModelError::NoSuchLayer {
            layer: l,
            n_layers: cfg.spec.n_layers,
        });
    }
    let _span = tracing::debug_span!("load_layer", layer = l).entered();
    Ok(match cfg.spec.architecture {
        Architecture::Llama | Architecture::Qwen2 => Arc::new(llama::LlamaBlock::load(ld, cfg, l)?),
        Architecture::Gemma3 => Arc::new(gemma3::Gemma3Block::load(ld, cfg, l)?),
    })
}

impl LayeredModel {
    pub fn load(source: Arc<dyn WeightSource>, opts: &LoadOptions) -> Result<Self> {
        Self::load_on(source, opts, &Device::Cpu)
    }

    pub fn load_on(
        source: Arc<dyn WeightSource>,
        opts: &LoadOptions,
        device: &Device,
    ) -> Result<Self> {
        let spec = source.spec().clone();
        let cfg = arch_config(&spec);
        let ld = TensorLoader {
            src: &*source,
            device,
            format: opts.format,
        };
        let (embedding, head, head_is_embedding) = load_io(&ld, opts.format)?;
        let final_norm = ld.norm(names::OUTPUT_NORM)?;
        let n = opts.layers.unwrap_or(spec.n_layers).min(spec.n_layers);
        let mut layers: Vec<Option<Arc<dyn Block>>> = vec![None; spec.n_layers];
        for (l, slot) in layers.iter_mut().enumerate().take(n) {
            *slot = Some(load_block(&ld, &cfg, l)?);
        }
        Ok(Self {
            format: opts.format,
            head_is_embedding,
            source,
            cfg,
            device: device.clone(),
            embedding: Some(embedding),
            layers,
            final_norm,
            head: Some(head),
        })
    }

    /// Frees the token embedding and the LM head (the final norm stays). With its layers
    /// dropped too, the model holds almost nothing: an engine that does not serve, or a
    /// scorer between batches. [`LayeredModel::embed`] then reads each token's row from the
    /// source, and the head is read in slices of [`HEAD_SLICE_ROWS`] vocabulary rows
    /// ([`LayeredModel::lm_head_slices`]); [`LayeredModel::load_io`] holds them again. Their
    /// memory goes back to the system.
    pub fn drop_io(&mut self) {
        self.embedding = None;
        self.head = None;
        switchyard_kernels::mem::return_free_memory();
    }

    /// Holds the token embedding and the LM head again (after [`LayeredModel::drop_io`]).
    pub fn load_io(&mut self) -> Result<()> {
        if self.embedding.is_none() || self.head.is_none() {
            let (embedding, head, _) = load_io(&self.loader(), self.format)?;
            self.embedding = Some(embedding);
            self.head = Some(head);
        }
        Ok(())
    }

    /// Whether the embedding and the LM head are held (see [`LayeredModel::drop_io`]).
    pub fn io_resident(&self) -> bool {
        self.embedding.is_some() && self.head.is_some()
    }

    pub fn config(&self) -> &ArchConfig {
        &self.cfg
    }

    /// A loader for this model's source, device and weight format (for loading layers on
    /// another thread with [`load_block`]).
    pub fn loader(&self) -> TensorLoader<'_> {
        TensorLoader {
            src: &*self.source,
            device: &self.device,
            format: self.format,
        }
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.cfg.spec
    }

    pub fn source(&self) -> &Arc<dyn WeightSource> {
        &self.source
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn is_resident(&self, l: usize) -> bool {
        self.layers.get(l).is_some_and(Option::is_some)
    }

    pub fn resident_layers(&self) -> Vec<usize> {
        (0..self.layers.len())
            .filter(|&l| self.is_resident(l))
            .collect()
    }

    /// Loads layer `l` from the source if it is not resident.
    pub fn load_layer(&mut self, l: usize) -> Result<()> {
        if !self.is_resident(l) {
            let ld = self.loader();
            let block = load_block(&ld, &self.cfg, l)?;
            self.install_layer(l, block)?;
        }
        Ok(())
    }

    /// Puts a block loaded elsewhere (see [`load_block`]) in place.
    pub fn install_layer(&mut self, l: usize, block: Arc<dyn Block>) -> Result<()> {
        let n_layers = self.layers.len();
        let slot = self
            .layers
            .get_mut(l)
            .ok_or(ModelError::NoSuchLayer { layer: l, n_layers })?;
        *slot = Some(block);
        Ok(())
    }

    /// Frees layer `l`'s weights, and hands their memory back to the system.
    pub fn drop_layer(&mut self, l: usize) {
        if let Some(slot) = self.layers.get_mut(l) {
            if slot.take().is_some() {
                switchyard_kernels::mem::return_free_memory();
            }
        }
    }

    /// Bytes layer `l` takes when resident (as its kernels hold it), computed from the tensor
    /// types and shapes in the source without loading anything.
    pub fn layer_bytes(&self, l: usize) -> usize {
        names::layer_tensors(self.spec())
            .iter()
            .filter_map(|(suffix, _)| self.source.tensor_meta(&names::layer(l, suffix)))
            .map(|m| match self.format {
                WeightFormat::AsStored => QLinear::planned_bytes(m.dtype, &m.shape),
                WeightFormat::F32 => m.shape.iter().product::<usize>() * 4,
                WeightFormat::F16 if m.shape.len() == 2 => {
                    switchyard_kernels::planned_f16_bytes(m.shape[0], m.shape[1])
                }
                WeightFormat::F16 => m.shape.iter().product::<usize>() * 4,
                WeightFormat::Quantized(t) => match m.shape[..] {
                    [_, k] => QLinear::planned_bytes(t.dtype_for(k, false), &m.shape),
                    _ => QLinear::planned_bytes(m.dtype, &m.shape),
                },
            })
            .sum()
    }

    pub fn resident_bytes(&self) -> ResidentBytes {
        let head = self.final_norm.bytes()
            + match &self.head {
                Some(h) if !self.head_is_embedding => h.resident_bytes(),
                _ => 0,
            };
        ResidentBytes {
            embedding: self.embedding.as_ref().map_or(0, QLinear::resident_bytes),
            head,
            layers: self
                .layers
                .iter()
                .flatten()
                .map(|b| b.resident_bytes())
                .sum(),
        }
    }

    /// Hidden states `[tokens, d_model]` for `tokens`.
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        let _t = switchyard_kernels::prof::time(switchyard_kernels::prof::Part::Embed);
        let vocab = self.spec().vocab_size;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::TokenOutOfRange { id, vocab });
        }
        let x = match &self.embedding {
            Some(e) => e.rows(tokens)?,
            None => self.streamed_rows(tokens)?,
        };
        Ok(match self.cfg.embed_scale {
            Some(s) => (x * s as f64)?,
            None => x,
        })
    }

    /// Runs `x` through `layers` (all resident) for the sequences of `batch`, writing each
    /// layer's K/V for the batch's positions.
    pub fn forward_layers(
        &self,
        x: Tensor,
        layers: Range<usize>,
        batch: &mut ForwardBatch<'_>,
    ) -> Result<Tensor> {
        self.run_layers(x, layers, batch, LayerPass::Full)
    }

    /// Writes only the K/V of `layers` for the batch's positions, every layer computing them
    /// from the same `x` (no attention, no MLP; `x` is not advanced from layer to layer).
    ///
    /// This is CALM's state propagation (Schuster et al. 2022): when a token exits early at
    /// depth `d`, its hidden state there stands in for the inputs of layers `d..` it skipped,
    /// so later tokens that go deeper find K/V at its position.
    pub fn write_kv_layers(
        &self,
        x: &Tensor,
        layers: Range<usize>,
        batch: &mut ForwardBatch<'_>,
    ) -> Result<()> {
        self.run_layers(x.clone(), layers, batch, LayerPass::KvOnly)
            .map(|_| ())
    }

    fn run_layers(
        &self,
        mut x: Tensor,
        layers: Range<usize>,
        batch: &mut ForwardBatch<'_>,
        pass: LayerPass,
    ) -> Result<Tensor> {
        check_rows(&x, batch)?;
        let context = self.spec().context_length;
        if let Some(s) = batch.seqs.iter().find(|s| s.start + s.n > context) {
            return Err(ModelError::ContextExceeded {
                position: s.start + s.n - 1,
                context,
            });
        }
        let positions = batch.positions();
        let ropes: Vec<RopeTable> = self
            .cfg
            .rope_thetas()
            .into_iter()
            .map(|theta| RopeTable::new(theta, self.spec().head_dim, &positions))
            .collect();
        for l in layers {
            let block = self.layers.get(l).and_then(Option::as_ref).ok_or_else(|| {
                ModelError::LayerNotResident {
                    layer: l,
                    resident: self.resident_layers(),
                }
            })?;
            let _span = tracing::trace_span!("layer", l).entered();
            let theta = self.cfg.rope_theta(l);
            let rope = ropes.iter().find(|r| r.theta == theta).ok_or_else(|| {
                candle_core::Error::Msg(format!("no rope table for base {theta}"))
            })?;
            let mut ctx = LayerCtx {
                layer: l,
                batch,
                rope,
                shape: self.cfg.attn_shape(l),
            };
            match pass {
                LayerPass::Full => x = block.forward(&x, &mut ctx)?,
                LayerPass::KvOnly => block.write_kv(&x, &mut ctx)?,
            }
        }
        Ok(x)
    }

    pub fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        self.final_norm.forward(x)
    }

    /// The LM head on already-normed states.
    pub fn lm_head(&self, normed: &Tensor) -> Result<Tensor> {
        let _span = tracing::trace_span!("lm_head").entered();
        match &self.head {
            Some(h) => Ok(h.forward_as(normed, switchyard_kernels::prof::Part::LmHead)?),
            None => {
                let mut slices = Vec::new();
                self.lm_head_slices(std::slice::from_ref(normed), |_, _, logits| {
                    slices.push(logits);
                    Ok(())
                })?;
                Ok(Tensor::cat(&slices, 1)?)
            }
        }
    }

    /// The LM head over each of `parts` (already-normed states), one slice of the vocabulary
    /// at a time: `each(part, first_token_id, logits [rows, slice])`, slices in vocabulary
    /// order. When the head is held that is one call per part over the whole vocabulary;
    /// when it is not (see [`LayeredModel::drop_io`]) each slice of [`HEAD_SLICE_ROWS`] rows
    /// is read from the source, run over every part and freed, so a pass needs one slice of
    /// the head and one part's slice of logits. Returns the most bytes of head held at once.
    pub fn lm_head_slices(
        &self,
        parts: &[Tensor],
        mut each: impl FnMut(usize, usize, Tensor) -> Result<()>,
    ) -> Result<usize> {
        if let Some(h) = &self.head {
            for (i, p) in parts.iter().enumerate() {
                each(
                    i,
                    0,
                    h.forward_as(p, switchyard_kernels::prof::Part::LmHead)?,
                )?;
            }
            return Ok(h.resident_bytes());
        }
        let vocab = self.spec().vocab_size;
        let ld = self.loader();
        let name = self.head_name();
        let (mut start, mut peak) = (0, 0);
        while start < vocab {
            let end = (start + HEAD_SLICE_ROWS).min(vocab);
            let slice = ld.head_rows(name, start..end)?;
            peak = peak.max(slice.resident_bytes());
            for (i, p) in parts.iter().enumerate() {
                each(
                    i,
                    start,
                    slice.forward_as(p, switchyard_kernels::prof::Part::LmHead)?,
                )?;
            }
            start = end;
        }
        Ok(peak)
    }

    fn head_name(&self) -> &'static str {
        if self.spec().tied_embeddings {
            names::TOKEN_EMBD
        } else {
            names::OUTPUT
        }
    }

    /// Embedding rows of `tokens` read from the source one token at a time (the embedding is
    /// not held), dequantized as the held embedding would be.
    fn streamed_rows(&self, tokens: &[u32]) -> Result<Tensor> {
        let mut rows = Vec::with_capacity(tokens.len());
        for &t in tokens {
            let t = t as usize;
            let row = self
                .source
                .load_rows(names::TOKEN_EMBD, t..t + 1, &self.device)?;
            rows.push(QLinear::new(row, None)?.rows(&[0])?);
        }
        if rows.is_empty() {
            return Ok(Tensor::zeros(
                (0, self.spec().d_model),
                DType::F32,
                &self.device,
            )?);
        }
        Ok(Tensor::cat(&rows, 0)?)
    }

    /// The final norm's scale (f32) and epsilon.
    pub fn final_norm_parts(&self) -> (&Tensor, f32) {
        self.final_norm.parts()
    }

    /// The LM head's matrix dequantized to dense f32, `[vocab, d_model]`: the frozen
    /// projection that exit-head training differentiates through.
    pub fn lm_head_f32(&self) -> Result<Tensor> {
        Ok(self
            .source
            .load(self.head_name(), &self.device)?
            .dequantize(&self.device)?
            .to_dtype(DType::F32)?)
    }

    /// Final norm then LM head: `[rows, vocab]` logits.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head(&self.final_norm(hidden)?)
    }

    /// Embed, all layers, logits of every row: the plain full-depth forward.
    pub fn forward(&self, tokens: &[u32], batch: &mut ForwardBatch<'_>) -> Result<Tensor> {
        let x = self.embed(tokens)?;
        let h = self.forward_layers(x, 0..self.n_layers(), batch)?;
        self.logits(&h)
    }
}
