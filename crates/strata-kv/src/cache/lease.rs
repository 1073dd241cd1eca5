//! A request's hold on the cache: the [`Lease`].
//!
//! One lease per request, from admission to the end. It owns everything the request holds:
//! the lock on its matched prefix, the device pages reserved for its tokens, the tickets of
//! the L3 prefetch and host → device load-back serving its prefix, and the page arithmetic
//! that turns those into the request's page list (surplus reservation handed back, the last
//! prompt page copied on write). The caller sees page numbers and token counts only, never a
//! tree node.
//!
//! Lifecycle: [`TieredCache::admit`] (or [`TieredCache::admit_computed`] for K/V computed
//! elsewhere) → [`TieredCache::advance`] until [`Lease::is_ready`] → compute into
//! [`Lease::pages`] from [`Lease::start`] → [`TieredCache::commit`] (whole pages join the tree)
//! or [`TieredCache::release`]. A lease dropped without either is released at the cache's
//! next `poll`, `admit` or `wait_all`: nothing leaks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::layout::Class;
use crate::policy::PrefetchPolicy;
use crate::tree::{NodeId, TreeMatch, NO_PAGE, ROOT};

use super::{CacheMatch, Ticket, TieredCache};

/// Prompt tokens served from each tier (whose K/V were not computed for this request).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Served {
    pub device: usize,
    pub host: usize,
    /// Prefetched from L3 for this request.
    pub storage: usize,
}

impl Served {
    pub fn total(&self) -> usize {
        self.device + self.host + self.storage
    }

    /// The same, counting `tokens` at most (what goes over comes off the device's share
    /// first: a page-aligned prompt held whole counts its last token, a device copy).
    pub fn capped(mut self, tokens: usize) -> Served {
        let mut over = self.total().saturating_sub(tokens);
        for t in [&mut self.device, &mut self.host, &mut self.storage] {
            let cut = over.min(*t);
            *t -= cut;
            over -= cut;
        }
        self
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// L3 → host copy in flight (waited for until the deadline, if any), for these prompt
    /// tokens; then load-back.
    Prefetch(Ticket, Option<Instant>, Vec<u32>),
    /// Host → device copy in flight.
    Loading(Option<Ticket>),
    Ready,
}

/// What a lease holds; moved to the cache's release queue if the lease is dropped.
#[derive(Debug)]
pub(super) struct Held {
    pub(super) prompt_len: usize,
    /// Tokens reserved: prompt + new tokens.
    pub(super) reserve_tokens: usize,
    /// Deepest tree node of the prefix in use (locked; ROOT if none).
    pub(super) lock: NodeId,
    pub(super) matched: CacheMatch,
    pub(super) phase: Phase,
    /// Before ready: the reservation. Ready: the prefix's pages (tree-owned) then the own.
    pub(super) pages: Vec<u32>,
    /// With window kinds: a device window page per entry of `pages` (the own ones held by the
    /// lease; the prefix's the tree's, NO_PAGE where a page has none). Empty otherwise. In
    /// ring mode, before ready: the reserved window pages, in no order (`ring.rs`).
    pub(super) windows: Vec<u32>,
    /// Ring mode, once ready: window pages held and not assigned to a page.
    pub(super) ring: Vec<u32>,
    /// Ring mode: own pages before this one were looked at for release for good.
    pub(super) swept: usize,
    /// Window pages held for the span's load-back (handed to it when it starts).
    pub(super) spare: Vec<u32>,
    pub(super) prefix_pages: usize,
    /// Pages of the prompt the cache held when it was admitted, before the window rule cut
    /// the hit back: where this prompt left the cached prefixes (its branch point).
    pub(super) branch: usize,
    /// Tokens at the start of the prompt that later prompts are expected to share
    /// ([`Lease::set_shared_prefix`]; 0: none).
    pub(super) shared: usize,
    /// Positions whose K/V are in `pages` once ready.
    pub(super) start: usize,
    pub(super) served: Served,
    /// The request's session and its leaf at admission ([`TieredCache::set_session`]).
    pub(super) session: Option<super::session::LeaseSession>,
}

impl Held {
    /// Where a continuation may resume besides its end and checkpoints, in pages: its
    /// branch point, its prompt's end and the end of its shared prefix.
    pub(super) fn points(&self, ps: usize) -> [usize; 3] {
        [self.branch, self.prompt_len / ps, self.shared / ps]
    }

