//! A miss-ratio curve from the live page stream: what the hit ratio would be at other cache
//! sizes, in constant memory (SHARDS: Waldspurger et al., "Efficient MRC Construction with
//! SHARDS", FAST '15).
//!
//! A page is *sampled* when a keyed hash of its page hash falls under a threshold (spatial
//! sampling: a sampled page is sampled at every reference, so its reuse distances are whole).
//! For each sampled reference the sampler counts the distinct sampled pages referenced since
//! that page's previous reference (its LRU stack distance among sampled pages, a Fenwick tree
//! over time slots) and records it scaled by 1 / rate: an estimate of the distance among all
//! pages. An LRU cache of `C` pages hits exactly the references whose distance is under `C`,
//! so the recorded distances give the LRU hit ratio at every size at once.
//!
//! Memory is fixed: at most `max_tracked` sampled pages are tracked; one more lowers the
//! threshold to the largest tracked hash and drops that page (fixed-size SHARDS), so a larger
//! working set lowers the rate, never the memory. Each recorded reference weighs 1 / rate at
//! the time it was seen, so references before and after a lowering count as the pages they
//! stand for. The sampling key is this process's secret: a client that knows its prompts'
//! page hashes still cannot tell which pages are sampled, nor make a chosen page sampled.

use std::collections::BinaryHeap;

pub mod mini;

use rustc_hash::FxHashMap;

use crate::hash::PageHash;

/// Sub-buckets per power of two of the distance histogram (relative bucket width ≤ 1/32).
const SUB: usize = 32;
/// Octaves of the histogram: distances up to 2^48 pages.
const OCTAVES: usize = 48;

/// The sampler and its curve.
pub struct Shards {
    key: [u8; 32],
    /// A page is sampled when its sampling hash is below this (rate = threshold / 2^64).
    threshold: u64,
    max_tracked: usize,
    /// Tracked pages: the time slot of their last reference and their sampling hash.
    tracked: FxHashMap<PageHash, (u32, u64)>,
    /// Bytes of `tracked`'s table, as made (its capacity reads lower while it holds
    /// tombstones; its buckets do not change).
    table_bytes: usize,
    /// Tracked pages by sampling hash, largest first: who leaves when over the budget.
    by_hash: BinaryHeap<(u64, PageHash)>,
    /// Fenwick tree over time slots: 1 at the slot of each tracked page's last reference.
    fenwick: Vec<u32>,
    /// The next time slot.
    now: usize,
    /// Weights of recorded reuse distances, log-linear buckets (see [`bucket`]).
    hist: Vec<f64>,
    /// Weight of first references (no previous one: a miss at every size).
    cold: f64,
    /// Every reference, sampled or not.
    seen: u64,
    /// Pages of prompt no size serves ([`Shards::add_misses`]).
    misses: f64,
    /// The last sampled references' sampling hashes (a ring of fixed size: the window the
    /// miniature simulations replay, [`Shards::recent`]).
    recent: Vec<u64>,
    /// Sampled references recorded in `recent` (the next goes at this modulo its length).
    recorded: u64,
}

impl Shards {
    /// A sampler tracking at most `max_tracked` pages, sampling at `rate` (0 < rate ≤ 1) until
    /// the budget lowers it, with sampling key `key`.
    pub fn new(max_tracked: usize, rate: f64, key: [u8; 32]) -> Shards {
        let max_tracked = max_tracked.max(1);
        let rate = if rate.is_finite() {
            rate.clamp(0.0, 1.0)
        } else {
            1.0
        };
        let tracked =
            FxHashMap::with_capacity_and_hasher(2 * (max_tracked + 1), Default::default());
        // hashbrown keeps 8 buckets for every 7 usable, a control byte each.
        let entry = std::mem::size_of::<(PageHash, (u32, u64))>() + 1;
        let table_bytes = tracked.capacity() * 8 / 7 * entry;
        Shards {
            key,
            table_bytes,
            threshold: (rate * u64::MAX as f64) as u64,
            max_tracked,
            // Twice what it ever holds: tombstones of removed pages are then cleared by
            // rehashing in place, never by growing the table.
            tracked,
            by_hash: BinaryHeap::with_capacity(max_tracked + 1),
            fenwick: vec![0; 2 * max_tracked + 1],
            now: 0,
            hist: vec![0.0; OCTAVES * SUB],
            cold: 0.0,
            seen: 0,
            misses: 0.0,
            recent: vec![0; 2 * max_tracked],
            recorded: 0,
        }
    }

