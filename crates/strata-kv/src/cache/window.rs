//! Window pages in the tiered cache: the match rule, their allocation and eviction.
//!
//! A layout's window kinds are read only for the `w` tokens before the position a request
//! continues from (`PageLayout::window_tokens`), so each tier keeps them in a page space of
//! its own and may drop them from a node while keeping its main pages (`tree/window.rs`).
//! * **Match rule.** A hit ending at page `k` is usable only if every page covering
//!   `[s − w, s)` has its window page in some tier, `s` being where the request continues (the
//!   page boundary, or the last prompt token when a page-aligned prompt matched in full). A
//!   match backs off to the deepest such `k`; the tokens given up are counted
//!   (`window_cut_tokens`). L3 pages count as having theirs until read (an entry may be the
//!   main part only; the match after the read applies the rule again).
//! * **Eviction.** Window pages of unlocked nodes go first when window pages run short, in the
//!   policy's order, without a copy; main pages evicted take their window pages with them.
//! * **Leases** load (or keep) the window pages of the span before their start on device, and
//!   hold a window page for each page they compute — with checkpoints, only while a step can
//!   still read it or a commit will keep it (`ring.rs`).
//! * **Residency of committed prefixes** (`checkpoint_pages` K > 0): a committed sequence
//!   keeps the window pages a continuation can start from — those covering
//!   `[end − 1 − w, end)` (a continuation at its end, or a repeat of it continuing at its last
//!   token), those covering `[b − w, b)` for its branch point `b` (where it left the prefixes
//!   cached when it was admitted: a shared system prompt's end, from the second request that
//!   shares it on), for its prompt's end (a next turn that renders the answer otherwise
//!   continues there) and for the end of its shared prefix when the request names one (a
//!   chat's system part: other conversations leave it there, from the first request on),
//!   and, for every checkpoint boundary `c` (a multiple of K pages) inside it,
//!   those covering `[c − w, c)` — and gives the others back at commit. A later hit between
//!   checkpoints backs off to the nearest kept boundary by the match rule, and recomputes the
//!   rest. With K = 0 every page keeps its window page.

use std::ops::Range;

use crate::tree::{NodeId, Slot, TreeMatch, NO_PAGE};

use super::{CacheMatch, TieredCache};

/// A configuration's window pages against its layout: device window pages where the layout
/// has window kinds, none where it has not.
pub(super) fn check_pages(cfg: &super::CacheConfig) -> Result<(), super::CacheError> {
    let has_window = cfg.layout.has_window();
    if has_window && cfg.device_window_pages == 0 {
        return Err(super::CacheError::NoDeviceWindowPages);
    }
    if !has_window && (cfg.device_window_pages > 0 || cfg.host_window_pages > 0) {
        return Err(super::CacheError::WindowPagesWithoutWindowKinds);
    }
    Ok(())
}

impl TieredCache {
    /// Whether the layout has window kinds (and so window pages).
    pub fn has_window(&self) -> bool {
        self.window > 0
    }

    /// Whether a committed prefix of `whole` pages keeps the window page of its page `j`,
    /// `points` being its branch point, its prompt's end and its shared prefix's end in pages
    /// (see the module docs).
    pub(super) fn keeps_window(&self, whole: usize, points: [usize; 3], j: usize) -> bool {
        self.checkpoint_pages == 0
            || self.end_keeps(whole, j)
            || self.lasting_keeps(whole, points, j)
    }

    /// The end rule: page `j` covers `[end − 1 − w, end)` of a prefix of `whole` pages (its
    /// end, and one token before it: a repeat of a page-aligned prompt resumes there). Fewer
    /// pages the larger `whole`.
    pub(super) fn end_keeps(&self, whole: usize, j: usize) -> bool {
        let ps = self.page_size();
        j >= (whole * ps).saturating_sub(1 + self.window) / ps
    }

    /// The point and checkpoint rules: page `j` covers the window before one of `points` —
    /// the branch point (the next prompt that shares the prefix leaves it there too), the
    /// prompt's end (a next turn that renders the answer otherwise, or a retry, continues
    /// there) and the shared prefix's end (other conversations leave it there) — or before its nearest checkpoint at most `whole` pages in (later
    /// checkpoints' spans start later). A page a whole `window` before the least possible end
    /// gets the same answer for every larger `whole`.
    pub(super) fn lasting_keeps(&self, whole: usize, points: [usize; 3], j: usize) -> bool {
        let (k, ps) = (self.checkpoint_pages, self.page_size());
        let before = |b: usize| b > 0 && j < b && j >= (b * ps).saturating_sub(self.window) / ps;
        if points.into_iter().any(before) {
            return true;
        }
        let c = (j + 1).div_ceil(k) * k;
        c <= whole && (c * ps).saturating_sub(self.window) / ps <= j
    }

    /// Whether page `j` is in the span before a checkpoint of a prefix of `pages` pages (one a
    /// hit may back off to).
    pub(super) fn checkpoint_reads(&self, j: usize, pages: usize) -> bool {
        self.checkpoint_pages > 0 && self.lasting_keeps(pages, [0; 3], j)
    }

