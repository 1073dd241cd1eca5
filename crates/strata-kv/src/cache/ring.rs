//! A running request's window pages: a ring over the span it can still read.
//!
//! With checkpoint residency (`checkpoint_pages` K > 0) a request does not hold a window page
//! for every page it computes. Once ready it holds them for the pages a step can still read
//! or write — those covering `[pos − w, end of the step)` — plus the ones a commit will keep
//! for good (its checkpoints, branch point, prompt's end and shared prefix's end, see
//! `window.rs`); a page that leaves the span otherwise gives its window page back to the
//! lease's ring, which the next pages reuse.
//! [`TieredCache::secure_windows`] does this before each model call. The longest request is
//! then bounded by its main pages only.
//!
//! Invariants:
//! * A ready lease holds at least `min(ring_min, own pages)` window pages (assigned or in its
//!   ring), `ring_min` being the most own pages a one-token step reads or writes; so
//!   `secure_windows` always grants at least one token, by reusing its ring, taking free
//!   pages, or at worst giving up a page it kept for a checkpoint.
//! * A page released early is one no commit would keep: it is before the span, and neither
//!   a checkpoint, the branch point, the prompt's end nor the shared prefix's end keeps it
//!   (those do not depend on how far the request gets), nor the end rule for the least end the request can still
//!   commit (the end rule keeps fewer pages the further the end).

use crate::tree::NO_PAGE;

use super::lease::{Held, Lease};
use super::TieredCache;

impl TieredCache {
    /// Whether running requests hold window pages for their span only (a layout with window
    /// kinds and checkpoint residency).
    pub(super) fn ring_mode(&self) -> bool {
        self.window > 0 && self.checkpoint_pages > 0
    }

    /// The most own pages whose window state a step of one token reads or writes.
    pub(super) fn ring_min(&self) -> usize {
        self.window.div_ceil(self.page_size()) + 1
    }

    /// Window pages a lease that computes `own` pages reserves.
    pub(super) fn window_reserve(&self, own: usize) -> usize {
        if self.ring_mode() {
            own.min(self.ring_min())
        } else {
            own
        }
    }

    /// The most tokens one request can compute: a page for each, and a window page for each
    /// without ring mode (with it, its ring, unless the window pages hold less).
    pub fn request_capacity_tokens(&self) -> usize {
        let mut pages = self.device_usage().pages_total as usize;
        if self.has_window() {
            let windows = self.window_usage().0.pages_total as usize;
            if !self.ring_mode() || windows < self.ring_min() {
                pages = pages.min(windows);
            }
        }
        pages * self.page_size()
    }

    /// At ready (ring mode): the reservation becomes the ring; the lease's `own` pages get
    /// their window pages as it computes, from page `prefix` on.
    pub(super) fn ring_start(&self, h: &mut Held, own: usize, prefix: usize) {
        if self.ring_mode() {
            h.ring = std::mem::replace(&mut h.windows, vec![NO_PAGE; own]);
            h.swept = prefix;
        }
    }

    /// Ring mode: the first own page (a copy-on-write page) gets its window page now.
    pub(super) fn ring_assign_first(&self, h: &mut Held) {
        if self.ring_mode() {
            h.windows[0] = h.ring.pop().expect("a ready lease's ring holds one");
        }
    }

    /// Before computing positions `from..upto` of a ready lease: gives back the window pages
    /// of its own pages that no step from `from` on reads and no commit keeps, and gives the
    /// pages of the span a window page each. Returns how far the lease may compute now
    /// (`upto`, or less when window pages are short; always more than `from` when
    /// `from < upto`). Without ring mode, `upto`.
    pub fn secure_windows(&mut self, lease: &mut Lease, from: usize, upto: usize) -> usize {
        if !self.ring_mode() || from >= upto {
            return upto;
        }
        let h = lease.held_mut();
        assert!(h.is_ready(), "windows are secured for a ready lease");
        let ps = self.page_size();
        let first = from.saturating_sub(self.window) / ps;
        self.sweep(h, from, first);
        let last = ((upto - 1) / ps).min(h.windows.len().saturating_sub(1));
        let mut in_span = 0;
        for j in first.max(h.prefix_pages)..=last {
            if h.windows[j] != NO_PAGE {
                in_span += 1;
                continue;
            }
            let w = match h.ring.pop() {
                Some(w) => Some(w),
                None => self.alloc_windows_upto(1).pop().or_else(|| {
                    // The last resort: a page kept for a checkpoint (not read from here on).
                    let k = (h.prefix_pages..first).find(|&k| h.windows[k] != NO_PAGE)?;
                    Some(std::mem::replace(&mut h.windows[k], NO_PAGE))
                }),
            };
            let Some(w) = w else {
                return (j * ps).max(from);
            };
            h.windows[j] = w;
            in_span += 1;
        }
        // The ring keeps what the next step may need; the rest goes back to the pool.
        let keep = self.ring_min().saturating_sub(in_span);
        if h.ring.len() > keep {
            let extra = h.ring.split_off(keep);
            self.free_windows(&extra);
        }
        upto
    }

    /// Releases into the ring the window pages of own pages before `first` (the first page a
    /// step from `from` reads) that no commit keeps; pages kept by the end rule for now stay
    /// ahead of the sweep and are looked at again.
    fn sweep(&self, h: &mut Held, from: usize, first: usize) {
        let whole_min = from / self.page_size();
        let mut j = h.swept.max(h.prefix_pages);
        while j < first.min(h.windows.len()) {
            if self.end_keeps(whole_min, j) {
                break;
            }
            let w = h.windows[j];
            if w != NO_PAGE && !self.lasting_keeps(whole_min, h.points(self.page_size()), j) {
                h.ring.push(w);
                h.windows[j] = NO_PAGE;
            }
            j += 1;
        }
        h.swept = j;
    }
}
