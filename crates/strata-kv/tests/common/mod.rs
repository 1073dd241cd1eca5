//! What the cache's property tests share: the small two-kind cache they run on, the write
//! policies they draw from, and the final check that nothing leaked.

use std::sync::Arc;

use proptest::prelude::*;
use strata_kv::memory::HeapAllocator;
use strata_kv::storage::{MemoryStorage, Storage};
use strata_kv::{CacheConfig, EvictionPolicy, PageLayout, PoolKind, TieredCache, WritePolicy};

/// A main KV kind and an indexer-like kind, so that pages have several chunks of two shapes.
pub fn layout(ps: usize) -> PageLayout {
    PageLayout::new(
        ps,
        vec![PoolKind::kv("kv", 2, 1, 4, 2), PoolKind::aux("idx", 1, 3)],
    )
    .unwrap()
}

/// A cache with data, hashing, two copy threads, and optionally an in-memory L3 of
/// `l3_pages`.
pub fn cache(
    layout: PageLayout,
    (device, host): (u32, u32),
    wp: WritePolicy,
    ev: EvictionPolicy,
    l3_pages: Option<u64>,
) -> TieredCache {
    let mut cfg = CacheConfig::new(layout, device, host);
    cfg.write_policy = wp;
    cfg.eviction = ev;
    cfg.hashing = true;
    cfg.copy_threads = 2;
    let storage: Option<Arc<dyn Storage>> =
        l3_pages.map(|n| Arc::new(MemoryStorage::new(u64::MAX, n)) as Arc<dyn Storage>);
    TieredCache::new(cfg, &HeapAllocator, storage).unwrap()
}

pub fn write_policy() -> impl Strategy<Value = WritePolicy> {
    prop_oneof![
        Just(WritePolicy::WriteThrough),
        Just(WritePolicy::WriteBack),
        (1u32..3).prop_map(|threshold| WritePolicy::WriteThroughSelective { threshold }),
    ]
}

/// With nothing held any more everything is evictable: evicts it all and fails unless every
/// page came back and only the root is left (no page or lock leaked).
pub fn assert_all_evictable(cache: &mut TieredCache) {
    while cache.evict_device(usize::MAX / 2) > 0 {
        cache.wait_all();
    }
    cache.evict_host(usize::MAX / 2);
    assert_eq!(cache.device_usage().pages_used, 0, "device pages leaked");
    assert_eq!(cache.host_usage().pages_used, 0, "host pages leaked");
    assert_eq!(cache.tree().node_count(), 1, "nodes left");
    cache.check().unwrap();
}

/// Token sequences that share prefixes by group (`s % groups`) for their first `shared` tokens,
/// so that nodes split and share; the rest is the sequence's own.
pub fn tokens(s: u8, len: u8, groups: u8, shared: u32) -> Vec<u32> {
    let g = (s % groups) as u32;
    (0..len as u32)
        .map(|i| {
            if i < shared {
                g * 100 + i
            } else {
                10_000 + s as u32 * 100 + i
            }
        })
        .collect()
}
