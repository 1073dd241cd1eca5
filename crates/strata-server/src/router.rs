//! The router: an OpenAI-compatible front door over workers addressed by URL. For each request
//! it picks a prefill and a decode worker (PD) or one worker doing both, forwards the request
//! (the decode worker coordinates the K/V handoff), and streams the answer back. Workers are
//! health-checked; a request that has not started streaming is retried once on another pair.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde_json::json;

use crate::app::PREFILL_HEADER;
use crate::cache_index::{CacheIndex, DEVICE_WEIGHT, HOST_WEIGHT, LOAD_TOKENS, REMOTE_WEIGHT};
pub use crate::dashboard::{health_loop, WorkerStats};
use crate::error::ApiError;

/// How to pick workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    RoundRobin,
    LeastLoad,
    /// Most cached prefix (device pages weigh more than host pages) minus load, from the
    /// workers' cache events.
    CacheAware,
}

impl Policy {
    pub fn parse(s: &str) -> Option<Policy> {
        match s {
            "round_robin" => Some(Policy::RoundRobin),
            "least_load" => Some(Policy::LeastLoad),
            "cache_aware" => Some(Policy::CacheAware),
            _ => None,
        }
    }
    pub fn name(&self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::LeastLoad => "least_load",
            Policy::CacheAware => "cache_aware",
        }
    }
}

/// One worker as the router sees it.
pub struct Worker {
    pub url: String,
    pub healthy: AtomicBool,
    /// Unix milliseconds of the last successful scrape of its `/metrics` (0: never).
    pub last_seen_ms: AtomicU64,
    pub in_flight: AtomicUsize,
    pub requests: AtomicU64,
    pub failures: AtomicU64,
}

impl Worker {
    fn new(url: &str) -> Arc<Worker> {
        Arc::new(Worker {
            url: url.trim_end_matches('/').to_string(),
            healthy: AtomicBool::new(true),
            last_seen_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        })
    }
}

pub struct RouterState {
    /// Prefill workers (empty: no PD, `decode` workers do both).
    pub prefill: Vec<Arc<Worker>>,
    /// Decode workers, or workers doing both.
    pub decode: Vec<Arc<Worker>>,
    pub policy: Policy,
    pub api_keys: HashSet<String>,
    pub client: reqwest::Client,
    rr: AtomicUsize,
    pub retries: AtomicU64,
    /// Requests forwarded (first attempts).
    pub forwarded: AtomicU64,
    pub body_limit: usize,
    /// The cache index (cache_aware policy).
    pub index: Option<Arc<CacheIndex>>,
    /// Cache-aware decisions that found a cached prefix / found none.
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    /// Cached pages on the chosen worker at decision time, by tier.
    pub hit_pages_device: AtomicU64,
    pub hit_pages_host: AtomicU64,
    pub hit_pages_remote: AtomicU64,
    /// The latest scrape of each worker's `/metrics` (by URL), for `/dashboard`.
    pub scraped: std::sync::Mutex<std::collections::HashMap<String, WorkerStats>>,
    /// What the dashboard draws over time: a ring of samples (15 minutes at the health
    /// interval of 1 s).
    pub history: std::sync::Mutex<crate::dashboard::History>,
    /// How often workers are checked and samples recorded (set by `health_loop`'s caller).
    pub health_every: Duration,
    /// The deployment's cluster key: every call to a worker carries proof of it.
    pub cluster_key: Option<strata_kv::auth::ClusterKey>,
    /// Bounds the prompt hashing of cache-aware routing (CPU work, off the async workers).
    pub cpu_gate: Arc<tokio::sync::Semaphore>,
    /// Requests by route, status and worker; latencies; upstream and auth failures.
    pub front: crate::metrics::FrontMetrics,
}

