//! Integration tests of `switchyard-server`, one binary: each file is a module, so the suite links
//! and starts once per crate instead of once per file.

mod common;
mod helios_http;
mod helios_remote;
mod hostile_input;
mod http;
mod modeswitch_http;
mod openai_client;
mod sampling_params;
mod structured_outputs;
mod tools;
