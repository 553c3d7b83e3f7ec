//! Integration tests of `switchyard-exit-study`, one binary: each file is a module, so the suite
//! links and starts once per crate instead of once per file.

mod smollm2;
