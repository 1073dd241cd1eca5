//! Routes, shared state, and the serve loop with graceful shutdown.

use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use strata_engine::{EngineHandle, SamplingParams};
use strata_model::{ChatTemplate, ModelTokenizer};
use tokio::net::TcpListener;

use crate::api::{ChatRequest, CompletionRequest, Prompt, Sampling};
use crate::error::ApiError;
pub use crate::internal::watch_engine;
use crate::internal::{
    cache_events, cache_info, cache_snapshot, flush_cache, health, health_generate,
};
use crate::respond::{engine_error, first_event, stream_response, whole_response, Job, Kind};

/// Header by which the router names the prefill worker of a request sent to a decode worker.
pub const PREFILL_HEADER: &str = "x-strata-prefill";

/// What every handler shares.
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<ModelTokenizer>,
    pub template: Option<Arc<ChatTemplate>>,
    /// The name `/v1/models` lists and requests may give as `model`.
    pub model_name: String,
    /// Bearer token for admin endpoints (`/flush_cache`); None: open.
    pub admin_key: Option<String>,
    /// `max_tokens` when a request gives none (capped by the context and the pool).
    pub default_max_tokens: usize,
    /// Largest accepted request body in bytes.
    pub body_limit: usize,
    pub created: u64,
    /// This worker's KV listener (decode role): where prefill workers send K/V.
    pub kv: Option<Arc<crate::pd::KvInbox>>,
    /// How long a KV transfer may take, end to end.
    pub kv_deadline: Duration,
    /// Client for calls to prefill workers.
    pub http: reqwest::Client,
    pub transfers_sent: AtomicU64,
    pub transfer_bytes_sent: AtomicU64,
    pub transfer_failures: AtomicU64,
    pub transfer_nanos_sent: AtomicU64,
    /// Latencies and outcomes the HTTP layer measures.
    pub metrics: crate::metrics::ServerMetrics,
    /// The memory plan, exported as gauges.
    pub plan: Option<crate::metrics::PlanGauges>,
    /// prefill, decode, both or server (a label of strata_build_info).
    pub role: String,
    /// Name of the L3 tier in metrics (`disk`, `remote`).
    pub storage_tier: String,
    /// Bounds CPU work done for requests outside the engine (tokenizing, template
    /// rendering): it runs on blocking threads, this many at once, never on the async
    /// workers that answer `/health`.
    pub cpu_gate: Arc<tokio::sync::Semaphore>,
    /// The deployment's cluster key: worker-to-worker and router-to-worker calls must prove
    /// they hold it. None: this worker listens on loopback only.
    pub cluster_key: Option<strata_kv::auth::ClusterKey>,
    /// Prefill workers this decode worker may be told to use (`x-strata-prefill`).
    pub prefill_workers: Vec<String>,
    /// Cluster-call nonces seen (replays are refused).
    pub replay: crate::auth::ReplayGuard,
    /// The PD prefill work this worker does for decode workers.
    pub pd_prefill: crate::metrics::PdPrefillMetrics,
}

impl AppState {
    pub fn new(engine: EngineHandle, tokenizer: Arc<ModelTokenizer>, model_name: String) -> Self {
        AppState {
            engine,
            tokenizer,
            template: None,
            model_name,
            admin_key: None,
            default_max_tokens: 1024,
            body_limit: 4 << 20,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            kv: None,
            kv_deadline: Duration::from_secs(30),
            http: reqwest::Client::new(),
            transfers_sent: AtomicU64::new(0),
            transfer_bytes_sent: AtomicU64::new(0),
            transfer_failures: AtomicU64::new(0),
            transfer_nanos_sent: AtomicU64::new(0),
            metrics: crate::metrics::ServerMetrics::default(),
            plan: None,
            role: "server".into(),
            storage_tier: "disk".into(),
            // One core fewer than the machine has (at least one): the async workers always
            // find a core free.
            cpu_gate: cpu_gate(),
            cluster_key: None,
            prefill_workers: Vec::new(),
            replay: crate::auth::ReplayGuard::default(),
            pd_prefill: Default::default(),
        }
    }
}

type St = State<Arc<AppState>>;

/// The HTTP API.
pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.body_limit;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/health_generate", get(health_generate))
        .route("/flush_cache", post(flush_cache))
        .route("/pd/prefill", post(crate::pd::prefill))
        .route("/cache/info", get(cache_info))
        .route("/metrics", get(metrics))
        .route("/cache/events", get(cache_events))
        .route("/cache/snapshot", get(cache_snapshot))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            count_outcome,
        ))
        .with_state(state)
}

