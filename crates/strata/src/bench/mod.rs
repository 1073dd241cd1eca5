//! `strata bench`: measurements against a running OpenAI-compatible server.
//!
//! * `tiers`: time to first token of a long prompt computed cold, then served from the device
//!   tier, the host tier (after `/flush_cache?tier=device`) and L3 (after `?tier=all`).
//! * `streams`: decode throughput with N concurrent streams.

pub(crate) mod agent;
pub(crate) mod compare;
pub(crate) mod health;
pub(crate) mod http;
pub(crate) mod limits;
pub(crate) mod load;
pub(crate) mod report;
pub(crate) mod router;
pub(crate) mod streams_model;
pub(crate) mod workload;

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde_json::{json, Value};

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// TTFT of a long prompt: cold vs prefix in device, host and L3 tiers.
    Tiers(TiersArgs),
    /// Decode throughput with several concurrent streams.
    Streams(StreamsArgs),
    /// KV transfer protocol on loopback vs a plain TCP copy of the same bytes (in-process).
    Transfer(TransferArgs),
    /// Latency the router adds, open loop, against a fake instant backend (in-process).
    Router(RouterArgs),
    /// The cache-aware router over many simulated workers publishing cache events: events
    /// absorbed per second, routing latency at a request rate, index bytes per cached page.
    RouterScale(crate::bench::router::RouterScaleArgs),
    /// Remote L3 (Redis) page put/get throughput and latency.
    L3(L3Args),
    /// One workload (multi-turn, shared-prefix, trace replay) against a deployment: TTFT, ITL,
    /// throughput, cached fraction; optional JSON record.
    Workload(crate::bench::workload::WorkloadArgs),
    /// Starts each configuration itself (no cache / device / +host / +disk / PD) and runs the
    /// same workload against each: table, JSON, SVG plots.
    Compare(crate::bench::compare::CompareArgs),
    /// `/health` latency while clients send megabyte prompts.
    Health(crate::bench::health::HealthArgs),
}

#[derive(Args, Debug)]
pub struct L3Args {
    /// The Redis to measure.
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    pub url: String,
    /// Pages per batch (one pipelined round trip).
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Batches.
    #[arg(long, default_value_t = 32)]
    pub batches: usize,
    /// Bytes per page (default: SmolLM2-135M's 16-token page).
    #[arg(long, default_value_t = 368_640)]
    pub page_bytes: usize,
    /// Single-page operations timed for latency.
    #[arg(long, default_value_t = 200)]
    pub single: usize,
}

#[derive(Args, Debug)]
pub struct TransferArgs {
    /// Pages per transfer.
    #[arg(long, default_value_t = 128)]
    pub pages: usize,
    /// Bytes per page (default: SmolLM2-135M's 16-token page, 368,640 bytes).
    #[arg(long, default_value_t = 368_640)]
    pub page_bytes: usize,
    /// Transfers to time (best and median reported).
    #[arg(long, default_value_t = 20)]
    pub reps: usize,
}

#[derive(Args, Debug)]
pub struct RouterArgs {
    /// Requests per second (Poisson arrivals).
    #[arg(long, default_value_t = 200.0)]
    pub rate: f64,
    /// Seconds of load per configuration.
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
}

#[derive(Args, Debug, Clone)]
pub struct Target {
    /// Base URL of the server.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Bearer token for /flush_cache.
    #[arg(long, env = "STRATA_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
}

#[derive(Args, Debug)]
pub struct TiersArgs {
    #[command(flatten)]
    pub target: Target,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 2048)]
    pub prompt_tokens: usize,
    /// Rounds (a fresh prompt each); medians are reported.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Skip the L3 step (a server without --l3).
    #[arg(long)]
    pub no_l3: bool,
    /// Token ids stay below this (a model with a small vocabulary, e.g. 288 for the tiny
    /// test models); at 31000 and above the ids are 1000..31000.
    #[arg(long, default_value_t = 31_000)]
    pub vocab: u32,
}

