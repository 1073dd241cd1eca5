//! `strata bench workload`: one workload against one OpenAI-compatible URL, streamed, summarised
//! (TTFT, ITL, throughput, cached fraction, hit tokens by tier from `/metrics`), with a JSON
//! record. The workload is built and checked before any request is sent (`load`). The
//! pieces here (counters, sampler, table, JSON) are also what `strata bench compare` reports
//! per configuration.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use strata_bench::stats::{summarize, Outcome, Summary};

use crate::bench::load::{client, drive, prepare, WorkloadOpts};

#[derive(Args, Debug)]
pub struct WorkloadArgs {
    /// Base URL of the deployment (any OpenAI-compatible server).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Requests in flight at once (closed loop).
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Strata workers whose `/metrics` give hit tokens by tier (repeat; default: none).
    #[arg(long)]
    pub metrics_url: Vec<String>,
    /// Write the summary and every request's outcome here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub w: WorkloadOpts,
}

/// Cumulative prompt-token counters of a deployment at one moment, summed over workers.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TierCounts {
    /// Seconds since the run started.
    pub t: f64,
    pub device: f64,
    pub host: f64,
    /// The L3 tiers (disk, remote).
    pub l3: f64,
    pub miss: f64,
    /// K/V bytes the workers received from prefill workers (PD).
    pub kv_received: f64,
}

impl TierCounts {
    pub fn minus(&self, b: &TierCounts) -> TierCounts {
        TierCounts {
            t: self.t - b.t,
            device: self.device - b.device,
            host: self.host - b.host,
            l3: self.l3 - b.l3,
            miss: self.miss - b.miss,
            kv_received: self.kv_received - b.kv_received,
        }
    }
    pub fn prompt(&self) -> f64 {
        self.device + self.host + self.l3 + self.miss
    }
}

/// Adds one worker's `/metrics` text to `c`.
pub fn add_counts(c: &mut TierCounts, text: &str) {
    let w = strata_router::WorkerStats::parse(text);
    c.device += w.hit_device;
    c.host += w.hit_host;
    c.l3 += w.hit_l3;
    c.miss += w.miss;
    let received = "strata_kv_transfer_bytes_total{direction=\"received\"} ";
    c.kv_received += text
        .lines()
        .find_map(|l| l.strip_prefix(received))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0);
}

/// Reads the counters of every worker in `urls` now.
pub async fn counts(c: &reqwest::Client, urls: &[String], t: f64) -> Result<TierCounts> {
    let mut out = TierCounts {
        t,
        ..TierCounts::default()
    };
    for u in urls {
        let u = format!("{}/metrics", u.trim_end_matches('/'));
        let text = c
            .get(&u)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .with_context(|| format!("GET {u}"))?
            .text()
            .await?;
        add_counts(&mut out, &text);
    }
    Ok(out)
}

/// Samples the counters every `every` until `stop` is set; the samples, oldest first.
pub fn sampler(
    c: reqwest::Client,
    urls: Vec<String>,
    every: Duration,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<TierCounts>> {
    tokio::spawn(async move {
        let t0 = Instant::now();
        let mut v = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            if let Ok(s) = counts(&c, &urls, t0.elapsed().as_secs_f64()).await {
                v.push(s);
            }
            tokio::time::sleep(every).await;
        }
        if let Ok(s) = counts(&c, &urls, t0.elapsed().as_secs_f64()).await {
            v.push(s);
        }
        v
    })
}

/// One row of the results table.
pub struct Row {
    pub label: String,
    pub s: Summary,
    /// Hit and miss tokens over the run (None: no metrics read).
    pub tiers: Option<TierCounts>,
}

pub fn print_table(rows: &[Row]) {
    println!("| configuration | requests | failures | TTFT p50 | p90 | p99 | ITL p50 | p99 | req/s | output tok/s | cached (usage) | hit device | hit host | hit L3 | miss | K/V received per request |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let s = &r.s;
        let t = |f: fn(&TierCounts) -> f64| match &r.tiers {
            Some(c) => format!("{:.0}", f(c)),
            None => "–".into(),
        };
        println!(
            "| {} | {} | {} | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.3} | {:.1} | {:.1} % | {} | {} | {} | {} | {} |",
            r.label,
            s.requests,
            s.failures,
            s.ttft_p50 * 1e3,
            s.ttft_p90 * 1e3,
            s.ttft_p99 * 1e3,
            s.itl_p50 * 1e3,
            s.itl_p99 * 1e3,
            s.requests_per_s,
            s.output_tokens_per_s,
            100.0 * s.cached_fraction,
            t(|c| c.device),
            t(|c| c.host),
            t(|c| c.l3),
            t(|c| c.miss),
            match &r.tiers {
                Some(c) => format!(
                    "{:.2} MB",
                    c.kv_received / s.requests.max(1) as f64 / 1e6
                ),
                None => "–".into(),
            },
        );
    }
}

