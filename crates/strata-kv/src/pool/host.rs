//! The host (L2) pool: page-first blobs. A page's main blob may be held in several regions,
//! one per pool kind (a tensor-parallel rank's kind on the rank's NUMA node): each region holds
//! that kind's part of every page, so a blob read or written whole is gathered or scattered
//! part by part and every other reader sees one blob.

use std::sync::Arc;

use super::blob_len;
use crate::layout::{Chunk, Class, PageLayout};
use crate::memory::{HostAllocator, MemError, Region};

/// Bytes `[start, start + len)` of every main blob, for all pages in one region: page `p`'s
/// part at `p × len`.
struct Segment {
    start: usize,
    len: usize,
    region: Region,
}

/// L2: page-first; page `p`'s main blob is the concatenation of each segment's bytes at
/// `p × len`, window page `w` the window blob `[w × window, (w+1) × window)` of another region.
pub struct HostPool {
    layout: Arc<PageLayout>,
    pages: u32,
    window_pages: u32,
    segments: Vec<Segment>,
    /// The segment holding each main kind's chunks (whole kinds per segment).
    segment_of_kind: Vec<usize>,
    window_region: Option<Region>,
}

fn overflow(alloc: &dyn HostAllocator) -> MemError {
    MemError::Alloc {
        bytes: usize::MAX,
        allocator: alloc.name(),
        reason: "host pool size overflows".into(),
    }
}

impl HostPool {
    /// A pool with as many window pages as pages.
    pub fn new(
        layout: Arc<PageLayout>,
        pages: u32,
        alloc: &dyn HostAllocator,
    ) -> Result<HostPool, MemError> {
        let window = layout.window_pages_for(pages);
        HostPool::with_window(layout, pages, window, alloc)
    }

    /// A pool of `pages` main pages and `window_pages` window pages, in one region for the
    /// main blobs and one for the window blobs.
    pub fn with_window(
        layout: Arc<PageLayout>,
        pages: u32,
        window_pages: u32,
        alloc: &dyn HostAllocator,
    ) -> Result<HostPool, MemError> {
        let main = layout.class_bytes(Class::Main);
        let parts = vec![(0, main, alloc)];
        HostPool::build(layout, pages, window_pages, parts, alloc)
    }

