//! Loading a model's layers while it serves: a [`LayerLoadJob`] reads layers from the weight
//! source on any thread (the engine runs it on a background thread, so loading overlaps with
//! compute), and the engine installs each [`LoadedLayer`] between steps.
//!
//! The memory for the layers is taken from the KV pool before the job starts (see
//! [`crate::EngineCore::begin_load`]), so the budget holds while the job runs.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;
use serde::Serialize;
use switchyard_models::block::Block;
use switchyard_models::model::load_block;
use switchyard_models::{ArchConfig, TensorLoader, WeightFormat};
use switchyard_weights::WeightSource;

use crate::{RequestId, Result};

/// Layers to load from a weight source; `Send`, owns everything it needs.
#[derive(Debug, Clone)]
pub struct LayerLoadJob {
    pub(crate) source: Arc<dyn WeightSource>,
    pub(crate) device: Device,
    pub(crate) format: WeightFormat,
    pub(crate) cfg: ArchConfig,
    pub(crate) layers: Range<usize>,
}

impl LayerLoadJob {
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// Loads layer `l` (from the memory-mapped file for GGUF sources) and times it.
    pub fn load(&self, l: usize) -> Result<LoadedLayer> {
        let t0 = Instant::now();
        let ld = TensorLoader {
            src: &*self.source,
            device: &self.device,
            format: self.format,
        };
        let block = load_block(&ld, &self.cfg, l)?;
        Ok(LoadedLayer {
            layer: l,
            bytes: block.resident_bytes(),
            block,
            secs: t0.elapsed().as_secs_f64(),
        })
    }

    /// Loads every layer in order, handing each over as soon as it is ready; stops at the
    /// first failure or when `send` returns `false` (nobody wants the rest).
    pub fn run(&self, mut send: impl FnMut(Result<LoadedLayer>) -> bool) {
        for l in self.layers.clone() {
            let r = self.load(l);
            let failed = r.is_err();
            if !send(r) || failed {
                return;
            }
        }
    }
}

/// A layer read by a [`LayerLoadJob`], ready to install.
#[derive(Clone)]
pub struct LoadedLayer {
    pub layer: usize,
    pub block: Arc<dyn Block>,
    pub bytes: usize,
    pub secs: f64,
}

impl std::fmt::Debug for LoadedLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedLayer")
            .field("layer", &self.layer)
            .field("bytes", &self.bytes)
            .field("secs", &self.secs)
            .finish()
    }
}

/// One layer's load, as reported.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LayerLoadTime {
    pub layer: usize,
    pub bytes: usize,
    pub secs: f64,
}

/// What a residency change did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LoadReport {
    pub layers: Vec<LayerLoadTime>,
    /// Sequences preempted to make room for the layers' weights.
    pub preempted: Vec<RequestId>,
    /// KV blocks the pool gave up (negative when it grew).
    pub pool_blocks_freed: i64,
}

impl LoadReport {
    /// Mean seconds to load one layer.
    pub fn mean_layer_secs(&self) -> f64 {
        if self.layers.is_empty() {
            return 0.0;
        }
        self.layers.iter().map(|l| l.secs).sum::<f64>() / self.layers.len() as f64
    }
}
