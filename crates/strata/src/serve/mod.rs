//! `strata serve`: one worker (model + tiered cache + engine) behind the OpenAI API.
//!
//! Order: every flag is checked and the memory plan printed before anything is allocated; a
//! bad flag or a plan that does not fit exits once with the reason (exit code 2), never a loop.
//!
//! - [`checks`]: the flags and their combinations, checked before anything is bound or loaded.
//! - [`cache`]: the tiered cache as planned, and its L3 tiers.
//! - [`kv`]: a decode worker's KV-transfer listener (bound and checked first, started last).
//! - [`tp`]: tensor-parallel ranks: placement, allocators, the model per rank.

mod cache;
mod checks;
pub(crate) mod kv;
pub(crate) mod tp;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{ArgAction, Args};
use strata_engine::record::TraceRecorder;
use strata_engine::{Engine, EngineConfig};
use strata_kv::{PageLayout, WritePolicy};
use strata_mem::make_plan;
use strata_model::fetch::{cache_dir, ensure_model};
use strata_model::ModelTokenizer;
use strata_server::state::DEFAULT_LOCAL_PREFILL_TOKENS as LOCAL_PREFILL;
use strata_server::AppState;

use crate::sizing::SizingArgs;
use cache::build_cache;
pub(crate) use checks::{check_admin_key, socket_of};
use checks::{check_flags, check_staging_before_pools, prefetch_policy, Checked};

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
    /// (docs/API.md lists the fields it knows; refused ones stay refused, as do the other
    /// endpoint's: `response_format` on completions).
    #[arg(long, help_heading = "Server")]
    pub lenient_fields: bool,
    /// No log line per finished request (by default one at info under `strata::request`: id,
    /// route, status, prompt / cached / output tokens, time to first token, duration).
    #[arg(long, help_heading = "Server")]
    pub no_request_log: bool,
    /// Seconds running requests may take to finish after SIGTERM / Ctrl-C (then their answers
    /// are written out for as long again, 2 to 30 s, and the process exits).
    #[arg(long, default_value_t = 30.0, help_heading = "Server")]
    pub shutdown_grace: f64,
    /// The deployment's cluster key (a file of ≥ 32 secret bytes, mode 600; `strata up`
    /// makes one). It authenticates the router and the other workers (KV transfer, /pd/prefill,
    /// /cache/info, /cache/events, /cache/snapshot) and keys L3 page checksums. Without it the worker listens on loopback only.
    #[arg(long, help_heading = "Server")]
    pub cluster_key_file: Option<PathBuf>,

    /// At most this many responses kept.
    #[arg(long, default_value_t = 10_000, help_heading = "Responses API")]
    pub response_store_max: usize,
    /// Seconds a response is kept.
    #[arg(long, default_value_t = 3600.0, help_heading = "Responses API")]
    pub response_store_ttl: f64,

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
    /// Which cached prefix leaves a tier first (`auto`: learns how much a new prefix is
    /// worth from which evicted prefixes come back; docs/ARCHITECTURE.md, "Eviction policies").
    #[arg(long, value_enum, default_value_t = Eviction::Auto, help_heading = "Cache")]
    pub eviction: Eviction,
    /// Pages the live miss-ratio curve may track (its fixed memory, about 180 bytes a page
    /// with its window of recent references: 12 MiB at the default; past this the sampling
    /// rate falls instead); 0: no curve.
    #[arg(long, default_value_t = 65536, help_heading = "Cache")]
    pub curve_pages: usize,
    /// Record the served requests as a Mooncake-format trace in FILE (timestamps, lengths,
    /// keyed page hashes; never token ids or text; mode 0600), for `strata sim --block-tokens
    /// P --page-size P` (P: --page-size). Off by default.
    #[arg(long, value_name = "FILE", help_heading = "Cache")]
    pub record_trace: Option<PathBuf>,
    /// Bytes of --record-trace before the file is renamed FILE.1 and a new one begun (at most
    /// twice this on disk).
    #[arg(long, default_value = "1GiB", help_heading = "Cache")]
    pub record_trace_size: String,
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
    /// Bound on every remote (Redis) operation, in milliseconds (1 to 10000). Which pages
    /// Redis holds is asked as a request is admitted, off the scheduler's thread: a Redis that
    /// stalls delays that request's first token by up to this (and the requests queued
    /// behind it), three times, before the tier is skipped; the running streams go on (a
    /// lower bound keeps a hiccup short).
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
    /// What a finished answer leaves in the cache for a later prompt that extends it (a
    /// conversation's next turn): `exact` computes its positions again as prompt rows once its
    /// last token is chosen and caches them before telling the client it is done (a later
    /// prompt's answer is the same bits as an uncached worker's; costs a prefill of each
    /// answer, which its end, usage and a non-streamed body wait for;
    /// `strata_settled_tokens_total`); `as-decoded` caches them as the decode steps computed
    /// them (no extra work; the later answer differs from an uncached worker's in its last
    /// bits); `off` caches prompts only.
    #[arg(long, default_value = "exact", value_parser = cache_outputs, help_heading = "Cache")]
    pub cache_outputs: strata_engine::CacheOutputs,
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
    /// GDSF where a prefix new to the cache starts on probation, with a credit learnt from
    /// which evicted prefixes come back (the default).
    Auto,
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