#[derive(Args, Debug)]
pub struct StreamsArgs {
    #[command(flatten)]
    pub target: Target,
    /// Concurrency levels to measure, one after the other.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub concurrency: Vec<usize>,
    /// Tokens each stream generates.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
}

pub fn run(c: BenchCommand) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        match c {
            BenchCommand::Tiers(a) => tiers(a).await,
            BenchCommand::Streams(a) => streams(a).await,
            BenchCommand::Transfer(a) => transfer(a).await,
            BenchCommand::Router(a) => router_latency(a).await,
            BenchCommand::RouterScale(a) => crate::bench::router::run(a).await,
            BenchCommand::L3(a) => l3(a).await,
            BenchCommand::Workload(a) => crate::bench::workload::run(a).await,
            BenchCommand::Compare(a) => crate::bench::compare::run(a).await,
            BenchCommand::Health(a) => crate::bench::health::run(a).await,
        }
    })
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(600))
        .build()
        .expect("HTTP client")
}

/// Deterministic token ids for round `r` (distinct rounds share no prefix).
fn prompt_ids(r: usize, n: usize) -> Vec<u32> {
    prompt_ids_below(r, n, 31_000)
}

/// [`prompt_ids`] for a vocabulary of `vocab` tokens: ids 1000..31000 when it has them, else
/// any id below `vocab`.
fn prompt_ids_below(r: usize, n: usize, vocab: u32) -> Vec<u32> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (r as u64 + 1).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if vocab >= 31_000 {
                1000 + (x % 30000) as u32
            } else {
                (x % vocab.max(1) as u64) as u32
            }
        })
        .collect()
}

/// One completion with max_tokens 1: (seconds, cached tokens).
async fn one_token(c: &reqwest::Client, url: &str, ids: &[u32]) -> Result<(f64, u64)> {
    let t = Instant::now();
    let r = c
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": ids, "max_tokens": 1, "temperature": 0, "ignore_eos": true}))
        .send()
        .await
        .with_context(|| format!("POST {url}/v1/completions"))?;
    let status = r.status();
    let v: Value = r.json().await?;
    if !status.is_success() {
        bail!("{status}: {v}");
    }
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    Ok((t.elapsed().as_secs_f64(), cached))
}

async fn flush(c: &reqwest::Client, t: &Target, tier: &str) -> Result<()> {
    let mut r = c.post(format!("{}/flush_cache?tier={tier}", t.url));
    if let Some(k) = &t.admin_key {
        r = r.bearer_auth(k);
    }
    let r = r.send().await?;
    if !r.status().is_success() {
        bail!("flush_cache: {} {}", r.status(), r.text().await?);
    }
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn tiers(a: TiersArgs) -> Result<()> {
    if a.prompt_tokens < 2 || a.reps == 0 {
        bail!("--prompt-tokens must be at least 2 and --reps at least 1");
    }
    let c = client();
    let url = a.target.url.trim_end_matches('/').to_string();
    let names = ["cold", "device", "host", "l3"];
    let steps = if a.no_l3 { 3 } else { 4 };
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); steps];
    let mut cached: Vec<u64> = vec![0; steps];
    // Warm-up: page in the weights and code paths.
    one_token(&c, &url, &prompt_ids_below(1000, 64, a.vocab)).await?;
    for r in 0..a.reps {
        let ids = prompt_ids_below(r, a.prompt_tokens, a.vocab);
        for (i, name) in names.iter().enumerate().take(steps) {
            match *name {
                "host" => flush(&c, &a.target, "device").await?,
                "l3" => flush(&c, &a.target, "all").await?,
                _ => {}
            }
            let (t, k) = one_token(&c, &url, &ids).await?;
            times[i].push(t);
            cached[i] = k;
            eprintln!(
                "round {r}: {name:<6} {:>9.1} ms  cached {k} tokens",
                t * 1e3
            );
        }
    }
    let cold = median(&mut times[0].clone());
    println!(
        "TTFT, prompt {} tokens, median of {} rounds ({url}):",
        a.prompt_tokens, a.reps
    );
    println!("| prefix from | TTFT | cached tokens | speed-up vs cold |");
    println!("|---|---|---|---|");
    for i in 0..steps {
        let m = median(&mut times[i]);
        println!(
            "| {} | {:.1} ms | {} | {:.1}× |",
            names[i],
            m * 1e3,
            cached[i],
            cold / m
        );
    }
    Ok(())
}

