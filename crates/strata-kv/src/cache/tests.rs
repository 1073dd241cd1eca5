use std::sync::Arc;

use super::*;
use crate::layout::PoolKind;
use crate::storage::{DiskStorage, MemoryStorage};
use crate::testing::{verify_tree_bytes, write_expected_page};

/// Test fixture: a "model" whose K/V bytes for a page are a function of the page's identity, so
/// any page read back anywhere can be checked.
struct Fx {
    cache: TieredCache,
    ns: HashNamespace,
}

fn layout() -> PageLayout {
    PageLayout::new(
        4,
        vec![
            PoolKind::kv("kv", 2, 1, 8, 2),
            PoolKind::aux("indexer", 2, 4),
        ],
    )
    .unwrap()
}

impl Fx {
    fn new(dev: u32, host: u32, wp: WritePolicy, storage: Option<Arc<dyn Storage>>) -> Fx {
        let mut cfg = CacheConfig::new(layout(), dev, host);
        cfg.write_policy = wp;
        cfg.hashing = true;
        cfg.model_id = "fx".into();
        let ns = HashNamespace::new("fx", &cfg.layout);
        Fx {
            cache: TieredCache::new(cfg, &HeapAllocator, storage).unwrap(),
            ns,
        }
    }

    /// Computes `tokens` beyond the cached device prefix: writes K/V, inserts. Returns the match.
    fn run(&mut self, tokens: &[u32]) -> CacheMatch {
        let m = self.cache.match_prefix(tokens);
        self.cache.lock(m.last);
        if let Some(t) = self.cache.prefetch(tokens, &m) {
            self.cache.wait(t);
        }
        let m2 = self.cache.tree.match_prefix(tokens);
        let mm = CacheMatch {
            path: m2.path.clone(),
            last: m2.last,
            ..CacheMatch::default()
        };
        self.cache.lock(m2.last);
        if let Some(t) = self.cache.load_back(&mm) {
            self.cache.wait(t);
        }
        let ps = self.cache.page_size();
        let have = m2.tokens() / ps;
        let total = tokens.len() / ps;
        let pages = self.cache.alloc_device(total - have).expect("room");
        let hashes = self.ns.chain(PageHash::ROOT, &tokens[..total * ps], ps);
        for (i, &p) in pages.iter().enumerate() {
            self.write_page(p, &hashes[have + i]);
        }
        let ins = self.cache.insert(tokens, &pages, have);
        self.cache.unlock(m2.last);
        self.cache.unlock(m.last);
        let _ = ins;
        self.cache.check().unwrap();
        m
    }

    fn write_page(&self, page: u32, h: &PageHash) {
        write_expected_page(self.cache.device_pool().unwrap(), page, h);
    }

    /// Every device and host page in the tree holds exactly the bytes its identity implies.
    fn verify_all_bytes(&self) {
        verify_tree_bytes(&self.cache);
    }
}

fn seq(base: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| base * 1000 + i).collect()
}

#[test]
fn write_through_backs_up_on_insert_with_exact_bytes() {
    let mut f = Fx::new(16, 32, WritePolicy::WriteThrough, None);
    f.run(&seq(1, 12));
    f.cache.wait_all();
    assert_eq!(f.cache.host_usage().pages_used, 3);
    assert_eq!(f.cache.stats().backup.pages, 3);
    f.verify_all_bytes();
}

#[test]
fn write_back_copies_only_on_eviction_then_loads_back_exactly() {
    let mut f = Fx::new(4, 8, WritePolicy::WriteBack, None);
    f.run(&seq(1, 16));
    assert_eq!(f.cache.host_usage().pages_used, 0);
    // A second prompt needs the whole device: the first is written back, then dropped.
    f.run(&seq(2, 16));
    f.cache.wait_all();
    assert_eq!(f.cache.stats().backup.pages, 4);
    f.verify_all_bytes();
    let m = f.cache.match_prefix(&seq(1, 16));
    assert_eq!((m.device_tokens, m.host_tokens), (0, 16));
    f.cache.lock(m.last);
    let t = f.cache.load_back(&m).expect("load-back starts");
    f.cache.wait(t);
    f.cache.unlock(m.last);
    f.verify_all_bytes();
    assert_eq!(f.cache.tree().peek(&seq(1, 16)), (16, 0));
    assert_eq!(f.cache.stats().load_back.pages, 4);
    f.cache.check().unwrap();
}

