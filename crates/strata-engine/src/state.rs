//! State shared between the handles and the scheduler thread: counters, the cache event log,
//! the latest [`Snapshot`] and the liveness signals.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use strata_kv::stats::{CacheStats, PoolUsage, TierUsage};
use strata_kv::storage::StorageStats;
use strata_kv::CacheEvent;

/// Requests ended, by outcome.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Finished {
    pub stop: u64,
    pub length: u64,
    pub cancelled: u64,
    pub aborted: u64,
    pub error: u64,
    /// Waited longer than `max_queue_time` for admission.
    pub queue_timeout: u64,
}

/// The engine's state for metrics and tests, refreshed after every step.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub cache: CacheStats,
    pub storage: Option<StorageStats>,
    pub device: TierUsage,
    pub host: TierUsage,
    /// Window pages of the device and host tiers (all zero without window kinds).
    pub device_window: TierUsage,
    pub host_window: TierUsage,
    pub pools: Vec<PoolUsage>,
    /// The cache's live miss-ratio curve (None: it keeps none).
    pub curve: Option<strata_kv::cache::curve::Curve>,
    /// What the `auto` eviction policy has learnt (None under another policy).
    pub auto: Option<strata_kv::AutoLearning>,
    /// Device pages held by requests (not in the tree): their own pages.
    pub device_pages_held: u64,
    pub waiting: usize,
    /// Requests admitted and not finished (including those waiting for load-back/prefetch).
    pub running: usize,
    pub tokens_in_flight: usize,
    /// Cache copies (load-backs, backups, L3 reads and writes) not yet landed.
    pub copies_in_flight: usize,
    pub steps: u64,
    /// Prompt tokens of admitted requests, and how each was served: from a cache tier,
    /// computed, or transferred (`cached_* + computed + transferred == prompt`, always).
    pub prompt_tokens: u64,
    pub cached_device_tokens: u64,
    pub cached_host_tokens: u64,
    pub cached_storage_tokens: u64,
    pub computed_prompt_tokens: u64,
    /// Prompt tokens whose K/V arrived from a prefill worker.
    pub transferred_prompt_tokens: u64,
    /// Prompt tokens of PD requests whose K/V this worker's cache held, so that a prefill
    /// worker sent only the rest (also counted in `cached_*`).
    pub pd_held_prompt_tokens: u64,
    /// PD requests this worker computed itself: its cache held all of the prompt but at most
    /// the request's local threshold (no prefill worker, no transfer).
    pub pd_local_prefills: u64,
    /// Pages a prefill worker exported while their prompt was still being computed (sent to
    /// the decode worker during the prefill, not after it).
    pub pd_overlapped_pages: u64,
    pub generated_tokens: u64,
    /// Generated positions computed again as prompt rows before their answer was cached
    /// (`CacheOutputs::Exact`).
    pub settled_tokens: u64,
    pub finished: Finished,
}

/// Cache events with sequence numbers, kept in a bounded log for routers to poll.
pub struct EventLog {
    /// Differs on every start: a router that sees a new epoch resynchronises.
    pub epoch: u64,
    /// Sequence number of the oldest event still held.
    pub first: u64,
    /// Sequence number the next event will get.
    pub next: u64,
    items: std::collections::VecDeque<CacheEvent>,
    cap: usize,
}

impl EventLog {
    pub(crate) fn new(cap: usize) -> EventLog {
        let epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
            ^ ((std::process::id() as u64) << 40);
        EventLog {
            epoch,
            first: 0,
            next: 0,
            items: std::collections::VecDeque::new(),
            cap,
        }
    }

    pub(crate) fn push(&mut self, e: CacheEvent) {
        self.items.push_back(e);
        self.next += 1;
        while self.items.len() > self.cap {
            self.items.pop_front();
            self.first += 1;
        }
    }

    /// Events from `since` on (at most `max`); None when `since` is older than the log holds
    /// (a gap: resynchronise from a snapshot).
    pub fn since(&self, since: u64, max: usize) -> Option<Vec<(u64, CacheEvent)>> {
        if since < self.first || since > self.next {
            return None;
        }
        let skip = (since - self.first) as usize;
        Some(
            self.items
                .iter()
                .skip(skip)
                .take(max)
                .enumerate()
                .map(|(i, e)| (since + i as u64, e.clone()))
                .collect(),
        )
    }
}

/// What the handles and the scheduler thread share: admission counters, the event log, the
/// latest snapshot, the heartbeat and the engine's end.
pub(crate) struct Shared {
    pub events: Mutex<EventLog>,
    pub waiting: AtomicUsize,
    pub tokens_in_flight: AtomicUsize,
    pub closing: AtomicBool,
    pub next_id: AtomicU64,
    pub snapshot: Mutex<Snapshot>,
    /// Milliseconds since `epoch` at the scheduler's latest pass round its loop.
    pub beat_ms: AtomicU64,
    pub epoch: Instant,
    /// Set when the scheduler thread ended other than by shutdown: why.
    pub dead: Mutex<Option<String>>,
    /// Set when the scheduler thread has ended (unwound, if it panicked).
    pub ended: AtomicBool,
}

impl Shared {
    pub(crate) fn beat(&self) {
        self.beat_ms
            .store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}
