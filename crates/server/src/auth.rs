//! Bearer-key authentication for `/v1` and `/admin`, compared in constant time.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use crate::error::ApiError;
use crate::state::AppState;

/// Whether `presented` equals one of `keys`. Every key is compared (no early exit), each in
/// time independent of where the bytes differ.
pub fn key_matches(keys: &[String], presented: &[u8]) -> bool {
    let mut ok = subtle::Choice::from(0u8);
    for k in keys {
        // ct_eq on slices of different lengths is false (and does not leak their contents).
        ok |= k.as_bytes().ct_eq(presented);
    }
    bool::from(ok)
}

pub async fn require_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if state.config.api_keys.is_empty() {
        return next.run(req).await;
    }
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match presented {
        Some(k) if key_matches(&state.config.api_keys, k.as_bytes()) => next.run(req).await,
        _ => ApiError::Unauthorized.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_exactly() {
        let keys = vec!["secret-one".to_string(), "two".to_string()];
        assert!(key_matches(&keys, b"secret-one"));
        assert!(key_matches(&keys, b"two"));
        assert!(!key_matches(&keys, b"secret-onf"));
        assert!(!key_matches(&keys, b"secret-one "));
        assert!(!key_matches(&keys, b""));
    }
}
