//! What makes a directory a disk store: a marker file. A directory without it is the store's
//! only if it is empty or holds nothing but a store's own names; anything else (`--l3 disk:/`,
//! a home directory named by mistake) is refused before the store removes anything in it
//! (its `tmp/` is emptied at open).

use std::io::Write;
use std::path::Path;

use super::at::StoreDir;
use super::{io, StorageError};

/// The file that makes a directory a store: nothing in a directory without it is touched.
pub(super) const MARKER: &str = "STRATA-L3";
const MARKER_TEXT: &[u8] =
    b"A Strata disk L3 store: K/V pages under 00/ to ff/, writes in progress in tmp/.\n";

/// Takes `root` (at `dir`) as a store: one with the marker; else an empty directory, or one
/// holding only a store's own names (a store made before the marker), which gets the marker.
/// Anything else (`--l3 disk:/`, a home directory by mistake) is refused before anything in
/// it is removed.
pub(super) fn claim(root: &StoreDir, dir: &Path) -> Result<(), StorageError> {
    let marked = StoreDir::entry(root.fd(), MARKER).map_err(|e| io(dir, e))?;
    if marked.is_some_and(|e| e.file) {
        return Ok(());
    }
    // The store's names; the marker itself (another worker sharing the directory may make
    // it meanwhile); a filesystem root's `lost+found` (a store on a volume of its own).
    let own = |n: &str| {
        matches!(n, "tmp" | MARKER | "lost+found")
            || (n.len() == 2 && n.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
    };
    let names = StoreDir::first_names(root.fd(), 512).map_err(|e| io(dir, e))?;
    if let Some(other) = names.iter().find(|n| !n.to_str().is_some_and(own)) {
        let msg = format!(
            "not a Strata disk store: it holds `{}` and no {MARKER} file, so nothing in it is touched (name an empty or new directory)",
            other.to_string_lossy()
        );
        return Err(io(dir, std::io::Error::other(msg)));
    }
    match StoreDir::create(root.fd(), MARKER) {
        Ok(mut f) => f.write_all(MARKER_TEXT).map_err(|e| io(dir, e)),
        // Another worker sharing the directory made it first.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io(dir, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn only_a_store_or_an_empty_directory_is_taken() {
        let d = tempfile::tempdir().unwrap();
        // Someone's directory: refused, its tmp/ left whole.
        fs::create_dir_all(d.path().join("home/tmp")).unwrap();
        fs::write(d.path().join("home/tmp/precious.txt"), b"keep").unwrap();
        fs::write(d.path().join("home/notes.txt"), b"keep").unwrap();
        let home = d.path().join("home");
        let e = super::super::DiskStorage::open(&home, 1 << 20, false)
            .err()
            .unwrap();
        assert!(
            e.to_string()
                .contains("not a Strata disk store: it holds `"),
            "{e}"
        );
        assert_eq!(fs::read(home.join("tmp/precious.txt")).unwrap(), b"keep");
        // An empty directory, and a store from before the marker (its own names only).
        let volume = &["ab", "lost+found"][..];
        for (name, made) in [
            ("empty", &[][..]),
            ("old", &["ab", "tmp", "00"][..]),
            ("volume", volume),
        ] {
            let p = d.path().join(name);
            fs::create_dir(&p).unwrap();
            for m in made {
                fs::create_dir(p.join(m)).unwrap();
            }
            let root = StoreDir::open(&p).unwrap();
            claim(&root, &p).unwrap();
            assert_eq!(fs::read(p.join(MARKER)).unwrap(), MARKER_TEXT);
            // Marked: taken again whatever else is added.
            fs::write(p.join("other"), b"x").unwrap();
            claim(&root, &p).unwrap();
        }
    }
}
