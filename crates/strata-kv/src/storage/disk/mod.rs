//! Local-disk L3 backend: one file per page under `<dir>/<2 hex>/<32 hex>.page`.
//!
//! File = header (magic `STRATAPG`, format version, payload length, BLAKE3 of the payload, the
//! page hash) + payload. Writes go to `<dir>/tmp/` and are renamed into place, so a reader never
//! sees a partial file under a page's name. A file whose header, length, hash or checksum is wrong
//! is a miss, counted as corrupt, and deleted. A byte cap evicts least recently used pages.
//!
//! Nothing in the directory is trusted: a page is read only from a regular file (opened without
//! following a symlink and without blocking, so a FIFO or a device is a miss, not a hang), in a
//! subdirectory that is not a symlink, and of at most the largest value this store holds. Every
//! read, removal and rename goes through handles of the store and the page's subdirectory
//! (`at.rs`), so a subdirectory swapped for a link meanwhile leads nowhere outside.
//!
//! A store directory removed while the worker runs (a clean-up script, an operator) is made
//! again at the next write, empty, and its index emptied with it: the tier goes on, and its
//! gauges never describe files that are gone. Pages the cache had stored before are misses
//! there; their prefixes are stored again once recomputed.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock, RwLockReadGuard};

use super::lru::LruIndex;
use super::{io, Storage, StorageError, StorageStats};
use crate::hash::PageHash;

use super::at::StoreDir;
use super::blob::{self, BlobKey, HEADER};
use super::marker::claim;

/// One-file-per-page disk store with a byte cap.
pub struct DiskStorage {
    dir: PathBuf,
    /// The store, held open (its `tmp/` is opened for each write: one removed meanwhile is
    /// made again, not written into while deleted; the store itself likewise, see
    /// [`DiskStorage::remake`]).
    root: RwLock<StoreDir>,
    cap_bytes: u64,
    sync: bool,
    key: BlobKey,
    /// Largest file read (header + payload).
    max_value: u64,
    index: Mutex<LruIndex>,
    stats: Mutex<StorageStats>,
    seq: AtomicU64,
}

impl DiskStorage {
    /// Opens (or creates) `dir`, indexing the pages already there, oldest modification first.
    /// `sync` makes every put fsync before the rename (durable across power loss).
    pub fn open(
        dir: impl Into<PathBuf>,
        cap_bytes: u64,
        sync: bool,
    ) -> Result<DiskStorage, StorageError> {
        let dir = dir.into();
        let tmp_path = dir.join("tmp");
        fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
        let root = StoreDir::open(&dir).map_err(|e| io(&dir, e))?;
        claim(&root, &dir)?;
        let tmp = root.sub_made("tmp").map_err(|e| io(&tmp_path, e))?;
        // Leftovers of writes a crash interrupted are never visible; clear them: what is older
        // than a minute (a worker sharing the store may be writing now).
        StoreDir::clear(&tmp, super::at::ago(60)).map_err(|e| io(&tmp_path, e))?;
        let mut found = Self::scan(&root, cap_bytes).map_err(|e| io(&dir, e))?;
        found.sort_by_key(|x| x.0);
        let s = DiskStorage {
            dir,
            root: RwLock::new(root),
            cap_bytes,
            sync,
            key: BlobKey::public(),
            max_value: cap_bytes,
            index: Mutex::new(LruIndex::default()),
            stats: Mutex::new(StorageStats::default()),
            seq: AtomicU64::new(0),
        };
        {
            let mut ix = s.index();
            for (_, h, len) in found {
                ix.touch(h, len);
            }
        }
        s.enforce_cap(None)?;
        Ok(s)
    }

    /// The pages found in `root` (by handle: a subdirectory that is a link is not the store's),
    /// each under the subdirectory its hash names: a regular file no larger than the store is
    /// indexed; anything else is left to a read, which removes it, and never counts against
    /// the cap (one huge file would otherwise evict every page at the next put). A
    /// subdirectory the store may not read is skipped, not a failure to start.
    fn scan(root: &StoreDir, cap_bytes: u64) -> std::io::Result<Vec<(i128, PageHash, u64)>> {
        // Refused: skipped (someone else's); any other error (out of descriptors, memory) is
        // the store's own failure, not a reason to start with a partial index.
        let refused = |e: &std::io::Error| e.kind() == std::io::ErrorKind::PermissionDenied;
        let mut found = Vec::new();
        for i in 0..=255u8 {
            let sub = format!("{i:02x}");
            let d = match root.sub(&sub) {
                Ok(Some(d)) => d,
                Ok(None) => continue,
                Err(e) if refused(&e) => continue,
                Err(e) => return Err(e),
            };
            let names = match StoreDir::names(&d) {
                Ok(n) => n,
                Err(e) if refused(&e) => continue,
                Err(e) => return Err(e),
            };
            for name in names {
                let Some(n) = name.to_str() else { continue };
                let Some(hex) = n.strip_suffix(".page") else {
                    continue;
                };
                // Only a page's own name (lower-case hex, in its subdirectory): a read finds
                // nothing else, so nothing else may count against the cap.
                let own = |h: &PageHash| h.to_hex() == hex && hex.starts_with(&sub);
                let Some(h) = PageHash::from_hex(hex).filter(own) else {
                    continue;
                };
                if let Ok(Some(e)) = StoreDir::entry(&d, n) {
                    if e.file && e.len <= cap_bytes {
                        found.push((e.modified, h, e.len));
                    }
                }
            }
        }
        Ok(found)
    }

