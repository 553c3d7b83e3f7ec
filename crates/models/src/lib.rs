//! Model architectures behind one layered-model contract.
//!
//! [`LayeredModel`] exposes a decoder-only transformer as embed → layers `i..j` → final norm →
//! LM head, each callable on its own, over a batch of sequences at arbitrary positions with a
//! cache the caller owns. That one contract serves full-depth decoding, early exit (stop after
//! any layer and read the hidden state), partial residency (load only the first N layers) and
//! running later layers for positions computed earlier.

pub mod attention;
pub mod batch;
pub mod block;
pub mod config;
pub mod gemma3;
pub mod kv;
pub mod llama;
pub mod model;
pub mod rope;

pub use block::{QuantTarget, TensorLoader, WeightFormat};
pub use config::ArchConfig;
pub use kv::{DenseKv, KvChunk, SeqKv};
pub use model::{
    ForwardBatch, LayeredModel, LoadOptions, ResidentBytes, SeqChunk, HEAD_SLICE_ROWS,
};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Weights(#[from] switchyard_weights::WeightsError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("layer {layer} is not resident (resident: {resident:?})")]
    LayerNotResident { layer: usize, resident: Vec<usize> },
    #[error("layer {layer} does not exist (the model has {n_layers})")]
    NoSuchLayer { layer: usize, n_layers: usize },
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("position {position} is beyond the context length {context}")]
    ContextExceeded { position: usize, context: usize },
    #[error("cache has {n_layers} layers, layer {layer} was asked for")]
    KvLayer { layer: usize, n_layers: usize },
    #[error("cache write at position {start} of layer {layer} with {values} values (row {row}) is invalid: {stored} positions stored")]
    KvWrite {
        layer: usize,
        start: usize,
        stored: usize,
        values: usize,
        row: usize,
    },
    #[error("cache of layer {layer} holds {stored} positions, {len} needed; run the missing positions through this layer first")]
    KvMissing {
        layer: usize,
        len: usize,
        stored: usize,
    },
    /// A cache implementation's own failure (e.g. a paged cache refusing a write).
    #[error(transparent)]
    Kv(Box<dyn std::error::Error + Send + Sync>),
    #[error("batch holds {batch} tokens but the hidden state has {hidden} rows")]
    BatchMismatch { batch: usize, hidden: usize },
}

pub type Result<T> = std::result::Result<T, ModelError>;
