//! Routes, shared state, and the serve loop with graceful shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tokio::net::TcpListener;

pub use crate::body::{body_bytes, method_not_allowed, not_found, parse, parse_json};
use crate::endpoints::{detokenize, logged_request, model, models, tokenize, version};
use crate::generation::{chat, completions};
pub use crate::internal::watch_engine;
use crate::internal::{
    cache_events, cache_info, cache_snapshot, flush_cache, health, health_generate,
};
pub use crate::state::{cpu_gate, off_async, AppState, PREFILL_HEADER};

type St = State<Arc<AppState>>;

/// The HTTP API.
pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.body_limit;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/responses", post(crate::responses::create))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/tokenizer_info", get(crate::endpoints::tokenizer_info))
        .route("/version", get(version))
        .route("/health", get(health))
        .route("/health_generate", get(health_generate))
        .route("/flush_cache", post(flush_cache))
        .route("/pd/prefill", post(crate::pd::prefill))
        .route("/cache/info", get(cache_info))
        .route("/metrics", get(metrics))
        .route("/cache/events", get(cache_events))
        .route("/cache/snapshot", get(cache_snapshot))
        .route("/cache/curve", get(crate::curve::curve))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn(crate::body::plain_bodies))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            count_outcome,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.request_log,
            logged_request,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            name_instance,
        ))
        .with_state(state)
}

/// With a cluster key, every answer names this process's instance: what a peer signs its calls
/// for ([`crate::auth`]).
async fn name_instance(
    State(st): St,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let mut r = next.run(req).await;
    if st.cluster_key.is_some() {
        let name = crate::auth::INSTANCE_HEADER;
        r.headers_mut()
            .insert(name, st.replay.instance_header().clone());
    }
    r
}

/// The listener with TCP_NODELAY on every accepted connection: without it a streamed token
/// waits behind Nagle's algorithm for the client's delayed ACK (up to 40 ms on Linux), which
/// would show as time to first token.
pub fn no_delay(
    listener: TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = std::net::SocketAddr> {
    use axum::serve::ListenerExt;
    listener.tap_io(|s| {
        if let Err(e) = s.set_nodelay(true) {
            tracing::warn!(error = %e, "cannot set TCP_NODELAY on a connection");
        }
    })
}

/// Serves until `signal` resolves; then refuses new requests (503), lets running ones finish
/// for up to `grace`, aborts the rest, writes out their answers for up to the grace again
/// (2 to 30 s) and returns. Connections are bounded by `limits` ([`crate::listen`]).
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    mut limits: crate::listen::HttpLimits,
    signal: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    let engine = state.engine.clone();
    let stats = state.http.clone();
    let stop = async move {
        signal.await;
        tracing::info!(
            grace_s = grace.as_secs_f64(),
            "shutting down: new requests get 503; running requests may finish within the grace (seconds)"
        );
        let _ = tokio::task::spawn_blocking(move || engine.shutdown(grace)).await;
    };
    // Once the engine stopped, what is left is writing answers out (and work before the
    // engine: a tokenization, a template render): an operator who chose a short grace gets
    // a short stop.
    limits.drain = grace.clamp(Duration::from_secs(2), Duration::from_secs(30));
    crate::listen::serve(listener, router(state), (limits, None), stats, stop).await
}

/// Counts the outcome of every API request by status.
async fn count_outcome(
    State(st): St,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let api = req.uri().path().starts_with("/v1/");
    let r = next.run(req).await;
    if api {
        st.metrics.count_status(r.status().as_u16());
    }
    r
}

async fn metrics(State(st): St) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        crate::exposition::worker(&st),
    )
        .into_response()
}
