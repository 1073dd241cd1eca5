//! Tier movement: load-back (host → device), prefetch (L3 → host), backups (device → host)
//! and eviction from the device and host tiers.

use crate::copy::JobKind;
use crate::policy::WritePolicy;
use crate::pool::Direction;
use crate::tree::{NodeId, Slot, NO_PAGE};

use super::{CacheMatch, Pending, Ticket, Tier, TieredCache};

impl TieredCache {
    /// Starts copying the host-only part of a match to the device (all or nothing), with the
    /// window pages of the span before its end that the device lacks. The nodes are on device
    /// (and locked) at once; read them after the ticket completes.
    pub fn load_back(&mut self, m: &CacheMatch) -> Option<Ticket> {
        let (nodes, loads) = self.load_plan(m);
        if nodes.is_empty() && loads.is_empty() {
            return None;
        }
        let need = self.host_pages_of(&nodes);
        self.tree.lock(m.last);
        let skipped = |c: &mut Self| {
            c.tree.unlock(m.last);
            c.stats.load_back_skipped_tokens += (need * c.page_size()) as u64;
            None
        };
        let Some(pages) = self.alloc_device(need) else {
            return skipped(self);
        };
        let Some(mut dwins) = self.alloc_windows(loads.len()) else {
            self.free_device(&pages).expect("just allocated");
            return skipped(self);
        };
        // Allocating may have let copies land and split nodes of the (locked) path, or given
        // them host window pages: plan again on the tree as it is now. Splits keep the pages.
        let (nodes, mut loads) = self.load_plan(m);
        if self.host_pages_of(&nodes) != need {
            self.free_device(&pages).expect("just allocated");
            self.free_windows(&dwins);
            return skipped(self);
        }
        loads.truncate(dwins.len());
        let extra = dwins.split_off(loads.len());
        self.free_windows(&extra);
        self.held_device -= need;
        self.held_dwin -= dwins.len();
        let mut pairs: Vec<(u32, u32)> = Vec::with_capacity(need);
        let mut it = pages.into_iter();
        for n in nodes {
            let host = self.tree.view(n).host.to_vec();
            let dev: Vec<u32> = it.by_ref().take(host.len()).collect();
            pairs.extend(dev.iter().copied().zip(host));
            self.tree.set_pages(n, Slot::Device, dev);
        }
        let mut window_pairs = Vec::with_capacity(loads.len());
        for (&(n, i, h), &d) in loads.iter().zip(&dwins) {
            let mut list = vec![NO_PAGE; self.tree.view(n).device.len()];
            list[i] = d;
            self.tree.set_windows(n, Slot::Device, &list);
            window_pairs.push((d, h));
        }
        let loaded = self.tree.path_to(m.last);
        self.emit(true, Tier::Device, &loaded);
        let written: Vec<u32> = pairs.iter().map(|p| p.0).collect();
        self.loading.extend(written.iter().copied());
        self.loading_windows.extend(dwins.iter().copied());
        let job = JobKind::Copy {
            dir: Direction::HostToDevice,
            pairs,
            window_pairs,
        };
        Some(self.submit(
            job,
            Pending::LoadBack {
                lock: m.last,
                pages: written,
                windows: dwins,
            },
        ))
    }

    /// The host-only nodes of the path to `m.last` and the span's window loads, read now.
    fn load_plan(&self, m: &CacheMatch) -> (Vec<NodeId>, Vec<(NodeId, usize, u32)>) {
        let nodes = self
            .tree
            .path_to(m.last)
            .into_iter()
            .filter(|&n| self.tree.view(n).device.is_empty())
            .collect();
        (nodes, self.window_loads(m.last, m.queried_tokens))
    }

