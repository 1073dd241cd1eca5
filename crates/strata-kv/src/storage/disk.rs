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

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

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
    /// made again, not written into while deleted).
    root: StoreDir,
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
            root,
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
        match self.root.sub(&sub)? {
            Some(d) => StoreDir::remove(&d, &name),
            None => Err(std::io::ErrorKind::NotFound.into()),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
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
        let Some(d) = self.root.sub(&sub)? else {
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
        let d = match self.root.sub_made(&sub) {
            Ok(d) => d,
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
        let t = match self.root.sub_made("tmp") {
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
mod tests {
    use super::*;

    fn h(i: u8) -> PageHash {
        PageHash([i; 16])
    }

    #[test]
    fn put_get_roundtrip_and_reopen() {
        let d = tempfile::tempdir().unwrap();
        let s = DiskStorage::open(d.path(), 1 << 20, false).unwrap();
        s.put(&h(1), b"hello page").unwrap();
        assert_eq!(s.get(&h(1)).unwrap().as_deref(), Some(&b"hello page"[..]));
        assert_eq!(s.get(&h(2)).unwrap(), None);
        drop(s);
        let s = DiskStorage::open(d.path(), 1 << 20, false).unwrap();
        assert_eq!(s.exists(&[h(1), h(2)]).unwrap(), vec![true, false]);
        assert_eq!(s.get(&h(1)).unwrap().as_deref(), Some(&b"hello page"[..]));
        // No temp files remain after successful writes.
        assert_eq!(fs::read_dir(d.path().join("tmp")).unwrap().count(), 0);
    }

    #[test]
    fn interrupted_writes_are_never_visible_and_are_cleared() {
        let d = tempfile::tempdir().unwrap();
        let s = DiskStorage::open(d.path(), 1 << 20, false).unwrap();
        s.put(&h(1), b"complete").unwrap();
        drop(s);
        // A crash mid-put leaves only a temp file: not under any page's name.
        let tmp = d
            .path()
            .join("tmp")
            .join(format!("{}.1.0.tmp", h(2).to_hex()));
        fs::write(&tmp, b"STRATAPG partial").unwrap();
        // One begun a moment ago may be another worker's, in progress: it stays.
        let s = DiskStorage::open(d.path(), 1 << 20, false).unwrap();
        assert!(tmp.exists());
        drop(s);
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(120);
        fs::File::options()
            .write(true)
            .open(&tmp)
            .unwrap()
            .set_modified(old)
            .unwrap();
        let s = DiskStorage::open(d.path(), 1 << 20, false).unwrap();
        assert!(!tmp.exists());
        assert_eq!(s.exists(&[h(1), h(2)]).unwrap(), vec![true, false]);
        assert_eq!(s.get(&h(2)).unwrap(), None);
        assert_eq!(s.stats().corrupt, 0);
    }

    #[test]
    fn corruption_and_truncation_are_misses_and_counted() {
        let d = tempfile::tempdir().unwrap();
        let s = DiskStorage::open(d.path(), 1 << 20, false).unwrap();
        s.put(&h(1), &[7u8; 100]).unwrap();
        s.put(&h(2), &[8u8; 100]).unwrap();
        s.put(&h(3), &[9u8; 100]).unwrap();
        // Flip one payload byte.
        let p = s.path_of(&h(1));
        let mut b = fs::read(&p).unwrap();
        b[HEADER + 5] ^= 1;
        fs::write(&p, b).unwrap();
        // Truncate another.
        let p2 = s.path_of(&h(2));
        let b2 = fs::read(&p2).unwrap();
        fs::write(&p2, &b2[..b2.len() - 1]).unwrap();
        // A file of page 3 stored under page 4's name.
        fs::create_dir_all(s.path_of(&h(4)).parent().unwrap()).unwrap();
        fs::copy(s.path_of(&h(3)), s.path_of(&h(4))).unwrap();
        let s = DiskStorage::open(d.path(), 1 << 20, false).unwrap();
        assert_eq!(s.get(&h(1)).unwrap(), None);
        assert_eq!(s.get(&h(2)).unwrap(), None);
        assert_eq!(s.get(&h(4)).unwrap(), None);
        assert_eq!(s.get(&h(3)).unwrap(), Some(vec![9u8; 100]));
        let st = s.stats();
        assert_eq!(st.corrupt, 3);
        assert_eq!(
            s.exists(&[h(1), h(2), h(3), h(4)]).unwrap(),
            vec![false, false, true, false]
        );
        assert!(!s.path_of(&h(1)).exists());
    }

    #[test]
    fn cap_is_respected_with_lru_eviction() {
        let d = tempfile::tempdir().unwrap();
        let one = (HEADER + 1000) as u64;
        let s = DiskStorage::open(d.path(), 3 * one, false).unwrap();
        for i in 0..3 {
            s.put(&h(i), &[i; 1000]).unwrap();
        }
        s.get(&h(0)).unwrap();
        s.put(&h(3), &[3; 1000]).unwrap();
        assert_eq!(
            s.exists(&[h(0), h(1), h(2), h(3)]).unwrap(),
            vec![true, false, true, true]
        );
        let st = s.stats();
        assert!(st.bytes <= 3 * one);
        assert_eq!(st.evictions, 1);
        let on_disk: u64 = walk(d.path());
        assert_eq!(on_disk, st.bytes);
        assert!(matches!(
            s.put(&h(9), &[0; 4000]),
            Err(StorageError::TooLarge { .. })
        ));
        // Reopening with a smaller cap trims to it.
        drop(s);
        let s = DiskStorage::open(d.path(), one, false).unwrap();
        assert_eq!(s.stats().entries, 1);
        assert_eq!(walk(d.path()), one);
    }

    /// The bytes of the pages (every file but the marker) under `p`.
    fn walk(p: &Path) -> u64 {
        let mut n = 0;
        for e in fs::read_dir(p).unwrap().flatten() {
            if e.file_name() == super::super::marker::MARKER {
                continue;
            }
            let md = e.metadata().unwrap();
            n += if md.is_dir() {
                walk(&e.path())
            } else {
                md.len()
            };
        }
        n
    }

    /// A FIFO, a symlink to /dev/zero, a symlink out of the directory and an oversized file
    /// under page names: each is a miss (counted, removed), at once, without unbounded reads;
    /// the next put of each page writes a real page in its place.
    #[test]
    fn things_that_are_not_page_files_are_misses_without_hanging() {
        let d = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let s = DiskStorage::open(d.path(), 1 << 20, false)
            .unwrap()
            .with_page_bytes(10);
        for i in 1..=4u8 {
            s.put(&h(i), b"0123456789").unwrap();
        }
        let fifo = s.path_of(&h(1));
        fs::remove_file(&fifo).unwrap();
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo(3) with a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let zero = s.path_of(&h(2));
        fs::remove_file(&zero).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let out = s.path_of(&h(3));
        let secret = outside.path().join("secret");
        fs::write(
            &secret,
            blob::encode(&BlobKey::public(), &h(3), b"0123456789"),
        )
        .unwrap();
        fs::remove_file(&out).unwrap();
        std::os::unix::fs::symlink(&secret, &out).unwrap();
        let big = s.path_of(&h(4));
        fs::write(&big, vec![0u8; 1 << 20]).unwrap();
        let t = std::time::Instant::now();
        for i in 1..=4u8 {
            assert_eq!(s.get(&h(i)).unwrap(), None, "page {i}");
        }
        assert!(
            t.elapsed() < std::time::Duration::from_secs(2),
            "a read blocked"
        );
        assert_eq!(s.stats().corrupt, 4);
        assert!(
            secret.exists(),
            "the link's target outside the directory was touched"
        );
        for i in 1..=4u8 {
            s.put(&h(i), b"0123456789").unwrap();
            assert_eq!(s.get(&h(i)).unwrap().as_deref(), Some(&b"0123456789"[..]));
        }
    }

    #[test]
    fn writes_never_go_through_a_link_out_of_the_store() {
        let d = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let s = DiskStorage::open(d.path(), 1 << 20, false).unwrap();
        let sub = s.path_of(&h(1)).parent().unwrap().to_path_buf();
        let _ = fs::remove_dir_all(&sub);
        std::os::unix::fs::symlink(outside.path(), &sub).unwrap();
        s.put(&h(1), b"page").unwrap();
        assert_eq!(
            fs::read_dir(outside.path()).unwrap().count(),
            0,
            "written outside"
        );
        assert!(fs::symlink_metadata(&sub).unwrap().is_dir());
        assert_eq!(s.get(&h(1)).unwrap().as_deref(), Some(&b"page"[..]));
        // A store reopened over a symlinked tmp/ gets a real one.
        drop(s);
        fs::remove_dir_all(d.path().join("tmp")).unwrap();
        std::os::unix::fs::symlink(outside.path(), d.path().join("tmp")).unwrap();
        let s = DiskStorage::open(d.path(), 1 << 20, false).unwrap();
        s.put(&h(2), b"page").unwrap();
        assert_eq!(
            fs::read_dir(outside.path()).unwrap().count(),
            0,
            "written outside"
        );
    }

    /// Through a symlinked subdirectory nothing outside the store is read or removed: not by a
    /// read that refuses it, nor by a delete.
    #[test]
    fn nothing_outside_is_removed_through_a_symlinked_subdirectory() {
        let d = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let s = DiskStorage::open(d.path(), 1 << 20, false).unwrap();
        s.put(&h(1), b"page").unwrap();
        let p = s.path_of(&h(1));
        let sub = p.parent().unwrap().to_path_buf();
        let moved = outside.path().join("victim");
        fs::rename(&sub, &moved).unwrap();
        std::os::unix::fs::symlink(&moved, &sub).unwrap();
        assert_eq!(s.get(&h(1)).unwrap(), None);
        s.delete(&h(1)).unwrap();
        assert!(
            moved.join(p.file_name().unwrap()).exists(),
            "removed outside"
        );
    }

    /// A file found at open that no page of the store can be is not counted against the cap:
    /// one larger than the store is not indexed, one larger than a page leaves the index once
    /// the page size is known (and stays on disk: another worker's). The pages stay.
    #[test]
    fn a_huge_or_odd_file_found_at_open_evicts_nothing() {
        let d = tempfile::tempdir().unwrap();
        let s = DiskStorage::open(d.path(), 1 << 20, false)
            .unwrap()
            .with_page_bytes(4);
        for i in 1..=5 {
            s.put(&h(i), b"page").unwrap();
        }
        drop(s);
        let file = |i: u8| {
            let hex = h(i).to_hex();
            let dir = d.path().join(&hex[..2]);
            fs::create_dir_all(&dir).unwrap();
            dir.join(format!("{hex}.page"))
        };
        fs::File::create(file(9)).unwrap().set_len(1 << 30).unwrap();
        fs::write(file(8), vec![0u8; 900_000]).unwrap();
        fs::write(file(7), vec![0u8; HEADER + 2]).unwrap();
        let s = DiskStorage::open(d.path(), 1 << 20, false)
            .unwrap()
            .with_page_bytes(4);
        // The smaller file may be a page saved without its window state: it stays indexed
        // (and a read of it refuses it as damaged).
        assert_eq!(s.stats().entries, 6);
        assert!(file(8).exists(), "another worker's file is left on disk");
        for i in 1..=5 {
            assert_eq!(s.get(&h(i)).unwrap().as_deref(), Some(&b"page"[..]), "{i}");
        }
        s.put(&h(6), b"page").unwrap();
        assert_eq!(s.stats().evictions, 0);
    }

    #[test]
    fn a_tmp_removed_while_running_is_made_again() {
        let d = tempfile::tempdir().unwrap();
        let s = DiskStorage::open(d.path(), 1 << 20, false).unwrap();
        s.put(&h(1), b"one").unwrap();
        fs::remove_dir_all(d.path().join("tmp")).unwrap();
        s.put(&h(2), b"two").unwrap();
        fs::remove_dir_all(d.path().join("tmp")).unwrap();
        std::os::unix::fs::symlink(d.path().join("elsewhere"), d.path().join("tmp")).unwrap();
        s.put(&h(3), b"three").unwrap();
        assert!(fs::symlink_metadata(d.path().join("tmp")).unwrap().is_dir());
        for (i, v) in [(1, &b"one"[..]), (2, b"two"), (3, b"three")] {
            assert_eq!(s.get(&h(i)).unwrap().as_deref(), Some(v), "{i}");
        }
        assert_eq!(s.stats().errors, 0);
    }

    #[test]
    fn only_what_a_read_would_find_is_indexed_at_open() {
        let d = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let s = DiskStorage::open(d.path(), 1 << 20, false).unwrap();
        s.put(&h(1), b"page").unwrap();
        let real = fs::read(s.path_of(&h(1))).unwrap();
        drop(s);
        let hex = h(2).to_hex();
        // Another subdirectory, upper case, a linked subdirectory: none is where a read looks.
        fs::create_dir_all(d.path().join("zz")).unwrap();
        fs::write(d.path().join(format!("zz/{hex}.page")), &real).unwrap();
        let up = h(0xab).to_hex().to_uppercase();
        fs::create_dir_all(d.path().join("ab")).unwrap();
        fs::write(d.path().join(format!("ab/{up}.page")), &real).unwrap();
        let h3 = h(3).to_hex();
        fs::write(outside.path().join(format!("{h3}.page")), &real).unwrap();
        std::os::unix::fs::symlink(outside.path(), d.path().join(&h3[..2])).unwrap();
        let s = DiskStorage::open(d.path(), 1 << 20, false).unwrap();
        assert_eq!(s.stats().entries, 1);
        assert_eq!(s.stats().bytes, real.len() as u64);
        assert_eq!(s.exists(&[h(1), h(2), h(3)]).unwrap(), [true, false, false]);
    }

    /// A directory under a page's name is a miss, removed, and the next put stores the page.
    #[test]
    fn a_directory_under_a_pages_name_is_replaced() {
        let d = tempfile::tempdir().unwrap();
        let s = DiskStorage::open(d.path(), 1 << 20, false).unwrap();
        s.put(&h(1), b"page").unwrap();
        let p = s.path_of(&h(1));
        fs::remove_file(&p).unwrap();
        fs::create_dir(&p).unwrap();
        fs::write(p.join("x"), b"x").unwrap();
        assert_eq!(s.get(&h(1)).unwrap(), None);
        s.put(&h(1), b"page").unwrap();
        assert_eq!(s.get(&h(1)).unwrap().as_deref(), Some(&b"page"[..]));
    }

    #[test]
    fn a_damaged_page_still_indexed_is_replaced_by_the_next_put() {
        let d = tempfile::tempdir().unwrap();
        let s = DiskStorage::open(d.path(), 1 << 20, false).unwrap();
        s.put(&h(1), b"page one").unwrap();
        let p = s.path_of(&h(1));
        let mut b = fs::read(&p).unwrap();
        b.truncate(b.len() - 3);
        fs::write(&p, b).unwrap();
        s.put(&h(1), b"page one").unwrap();
        assert_eq!(s.get(&h(1)).unwrap().as_deref(), Some(&b"page one"[..]));
    }

    #[test]
    fn pages_under_another_key_are_misses() {
        let d = tempfile::tempdir().unwrap();
        let ck = crate::auth::ClusterKey::from_secret(&[5; 32]).unwrap();
        let mine = DiskStorage::open(d.path(), 1 << 20, false)
            .unwrap()
            .with_key(BlobKey::from_cluster(&ck));
        let public = DiskStorage::open(d.path(), 1 << 20, false).unwrap();
        public.put(&h(9), b"forged").unwrap();
        assert_eq!(mine.get(&h(9)).unwrap(), None);
        assert_eq!(mine.stats().corrupt, 1);
    }
}