/// Serves until `signal` resolves; then refuses new requests (503), lets running ones finish
/// for up to `grace`, aborts the rest and returns.
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

pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    signal: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    let engine = state.engine.clone();
    axum::serve(no_delay(listener), router(state))
        .with_graceful_shutdown(async move {
            signal.await;
            tracing::info!(
                grace_s = grace.as_secs_f64(),
                "shutting down: new requests get 503; running requests may finish within the grace (seconds)"
            );
            let _ = tokio::task::spawn_blocking(move || engine.shutdown(grace)).await;
        })
        .await
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
        crate::metrics::worker(&st),
    )
        .into_response()
}

pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found_error",
        format!("no route {}", uri.path()),
    )
}

pub async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!("{} is not allowed on {}", method, uri.path()),
    )
}

/// Runs CPU work for a request (tokenizing, rendering) on a blocking thread, at most
/// `cpu_gate` at once, so the async workers keep answering (`/health` within milliseconds
/// while megabyte prompts are tokenized).
pub async fn off_async<T: Send + 'static>(
    st: &Arc<AppState>,
    f: impl FnOnce(&AppState) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    // The permit moves into the blocking task: a client that goes away does not free its
    // place while its tokenization still runs.
    let permit = st
        .cpu_gate
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| engine_error("the server is closing"))?;
    let st = st.clone();
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        f(&st)
    })
    .await
    .map_err(|e| engine_error(&format!("request preparation failed: {e}")))?
}

/// A gate of one core fewer than the machine has (at least one): the async workers always
/// find a core free.
pub fn cpu_gate() -> Arc<tokio::sync::Semaphore> {
    Arc::new(tokio::sync::Semaphore::new(
        std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1)),
    ))
}

pub fn parse<T: DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
    limit: usize,
) -> Result<T, ApiError> {
    parse_json(&body_bytes(body, limit)?)
}

/// The body's bytes, or a JSON 413 / 400.
pub fn body_bytes(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("the request body exceeds the limit of {limit} bytes"),
            )
        } else {
            ApiError::bad_request(format!("cannot read the request body: {e}"), None)
        }
    })
}

/// A JSON body; the error names the field at fault.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let param = if path != "." {
            Some(path)
        } else {
            failing_sampling_field(bytes)
        };
        ApiError::bad_request(
            format!("invalid request body: {}", e.inner()),
            param.as_deref(),
        )
    })
}

/// serde loses the path of an error inside a flattened struct (the sampling fields): the
/// field that fails on its own is the one to name.
fn failing_sampling_field(bytes: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(bytes).ok()?;
    v.as_object()?
        .iter()
        .find(|(k, val)| {
            serde_json::from_value::<crate::api::Sampling>(json!({ k.as_str(): val })).is_err()
        })
        .map(|(k, _)| k.clone())
}

fn check_model(st: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != &st.model_name => Err(ApiError {
            param: Some("model".into()),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found_error",
                format!(
                    "the model `{m}` does not exist; this server serves `{}`",
                    st.model_name
                ),
            )
            .with_code("model_not_found")
        }),
        _ => Ok(()),
    }
}

/// Longest stop string accepted (matching work per token grows with it).
pub const MAX_STOP_BYTES: usize = 256;

