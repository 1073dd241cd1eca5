//! `POST /v1/responses` through the router: to a healthy decode worker (the policy's pick), or — for a
//! request continuing a stored response (`previous_response_id`) — to the worker that stores
//! it (a worker keeps its responses' conversations; the router learns each response's worker
//! from the answer: the JSON's `id`, or the stream's first event). Under PD a prefill worker
//! is named too (the policy's, without the prompt): the decode worker computes a turn whose
//! conversation so far it holds itself (`--pd-local-prefill-tokens`), and has a longer one
//! computed there, receiving only the pages it lacks.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;
use futures_util::StreamExt;
use strata_server::ApiError;

use crate::front::ChosenWorker;
use crate::policy::{LeastLoad, LoadBalancingPolicy};
use crate::state::RouterState;
use crate::worker::{InFlight, Worker};

/// The response id in the first bytes of an answer (`"id":"resp_…"`).
fn response_id(bytes: &[u8]) -> Option<String> {
    let pat = b"\"id\":\"resp_";
    let at = bytes.windows(pat.len()).position(|w| w == pat)?;
    let rest = &bytes[at + 6..];
    let end = rest.iter().position(|&b| b == b'"')?;
    let id = std::str::from_utf8(&rest[..end]).ok()?;
    (id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
        .then(|| id.to_string())
}

/// The decode worker for a request: the one storing its previous response when known (Err
/// naming the response when that worker is down now: another would answer that it stores no
/// such response, which is false), else the router's policy's (without the prompt: the
/// conversation is the worker's).
fn pick(st: &RouterState, body: &Bytes) -> Result<Option<Arc<Worker>>, String> {
    #[derive(serde::Deserialize)]
    struct Previous {
        previous_response_id: Option<String>,
    }
    let previous = serde_json::from_slice::<Previous>(body)
        .ok()
        .and_then(|v| v.previous_response_id);
    if let Some(id) = previous {
        let owner = st
            .response_owners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id);
        if let Some(w) = owner.and_then(|u| st.decode.iter().find(|w| w.url == u).cloned()) {
            return match w.is_healthy() {
                true => Ok(Some(w)),
                false => Err(id),
            };
        }
    }
    Ok(st
        .balancer()
        .pick(&st.decode, None, None)
        .or_else(|| LeastLoad.pick(&st.decode, None, None)))
}

pub async fn forward_responses(
    State(st): State<Arc<RouterState>>,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Response, ApiError> {
    let body = strata_server::body::body_bytes(body, st.body_limit)?;
    st.forwarded.fetch_add(1, Ordering::Relaxed);
    // Reading the body is CPU work (up to --body-limit): off the async workers.
    let b = body.clone();
    let fallback = || Ok(LeastLoad.pick(&st.decode, None, None));
    let picked = crate::forward::off_async(&st, move |st| pick(st, &b), fallback).await;
    let w = match picked {
        Ok(Some(w)) => w,
        Ok(None) => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "no healthy worker to route to",
            ))
        }
        Err(id) => {
            return Err(ApiError {
                retry_after: Some(5),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "service_unavailable",
                    format!(
                        "the worker storing previous response `{id}` is unavailable now: retry, \
                         or send the whole conversation without previous_response_id"
                    ),
                )
            })
        }
    };
    let prefill = match st.prefill.is_empty() {
        true => None,
        false => st
            .balancer()
            .pick(&st.prefill, None, None)
            .or_else(|| LeastLoad.pick(&st.prefill, None, None)),
    };
    let rid = headers.get(strata_server::endpoints::REQUEST_ID);
    let path = "/v1/responses";
    let sending = crate::forward::send_to(&st, &w, prefill.as_deref(), path, &body, rid);
    let guard = InFlight::start(std::iter::once(w.clone()).chain(prefill.clone()).collect());
    let sent = crate::forward::answer_of(&st, &w, sending).await?;
    let r = match sent {
        Ok(r) => r,
        Err(e) => {
            st.front.upstream_errors[0].fetch_add(1, Ordering::Relaxed);
            w.failures.fetch_add(1, Ordering::Relaxed);
            return Err(ApiError::new(
                StatusCode::BAD_GATEWAY,
                "server_error",
                format!("the worker was unreachable: {e}"),
            ));
        }
    };
    if r.status() == StatusCode::UNAUTHORIZED {
        return Err(crate::forward::refused_the_router(&st, &w, r).await);
    }
    answer(&st, r, guard, &w).await
}

