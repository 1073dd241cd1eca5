//! Residency: which tier holds a node's pages, locks, the eviction sets and their victims,
//! and taking pages out of the tree (which removes nodes left with none).

use super::node::{
    IN_ANY, IN_DEV, IN_DWIN, IN_HOST, IN_HWIN, IN_STORAGE, LIVE, RETIRED, VISITED, WINDOWS,
};
use super::{edge_hash, key_id, Node, NodeId, RadixTree, Slot};
use crate::policy::EvictionPolicy;

impl RadixTree {
    fn set_of(&mut self, flag: u16) -> &mut super::KeySet {
        match flag {
            IN_DEV => &mut self.device_leaves,
            IN_HOST => &mut self.host_leaves,
            IN_DWIN => &mut self.device_windows,
            _ => &mut self.host_windows,
        }
    }

    /// `id`'s pages leave tier 0 (device) or 1 (host): SIEVE's hand, if at its key, moves past
    /// every key of its priority, so that the pieces of one insertion (the heads its splits
    /// left, its parent when that becomes a leaf) are behind it, whatever ids the arena gave.
    fn pass_hand(&mut self, tier: usize, id: u32) {
        if self.policy != EvictionPolicy::Sieve {
            return;
        }
        let k = self.key_of(id);
        if self.hands[tier] == k {
            self.hands[tier] = k | u32::MAX as u128;
        }
    }

    /// Takes `id` out of every eviction set (before its key changes).
    pub(super) fn unfile(&mut self, id: u32) {
        let flags = self.nodes[id as usize].flags;
        if flags & IN_ANY == 0 {
            return;
        }
        let key = self.key_of(id);
        for f in [IN_DEV, IN_HOST, IN_DWIN, IN_HWIN] {
            if flags & f != 0 {
                self.set_of(f).remove(&key);
            }
        }
        self.nodes[id as usize].flags &= !IN_ANY;
    }

    /// Re-files `id` in the eviction sets after any change to its state.
    pub(super) fn refresh(&mut self, id: u32) {
        let n = &self.nodes[id as usize];
        let free = id != 0 && n.live() && n.lock_ref == 0;
        let (dev, host) = (self.on_device(id), self.on_host(id));
        let wins = n.has(WINDOWS).then(|| self.windows_of(id));
        let (dwin, hwin) = wins.map_or((false, false), |(d, h)| (!d.is_empty(), !h.is_empty()));
        let want = [
            (IN_DEV, free && dev && n.device_children == 0),
            (
                IN_HOST,
                free && !dev && host && n.host_lock == 0 && n.children == 0,
            ),
            (IN_DWIN, free && dwin),
            (IN_HWIN, free && hwin && n.host_lock == 0),
        ];
        let flags = n.flags;
        let mut key = None;
        for (f, on) in want {
            if (flags & f != 0) == on {
                continue;
            }
            let k = *key.get_or_insert_with(|| self.key_of(id));
            if on {
                self.set_of(f).insert(k);
            } else {
                self.set_of(f).remove(&k);
            }
            self.nodes[id as usize].set(f, on);
        }
    }

    /// Puts `pages` in `id`'s empty `slot`, keeping the page counters and eviction sets current.
    pub(super) fn fill(&mut self, id: u32, slot: Slot, pages: &[u32]) {
        self.check_page_bound(pages);
        let g = self.g();
        assert_eq!(
            pages.len(),
            self.nodes[id as usize].pages(g),
            "one page per page"
        );
        debug_assert!(self.slot(id, slot).is_empty());
        match slot {
            Slot::Device => self.nodes[id as usize].set_device(g, pages),
            Slot::Host => self.nodes[id as usize].set_host(g, pages),
        }
        self.filled(id, slot, pages.len());
    }

    /// The counters and sets after `id` got `np` pages in `slot`.
    pub(super) fn filled(&mut self, id: u32, slot: Slot, np: usize) {
        if self.policy == EvictionPolicy::S3Fifo {
            self.s3_count(id, slot, np, true);
        }
        match slot {
            Slot::Device => {
                self.device_pages += np;
                let parent = self.nodes[id as usize].parent;
                self.nodes[parent as usize].device_children += 1;
                self.refresh(parent);
            }
            Slot::Host => self.host_pages += np,
        }
        self.refresh(id);
    }

    /// Gives `id` pages in `slot` (which must be empty), e.g. after a backup or load-back starts.
    pub fn set_pages(&mut self, id: NodeId, slot: Slot, pages: Vec<u32>) {
        assert!(self.slot(id.0, slot).is_empty(), "slot already filled");
        if slot == Slot::Device {
            let p = self.nodes[id.0 as usize].parent;
            assert!(
                p == 0 || self.on_device(p),
                "device residency must stay prefix-closed"
            );
        }
        self.fill(id.0, slot, &pages);
    }

