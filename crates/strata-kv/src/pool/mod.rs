//! Byte pools of one tier: the device (L1) pool in layer-first layout and the host (L2) pool in
//! page-first layout, plus the page copy between them.

use std::sync::Arc;

use crate::layout::{Class, PageLayout};
use crate::memory::{HostAllocator, MemError, Region};

mod host;
pub use host::HostPool;

/// L1: per kind, per layer, per plane, one contiguous run of chunks for all pages of the kind's
/// class (window kinds are addressed by window page, [`crate::layout::Class`]).
pub struct DevicePool {
    layout: Arc<PageLayout>,
    pages: u32,
    window_pages: u32,
    /// One region per pool kind.
    regions: Vec<Region>,
}

impl DevicePool {
    /// A pool with as many window pages as pages (every page may keep its window state).
    pub fn new(
        layout: Arc<PageLayout>,
        pages: u32,
        alloc: &dyn HostAllocator,
    ) -> Result<DevicePool, MemError> {
        let window = layout.window_pages_for(pages);
        DevicePool::with_window(layout, pages, window, alloc)
    }

    /// A pool of `pages` main pages and `window_pages` window pages.
    pub fn with_window(
        layout: Arc<PageLayout>,
        pages: u32,
        window_pages: u32,
        alloc: &dyn HostAllocator,
    ) -> Result<DevicePool, MemError> {
        DevicePool::with_allocators(layout, pages, window_pages, &|_| alloc)
    }