    pub(super) fn is_ready(&self) -> bool {
        self.phase == Phase::Ready
    }

    fn own(&self) -> &[u32] {
        &self.pages[self.prefix_pages..]
    }

    fn own_windows(&self) -> &[u32] {
        self.windows.get(self.prefix_pages..).unwrap_or(&[])
    }
}

/// Leases dropped without a commit or release, waiting for the cache to release them (the
/// flag spares the lock when there are none).
#[derive(Debug, Default)]
pub(super) struct Dropped {
    any: AtomicBool,
    held: Mutex<Vec<Held>>,
}

pub(super) type DropQueue = Arc<Dropped>;

/// A request's locks, reserved pages and copies in flight; see the module docs.
#[derive(Debug)]
pub struct Lease {
    held: Option<Held>,
    dropped: DropQueue,
}

impl Lease {
    fn held(&self) -> &Held {
        self.held.as_ref().expect("a lease holds until consumed")
    }

    pub(super) fn held_mut(&mut self) -> &mut Held {
        self.held.as_mut().expect("a lease holds until consumed")
    }

    /// Its prefix is on device and its pages are in position order: compute may start.
    pub fn is_ready(&self) -> bool {
        self.held().phase == Phase::Ready
    }

    /// Device pages in position order (prefix then own); final once ready.
    pub fn pages(&self) -> &[u32] {
        &self.held().pages
    }

    /// With window kinds: the device window page of each entry of [`Lease::pages`] (NO_PAGE
    /// where a page has none: a page the computation does not read, or with checkpoints one
    /// not yet secured by [`TieredCache::secure_windows`]); empty otherwise.
    pub fn windows(&self) -> &[u32] {
        &self.held().windows
    }

    /// Positions whose K/V the pages already hold (meaningful once ready).
    pub fn start(&self) -> usize {
        self.held().start
    }

    /// Pages at its start that the tree holds (once ready; its own pages follow).
    pub fn prefix_pages(&self) -> usize {
        self.held().prefix_pages
    }

    /// Prompt tokens served per tier (final once ready).
    pub fn served(&self) -> Served {
        self.held().served
    }

    /// Device pages the request holds itself (not the tree's).
    pub fn own_pages(&self) -> usize {
        self.held().own().len()
    }

    /// The first `tokens` of the prompt are where later prompts are expected to leave it (a
    /// chat's system part, up to where each user's turn starts): with window kinds and
    /// checkpoints, the commit keeps the window state before that point, so their hits
    /// resume there instead of backing off. Set before computing; clamped to the prompt.
    pub fn set_shared_prefix(&mut self, tokens: usize) {
        let h = self.held_mut();
        h.shared = tokens.min(h.prompt_len);
    }

