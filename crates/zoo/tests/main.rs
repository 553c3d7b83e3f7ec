//! Integration tests of `switchyard-zoo`, one binary: each file is a module, so the suite links
//! and starts once per crate instead of once per file.

mod corrupt_cache;
mod pull_offline;
mod real_default_model;
