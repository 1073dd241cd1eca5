//! Insertion: walking a token sequence into the tree, filling a slot's pages (and window
//! pages) where nodes lack them, new leaves, and splitting nodes at page boundaries.

use super::node::{IN_STORAGE, LIVE, PROBATION, RETIRED, VISITED, WINDOWS};
use super::packed::{Pages, Tokens};
use super::{
    chain_step, window_half, GdsfNode, Inserted, Node, NodeId, RadixTree, Slot, Windows, NO_PAGE,
    ROOT,
};
use crate::hash::PageHash;
use crate::policy::EvictionPolicy;

/// `v[a..b]`, or nothing when `v` is empty (a tier the node is not in).
fn cut(v: Pages<'_>, a: usize, b: usize) -> Pages<'_> {
    if v.is_empty() {
        Pages::EMPTY
    } else {
        v.slice(a, b)
    }
}

impl RadixTree {
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
        self.insert_with_windows(tokens, pages, &[], slot, skip)
    }

    /// [`RadixTree::insert`] with a window page per given page (`windows` empty for none, or
    /// one per page, [`NO_PAGE`] where a page has none). A node that keeps its own pages
    /// adopts the given window pages where it lacks them.
    pub fn insert_with_windows(
        &mut self,
        tokens: &[u32],
        pages: &[u32],
        windows: &[u32],
        slot: Slot,
        skip: usize,
    ) -> Inserted {
        self.clock += 1;
        let ps = self.page_size;
        let n = tokens.len() / ps * ps;
        let skip_tok = skip * ps;
        let ok = skip_tok <= n && pages.len() == (n - skip_tok) / ps;
        assert!(ok, "one page index per whole page");
        let ok = windows.is_empty() || windows.len() == pages.len();
        assert!(ok, "one window entry per page");
        self.check_page_bound(pages);
        let win = |a: usize, b: usize| windows.get(a..b).unwrap_or(&[]);
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
                    let node_tokens = self.tokens(c);
                    let clen = node_tokens.len();
                    let mut common = node_tokens.common_prefix(&tokens[pos..n]) / ps * ps;
                    if pos < skip_tok {
                        common = common.min(skip_tok - pos);
                    }
                    let c = if common < clen {
                        self.split(c, common)
                    } else {
                        c
                    };
                    if pos >= skip_tok {
                        let (a, b) = (page_at(pos), page_at(pos + common));
                        self.give(c, slot, (&pages[a..b], win(a, b)), &mut out);
                    }
                    self.touch(c, false);
                    pos += common;
                    cur = c;
                }
                None => {
                    if pos < skip_tok {
                        // The skipped prefix is gone: cache no further.
                        break;
                    }
                    let c = self.new_leaf(cur, &tokens[pos..n], slot, &pages[page_at(pos)..]);
                    let left = self.adopt_windows(c, slot, win(page_at(pos), pages.len()));
                    out.unused_windows.extend(left);
                    self.touch(c, false);
                    out.filled.push(NodeId(c));
                    pos = n;
                    cur = c;
                }
            }
        }
        let rest = page_at(pos.max(skip_tok));
        out.unused.extend_from_slice(&pages[rest..]);
        let rest_win = win(rest, pages.len()).iter().filter(|&&w| w != NO_PAGE);
        out.unused_windows.extend(rest_win);
        out.last = NodeId(cur);
        out.tokens = pos;
        out
    }

    /// Gives an existing node `pages` (and window pages) in `slot` if it lacks them; what it
    /// does not take goes to `out`'s unused lists.
    fn give(&mut self, c: u32, slot: Slot, (pages, windows): (&[u32], &[u32]), out: &mut Inserted) {
        if self.slot(c, slot).is_empty() {
            self.fill(c, slot, pages);
            out.filled.push(NodeId(c));
        } else {
            out.unused.extend_from_slice(pages);
        }
        let left = self.adopt_windows(c, slot, windows);
        out.unused_windows.extend(left);
    }

    /// A new child of `parent` holding `tokens` and `pages` in `slot`.
    pub(super) fn new_leaf(
        &mut self,
        parent: u32,
        tokens: &[u32],
        slot: Slot,
        pages: &[u32],
    ) -> u32 {
        let ps = self.page_size;
        let g = self.g();
        let hashes = match &self.namespace {
            Some(ns) => {
                let p = self.last_hash(NodeId(parent)).unwrap_or(PageHash::ROOT);
                ns.chain(p, tokens, ps)
            }
            None => Vec::new(),
        };
        let (device, host) = match slot {
            Slot::Device => (pages, &[][..]),
            Slot::Host => (&[][..], pages),
        };
        let mut node = Node::pack(
            Tokens::Wide(tokens),
            g,
            Pages::Wide(device),
            Pages::Wide(host),
        );
        node.parent = parent;
        node.flags |= LIVE;
        let id = self.alloc_node(node);
        if self.namespace.is_some() {
            self.hashes[id as usize] = hashes.into_boxed_slice();
        }
        if self.policy.has_history() {
            let chain = chain_step(self.gdsf[parent as usize].base, Tokens::Wide(&tokens[..ps]));
            self.gdsf[id as usize] = GdsfNode { base: chain };
            self.set_freq(id, 0);
        }
        match self.policy {
            // This insertion is an access too: a page that comes back after eviction then
            // carries its earlier accesses plus this one, which is how reuse beyond the cache
            // is detected.
            EvictionPolicy::Gdsf => {
                let chain = self.gdsf[id as usize].base;
                let known = self.history.take(chain);
                self.set_freq(id, known.saturating_add(1));
            }
            EvictionPolicy::Auto => {
                let chain = self.gdsf[id as usize].base;
                self.auto_place(id, chain, pages.len());
            }
            EvictionPolicy::S3Fifo => self.s3_place(id, self.gdsf[id as usize].base),
            // Its place in the queue: when it came.
            EvictionPolicy::Sieve => self.prio[id as usize] = self.clock,
            EvictionPolicy::Lru => {}
        }
        self.add_edge(id);
        self.nodes[parent as usize].children += 1;
        self.refresh(parent);
        self.filled(id, slot, pages.len());
        id
    }

    /// Splits `id` so that it keeps only its last `tail_pages` pages (its head becomes a new
    /// parent node). Eviction uses it to free just what is needed, keeping the more valuable
    /// head of a prefix. No-op when the node is not longer than that, or when it holds window
    /// pages: its head would become an inner node, whose window pages are evicted first as
    /// state a sequence has moved past, while it is still the end a continuation reads; or
    /// when it is retired (an answer its session left goes whole, not its tail only).
    pub fn split_tail(&mut self, id: NodeId, tail_pages: usize) {
        let node = &self.nodes[id.0 as usize];
        // A retired answer goes whole (its head would be a live-looking leaf).
        if node.has(WINDOWS) || node.has(RETIRED) {
            return;
        }
        let len = node.token_len(self.g());
        let keep = tail_pages.saturating_mul(self.page_size);
        if tail_pages > 0 && keep < len {
            self.split(id.0, len - keep);
        }
    }

    /// Splits `id` so that its first `at` tokens become a new parent node; returns that parent.
    pub(super) fn split(&mut self, id: u32, at: usize) -> u32 {
        let ps = self.page_size;
        let g = self.g();
        let i = id as usize;
        debug_assert!(at > 0 && at.is_multiple_of(ps) && at < self.nodes[i].token_len(g));
        let p = at / ps;
        let n = &self.nodes[i];
        let (tokens, device, host) = n.parts(g);
        let len = tokens.len();
        let np = len / ps;
        let mut head = Node::pack(tokens.slice(0, at), g, cut(device, 0, p), cut(host, 0, p));
        let tail = Node::pack(
            tokens.slice(at, len),
            g,
            cut(device, p, np),
            cut(host, p, np),
        );
        let head_key = tokens.page_key(ps);
        head.parent = n.parent;
        head.stamp = n.stamp;
        head.children = 1;
        head.device_children = !device.is_empty() as u32;
        head.lock_ref = n.lock_ref;
        // An L3 write in flight reads both halves: the head keeps the pins (its window pages
        // are not protected by its child), and the write unpins it when it lands (it follows
        // the split, `TieredCache::absorb_splits`).
        head.host_lock = n.host_lock;
        head.hits = n.hits;
        head.flags |= LIVE | (n.flags & (IN_STORAGE | VISITED | PROBATION));
        let parent = n.parent;
        // The suffix keeps its id, its place in the eviction sets (its key does not change)
        // and everything but the head's part of its tokens and pages.
        self.nodes[i].take_block(tail);
        let new_id = self.alloc_node(head);
        self.split_side_tables(id, new_id, p);
        // The head takes the node's edge; the suffix hangs below it.
        *self.edge_mut(parent, head_key, id) = new_id;
        self.nodes[i].parent = new_id;
        self.add_edge(id);
        self.splits.push((NodeId(id), NodeId(new_id)));
        // The suffix's main residency did not change and the new node has a child on every
        // tier the suffix uses, so neither is a leaf of a tier; their window pages may now sit
        // in either half.
        self.refresh(id);
        self.refresh(new_id);
        new_id
    }

    /// Gives the new head `head` of a split of `id` after `p` pages its part of `id`'s hashes,
    /// window lists and policy state.
    fn split_side_tables(&mut self, id: u32, head: u32, p: usize) {
        let (i, h) = (id as usize, head as usize);
        if self.namespace.is_some() {
            let all = std::mem::take(&mut self.hashes[i]);
            self.hashes[h] = all[..p].into();
            self.hashes[i] = all[p..].into();
        }
        if !self.prio.is_empty() {
            self.prio[h] = self.prio[i];
        }
        if self.policy.has_history() {
            // The head starts where the node started: it takes the node's key, and as base
            // its key too; the suffix's key follows from that, and its base (its children's
            // keys) stays: O(1), whatever lies below.
            let start = self.chain_of(head);
            self.gdsf[h] = GdsfNode { base: start };
            self.set_freq(head, self.freq(id));
        }
        if let Some(w) = self.windows.remove(&id) {
            let cut = |mut v: Vec<u32>| {
                if v.is_empty() {
                    return (Vec::new(), Vec::new());
                }
                let tail = v.split_off(p);
                (window_half(v), window_half(tail))
            };
            let (dh, dt) = cut(w.device);
            let (hh, ht) = cut(w.host);
            self.put_windows(
                head,
                Windows {
                    device: dh,
                    host: hh,
                },
            );
            self.put_windows(
                id,
                Windows {
                    device: dt,
                    host: ht,
                },
            );
        }
    }

    /// Stores `id`'s window lists (none when both are empty).
    pub(super) fn put_windows(&mut self, id: u32, w: Windows) {
        let some = !w.device.is_empty() || !w.host.is_empty();
        self.nodes[id as usize].set(WINDOWS, some);
        if some {
            self.windows.insert(id, w);
        } else {
            self.windows.remove(&id);
        }
    }
}