    /// Waiting for an L3 prefetch.
    pub fn prefetching(&self) -> bool {
        matches!(self.held().phase, Phase::Prefetch(..))
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(h) = self.held.take() {
            let mut q = self.dropped.held.lock().expect("drop queue lock");
            q.push(h);
            self.dropped.any.store(true, Ordering::Release);
        }
    }
}

impl TieredCache {
    /// Admits a request: matches `prompt` (unless `use_prefix` is false), locks the match,
    /// reserves device pages for `prompt + new_tokens` tokens (the worst case: nothing loaded
    /// back), records the match's statistics, and starts the L3 prefetch and the load-back.
    /// None when the pages cannot be reserved now (nothing is held or counted then).
    pub fn admit(
        &mut self,
        prompt: &[u32],
        new_tokens: usize,
        use_prefix: bool,
        prefetch: PrefetchPolicy,
    ) -> Option<Lease> {
        assert!(
            !prompt.is_empty(),
            "a request has at least one prompt token"
        );
        self.release_dropped();
        let ps = self.page_size();
        let m = if use_prefix {
            self.lookup(prompt)
        } else {
            CacheMatch {
                queried_tokens: prompt.len(),
                last: ROOT,
                ..CacheMatch::default()
            }
        };
        self.tree.lock(m.last);
        let branch = (m.cached_tokens() + m.window_cut_tokens) / ps;
        // The last prompt token is always computed (its logits give the first token): at
        // most the pages before it are used as they are, and only as far as the window pages
        // on device allow.
        let dev_pages = (m.device_tokens / ps).min((prompt.len() - 1) / ps);
        let dev_pages = self.device_usable(&m.path, dev_pages, prompt.len());
        let reserve_tokens = prompt.len() + new_tokens;
        let total = reserve_tokens.div_ceil(ps);
        // Room for the whole page list (prefix + own) once ready: no reallocation then.
        let mut own = Vec::with_capacity(total);
        if !self.alloc_device_into(total - dev_pages, &mut own) {
            self.tree.unlock(m.last);
            return None;
        }
        let (mut windows, mut spare) = (Vec::new(), Vec::new());
        if self.has_window() {
            let Some(w) = self.alloc_windows(self.window_reserve(total - dev_pages)) else {
                self.free_device(&own).expect("just allocated");
                self.tree.unlock(m.last);
                return None;
            };
            windows = w;
            // Best effort, without waiting: room to load the span's window pages back.
            let want = self.spare_needed(&m);
            spare = self.alloc_windows_upto(want);
        }
        self.record(&m);
        let mut m = m;
        let phase = self.start_prefetch(prompt, &mut m, prefetch);
        let mut held = Held {
            prompt_len: prompt.len(),
            reserve_tokens,
            lock: m.last,
            matched: m,
            phase,
            pages: own,
            windows,
            spare,
            ring: Vec::new(),
            swept: 0,
            prefix_pages: 0,
            branch,
            shared: 0,
            start: 0,
            served: Served::default(),
            session: None,
        };
        if held.phase == Phase::Loading(None) {
            self.start_load_back(&mut held);
        }
        Some(self.lease(held))
    }

    pub(super) fn lease(&mut self, held: Held) -> Lease {
        Lease {
            held: Some(held),
            dropped: self.dropped.clone(),
        }
    }

    /// Moves a lease forward as its copies land (prefetched → loading back → ready). True
    /// once it is ready.
    pub fn advance(&mut self, lease: &mut Lease) -> bool {
        debug_assert!(
            Arc::ptr_eq(&lease.dropped, &self.dropped),
            "a lease of this cache"
        );
        let h = lease.held.as_mut().expect("a lease holds until consumed");
        match &h.phase {
            Phase::Ready => return true,
            Phase::Prefetch(t, deadline, _)
                if self.is_done(*t) || deadline.is_some_and(|d| Instant::now() >= d) =>
            {
                self.after_prefetch(h);
            }
            Phase::Loading(t) if t.is_none_or(|t| self.is_done(t)) && self.prefix_landed(h) => {
                self.make_ready(h);
            }
            _ => {}
        }
        h.phase == Phase::Ready
    }

    /// The prefetched pages joined the tree as host nodes: match again and load them back.
    fn after_prefetch(&mut self, h: &mut Held) {
        let ps = self.page_size();
        let Phase::Prefetch(_, _, prompt) = std::mem::replace(&mut h.phase, Phase::Loading(None))
        else {
            unreachable!("called in the prefetch phase")
        };
        // The tree alone: L3 was asked at admission.
        let tm = self.tree.match_prefix(&prompt);
        let mut m = CacheMatch {
            queried_tokens: prompt.len(),
            device_tokens: tm.device_tokens,
            host_tokens: tm.host_tokens,
            last: tm.last,
            path: tm.path,
            ..CacheMatch::default()
        };
        // Pages read without their window part may leave the end unusable.
        self.window_rule(&mut m);
        self.stats.window_cut_tokens += m.window_cut_tokens as u64;
        self.tree.lock(m.last);
        self.tree.unlock(h.lock);
        h.lock = m.last;
        let tree_pages = (m.device_tokens + m.host_tokens) / ps;
        let before = (h.matched.device_tokens + h.matched.host_tokens) / ps;
        h.served.storage = tree_pages.saturating_sub(before) * ps;
        // Host tokens now include the prefetched ones.
        h.matched = m;
        self.start_load_back(h);
    }

