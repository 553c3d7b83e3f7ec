//! The ModeSwitch router: for each request, before generation, the one fixed inference mode it
//! is served in (ModeSwitch-LLM, DESIGN.md section 2). Features in, [`Decision`] out.
//!
//! Architecture invariant: this crate is pure. It knows nothing about models, weights, HTTP or
//! scheduling, loads nothing and measures nothing; the caller says which modes can be served
//! now ([`ModeSet`]) and gets back a mode, the rule that chose it, and whether the baseline had
//! to stand in.
//!
//! Code map:
//! * `features` — [`RequestFeatures`], the six cheap per-request features, and their fixed
//!   numeric encoding ([`RequestFeatures::vector`]) for learned routers.
//! * `rules` — the classifier ([`Class`]: batch, shared-prefix, prefill-heavy, decode-heavy,
//!   interactive) and its thresholds ([`RuleConfig`]).
//! * `policy` — the ordered priority rules ([`Policy`], loaded from a `[router]` TOML table,
//!   [`DEFAULT_POLICY_TOML`]) and the rule-based router ([`RulesRouter`]).
//! * `oracle` — a measured mode x workload matrix ([`ModeMatrix`]) and the constraint-aware
//!   [`Oracle`]: the fastest mode within accuracy, energy and memory bounds of f16.
//! * `gate` — the quality [`Gate`]: bits per byte and paired accuracy intervals against f16,
//!   per class of requests.
//! * `fit` — [`fit`]: the fastest gate-passing mode per class of a measured matrix, written as
//!   a [`Policy`] (`switchyard router fit`).
//! * `prefix` — [`PrefixIndex`]: the shared-prefix feature, from the prompts seen before.
//! * `learned` — decision tree, random forest and logistic regression routers trained to
//!   imitate the oracle ([`LearnedRouter`]).
//! * `decision` — the [`Router`] trait all of the above implement, [`Decision`], [`ModeSet`]
//!   and the no-controller [`FixedRouter`].
//!
//! API boundary: a server or benchmark holds a `Box<dyn Router>` and calls
//! [`Router::route_among`] once per request.

pub mod decision;
pub mod error;
pub mod features;
pub mod fit;
pub mod gate;
pub mod learned;
pub mod oracle;
pub mod policy;
pub mod prefix;
pub mod rules;

pub use decision::{Decision, FixedRouter, ModeSet, Router};
pub use error::{Result, RouterError};
pub use features::{RequestFeatures, Shape, WorkloadFamily, FEATURE_COUNT, FEATURE_NAMES};
pub use fit::{fit, FitChoice, FitReport};
pub use gate::{Gate, GateFailure, PairedDelta, QualityMeasure};
pub use learned::{Example, LearnedKind, LearnedParams, LearnedRouter};
pub use oracle::{CellMeasure, Constraints, ModeMatrix, Oracle};
pub use policy::{Condition, Policy, Rule, RulesRouter, DEFAULT_POLICY_TOML};
pub use prefix::PrefixIndex;
pub use rules::{Class, RuleConfig};
pub use switchyard_request::Mode;
