//! Insertion: walking a token sequence into the tree, filling a slot's pages (and window
//! pages) where nodes lack them, new leaves, and splitting nodes at page boundaries.

use rustc_hash::FxHashMap;

use super::{
    chain_step, common_prefix, page_key, window_half, Inserted, Node, NodeId, RadixTree, Slot,
    NO_PAGE, ROOT,
};
use crate::hash::PageHash;
use crate::policy::EvictionPolicy;

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
                        let (a, b) = (page_at(pos), page_at(pos + common));
                        self.give(c, slot, (&pages[a..b], win(a, b)), &mut out);
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
            self.fill(c, slot, pages.to_vec());
            out.filled.push(NodeId(c));
        } else {
            out.unused.extend_from_slice(pages);
        }
        let left = self.adopt_windows(c, slot, windows);
        out.unused_windows.extend(left);
    }

    pub(super) fn slot(&self, id: u32, slot: Slot) -> &Vec<u32> {
        let n = &self.nodes[id as usize];
        match slot {
            Slot::Device => &n.device,
            Slot::Host => &n.host,
        }
    }

    pub(super) fn new_leaf(&mut self, parent: u32, key: u64, tokens: &[u32]) -> u32 {
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
            chain = chain_step(self.nodes[parent as usize].base, &tokens[..self.page_size]);
            freq = self.history.take(chain).saturating_add(1);
        }
        let node = Node {
            parent,
            tokens: tokens.to_vec(),
            hashes,
            chain,
            base: chain,
            freq,
            live: true,
            ..Node::default()
        };
        let id = self.alloc_node(node);
        self.nodes[parent as usize].children.insert(key, id);
        self.refresh(parent);
        id
    }

    /// Puts `node` in a free arena slot (or a new one) and returns its id.
    fn alloc_node(&mut self, node: Node) -> u32 {
        match self.free_ids.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
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
    pub(super) fn split(&mut self, id: u32, at: usize) -> u32 {
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
        let device_win = window_half(cut(&mut n.device_win, p));
        let host_win = window_half(cut(&mut n.host_win, p));
        n.device_win = window_half(std::mem::take(&mut n.device_win));
        n.host_win = window_half(std::mem::take(&mut n.host_win));
        let on_device = !n.device.is_empty();
        let suffix_key = page_key(&n.tokens[..ps]);
        let parent = n.parent;
        // The head starts where the node started: it takes the node's key, and as base its
        // key too; the suffix's key follows from that, and its base (its children's keys)
        // stays: O(1), whatever lies below.
        let chain = n.chain;
        if self.policy == EvictionPolicy::Gdsf {
            n.chain = chain_step(chain, &n.tokens[..ps]);
        }
        let n = &mut self.nodes[id as usize];
        let node = Node {
            parent,
            tokens,
            hashes,
            chain,
            base: chain,
            device,
            host,
            device_win,
            host_win,
            in_storage: n.in_storage,
            children: FxHashMap::default(),
            device_children: on_device as u32,
            lock_ref: n.lock_ref,
            // An L3 write in flight reads both halves: the head keeps the pins (its window
            // pages are not protected by its child), and the write unpins it when it lands
            // (it follows the split, `TieredCache::absorb_splits`).
            host_lock: n.host_lock,
            hits: n.hits,
            freq: n.freq,
            last_access: n.last_access,
            priority: n.priority,
            dev_key: None,
            host_key: None,
            dwin_key: None,
            hwin_key: None,
            live: true,
        };
        let new_id = self.alloc_node(node);
        self.nodes[new_id as usize].children.insert(suffix_key, id);
        self.nodes[id as usize].parent = new_id;
        let pkey = page_key(&self.nodes[new_id as usize].tokens[..ps]);
        self.nodes[parent as usize].children.insert(pkey, new_id);
        self.splits.push((NodeId(id), NodeId(new_id)));
        // The suffix's main residency did not change and the new node has a child on every
        // tier the suffix uses, so neither is a leaf of a tier; their window pages may now sit
        // in either half.
        self.refresh(id);
        self.refresh(new_id);
        new_id
    }
}
