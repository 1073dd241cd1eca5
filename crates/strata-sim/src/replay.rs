//! Replays a trace through the real [`TieredCache`] (metadata-only: no bytes, copies inline),
//! per request: match → load-back of the host part → L3 prefetch → allocate (evicting to
//! capacity) → insert.

use std::sync::Arc;
use std::time::Instant;

use strata_kv::memory::HeapAllocator;
use strata_kv::storage::{MemoryStorage, Storage};
use strata_kv::{CacheConfig, CacheStats, EvictionPolicy, PageLayout, TieredCache, WritePolicy};
use thiserror::Error;

use crate::tokens::request_tokens;
use crate::trace::TraceRequest;

/// A simulation that cannot run as configured.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SimError {
    #[error("{tier} capacity of {tokens} tokens is smaller than one page ({page_size} tokens)")]
    TooSmall {
        tier: &'static str,
        tokens: u64,
        page_size: usize,
    },
    #[error("page size {page_size} must divide the trace block size {block}")]
    PageSize { page_size: usize, block: usize },
    #[error("{0}")]
    Cache(String),
}

/// Capacities in tokens; host and storage may be 0 (tier off).
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub layout: PageLayout,
    pub block_tokens: usize,
    pub vocab: u32,
    pub device_tokens: u64,
    pub host_tokens: u64,
    pub storage_tokens: u64,
    pub write_policy: WritePolicy,
    pub eviction: EvictionPolicy,
}

/// Outcome of one replay.
#[derive(Clone, Debug)]
pub struct SimResult {
    pub stats: CacheStats,
    pub requests: u64,
    /// match + insert + evict calls (an evict counted when a request had to evict).
    pub ops: u64,
    pub cache_nanos: u64,
    pub match_nanos: u64,
    pub match_calls: u64,
    pub evict_nanos: u64,
    pub evict_calls: u64,
    /// Tree metadata bytes at the end and the tokens it then held.
    pub metadata_bytes: u64,
    pub tree_tokens: u64,
}

impl SimResult {
    pub fn ops_per_sec(&self) -> f64 {
        self.ops as f64 * 1e9 / self.cache_nanos.max(1) as f64
    }

    pub fn requests_per_sec(&self) -> f64 {
        self.requests as f64 * 1e9 / self.cache_nanos.max(1) as f64
    }
}

fn pages(tier: &'static str, tokens: u64, ps: usize, optional: bool) -> Result<u32, SimError> {
    if optional && tokens == 0 {
        return Ok(0);
    }
    let p = tokens / ps as u64;
    if p == 0 {
        return Err(SimError::TooSmall {
            tier,
            tokens,
            page_size: ps,
        });
    }
    Ok(p.min(u32::MAX as u64) as u32)
}

/// Pages must tile trace blocks exactly, so page identities follow block ids.
pub fn check_page_size(cfg: &SimConfig) -> Result<(), SimError> {
    let ps = cfg.layout.page_size();
    if !cfg.block_tokens.is_multiple_of(ps) {
        return Err(SimError::PageSize {
            page_size: ps,
            block: cfg.block_tokens,
        });
    }
    Ok(())
}

/// Checks capacities and builds the metadata-only cache.
pub fn build_cache(cfg: &SimConfig) -> Result<TieredCache, SimError> {
    check_page_size(cfg)?;
    let ps = cfg.layout.page_size();
    let dev = pages("device", cfg.device_tokens, ps, false)?;
    let host = pages("host", cfg.host_tokens, ps, true)?;
    let l3 = pages("storage", cfg.storage_tokens, ps, true)?;
    let mut cc = CacheConfig::new(cfg.layout.clone(), dev, host);
    cc.with_data = false;
    cc.model_id = "sim".into();
    cc.write_policy = cfg.write_policy;
    cc.eviction = cfg.eviction;
    let storage =
        (l3 > 0).then(|| Arc::new(MemoryStorage::new(u64::MAX, l3 as u64)) as Arc<dyn Storage>);
    TieredCache::new(cc, &HeapAllocator, storage).map_err(|e| SimError::Cache(e.to_string()))
}