    /// A page's subdirectory and file name.
    fn loc(h: &PageHash) -> (String, String) {
        let hex = h.to_hex();
        (hex[..2].to_string(), format!("{hex}.page"))
    }

    /// Removes the page `h`'s name in this store, whatever is there (a file, a link, a FIFO, a
    /// directory tree), only in a real subdirectory of the store: NotFound when absent, or
    /// when its subdirectory is not one (nothing removed, nothing counted).
    fn remove_page(&self, h: &PageHash) -> std::io::Result<()> {
        let (sub, name) = Self::loc(h);
        match self.root().sub(&sub)? {
            Some(d) => StoreDir::remove(&d, &name),
            None => Err(std::io::ErrorKind::NotFound.into()),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn root(&self) -> RwLockReadGuard<'_, StoreDir> {
        self.root.read().unwrap_or_else(|e| e.into_inner())
    }

    /// After a write found no directory to write in: when the store's own directory was
    /// removed (its handle names a directory with no links left), it is made again at its
    /// path, claimed as a store, and the index emptied (every page it listed went with it).
    /// Only a real directory of the store's owner is taken (made here, or by another worker
    /// sharing the path), never a link or another user's directory planted at the path, and
    /// it is the one opened (same device and inode). Checked and swapped under the write lock,
    /// so concurrent writes remake it once. True when the write is worth one more try (the
    /// store was made again, here or by a concurrent write).
    fn remake(&self) -> bool {
        use std::os::unix::fs::MetadataExt;
        let meta = |r: &StoreDir| r.fd().try_clone().map(fs::File::from)?.metadata();
        let mut root = self.root.write().unwrap_or_else(|e| e.into_inner());
        let Ok(old) = meta(&root) else { return false };
        if old.nlink() != 0 {
            return true;
        }
        if let Some(parent) = self.dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            let _ = fs::create_dir_all(parent);
        }
        match fs::create_dir(&self.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(_) => return false,
        }
        let Ok(m) = fs::symlink_metadata(&self.dir) else {
            return false;
        };
        if !m.is_dir() || m.uid() != old.uid() {
            return false;
        }
        let Ok(new) = StoreDir::open(&self.dir) else {
            return false;
        };
        let same = meta(&new).is_ok_and(|n| (n.dev(), n.ino()) == (m.dev(), m.ino()));
        if !same || claim(&new, &self.dir).is_err() {
            return false;
        }
        *root = new;
        *self.index() = LruIndex::default();
        true
    }

    /// Pages are MAC'd with `key` (from the cluster key: pages only its holders can make).
    pub fn with_key(mut self, key: BlobKey) -> DiskStorage {
        self.key = key;
        self
    }

    /// A page's payload has at most `bytes` (a page saved without its window state has
    /// fewer): a larger file is not a page of this store. Those found at open leave the index
    /// (they stay on disk: a worker of another K/V dtype or page size may share the
    /// directory; its pages have other hashes).
    pub fn with_page_bytes(mut self, bytes: u64) -> DiskStorage {
        self.max_value = bytes + HEADER as u64;
        let ix = self.index.get_mut().unwrap_or_else(|e| e.into_inner());
        for h in ix.larger_than(self.max_value) {
            ix.remove(&h);
        }
        self
    }

    /// A page file's bytes, read only from a regular file of at most `max_value` bytes, in a
    /// real subdirectory of the store. Ok(None): absent; empty: something is under the page's
    /// name that is not a page file (a link, a FIFO, a directory, a file of the wrong size).
    fn read_page(&self, h: &PageHash) -> std::io::Result<Option<Vec<u8>>> {
        use std::io::Read;
        let (sub, name) = Self::loc(h);
        let Some(d) = self.root().sub(&sub)? else {
            return Ok(None);
        };
        let Some(f) = StoreDir::open_read(&d, &name)? else {
            let present = StoreDir::entry(&d, &name)?.is_some();
            return Ok(present.then(Vec::new));
        };
        let md = f.metadata()?;
        if !md.is_file() || md.len() > self.max_value || md.len() < HEADER as u64 {
            return Ok(Some(Vec::new()));
        }
        let mut bytes = Vec::with_capacity(md.len() as usize);
        // At most the size the file had: a file that grows meanwhile is cut, then refused.
        f.take(self.max_value + 1).read_to_end(&mut bytes)?;
        Ok(Some(bytes))
    }

    /// Path of a page's file.
    pub fn path_of(&self, h: &PageHash) -> PathBuf {
        let (sub, name) = Self::loc(h);
        self.dir.join(sub).join(name)
    }

