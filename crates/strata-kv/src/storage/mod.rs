//! L3 storage: pages keyed by their stable hash, outside the radix tree.
//!
//! The tree does not index L3; a prompt's L3 hit is the number of its consecutive page hashes a
//! backend holds ([`Storage::prefix_len`]). Backends must never return bad bytes: a corrupt or
//! truncated entry is a miss plus a counted error.

mod at;
pub mod blob;
mod disk;
mod lru;
mod marker;
mod memory;

pub use disk::DiskStorage;
pub use memory::MemoryStorage;

use thiserror::Error;

use crate::hash::PageHash;

/// A storage operation that failed (as opposed to a plain miss).
#[derive(Debug, Error)]
pub enum StorageError {
    // The cause in the message, not also as a source (a report of the chain said it twice).
    #[error("storage I/O error at {path}: {error}")]
    Io { path: String, error: std::io::Error },
    #[error("entry of {bytes} bytes exceeds the storage capacity of {capacity} bytes")]
    TooLarge { bytes: u64, capacity: u64 },
    #[error("storage backend unavailable: {0}")]
    Unavailable(String),
    #[error("storage operation timed out after {0:?}")]
    Timeout(std::time::Duration),
}

/// An I/O error at `path`.
pub(crate) fn io(path: &std::path::Path, error: std::io::Error) -> StorageError {
    StorageError::Io {
        path: path.display().to_string(),
        error,
    }
}

/// Counters every backend keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StorageStats {
    pub entries: u64,
    pub bytes: u64,
    pub capacity_bytes: u64,
    pub gets: u64,
    pub hits: u64,
    pub puts: u64,
    pub evictions: u64,
    /// Entries found corrupt or truncated (each was treated as a miss and removed).
    pub corrupt: u64,
    /// Intact entries written for another page layout: another page size, pool kinds or K/V
    /// dtype (each was treated as a miss and removed).
    pub other_layout: u64,
    /// Failed operations.
    pub errors: u64,
    /// Operations that ran past their time limit (also counted in `errors`).
    pub timeouts: u64,
}

/// A page store keyed by page hash. Implementations are thread-safe; the cache calls them from
/// its copy workers and its probe thread (`cache/probe.rs`), or in place without a copy
/// engine (the simulator).
pub trait Storage: Send + Sync {
    /// Metric tier label: `disk`, `remote`, ...
    fn tier(&self) -> &'static str;

    /// Which of `hashes` are held.
    fn exists(&self, hashes: &[PageHash]) -> Result<Vec<bool>, StorageError>;

    /// How many leading hashes of `hashes` are held.
    fn prefix_len(&self, hashes: &[PageHash]) -> Result<usize, StorageError> {
        Ok(self.exists(hashes)?.iter().take_while(|&&b| b).count())
    }

    /// The page, or None on a miss (including a corrupt entry, which is counted and dropped).
    fn get(&self, hash: &PageHash) -> Result<Option<Vec<u8>>, StorageError>;

    /// Stores a page; storing a hash that is present refreshes it.
    fn put(&self, hash: &PageHash, data: &[u8]) -> Result<(), StorageError>;

    /// Several pages in one round trip where the backend can (default: one by one).
    fn get_many(&self, hashes: &[PageHash]) -> Vec<Result<Option<Vec<u8>>, StorageError>> {
        hashes.iter().map(|h| self.get(h)).collect()
    }

    /// Stores several pages in one round trip where the backend can (default: one by one).
    fn put_many(&self, pages: &[(PageHash, Vec<u8>)]) -> Vec<Result<(), StorageError>> {
        pages.iter().map(|(h, d)| self.put(h, d)).collect()
    }

    /// Removes a page; true if it was there.
    fn delete(&self, hash: &PageHash) -> Result<bool, StorageError>;

    fn stats(&self) -> StorageStats;

    /// Each tier's own numbers (a [`Chain`]: each of its tiers, in order).
    fn parts(&self) -> Vec<(&'static str, StorageStats)> {
        vec![(self.tier(), self.stats())]
    }
}

/// Several backends as one L3, in order (disk first, then remote): a page is held if any holds
/// it, read from the first that has it intact, written to all.
pub struct Chain {
    tiers: Vec<std::sync::Arc<dyn Storage>>,
    name: &'static str,
}

impl Chain {
    pub fn new(tiers: Vec<std::sync::Arc<dyn Storage>>) -> Chain {
        let name = match tiers
            .iter()
            .map(|t| t.tier())
            .collect::<Vec<_>>()
            .as_slice()
        {
            ["disk", "remote"] => "disk+remote",
            [one] => one,
            _ => "l3",
        };
        Chain { tiers, name }
    }
}

impl Storage for Chain {
    fn tier(&self) -> &'static str {
        self.name
    }

    fn exists(&self, hashes: &[PageHash]) -> Result<Vec<bool>, StorageError> {
        let mut out = vec![false; hashes.len()];
        let mut last_err = None;
        let mut any_ok = false;
        for t in &self.tiers {
            match t.exists(hashes) {
                Ok(v) => {
                    any_ok = true;
                    for (o, b) in out.iter_mut().zip(v) {
                        *o |= b;
                    }
                }
                Err(e) => last_err = Some(e),
            }
        }
        match (any_ok, last_err) {
            (false, Some(e)) => Err(e),
            _ => Ok(out),
        }
    }

    fn get(&self, hash: &PageHash) -> Result<Option<Vec<u8>>, StorageError> {
        let mut last_err = None;
        for t in &self.tiers {
            match t.get(hash) {
                Ok(Some(d)) => return Ok(Some(d)),
                Ok(None) => {}
                Err(e) => last_err = Some(e),
            }
        }
        match last_err {
            Some(e) => Err(e),
            None => Ok(None),
        }
    }

    fn put(&self, hash: &PageHash, data: &[u8]) -> Result<(), StorageError> {
        let mut res = Ok(());
        for t in &self.tiers {
            if let Err(e) = t.put(hash, data) {
                res = Err(e);
            }
        }
        res
    }

    fn put_many(&self, pages: &[(PageHash, Vec<u8>)]) -> Vec<Result<(), StorageError>> {
        let mut out: Vec<Result<(), StorageError>> = pages.iter().map(|_| Ok(())).collect();
        for t in &self.tiers {
            for (o, r) in out.iter_mut().zip(t.put_many(pages)) {
                if r.is_err() {
                    *o = r;
                }
            }
        }
        out
    }

    fn delete(&self, hash: &PageHash) -> Result<bool, StorageError> {
        let mut any = false;
        for t in &self.tiers {
            any |= t.delete(hash)?;
        }
        Ok(any)
    }

    fn parts(&self) -> Vec<(&'static str, StorageStats)> {
        self.tiers.iter().flat_map(|t| t.parts()).collect()
    }

    fn stats(&self) -> StorageStats {
        let mut s = StorageStats::default();
        for t in &self.tiers {
            let x = t.stats();
            s.entries += x.entries;
            s.bytes += x.bytes;
            s.capacity_bytes = s.capacity_bytes.saturating_add(x.capacity_bytes);
            s.gets += x.gets;
            s.hits += x.hits;
            s.puts += x.puts;
            s.evictions += x.evictions;
            s.corrupt += x.corrupt;
            s.other_layout += x.other_layout;
            s.errors += x.errors;
            s.timeouts += x.timeouts;
        }
        s
    }
}
