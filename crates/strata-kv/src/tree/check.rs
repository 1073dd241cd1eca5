//! [`RadixTree::check`]: the structural invariants, verified node by node, then the page
//! counters, the edge map and the eviction sets.

use super::node::{IN_DEV, IN_DWIN, IN_HOST, IN_HWIN, RETIRED, WINDOWS};
use super::packed::Tokens;
use super::{child_hash, key_id, NodeId, RadixTree, NO_PAGE};
use crate::hash::PageHash;

/// What a node's children add up to (counted from the children's side).
#[derive(Clone, Copy, Default)]
struct Below {
    children: u32,
    device_children: u32,
    locks: u32,
}

impl RadixTree {
    /// Verifies every structural invariant; returns the first violation.
    pub fn check(&self) -> Result<(), String> {
        let (mut dp, mut hp, mut dw, mut hw) = (0, 0, 0, 0);
        let real = |v: &[u32]| v.iter().filter(|&&w| w != NO_PAGE).count();
        let mut below = vec![Below::default(); self.nodes.len()];
        self.check_arena()?;
        let ids = self.node_ids();
        for &id in &ids {
            self.check_pages(id)?;
            self.check_windows(id)?;
            self.check_links(id)?;
            self.check_chains(id)?;
            let n = &self.nodes[id.0 as usize];
            let b = &mut below[n.parent as usize];
            b.children += 1;
            b.device_children += self.on_device(id.0) as u32;
            b.locks += n.lock_ref;
            dp += self.slot(id.0, super::Slot::Device).len();
            hp += self.slot(id.0, super::Slot::Host).len();
            let (d, h) = self.windows_of(id.0);
            dw += real(d);
            hw += real(h);
        }
        for (i, n) in self.nodes.iter().enumerate().filter(|(_, n)| n.live()) {
            let b = below[i];
            if b.children != n.children || b.device_children != n.device_children {
                return Err(format!(
                    "node {i}: {} children ({} on device) but {} ({}) counted",
                    n.children, n.device_children, b.children, b.device_children
                ));
            }
            // A use clears the mark, and a child comes only through a use (a lock may come
            // from a write-back's backup, which is no use).
            if n.has(RETIRED) && n.children != 0 {
                return Err(format!("node {i}: retired with children"));
            }
            if i != 0 && n.lock_ref < b.locks {
                return Err(format!(
                    "node {i}: lock_ref {} below its children's {}",
                    n.lock_ref, b.locks
                ));
            }
        }
        if self.edges.len() != ids.len() {
            return Err(format!(
                "{} edges for {} nodes",
                self.edges.len(),
                ids.len()
            ));
        }
        if dp != self.device_pages || hp != self.host_pages {
            return Err(format!(
                "page counters {}/{} but nodes hold {dp}/{hp}",
                self.device_pages, self.host_pages
            ));
        }
        if self.policy == crate::policy::EvictionPolicy::S3Fifo {
            let small = |slot| {
                ids.iter()
                    .filter(|n| self.s3_small(n.0))
                    .map(|n| self.slot(n.0, slot).len())
                    .sum::<usize>()
            };
            let got = [small(super::Slot::Device), small(super::Slot::Host)];
            if got != self.small_pages {
                return Err(format!(
                    "small-queue pages {:?} but small nodes hold {got:?}",
                    self.small_pages
                ));
            }
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
        let g = self.g();
        let i = id.0 as usize;
        let n = &self.nodes[i];
        let pages = n.pages(g);
        if pages == 0 {
            return Err(format!("node {i} holds no tokens"));
        }
        n.check_block(g).map_err(|e| format!("node {i}: {e}"))?;
        let (device, host) = (n.device(g), n.host(g));
        if device.is_empty() && host.is_empty() {
            return Err(format!("node {i} holds no pages"));
        }
        for (name, v) in [("device", device), ("host", host)] {
            if !v.is_empty() && v.len() != pages {
                return Err(format!(
                    "node {i}: {} {name} pages for {pages} pages of tokens",
                    v.len()
                ));
            }
        }
        let t = n.tokens(g);
        let max = (0..t.len()).map(|k| t.get(k)).max().unwrap_or(0);
        let narrower = match t {
            Tokens::Wide(_) => max <= 0xFF_FFFF,
            Tokens::Mid(_) => max <= 0xFFFF,
            Tokens::Narrow(_) => false,
        };
        if narrower {
            return Err(format!("node {i}: tokens stored wider than they need"));
        }
        if self.namespace.is_some() && self.hashes[i].len() != pages {
            return Err(format!(
                "node {i}: {} hashes for {pages} pages",
                self.hashes[i].len()
            ));
        }
        Ok(())
    }

    /// One node's window lists: empty, or one entry per main page of that tier with at least
    /// one real page; each unlocked holder filed as a window victim.
    fn check_windows(&self, id: NodeId) -> Result<(), String> {
        let i = id.0 as usize;
        let n = &self.nodes[i];
        let (dwin, hwin) = self.windows_of(id.0);
        if n.has(WINDOWS) != self.windows.contains_key(&id.0) {
            return Err(format!("node {i}: window flag and map disagree"));
        }
        if n.has(WINDOWS) && dwin.is_empty() && hwin.is_empty() {
            return Err(format!("node {i}: empty window lists kept"));
        }
        let g = self.g();
        for (name, win, main) in [("device", dwin, n.device(g)), ("host", hwin, n.host(g))] {
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
        let d = !dwin.is_empty() && n.lock_ref == 0;
        let h = !hwin.is_empty() && n.lock_ref == 0 && n.host_lock == 0;
        if d != n.has(IN_DWIN) || h != n.has(IN_HWIN) {
            return Err(format!("node {i}: window victim sets out of date"));
        }
        Ok(())
    }

    /// One node's links: listed by its parent under its first page, device residency
    /// prefix-closed.
    fn check_links(&self, id: NodeId) -> Result<(), String> {
        let ps = self.page_size;
        let g = self.g();
        let i = id.0 as usize;
        let n = &self.nodes[i];
        let p = &self.nodes[n.parent as usize];
        let found = self
            .edges
            .find(child_hash(&self.nodes, g, id.0), |&c| c == id.0);
        if !p.live() || found.is_none() {
            return Err(format!("node {i}: parent does not list it"));
        }
        // No sibling starts with the same page (a lookup finds this node).
        let first = n.tokens(g).slice(0, ps).to_vec();
        if self.child_of(n.parent, &first) != Some(id.0) {
            return Err(format!("node {i}: a sibling starts with the same page"));
        }
        if self.on_device(id.0) && n.parent != 0 && !self.on_device(n.parent) {
            return Err(format!("node {i} on device under a parent that is not"));
        }
        Ok(())
    }

    /// One node's page hashes follow on from its parent's.
    fn check_chains(&self, id: NodeId) -> Result<(), String> {
        let ps = self.page_size;
        let g = self.g();
        let i = id.0 as usize;
        let n = &self.nodes[i];
        if let Some(ns) = &self.namespace {
            let parent_hash = self.last_hash(NodeId(n.parent)).unwrap_or(PageHash::ROOT);
            if ns.chain(parent_hash, &n.tokens(g).to_vec(), ps)[..] != self.hashes[i][..] {
                return Err(format!(
                    "node {i}: page hashes do not chain from its parent"
                ));
            }
        }
        Ok(())
    }

    /// The free slots are the arena's dead ones, each once, and its last slot is live.
    fn check_arena(&self) -> Result<(), String> {
        let mut free: Vec<u32> = self.free_ids.iter().map(|r| r.0).collect();
        free.sort_unstable();
        let dead: Vec<u32> = (0..self.nodes.len() as u32)
            .filter(|&i| !self.nodes[i as usize].live())
            .collect();
        if free != dead {
            return Err(format!("free slots {free:?}, dead slots {dead:?}"));
        }
        if self.nodes.last().is_none_or(|n| !n.live()) {
            return Err("the arena ends in a dead slot".into());
        }
        Ok(())
    }

    /// Every entry of the eviction sets is the current key of a live node filed there, and
    /// every node filed in a set is in it.
    fn check_eviction_sets(&self) -> Result<(), String> {
        let mut filed = 0;
        for (set, name, flag) in [
            (&self.device_leaves, "device", IN_DEV),
            (&self.host_leaves, "host", IN_HOST),
            (&self.device_windows, "device window", IN_DWIN),
            (&self.host_windows, "host window", IN_HWIN),
        ] {
            set.check()
                .map_err(|e| format!("{name} eviction set: {e}"))?;
            for k in set {
                let id = key_id(k).0;
                let stale = self
                    .nodes
                    .get(id as usize)
                    .is_none_or(|n| !n.live() || !n.has(flag));
                if stale || self.key_of(id) != *k {
                    return Err(format!(
                        "{name} eviction set holds stale entry for node {id}"
                    ));
                }
            }
            filed += self.nodes.iter().filter(|n| n.has(flag)).count();
        }
        let entries = self.device_leaves.len()
            + self.host_leaves.len()
            + self.device_windows.len()
            + self.host_windows.len();
        if filed != entries {
            return Err(format!(
                "{filed} set memberships flagged, {entries} entries"
            ));
        }
        Ok(())
    }
}
