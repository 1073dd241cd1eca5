//! `strata bench health`: how fast `/health` answers while megabyte prompts are being
//! tokenized. Clients keep sending chat requests whose message is `--prompt-bytes` of text
//! (each is refused as too long for the context after tokenizing, the expensive part); a probe
//! reads `/health` every `--every-ms` and reports its latency quantiles.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use strata_bench::stats::quantile;
use strata_kv::units::parse_size;

#[derive(Args, Debug)]
pub struct HealthArgs {
    /// The server (a worker or the router).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Size of each prompt's text, with a unit.
    #[arg(long, default_value = "3MiB")]
    pub prompt_bytes: String,
    /// Clients sending large prompts at once.
    #[arg(long, default_value_t = 3)]
    pub concurrency: usize,
    /// How long to measure.
    #[arg(long, default_value_t = 20.0)]
    pub seconds: f64,
    /// Milliseconds between two `/health` probes.
    #[arg(long, default_value_t = 20)]
    pub every_ms: u64,
}

/// Status codes of the large requests, counted.
type Statuses = Arc<std::sync::Mutex<std::collections::BTreeMap<u16, u64>>>;

pub async fn run(a: HealthArgs) -> Result<()> {
    let bytes = parse_size(&a.prompt_bytes).context("--prompt-bytes")?;
    // A worker takes bodies of at most its --body-limit (default 64 MiB); 1 GiB is past any.
    if bytes > 1 << 30 {
        bail!("--prompt-bytes {}: at most 1GiB", a.prompt_bytes);
    }
    let bytes = bytes as usize;
    super::limits::count("--concurrency", a.concurrency, 1024)?;
    super::limits::positive("--seconds", a.seconds, 86_400.0)?;
    if a.every_ms == 0 {
        bail!("--every-ms must be positive");
    }
    let url = a.url.trim_end_matches('/').to_string();
    let client = reqwest::Client::new();
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let statuses: Statuses = Arc::default();
    let load = start_load(&a, &client, &url, bytes, &stop, &sent, &statuses);
    // Let the load start before measuring.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (lat, failed) = probe(&a, &client, &url).await;
    stop.store(true, Ordering::Relaxed);
    for h in load {
        let _ = h.await;
    }
    let q = |p| quantile(&lat, p).unwrap_or(f64::NAN);
    println!(
        "/health under {} clients sending {} prompts: {} probes, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms, {} failed; {} large requests answered (by status: {:?})",
        a.concurrency,
        a.prompt_bytes,
        lat.len(),
        q(0.5),
        q(0.99),
        lat.iter().cloned().fold(0.0, f64::max),
        failed,
        sent.load(Ordering::Relaxed),
        statuses.lock().expect("status lock")
    );
    Ok(())
}

/// `--concurrency` clients sending a chat request of `bytes` of text, one after the other,
/// until `stop`; each answer counted in `sent` and by status.
fn start_load(
    a: &HealthArgs,
    client: &reqwest::Client,
    url: &str,
    bytes: usize,
    stop: &Arc<AtomicBool>,
    sent: &Arc<AtomicU64>,
    statuses: &Statuses,
) -> Vec<tokio::task::JoinHandle<()>> {
    // Words, so that tokenizing does real work (not one long run of a single byte).
    let text: String = "the quick brown fox jumps over a lazy dog "
        .chars()
        .cycle()
        .take(bytes)
        .collect();
    let body = Arc::new(
        serde_json::json!({"messages": [{"role": "user", "content": text}], "max_tokens": 1})
            .to_string(),
    );
    let mut load = Vec::new();
    for _ in 0..a.concurrency {
        let (c, u, b, stop, sent, statuses) = (
            client.clone(),
            url.to_string(),
            body.clone(),
            stop.clone(),
            sent.clone(),
            statuses.clone(),
        );
        load.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let r = c
                    .post(format!("{u}/v1/chat/completions"))
                    .header("content-type", "application/json")
                    .body(b.as_str().to_owned())
                    .send()
                    .await;
                if let Ok(r) = r {
                    *statuses
                        .lock()
                        .expect("status lock")
                        .entry(r.status().as_u16())
                        .or_default() += 1;
                    let _ = r.bytes().await;
                    sent.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    load
}

/// Reads `/health` every `--every-ms` for `--seconds`: the latencies (ms) of the successful
/// probes, and how many failed.
async fn probe(a: &HealthArgs, client: &reqwest::Client, url: &str) -> (Vec<f64>, u64) {
    let mut lat = Vec::new();
    let mut failed = 0u64;
    let t = Instant::now();
    while t.elapsed().as_secs_f64() < a.seconds {
        let s = Instant::now();
        match client
            .get(format!("{url}/health"))
            .timeout(Duration::from_secs(10))
            .send()
            .await
        {
            Ok(r) if r.status().is_success() => lat.push(s.elapsed().as_secs_f64() * 1e3),
            _ => failed += 1,
        }
        tokio::time::sleep(Duration::from_millis(a.every_ms)).await;
    }
    (lat, failed)
}
