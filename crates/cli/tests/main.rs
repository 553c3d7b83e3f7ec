//! Integration tests of `switchyard-cli`, one binary: each file is a module, so the suite links
//! and starts once per crate instead of once per file.

mod bench_step;
mod common;
mod serve_processes;
mod serve_signal;
