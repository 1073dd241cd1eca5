//! Cache-aware routing: the worker holding the most of the prompt's prefix, weighted by the
//! tier each page is in, minus a load term; least load when the prompt cannot be read.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use strata_kv::PageHash;

use super::{candidates, LeastLoad, LoadBalancingPolicy};
use crate::cache_index::{CacheIndex, DEVICE_WEIGHT, HOST_WEIGHT, LOAD_TOKENS, REMOTE_WEIGHT};
use crate::worker::Worker;

/// Decisions of the cache-aware policy (cumulative).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheAwareStats {
    /// Decisions that found a cached prefix / found none.
    pub hits: u64,
    pub misses: u64,
    /// Cached pages on the chosen worker at decision time, by tier.
    pub hit_pages_device: u64,
    pub hit_pages_host: u64,
    pub hit_pages_remote: u64,
    /// PD decisions that sent the request to a decode worker holding some of its prompt.
    pub decode_hits: u64,
}

/// Scores every healthy worker of the pool on the prompt's cached pages (from the index the
/// workers' cache events feed).
pub struct CacheAware {
    index: Arc<CacheIndex>,
    /// Where the scan starts (ties go to the first worker scanned), in the pool a request's
    /// cache reads from and in the decode pool under PD.
    start: AtomicUsize,
    decode_start: AtomicUsize,
    hits: AtomicU64,
    misses: AtomicU64,
    /// Device, host, remote.
    hit_pages: [AtomicU64; 3],
    decode_hits: AtomicU64,
}

impl CacheAware {
    pub fn new(index: Arc<CacheIndex>) -> CacheAware {
        CacheAware {
            index,
            start: AtomicUsize::new(0),
            decode_start: AtomicUsize::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            hit_pages: Default::default(),
            decode_hits: AtomicU64::new(0),
        }
    }

    /// The candidate with the most weighted cached prefix of `hashes` minus load, and its
    /// cached pages by tier; None when no worker is healthy.
    fn best(
        &self,
        pool: &[Arc<Worker>],
        hashes: &[PageHash],
        avoid: Option<&Arc<Worker>>,
        start: &AtomicUsize,
    ) -> Option<(usize, [usize; 3])> {
        let ps = self.index.page_size() as f64;
        let up = candidates(pool, avoid);
        if up.is_empty() {
            return None;
        }
        let start = start.fetch_add(1, Ordering::Relaxed);
        // (score, worker, pages by tier)
        let mut best: Option<(f64, usize, [usize; 3])> = None;
        for k in 0..up.len() {
            let i = up[(start + k) % up.len()];
            let (dev, host, rem) = self.index.cached_prefix(pool[i].slot, hashes);
            let score = (dev as f64 * DEVICE_WEIGHT
                + host as f64 * HOST_WEIGHT
                + rem as f64 * REMOTE_WEIGHT)
                * ps
                - LOAD_TOKENS * pool[i].load() as f64;
            if best.is_none_or(|b| score > b.0) {
                best = Some((score, i, [dev, host, rem]));
            }
        }
        best.map(|(_, i, pages)| (i, pages))
    }

    /// The chained page hashes of a request's prompt; None when it cannot be read.
    fn prompt_hashes(&self, body: &[u8]) -> Option<Vec<PageHash>> {
        Some(self.index.hashes(&self.index.prompt_tokens(body)?))
    }

    /// Most weighted cached prefix of `hashes` minus load (counted as a hit or a miss); None
    /// when no worker is healthy.
    fn pick_cached(
        &self,
        pool: &[Arc<Worker>],
        hashes: &[PageHash],
        avoid: Option<&Arc<Worker>>,
    ) -> Option<Arc<Worker>> {
        let (i, pages) = self.best(pool, hashes, avoid, &self.start)?;
        if pages.iter().sum::<usize>() > 0 {
            self.hits.fetch_add(1, Ordering::Relaxed);
            for (counter, n) in self.hit_pages.iter().zip(pages) {
                counter.fetch_add(n as u64, Ordering::Relaxed);
            }
        } else {
            self.misses.fetch_add(1, Ordering::Relaxed);
        }
        Some(pool[i].clone())
    }

    /// The decode worker holding the most of `hashes` (its own device and host tiers: the
    /// shared L3 is the prefill worker's to read) minus load: a conversation's next turn goes
    /// back to the decode worker that holds it, which then asks only for the new pages.
    fn pick_holding(
        &self,
        pool: &[Arc<Worker>],
        hashes: &[PageHash],
        avoid: Option<&Arc<Worker>>,
    ) -> Option<Arc<Worker>> {
        let (i, [dev, host, _]) = self.best(pool, hashes, avoid, &self.decode_start)?;
        if dev + host > 0 {
            self.decode_hits.fetch_add(1, Ordering::Relaxed);
        }
        Some(pool[i].clone())
    }
}

impl LoadBalancingPolicy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn reads_prompt(&self) -> bool {
        true
    }

    fn pick(
        &self,
        pool: &[Arc<Worker>],
        prompt: Option<&[u8]>,
        avoid: Option<&Arc<Worker>>,
    ) -> Option<Arc<Worker>> {
        prompt
            .and_then(|body| self.pick_cached(pool, &self.prompt_hashes(body)?, avoid))
            .or_else(|| LeastLoad.pick(pool, None, avoid))
    }

    /// The prefill worker by its cache (L3 included) and the decode worker holding the most
    /// of the prompt, from one reading of it (least load where it cannot be read).
    fn pick_pd(
        &self,
        prefill: &[Arc<Worker>],
        decode: &[Arc<Worker>],
        prompt: Option<&[u8]>,
        (avoid_p, avoid_d): (Option<&Arc<Worker>>, Option<&Arc<Worker>>),
    ) -> Option<(Arc<Worker>, Arc<Worker>)> {
        let hashes = prompt.and_then(|body| self.prompt_hashes(body));
        let p = hashes
            .as_ref()
            .and_then(|h| self.pick_cached(prefill, h, avoid_p))
            .or_else(|| LeastLoad.pick(prefill, None, avoid_p))?;
        let d = hashes
            .as_ref()
            .and_then(|h| self.pick_holding(decode, h, avoid_d))
            .or_else(|| LeastLoad.pick(decode, None, avoid_d))?;
        Some((p, d))
    }

    fn cache_stats(&self) -> Option<CacheAwareStats> {
        let [d, h, r] = &self.hit_pages;
        Some(CacheAwareStats {
            decode_hits: self.decode_hits.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            hit_pages_device: d.load(Ordering::Relaxed),
            hit_pages_host: h.load(Ordering::Relaxed),
            hit_pages_remote: r.load(Ordering::Relaxed),
        })
    }
}
