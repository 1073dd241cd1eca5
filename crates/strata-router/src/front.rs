//! The router's front door: every answer counted by route, status and worker; the time to
//! the end of each API answer; requests in flight; API keys checked; one log line per
//! finished API request (`strata::request`, as the workers log theirs).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use strata_server::ApiError;

use crate::state::RouterState;

type St = State<Arc<RouterState>>;

/// The decode worker (or the one worker) that answered a request.
#[derive(Clone)]
pub struct ChosenWorker(pub String);

/// The routes answered without an API key (docs/SECURITY.md): liveness checks and what
/// operators and Prometheus read. Every other path needs a key when keys are configured,
/// unknown paths included (a 401, not a 404, tells nothing about the routes).
pub const OPEN_PATHS: &[&str] = &[
    "/health",
    "/health_generate",
    "/metrics",
    "/workers",
    "/dashboard",
    "/dashboard/data",
    "/dashboard/history",
    "/cache/curve",
];

/// Counts every answer by route, status and worker; for the API routes, also the time to the
/// end of the answer (when its body is done or dropped) and the requests in flight. Checks
/// the API key of every path but the open ones.
pub async fn front_door(
    State(st): St,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let route = known_route(req.uri().path());
    let api = route.starts_with("/v1/");
    // Made before the handler runs: if the client goes away and the handler is dropped, the
    // request still leaves the in-flight gauge, and is counted as 499 (client closed).
    let mut end = api.then(|| End {
        st: st.clone(),
        t: std::time::Instant::now(),
        route: route.clone(),
        method: req.method().to_string(),
        id: request_id(req.headers()),
        status: 499,
        worker: "none".into(),
        answered: false,
    });
    if api {
        st.front.in_flight.fetch_add(1, Ordering::Relaxed);
    }
    let resp = match refusal(&st, req.uri().path(), req.headers()) {
        Some(refused) => refused,
        None => next.run(req).await,
    };
    let worker = resp
        .extensions()
        .get::<ChosenWorker>()
        .map(|w| w.0.clone())
        .unwrap_or_else(|| "none".into());
    st.front.answered(&route, resp.status().as_u16(), &worker);
    let Some(mut end) = end.take() else {
        return resp;
    };
    end.answered = true;
    end.status = resp.status().as_u16();
    end.worker = worker;
    if end.id == "-" {
        end.id = request_id(resp.headers());
    }
    let (parts, body) = resp.into_parts();
    let body = Body::from_stream(body.into_data_stream().map(move |c| {
        let _end = &end;
        c
    }));
    Response::from_parts(parts, body)
}

/// The key check of a request's head: for a path that is not open, a client API key (a 401 if
/// missing or wrong), or for `/flush_cache` the router's admin key ([`check_admin`]).
fn refusal(st: &RouterState, path: &str, headers: &HeaderMap) -> Option<Response> {
    if OPEN_PATHS.contains(&path) {
        return None;
    }
    // The admin endpoint takes the router's admin key, not a client's.
    let e = match path {
        "/flush_cache" => check_admin(st, headers).err()?,
        _ => check_key(st, headers).err()?,
    };
    Some(e.into_response())
}

/// The listener's gate: the key is checked on a request's head, before any byte of its body
/// is read (the front door checks again, for routers served otherwise); a refusal is
/// counted by route as the front door counts answers.
pub fn gate(st: Arc<RouterState>) -> strata_server::listen::Gate {
    Arc::new(move |parts| {
        // A browser's CORS preflight carries no key: the CORS layer answers it where
        // `--allowed-origins` lists origins, else the front door refuses it as any request
        // without a key.
        if is_preflight(parts) {
            return None;
        }
        let path = parts.uri.path();
        let r = refusal(&st, path, &parts.headers)?;
        st.front
            .answered(&known_route(path), r.status().as_u16(), "none");
        Some(r)
    })
}