impl RouterState {
    pub fn new(prefill: &[String], decode: &[String], policy: Policy) -> RouterState {
        RouterState {
            prefill: prefill.iter().map(|u| Worker::new(u)).collect(),
            decode: decode.iter().map(|u| Worker::new(u)).collect(),
            policy,
            api_keys: HashSet::new(),
            client: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(2))
                .build()
                .expect("HTTP client"),
            rr: AtomicUsize::new(0),
            retries: AtomicU64::new(0),
            forwarded: AtomicU64::new(0),
            body_limit: 4 << 20,
            index: None,
            cache_hits: AtomicU64::new(0),
            cache_misses: AtomicU64::new(0),
            hit_pages_device: AtomicU64::new(0),
            hit_pages_host: AtomicU64::new(0),
            hit_pages_remote: AtomicU64::new(0),
            scraped: std::sync::Mutex::new(std::collections::HashMap::new()),
            history: Default::default(),
            health_every: Duration::from_secs(1),
            cluster_key: None,
            cpu_gate: crate::app::cpu_gate(),
            front: Default::default(),
        }
    }

    /// The workers whose caches serve prompts: prefill workers under PD, else the workers.
    pub fn cache_pool(&self) -> &[Arc<Worker>] {
        if self.prefill.is_empty() {
            &self.decode
        } else {
            &self.prefill
        }
    }

    /// Cache-aware choice in the cache pool: most weighted cached prefix minus load.
    fn pick_cached(&self, body: &[u8], avoid: Option<&Arc<Worker>>) -> Option<Arc<Worker>> {
        let index = self.index.as_ref()?;
        let hashes = index.hashes(&index.prompt_tokens(body)?);
        let ps = index.page_size() as f64;
        let pool = self.cache_pool();
        let mut best: Option<(f64, usize, usize, usize, usize)> = None; // score, worker, pages by tier
        let start = self.rr.fetch_add(1, Ordering::Relaxed);
        for k in 0..pool.len() {
            let i = (start + k) % pool.len();
            let w = &pool[i];
            if !w.healthy.load(Ordering::Relaxed)
                || (avoid.is_some_and(|a| Arc::ptr_eq(a, w)) && pool.len() > 1)
            {
                continue;
            }
            let (dev, host, rem) = index.cached_prefix(i, &hashes);
            let score = (dev as f64 * DEVICE_WEIGHT
                + host as f64 * HOST_WEIGHT
                + rem as f64 * REMOTE_WEIGHT)
                * ps
                - LOAD_TOKENS * w.in_flight.load(Ordering::Relaxed) as f64;
            if best.is_none_or(|b| score > b.0) {
                best = Some((score, i, dev, host, rem));
            }
        }
        let (_, i, dev, host, rem) = best?;
        if dev + host + rem > 0 {
            self.cache_hits.fetch_add(1, Ordering::Relaxed);
            self.hit_pages_device
                .fetch_add(dev as u64, Ordering::Relaxed);
            self.hit_pages_host
                .fetch_add(host as u64, Ordering::Relaxed);
            self.hit_pages_remote
                .fetch_add(rem as u64, Ordering::Relaxed);
        } else {
            self.cache_misses.fetch_add(1, Ordering::Relaxed);
        }
        Some(pool[i].clone())
    }

    fn pick(&self, pool: &[Arc<Worker>], avoid: Option<&Arc<Worker>>) -> Option<Arc<Worker>> {
        let up: Vec<&Arc<Worker>> = pool
            .iter()
            .filter(|w| w.healthy.load(Ordering::Relaxed))
            .filter(|w| avoid.is_none_or(|a| !Arc::ptr_eq(a, w)) || pool.len() == 1)
            .collect();
        if up.is_empty() {
            return None;
        }
        let w = match self.policy {
            Policy::RoundRobin => up[self.rr.fetch_add(1, Ordering::Relaxed) % up.len()],
            Policy::LeastLoad | Policy::CacheAware => up
                .iter()
                .min_by_key(|w| w.in_flight.load(Ordering::Relaxed))
                .expect("non-empty"),
        };
        Some(w.clone())
    }
}

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
        .fallback(crate::app::not_found)
        .method_not_allowed_fallback(crate::app::method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            front_door,
        ))
        .with_state(state)
}

/// The decode worker (or the one worker) that answered a request.
#[derive(Clone)]
struct ChosenWorker(String);

