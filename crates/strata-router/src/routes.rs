//! The router's HTTP API: the routes, the cache-event follower, and the small handlers
//! (`/metrics`, `/v1/models`, `/health`, `/workers`).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use strata_server::ApiError;

use crate::forward::{forward_chat, forward_completions};
use crate::front::front_door;
use crate::state::RouterState;

type St = State<Arc<RouterState>>;

/// The router's HTTP API.
pub fn router(state: Arc<RouterState>) -> Router {
    let limit = state.body_limit;
    Router::new()
        .route("/v1/chat/completions", post(forward_chat))
        .route("/v1/completions", post(forward_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/workers", get(workers))
        .route("/metrics", get(metrics))
        .route("/dashboard", get(crate::dashboard::page))
        .route("/dashboard/data", get(crate::dashboard::data))
        .route("/dashboard/history", get(crate::dashboard::history))
        .fallback(strata_server::body::not_found)
        .method_not_allowed_fallback(strata_server::body::method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            front_door,
        ))
        .with_state(state)
}

/// Follows the cache events of the cache pool's workers, every `every`.
pub async fn index_loop(state: Arc<RouterState>, every: Duration) {
    let Some(index) = state.index().cloned() else {
        return;
    };
    loop {
        for (i, w) in state.cache_pool().iter().enumerate() {
            if let Err(e) = index
                .poll(&state.client, state.cluster_key.as_ref(), i, &w.url)
                .await
            {
                tracing::debug!(worker = %w.url, error = %e, "cache events not read");
            }
        }
        tokio::time::sleep(every).await;
    }
}

async fn metrics(State(st): St) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::metrics::render(&st.view(), &st.front),
    )
        .into_response()
}

async fn models(State(st): St) -> Response {
    for w in &st.decode {
        if let Ok(r) = st.client.get(format!("{}/v1/models", w.url)).send().await {
            if let Ok(v) = r.json::<serde_json::Value>().await {
                return Json(v).into_response();
            }
        }
    }
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "service_unavailable",
        "no worker answered",
    )
    .into_response()
}

async fn health(State(st): St) -> Response {
    let any_up = |ws: &[Arc<crate::worker::Worker>]| ws.iter().any(|w| w.is_healthy());
    let up = any_up(&st.decode) && (st.prefill.is_empty() || any_up(&st.prefill));
    let code = if up {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        code,
        Json(json!({"status": if up { "ok" } else { "no healthy worker pair" }})),
    )
        .into_response()
}

async fn workers(State(st): St) -> Json<serde_json::Value> {
    let v = st.view();
    let c = v.cache;
    let ca = json!({"hits": c.hits, "misses": c.misses,
                    "hit_pages_device": c.hit_pages_device,
                    "hit_pages_host": c.hit_pages_host,
                    "hit_pages_remote": c.hit_pages_remote,
                    "resyncs": v.resyncs});
    Json(
        json!({"policy": v.policy, "retries": v.retries, "cache_aware": ca,
                "workers": v.workers}),
    )
}