    /// Starts copying the host-only part of the lease's match to the device.
    fn start_load_back(&mut self, h: &mut Held) {
        let ps = self.page_size();
        let m = &h.matched;
        // Loaded pages the request will use in place of reserved ones (see `make_ready`).
        let usable = (h.prompt_len - 1) / ps;
        let host_pages = (m.host_tokens / ps).min(usable.saturating_sub(m.device_tokens / ps));
        let mut ticket = None;
        if host_pages > 0 || !self.window_loads(m.last, m.queried_tokens).is_empty() {
            // Those positions will come from the tree: hand the reserved pages back first, so
            // the load-back can land in them. (Freed after it, a pool sized for one long
            // request would need room for it twice, and long prompts would be recomputed.)
            let surplus: Vec<u32> = h.pages.drain(..host_pages).collect();
            self.free_device(&surplus).expect("reserved pages are held");
            let wn = host_pages.min(h.windows.len());
            let wsurplus: Vec<u32> = h.windows.drain(..wn).collect();
            self.free_windows(&wsurplus);
            let spare = std::mem::take(&mut h.spare);
            self.free_windows(&spare);
            match self.load_back(&h.matched) {
                Some(t) => ticket = Some(t),
                None => {
                    // Not loaded (no room): take the reservation back; a failed load-back
                    // allocates nothing, so the pages just freed are still free.
                    let back = self
                        .alloc_device(host_pages)
                        .expect("the pages just freed are free");
                    h.pages.splice(0..0, back);
                    let wback = self
                        .alloc_windows(wn)
                        .expect("the window pages just freed are free");
                    h.windows.splice(0..0, wback);
                }
            }
        }
        h.phase = Phase::Loading(ticket);
    }

    /// No page of the lease's prefix is still being written by a load-back (another request's
    /// may have put it on device, with its copy still in flight).
    fn prefix_landed(&mut self, h: &Held) -> bool {
        if self.loading.is_empty() && self.loading_windows.is_empty() {
            return true;
        }
        let mut path = std::mem::take(&mut self.scratch_path);
        self.tree.path_into(h.lock, &mut path);
        let landed = path.iter().all(|&n| {
            let v = self.tree.view(n);
            !v.device.iter().any(|p| self.loading.contains(&p))
                && !v
                    .device_win
                    .iter()
                    .any(|w| self.loading_windows.contains(w))
        });
        self.scratch_path = path;
        landed
    }

    /// Starts reading the match's L3 part, if any: the prefetch phase, or (nothing to read, or
    /// no room to read it) the load-back phase with the tree part alone.
    fn start_prefetch(
        &mut self,
        prompt: &[u32],
        m: &mut CacheMatch,
        prefetch: PrefetchPolicy,
    ) -> Phase {
        if m.storage_tokens == 0 {
            return Phase::Loading(None);
        }
        if let Some(t) = self.prefetch(prompt, m) {
            let deadline = match prefetch {
                PrefetchPolicy::WaitComplete => None,
                PrefetchPolicy::BestEffort => Some(Instant::now()),
                PrefetchPolicy::Timeout { per_token } => {
                    Some(Instant::now() + per_token * m.storage_tokens as u32)
                }
            };
            return Phase::Prefetch(t, deadline, prompt.to_vec());
        }
        // No room to read L3: the tree part alone must be continued from.
        self.drop_storage_part(m);
        Phase::Loading(None)
    }

    /// A match whose L3 part will not be read: drops it and applies the window rule to the
    /// tree part, moving the lock to the new end.
    fn drop_storage_part(&mut self, m: &mut CacheMatch) {
        m.storage_tokens = 0;
        m.storage_hashes.clear();
        // Copies that landed since the match may have split nodes of its path.
        m.path = self.tree.path_to(m.last);
        let old = m.last;
        let cut = m.window_cut_tokens;
        self.window_rule(m);
        self.stats.window_cut_tokens += (m.window_cut_tokens - cut) as u64;
        if m.last != old {
            self.tree.lock(m.last);
            self.tree.unlock(old);
        }
    }