    pub fn set_in_storage(&mut self, id: NodeId, v: bool) {
        self.nodes[id.0 as usize].set(IN_STORAGE, v);
    }

    /// Locks `id` and its ancestors against eviction.
    pub fn lock(&mut self, id: NodeId) {
        let mut c = id.0;
        while c != 0 {
            let n = &mut self.nodes[c as usize];
            n.lock_ref += 1;
            let parent = n.parent;
            if n.lock_ref == 1 {
                self.refresh(c);
            }
            c = parent;
        }
    }

    /// Undoes one [`RadixTree::lock`] of `id`.
    pub fn unlock(&mut self, id: NodeId) {
        let mut c = id.0;
        while c != 0 {
            let n = &mut self.nodes[c as usize];
            assert!(n.lock_ref > 0, "unlock of unlocked node {c}");
            n.lock_ref -= 1;
            let parent = n.parent;
            if n.lock_ref == 0 {
                self.refresh(c);
            }
            c = parent;
        }
    }

    /// Pins `id`'s host pages (a storage write reads them).
    pub fn host_lock(&mut self, id: NodeId) {
        let n = &mut self.nodes[id.0 as usize];
        n.host_lock = n
            .host_lock
            .checked_add(1)
            .expect("host pins of one node overflow");
        self.refresh(id.0);
    }

    pub fn host_unlock(&mut self, id: NodeId) {
        let n = &mut self.nodes[id.0 as usize];
        assert!(n.host_lock > 0, "host_unlock of unlocked node");
        n.host_lock -= 1;
        self.refresh(id.0);
    }

    /// Next device victim under the policy: an unlocked node with no child on device.
    pub fn device_victim(&self) -> Option<NodeId> {
        self.device_leaves.first().map(key_id)
    }

    /// Marks the leaf `id` a dead end: its session's next request went elsewhere (the
    /// session's previous leaf, `TieredCache::set_session`). It is then evicted, on every
    /// tier, before whatever the policy would choose, until something uses it again (a match
    /// or an insertion through it clears the mark). `stamp` is its last access as the caller
    /// saw it (`NodeView::last_access`): a node used since, or a slot reused by another
    /// node, is left alone, as is a node with children or locks. True if it was marked.
    pub fn retire(&mut self, id: NodeId, stamp: u64) -> bool {
        let i = id.0 as usize;
        let Some(n) = self.nodes.get(i) else {
            return false;
        };
        if i == 0
            || !n.live()
            || n.stamp != stamp
            || n.children != 0
            || n.lock_ref != 0
            || n.has(RETIRED)
        {
            return false;
        }
        self.unfile(id.0);
        self.nodes[i].set(RETIRED, true);
        self.refresh(id.0);
        true
    }

    /// The first retired leaf of the device (0) or host (1) set not in `skip`. Retired keys
    /// have priority 0 and sort first, so this looks at them (and at most a few others of
    /// priority 0) only.
    fn retired_victim(&self, tier: usize, skip: &[NodeId]) -> Option<NodeId> {
        let set = if tier == 0 {
            &self.device_leaves
        } else {
            &self.host_leaves
        };
        set.range(..1u128 << 64)
            .map(key_id)
            .find(|id| !skip.contains(id) && self.nodes[id.0 as usize].has(RETIRED))
    }

    /// The device victim to evict next that is not in `skip` (under SIEVE this moves the
    /// hand and clears the visited bits it passes).
    pub fn device_victim_excluding(&mut self, skip: &[NodeId]) -> Option<NodeId> {
        if let Some(id) = self.retired_victim(0, skip) {
            return Some(id);
        }
        if self.policy == EvictionPolicy::S3Fifo {
            return self.s3_victim(Slot::Device, skip);
        }
        if self.policy == EvictionPolicy::Sieve {
            return self.sieve(0, skip);
        }
        self.device_leaves
            .iter()
            .map(key_id)
            .find(|n| !skip.contains(n))
    }

    /// Next host victim: off device, unlocked, childless (under SIEVE this moves the hand).
    pub fn host_victim(&mut self) -> Option<NodeId> {
        if let Some(id) = self.retired_victim(1, &[]) {
            return Some(id);
        }
        if self.policy == EvictionPolicy::S3Fifo {
            return self.s3_victim(Slot::Host, &[]);
        }
        if self.policy == EvictionPolicy::Sieve {
            return self.sieve(1, &[]);
        }
        self.host_leaves.first().map(key_id)
    }