    /// [`DevicePool::with_window`], each kind's region from `alloc(kind)` (a tensor-parallel
    /// rank's kind on its NUMA node).
    pub fn with_allocators<'a>(
        layout: Arc<PageLayout>,
        pages: u32,
        window_pages: u32,
        alloc_of: &dyn Fn(usize) -> &'a dyn HostAllocator,
    ) -> Result<DevicePool, MemError> {
        let mut regions = Vec::new();
        for (ki, k) in layout.kinds().iter().enumerate() {
            let alloc = alloc_of(ki);
            let n = match k.class() {
                Class::Main => pages,
                Class::Window => window_pages,
            };
            let bytes = k
                .bytes_per_token()
                .checked_mul(layout.page_size() * n as usize)
                .ok_or_else(|| MemError::Alloc {
                    bytes: usize::MAX,
                    allocator: alloc.name(),
                    reason: format!("device pool `{}` size overflows", k.name),
                })?;
            regions.push(alloc.allocate(bytes.max(1))?);
        }
        Ok(DevicePool {
            layout,
            pages,
            window_pages,
            regions,
        })
    }

    /// Pages of `class` (window pages are 0 without window kinds).
    pub fn count(&self, class: Class) -> u32 {
        match class {
            Class::Main => self.pages,
            Class::Window => self.window_pages,
        }
    }

    pub fn pages(&self) -> u32 {
        self.pages
    }

    pub fn layout(&self) -> &PageLayout {
        &self.layout
    }

    /// Total bytes held by this pool.
    pub fn bytes(&self) -> usize {
        self.regions.iter().map(Region::len).sum()
    }

    /// Pointer to the chunk (kind, layer, plane) of `page`; `chunk_bytes` long.
    /// `page` is a window page for a window kind.
    fn chunk_ptr(&self, kind: usize, layer: usize, plane: usize, page: u32) -> *mut u8 {
        let k = &self.layout.kinds()[kind];
        let n = self.count(k.class());
        assert!(
            page < n,
            "device page {page} of kind `{}` out of range",
            k.name
        );
        assert!(layer < k.layers && plane < k.planes, "chunk out of range");
        let chunk = self.layout.page_size() * k.plane_bytes_per_token;
        let run = (layer * k.planes + plane) * n as usize + page as usize;
        // SAFETY: page < n (the kind's class count), layer < layers and plane < planes
        // (asserted), so run < layers × planes × n and the offset stays inside the region.
        unsafe { self.regions[kind].as_ptr().add(run * chunk) }
    }

    /// All pages of one (kind, layer, plane): the slab attention reads (indexed by window page
    /// for a window kind). Caller must not read pages that a copy job is writing (wait for its
    /// ticket first).
    pub fn plane(&self, kind: usize, layer: usize, plane: usize) -> &[u8] {
        let k = &self.layout.kinds()[kind];
        let n = self.count(k.class()) as usize;
        let len = n * self.layout.page_size() * k.plane_bytes_per_token;
        let ptr = self.chunk_ptr_base(kind, layer, plane);
        // SAFETY: ptr..ptr+len lies inside the region; see the ownership note above.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }

    fn chunk_ptr_base(&self, kind: usize, layer: usize, plane: usize) -> *mut u8 {
        let k = &self.layout.kinds()[kind];
        assert!(layer < k.layers && plane < k.planes, "plane out of range");
        let chunk = self.layout.page_size() * k.plane_bytes_per_token;
        let run = (layer * k.planes + plane) * self.count(k.class()) as usize;
        // SAFETY: layer and plane are in range (asserted), so the plane's run of the class's
        // page count of chunks lies inside the region (see chunk_ptr).
        unsafe { self.regions[kind].as_ptr().add(run * chunk) }
    }

    /// Writes one token's row of a plane (`page_size` rows per page chunk), e.g. the K of a
    /// token just computed. The page must be owned by the caller.
    pub fn write_token(
        &self,
        kind: usize,
        layer: usize,
        plane: usize,
        page: u32,
        slot: usize,
        data: &[u8],
    ) {
        let row = self.layout.kinds()[kind].plane_bytes_per_token;
        assert!(
            slot < self.layout.page_size() && data.len() == row,
            "token row out of range"
        );
        // SAFETY: the row lies inside the page's chunk, which lies inside the region; the caller
        // owns the page.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.chunk_ptr(kind, layer, plane, page).add(slot * row),
                row,
            )
        }
    }

    /// Writes `data` at byte `offset` of the chunk (kind, layer, plane) of `page`: a state
    /// smaller or larger than one token's row (a compressed block). The page must be owned by
    /// the caller.
    pub fn write_at(
        &self,
        kind: usize,
        layer: usize,
        plane: usize,
        page: u32,
        offset: usize,
        data: &[u8],
    ) {
        let n = self.layout.page_size() * self.layout.kinds()[kind].plane_bytes_per_token;
        assert!(
            offset.checked_add(data.len()).is_some_and(|end| end <= n),
            "write past the chunk"
        );
        // SAFETY: offset..offset + len lies inside the page's chunk, which lies inside the
        // region; the caller owns the page.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.chunk_ptr(kind, layer, plane, page).add(offset),
                data.len(),
            )
        }
    }

    /// Copies one chunk out.
    pub fn read_chunk(&self, kind: usize, layer: usize, plane: usize, page: u32, out: &mut [u8]) {
        let n = self.layout.page_size() * self.layout.kinds()[kind].plane_bytes_per_token;
        assert_eq!(out.len(), n);
        // SAFETY: source chunk is n bytes inside the region, out is a distinct n-byte buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.chunk_ptr(kind, layer, plane, page),
                out.as_mut_ptr(),
                n,
            )
        }
    }

    /// Copies the chunks of `class` of page `src` into page `dst` (window pages for
    /// `Class::Window`): copy-on-write of a shared page. `dst` must be owned by the caller and
    /// differ from `src`.
    pub fn copy_page(&self, class: Class, src: u32, dst: u32) {
        let n = self.count(class);
        assert!(src != dst && src < n && dst < n, "bad page copy");
        for c in self.layout.chunks().iter().filter(|c| c.class == class) {
            // SAFETY: both chunks are c.bytes inside the region and distinct pages do not
            // overlap; the caller owns `dst`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.chunk_ptr(c.kind, c.layer, c.plane, src),
                    self.chunk_ptr(c.kind, c.layer, c.plane, dst),
                    c.bytes,
                )
            }
        }
    }

    /// Writes one chunk (the model's new K/V for a page). The page must be owned by the caller.
    pub fn write_chunk(&self, kind: usize, layer: usize, plane: usize, page: u32, data: &[u8]) {
        let n = self.layout.page_size() * self.layout.kinds()[kind].plane_bytes_per_token;
        assert_eq!(data.len(), n);
        // SAFETY: destination chunk is n bytes inside the region and owned by the caller.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.chunk_ptr(kind, layer, plane, page),
                n,
            )
        }
    }

    /// Copies page `page` (and its window page `window`, if any) out into `blob`, laid out as
    /// a host page (chunk by chunk at the layout's host offsets; the window part only with a
    /// window page): the form a page travels in (PD transfer).
    pub fn read_page_host_layout(&self, page: u32, window: Option<u32>, blob: &mut [u8]) {
        assert_eq!(
            blob.len(),
            blob_len(&self.layout, window),
            "one page of bytes"
        );
        for c in self.layout.chunks() {
            let Some(p) = chunk_page(c.class, page, window) else {
                continue;
            };
            let dst = &mut blob[c.host_offset..c.host_offset + c.bytes];
            self.read_chunk(c.kind, c.layer, c.plane, p, dst);
        }
    }

    /// Writes `blob`, a page in the host layout (with its window part iff `window` is given),
    /// into device page `page` and window page `window` (owned by the caller).
    pub fn write_page_host_layout(&self, page: u32, window: Option<u32>, blob: &[u8]) {
        assert_eq!(
            blob.len(),
            blob_len(&self.layout, window),
            "one page of bytes"
        );
        for c in self.layout.chunks() {
            let Some(p) = chunk_page(c.class, page, window) else {
                continue;
            };
            let src = &blob[c.host_offset..c.host_offset + c.bytes];
            self.write_chunk(c.kind, c.layer, c.plane, p, src);
        }
    }
}