    /// Where a request over `len` prompt tokens continues from after using `pages` cached
    /// pages: their end, or the last prompt token when they cover it (copy-on-write).
    fn start_of(&self, pages: usize, len: usize) -> usize {
        let ps = self.page_size();
        if pages * ps >= len {
            len.saturating_sub(1)
        } else {
            pages * ps
        }
    }

    /// The pages whose window state a continuation after `pages` cached pages reads.
    pub(super) fn span(&self, pages: usize, len: usize) -> Range<usize> {
        let ps = self.page_size();
        let s = self.start_of(pages, len);
        s.saturating_sub(self.window) / ps..s.div_ceil(ps)
    }

    /// The deepest `k ≤ ok.len()` whose span has a window page in every page (`ok`).
    fn deepest_usable(&self, ok: &[bool], len: usize) -> usize {
        let mut bad = Vec::with_capacity(ok.len() + 1);
        bad.push(0usize);
        for &o in ok {
            bad.push(bad.last().unwrap() + usize::from(!o));
        }
        (1..=ok.len())
            .rev()
            .find(|&k| {
                let r = self.span(k, len);
                bad[r.end.min(k)] == bad[r.start.min(k)]
            })
            .unwrap_or(0)
    }

    /// Per page of the path, whether it holds a window page (on device only, or in any tier).
    fn path_windows_ok(&self, path: &[NodeId], device_only: bool) -> Vec<bool> {
        let mut ok = Vec::new();
        for &n in path {
            let v = self.tree.view(n);
            let pages = v.tokens.len() / self.page_size();
            for i in 0..pages {
                let real = |l: &[u32]| l.get(i).is_some_and(|&w| w != NO_PAGE);
                ok.push(real(v.device_win) || (!device_only && real(v.host_win)));
            }
        }
        ok
    }

    /// Applies the match rule (see the module docs) to `m`.
    pub(super) fn window_rule(&mut self, m: &mut CacheMatch) {
        if self.window == 0 {
            return;
        }
        let ps = self.page_size();
        let tree_pages = (m.device_tokens + m.host_tokens) / ps;
        let mut ok = self.path_windows_ok(&m.path, false);
        ok.truncate(tree_pages);
        ok.resize(tree_pages + m.storage_hashes.len(), true);
        let k = self.deepest_usable(&ok, m.queried_tokens);
        if k == ok.len() {
            return;
        }
        m.window_cut_tokens += (ok.len() - k) * ps;
        if k >= tree_pages {
            m.storage_hashes.truncate(k - tree_pages);
            m.storage_tokens = m.storage_hashes.len() * ps;
            return;
        }
        m.storage_hashes.clear();
        m.storage_tokens = 0;
        let mut tm = TreeMatch {
            path: std::mem::take(&mut m.path),
            device_tokens: m.device_tokens,
            host_tokens: m.host_tokens,
            last: m.last,
        };
        self.tree.truncate_match(&mut tm, k * ps);
        m.path = tm.path;
        m.device_tokens = tm.device_tokens;
        m.host_tokens = tm.host_tokens;
        m.last = tm.last;
    }

    /// The deepest number of the first `pages` device pages along `path` a request over `len`
    /// prompt tokens can continue from with the window pages on device alone.
    pub(super) fn device_usable(&self, path: &[NodeId], pages: usize, len: usize) -> usize {
        if self.window == 0 {
            return pages;
        }
        let mut ok = self.path_windows_ok(path, true);
        ok.truncate(pages);
        self.deepest_usable(&ok, len)
    }

    /// Span pages of the tree path to `last` (a prompt of `len` tokens continuing after it)
    /// lacking a device window page that the host has: (node, page index in the node, host
    /// window page). The path is read now: nodes on it may have split since the match.
    pub(super) fn window_loads(&self, last: NodeId, len: usize) -> Vec<(NodeId, usize, u32)> {
        if self.window == 0 {
            return Vec::new();
        }
        let ps = self.page_size();
        let path = self.tree.path_to(last);
        let tree_pages: usize = path
            .iter()
            .map(|&n| self.tree.view(n).tokens.len() / ps)
            .sum();
        let span = self.span(tree_pages, len);
        let mut out = Vec::new();
        let mut at = 0;
        for &n in &path {
            let v = self.tree.view(n);
            for i in 0..v.tokens.len() / ps {
                let has = |l: &[u32]| l.get(i).copied().filter(|&w| w != NO_PAGE);
                if span.contains(&(at + i)) && has(v.device_win).is_none() {
                    if let Some(h) = has(v.host_win) {
                        out.push((n, i, h));
                    }
                }
            }
            at += v.tokens.len() / ps;
        }
        out
    }

    /// `n` device window pages (held by the caller), evicting window pages per policy; None
    /// when they cannot be freed.
    pub(super) fn alloc_windows(&mut self, n: usize) -> Option<Vec<u32>> {
        if n == 0 {
            return Some(Vec::new());
        }
        loop {
            let avail = self.dwin_alloc.available() as usize;
            if avail >= n {
                break;
            }
            self.evict_device_windows(n - avail);
            if self.dwin_alloc.available() as usize >= n || self.pending.is_empty() {
                break;
            }
            // Holders may be locked by copies in flight: let one land.
            self.complete_one();
        }
        let v = self.dwin_alloc.alloc(n)?;
        self.held_dwin += n;
        Some(v)
    }

