//! The radix tree over token ids, page-aligned, recording per node where its pages live.
//!
//! Arena of nodes; each edge holds whole pages. Residency invariants (checked by
//! [`RadixTree::check`]):
//! * every node but the root holds device pages, host pages, or both;
//! * device residency is prefix-closed (a node on device has its parent on device), because the
//!   device tier only ever evicts nodes none of whose children are on device;
//! * host eviction only removes nodes that are off device, unlocked and childless;
//! * window pages (the window class of a layout, `crate::layout::Class`) are kept per page
//!   per tier beside a node's pages and are *not* prefix-closed: any unlocked node may lose
//!   them (window eviction) and keep its main pages (see `window.rs`).
//!
//! Locks are inherited along the path: locking a node increments every ancestor's `lock_ref`,
//! and nothing with a non-zero `lock_ref` is evicted. Evictable leaves of each tier sit in an
//! ordered set keyed by the policy's priority, so picking a victim is O(log n).

use hashbrown::HashTable;
use rustc_hash::FxHashMap;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::hash::{HashNamespace, PageHash};
use crate::policy::{EvictionPolicy, FrequencyHistory};

use keyset::KeySet;
use node::{Geom, Node, LIVE};
use packed::page_key;
pub use packed::{Packed, Pages, Tokens};

/// Index of a node in the arena. Stable while the node lives; a split keeps the id on the deeper
/// half, so a lock taken on a node still covers the same tokens afterwards.
/// The default is the root.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

/// The root: holds no tokens.
pub const ROOT: NodeId = NodeId(0);

/// A page's entry in a window list when it holds no window page in that tier.
pub const NO_PAGE: u32 = u32::MAX;

/// Which per-node page slot an operation addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    Device,
    Host,
}

/// A node's place in an eviction set: its priority (high 64 bits), under GDSF the low 32 bits
/// of its last access (ties; 0 otherwise), its id (low 32 bits). Fixed while the node is filed
/// in any set.
type Key = u128;

fn key_id(k: &Key) -> NodeId {
    NodeId(*k as u32)
}

/// Hash of an edge: the parent's id and the child's first page key, mixed (murmur3's
/// finalizer) so that both the table's index bits and its tag bits depend on all of it.
fn edge_hash(parent: u32, page_key: u64) -> u64 {
    let mut x = page_key ^ (parent as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x = (x ^ x >> 33).wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x = (x ^ x >> 33).wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    x ^ x >> 33
}

/// The edge hash of node `c` (from its parent and its first page).
fn child_hash(nodes: &[Node], g: Geom, c: u32) -> u64 {
    let n = &nodes[c as usize];
    edge_hash(n.parent, n.tokens(g).page_key(g.ps))
}

/// Window pages of a node per tier (see `window.rs`).
#[derive(Debug, Default)]
struct Windows {
    device: Vec<u32>,
    host: Vec<u32>,
}

/// Per-node state of the policies with a history (GDSF, `auto`, S3-FIFO) beside the arena:
/// the history key. (Their frequency is the node's `freq`, in its padding.)
#[derive(Clone, Copy, Debug, Default)]
struct GdsfNode {
    /// What this node's children's history keys chain from: its own key (where it starts: its
    /// parent's `base` and its first page) when it was made; a split leaves it to the deeper
    /// half (so the children keep their keys) and gives the new head its key as base. An
    /// evicted node's frequency is remembered under its key, and a new leaf starting at the
    /// same place takes it back: one key per node, never per page.
    base: u64,
}

/// Result of [`RadixTree::match_prefix`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TreeMatch {
    /// Matched nodes from the root down (root excluded).
    pub path: Vec<NodeId>,
    /// Tokens matched on device (a prefix of the match).
    pub device_tokens: usize,
    /// Tokens matched after that, held only on host.
    pub host_tokens: usize,
    /// Deepest matched node (ROOT when nothing matched).
    pub last: NodeId,
}