    /// The prefix is on device: lay out the request's pages in position order. Stays not
    /// ready when the pages for positions the prefix cannot serve cannot be had yet.
    fn make_ready(&mut self, h: &mut Held) {
        let ps = self.page_size();
        // Prefix device pages along the path, root first. The path is read again from the
        // locked node: nodes on it may have been split since the match (an insert diverging
        // inside one), and a split node keeps its id for the suffix.
        // Pages used as they are: those before the last prompt token's page.
        let keep = (h.prompt_len - 1) / ps;
        let mut path = std::mem::take(&mut self.scratch_path);
        self.tree.path_into(h.lock, &mut path);
        let mut prefix = std::mem::take(&mut self.scratch_pages);
        prefix.clear();
        for &n in &path {
            let v = self.tree.view(n);
            if v.device.is_empty() || prefix.len() > keep {
                break;
            }
            v.device.extend_into(&mut prefix);
        }
        // As far as the window pages on device allow (never below the reservation's count).
        let mut prefix_windows = Vec::new();
        if self.has_window() {
            self.window_prefix(h, &mut path, &mut prefix, &mut prefix_windows);
        }
        self.scratch_path = path;
        // A page-aligned prompt matched in full: its last page also holds the last token,
        // which is computed again. Copy the page (copy-on-write: the tree's page stays
        // untouched) and compute only that token.
        let cow = prefix.get(keep).copied();
        let cow_window = prefix_windows.get(keep).copied().filter(|&w| w != NO_PAGE);
        prefix.truncate(keep);
        prefix_windows.truncate(keep);
        // Pages not loaded (no room) are computed into the reserved pages.
        let own_needed = h.reserve_tokens.div_ceil(ps) - prefix.len();
        if !self.top_up(h, own_needed) {
            // Not now: a later advance tries again (requests finishing free pages).
            self.scratch_pages = prefix;
            return;
        }
        if h.pages.len() > own_needed {
            self.free_device(&h.pages[own_needed..])
                .expect("reserved pages are held");
            h.pages.truncate(own_needed);
        }
        let wneeded = self.window_reserve(own_needed);
        if h.windows.len() > wneeded {
            let surplus = h.windows.split_off(wneeded);
            self.free_windows(&surplus);
        }
        self.ring_start(h, own_needed, prefix.len());
        h.prefix_pages = prefix.len();
        h.start = h.prefix_pages * ps;
        if let Some(src) = cow {
            if cow_window.is_some() {
                self.ring_assign_first(h);
            }
            if let Some(pool) = self.device_pool() {
                pool.copy_page(Class::Main, src, h.pages[0]);
                if let (Some(w), Some(&dst)) = (cow_window, h.windows.first()) {
                    pool.copy_page(Class::Window, w, dst);
                }
            }
            h.start = h.prompt_len - 1;
        }
        h.pages.splice(0..0, prefix.iter().copied());
        if self.has_window() {
            h.windows.splice(0..0, prefix_windows);
        }
        self.scratch_pages = prefix;
        let dev = h.matched.device_tokens.min(h.start);
        let storage = h.served.storage.min(h.start - dev);
        h.served = Served {
            device: dev,
            host: h.start - dev - storage,
            storage,
        };
        h.phase = Phase::Ready;
    }

    /// Cuts `prefix` to what the window pages on device allow (no longer pinning the rest),
    /// lays out its window pages in `windows`, and gives back the spare window pages.
    fn window_prefix(
        &mut self,
        h: &mut Held,
        path: &mut Vec<NodeId>,
        prefix: &mut Vec<u32>,
        windows: &mut Vec<u32>,
    ) {
        let ps = self.page_size();
        let usable = self.device_usable(path, prefix.len(), h.prompt_len);
        if usable < prefix.len() {
            // The rest cannot be continued from: stop pinning it (its pages may make room
            // for this request's own).
            self.relock(h, usable * ps);
            self.tree.path_into(h.lock, path);
        }
        prefix.truncate(usable);
        self.path_device_windows(path, prefix.len(), windows);
        let spare = std::mem::take(&mut h.spare);
        self.free_windows(&spare);
    }

