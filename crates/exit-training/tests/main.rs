//! Integration tests of `switchyard-exit-training`, one binary: each file is a module, so the
//! suite links and starts once per crate instead of once per file.

mod block_smollm2;
mod ee_tune_smollm2;