impl TreeMatch {
    pub fn tokens(&self) -> usize {
        self.device_tokens + self.host_tokens
    }
}

/// Result of [`RadixTree::insert`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inserted {
    /// Given pages the tree did not take (their tokens were already held in that slot): free them.
    pub unused: Vec<u32>,
    /// Given window pages the tree did not take (other than [`NO_PAGE`]): free them.
    pub unused_windows: Vec<u32>,
    /// Nodes whose slot was filled by this call, root-most first.
    pub filled: Vec<NodeId>,
    /// Deepest node covering the inserted tokens (ROOT if none).
    pub last: NodeId,
    /// Whole-page tokens now covered by the tree along this path.
    pub tokens: usize,
}

/// Read-only view of one node.
#[derive(Clone, Copy, Debug)]
pub struct NodeView<'a> {
    pub id: NodeId,
    pub parent: NodeId,
    pub tokens: Tokens<'a>,
    pub hashes: &'a [PageHash],
    pub device: Pages<'a>,
    pub host: Pages<'a>,
    /// Window pages per tier (empty, or one per page with [`NO_PAGE`] gaps).
    pub device_win: &'a [u32],
    pub host_win: &'a [u32],
    pub in_storage: bool,
    pub children: usize,
    /// Children that are on device.
    pub device_children: u32,
    pub lock_ref: u32,
    pub host_lock: u32,
    pub hits: u32,
    pub last_access: u64,
}

/// Radix tree with per-tier residency.
pub struct RadixTree {
    page_size: usize,
    /// Bytes a page index takes in the nodes' page lists (see [`RadixTree::set_page_bound`]).
    page_width: usize,
    nodes: Vec<Node>,
    /// Free arena slots, lowest first (see [`RadixTree::release_id`]).
    free_ids: BinaryHeap<Reverse<u32>>,
    /// Every parent → child edge: the child's id, found by [`edge_hash`] and compared by its
    /// parent and first page (4 bytes an edge).
    edges: HashTable<u32>,
    /// Page hashes per node (with a namespace only; indexed by node id).
    hashes: Vec<Box<[PageHash]>>,
    /// Window lists of the nodes that have some.
    windows: FxHashMap<u32, Windows>,
    /// Priority per node, for policies whose priority is not the last access.
    prio: Vec<u64>,
    /// Per-node state of GDSF and S3-FIFO (the frequency, and the key of the history).
    gdsf: Vec<GdsfNode>,
    device_leaves: KeySet,
    host_leaves: KeySet,
    /// Unlocked nodes holding window pages, per tier (any node, not only leaves).
    device_windows: KeySet,
    host_windows: KeySet,
    /// Window pages referenced by nodes, per tier.
    device_win_pages: usize,
    host_win_pages: usize,
    clock: u64,
    policy: EvictionPolicy,
    inflation: u64,
    history: FrequencyHistory,
    /// `auto`'s newcomer credit and what it learns from.
    adaptive: crate::policy::Newcomers,
    /// Removals now are the operator's (a flush), not the policy's: `auto` learns nothing.
    flushing: bool,
    /// SIEVE's hands (device, host leaves): the key from which the next sweep starts.
    hands: [Key; 2],
    /// S3-FIFO: the last queue position given, and pages of small-queue nodes per tier.
    seq: u64,
    small_pages: [usize; 2],
    namespace: Option<HashNamespace>,
    device_pages: usize,
    host_pages: usize,
    /// (suffix, new head) of every split since the last [`RadixTree::take_splits`]: lets the
    /// owner of lists of node ids (copies in flight) follow nodes that were split meanwhile.
    splits: Vec<(NodeId, NodeId)>,
}

