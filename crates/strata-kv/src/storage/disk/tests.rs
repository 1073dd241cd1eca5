//! The disk store against a real directory: round trips, damage, links, caps, a store removed.

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

#[test]
fn a_store_removed_while_running_is_made_again_with_an_empty_index() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("l3");
    let s = DiskStorage::open(&dir, 1 << 20, false).unwrap();
    s.put(&h(1), b"first page").unwrap();
    assert_eq!(s.stats().entries, 1);
    fs::remove_dir_all(&dir).unwrap();
    // The next write makes the store again; what it listed went with the directory.
    s.put(&h(2), b"second page").unwrap();
    assert!(dir.join(super::super::marker::MARKER).is_file());
    let st = s.stats();
    assert_eq!((st.entries, st.bytes), (1, (HEADER + 11) as u64), "{st:?}");
    assert_eq!(s.exists(&[h(1), h(2)]).unwrap(), vec![false, true]);
    assert_eq!(s.get(&h(2)).unwrap().as_deref(), Some(&b"second page"[..]));
    assert_eq!(s.get(&h(1)).unwrap(), None);
    // A reopened store finds the page written after.
    drop(s);
    let s = DiskStorage::open(&dir, 1 << 20, false).unwrap();
    assert_eq!(s.exists(&[h(1), h(2)]).unwrap(), vec![false, true]);
}

#[test]
fn a_link_planted_where_the_store_was_is_not_taken() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("l3");
    let elsewhere = d.path().join("elsewhere");
    fs::create_dir(&elsewhere).unwrap();
    let s = DiskStorage::open(&dir, 1 << 20, false).unwrap();
    s.put(&h(1), b"first page").unwrap();
    fs::remove_dir_all(&dir).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &dir).unwrap();
    assert!(s.put(&h(2), b"second page").is_err());
    assert!(
        fs::read_dir(&elsewhere).unwrap().next().is_none(),
        "written through a link"
    );
    // Once the link is gone, the next write makes the store again.
    fs::remove_file(&dir).unwrap();
    s.put(&h(3), b"third page").unwrap();
    assert_eq!(s.exists(&[h(1), h(3)]).unwrap(), vec![false, true]);
}
