//! The OpenAI-compatible HTTP server: `/v1/completions`, `/v1/chat/completions` (streamed with
//! server-sent events or not), `/v1/models`, `/health`, `/metrics`, and `/admin` routes, in
//! front of local engines and remote OpenAI-compatible backends.
//!
//! Architecture invariant: only this crate knows about HTTP. Requests are validated once, at
//! the edge ([`validate`]), into types the rest of the program trusts; failures become status
//! codes and OpenAI error objects in one place ([`error`]).

pub mod api;
pub mod auth;
pub mod config;
pub mod error;
pub mod helios;
pub mod listen;
pub mod local;
pub mod metrics;
pub mod modeswitch;
pub mod remote;
mod respond;
pub mod routes;
mod serving;
pub mod state;
pub mod tools;
pub mod validate;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;

use config::Config;
use local::LocalModel;
use remote::RemoteModel;
use state::{AppState, Served};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error(transparent)]
    Zoo(#[from] switchyard_zoo::ZooError),
    #[error(transparent)]
    Weights(#[from] switchyard_weights::WeightsError),
    #[error(transparent)]
    Tokenizer(#[from] switchyard_tokenizer::TokenizerError),
    #[error(transparent)]
    Model(#[from] switchyard_models::ModelError),
    #[error(transparent)]
    Engine(#[from] switchyard_engine::EngineError),
    #[error("backend {name}: {detail}")]
    Backend { name: String, detail: String },
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("server error: {0}")]
    Io(#[from] std::io::Error),
}

/// Builds the router over a ready state.
pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/completions", post(routes::completions))
        .route("/v1/chat/completions", post(routes::chat))
        .route("/v1/models", get(routes::models))
        .route("/tokenize", post(routes::tokenize))
        .route("/detokenize", post(routes::detokenize));
    let mut protected = v1;
    if state.config.admin {
        protected = protected
            .route("/admin/stats", get(routes::admin_stats))
            .route("/admin/depth", post(routes::admin_depth))
            .route("/admin/pht", get(routes::admin_pht))
            .route("/admin/routes", get(routes::admin_routes));
    }
    let protected = protected.route_layer(axum::middleware::from_fn_with_state(
        state.clone(),
        auth::require_key,
    ));
    let cors = cors_layer(&state.config.cors_allowed_origins);
    let app = Router::new()
        .merge(protected)
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .with_state(state);
    let app = match cors {
        Some(c) => app.layer(c),
        None => app,
    };
    // Outermost: every request gets an `x-request-id` (the client's, or a new UUID), which
    // comes back in the response headers and is a field of every log line the request's
    // handling writes (its span).
    let x_request_id = axum::http::HeaderName::from_static("x-request-id");
    app.layer(
        tower::ServiceBuilder::new()
            .layer(tower_http::request_id::SetRequestIdLayer::new(
                x_request_id.clone(),
                tower_http::request_id::MakeRequestUuid,
            ))
            .layer(axum::middleware::from_fn(request_span))
            .layer(tower_http::request_id::PropagateRequestIdLayer::new(
                x_request_id,
            )),
    )
}

/// Runs the rest of the request inside a span named for its id.
async fn request_span(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    use tracing::Instrument;
    let id = req
        .extensions()
        .get::<tower_http::request_id::RequestId>()
        .and_then(|id| id.header_value().to_str().ok())
        .unwrap_or("-")
        .to_string();
    // At error level, so the span is enabled under every filter (the default is `warn`)
    // and every line the request writes, at any level, carries its id.
    let span = tracing::error_span!("request", request_id = %id);
    next.run(req).instrument(span).await
}

/// CORS for the configured origins; `None` (no CORS headers at all) when there are none.
fn cors_layer(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    use tower_http::cors::{AllowOrigin, CorsLayer};
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(
            origins
                .iter()
                .filter_map(|o| axum::http::HeaderValue::from_str(o).ok()),
        )
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([axum::http::Method::GET, axum::http::Method::POST])
            .allow_headers([
                axum::http::header::AUTHORIZATION,
                axum::http::header::CONTENT_TYPE,
            ])
            .expose_headers([axum::http::HeaderName::from_static("x-request-id")]),
    )
}

/// Starts every configured engine and backend.
pub async fn build_state(cfg: &Config) -> Result<Arc<AppState>, ServerError> {
    let mut models = BTreeMap::new();
    for section in &cfg.models {
        let s = section.clone();
        let m = tokio::task::spawn_blocking(move || LocalModel::start(&s))
            .await
            .map_err(|e| ServerError::Io(std::io::Error::other(e.to_string())))??;
        tracing::info!(model = %m.name, "engine started");
        models.insert(section.name.clone(), Served::Local(Arc::new(m)));
    }
    if let Some(section) = &cfg.helios {
        let s = section.clone();
        let h = tokio::task::spawn_blocking(move || helios::HeliosModel::start(&s))
            .await
            .map_err(|e| ServerError::Io(std::io::Error::other(e.to_string())))??;
        tracing::info!(model = %h.name, candidates = ?h.orchestrator.candidates(), "HELIOS started");
        models.insert(section.name.clone(), Served::Helios(Arc::new(h)));
    }
    if let Some(section) = &cfg.modeswitch {
        let s = section.clone();
        let policy = cfg.router_policy()?;
        let m = tokio::task::spawn_blocking(move || modeswitch::ModeSwitchModel::start(&s, policy))
            .await
            .map_err(|e| ServerError::Io(std::io::Error::other(e.to_string())))??;
        tracing::info!(model = %m.name, modes = ?section.modes, "ModeSwitch started");
        models.insert(section.name.clone(), Served::Modes(Arc::new(m)));
    }
    for b in &cfg.backends {
        let r = Arc::new(RemoteModel::new(b).map_err(|e| ServerError::Backend {
            name: b.name.clone(),
            detail: e.to_string(),
        })?);
        tokio::spawn(Arc::clone(&r).health_loop());
        models.insert(b.name.clone(), Served::Remote(r));
    }
    Ok(Arc::new(AppState::new(models, cfg.server.clone())))
}

/// Serves until SIGINT or SIGTERM, then stops accepting, lets running requests finish for up
/// to `shutdown_grace_s`, stops the engines and returns. `on_ready` gets the bound address.
pub async fn serve(
    cfg: Config,
    on_ready: impl FnOnce(SocketAddr) + Send,
) -> Result<(), ServerError> {
    let state = build_state(&cfg).await?;
    let addr = format!("{}:{}", cfg.server.host, cfg.server.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| ServerError::Bind {
            addr: addr.clone(),
            source,
        })?;
    let local = listener.local_addr()?;
    on_ready(local);
    let app = router(state.clone());
    let grace = Duration::from_secs(cfg.server.shutdown_grace_s);
    let st = state.clone();
    let (signalled_tx, signalled_rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        shutdown_signal().await;
        tracing::info!("shutting down: draining running requests");
        st.shutting_down.store(true, Ordering::SeqCst);
        let _ = signalled_tx.send(());
    };
    let server = listen::serve_connections(
        listener,
        app,
        listen::ConnectionLimits::of(&cfg.server),
        Some(state.metrics.clone()),
        shutdown,
    );
    tokio::pin!(server);
    tokio::select! {
        () = &mut server => {},
        _ = async {
            let _ = signalled_rx.await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!("grace period of {} s over; exiting with requests still running", grace.as_secs());
        }
    }
    for s in state.models.values() {
        match s {
            Served::Local(m) => {
                let _ = m.handle.shutdown().recv().await;
            }
            Served::Helios(h) => {
                for e in &h.engines {
                    let _ = e.shutdown().recv().await;
                }
            }
            Served::Modes(m) => {
                let _ = m.base.handle.shutdown().recv().await;
            }
            Served::Remote(_) => {}
        }
    }
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
