//! The router's metrics: what it measures at its front door, and its `/metrics` page
//! rendered from a [`RouterView`] (a snapshot of its figures; this module reads no shared
//! state). Names and help come from the one catalogue, `strata_server::metrics::CATALOGUE`.

use std::sync::atomic::{AtomicU64, Ordering};

use strata_server::metrics::{node_health, Histogram, Text};

use strata_protocol::WorkerRole;

use crate::policy::CacheAwareStats;

/// What the router measures at its front door.
#[derive(Default)]
pub struct FrontMetrics {
    /// (route, code, worker) → requests answered.
    pub answered: std::sync::Mutex<std::collections::BTreeMap<(String, u16, String), u64>>,
    pub duration: Histogram,
    pub added: Histogram,
    /// connect, status, stream.
    pub upstream_errors: [AtomicU64; 3],
    pub auth_failures: AtomicU64,
    pub in_flight: AtomicU64,
    /// What the HTTP listener saw (connections, timeouts).
    pub http: std::sync::Arc<strata_server::listen::HttpStats>,
}

impl FrontMetrics {
    pub fn answered(&self, route: &str, code: u16, worker: &str) {
        *self
            .answered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((route.to_string(), code, worker.to_string()))
            .or_default() += 1;
    }

    /// Its samples, into `t`.
    pub fn render(&self, t: &mut Text) {
        let answered = self
            .answered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for ((route, code, worker), n) in &answered {
            t.sample(
                "strata_router_http_requests_total",
                &[
                    ("route", route),
                    ("code", &code.to_string()),
                    ("worker", worker),
                ],
                *n as f64,
            );
        }
        t.histogram("strata_router_request_duration_seconds", &self.duration);
        t.histogram("strata_router_added_latency_seconds", &self.added);
        for (i, kind) in ["connect", "status", "stream"].iter().enumerate() {
            t.sample(
                "strata_router_upstream_errors_total",
                &[("kind", kind)],
                self.upstream_errors[i].load(Ordering::Relaxed) as f64,
            );
        }
        t.sample(
            "strata_router_auth_failures_total",
            &[],
            self.auth_failures.load(Ordering::Relaxed) as f64,
        );
        t.sample(
            "strata_router_in_flight_requests",
            &[],
            self.in_flight.load(Ordering::Relaxed) as f64,
        );
        self.http.render(t);
    }
}

/// One worker's figures as the router sees them.
#[derive(Clone, Debug, serde::Serialize)]
pub struct WorkerView {
    pub url: String,
    pub role: WorkerRole,
    pub healthy: bool,
    pub in_flight: u64,
    pub requests: u64,
    pub failures: u64,
}

/// The router's figures at one moment.
#[derive(Clone, Debug)]
pub struct RouterView {
    pub policy: &'static str,
    pub forwarded: u64,
    pub retries: u64,
    pub cache: CacheAwareStats,
    pub resyncs: u64,
    /// What the cache index holds and may hold (None: no index).
    pub index: Option<crate::cache_index::Footprint>,
    pub workers: Vec<WorkerView>,
}

/// The router's `/metrics`.
pub fn render(v: &RouterView, front: &FrontMetrics) -> String {
    let mut t = Text::new();
    front.render(&mut t);
    let p = v.policy;
    let c = &v.cache;
    let by_reason = [
        ("cache_hit", c.hits),
        ("no_cache_hit", c.misses),
        ("policy", v.forwarded.saturating_sub(c.hits + c.misses)),
    ];
    for (reason, n) in by_reason {
        t.sample(
            "strata_router_requests_total",
            &[("policy", p), ("reason", reason)],
            n as f64,
        );
    }
    for (tier, n) in [("device", c.hit_pages_device), ("host", c.hit_pages_host)] {
        t.sample(
            "strata_router_cache_hit_pages_total",
            &[("tier", tier)],
            n as f64,
        );
    }
    t.sample(
        "strata_router_decode_cache_hits_total",
        &[],
        c.decode_hits as f64,
    );
    t.sample("strata_router_retries_total", &[], v.retries as f64);
    if let Some(f) = v.index {
        t.sample("strata_router_index_pages", &[], f.pages as f64);
        t.sample("strata_router_index_bytes", &[], f.bytes as f64);
        t.sample("strata_router_index_limit_bytes", &[], f.limit_bytes as f64);
        let unindexed = f.unindexed as f64;
        t.sample("strata_router_index_unindexed_pages", &[], unindexed);
    }
    for w in &v.workers {
        let l = [("worker", w.url.as_str()), ("worker_role", w.role.as_str())];
        t.sample("strata_router_worker_up", &l, w.healthy as u8 as f64);
        t.sample("strata_router_worker_in_flight", &l, w.in_flight as f64);
    }
    node_health(&mut t, "router");
    t.finish()
}