    /// Up to `n` device window pages (held by the caller) without waiting for a copy: as many
    /// as are free or can be freed now (every page evicted for it is used).
    pub(super) fn alloc_windows_upto(&mut self, n: usize) -> Vec<u32> {
        let v = self.windows_upto(Slot::Device, n);
        self.held_dwin += v.len();
        v
    }

    /// Up to `n` window pages of `slot`, evicting that tier's window pages for them.
    fn windows_upto(&mut self, slot: Slot, n: usize) -> Vec<u32> {
        let avail = |c: &Self| match slot {
            Slot::Device => c.dwin_alloc.available(),
            Slot::Host => c.hwin_alloc.available(),
        } as usize;
        if avail(self) < n {
            self.evict_windows(slot, n - avail(self));
        }
        let k = n.min(avail(self));
        let alloc = match slot {
            Slot::Device => &mut self.dwin_alloc,
            Slot::Host => &mut self.hwin_alloc,
        };
        alloc.alloc(k).expect("available pages")
    }

    /// Returns device window pages obtained from [`TieredCache::alloc_windows`] (NO_PAGE
    /// entries are skipped).
    pub(super) fn free_windows(&mut self, windows: &[u32]) {
        let real: Vec<u32> = windows.iter().copied().filter(|&w| w != NO_PAGE).collect();
        self.dwin_alloc
            .free(&real)
            .expect("window pages were held by the caller");
        self.held_dwin -= real.len();
    }

    /// Up to `n` host window pages (not held: the caller hands them to the tree or frees
    /// them), evicting host window pages per policy.
    pub(super) fn alloc_host_windows(&mut self, n: usize) -> Vec<u32> {
        self.windows_upto(Slot::Host, n)
    }

    /// Drops window pages of unlocked nodes from the device tier until `n` are free or none
    /// is left to drop; returns how many were freed.
    pub fn evict_device_windows(&mut self, n: usize) -> usize {
        self.evict_windows(Slot::Device, n)
    }

    /// The same for the host tier.
    pub fn evict_host_windows(&mut self, n: usize) -> usize {
        self.evict_windows(Slot::Host, n)
    }

    fn evict_windows(&mut self, slot: Slot, n: usize) -> usize {
        let mut got = 0;
        // What short sequence ends read of their parents' last pages.
        let span = (self.window + 1).div_ceil(self.page_size());
        let protect = self.tree.window_protection(slot, span);
        while got < n {
            let Some((v, keep)) = self.tree.window_victim_protected(slot, &protect, |_| false)
            else {
                break;
            };
            let k = self.drop_windows_before(v, slot, keep);
            got += k;
            match slot {
                Slot::Device => self.stats.evicted_device_window_pages += k as u64,
                Slot::Host => self.stats.evicted_host_window_pages += k as u64,
            }
        }
        got
    }

    /// Frees the window pages of `id` in `slot` but those of its last `keep` pages; returns
    /// how many.
    fn drop_windows_before(&mut self, id: NodeId, slot: Slot, keep: usize) -> usize {
        let w = self.tree.take_windows_before(id, slot, keep);
        let alloc = match slot {
            Slot::Device => &mut self.dwin_alloc,
            Slot::Host => &mut self.hwin_alloc,
        };
        alloc.free(&w).expect("tree window pages are allocated");
        w.len()
    }

    /// Frees the window pages of `id` in `slot` (before its main pages leave that tier);
    /// returns how many.
    pub(super) fn drop_windows(&mut self, id: NodeId, slot: Slot) -> usize {
        self.drop_windows_before(id, slot, 0)
    }

    /// Window pages a lease may need to load its span's window state onto the device: span
    /// pages the tree's device lacks (and the host has), plus L3 pages inside the span.
    pub(super) fn spare_needed(&self, m: &CacheMatch) -> usize {
        if self.window == 0 {
            return 0;
        }
        let ps = self.page_size();
        let tree = (m.device_tokens + m.host_tokens) / ps;
        let all = tree + m.storage_hashes.len();
        let span = self.span(all, m.queried_tokens);
        let in_l3 = (tree..all).filter(|p| span.contains(p)).count();
        self.window_loads(m.last, m.queried_tokens).len() + in_l3
    }

    /// The device window entry of every page along `path` (NO_PAGE where none), `pages` long.
    pub(super) fn path_device_windows(&self, path: &[NodeId], pages: usize, out: &mut Vec<u32>) {
        out.clear();
        for &n in path {
            if out.len() >= pages {
                break;
            }
            let v = self.tree.view(n);
            let np = v.tokens.len() / self.page_size();
            if v.device_win.is_empty() {
                out.extend(std::iter::repeat_n(NO_PAGE, np));
            } else {
                out.extend_from_slice(v.device_win);
            }
        }
        out.truncate(pages);
    }
}