    /// SIEVE's sweep over the device (0) or host (1) leaves: from the hand towards newer
    /// leaves, wrapping to the oldest, clearing visited bits, up to the first leaf without one
    /// (after one full turn every bit is clear, so a second finds one if any leaf is allowed).
    fn sieve(&mut self, tier: usize, skip: &[NodeId]) -> Option<NodeId> {
        let set = if tier == 0 {
            &self.device_leaves
        } else {
            &self.host_leaves
        };
        let hand = self.hands[tier];
        let turn = || set.range(hand..).chain(set.range(..hand));
        for k in turn().chain(turn()) {
            let id = key_id(k);
            if skip.contains(&id) {
                continue;
            }
            let n = &mut self.nodes[id.0 as usize];
            if n.has(VISITED) {
                n.set(VISITED, false);
                continue;
            }
            self.hands[tier] = *k;
            return Some(id);
        }
        None
    }

    /// Removes `id`'s device pages and returns them. A node left with no pages is removed from
    /// the tree; that requires it to be childless (back it up first otherwise).
    pub fn take_device(&mut self, id: NodeId) -> Vec<u32> {
        let i = id.0;
        self.pass_hand(0, i);
        let n = &self.nodes[i as usize];
        assert!(
            n.lock_ref == 0 && n.device_children == 0,
            "device eviction of a locked or inner node"
        );
        assert!(
            self.on_host(i) || n.children == 0,
            "evicting an unbacked node with children"
        );
        assert!(
            self.windows_of(i).0.is_empty(),
            "take the window pages first"
        );
        self.bump_inflation(i);
        let pages = self.slot(i, Slot::Device).to_vec();
        self.device_pages -= pages.len();
        if self.policy == EvictionPolicy::S3Fifo {
            self.s3_count(i, Slot::Device, pages.len(), false);
        }
        let parent = self.nodes[i as usize].parent;
        self.nodes[parent as usize].device_children -= 1;
        if self.on_host(i) {
            let g = self.g();
            self.nodes[i as usize].set_device(g, &[]);
            self.refresh(i);
        } else {
            // The node goes with its block: no need to cut the pages out first.
            self.remove(i);
        }
        self.refresh(parent);
        pages
    }

    /// Removes `id` (off device, childless) and returns its host pages.
    pub fn take_host(&mut self, id: NodeId) -> Vec<u32> {
        let i = id.0;
        self.pass_hand(1, i);
        let n = &self.nodes[i as usize];
        assert!(!self.on_device(i) && n.children == 0 && n.lock_ref == 0 && n.host_lock == 0);
        assert!(
            self.windows_of(i).1.is_empty(),
            "take the window pages first"
        );
        self.bump_inflation(i);
        let pages = self.slot(i, Slot::Host).to_vec();
        self.host_pages -= pages.len();
        if self.policy == EvictionPolicy::S3Fifo {
            self.s3_count(i, Slot::Host, pages.len(), false);
        }
        let parent = self.nodes[i as usize].parent;
        self.remove(i);
        self.refresh(parent);
        pages
    }

    /// GDSF's L rises to the victim's priority: only for victims the policy chose (a retired
    /// leaf goes out of order; its priority says nothing of what the cache keeps).
    fn bump_inflation(&mut self, i: u32) {
        if self.policy.is_gdsf() && !self.nodes[i as usize].has(RETIRED) {
            self.inflation = self.inflation.max(self.prio[i as usize]);
        }
    }

    /// Removes `i` (childless, its pages already counted out) from the tree.
    fn remove(&mut self, i: u32) {
        let ps = self.page_size;
        let g = self.g();
        let n = &self.nodes[i as usize];
        debug_assert!(n.children == 0);
        let hash = edge_hash(n.parent, n.tokens(g).page_key(ps));
        let (parent, pages) = (n.parent, n.pages(g));
        if self.policy.has_history() {
            // GDSF remembers the frequency; S3-FIFO's ghost only that the node was here.
            let chain = self.chain_of(i);
            match self.policy {
                EvictionPolicy::Gdsf => self.history.record(chain, self.freq(i)),
                EvictionPolicy::Auto => self.auto_removed(i, chain, pages),
                _ => self.history.record(chain, 1),
            }
        }
        // Drop from the sets before the slot is recycled.
        self.unfile(i);
        let edge = self.edges.find_entry(hash, |&c| c == i);
        edge.expect("every node is its parent's child").remove();
        self.nodes[parent as usize].children -= 1;
        self.nodes[i as usize] = Node::default();
        debug_assert!(self.nodes[i as usize].flags & LIVE == 0);
        if let Some(h) = self.hashes.get_mut(i as usize) {
            *h = Box::default();
        }
        self.windows.remove(&i);
        self.release_id(i);
    }
}
