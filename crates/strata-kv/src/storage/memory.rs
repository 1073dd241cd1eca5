//! In-process L3 backend: pages in a hash map with an LRU cap in bytes and entries. Useful as a
//! fast local tier and for the simulator, which stores metadata-only pages.

use std::sync::Mutex;

use rustc_hash::FxHashMap;

use super::lru::LruIndex;
use super::{Storage, StorageError, StorageStats};
use crate::hash::PageHash;

#[derive(Default)]
struct Inner {
    data: FxHashMap<PageHash, Vec<u8>>,
    lru: LruIndex,
    stats: StorageStats,
}

/// In-memory page store.
pub struct MemoryStorage {
    inner: Mutex<Inner>,
    cap_bytes: u64,
    cap_entries: u64,
}

impl MemoryStorage {
    /// `cap_bytes` / `cap_entries`: whichever binds first; `u64::MAX` for none.
    pub fn new(cap_bytes: u64, cap_entries: u64) -> MemoryStorage {
        MemoryStorage {
            inner: Mutex::new(Inner::default()),
            cap_bytes,
            cap_entries,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Storage for MemoryStorage {
    fn tier(&self) -> &'static str {
        "memory"
    }

    fn exists(&self, hashes: &[PageHash]) -> Result<Vec<bool>, StorageError> {
        let g = self.lock();
        Ok(hashes.iter().map(|h| g.data.contains_key(h)).collect())
    }

    fn get(&self, hash: &PageHash) -> Result<Option<Vec<u8>>, StorageError> {
        let mut g = self.lock();
        g.stats.gets += 1;
        let v = g.data.get(hash).cloned();
        if let Some(d) = &v {
            g.stats.hits += 1;
            let n = d.len() as u64;
            g.lru.touch(*hash, n);
        }
        Ok(v)
    }

    fn put(&self, hash: &PageHash, data: &[u8]) -> Result<(), StorageError> {
        let n = data.len() as u64;
        if n > self.cap_bytes || self.cap_entries == 0 {
            return Err(StorageError::TooLarge {
                bytes: n,
                capacity: self.cap_bytes,
            });
        }
        let mut g = self.lock();
        g.stats.puts += 1;
        g.lru.touch(*hash, n);
        g.data.insert(*hash, data.to_vec());
        while g.lru.bytes > self.cap_bytes || g.lru.len() as u64 > self.cap_entries {
            let old = g.lru.oldest().expect("non-empty");
            g.lru.remove(&old);
            g.data.remove(&old);
            g.stats.evictions += 1;
        }
        Ok(())
    }

    fn delete(&self, hash: &PageHash) -> Result<bool, StorageError> {
        let mut g = self.lock();
        g.lru.remove(hash);
        Ok(g.data.remove(hash).is_some())
    }

    fn stats(&self) -> StorageStats {
        let g = self.lock();
        StorageStats {
            entries: g.data.len() as u64,
            bytes: g.lru.bytes,
            capacity_bytes: self.cap_bytes,
            ..g.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> PageHash {
        PageHash([i; 16])
    }

    #[test]
    fn lru_cap_by_entries_and_bytes() {
        let s = MemoryStorage::new(10, 3);
        for i in 0..3 {
            s.put(&h(i), &[i]).unwrap();
        }
        s.get(&h(0)).unwrap();
        s.put(&h(3), &[3]).unwrap();
        assert_eq!(
            s.exists(&[h(0), h(1), h(2), h(3)]).unwrap(),
            vec![true, false, true, true]
        );
        s.put(&h(4), &[0; 9]).unwrap();
        assert!(s.stats().bytes <= 10);
        assert!(matches!(
            s.put(&h(5), &[0; 11]),
            Err(StorageError::TooLarge { .. })
        ));
        assert_eq!(s.prefix_len(&[h(4), h(9), h(3)]).unwrap(), 1);
    }
}
