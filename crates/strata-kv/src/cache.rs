//! The tiered cache: radix tree + page allocators + byte pools + copy workers + L3 storage,
//! applying the write and eviction policies and keeping the statistics.
//!
//! Single-owner (the scheduler thread); copies run on worker threads and are acknowledged by
//! [`TieredCache::poll`] / [`TieredCache::wait`]. In metadata-only mode (the simulator) there are
//! no bytes and every copy completes inline, through the same code path.

use std::sync::Arc;

use rustc_hash::FxHashMap;
use thiserror::Error;

use crate::copy::{CopyEngine, Done, JobKind, Planes};
use crate::hash::{HashNamespace, PageHash};
use crate::layout::PageLayout;
use crate::memory::{HeapAllocator, HostAllocator, MemError};
use crate::pages::{PageAllocator, PageError};
use crate::policy::{EvictionPolicy, WritePolicy};
use crate::pool::{DevicePool, Direction, HostPool};
use crate::stats::{CacheStats, PoolUsage, TierUsage};
use crate::storage::Storage;
use crate::tree::{Inserted, NodeId, RadixTree, Slot};

/// How to build a [`TieredCache`].
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Part of the page-hash namespace.
    pub model_id: String,
    pub layout: PageLayout,
    pub device_pages: u32,
    pub host_pages: u32,
    pub write_policy: WritePolicy,
    pub eviction: EvictionPolicy,
    /// Compute stable page hashes even without storage or GDSF (e.g. for routing events).
    pub hashing: bool,
    /// Allocate real bytes. `false` gives the metadata-only cache the simulator uses.
    pub with_data: bool,
    pub copy_threads: usize,
}

impl CacheConfig {
    pub fn new(layout: PageLayout, device_pages: u32, host_pages: u32) -> CacheConfig {
        CacheConfig {
            model_id: "model".into(),
            layout,
            device_pages,
            host_pages,
            write_policy: WritePolicy::WriteThrough,
            eviction: EvictionPolicy::Lru,
            hashing: false,
            with_data: true,
            copy_threads: 1,
        }
    }
}

/// A tier of the cache, as cache events name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    Device,
    Host,
    /// A shared remote L3 (pages written there are reachable by every worker on it).
    Remote,
}

impl Tier {
    pub fn name(&self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Remote => "remote",
        }
    }
}

/// Pages that entered or left the device or host tier, or were written to a shared remote L3
/// (by their chained hashes): what a cache-aware router follows. Emitted only when the cache
/// computes hashes. Remote removals are not seen (Redis evicts on its own): remote events are
/// hints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheEvent {
    pub stored: bool,
    pub tier: Tier,
    pub hashes: Vec<PageHash>,
}

