//! What the router's handlers share: the worker pools, the policy, the cache index, the
//! scraped figures and the front-door metrics.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_protocol::WorkerRole;

use crate::cache_index::CacheIndex;
use crate::metrics::{FrontMetrics, RouterView, WorkerView};
use crate::policy::{CacheAware, LeastLoad, LoadBalancingPolicy, Policy, RoundRobin};
use crate::scrape::{History, WorkerStats};
use crate::worker::Worker;

pub struct RouterState {
    /// Prefill workers (empty: no PD, `decode` workers do both).
    pub prefill: Vec<Arc<Worker>>,
    /// Decode workers, or workers doing both.
    pub decode: Vec<Arc<Worker>>,
    pub policy: Policy,
    /// The policy at work (cache-aware needs the index: see [`RouterState::set_index`]).
    balancer: Box<dyn LoadBalancingPolicy>,
    pub api_keys: HashSet<String>,
    /// The bearer token `/flush_cache` needs (`--admin-key`); None: the router flushes nothing.
    pub admin_key: Option<String>,
    pub client: reqwest::Client,
    pub retries: AtomicU64,
    /// Requests forwarded (first attempts).
    pub forwarded: AtomicU64,
    pub body_limit: usize,
    /// The cache index (set with [`RouterState::set_index`], which also arms the cache-aware
    /// policy).
    index: Option<Arc<CacheIndex>>,
    /// The latest scrape of each worker's `/metrics` (by URL), for `/dashboard`.
    pub scraped: Mutex<HashMap<String, WorkerStats>>,
    /// What the dashboard draws over time: a ring of samples (15 minutes at the health
    /// interval of 1 s).
    pub history: Mutex<History>,
    /// How often workers are checked and samples recorded (set by `health_loop`'s caller).
    pub health_every: Duration,
    /// The deployment's cluster key: every call to a worker carries proof of it.
    pub cluster_key: Option<strata_kv::auth::ClusterKey>,
    /// The workers' instances, learnt from their answers (cluster MACs name them).
    pub peers: strata_server::auth::Peers,
    /// Bounds the prompt hashing of cache-aware routing (CPU work, off the async workers).
    pub cpu_gate: Arc<tokio::sync::Semaphore>,
    /// Which decode worker stores which `/v1/responses` response.
    pub response_owners: Mutex<crate::response_owners::Owners>,
    /// Requests by route, status and worker; latencies; upstream and auth failures.
    pub front: FrontMetrics,
    /// A worker's answer stream silent this long is cut (the client gets an error event).
    /// Workers send a keep-alive comment every 15 s: keep it above that.
    pub stream_idle: Duration,
    /// The longest a worker may take to start its answer to a generation request (a
    /// non-streamed one is sent whole when done): past it the client gets a 504.
    pub request_timeout: Duration,
    /// The last `/health_generate` answer (status, body) and when it came: concurrent and
    /// repeated calls within a second share it (the path is open, and each call costs a
    /// worker a generation).
    pub health_generate: tokio::sync::Mutex<Option<(std::time::Instant, u16, axum::body::Bytes)>>,
    /// One log line per finished API request (`strata route --no-request-log`: off).
    pub request_log: bool,
    /// The last `/cache/curve` answer and when it was made: calls within a second share it
    /// (the path is open, and each answer reads every worker).
    pub curve: tokio::sync::Mutex<Option<(std::time::Instant, strata_protocol::FleetCurve)>>,
}

/// TCP keep-alive on every connection to a worker: a peer whose link went down is found
/// within about idle + interval × retries (8 s) even while no answer byte is due.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
pub const KEEPALIVE_RETRIES: u32 = 3;