    fn index(&self) -> std::sync::MutexGuard<'_, LruIndex> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn count(&self, f: impl FnOnce(&mut StorageStats)) {
        f(&mut self.stats.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Evicts least recently used pages until under the cap (never `keep`).
    fn enforce_cap(&self, keep: Option<PageHash>) -> Result<(), StorageError> {
        loop {
            let victim = {
                let mut ix = self.index();
                if ix.bytes <= self.cap_bytes {
                    return Ok(());
                }
                let Some(v) = ix.oldest() else { return Ok(()) };
                if Some(v) == keep {
                    return Ok(());
                }
                ix.remove(&v);
                v
            };
            match self.remove_page(&victim) {
                Ok(()) => self.count(|s| s.evictions += 1),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io(&self.path_of(&victim), e)),
            }
        }
    }
}

impl Storage for DiskStorage {
    fn tier(&self) -> &'static str {
        "disk"
    }

    fn exists(&self, hashes: &[PageHash]) -> Result<Vec<bool>, StorageError> {
        let ix = self.index();
        Ok(hashes.iter().map(|h| ix.contains(h)).collect())
    }

    fn get(&self, h: &PageHash) -> Result<Option<Vec<u8>>, StorageError> {
        self.count(|s| s.gets += 1);
        let bytes = match self.read_page(h) {
            Ok(Some(b)) => b,
            Ok(None) => {
                self.index().remove(h);
                return Ok(None);
            }
            Err(e) => {
                self.count(|s| s.errors += 1);
                return Err(io(&self.path_of(h), e));
            }
        };
        match blob::decode(&self.key, h, &bytes) {
            Ok(payload) => {
                self.index().touch(*h, bytes.len() as u64);
                self.count(|s| s.hits += 1);
                Ok(Some(payload))
            }
            Err(why) => {
                self.count(|s| match why {
                    blob::Refused::Damaged => s.corrupt += 1,
                    blob::Refused::OtherLayout => s.other_layout += 1,
                });
                self.index().remove(h);
                let _ = self.remove_page(h);
                Ok(None)
            }
        }
    }

    fn put(&self, h: &PageHash, data: &[u8]) -> Result<(), StorageError> {
        let total = (HEADER + data.len()) as u64;
        if total > self.cap_bytes {
            return Err(StorageError::TooLarge {
                bytes: total,
                capacity: self.cap_bytes,
            });
        }
        self.count(|s| s.puts += 1);
        let (sub, name) = Self::loc(h);
        let made = || self.root().sub_made(&sub);
        let d = match made() {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && self.remake() => {
                made().map_err(|e| {
                    self.count(|s| s.errors += 1);
                    io(&self.path_of(h), e)
                })?
            }
            Err(e) => {
                self.count(|s| s.errors += 1);
                return Err(io(&self.path_of(h), e));
            }
        };
        // Skipped only when a regular file of the right size is in place: anything else under
        // the page's name (damaged, truncated, a FIFO, a link, a directory) is replaced.
        let there = StoreDir::entry(&d, &name).ok().flatten();
        if self.index().contains(h) && there.is_some_and(|e| e.file && e.len == total) {
            self.index().touch(*h, total);
            return Ok(());
        }
        if there.is_some_and(|e| e.dir) {
            let _ = StoreDir::remove(&d, &name);
        }
        let t = match self.root().sub_made("tmp") {
            Ok(t) => t,
            Err(e) => {
                self.count(|s| s.errors += 1);
                return Err(io(&self.dir.join("tmp"), e));
            }
        };
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        let tmp = format!("{}.{}.{n}.tmp", h.to_hex(), std::process::id());
        let write = || -> std::io::Result<()> {
            // A new file, never through a link someone planted under the temporary name.
            let mut f = StoreDir::create(&t, &tmp)?;
            f.write_all(&blob::header(&self.key, h, data))?;
            f.write_all(data)?;
            if self.sync {
                f.sync_all()?;
            }
            Ok(())
        };
        // The rename replaces a file, a link or a FIFO under the name (never what a link
        // points to).
        let res = write().and_then(|_| StoreDir::rename(&t, &tmp, &d, &name));
        if let Err(e) = res {
            let _ = StoreDir::remove(&t, &tmp);
            self.count(|s| s.errors += 1);
            return Err(io(&self.path_of(h), e));
        }
        self.index().touch(*h, total);
        self.enforce_cap(Some(*h))
    }

    fn delete(&self, h: &PageHash) -> Result<bool, StorageError> {
        self.index().remove(h);
        match self.remove_page(h) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io(&self.path_of(h), e)),
        }
    }

    fn stats(&self) -> StorageStats {
        let ix = self.index();
        let s = *self.stats.lock().unwrap_or_else(|e| e.into_inner());
        StorageStats {
            entries: ix.len() as u64,
            bytes: ix.bytes,
            capacity_bytes: self.cap_bytes,
            ..s
        }
    }
}

#[cfg(test)]
mod tests;
