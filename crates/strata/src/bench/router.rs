//! `strata bench router-scale`: the cache-aware router over many simulated workers.
//!
//! Each simulated worker is an HTTP server that speaks the worker side of the router's
//! protocol (`/cache/info`, `/cache/events`, `/cache/snapshot`, `/health`, `/metrics`,
//! `/v1/completions` answered at once) and publishes cache events at a set rate: the pages of
//! the documents it owns, then fresh pages. A real router (`strata_router`, cache_aware, its
//! index loop and health checks) follows them while an open-loop client sends prompts that
//! start with a document. Reported: events the router absorbed per second and how far behind
//! it ended, routing latency (client → router → worker that answers at once) at the offered
//! rate, how many requests went to the worker holding their document, and the index's bytes
//! per cached page.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use axum::extract::{Query, State};
use axum::routing::{get, post};
use clap::Args;
use serde_json::{json, Value};
use strata_kv::{HashNamespace, PageHash, PageLayout, PoolKind};
use strata_protocol::{CacheEvents, CacheInfo, CacheSnapshot, Hex, Tier, WireEvent};
use strata_router::cache_index::{IndexLimits, DEFAULT_INDEX_MEMORY};

#[derive(Args, Debug)]
pub struct RouterScaleArgs {
    /// Simulated workers.
    #[arg(long, default_value_t = 64)]
    pub workers: usize,
    /// Requests per second offered by the client (Poisson arrivals).
    #[arg(long, default_value_t = 2000.0)]
    pub rate: f64,
    /// Seconds of load.
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// Cache events each worker publishes per second.
    #[arg(long, default_value_t = 100.0)]
    pub events_per_second: f64,
    /// Pages per event.
    #[arg(long, default_value_t = 16)]
    pub pages_per_event: usize,
    /// Documents (shared prompt prefixes), spread over the workers.
    #[arg(long, default_value_t = 256)]
    pub documents: usize,
    /// Tokens of a document (whole pages of 16 tokens).
    #[arg(long, default_value_t = 1024)]
    pub document_tokens: usize,
    /// Seconds between the router's reads of the workers' events.
    #[arg(long, default_value_t = 0.05)]
    pub index_interval: f64,
    /// The GGUF whose tokenizer the router loads (prompts are sent as token ids).
    #[arg(long)]
    pub model: Option<std::path::PathBuf>,
}

const PAGE: usize = 16;

/// One simulated worker's cache as the router reads it.
struct Sim {
    id: usize,
    epoch: u64,
    ns: HashNamespace,
    log: Mutex<Vec<WireEvent>>,
    /// Events handed to the router, and completions answered (for their own document or not).
    served_events: AtomicU64,
    own: AtomicU64,
    other: AtomicU64,
    workers: usize,
    /// Document by its first token.
    first_tokens: Arc<std::collections::HashMap<u32, usize>>,
}

fn document(d: usize, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 1 + (d as u32 * 7919 + i * 31) % 40_000)
        .collect()
}

async fn info(State(s): State<Arc<Sim>>) -> axum::Json<CacheInfo> {
    let next = s.log.lock().expect("log").len() as u64;
    axum::Json(CacheInfo {
        model_id: "sim".into(),
        page_size: PAGE,
        hash_key: Some(Hex(s.ns.key())),
        epoch: s.epoch,
        next,
    })
}

#[derive(serde::Deserialize)]
struct Since {
    since: u64,
}

async fn events(State(s): State<Arc<Sim>>, Query(q): Query<Since>) -> axum::Json<CacheEvents> {
    let log = s.log.lock().expect("log");
    let from = (q.since as usize).min(log.len());
    let events: Vec<WireEvent> = log[from..].to_vec();
    s.served_events
        .fetch_add(events.len() as u64, Ordering::Relaxed);
    axum::Json(CacheEvents {
        epoch: s.epoch,
        first: 0,
        next: log.len() as u64,
        resync: false,
        events,
    })
}

async fn snapshot(State(s): State<Arc<Sim>>) -> axum::Json<CacheSnapshot> {
    let log = s.log.lock().expect("log");
    let hashes = log.iter().flat_map(|e| e.hashes.iter().copied()).collect();
    axum::Json(CacheSnapshot {
        epoch: s.epoch,
        next: log.len() as u64,
        tiers: vec![WireEvent {
            seq: None,
            stored: true,
            tier: Tier::Device,
            hashes,
        }],
    })
}

async fn complete(State(s): State<Arc<Sim>>, body: axum::body::Bytes) -> axum::Json<Value> {
    let first = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["prompt"][0].as_u64());
    let own = first
        .and_then(|f| s.first_tokens.get(&(f as u32)))
        .is_some_and(|d| d % s.workers == s.id);
    if own { &s.own } else { &s.other }.fetch_add(1, Ordering::Relaxed);
    axum::Json(
        json!({"id": "x", "object": "text_completion", "choices": [{"index": 0,
        "text": "k", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}),
    )
}

/// Starts a simulated worker; its URL.
async fn start_sim(s: Arc<Sim>) -> Result<String> {
    let app = axum::Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(|| async { "" }))
        .route("/cache/info", get(info))
        .route("/cache/events", get(events))
        .route("/cache/snapshot", get(snapshot))
        .route("/v1/completions", post(complete))
        .with_state(s);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", l.local_addr()?);
    tokio::spawn(async move { axum::serve(strata_server::app::no_delay(l), app).await });
    Ok(url)
}