/// Counts every answer by route, status and worker; for the API routes, also the time to the
/// end of the answer (when its body is done or dropped) and the requests in flight.
async fn front_door(
    State(st): St,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let route = match req.uri().path() {
        p @ ("/v1/chat/completions"
        | "/v1/completions"
        | "/v1/models"
        | "/health"
        | "/metrics"
        | "/workers"
        | "/dashboard"
        | "/dashboard/data") => p.to_string(),
        _ => "other".to_string(),
    };
    let api = route.starts_with("/v1/");
    // Made before the handler runs: if the client goes away and the handler is dropped, the
    // request still leaves the in-flight gauge, and is counted as 499 (client closed).
    let mut end = api.then(|| End {
        st: st.clone(),
        t: std::time::Instant::now(),
        route: route.clone(),
        answered: false,
    });
    if api {
        st.front.in_flight.fetch_add(1, Ordering::Relaxed);
    }
    let resp = next.run(req).await;
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
    let (parts, body) = resp.into_parts();
    let body = Body::from_stream(body.into_data_stream().map(move |c| {
        let _end = &end;
        c
    }));
    Response::from_parts(parts, body)
}

/// Ends an API request's measurement when its body is done or dropped (or when the request
/// is dropped before an answer: then it is counted as 499).
struct End {
    st: Arc<RouterState>,
    t: std::time::Instant,
    route: String,
    answered: bool,
}

