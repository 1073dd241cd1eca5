//! O(1) page-index allocation with double-free and out-of-range detection.

use thiserror::Error;

/// A free that would corrupt the pool.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PageError {
    #[error("page {page} freed twice")]
    DoubleFree { page: u32 },
    #[error("page {page} out of range (capacity {capacity})")]
    OutOfRange { page: u32, capacity: u32 },
}

/// Free list of page indices `0..capacity` plus an allocation bitmap.
#[derive(Clone, Debug)]
pub struct PageAllocator {
    free: Vec<u32>,
    used: Vec<u64>,
    capacity: u32,
}

impl PageAllocator {
    pub fn new(capacity: u32) -> PageAllocator {
        PageAllocator {
            free: (0..capacity).rev().collect(),
            used: vec![0; (capacity as usize).div_ceil(64)],
            capacity,
        }
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    pub fn available(&self) -> u32 {
        self.free.len() as u32
    }

    pub fn used(&self) -> u32 {
        self.capacity - self.available()
    }

    pub fn is_allocated(&self, page: u32) -> bool {
        page < self.capacity && self.used[(page / 64) as usize] & (1 << (page % 64)) != 0
    }

    /// Appends `n` pages to `out`, all or nothing.
    pub fn alloc_into(&mut self, n: usize, out: &mut Vec<u32>) -> bool {
        if n > self.free.len() {
            return false;
        }
        let start = self.free.len() - n;
        for &p in &self.free[start..] {
            self.used[(p / 64) as usize] |= 1 << (p % 64);
        }
        out.extend(self.free.drain(start..).rev());
        true
    }

    /// `n` pages, all or nothing.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        let mut v = Vec::with_capacity(n);
        self.alloc_into(n, &mut v).then_some(v)
    }

    /// Returns pages; a bad call (out of range, already free, or listed twice) changes nothing.
    pub fn free(&mut self, pages: &[u32]) -> Result<(), PageError> {
        for (i, &p) in pages.iter().enumerate() {
            let bad = if p >= self.capacity {
                Some(PageError::OutOfRange {
                    page: p,
                    capacity: self.capacity,
                })
            } else if !self.is_allocated(p) {
                Some(PageError::DoubleFree { page: p })
            } else {
                None
            };
            if let Some(e) = bad {
                for &q in &pages[..i] {
                    self.used[(q / 64) as usize] |= 1 << (q % 64);
                }
                return Err(e);
            }
            self.used[(p / 64) as usize] &= !(1 << (p % 64));
        }
        self.free.extend_from_slice(pages);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_roundtrip_and_all_or_nothing() {
        let mut a = PageAllocator::new(10);
        let x = a.alloc(4).unwrap();
        assert_eq!(x, vec![0, 1, 2, 3]);
        assert!(a.alloc(7).is_none());
        assert_eq!(a.available(), 6);
        a.free(&x).unwrap();
        assert_eq!(a.available(), 10);
        let all = a.alloc(10).unwrap();
        let mut s = all.clone();
        s.sort();
        s.dedup();
        assert_eq!(s.len(), 10);
    }

    #[test]
    fn double_free_and_range_detected_without_side_effects() {
        let mut a = PageAllocator::new(4);
        let x = a.alloc(2).unwrap();
        a.free(&x[..1]).unwrap();
        assert_eq!(a.free(&x), Err(PageError::DoubleFree { page: x[0] }));
        assert_eq!(a.available(), 3);
        assert_eq!(
            a.free(&[9]),
            Err(PageError::OutOfRange {
                page: 9,
                capacity: 4
            })
        );
        assert_eq!(
            a.free(&[x[1], x[1]]),
            Err(PageError::DoubleFree { page: x[1] })
        );
        assert_eq!(a.available(), 3);
    }
}
