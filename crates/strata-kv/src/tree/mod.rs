//! The radix tree over token ids, page-aligned, recording per node where its pages live.
//!
//! Arena of nodes; each edge holds whole pages. Residency invariants (checked by
//! [`RadixTree::check`]):
//! * every node but the root holds device pages, host pages, or both;
//! * device residency is prefix-closed (a node on device has its parent on device), because the
//!   device tier only ever evicts nodes none of whose children are on device;
//! * host eviction only removes nodes that are off device, unlocked and childless.
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
    /// In-process chained key after this node's last page (GDSF history only; 0 otherwise).
    chain: u64,
    device: Vec<u32>,
    host: Vec<u32>,
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

/// One step of the in-process page chain used to key the eviction history (never leaves the
/// process, so a fast non-cryptographic hash is fine).
fn chain_step(prev: u64, page: &[u32]) -> u64 {
    let mut h = FxHasher::default();
    h.write_u64(prev);
    for &t in page {
        h.write_u32(t);
    }
    h.finish()
}

/// The history remembers one page in [`HISTORY_SAMPLE`], chosen by content so that recording
/// and lookup agree whatever the node boundaries: a quarter of the hash-map traffic, while a
/// prefix of more than a few pages is still recognised.
const HISTORY_SAMPLE: u64 = 4;