/// `--cache-outputs`: what [`strata_engine::CacheOutputs::parse`] accepts.
fn cache_outputs(s: &str) -> Result<strata_engine::CacheOutputs, String> {
    strata_engine::CacheOutputs::parse(s).ok_or_else(|| "expected exact, as-decoded or off".into())
}

/// Phase one of [`run`] for `strata up`, before it starts any process: the flags checked and
/// the memory plan made, nothing bound, loaded or allocated (the model's header is read).
/// Returns the plan and the bytes it places in host memory.
pub fn preflight(a: &ServeArgs) -> Result<(strata_mem::Plan, u64)> {
    check_flags(a)?;
    let req = request(a)?;
    let plan = make_plan(&req, &a.sizing.topology()?)?;
    let needed = plan.numa.needed_bytes;
    Ok((plan, needed))
}

/// The plan's request for these flags: a worker with no `--prefill-worker` receives no K/V
/// (the header naming one is refused), so its plan reserves no staging for it.
fn request(a: &ServeArgs) -> Result<strata_mem::PlanRequest> {
    let mut req = a.sizing.request()?;
    if a.prefill_worker.is_empty() {
        req.beside.retain(|b| b.0 != "--kv-staging");
    }
    Ok(req)
}

pub fn run(mut a: ServeArgs) -> Result<()> {
    // Check everything cheap first.
    let mut c = check_flags(&a)?;
    for w in checks::idle_flags(&a) {
        tracing::warn!("{w}");
        say!("strata serve: {w}");
    }
    checks::open_record_trace(&a, &mut c)?;
    // Bind before loading anything: a port in use is a configuration error, said at once.
    let std_listener = std::net::TcpListener::bind(c.addr)
        .with_context(|| format!("cannot listen on {}", c.addr))?;
    std_listener.set_nonblocking(true)?;
    // The port really bound (--port 0: any free one, said in the ready line).
    let addr = std_listener.local_addr()?;
    // A decode worker's KV listener, likewise, and the address it announces.
    let kv = match a.sizing.role.receives_kv() {
        true => Some(kv::kv_bind(&kv_flags(&a, &c), c.cluster_key.is_some())?),
        false => None,
    };
    // The memory plan, printed before anything is allocated.
    let path = match &a.sizing.model {
        Some(p) => p.clone(),
        None => ensure_model(&cache_dir(), |m| say!("{m}"))?,
    };
    a.sizing.model = Some(path.clone());
    let req = request(&a)?;
    let topo = a.sizing.topology()?;
    let plan = make_plan(&req, &topo)?;
    eprint!("{}", plan.render());
    let prefetch = prefetch_policy(&a)?;

    // Model: tensor-parallel ranks placed by --numa-nodes.
    let (model, tk, template, ranks) = tp::load_model(&a.sizing, !a.f32_decode, &topo)?;

    // Pools, as planned (the plan's kinds are the model's, byte for byte); the engine over them.
    let layout = PageLayout::new(req.page_size, model.pool_kinds(req.page_size)?)?;
    tp::check_plan_layout(&plan, &layout)?;
    checks::check_l3_size(&a, layout.page_bytes() as u64)?;
    if kv.is_some() {
        check_staging_before_pools(&a, &c, &*model, &plan, &layout)?;
    }
    let allocs = tp::rank_allocators(&ranks, req.policy, a.sizing.huge_pages);
    let (cache, l3) = build_cache(&a, &c, &path, &req, &plan, layout, &allocs)?;
    let gauges = tp::plan_gauges(&plan, &cache, &ranks);
    let mut ecfg = engine_config(&a, &path, &tk, prefetch);
    if let (Some(f), Some(file)) = (&a.record_trace, c.record_trace.take()) {
        let r = TraceRecorder::start(f, file, c.record_trace_size, req.page_size)
            .with_context(|| format!("--record-trace {}", f.display()))?;
        ecfg.record_trace = Some(Arc::new(Mutex::new(r)));
    }
    let engine = Engine::start(model, cache, ecfg);

    // The HTTP API's state; the KV-transfer listener for decode workers.
    let name = a.served_model_name.clone().unwrap_or_else(|| {
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    let mut st = AppState::new(engine, Arc::new(tk), name.clone());
    st.template = template;
    st.plan = Some(gauges);
    (st.storage_tier, st.l3_unavailable, st.l3) = (l3.tier, l3.unavailable, l3.storage);
    configure(&mut st, &a, &mut c);
    if let Some(bound) = kv {
        let key = c.cluster_key.clone();
        st.pd.kv = Some(kv::kv_start(
            bound,
            &kv_flags(&a, &c),
            &st,
            c.kv_staging,
            key,
        )?);
    }
    let grace = Duration::from_secs_f64(a.shutdown_grace);
    serve_until_stopped(std_listener, addr, st, name, (c.role, c.http), grace)
}

/// The `--kv-*` flags.
fn kv_flags<'a>(a: &'a ServeArgs, c: &Checked) -> kv::KvFlags<'a> {
    kv::KvFlags {
        addr: c.kv_addr,
        advertise: a.kv_advertise.as_deref(),
        staging_text: &a.sizing.kv_staging,
        max_connections: a.kv_max_connections,
    }
}