/// Bytes of a page blob with (or without) its window part.
pub fn blob_len(layout: &PageLayout, window: Option<u32>) -> usize {
    match window {
        Some(_) => layout.page_bytes(),
        None => layout.class_bytes(Class::Main),
    }
}

/// The page a chunk of `class` lives in: `page` for main chunks, the window page for window
/// chunks (None without one).
fn chunk_page(class: Class, page: u32, window: Option<u32>) -> Option<u32> {
    match class {
        Class::Main => Some(page),
        Class::Window => window,
    }
}

/// Direction of a tier copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Backup: L1 → L2.
    DeviceToHost,
    /// Load-back: L2 → L1.
    HostToDevice,
}

/// Copies of at least this many bytes use streaming (non-temporal) stores: the destination is
/// not read into cache first, which is what lets a large plain memcpy run faster than a loop
/// of small ones.
const STREAM_MIN_BYTES: usize = 1 << 20;

/// Copies `len` bytes with non-temporal 32-byte stores (AVX2, present on every x86-64-v3
/// target); the caller issues the store fence.
///
/// # Safety
/// `src` and `dst` must be valid for `len` bytes and must not overlap.
#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
unsafe fn copy_stream(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    let head = dst.align_offset(32).min(len);
    // SAFETY: the caller guarantees both ranges; every access below stays inside them, and `d`
    // is 32-byte aligned after the head, as _mm256_stream_si256 requires.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let (mut s, mut d, mut n) = (src.add(head), dst.add(head), len - head);
        while n >= 128 {
            let a = _mm256_loadu_si256(s as *const __m256i);
            let b = _mm256_loadu_si256(s.add(32) as *const __m256i);
            let c = _mm256_loadu_si256(s.add(64) as *const __m256i);
            let e = _mm256_loadu_si256(s.add(96) as *const __m256i);
            _mm256_stream_si256(d as *mut __m256i, a);
            _mm256_stream_si256(d.add(32) as *mut __m256i, b);
            _mm256_stream_si256(d.add(64) as *mut __m256i, c);
            _mm256_stream_si256(d.add(96) as *mut __m256i, e);
            s = s.add(128);
            d = d.add(128);
            n -= 128;
        }
        std::ptr::copy_nonoverlapping(s, d, n);
    }
}

/// Copies `len` bytes, streaming when `stream` and the CPU allows.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`].
unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize, stream: bool) {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    if stream {
        // SAFETY: forwarded from the caller.
        return unsafe { copy_stream(src, dst, len) };
    }
    let _ = stream;
    // SAFETY: forwarded from the caller.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// Copies `src` into `dst` (equal lengths) the way large tier copies do (streaming stores when
/// the CPU allows). The benchmarks use it as the contiguous baseline for `copy_pages`.
pub fn copy_slice_streaming(src: &[u8], dst: &mut [u8]) {
    assert_eq!(
        src.len(),
        dst.len(),
        "copy_slice_streaming needs equal lengths"
    );
    // SAFETY: two distinct borrows of equal length cannot overlap.
    unsafe { copy_bytes(src.as_ptr(), dst.as_mut_ptr(), src.len(), true) };
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    // SAFETY: sfence has no memory operands.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Copies pages between the pools: `pairs` are (device page, host page) of main pages,
/// `window_pairs` of window pages. Returns bytes moved. Every page must be owned by the caller
/// for the duration (locked in the tree).
pub fn copy_pages(
    device: &DevicePool,
    host: &HostPool,
    dir: Direction,
    pairs: &[(u32, u32)],
    window_pairs: &[(u32, u32)],
) -> u64 {
    let layout = host.layout();
    let total = pairs.len() * layout.class_bytes(Class::Main)
        + window_pairs.len() * layout.class_bytes(Class::Window);
    let stream = total >= STREAM_MIN_BYTES;
    let mut bytes = 0u64;
    for (class, list) in [(Class::Main, pairs), (Class::Window, window_pairs)] {
        for &(d, h) in list {
            for c in layout.chunks().iter().filter(|c| c.class == class) {
                let dp = device.chunk_ptr(c.kind, c.layer, c.plane, d);
                let hp = host.chunk_ptr(c, h, h);
                // SAFETY: both ranges are c.bytes long inside their regions (checked by the
                // pointer helpers) and belong to different regions, so they do not overlap.
                unsafe {
                    match dir {
                        Direction::DeviceToHost => copy_bytes(dp, hp, c.bytes, stream),
                        Direction::HostToDevice => copy_bytes(hp, dp, c.bytes, stream),
                    }
                }
                bytes += c.bytes as u64;
            }
        }
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    if stream {
        // SAFETY: sfence has no memory operands; it orders the streamed stores before the
        // completion is sent to the cache thread.
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
    bytes
}

#[cfg(test)]
mod tests;
