//! The router's live view: it scrapes every worker's `/metrics` (one task per worker, so a
//! worker that hangs delays nobody else), keeps a ring of samples (15 minutes at one second),
//! and serves the built-in page (`/dashboard`), the latest figures (`/dashboard/data`) and
//! the samples since a sequence number (`/dashboard/history?since=N`) that the page draws as
//! time series.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::auth::now_ms;
use crate::metrics::LATENCY_BUCKETS;
use crate::router::{RouterState, Worker};

/// Samples kept: 15 minutes at the default health interval of one second.
pub const HISTORY_SAMPLES: usize = 900;

/// What the dashboard shows of a worker, from its `/metrics` (cumulative counters and gauges
/// as scraped; the page computes rates from consecutive samples).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct WorkerStats {
    pub prompt_tokens: f64,
    pub hit_device: f64,
    pub hit_host: f64,
    pub hit_l3: f64,
    pub miss: f64,
    pub device_used: f64,
    pub device_total: f64,
    pub host_used: f64,
    pub host_total: f64,
    pub ttft_sum: f64,
    pub ttft_count: f64,
    /// Cumulative TTFT bucket counts, one per `LATENCY_BUCKETS` bound, then +Inf.
    pub ttft_buckets: Vec<f64>,
    pub running: f64,
    pub queued: f64,
    pub generated: f64,
    pub requests_ok: f64,
    pub requests_error: f64,
    pub requests_429: f64,
    pub kv_sent_bytes: f64,
    pub kv_received_bytes: f64,
}

impl WorkerStats {
    /// Reads the figures from a Prometheus text exposition.
    pub fn parse(text: &str) -> WorkerStats {
        let mut w = WorkerStats {
            ttft_buckets: vec![0.0; LATENCY_BUCKETS.len() + 1],
            ..WorkerStats::default()
        };
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((key, v)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(v) = v.parse::<f64>() else { continue };
            let (name, labels) = key.split_once('{').unwrap_or((key, ""));
            let has = |l: &str| labels.contains(l);
            match name {
                "strata_prompt_tokens_total" => w.prompt_tokens = v,
                "strata_cache_hit_tokens_total" if has("tier=\"device\"") => w.hit_device = v,
                "strata_cache_hit_tokens_total" if has("tier=\"host\"") => w.hit_host = v,
                "strata_cache_hit_tokens_total" => w.hit_l3 += v,
                "strata_cache_miss_tokens_total" => w.miss = v,
                "strata_cache_pages" if has("tier=\"device\"") && has("state=\"used\"") => {
                    w.device_used = v
                }
                "strata_cache_pages" if has("tier=\"device\"") => w.device_total = v,
                "strata_cache_pages" if has("state=\"used\"") => w.host_used = v,
                "strata_cache_pages" => w.host_total = v,
                "strata_time_to_first_token_seconds_sum" => w.ttft_sum = v,
                "strata_time_to_first_token_seconds_count" => w.ttft_count = v,
                "strata_time_to_first_token_seconds_bucket" => {
                    let le = labels
                        .split_once("le=\"")
                        .and_then(|(_, r)| r.split_once('"'))
                        .map(|(le, _)| le);
                    let i = match le {
                        Some("+Inf") => Some(LATENCY_BUCKETS.len()),
                        Some(b) => b
                            .parse::<f64>()
                            .ok()
                            .and_then(|b| LATENCY_BUCKETS.iter().position(|&x| x == b)),
                        None => None,
                    };
                    if let Some(i) = i {
                        w.ttft_buckets[i] = v;
                    }
                }
                "strata_running_requests" => w.running = v,
                "strata_queue_depth" => w.queued = v,
                "strata_generation_tokens_total" => w.generated = v,
                "strata_requests_total" if has("outcome=\"ok\"") => w.requests_ok = v,
                "strata_requests_total" if has("outcome=\"429\"") => w.requests_429 = v,
                "strata_requests_total" if has("outcome=\"4xx\"") || has("outcome=\"5xx\"") => {
                    w.requests_error += v
                }
                "strata_kv_transfer_bytes_total" if has("direction=\"sent\"") => {
                    w.kv_sent_bytes = v
                }
                "strata_kv_transfer_bytes_total" => w.kv_received_bytes = v,
                _ => {}
            }
        }
        w
    }
}

/// The router's own figures in a sample (cumulative).
#[derive(Clone, Debug, Default, Serialize)]
pub struct RouterSample {
    pub requests_2xx: u64,
    pub requests_4xx: u64,
    pub requests_429: u64,
    pub requests_5xx: u64,
    pub in_flight: u64,
    pub retries: u64,
}

/// One pass of the recorder: when, every worker's latest figures (None: not heard from since
/// the previous sample), and the router's.
#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    pub seq: u64,
    pub t_ms: u64,
    pub workers: Vec<Option<WorkerStats>>,
    pub router: RouterSample,
}

/// The ring of samples (shared, so that answers copy pointers, not figures, under the lock).
#[derive(Default)]
pub struct History {
    pub samples: VecDeque<Arc<Sample>>,
    pub next_seq: u64,
}

/// Most samples one `/dashboard/history` answer carries (the page asks again for the rest).
pub const SAMPLES_PER_ANSWER: usize = 120;

/// Every worker in the order the dashboard lists them, with its role.
fn all_workers(st: &RouterState) -> Vec<(&Arc<Worker>, &'static str)> {
    let role = if st.prefill.is_empty() {
        "both"
    } else {
        "decode"
    };
    st.prefill
        .iter()
        .map(|w| (w, "prefill"))
        .chain(st.decode.iter().map(|w| (w, role)))
        .collect()
}