    /// [`HostPool::with_window`] with each main kind's part of the blobs in its own region,
    /// from `alloc_of(kind)` (window blobs from the first window kind's).
    pub fn with_allocators<'a>(
        layout: Arc<PageLayout>,
        pages: u32,
        window_pages: u32,
        alloc_of: &dyn Fn(usize) -> &'a dyn HostAllocator,
    ) -> Result<HostPool, MemError> {
        let mut parts: Vec<(usize, usize, &dyn HostAllocator)> = Vec::new();
        let mut kind = None;
        for c in layout.chunks().iter().filter(|c| c.class == Class::Main) {
            match parts.last_mut() {
                Some(p) if kind == Some(c.kind) => p.1 += c.bytes,
                _ => parts.push((c.host_offset, c.bytes, alloc_of(c.kind))),
            }
            kind = Some(c.kind);
        }
        let window_kind = layout.chunks().iter().find(|c| c.class == Class::Window);
        let walloc = alloc_of(window_kind.map_or(0, |c| c.kind));
        HostPool::build(layout, pages, window_pages, parts, walloc)
    }

    fn build(
        layout: Arc<PageLayout>,
        pages: u32,
        window_pages: u32,
        parts: Vec<(usize, usize, &dyn HostAllocator)>,
        walloc: &dyn HostAllocator,
    ) -> Result<HostPool, MemError> {
        let mut segments = Vec::with_capacity(parts.len());
        for (start, len, alloc) in parts {
            let bytes = len
                .checked_mul(pages as usize)
                .ok_or_else(|| overflow(alloc))?;
            let region = alloc.allocate(bytes)?;
            segments.push(Segment { start, len, region });
        }
        let wbytes = layout
            .class_bytes(Class::Window)
            .checked_mul(window_pages as usize)
            .ok_or_else(|| overflow(walloc))?;
        let window_region = if wbytes > 0 {
            Some(walloc.allocate(wbytes)?)
        } else {
            None
        };
        let mut segment_of_kind = vec![0; layout.kinds().len()];
        for c in layout.chunks().iter().filter(|c| c.class == Class::Main) {
            let within = |s: &Segment| (s.start..s.start + s.len).contains(&c.host_offset);
            segment_of_kind[c.kind] = segments.iter().position(within).expect("segments cover");
        }
        Ok(HostPool {
            layout,
            pages,
            window_pages,
            segments,
            segment_of_kind,
            window_region,
        })
    }

    pub fn pages(&self) -> u32 {
        self.pages
    }

    /// Pages of `class`.
    pub fn count(&self, class: Class) -> u32 {
        match class {
            Class::Main => self.pages,
            Class::Window => self.window_pages,
        }
    }

    pub fn bytes(&self) -> usize {
        self.regions().map(Region::len).sum()
    }

    pub fn layout(&self) -> &PageLayout {
        &self.layout
    }

    /// The memory behind the pages (for placement checks): the main blobs' regions, then
    /// the window blobs'.
    pub fn regions(&self) -> impl Iterator<Item = &Region> {
        let main = self.segments.iter().map(|s| &s.region);
        main.chain(self.window_region.as_ref())
    }

    /// Where the memory came from (allocator, NUMA placement), region by region.
    pub fn origin(&self) -> String {
        let o: Vec<&str> = self.regions().map(Region::origin).collect();
        o.join("; ")
    }

    /// Start of segment `s`'s part of main page `page`.
    fn part_ptr(&self, s: &Segment, page: u32) -> *mut u8 {
        assert!(page < self.pages, "host page {page} out of range");
        // SAFETY: page < pages, so the part lies inside the segment's region of pages × len.
        unsafe { s.region.as_ptr().add(page as usize * s.len) }
    }

    /// Start of window page `w`'s blob.
    fn window_ptr(&self, w: u32) -> *mut u8 {
        assert!(w < self.window_pages, "host window page {w} out of range");
        let region = self.window_region.as_ref().expect("window pages exist");
        let bytes = self.layout.class_bytes(Class::Window);
        // SAFETY: w < the window page count, so the blob lies inside the window region.
        unsafe { region.as_ptr().add(w as usize * bytes) }
    }

    /// Where chunk `c` of host page `page` / window page `window` lives.
    pub(super) fn chunk_ptr(&self, c: &Chunk, page: u32, window: u32) -> *mut u8 {
        match c.class {
            Class::Main => {
                let s = &self.segments[self.segment_of_kind[c.kind]];
                // SAFETY: the chunk lies inside the segment's part of the page (segments are
                // whole kinds' runs of chunks).
                unsafe { self.part_ptr(s, page).add(c.host_offset - s.start) }
            }
            // SAFETY: window chunks follow the main part of a blob; their offset minus the
            // main size lies inside the window blob.
            Class::Window => unsafe {
                self.window_ptr(window)
                    .add(c.host_offset - self.layout.class_bytes(Class::Main))
            },
        }
    }

    /// Copies one page blob out (its window part too when `window` is given).
    pub fn read_page(&self, page: u32, window: Option<u32>, out: &mut [u8]) {
        let main = self.layout.class_bytes(Class::Main);
        assert_eq!(out.len(), blob_len(&self.layout, window));
        for s in &self.segments {
            let dst = &mut out[s.start..s.start + s.len];
            // SAFETY: the segment's part of the page, `len` bytes inside its region, into a
            // distinct buffer of that length.
            unsafe {
                std::ptr::copy_nonoverlapping(self.part_ptr(s, page), dst.as_mut_ptr(), s.len)
            }
        }
        if let Some(w) = window {
            let n = out.len() - main;
            // SAFETY: the window blob is n bytes inside the window region; out[main..] is n.
            unsafe {
                std::ptr::copy_nonoverlapping(self.window_ptr(w), out.as_mut_ptr().add(main), n)
            }
        }
    }

    /// Writes one page blob (with its window part iff `window` is given). The pages must be
    /// owned by the caller.
    pub fn write_page(&self, page: u32, window: Option<u32>, data: &[u8]) {
        let main = self.layout.class_bytes(Class::Main);
        assert_eq!(data.len(), blob_len(&self.layout, window));
        for s in &self.segments {
            let src = &data[s.start..s.start + s.len];
            // SAFETY: `len` bytes into the segment's part of the page, owned by the caller.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.part_ptr(s, page), s.len) }
        }
        if let Some(w) = window {
            let n = data.len() - main;
            // SAFETY: n-byte window blob inside the window region, owned by the caller.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr().add(main), self.window_ptr(w), n) }
        }
    }
}