#[test]
fn selective_write_through_waits_for_the_hit_threshold() {
    let mut f = Fx::new(
        16,
        16,
        WritePolicy::WriteThroughSelective { threshold: 2 },
        None,
    );
    f.run(&seq(1, 8));
    f.cache.match_prefix(&seq(1, 8));
    f.cache.wait_all();
    assert_eq!(f.cache.host_usage().pages_used, 0);
    f.cache.match_prefix(&seq(1, 8));
    f.cache.wait_all();
    assert_eq!(f.cache.host_usage().pages_used, 2);
    f.verify_all_bytes();
}

#[test]
fn stats_balance_per_tier() {
    let mut f = Fx::new(4, 16, WritePolicy::WriteThrough, None);
    f.run(&seq(1, 16));
    f.run(&seq(2, 16));
    f.cache.wait_all();
    let m = f.run(&[seq(1, 16), vec![5, 5]].concat());
    assert_eq!(
        (m.device_tokens, m.host_tokens, m.queried_tokens),
        (0, 16, 18)
    );
    let s = f.cache.stats();
    assert!(s.balanced());
    assert_eq!(s.queried_tokens, 50);
    assert_eq!(s.hit_host_tokens, 16);
    assert_eq!(s.miss_tokens, 34);
}

#[test]
fn locked_prefix_survives_pressure_and_allocation_fails_cleanly() {
    let mut f = Fx::new(4, 4, WritePolicy::WriteThrough, None);
    f.run(&seq(1, 16));
    let m = f.cache.match_prefix(&seq(1, 16));
    f.cache.lock(m.last);
    assert!(f.cache.alloc_device(1).is_none());
    f.cache.check().unwrap();
    assert_eq!(f.cache.tree().peek(&seq(1, 16)), (16, 0));
    f.cache.unlock(m.last);
    assert!(f.cache.alloc_device(4).is_some());
}

#[test]
fn l3_roundtrip_through_disk_with_corruption_detected() {
    let dir = tempfile::tempdir().unwrap();
    let disk: Arc<dyn Storage> = Arc::new(DiskStorage::open(dir.path(), 1 << 30, false).unwrap());
    let mut f = Fx::new(4, 8, WritePolicy::WriteThrough, Some(disk.clone()));
    f.run(&seq(1, 16));
    f.cache.wait_all();
    assert_eq!(
        disk.stats().entries,
        4,
        "{:?} {:?}",
        disk.stats(),
        f.cache.stats()
    );
    // Push it out of device and host.
    f.run(&seq(2, 16));
    f.cache.wait_all();
    f.run(&seq(3, 16));
    f.cache.wait_all();
    f.run(&seq(4, 16));
    f.cache.wait_all();
    assert_eq!(f.cache.tree().peek(&seq(1, 16)), (0, 0));
    let m = f.cache.match_prefix(&seq(1, 16));
    assert_eq!(m.storage_tokens, 16);
    // Full path back: L3 → host → device, bytes exact.
    f.run(&seq(1, 16));
    f.cache.wait_all();
    f.verify_all_bytes();
    assert_eq!(f.cache.stats().storage_get.pages, 4);
    // Corrupt the third page of prompt 3 on disk, then evict prompt 3 from the tree.
    let hs = f.ns.chain(PageHash::ROOT, &seq(3, 16), 4);
    let p = dir
        .path()
        .join(&hs[2].to_hex()[..2])
        .join(format!("{}.page", hs[2].to_hex()));
    let mut b = std::fs::read(&p).unwrap();
    let last = b.len() - 1;
    b[last] ^= 0xff;
    std::fs::write(&p, b).unwrap();
    for i in 4..7 {
        f.run(&seq(i, 16));
        f.cache.wait_all();
    }
    assert_eq!(f.cache.tree().peek(&seq(3, 16)), (0, 0));
    let m = f.cache.match_prefix(&seq(3, 16));
    assert_eq!(m.storage_tokens, 16, "index still lists it");
    f.run(&seq(3, 16));
    f.cache.wait_all();
    // Only the two intact leading pages came from L3; the rest was recomputed.
    assert_eq!(f.cache.stats().storage_read_misses, 2);
    assert_eq!(disk.stats().corrupt, 1);
    f.verify_all_bytes();
}

