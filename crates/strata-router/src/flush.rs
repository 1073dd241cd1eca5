//! `POST /flush_cache` through the router: the router's own admin endpoint. It needs the
//! router's `--admin-key` (checked on the request's head, by the front door's gate: a router
//! without one refuses to flush), then reaches every worker as the deployment does: signed with
//! the cluster key when the router has one (the workers take the cluster's own processes as
//! admins), else with the admin key as the bearer (workers given the same `--admin-key`). A
//! client's credential never travels to the workers, so a worker that would take anything (a
//! loopback worker with no key) is reached only by the router's admin.

use std::sync::atomic::Ordering;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use strata_server::ApiError;

use crate::state::RouterState;
use crate::worker::Worker;

type St = State<std::sync::Arc<RouterState>>;

/// How long one worker may take to flush and answer.
const FLUSH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(90);

/// The admin check of `/flush_cache`'s head: 403 on a router without `--admin-key` (no
/// credential would do), 401 for a missing or wrong one.
pub fn check_admin(st: &RouterState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &st.admin_key else {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            "this router flushes nothing: start it with --admin-key to flush every worker \
             through it, or call each worker's /flush_cache",
        ));
    };
    let given = strata_server::error::bearer(headers);
    if given.is_some_and(|g| strata_server::error::secret_eq(g, key)) {
        return Ok(());
    }
    st.front.auth_failures.fetch_add(1, Ordering::Relaxed);
    Err(ApiError::new(
        StatusCode::UNAUTHORIZED,
        "authentication_error",
        "/flush_cache needs the router's admin key: Authorization: Bearer <key>",
    )
    .with_code("invalid_api_key"))
}

/// Every worker (prefill and decode) flushed with the caller's query (`?tier=device`): 200 with
/// each worker's answer when all flushed; a worker's refusal of the query (its 400) as it gave
/// it, before any later worker is called; a worker that refuses the router's credential, or,
/// once every worker that answers has flushed, those that did not: the router's 502 naming
/// them.
pub async fn flush_cache(State(st): St, uri: axum::http::Uri, body: Bytes) -> Response {
    // The workers check the query (the first refuses a parameter it does not take, before
    // any flushes); a body would not reach them, so it is refused here.
    if !body.is_empty() {
        return ApiError::flush_body().into_response();
    }
    let target = match uri.query() {
        Some(q) => format!("/flush_cache?{q}"),
        None => "/flush_cache".to_string(),
    };
    let (mut answers, mut missed) = (Vec::new(), Vec::new());
    for w in st.indexed() {
        let (status, body) = match flush_one(&st, w, &target).await {
            Ok(a) => a,
            // One worker unreachable: the others are still flushed, and it is named.
            Err(e) => {
                missed.push(format!("{} ({e})", w.url));
                continue;
            }
        };
        if matches!(status, 401 | 403) {
            tracing::warn!(worker = %w.url, status, "a worker refused the router's flush");
            missed.push(format!(
                "{} (refused the router's credential: another --cluster-key-file, or, without one, \
                 another --admin-key)",
                w.url
            ));
            continue;
        }
        let body = match crate::upstream::json_or_502(status, body, &w.url) {
            Ok(b) => serde_json::from_slice::<Value>(&b).unwrap_or_default(),
            Err(_) => {
                missed.push(format!("{} (an answer that is not JSON)", w.url));
                continue;
            }
        };
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
        if !status.is_success() {
            return (status, axum::Json(body)).into_response();
        }
        answers.push(json!({"worker": w.url, "answer": body}));
    }
    if !missed.is_empty() {
        let msg = format!(
            "{} of the workers did not flush: {}; the other {} flushed",
            missed.len(),
            missed.join(", "),
            answers.len()
        );
        return crate::upstream::bad_gateway(msg).into_response();
    }
    axum::Json(json!({"workers": answers})).into_response()
}

/// One worker's `/flush_cache` call with the router's credential: its status and body (at most
/// 1 MiB), or why there is none.
async fn flush_one(st: &RouterState, w: &Worker, target: &str) -> Result<(u16, Bytes), String> {
    let url = format!("{}{target}", w.url);
    let build = || {
        let req = st.client.post(&url).timeout(FLUSH_TIMEOUT);
        match (&st.cluster_key, &st.admin_key) {
            (None, Some(k)) => req.header(header::AUTHORIZATION, format!("Bearer {k}")),
            _ => req,
        }
    };
    let call = strata_server::auth::Call {
        method: "POST",
        target,
        body: b"",
        prefill: None,
    };
    let key = st.cluster_key.as_ref();
    let r = strata_server::auth::send(&st.peers, key, &w.url, &call, build)
        .await
        .map_err(|e| e.to_string())?;
    let status = r.status().as_u16();
    crate::upstream::body_within(r, 1 << 20, FLUSH_TIMEOUT, FLUSH_TIMEOUT)
        .await
        .map(|b| (status, b))
}
