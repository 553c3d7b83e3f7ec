//! Integration tests of `switchyard-engine`, one binary: each file is a module, so the suite links
//! and starts once per crate instead of once per file.

mod constrained;
mod kv_budget_props;
mod kv_compressed;
mod kv_paged_model;
mod max_model_len;
mod pinned_decode;
mod real_model;
mod sequential;
mod serving;
mod serving_budget_props;
mod serving_handle;
