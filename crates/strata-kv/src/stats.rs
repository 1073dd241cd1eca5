//! Counters every cache operation updates; the server turns them into metrics.

/// Upper bounds (seconds) of the duration histogram of copies between tiers.
pub const COPY_BUCKETS: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// Events counted between reports, reported at most once per period (a log line that whoever
/// causes the events cannot make flood the log).
#[derive(Debug)]
pub struct Throttled {
    every: std::time::Duration,
    since: u64,
    last: Option<std::time::Instant>,
}

impl Throttled {
    pub fn new(every: std::time::Duration) -> Throttled {
        Throttled {
            every,
            since: 0,
            last: None,
        }
    }

    /// Counts `n` more at `now`: Some(the count since the last report) when one is due.
    pub fn add(&mut self, n: u64, now: std::time::Instant) -> Option<u64> {
        self.since += n;
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < self.every)
        {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.since))
    }
}

/// Count, pages, bytes and time of one kind of transfer, with a duration histogram.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Transfer {
    pub ops: u64,
    pub pages: u64,
    pub bytes: u64,
    pub nanos: u64,
    /// Operations per [`COPY_BUCKETS`] bucket (not cumulative; longer ones only in `ops`).
    pub buckets: [u64; 12],
}

impl Transfer {
    pub fn add(&mut self, pages: u64, bytes: u64, nanos: u64) {
        self.ops += 1;
        self.pages += pages;
        self.bytes += bytes;
        self.nanos += nanos;
        let s = nanos as f64 / 1e9;
        if let Some(i) = COPY_BUCKETS.iter().position(|&b| s <= b) {
            self.buckets[i] += 1;
        }
    }

    /// Bytes per second over the time spent (0 when none).
    pub fn bandwidth(&self) -> f64 {
        if self.nanos == 0 {
            0.0
        } else {
            self.bytes as f64 * 1e9 / self.nanos as f64
        }
    }
}

/// Cumulative cache counters. `hit_device + hit_host + hit_storage + miss == queried`, always.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub queries: u64,
    pub queried_tokens: u64,
    pub hit_device_tokens: u64,
    pub hit_host_tokens: u64,
    pub hit_storage_tokens: u64,
    pub miss_tokens: u64,
    pub inserted_tokens: u64,
    pub evicted_device_tokens: u64,
    pub evicted_host_tokens: u64,
    pub evicted_device_nodes: u64,
    pub evicted_host_nodes: u64,
    /// Window pages dropped from each tier (their nodes keep their main pages).
    pub evicted_device_window_pages: u64,
    pub evicted_host_window_pages: u64,
    /// Matched tokens given up because the window state before their end was gone (the hit
    /// backs off to the deepest boundary it can continue from); counted as misses.
    pub window_cut_tokens: u64,
    /// Hits of a layout with window kinds, by where they resume: where the match ended (a
    /// committed sequence's end, or a checkpoint the query stopped at), or backed off to an
    /// earlier boundary that kept its window state (a checkpoint; the rest is recomputed).
    pub window_hits_as_matched: u64,
    pub window_hits_backed_off: u64,
    pub load_back: Transfer,
    pub backup: Transfer,
    pub storage_get: Transfer,
    pub storage_put: Transfer,
    /// Pages not backed up because the host tier was full of pages still on device.
    pub backup_skipped_pages: u64,
    /// Host-matched tokens not loaded back because the device tier had no room.
    pub load_back_skipped_tokens: u64,
    /// Storage-matched pages that turned out missing or corrupt at read time.
    pub storage_read_misses: u64,
    pub storage_errors: u64,
    /// Leaves retired because their session's next request did not continue them (evicted
    /// first; `cache/session.rs`), and their tokens.
    pub session_retired_nodes: u64,
    pub session_retired_tokens: u64,
}

impl CacheStats {
    /// Hit tokens over all tiers.
    pub fn hit_tokens(&self) -> u64 {
        self.hit_device_tokens + self.hit_host_tokens + self.hit_storage_tokens
    }

    /// Fraction of queried tokens served from any tier.
    pub fn hit_rate(&self) -> f64 {
        if self.queried_tokens == 0 {
            0.0
        } else {
            self.hit_tokens() as f64 / self.queried_tokens as f64
        }
    }

    /// `hits + miss == queried`.
    pub fn balanced(&self) -> bool {
        self.hit_tokens() + self.miss_tokens == self.queried_tokens
    }
}

/// What `auto` has learnt (`tree/auto.rs`), for metrics and `strata sim`: the credit a leaf new
/// to the cache starts with, and the evidence it came from. Pages counted at the tree's page
/// size since the cache was made; a removal is the policy's (flushes and retired answers are
/// not counted); a new leaf that begins where a removed node of a class began, while the
/// ghosts remember it (about one cache of removals), counts its pages as *returned* to that
/// class: all of them, so a class may return more pages than it lost.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AutoLearning {
    /// In accesses: between 0.25 and 1 (1 is GDSF's order).
    pub newcomer_credit: f64,
    /// Pages removed on probation (never hit), and how many came back.
    pub probation_removed_pages: u64,
    pub probation_returned_pages: u64,
    /// Pages removed after earning an access, and how many came back.
    pub used_removed_pages: u64,
    pub used_returned_pages: u64,
}

/// Pages used and free in one tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierUsage {
    pub pages_total: u64,
    pub pages_used: u64,
    /// Bytes per page over all pool kinds (the layout's size, also in metadata-only mode).
    pub page_bytes: u64,
}

/// Bytes one pool kind uses in one tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolUsage {
    pub tier: &'static str,
    pub kind: String,
    /// Tokens the kind's pages hold in that tier (window pages for a window kind).
    pub tokens_total: u64,
    pub bytes_total: u64,
    pub bytes_used: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttled_reports_at_once_then_at_most_once_a_period_with_the_count() {
        let t0 = std::time::Instant::now();
        let s = std::time::Duration::from_secs;
        let mut t = Throttled::new(s(60));
        assert_eq!(t.add(2, t0), Some(2));
        assert_eq!(t.add(3, t0 + s(10)), None);
        assert_eq!(t.add(4, t0 + s(59)), None);
        assert_eq!(t.add(1, t0 + s(60)), Some(8));
    }
}
