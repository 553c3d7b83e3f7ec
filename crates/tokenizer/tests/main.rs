//! Integration tests of `switchyard-tokenizer`, one binary: each file is a module, so the suite links
//! and starts once per crate instead of once per file.

mod common;
mod formats;
mod gemma3;
mod hostile_text;
mod qwen2;
mod smollm2;
