//! Window pages: the window class of a node's pages, per tier, beside its main pages.
//!
//! A window list is empty (no window page in that tier) or holds one entry per page of the
//! node, [`NO_PAGE`] where that page has none, and at least one real page. Window pages need
//! the tier's main pages (a list in a tier without main pages is empty) but are not
//! prefix-closed: any unlocked node (any position, not only leaves) holding some is a window
//! victim of that tier — inner nodes before leaves (sequence ends), each in the policy's
//! order. A continuation reads window state only just
//! before it starts, which is what lets the cache drop it from the rest of a prefix.

use rustc_hash::FxHashMap;

use super::node::WINDOWS;
use super::{key_id, window_half, NodeId, RadixTree, Slot, TreeMatch, NO_PAGE};

impl RadixTree {
    /// `id`'s window lists (device, host).
    pub(super) fn windows_of(&self, id: u32) -> (&[u32], &[u32]) {
        if !self.nodes[id as usize].has(WINDOWS) {
            return (&[], &[]);
        }
        let w = &self.windows[&id];
        (&w.device, &w.host)
    }

    /// Takes `id`'s window list of `slot` out (put it back with `put_win`).
    fn take_win(&mut self, id: u32, slot: Slot) -> Vec<u32> {
        let Some(w) = self.windows.get_mut(&id) else {
            return Vec::new();
        };
        match slot {
            Slot::Device => std::mem::take(&mut w.device),
            Slot::Host => std::mem::take(&mut w.host),
        }
    }

    /// Sets `id`'s window list of `slot`.
    fn put_win(&mut self, id: u32, slot: Slot, list: Vec<u32>) {
        let mut w = self.windows.remove(&id).unwrap_or_default();
        match slot {
            Slot::Device => w.device = list,
            Slot::Host => w.host = list,
        }
        self.put_windows(id, w);
    }

    fn win_count(&mut self, slot: Slot) -> &mut usize {
        match slot {
            Slot::Device => &mut self.device_win_pages,
            Slot::Host => &mut self.host_win_pages,
        }
    }

    /// Window pages referenced by nodes in `slot`.
    pub fn window_pages_in(&self, slot: Slot) -> usize {
        match slot {
            Slot::Device => self.device_win_pages,
            Slot::Host => self.host_win_pages,
        }
    }

    /// Gives `id` the window pages `given` (one per page, [`NO_PAGE`] for none) wherever it
    /// lacks one in `slot`; returns the given pages it did not take. A node without main pages
    /// in `slot` takes none.
    pub fn adopt_windows(&mut self, id: u32, slot: Slot, given: &[u32]) -> Vec<u32> {
        let real = || given.iter().copied().filter(|&w| w != NO_PAGE);
        if given.is_empty() {
            return Vec::new();
        }
        let pages = self.slot(id, slot).len();
        if pages == 0 {
            return real().collect();
        }
        assert_eq!(given.len(), pages, "one window entry per page");
        let mut left = Vec::new();
        let mut taken = 0;
        let mut list = self.take_win(id, slot);
        if list.is_empty() {
            list.resize(pages, NO_PAGE);
        }
        for (have, &w) in list.iter_mut().zip(given) {
            if w == NO_PAGE {
                continue;
            }
            if *have == NO_PAGE {
                *have = w;
                taken += 1;
            } else {
                left.push(w);
            }
        }
        self.put_win(id, slot, window_half(list));
        *self.win_count(slot) += taken;
        self.refresh(id);
        left
    }

    /// Gives `id` window pages in `slot` where it lacks them (see
    /// [`RadixTree::adopt_windows`]); the node must hold main pages there.
    pub fn set_windows(&mut self, id: NodeId, slot: Slot, given: &[u32]) {
        assert!(
            !self.slot(id.0, slot).is_empty(),
            "window pages need main pages"
        );
        let left = self.adopt_windows(id.0, slot, given);
        assert!(left.is_empty(), "window pages given twice");
    }

    /// Removes `id`'s window pages in `slot` and returns them (real pages only).
    pub fn take_windows(&mut self, id: NodeId, slot: Slot) -> Vec<u32> {
        self.take_windows_before(id, slot, 0)
    }

    /// The next window victim of `slot`, skipping those `skip` refuses (see
    /// [`RadixTree::window_victim_protected`], nothing protected).
    pub fn window_victim(&self, slot: Slot, skip: impl Fn(NodeId) -> bool) -> Option<NodeId> {
        let none = FxHashMap::default();
        self.window_victim_protected(slot, &none, skip)
            .map(|(n, _)| n)
    }

