//! How well early exit works, and the single-model early-exit baseline (EE-LLM) that HELIOS
//! is measured against.
//!
//! * [`study`] and [`plot`]: the exit study (agreement, confidence buckets, cumulative exit
//!   distribution, complementarity of two models), as Markdown, JSON and PNG.
//! * [`decode`], [`baseline`] and [`bench`]: per-token early exit at batch 1 with either fix
//!   for the K/V of skipped layers (EE-LLM's recomputation, CALM's state propagation),
//!   generation and teacher-forced scoring with it, and its benchmark.

pub mod baseline;
pub mod bench;
pub mod decode;
pub mod plot;
pub mod study;

pub use decode::{EarlyExitDecoder, ExitPolicy, KvFix};
