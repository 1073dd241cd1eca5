//! K/V computed elsewhere: a lease whose prompt pages arrive from a prefill worker, and the
//! export of a ready lease's prompt pages to a decode worker (PD), with their page hashes.
//!
//! A page travels with its window part only where the sender holds one (with checkpoints: its
//! end span, its checkpoints and its branch point); the receiver keeps window pages for those
//! and, in ring mode, a ring for its decode steps.

use crate::hash::PageHash;
use crate::layout::Class;
use crate::pool::blob_len;
use crate::tree::{NO_PAGE, ROOT};

use super::lease::{Held, Lease, Phase, Served};
use super::{CacheMatch, TieredCache};

impl TieredCache {
    /// Admits a request whose prompt K/V were computed elsewhere (a prefill worker): reserves
    /// pages for `prompt_len + new_tokens` tokens and writes `blobs` (one per prompt page, in
    /// the host layout) into them. The lease is ready with every prompt position computed.
    /// None when the pages cannot be reserved now.
    pub fn admit_computed(
        &mut self,
        prompt_len: usize,
        new_tokens: usize,
        blobs: &[Vec<u8>],
    ) -> Option<Lease> {
        self.release_dropped();
        let reserve_tokens = prompt_len + new_tokens;
        let pages = self.alloc_device(reserve_tokens.div_ceil(self.page_size()))?;
        let (mut windows, mut ring) = (Vec::new(), Vec::new());
        if self.has_window() {
            let Some((w, r)) = self.import_windows(prompt_len, pages.len(), blobs) else {
                self.free_device(&pages).expect("just allocated");
                return None;
            };
            (windows, ring) = (w, r);
        }
        let pool = self
            .device_pool_shared()
            .expect("K/V is imported into a cache with data");
        let main_len = blob_len(&self.layout, None);
        for (i, (blob, &page)) in blobs.iter().zip(&pages).enumerate() {
            let w = windows.get(i).copied().filter(|&w| w != NO_PAGE);
            // A page whose window part found no window page keeps its main part only.
            let blob = if w.is_none() { &blob[..main_len] } else { blob };
            pool.write_page_host_layout(page, w, blob);
        }
        let held = Held {
            prompt_len,
            reserve_tokens,
            lock: ROOT,
            matched: CacheMatch::default(),
            phase: Phase::Ready,
            pages,
            windows,
            spare: Vec::new(),
            ring,
            swept: 0,
            prefix_pages: 0,
            branch: 0,
            shared: 0,
            start: prompt_len,
            served: Served::default(),
            session: None,
        };
        Some(self.lease(held))
    }

    /// The window pages of an imported prompt of `n` pages (`blobs` sent, the rest to
    /// decode): one for each page sent with its window part that decoding reads (within the
    /// window of the prompt's end), and without ring mode one for each page after the prompt
    /// — all of them or nothing (None: not now); in ring mode a ring making what the lease
    /// holds up to what one step needs. Pages sent whole before that (checkpoints kept by the
    /// sender, read only by later hits) get one while the pool has them, the newest first;
    /// the others keep their main part only.
    fn import_windows(
        &mut self,
        prompt_len: usize,
        n: usize,
        blobs: &[Vec<u8>],
    ) -> Option<(Vec<u32>, Vec<u32>)> {
        let main = self.layout.class_bytes(Class::Main);
        let ring_mode = self.ring_mode();
        let read_from = prompt_len.saturating_sub(self.window) / self.page_size();
        let whole = |i: usize| blobs.get(i).is_some_and(|b| b.len() != main);
        let must = |i: usize| (whole(i) && i >= read_from) || (i >= blobs.len() && !ring_mode);
        let n_must = (0..n).filter(|&i| must(i)).count();
        let extra = if ring_mode {
            self.window_reserve(n).saturating_sub(n_must)
        } else {
            0
        };
        let mut got = self.alloc_windows(n_must + extra)?;
        let ring = got.split_off(n_must);
        let mut windows = vec![NO_PAGE; n];
        for (i, w) in (0..n).filter(|&i| must(i)).zip(got) {
            windows[i] = w;
        }
        let optional: Vec<usize> = (0..n).filter(|&i| whole(i) && !must(i)).collect();
        let spare = self.alloc_windows_upto(optional.len());
        for (&i, w) in optional.iter().rev().zip(spare) {
            windows[i] = w;
        }
        Some((windows, ring))
    }

