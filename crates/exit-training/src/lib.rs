//! Fitting exit heads on a frozen model.
//!
//! * [`ridge`] and [`calibrate`]: affine heads (the tuned lens) fitted in closed form by ridge
//!   regression over a calibration corpus ([`corpus`]), streaming sufficient statistics in f64.
//! * [`tune`]: EE-Tuning, exit heads (affine, MLP, block) trained on the frozen model against
//!   the final layer's distribution from a memory-mapped hidden-state cache, plus an exit probe
//!   that decides without the vocabulary head; its cost model and held-out evaluation.
//!
//! What it fits is written through `switchyard_exits::file` and served by
//! `switchyard_exits::ExitHeads`; this crate is needed only to produce heads, never to serve
//! them.

pub mod calibrate;
pub mod corpus;
pub mod ridge;
pub mod tune;
