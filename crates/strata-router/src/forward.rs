//! Forwarding an API request: pick a worker (and a prefill worker under PD), send, retry once
//! on another pair before any token, and relay the answer (an SSE stream guarded against a
//! worker that dies mid-answer).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;
use strata_server::state::PREFILL_HEADER;
use strata_server::ApiError;

use crate::front::ChosenWorker;
use crate::policy::{LeastLoad, LoadBalancingPolicy};
use crate::state::RouterState;
use crate::worker::{InFlight, Worker};

type St = State<Arc<RouterState>>;
type Body_ = Result<Bytes, axum::extract::rejection::BytesRejection>;

pub async fn forward_chat(st: St, headers: HeaderMap, body: Body_) -> Result<Response, ApiError> {
    forward(st, headers, body, "/v1/chat/completions").await
}

pub async fn forward_completions(
    st: St,
    headers: HeaderMap,
    body: Body_,
) -> Result<Response, ApiError> {
    forward(st, headers, body, "/v1/completions").await
}

/// The workers of one attempt: the decode worker (or the one worker), and the prefill worker
/// under PD.
struct Pair {
    decode: Arc<Worker>,
    prefill: Option<Arc<Worker>>,
}

/// Picks a pair, avoiding the previous attempt's workers. The pool whose caches serve
/// prompts is picked with the prompt when the policy reads it (under PD both pools, the
/// prompt read once); the other without.
async fn pick_pair(st: &Arc<RouterState>, body: &Bytes, avoid: Option<&Pair>) -> Option<Pair> {
    let avoid_d = avoid.map(|p| p.decode.clone());
    let avoid_p = avoid.and_then(|p| p.prefill.clone());
    let b = st.balancer();
    if st.prefill.is_empty() {
        let decode = if b.reads_prompt() {
            let (body, a) = (body.clone(), avoid_d.clone());
            off_async(
                st,
                move |st| st.balancer().pick(&st.decode, Some(&body), a.as_ref()),
                || LeastLoad.pick(&st.decode, None, avoid_d.as_ref()),
            )
            .await?
        } else {
            b.pick(&st.decode, None, avoid_d.as_ref())?
        };
        return Some(Pair {
            decode,
            prefill: None,
        });
    }
    let (prefill, decode) = if b.reads_prompt() {
        let (body, ap, ad) = (body.clone(), avoid_p.clone(), avoid_d.clone());
        off_async(
            st,
            move |st| {
                let avoid = (ap.as_ref(), ad.as_ref());
                st.balancer()
                    .pick_pd(&st.prefill, &st.decode, Some(&body), avoid)
            },
            || {
                let p = LeastLoad.pick(&st.prefill, None, avoid_p.as_ref())?;
                Some((p, LeastLoad.pick(&st.decode, None, avoid_d.as_ref())?))
            },
        )
        .await?
    } else {
        let decode = b.pick(&st.decode, None, avoid_d.as_ref())?;
        (b.pick(&st.prefill, None, avoid_p.as_ref())?, decode)
    };
    Some(Pair {
        decode,
        prefill: Some(prefill),
    })
}

/// A pick that reads the prompt: CPU work, run off the async workers, a bounded number at
/// once (the permit goes with the task); `fallback` if the task failed.
pub(crate) async fn off_async<T: Send + 'static>(
    st: &Arc<RouterState>,
    pick: impl FnOnce(&RouterState) -> T + Send + 'static,
    fallback: impl FnOnce() -> T,
) -> T {
    let permit = st.cpu_gate.clone().acquire_owned().await.ok();
    let st2 = st.clone();
    let picked = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        pick(&st2)
    })
    .await;
    // The scoring task failed: least load, as when the prompt cannot be read.
    picked.unwrap_or_else(|_| fallback())
}

/// Sends the request to `decode` (with `prefill` named under PD), signed when the deployment
/// has a cluster key (for the worker's instance: [`strata_server::auth::send`]).
/// The 502 for a lone worker that could not be reached or whose answer could not be read.
fn unreadable(d: &Worker, e: &reqwest::Error) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        "server_error",
        format!(
            "the worker {} could not be reached or answered unreadably: {e}",
            d.url
        ),
    )
}

pub(crate) async fn send_to(
    st: &RouterState,
    decode: &Worker,
    prefill: Option<&Worker>,
    path: &str,
    body: &Bytes,
    request_id: Option<&axum::http::HeaderValue>,
) -> reqwest::Result<reqwest::Response> {
    let build = || {
        let mut req = st
            .client
            .post(format!("{}{path}", decode.url))
            .header(header::CONTENT_TYPE, "application/json")
            .body(body.clone());
        if let Some(p) = prefill {
            req = req.header(PREFILL_HEADER, &p.url);
        }
        // The worker logs and echoes the same id as the router.
        if let Some(id) = request_id {
            req = req.header(strata_server::endpoints::REQUEST_ID, id.clone());
        }
        req
    };
    let call = strata_server::auth::Call {
        method: "POST",
        target: path,
        body,
        prefill: prefill.map(|w| w.url.as_str()),
    };
    let key = st.cluster_key.as_ref();
    strata_server::auth::send(&st.peers, key, &decode.url, &call, build).await
}