/// A cache that cannot be built or an operation that was refused.
#[derive(Debug, Error)]
pub enum CacheError {
    #[error("the device tier needs at least one page")]
    NoDevicePages,
    #[error(transparent)]
    Mem(#[from] MemError),
    #[error(transparent)]
    Page(#[from] PageError),
}

/// An in-flight copy; its pages are usable once [`TieredCache::wait`] returns or
/// [`TieredCache::is_done`] says so.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ticket(pub u64);

/// Where a prompt's cached prefix lives.
#[derive(Clone, Debug, Default)]
pub struct CacheMatch {
    pub queried_tokens: usize,
    pub device_tokens: usize,
    pub host_tokens: usize,
    /// Tokens after the tree match that L3 holds (consecutive pages).
    pub storage_tokens: usize,
    /// Matched tree nodes, root-most first.
    pub path: Vec<NodeId>,
    pub last: NodeId,
    /// Hashes of the L3-held pages.
    pub storage_hashes: Vec<PageHash>,
}

impl CacheMatch {
    pub fn cached_tokens(&self) -> usize {
        self.device_tokens + self.host_tokens + self.storage_tokens
    }
}

enum Pending {
    LoadBack {
        lock: NodeId,
        pages: u64,
    },
    Backup {
        lock: NodeId,
        nodes: Vec<NodeId>,
        evict_after: bool,
    },
    Put {
        nodes: Vec<NodeId>,
        /// Heads split off `nodes` while the put was in flight: their pages were written too,
        /// but they hold no host pin of their own.
        heads: Vec<NodeId>,
    },
    Prefetch {
        lock: NodeId,
        tokens: Vec<u32>,
        host_pages: Vec<u32>,
        skip: usize,
    },
}

/// The tiered prefix cache.
pub struct TieredCache {
    tree: RadixTree,
    layout: Arc<PageLayout>,
    write_policy: WritePolicy,
    device_alloc: PageAllocator,
    host_alloc: PageAllocator,
    planes: Planes,
    engine: Option<CopyEngine>,
    pending: FxHashMap<u64, Pending>,
    next_ticket: u64,
    /// Pages handed to callers and not yet inserted or freed.
    held_device: usize,
    held_host: usize,
    stats: CacheStats,
    events: Vec<CacheEvent>,
}

impl TieredCache {
    pub fn new(
        cfg: CacheConfig,
        host_alloc: &dyn HostAllocator,
        storage: Option<Arc<dyn Storage>>,
    ) -> Result<TieredCache, CacheError> {
        if cfg.device_pages == 0 {
            return Err(CacheError::NoDevicePages);
        }
        let layout = Arc::new(cfg.layout);
        let hashing = cfg.hashing || storage.is_some();
        let ns = hashing.then(|| HashNamespace::new(&cfg.model_id, &layout));
        let mut tree = RadixTree::new(layout.page_size(), cfg.eviction, ns);
        tree.set_history_cap(64 * (cfg.device_pages as usize + cfg.host_pages as usize));
        let (device, host) = if cfg.with_data {
            let d = DevicePool::new(layout.clone(), cfg.device_pages, &HeapAllocator)?;
            let h = HostPool::new(layout.clone(), cfg.host_pages, host_alloc)?;
            (Some(Arc::new(d)), Some(Arc::new(h)))
        } else {
            (None, None)
        };
        let planes = Planes {
            device,
            host,
            storage,
        };
        let engine = cfg
            .with_data
            .then(|| CopyEngine::start(planes.clone(), cfg.copy_threads));
        Ok(TieredCache {
            tree,
            layout,
            write_policy: cfg.write_policy,
            device_alloc: PageAllocator::new(cfg.device_pages),
            host_alloc: PageAllocator::new(cfg.host_pages),
            planes,
            engine,
            pending: FxHashMap::default(),
            next_ticket: 1,
            held_device: 0,
            held_host: 0,
            stats: CacheStats::default(),
            events: Vec::new(),
        })
    }

    pub fn tree(&self) -> &RadixTree {
        &self.tree
    }

    pub fn layout(&self) -> &PageLayout {
        &self.layout
    }

    pub fn page_size(&self) -> usize {
        self.layout.page_size()
    }

    pub fn stats(&self) -> &CacheStats {
        &self.stats
    }

    pub fn storage(&self) -> Option<&Arc<dyn Storage>> {
        self.planes.storage.as_ref()
    }

    /// The device pool's bytes (None in metadata-only mode).
    pub fn device_pool(&self) -> Option<&DevicePool> {
        self.planes.device.as_deref()
    }

    pub fn host_pool(&self) -> Option<&HostPool> {
        self.planes.host.as_deref()
    }

    pub fn device_usage(&self) -> TierUsage {
        TierUsage {
            pages_total: self.device_alloc.capacity() as u64,
            pages_used: self.device_alloc.used() as u64,
            page_bytes: self.layout.page_bytes() as u64,
        }
    }

    pub fn host_usage(&self) -> TierUsage {
        TierUsage {
            pages_total: self.host_alloc.capacity() as u64,
            pages_used: self.host_alloc.used() as u64,
            page_bytes: self.layout.page_bytes() as u64,
        }
    }

    /// Bytes used and total per tier and pool kind (every kind of a page moves together, so
    /// each kind's share follows its bytes per token).
    pub fn pool_usage(&self) -> Vec<PoolUsage> {
        let ps = self.layout.page_size() as u64;
        let mut out = Vec::new();
        for (tier, u) in [("device", self.device_usage()), ("host", self.host_usage())] {
            for k in self.layout.kinds() {
                let per_page = ps * k.bytes_per_token() as u64;
                out.push(PoolUsage {
                    tier,
                    kind: k.name.clone(),
                    bytes_total: u.pages_total * per_page,
                    bytes_used: u.pages_used * per_page,
                });
            }
        }
        out
    }

    /// Copies still in flight.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// Events since the last call, in order.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }

    fn emit(&mut self, stored: bool, tier: Tier, nodes: &[NodeId]) {
        if self.tree.namespace().is_none() {
            return;
        }
        let mut hashes = Vec::new();
        for &n in nodes {
            if self.tree.is_live(n) {
                hashes.extend_from_slice(self.tree.view(n).hashes);
            }
        }
        if !hashes.is_empty() {
            self.events.push(CacheEvent {
                stored,
                tier,
                hashes,
            });
        }
    }

    /// Every page the device and host tiers hold now (a router resynchronising its index).
    /// L3 is not listed: it may hold pages beyond the tree and may be shared.
    pub fn snapshot(&self) -> Vec<CacheEvent> {
        let mut by_tier = [Vec::new(), Vec::new()];
        for n in self.tree.node_ids() {
            let v = self.tree.view(n);
            if !v.device.is_empty() {
                by_tier[0].extend_from_slice(v.hashes);
            }
            if !v.host.is_empty() {
                by_tier[1].extend_from_slice(v.hashes);
            }
        }
        [Tier::Device, Tier::Host]
            .into_iter()
            .zip(by_tier)
            .map(|(tier, hashes)| CacheEvent {
                stored: true,
                tier,
                hashes,
            })
            .collect()
    }

    // ---- lookups -------------------------------------------------------------------------

    /// Longest cached prefix of `tokens` per tier, counting statistics. Under
    /// `write_through_selective`, nodes whose hit count reached the threshold are backed up.
    pub fn match_prefix(&mut self, tokens: &[u32]) -> CacheMatch {
        let m = self.lookup(tokens);
        self.record(&m);
        m
    }

    /// Like [`TieredCache::match_prefix`] without counting statistics (a scheduler that may
    /// retry an admission, or re-match after a prefetch, records once with
    /// [`TieredCache::record`]).
    pub fn lookup(&mut self, tokens: &[u32]) -> CacheMatch {
        let ps = self.page_size();
        let tm = self.tree.match_prefix(tokens);
        let mut m = CacheMatch {
            queried_tokens: tokens.len(),
            device_tokens: tm.device_tokens,
            host_tokens: tm.host_tokens,
            last: tm.last,
            path: tm.path,
            ..CacheMatch::default()
        };
        if let Some(st) = self.planes.storage.clone() {
            let start = m.device_tokens + m.host_tokens;
            let whole = tokens.len() / ps * ps;
            if whole > start {
                let ns = self.tree.namespace().expect("storage implies hashing");
                let parent = self.tree.last_hash(m.last).unwrap_or(PageHash::ROOT);
                let mut hashes = ns.chain(parent, &tokens[start..whole], ps);
                match st.prefix_len(&hashes) {
                    Ok(k) => hashes.truncate(k),
                    Err(_) => {
                        self.stats.storage_errors += 1;
                        hashes.clear();
                    }
                }
                m.storage_tokens = hashes.len() * ps;
                m.storage_hashes = hashes;
            }
        }
        m
    }

    /// Counts one query's hits and misses per tier (and applies selective write-through).
    pub fn record(&mut self, m: &CacheMatch) {
        let s = &mut self.stats;
        s.queries += 1;
        s.queried_tokens += m.queried_tokens as u64;
        s.hit_device_tokens += m.device_tokens as u64;
        s.hit_host_tokens += m.host_tokens as u64;
        s.hit_storage_tokens += m.storage_tokens as u64;
        s.miss_tokens += (m.queried_tokens - m.cached_tokens()) as u64;
        if let WritePolicy::WriteThroughSelective { threshold } = self.write_policy {
            let due: Vec<NodeId> = m
                .path
                .iter()
                .copied()
                .filter(|&n| {
                    if !self.tree.is_live(n) {
                        return false;
                    }
                    let v = self.tree.view(n);
                    v.hits >= threshold && v.host.is_empty() && !v.device.is_empty()
                })
                .collect();
            if !due.is_empty() {
                self.backup_nodes(due, false);
            }
        }
    }

    /// Locks `node` and its ancestors against eviction (a running request's prefix).
    pub fn lock(&mut self, node: NodeId) {
        self.tree.lock(node);
    }

    pub fn unlock(&mut self, node: NodeId) {
        self.tree.unlock(node);
    }

    // ---- device pages for compute ------------------------------------------------------

    /// `n` device pages for new tokens, evicting per policy; None if they cannot be freed.
    pub fn alloc_device(&mut self, n: usize) -> Option<Vec<u32>> {
        loop {
            let avail = self.device_alloc.available() as usize;
            if avail >= n {
                break;
            }
            self.evict_device(n - avail);
            if self.device_alloc.available() as usize >= n || self.pending.is_empty() {
                break;
            }
            // Victims may be locked by copies in flight (backups, write-backs): let one land.
            self.complete_one();
        }
        let p = self.device_alloc.alloc(n)?;
        self.held_device += n;
        Some(p)
    }

    /// Returns device pages obtained from [`TieredCache::alloc_device`] and not inserted.
    pub fn free_device(&mut self, pages: &[u32]) -> Result<(), PageError> {
        self.device_alloc.free(pages)?;
        self.held_device -= pages.len();
        Ok(())
    }

    /// Inserts computed tokens: `pages` hold the whole pages of `tokens` after the first `skip`
    /// pages (which the caller holds locked in the tree). Pages the tree already had are freed.
    /// Under `write_through` the new nodes are backed up at once.
    pub fn insert(&mut self, tokens: &[u32], pages: &[u32], skip: usize) -> Inserted {
        let ins = self.tree.insert(tokens, pages, Slot::Device, skip);
        self.device_alloc
            .free(&ins.unused)
            .expect("unused pages were held by the caller");
        self.held_device -= pages.len();
        let ps = self.page_size() as u64;
        self.stats.inserted_tokens += (pages.len() - ins.unused.len()) as u64 * ps;
        self.emit(true, Tier::Device, &ins.filled);
        if self.write_policy == WritePolicy::WriteThrough && !ins.filled.is_empty() {
            self.backup_nodes(ins.filled.clone(), false);
        }
        ins
    }

    // ---- tier movement -----------------------------------------------------------------

    /// Starts copying the host-only part of a match to the device (all or nothing). The nodes
    /// are on device (and locked) at once; read them after the ticket completes.
    pub fn load_back(&mut self, m: &CacheMatch) -> Option<Ticket> {
        let nodes: Vec<NodeId> = m
            .path
            .iter()
            .copied()
            .filter(|&n| self.tree.is_live(n) && self.tree.view(n).device.is_empty())
            .collect();
        if nodes.is_empty() {
            return None;
        }
        let need: usize = nodes.iter().map(|&n| self.tree.view(n).host.len()).sum();
        self.tree.lock(m.last);
        let Some(pages) = self.alloc_device(need) else {
            self.tree.unlock(m.last);
            self.stats.load_back_skipped_tokens += (need * self.page_size()) as u64;
            return None;
        };
        self.held_device -= need;
        let mut pairs = Vec::with_capacity(need);
        let mut it = pages.into_iter();
        for n in nodes {
            let host = self.tree.view(n).host.to_vec();
            let dev: Vec<u32> = it.by_ref().take(host.len()).collect();
            pairs.extend(dev.iter().copied().zip(host));
            self.tree.set_pages(n, Slot::Device, dev);
        }
        let loaded: Vec<NodeId> = m
            .path
            .iter()
            .copied()
            .filter(|&n| self.tree.is_live(n))
            .collect();
        self.emit(true, Tier::Device, &loaded);
        let job = JobKind::Copy {
            dir: Direction::HostToDevice,
            pairs,
        };
        Some(self.submit(
            job,
            Pending::LoadBack {
                lock: m.last,
                pages: need as u64,
            },
        ))
    }

    /// Starts reading the L3-held part of a match into host pages; when it completes the pages
    /// join the tree as host-only nodes (then [`TieredCache::load_back`] brings them up).
    pub fn prefetch(&mut self, tokens: &[u32], m: &CacheMatch) -> Option<Ticket> {
        if m.storage_hashes.is_empty() {
            return None;
        }
        let n = m.storage_hashes.len();
        self.tree.lock(m.last);
        let Some(host_pages) = self.alloc_host(n) else {
            self.tree.unlock(m.last);
            return None;
        };
        self.held_host += n;
        let ps = self.page_size();
        let skip = (m.device_tokens + m.host_tokens) / ps;
        let job = JobKind::Get {
            hashes: m.storage_hashes.clone(),
            host_pages: host_pages.clone(),
        };
        let tokens = tokens[..(skip + n) * ps].to_vec();
        Some(self.submit(
            job,
            Pending::Prefetch {
                lock: m.last,
                tokens,
                host_pages,
                skip,
            },
        ))
    }

    /// Backs up device-resident nodes lying on one root path (root-most first). Nodes that do
    /// not fit in the host tier are skipped and counted. Returns the ticket if any copy started.
    fn backup_nodes(&mut self, nodes: Vec<NodeId>, evict_after: bool) -> Option<Ticket> {
        let mut chosen = Vec::new();
        let mut pairs = Vec::new();
        let mut lock = None;
        for n in nodes {
            let v = self.tree.view(n);
            if !v.host.is_empty() || v.device.is_empty() {
                continue;
            }
            let np = v.device.len();
            let Some(host) = self.alloc_host(np) else {
                self.stats.backup_skipped_pages += np as u64;
                continue;
            };
            let dev = self.tree.view(n).device.to_vec();
            pairs.extend(dev.into_iter().zip(host.iter().copied()));
            self.tree.set_pages(n, Slot::Host, host);
            chosen.push(n);
            lock = Some(n);
        }
        let lock = lock?;
        self.emit(true, Tier::Host, &chosen);
        self.tree.lock(lock);
        let job = JobKind::Copy {
            dir: Direction::DeviceToHost,
            pairs,
        };
        Some(self.submit(
            job,
            Pending::Backup {
                lock,
                nodes: chosen,
                evict_after,
            },
        ))
    }

    fn alloc_host(&mut self, n: usize) -> Option<Vec<u32>> {
        let avail = self.host_alloc.available() as usize;
        if avail < n {
            self.evict_host(n - avail);
        }
        self.host_alloc.alloc(n)
    }

    /// Frees at least `n` device pages if possible (write-back victims free when their copy
    /// lands). Returns pages freed or scheduled.
    pub fn evict_device(&mut self, n: usize) -> usize {
        let mut got = 0;
        let mut skip: Vec<NodeId> = Vec::new();
        while got < n {
            let Some(v) = self.tree.device_victim_excluding(&skip) else {
                break;
            };
            // Free only what is still needed: the head of the node stays cached.
            self.tree.split_tail(v, n - got);
            let view = self.tree.view(v);
            let np = view.device.len();
            let needs_copy = view.host.is_empty()
                && (self.write_policy == WritePolicy::WriteBack || view.children > 0);
            if needs_copy {
                // Keep the data reachable: copy first, free on completion.
                if self.backup_nodes(vec![v], true).is_some() {
                    got += np;
                } else {
                    skip.push(v);
                }
                continue;
            }
            got += np;
            self.drop_device(v);
        }
        got
    }

    fn drop_device(&mut self, v: NodeId) {
        self.emit(false, Tier::Device, &[v]);
        let pages = self.tree.take_device(v);
        self.stats.evicted_device_nodes += 1;
        self.stats.evicted_device_tokens += (pages.len() * self.page_size()) as u64;
        self.device_alloc
            .free(&pages)
            .expect("tree pages are allocated");
    }

    /// Frees at least `n` host pages if possible (only nodes already off device).
    pub fn evict_host(&mut self, n: usize) -> usize {
        let mut got = 0;
        while got < n {
            let Some(v) = self.tree.host_victim() else {
                break;
            };
            self.tree.split_tail(v, n - got);
            self.emit(false, Tier::Host, &[v]);
            let pages = self.tree.take_host(v);
            got += pages.len();
            self.stats.evicted_host_nodes += 1;
            self.stats.evicted_host_tokens += (pages.len() * self.page_size()) as u64;
            self.host_alloc
                .free(&pages)
                .expect("tree pages are allocated");
        }
        got
    }

    // ---- completions -------------------------------------------------------------------

    fn submit(&mut self, job: JobKind, p: Pending) -> Ticket {
        // Splits so far belong to the copies already in flight, not to this one.
        self.absorb_splits();
        let t = self.next_ticket;
        self.next_ticket += 1;
        self.pending.insert(t, p);
        match &self.engine {
            Some(e) => e.submit(t, job),
            None => {
                let d = self.planes.run(t, &job);
                self.complete(d);
            }
        }
        Ticket(t)
    }

    pub fn is_done(&self, t: Ticket) -> bool {
        !self.pending.contains_key(&t.0)
    }

    /// Acknowledges finished copies without blocking; returns how many.
    pub fn poll(&mut self) -> usize {
        let mut k = 0;
        while let Some(d) = self.engine.as_ref().and_then(CopyEngine::try_recv) {
            self.complete(d);
            k += 1;
        }
        k
    }

    fn complete_one(&mut self) {
        if let Some(e) = &self.engine {
            let d = e.recv();
            self.complete(d);
        }
    }

    /// Blocks until `t` completes.
    pub fn wait(&mut self, t: Ticket) {
        while self.pending.contains_key(&t.0) {
            self.complete_one();
        }
    }

    /// Blocks until nothing is in flight (including L3 writes that follow backups).
    pub fn wait_all(&mut self) {
        while !self.pending.is_empty() {
            self.complete_one();
        }
    }

    /// Follows splits made since the last call into the node lists of copies in flight: a
    /// node split while its backup or put was in flight has its head covered by the same copy.
    fn absorb_splits(&mut self) {
        let splits = self.tree.take_splits();
        if splits.is_empty() || self.pending.is_empty() {
            return;
        }
        for (suffix, head) in splits {
            for p in self.pending.values_mut() {
                match p {
                    Pending::Backup { nodes, .. } if nodes.contains(&suffix) => {
                        let at = nodes.iter().position(|&n| n == suffix).expect("present");
                        nodes.insert(at, head);
                    }
                    Pending::Put { nodes, heads }
                        if nodes.contains(&suffix) || heads.contains(&suffix) =>
                    {
                        heads.push(head);
                    }
                    _ => {}
                }
            }
        }
    }

    fn complete(&mut self, d: Done) {
        self.absorb_splits();
        let p = self
            .pending
            .remove(&d.ticket)
            .expect("completion for a known ticket");
        match p {
            Pending::LoadBack { lock, pages } => {
                self.stats.load_back.add(pages, d.bytes, d.nanos);
                self.tree.unlock(lock);
            }
            Pending::Backup {
                lock,
                nodes,
                evict_after,
            } => {
                self.stats.backup.add(d.pages_ok as u64, d.bytes, d.nanos);
                self.tree.unlock(lock);
                if evict_after {
                    for &n in &nodes {
                        // A request may have matched it meanwhile; then it stays on device.
                        let v = self.tree.view(n);
                        if v.lock_ref == 0 && !v.device.is_empty() && v.device_children == 0 {
                            self.drop_device(n);
                        }
                    }
                }
                if self.planes.storage.is_some() {
                    self.put_to_storage(nodes);
                }
            }
            Pending::Put { nodes, heads } => {
                self.stats
                    .storage_put
                    .add(d.pages_ok as u64, d.bytes, d.nanos);
                self.stats.storage_errors += d.errors;
                for &n in &nodes {
                    self.tree.host_unlock(n);
                    if d.errors == 0 {
                        self.tree.set_in_storage(n, true);
                    }
                }
                let shared = self
                    .planes
                    .storage
                    .as_ref()
                    .is_some_and(|s| s.tier().contains("remote"));
                if d.errors == 0 && shared {
                    let mut all = nodes.clone();
                    all.extend(heads.iter().copied());
                    self.emit(true, Tier::Remote, &all);
                }

                if d.errors == 0 {
                    for &n in &heads {
                        if self.tree.is_live(n) {
                            self.tree.set_in_storage(n, true);
                        }
                    }
                }
            }
            Pending::Prefetch {
                lock,
                tokens,
                host_pages,
                skip,
            } => {
                self.stats
                    .storage_get
                    .add(d.pages_ok as u64, d.bytes, d.nanos);
                self.stats.storage_errors += d.errors;
                let ok = d.pages_ok;
                self.stats.storage_read_misses += (host_pages.len() - ok) as u64;
                self.host_alloc
                    .free(&host_pages[ok..])
                    .expect("prefetch pages are held");
                self.held_host -= host_pages.len();
                let ps = self.page_size();
                let ins = self.tree.insert(
                    &tokens[..(skip + ok) * ps],
                    &host_pages[..ok],
                    Slot::Host,
                    skip,
                );
                self.host_alloc
                    .free(&ins.unused)
                    .expect("prefetch pages are held");
                for &n in &ins.filled {
                    self.tree.set_in_storage(n, true);
                }
                let filled = ins.filled.clone();
                self.emit(true, Tier::Host, &filled);
                self.tree.unlock(lock);
            }
        }
    }

    fn put_to_storage(&mut self, nodes: Vec<NodeId>) {
        let mut host_pages = Vec::new();
        let mut hashes = Vec::new();
        let mut locked = Vec::new();
        for n in nodes {
            let v = self.tree.view(n);
            if v.in_storage || v.host.is_empty() {
                continue;
            }
            host_pages.extend_from_slice(v.host);
            hashes.extend_from_slice(v.hashes);
            locked.push(n);
        }
        if locked.is_empty() {
            return;
        }
        for &n in &locked {
            self.tree.host_lock(n);
        }
        self.submit(
            JobKind::Put { host_pages, hashes },
            Pending::Put {
                nodes: locked,
                heads: Vec::new(),
            },
        );
    }

    /// Checks tree invariants plus page accounting: every tree page is allocated, owned once,
    /// and allocator usage equals tree pages plus pages held by callers or in flight.
    pub fn check(&self) -> Result<(), String> {
        self.tree.check()?;
        let mut dev = Vec::new();
        let mut host = Vec::new();
        for n in self.tree.node_ids() {
            let v = self.tree.view(n);
            dev.extend_from_slice(v.device);
            host.extend_from_slice(v.host);
        }
        for (name, pages, alloc, held) in [
            ("device", &mut dev, &self.device_alloc, self.held_device),
            ("host", &mut host, &self.host_alloc, self.held_host),
        ] {
            if let Some(p) = pages.iter().find(|&&p| !alloc.is_allocated(p)) {
                return Err(format!("{name} page {p} is in the tree but free"));
            }
            let n = pages.len();
            pages.sort_unstable();
            pages.dedup();
            if pages.len() != n {
                return Err(format!("a {name} page is owned by two nodes"));
            }
            if alloc.used() as usize != n + held {
                return Err(format!(
                    "{name}: {} pages allocated, tree holds {n}, callers {held}",
                    alloc.used()
                ));
            }
        }
        if !self.stats.balanced() {
            return Err("hit + miss tokens != queried tokens".into());
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "cache_tests.rs"]
mod tests;
