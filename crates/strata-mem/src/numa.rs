//! Host pools in NUMA-bound memory: mmap, mbind, optional transparent huge pages, pre-fault with
//! progress, then verify where the pages really landed (move_pages).

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::Arc;

use serde::Serialize;
use strata_kv::memory::{HostAllocator, MemError, Region};

use crate::plan::NumaPolicy;

const MPOL_PREFERRED: i32 = 1;
const MPOL_BIND: i32 = 2;
const MPOL_INTERLEAVE: i32 = 3;
const MPOL_MF_STRICT: u32 = 1;
const MPOL_MF_MOVE: u32 = 2;
const MASK_WORDS: usize = 16;
const PAGE: usize = 4096;

/// Progress of pre-faulting: (bytes done, bytes total).
pub type Progress = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// Where a region's pages are, from a sample of its pages.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Placement {
    pub sampled_pages: u64,
    /// NUMA node → sampled pages found there.
    pub pages_per_node: BTreeMap<i32, u64>,
    /// Sampled pages not (yet) backed by memory.
    pub not_present: u64,
}

impl Placement {
    /// `node 0: 1024/1024 sampled pages`.
    pub fn describe(&self) -> String {
        let mut parts: Vec<String> = self
            .pages_per_node
            .iter()
            .map(|(n, c)| format!("node {n}: {c}/{} sampled pages", self.sampled_pages))
            .collect();
        if self.not_present > 0 {
            parts.push(format!("not present: {}", self.not_present));
        }
        parts.join(", ")
    }

    /// All sampled pages are present and on `nodes`.
    pub fn all_on(&self, nodes: &[u32]) -> bool {
        self.not_present == 0
            && self
                .pages_per_node
                .keys()
                .all(|&n| n >= 0 && nodes.contains(&(n as u32)))
    }
}

/// Allocates host pools bound to NUMA nodes.
#[derive(Clone)]
pub struct NumaAllocator {
    pub nodes: Vec<u32>,
    pub policy: NumaPolicy,
    pub huge_pages: bool,
    pub prefault: bool,
    pub progress: Option<Progress>,
}

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

impl NumaAllocator {
    pub fn new(nodes: Vec<u32>, policy: NumaPolicy) -> NumaAllocator {
        NumaAllocator {
            nodes,
            policy,
            huge_pages: false,
            prefault: true,
            progress: None,
        }
    }

    fn err(&self, bytes: usize, reason: String) -> MemError {
        MemError::Alloc {
            bytes,
            allocator: self.name(),
            reason,
        }
    }

    /// Allocates, binds, pre-faults and verifies; returns the region and where it landed.
    pub fn allocate_verified(&self, bytes: usize) -> Result<(Region, Placement), MemError> {
        let align = if self.huge_pages { 2 << 20 } else { PAGE };
        let len = bytes.div_ceil(align).max(1) * align;
        // SAFETY: anonymous private mapping; no file, no fixed address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(self.err(bytes, format!("mmap of {len} bytes failed: {}", errno())));
        }
        let release = move |ptr: NonNull<u8>, _| {
            // SAFETY: ptr/len is exactly the mapping created above, unmapped once.
            unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
        };
        let ptr = NonNull::new(p.cast::<u8>()).expect("mmap returned non-null");
        // SAFETY: the mapping is ours, zero-filled by the kernel, len ≥ bytes; `release` unmaps it.
        let region = unsafe { Region::from_raw(ptr, bytes, String::new(), Box::new(release)) };
        if self.huge_pages {
            // SAFETY: advisory call on our own mapping.
            if unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) } != 0 {
                return Err(self.err(bytes, format!("madvise(MADV_HUGEPAGE) failed: {}", errno())));
            }
        }
        if !self.nodes.is_empty() {
            // SAFETY: p/len is the mapping created above, still owned by `region`.
            unsafe { self.bind(p, len, bytes)? };
        }
        if self.prefault {
            // SAFETY: ptr/len is the mapping created above, still owned by `region`.
            unsafe { self.prefault(ptr, len) };
        }
        let placement = placement_of(&region, 1024);
        Ok((region, placement))
    }

    /// Binds the mapping `p`/`len` to `self.nodes` under `self.policy` (mbind); errors name
    /// `bytes`, the size asked for.
    ///
    /// # Safety
    /// `p`/`len` must be a mapping this allocator created and still owns.
    unsafe fn bind(&self, p: *mut libc::c_void, len: usize, bytes: usize) -> Result<(), MemError> {
        let mut mask = [0 as libc::c_ulong; MASK_WORDS];
        for &n in &self.nodes {
            let n = n as usize;
            if n >= MASK_WORDS * 64 {
                return Err(self.err(
                    bytes,
                    format!(
                        "NUMA node {n} is beyond the supported {} nodes",
                        MASK_WORDS * 64
                    ),
                ));
            }
            mask[n / 64] |= 1 << (n % 64);
        }
        let mode = match self.policy {
            NumaPolicy::Bind => MPOL_BIND,
            NumaPolicy::Interleave => MPOL_INTERLEAVE,
            NumaPolicy::Preferred => MPOL_PREFERRED,
        };
        let flags = if self.policy == NumaPolicy::Bind {
            MPOL_MF_STRICT | MPOL_MF_MOVE
        } else {
            0
        };
        // SAFETY: mbind on our own mapping with a mask of MASK_WORDS words; maxnode counts bits.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mbind,
                p,
                len,
                mode,
                mask.as_ptr(),
                (MASK_WORDS * 64 + 1) as libc::c_ulong,
                flags,
            )
        };
        if rc != 0 {
            return Err(self.err(
                bytes,
                format!(
                    "mbind({} to node(s) {:?}) failed: {}",
                    self.policy.name(),
                    self.nodes,
                    errno()
                ),
            ));
        }
        Ok(())
    }

    /// Touches every page of the mapping so the kernel backs it now, reporting progress.
    ///
    /// # Safety
    /// `ptr`/`len` must be a writable mapping this allocator created and still owns.
    unsafe fn prefault(&self, ptr: NonNull<u8>, len: usize) {
        let step = 1usize << 28;
        for (i, off) in (0..len).step_by(PAGE).enumerate() {
            // SAFETY: off < len, inside our mapping; a volatile write makes the kernel back
            // the page now, under the policy just set.
            unsafe { std::ptr::write_volatile(ptr.as_ptr().add(off), 0) };
            if let Some(cb) = &self.progress {
                if (i * PAGE).is_multiple_of(step) {
                    cb(off as u64, len as u64);
                }
            }
        }
        if let Some(cb) = &self.progress {
            cb(len as u64, len as u64);
        }
    }
}

