//! The disk store's directory by handle: every read, removal and rename of a page goes through
//! an open descriptor of the store and of the page's subdirectory (opened without following a
//! link), never through a path resolved again later. Whoever else writes the directory cannot
//! swap a subdirectory for a link between a check and the act and so have the store read,
//! write or delete outside itself.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;

use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags};
use rustix::io::Errno;

/// Deepest directory tree under a page's name that is removed, and most entries in it: anything
/// planted deeper or larger stays, and the page's name stays blocked (an error, not a stack
/// exhausted or a put that lists millions of names).
const MAX_DEPTH: usize = 16;
const MAX_ENTRIES: usize = 4096;

/// The store's directory, held open.
#[derive(Debug)]
pub(super) struct StoreDir {
    fd: OwnedFd,
}

/// What sits under a name: its type and size (the entry itself: a link is not followed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Entry {
    pub file: bool,
    pub dir: bool,
    pub len: u64,
    /// Last modification, in nanoseconds since the epoch.
    pub modified: i128,
}

const DIR: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

/// A missing entry, a link where a directory was asked for, or a non-directory: as absent.
fn absent(e: Errno) -> bool {
    matches!(e, Errno::NOENT | Errno::LOOP | Errno::NOTDIR)
}

impl StoreDir {
    /// Opens `dir` (the operator's path: a link there is the operator's choice and followed).
    pub fn open(dir: &Path) -> io::Result<StoreDir> {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
        Ok(StoreDir {
            fd: rustix::fs::open(dir, flags, Mode::empty())?,
        })
    }

    /// The store's own descriptor.
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// The first `max` names in `d` (`.` and `..` left out).
    pub fn first_names(d: &OwnedFd, max: usize) -> io::Result<Vec<OsString>> {
        names_upto(d, max)
    }

