//! `strata route`: the router in front of prefill and decode workers (or workers doing both).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use strata_router::cache_index::IndexLimits;
use strata_router::{health_loop, index_loop, router, Policy, RouterState};

#[derive(Args, Debug, Clone)]
pub struct RouteArgs {
    /// Address to listen on: clients reach the deployment here.
    #[arg(long, default_value = "127.0.0.1", help_heading = "Server")]
    pub host: String,
    /// Port of the API (0: any free port, said in the ready line).
    #[arg(long, default_value_t = 8000, help_heading = "Server")]
    pub port: u16,
    /// A prefill worker's URL (repeat for several). With prefill workers, requests go PD:
    /// prefill on one, decode on another.
    #[arg(long, help_heading = "Workers")]
    pub prefill: Vec<String>,
    /// A decode worker's URL (repeat), or a worker doing both when no --prefill is given.
    #[arg(long, help_heading = "Workers")]
    pub decode: Vec<String>,
    /// round_robin, least_load or cache_aware (needs --model: prompts are hashed as the
    /// workers hash them, and scored against the workers' cache events).
    #[arg(long, default_value = "round_robin", help_heading = "Workers")]
    pub policy: String,
    /// The workers' GGUF file (its tokenizer and chat template), for cache_aware.
    #[arg(long, help_heading = "Workers")]
    pub model: Option<PathBuf>,
    /// Seconds between reads of the workers' cache events (cache_aware).
    #[arg(long, default_value_t = 0.05, help_heading = "Workers")]
    pub index_interval: f64,
    /// The most memory the cache index may take (cache_aware), with a unit: split evenly
    /// between the workers and the shared remote tier's pages; a worker announcing more pages
    /// than its share holds is indexed up to it. Default: 1 GiB (7.3 million pages a worker
    /// at 1 worker, 1.8 million at 8).
    #[arg(long, help_heading = "Workers")]
    pub cache_index_memory: Option<String>,
    /// Seconds between health checks of every worker. A worker that fails them for three
    /// intervals, and at least 10 s (stopped, hung, its engine stalled), has the answers it
    /// owes given up: their clients get a 503 instead of waiting --request-timeout.
    #[arg(long, default_value_t = 1.0, help_heading = "Workers")]
    pub health_interval: f64,
    /// Seconds a worker's answer stream may stay silent before the router ends the client's
    /// stream with an error event (workers send a keep-alive every 15 s: keep it above that).
    #[arg(long, default_value_t = 45.0, help_heading = "Workers")]
    pub stream_idle_timeout: f64,
    /// Seconds a worker may take to start answering a generation request, and then to finish
    /// its answer (streamed or whole); past the first the client gets a 504 and the worker a
    /// failure, past the second a stream ends with an error event and a whole answer is a 502.
    #[arg(long, default_value_t = 1800.0, help_heading = "Workers")]
    pub request_timeout: f64,
    /// A client API key (repeat); requests without a valid one get 401. Also $STRATA_API_KEY.
    #[arg(
        long,
        env = "STRATA_API_KEY",
        hide_env_values = true,
        help_heading = "Access"
    )]
    pub api_key: Vec<String>,
    /// A file of client API keys, one per line.
    #[arg(long, help_heading = "Access")]
    pub api_key_file: Option<PathBuf>,
    /// Bearer token for the router's admin endpoint (`/flush_cache`, which empties every
    /// worker's cache); without it the router refuses to flush. Also $STRATA_ADMIN_KEY.
    #[arg(
        long,
        env = "STRATA_ADMIN_KEY",
        hide_env_values = true,
        help_heading = "Access"
    )]
    pub admin_key: Option<String>,
    /// The deployment's cluster key file (as given to the workers): every call to a worker
    /// carries proof of it.
    #[arg(long, help_heading = "Access")]
    pub cluster_key_file: Option<PathBuf>,
    /// Largest request body, with a unit (the same default as `strata serve`).
    #[arg(long, default_value = "4MiB", help_heading = "Server")]
    pub body_limit: String,
    /// No log line per finished API request (by default one at info under `strata::request`:
    /// id, method, route, status, the worker that answered, duration).
    #[arg(long, help_heading = "Server")]
    pub no_request_log: bool,
    #[command(flatten)]
    pub http: crate::http_args::HttpArgs,
}

/// `strata route`'s flags, every one checked (nothing started, the model file not opened).
pub struct Checked {
    policy: Policy,
    keys: HashSet<String>,
    admin_key: Option<String>,
    addr: SocketAddr,
    body_limit: usize,
    limits: strata_server::listen::HttpLimits,
    cluster_key: Option<strata_kv::auth::ClusterKey>,
    /// cache_aware: the model file, the index's limits and `--cache-index-memory` as said.
    index: Option<(PathBuf, IndexLimits, String)>,
}

