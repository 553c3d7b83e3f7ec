//! Integration tests of `switchyard-bench`, one binary: each file is a module, so the suite links
//! and starts once per crate instead of once per file.

mod serve_client;