/// `OPTIONS` with `Origin` and `Access-Control-Request-Method` and no body: what browsers
/// send before a cross-origin request, never with credentials. (A body would be read, and
/// held in the listener's budget for bodies, before any key is checked.)
fn is_preflight(parts: &axum::http::request::Parts) -> bool {
    use axum::http::header::{
        ACCESS_CONTROL_REQUEST_METHOD, CONTENT_LENGTH, ORIGIN, TRANSFER_ENCODING,
    };
    let h = &parts.headers;
    let no_body = !h.contains_key(TRANSFER_ENCODING)
        && h.get_all(CONTENT_LENGTH)
            .iter()
            .all(|v| v.as_bytes() == b"0");
    parts.method == axum::http::Method::OPTIONS
        && h.contains_key(ORIGIN)
        && h.contains_key(ACCESS_CONTROL_REQUEST_METHOD)
        && no_body
}

/// The route label of a path (a bounded set: unknown paths are "other").
fn known_route(path: &str) -> String {
    match path {
        p @ ("/v1/chat/completions"
        | "/v1/completions"
        | "/v1/responses"
        | "/v1/models"
        | "/tokenize"
        | "/detokenize"
        | "/tokenizer_info"
        | "/flush_cache"
        | "/health"
        | "/health_generate"
        | "/metrics"
        | "/workers"
        | "/dashboard"
        | "/dashboard/data"
        | "/cache/curve") => p.to_string(),
        _ => "other".to_string(),
    }
}

/// The client's `X-Request-Id` (or the worker's, on an answer) when it can be echoed; `-`
/// when there is none.
fn request_id(h: &HeaderMap) -> String {
    use strata_server::ids::{client_request_id, REQUEST_ID};
    client_request_id(h.get(REQUEST_ID)).unwrap_or_else(|| "-".into())
}

/// Ends an API request's measurement when its body is done or dropped (or when the request
/// is dropped before an answer: then it is counted as 499), and logs its line.
struct End {
    st: Arc<RouterState>,
    t: std::time::Instant,
    route: String,
    method: String,
    id: String,
    status: u16,
    worker: String,
    answered: bool,
}

impl Drop for End {
    fn drop(&mut self) {
        let f = &self.st.front;
        if !self.answered {
            f.answered(&self.route, 499, "none");
        }
        let secs = self.t.elapsed().as_secs_f64();
        f.duration.observe(secs);
        f.in_flight.fetch_sub(1, Ordering::Relaxed);
        if self.st.request_log {
            tracing::info!(
                target: "strata::request",
                request_id = %self.id,
                method = %self.method,
                route = %self.route,
                status = self.status,
                worker = %self.worker,
                duration_ms = %format!("{:.1}", secs * 1e3),
                "request"
            );
        }
    }
}

/// The admin check of `/flush_cache`'s head: the admin key, or a 401. A router without
/// `--admin-key` answers 403 (no credential would do), to a client it knows only: one without
/// a client key gets the 401 of every other keyed path.
pub fn check_admin(st: &RouterState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &st.admin_key else {
        check_key(st, headers)?;
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            "this router flushes nothing: start it with --admin-key to flush every worker \
             through it, or call each worker's /flush_cache",
        ));
    };
    if strata_server::error::bearer_is(headers, key) {
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

pub fn check_key(st: &RouterState, headers: &HeaderMap) -> Result<(), ApiError> {
    if st.api_keys.is_empty() {
        return Ok(());
    }
    let r = check_key_inner(st, headers);
    if r.is_err() {
        st.front.auth_failures.fetch_add(1, Ordering::Relaxed);
    }
    r
}

fn check_key_inner(st: &RouterState, headers: &HeaderMap) -> Result<(), ApiError> {
    let given = strata_server::error::bearer(headers);
    // Every key is compared, each in constant time: the answer's timing says nothing about
    // which key or which byte was close.
    let ok = given.is_some_and(|g| {
        st.api_keys
            .iter()
            .fold(false, |ok, k| strata_server::error::secret_eq(g, k) | ok)
    });
    match ok {
        true => Ok(()),
        false => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "a valid API key is needed: Authorization: Bearer <key>",
        )
        .with_code("invalid_api_key")),
    }
}
