//! Integration tests of `switchyard-models`, one binary: each file is a module, so the suite links
//! and starts once per crate instead of once per file.

mod common;
mod consistency;
mod reference_exact;
mod reference_quantized;
mod safetensors_folder;
