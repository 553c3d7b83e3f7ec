//! Integration tests of `switchyard-modes`, one binary: each file is a module, so the suite links
//! and starts once per crate instead of once per file.

mod batched_twin;
mod common;
mod gptq_smollm2;
mod precision_smollm2;
mod speculative_real;
mod speculative_synthetic;
mod trace_prefixes;
