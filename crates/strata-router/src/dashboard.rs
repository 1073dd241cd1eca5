//! The router's live view: it scrapes every worker's `/metrics` (one task per worker, so a
//! worker that hangs delays nobody else), keeps a ring of samples (15 minutes at one second),
//! and serves the built-in page (`/dashboard`), the latest figures (`/dashboard/data`) and
//! the samples since a sequence number (`/dashboard/history?since=N`) that the page draws as
//! time series.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::Json;
use serde_json::json;
use strata_server::auth::now_ms;
use strata_server::metrics::LATENCY_BUCKETS;

use crate::scrape::{
    RouterSample, Sample, WorkerStats, HISTORY_SAMPLES, SAMPLES_PER_ANSWER, STALE_INTERVALS,
};
use crate::state::RouterState;
use crate::worker::Worker;

/// One worker's watch: its `/health` marks it up or down, its `/metrics` feeds the dashboard.
async fn watch(state: Arc<RouterState>, w: Arc<Worker>, every: Duration) {
    loop {
        let ok = match state
            .client
            .get(format!("{}/health", w.url))
            .timeout(Duration::from_secs(2))
            .send()
            .await
        {
            Ok(r) => {
                // A worker names its instance on every answer: the first signed call to it
                // (or the first after it restarted) then needs no second try.
                state.peers.learn(&w.url, &r);
                r.status().is_success()
            }
            Err(_) => false,
        };
        if ok {
            if let Ok(r) = state
                .client
                .get(format!("{}/metrics", w.url))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .and_then(|r| r.error_for_status())
            {
                // Bounded: a worker's /metrics is kilobytes; an endless one is cut.
                let two = Duration::from_secs(2);
                let body = crate::upstream::body_within(r, 8 << 20, two, two).await;
                if let Ok(body) = body {
                    let text = String::from_utf8_lossy(&body);
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
        if w.checked(ok) {
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
    for (w, _) in state.all_workers() {
        tokio::spawn(watch(state.clone(), w.clone(), every));
    }
    loop {
        tokio::time::sleep(every).await;
        record(&state, every);
    }
}

/// Appends one sample: the latest figures of every worker heard from recently.
fn record(st: &RouterState, every: Duration) {
    let now = now_ms();
    let fresh_ms = (every.as_millis() as f64 * STALE_INTERVALS) as u64;
    let scraped = st.scraped.lock().expect("scrape lock").clone();
    let workers = st
        .all_workers()
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
    let workers: Vec<_> = st
        .all_workers()
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

/// Samples from sequence number `since` on, at most [`SAMPLES_PER_ANSWER`] (the page asks
/// again from `next`). The lock is held only to copy pointers; the JSON is built off the async
/// workers.
pub async fn history(
    State(st): St,
    uri: axum::http::Uri,
) -> Result<axum::response::Response, strata_server::ApiError> {
    let q: strata_server::error::SinceQuery = strata_server::error::query(&uri)?;
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
    let workers: Vec<_> = st
        .all_workers()
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
    .map_err(|e| strata_server::error::engine_error(&e.to_string()))?
    .map_err(|e| strata_server::error::engine_error(&e.to_string()))?;
    Ok(axum::response::IntoResponse::into_response((
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body,
    )))
}