    /// Writes K/V computed elsewhere into a ready lease whose prefix this cache held (a
    /// decode worker that asked a prefill worker only for what it lacks): `blobs` (host
    /// layout) are the prompt's pages from `first` on, `first` being where the lease's own
    /// pages start. A page sent with its window part gets a window page (from the lease's
    /// ring, then the pool); one sent without gives its window page back (its window state is
    /// never read: the sender sends the span before the prompt's end whole). Err when the
    /// blobs do not fit the lease (before anything is written), or when a page the next step
    /// reads finds no window page.
    pub fn write_transferred(
        &mut self,
        lease: &mut Lease,
        first: usize,
        blobs: &[Vec<u8>],
    ) -> Result<(), String> {
        let ps = self.page_size();
        let (full, main) = (
            blob_len(&self.layout, Some(0)),
            blob_len(&self.layout, None),
        );
        let h = lease.held_mut();
        if !h.is_ready() {
            return Err("the request's prefix is not on device yet".into());
        }
        let n = h.prompt_len.div_ceil(ps);
        if first != h.prefix_pages || first + blobs.len() != n {
            return Err(format!(
                "pages {first}..{} arrived; this request holds the first {} of its {n}",
                first + blobs.len(),
                h.prefix_pages
            ));
        }
        if let Some(b) = blobs.iter().find(|b| b.len() != full && b.len() != main) {
            return Err(format!(
                "a page of {} bytes, this pool's pages have {full}",
                b.len()
            ));
        }
        if self.has_window() {
            self.window_transferred(h, first, blobs, main)?;
        }
        let pool = self
            .device_pool_shared()
            .expect("K/V is imported into a cache with data");
        for (i, blob) in blobs.iter().enumerate() {
            let w = h.windows.get(first + i).copied().filter(|&w| w != NO_PAGE);
            // A page whose window part found no window page keeps its main part only.
            let blob = if w.is_none() {
                &blob[..main]
            } else {
                &blob[..]
            };
            pool.write_page_host_layout(h.pages[first + i], w, blob);
        }
        h.start = h.prompt_len;
        Ok(())
    }

    /// Window pages for the transferred pages of `h` (from `first` on) sent with their window
    /// part: first those the next decode step reads (the window before the prompt's end, the
    /// last pages: the ring always holds enough for them), then the others while window pages can be had (the
    /// sender keeps theirs for a commit: an end, a checkpoint); a page sent without one gives
    /// its window page back.
    fn window_transferred(
        &mut self,
        h: &mut Held,
        first: usize,
        blobs: &[Vec<u8>],
        main: usize,
    ) -> Result<(), String> {
        let ps = self.page_size();
        let read_from = h.prompt_len.saturating_sub(self.window) / ps;
        let ring_mode = self.ring_mode();
        // Last first: the pages the next step reads are the last ones.
        for i in (0..blobs.len()).rev() {
            let j = first + i;
            let (want, have) = (blobs[i].len() != main, h.windows[j] != NO_PAGE);
            if want && !have {
                match h.ring.pop().or_else(|| self.alloc_windows_upto(1).pop()) {
                    Some(w) => h.windows[j] = w,
                    None if j >= read_from => {
                        return Err(format!("no window page for page {j}, which decoding reads"))
                    }
                    None => {}
                }
            } else if !want && have {
                let w = std::mem::replace(&mut h.windows[j], NO_PAGE);
                if ring_mode {
                    h.ring.push(w);
                } else {
                    self.free_windows(&[w]);
                }
            }
        }
        Ok(())
    }

    /// Pages `pages` of a ready lease, each in the host layout (PD export: the receiver holds
    /// the ones before; a prefill worker sends them as its chunks complete). A page holding
    /// no window page travels as its main part only.
    pub fn export(&self, lease: &Lease, pages: std::ops::Range<usize>) -> Vec<Vec<u8>> {
        let pool = self
            .device_pool()
            .expect("K/V is exported from a cache with data");
        let mut blobs = Vec::with_capacity(pages.len());
        for i in pages {
            let w = self.export_window(lease, i);
            let mut blob = vec![0u8; blob_len(&self.layout, w)];
            pool.read_page_host_layout(lease.pages()[i], w, &mut blob);
            blobs.push(blob);
        }
        blobs
    }

    /// The end (in pages) of what a lease computing its prompt can export now, from page
    /// `from` on, `computed` positions being in its pages: every whole page computed, or with
    /// window kinds only pages no later step gives a window page again (entirely before the
    /// window of the next position) that hold none, up to the first that holds one — so a
    /// page leaves as it would at the prompt's end. At least `from`.
    pub fn exportable_pages(&self, lease: &Lease, from: usize, computed: usize) -> usize {
        let ps = self.page_size();
        if !self.has_window() {
            return (computed / ps).max(from);
        }
        let settled = computed.saturating_sub(self.window) / ps;
        (from..settled)
            .find(|&i| self.export_window(lease, i).is_some())
            .unwrap_or(settled)
            .max(from)
    }

    /// The window page a lease's page `i` travels with (None: its main part only).
    fn export_window(&self, lease: &Lease, i: usize) -> Option<u32> {
        lease.windows().get(i).copied().filter(|&w| w != NO_PAGE)
    }

    /// Chained hashes of the whole pages of `tokens` from the root (empty when the cache
    /// computes no hashes).
    pub fn page_hashes(&self, tokens: &[u32]) -> Vec<PageHash> {
        match self.tree.namespace() {
            Some(ns) => ns.chain(PageHash::ROOT, tokens, self.page_size()),
            None => Vec::new(),
        }
    }

    /// The key of the page-hash namespace (None when the cache computes no hashes).
    pub fn hash_key(&self) -> Option<[u8; 32]> {
        self.tree.namespace().map(|n| n.key())
    }
}
