//! Write and eviction policies.

use rustc_hash::FxHashMap;

/// When device pages are copied to the host tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WritePolicy {
    /// Back up every inserted node at once.
    WriteThrough,
    /// Back up a node once its hit count reaches the threshold.
    WriteThroughSelective { threshold: u32 },
    /// Copy to host only when the node is evicted from the device.
    WriteBack,
}

impl WritePolicy {
    /// Parses `write_through`, `write_through_selective[:N]` (default N = 2) or `write_back`.
    pub fn parse(s: &str) -> Option<WritePolicy> {
        match s {
            "write_through" => Some(WritePolicy::WriteThrough),
            "write_back" => Some(WritePolicy::WriteBack),
            "write_through_selective" => Some(WritePolicy::WriteThroughSelective { threshold: 2 }),
            _ => {
                let n = s.strip_prefix("write_through_selective:")?.parse().ok()?;
                Some(WritePolicy::WriteThroughSelective { threshold: n })
            }
        }
    }
}

/// How long admission waits for pages being prefetched from L3 into the host tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefetchPolicy {
    /// Do not wait: compute what has not arrived (the prefetch still lands for later requests).
    BestEffort,
    /// Wait until the prefetch completes.
    WaitComplete,
    /// Wait at most this long per prefetched token, then compute the rest.
    Timeout { per_token: std::time::Duration },
}

/// Which evictable leaf goes first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// Least recently used leaf.
    Lru,
    /// Greedy-Dual-Size-Frequency over equal-size pages: priority = L + frequency, where L rises
    /// to each victim's priority (so idle entries age out) and the frequency of an evicted page is
    /// remembered in a bounded history, so a prefix that keeps coming back is recognised even
    /// after it was pushed out. Beats LRU when reuse distances exceed the cache.
    Gdsf,
}

impl EvictionPolicy {
    pub fn parse(s: &str) -> Option<EvictionPolicy> {
        match s {
            "lru" => Some(EvictionPolicy::Lru),
            "gdsf" => Some(EvictionPolicy::Gdsf),
            _ => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::Gdsf => "gdsf",
        }
    }
}

/// Access counts of pages no longer cached, keyed by page hash. Bounded: past `cap` entries the
/// least counted are dropped; every `cap` records all counts halve, so old popularity fades.
#[derive(Debug, Default)]
pub struct FrequencyHistory {
    counts: FxHashMap<u64, u32>,
    cap: usize,
    since_aging: usize,
}

impl FrequencyHistory {
    pub fn new(cap: usize) -> FrequencyHistory {
        FrequencyHistory {
            counts: FxHashMap::default(),
            cap: cap.max(16),
            since_aging: 0,
        }
    }

    pub fn record(&mut self, key: u64, count: u32) {
        let e = self.counts.entry(key).or_insert(0);
        *e = (*e).max(count);
        self.since_aging += 1;
        if self.since_aging >= self.cap {
            self.since_aging = 0;
            self.counts.retain(|_, v| {
                *v /= 2;
                *v > 0
            });
        }
        if self.counts.len() > self.cap {
            // Keep the most counted three quarters (amortised O(1): runs once per cap/4 records).
            let keep = self.cap * 3 / 4;
            let mut v: Vec<u32> = self.counts.values().copied().collect();
            let idx = v.len() - keep;
            let (_, &mut floor, _) = v.select_nth_unstable(idx);
            let mut surplus = self.counts.len() - keep;
            self.counts.retain(|_, c| {
                if surplus > 0 && *c <= floor {
                    surplus -= 1;
                    false
                } else {
                    true
                }
            });
        }
    }

    /// Takes the remembered count of `key` (0 when unknown).
    pub fn take(&mut self, key: u64) -> u32 {
        self.counts.remove(&key).unwrap_or(0)
    }

    pub fn len(&self) -> usize {
        self.counts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_policies() {
        assert_eq!(
            WritePolicy::parse("write_back"),
            Some(WritePolicy::WriteBack)
        );
        assert_eq!(
            WritePolicy::parse("write_through_selective:3"),
            Some(WritePolicy::WriteThroughSelective { threshold: 3 })
        );
        assert_eq!(WritePolicy::parse("write_sideways"), None);
        assert_eq!(EvictionPolicy::parse("gdsf"), Some(EvictionPolicy::Gdsf));
        assert_eq!(EvictionPolicy::parse("mru"), None);
    }

    #[test]
    fn history_is_bounded_and_ages() {
        let mut h = FrequencyHistory::new(16);
        for k in 0..100u64 {
            h.record(k, if k < 8 { 100 } else { 1 });
        }
        assert!(h.len() <= 16);
        // Frequent pages survive trimming and aging; one-off pages are forgotten first.
        for k in 0..8 {
            assert!(h.take(k) > 0, "frequent page {k} forgotten");
        }
        assert!((8..100).filter(|&k| h.take(k) > 0).count() <= 8);
    }
}
