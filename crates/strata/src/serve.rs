//! `strata serve`: one worker (model + tiered cache + engine) behind the OpenAI API.
//!
//! Order: every flag is checked and the memory plan printed before anything is allocated; a
//! bad flag or a plan that does not fit exits once with the reason (exit code 2), never a loop.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{ArgAction, Args};
use strata_engine::{Engine, EngineConfig};
use strata_kv::auth::ClusterKey;
use strata_kv::storage::{DiskStorage, Storage};
use strata_kv::units::parse_size;
use strata_kv::{CacheConfig, EvictionPolicy, PageLayout, TieredCache, WritePolicy};
use strata_mem::{make_plan, NumaAllocator, Plan, PlanRequest};
use strata_model::fetch::{cache_dir, ensure_model};
use strata_model::ModelTokenizer;
use strata_server::state::DEFAULT_LOCAL_PREFILL_TOKENS as LOCAL_PREFILL;
use strata_server::AppState;

use crate::serve_tp;
use crate::sizing::SizingArgs;

#[derive(Args, Debug, Clone)]
// A worker serves the model it loads: the sizing flags it would refuse are not offered (still
// refused with the reason when given).
#[command(mut_arg("model_preset", |a| a.hide(true)))]
#[command(mut_arg("machine", |a| a.hide(true)))]
pub struct ServeArgs {
    #[command(flatten)]
    pub sizing: SizingArgs,
    #[command(flatten)]
    pub http: crate::http_args::HttpArgs,