/// One worker's watch: its `/health` marks it up or down, its `/metrics` feeds the dashboard.
async fn watch(state: Arc<RouterState>, w: Arc<Worker>, every: Duration) {
    loop {
        let ok = state
            .client
            .get(format!("{}/health", w.url))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .map(|r| r.status().is_success())
            .unwrap_or(false);
        if ok {
            if let Ok(r) = state
                .client
                .get(format!("{}/metrics", w.url))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .and_then(|r| r.error_for_status())
            {
                if let Ok(text) = r.text().await {
                    let stats = WorkerStats::parse(&text);
                    state
                        .scraped
                        .lock()
                        .expect("scrape lock")
                        .insert(w.url.clone(), stats);
                    w.last_seen_ms.store(now_ms(), Ordering::Relaxed);
                }
            }
        }
        let was = w.healthy.swap(ok, Ordering::Relaxed);
        if was != ok {
            if ok {
                tracing::info!(worker = %w.url, "worker up");
            } else {
                tracing::warn!(worker = %w.url, "worker down");
            }
        }
        tokio::time::sleep(every).await;
    }
}

/// Marks workers down and up from their `/health` (each on its own task), and records a
/// dashboard sample every `every`.
pub async fn health_loop(state: Arc<RouterState>, every: Duration) {
    for (w, _) in all_workers(&state) {
        tokio::spawn(watch(state.clone(), w.clone(), every));
    }
    loop {
        tokio::time::sleep(every).await;
        record(&state, every);
    }
}

/// A worker not heard from for this many intervals is stale: its samples are gaps.
pub const STALE_INTERVALS: f64 = 2.5;

/// Appends one sample: the latest figures of every worker heard from recently.
fn record(st: &RouterState, every: Duration) {
    let now = now_ms();
    let fresh_ms = (every.as_millis() as f64 * STALE_INTERVALS) as u64;
    let scraped = st.scraped.lock().expect("scrape lock").clone();
    let workers = all_workers(st)
        .iter()
        .map(|(w, _)| {
            let seen = w.last_seen_ms.load(Ordering::Relaxed);
            (now.saturating_sub(seen) <= fresh_ms)
                .then(|| scraped.get(&w.url).cloned())
                .flatten()
        })
        .collect();
    let answered = st
        .front
        .answered
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let mut r = RouterSample {
        in_flight: st.front.in_flight.load(Ordering::Relaxed),
        retries: st.retries.load(Ordering::Relaxed),
        ..RouterSample::default()
    };
    for ((route, code, _), n) in answered {
        if !route.starts_with("/v1/") {
            continue;
        }
        match code {
            200..=299 => r.requests_2xx += n,
            429 => r.requests_429 += n,
            400..=499 => r.requests_4xx += n,
            _ => r.requests_5xx += n,
        }
    }
    let mut h = st.history.lock().expect("history lock");
    let seq = h.next_seq;
    h.next_seq += 1;
    h.samples.push_back(Arc::new(Sample {
        seq,
        t_ms: now,
        workers,
        router: r,
    }));
    while h.samples.len() > HISTORY_SAMPLES {
        h.samples.pop_front();
    }
}

type St = State<Arc<RouterState>>;

/// The built-in dashboard (one page, no external assets).
pub async fn page() -> axum::response::Html<&'static str> {
    axum::response::Html(include_str!("dashboard.html"))
}

/// The latest figures of every worker, with its health and when it was last heard from.
pub async fn data(State(st): St) -> Json<serde_json::Value> {
    let scraped = st.scraped.lock().expect("scrape lock").clone();
    let workers: Vec<_> = all_workers(&st)
        .into_iter()
        .map(|(w, role)| {
            json!({"url": w.url, "role": role,
                   "healthy": w.healthy.load(Ordering::Relaxed),
                   "last_seen_ms": w.last_seen_ms.load(Ordering::Relaxed),
                   "stats": scraped.get(&w.url)})
        })
        .collect();
    Json(json!({"policy": st.policy.name(), "now_ms": now_ms(), "workers": workers}))
}

#[derive(Deserialize)]
pub struct SinceQuery {
    since: Option<u64>,
}

/// Samples from sequence number `since` on, at most [`SAMPLES_PER_ANSWER`] (the page asks
/// again from `next`). The lock is held only to copy pointers; the JSON is built off the async
/// workers.
pub async fn history(
    State(st): St,
    q: Query<SinceQuery>,
) -> Result<axum::response::Response, crate::ApiError> {
    let since = q.since.unwrap_or(0);
    let (samples, next) = {
        let h = st.history.lock().expect("history lock");
        let samples: Vec<Arc<Sample>> = h
            .samples
            .iter()
            .filter(|s| s.seq >= since)
            .take(SAMPLES_PER_ANSWER)
            .cloned()
            .collect();
        let next = samples
            .last()
            .map(|s| s.seq + 1)
            .unwrap_or(h.next_seq.max(since));
        (samples, next)
    };
    let workers: Vec<_> = all_workers(&st)
        .into_iter()
        .map(|(w, role)| json!({"url": w.url, "role": role}))
        .collect();
    let stale_ms = (st.health_every.as_millis() as f64 * STALE_INTERVALS) as u64;
    let body = tokio::task::spawn_blocking(move || {
        let samples: Vec<&Sample> = samples.iter().map(|s| s.as_ref()).collect();
        serde_json::to_vec(&json!({
            "now_ms": now_ms(),
            "next": next,
            "stale_ms": stale_ms,
            "ttft_buckets": LATENCY_BUCKETS,
            "workers": workers,
            "samples": samples,
        }))
    })
    .await
    .map_err(|e| crate::respond::engine_error(&e.to_string()))?
    .map_err(|e| crate::respond::engine_error(&e.to_string()))?;
    Ok(axum::response::IntoResponse::into_response((
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body,
    )))
}