impl Checked {
    /// One of the client API keys, if the router asks for one (`strata up`'s smoke test sends
    /// it).
    pub fn a_client_key(&self) -> Option<String> {
        self.keys.iter().min().cloned()
    }
}

/// Checks every flag and combination (`strata up` does too, before any worker starts).
pub fn check(a: &RouteArgs) -> Result<Checked> {
    let Some(policy) = Policy::parse(&a.policy) else {
        bail!(
            "--policy `{}`: expected round_robin, least_load or cache_aware",
            a.policy
        );
    };
    if a.decode.is_empty() {
        bail!("no worker: give --decode URL (and --prefill URL for PD)");
    }
    crate::http_args::check_worker_urls("--prefill", &a.prefill)?;
    crate::http_args::check_worker_urls("--decode", &a.decode)?;
    use crate::http_args::check_seconds;
    check_seconds("--health-interval", a.health_interval, 0.0, false)?;
    check_seconds("--stream-idle-timeout", a.stream_idle_timeout, 0.1, true)?;
    check_seconds("--index-interval", a.index_interval, 0.0, false)?;
    check_seconds("--request-timeout", a.request_timeout, 0.0, false)?;
    let index = match policy {
        Policy::CacheAware => Some(index_flags(a)?),
        _ if a.cache_index_memory.is_some() => bail!("--cache-index-memory sizes the index of --policy cache_aware, which this router does not use"),
        _ => None,
    };
    let keys = api_keys(a)?;
    if let Some(k) = &a.admin_key {
        crate::serve::check_admin_key(k)?;
        if keys.contains(k) {
            bail!("--admin-key (or $STRATA_ADMIN_KEY) is also a client API key: every client holding it could flush every worker; give the admin its own key");
        }
    }
    let addr: SocketAddr = crate::serve::socket_of("--host", &a.host, a.port)?;
    let body_limit = crate::http_args::body_limit(&a.body_limit)?;
    let limits = a.http.limits(body_limit)?;
    let cluster_key = match &a.cluster_key_file {
        Some(f) => Some(strata_kv::auth::ClusterKey::from_file(f).context("--cluster-key-file")?),
        None => None,
    };
    Ok(Checked {
        policy,
        keys,
        admin_key: a.admin_key.clone(),
        addr,
        body_limit,
        limits,
        cluster_key,
        index,
    })
}

pub fn run(a: RouteArgs) -> Result<()> {
    let c = check(&a)?;
    if a.stream_idle_timeout <= 15.0 {
        eprintln!(
            "strata route: --stream-idle-timeout {} s is not above the workers' 15 s keep-alive: a stream with nothing to say for that long is cut",
            a.stream_idle_timeout
        );
    }
    if c.keys.is_empty() && !c.addr.ip().is_loopback() {
        eprintln!(
            "strata route: no --api-key and listening on {}: any client that reaches this address is served (give keys, or keep it on loopback behind a proxy that authenticates)",
            c.addr.ip()
        );
    }
    let mut st = RouterState::new(&a.prefill, &a.decode, c.policy);
    st.api_keys = c.keys;
    st.admin_key = c.admin_key;
    st.body_limit = c.body_limit;
    st.request_log = !a.no_request_log;
    st.stream_idle = Duration::from_secs_f64(a.stream_idle_timeout);
    st.request_timeout = Duration::from_secs_f64(a.request_timeout);
    st.cluster_key = c.cluster_key;
    if let Some(index) = c.index {
        add_cache_index(index, &mut st)?;
    }
    let index_every = Duration::from_secs_f64(a.index_interval.max(0.001));
    let every = Duration::from_secs_f64(a.health_interval);
    st.health_every = every;
    serve(
        &a,
        Arc::new(st),
        (c.policy, c.limits),
        c.addr,
        every,
        index_every,
    )
}

/// Largest `--api-key-file` read (a key a line: thousands of keys).
const API_KEY_FILE_MAX: u64 = 1 << 20;

/// The client keys: `--api-key` (each one not blank) and `--api-key-file`'s lines (a regular
/// file, opened without blocking, at most [`API_KEY_FILE_MAX`], holding at least one key). A
/// key asked for and not found is an error, never a router left open.
fn api_keys(a: &RouteArgs) -> Result<HashSet<String>> {
    if let Some(k) = a.api_key.iter().find(|k| k.trim().is_empty()) {
        bail!("--api-key `{k}` (or $STRATA_API_KEY): an empty key would refuse every client; give a key, or none for an open router");
    }
    let mut keys: HashSet<String> = a.api_key.iter().map(|k| k.trim().to_string()).collect();
    if let Some(f) = &a.api_key_file {
        let text = read_key_file(f).with_context(|| format!("--api-key-file {}", f.display()))?;
        let before = keys.len();
        keys.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(str::to_string),
        );
        if keys.len() == before && a.api_key.is_empty() {
            bail!("--api-key-file {}: no key in it (a key a line; `#` starts a comment): the router would be open", f.display());
        }
    }
    Ok(keys)
}