/// One step of the in-process key chain of the eviction history (never leaves the process, so
/// a fast non-cryptographic hash is fine): the page's tokens two at a time in two independent
/// multiply-rotate lanes, mixed so that every bit depends on all of them.
fn chain_step(prev: u64, page: Tokens<'_>) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    const L: u64 = 0xC2B2_AE3D_27D4_EB4F;
    let (mut a, mut b) = (prev ^ K, prev.rotate_left(32) ^ L ^ page.len() as u64);
    let n = page.len();
    let mut i = 0;
    while i + 4 <= n {
        let x = page.get(i) as u64 | (page.get(i + 1) as u64) << 32;
        let y = page.get(i + 2) as u64 | (page.get(i + 3) as u64) << 32;
        a = (a ^ x).wrapping_mul(K).rotate_left(31);
        b = (b ^ y).wrapping_mul(L).rotate_left(29);
        i += 4;
    }
    while i < n {
        a = (a ^ page.get(i) as u64).wrapping_mul(K).rotate_left(31);
        i += 1;
    }
    let h = (a ^ b.rotate_left(23)).wrapping_mul(K);
    h ^ (h >> 29)
}

impl RadixTree {
    /// `namespace` enables stable page hashes (needed for L3 storage and routing events);
    /// without it pages carry no hash.
    pub fn new(
        page_size: usize,
        policy: EvictionPolicy,
        namespace: Option<HashNamespace>,
    ) -> RadixTree {
        assert!(page_size >= 1, "page size must be at least 1");
        let mut root = Node::default();
        root.flags = LIVE;
        let mut t = RadixTree {
            page_size,
            page_width: 4,
            nodes: vec![root],
            free_ids: BinaryHeap::new(),
            edges: HashTable::new(),
            hashes: Vec::new(),
            windows: FxHashMap::default(),
            prio: Vec::new(),
            gdsf: Vec::new(),
            splits: Vec::new(),
            device_leaves: KeySet::new(),
            host_leaves: KeySet::new(),
            device_windows: KeySet::new(),
            host_windows: KeySet::new(),
            device_win_pages: 0,
            host_win_pages: 0,
            clock: 0,
            policy,
            inflation: 0,
            history: FrequencyHistory::new(16),
            adaptive: crate::policy::Newcomers::new(16),
            flushing: false,
            hands: [0; 2],
            seq: 0,
            small_pages: [0; 2],
            namespace,
            device_pages: 0,
            host_pages: 0,
        };
        t.grow_side_tables(1);
        t
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// The nodes' shared shape: page size and page width.
    #[inline]
    fn g(&self) -> Geom {
        Geom {
            ps: self.page_size,
            pw: self.page_width,
        }
    }

    /// Panics, before anything changes, on a page index past [`RadixTree::set_page_bound`]'s
    /// (the pools' allocators never give one: it would be a bug, not an input).
    fn check_page_bound(&self, pages: &[u32]) {
        assert!(
            Pages::Wide(pages).width_needed() <= self.page_width,
            "a page index beyond the tree's page bound"
        );
    }

    /// Declares every page index the tree will be given below `pages` (the larger pool's
    /// page count), so that the nodes' page lists take 2 bytes a page index for pools of up
    /// to 65,536 pages and 3 up to 2^24 (4 without it). At page size 1 that is 1 or 2 bytes
    /// less per cached token. Only on an empty tree; a larger index given later panics.
    pub fn set_page_bound(&mut self, pages: usize) {
        assert_eq!(
            self.node_count(),
            1,
            "the page bound is set on an empty tree"
        );
        self.page_width = Geom::page_width(pages);
    }

    pub fn policy(&self) -> EvictionPolicy {
        self.policy
    }

    pub fn namespace(&self) -> Option<&HashNamespace> {
        self.namespace.as_ref()
    }

    /// Sizes the eviction history of GDSF, S3-FIFO and `auto` (`keys`, 1 byte each), e.g. to a
    /// few times the cache's page count, and `auto`'s ghosts and window from the cache's
    /// `pages`. Only those policies allocate them.
    pub fn set_history_cap(&mut self, keys: usize, pages: usize) {
        if self.policy.has_history() {
            self.history = FrequencyHistory::new(keys);
        }
        if self.policy == EvictionPolicy::Auto {
            self.adaptive = crate::policy::Newcomers::new(pages);
        }
    }

    /// Marks what is removed from now on as the operator's doing (a flush, `true`) or the
    /// policy's (`false`, the default): `auto`'s credit learns only from the policy's.
    pub fn set_flushing(&mut self, flushing: bool) {
        self.flushing = flushing;
    }

    /// Pages referenced by nodes, per slot.
    pub fn pages_in(&self, slot: Slot) -> usize {
        match slot {
            Slot::Device => self.device_pages,
            Slot::Host => self.host_pages,
        }
    }

    /// Live nodes, root included.
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free_ids.len()
    }