/// Samples up to `samples` pages of a region evenly and asks the kernel where each is.
pub fn placement_of(region: &Region, samples: usize) -> Placement {
    let ptr = region.as_ptr();
    let pages = region.len().div_ceil(PAGE);
    let n = samples.min(pages).max(1);
    let addrs: Vec<*mut libc::c_void> = (0..n)
        .map(|i| {
            // SAFETY: i × pages / n < pages, so the address is inside the range.
            unsafe { ptr.add(i * pages / n * PAGE).cast() }
        })
        .collect();
    let mut status = vec![0i32; n];
    // SAFETY: move_pages with nodes = NULL only queries; both arrays have n entries.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            0,
            n as libc::c_ulong,
            addrs.as_ptr(),
            std::ptr::null::<i32>(),
            status.as_mut_ptr(),
            0,
        )
    };
    let mut p = Placement {
        sampled_pages: n as u64,
        ..Placement::default()
    };
    if rc != 0 {
        p.not_present = n as u64;
        return p;
    }
    for s in status {
        if s >= 0 {
            *p.pages_per_node.entry(s).or_insert(0) += 1;
        } else {
            p.not_present += 1;
        }
    }
    p
}

/// Where a host pool's pages are: each region sampled in proportion to its size (a pool of
/// tensor-parallel ranks holds one per rank), so sampled pages stand for bytes.
pub fn placement_of_pool(pool: &strata_kv::pool::HostPool) -> Placement {
    let total = pool.bytes().max(1);
    let mut all = Placement::default();
    for r in pool.regions() {
        let samples = (1024 * r.len() / total).max(1);
        let p = placement_of(r, samples);
        all.sampled_pages += p.sampled_pages;
        all.not_present += p.not_present;
        for (n, k) in p.pages_per_node {
            *all.pages_per_node.entry(n).or_insert(0) += k;
        }
    }
    all
}

impl HostAllocator for NumaAllocator {
    fn allocate(&self, bytes: usize) -> Result<Region, MemError> {
        let (region, placement) = self.allocate_verified(bytes)?;
        if self.prefault && self.policy == NumaPolicy::Bind && !placement.all_on(&self.nodes) {
            return Err(self.err(
                bytes,
                format!(
                    "pages landed outside node(s) {:?}: {}",
                    self.nodes,
                    placement.describe()
                ),
            ));
        }
        Ok(region)
    }

    fn name(&self) -> String {
        format!(
            "numa {} node(s) {:?}{}",
            self.policy.name(),
            self.nodes,
            if self.huge_pages { ", huge pages" } else { "" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn binds_prefaults_and_verifies_on_node_0() {
        let seen = Arc::new(AtomicU64::new(0));
        let s2 = seen.clone();
        let mut a = NumaAllocator::new(vec![0], NumaPolicy::Bind);
        a.progress = Some(Arc::new(move |done, _| s2.store(done, Ordering::Relaxed)));
        let (r, p) = a.allocate_verified(64 << 20).unwrap();
        assert_eq!(r.len(), 64 << 20);
        assert_eq!(seen.load(Ordering::Relaxed), 64 << 20);
        assert!(p.all_on(&[0]), "{}", p.describe());
        assert_eq!(p.sampled_pages, 1024);
        // Usable memory, zero-filled.
        // SAFETY: the region is ours and 64 MiB long.
        unsafe {
            assert_eq!(*r.as_ptr().add(12345), 0);
            *r.as_ptr().add(12345) = 7;
        }
    }

    #[test]
    fn a_node_that_does_not_exist_is_refused() {
        let a = NumaAllocator::new(vec![63], NumaPolicy::Bind);
        let e = a.allocate(1 << 20).err().unwrap().to_string();
        assert!(e.contains("mbind(bind to node(s) [63]) failed"), "{e}");
    }

    #[test]
    fn huge_pages_and_interleave_allocate() {
        let mut a = NumaAllocator::new(vec![0], NumaPolicy::Interleave);
        a.huge_pages = true;
        let (r, p) = a.allocate_verified(8 << 20).unwrap();
        assert_eq!(r.len(), 8 << 20);
        assert!(p.all_on(&[0]), "{}", p.describe());
    }
}
