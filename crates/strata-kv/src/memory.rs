//! Raw memory regions behind the pools, and the allocator trait the NUMA-bound host allocator
//! plugs into.

use std::alloc::Layout;
use std::ptr::NonNull;

use thiserror::Error;

/// Why a region could not be allocated.
#[derive(Debug, Error)]
pub enum MemError {
    #[error("cannot allocate {bytes} bytes with {allocator}: {reason}")]
    Alloc {
        bytes: usize,
        allocator: String,
        reason: String,
    },
}

type Release = Box<dyn FnOnce(NonNull<u8>, usize) + Send + Sync>;

/// An owned, zero-initialised, page-aligned block of memory. Pools share it with copy workers
/// through `Arc`; who may touch which bytes is decided by the cache's page ownership (a page in
/// flight is locked in the tree and read or written by exactly one copy job).
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
    release: Option<Release>,
    origin: String,
}

// SAFETY: a Region is a plain block of bytes with no thread affinity; concurrent access to
// disjoint byte ranges is coordinated by the page-ownership protocol documented above.
unsafe impl Send for Region {}
// SAFETY: as above; `&Region` only exposes the raw pointer, never references into the bytes.
unsafe impl Sync for Region {}

impl Region {
    /// Wraps memory obtained elsewhere (mmap, NUMA allocators).
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes until `release` runs, must not be
    /// used by anyone else, and must be zero-initialised or otherwise fully initialised.
    pub unsafe fn from_raw(
        ptr: NonNull<u8>,
        len: usize,
        origin: String,
        release: Release,
    ) -> Region {
        Region {
            ptr,
            len,
            release: Some(release),
            origin,
        }
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Which allocator produced it, and how (for the startup report).
    pub fn origin(&self) -> &str {
        &self.origin
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Some(r) = self.release.take() {
            r(self.ptr, self.len);
        }
    }
}

/// Allocates host memory for a pool. `strata-mem` provides the NUMA-bound implementation.
pub trait HostAllocator: Send + Sync {
    fn allocate(&self, bytes: usize) -> Result<Region, MemError>;
    fn name(&self) -> String;
}

/// Plain zeroed heap memory, 4 KiB aligned. The default for tests and the CPU "device" pool.
#[derive(Clone, Copy, Debug, Default)]
pub struct HeapAllocator;

const ALIGN: usize = 4096;

impl HostAllocator for HeapAllocator {
    fn allocate(&self, bytes: usize) -> Result<Region, MemError> {
        let err = |reason: &str| MemError::Alloc {
            bytes,
            allocator: self.name(),
            reason: reason.to_string(),
        };
        if bytes == 0 {
            // SAFETY: a zero-length region is never dereferenced; the dangling pointer is aligned.
            return Ok(unsafe {
                Region::from_raw(NonNull::dangling(), 0, self.name(), Box::new(|_, _| {}))
            });
        }
        let layout = Layout::from_size_align(bytes, ALIGN).map_err(|e| err(&e.to_string()))?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| err("out of memory"))?;
        let release: Release = Box::new(move |p, _| {
            // SAFETY: p came from alloc_zeroed with exactly this layout and is freed once.
            unsafe { std::alloc::dealloc(p.as_ptr(), layout) }
        });
        // SAFETY: fresh, zeroed, exclusively owned allocation of `bytes` bytes.
        Ok(unsafe { Region::from_raw(ptr, bytes, self.name(), release) })
    }

    fn name(&self) -> String {
        "heap".to_string()
    }
}
