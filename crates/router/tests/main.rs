//! Integration tests of `switchyard-router`, one binary: each file is a module, so the suite links
//! and starts once per crate instead of once per file.

mod common;
mod fit;
mod learned;
mod oracle;
mod policy;