/// The worker's answer relayed to the client: a stream as it comes (guarded; the in-flight
/// guard lives as long as it), any other answer read whole within bounds and passed on only
/// when it is JSON.
async fn relay(
    st: &Arc<RouterState>,
    r: reqwest::Response,
    guard: InFlight,
    decode: &Worker,
) -> Result<Response, ApiError> {
    let status = r.status();
    if matches!(status.as_u16(), 502 | 503) {
        st.front.upstream_errors[1].fetch_add(1, Ordering::Relaxed);
    }
    let ctype = r.headers().get(header::CONTENT_TYPE).cloned();
    let retry = crate::upstream::retry_after(&r);
    let sse = ctype
        .as_ref()
        .and_then(|c| c.to_str().ok())
        .is_some_and(|c| c.starts_with("text/event-stream"));
    let body = if sse {
        Body::from_stream(crate::sse::guard(
            Box::pin(r.bytes_stream()),
            crate::sse::Dialect::Chat,
            guard,
            st.clone(),
        ))
    } else {
        use crate::upstream::{
            answer_within, held_body, json_or_502, BUDGET_CUT, MAX_ANSWER_BYTES,
        };
        let (bytes, share) = answer_within(r, MAX_ANSWER_BYTES, st.stream_idle, st.request_timeout)
            .await
            .map_err(|e| {
                if !e.starts_with(BUDGET_CUT) {
                    decode.failures.fetch_add(1, Ordering::Relaxed);
                }
                crate::upstream::bad_gateway(format!("the worker's answer was cut: {e}"))
            })?;
        drop(guard);
        // An answer that is not JSON counts against the worker (`/workers`' failures).
        let checked = json_or_502(status.as_u16(), bytes, &decode.url).inspect_err(|_| {
            decode.failures.fetch_add(1, Ordering::Relaxed);
        })?;
        held_body(checked, share)
    };
    let mut resp = Response::new(body);
    *resp.status_mut() = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    // A stream keeps its type; any other answer was checked as JSON and is said to be JSON
    // (never the worker's `text/html`, which a browser would render).
    let json = header::HeaderValue::from_static("application/json");
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        if sse { ctype.unwrap_or(json) } else { json },
    );
    if let Some(v) = retry {
        resp.headers_mut().insert(header::RETRY_AFTER, v);
    }
    resp.extensions_mut()
        .insert(ChosenWorker(decode.url.clone()));
    Ok(resp)
}

/// Waits for a worker's answer to begin: at most `--request-timeout`, and no longer than the
/// worker keeps failing its health checks ([`give_up_after`]): hung or stopped, it would
/// hold its clients for the whole timeout (30 minutes by default).
pub(crate) async fn answer_of(
    st: &RouterState,
    d: &Worker,
    sending: impl std::future::Future<Output = reqwest::Result<reqwest::Response>>,
) -> Result<reqwest::Result<reqwest::Response>, ApiError> {
    let after = give_up_after(st);
    let failing = async {
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            if d.failing_for().is_some_and(|t| t >= after) {
                return;
            }
        }
    };
    tokio::select! {
        sent = tokio::time::timeout(st.request_timeout, sending) => {
            sent.map_err(|_| timed_out(st, d))
        }
        _ = failing => Err(given_up(
            st,
            d,
            (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable"),
            format!("the worker answering this request failed its health checks for {} s (hung or stopped); send it again", after.as_secs()),
        )),
    }
}

/// How long a worker fails its health checks before the answers it owes are given up: three
/// checks, and at least 10 s (a worker's `/health` fails after its engine stalled for a minute,
/// or when it is stopped or hung; a blip is not a verdict).
pub(crate) fn give_up_after(st: &RouterState) -> Duration {
    (st.health_every * 3).max(Duration::from_secs(10))
}

/// The decode worker did not answer within `--request-timeout`: counted, logged, the 504.
pub(crate) fn timed_out(st: &RouterState, d: &Worker) -> ApiError {
    let within = st.request_timeout.as_secs_f64();
    given_up(
        st,
        d,
        (StatusCode::GATEWAY_TIMEOUT, "server_error"),
        format!("the worker did not answer within {within:.0} s (--request-timeout)"),
    )
}