#[test]
fn metadata_only_mode_runs_copies_inline() {
    let mut cfg = CacheConfig::new(layout(), 4, 8);
    cfg.with_data = false;
    cfg.write_policy = WritePolicy::WriteBack;
    let st: Arc<dyn Storage> = Arc::new(MemoryStorage::new(u64::MAX, 100));
    let mut c = TieredCache::new(cfg, &HeapAllocator, Some(st)).unwrap();
    let t = seq(1, 16);
    let p = c.alloc_device(4).unwrap();
    c.insert(&t, &p, 0);
    assert_eq!(c.evict_device(4), 4);
    assert_eq!(c.in_flight(), 0);
    assert_eq!(c.tree().peek(&t), (0, 16));
    c.check().unwrap();
}

#[test]
fn eviction_frees_only_what_is_needed_and_keeps_the_head() {
    let mut cfg = CacheConfig::new(layout(), 8, 0);
    cfg.with_data = false;
    cfg.write_policy = WritePolicy::WriteThroughSelective {
        threshold: u32::MAX,
    };
    let mut c = TieredCache::new(cfg, &HeapAllocator, None).unwrap();
    let t = seq(1, 16);
    let p = c.alloc_device(4).unwrap();
    c.insert(&t, &p, 0);
    assert_eq!(c.evict_device(1), 1);
    assert_eq!(c.tree().peek(&t), (12, 0));
    assert_eq!(c.stats().evicted_device_tokens, 4);
    c.check().unwrap();
}

#[test]
fn pool_usage_covers_every_kind_in_every_tier() {
    let mut f = Fx::new(16, 32, WritePolicy::WriteThrough, None);
    f.run(&seq(1, 12));
    f.cache.wait_all();
    let u = f.cache.pool_usage();
    assert_eq!(u.len(), 4);
    let kv_dev = u
        .iter()
        .find(|x| x.tier == "device" && x.kind == "kv")
        .unwrap();
    // 3 pages of 4 tokens × (2 layers × 2 planes × 16 bytes).
    assert_eq!(kv_dev.bytes_used, 3 * 4 * 64);
    let idx_host = u
        .iter()
        .find(|x| x.tier == "host" && x.kind == "indexer")
        .unwrap();
    assert_eq!(idx_host.bytes_used, 3 * 4 * 8);
    assert_eq!(idx_host.bytes_total, 32 * 4 * 8);
    let total: u64 = u
        .iter()
        .filter(|x| x.tier == "host")
        .map(|x| x.bytes_total)
        .sum();
    assert_eq!(total as usize, f.cache.host_pool().unwrap().bytes());
}

/// A node split while its write-through backup is in flight (a request matching part of it
/// before the copy lands) still reaches L3 in full: the split-off head is followed.
#[test]
fn a_node_split_during_its_backup_reaches_storage_in_full() {
    let st: Arc<dyn Storage> = Arc::new(MemoryStorage::new(u64::MAX, 100));
    let mut f = Fx::new(16, 16, WritePolicy::WriteThrough, Some(st.clone()));
    let t = seq(7, 24); // 6 pages of 4 tokens
    let pages = f.cache.alloc_device(6).unwrap();
    let hashes = f.ns.chain(PageHash::ROOT, &t, 4);
    for (p, h) in pages.iter().zip(&hashes) {
        f.write_page(*p, h);
    }
    f.cache.insert(&t, &pages, 0);
    // The backup is submitted, not yet acknowledged: split the node at 3 pages now.
    let m = f.cache.match_prefix(&t[..12]);
    assert_eq!(m.device_tokens, 12);
    f.cache.wait_all();
    assert_eq!(st.prefix_len(&hashes).unwrap(), 6, "{:?}", st.stats());
    // Both halves know they are stored, so eviction to nothing keeps them reachable.
    f.cache.evict_device(16);
    f.cache.wait_all();
    f.cache.evict_host(16);
    let m = f.cache.match_prefix(&t);
    assert_eq!(m.storage_tokens, 24);
    f.cache.check().unwrap();
}

