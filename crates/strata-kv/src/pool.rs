//! Byte pools of one tier: the device (L1) pool in layer-first layout and the host (L2) pool in
//! page-first layout, plus the page copy between them.

use std::sync::Arc;

use crate::layout::PageLayout;
use crate::memory::{HostAllocator, MemError, Region};

/// L1: per kind, per layer, per plane, one contiguous run of chunks for all pages.
pub struct DevicePool {
    layout: Arc<PageLayout>,
    pages: u32,
    /// One region per pool kind.
    regions: Vec<Region>,
}

impl DevicePool {
    pub fn new(
        layout: Arc<PageLayout>,
        pages: u32,
        alloc: &dyn HostAllocator,
    ) -> Result<DevicePool, MemError> {
        let mut regions = Vec::new();
        for k in layout.kinds() {
            let bytes = k
                .bytes_per_token()
                .checked_mul(layout.page_size() * pages as usize)
                .ok_or_else(|| MemError::Alloc {
                    bytes: usize::MAX,
                    allocator: alloc.name(),
                    reason: format!("device pool `{}` size overflows", k.name),
                })?;
            regions.push(alloc.allocate(bytes)?);
        }
        Ok(DevicePool {
            layout,
            pages,
            regions,
        })
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
    fn chunk_ptr(&self, kind: usize, layer: usize, plane: usize, page: u32) -> *mut u8 {
        assert!(page < self.pages, "device page {page} out of range");
        let k = &self.layout.kinds()[kind];
        assert!(layer < k.layers && plane < k.planes, "chunk out of range");
        let chunk = self.layout.page_size() * k.plane_bytes_per_token;
        let run = (layer * k.planes + plane) * self.pages as usize + page as usize;
        // SAFETY: page < pages, layer < layers and plane < planes (asserted), so run <
        // layers × planes × pages and the offset stays inside the region.
        unsafe { self.regions[kind].as_ptr().add(run * chunk) }
    }

    /// All pages of one (kind, layer, plane): the slab attention reads. Caller must not read
    /// pages that a copy job is writing (wait for its ticket first).
    pub fn plane(&self, kind: usize, layer: usize, plane: usize) -> &[u8] {
        let k = &self.layout.kinds()[kind];
        let len = self.pages as usize * self.layout.page_size() * k.plane_bytes_per_token;
        let ptr = self.chunk_ptr_base(kind, layer, plane);
        // SAFETY: ptr..ptr+len lies inside the region; see the ownership note above.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }

    fn chunk_ptr_base(&self, kind: usize, layer: usize, plane: usize) -> *mut u8 {
        let k = &self.layout.kinds()[kind];
        assert!(layer < k.layers && plane < k.planes, "plane out of range");
        let chunk = self.layout.page_size() * k.plane_bytes_per_token;
        let run = (layer * k.planes + plane) * self.pages as usize;
        // SAFETY: layer and plane are in range (asserted), so the plane's run of `pages`
        // chunks lies inside the region (see chunk_ptr).
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

    /// Copies every chunk of page `src` into page `dst` (copy-on-write of a shared page).
    /// `dst` must be owned by the caller and differ from `src`.
    pub fn copy_page(&self, src: u32, dst: u32) {
        assert!(
            src != dst && src < self.pages && dst < self.pages,
            "bad page copy"
        );
        for (kind, k) in self.layout.kinds().iter().enumerate() {
            let n = self.layout.page_size() * k.plane_bytes_per_token;
            for layer in 0..k.layers {
                for plane in 0..k.planes {
                    // SAFETY: both chunks are n bytes inside the region and distinct pages do
                    // not overlap; the caller owns `dst`.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.chunk_ptr(kind, layer, plane, src),
                            self.chunk_ptr(kind, layer, plane, dst),
                            n,
                        )
                    }
                }
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

    /// Copies page `page` out into `blob`, laid out as a host page (chunk by chunk at the
    /// layout's host offsets): the form a page travels in (PD transfer).
    pub fn read_page_host_layout(&self, page: u32, blob: &mut [u8]) {
        assert_eq!(blob.len(), self.layout.page_bytes(), "one page of bytes");
        for c in self.layout.chunks() {
            let dst = &mut blob[c.host_offset..c.host_offset + c.bytes];
            self.read_chunk(c.kind, c.layer, c.plane, page, dst);
        }
    }

    /// Writes `blob`, a page in the host layout, into device page `page` (owned by the caller).
    pub fn write_page_host_layout(&self, page: u32, blob: &[u8]) {
        assert_eq!(blob.len(), self.layout.page_bytes(), "one page of bytes");
        for c in self.layout.chunks() {
            let src = &blob[c.host_offset..c.host_offset + c.bytes];
            self.write_chunk(c.kind, c.layer, c.plane, page, src);
        }
    }
}

/// L2: page-first; page `p` is the blob `[p × page_bytes, (p+1) × page_bytes)`.
pub struct HostPool {
    layout: Arc<PageLayout>,
    pages: u32,
    region: Region,
}

impl HostPool {
    pub fn new(
        layout: Arc<PageLayout>,
        pages: u32,
        alloc: &dyn HostAllocator,
    ) -> Result<HostPool, MemError> {
        let bytes = layout
            .page_bytes()
            .checked_mul(pages as usize)
            .ok_or_else(|| MemError::Alloc {
                bytes: usize::MAX,
                allocator: alloc.name(),
                reason: "host pool size overflows".into(),
            })?;
        let region = alloc.allocate(bytes)?;
        Ok(HostPool {
            layout,
            pages,
            region,
        })
    }

    pub fn pages(&self) -> u32 {
        self.pages
    }

    pub fn bytes(&self) -> usize {
        self.region.len()
    }

    /// Bytes of one page blob.
    pub fn layout_page_bytes(&self) -> usize {
        self.layout.page_bytes()
    }

    /// The memory behind the pool (for placement checks).
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Where the memory came from (allocator, NUMA placement).
    pub fn origin(&self) -> &str {
        self.region.origin()
    }

    fn page_ptr(&self, page: u32) -> *mut u8 {
        assert!(page < self.pages, "host page {page} out of range");
        // SAFETY: page < pages, so the blob lies inside the region.
        unsafe {
            self.region
                .as_ptr()
                .add(page as usize * self.layout.page_bytes())
        }
    }

    /// Copies one page blob out.
    pub fn read_page(&self, page: u32, out: &mut [u8]) {
        let n = self.layout.page_bytes();
        assert_eq!(out.len(), n);
        // SAFETY: n-byte blob inside the region into a distinct n-byte buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.page_ptr(page), out.as_mut_ptr(), n) }
    }

    /// Writes one page blob. The page must be owned by the caller.
    pub fn write_page(&self, page: u32, data: &[u8]) {
        let n = self.layout.page_bytes();
        assert_eq!(data.len(), n);
        // SAFETY: n-byte blob inside the region, owned by the caller.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.page_ptr(page), n) }
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

/// Copies pages between the pools: `pairs` are (device page, host page). Returns bytes moved.
/// Every pair's pages must be owned by the caller for the duration (locked in the tree).
pub fn copy_pages(
    device: &DevicePool,
    host: &HostPool,
    dir: Direction,
    pairs: &[(u32, u32)],
) -> u64 {
    let layout = &*host.layout;
    let stream = pairs.len() * layout.page_bytes() >= STREAM_MIN_BYTES;
    let mut bytes = 0u64;
    for &(d, h) in pairs {
        let blob = host.page_ptr(h);
        for c in layout.chunks() {
            let dp = device.chunk_ptr(c.kind, c.layer, c.plane, d);
            // SAFETY: both ranges are c.bytes long inside their regions (checked by the
            // pointer helpers) and belong to different regions, so they do not overlap.
            unsafe {
                let hp = blob.add(c.host_offset);
                match dir {
                    Direction::DeviceToHost => copy_bytes(dp, hp, c.bytes, stream),
                    Direction::HostToDevice => copy_bytes(hp, dp, c.bytes, stream),
                }
            }
            bytes += c.bytes as u64;
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
mod tests {
    use super::*;
    use crate::layout::PoolKind;
    use crate::memory::HeapAllocator;

    #[test]
    fn streamed_large_copies_are_exact() {
        // Above the streaming threshold, with odd chunk sizes and offsets.
        let layout = Arc::new(
            PageLayout::new(
                7,
                vec![PoolKind::kv("kv", 5, 3, 1000, 2), PoolKind::aux("x", 3, 13)],
            )
            .unwrap(),
        );
        let n = 1 + (STREAM_MIN_BYTES / layout.page_bytes()) as u32;
        let dev = DevicePool::new(layout.clone(), n, &HeapAllocator).unwrap();
        let host = HostPool::new(layout.clone(), n, &HeapAllocator).unwrap();
        let mut v = 1u8;
        for p in 0..n {
            for c in layout.chunks() {
                let data: Vec<u8> = (0..c.bytes)
                    .map(|_| {
                        v = v.wrapping_mul(31).wrapping_add(7);
                        v
                    })
                    .collect();
                dev.write_chunk(c.kind, c.layer, c.plane, p, &data);
            }
        }
        let pairs: Vec<(u32, u32)> = (0..n).map(|p| (p, n - 1 - p)).collect();
        copy_pages(&dev, &host, Direction::DeviceToHost, &pairs);
        let dev2 = DevicePool::new(layout.clone(), n, &HeapAllocator).unwrap();
        copy_pages(&dev2, &host, Direction::HostToDevice, &pairs);
        for p in 0..n {
            for c in layout.chunks() {
                let (mut a, mut b) = (vec![0; c.bytes], vec![0; c.bytes]);
                dev.read_chunk(c.kind, c.layer, c.plane, p, &mut a);
                dev2.read_chunk(c.kind, c.layer, c.plane, p, &mut b);
                assert_eq!(a, b);
            }
        }
    }

    #[test]
    fn device_host_roundtrip_is_exact() {
        let layout = Arc::new(
            PageLayout::new(
                2,
                vec![PoolKind::kv("kv", 3, 1, 4, 2), PoolKind::aux("idx", 3, 5)],
            )
            .unwrap(),
        );
        let dev = DevicePool::new(layout.clone(), 4, &HeapAllocator).unwrap();
        let host = HostPool::new(layout.clone(), 4, &HeapAllocator).unwrap();
        let mut v = 0u8;
        for c in layout.chunks() {
            let data: Vec<u8> = (0..c.bytes)
                .map(|_| {
                    v = v.wrapping_add(7);
                    v
                })
                .collect();
            dev.write_chunk(c.kind, c.layer, c.plane, 1, &data);
        }
        let b = copy_pages(&dev, &host, Direction::DeviceToHost, &[(1, 3)]);
        assert_eq!(b as usize, layout.page_bytes());
        copy_pages(&dev, &host, Direction::HostToDevice, &[(2, 3)]);
        for c in layout.chunks() {
            let mut a = vec![0; c.bytes];
            let mut b = vec![0; c.bytes];
            dev.read_chunk(c.kind, c.layer, c.plane, 1, &mut a);
            dev.read_chunk(c.kind, c.layer, c.plane, 2, &mut b);
            assert_eq!(a, b);
        }
        // The host blob is the chunks in page-first order.
        let mut blob = vec![0; layout.page_bytes()];
        host.read_page(3, &mut blob);
        let c = layout.chunks()[4];
        let mut a = vec![0; c.bytes];
        dev.read_chunk(c.kind, c.layer, c.plane, 1, &mut a);
        assert_eq!(&blob[c.host_offset..c.host_offset + c.bytes], &a[..]);
    }
}