/// The worker's answer to the client: a stream as it comes (guarded: `sse`), any other
/// whole, bounded and JSON (or the router's own error); either way the owner of the response
/// id it names is recorded.
async fn answer(
    st: &Arc<RouterState>,
    r: reqwest::Response,
    guard: InFlight,
    w: &Arc<crate::Worker>,
) -> Result<Response, ApiError> {
    let status = StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let ctype = r.headers().get(header::CONTENT_TYPE).cloned();
    let sse = ctype
        .as_ref()
        .and_then(|c| c.to_str().ok())
        .is_some_and(|c| c.starts_with("text/event-stream"));
    let record = |st: &RouterState, b: &[u8], url: &str| {
        if let Some(id) = response_id(b) {
            st.response_owners
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .record(id, url);
            return true;
        }
        false
    };
    if !sse {
        use crate::upstream::{
            answer_within, bad_gateway, held_body, json_or_502, MAX_ANSWER_BYTES,
        };
        let retry = crate::upstream::retry_after(&r);
        let (bytes, share) = answer_within(r, MAX_ANSWER_BYTES, st.stream_idle, st.request_timeout)
            .await
            .map_err(|e| bad_gateway(format!("the worker's answer was cut: {e}")))?;
        let bytes = json_or_502(status.as_u16(), bytes, &w.url)?;
        record(st, &bytes, &w.url);
        drop(guard);
        let json = [(header::CONTENT_TYPE, "application/json")];
        let body = held_body(bytes, share);
        let mut resp = axum::response::IntoResponse::into_response((status, json, body));
        resp.extensions_mut().insert(ChosenWorker(w.url.clone()));
        if let Some(v) = retry {
            resp.headers_mut().insert(header::RETRY_AFTER, v);
        }
        return Ok(resp);
    }
    let url = w.url.clone();
    let (st2, mut seen) = (st.clone(), false);
    let events = r.bytes_stream().map(move |c| {
        if let (Ok(b), false) = (&c, seen) {
            seen = record(&st2, b, &url);
        }
        c
    });
    let dialect = crate::sse::Dialect::Responses;
    let body = crate::sse::guard(Box::pin(events), dialect, guard, st.clone());
    let mut resp = Response::new(Body::from_stream(body));
    *resp.status_mut() = status;
    if let Some(c) = ctype {
        resp.headers_mut().insert(header::CONTENT_TYPE, c);
    }
    resp.extensions_mut().insert(ChosenWorker(w.url.clone()));
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_read_from_an_answer_and_owners_are_bounded() {
        let b = br#"event: response.created
data: {"response":{"id":"resp_ab12","object":"response"}}"#;
        assert_eq!(response_id(b).as_deref(), Some("resp_ab12"));
        assert_eq!(response_id(br#"{"id":"resp_x\"y"}"#), None);
        assert_eq!(response_id(br#"{"previous_response_id":"resp_a"}"#), None);
        let mut o = crate::response_owners::Owners::default();
        let max = crate::response_owners::MAX_OWNERS;
        for i in 0..max + 5 {
            o.record(format!("resp_{i}"), "http://w");
        }
        assert_eq!(o.get("resp_0"), None);
        assert_eq!(
            o.get(&format!("resp_{}", max + 4)).as_deref(),
            Some("http://w")
        );
    }
}
