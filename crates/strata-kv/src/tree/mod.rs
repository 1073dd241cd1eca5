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

use std::collections::BTreeSet;
use std::hash::Hasher;

use rustc_hash::{FxHashMap, FxHasher};

use crate::hash::{HashNamespace, PageHash};
use crate::policy::{EvictionPolicy, FrequencyHistory};

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

type Key = (u64, u64, u32);

#[derive(Debug, Default)]
struct Node {
    parent: u32,
    tokens: Vec<u32>,
    hashes: Vec<PageHash>,
    /// In-process key of where this node starts: its parent's `base` and its first page (GDSF
    /// history only; 0 otherwise). An evicted node's frequency is remembered under it, and a
    /// new leaf starting at the same place (the same parent, then the same page) takes it
    /// back: one key per node, never per page.
    chain: u64,
    /// What this node's children's keys chain from: its own key when it was made; a split
    /// leaves it to the deeper half (so the children keep their keys) and gives the new head
    /// its key as base.
    base: u64,
    device: Vec<u32>,
    host: Vec<u32>,
    /// Window pages per tier: empty when the node holds none there, else one entry per page
    /// ([`NO_PAGE`] for a page without one), with at least one page.
    device_win: Vec<u32>,
    host_win: Vec<u32>,
    in_storage: bool,
    children: FxHashMap<u64, u32>,
    device_children: u32,
    lock_ref: u32,
    host_lock: u32,
    hits: u32,
    freq: u32,
    last_access: u64,
    priority: u64,
    dev_key: Option<Key>,
    host_key: Option<Key>,
    dwin_key: Option<Key>,
    hwin_key: Option<Key>,
    live: bool,
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
    pub tokens: &'a [u32],
    pub hashes: &'a [PageHash],
    pub device: &'a [u32],
    pub host: &'a [u32],
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
    nodes: Vec<Node>,
    free_ids: Vec<u32>,
    device_leaves: BTreeSet<Key>,
    host_leaves: BTreeSet<Key>,
    /// Unlocked nodes holding window pages, per tier (any node, not only leaves).
    device_windows: BTreeSet<Key>,
    host_windows: BTreeSet<Key>,
    /// Window pages referenced by nodes, per tier.
    device_win_pages: usize,
    host_win_pages: usize,
    clock: u64,
    policy: EvictionPolicy,
    inflation: u64,
    history: FrequencyHistory,
    namespace: Option<HashNamespace>,
    device_pages: usize,
    host_pages: usize,
    /// (suffix, new head) of every split since the last [`RadixTree::take_splits`]: lets the
    /// owner of lists of node ids (copies in flight) follow nodes that were split meanwhile.
    splits: Vec<(NodeId, NodeId)>,
}

fn page_key(page: &[u32]) -> u64 {
    if page.len() == 1 {
        return page[0] as u64;
    }
    let mut h = FxHasher::default();
    for &t in page {
        h.write_u32(t);
    }
    h.finish()
}

/// One step of the in-process key chain of the eviction history (never leaves the process, so
/// a fast non-cryptographic hash is fine): the page's tokens two at a time in two independent
/// multiply-rotate lanes, mixed so that every bit depends on all of them.
fn chain_step(prev: u64, page: &[u32]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    const L: u64 = 0xC2B2_AE3D_27D4_EB4F;
    let (mut a, mut b) = (prev ^ K, prev.rotate_left(32) ^ L ^ page.len() as u64);
    let mut pairs = page.chunks_exact(4);
    for q in &mut pairs {
        let x = q[0] as u64 | (q[1] as u64) << 32;
        let y = q[2] as u64 | (q[3] as u64) << 32;
        a = (a ^ x).wrapping_mul(K).rotate_left(31);
        b = (b ^ y).wrapping_mul(L).rotate_left(29);
    }
    for &t in pairs.remainder() {
        a = (a ^ t as u64).wrapping_mul(K).rotate_left(31);
    }
    let h = (a ^ b.rotate_left(23)).wrapping_mul(K);
    h ^ (h >> 29)
}