/// Replays `reqs`; `progress` is called every 256 requests with the count done.
pub fn replay(
    reqs: &[TraceRequest],
    cfg: &SimConfig,
    mut progress: impl FnMut(usize),
) -> Result<SimResult, SimError> {
    let mut cache = build_cache(cfg)?;
    let ps = cfg.layout.page_size();
    let mut r = SimResult {
        stats: CacheStats::default(),
        requests: 0,
        ops: 0,
        cache_nanos: 0,
        match_nanos: 0,
        match_calls: 0,
        evict_nanos: 0,
        evict_calls: 0,
        metadata_bytes: 0,
        tree_tokens: 0,
    };
    for (i, q) in reqs.iter().enumerate() {
        let tokens = request_tokens(&q.hash_ids, q.input_length, cfg.block_tokens, cfg.vocab);
        let t0 = Instant::now();
        let m = cache.match_prefix(&tokens);
        let t1 = Instant::now();
        cache.lock(m.last);
        cache.load_back(&m);
        cache.prefetch(&tokens, &m);
        let skip = (m.device_tokens + m.host_tokens) / ps;
        let total = tokens.len() / ps;
        let evicted_before = cache.stats().evicted_device_nodes;
        let t2 = Instant::now();
        let pages = match cache.alloc_device(total - skip) {
            Some(p) => p,
            None => {
                // Longer than the device tier can hold: cache the prefix that fits.
                let k = cache.device_usage().pages_free() as usize;
                cache.alloc_device(k).expect("free pages")
            }
        };
        let t3 = Instant::now();
        let upto = (skip + pages.len()) * ps;
        cache.insert(&tokens[..upto], &pages, skip);
        cache.unlock(m.last);
        let t4 = Instant::now();
        r.match_nanos += (t1 - t0).as_nanos() as u64;
        r.match_calls += 1;
        r.cache_nanos += (t4 - t0).as_nanos() as u64;
        r.ops += 2;
        if cache.stats().evicted_device_nodes > evicted_before {
            r.ops += 1;
            r.evict_calls += 1;
            r.evict_nanos += (t3 - t2).as_nanos() as u64;
        }
        r.requests += 1;
        if (i + 1) % 256 == 0 {
            progress(i + 1);
        }
    }
    cache.check().map_err(SimError::Cache)?;
    r.stats = *cache.stats();
    r.metadata_bytes = cache.tree().metadata_bytes() as u64;
    r.tree_tokens = ((cache
        .tree()
        .node_ids()
        .iter()
        .map(|&n| cache.tree().view(n).tokens.len())
        .sum::<usize>()) as u64)
        .max(1);
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_kv::PoolKind;

    fn cfg(dev: u64) -> SimConfig {
        SimConfig {
            layout: PageLayout::new(4, vec![PoolKind::kv("kv", 1, 1, 4, 2)]).unwrap(),
            block_tokens: 8,
            vocab: 1000,
            device_tokens: dev,
            host_tokens: 0,
            storage_tokens: 0,
            write_policy: WritePolicy::WriteThrough,
            eviction: EvictionPolicy::Lru,
        }
    }

    fn req(ids: &[u64], len: usize) -> TraceRequest {
        TraceRequest {
            timestamp_ms: 0,
            input_length: len,
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn repeated_prefix_hits_and_stats_balance() {
        let reqs = vec![req(&[1, 2], 16), req(&[1, 2, 3], 20), req(&[1, 9], 12)];
        let r = replay(&reqs, &cfg(1000), |_| {}).unwrap();
        assert_eq!(r.stats.queried_tokens, 48);
        assert_eq!(r.stats.hit_device_tokens, 16 + 8);
        assert!(r.stats.balanced());
    }

    #[test]
    fn impossible_capacities_are_refused() {
        let e = build_cache(&cfg(3)).err().unwrap();
        assert_eq!(
            e.to_string(),
            "device capacity of 3 tokens is smaller than one page (4 tokens)"
        );
        let e = build_cache(&cfg(0)).err().unwrap();
        assert!(e.to_string().starts_with("device capacity of 0 tokens"));
        let mut c = cfg(100);
        c.host_tokens = 2;
        assert!(build_cache(&c)
            .err()
            .unwrap()
            .to_string()
            .starts_with("host capacity of 2 tokens"));
        let mut c = cfg(100);
        c.block_tokens = 6;
        assert!(matches!(build_cache(&c), Err(SimError::PageSize { .. })));
    }

    #[test]
    fn host_and_storage_tiers_serve_what_the_device_dropped() {
        let reqs = vec![
            req(&[1, 2], 16),
            req(&[3, 4], 16),
            req(&[1, 2], 16),
            req(&[5, 6], 16),
            req(&[7, 8], 16),
            req(&[3, 4], 16),
        ];
        let mut c = cfg(16);
        c.host_tokens = 32;
        c.storage_tokens = 1000;
        let r = replay(&reqs, &c, |_| {}).unwrap();
        assert!(r.stats.hit_host_tokens > 0, "{:?}", r.stats);
        assert!(r.stats.hit_storage_tokens > 0, "{:?}", r.stats);
        assert!(r.stats.balanced());
    }
}