/// The HTTP state's settings from the flags.
fn configure(st: &mut AppState, a: &ServeArgs, c: &mut Checked) {
    st.admin_key = a.admin_key.clone();
    st.default_max_tokens = a.default_max_tokens;
    st.body_limit = c.body_limit;
    st.lenient_fields = a.lenient_fields;
    st.request_log = !a.no_request_log;
    st.responses = Arc::new(std::mem::take(&mut c.responses));
    st.pd.kv_deadline = Duration::from_secs_f64(a.kv_deadline);
    st.role = c.role.to_string();
    st.cluster_key = c.cluster_key.clone();
    st.pd.prefill_workers = a.prefill_worker.clone();
    st.pd.local_prefill_tokens = a.pd_local_prefill_tokens;
    st.pd.decode_reuse = a.pd_decode_reuse;
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
        cache_outputs: a.cache_outputs,
        max_queue_time: (a.max_queue_time > 0.0).then(|| Duration::from_secs_f64(a.max_queue_time)),
        fault_panic_token: a.fault_panic_token,
        ..EngineConfig::default()
    };
    if a.disable_prefix_cache {
        tracing::warn!("prefix cache disabled: every prompt is computed in full");
        say!("strata serve: prefix cache disabled (--disable-prefix-cache): every prompt is computed in full");
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
    let r = rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(std_listener)
            .with_context(|| format!("cannot listen on {addr}"))?;
        tracing::info!(url = %format!("http://{addr}"), model = %name, "serving");
        say!("strata serve: ready on http://{addr} (model `{name}`, role {role_s})");
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
                    say!("strata serve: the engine died ({why}); exiting with code {ENGINE_DEAD_EXIT} so that a supervisor restarts this worker");
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
    });
    drop_runtime(rt);
    r
}

/// Ends a server's runtime once it stopped serving: work still on its blocking threads (a
/// tokenization, a template render: each bounded, but seconds for the largest body) is not
/// waited for past a second. A worker's stop takes at most its grace, the answers' drain
/// (the grace again, 2 to 30 s) and that second.
pub fn drop_runtime(rt: tokio::runtime::Runtime) {
    rt.shutdown_timeout(Duration::from_secs(1));
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
