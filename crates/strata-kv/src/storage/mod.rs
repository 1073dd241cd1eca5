//! L3 storage: pages keyed by their stable hash, outside the radix tree.
//!
//! The tree does not index L3; a prompt's L3 hit is the number of its consecutive page hashes a
//! backend holds ([`Storage::prefix_len`]). Backends must never return bad bytes: a corrupt or
//! truncated entry is a miss plus a counted error.

pub mod blob;
mod disk;
mod lru;
mod memory;

pub use disk::DiskStorage;
pub use memory::MemoryStorage;

use thiserror::Error;

use crate::hash::PageHash;

/// A storage operation that failed (as opposed to a plain miss).
#[derive(Debug, Error)]
pub enum StorageError {
    #[error("storage I/O error at {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("entry of {bytes} bytes exceeds the storage capacity of {capacity} bytes")]
    TooLarge { bytes: u64, capacity: u64 },
    #[error("storage backend unavailable: {0}")]
    Unavailable(String),
    #[error("storage operation timed out after {0:?}")]
    Timeout(std::time::Duration),
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
    /// Failed operations.
    pub errors: u64,
    /// Operations that ran past their time limit (also counted in `errors`).
    pub timeouts: u64,
}

/// A page store keyed by page hash. Implementations are thread-safe; the cache calls them from
/// its copy workers.
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
}
