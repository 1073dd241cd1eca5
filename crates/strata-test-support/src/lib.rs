//! Helpers the integration tests share (dev-dependency only): the tiny random-weight model,
//! a worker started in-process on a port the OS picks, and probes of its HTTP answers and
//! `/metrics`.
//!
//! * `proc`: a child process killed however the test ends, its stderr lines kept;
//!   [`up`]: `strata up` stopped with SIGTERM, its ready summary's ports.
//! * `redis`: redis-server processes, one or a Redis Cluster.
//! * [`netbed`]: hosts as network namespaces on a bridge (root only).

use std::net::TcpListener as StdListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use strata_engine::{Engine, EngineConfig};
use strata_kv::memory::HeapAllocator;
use strata_kv::storage::Storage;
use strata_kv::{CacheConfig, PageLayout, TieredCache};
use strata_model::tiny::{write_tiny, TinySpec, TINY_TEMPLATE};
use strata_model::{ChatTemplate, LoadOptions};
use strata_server::app::serve;
use strata_server::pd::{KvInbox, KvLimits};
use strata_server::AppState;
use tokio::sync::oneshot;

pub mod netbed;
mod proc;
pub use proc::{
    connect_from, get_json, http1, metrics_text, port_after, post_json, raise_fd_limit, Proc,
};
mod redis;
pub use redis::{redis_cli, Redis, RedisCluster};
pub mod up;

/// Writes the tiny model with a context of `context` tokens into `dir` (prompts that show
/// tools need more than the default: its tokenizer spends about a token per byte).
pub fn tiny_model_with_context(dir: &Path, context: usize) -> PathBuf {
    let p = dir.join("tiny.gguf");
    write_tiny(
        &p,
        &TinySpec {
            context,
            ..TinySpec::default()
        },
    )
    .unwrap();
    p
}

/// Writes the tiny model (default spec) into `dir`; returns its path.
pub fn tiny_model(dir: &Path) -> PathBuf {
    let p = dir.join("tiny.gguf");
    write_tiny(&p, &TinySpec::default()).unwrap();
    p
}

/// Writes the tiny DeepSeek-V4 model (default spec: window 32, ratios 4 and 128) into `dir`.
pub fn tiny_dsv4_model(dir: &Path) -> PathBuf {
    let p = dir.join("tiny-dsv4.gguf");
    strata_model::tiny::deepseek4::write_tiny_dsv4(
        &p,
        &strata_model::tiny::deepseek4::TinyDsv4Spec::default(),
    )
    .unwrap();
    p
}

