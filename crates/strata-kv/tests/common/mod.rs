//! What the cache's property tests share: the small two-kind cache they run on, the write
//! policies they draw from, and the final check that nothing leaked.

use std::sync::Arc;

use proptest::prelude::*;
use strata_kv::memory::HeapAllocator;
use strata_kv::storage::{MemoryStorage, Storage};
use strata_kv::{
    CacheConfig, EvictionPolicy, Lease, PageLayout, PoolKind, TieredCache, WritePolicy,
};

/// A main KV kind and an indexer-like kind, so that pages have several chunks of two shapes.
pub fn layout(ps: usize) -> PageLayout {
    PageLayout::new(
        ps,
        vec![PoolKind::kv("kv", 2, 1, 4, 2), PoolKind::aux("idx", 1, 3)],
    )
    .unwrap()
}

/// [`layout`] plus a window kind read only for the last `window` tokens before a
/// continuation (a sliding window's raw K/V).
#[allow(dead_code)] // not every test file uses every helper
pub fn window_layout(ps: usize, window: usize) -> PageLayout {
    PageLayout::new(
        ps,
        vec![
            PoolKind::kv("kv", 2, 1, 4, 2),
            PoolKind::aux("raw", 2, 5).with_window(window),
            PoolKind::aux("idx", 1, 3),
        ],
    )
    .unwrap()
}

/// A cache with data, hashing, two copy threads, and optionally an in-memory L3 of
/// `l3_pages`.
#[allow(dead_code)]
pub fn cache(
    layout: PageLayout,
    sizes: (u32, u32),
    wp: WritePolicy,
    ev: EvictionPolicy,
    l3_pages: Option<u64>,
) -> TieredCache {
    cache_with_windows(layout, sizes, None, wp, ev, l3_pages)
}

/// [`cache`] with `windows` (device, host) window pages instead of one per page.
pub fn cache_with_windows(
    layout: PageLayout,
    (device, host): (u32, u32),
    windows: Option<(u32, u32, usize)>,
    wp: WritePolicy,
    ev: EvictionPolicy,
    l3_pages: Option<u64>,
) -> TieredCache {
    let mut cfg = CacheConfig::new(layout, device, host);
    if let Some((d, h, checkpoints)) = windows {
        cfg.device_window_pages = d;
        cfg.host_window_pages = h;
        cfg.window_checkpoint_pages = checkpoints;
    }
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

/// Advances `lease` through its phases (prefetched, loading back, ready), each once its
/// copies landed. False when it still is not ready: the pages it needs are held by other
/// leases (a lease alone in the cache needs nothing else).
#[allow(dead_code)] // not every test file uses every helper
pub fn ready_once_copies_land(cache: &mut TieredCache, lease: &mut Lease) -> bool {
    for _ in 0..3 {
        if cache.advance(lease) {
            return true;
        }
        cache.wait_all();
    }
    cache.advance(lease)
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
    let (dw, hw) = cache.window_usage();
    assert_eq!(
        (dw.pages_used, hw.pages_used),
        (0, 0),
        "window pages leaked"
    );
    assert_eq!(cache.tree().node_count(), 1, "nodes left");
    cache.check().unwrap();
}

/// Token sequences that share prefixes by group (`s % groups`) for their first `shared` tokens,
/// so that nodes split and share; the rest is the sequence's own. Odd sequences have some
/// tokens past 2^16 in their own part, and every fourth from the third some past 2^24 (nodes
/// stored in three or four bytes a token, splits into narrower and wider halves).
pub fn tokens(s: u8, len: u8, groups: u8, shared: u32) -> Vec<u32> {
    let g = (s % groups) as u32;
    (0..len as u32)
        .map(|i| {
            if i < shared {
                g * 100 + i
            } else if s % 2 == 1 && i % 5 == 0 {
                // Stored in three bytes a token.
                100_000 + s as u32 * 100 + i
            } else if s % 4 == 2 && i % 7 == 3 {
                // Stored in four.
                20_000_000 + s as u32 * 100 + i
            } else {
                10_000 + s as u32 * 100 + i
            }
        })
        .collect()
}