impl RouterState {
    pub fn new(prefill: &[String], decode: &[String], policy: Policy) -> RouterState {
        let balancer: Box<dyn LoadBalancingPolicy> = match policy {
            Policy::RoundRobin => Box::new(RoundRobin::default()),
            // Cache-aware without an index yet: least load.
            Policy::LeastLoad | Policy::CacheAware => Box::new(LeastLoad),
        };
        // Cache index places: the prefill workers, then the decode workers.
        let np = prefill.len();
        RouterState {
            prefill: (0..np).map(|i| Worker::at(&prefill[i], i)).collect(),
            decode: (0..decode.len())
                .map(|j| Worker::at(&decode[j], np + j))
                .collect(),
            policy,
            balancer,
            api_keys: HashSet::new(),
            admin_key: None,
            client: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(2))
                // A worker's redirect is its answer, never followed: it could send a call
                // (its body, its cluster signature) anywhere.
                .redirect(reqwest::redirect::Policy::none())
                // Straight to the worker URLs the flags name: never through a proxy that
                // `$HTTP_PROXY` names (the calls carry cluster signatures and admin keys).
                .no_proxy()
                // Idle connections are dropped before the workers' idle keep-alive limit
                // (--header-timeout, 20 s by default) would close them under a request.
                .pool_idle_timeout(Duration::from_secs(4))
                .tcp_keepalive(KEEPALIVE_IDLE)
                .tcp_keepalive_interval(KEEPALIVE_INTERVAL)
                .tcp_keepalive_retries(KEEPALIVE_RETRIES)
                .build()
                .expect("HTTP client"),
            retries: AtomicU64::new(0),
            forwarded: AtomicU64::new(0),
            body_limit: 4 << 20,
            index: None,
            scraped: Mutex::new(HashMap::new()),
            history: Default::default(),
            health_every: Duration::from_secs(1),
            cluster_key: None,
            peers: Default::default(),
            cpu_gate: strata_server::state::cpu_gate(),
            response_owners: Default::default(),
            front: Default::default(),
            stream_idle: Duration::from_secs(45),
            request_timeout: Duration::from_secs(1800),
            health_generate: Default::default(),
            curve: Default::default(),
            request_log: true,
        }
    }

    /// Follows the workers' caches with `index` (the cache-aware policy scores on it).
    pub fn set_index(&mut self, index: Arc<CacheIndex>) {
        if self.policy == Policy::CacheAware {
            self.balancer = Box::new(CacheAware::new(index.clone()));
        }
        self.index = Some(index);
    }

    /// The cache index, when the router follows the workers' caches.
    pub fn index(&self) -> Option<&Arc<CacheIndex>> {
        self.index.as_ref()
    }

    pub fn balancer(&self) -> &dyn LoadBalancingPolicy {
        self.balancer.as_ref()
    }

    /// The workers whose cache events the index follows: every worker (under PD the decode
    /// workers' caches serve the prefix they hold too), in index order.
    pub fn indexed(&self) -> impl Iterator<Item = &Arc<Worker>> {
        self.prefill.iter().chain(&self.decode)
    }

    /// The workers whose caches serve prompts: prefill workers under PD, else the workers.
    pub fn cache_pool(&self) -> &[Arc<Worker>] {
        if self.prefill.is_empty() {
            &self.decode
        } else {
            &self.prefill
        }
    }

    /// The role of the workers in `decode`: decode under PD, else both.
    pub fn decode_role(&self) -> WorkerRole {
        if self.prefill.is_empty() {
            WorkerRole::Both
        } else {
            WorkerRole::Decode
        }
    }

    /// Every worker in the order the router lists them, with its role.
    pub fn all_workers(&self) -> Vec<(&Arc<Worker>, WorkerRole)> {
        let role = self.decode_role();
        self.prefill
            .iter()
            .map(|w| (w, WorkerRole::Prefill))
            .chain(self.decode.iter().map(|w| (w, role)))
            .collect()
    }

    /// Its figures now, for `/metrics` and `/workers`.
    pub fn view(&self) -> RouterView {
        RouterView {
            policy: self.policy.name(),
            forwarded: self.forwarded.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            cache: self.balancer.cache_stats().unwrap_or_default(),
            resyncs: self.index.as_ref().map_or(0, |i| i.resyncs()),
            index: self.index.as_ref().map(|i| i.footprint()),
            workers: self
                .all_workers()
                .into_iter()
                .map(|(w, role)| WorkerView {
                    url: w.url.clone(),
                    role,
                    healthy: w.is_healthy(),
                    in_flight: w.load() as u64,
                    requests: w.requests.load(Ordering::Relaxed),
                    failures: w.failures.load(Ordering::Relaxed),
                })
                .collect(),
        }
    }
}
