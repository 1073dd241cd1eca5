//! `POST /flush_cache` through the router: the router's own admin endpoint. It needs the
//! router's `--admin-key` (checked on the request's head, by the front door's gate: a router
//! without one refuses to flush), then reaches every worker as the deployment does: signed with
//! the cluster key when the router has one (the workers take the cluster's own processes as
//! admins), else with the admin key as the bearer (workers given the same `--admin-key`). A
//! client's credential never travels to the workers, so a worker that would take anything (a
//! loopback worker with no key) is reached only by the router's admin.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use strata_server::ApiError;

use crate::state::RouterState;
use crate::upstream::PASS_TIMEOUT;
use crate::worker::Worker;

type St = State<std::sync::Arc<RouterState>>;

/// Every worker (prefill and decode) flushed with the caller's query (`?tier=device`): 200 with
/// each worker's answer when all flushed; the first worker's refusal of the query (its 4xx,
/// before anything flushed) as it gave it; else the router's 502 naming each worker that did
/// not flush (unreachable, refusing the router's credential, or failing), once every other
/// worker has.
pub async fn flush_cache(
    State(st): St,
    headers: HeaderMap,
    uri: axum::http::Uri,
    body: Bytes,
) -> Response {
    // The front door checked already; a router assembled without it is still shut.
    if let Err(e) = crate::front::check_admin(&st, &headers) {
        return e.into_response();
    }
    // The workers check the query (the first refuses a parameter it does not take, before
    // any flushes); a body would not reach them, so it is refused here.
    if !body.is_empty() {
        return ApiError::flush_body().into_response();
    }
    let (mut answers, mut missed) = (Vec::new(), Vec::new());
    // Each worker logs the flush under the router's id for it (the client's, or a fresh one).
    let rid = headers.get(strata_server::endpoints::REQUEST_ID);
    for w in st.indexed() {
        let (status, body) = match flush_one(&st, w, uri.query(), rid).await {
            Ok(a) => a,
            // One worker unreachable: the others are still flushed, and it is named.
            Err(e) => {
                missed.push(format!("{} ({e})", w.url));
                continue;
            }
        };
        if matches!(status, 401 | 403) {
            let text = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
            tracing::warn!(worker = %w.url, status, answer = ?text, "a worker refused the router's flush");
            missed.push(format!(
                "{} (refused the router's credential, e.g. another --cluster-key-file, or without \
                 one another --admin-key; its answer is in the router's log)",
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
        let code = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
        if code.is_success() {
            answers.push(json!({"worker": w.url, "answer": body}));
        } else if code.is_client_error() && answers.is_empty() && missed.is_empty() {
            // The query refused before anything flushed: the client's to mend, as said.
            return (code, axum::Json(body)).into_response();
        } else {
            let said = body["error"]["message"].as_str().unwrap_or_default();
            let said: String = said.chars().take(200).collect();
            missed.push(format!("{} (answered {status}: {said})", w.url));
        }
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
/// 1 MiB), or why there is none. The MAC covers the target as it goes on the wire (the URL
/// parser's encoding of the query, not the client's spelling of it).
async fn flush_one(
    st: &RouterState,
    w: &Worker,
    query: Option<&str>,
    request_id: Option<&axum::http::HeaderValue>,
) -> Result<(u16, Bytes), String> {
    let mut url =
        reqwest::Url::parse(&format!("{}/flush_cache", w.url)).map_err(|e| e.to_string())?;
    url.set_query(query);
    let target = match url.query() {
        Some(q) => format!("{}?{q}", url.path()),
        None => url.path().to_string(),
    };
    let build = || {
        let mut req = st.client.post(url.clone()).timeout(PASS_TIMEOUT);
        if let Some(id) = request_id {
            req = req.header(strata_server::endpoints::REQUEST_ID, id.clone());
        }
        match (&st.cluster_key, &st.admin_key) {
            (None, Some(k)) => req.header(header::AUTHORIZATION, format!("Bearer {k}")),
            _ => req,
        }
    };
    let call = strata_server::auth::Call {
        method: "POST",
        target: &target,
        body: b"",
        prefill: None,
    };
    let key = st.cluster_key.as_ref();
    let r = strata_server::auth::send(&st.peers, key, &w.url, &call, build)
        .await
        .map_err(|e| e.to_string())?;
    let status = r.status().as_u16();
    crate::upstream::body_within(r, 1 << 20, PASS_TIMEOUT, PASS_TIMEOUT)
        .await
        .map(|b| (status, b))
}