    /// Heap bytes of tree metadata: the node arena, each node's block (tokens and page lists),
    /// the edge map, hashes, window lists, the policy's per-node state, the eviction sets and
    /// the GDSF history. Hash tables count a bucket per 7/8 of their capacity; the eviction
    /// sets their runs' capacity. The allocator's own overhead per block is not counted.
    pub fn metadata_bytes(&self) -> usize {
        let table = |cap: usize, entry: usize| (cap + cap / 7) * (entry + 1);
        let mut b = self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.free_ids.capacity() * 4
            + table(self.edges.capacity(), 4)
            + self.hashes.capacity() * 16
            + table(
                self.windows.capacity(),
                std::mem::size_of::<(u32, Windows)>(),
            )
            + self.prio.capacity() * 8
            + self.gdsf.capacity() * std::mem::size_of::<GdsfNode>();
        for n in &self.nodes {
            b += n.heap_bytes();
        }
        for h in &self.hashes {
            b += h.len() * 16;
        }
        for w in self.windows.values() {
            b += (w.device.capacity() + w.host.capacity()) * 4;
        }
        let sets = self.device_leaves.bytes()
            + self.host_leaves.bytes()
            + self.device_windows.bytes()
            + self.host_windows.bytes();
        let history = match self.policy {
            EvictionPolicy::Auto => self.history.bytes() + self.adaptive.bytes(),
            p if p.has_history() => self.history.bytes(),
            _ => 0,
        };
        b + sets + history
    }

