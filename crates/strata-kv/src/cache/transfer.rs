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

    /// The first `pages` pages of a ready lease, each in the host layout (PD export), with
    /// the chained hash of each whole page of `prompt` (zero for a partial last page, and all
    /// zero when the cache computes no hashes).
    pub fn export(&self, lease: &Lease, prompt: &[u32]) -> (Vec<Vec<u8>>, Vec<PageHash>) {
        let ps = self.page_size();
        let n = prompt.len().div_ceil(ps);
        let mut blobs = Vec::with_capacity(n);
        let pool = self
            .device_pool()
            .expect("K/V is exported from a cache with data");
        for (i, &page) in lease.pages()[..n].iter().enumerate() {
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
