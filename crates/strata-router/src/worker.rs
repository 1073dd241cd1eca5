//! One worker as the router sees it: its URL, health and load.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// One worker as the router sees it.
pub struct Worker {
    pub url: String,
    /// Its place in the router's cache index.
    pub slot: usize,
    pub healthy: AtomicBool,
    /// Unix milliseconds of the first of the health checks it has failed in a row (0: its
    /// last check passed). Only the checks set it: a refused connection marks a worker down
    /// for routing, not for giving up on the answers it owes.
    failing_since_ms: AtomicU64,
    /// Unix milliseconds of the last successful scrape of its `/metrics` (0: never).
    pub last_seen_ms: AtomicU64,
    pub in_flight: AtomicUsize,
    pub requests: AtomicU64,
    pub failures: AtomicU64,
}

impl Worker {
    pub fn new(url: &str) -> Arc<Worker> {
        Worker::at(url, 0)
    }

    /// A worker at place `slot` of the router's cache index.
    pub fn at(url: &str, slot: usize) -> Arc<Worker> {
        Arc::new(Worker {
            url: url.trim_end_matches('/').to_string(),
            slot,
            healthy: AtomicBool::new(true),
            failing_since_ms: AtomicU64::new(0),
            last_seen_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        })
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Records a health check's verdict; whether it changed the worker's state.
    pub fn checked(&self, ok: bool) -> bool {
        let was = self.healthy.swap(ok, Ordering::Relaxed);
        if ok {
            self.failing_since_ms.store(0, Ordering::Relaxed);
        } else if self.failing_since_ms.load(Ordering::Relaxed) == 0 {
            let now = strata_server::auth::now_ms().max(1);
            self.failing_since_ms.store(now, Ordering::Relaxed);
        }
        was != ok
    }

    /// How long it has failed its health checks in a row (None: its last one passed).
    pub fn failing_for(&self) -> Option<std::time::Duration> {
        match self.failing_since_ms.load(Ordering::Relaxed) {
            0 => None,
            t => Some(std::time::Duration::from_millis(
                strata_server::auth::now_ms().saturating_sub(t),
            )),
        }
    }

    pub fn load(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }
}

/// Decrements workers' in-flight counts when dropped (a response body done or dropped).
pub struct InFlight(Vec<Arc<Worker>>);

impl InFlight {
    /// Counts a request on each worker (in flight and in total) until the guard is dropped.
    pub fn start(workers: Vec<Arc<Worker>>) -> InFlight {
        for w in &workers {
            w.in_flight.fetch_add(1, Ordering::Relaxed);
            w.requests.fetch_add(1, Ordering::Relaxed);
        }
        InFlight(workers)
    }

    /// The answer failed after it started (its stream broke, stalled or ran past its bound):
    /// one failure on the worker that was answering (the first: the decode worker).
    pub fn failed(&self) {
        if let Some(w) = self.0.first() {
            w.failures.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        for w in &self.0 {
            w.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
