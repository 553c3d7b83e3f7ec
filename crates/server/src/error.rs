//! The one place where failures become HTTP status codes and OpenAI error objects.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::api::{ErrorBody, ErrorDetail};

/// Seconds a client told "queue full" should wait before retrying.
pub const RETRY_AFTER_SECS: u64 = 1;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON, not an object, or not UTF-8 (400).
    #[error("{0}")]
    Malformed(String),
    /// A field is missing, has the wrong type or a value out of range (422).
    #[error("{message}")]
    Invalid { param: String, message: String },
    /// A well-formed value the server cannot use, such as a JSON schema or grammar that does
    /// not compile (400).
    #[error("{message}")]
    Rejected { param: String, message: String },
    /// Valid JSON asking for something this server does not do (400), e.g. `best_of > n`.
    #[error("{message}")]
    Unsupported { param: String, message: String },
    /// The prompt and requested tokens do not fit the model (400).
    #[error("{0}")]
    ContextLength(String),
    #[error("the model `{0}` does not exist")]
    UnknownModel(String),
    #[error("the request body is larger than {limit} bytes")]
    TooLarge { limit: usize },
    #[error("unsupported content type {0:?}: send application/json")]
    ContentType(String),
    #[error("missing or invalid API key")]
    Unauthorized,
    #[error("the server is at capacity ({0} requests in flight); retry shortly")]
    Overloaded(usize),
    #[error("the request took longer than {0} s")]
    Timeout(u64),
    #[error("the request body did not arrive within {0} s")]
    BodyTimeout(u64),
    #[error("the backend for `{model}` is unavailable: {detail}")]
    BackendUnavailable { model: String, detail: String },
    #[error("the server is shutting down")]
    ShuttingDown,
    /// A model's engine thread failed; `/health` reports it down (503).
    #[error("{0}")]
    EngineDown(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Malformed(_)
            | ApiError::Rejected { .. }
            | ApiError::Unsupported { .. }
            | ApiError::ContextLength(_) => StatusCode::BAD_REQUEST,
            ApiError::Invalid { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::UnknownModel(_) => StatusCode::NOT_FOUND,
            ApiError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::ContentType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::BackendUnavailable { .. } => StatusCode::BAD_GATEWAY,
            ApiError::ShuttingDown | ApiError::EngineDown(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's error `type`.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::Malformed(_)
            | ApiError::Invalid { .. }
            | ApiError::Rejected { .. }
            | ApiError::Unsupported { .. }
            | ApiError::ContextLength(_)
            | ApiError::TooLarge { .. }
            | ApiError::ContentType(_) => "invalid_request_error",
            ApiError::UnknownModel(_) => "not_found_error",
            ApiError::Unauthorized => "authentication_error",
            ApiError::Overloaded(_) => "rate_limit_error",
            ApiError::Timeout(_) | ApiError::BodyTimeout(_) => "timeout_error",
            ApiError::BackendUnavailable { .. }
            | ApiError::ShuttingDown
            | ApiError::EngineDown(_) => "service_unavailable",
            ApiError::Internal(_) => "server_error",
        }
    }

    fn param(&self) -> Option<String> {
        match self {
            ApiError::Invalid { param, .. }
            | ApiError::Rejected { param, .. }
            | ApiError::Unsupported { param, .. } => Some(param.clone()),
            ApiError::UnknownModel(_) => Some("model".into()),
            ApiError::ContextLength(_) => Some("messages".into()),
            _ => None,
        }
    }

    fn code(&self) -> Option<String> {
        match self {
            ApiError::UnknownModel(_) => Some("model_not_found".into()),
            ApiError::ContextLength(_) => Some("context_length_exceeded".into()),
            ApiError::Unauthorized => Some("invalid_api_key".into()),
            _ => None,
        }
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.to_string(),
                kind: self.kind().into(),
                param: self.param(),
                code: self.code(),
            },
        }
    }

    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        ApiError::Invalid {
            param: param.into(),
            message: message.into(),
        }
    }

    pub fn unsupported(param: &str, message: impl Into<String>) -> Self {
        ApiError::Unsupported {
            param: param.into(),
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status(), Json(self.body())).into_response();
        if let ApiError::Overloaded(_) = self {
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                HeaderValue::from(RETRY_AFTER_SECS),
            );
        }
        if let ApiError::Unauthorized = self {
            resp.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer"),
            );
        }
        resp
    }
}

impl From<switchyard_engine::EngineError> for ApiError {
    fn from(e: switchyard_engine::EngineError) -> Self {
        use switchyard_engine::EngineError as E;
        match e {
            E::PromptTooLong { .. } | E::PromptExceedsMemory { .. } | E::EmptyPrompt => {
                ApiError::ContextLength(e.to_string())
            }
            E::Request(r) => ApiError::invalid("sampling", r.to_string()),
            E::Unsupported { param, .. } => ApiError::unsupported(param, e.to_string()),
            E::Grammar(g @ switchyard_grammar::GrammarError::Invalid { .. }) => {
                ApiError::Rejected {
                    param: "response_format".into(),
                    message: g.to_string(),
                }
            }
            E::EngineStopped => ApiError::ShuttingDown,
            E::EngineFailed { .. } => ApiError::EngineDown(e.to_string()),
            other => ApiError::Internal(other.to_string()),
        }
    }
}