impl Drop for End {
    fn drop(&mut self) {
        let f = &self.st.front;
        if !self.answered {
            f.answered(&self.route, 499, "none");
        }
        f.duration.observe(self.t.elapsed().as_secs_f64());
        f.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Follows the cache events of the cache pool's workers, every `every`.
pub async fn index_loop(state: Arc<RouterState>, every: Duration) {
    let Some(index) = state.index.clone() else {
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

type St = State<Arc<RouterState>>;

fn check_key(st: &RouterState, headers: &HeaderMap) -> Result<(), ApiError> {
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
    let given = crate::error::bearer(headers);
    // Every key is compared, each in constant time: the answer's timing says nothing about
    // which key or which byte was close.
    let ok = given.is_some_and(|g| {
        st.api_keys
            .iter()
            .fold(false, |ok, k| crate::error::secret_eq(g, k) | ok)
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

type Body_ = Result<Bytes, axum::extract::rejection::BytesRejection>;

async fn forward_chat(st: St, headers: HeaderMap, body: Body_) -> Result<Response, ApiError> {
    forward(st, headers, body, "/v1/chat/completions").await
}

async fn forward_completions(
    st: St,
    headers: HeaderMap,
    body: Body_,
) -> Result<Response, ApiError> {
    forward(st, headers, body, "/v1/completions").await
}

/// The SSE event a client gets when the worker's stream broke before its end: an error in
/// OpenAI's shape, then `[DONE]`, so that no client mistakes a truncated answer for a whole
/// one.
pub fn broken_stream_tail(why: &str) -> Bytes {
    let e = ApiError::new(
        StatusCode::BAD_GATEWAY,
        "server_error",
        format!("the worker's stream broke before the end of the answer: {why}"),
    );
    // A blank line first: the break may have cut an event in the middle of its line.
    Bytes::from(format!("\n\ndata: {}\n\ndata: [DONE]\n\n", e.body()))
}

/// The worker's SSE body, passed through; if it fails (the worker died) or ends without
/// `[DONE]`, the client gets [`broken_stream_tail`] and a clean end of stream.
fn guard_sse<S>(
    upstream: S,
    keep: InFlight,
    st: Arc<RouterState>,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>>
where
    S: futures_util::Stream<Item = Result<Bytes, reqwest::Error>> + Send + Unpin + 'static,
{
    struct G<S> {
        up: S,
        done_seen: bool,
        tail: [u8; 16],
        over: bool,
        _keep: InFlight,
        st: Arc<RouterState>,
    }
    futures_util::stream::unfold(
        G {
            up: upstream,
            done_seen: false,
            // A newline: the stream's first line starts a line.
            tail: {
                let mut t = [0u8; 16];
                t[15] = b'\n';
                t
            },
            over: false,
            _keep: keep,
            st,
        },
        |mut g| async move {
            if g.over {
                return None;
            }
            match g.up.next().await {
                Some(Ok(b)) => {
                    // The end of stream is a line `data: [DONE]` (model text inside an event is
                    // JSON, never at a line's start). It may straddle two chunks: look at the
                    // last bytes of both; the stream's start counts as a line start.
                    let mut w = g.tail.to_vec();
                    w.extend_from_slice(&b);
                    if w.windows(13).any(|x| x == b"\ndata: [DONE]") {
                        g.done_seen = true;
                    }
                    let n = w.len().min(16);
                    g.tail = [0; 16];
                    g.tail[16 - n..].copy_from_slice(&w[w.len() - n..]);
                    Some((Ok(b), g))
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "a worker's stream broke; ending the client's stream with an error event");
                    g.st.front.upstream_errors[2].fetch_add(1, Ordering::Relaxed);
                    g.over = true;
                    Some((Ok(broken_stream_tail("connection lost")), g))
                }
                None if !g.done_seen => {
                    g.st.front.upstream_errors[2].fetch_add(1, Ordering::Relaxed);
                    g.over = true;
                    Some((Ok(broken_stream_tail("it ended without [DONE]")), g))
                }
                None => None,
            }
        },
    )
}

/// Decrements a worker's in-flight count when the response body is done (or dropped).
struct InFlight(Vec<Arc<Worker>>);

impl Drop for InFlight {
    fn drop(&mut self) {
        for w in &self.0 {
            w.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

async fn forward(
    State(st): St,
    headers: HeaderMap,
    body: Body_,
    path: &str,
) -> Result<Response, ApiError> {
    let arrived = std::time::Instant::now();
    check_key(&st, &headers)?;
    // The body limit is the DefaultBodyLimit layer's: the worker's reader names a breach.
    let body = crate::app::body_bytes(body, st.body_limit)?;
    st.forwarded.fetch_add(1, Ordering::Relaxed);
    let mut last_err = None;
    let (mut avoid_p, mut avoid_d) = (None, None);
    for attempt in 0..2 {
        let cached = if st.policy == Policy::CacheAware {
            let avoid = if st.prefill.is_empty() {
                avoid_d.as_ref()
            } else {
                avoid_p.as_ref()
            };
            // Tokenizing the prompt is CPU work: off the async workers, a bounded number at
            // once (the permit goes with the task).
            let permit = st.cpu_gate.clone().acquire_owned().await.ok();
            let (st2, body2, avoid) = (st.clone(), body.clone(), avoid.cloned());
            tokio::task::spawn_blocking(move || {
                let _permit = permit;
                st2.pick_cached(&body2, avoid.as_ref())
            })
            .await
            .ok()
            .flatten()
        } else {
            None
        };
        let (d, p) = match (cached, st.prefill.is_empty()) {
            (Some(w), true) => (Some(w), None),
            (Some(w), false) => (st.pick(&st.decode, avoid_d.as_ref()), Some(w)),
            (None, true) => (st.pick(&st.decode, avoid_d.as_ref()), None),
            (None, false) => (
                st.pick(&st.decode, avoid_d.as_ref()),
                st.pick(&st.prefill, avoid_p.as_ref()),
            ),
        };
        let (Some(d), true) = (d, st.prefill.is_empty() || p.is_some()) else {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "no healthy worker to route to",
            ));
        };
        let mut guard = vec![d.clone()];
        d.in_flight.fetch_add(1, Ordering::Relaxed);
        d.requests.fetch_add(1, Ordering::Relaxed);
        let mut req = st
            .client
            .post(format!("{}{path}", d.url))
            .header(header::CONTENT_TYPE, "application/json")
            .body(body.clone());
        if let Some(p) = &p {
            p.in_flight.fetch_add(1, Ordering::Relaxed);
            p.requests.fetch_add(1, Ordering::Relaxed);
            guard.push(p.clone());
            req = req.header(PREFILL_HEADER, &p.url);
        }
        if let Some(k) = &st.cluster_key {
            let call = crate::auth::Call {
                method: "POST",
                target: path,
                body: &body,
                prefill: p.as_ref().map(|w| w.url.as_str()),
            };
            req = req.header(crate::auth::AUTH_HEADER, crate::auth::sign(k, &call));
        }
        let guard = InFlight(guard);
        st.front.added.observe(arrived.elapsed().as_secs_f64());
        match req.send().await {
            // Worker-side failures before any token (bad gateway, unavailable) are retried.
            Ok(r) if attempt == 0 && matches!(r.status().as_u16(), 502 | 503) => {
                st.front.upstream_errors[1].fetch_add(1, Ordering::Relaxed);
                let status = r.status();
                let text = r.text().await.unwrap_or_default();
                // The worker's words go to the log, never to the client.
                tracing::warn!(decode = %d.url, prefill = ?p.as_ref().map(|w| &w.url), %status, %text, "retrying on another pair");
                d.failures.fetch_add(1, Ordering::Relaxed);
                last_err = Some(format!("a worker answered {status}"));
            }
            Ok(r) => {
                let status = r.status();
                if matches!(status.as_u16(), 502 | 503) {
                    st.front.upstream_errors[1].fetch_add(1, Ordering::Relaxed);
                }
                let ctype = r.headers().get(header::CONTENT_TYPE).cloned();
                let sse = ctype
                    .as_ref()
                    .and_then(|c| c.to_str().ok())
                    .is_some_and(|c| c.starts_with("text/event-stream"));
                let body = if sse {
                    Body::from_stream(guard_sse(Box::pin(r.bytes_stream()), guard, st.clone()))
                } else {
                    Body::from_stream(r.bytes_stream().map(move |c| {
                        let _keep = &guard;
                        c
                    }))
                };
                let mut resp = Response::new(body);
                *resp.status_mut() =
                    StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
                if let Some(c) = ctype {
                    resp.headers_mut().insert(header::CONTENT_TYPE, c);
                }
                resp.extensions_mut().insert(ChosenWorker(d.url.clone()));
                return Ok(resp);
            }
            Err(e) => {
                st.front.upstream_errors[0].fetch_add(1, Ordering::Relaxed);
                tracing::warn!(decode = %d.url, error = %e, "worker unreachable; retrying on another pair");
                d.failures.fetch_add(1, Ordering::Relaxed);
                if e.is_connect() {
                    d.healthy.store(false, Ordering::Relaxed);
                }
                last_err = Some("a worker was unreachable".into());
            }
        }
        st.retries.fetch_add(1, Ordering::Relaxed);
        avoid_d = Some(d);
        avoid_p = p;
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

async fn metrics(State(st): St) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::metrics::router(&st),
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
    let up = st.decode.iter().any(|w| w.healthy.load(Ordering::Relaxed))
        && (st.prefill.is_empty() || st.prefill.iter().any(|w| w.healthy.load(Ordering::Relaxed)));
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
    let list = |ws: &[Arc<Worker>], role: &str| -> Vec<serde_json::Value> {
        ws.iter()
            .map(|w| {
                json!({"url": w.url, "role": role, "healthy": w.healthy.load(Ordering::Relaxed),
                       "in_flight": w.in_flight.load(Ordering::Relaxed),
                       "requests": w.requests.load(Ordering::Relaxed),
                       "failures": w.failures.load(Ordering::Relaxed)})
            })
            .collect()
    };
    let role = if st.prefill.is_empty() {
        "both"
    } else {
        "decode"
    };
    let mut all = list(&st.prefill, "prefill");
    all.extend(list(&st.decode, role));
    let ca = json!({"hits": st.cache_hits.load(Ordering::Relaxed),
                    "misses": st.cache_misses.load(Ordering::Relaxed),
                    "hit_pages_device": st.hit_pages_device.load(Ordering::Relaxed),
                    "hit_pages_host": st.hit_pages_host.load(Ordering::Relaxed),
                    "hit_pages_remote": st.hit_pages_remote.load(Ordering::Relaxed),
                    "resyncs": st.index.as_ref().map(|i| i.resyncs()).unwrap_or(0)});
    Json(
        json!({"policy": st.policy.name(), "retries": st.retries.load(Ordering::Relaxed),
                "cache_aware": ca, "workers": all}),
    )
}
