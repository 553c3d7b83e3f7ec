//! Integration tests of `switchyard-weights`, one binary: each file is a module, so the suite links
//! and starts once per crate instead of once per file.

mod corrupt_gguf;
mod gguf_array_length;
