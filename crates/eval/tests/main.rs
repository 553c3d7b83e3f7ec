//! Integration tests of `switchyard-eval`, one binary: each file is a module, so the suite links
//! and starts once per crate instead of once per file.

mod quality_datasets;
mod quality_metrics;
mod quality_model;
mod sharegpt;