async fn streams(a: StreamsArgs) -> Result<()> {
    if a.concurrency.contains(&0) || a.max_tokens == 0 {
        bail!("--concurrency levels and --max-tokens must be at least 1");
    }
    for &c in &a.concurrency {
        limits::count("--concurrency", c, limits::MAX_CONCURRENCY)?;
    }
    let c = client();
    let url = a.target.url.trim_end_matches('/').to_string();
    one_token(&c, &url, &prompt_ids(2000, 32)).await?;
    println!("| streams | tokens | wall time | output tok/s | per stream tok/s |");
    println!("|---|---|---|---|---|");
    for &n in &a.concurrency {
        let t = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..n {
            let (c, url) = (c.clone(), url.clone());
            let ids = prompt_ids(5000 + n * 100 + i, 32);
            let max = a.max_tokens;
            tasks.push(tokio::spawn(async move {
                let r = c
                    .post(format!("{url}/v1/completions"))
                    .json(&json!({"prompt": ids, "max_tokens": max, "temperature": 0, "ignore_eos": true}))
                    .send()
                    .await?;
                let v: Value = r.json().await?;
                let k = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                anyhow::Ok(k)
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += t.await??;
        }
        let wall = t.elapsed().as_secs_f64();
        println!(
            "| {n} | {total} | {wall:.2} s | {:.1} | {:.1} |",
            total as f64 / wall,
            total as f64 / wall / n as f64
        );
    }
    Ok(())
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

async fn transfer(a: TransferArgs) -> Result<()> {
    if a.pages == 0 || a.page_bytes == 0 || a.reps == 0 {
        bail!("--pages, --page-bytes and --reps must be at least 1");
    }
    limits::at_most("--reps", a.reps, 1_000_000)?;
    limits::buffers("--pages × --page-bytes", a.pages, a.page_bytes)?;
    let blobs: Vec<Vec<u8>> = (0..a.pages)
        .map(|i| (0..a.page_bytes).map(|j| (i * 31 + j) as u8).collect())
        .collect();
    let total = (a.pages * a.page_bytes) as f64;
    let (pb, reps) = (a.page_bytes as u64, a.reps);
    tokio::task::spawn_blocking(move || -> Result<()> {
        let (mut proto, mut plain) = interleaved_rates(&blobs, pb, total, reps)?;
        let mut ratios: Vec<f64> = proto.iter().zip(&plain).map(|(p, q)| p / q).collect();
        let (pm, qm) = (median(&mut proto.clone()), median(&mut plain.clone()));
        println!(
            "KV transfer on loopback: {} pages × {} bytes = {:.1} MB per transfer, {reps} transfers each way, interleaved",
            blobs.len(),
            pb,
            total / 1e6
        );
        println!("| path | median GB/s | best GB/s |");
        println!("|---|---|---|");
        println!("| plain TCP copy | {qm:.2} | {:.2} |", pct(&mut plain, 1.0));
        println!("| Strata KV protocol (framed, xxh3-128 per frame, handshake, acks) | {pm:.2} | {:.2} |", pct(&mut proto, 1.0));
        println!("protocol / plain (median of medians): {:.2}", pm / qm);
        println!(
            "protocol / plain (median of the {reps} side-by-side pairs): {:.2}",
            median(&mut ratios)
        );
        Ok(())
    })
    .await??;
    Ok(())
}

/// The KV transfer protocol and a plain TCP copy of the same bytes on loopback, one
/// connection each, one transfer of each in turn (`reps` pairs, the order alternating), so
/// both see the same machine from moment to moment: GB/s of each transfer, by path.
fn interleaved_rates(
    blobs: &[Vec<u8>],
    pb: u64,
    total: f64,
    reps: usize,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let mut proto = ProtocolPath::start(blobs.len(), pb, reps)?;
    let mut plain = PlainPath::start(total as usize, reps)?;
    let (mut p, mut q) = (Vec::new(), Vec::new());
    for r in 0..reps {
        if r % 2 == 0 {
            p.push(proto.once(blobs, r)?);
            q.push(plain.once(blobs, total)?);
        } else {
            q.push(plain.once(blobs, total)?);
            p.push(proto.once(blobs, r)?);
        }
    }
    proto.finish()?;
    plain.finish()?;
    Ok((p, q))
}

/// The KV transfer protocol on loopback, as a decode worker receives (paced frames, the
/// cluster key's handshake, pages into reused buffers given back after each transfer).
struct ProtocolPath {
    conn: std::net::TcpStream,
    tokens: Vec<u32>,
    rx: std::thread::JoinHandle<Result<()>>,
}

impl ProtocolPath {
    fn start(npages: usize, pb: u64, reps: usize) -> Result<ProtocolPath> {
        use std::net::{TcpListener, TcpStream};
        use strata_engine::transfer::{self, Hello};
        let hello = Hello {
            model_id: "bench".into(),
            page_size: 16,
            page_bytes: pb,
            layout: "bench".into(),
        };
        let h2 = hello.clone();
        let key = strata_kv::auth::ClusterKey::from_secret(&[7; 32]).expect("32 bytes");
        let key2 = key.clone();
        let l = TcpListener::bind("127.0.0.1:0")?;
        let addr = l.local_addr()?;
        let rx = std::thread::spawn(move || -> Result<()> {
            let (c, _) = l.accept()?;
            c.set_nodelay(true)?;
            let mut c =
                transfer::Paced::new(c, Duration::from_secs(10), Duration::from_secs(1), 1 << 20);
            transfer::handshake_accept(&mut c, &h2, Some(&key2))?;
            let lim = transfer::RecvLimits {
                page_bytes: pb,
                main_page_bytes: None,
                page_size: 16,
                max_tokens: npages * 16,
            };
            for _ in 0..reps {
                let r = transfer::recv_kv(&mut c, &lim, &mut |_, _, _| transfer::Admit::Yes)?;
                // As the engine does once it wrote them into its pool.
                transfer::recycle(r.pages);
            }
            Ok(())
        });
        let mut conn = TcpStream::connect(addr)?;
        conn.set_nodelay(true)?;
        transfer::handshake_connect(&mut conn, &hello, Some(&key))?;
        // One token per page slot: the pages announced match the tokens they hold.
        let tokens = (0..npages * 16).map(|i| i as u32 % 100).collect();
        Ok(ProtocolPath { conn, tokens, rx })
    }

    /// One transfer (acknowledged by the receiver); its GB/s.
    fn once(&mut self, blobs: &[Vec<u8>], r: usize) -> Result<f64> {
        use strata_engine::transfer::{self, OutPage};
        let pages: Vec<OutPage> = blobs
            .iter()
            .map(|d| OutPage {
                hash: [1; 16],
                data: d,
            })
            .collect();
        let st = transfer::send_kv(
            &mut self.conn,
            r as u128,
            &self.tokens,
            0,
            &pages,
            Duration::from_secs(60),
        )?;
        Ok(st.bytes as f64 / st.seconds / 1e9)
    }

    fn finish(self) -> Result<()> {
        self.rx
            .join()
            .map_err(|_| anyhow::anyhow!("receiver panicked"))?
    }
}

/// Plain TCP on loopback: the same bytes written and read back to back (into one reused
/// buffer), acknowledged by one byte.
struct PlainPath {
    conn: std::net::TcpStream,
    rx: std::thread::JoinHandle<Result<()>>,
}

impl PlainPath {
    fn start(per: usize, reps: usize) -> Result<PlainPath> {
        use std::io::{Read, Write};
        use std::net::{TcpListener, TcpStream};
        let l = TcpListener::bind("127.0.0.1:0")?;
        let addr = l.local_addr()?;
        let rx = std::thread::spawn(move || -> Result<()> {
            let (mut c, _) = l.accept()?;
            let mut buf = vec![0u8; 1 << 20];
            for _ in 0..reps {
                let mut got = 0;
                while got < per {
                    let k = c.read(&mut buf[..(per - got).min(1 << 20)])?;
                    if k == 0 {
                        bail!("plain copy: early EOF");
                    }
                    got += k;
                }
                c.write_all(&[1])?;
            }
            Ok(())
        });
        let conn = TcpStream::connect(addr)?;
        conn.set_nodelay(true)?;
        Ok(PlainPath { conn, rx })
    }

    fn once(&mut self, blobs: &[Vec<u8>], total: f64) -> Result<f64> {
        use std::io::{Read, Write};
        let t = Instant::now();
        for b in blobs {
            self.conn.write_all(b)?;
        }
        let mut ack = [0u8; 1];
        self.conn.read_exact(&mut ack)?;
        Ok(total / t.elapsed().as_secs_f64() / 1e9)
    }

    fn finish(self) -> Result<()> {
        self.rx
            .join()
            .map_err(|_| anyhow::anyhow!("receiver panicked"))?
    }
}

async fn router_latency(a: RouterArgs) -> Result<()> {
    limits::positive("--rate", a.rate, 1e6)?;
    limits::positive("--seconds", a.seconds, 86_400.0)?;
    limits::buffers(
        "--rate × --seconds requests",
        (a.rate * a.seconds) as usize,
        64,
    )?;
    if !(a.rate > 0.0 && a.seconds > 0.0) {
        bail!("--rate and --seconds must be > 0");
    }
    let backend = fake_backend().await?;
    let front = start_router(&backend).await?;
    let c = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()?;
    let body = json!({"messages": [{"role": "user", "content": "say OK"}], "max_tokens": 1});
    // Warm both paths' connection pools.
    for _ in 0..20 {
        c.post(format!("{backend}/v1/chat/completions"))
            .json(&body)
            .send()
            .await?
            .bytes()
            .await?;
        c.post(format!("{front}/v1/chat/completions"))
            .json(&body)
            .send()
            .await?
            .bytes()
            .await?;
    }
    let load = (a.rate, a.seconds);
    let chat = |u: &str| format!("{u}/v1/chat/completions");
    let (mut direct, f1) =
        crate::bench::http::poisson_load(&c, &chat(&backend), load, |_, _| body.clone()).await?;
    let (mut routed, f2) =
        crate::bench::http::poisson_load(&c, &chat(&front), load, |_, _| body.clone()).await?;
    println!(
        "router latency, open loop {} req/s for {} s each, fake instant backend ({} + {} failures)",
        a.rate, a.seconds, f1, f2
    );
    println!("| path | p50 ms | p90 ms | p99 ms |");
    println!("|---|---|---|---|");
    let (d50, d90, d99) = (
        pct(&mut direct, 0.5),
        pct(&mut direct, 0.9),
        pct(&mut direct, 0.99),
    );
    let (r50, r90, r99) = (
        pct(&mut routed, 0.5),
        pct(&mut routed, 0.9),
        pct(&mut routed, 0.99),
    );
    println!("| client → backend | {d50:.3} | {d90:.3} | {d99:.3} |");
    println!("| client → router → backend | {r50:.3} | {r90:.3} | {r99:.3} |");
    println!(
        "| added by the router | {:.3} | {:.3} | {:.3} |",
        r50 - d50,
        r90 - d90,
        r99 - d99
    );
    Ok(())
}

/// The fake backend: answers every completion at once with a fixed body; its URL.
async fn fake_backend() -> Result<String> {
    let fake = axum::Router::new().route(
        "/v1/chat/completions",
        axum::routing::post(|| async {
            axum::Json(
                json!({"id": "x", "object": "chat.completion", "choices": [{"index": 0,
                "message": {"role": "assistant", "content": "OK"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}),
            )
        }),
    );
    let fl = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let backend = format!("http://{}", fl.local_addr()?);
    tokio::spawn(async move { axum::serve(strata_server::app::no_delay(fl), fake).await });
    Ok(backend)
}

/// The router, round robin over the one backend; its URL.
async fn start_router(backend: &str) -> Result<String> {
    use std::sync::Arc;
    use strata_router::{router, Policy, RouterState};
    let st = Arc::new(RouterState::new(
        &[],
        &[backend.to_string()],
        Policy::RoundRobin,
    ));
    let rl = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let front = format!("http://{}", rl.local_addr()?);
    tokio::spawn(async move { axum::serve(strata_server::app::no_delay(rl), router(st)).await });
    Ok(front)
}

/// `strata bench l3`'s flags: at least 1 each, pages Redis takes (at most 512 MB), batches
/// within the benches' buffers.
fn check_l3_args(a: &L3Args) -> Result<()> {
    if a.batch == 0 || a.batches == 0 || a.page_bytes == 0 || a.single == 0 {
        bail!("--batch, --batches, --page-bytes and --single must be at least 1");
    }
    limits::at_most("--page-bytes", a.page_bytes, 512 << 20)?;
    limits::buffers("--batch × --page-bytes", a.batch, a.page_bytes)?;
    limits::at_most("--batches", a.batches, 1_000_000)?;
    limits::at_most("--single", a.single, 1_000_000)
}

async fn l3(a: L3Args) -> Result<()> {
    use strata_kv::storage::Storage;
    use strata_kv::PageHash;
    check_l3_args(&a)?;
    tokio::task::spawn_blocking(move || -> Result<()> {
        let ns = format!("bench-{}", std::process::id());
        let s = strata_redis::RedisStorage::connect(&strata_redis::RedisConfig {
            url: a.url.clone(),
            namespace: ns,
            ttl: Some(Duration::from_secs(600)),
            timeout: Duration::from_secs(10),
            page_key: strata_kv::storage::blob::BlobKey::public(),
            max_value_bytes: 1 << 30,
        })?;
        let hash = |i: usize| {
            let mut h = [0u8; 16];
            h[..8].copy_from_slice(&(i as u64).to_le_bytes());
            PageHash(h)
        };
        let page: Vec<u8> = (0..a.page_bytes).map(|i| i as u8).collect();
        let n = a.batch * a.batches;
        let t = Instant::now();
        for b in 0..a.batches {
            let pages: Vec<(PageHash, Vec<u8>)> = (0..a.batch)
                .map(|i| (hash(b * a.batch + i), page.clone()))
                .collect();
            if s.put_many(&pages).iter().any(|r| r.is_err()) {
                bail!("a put failed");
            }
        }
        let put_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for b in 0..a.batches {
            let hs: Vec<PageHash> = (0..a.batch).map(|i| hash(b * a.batch + i)).collect();
            for r in s.get_many(&hs) {
                if r?.map(|d| d.len()) != Some(a.page_bytes) {
                    bail!("a get missed");
                }
            }
        }
        let get_s = t.elapsed().as_secs_f64();
        let (mut put_lat, mut get_lat) = (Vec::new(), Vec::new());
        for i in 0..a.single {
            let h = hash(n + i);
            let t = Instant::now();
            s.put(&h, &page)?;
            put_lat.push(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            s.get(&h)?;
            get_lat.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let bytes = (n * a.page_bytes) as f64;
        println!(
            "remote L3 at {}: {n} pages × {} bytes in batches of {}",
            a.url, a.page_bytes, a.batch
        );
        println!("| operation | throughput | pages/s | single-page p50 | single-page p99 |");
        println!("|---|---|---|---|---|");
        println!(
            "| put | {:.2} GB/s | {:.0} | {:.3} ms | {:.3} ms |",
            bytes / put_s / 1e9,
            n as f64 / put_s,
            pct(&mut put_lat, 0.5),
            pct(&mut put_lat, 0.99)
        );
        println!(
            "| get | {:.2} GB/s | {:.0} | {:.3} ms | {:.3} ms |",
            bytes / get_s / 1e9,
            n as f64 / get_s,
            pct(&mut get_lat, 0.5),
            pct(&mut get_lat, 0.99)
        );
        Ok(())
    })
    .await??;
    Ok(())
}
