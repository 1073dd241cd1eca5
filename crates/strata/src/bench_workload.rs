//! `strata bench workload`: one workload against one OpenAI-compatible URL, streamed, summarised
//! (TTFT, ITL, throughput, cached fraction), with a JSON record. The workload is checked before
//! any request is sent.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use futures_util::StreamExt;
use serde_json::{json, Value};
use strata_bench::stats::{summarize, Outcome};
use strata_bench::workload::{MultiTurn, SharedPrefix, TraceReplay};

#[derive(Args, Debug)]
pub struct WorkloadArgs {
    /// Base URL of the deployment (any OpenAI-compatible server).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// multi-turn, shared-prefix or trace.
    #[arg(long)]
    pub workload: String,
    /// Seed of the generators (same seed, same requests).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Requests in flight at once (closed loop; multi-turn: one per client).
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Open loop instead: Poisson arrivals at this many requests per second (shared-prefix).
    #[arg(long)]
    pub rate: Option<f64>,
    #[arg(long, default_value_t = 4, help_heading = "multi-turn")]
    pub clients: usize,
    #[arg(long, default_value_t = 3, help_heading = "multi-turn")]
    pub rounds: usize,
    #[arg(long, default_value_t = 200, help_heading = "multi-turn")]
    pub system_words: usize,
    #[arg(long, default_value_t = 20, help_heading = "multi-turn")]
    pub user_words: usize,
    #[arg(long, default_value_t = 4, help_heading = "shared-prefix")]
    pub groups: usize,
    #[arg(long, default_value_t = 4, help_heading = "shared-prefix")]
    pub per_group: usize,
    #[arg(long, default_value_t = 300, help_heading = "shared-prefix")]
    pub prefix_words: usize,
    #[arg(long, default_value_t = 10, help_heading = "shared-prefix")]
    pub suffix_words: usize,
    /// Mooncake-format trace (JSONL).
    #[arg(long, help_heading = "trace")]
    pub trace: Option<PathBuf>,
    #[arg(long, default_value_t = 512, help_heading = "trace")]
    pub block_tokens: usize,
    /// Multiplies every prompt and output length (and block size).
    #[arg(long, default_value_t = 0.1, help_heading = "trace")]
    pub length_scale: f64,
    /// Multiplies every arrival time (0.1: ten times faster).
    #[arg(long, default_value_t = 0.01, help_heading = "trace")]
    pub time_scale: f64,
    /// Requests from the start of the trace (0: all).
    #[arg(long, default_value_t = 100, help_heading = "trace")]
    pub limit: usize,
    /// Token ids are drawn below this (the model's vocabulary).
    #[arg(long, default_value_t = 49152, help_heading = "trace")]
    pub vocab: u32,
    /// Write the summary and every request's outcome here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One request to send.
enum Job {
    Chat(Vec<Value>),
    Tokens(Vec<u32>, usize),
}

/// Sends one streaming request; returns its outcome and the generated text.
async fn send(c: &reqwest::Client, url: &str, job: &Job, max_tokens: usize) -> (Outcome, String) {
    let (path, body) = match job {
        Job::Chat(msgs) => (
            "/v1/chat/completions",
            json!({"messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                   "stream": true, "stream_options": {"include_usage": true}}),
        ),
        Job::Tokens(t, m) => (
            "/v1/completions",
            json!({"prompt": t, "max_tokens": m, "temperature": 0, "ignore_eos": true,
                   "stream": true, "stream_options": {"include_usage": true}}),
        ),
    };
    let t0 = Instant::now();
    let mut o = Outcome::default();
    let mut text = String::new();
    let Ok(r) = c.post(format!("{url}{path}")).json(&body).send().await else {
        return (o, text);
    };
    if !r.status().is_success() {
        let status = r.status();
        let body = r.text().await.unwrap_or_default();
        eprintln!(
            "\nrequest failed: {status}: {}",
            body.chars().take(300).collect::<String>()
        );
        return (o, text);
    }
    let mut last: Option<Instant> = None;
    let mut buf = Vec::new();
    let mut stream = r.bytes_stream();
    let mut done = false;
    while let Some(Ok(chunk)) = stream.next().await {
        buf.extend_from_slice(&chunk);
        while let Some(i) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..i + 2).collect();
            let line = String::from_utf8_lossy(&event);
            let Some(data) = line.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            let piece = v["choices"][0]["delta"]["content"]
                .as_str()
                .or(v["choices"][0]["text"].as_str())
                .unwrap_or("");
            if !piece.is_empty() {
                let now = Instant::now();
                match last {
                    None => o.ttft = (now - t0).as_secs_f64(),
                    Some(l) => o.itl.push((now - l).as_secs_f64()),
                }
                last = Some(now);
                text.push_str(piece);
            }
            if v["usage"].is_object() {
                o.output_tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                o.prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
                o.cached_tokens = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0);
            }
        }
    }
    if last.is_none() {
        o.ttft = t0.elapsed().as_secs_f64();
    }
    o.ok = done;
    (o, text)
}

fn progress(done: &AtomicUsize, total: usize) {
    let d = done.fetch_add(1, Ordering::Relaxed) + 1;
    eprint!("\r{d}/{total} requests");
    if d == total {
        eprintln!();
    }
}