/// A child process killed (and reaped) when dropped.
pub struct ChildGuard(pub Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `cmd` (a server, its stderr piped here) and waits for its ready line
/// (`ready on http://HOST:PORT`); the guard and the port. The rest of stderr is drained so
/// the server never blocks on it.
pub fn spawn_ready(cmd: &mut Command, timeout: Duration) -> (ChildGuard, u16) {
    use std::io::{BufRead, BufReader, Read};
    let mut child = cmd
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the server");
    let mut err = BufReader::new(child.stderr.take().expect("stderr piped"));
    let guard = ChildGuard(child);
    let t = Instant::now();
    let mut log = String::new();
    let marker = "ready on http://";
    let port = loop {
        let mut line = String::new();
        if err.read_line(&mut line).unwrap_or(0) == 0 {
            panic!("the server exited before it was ready:\n{log}");
        }
        log.push_str(&line);
        if let Some(at) = line.find(marker) {
            // HOST:PORT, HOST an address (IPv6 in brackets): the digits after its last colon.
            let hostport: String = line[at + marker.len()..]
                .chars()
                .take_while(|c| !c.is_whitespace() && *c != '/')
                .collect();
            let digits = hostport.rsplit(':').next().unwrap_or("");
            break digits.parse::<u16>().expect("a port in the ready line");
        }
        assert!(t.elapsed() < timeout, "not ready:\n{log}");
    };
    std::thread::spawn(move || {
        let mut sink = String::new();
        let _ = err.read_to_string(&mut sink);
    });
    (guard, port)
}

/// A multi-turn Mooncake-format trace in `dir`: `conversations` × `turns`, each turn re-sending
/// its conversation (2 shared system blocks, then its own 512-token blocks, one more a turn),
/// interleaved as a multi-turn service sees them; `output_length` tokens each.
pub fn write_multi_turn_trace(
    dir: &Path,
    conversations: usize,
    turns: usize,
    output_length: usize,
) -> PathBuf {
    let mut lines = Vec::new();
    let mut next_id = 1000u64;
    let mut convs: Vec<Vec<u64>> = (0..conversations).map(|_| vec![0, 1]).collect();
    for turn in 0..turns {
        for (c, ids) in convs.iter_mut().enumerate() {
            ids.push(next_id);
            next_id += 1;
            let len = ids.len() * 512 - 100;
            lines.push(format!(
                r#"{{"timestamp": {}, "input_length": {len}, "output_length": {output_length}, "hash_ids": {:?}}}"#,
                turn * 1000 + c,
                ids
            ));
        }
    }
    let p = dir.join("trace.jsonl");
    std::fs::write(&p, lines.join("\n") + "\n").unwrap();
    p
}

/// How to start a test worker.
pub struct WorkerSpec {
    pub page_size: usize,
    pub device_pages: u32,
    pub host_pages: u32,
    /// Device and host window pages (layouts with window kinds; None: one per page).
    pub window_pages: Option<(u32, u32)>,
    /// Committed prefixes keep window pages only at their end and every this many pages
    /// (0: every page).
    pub window_checkpoint_pages: usize,
    /// The cache's eviction policy (`--eviction`).
    pub eviction: strata_kv::EvictionPolicy,
    /// Start a KV listener (a decode worker under PD).
    pub kv_listener: bool,
    /// `--kv-deadline` (5 s by default here: a failing transfer ends a test soon).
    pub kv_deadline: Duration,
    /// The address announced to prefill workers for K/V (None: the listener's own).
    pub kv_advertise: Option<std::net::SocketAddr>,
    /// Prefill workers this worker may be told to use.
    pub prefill_workers: Vec<String>,
    /// `--pd-local-prefill-tokens` of a decode worker (0: every PD request goes through the
    /// prefill worker, sending only the pages this worker lacks).
    pub pd_local_prefill_tokens: usize,
    /// `--pd-decode-reuse` of a decode worker.
    pub pd_decode_reuse: bool,
    pub engine: EngineConfig,
    /// L3 storage and its tier name in metrics.
    pub storage: Option<Arc<dyn Storage>>,
    pub storage_tier: &'static str,
    /// Bearer token of the admin endpoints (None: open).
    pub admin_key: Option<String>,
    /// The deployment's cluster key (`--cluster-key-file`): calls between processes and the
    /// K/V transfer prove it.
    pub cluster_key: Option<strata_kv::auth::ClusterKey>,
    /// Largest request body (None: the server's default).
    pub body_limit: Option<usize>,
    /// How long a graceful stop waits for requests in flight.
    pub grace: Duration,
    /// Tensor-parallel ranks (unpinned threads) of the worker's model.
    pub tp: usize,
    /// `/v1/responses`' store (None: the server's default bounds).
    pub response_store: Option<strata_server::response_store::ResponseStore>,
}

impl Default for WorkerSpec {
    fn default() -> Self {
        WorkerSpec {
            page_size: 16,
            device_pages: 128,
            host_pages: 128,
            window_pages: None,
            window_checkpoint_pages: 0,
            eviction: strata_kv::EvictionPolicy::DEFAULT,
            kv_listener: false,
            kv_advertise: None,
            kv_deadline: Duration::from_secs(5),
            prefill_workers: Vec::new(),
            pd_local_prefill_tokens: strata_server::state::DEFAULT_LOCAL_PREFILL_TOKENS,
            pd_decode_reuse: true,
            engine: EngineConfig::default(),
            storage: None,
            storage_tier: "disk",
            admin_key: None,
            cluster_key: None,
            body_limit: None,
            grace: Duration::from_secs(5),
            tp: 1,
            response_store: None,
        }
    }
}

/// A worker serving in-process.
pub struct TestWorker {
    pub url: String,
    pub state: Arc<AppState>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl TestWorker {
    /// Stops it gracefully and waits for the server to end (cleanly: an error fails the
    /// test).
    pub async fn stop(mut self) {
        let _ = self.stop.take().expect("stopped once").send(());
        self.task
            .await
            .expect("the server task")
            .expect("the server ended cleanly");
    }
}

/// The engine and HTTP state of a worker on the model at `path`, of any architecture
/// `strata_model::load` runs (page hashes on, model id `tiny`).
pub fn app_state(path: &Path, spec: WorkerSpec) -> AppState {
    let loaded = strata_model::load(
        path,
        LoadOptions {
            ranks: match spec.tp {
                0 | 1 => Vec::new(),
                n => vec![strata_model::RankPlacement::default(); n],
            },
            ..LoadOptions::new(2)
        },
    )
    .unwrap();
    let (m, tk) = (loaded.runtime, loaded.tokenizer);
    let layout = PageLayout::new(spec.page_size, m.pool_kinds(spec.page_size).unwrap()).unwrap();
    let mut cc = CacheConfig::new(layout, spec.device_pages, spec.host_pages);
    if let Some((d, h)) = spec.window_pages {
        (cc.device_window_pages, cc.host_window_pages) = (d, h);
    }
    cc.window_checkpoint_pages = spec.window_checkpoint_pages;
    cc.eviction = spec.eviction;
    cc.model_id = "tiny".into();
    cc.hashing = true;
    let l3 = spec.storage.clone();
    let cache = TieredCache::new(cc, &HeapAllocator, spec.storage).unwrap();
    let cfg = EngineConfig {
        stop_token_ids: tk.stop.clone(),
        model_id: "tiny".into(),
        ..spec.engine
    };
    let engine = Engine::start(m, cache, cfg);
    let mut st = AppState::new(engine, Arc::new(tk), "tiny".into());
    st.template = Some(Arc::new(ChatTemplate::new(TINY_TEMPLATE).unwrap()));
    st.pd.kv_deadline = spec.kv_deadline;
    st.pd.prefill_workers = spec.prefill_workers;
    st.pd.local_prefill_tokens = spec.pd_local_prefill_tokens;
    st.pd.decode_reuse = spec.pd_decode_reuse;
    st.storage_tier = spec.storage_tier.into();
    st.l3 = l3;
    st.admin_key = spec.admin_key;
    st.cluster_key = spec.cluster_key;
    if let Some(limit) = spec.body_limit {
        st.body_limit = limit;
    }
    if let Some(store) = spec.response_store {
        st.responses = Arc::new(store);
    }
    if spec.kv_listener {
        let info = st.engine.info().clone();
        let l = StdListener::bind("127.0.0.1:0").unwrap();
        let limits = KvLimits {
            page_size: info.page_size as u32,
            max_tokens: info.context_length,
            main_page_bytes: info.main_page_bytes(),
            advertise: spec.kv_advertise,
            ..KvLimits::default()
        };
        st.pd.kv = Some(KvInbox::start(
            l,
            info.hello(),
            info.page_bytes as u64,
            limits,
            st.cluster_key.clone(),
        ));
    }
    st
}

/// Serves `st` on a port the OS picks (no pick-then-bind race); a graceful stop waits `grace`
/// for requests in flight.
pub async fn serve_state(st: AppState, grace: Duration) -> TestWorker {
    let limits = strata_server::listen::HttpLimits::for_fd_limit(4096, st.body_limit);
    let state = Arc::new(st);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = oneshot::channel();
    let task = tokio::spawn(serve(
        listener,
        state.clone(),
        limits,
        async move {
            let _ = rx.await;
        },
        grace,
    ));
    TestWorker {
        url,
        state,
        stop: Some(tx),
        task,
    }
}

/// Starts a worker on the model at `path`.
pub async fn spawn_worker(path: &Path, spec: WorkerSpec) -> TestWorker {
    let grace = spec.grace;
    serve_state(app_state(path, spec), grace).await
}

/// POSTs JSON; (status, JSON answer).
pub async fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// A worker on the tiny model with room for prompts that show tools (4096 tokens of context,
/// 512 device pages, 64 host pages: its tokenizer spends about a token per byte), and the
/// directory of its model.
pub async fn spawn_roomy_worker() -> (tempfile::TempDir, TestWorker) {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_model_with_context(d.path(), 4096);
    let spec = WorkerSpec {
        device_pages: 512,
        host_pages: 64,
        ..WorkerSpec::default()
    };
    let w = spawn_worker(&path, spec).await;
    (d, w)
}

/// POSTs JSON; the answer's text (e.g. a server-sent event stream).
pub async fn post_text(url: &str, body: &Value) -> String {
    reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The JSON events of a server-sent event stream (its `data: ` lines but `[DONE]`).
pub fn sse_events(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("an event is JSON"))
        .collect()
}

/// The text of `url/metrics`.
pub async fn metrics_of(url: &str) -> String {
    reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The value of the sample line that starts with `key` (name and labels as written); NaN if
/// there is none.
pub fn sample(metrics: &str, key: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(key) && l[key.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// What a finished program said, its standard output then its standard error, as text.
pub fn said(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A loopback port free a moment ago, for a program that cannot bind port 0 and report it
/// (redis-server). Where the program can, bind port 0 instead: this races with other binds.
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
