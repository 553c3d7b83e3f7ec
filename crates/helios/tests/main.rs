//! Integration tests of `switchyard-helios`, one binary: each file is a module, so the suite links
//! and starts once per crate instead of once per file.

mod bench_helios;
mod orchestrator;
mod profile_smollm2;
mod shadow_orchestrator;
mod shadow_scoring;
