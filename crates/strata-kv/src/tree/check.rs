//! [`RadixTree::check`]: the structural invariants, verified node by node, then the page
//! counters and the eviction sets.

use super::{chain_step, page_key, NodeId, RadixTree, NO_PAGE};
use crate::hash::PageHash;
use crate::policy::EvictionPolicy;

impl RadixTree {
    /// Verifies every structural invariant; returns the first violation.
    pub fn check(&self) -> Result<(), String> {
        let (mut dp, mut hp, mut dw, mut hw) = (0, 0, 0, 0);
        let real = |v: &[u32]| v.iter().filter(|&&w| w != NO_PAGE).count();
        for id in self.node_ids() {
            self.check_pages(id)?;
            self.check_windows(id)?;
            self.check_links(id)?;
            self.check_chains(id)?;
            let n = &self.nodes[id.0 as usize];
            dp += n.device.len();
            hp += n.host.len();
            dw += real(&n.device_win);
            hw += real(&n.host_win);
        }
        if dp != self.device_pages || hp != self.host_pages {
            return Err(format!(
                "page counters {}/{} but nodes hold {dp}/{hp}",
                self.device_pages, self.host_pages
            ));
        }
        if dw != self.device_win_pages || hw != self.host_win_pages {
            return Err(format!(
                "window page counters {}/{} but nodes hold {dw}/{hw}",
                self.device_win_pages, self.host_win_pages
            ));
        }
        self.check_eviction_sets()
    }

    /// One node's shape: whole pages of tokens, some pages held, one page (and hash) per page.
    fn check_pages(&self, id: NodeId) -> Result<(), String> {
        let ps = self.page_size;
        let i = id.0 as usize;
        let n = &self.nodes[i];
        let pages = n.tokens.len() / ps;
        if n.tokens.is_empty() || !n.tokens.len().is_multiple_of(ps) {
            return Err(format!(
                "node {i}: {} tokens is not a whole number of pages",
                n.tokens.len()
            ));
        }
        if n.device.is_empty() && n.host.is_empty() {
            return Err(format!("node {i} holds no pages"));
        }
        for (name, v) in [("device", &n.device), ("host", &n.host)] {
            if !v.is_empty() && v.len() != pages {
                return Err(format!(
                    "node {i}: {} {name} pages for {pages} pages of tokens",
                    v.len()
                ));
            }
        }
        if self.namespace.is_some() && n.hashes.len() != pages {
            return Err(format!(
                "node {i}: {} hashes for {pages} pages",
                n.hashes.len()
            ));
        }
        Ok(())
    }

    /// One node's window lists: empty, or one entry per main page of that tier with at least
    /// one real page; each unlocked holder filed as a window victim.
    fn check_windows(&self, id: NodeId) -> Result<(), String> {
        let i = id.0 as usize;
        let n = &self.nodes[i];
        for (name, win, main) in [
            ("device", &n.device_win, &n.device),
            ("host", &n.host_win, &n.host),
        ] {
            if win.is_empty() {
                continue;
            }
            if win.len() != main.len() {
                return Err(format!(
                    "node {i}: {} {name} window entries for {} {name} pages",
                    win.len(),
                    main.len()
                ));
            }
            if win.iter().all(|&w| w == NO_PAGE) {
                return Err(format!(
                    "node {i}: an empty {name} window list is not cleared"
                ));
            }
        }
        let dwin = !n.device_win.is_empty() && n.lock_ref == 0;
        let hwin = !n.host_win.is_empty() && n.lock_ref == 0 && n.host_lock == 0;
        if dwin != n.dwin_key.is_some() || hwin != n.hwin_key.is_some() {
            return Err(format!("node {i}: window victim sets out of date"));
        }
        Ok(())
    }

    /// One node's links: listed by its parent, device residency prefix-closed, and its
    /// device-child count and lock count consistent with its children.
    fn check_links(&self, id: NodeId) -> Result<(), String> {
        let ps = self.page_size;
        let i = id.0 as usize;
        let n = &self.nodes[i];
        let p = &self.nodes[n.parent as usize];
        if !p.live || p.children.get(&page_key(&n.tokens[..ps])) != Some(&id.0) {
            return Err(format!("node {i}: parent does not list it"));
        }
        if !n.device.is_empty() && n.parent != 0 && p.device.is_empty() {
            return Err(format!("node {i} on device under a parent that is not"));
        }
        let dc = n
            .children
            .values()
            .filter(|&&c| !self.nodes[c as usize].device.is_empty())
            .count();
        if dc as u32 != n.device_children {
            return Err(format!(
                "node {i}: device_children {} but {dc} counted",
                n.device_children
            ));
        }
        let locks: u32 = n
            .children
            .values()
            .map(|&c| self.nodes[c as usize].lock_ref)
            .sum();
        if n.lock_ref < locks {
            return Err(format!(
                "node {i}: lock_ref {} below its children's {locks}",
                n.lock_ref
            ));
        }
        Ok(())
    }

    /// One node's keys: page hashes and the history chain key follow on from its parent's.
    fn check_chains(&self, id: NodeId) -> Result<(), String> {
        let ps = self.page_size;
        let i = id.0 as usize;
        let n = &self.nodes[i];
        if let Some(ns) = &self.namespace {
            let parent_hash = self.last_hash(NodeId(n.parent)).unwrap_or(PageHash::ROOT);
            if ns.chain(parent_hash, &n.tokens, ps) != n.hashes {
                return Err(format!(
                    "node {i}: page hashes do not chain from its parent"
                ));
            }
        }
        if self.policy == EvictionPolicy::Gdsf {
            let start = self.nodes[n.parent as usize].base;
            if chain_step(start, &n.tokens[..ps]) != n.chain {
                return Err(format!(
                    "node {i}: history chain key does not follow its parent"
                ));
            }
        }
        Ok(())
    }

    /// Every entry of the eviction sets is the current key of a live node.
    fn check_eviction_sets(&self) -> Result<(), String> {
        for (set, name) in [
            (&self.device_leaves, "device"),
            (&self.host_leaves, "host"),
            (&self.device_windows, "device window"),
            (&self.host_windows, "host window"),
        ] {
            for k in set {
                let n = &self.nodes[k.2 as usize];
                let key = match name {
                    "device" => n.dev_key,
                    "host" => n.host_key,
                    "device window" => n.dwin_key,
                    _ => n.hwin_key,
                };
                if !n.live || key != Some(*k) {
                    return Err(format!(
                        "{name} eviction set holds stale entry for node {}",
                        k.2
                    ));
                }
            }
        }
        Ok(())
    }
}
