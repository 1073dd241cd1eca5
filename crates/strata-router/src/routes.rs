//! The router's HTTP API: the routes, the cache-event follower, and the small handlers
//! (`/metrics`, `/v1/models`, `/health`, `/health_generate`, `/workers`).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use strata_server::ApiError;

use crate::forward::{forward_chat, forward_completions};
use crate::front::front_door;
use crate::state::RouterState;
use crate::upstream::PASS_TIMEOUT;

type St = State<Arc<RouterState>>;

/// The router's HTTP API.
pub fn router(state: Arc<RouterState>) -> Router {
    let limit = state.body_limit;
    Router::new()
        .route("/v1/chat/completions", post(forward_chat))
        .route("/v1/completions", post(forward_completions))
        .route("/v1/responses", post(crate::responses::forward_responses))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/tokenizer_info", get(tokenizer_info))
        .route("/flush_cache", post(crate::flush::flush_cache))
        .route("/version", get(version))
        .route("/health", get(health))
        .route("/health_generate", get(health_generate))
        .route("/workers", get(workers))
        .route("/cache/curve", get(crate::curve::curve))
        .route("/metrics", get(metrics))
        .route("/dashboard", get(crate::dashboard::page))
        .route("/dashboard/data", get(crate::dashboard::data))
        .route("/dashboard/history", get(crate::dashboard::history))
        .fallback(strata_server::body::not_found)
        .method_not_allowed_fallback(strata_server::body::method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn(strata_server::body::plain_bodies))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            front_door,
        ))
        .layer(axum::middleware::from_fn(
            strata_server::endpoints::request_id,
        ))
        .with_state(state)
}

/// Follows the cache events of every worker, every `every`: each worker by a task of its own,
/// so one that answers slowly (up to its timeouts: seconds, a minute for a snapshot) delays
/// no other's updates. Ends (with its tasks) when dropped.
pub async fn index_loop(state: Arc<RouterState>, every: Duration) {
    let Some(index) = state.index().cloned() else {
        return;
    };
    let mut polls = tokio::task::JoinSet::new();
    for w in state.indexed().cloned().collect::<Vec<_>>() {
        let (state, index) = (state.clone(), index.clone());
        polls.spawn(async move {
            let key = state.cluster_key.as_ref().map(|k| (k, &state.peers));
            loop {
                if let Err(e) = index.poll(&state.client, key, w.slot, &w.url).await {
                    tracing::debug!(worker = %w.url, error = %e, "cache events not read");
                }
                tokio::time::sleep(every).await;
            }
        });
    }
    while polls.join_next().await.is_some() {}
}

async fn metrics(State(st): St) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::metrics::render(&st.view(), &st.front),
    )
        .into_response()
}

/// Passes a request to the first decode worker that answers (an unreachable one is skipped):
/// its status, content type and body come back as they are.
async fn pass(
    st: &RouterState,
    method: reqwest::Method,
    path: &str,
    body: Option<Bytes>,
) -> Response {
    use crate::upstream::{answer_within, held_body, json_or_502, MAX_ANSWER_BYTES};
    for w in st.decode.iter().filter(|w| w.is_healthy()) {
        let mut req = st
            .client
            .request(method.clone(), format!("{}{path}", w.url))
            .timeout(PASS_TIMEOUT);
        if let Some(b) = &body {
            req = req
                .header(header::CONTENT_TYPE, "application/json")
                .body(b.clone());
        }
        let Ok(r) = req.send().await else {
            continue;
        };
        let status = StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        let (bytes, share) =
            match answer_within(r, MAX_ANSWER_BYTES / 4, PASS_TIMEOUT, PASS_TIMEOUT).await {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(worker = %w.url, path, error = %e, "a worker's answer was cut");
                    continue;
                }
            };
        return match json_or_502(status.as_u16(), bytes, &w.url) {
            Ok(b) => {
                let json = [(header::CONTENT_TYPE, "application/json")];
                (status, json, held_body(b, share)).into_response()
            }
            Err(e) => e.into_response(),
        };
    }
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "service_unavailable",
        "no worker answered",
    )
    .into_response()
}

async fn models(State(st): St) -> Response {
    pass(&st, reqwest::Method::GET, "/v1/models", None).await
}

async fn model(
    State(st): St,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Response {
    // The id travels in the path, as one segment: only what a model id can be, every byte
    // but the unreserved ones percent-encoded (a `/`, `?` or `\\` the client encoded stays
    // in the segment), and never a dot segment (which a URL resolves to the path above). One
    // that is not UTF-8 is no model's: the JSON 404 too.
    let id = id.map_or_else(|_| String::new(), |Path(id)| id);
    let dots = id == "." || id == "..";
    if id.is_empty() || id.len() > 256 || !id.bytes().all(|b| b.is_ascii_graphic()) || dots {
        return strata_server::body::not_found(axum::http::Uri::from_static("/v1/models/"))
            .await
            .into_response();
    }
    let path = format!("/v1/models/{}", segment(&id));
    pass(&st, reqwest::Method::GET, &path, None).await
}

/// `s` as one path segment: every byte but ASCII letters, digits and `-._~` percent-encoded.
fn segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

async fn tokenize(State(st): St, body: Bytes) -> Response {
    pass(&st, reqwest::Method::POST, "/tokenize", Some(body)).await
}

async fn detokenize(State(st): St, body: Bytes) -> Response {
    pass(&st, reqwest::Method::POST, "/detokenize", Some(body)).await
}

async fn tokenizer_info(State(st): St) -> Response {
    pass(&st, reqwest::Method::GET, "/tokenizer_info", None).await
}

async fn version(State(st): St) -> Response {
    pass(&st, reqwest::Method::GET, "/version", None).await
}

/// A decode worker's `/health_generate` (a one-token generation), through the first healthy
/// one that answers; callers within a second of an answer (or waiting for it) share it.
async fn health_generate(State(st): St) -> Response {
    let mut last = st.health_generate.lock().await;
    let fresh = last
        .as_ref()
        .filter(|(t, _, _)| t.elapsed() < Duration::from_secs(1));
    let (code, body) = match fresh {
        Some((_, code, body)) => (*code, body.clone()),
        None => {
            let r = pass(&st, reqwest::Method::GET, "/health_generate", None).await;
            let code = r.status().as_u16();
            let body = axum::body::to_bytes(r.into_body(), 64 << 10)
                .await
                .unwrap_or_default();
            *last = Some((std::time::Instant::now(), code, body.clone()));
            (code, body)
        }
    };
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_GATEWAY);
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
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