    /// Address to listen on (loopback unless you mean it).
    #[arg(long, default_value = "127.0.0.1", help_heading = "Server")]
    pub host: String,
    /// Port of the HTTP API (0: any free port, said in the ready line).
    #[arg(long, default_value_t = 8000, help_heading = "Server")]
    pub port: u16,
    /// Name clients use as `model` (default: the GGUF file name without extension).
    #[arg(long, help_heading = "Server")]
    pub served_model_name: Option<String>,
    /// Bearer token required by admin endpoints (/flush_cache). Also $STRATA_ADMIN_KEY.
    #[arg(
        long,
        env = "STRATA_ADMIN_KEY",
        hide_env_values = true,
        help_heading = "Server"
    )]
    pub admin_key: Option<String>,
    /// Largest request body, with a unit.
    #[arg(long, default_value = "4MiB", help_heading = "Server")]
    pub body_limit: String,
    /// Log and ignore request fields this server does not know instead of refusing them
    /// (docs/API.md lists the fields it knows; refused ones stay refused).
    #[arg(long, help_heading = "Server")]
    pub lenient_fields: bool,
    /// Seconds running requests may take to finish after SIGTERM / Ctrl-C.
    #[arg(long, default_value_t = 30.0, help_heading = "Server")]
    pub shutdown_grace: f64,
    /// The deployment's cluster key (a file of ≥ 32 secret bytes, mode 600; `strata up`
    /// makes one). It authenticates the router and the other workers (KV transfer, /pd/prefill,
    /// /cache/*) and keys L3 page checksums. Without it the worker listens on loopback only.
    #[arg(long, help_heading = "Server")]
    pub cluster_key_file: Option<PathBuf>,

    /// Conversations kept for /v1/responses' previous_response_id: at most this many bytes
    /// (their JSON), with a unit; the oldest go first.
    #[arg(long, default_value = "64MiB", help_heading = "Responses API")]
    pub response_store_size: String,
    /// At most this many responses kept.
    #[arg(long, default_value_t = 10_000, help_heading = "Responses API")]
    pub response_store_max: usize,
    /// Seconds a response is kept.
    #[arg(long, default_value_t = 3600.0, help_heading = "Responses API")]
    pub response_store_ttl: f64,

    /// Threads for matrix products and attention (split evenly over --tp-size ranks).
    #[arg(long, default_value_t = 2, help_heading = "Compute")]
    pub threads: usize,
    /// Keep f32 activations for decode steps too (default: 8-bit activations, integer dot
    /// products). llama models only: DeepSeek-V4 always computes in f32.
    #[arg(long, help_heading = "Compute")]
    pub f32_decode: bool,

    /// Requests waiting for admission; beyond it: 429 with Retry-After.
    #[arg(long, default_value_t = 128, help_heading = "Scheduling")]
    pub max_waiting: usize,
    /// Prompt + max_tokens over accepted unfinished requests; beyond it: 429 (0: 4 × the
    /// device pool's tokens).
    #[arg(long, default_value_t = 0, help_heading = "Scheduling")]
    pub max_tokens_in_flight: usize,
    /// max_tokens for requests that give none.
    #[arg(long, default_value_t = 1024, help_heading = "Scheduling")]
    pub default_max_tokens: usize,
    /// Seconds a request may wait for admission; beyond it: 503 with Retry-After (0: no
    /// limit).
    #[arg(long, default_value_t = 30.0, help_heading = "Scheduling")]
    pub max_queue_time: f64,
    /// Test hook (fault injection): the engine thread panics on a prompt starting with this
    /// token id. For tests of supervision only.
    #[arg(long, hide = true)]
    pub fault_panic_token: Option<u32>,

    /// When device pages are backed up to the host tier: write_through (at once),
    /// write_through_selective[:N] (once hit N times, default 2) or write_back (on eviction).
    #[arg(
        long,
        default_value = "write_through",
        value_parser = write_policy,
        help_heading = "Cache"
    )]
    pub write_policy: WritePolicy,
    /// Which cached prefix leaves a tier first.
    #[arg(long, value_enum, default_value_t = Eviction::Lru, help_heading = "Cache")]
    pub eviction: Eviction,
    /// L3 storage: `disk:PATH` and/or `redis://HOST:PORT` (repeat for both; disk is read
    /// first). A Redis shared by several workers makes one prefix cache for all of them. A
    /// URL naming a Redis Cluster node uses the whole cluster; `redis-cluster://H:P,H:P,...`
    /// lists seed nodes (any one reachable is enough).
    #[arg(long, help_heading = "Cache")]
    pub l3: Vec<String>,
    /// Bytes the L3 disk tier may use, with a unit.
    #[arg(long, default_value = "10GiB", help_heading = "Cache")]
    pub l3_size: String,
    /// Remote (Redis) pages expire after this many seconds (0: never; Redis' maxmemory
    /// eviction still applies).
    #[arg(long, default_value_t = 0, help_heading = "Cache")]
    pub l3_ttl: u64,
    /// Bound on every remote (Redis) operation, in milliseconds.
    #[arg(long, default_value_t = 500, help_heading = "Cache")]
    pub l3_timeout_ms: u64,
    /// How long admission waits for L3 → host prefetch: best_effort (not at all),
    /// wait_complete, or timeout (--prefetch-ms-per-token per prefetched token).
    #[arg(long, value_enum, default_value_t = Prefetch::WaitComplete, help_heading = "Cache")]
    pub prefetch_policy: Prefetch,
    /// Milliseconds of waiting per prefetched token under --prefetch-policy timeout.
    #[arg(long, default_value_t = 0.05, help_heading = "Cache")]
    pub prefetch_ms_per_token: f64,
    /// Reuse no cached prefix: every prompt computed in full (a baseline for benchmarks; the
    /// pools are still allocated as planned).
    #[arg(long, help_heading = "Cache")]
    pub disable_prefix_cache: bool,
    /// Threads copying pages between tiers.
    #[arg(long, default_value_t = 1, help_heading = "Cache")]
    pub copy_threads: usize,

    /// Address the KV-transfer listener binds (decode and both roles); prefill workers send
    /// K/V there.
    #[arg(long, default_value = "127.0.0.1", help_heading = "PD disaggregation")]
    pub kv_host: String,
    /// Port of the KV-transfer listener (0: any free port; the worker tells prefill workers).
    #[arg(long, default_value_t = 0, help_heading = "PD disaggregation")]
    pub kv_port: u16,
    /// The address prefill workers send K/V to, IP or IP:PORT (default: the listener's own;
    /// the port defaults to the listener's). Needed when --kv-host is 0.0.0.0 (e.g. the pod's
    /// IP under Kubernetes).
    #[arg(long, help_heading = "PD disaggregation")]
    pub kv_advertise: Option<String>,
    /// Received K/V held at most before transfers are told to retry, with a unit.
    #[arg(long, default_value = "1GiB", help_heading = "PD disaggregation")]
    pub kv_staging: String,
    /// Seconds a KV transfer may take end to end.
    #[arg(long, default_value_t = 30.0, help_heading = "PD disaggregation")]
    pub kv_deadline: f64,
    /// KV-transfer connections served at once (more are closed at once).
    #[arg(long, default_value_t = 64, help_heading = "PD disaggregation")]
    pub kv_max_connections: usize,
    /// A prefill worker's URL this decode worker may be sent to by the router (repeat). The
    /// router's `x-strata-prefill` header is refused for any other.
    #[arg(long, help_heading = "PD disaggregation")]
    pub prefill_worker: Vec<String>,
    /// A PD request whose prompt this decode worker's cache holds but for at most this many
    /// tokens is computed here, with no prefill worker and no transfer; 0: never.
    #[arg(long, default_value_t = LOCAL_PREFILL, help_heading = "PD disaggregation")]
    pub pd_local_prefill_tokens: usize,
    /// Match each PD prompt in this decode worker's cache and receive only the pages after
    /// the prefix it holds; false: the whole prompt's K/V every time (to compare).
    #[arg(long, default_value_t = true, action = ArgAction::Set, help_heading = "PD disaggregation")]
    pub pd_decode_reuse: bool,
}