/// Replaying the events gives exactly the pages per tier the cache holds (what a router's
/// index relies on), through inserts, backups, evictions, load-backs and L3 prefetches.
#[test]
fn events_replayed_equal_the_snapshot() {
    use crate::cache::Tier;
    use std::collections::HashSet;
    let st: Arc<dyn Storage> = Arc::new(MemoryStorage::new(u64::MAX, 100));
    let mut f = Fx::new(6, 6, WritePolicy::WriteThrough, Some(st));
    let mut index: [HashSet<PageHash>; 2] = Default::default();
    let slot = |t: Tier| match t {
        Tier::Device => 0,
        Tier::Host | Tier::Remote => 1,
    };
    for round in 0..3 {
        for i in 0..5u32 {
            f.run(&seq(i, 8 + 4 * (i as usize % 3)));
            f.cache.wait_all();
        }
        for e in f.cache.take_events() {
            for h in e.hashes {
                if e.stored {
                    index[slot(e.tier)].insert(h);
                } else {
                    index[slot(e.tier)].remove(&h);
                }
            }
        }
        for snap in f.cache.snapshot() {
            let want: HashSet<PageHash> = snap.hashes.into_iter().collect();
            assert_eq!(
                index[slot(snap.tier)],
                want,
                "round {round} tier {:?}",
                snap.tier
            );
        }
    }
}

/// Pools past 65,536 pages: the nodes' page lists take three bytes an index, and every index
/// comes back exactly through insertion, a split, and eviction to host.
#[test]
fn page_lists_of_pools_past_16_bits_round_trip() {
    let mut cfg = CacheConfig::new(layout(), 70_000, 140_000);
    cfg.with_data = false;
    cfg.write_policy = WritePolicy::WriteBack;
    let mut c = TieredCache::new(cfg, &HeapAllocator, None).unwrap();
    let mut given = Vec::new();
    for s in 0..100u32 {
        // 690 pages of 4 tokens each, every sequence its own branch.
        let t = seq(s * 10 + 1, 2_760);
        let p = c.alloc_device(690).unwrap();
        let last = c.insert(&t, &p, 0).last;
        assert!(c.tree().view(last).device == p[..]);
        given.push((t, p));
    }
    assert!(given.iter().any(|(_, p)| p.iter().any(|&x| x >= 65_536)));
    // A match ending inside a node splits it: both halves keep their indices.
    let (t, p) = &given[99];
    let m = c.match_prefix(&t[..1_000]);
    assert!(c.tree().view(m.last).device == p[..250]);
    c.check().unwrap();
    assert_eq!(c.evict_device(69_000), 69_000);
    c.check().unwrap();
    let mut host = Vec::new();
    for id in c.tree().node_ids() {
        let v = c.tree().view(id);
        assert!(v.device.is_empty() && v.host.len() == v.tokens.len() / 4);
        v.host.extend_into(&mut host);
    }
    host.sort_unstable();
    host.dedup();
    assert_eq!(host.len(), 69_000, "each host page held once");
}

/// An L3 whose `exists` waits while its gate is shut (at most 5 s, then a timeout): a Redis
/// that stalls.
struct Gated {
    inner: MemoryStorage,
    shut: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
    asked: std::sync::atomic::AtomicUsize,
}

