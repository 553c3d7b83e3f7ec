//! The router's one error type: everything a policy file, a measured matrix or a training set
//! can get wrong, with the field or rule that is wrong in the message.

use switchyard_request::UnknownMode;

/// Everything that can go wrong while building a router. Routing itself never fails: a router
/// that cannot serve a request's mode answers with the baseline and says so in the decision.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// The policy text is not TOML, or does not have the `[router]` shape.
    #[error("router policy: {0}")]
    PolicyToml(String),
    /// A policy with no rule would route nothing.
    #[error("router policy has no rules; add at least one [[router.rules]] entry")]
    EmptyPolicy,
    /// A rule names a mode that does not exist.
    #[error("rule {index} ({id:?}): {source}")]
    UnknownMode {
        /// 1-based position of the rule in the policy.
        index: usize,
        id: String,
        source: UnknownMode,
    },
    /// A rule is malformed (empty id, duplicate id, empty condition list).
    #[error("rule {index} ({id:?}): {reason}")]
    InvalidRule {
        /// 1-based position of the rule in the policy.
        index: usize,
        id: String,
        reason: String,
    },
    /// A classifier threshold or an oracle constraint is out of its range.
    #[error("{field} must be {expected}, got {value}")]
    InvalidThreshold {
        field: &'static str,
        value: f64,
        expected: &'static str,
    },
    /// The measured matrix is not JSON of the expected shape.
    #[error("mode matrix: {0}")]
    MatrixJson(String),
    /// A measured cell cannot be compared against the baseline.
    #[error("mode matrix cell {cell:?}: {reason}")]
    InvalidCell { cell: String, reason: String },
    /// A learned router needs at least one labelled example.
    #[error("learned router: the training set is empty")]
    EmptyTrainingSet,
    /// The learning library refused the data.
    #[error("learned router ({kind}): training failed: {message}")]
    Training { kind: &'static str, message: String },
    /// A saved learned router cannot be read or written, or is not one this build can use.
    #[error("learned router file {path}: {reason}")]
    RouterFile { path: String, reason: String },
}

pub type Result<T> = std::result::Result<T, RouterError>;