/// `--eviction`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Eviction {
    /// Least recently used.
    Lru,
    /// Greedy-dual size frequency (keeps what is reused often and costs most to recompute).
    Gdsf,
    /// SIEVE: insertion order with a visited bit and a sweeping hand (no reordering on hits).
    Sieve,
    /// S3-FIFO: small and main FIFO queues, a ghost of evicted prefixes, 2-bit frequencies.
    S3fifo,
}

/// `--prefetch-policy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Prefetch {
    /// Never wait: what has not arrived is computed.
    #[value(name = "best_effort")]
    BestEffort,
    /// Wait until the prefetch completes.
    #[value(name = "wait_complete")]
    WaitComplete,
    /// Wait --prefetch-ms-per-token per prefetched token, then compute the rest.
    Timeout,
}

/// `--write-policy` (here and in `strata sim`): what [`WritePolicy::parse`] accepts.
pub fn write_policy(s: &str) -> Result<WritePolicy, String> {
    WritePolicy::parse(s).ok_or_else(|| {
        "expected write_through, write_through_selective[:N] (N: hits, default 2) or write_back"
            .to_string()
    })
}

fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The L3 tiers of `--l3`, in order, and how many were left out: a Redis that cannot be
/// reached at start is left out (a warning, and `strata_l3_unavailable_tiers`); a bad spec
/// or an unusable disk path is an error.
fn l3_storage(
    a: &ServeArgs,
    ns: &str,
    key: strata_kv::storage::blob::BlobKey,
    page_bytes: u64,
) -> Result<(Option<Arc<dyn Storage>>, usize)> {
    let mut left_out = 0;
    let cap = parse_size(&a.l3_size).context("--l3-size")?;
    let mut tiers: Vec<Arc<dyn Storage>> = Vec::new();
    for spec in &a.l3 {
        if let Some(path) = spec.strip_prefix("disk:").filter(|p| !p.is_empty()) {
            let d = DiskStorage::open(PathBuf::from(path), cap, false)
                .with_context(|| format!("--l3 {spec}"))?
                .with_key(key)
                .with_page_bytes(page_bytes);
            tracing::info!(
                path,
                capacity_bytes = cap,
                "L3 disk tier ready (capacity in bytes)"
            );
            tiers.push(Arc::new(d));
        } else if is_redis(spec) {
            let cfg = strata_redis::RedisConfig {
                url: spec.clone(),
                namespace: ns.to_string(),
                ttl: (a.l3_ttl > 0).then(|| Duration::from_secs(a.l3_ttl)),
                timeout: Duration::from_millis(a.l3_timeout_ms.max(1)),
                page_key: key,
                max_value_bytes: page_bytes + strata_kv::storage::blob::HEADER as u64,
            };
            match strata_redis::RedisStorage::connect(&cfg) {
                Ok(r) => {
                    tracing::info!(url = %spec, namespace = ns, "L3 remote tier (Redis) ready");
                    tiers.push(Arc::new(r));
                }
                Err(e) => {
                    left_out += 1;
                    tracing::warn!(url = %spec, error = %e, "L3 remote tier unavailable at start: serving without it");
                    eprintln!("strata serve: L3 remote tier {spec} unavailable at start ({e}): serving without it");
                }
            }
        } else {
            bail!("--l3 `{spec}`: {L3_SPECS}");
        }
    }
    let tiers: Option<Arc<dyn Storage>> = match tiers.len() {
        0 => None,
        1 => tiers.pop(),
        _ => Some(Arc::new(strata_kv::storage::Chain::new(tiers))),
    };
    Ok((tiers, left_out))
}