impl Gated {
    fn set(&self, shut: bool) {
        *self.shut.lock().unwrap() = shut;
        self.cv.notify_all();
    }
    fn asked(&self) -> usize {
        self.asked.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Storage for Gated {
    fn tier(&self) -> &'static str {
        "remote"
    }
    fn exists(&self, hashes: &[PageHash]) -> Result<Vec<bool>, crate::storage::StorageError> {
        self.asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let wait = std::time::Duration::from_secs(5);
        let g = self.shut.lock().unwrap();
        let (g, t) = self.cv.wait_timeout_while(g, wait, |s| *s).unwrap();
        drop(g);
        if t.timed_out() {
            return Err(crate::storage::StorageError::Timeout(wait));
        }
        self.inner.exists(hashes)
    }
    fn get(&self, h: &PageHash) -> Result<Option<Vec<u8>>, crate::storage::StorageError> {
        self.inner.get(h)
    }
    fn put(&self, h: &PageHash, d: &[u8]) -> Result<(), crate::storage::StorageError> {
        self.inner.put(h, d)
    }
    fn delete(&self, h: &PageHash) -> Result<bool, crate::storage::StorageError> {
        self.inner.delete(h)
    }
    fn stats(&self) -> crate::storage::StorageStats {
        self.inner.stats()
    }
}

/// With a copy engine, L3 is asked which pages of a prompt it holds off the caller's thread:
/// while the tier stalls, `probe_ready` says "not yet" and a match counts no L3 pages (it does
/// not ask again on its own thread); the answer, once in, is what admission uses; past 64
/// questions out the tier counts as stalled and admissions go on without asking.
#[test]
fn l3_is_asked_off_the_callers_thread() {
    let st = Arc::new(Gated {
        inner: MemoryStorage::new(u64::MAX, 1000),
        shut: std::sync::Mutex::new(false),
        cv: std::sync::Condvar::new(),
        asked: Default::default(),
    });
    let mut f = Fx::new(4, 8, WritePolicy::WriteThrough, Some(st.clone()));
    for i in 1..5 {
        f.run(&seq(i, 16));
        f.cache.wait_all();
    }
    assert_eq!(f.cache.tree().peek(&seq(1, 16)), (0, 0));
    st.set(true);
    let before = st.asked();
    assert!(!f.cache.probe_ready(&seq(1, 16)), "the tier is shut");
    assert!(!f.cache.probe_ready(&seq(1, 16)), "asked once, not again");
    let m = f.cache.match_prefix(&seq(1, 16));
    assert_eq!(m.storage_tokens, 0, "no L3 pages while the question is out");
    assert_eq!(f.cache.probes_in_flight(), 1);
    st.set(false);
    let t = std::time::Instant::now();
    while f.cache.poll() == 0 {
        assert!(t.elapsed().as_secs() < 60, "no answer");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(f.cache.probe_ready(&seq(1, 16)));
    let m = f.cache.match_prefix(&seq(1, 16));
    assert_eq!(m.storage_tokens, 16, "the answer: every page in L3");
    assert_eq!(
        st.asked(),
        before + 1,
        "asked once, on the probe thread only"
    );
    // Stalled: 64 questions out, then admissions go on without asking.
    st.set(true);
    for i in 0..64 {
        assert!(!f.cache.probe_ready(&seq(100 + i, 16)));
    }
    assert!(
        f.cache.probe_ready(&seq(200, 16)),
        "a stalled tier is not waited on"
    );
    assert_eq!(f.cache.match_prefix(&seq(200, 16)).storage_tokens, 0);
    st.set(false);
    f.cache.wait_all();
}

/// An L3 whose `exists` panics: the probe thread ends, and admission goes on without L3 pages
/// (no request waits for an answer that cannot come).
#[test]
fn a_probe_thread_that_ends_leaves_no_request_waiting() {
    struct Panics(MemoryStorage);
    impl Storage for Panics {
        fn tier(&self) -> &'static str {
            "remote"
        }
        fn exists(&self, _: &[PageHash]) -> Result<Vec<bool>, crate::storage::StorageError> {
            panic!("a tier that panics (this test)")
        }
        fn get(&self, h: &PageHash) -> Result<Option<Vec<u8>>, crate::storage::StorageError> {
            self.0.get(h)
        }
        fn put(&self, h: &PageHash, d: &[u8]) -> Result<(), crate::storage::StorageError> {
            self.0.put(h, d)
        }
        fn delete(&self, h: &PageHash) -> Result<bool, crate::storage::StorageError> {
            self.0.delete(h)
        }
        fn stats(&self) -> crate::storage::StorageStats {
            self.0.stats()
        }
    }
    let st = Arc::new(Panics(MemoryStorage::new(u64::MAX, 1000)));
    let mut f = Fx::new(4, 8, WritePolicy::WriteThrough, Some(st));
    let t = std::time::Instant::now();
    while !f.cache.probe_ready(&seq(1, 16)) {
        assert!(t.elapsed().as_secs() < 60, "waits for ever");
        std::thread::sleep(std::time::Duration::from_millis(1));
        f.cache.poll();
    }
    assert_eq!(f.cache.match_prefix(&seq(1, 16)).storage_tokens, 0);
    assert!(f.cache.probe_ready(&seq(2, 16)));
}