/// Appends `--events-per-second` events to every worker's log, in 10 ms ticks, until `stop`.
async fn publish(sims: Vec<Arc<Sim>>, a: Arc<RouterScaleArgs>, stop: Arc<AtomicU64>) {
    let per_tick = a.events_per_second / 100.0;
    let mut due = 0.0f64;
    let mut fresh = 0u64;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    while stop.load(Ordering::Relaxed) == 0 {
        tick.tick().await;
        due += per_tick;
        let n = due.floor() as usize;
        due -= n as f64;
        for s in &sims {
            let mut log = s.log.lock().expect("log");
            for _ in 0..n {
                let hashes = (0..a.pages_per_event)
                    .map(|_| {
                        fresh += 1;
                        let mut h = [0u8; 16];
                        h[..8].copy_from_slice(&fresh.to_le_bytes());
                        h[8] = 0xfe;
                        Hex(h)
                    })
                    .collect();
                let seq = log.len() as u64;
                log.push(WireEvent {
                    seq: Some(seq),
                    stored: true,
                    tier: Tier::Device,
                    hashes,
                });
            }
        }
    }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

pub async fn run(a: RouterScaleArgs) -> Result<()> {
    use super::limits;
    limits::count("--workers", a.workers, 4096)?;
    limits::positive("--rate", a.rate, 1e6)?;
    limits::positive("--seconds", a.seconds, 86_400.0)?;
    limits::positive("--index-interval", a.index_interval, 3600.0)?;
    if !(a.events_per_second >= 0.0 && a.events_per_second <= 1e6) {
        bail!(
            "--events-per-second {}: expected 0 to 1e6",
            a.events_per_second
        );
    }
    limits::count("--pages-per-event", a.pages_per_event, 1 << 16)?;
    limits::at_most("--document-tokens", a.document_tokens, 1 << 20)?;
    limits::buffers(
        "--documents × --document-tokens",
        a.documents,
        a.document_tokens.saturating_mul(4),
    )?;
    if a.workers == 0 || a.documents == 0 || a.document_tokens < PAGE {
        bail!("--workers and --documents must be at least 1, --document-tokens at least 16");
    }
    if !(a.rate > 0.0 && a.seconds > 0.0 && a.events_per_second >= 0.0) {
        bail!("--rate and --seconds must be > 0, --events-per-second ≥ 0");
    }
    if a.documents > a.workers * 64 {
        bail!("--documents: at most 64 per worker");
    }
    let model = a
        .model
        .clone()
        .unwrap_or_else(|| strata_model::fetch::cache_dir().join(strata_model::fetch::MODEL_FILE));
    let layout = PageLayout::new(PAGE, vec![PoolKind::aux("kv", 1, 1)])?;
    let ns = HashNamespace::new("sim", &layout);
    let (sims, urls) = start_sims(&a, &ns).await?;
    let index = router_index(&model, a.workers)?;
    let front = start_router(&urls, index.clone(), a.index_interval).await?;
    let a = Arc::new(a);
    // Let the router read every worker's documents before the load starts.
    let t0 = Instant::now();
    while index.footprint().pages < a.documents * (a.document_tokens / PAGE) {
        if t0.elapsed() > Duration::from_secs(30) {
            bail!("the router did not index the workers' documents in 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let published0: usize = sims.iter().map(|s| s.log.lock().expect("log").len()).sum();
    let served0: u64 = sims
        .iter()
        .map(|s| s.served_events.load(Ordering::Relaxed))
        .sum();
    let stop = Arc::new(AtomicU64::new(0));
    let publisher = tokio::spawn(publish(sims.clone(), a.clone(), stop.clone()));
    let started = Instant::now();
    let (mut lat, fails) = load(&front, &a).await?;
    let elapsed = started.elapsed().as_secs_f64();
    stop.store(1, Ordering::Relaxed);
    publisher.await?;
    let report = report(
        &a,
        &sims,
        &index,
        (published0, served0),
        elapsed,
        &mut lat,
        fails,
    );
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// The figures of a run (see the module docs).
fn report(
    a: &RouterScaleArgs,
    sims: &[Arc<Sim>],
    index: &strata_router::cache_index::CacheIndex,
    (published0, served0): (usize, u64),
    elapsed: f64,
    lat: &mut [f64],
    fails: usize,
) -> Value {
    let published: usize = sims.iter().map(|s| s.log.lock().expect("log").len()).sum();
    let served: u64 = sims
        .iter()
        .map(|s| s.served_events.load(Ordering::Relaxed))
        .sum();
    let (own, other): (u64, u64) = sims.iter().fold((0, 0), |(o, t), s| {
        (
            o + s.own.load(Ordering::Relaxed),
            t + s.other.load(Ordering::Relaxed),
        )
    });
    let f = index.footprint();
    let (pages, bytes) = (f.pages, f.bytes);
    let absorbed = served - served0;
    let offered = (published - published0) as u64;
    json!({
        "workers": a.workers,
        "offered_rate": a.rate,
        "seconds": elapsed,
        "requests": lat.len(),
        "failures": fails,
        "latency_ms": {"p50": pct(lat, 0.5), "p90": pct(lat, 0.9),
                       "p99": pct(lat, 0.99), "max": pct(lat, 1.0)},
        "events_published": offered,
        "events_absorbed": absorbed,
        "events_absorbed_per_second": absorbed as f64 / elapsed,
        "pages_per_event": a.pages_per_event,
        "events_behind_at_end": offered.saturating_sub(absorbed),
        "routed_to_owner": own,
        "routed_elsewhere": other,
        "index_pages": pages,
        "index_bytes": bytes,
        "index_bytes_per_page": bytes as f64 / pages.max(1) as f64,
    })
}

/// The simulated workers, each starting with its documents' pages cached; their URLs.
async fn start_sims(
    a: &RouterScaleArgs,
    ns: &HashNamespace,
) -> Result<(Vec<Arc<Sim>>, Vec<String>)> {
    let mut sims = Vec::new();
    let mut urls = Vec::new();
    // The documents' first tokens differ (7919 is prime to 40,000, and there are fewer).
    let first_tokens: std::collections::HashMap<u32, usize> =
        (0..a.documents).map(|d| (document(d, 1)[0], d)).collect();
    let first_tokens = Arc::new(first_tokens);
    for i in 0..a.workers {
        let mut log = Vec::new();
        for d in (0..a.documents).filter(|d| d % a.workers == i) {
            let hashes = ns.chain(PageHash::ROOT, &document(d, a.document_tokens), PAGE);
            log.push(WireEvent {
                seq: Some(log.len() as u64),
                stored: true,
                tier: Tier::Device,
                hashes: hashes.iter().map(|h| Hex(h.0)).collect(),
            });
        }
        let s = Arc::new(Sim {
            id: i,
            epoch: 1,
            ns: HashNamespace::from_key(ns.key()),
            log: Mutex::new(log),
            served_events: AtomicU64::new(0),
            own: AtomicU64::new(0),
            other: AtomicU64::new(0),
            workers: a.workers,
            first_tokens: first_tokens.clone(),
        });
        urls.push(start_sim(s.clone()).await?);
        sims.push(s);
    }
    Ok((sims, urls))
}

/// The router's cache index: the model's tokenizer, one index per worker.
fn router_index(
    model: &std::path::Path,
    workers: usize,
) -> Result<Arc<strata_router::cache_index::CacheIndex>> {
    let g = strata_model::GgufHeader::open(model)?;
    let tk = strata_model::ModelTokenizer::from_gguf(&g)?;
    Ok(Arc::new(strata_router::cache_index::CacheIndex::new(
        Arc::new(tk),
        None,
        workers,
        IndexLimits::within(DEFAULT_INDEX_MEMORY, workers)
            .context("too many workers for the index")?,
    )))
}

/// A cache-aware router over `urls` with its index loop and health checks; its URL.
async fn start_router(
    urls: &[String],
    index: Arc<strata_router::cache_index::CacheIndex>,
    every: f64,
) -> Result<String> {
    use strata_router::{router, Policy, RouterState};
    let mut st = RouterState::new(&[], urls, Policy::CacheAware);
    st.set_index(index);
    let st = Arc::new(st);
    tokio::spawn(strata_router::index_loop(
        st.clone(),
        Duration::from_secs_f64(every),
    ));
    tokio::spawn(strata_router::health_loop(
        st.clone(),
        Duration::from_secs(1),
    ));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", l.local_addr()?);
    tokio::spawn(async move { axum::serve(strata_server::app::no_delay(l), router(st)).await });
    Ok(url)
}

/// The open-loop client: prompts of a random document plus a few tokens of their own.
async fn load(front: &str, a: &RouterScaleArgs) -> Result<(Vec<f64>, usize)> {
    let c = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()?;
    let url = format!("{front}/v1/completions");
    let (lat, fails) = crate::bench::http::poisson_load(&c, &url, (a.rate, a.seconds), |k, r| {
        let mut prompt = document((r % a.documents as u64) as usize, a.document_tokens);
        prompt.extend([40_001 + (k % 997) as u32, 40_002]);
        json!({"prompt": prompt, "max_tokens": 1})
    })
    .await?;
    if lat.is_empty() {
        bail!("no request succeeded ({fails} failed)");
    }
    Ok((lat, fails))
}