/// An answer the router stopped waiting for: counted against the worker, logged, and the
/// client's error (`status` and its type) saying why.
fn given_up(
    st: &RouterState,
    d: &Worker,
    (status, kind): (StatusCode, &'static str),
    why: String,
) -> ApiError {
    st.front.upstream_errors[0].fetch_add(1, Ordering::Relaxed);
    d.failures.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(decode = %d.url, "{why}");
    ApiError::new(status, kind, why)
}

/// A worker's answer that is not passed on: counted against it; its status and its words
/// (read within bounds), which go to the log, never to the client.
async fn not_passed_on(st: &RouterState, d: &Worker, r: reqwest::Response) -> (StatusCode, String) {
    st.front.upstream_errors[1].fetch_add(1, Ordering::Relaxed);
    d.failures.fetch_add(1, Ordering::Relaxed);
    let status = StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let idle = st.stream_idle;
    let text = crate::upstream::body_within(r, 64 << 10, idle, idle)
        .await
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    (status, text)
}

/// A worker's failure before any token (to be retried on another pair): logged; what the
/// client may be told.
async fn failed_before_any_token(st: &RouterState, pair: &Pair, r: reqwest::Response) -> String {
    let d = &pair.decode;
    let (status, text) = not_passed_on(st, d, r).await;
    tracing::warn!(decode = %d.url, prefill = ?pair.prefill.as_ref().map(|w| &w.url), %status, text = ?text, "retrying on another pair");
    format!("a worker answered {status}")
}

/// A worker's 401 to the router: logged; the client gets the router's 502.
pub(crate) async fn refused_the_router(
    st: &RouterState,
    d: &Worker,
    r: reqwest::Response,
) -> ApiError {
    let (_, text) = not_passed_on(st, d, r).await;
    tracing::warn!(decode = %d.url, text = ?text, "the worker refused the router's authentication");
    crate::upstream::bad_gateway(
        "a worker refused the router's authentication (another --cluster-key-file, or a worker \
         --api-key)"
            .into(),
    )
}

async fn forward(
    State(st): St,
    headers: HeaderMap,
    body: Body_,
    path: &str,
) -> Result<Response, ApiError> {
    let arrived = std::time::Instant::now();
    // The body limit is the DefaultBodyLimit layer's: the worker's reader names a breach.
    let body = strata_server::body::body_bytes(body, st.body_limit)?;
    st.forwarded.fetch_add(1, Ordering::Relaxed);
    let mut last_err = None;
    let mut previous: Option<Pair> = None;
    // One pair at most: a retry would go back to the same workers (a queue that timed out
    // would be waited on twice), so their answer is the answer.
    let alone = st.decode.len() == 1 && st.prefill.len() <= 1;
    for attempt in 0..2 {
        let Some(pair) = pick_pair(&st, &body, previous.as_ref()).await else {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "no healthy worker to route to",
            ));
        };
        let rid = headers.get(strata_server::endpoints::REQUEST_ID);
        let prefill = pair.prefill.as_deref();
        let sending = send_to(&st, &pair.decode, prefill, path, &body, rid);
        let mut both = vec![pair.decode.clone()];
        both.extend(pair.prefill.clone());
        let guard = InFlight::start(both);
        st.front.added.observe(arrived.elapsed().as_secs_f64());
        let d = &pair.decode;
        // Not retried: the worker may still be computing it.
        let sent = answer_of(&st, d, sending).await?;
        match sent {
            // The worker refused the router itself (the router sends no client credentials:
            // another cluster key, or a worker --api-key): never the client's error.
            Ok(r) if r.status() == StatusCode::UNAUTHORIZED && (attempt == 1 || alone) => {
                return Err(refused_the_router(&st, d, r).await);
            }
            // Worker-side failures before any token (bad gateway, unavailable, a refusal of
            // the router) are retried on another pair.
            Ok(r) if attempt == 0 && !alone && matches!(r.status().as_u16(), 401 | 502 | 503) => {
                last_err = Some(failed_before_any_token(&st, &pair, r).await);
            }
            Ok(r) => return relay(&st, r, guard, d).await,
            Err(e) => {
                st.front.upstream_errors[0].fetch_add(1, Ordering::Relaxed);
                tracing::warn!(decode = %d.url, error = %e, "worker unreachable; retrying on another pair");
                d.failures.fetch_add(1, Ordering::Relaxed);
                if e.is_connect() {
                    d.healthy.store(false, Ordering::Relaxed);
                }
                last_err = Some("a worker was unreachable".into());
                // A lone pair is not asked twice: it may have run the request already (an
                // answer the transport refused), and would run it again.
                if alone {
                    return Err(unreadable(d, &e));
                }
            }
        }
        st.retries.fetch_add(1, Ordering::Relaxed);
        previous = Some(pair);
    }
    Err(ApiError::new(
        StatusCode::BAD_GATEWAY,
        "server_error",
        format!(
            "the request failed on two worker pairs: {}",
            last_err.unwrap_or_default()
        ),
    ))
}