pub async fn run(a: WorkloadArgs) -> Result<()> {
    if a.concurrency == 0 {
        bail!("--concurrency must be at least 1");
    }
    if let Some(r) = a.rate {
        if !(r > 0.0 && r.is_finite()) {
            bail!("--rate {r}: expected requests per second > 0");
        }
    }
    let url = a.url.trim_end_matches('/').to_string();
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(3600))
        .build()?;
    let done = Arc::new(AtomicUsize::new(0));
    let t0 = Instant::now();
    let mut outcomes: Vec<Outcome> = Vec::new();
    let scaling;
    match a.workload.as_str() {
        "multi-turn" => {
            let w = MultiTurn {
                clients: a.clients,
                rounds: a.rounds,
                system_words: a.system_words,
                user_words: a.user_words,
                max_tokens: a.max_tokens,
                seed: a.seed,
            };
            let convs = w.conversations()?;
            scaling = format!(
                "{} clients × {} rounds, system prompt {} words",
                a.clients, a.rounds, a.system_words
            );
            let total = a.clients * a.rounds;
            let mut tasks = Vec::new();
            for conv in convs {
                let (c, url, done, max) = (c.clone(), url.clone(), done.clone(), a.max_tokens);
                tasks.push(tokio::spawn(async move {
                    let mut msgs = vec![json!({"role": "system", "content": conv.system})];
                    let mut out = Vec::new();
                    for turn in conv.user_turns {
                        msgs.push(json!({"role": "user", "content": turn}));
                        let (o, text) = send(&c, &url, &Job::Chat(msgs.clone()), max).await;
                        msgs.push(json!({"role": "assistant", "content": text}));
                        out.push(o);
                        progress(&done, total);
                    }
                    out
                }));
            }
            for t in tasks {
                outcomes.extend(t.await?);
            }
        }
        "shared-prefix" | "trace" => {
            let jobs: Vec<(Job, Option<u64>)> = if a.workload == "trace" {
                let path = a
                    .trace
                    .clone()
                    .context("--workload trace needs --trace FILE")?;
                let w = TraceReplay {
                    path,
                    block_tokens: a.block_tokens,
                    length_scale: a.length_scale,
                    time_scale: a.time_scale,
                    vocab: a.vocab,
                    limit: a.limit,
                    max_tokens: a.max_tokens,
                };
                scaling = format!(
                    "lengths × {}, arrival times × {}, first {} requests",
                    a.length_scale, a.time_scale, a.limit
                );
                w.requests()?
                    .into_iter()
                    .map(|r| (Job::Tokens(r.prompt, r.max_tokens), Some(r.at_us)))
                    .collect()
            } else {
                let w = SharedPrefix {
                    groups: a.groups,
                    per_group: a.per_group,
                    prefix_words: a.prefix_words,
                    suffix_words: a.suffix_words,
                    max_tokens: a.max_tokens,
                    seed: a.seed,
                };
                scaling = format!(
                    "{} groups × {} requests, prefix {} words",
                    a.groups, a.per_group, a.prefix_words
                );
                let mut rng = strata_bench::workload::Rng::new(a.seed ^ 0x5eed);
                let mut at = 0.0f64;
                w.requests()?
                    .into_iter()
                    .map(|r| {
                        let when = a.rate.map(|rate| {
                            at += -(rng.unit().max(1e-12)).ln() / rate;
                            (at * 1e6) as u64
                        });
                        let msgs = vec![json!({"role": "user", "content": format!("{}\n\n{}", r.prefix, r.suffix)})];
                        (Job::Chat(msgs), when)
                    })
                    .collect()
            };
            let total = jobs.len();
            let sem = Arc::new(tokio::sync::Semaphore::new(a.concurrency));
            let mut tasks = Vec::new();
            for (job, when) in jobs {
                if let Some(us) = when {
                    tokio::time::sleep_until((t0 + Duration::from_micros(us)).into()).await;
                }
                let permit = if when.is_none() {
                    Some(sem.clone().acquire_owned().await?)
                } else {
                    None
                };
                let (c, url, done, max) = (c.clone(), url.clone(), done.clone(), a.max_tokens);
                tasks.push(tokio::spawn(async move {
                    let (o, _) = send(&c, &url, &job, max).await;
                    drop(permit);
                    progress(&done, total);
                    o
                }));
            }
            for t in tasks {
                outcomes.push(t.await?);
            }
        }
        w => bail!("--workload `{w}`: expected multi-turn, shared-prefix or trace"),
    }
    let wall = t0.elapsed().as_secs_f64();
    let s = summarize(&outcomes, wall);
    println!(
        "workload {} ({scaling}), seed {}, against {url}",
        a.workload, a.seed
    );
    println!("| requests | failures | TTFT p50 | p90 | p99 | ITL p50 | p99 | req/s | output tok/s | cached |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {} | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.2} | {:.1} | {:.1} % |",
        s.requests,
        s.failures,
        s.ttft_p50 * 1e3,
        s.ttft_p90 * 1e3,
        s.ttft_p99 * 1e3,
        s.itl_p50 * 1e3,
        s.itl_p99 * 1e3,
        s.requests_per_s,
        s.output_tokens_per_s,
        100.0 * s.cached_fraction
    );
    if let Some(p) = &a.json {
        let v = json!({
            "workload": a.workload, "seed": a.seed, "url": url, "scaling": scaling,
            "wall_seconds": wall,
            "summary": {"requests": s.requests, "failures": s.failures,
                        "ttft_p50": s.ttft_p50, "ttft_p90": s.ttft_p90, "ttft_p99": s.ttft_p99,
                        "itl_p50": s.itl_p50, "itl_p99": s.itl_p99,
                        "requests_per_s": s.requests_per_s,
                        "output_tokens_per_s": s.output_tokens_per_s,
                        "cached_fraction": s.cached_fraction},
            "requests": outcomes.iter().map(|o| json!({"ok": o.ok, "ttft": o.ttft,
                "output_tokens": o.output_tokens, "prompt_tokens": o.prompt_tokens,
                "cached_tokens": o.cached_tokens})).collect::<Vec<_>>(),
        });
        std::fs::write(p, serde_json::to_string_pretty(&v)?)
            .with_context(|| format!("--json {}", p.display()))?;
    }
    Ok(())
}