/// Checks the sampling fields and fills defaults.
fn sampling(
    st: &AppState,
    s: &Sampling,
    prompt_len: usize,
) -> Result<(SamplingParams, Vec<String>), ApiError> {
    if let Some(n) = s.n {
        if n != 1 {
            return Err(ApiError::bad_request(
                format!("n = {n}: only n = 1 is supported"),
                Some("n"),
            ));
        }
    }
    let temperature = s.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad_request(
            format!("temperature {temperature} is outside [0, 2]"),
            Some("temperature"),
        ));
    }
    let top_p = s.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad_request(
            format!("top_p {top_p} is outside (0, 1]"),
            Some("top_p"),
        ));
    }
    let top_k = match s.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::bad_request(
                format!("top_k {k}: use a positive number, or -1 / 0 for no limit"),
                Some("top_k"),
            ))
        }
    };
    let stops = s.stop.clone().map(|v| v.into_vec()).unwrap_or_default();
    if stops.len() > 16 {
        return Err(ApiError::bad_request(
            format!("{} stop strings: at most 16", stops.len()),
            Some("stop"),
        ));
    }
    if let Some(s) = stops
        .iter()
        .find(|s| s.len() > MAX_STOP_BYTES || s.is_empty())
    {
        return Err(ApiError::bad_request(
            format!(
                "a stop string of {} bytes: each must have 1 to {MAX_STOP_BYTES}",
                s.len()
            ),
            Some("stop"),
        ));
    }
    let info = st.engine.info();
    let max_tokens = match s.max_completion_tokens.or(s.max_tokens) {
        Some(0) => {
            return Err(ApiError::bad_request(
                "max_tokens must be at least 1",
                Some("max_tokens"),
            ))
        }
        Some(m) if m > info.context_length => {
            return Err(ApiError::bad_request(
                format!(
                    "max_tokens {m} exceeds the context length ({} tokens)",
                    info.context_length
                ),
                Some("max_tokens"),
            )
            .with_code("context_length_exceeded"))
        }
        Some(m) => m,
        None => {
            let room = info
                .context_length
                .min(info.device_tokens)
                .saturating_sub(prompt_len);
            st.default_max_tokens.min(room).max(1)
        }
    };
    let stop_token_ids = s.stop_token_ids.clone().unwrap_or_default();
    if stop_token_ids.len() > strata_engine::MAX_STOP_TOKEN_IDS {
        return Err(ApiError::bad_request(
            format!(
                "{} stop_token_ids: at most {}",
                stop_token_ids.len(),
                strata_engine::MAX_STOP_TOKEN_IDS
            ),
            Some("stop_token_ids"),
        ));
    }
    let params = SamplingParams {
        max_tokens,
        temperature,
        top_p,
        top_k,
        seed: s.seed,
        stop_token_ids,
        ignore_eos: s.ignore_eos.unwrap_or(false),
    };
    Ok((params, stops))
}

async fn completions(
    State(st): St,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body_bytes(body, st.body_limit)?;
    let req: CompletionRequest = parse_json(&bytes)?;
    check_model(&st, &req.model)?;
    // Token ids as given need no tokenizing; a text goes off the async workers.
    let ids = match req.prompt {
        Prompt::Tokens(t) => t,
        p => {
            off_async(&st, move |st| {
                crate::prompt::completion_ids(&st.tokenizer, &p)
            })
            .await?
        }
    };
    start(st, ids, &req.sampling, Kind::Completion, &headers, &bytes).await
}

async fn chat(
    State(st): St,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body_bytes(body, st.body_limit)?;
    let req: ChatRequest = parse_json(&bytes)?;
    check_model(&st, &req.model)?;
    if req.messages.is_empty() {
        return Err(ApiError::bad_request("messages is empty", Some("messages")));
    }
    if st.template.is_none() {
        return Err(ApiError::bad_request(
            "this model has no chat template: use /v1/completions",
            Some("messages"),
        ));
    }
    let ChatRequest {
        messages, sampling, ..
    } = req;
    let ids = off_async(&st, move |st| {
        crate::prompt::chat_ids(&st.tokenizer, st.template.as_deref(), &messages)
    })
    .await?;
    start(st, ids, &sampling, Kind::Chat, &headers, &bytes).await
}

async fn start(
    st: Arc<AppState>,
    ids: Vec<u32>,
    s: &Sampling,
    kind: Kind,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let started = std::time::Instant::now();
    let (params, stops) = sampling(&st, s, ids.len())?;
    let prefill = match headers.get(PREFILL_HEADER) {
        None => None,
        Some(v) => {
            let url = v.to_str().map_err(|_| {
                ApiError::bad_request(format!("{PREFILL_HEADER} is not ASCII"), None)
            })?;
            let path = match kind {
                Kind::Chat => "/v1/chat/completions",
                Kind::Completion => "/v1/completions",
            };
            crate::pd::check_prefill_header(&st, headers, path, body, url)?;
            Some(url.to_string())
        }
    };
    let mut rs = match prefill {
        Some(url) => crate::pd::decode_after_remote_prefill(&st, &url, ids, params).await?,
        None => st
            .engine
            .submit(ids, params)
            .map_err(|e| ApiError::from_submit(&e))?,
    };
    let first = first_event(&mut rs).await?;
    let prefix = if kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let job = Job {
        kind,
        started,
        id: format!("{prefix}-{:016x}", rs.id),
        stream: s.stream,
        include_usage: s.stream_options.as_ref().is_some_and(|o| o.include_usage),
        stops,
    };
    if job.stream {
        Ok(stream_response(st, rs, job, first).into_response())
    } else {
        whole_response(st, rs, job, first).await
    }
}

async fn models(State(st): St) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": st.model_name, "object": "model", "created": st.created, "owned_by": "strata",
        "max_model_len": st.engine.info().context_length,
    }]}))
}