    fn host_pages_of(&self, nodes: &[NodeId]) -> usize {
        nodes.iter().map(|&n| self.tree.view(n).host.len()).sum()
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
        // Host window pages for the L3 pages in the span before the match's end, and (with
        // checkpoints) before each checkpoint inside it, where the match may back off to.
        let mut windows = Vec::new();
        if self.has_window() {
            let span = self.span(skip + n, m.queried_tokens);
            let want: Vec<usize> = (skip..skip + n)
                .filter(|&p| span.contains(&p) || self.checkpoint_reads(p, skip + n))
                .collect();
            let got = self.alloc_host_windows(want.len());
            self.held_hwin += got.len();
            windows = vec![NO_PAGE; n];
            for (&p, w) in want.iter().zip(got) {
                windows[p - skip] = w;
            }
        }
        let job = JobKind::Get {
            hashes: m.storage_hashes.clone(),
            host_pages: host_pages.clone(),
            windows: windows
                .iter()
                .map(|&w| (w != NO_PAGE).then_some(w))
                .collect(),
        };
        let tokens = tokens[..(skip + n) * ps].to_vec();
        Some(self.submit(
            job,
            Pending::Prefetch {
                lock: m.last,
                tokens,
                host_pages,
                windows,
                skip,
            },
        ))
    }

    /// Backs up device-resident nodes lying on one root path (root-most first). Nodes that do
    /// not fit in the host tier are skipped and counted. Returns the ticket if any copy started.
    pub(super) fn backup_nodes(&mut self, nodes: Vec<NodeId>, evict_after: bool) -> Option<Ticket> {
        let mut chosen = Vec::new();
        let mut pairs = Vec::new();
        let mut window_pairs = Vec::new();
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
            self.backup_windows(n, &mut window_pairs);
            // Locked until the copy is locked below: a later node's host window pages must
            // not be taken from this one (a lock follows splits).
            self.tree.lock(n);
            chosen.push(n);
            lock = Some(n);
        }
        for &n in &chosen {
            self.tree.unlock(n);
        }
        let lock = lock?;
        self.emit(true, Tier::Host, &chosen);
        self.tree.lock(lock);
        let job = JobKind::Copy {
            dir: Direction::DeviceToHost,
            pairs,
            window_pairs,
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

    /// Gives node `n` (just given host pages) host window pages for its device window pages,
    /// as many as the host tier has room for, and records the copies.
    fn backup_windows(&mut self, n: NodeId, window_pairs: &mut Vec<(u32, u32)>) {
        let dwin = self.tree.view(n).device_win.to_vec();
        let real = dwin.iter().filter(|&&w| w != NO_PAGE).count();
        if real == 0 {
            return;
        }
        let mut got = self.alloc_host_windows(real).into_iter();
        let list: Vec<u32> = dwin
            .iter()
            .map(|&d| {
                if d == NO_PAGE {
                    return NO_PAGE;
                }
                match got.next() {
                    Some(h) => {
                        window_pairs.push((d, h));
                        h
                    }
                    None => NO_PAGE,
                }
            })
            .collect();
        if list.iter().any(|&w| w != NO_PAGE) {
            self.tree.set_windows(n, Slot::Host, &list);
        }
    }

    pub(super) fn alloc_host(&mut self, n: usize) -> Option<Vec<u32>> {
        let avail = self.host_alloc.available() as usize;
        if avail < n {
            self.evict_host(n - avail);
        }
        self.host_alloc.alloc(n)
    }

    /// What the `auto` eviction policy has learnt (`None` under another policy).
    pub fn auto_learning(&self) -> Option<crate::AutoLearning> {
        self.tree.auto_learning()
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
        self.drop_windows(v, Slot::Device);
        let pages = self.tree.take_device(v);
        self.stats.evicted_device_nodes += 1;
        self.stats.evicted_device_tokens += (pages.len() * self.page_size()) as u64;
        self.device_alloc
            .free(&pages)
            .expect("tree pages are allocated");
    }

    /// Marks the removals from now on as the operator's (a flush: `true`) or the policy's
    /// (`false`): the `auto` policy learns its newcomer credit only from its own evictions.
    pub fn set_flushing(&mut self, flushing: bool) {
        self.tree.set_flushing(flushing);
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
            self.drop_windows(v, Slot::Host);
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
