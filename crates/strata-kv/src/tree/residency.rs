//! Residency: which tier holds a node's pages, locks, the eviction sets and their victims,
//! and taking pages out of the tree (which removes nodes left with none).

use super::{page_key, Node, NodeId, RadixTree, Slot};
use crate::policy::EvictionPolicy;

impl RadixTree {
    /// Re-files `id` in the eviction sets after any change to its state.
    pub(super) fn refresh(&mut self, id: u32) {
        let n = &self.nodes[id as usize];
        let key = (n.priority, n.last_access, id);
        let dev = (id != 0
            && n.live
            && !n.device.is_empty()
            && n.lock_ref == 0
            && n.device_children == 0)
            .then_some(key);
        let host = (id != 0
            && n.live
            && n.device.is_empty()
            && !n.host.is_empty()
            && n.lock_ref == 0
            && n.host_lock == 0
            && n.children.is_empty())
        .then_some(key);
        let dwin =
            (id != 0 && n.live && !n.device_win.is_empty() && n.lock_ref == 0).then_some(key);
        let hwin =
            (id != 0 && n.live && !n.host_win.is_empty() && n.lock_ref == 0 && n.host_lock == 0)
                .then_some(key);
        let (old_dwin, old_hwin) = (n.dwin_key, n.hwin_key);
        for (old, new, set) in [
            (old_dwin, dwin, &mut self.device_windows),
            (old_hwin, hwin, &mut self.host_windows),
        ] {
            if old != new {
                if let Some(k) = old {
                    set.remove(&k);
                }
                if let Some(k) = new {
                    set.insert(k);
                }
            }
        }
        let n = &self.nodes[id as usize];
        let (old_dev, old_host) = (n.dev_key, n.host_key);
        if old_dev != dev {
            if let Some(k) = old_dev {
                self.device_leaves.remove(&k);
            }
            if let Some(k) = dev {
                self.device_leaves.insert(k);
            }
        }
        if old_host != host {
            if let Some(k) = old_host {
                self.host_leaves.remove(&k);
            }
            if let Some(k) = host {
                self.host_leaves.insert(k);
            }
        }
        let n = &mut self.nodes[id as usize];
        n.dev_key = dev;
        n.host_key = host;
        n.dwin_key = dwin;
        n.hwin_key = hwin;
    }

    /// Puts `pages` in `id`'s empty `slot`, keeping the page counters and eviction sets current.
    pub(super) fn fill(&mut self, id: u32, slot: Slot, pages: Vec<u32>) {
        debug_assert_eq!(
            pages.len() * self.page_size,
            self.nodes[id as usize].tokens.len()
        );
        let np = pages.len();
        match slot {
            Slot::Device => {
                debug_assert!(self.nodes[id as usize].device.is_empty());
                self.nodes[id as usize].device = pages;
                self.device_pages += np;
                let parent = self.nodes[id as usize].parent;
                self.nodes[parent as usize].device_children += 1;
                self.refresh(parent);
            }
            Slot::Host => {
                debug_assert!(self.nodes[id as usize].host.is_empty());
                self.nodes[id as usize].host = pages;
                self.host_pages += np;
            }
        }
        self.refresh(id);
    }

    /// Gives `id` pages in `slot` (which must be empty), e.g. after a backup or load-back starts.
    pub fn set_pages(&mut self, id: NodeId, slot: Slot, pages: Vec<u32>) {
        assert!(self.slot(id.0, slot).is_empty(), "slot already filled");
        if slot == Slot::Device {
            let p = self.nodes[id.0 as usize].parent;
            assert!(
                p == 0 || !self.nodes[p as usize].device.is_empty(),
                "device residency must stay prefix-closed"
            );
        }
        self.fill(id.0, slot, pages);
    }

    pub fn set_in_storage(&mut self, id: NodeId, v: bool) {
        self.nodes[id.0 as usize].in_storage = v;
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
        self.nodes[id.0 as usize].host_lock += 1;
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
        self.device_leaves.first().map(|k| NodeId(k.2))
    }

    /// First device victim not in `skip`.
    pub fn device_victim_excluding(&self, skip: &[NodeId]) -> Option<NodeId> {
        self.device_leaves
            .iter()
            .map(|k| NodeId(k.2))
            .find(|n| !skip.contains(n))
    }

    /// Next host victim: off device, unlocked, childless.
    pub fn host_victim(&self) -> Option<NodeId> {
        self.host_leaves.first().map(|k| NodeId(k.2))
    }

    /// Removes `id`'s device pages and returns them. A node left with no pages is removed from
    /// the tree; that requires it to be childless (back it up first otherwise).
    pub fn take_device(&mut self, id: NodeId) -> Vec<u32> {
        let i = id.0;
        let n = &self.nodes[i as usize];
        assert!(
            n.lock_ref == 0 && n.device_children == 0,
            "device eviction of a locked or inner node"
        );
        assert!(
            !n.host.is_empty() || n.children.is_empty(),
            "evicting an unbacked node with children"
        );
        assert!(n.device_win.is_empty(), "take the window pages first");
        self.bump_inflation(i);
        let pages = std::mem::take(&mut self.nodes[i as usize].device);
        self.device_pages -= pages.len();
        let parent = self.nodes[i as usize].parent;
        self.nodes[parent as usize].device_children -= 1;
        if self.nodes[i as usize].host.is_empty() {
            self.remove(i);
        } else {
            self.refresh(i);
        }
        self.refresh(parent);
        pages
    }

    /// Removes `id` (off device, childless) and returns its host pages.
    pub fn take_host(&mut self, id: NodeId) -> Vec<u32> {
        let i = id.0;
        let n = &self.nodes[i as usize];
        assert!(
            n.device.is_empty() && n.children.is_empty() && n.lock_ref == 0 && n.host_lock == 0
        );
        assert!(n.host_win.is_empty(), "take the window pages first");
        self.bump_inflation(i);
        let pages = std::mem::take(&mut self.nodes[i as usize].host);
        self.host_pages -= pages.len();
        let parent = self.nodes[i as usize].parent;
        self.remove(i);
        self.refresh(parent);
        pages
    }

    fn bump_inflation(&mut self, i: u32) {
        if self.policy == EvictionPolicy::Gdsf {
            self.inflation = self.inflation.max(self.nodes[i as usize].priority);
        }
    }

    fn remove(&mut self, i: u32) {
        let n = &self.nodes[i as usize];
        debug_assert!(n.children.is_empty() && n.device.is_empty() && n.host.is_empty());
        let key = page_key(&n.tokens[..self.page_size]);
        let parent = n.parent;
        if self.policy == EvictionPolicy::Gdsf {
            let (chain, f) = (n.chain, n.freq);
            self.history.record(chain, f);
        }
        // Drop from the sets before the slot is recycled.
        self.nodes[i as usize].live = false;
        self.refresh(i);
        let removed = self.nodes[parent as usize].children.remove(&key);
        debug_assert_eq!(removed, Some(i));
        self.nodes[i as usize] = Node::default();
        self.free_ids.push(i);
    }
}
