//! The tiered cache: radix tree + page allocators + byte pools + copy workers + L3 storage,
//! applying the write and eviction policies and keeping the statistics.
//!
//! Single-owner (the scheduler thread); copies run on worker threads and are acknowledged by
//! [`TieredCache::poll`] / [`TieredCache::wait`]. In metadata-only mode (the simulator) there are
//! no bytes and every copy completes inline, through the same code path.

use std::sync::Arc;

use rustc_hash::FxHashMap;
use thiserror::Error;

use crate::copy::{CopyEngine, Planes};
use crate::hash::{HashNamespace, PageHash};
use crate::layout::{Class, PageLayout};
use crate::memory::{HeapAllocator, HostAllocator, MemError};
use crate::pages::{PageAllocator, PageError};
use crate::policy::{EvictionPolicy, WritePolicy};
use crate::pool::{DevicePool, HostPool};
use crate::stats::{CacheStats, PoolUsage, TierUsage};
use crate::storage::Storage;
use crate::tree::{Inserted, NodeId, RadixTree, Slot, NO_PAGE};

/// How to build a [`TieredCache`].
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Part of the page-hash namespace.
    pub model_id: String,
    pub layout: PageLayout,
    pub device_pages: u32,
    pub host_pages: u32,
    /// Window pages per tier (layouts with window kinds; 0 otherwise). [`CacheConfig::new`]
    /// gives one per page.
    pub device_window_pages: u32,
    pub host_window_pages: u32,
    /// Committed prefixes keep their window state only where a continuation can start: at
    /// their end, and at a checkpoint every this many pages (0: every page keeps its own, as
    /// [`CacheConfig::new`] sets). See `cache/window.rs`.
    pub window_checkpoint_pages: usize,
    pub write_policy: WritePolicy,
    pub eviction: EvictionPolicy,
    /// GDSF's (and S3-FIFO's ghost) memory of evicted nodes, in keys per cached page (1 byte each; one key per
    /// evicted node, under where it started). Unused by LRU and SIEVE.
    pub gdsf_history: usize,
    /// Compute stable page hashes even without storage or GDSF (e.g. for routing events).
    pub hashing: bool,
    /// Allocate real bytes. `false` gives the metadata-only cache the simulator uses.
    pub with_data: bool,
    pub copy_threads: usize,
    /// Pages the live miss-ratio curve may track (`curve.rs`; 0: no curve).
    pub curve_pages: usize,
    /// Bytes the curve's answer adds to each tier ([`curve::Gain`]; a worker: 1 GiB per rank).
    pub curve_step_bytes: u64,
}

/// Default [`CacheConfig::gdsf_history`].
pub const DEFAULT_GDSF_HISTORY: usize = 1;

