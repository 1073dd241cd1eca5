//! `strata bench`: measurements against a running OpenAI-compatible server.
//!
//! * `tiers`: time to first token of a long prompt computed cold, then served from the device
//!   tier, the host tier (after `/flush_cache?tier=device`) and L3 (after `?tier=all`).
//! * `streams`: decode throughput with N concurrent streams.

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
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (r as u64 + 1).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            1000 + (x % 30000) as u32
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
    one_token(&c, &url, &prompt_ids(1000, 64)).await?;
    for r in 0..a.reps {
        let ids = prompt_ids(r, a.prompt_tokens);
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
