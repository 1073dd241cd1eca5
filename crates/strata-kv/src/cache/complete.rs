//! Copies in flight: submitting them, acknowledging completions (which is when pages change
//! hands between tiers), and the L3 writes that follow backups.

use crate::copy::{CopyEngine, Done, JobKind};
use crate::tree::{NodeId, Slot, NO_PAGE};

use super::{Pending, Ticket, Tier, TieredCache};

impl TieredCache {
    pub(super) fn submit(&mut self, job: JobKind, p: Pending) -> Ticket {
        // Splits so far belong to the copies already in flight, not to this one.
        self.absorb_splits();
        let t = self.next_ticket;
        self.next_ticket += 1;
        self.pending.insert(t, p);
        match &self.engine {
            Some(e) => e.submit(t, job),
            None => {
                let d = self.planes.run(t, &job);
                self.complete(d);
            }
        }
        Ticket(t)
    }

    pub fn is_done(&self, t: Ticket) -> bool {
        !self.pending.contains_key(&t.0)
    }

    /// Acknowledges finished copies (and answers from L3 about prompts' pages) without
    /// blocking; returns how many.
    pub fn poll(&mut self) -> usize {
        self.release_dropped();
        let mut k = self.absorb_probes();
        while let Some(d) = self.engine.as_ref().and_then(CopyEngine::try_recv) {
            self.complete(d);
            k += 1;
        }
        k
    }

    pub(super) fn complete_one(&mut self) {
        if let Some(e) = &self.engine {
            let d = e.recv();
            self.complete(d);
        }
    }

    /// Blocks until `t` completes.
    pub fn wait(&mut self, t: Ticket) {
        while self.pending.contains_key(&t.0) {
            self.complete_one();
        }
    }

    /// Blocks until nothing is in flight (including L3 writes that follow backups).
    pub fn wait_all(&mut self) {
        self.release_dropped();
        while !self.pending.is_empty() {
            self.complete_one();
        }
    }

    /// Follows splits made since the last call into the node lists of copies in flight: a
    /// node split while its backup or put was in flight has its head covered by the same copy.
    pub(super) fn absorb_splits(&mut self) {
        let splits = self.tree.take_splits();
        if splits.is_empty() || self.pending.is_empty() {
            return;
        }
        for (suffix, head) in splits {
            for p in self.pending.values_mut() {
                match p {
                    Pending::Backup { nodes, .. } if nodes.contains(&suffix) => {
                        let at = nodes.iter().position(|&n| n == suffix).expect("present");
                        nodes.insert(at, head);
                    }
                    Pending::Put { nodes, heads }
                        if nodes.contains(&suffix) || heads.contains(&suffix) =>
                    {
                        heads.push(head);
                    }
                    _ => {}
                }
            }
        }
    }

    pub(super) fn complete(&mut self, d: Done) {
        self.absorb_splits();
        let p = self
            .pending
            .remove(&d.ticket)
            .expect("completion for a known ticket");
        match p {
            Pending::LoadBack {
                lock,
                pages,
                windows,
            } => self.complete_load_back(&d, lock, pages, windows),
            Pending::Backup {
                lock,
                nodes,
                evict_after,
            } => self.complete_backup(&d, lock, nodes, evict_after),
            Pending::Put { nodes, heads } => self.complete_put(&d, nodes, heads),
            Pending::Prefetch {
                lock,
                tokens,
                host_pages,
                windows,
                skip,
            } => self.complete_prefetch(&d, lock, tokens, (host_pages, windows), skip),
        }
    }

    /// A load-back landed: its device pages are readable, the match lock is released.
    fn complete_load_back(&mut self, d: &Done, lock: NodeId, pages: Vec<u32>, windows: Vec<u32>) {
        self.stats
            .load_back
            .add(pages.len() as u64, d.bytes, d.nanos);
        for p in &pages {
            self.loading.remove(p);
        }
        for w in &windows {
            self.loading_windows.remove(w);
        }
        self.tree.unlock(lock);
    }

    /// A backup landed: evicts the nodes it was freeing, then writes them on to L3.
    fn complete_backup(&mut self, d: &Done, lock: NodeId, nodes: Vec<NodeId>, evict_after: bool) {
        self.stats.backup.add(d.pages_ok as u64, d.bytes, d.nanos);
        self.tree.unlock(lock);
        if evict_after {
            for &n in &nodes {
                // A request may have matched it meanwhile; then it stays on device.
                let v = self.tree.view(n);
                if v.lock_ref == 0 && !v.device.is_empty() && v.device_children == 0 {
                    self.drop_device(n);
                }
            }
        }
        if self.planes.storage.is_some() {
            self.put_to_storage(nodes);
        }
    }