    /// The same with a random sampling key (what a worker uses).
    pub fn with_random_key(max_tracked: usize, rate: f64) -> Result<Shards, getrandom::Error> {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key)?;
        Ok(Shards::new(max_tracked, rate, key))
    }

    /// The sampling rate now (it only falls).
    pub fn rate(&self) -> f64 {
        self.threshold as f64 / u64::MAX as f64
    }

    /// Pages tracked now (at most the budget).
    pub fn tracked(&self) -> usize {
        self.tracked.len()
    }

    /// References the recorded ones stand for (each sampled one weighs 1 / rate).
    pub fn sampled_weight(&self) -> f64 {
        self.cold + self.hist.iter().sum::<f64>()
    }

    /// Every reference seen, sampled or not.
    pub fn references(&self) -> u64 {
        self.seen
    }

    /// Bytes the sampler holds: its tables are sized for the budget when it is made and never
    /// grow past it.
    pub fn memory_bytes(&self) -> usize {
        let heap = std::mem::size_of::<(u64, PageHash)>();
        self.table_bytes
            + self.by_hash.capacity() * heap
            + self.fenwick.len() * 4
            + self.hist.len() * 8
            + self.recent.len() * 8
    }

    /// The recent window of sampled references (at most twice the tracked budget), oldest
    /// first, as sampling hashes (one per page; the low bit set where the reference counts,
    /// clear for [`Shards::touch`]), only those of pages sampled at today's rate; and whether
    /// older sampled references have left it (false: it holds every one).
    pub fn recent(&self) -> (Vec<u64>, bool) {
        let n = self.recent.len() as u64;
        let start = self.recorded.saturating_sub(n);
        let v = (start..self.recorded)
            .map(|i| self.recent[(i % n) as usize])
            .filter(|&s| s & !1 < self.threshold)
            .collect();
        (v, start > 0)
    }

    /// The curve's denominator: references, and pages of prompt no size serves.
    pub fn denominator(&self) -> f64 {
        self.seen as f64 + self.misses
    }

    /// The share of the curve's denominator that whole prompt pages are (the rest:
    /// [`Shards::add_misses`]); miniature simulations over pages scale their ratios by it.
    pub fn page_share(&self) -> f64 {
        let total = self.seen as f64 + self.misses;
        if total > 0.0 {
            self.seen as f64 / total
        } else {
            1.0
        }
    }

    /// Sampled references recorded so far (the window moved when this did).
    pub fn recorded(&self) -> u64 {
        self.recorded
    }

    /// One reference to page `h`: a hit or a miss of the curve.
    pub fn access(&mut self, h: &PageHash) {
        self.reference(h, true);
    }

    /// Page `h` entered the cache without being asked for (a request's generated tokens,
    /// cached when it ends): it becomes the most recent, and counts as neither hit nor miss.
    pub fn touch(&mut self, h: &PageHash) {
        self.reference(h, false);
    }

    /// `pages` of prompt that no cache size serves (the part of a page a prompt ends in, its
    /// last token's page): counted in the ratio's denominator only, so that hit ratios are of
    /// prompt tokens, as the cache's own hit rate is. Non-finite or negative: ignored.
    pub fn add_misses(&mut self, pages: f64) {
        if pages.is_finite() && pages > 0.0 {
            self.misses += pages;
        }
    }

    fn reference(&mut self, h: &PageHash, counted: bool) {
        self.seen += counted as u64;
        let s = self.sample_hash(h);
        if s >= self.threshold {
            return;
        }
        let weight = 1.0 / self.rate().max(f64::MIN_POSITIVE);
        let n = self.recent.len() as u64;
        // The low bit says whether the reference counts (the sampling hash keeps the rest).
        self.recent[(self.recorded % n) as usize] = (s & !1) | counted as u64;
        self.recorded += 1;
        match self.tracked.remove(h) {
            Some((slot, _)) => {
                if counted {
                    let since = self.prefix(self.now) - self.prefix(slot as usize + 1);
                    let b = bucket(since as f64 / self.rate());
                    self.hist[b] += weight;
                }
                self.add(slot as usize, -1);
            }
            None => {
                if counted {
                    self.cold += weight;
                }
                self.by_hash.push((s, *h));
            }
        }
        if self.now + 1 >= self.fenwick.len() {
            self.compact();
        }
        let slot = self.now;
        self.now += 1;
        self.add(slot, 1);
        self.tracked.insert(*h, (slot as u32, s));
        while self.tracked.len() > self.max_tracked {
            let (top, page) = self.by_hash.pop().expect("a tracked page is in the heap");
            self.threshold = top;
            if let Some((slot, _)) = self.tracked.remove(&page) {
                self.add(slot as usize, -1);
            }
        }
    }

    /// The LRU hit ratio of a cache of `pages` pages over the references seen (0 before any).
    ///
    /// SHARDS' adjustment: the references seen minus the weight sampled are counted as
    /// distance-0 hits. Sampling misses mostly the few hottest pages (a page is in or out
    /// whole), whose references are the shortest reuses: without it the curve sags at small
    /// sizes.
    pub fn hit_ratio(&self, pages: f64) -> f64 {
        self.hit_ratios(&[pages])[0]
    }

    /// [`Shards::hit_ratio`] at each of `sizes`, in one pass over the histogram.
    pub fn hit_ratios(&self, sizes: &[f64]) -> Vec<f64> {
        let total = self.seen as f64;
        let denominator = total + self.misses;
        // Weight of the buckets before each bucket.
        let mut before = Vec::with_capacity(self.hist.len());
        let mut acc = 0.0;
        for &w in &self.hist {
            before.push(acc);
            acc += w;
        }
        let adj = total - self.sampled_weight();
        sizes
            .iter()
            .map(|&pages| {
                if total <= 0.0 || pages.is_nan() || pages < 1.0 {
                    return 0.0;
                }
                // Past the last bucket: every recorded distance.
                let under = if pages >= bucket_range(self.hist.len() - 1).1 {
                    acc
                } else {
                    let i = bucket(pages);
                    let (lo, hi) = bucket_range(i);
                    before[i] + self.hist[i] * ((pages - lo) / (hi - lo)).clamp(0.0, 1.0)
                };
                ((adj + under) / denominator).clamp(0.0, 1.0)
            })
            .collect()
    }

    fn sample_hash(&self, h: &PageHash) -> u64 {
        let out = blake3::keyed_hash(&self.key, &h.0);
        u64::from_le_bytes(out.as_bytes()[..8].try_into().expect("8 bytes"))
    }

    /// Renumbers the tracked pages' slots 0.. in their order and rebuilds the tree.
    fn compact(&mut self) {
        let mut order: Vec<(u32, PageHash)> = self
            .tracked
            .iter()
            .map(|(h, &(slot, _))| (slot, *h))
            .collect();
        order.sort_unstable();
        self.fenwick.iter_mut().for_each(|x| *x = 0);
        for (i, (_, h)) in order.iter().enumerate() {
            if let Some(e) = self.tracked.get_mut(h) {
                e.0 = i as u32;
            }
            self.add(i, 1);
        }
        self.now = order.len();
    }

    fn add(&mut self, slot: usize, delta: i32) {
        let mut i = slot + 1;
        while i < self.fenwick.len() {
            self.fenwick[i] = self.fenwick[i].wrapping_add_signed(delta);
            i += i & i.wrapping_neg();
        }
    }

    /// Marks in slots `0..n`.
    fn prefix(&self, n: usize) -> u32 {
        let (mut i, mut s) = (n.min(self.fenwick.len() - 1), 0u32);
        while i > 0 {
            s = s.wrapping_add(self.fenwick[i]);
            i -= i & i.wrapping_neg();
        }
        s
    }
}

/// The bucket of distance `d` (pages): one per page under [`SUB`], then [`SUB`] per octave.
fn bucket(d: f64) -> usize {
    if d.is_nan() || d < 0.0 {
        return 0;
    }
    if d < SUB as f64 {
        return d as usize;
    }
    // ≥ log2(SUB); capped so a huge (or infinite) distance lands in the last bucket.
    let octave = (d.log2().floor() as usize).min(OCTAVES + SUB.trailing_zeros() as usize);
    let base = (1u64 << octave.min(62)) as f64;
    let sub = (((d - base) / base) * SUB as f64) as usize;
    let i = (octave + 1 - SUB.trailing_zeros() as usize) * SUB + sub.min(SUB - 1);
    i.min(OCTAVES * SUB - 1)
}

/// The distances bucket `i` holds: [lo, hi).
fn bucket_range(i: usize) -> (f64, f64) {
    if i < SUB {
        return (i as f64, i as f64 + 1.0);
    }
    let octave = i / SUB - 1 + SUB.trailing_zeros() as usize;
    let base = (1u64 << octave.min(62)) as f64;
    let step = base / SUB as f64;
    let lo = base + (i % SUB) as f64 * step;
    (lo, lo + step)
}

#[cfg(test)]
mod tests;