    #[inline]
    pub fn view(&self, id: NodeId) -> NodeView<'_> {
        let i = id.0 as usize;
        let n = &self.nodes[i];
        assert!(n.live(), "node {id:?} is not live");
        let (tokens, device, host) = n.parts(self.g());
        let (device_win, host_win) = self.windows_of(id.0);
        NodeView {
            id,
            parent: NodeId(n.parent),
            tokens,
            hashes: self.hashes.get(i).map_or(&[], |h| h),
            device,
            host,
            device_win,
            host_win,
            in_storage: n.has(node::IN_STORAGE),
            children: n.children as usize,
            device_children: n.device_children,
            lock_ref: n.lock_ref,
            host_lock: n.host_lock as u32,
            hits: n.hits as u32,
            last_access: n.stamp,
        }
    }

    pub fn is_live(&self, id: NodeId) -> bool {
        self.nodes.get(id.0 as usize).is_some_and(|n| n.live())
    }

    /// Hash of the last page of `id` (ROOT's is [`PageHash::ROOT`]); None without hashing.
    pub fn last_hash(&self, id: NodeId) -> Option<PageHash> {
        self.namespace.as_ref()?;
        if id == ROOT {
            return Some(PageHash::ROOT);
        }
        self.hashes[id.0 as usize].last().copied()
    }

    /// Nodes from the root (excluded) down to `id`.
    pub fn path_to(&self, id: NodeId) -> Vec<NodeId> {
        let mut v = Vec::new();
        self.path_into(id, &mut v);
        v
    }

    /// [`RadixTree::path_to`] into `out` (cleared first; no allocation once it has room).
    pub fn path_into(&self, id: NodeId, out: &mut Vec<NodeId>) {
        out.clear();
        let mut c = id;
        while c != ROOT {
            out.push(c);
            c = NodeId(self.nodes[c.0 as usize].parent);
        }
        out.reverse();
    }

    /// The child of `parent` whose first page is `page`.
    fn child_of(&self, parent: u32, page: &[u32]) -> Option<u32> {
        let (nodes, g) = (&self.nodes, self.g());
        let eq = |&c: &u32| {
            let n = &nodes[c as usize];
            n.parent == parent && n.tokens(g).slice(0, g.ps) == *page
        };
        self.edges
            .find(edge_hash(parent, page_key(page)), eq)
            .copied()
    }

    /// Files the edge to `c` (its parent and tokens set).
    fn add_edge(&mut self, c: u32) {
        let (nodes, g) = (&self.nodes, self.g());
        let h = child_hash(nodes, g, c);
        self.edges.insert_unique(h, c, |&x| child_hash(nodes, g, x));
    }

    /// The edge entry of the child of `parent` starting with `page_key`, which must be `c`.
    fn edge_mut(&mut self, parent: u32, page_key: u64, c: u32) -> &mut u32 {
        self.edges
            .find_mut(edge_hash(parent, page_key), |&x| x == c)
            .expect("every node is its parent's child")
    }

    /// The tokens of `id`, as stored.
    fn tokens(&self, id: u32) -> Tokens<'_> {
        self.nodes[id as usize].tokens(self.g())
    }

    /// `id`'s pages in `slot`.
    pub(super) fn slot(&self, id: u32, slot: Slot) -> Pages<'_> {
        let (n, g) = (&self.nodes[id as usize], self.g());
        match slot {
            Slot::Device => n.device(g),
            Slot::Host => n.host(g),
        }
    }

    fn on_device(&self, id: u32) -> bool {
        self.nodes[id as usize].has(node::DEVICE)
    }

    fn on_host(&self, id: u32) -> bool {
        self.nodes[id as usize].has(node::HOST)
    }

    /// The history key of `id`: where it starts (its parent's base and its first page).
    fn chain_of(&self, id: u32) -> u64 {
        let (n, g) = (&self.nodes[id as usize], self.g());
        chain_step(
            self.gdsf[n.parent as usize].base,
            n.tokens(g).slice(0, g.ps),
        )
    }

    /// Longest cached whole-page prefix of `tokens`. Splits a node when the match ends inside
    /// it, and counts a hit on every matched node.
    pub fn match_prefix(&mut self, tokens: &[u32]) -> TreeMatch {
        self.clock += 1;
        let ps = self.page_size;
        let n = tokens.len() / ps * ps;
        let mut m = TreeMatch {
            last: ROOT,
            ..TreeMatch::default()
        };
        let mut cur = 0u32;
        let mut pos = 0;
        while pos < n {
            let Some(c) = self.child_of(cur, &tokens[pos..pos + ps]) else {
                break;
            };
            let node_tokens = self.tokens(c);
            let clen = node_tokens.len();
            let common = node_tokens.common_prefix(&tokens[pos..n]) / ps * ps;
            let c = if common < clen {
                self.split(c, common)
            } else {
                c
            };
            self.touch(c, true);
            if self.on_device(c) {
                m.device_tokens += common;
            } else {
                m.host_tokens += common;
            }
            m.path.push(NodeId(c));
            pos += common;
            cur = c;
            if common < clen {
                break;
            }
        }
        m.last = NodeId(cur);
        m
    }

    /// Like [`RadixTree::match_prefix`] without any change: no split, no hit, no clock.
    /// Returns (device tokens, host tokens) of the longest cached whole-page prefix.
    pub fn peek(&self, tokens: &[u32]) -> (usize, usize) {
        let ps = self.page_size;
        let n = tokens.len() / ps * ps;
        let (mut dev, mut host, mut pos, mut cur) = (0, 0, 0, 0u32);
        while pos < n {
            let Some(c) = self.child_of(cur, &tokens[pos..pos + ps]) else {
                break;
            };
            let node_tokens = self.tokens(c);
            let common = node_tokens.common_prefix(&tokens[pos..n]) / ps * ps;
            if self.on_device(c) {
                dev += common;
            } else {
                host += common;
            }
            pos += common;
            cur = c;
            if common < node_tokens.len() {
                break;
            }
        }
        (dev, host)
    }

    /// Splits since the last call, oldest first: (the suffix, which kept its id; its new
    /// head, which took the first part of its pages).
    pub fn take_splits(&mut self) -> Vec<(NodeId, NodeId)> {
        std::mem::take(&mut self.splits)
    }

    /// The eviction priority of `id` under the policy.
    fn priority_of(&self, id: u32) -> u64 {
        match self.policy {
            EvictionPolicy::Lru => self.nodes[id as usize].stamp,
            _ => self.prio[id as usize],
        }
    }

    /// `id`'s key in the eviction sets: a retired node's has priority 0 (it sorts first).
    fn key_of(&self, id: u32) -> Key {
        if self.nodes[id as usize].has(node::RETIRED) {
            return id as u128;
        }
        let tie = match self.policy {
            EvictionPolicy::Gdsf | EvictionPolicy::Auto => self.nodes[id as usize].stamp as u32,
            _ => 0,
        };
        (self.priority_of(id) as u128) << 64 | (tie as u128) << 32 | id as u128
    }

    fn touch(&mut self, id: u32, hit: bool) {
        // Used again: no longer a dead end (its key changes, so out of the sets first).
        let revived = self.nodes[id as usize].has(node::RETIRED);
        if revived {
            self.unfile(id);
            self.nodes[id as usize].set(node::RETIRED, false);
        }
        if matches!(self.policy, EvictionPolicy::Sieve | EvictionPolicy::S3Fifo) {
            // A hit marks the node (a visited bit, a frequency); its place in the queue (its
            // key) does not change.
            let n = &mut self.nodes[id as usize];
            n.stamp = self.clock;
            if hit {
                n.hits = n.hits.saturating_add(1);
                match self.policy {
                    EvictionPolicy::Sieve => n.set(node::VISITED, true),
                    _ => self.s3_hit(id),
                }
            }
            if revived {
                self.refresh(id);
            }
            return;
        }
        // The key changes: out of the sets first (they are found by the old key), back after.
        self.unfile(id);
        let clock = self.clock;
        let n = &mut self.nodes[id as usize];
        n.stamp = clock;
        if hit {
            n.hits = n.hits.saturating_add(1);
            n.set(node::PROBATION, false);
        }
        if self.policy.is_gdsf() {
            let one = match self.policy {
                EvictionPolicy::Auto => crate::policy::UNIT,
                _ => 1,
            };
            if hit {
                self.set_freq(id, self.freq(id).saturating_add(one));
            }
            self.prio[id as usize] = self.inflation + self.freq(id) as u64;
        }
        self.refresh(id);
    }

    /// The frequency of GDSF, `auto` (fixed point) and S3-FIFO (0 to 3) of node `id`.
    fn freq(&self, id: u32) -> u32 {
        self.nodes[id as usize].freq as u32
    }

    /// Sets it, saturating at 65,535 (GDSF: accesses; `auto`: 3,276 accesses, beyond the
    /// history's 1,792).
    fn set_freq(&mut self, id: u32, f: u32) {
        self.nodes[id as usize].freq = f.min(u16::MAX as u32) as u16;
    }

    /// Every live node id, root excluded.
    pub fn node_ids(&self) -> Vec<NodeId> {
        (1..self.nodes.len() as u32)
            .filter(|&i| self.nodes[i as usize].live())
            .map(NodeId)
            .collect()
    }
}

/// A window list cut from a node: empty when no page of it holds a window page.
fn window_half(v: Vec<u32>) -> Vec<u32> {
    if v.iter().all(|&w| w == NO_PAGE) {
        Vec::new()
    } else {
        v
    }
}

mod arena;
mod auto;
mod check;
mod insert;
mod keyset;
mod node;
mod packed;
mod residency;
mod s3fifo;
mod window;

#[cfg(test)]
mod tests;
