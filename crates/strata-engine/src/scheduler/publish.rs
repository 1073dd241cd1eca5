//! The scheduler's snapshot: what `/metrics`, `/health` and the router read, published after
//! every step; and what it tells of each request it serves (the curve, the trace).

use std::sync::atomic::Ordering;

use strata_kv::TieredCache;

use super::{Req, Scheduler};
use crate::config::EngineConfig;

/// A request the worker serves, once: into the cache's miss-ratio curve and the recorded
/// trace (when there is one).
pub(super) fn observe(cache: &mut TieredCache, cfg: &EngineConfig, r: &Req) {
    let prompt = &r.tokens[..r.prompt_len];
    cache.observe(prompt);
    if let Some(t) = &cfg.record_trace {
        let mut t = t.lock().unwrap_or_else(|p| p.into_inner());
        t.record(prompt, r.params.max_tokens, r.arrived);
    }
}

impl Scheduler {
    /// Copies the cache's statistics, usage, events and curve and the queue's counts into the
    /// shared snapshot.
    pub(super) fn publish(&mut self) {
        let events = self.cache.take_events();
        if !events.is_empty() {
            let mut log = self.shared.events.lock().expect("event log lock");
            for e in events {
                log.push(e);
            }
        }
        let s = &mut self.snap;
        s.cache = *self.cache.stats();
        let bad = |x: &strata_kv::storage::StorageStats| x.corrupt + x.other_layout;
        let (failed_before, dropped_before) = s.storage.map_or((0, 0), |x| (x.errors, bad(&x)));
        s.storage = self.cache.storage().map(|st| st.stats());
        let (failed, dropped) = s.storage.map_or((0, 0), |x| {
            (
                x.errors.saturating_sub(failed_before),
                bad(&x).saturating_sub(dropped_before),
            )
        });
        s.device = self.cache.device_usage();
        s.host = self.cache.host_usage();
        (s.device_window, s.host_window) = self.cache.window_usage();
        s.pools = self.cache.pool_usage();
        s.auto = self.cache.auto_learning();
        if self.cache.curve_tick() != s.curve.as_ref().map(|c| c.version) {
            s.curve = self.cache.curve();
        }
        s.device_pages_held = self
            .active
            .iter()
            .map(|r| r.lease().own_pages() as u64)
            .sum();
        s.waiting = self.shared.waiting.load(Ordering::SeqCst);
        s.running = self.active.len();
        s.tokens_in_flight = self.shared.tokens_in_flight.load(Ordering::SeqCst);
        s.copies_in_flight = self.cache.in_flight();
        *self.shared.snapshot.lock().expect("snapshot lock") = s.clone();
        if failed > 0 {
            self.l3_failing(failed);
        }
        if dropped > 0 {
            self.l3_dropping(dropped);
        }
        if self.cache.probe_thread_ended() && !self.said_probe_ended {
            self.said_probe_ended = true;
            tracing::error!("the thread that asks L3 which pages it holds has ended (the tier panicked): requests are admitted without L3 pages until this worker restarts");
        }
    }

    /// L3 pages read back that did not verify (corrupt, truncated, forged, another layout's):
    /// each was a miss, recomputed, and removed from the tier; said in the log at most once a
    /// minute (`strata_l3_errors_total{kind="corrupt"|"other_layout"}` counts each), since a
    /// tier that holds damaged pages is something to look at.
    fn l3_dropping(&mut self, dropped: u64) {
        let Some(pages) = self.l3_dropped.add(dropped, std::time::Instant::now()) else {
            return;
        };
        let tier = self.cache.storage().map_or("l3", |st| st.tier());
        tracing::warn!(
            tier,
            pages,
            "L3 pages that did not verify (corrupt, foreign or of another layout) were dropped and recomputed; see strata_l3_errors_total by kind"
        );
    }

    /// L3 operations failed since the last snapshot: said in the log (at most once a minute;
    /// `strata_l3_errors_total` counts each), so that a tier that stopped working is not only a
    /// counter.
    fn l3_failing(&mut self, failed: u64) {
        let Some(failed) = self.l3_failures.add(failed, std::time::Instant::now()) else {
            return;
        };
        let tier = self.cache.storage().map_or("l3", |st| st.tier());
        tracing::warn!(
            tier,
            failed,
            "L3 operations are failing (reads are misses, writes are lost); see strata_l3_errors_total by kind"
        );
    }
}