impl CacheConfig {
    pub fn new(layout: PageLayout, device_pages: u32, host_pages: u32) -> CacheConfig {
        CacheConfig {
            model_id: "model".into(),
            device_window_pages: layout.window_pages_for(device_pages),
            host_window_pages: layout.window_pages_for(host_pages),
            window_checkpoint_pages: 0,
            layout,
            device_pages,
            host_pages,
            write_policy: WritePolicy::WriteThrough,
            eviction: EvictionPolicy::DEFAULT,
            gdsf_history: DEFAULT_GDSF_HISTORY,
            hashing: false,
            with_data: true,
            copy_threads: 1,
            curve_pages: 0,
            curve_step_bytes: 1 << 30,
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
    #[error("the layout's window kinds need at least one device window page")]
    NoDeviceWindowPages,
    #[error("window pages were given for a layout without window kinds")]
    WindowPagesWithoutWindowKinds,
    #[error(transparent)]
    Mem(#[from] MemError),
    #[error(transparent)]
    Page(#[from] PageError),
    #[error("no random key for the miss-ratio curve's sampler: {0}")]
    Random(String),
    #[error("no thread for the miss-ratio curve's simulations: {0}")]
    Thread(String),
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
    /// Matched tokens given up because the window state before their end was gone.
    pub window_cut_tokens: usize,
}

impl CacheMatch {
    pub fn cached_tokens(&self) -> usize {
        self.device_tokens + self.host_tokens + self.storage_tokens
    }
}

enum Pending {
    LoadBack {
        lock: NodeId,
        /// The device pages being written (already the tree's).
        pages: Vec<u32>,
        /// The device window pages being written (already the tree's).
        windows: Vec<u32>,
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
        /// A host window page per page (NO_PAGE where none was asked for), or empty.
        windows: Vec<u32>,
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
    /// Window pages per tier (capacity 0 without window kinds).
    dwin_alloc: PageAllocator,
    hwin_alloc: PageAllocator,
    /// Tokens before a continuation whose window state it reads (0: no window kinds).
    window: usize,
    /// [`CacheConfig::window_checkpoint_pages`].
    checkpoint_pages: usize,
    planes: Planes,
    engine: Option<CopyEngine>,
    /// Asks L3 off this thread (with a copy engine and L3: `probe.rs`).
    prober: Option<probe::Prober>,
    pending: FxHashMap<u64, Pending>,
    next_ticket: u64,
    /// Pages handed to callers and not yet inserted or freed.
    held_device: usize,
    held_host: usize,
    held_dwin: usize,
    held_hwin: usize,
    stats: CacheStats,
    events: Vec<CacheEvent>,
    /// Leases dropped without a commit or release (released at the next poll/admit).
    dropped: lease::DropQueue,
    /// Device pages that load-backs in flight are writing: the tree lists them as on device
    /// already, but no request may read them until the copy lands.
    loading: rustc_hash::FxHashSet<u32>,
    /// The same for device window pages.
    loading_windows: rustc_hash::FxHashSet<u32>,
    /// Buffers reused by leases (no allocation per request).
    scratch_path: Vec<NodeId>,
    scratch_pages: Vec<u32>,
    curve: Option<curve::CurveState>,
    /// Each session's last committed leaf (`session.rs`).
    sessions: session::Sessions,
}

impl TieredCache {
    pub fn new(
        cfg: CacheConfig,
        host_alloc: &dyn HostAllocator,
        storage: Option<Arc<dyn Storage>>,
    ) -> Result<TieredCache, CacheError> {
        TieredCache::with_allocators(cfg, host_alloc, &[], &[], storage)
    }

    /// [`TieredCache::new`] with each pool kind's memory from its own allocator (a
    /// tensor-parallel rank's kind on the rank's NUMA node): in the host pool from
    /// `host_allocs[kind]` (none given: one region from `host_alloc`; kinds beyond the slice
    /// take `host_alloc`), in the device pool from `device_allocs[kind]` (else the heap).
    pub fn with_allocators(
        cfg: CacheConfig,
        host_alloc: &dyn HostAllocator,
        host_allocs: &[&dyn HostAllocator],
        device_allocs: &[&dyn HostAllocator],
        storage: Option<Arc<dyn Storage>>,
    ) -> Result<TieredCache, CacheError> {
        if cfg.device_pages == 0 {
            return Err(CacheError::NoDevicePages);
        }
        window::check_pages(&cfg)?;
        let layout = Arc::new(cfg.layout);
        let ns =
            (cfg.hashing || storage.is_some()).then(|| HashNamespace::new(&cfg.model_id, &layout));
        let mut tree = RadixTree::new(layout.page_size(), cfg.eviction, ns);
        tree.set_page_bound((cfg.device_pages as usize).max(cfg.host_pages as usize));
        // GDSF's history: `gdsf_history` keys per cached page (the tree sizes it, LRU skips it).
        let pages = cfg.device_pages as usize + cfg.host_pages as usize;
        tree.set_history_cap(pages.saturating_mul(cfg.gdsf_history), pages);
        let (device, host) = if cfg.with_data {
            let (dp, dw) = (cfg.device_pages, cfg.device_window_pages);
            let d = DevicePool::with_allocators(layout.clone(), dp, dw, &|k| {
                device_allocs.get(k).copied().unwrap_or(&HeapAllocator)
            })?;
            let (hp, hw) = (cfg.host_pages, cfg.host_window_pages);
            let h = if host_allocs.is_empty() {
                HostPool::with_window(layout.clone(), hp, hw, host_alloc)?
            } else {
                HostPool::with_allocators(layout.clone(), hp, hw, &|k| {
                    host_allocs.get(k).copied().unwrap_or(host_alloc)
                })?
            };
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
        let curve = curve::CurveState::of(cfg.curve_pages, cfg.eviction, cfg.curve_step_bytes)?;
        Ok(TieredCache {
            tree,
            write_policy: cfg.write_policy,
            device_alloc: PageAllocator::new(cfg.device_pages),
            host_alloc: PageAllocator::new(cfg.host_pages),
            dwin_alloc: PageAllocator::new(cfg.device_window_pages),
            hwin_alloc: PageAllocator::new(cfg.host_window_pages),
            window: layout.window_tokens(),
            checkpoint_pages: cfg.window_checkpoint_pages,
            layout,
            prober: probe::Prober::of(&planes, engine.is_some()),
            planes,
            engine,
            pending: FxHashMap::default(),
            next_ticket: 1,
            held_device: 0,
            held_host: 0,
            held_dwin: 0,
            held_hwin: 0,
            stats: CacheStats::default(),
            events: Vec::new(),
            dropped: Default::default(),
            loading: Default::default(),
            loading_windows: Default::default(),
            scratch_path: Vec::new(),
            scratch_pages: Vec::new(),
            curve,
            sessions: Default::default(),
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

    /// The device pool, shared (to read and write it while the cache is borrowed mutably).
    pub(crate) fn device_pool_shared(&self) -> Option<Arc<DevicePool>> {
        self.planes.device.clone()
    }

    pub fn host_pool(&self) -> Option<&HostPool> {
        self.planes.host.as_deref()
    }

    /// Main pages of the device tier (`page_bytes`: their main part).
    pub fn device_usage(&self) -> TierUsage {
        self.usage(&self.device_alloc, Class::Main)
    }

    pub fn host_usage(&self) -> TierUsage {
        self.usage(&self.host_alloc, Class::Main)
    }

    /// Window pages of the device and host tiers (all zero without window kinds).
    pub fn window_usage(&self) -> (TierUsage, TierUsage) {
        (
            self.usage(&self.dwin_alloc, Class::Window),
            self.usage(&self.hwin_alloc, Class::Window),
        )
    }

    fn usage(&self, alloc: &PageAllocator, class: Class) -> TierUsage {
        TierUsage {
            pages_total: alloc.capacity() as u64,
            pages_used: alloc.used() as u64,
            page_bytes: self.layout.class_bytes(class) as u64,
        }
    }

    /// Bytes used and total per tier and pool kind (the kinds of a class move together, so
    /// each kind's share of its class follows its bytes per token).
    pub fn pool_usage(&self) -> Vec<PoolUsage> {
        let ps = self.layout.page_size() as u64;
        let (dwin, hwin) = self.window_usage();
        let mut out = Vec::new();
        for (tier, main, win) in [
            ("device", self.device_usage(), dwin),
            ("host", self.host_usage(), hwin),
        ] {
            for k in self.layout.kinds() {
                let u = match k.class() {
                    Class::Main => main,
                    Class::Window => win,
                };
                let per_page = ps * k.bytes_per_token() as u64;
                out.push(PoolUsage {
                    tier,
                    kind: k.name.clone(),
                    tokens_total: u.pages_total * ps,
                    bytes_total: u.pages_total * per_page,
                    bytes_used: u.pages_used * per_page,
                });
            }
        }
        out
    }

    /// Bytes of tree metadata (with the sessions remembered), and the tokens the tree holds.
    pub fn tree_footprint(&self) -> (usize, usize) {
        let tokens = self
            .tree
            .node_ids()
            .iter()
            .map(|&n| self.tree.view(n).tokens.len())
            .sum();
        (self.tree.metadata_bytes() + self.sessions.bytes(), tokens)
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
                let k = self.storage_prefix(st.as_ref(), start / ps, &hashes);
                hashes.truncate(k);
                m.storage_tokens = hashes.len() * ps;
                m.storage_hashes = hashes;
            }
        }
        self.window_rule(&mut m);
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
        s.window_cut_tokens += m.window_cut_tokens as u64;
        if self.window > 0 && m.cached_tokens() > 0 {
            match m.window_cut_tokens {
                0 => s.window_hits_as_matched += 1,
                _ => s.window_hits_backed_off += 1,
            }
        }
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
        let mut v = Vec::with_capacity(n);
        self.alloc_device_into(n, &mut v).then_some(v)
    }

    /// [`TieredCache::alloc_device`] appending to `out`; false (nothing taken) when the pages
    /// cannot be freed.
    pub fn alloc_device_into(&mut self, n: usize, out: &mut Vec<u32>) -> bool {
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
        if !self.device_alloc.alloc_into(n, out) {
            return false;
        }
        self.held_device += n;
        true
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
        self.insert_with_windows(tokens, pages, &[], skip)
    }

    /// [`TieredCache::insert`] with the pages' device window pages (`windows`: empty, or one
    /// per page, `NO_PAGE` for none; obtained with the pages and held the same way). Window
    /// pages the tree does not take are freed.
    pub fn insert_with_windows(
        &mut self,
        tokens: &[u32],
        pages: &[u32],
        windows: &[u32],
        skip: usize,
    ) -> Inserted {
        let ins = self
            .tree
            .insert_with_windows(tokens, pages, windows, Slot::Device, skip);
        self.device_alloc
            .free(&ins.unused)
            .expect("unused pages were held by the caller");
        self.held_device -= pages.len();
        self.dwin_alloc
            .free(&ins.unused_windows)
            .expect("unused window pages were held by the caller");
        self.held_dwin -= windows.iter().filter(|&&w| w != NO_PAGE).count();
        let ps = self.page_size() as u64;
        self.stats.inserted_tokens += (pages.len() - ins.unused.len()) as u64 * ps;
        self.emit(true, Tier::Device, &ins.filled);
        if self.write_policy == WritePolicy::WriteThrough && !ins.filled.is_empty() {
            self.backup_nodes(ins.filled.clone(), false);
        }
        ins
    }

    /// Checks tree invariants plus page accounting: every tree page is allocated, owned once,
    /// and allocator usage equals tree pages plus pages held by callers or in flight.
    pub fn check(&self) -> Result<(), String> {
        self.tree.check()?;
        let (mut dev, mut host, mut dwin, mut hwin) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let real = |v: &[u32]| {
            v.iter()
                .copied()
                .filter(|&w| w != NO_PAGE)
                .collect::<Vec<_>>()
        };
        for n in self.tree.node_ids() {
            let v = self.tree.view(n);
            v.device.extend_into(&mut dev);
            v.host.extend_into(&mut host);
            dwin.extend(real(v.device_win));
            hwin.extend(real(v.host_win));
        }
        for (name, pages, alloc, held) in [
            ("device", &mut dev, &self.device_alloc, self.held_device),
            ("host", &mut host, &self.host_alloc, self.held_host),
            ("device window", &mut dwin, &self.dwin_alloc, self.held_dwin),
            ("host window", &mut hwin, &self.hwin_alloc, self.held_hwin),
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

mod complete;
pub mod curve;
mod lease;
mod movement;
mod probe;
mod ring;
mod session;
pub use session::MAX_SESSIONS;
mod transfer;
mod window;

pub use lease::{Lease, Served};

#[cfg(test)]
mod tests;