pub fn run(mut a: ServeArgs) -> Result<()> {
    // Check everything cheap first.
    let c = check_flags(&a)?;
    // Bind before loading anything: a port in use is a configuration error, said at once.
    let std_listener = std::net::TcpListener::bind(c.addr)
        .with_context(|| format!("cannot listen on {}", c.addr))?;
    std_listener.set_nonblocking(true)?;
    // The port really bound (--port 0: any free one, said in the ready line).
    let addr = std_listener.local_addr()?;
    // The memory plan, printed before anything is allocated.
    let path = match &a.sizing.model {
        Some(p) => p.clone(),
        None => ensure_model(&cache_dir(), |m| eprintln!("{m}"))?,
    };
    a.sizing.model = Some(path.clone());
    let req = a.sizing.request()?;
    let topo = a.sizing.topology()?;
    let plan = make_plan(&req, &topo)?;
    eprint!("{}", plan.render());
    check_l3_specs(&a.l3)?;
    let prefetch = prefetch_policy(&a)?;

    // Model: tensor-parallel ranks placed by --numa-nodes.
    let (model, tk, template, ranks) =
        serve_tp::load_model(&a.sizing, a.threads, !a.f32_decode, &topo)?;

    // Pools, as planned (the plan's kinds are the model's, byte for byte); the engine over them.
    let layout = PageLayout::new(req.page_size, model.pool_kinds(req.page_size)?)?;
    serve_tp::check_plan_layout(&plan, &layout)?;
    let allocs = serve_tp::rank_allocators(&ranks, req.policy, a.sizing.huge_pages);
    let (cache, (storage_tier, l3_unavailable)) =
        build_cache(&a, &c, &path, &req, &plan, layout, &allocs)?;
    let gauges = serve_tp::plan_gauges(&plan, &cache, &ranks);
    let engine = Engine::start(model, cache, engine_config(&a, &path, &tk, prefetch));

    // The HTTP API's state; the KV-transfer listener for decode workers.
    let name = a.served_model_name.clone().unwrap_or_else(|| {
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    let mut st = AppState::new(engine, Arc::new(tk), name.clone());
    st.template = template;
    st.admin_key = a.admin_key.clone();
    st.default_max_tokens = a.default_max_tokens;
    st.body_limit = c.body_limit;
    st.lenient_fields = a.lenient_fields;
    st.responses = Arc::new(c.responses);
    st.pd.kv_deadline = Duration::from_secs_f64(a.kv_deadline);
    st.plan = Some(gauges);
    st.storage_tier = storage_tier;
    st.l3_unavailable = l3_unavailable;
    st.role = c.role.to_string();
    st.cluster_key = c.cluster_key.clone();
    st.pd.prefill_workers = a.prefill_worker.clone();
    st.pd.local_prefill_tokens = a.pd_local_prefill_tokens;
    st.pd.decode_reuse = a.pd_decode_reuse;
    if matches!(c.role, "decode" | "both") {
        let flags = crate::serve_kv::KvFlags {
            host: &a.kv_host,
            port: a.kv_port,
            advertise: a.kv_advertise.as_deref(),
            staging_text: &a.kv_staging,
            max_connections: a.kv_max_connections,
        };
        let key = c.cluster_key.clone();
        st.pd.kv = Some(crate::serve_kv::kv_listener(
            &flags,
            &st,
            c.kv_staging,
            key,
        )?);
    }
    let grace = Duration::from_secs_f64(a.shutdown_grace);
    serve_until_stopped(std_listener, addr, st, name, (c.role, c.http), grace)
}

/// What the flags checked before anything is bound or loaded give.
struct Checked {
    eviction: EvictionPolicy,
    body_limit: usize,
    role: &'static str,
    kv_staging: u64,
    addr: SocketAddr,
    cluster_key: Option<ClusterKey>,
    http: strata_server::listen::HttpLimits,
    responses: strata_server::response_store::ResponseStore,
}

/// Checks every flag that needs neither the model nor the plan.
fn check_flags(a: &ServeArgs) -> Result<Checked> {
    let eviction = match a.eviction {
        Eviction::Lru => EvictionPolicy::Lru,
        Eviction::Gdsf => EvictionPolicy::Gdsf,
        Eviction::Sieve => EvictionPolicy::Sieve,
        Eviction::S3fifo => EvictionPolicy::S3Fifo,
    };
    let body_limit = parse_size(&a.body_limit).context("--body-limit")? as usize;
    let role = a.sizing.role.name();
    let kv_staging = parse_size(&a.kv_staging).context("--kv-staging")?;
    if !(a.kv_deadline > 0.0 && a.kv_deadline.is_finite()) {
        bail!("--kv-deadline {}: expected seconds > 0", a.kv_deadline);
    }
    if a.sizing.machine.is_some() {
        bail!("--machine plans for another machine; `strata serve` allocates on this one (use `strata plan --machine`)");
    }
    if a.sizing.tp_size == 0 {
        bail!("--tp-size 0: expected at least 1 rank");
    }
    if a.threads == 0 {
        bail!("--threads 0: expected at least 1 thread for matrix products and attention");
    }
    if !(a.shutdown_grace >= 0.0 && a.shutdown_grace.is_finite()) {
        bail!(
            "--shutdown-grace {}: expected seconds ≥ 0",
            a.shutdown_grace
        );
    }
    if !(a.max_queue_time >= 0.0 && a.max_queue_time.is_finite()) {
        bail!(
            "--max-queue-time {}: expected seconds ≥ 0 (0: no limit)",
            a.max_queue_time
        );
    }
    if a.sizing.max_batch_tokens == 0 || a.sizing.max_running == 0 {
        bail!("--max-batch-tokens and --max-running must be at least 1");
    }
    let addr: SocketAddr = format!("{}:{}", a.host, a.port)
        .parse()
        .with_context(|| format!("--host {} --port {}: not an address", a.host, a.port))?;
    let cluster_key = cluster_key(a)?;
    for u in &a.prefill_worker {
        if !(u.starts_with("http://") || u.starts_with("https://")) {
            bail!("--prefill-worker `{u}`: expected http://HOST:PORT");
        }
    }
    let http = a.http.limits(body_limit)?;
    let responses = response_store(a)?;
    Ok(Checked {
        eviction,
        body_limit,
        role,
        kv_staging,
        addr,
        cluster_key,
        http,
        responses,
    })
}

/// The `--response-store-*` bounds, checked (nothing is allocated until responses come).
fn response_store(a: &ServeArgs) -> Result<strata_server::response_store::ResponseStore> {
    let size = parse_size(&a.response_store_size).context("--response-store-size")?;
    if size < 1 << 20 || a.response_store_max == 0 {
        bail!("--response-store-size must be at least 1MiB and --response-store-max at least 1 (a conversation over a quarter of the size is not kept; one the store cannot keep cannot be continued)");
    }
    let ttl = a.response_store_ttl;
    if !(ttl > 0.0 && ttl <= 7.0 * 86_400.0) {
        bail!("--response-store-ttl {ttl}: expected seconds > 0, at most a week");
    }
    Ok(strata_server::response_store::ResponseStore::new(
        a.response_store_max,
        usize::try_from(size).unwrap_or(usize::MAX),
        Duration::from_secs_f64(ttl),
    ))
}

/// The key of `--cluster-key-file`; without one, only loopback addresses are accepted.
fn cluster_key(a: &ServeArgs) -> Result<Option<ClusterKey>> {
    Ok(match &a.cluster_key_file {
        Some(f) => Some(ClusterKey::from_file(f).context("--cluster-key-file")?),
        None => {
            for (flag, host) in [("--host", &a.host), ("--kv-host", &a.kv_host)] {
                if !is_loopback(host) {
                    bail!(
                        "{flag} {host}: a worker without --cluster-key-file listens on loopback only \
                         (its worker-to-worker endpoints would be open to the network); give the \
                         deployment's key file, see docs/SECURITY.md"
                    );
                }
            }
            eprintln!(
                "strata serve: no cluster key (--cluster-key-file): worker endpoints are unauthenticated; listening on loopback only"
            );
            None
        }
    })
}

/// What `--l3` takes.
const L3_SPECS: &str =
    "expected disk:PATH, redis://HOST:PORT or redis-cluster://HOST:PORT[,HOST:PORT...]";

fn is_redis(spec: &str) -> bool {
    spec.starts_with("redis://") || spec.starts_with("redis-cluster://")
}

/// Refuses an `--l3` spec that is neither `disk:PATH` nor a Redis URL this build can use.
fn check_l3_specs(l3: &[String]) -> Result<()> {
    for spec in l3 {
        if spec.starts_with("rediss://") {
            bail!(
                "--l3 `{spec}`: TLS to Redis is not built in; reach Redis over a private network \
                 or a TLS tunnel (e.g. stunnel) with redis://"
            );
        }
        if !(spec.starts_with("disk:") || is_redis(spec)) {
            bail!("--l3 `{spec}`: {L3_SPECS}");
        }
    }
    Ok(())
}

/// The engine's prefetch policy from `--prefetch-policy` and `--prefetch-ms-per-token`.
fn prefetch_policy(a: &ServeArgs) -> Result<strata_engine::PrefetchPolicy> {
    Ok(match a.prefetch_policy {
        Prefetch::BestEffort => strata_engine::PrefetchPolicy::BestEffort,
        Prefetch::WaitComplete => strata_engine::PrefetchPolicy::WaitComplete,
        Prefetch::Timeout
            if a.prefetch_ms_per_token >= 0.0 && a.prefetch_ms_per_token.is_finite() =>
        {
            strata_engine::PrefetchPolicy::Timeout {
                per_token: Duration::from_secs_f64(a.prefetch_ms_per_token / 1e3),
            }
        }
        Prefetch::Timeout => bail!(
            "--prefetch-ms-per-token {}: expected milliseconds ≥ 0",
            a.prefetch_ms_per_token
        ),
    })
}

/// The tiered cache: device and host pools as planned, the L3 tiers of `--l3`; also the name
/// of its L3 tier (for the metrics).
fn build_cache(
    a: &ServeArgs,
    c: &Checked,
    path: &std::path::Path,
    req: &PlanRequest,
    plan: &Plan,
    layout: PageLayout,
    rank_allocs: &serve_tp::RankAllocators,
) -> Result<(TieredCache, (String, usize))> {
    let ps = req.page_size;
    let device_pages = (plan.device_tokens_per_rank / ps as u64) as u32;
    let host_pages = (plan.host_tokens_per_rank / ps as u64) as u32;
    let mut alloc = NumaAllocator::new(plan.numa.nodes.clone(), req.policy);
    alloc.huge_pages = a.sizing.huge_pages;
    // Pools under 1 GiB pre-fault in well under a second: no progress line for them.
    alloc.progress = Some(crate::sizing::prefault_progress(
        "host pool".into(),
        1 << 30,
    ));
    let ns_key = strata_kv::HashNamespace::new(&model_id(path), &layout).key();
    let ns: String = ns_key[..8].iter().map(|b| format!("{b:02x}")).collect();
    let blob_key = c
        .cluster_key
        .as_ref()
        .map(strata_kv::storage::blob::BlobKey::from_cluster)
        .unwrap_or_default();
    let (storage, l3_unavailable) = l3_storage(a, &ns, blob_key, layout.page_bytes() as u64)?;
    let storage_tier = storage.as_ref().map(|s| s.tier()).unwrap_or("disk");
    let storage_tier = (storage_tier.to_string(), l3_unavailable);
    let mut cc = CacheConfig::new(layout, device_pages, host_pages);
    if cc.layout.has_window() {
        cc.device_window_pages = (plan.device_window_tokens_per_rank / ps as u64) as u32;
        cc.host_window_pages = (plan.host_window_tokens_per_rank / ps as u64) as u32;
    }
    cc.model_id = model_id(path);
    cc.write_policy = a.write_policy;
    // The plan refused checkpoints for a model without window kinds.
    cc.window_checkpoint_pages = plan.window_checkpoint_pages as usize;
    cc.eviction = c.eviction;
    cc.hashing = true;
    cc.copy_threads = a.copy_threads.max(1);
    // Each kind from its rank's allocators (the layout holds the ranks' kinds in rank order).
    let per_rank = cc.layout.kinds().len() / rank_allocs.0.len().max(1);
    let (host, device) = (
        serve_tp::per_kind(&rank_allocs.0, per_rank),
        serve_tp::per_kind(&rank_allocs.1, per_rank),
    );
    let cache = TieredCache::with_allocators(cc, &alloc, &host, &device, storage)?;
    Ok((cache, storage_tier))
}

/// The engine's configuration from the scheduling flags (says so when the prefix cache is off).
fn engine_config(
    a: &ServeArgs,
    path: &std::path::Path,
    tk: &ModelTokenizer,
    prefetch: strata_engine::PrefetchPolicy,
) -> EngineConfig {
    let mut cfg = EngineConfig {
        max_batch_tokens: a.sizing.max_batch_tokens,
        max_running: a.sizing.max_running,
        max_waiting: a.max_waiting,
        max_tokens_in_flight: a.max_tokens_in_flight,
        stop_token_ids: tk.stop.clone(),
        model_id: model_id(path),
        prefetch,
        prefix_cache: !a.disable_prefix_cache,
        max_queue_time: (a.max_queue_time > 0.0).then(|| Duration::from_secs_f64(a.max_queue_time)),
        fault_panic_token: a.fault_panic_token,
        ..EngineConfig::default()
    };
    if a.disable_prefix_cache {
        tracing::warn!("prefix cache disabled: every prompt is computed in full");
        eprintln!("strata serve: prefix cache disabled (--disable-prefix-cache): every prompt is computed in full");
    }
    cfg.stop_token_ids.dedup();
    cfg
}

/// Serves the API on the bound listener until SIGTERM / Ctrl-C, or until the engine dies.
fn serve_until_stopped(
    std_listener: std::net::TcpListener,
    addr: SocketAddr,
    st: AppState,
    name: String,
    (role, limits): (&str, strata_server::listen::HttpLimits),
    grace: Duration,
) -> Result<()> {
    let role_s = role.to_string();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(std_listener)
            .with_context(|| format!("cannot listen on {addr}"))?;
        tracing::info!(url = %format!("http://{addr}"), model = %name, "serving");
        eprintln!("strata serve: ready on http://{addr} (model `{name}`, role {role_s})");
        // Stop on SIGTERM / Ctrl-C, or when the engine dies: then `/health` answers 503 for two
        // seconds, the server stops gracefully (responses in flight, e.g. the failed requests'
        // errors, are written out), and the process exits 70 so that a supervisor restarts it.
        let engine = st.engine.clone();
        let died: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
        let d2 = died.clone();
        let signal = async move {
            tokio::select! {
                _ = shutdown_signal() => {}
                why = strata_server::app::watch_engine(engine) => {
                    tracing::error!(reason = %why, "engine dead: exiting with code {ENGINE_DEAD_EXIT}");
                    eprintln!("strata serve: the engine died ({why}); exiting with code {ENGINE_DEAD_EXIT} so that a supervisor restarts this worker");
                    *d2.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
                    // Whatever the graceful stop waits for (a slow client, a scheduler still
                    // tearing down), the process is gone 7 s from now.
                    std::thread::spawn(|| {
                        std::thread::sleep(Duration::from_secs(7));
                        std::process::exit(ENGINE_DEAD_EXIT);
                    });
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
            }
        };
        strata_server::app::serve(listener, Arc::new(st), limits, signal, grace).await?;
        if died.lock().unwrap_or_else(|p| p.into_inner()).is_some() {
            std::process::exit(ENGINE_DEAD_EXIT);
        }
        tracing::info!("stopped");
        Ok(())
    })
}

/// Exit code of a worker whose engine thread died (EX_SOFTWARE): not a configuration error,
/// so `strata up` restarts it.
pub const ENGINE_DEAD_EXIT: i32 = 70;

/// The model's id in page hashes: file name plus size, so two different files never share
/// cache entries.
pub fn model_id(path: &std::path::Path) -> String {
    let len = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    format!(
        "{}:{len}",
        path.file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    )
}

pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