    /// An L3 write landed: unpins the host pages and marks the nodes (and heads split off
    /// them meanwhile) as stored, announcing them when the storage is shared.
    fn complete_put(&mut self, d: &Done, nodes: Vec<NodeId>, heads: Vec<NodeId>) {
        self.stats
            .storage_put
            .add(d.pages_ok as u64, d.bytes, d.nanos);
        self.stats.storage_errors += d.errors;
        for &n in &nodes {
            self.tree.host_unlock(n);
            if d.errors == 0 {
                self.tree.set_in_storage(n, true);
            }
        }
        let shared = self
            .planes
            .storage
            .as_ref()
            .is_some_and(|s| s.tier().contains("remote"));
        if d.errors == 0 && shared {
            let mut all = nodes.clone();
            all.extend(heads.iter().copied());
            self.emit(true, Tier::Remote, &all);
        }

        for &n in &heads {
            if self.tree.is_live(n) {
                // Split off a pinned node: it took the pin (tree/insert.rs, `split`).
                self.tree.host_unlock(n);
                if d.errors == 0 {
                    self.tree.set_in_storage(n, true);
                }
            }
        }
    }

    /// An L3 read landed: inserts the pages found on host (with the window pages that came
    /// with them), frees the rest.
    fn complete_prefetch(
        &mut self,
        d: &Done,
        lock: NodeId,
        tokens: Vec<u32>,
        (host_pages, mut windows): (Vec<u32>, Vec<u32>),
        skip: usize,
    ) {
        self.stats
            .storage_get
            .add(d.pages_ok as u64, d.bytes, d.nanos);
        self.stats.storage_errors += d.errors;
        let ok = d.pages_ok;
        self.stats.storage_read_misses += (host_pages.len() - ok) as u64;
        self.host_alloc
            .free(&host_pages[ok..])
            .expect("prefetch pages are held");
        self.held_host -= host_pages.len();
        // Window pages asked for but not written (an entry without its window part, or past
        // the pages found) go back.
        let mut unwritten = Vec::new();
        for (i, w) in windows.iter_mut().enumerate() {
            if *w != NO_PAGE && !d.windows.get(i).copied().unwrap_or(false) {
                unwritten.push(std::mem::replace(w, NO_PAGE));
            }
        }
        let asked = windows.len().min(ok);
        windows.truncate(asked);
        let held_windows = windows.iter().filter(|&&w| w != NO_PAGE).count() + unwritten.len();
        self.held_hwin -= held_windows;
        self.hwin_alloc
            .free(&unwritten)
            .expect("prefetch window pages are held");
        let ps = self.page_size();
        let ins = self.tree.insert_with_windows(
            &tokens[..(skip + ok) * ps],
            &host_pages[..ok],
            &windows,
            Slot::Host,
            skip,
        );
        self.host_alloc
            .free(&ins.unused)
            .expect("prefetch pages are held");
        self.hwin_alloc
            .free(&ins.unused_windows)
            .expect("prefetch window pages are held");
        for &n in &ins.filled {
            self.tree.set_in_storage(n, true);
        }
        let filled = ins.filled.clone();
        self.emit(true, Tier::Host, &filled);
        self.tree.unlock(lock);
    }

    pub(super) fn put_to_storage(&mut self, nodes: Vec<NodeId>) {
        let mut host_pages = Vec::new();
        let mut windows = Vec::new();
        let mut hashes = Vec::new();
        let mut locked = Vec::new();
        for n in nodes {
            let v = self.tree.view(n);
            if v.in_storage || v.host.is_empty() {
                continue;
            }
            v.host.extend_into(&mut host_pages);
            if self.has_window() {
                let win = |i: usize| v.host_win.get(i).copied().filter(|&w| w != NO_PAGE);
                windows.extend((0..v.host.len()).map(win));
            }
            hashes.extend_from_slice(v.hashes);
            locked.push(n);
        }
        if locked.is_empty() {
            return;
        }
        for &n in &locked {
            self.tree.host_lock(n);
        }
        self.submit(
            JobKind::Put {
                host_pages,
                windows,
                hashes,
            },
            Pending::Put {
                nodes: locked,
                heads: Vec::new(),
            },
        );
    }
}
