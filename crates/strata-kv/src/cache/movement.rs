//! Tier movement: load-back (host → device), prefetch (L3 → host), backups (device → host)
//! and eviction from the device and host tiers.

use crate::copy::JobKind;
use crate::policy::WritePolicy;
use crate::pool::Direction;
use crate::tree::{NodeId, Slot};

use super::{CacheMatch, Pending, Ticket, Tier, TieredCache};

impl TieredCache {
    /// Starts copying the host-only part of a match to the device (all or nothing). The nodes
    /// are on device (and locked) at once; read them after the ticket completes.
    pub fn load_back(&mut self, m: &CacheMatch) -> Option<Ticket> {
        let nodes: Vec<NodeId> = m
            .path
            .iter()
            .copied()
            .filter(|&n| self.tree.is_live(n) && self.tree.view(n).device.is_empty())
            .collect();
        if nodes.is_empty() {
            return None;
        }
        let need: usize = nodes.iter().map(|&n| self.tree.view(n).host.len()).sum();
        self.tree.lock(m.last);
        let Some(pages) = self.alloc_device(need) else {
            self.tree.unlock(m.last);
            self.stats.load_back_skipped_tokens += (need * self.page_size()) as u64;
            return None;
        };
        self.held_device -= need;
        let mut pairs: Vec<(u32, u32)> = Vec::with_capacity(need);
        let mut it = pages.into_iter();
        for n in nodes {
            let host = self.tree.view(n).host.to_vec();
            let dev: Vec<u32> = it.by_ref().take(host.len()).collect();
            pairs.extend(dev.iter().copied().zip(host));
            self.tree.set_pages(n, Slot::Device, dev);
        }
        let loaded: Vec<NodeId> = m
            .path
            .iter()
            .copied()
            .filter(|&n| self.tree.is_live(n))
            .collect();
        self.emit(true, Tier::Device, &loaded);
        let written: Vec<u32> = pairs.iter().map(|p| p.0).collect();
        self.loading.extend(written.iter().copied());
        let job = JobKind::Copy {
            dir: Direction::HostToDevice,
            pairs,
        };
        Some(self.submit(
            job,
            Pending::LoadBack {
                lock: m.last,
                pages: written,
            },
        ))
    }

    /// Starts reading the L3-held part of a match into host pages; when it completes the pages
    /// join the tree as host-only nodes (then [`TieredCache::load_back`] brings them up).
    pub fn prefetch(&mut self, tokens: &[u32], m: &CacheMatch) -> Option<Ticket> {
        if m.storage_hashes.is_empty() {
            return None;
        }
        let n = m.storage_hashes.len();
        self.tree.lock(m.last);
        let Some(host_pages) = self.alloc_host(n) else {
            self.tree.unlock(m.last);
            return None;
        };
        self.held_host += n;
        let ps = self.page_size();
        let skip = (m.device_tokens + m.host_tokens) / ps;
        let job = JobKind::Get {
            hashes: m.storage_hashes.clone(),
            host_pages: host_pages.clone(),
        };
        let tokens = tokens[..(skip + n) * ps].to_vec();
        Some(self.submit(
            job,
            Pending::Prefetch {
                lock: m.last,
                tokens,
                host_pages,
                skip,
            },
        ))
    }

    /// Backs up device-resident nodes lying on one root path (root-most first). Nodes that do
    /// not fit in the host tier are skipped and counted. Returns the ticket if any copy started.
    pub(super) fn backup_nodes(&mut self, nodes: Vec<NodeId>, evict_after: bool) -> Option<Ticket> {
        let mut chosen = Vec::new();
        let mut pairs = Vec::new();
        let mut lock = None;
        for n in nodes {
            let v = self.tree.view(n);
            if !v.host.is_empty() || v.device.is_empty() {
                continue;
            }
            let np = v.device.len();
            let Some(host) = self.alloc_host(np) else {
                self.stats.backup_skipped_pages += np as u64;
                continue;
            };
            let dev = self.tree.view(n).device.to_vec();
            pairs.extend(dev.into_iter().zip(host.iter().copied()));
            self.tree.set_pages(n, Slot::Host, host);
            chosen.push(n);
            lock = Some(n);
        }
        let lock = lock?;
        self.emit(true, Tier::Host, &chosen);
        self.tree.lock(lock);
        let job = JobKind::Copy {
            dir: Direction::DeviceToHost,
            pairs,
        };
        Some(self.submit(
            job,
            Pending::Backup {
                lock,
                nodes: chosen,
                evict_after,
            },
        ))
    }

    pub(super) fn alloc_host(&mut self, n: usize) -> Option<Vec<u32>> {
        let avail = self.host_alloc.available() as usize;
        if avail < n {
            self.evict_host(n - avail);
        }
        self.host_alloc.alloc(n)
    }

    /// Frees at least `n` device pages if possible (write-back victims free when their copy
    /// lands). Returns pages freed or scheduled.
    pub fn evict_device(&mut self, n: usize) -> usize {
        let mut got = 0;
        let mut skip: Vec<NodeId> = Vec::new();
        while got < n {
            let Some(v) = self.tree.device_victim_excluding(&skip) else {
                break;
            };
            // Free only what is still needed: the head of the node stays cached.
            self.tree.split_tail(v, n - got);
            let view = self.tree.view(v);
            let np = view.device.len();
            let needs_copy = view.host.is_empty()
                && (self.write_policy == WritePolicy::WriteBack || view.children > 0);
            if needs_copy {
                // Keep the data reachable: copy first, free on completion.
                if self.backup_nodes(vec![v], true).is_some() {
                    got += np;
                } else {
                    skip.push(v);
                }
                continue;
            }
            got += np;
            self.drop_device(v);
        }
        got
    }

    pub(super) fn drop_device(&mut self, v: NodeId) {
        self.emit(false, Tier::Device, &[v]);
        let pages = self.tree.take_device(v);
        self.stats.evicted_device_nodes += 1;
        self.stats.evicted_device_tokens += (pages.len() * self.page_size()) as u64;
        self.device_alloc
            .free(&pages)
            .expect("tree pages are allocated");
    }

    /// Frees at least `n` host pages if possible (only nodes already off device).
    pub fn evict_host(&mut self, n: usize) -> usize {
        let mut got = 0;
        while got < n {
            let Some(v) = self.tree.host_victim() else {
                break;
            };
            self.tree.split_tail(v, n - got);
            self.emit(false, Tier::Host, &[v]);
            let pages = self.tree.take_host(v);
            got += pages.len();
            self.stats.evicted_host_nodes += 1;
            self.stats.evicted_host_tokens += (pages.len() * self.page_size()) as u64;
            self.host_alloc
                .free(&pages)
                .expect("tree pages are allocated");
        }
        got
    }
}