/// A key file's text: a regular file (a FIFO or a device is refused, not waited on or read
/// without end), at most [`API_KEY_FILE_MAX`] bytes, UTF-8.
fn read_key_file(f: &std::path::Path) -> Result<String> {
    use std::io::Read;
    let file = strata_model::gguf::open_regular(f)?;
    let mut text = String::new();
    file.take(API_KEY_FILE_MAX + 1).read_to_string(&mut text)?;
    if text.len() as u64 > API_KEY_FILE_MAX {
        bail!("larger than {API_KEY_FILE_MAX} bytes: a key file is small");
    }
    Ok(text)
}

/// cache_aware's flags: the model file (opened at start), the index interval, and the
/// index's limits over the workers it follows.
fn index_flags(a: &RouteArgs) -> Result<(PathBuf, IndexLimits, String)> {
    let Some(path) = &a.model else {
        bail!("--policy cache_aware needs --model GGUF (to hash prompts as the workers do)");
    };
    if !(a.index_interval > 0.0 && a.index_interval.is_finite()) {
        let v = strata_kv::units::shown_number(a.index_interval);
        bail!("--index-interval {v}: expected seconds > 0");
    }
    let workers = a.prefill.len() + a.decode.len();
    let (limits, said) = index_limits(a.cache_index_memory.as_deref(), workers)?;
    Ok((path.clone(), limits, said))
}

/// cache_aware: the index that hashes prompts as the workers do (their tokenizer and template).
fn add_cache_index(
    (path, limits, said): (PathBuf, IndexLimits, String),
    st: &mut RouterState,
) -> Result<()> {
    // The workers it follows, as `index_flags` counted them for the limits.
    let n = st.indexed().count();
    // The header alone: the tokenizer and template of a model of any architecture.
    let g = strata_model::GgufHeader::open(&path)?;
    let tk = strata_model::ModelTokenizer::from_gguf(&g)?;
    let tpl = g.chat_template()?;
    let index = strata_router::cache_index::CacheIndex::new(Arc::new(tk), tpl, n, limits);
    st.set_index(Arc::new(index));
    eprintln!(
        "strata route: cache index: up to {} pages a worker ({n} worker(s)) and {} remote pages, at most {} (--cache-index-memory {said})",
        limits.worker_pages,
        limits.remote_pages,
        strata_kv::units::format_bytes(limits.bytes(n)),
    );
    Ok(())
}

/// The cache index's limits within `--cache-index-memory` (`typed`, else the default) over
/// `workers` workers, and the flag's value as said at start.
fn index_limits(typed: Option<&str>, workers: usize) -> Result<(IndexLimits, String)> {
    use strata_kv::units::{echo_size, format_bytes, parse_size};
    use strata_router::cache_index::{DEFAULT_INDEX_MEMORY, MIN_WORKER_PAGES};
    let (bytes, said) = match typed {
        Some(t) => {
            let b = parse_size(t).map_err(|e| anyhow::anyhow!("--cache-index-memory: {e}"))?;
            (b, echo_size(b, t))
        }
        None => (
            DEFAULT_INDEX_MEMORY,
            format!("{}, the default", format_bytes(DEFAULT_INDEX_MEMORY)),
        ),
    };
    let Some(limits) = IndexLimits::within(bytes, workers) else {
        bail!("--cache-index-memory {said}: too small for {workers} worker(s) and the remote tier (each share must hold {MIN_WORKER_PAGES} pages)");
    };
    Ok((limits, said))
}

/// Listens on `addr` and routes until SIGTERM / Ctrl-C, checking the workers' health and
/// reading their cache events meanwhile.
fn serve(
    a: &RouteArgs,
    st: Arc<RouterState>,
    (policy, limits): (Policy, strata_server::listen::HttpLimits),
    addr: SocketAddr,
    every: Duration,
    index_every: Duration,
) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let r = rt.block_on(async move {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        // The port really bound (--port 0: any free one).
        let addr = l.local_addr()?;
        tokio::spawn(health_loop(st.clone(), every));
        tokio::spawn(index_loop(st.clone(), index_every));
        say!(
            "strata route: ready on http://{addr} ({} prefill, {} decode workers, policy {})",
            a.prefill.len(),
            a.decode.len(),
            policy.name()
        );
        let stats = st.front.http.clone();
        let gate = strata_router::front::gate(st.clone());
        strata_server::listen::serve(
            l,
            router(st),
            (limits, Some(gate)),
            stats,
            crate::serve::shutdown_signal(),
        )
        .await?;
        Ok(())
    });
    crate::serve::drop_runtime(rt);
    r
}
