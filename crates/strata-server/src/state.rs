//! What every worker handler shares: the [`AppState`], and running request preparation off
//! the async workers.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use strata_engine::EngineHandle;
use strata_model::{ChatTemplate, ModelTokenizer};

use crate::error::{engine_error, ApiError};

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
    /// Unknown request fields are logged and ignored instead of refused (`--lenient-fields`).
    pub lenient_fields: bool,
    pub created: u64,
    /// Latencies and outcomes the HTTP layer measures.
    pub metrics: crate::metrics::ServerMetrics,
    /// The memory plan, exported as gauges.
    pub plan: Option<crate::metrics::PlanGauges>,
    /// prefill, decode, both or server (a label of strata_build_info).
    pub role: String,
    /// Name of the L3 tier in metrics (`disk`, `remote`).
    pub storage_tier: String,
    /// L3 tiers given with `--l3` but unreachable at start (served without them).
    pub l3_unavailable: usize,
    /// Bounds CPU work done for requests outside the engine (tokenizing, template
    /// rendering): it runs on blocking threads, this many at once, never on the async
    /// workers that answer `/health`.
    pub cpu_gate: Arc<tokio::sync::Semaphore>,
    /// The deployment's cluster key: worker-to-worker and router-to-worker calls must prove
    /// they hold it. None: this worker listens on loopback only.
    pub cluster_key: Option<strata_kv::auth::ClusterKey>,
    /// This process's instance and the cluster-call nonces it accepted (replays, and calls
    /// signed for another worker or an earlier start, are refused).
    pub replay: crate::auth::ReplayGuard,
    /// Prefill/decode disaggregation: the KV listener, the prefill workers, PD metrics.
    pub pd: PdSide,
    /// The grammar engine over this model's tokenizer, built on the first structured request
    /// (its error, if the tokenizer cannot be described to it).
    pub grammars: std::sync::OnceLock<Result<Arc<strata_grammar::Grammars>, String>>,
    /// The conversations `/v1/responses`' `previous_response_id` continues.
    pub responses: Arc<crate::response_store::ResponseStore>,
    /// What the HTTP listener saw (connections, timeouts).
    pub http: Arc<crate::listen::HttpStats>,
    /// One log line per finished request ([`crate::request_log`]; `--no-request-log`: off).
    pub request_log: bool,
    /// The L3 tiers, measured when `/metrics` is read (bytes, entries, evictions per tier).
    pub l3: Option<Arc<dyn strata_kv::storage::Storage>>,
}

/// A worker's side of prefill/decode disaggregation.
pub struct PdSide {
    /// This worker's KV listener (decode role): where prefill workers send K/V.
    pub kv: Option<Arc<crate::kv_inbox::KvInbox>>,
    /// How long a KV transfer may take, end to end.
    pub kv_deadline: Duration,
    /// Client for calls to prefill workers.
    pub http: reqwest::Client,
    /// The prefill workers' instances, learnt from their answers (cluster MACs name them).
    pub peers: crate::auth::Peers,
    /// Prefill workers this decode worker may be told to use (`x-strata-prefill`).
    pub prefill_workers: Vec<String>,
    /// A PD request whose prompt this decode worker's cache holds but for at most this many
    /// tokens is computed here, without a prefill worker (`--pd-local-prefill-tokens`).
    pub local_prefill_tokens: usize,
    /// A PD request is matched in this decode worker's cache first, and only the pages after
    /// the prefix it holds cross (`--pd-decode-reuse`; false: the whole prompt's K/V, always).
    pub decode_reuse: bool,
    /// The PD prefill work this worker does for decode workers, and the K/V it sends.
    pub metrics: crate::metrics::PdPrefillMetrics,
}

/// `--pd-local-prefill-tokens` by default: a conversation's next turn of a few sentences is
/// computed on the decode worker that holds the conversation (a chunk of a few hundred
/// tokens beside its decode steps), a longer one by a prefill worker.
pub const DEFAULT_LOCAL_PREFILL_TOKENS: usize = 256;

impl Default for PdSide {
    fn default() -> Self {
        PdSide {
            kv: None,
            kv_deadline: Duration::from_secs(30),
            // Idle connections to prefill workers are dropped before their servers' idle
            // keep-alive limit (--header-timeout, 20 s by default) would close them.
            http: reqwest::Client::builder()
                // A worker's redirect is its answer, never followed: it could send a call
                // (its body, its cluster signature) anywhere.
                .redirect(reqwest::redirect::Policy::none())
                // Straight to the worker URLs the flags name: never through a proxy that
                // `$HTTP_PROXY` names (the calls carry cluster signatures and admin keys).
                .no_proxy()
                .pool_idle_timeout(Duration::from_secs(4))
                .build()
                .expect("HTTP client"),
            peers: Default::default(),
            prefill_workers: Vec::new(),
            local_prefill_tokens: DEFAULT_LOCAL_PREFILL_TOKENS,
            decode_reuse: true,
            metrics: Default::default(),
        }
    }
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
            lenient_fields: false,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            metrics: crate::metrics::ServerMetrics::default(),
            plan: None,
            role: "server".into(),
            storage_tier: "disk".into(),
            l3_unavailable: 0,
            // One core fewer than the machine has (at least one): the async workers always
            // find a core free.
            cpu_gate: cpu_gate(),
            cluster_key: None,
            replay: crate::auth::ReplayGuard::default(),
            pd: PdSide::default(),
            grammars: std::sync::OnceLock::new(),
            responses: Arc::default(),
            http: Default::default(),
            request_log: true,
            l3: None,
        }
    }
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

pub use crate::ids::fresh_id;