    /// Moves the lease's lock up to the node ending at `tokens` of its path (splitting there).
    fn relock(&mut self, h: &mut Held, tokens: usize) {
        let path = self.tree.path_to(h.lock);
        let total = path.iter().map(|&n| self.tree.view(n).tokens.len()).sum();
        let mut tm = TreeMatch {
            path,
            device_tokens: total,
            host_tokens: 0,
            last: h.lock,
        };
        self.tree.truncate_match(&mut tm, tokens);
        if tm.last != h.lock {
            self.tree.lock(tm.last);
            self.tree.unlock(h.lock);
            h.lock = tm.last;
        }
    }

    /// Makes sure the lease holds `own` pages (and window pages) of its own: the reservation
    /// covers the prefix the match promised, but a prefix cut back further (window pages that
    /// could not be loaded) needs more. False when they cannot be had now.
    fn top_up(&mut self, h: &mut Held, own: usize) -> bool {
        let short = own.saturating_sub(h.pages.len());
        let wshort = if self.has_window() {
            self.window_reserve(own).saturating_sub(h.windows.len())
        } else {
            0
        };
        if short == 0 && wshort == 0 {
            return true;
        }
        let mut pages = Vec::with_capacity(short);
        if !self.alloc_device_into(short, &mut pages) {
            return false;
        }
        let Some(w) = self.alloc_windows(wshort) else {
            self.free_device(&pages).expect("just allocated");
            return false;
        };
        h.pages.extend(pages);
        h.windows.extend(w);
        true
    }

    /// Ends a request that computed `tokens[..computed]` into its pages: the whole pages join
    /// the tree (backed up per the write policy); everything else returns to the pool. A lease
    /// that is not ready is released.
    pub fn commit(&mut self, mut lease: Lease, tokens: &[u32], computed: usize) {
        debug_assert!(
            Arc::ptr_eq(&lease.dropped, &self.dropped),
            "a lease of this cache"
        );
        let h = lease.held.take().expect("a lease holds until consumed");
        if h.phase != Phase::Ready {
            return self.release_held(h);
        }
        let ps = self.page_size();
        let computed = computed.min(tokens.len());
        let whole = (computed / ps).max(h.prefix_pages);
        let give = whole - h.prefix_pages;
        let (own, own_w) = (h.own(), h.own_windows());
        // Window pages kept only where a continuation can start (its end, checkpoints).
        let mut give_w = own_w[..give.min(own_w.len())].to_vec();
        let mut dropped = Vec::new();
        for (i, w) in give_w.iter_mut().enumerate() {
            if *w != NO_PAGE && !self.keeps_window(whole, h.points(ps), h.prefix_pages + i) {
                dropped.push(std::mem::replace(w, NO_PAGE));
            }
        }
        self.free_windows(&dropped);
        let ins =
            self.insert_with_windows(&tokens[..whole * ps], &own[..give], &give_w, h.prefix_pages);
        if let Some(s) = h.session {
            self.session_committed(s, tokens, h.prompt_len, ins.last);
        }
        self.observe_commit(&tokens[..whole * ps], h.prompt_len);
        self.free_device(&own[give..])
            .expect("request pages are held");
        if own_w.len() > give {
            self.free_windows(&own_w[give..]);
        }
        self.free_windows(&h.ring);
        self.tree.unlock(h.lock);
    }

    /// Ends a request without caching anything it computed.
    pub fn release(&mut self, mut lease: Lease) {
        debug_assert!(
            Arc::ptr_eq(&lease.dropped, &self.dropped),
            "a lease of this cache"
        );
        let h = lease.held.take().expect("a lease holds until consumed");
        self.release_held(h);
    }

    fn release_held(&mut self, h: Held) {
        if let Phase::Prefetch(t, _, _) | Phase::Loading(Some(t)) = h.phase {
            // The copy writes into pages the tree owns; let it land before unlocking.
            self.wait(t);
        }
        self.free_device(h.own()).expect("request pages are held");
        self.free_windows(h.own_windows());
        self.free_windows(&h.spare);
        self.free_windows(&h.ring);
        self.tree.unlock(h.lock);
    }

    /// Releases leases dropped without a commit or release.
    pub(super) fn release_dropped(&mut self) {
        if !self.dropped.any.swap(false, Ordering::Acquire) {
            return;
        }
        let dropped = std::mem::take(&mut *self.dropped.held.lock().expect("drop queue lock"));
        for h in dropped {
            self.release_held(h);
        }
    }
}
