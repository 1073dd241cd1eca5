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
        let main = self.layout.class_bytes(Class::Main);
        let (mut windows, mut ring) = (Vec::new(), Vec::new());
        if self.has_window() {
            // A window page for each page sent with its window part (one older than the
            // window travels without), and for the pages after the prompt: without ring mode
            // each has its own, in ring mode the decode steps take them from a ring.
            let ring_mode = self.ring_mode();
            let assigned = |i: usize| match blobs.get(i) {
                Some(b) => b.len() != main,
                None => !ring_mode,
            };
            let n = (0..pages.len()).filter(|&i| assigned(i)).count();
            let extra = if ring_mode {
                self.window_reserve(pages.len())
            } else {
                0
            };
            let Some(mut got) = self.alloc_windows(n + extra) else {
                self.free_device(&pages).expect("just allocated");
                return None;
            };
            ring = got.split_off(n);
            let mut it = got.into_iter();
            windows = (0..pages.len())
                .map(|i| {
                    if assigned(i) {
                        it.next().expect("one per assigned page")
                    } else {
                        NO_PAGE
                    }
                })
                .collect();
        }
        let pool = self
            .device_pool_shared()
            .expect("K/V is imported into a cache with data");
        for (i, (blob, &page)) in blobs.iter().zip(&pages).enumerate() {
            let w = windows.get(i).copied().filter(|&w| w != NO_PAGE);
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
        };
        Some(self.lease(held))
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

    /// The pages of `prompt` from page `from` on of a ready lease, each in the host layout
    /// (PD export: the receiver holds the ones before), with the chained hash of each whole
    /// page of `prompt` from the first (zero for a partial last page, and all zero when the
    /// cache computes no hashes).
    pub fn export(
        &self,
        lease: &Lease,
        prompt: &[u32],
        from: usize,
    ) -> (Vec<Vec<u8>>, Vec<PageHash>) {
        let ps = self.page_size();
        let n = prompt.len().div_ceil(ps);
        let mut blobs = Vec::with_capacity(n.saturating_sub(from));
        let pool = self
            .device_pool()
            .expect("K/V is exported from a cache with data");
        for (i, &page) in lease.pages()[..n].iter().enumerate().skip(from) {
            // A page without a window page travels as its main part only.
            let w = lease.windows().get(i).copied().filter(|&w| w != NO_PAGE);
            let mut blob = vec![0u8; blob_len(&self.layout, w)];
            pool.read_page_host_layout(page, w, &mut blob);
            blobs.push(blob);
        }
        let mut hashes = self.page_hashes(prompt);
        hashes.resize(n, PageHash([0; 16]));
        (blobs, hashes)
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