    /// For each node holding window pages in `slot` whose end is a leaf's (a sequence end)
    /// shorter than `span` pages: the ancestors whose last pages that end's span reaches
    /// into, with how many of their last pages it needs.
    pub fn window_protection(&self, slot: Slot, span: usize) -> FxHashMap<NodeId, usize> {
        let set = match slot {
            Slot::Device => &self.device_windows,
            Slot::Host => &self.host_windows,
        };
        let g = self.g();
        let mut out: FxHashMap<NodeId, usize> = FxHashMap::default();
        for n in set.iter().map(key_id) {
            let node = &self.nodes[n.0 as usize];
            if node.children > 0 {
                continue;
            }
            let mut need = span.saturating_sub(node.pages(g));
            let mut p = node.parent;
            while need > 0 && p != 0 {
                let pages = self.nodes[p as usize].pages(g);
                let e = out.entry(NodeId(p)).or_default();
                *e = (*e).max(need.min(pages));
                need = need.saturating_sub(pages);
                p = self.nodes[p as usize].parent;
            }
        }
        out
    }

    /// The next window victim of `slot`, skipping those `skip` refuses, and how many of its
    /// last pages to keep: first inner nodes' window pages (state a sequence has moved past:
    /// checkpoints, earlier turns' ends, branch points) but the last pages a short sequence
    /// end below them still reads (`protect`, from [`RadixTree::window_protection`]); then
    /// leaves' (sequence ends, where conversations and agents continue), whole; then the
    /// protected last pages of inner nodes; each in the policy's order.
    pub fn window_victim_protected(
        &self,
        slot: Slot,
        protect: &FxHashMap<NodeId, usize>,
        skip: impl Fn(NodeId) -> bool,
    ) -> Option<(NodeId, usize)> {
        let set = match slot {
            Slot::Device => &self.device_windows,
            Slot::Host => &self.host_windows,
        };
        let (mut leaf, mut inner) = (None, None);
        for n in set.iter().map(key_id).filter(|&n| !skip(n)) {
            if self.nodes[n.0 as usize].children > 0 {
                let keep = protect.get(&n).copied().unwrap_or(0);
                let (d, h) = self.windows_of(n.0);
                let list = if slot == Slot::Device { d } else { h };
                let front = &list[..list.len().saturating_sub(keep)];
                if front.iter().any(|&w| w != NO_PAGE) {
                    return Some((n, keep));
                }
                inner.get_or_insert((n, 0));
            } else {
                leaf.get_or_insert((n, 0));
            }
        }
        // A protected parent's last pages go with (after) the ends that read them.
        leaf.or(inner)
    }

    /// Removes `id`'s window pages in `slot` but those of its last `keep_last` pages and
    /// returns them (real pages only).
    pub fn take_windows_before(&mut self, id: NodeId, slot: Slot, keep_last: usize) -> Vec<u32> {
        let mut list = self.take_win(id.0, slot);
        let cut = list.len().saturating_sub(keep_last);
        let mut real = Vec::new();
        for w in &mut list[..cut] {
            if *w != NO_PAGE {
                real.push(std::mem::replace(w, NO_PAGE));
            }
        }
        self.put_win(id.0, slot, window_half(list));
        *self.win_count(slot) -= real.len();
        self.refresh(id.0);
        real
    }

    /// Shortens a match to its first `keep` tokens (a page boundary), splitting the node the
    /// new end falls in. Used when the end of a match cannot be continued from (its window
    /// pages are gone).
    pub fn truncate_match(&mut self, m: &mut TreeMatch, keep: usize) {
        assert!(keep.is_multiple_of(self.page_size) && keep <= m.tokens());
        let mut pos = 0;
        let mut path = Vec::new();
        let (mut dev, mut host) = (0, 0);
        for &n in &m.path {
            if pos >= keep {
                break;
            }
            let len = self.nodes[n.0 as usize].token_len(self.g());
            let node = if pos + len > keep {
                NodeId(self.split(n.0, keep - pos))
            } else {
                n
            };
            let take = len.min(keep - pos);
            if self.on_device(node.0) {
                dev += take;
            } else {
                host += take;
            }
            path.push(node);
            pos += take;
        }
        m.last = path.last().copied().unwrap_or(super::ROOT);
        m.path = path;
        m.device_tokens = dev;
        m.host_tokens = host;
    }
}