pub fn summary_json(s: &Summary) -> Value {
    json!({"requests": s.requests, "failures": s.failures,
           "ttft_p50": s.ttft_p50, "ttft_p90": s.ttft_p90, "ttft_p99": s.ttft_p99,
           "itl_p50": s.itl_p50, "itl_p99": s.itl_p99,
           "requests_per_s": s.requests_per_s,
           "output_tokens_per_s": s.output_tokens_per_s,
           "cached_fraction": s.cached_fraction})
}

pub fn outcomes_json(o: &[Outcome]) -> Value {
    o.iter()
        .map(|o| {
            json!({"ok": o.ok, "ttft": o.ttft, "output_tokens": o.output_tokens,
                   "prompt_tokens": o.prompt_tokens, "cached_tokens": o.cached_tokens})
        })
        .collect()
}

pub fn tiers_json(t: &TierCounts) -> Value {
    json!({"t": t.t, "device": t.device, "host": t.host, "l3": t.l3, "miss": t.miss,
           "kv_received": t.kv_received})
}

pub async fn run(a: WorkloadArgs) -> Result<()> {
    super::limits::count(
        "--concurrency",
        a.concurrency,
        super::limits::MAX_CONCURRENCY,
    )?;
    let url = a.url.trim_end_matches('/').to_string();
    let parsed = reqwest::Url::parse(&url).ok();
    if !parsed.is_some_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some()) {
        let shown = strata_kv::units::shown_url(&a.url);
        bail!("--url `{shown}`: expected http://HOST:PORT");
    }
    if let Some(path) = &a.json {
        crate::outputs::check_writable("--json", path)?;
    }
    let p = Arc::new(prepare(&a.w)?);
    let c = client()?;
    let before = if a.metrics_url.is_empty() {
        None
    } else {
        Some(counts(&c, &a.metrics_url, 0.0).await?)
    };
    let r = drive(&c, &url, &p, a.concurrency, &p.name).await?;
    let tiers = match before {
        Some(b) => Some(counts(&c, &a.metrics_url, r.wall).await?.minus(&b)),
        None => None,
    };
    let s = summarize(&r.outcomes, r.wall);
    println!(
        "workload {} ({}), seed {}, concurrency {}, max_tokens {}, against {url}",
        p.name, p.scaling, a.w.seed, a.concurrency, a.w.max_tokens
    );
    print_table(&[Row {
        label: url.clone(),
        s: s.clone(),
        tiers,
    }]);
    if let Some(path) = &a.json {
        let v = json!({
            "workload": p.name, "seed": a.w.seed, "url": url, "scaling": p.scaling,
            "concurrency": a.concurrency, "max_tokens": a.w.max_tokens,
            "wall_seconds": r.wall,
            "summary": summary_json(&s),
            "tiers": tiers.as_ref().map(tiers_json),
            "requests": outcomes_json(&r.outcomes),
        });
        std::fs::write(path, serde_json::to_string_pretty(&v)?)
            .with_context(|| format!("--json {}", path.display()))?;
    }
    // A run in which nothing was answered measured nothing: not a success.
    if s.requests > 0 && s.failures == s.requests {
        bail!(
            "all {} requests failed against {url}: nothing was measured",
            s.requests
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_by_tier_are_read_from_metrics_text() {
        let text = "# HELP x\n\
            strata_cache_hit_tokens_total{tier=\"device\"} 10\n\
            strata_cache_hit_tokens_total{tier=\"host\"} 20\n\
            strata_cache_hit_tokens_total{tier=\"disk\"} 5\n\
            strata_cache_miss_tokens_total 7\n\
            strata_kv_transfer_bytes_total{direction=\"sent\"} 9\n\
            strata_kv_transfer_bytes_total{direction=\"received\"} 1000\n\
            strata_prompt_tokens_total 42\n";
        let mut c = TierCounts::default();
        add_counts(&mut c, text);
        add_counts(&mut c, text);
        assert_eq!((c.device, c.host, c.l3, c.miss), (20.0, 40.0, 10.0, 14.0));
        assert_eq!(c.kv_received, 2000.0);
        assert_eq!(c.prompt(), 84.0);
        let d = c.minus(&TierCounts {
            device: 1.0,
            ..TierCounts::default()
        });
        assert_eq!(d.device, 19.0);
    }
}