    /// The subdirectory `name`, a real one (never through a link); None when absent or not a
    /// directory.
    pub fn sub(&self, name: &str) -> io::Result<Option<OwnedFd>> {
        match rustix::fs::openat(&self.fd, name, DIR, Mode::empty()) {
            Ok(fd) => Ok(Some(fd)),
            Err(e) if absent(e) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The subdirectory `name`, made a real directory first: whatever else is in its place (a
    /// link, a file) is removed, so nothing is ever written through a link out of the store.
    pub fn sub_made(&self, name: &str) -> io::Result<OwnedFd> {
        for _ in 0..4 {
            if let Some(fd) = self.sub(name)? {
                return Ok(fd);
            }
            // The umask decides (workers of one group may share a store).
            match rustix::fs::mkdirat(&self.fd, name, Mode::from_raw_mode(0o777)) {
                Ok(()) | Err(Errno::EXIST) => {}
                Err(e) => return Err(e.into()),
            }
            if let Some(fd) = self.sub(name)? {
                return Ok(fd);
            }
            // Not a directory (a link, a file): out of the way, then again.
            match rustix::fs::unlinkat(&self.fd, name, AtFlags::empty()) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Err(io::Error::other(format!(
            "{name} in the store keeps changing"
        )))
    }

    /// What is under `name` in `sub`; None when absent.
    pub fn entry(sub: &OwnedFd, name: &str) -> io::Result<Option<Entry>> {
        match rustix::fs::statat(sub, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => {
                let t = FileType::from_raw_mode(st.st_mode);
                Ok(Some(Entry {
                    file: t == FileType::RegularFile,
                    dir: t == FileType::Directory,
                    len: st.st_size as u64,
                    modified: st.st_mtime as i128 * 1_000_000_000 + st.st_mtime_nsec as i128,
                }))
            }
            Err(e) if absent(e) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Opens `name` in `sub` to read: no link followed, no blocking open of a FIFO. None when
    /// absent or not something to read (a link, a FIFO without writer).
    pub fn open_read(sub: &OwnedFd, name: &str) -> io::Result<Option<File>> {
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
        match rustix::fs::openat(sub, name, flags, Mode::empty()) {
            Ok(fd) => Ok(Some(File::from(fd))),
            Err(e) if absent(e) || e == Errno::NXIO => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Creates `name` in `sub` to write, new (never through a link planted under the name).
    pub fn create(sub: &OwnedFd, name: &str) -> io::Result<File> {
        let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW;
        let fd = rustix::fs::openat(
            sub,
            name,
            flags | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o666), // the umask decides
        )?;
        Ok(File::from(fd))
    }

    /// Moves `from` in `from_dir` to `to` in `to_dir` (atomic: a reader sees the old entry or
    /// the new file).
    pub fn rename(from_dir: &OwnedFd, from: &str, to_dir: &OwnedFd, to: &str) -> io::Result<()> {
        Ok(rustix::fs::renameat(from_dir, from, to_dir, to)?)
    }

    /// The names in `d` (`.` and `..` left out).
    pub fn names(d: &OwnedFd) -> io::Result<Vec<OsString>> {
        names_within(d, usize::MAX)
    }

    /// Empties `d` of what was last modified before `before` (ns since the epoch: a write
    /// another worker sharing the store has in progress stays), [`StoreDir::remove`]-ing a
    /// bounded batch of names at a time (memory does not grow with what `d` holds); stops once
    /// a read reaches the end of `d` or a batch removes nothing. Returns how many entries went.
    pub fn clear(d: &OwnedFd, before: i128) -> io::Result<u64> {
        let mut removed = 0;
        loop {
            let batch = names_upto(d, CLEAR_BATCH)?;
            let was = removed;
            for n in &batch {
                let Some(name) = n.to_str() else { continue };
                let old = Self::entry(d, name)?.is_some_and(|e| e.modified < before);
                removed += u64::from(old && Self::remove(d, n).is_ok());
            }
            if batch.len() < CLEAR_BATCH || removed == was {
                return Ok(removed);
            }
        }
    }

    /// Removes `name` in `sub`, whatever it is (a file, a link itself, a FIFO, a directory
    /// tree up to [`MAX_DEPTH`]); NotFound when absent.
    pub fn remove(sub: &OwnedFd, name: impl AsRef<OsStr>) -> io::Result<()> {
        remove_at(sub, name.as_ref(), 0, &mut MAX_ENTRIES.clone())
    }
}

/// The instant `secs` seconds ago, in nanoseconds since the epoch ([`Entry::modified`]'s).
pub(super) fn ago(secs: u64) -> i128 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    now.map_or(0, |d| d.as_nanos() as i128) - i128::from(secs) * 1_000_000_000
}

/// How many names [`StoreDir::clear`] reads at a time.
const CLEAR_BATCH: usize = 4096;

/// The names in `d` (`.` and `..` left out), an error past `max`.
fn names_within(d: &OwnedFd, max: usize) -> io::Result<Vec<OsString>> {
    let names = names_upto(d, max.saturating_add(1))?;
    if names.len() > max {
        return Err(io::Error::other(
            "a directory larger than the store removes",
        ));
    }
    Ok(names)
}

/// The first `max` names in `d` (`.` and `..` left out).
fn names_upto(d: &OwnedFd, max: usize) -> io::Result<Vec<OsString>> {
    use std::os::unix::ffi::OsStrExt;
    let mut names = Vec::new();
    for e in Dir::read_from(d)? {
        if names.len() == max {
            break;
        }
        let e = e?;
        let n = e.file_name().to_bytes();
        if n != b"." && n != b".." {
            names.push(OsStr::from_bytes(n).to_os_string());
        }
    }
    Ok(names)
}

/// Removes `name` in `parent` and, if a directory, what it holds (within `depth` and `budget`
/// entries in all).
fn remove_at(parent: &OwnedFd, name: &OsStr, depth: usize, budget: &mut usize) -> io::Result<()> {
    match rustix::fs::unlinkat(parent, name, AtFlags::empty()) {
        Ok(()) => return Ok(()),
        Err(Errno::ISDIR) => {}
        // EPERM: a directory on some systems, or a file we may not remove (sticky, immutable).
        Err(Errno::PERM) => {
            let st = rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW)?;
            if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
                return Err(Errno::PERM.into());
            }
        }
        Err(e) => return Err(e.into()),
    }
    if depth >= MAX_DEPTH {
        return Err(io::Error::other(
            "a directory tree deeper than the store removes",
        ));
    }
    let fd = rustix::fs::openat(parent, name, DIR, Mode::empty())?;
    let names = names_within(&fd, *budget)?;
    *budget -= names.len();
    for n in names {
        match remove_at(&fd, &n, depth + 1, budget) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn nothing_outside_the_store_is_touched_through_a_link() {
        let store = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let secret = outside.path().join("x.page");
        fs::write(&secret, b"keep").unwrap();
        std::os::unix::fs::symlink(outside.path(), store.path().join("ab")).unwrap();
        let s = StoreDir::open(store.path()).unwrap();
        // A linked subdirectory is absent to reads and removals.
        assert!(s.sub("ab").unwrap().is_none());
        // Made real for writing: the link goes, the target stays.
        let ab = s.sub_made("ab").unwrap();
        assert!(fs::symlink_metadata(store.path().join("ab"))
            .unwrap()
            .is_dir());
        assert_eq!(fs::read(&secret).unwrap(), b"keep");
        // A link under a page's name is removed itself, its target kept; never opened.
        std::os::unix::fs::symlink(&secret, store.path().join("ab/x.page")).unwrap();
        assert!(StoreDir::open_read(&ab, "x.page").unwrap().is_none());
        assert!(!StoreDir::entry(&ab, "x.page").unwrap().unwrap().file);
        StoreDir::remove(&ab, "x.page").unwrap();
        assert_eq!(fs::read(&secret).unwrap(), b"keep");
        // The subdirectory swapped for a link after it was opened: the handle still names the
        // store's own directory (now unlinked), so nothing outside is removed.
        fs::write(store.path().join("ab/y.page"), b"page").unwrap();
        fs::write(outside.path().join("y.page"), b"keep").unwrap();
        fs::rename(store.path().join("ab"), store.path().join("old")).unwrap();
        std::os::unix::fs::symlink(outside.path(), store.path().join("ab")).unwrap();
        StoreDir::remove(&ab, "y.page").unwrap();
        assert_eq!(fs::read(outside.path().join("y.page")).unwrap(), b"keep");
        assert!(!store.path().join("old/y.page").exists());
    }

    #[test]
    fn a_directory_tree_under_a_page_name_is_removed_within_a_depth() {
        let store = tempfile::tempdir().unwrap();
        let s = StoreDir::open(store.path()).unwrap();
        let ab = s.sub_made("ab").unwrap();
        let page = store.path().join("ab/p.page");
        fs::create_dir_all(page.join("a/b")).unwrap();
        fs::write(page.join("a/b/f"), b"x").unwrap();
        std::os::unix::fs::symlink("/", page.join("a/root")).unwrap();
        assert!(StoreDir::entry(&ab, "p.page").unwrap().unwrap().dir);
        StoreDir::remove(&ab, "p.page").unwrap();
        assert!(StoreDir::entry(&ab, "p.page").unwrap().is_none());
        let e = StoreDir::remove(&ab, "p.page").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        // Deeper than the bound: an error, the tree left.
        let mut deep = page.clone();
        for _ in 0..=MAX_DEPTH + 1 {
            deep = deep.join("d");
        }
        fs::create_dir_all(&deep).unwrap();
        assert!(StoreDir::remove(&ab, "p.page").is_err());
        assert!(page.exists());
        // Wider than the bound: the same.
        fs::remove_dir_all(&page).unwrap();
        fs::create_dir_all(page.join("w")).unwrap();
        for i in 0..=MAX_ENTRIES {
            fs::write(page.join("w").join(i.to_string()), b"").unwrap();
        }
        assert!(StoreDir::remove(&ab, "p.page").is_err());
        assert!(page.exists());
    }

    #[test]
    fn clear_empties_a_directory_larger_than_its_batch() {
        let store = tempfile::tempdir().unwrap();
        let s = StoreDir::open(store.path()).unwrap();
        let t = s.sub_made("tmp").unwrap();
        let n = CLEAR_BATCH + CLEAR_BATCH / 2;
        for i in 0..n {
            fs::write(store.path().join("tmp").join(i.to_string()), b"").unwrap();
        }
        fs::create_dir_all(store.path().join("tmp/d/e")).unwrap();
        std::os::unix::fs::symlink("/", store.path().join("tmp/root")).unwrap();
        let later = i128::MAX;
        assert_eq!(StoreDir::clear(&t, later).unwrap(), n as u64 + 2);
        assert!(StoreDir::names(&t).unwrap().is_empty());
        assert_eq!(StoreDir::clear(&t, later).unwrap(), 0);
        // A write begun after the given instant (another worker's, in progress) stays.
        fs::write(store.path().join("tmp/new.tmp"), b"").unwrap();
        assert_eq!(StoreDir::clear(&t, 0).unwrap(), 0);
        assert_eq!(StoreDir::names(&t).unwrap().len(), 1);
    }
}
