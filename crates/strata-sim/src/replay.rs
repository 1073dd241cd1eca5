//! Replays a trace through the real [`TieredCache`] (metadata-only: no bytes, copies inline)
//! with the engine's own request lifecycle, one request at a time: a [`strata_kv::Lease`]
//! (match, lock, reserve prompt + output pages, L3 prefetch, load-back), then the commit of
//! the computed tokens (prompt and output: the engine caches generated tokens too).

use std::sync::Arc;
use std::time::Instant;

use strata_kv::memory::HeapAllocator;
use strata_kv::rng::{mix, SplitMix64};
use strata_kv::storage::{MemoryStorage, Storage};
use strata_kv::{
    CacheConfig, CacheStats, EvictionPolicy, PageLayout, PrefetchPolicy, TieredCache, WritePolicy,
};
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
    /// GDSF history keys per cached page ([`strata_kv::CacheConfig::gdsf_history`]).
    pub gdsf_history: usize,
    /// Generate each request's output tokens and cache them as the engine does (`false`:
    /// only prompts are cached, as if every request asked for one token).
    pub cache_outputs: bool,
    /// A layout with window kinds: each tier's window pages and the residency (None: one
    /// window page per page, as [`CacheConfig::new`] gives).
    pub windows: Option<SimWindows>,
}

/// Window pages per tier and the residency of a layout with window kinds (what `strata plan`
/// decides for the model).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimWindows {
    pub device_pages: u32,
    pub host_pages: u32,
    /// [`CacheConfig::window_checkpoint_pages`] (0: every page keeps its window state).
    pub checkpoint_pages: usize,
    /// Tokens a request computes per model call (`--max-batch-tokens`): the chunks a running
    /// request secures its window pages for.
    pub chunk_tokens: usize,
}

/// Outcome of one replay.
#[derive(Clone, Debug)]
pub struct SimResult {
    pub stats: CacheStats,
    pub requests: u64,
    /// Requests larger than the device tier (an engine refuses them; nothing is counted).
    pub refused: u64,
    /// Requests with an empty prompt (an engine refuses them too; nothing is counted).
    pub empty: u64,
    /// Admitted requests whose lease never became ready, alone with nothing in flight (a
    /// fault of the cache: released and counted, not waited on forever).
    pub stuck: u64,
    /// match + insert + evict calls (an evict counted when a request had to evict).
    pub ops: u64,
    pub cache_nanos: u64,
    /// Admissions (match, lock, reservation) that evicted nothing: their time and count.
    pub match_nanos: u64,
    pub match_calls: u64,
    /// Admissions whose reservation evicted: their time and count.
    pub evict_nanos: u64,
    pub evict_calls: u64,
    /// Tree metadata bytes at the end and the tokens it then held.
    pub metadata_bytes: u64,
    pub tree_tokens: u64,
    /// What `auto` learnt by the end (None under another policy).
    pub auto: Option<strata_kv::AutoLearning>,
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
    cc.gdsf_history = cfg.gdsf_history;
    if let Some(w) = cfg.windows {
        cc.device_window_pages = w.device_pages;
        cc.host_window_pages = w.host_pages;
        cc.window_checkpoint_pages = w.checkpoint_pages;
    }
    let storage =
        (l3 > 0).then(|| Arc::new(MemoryStorage::new(u64::MAX, l3 as u64)) as Arc<dyn Storage>);
    TieredCache::new(cc, &HeapAllocator, storage).map_err(|e| SimError::Cache(e.to_string()))
}

/// What the engine would generate after `prompt`: `n` tokens that depend only on the prompt
/// (a greedy model answers the same prompt the same way), drawn from the vocabulary (any
/// 32-bit value for `vocab == 0`, the identity mapping of block-granular replays).
pub fn output_tokens(prompt: &[u32], n: usize, vocab: u32) -> Vec<u32> {
    let mut seed = 0x5EED_0000_0F0F_u64;
    for &t in prompt {
        seed = mix(seed ^ t as u64);
    }
    let mut rng = SplitMix64::new(seed);
    let range = if vocab == 0 { 1 << 32 } else { vocab as u64 };
    (0..n).map(|_| (rng.next_u64() % range) as u32).collect()
}