fn sampled(chain: u64) -> bool {
    chain.is_multiple_of(HISTORY_SAMPLE)
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
            clock: 0,
            policy,
            inflation: 0,
            history: FrequencyHistory::new(1 << 20),
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

    /// Bounds the eviction history (entries), e.g. to a few times the cache's page count.
    pub fn set_history_cap(&mut self, cap: usize) {
        self.history = FrequencyHistory::new(cap);
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

    /// Heap bytes of tree metadata (nodes, edges, page lists, hashes, eviction sets).
    pub fn metadata_bytes(&self) -> usize {
        let node = std::mem::size_of::<Node>();
        let mut b = self.nodes.capacity() * node + self.free_ids.capacity() * 4;
        for n in &self.nodes {
            b += n.tokens.capacity() * 4
                + n.hashes.capacity() * 16
                + (n.device.capacity() + n.host.capacity()) * 4
                + n.children.capacity() * (8 + 4 + 1);
        }
        b + (self.device_leaves.len() + self.host_leaves.len()) * (std::mem::size_of::<Key>() + 8)
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
            in_storage: n.in_storage,
            children: n.children.len(),
            device_children: n.device_children,
            lock_ref: n.lock_ref,
            // Pins stay on the suffix; the prefix cannot be removed while that child exists.
            host_lock: 0,
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

    /// Inserts `tokens` (whole pages; a trailing partial page is ignored) with one page index per
    /// page for `slot`. Nodes already holding that slot keep their pages (the given ones come
    /// back in `unused`); nodes lacking it adopt the given pages; the rest becomes a new leaf.
    ///
    /// For `Slot::Device` every node on the path must be on device afterwards, which holds because
    /// the walk goes root-first and fills any gap.
    ///
    /// `pages` covers the whole pages of `tokens` after the first `skip` pages; those leading
    /// pages must already be in the tree (e.g. a locked match) and are only walked.
    pub fn insert(&mut self, tokens: &[u32], pages: &[u32], slot: Slot, skip: usize) -> Inserted {
        self.clock += 1;
        let ps = self.page_size;
        let n = tokens.len() / ps * ps;
        let skip_tok = skip * ps;
        assert!(
            skip_tok <= n && pages.len() == (n - skip_tok) / ps,
            "one page index per whole page"
        );
        let mut out = Inserted {
            last: ROOT,
            ..Inserted::default()
        };
        let page_at = |pos: usize| (pos - skip_tok) / ps;
        let mut cur = 0u32;
        let mut pos = 0;
        while pos < n {
            match self.child_of(cur, &tokens[pos..pos + ps]) {
                Some(c) => {
                    let clen = self.nodes[c as usize].tokens.len();
                    let mut common =
                        common_prefix(&self.nodes[c as usize].tokens, &tokens[pos..n]) / ps * ps;
                    if pos < skip_tok {
                        common = common.min(skip_tok - pos);
                    }
                    let c = if common < clen {
                        self.split(c, common)
                    } else {
                        c
                    };
                    if pos >= skip_tok {
                        let pg = &pages[page_at(pos)..page_at(pos + common)];
                        if self.slot(c, slot).is_empty() {
                            self.fill(c, slot, pg.to_vec());
                            out.filled.push(NodeId(c));
                        } else {
                            out.unused.extend_from_slice(pg);
                        }
                    }
                    self.touch(c, false);
                    pos += common;
                    cur = c;
                }
                None => {
                    let key = page_key(&tokens[pos..pos + ps]);
                    if pos < skip_tok || self.nodes[cur as usize].children.contains_key(&key) {
                        // The skipped prefix is gone, or a 64-bit key collision with a different
                        // page: cache no further.
                        break;
                    }
                    let c = self.new_leaf(cur, key, &tokens[pos..n]);
                    self.fill(c, slot, pages[page_at(pos)..].to_vec());
                    self.touch(c, false);
                    out.filled.push(NodeId(c));
                    pos = n;
                    cur = c;
                }
            }
        }
        out.unused
            .extend_from_slice(&pages[page_at(pos.max(skip_tok))..]);
        out.last = NodeId(cur);
        out.tokens = pos;
        out
    }

    fn slot(&self, id: u32, slot: Slot) -> &Vec<u32> {
        let n = &self.nodes[id as usize];
        match slot {
            Slot::Device => &n.device,
            Slot::Host => &n.host,
        }
    }

    fn new_leaf(&mut self, parent: u32, key: u64, tokens: &[u32]) -> u32 {
        let hashes = match &self.namespace {
            Some(ns) => {
                let p = self.last_hash(NodeId(parent)).unwrap_or(PageHash::ROOT);
                ns.chain(p, tokens, self.page_size)
            }
            None => Vec::new(),
        };
        // This insertion is an access too: a page that comes back after eviction then carries
        // its earlier accesses plus this one, which is how reuse beyond the cache is detected.
        let mut freq = 1;
        let mut chain = 0;
        if self.policy == EvictionPolicy::Gdsf {
            chain = self.nodes[parent as usize].chain;
            for page in tokens.chunks_exact(self.page_size) {
                chain = chain_step(chain, page);
                if sampled(chain) {
                    freq = freq.max(self.history.take(chain).saturating_add(1));
                }
            }
        }
        let node = Node {
            parent,
            tokens: tokens.to_vec(),
            hashes,
            chain,
            freq,
            live: true,
            ..Node::default()
        };
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.nodes[parent as usize].children.insert(key, id);
        self.refresh(parent);
        id
    }

    /// Splits `id` so that it keeps only its last `tail_pages` pages (its head becomes a new
    /// parent node). Eviction uses it to free just what is needed, keeping the more valuable
    /// head of a prefix. No-op when the node is not longer than that.
    pub fn split_tail(&mut self, id: NodeId, tail_pages: usize) {
        let len = self.nodes[id.0 as usize].tokens.len();
        let keep = tail_pages.saturating_mul(self.page_size);
        if tail_pages > 0 && keep < len {
            self.split(id.0, len - keep);
        }
    }

    /// Splits `id` so that its first `at` tokens become a new parent node; returns that parent.
    fn split(&mut self, id: u32, at: usize) -> u32 {
        let ps = self.page_size;
        debug_assert!(at > 0 && at.is_multiple_of(ps) && at < self.nodes[id as usize].tokens.len());
        let p = at / ps;
        let n = &mut self.nodes[id as usize];
        // The head keeps the original allocation and only the tail is copied: O(tail), which
        // is what eviction (a small tail off a long node) needs.
        fn cut<T>(v: &mut Vec<T>, at: usize) -> Vec<T> {
            if v.is_empty() {
                return Vec::new();
            }
            let tail = v.split_off(at);
            let mut head = std::mem::replace(v, tail);
            head.shrink_to_fit();
            head
        }
        let tokens = cut(&mut n.tokens, at);
        let hashes = cut(&mut n.hashes, p);
        let device = cut(&mut n.device, p);
        let host = cut(&mut n.host, p);
        let on_device = !n.device.is_empty();
        let suffix_key = page_key(&n.tokens[..ps]);
        let parent = n.parent;
        let chain = if self.policy == EvictionPolicy::Gdsf {
            let start = self.nodes[parent as usize].chain;
            tokens.chunks_exact(ps).fold(start, chain_step)
        } else {
            0
        };
        let n = &mut self.nodes[id as usize];
        let node = Node {
            parent,
            tokens,
            hashes,
            chain,
            device,
            host,
            in_storage: n.in_storage,
            children: FxHashMap::default(),
            device_children: on_device as u32,
            lock_ref: n.lock_ref,
            // Pins stay on the suffix; the prefix cannot be removed while that child exists.
            host_lock: 0,
            hits: n.hits,
            freq: n.freq,
            last_access: n.last_access,
            priority: n.priority,
            dev_key: None,
            host_key: None,
            live: true,
        };
        let new_id = match self.free_ids.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.nodes[new_id as usize].children.insert(suffix_key, id);
        self.nodes[id as usize].parent = new_id;
        let pkey = page_key(&self.nodes[new_id as usize].tokens[..ps]);
        self.nodes[parent as usize].children.insert(pkey, new_id);
        self.splits.push((NodeId(id), NodeId(new_id)));
        // The suffix's residency did not change, so its set membership holds; the new node has a
        // child on every tier the suffix uses and so is in no set.
        new_id
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

mod check;
mod residency;

#[cfg(test)]
mod tests;