/// Length of the common prefix of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    let n = a.len().min(b.len());
    // Compare in blocks so the compiler emits wide compares; finish token by token.
    const B: usize = 32;
    let mut i = 0;
    while i + B <= n && a[i..i + B] == b[i..i + B] {
        i += B;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

impl RadixTree {
    /// `namespace` enables stable page hashes (needed for L3 storage, routing events and the
    /// GDSF history); without it pages carry no hash.
    pub fn new(
        page_size: usize,
        policy: EvictionPolicy,
        namespace: Option<HashNamespace>,
    ) -> RadixTree {
        assert!(page_size >= 1, "page size must be at least 1");
        let root = Node {
            live: true,
            ..Node::default()
        };
        RadixTree {
            page_size,
            nodes: vec![root],
            free_ids: Vec::new(),
            splits: Vec::new(),
            device_leaves: BTreeSet::new(),
            host_leaves: BTreeSet::new(),
            device_windows: BTreeSet::new(),
            host_windows: BTreeSet::new(),
            device_win_pages: 0,
            host_win_pages: 0,
            clock: 0,
            policy,
            inflation: 0,
            history: FrequencyHistory::new(16),
            namespace,
            device_pages: 0,
            host_pages: 0,
        }
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn policy(&self) -> EvictionPolicy {
        self.policy
    }

    pub fn namespace(&self) -> Option<&HashNamespace> {
        self.namespace.as_ref()
    }

    /// Sizes the GDSF eviction history (keys; 2–4 bytes each), e.g. to a few times the
    /// cache's page count. Only GDSF allocates it.
    pub fn set_history_cap(&mut self, cap: usize) {
        if self.policy == EvictionPolicy::Gdsf {
            self.history = FrequencyHistory::new(cap);
        }
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

    /// Heap bytes of tree metadata (nodes, edges, page lists, hashes, eviction sets, the GDSF
    /// history).
    pub fn metadata_bytes(&self) -> usize {
        let node = std::mem::size_of::<Node>();
        let mut b = self.nodes.capacity() * node + self.free_ids.capacity() * 4;
        for n in &self.nodes {
            b += n.tokens.capacity() * 4
                + n.hashes.capacity() * 16
                + (n.device.capacity() + n.host.capacity()) * 4
                + (n.device_win.capacity() + n.host_win.capacity()) * 4
                + n.children.capacity() * (8 + 4 + 1);
        }
        let sets = self.device_leaves.len()
            + self.host_leaves.len()
            + self.device_windows.len()
            + self.host_windows.len();
        let history = match self.policy {
            EvictionPolicy::Gdsf => self.history.bytes(),
            EvictionPolicy::Lru => 0,
        };
        b + sets * (std::mem::size_of::<Key>() + 8) + history
    }

    pub fn view(&self, id: NodeId) -> NodeView<'_> {
        let n = &self.nodes[id.0 as usize];
        assert!(n.live, "node {id:?} is not live");
        NodeView {
            id,
            parent: NodeId(n.parent),
            tokens: &n.tokens,
            hashes: &n.hashes,
            device: &n.device,
            host: &n.host,
            device_win: &n.device_win,
            host_win: &n.host_win,
            in_storage: n.in_storage,
            children: n.children.len(),
            device_children: n.device_children,
            lock_ref: n.lock_ref,
            host_lock: n.host_lock,
            hits: n.hits,
            last_access: n.last_access,
        }
    }

    pub fn is_live(&self, id: NodeId) -> bool {
        self.nodes.get(id.0 as usize).is_some_and(|n| n.live)
    }

    /// Hash of the last page of `id` (ROOT's is [`PageHash::ROOT`]); None without hashing.
    pub fn last_hash(&self, id: NodeId) -> Option<PageHash> {
        self.namespace.as_ref()?;
        if id == ROOT {
            return Some(PageHash::ROOT);
        }
        self.nodes[id.0 as usize].hashes.last().copied()
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

    fn child_of(&self, parent: u32, page: &[u32]) -> Option<u32> {
        let c = *self.nodes[parent as usize].children.get(&page_key(page))?;
        // A 64-bit key collision between different pages is treated as no match.
        (self.nodes[c as usize].tokens[..page.len()] == *page).then_some(c)
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
            let clen = self.nodes[c as usize].tokens.len();
            let common = common_prefix(&self.nodes[c as usize].tokens, &tokens[pos..n]) / ps * ps;
            let c = if common < clen {
                self.split(c, common)
            } else {
                c
            };
            self.touch(c, true);
            if self.nodes[c as usize].device.is_empty() {
                m.host_tokens += common;
            } else {
                m.device_tokens += common;
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
            let node = &self.nodes[c as usize];
            let common = common_prefix(&node.tokens, &tokens[pos..n]) / ps * ps;
            if node.device.is_empty() {
                host += common;
            } else {
                dev += common;
            }
            pos += common;
            cur = c;
            if common < node.tokens.len() {
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

    fn priority_of(&self, n: &Node) -> u64 {
        match self.policy {
            EvictionPolicy::Lru => n.last_access,
            EvictionPolicy::Gdsf => self.inflation + n.freq as u64,
        }
    }

    fn touch(&mut self, id: u32, hit: bool) {
        let clock = self.clock;
        let n = &mut self.nodes[id as usize];
        n.last_access = clock;
        if hit {
            n.hits = n.hits.saturating_add(1);
            n.freq = n.freq.saturating_add(1);
        }
        let p = self.priority_of(&self.nodes[id as usize]);
        self.nodes[id as usize].priority = p;
        self.refresh(id);
    }

    /// Every live node id, root excluded.
    pub fn node_ids(&self) -> Vec<NodeId> {
        (1..self.nodes.len() as u32)
            .filter(|&i| self.nodes[i as usize].live)
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

mod check;
mod insert;
mod residency;
mod window;

#[cfg(test)]
mod tests;