/// One request through the engine's lifecycle: a lease (admitted without its prefix when only
/// its own locked prefix keeps it out, as the engine does on an idle engine), advanced until
/// ready, committed with its computed tokens.
fn replay_one(
    cache: &mut TieredCache,
    cfg: &SimConfig,
    q: &TraceRequest,
    mut tokens: Vec<u32>,
    r: &mut SimResult,
) {
    let prompt_len = tokens.len();
    let new = if cfg.cache_outputs {
        q.output_length.max(1)
    } else {
        1
    };
    if new > 1 {
        tokens.extend(output_tokens(&tokens, new - 1, cfg.vocab));
    }
    let evicted_before = cache.stats().evicted_device_nodes;
    let t0 = Instant::now();
    let prompt = &tokens[..prompt_len];
    let wait = PrefetchPolicy::WaitComplete;
    let lease = cache
        .admit(prompt, new, true, wait)
        .or_else(|| cache.admit(prompt, new, false, wait));
    let Some(mut lease) = lease else {
        r.refused += 1;
        return;
    };
    if let Some(k) = q.session {
        cache.set_session(&mut lease, k);
    }
    let t1 = Instant::now();
    // A lease alone in the cache needs only its copies landed (prefetched, loading back,
    // ready); one still not ready with nothing in flight after every phase never will be,
    // and is counted (`stuck`) rather than waited on forever.
    let mut idle = 0;
    while !cache.advance(&mut lease) {
        if cache.poll() > 0 || cache.in_flight() > 0 {
            idle = 0;
        } else if idle == 3 {
            cache.release(lease);
            r.stuck += 1;
            return;
        } else {
            idle += 1;
        }
    }
    // Every prompt token and every output token but the last (whose K/V a further step
    // would compute) are computed.
    let computed = prompt_len + new - 1;
    // Computed in chunks, as the engine's scheduler does, each securing its window pages.
    let chunk = cfg.windows.map_or(usize::MAX, |w| w.chunk_tokens.max(1));
    let mut pos = lease.start();
    while pos < computed {
        pos = cache.secure_windows(&mut lease, pos, pos.saturating_add(chunk).min(computed));
    }
    cache.commit(lease, &tokens, computed);
    let t2 = Instant::now();
    r.cache_nanos += (t2 - t0).as_nanos() as u64;
    r.ops += 2;
    if cache.stats().evicted_device_nodes > evicted_before {
        r.ops += 1;
        r.evict_calls += 1;
        r.evict_nanos += (t1 - t0).as_nanos() as u64;
    } else {
        r.match_calls += 1;
        r.match_nanos += (t1 - t0).as_nanos() as u64;
    }
    r.requests += 1;
}

/// Replays `reqs`; `progress` is called every 256 requests with the count done.
pub fn replay(
    reqs: &[TraceRequest],
    cfg: &SimConfig,
    mut progress: impl FnMut(usize),
) -> Result<SimResult, SimError> {
    let mut cache = build_cache(cfg)?;
    let mut r = SimResult {
        stats: CacheStats::default(),
        requests: 0,
        refused: 0,
        empty: 0,
        stuck: 0,
        ops: 0,
        cache_nanos: 0,
        match_nanos: 0,
        match_calls: 0,
        evict_nanos: 0,
        evict_calls: 0,
        metadata_bytes: 0,
        tree_tokens: 0,
        auto: None,
    };
    for (i, q) in reqs.iter().enumerate() {
        if (i + 1) % 256 == 0 {
            progress(i + 1);
        }
        let tokens = request_tokens(&q.hash_ids, q.input_length, cfg.block_tokens, cfg.vocab);
        if tokens.is_empty() {
            r.empty += 1; // the engine refuses an empty prompt
            continue;
        }
        replay_one(&mut cache, cfg, q, tokens, &mut r);
    }
    cache.check().map_err(SimError::Cache)?;
    r.stats = *cache.stats();
    let (bytes, tokens) = cache.tree_footprint();
    r.metadata_bytes = bytes as u64;
    r.tree_tokens = tokens.max(1) as u64;
    r.auto = cache.auto_learning();
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
            gdsf_history: strata_kv::DEFAULT_GDSF_HISTORY,
            cache_outputs: false,
            windows: None,
        }
    }

    fn req(ids: &[u64], len: usize) -> TraceRequest {
        TraceRequest {
            timestamp_ms: 0,
            input_length: len,
            output_length: 1,
            hash_ids: ids.to_vec(),
            session: None,
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
        // One request's prompt and its first output token: 5 pages of 4.
        let mut c = cfg(20);
        c.host_tokens = 32;
        c.storage_tokens = 1000;
        let r = replay(&reqs, &c, |_| {}).unwrap();
        assert!(r.stats.hit_host_tokens > 0, "{:?}", r.stats);
        assert!(r.stats.hit_storage_tokens > 0, "{:?}", r.stats);
        assert!(r.stats.balanced());
        assert_eq!(r.refused, 0);
        // A device tier smaller than one request refuses it, as the engine would.
        let r = replay(&reqs, &cfg(16), |_| {}).unwrap();
        assert_eq!((r.refused, r.requests), (6, 0));
    }

    #[test]
    fn empty_prompts_are_counted_apart_not_a_panic() {
        let reqs = vec![req(&[], 0), req(&[1, 2], 16)];
        let r = replay(&reqs, &cfg(100), |_| {}).unwrap();
        assert_eq!((r.empty, r.refused, r.requests), (1, 0, 1));
    }

    /// A page-aligned prompt cached in full, whose prompt and output fill the device tier:
    /// its locked prefix plus its reservation exceed the tier, so (as the engine does when
    /// idle) it is admitted without the prefix instead of never.
    #[test]
    fn a_request_its_own_prefix_keeps_out_is_admitted_without_it() {
        let mut q = req(&[1, 2], 16);
        q.output_length = 4;
        let mut c = cfg(20);
        c.cache_outputs = true;
        let r = replay(&[q.clone(), q], &c, |_| {}).unwrap();
        assert_eq!((r.refused, r.requests), (0, 2));
        assert_eq!(r.stats.hit_device_tokens, 0, "admitted without its prefix");
    }
}
