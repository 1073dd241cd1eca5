//! Test support shared by this crate's unit tests, its property tests and later crates' tests:
//! a stand-in "model" whose K/V bytes for a page are a pure function of the page's identity, so
//! any page read back from any tier can be checked byte for byte.

use crate::cache::{Lease, TieredCache};
use crate::hash::PageHash;
use crate::layout::Class;
use crate::pool::{blob_len, DevicePool};
use crate::tree::NO_PAGE;

/// The bytes chunk `chunk` (host-order index) of the page with hash `h` must hold.
pub fn expected_chunk(h: &PageHash, chunk: usize, len: usize) -> Vec<u8> {
    let mut x = blake3::Hasher::new();
    x.update(&h.0);
    x.update(&(chunk as u64).to_le_bytes());
    let mut out = vec![0; len];
    x.finalize_xof().fill(&mut out);
    out
}

/// Writes the expected bytes of page identity `h` into device page `page` (what a model's
/// forward pass would do).
pub fn write_expected_page(dev: &DevicePool, page: u32, h: &PageHash) {
    write_expected_page_with_window(dev, page, None, h)
}

/// [`write_expected_page`] with the window chunks into window page `window` (none without).
pub fn write_expected_page_with_window(
    dev: &DevicePool,
    page: u32,
    window: Option<u32>,
    h: &PageHash,
) {
    for (i, c) in dev.layout().chunks().iter().enumerate() {
        let p = match c.class {
            Class::Main => page,
            Class::Window => match window {
                Some(w) => w,
                None => continue,
            },
        };
        dev.write_chunk(c.kind, c.layer, c.plane, p, &expected_chunk(h, i, c.bytes));
    }
}

/// Computes positions `from..end` of a ready lease (`from` at least its start, where the
/// previous call stopped) as the scheduler does: in chunks of
/// at most `chunk` tokens, each after [`TieredCache::secure_windows`] (which may grant less).
/// Before each chunk it checks that the window state the chunk reads (the whole pages of
/// `[pos − w, pos)`) holds the bytes written for it; then it writes the expected bytes of the
/// whole pages of `tokens` the chunk touches. Returns the chunks' sizes.
pub fn compute_in_chunks(
    cache: &mut TieredCache,
    lease: &mut Lease,
    tokens: &[u32],
    (from, end): (usize, usize),
    chunk: usize,
) -> Vec<usize> {
    assert!(
        from >= lease.start(),
        "positions before the start are the prefix's"
    );
    let ps = cache.page_size();
    let hashes = cache.page_hashes(&tokens[..end.min(tokens.len())]);
    let dev = cache.device_pool_shared().expect("cache with data");
    let layout = dev.layout().clone();
    let mut pos = from;
    let mut sizes = Vec::new();
    while pos < end {
        let upto = cache.secure_windows(lease, pos, (pos + chunk.max(1)).min(end));
        assert!(
            upto > pos,
            "a ready lease may always compute one more token"
        );
        if layout.has_window() {
            let first = pos.saturating_sub(layout.window_tokens()) / ps;
            let read = first..(pos / ps).min(hashes.len());
            for (j, h) in hashes.iter().enumerate().take(read.end).skip(read.start) {
                let w = lease.windows()[j];
                assert_ne!(w, NO_PAGE, "page {j} is read from {pos} on");
                for (ci, c) in layout.chunks().iter().enumerate() {
                    if c.class == Class::Window {
                        let mut got = vec![0; c.bytes];
                        dev.read_chunk(c.kind, c.layer, c.plane, w, &mut got);
                        assert_eq!(got, expected_chunk(h, ci, c.bytes), "page {j}");
                    }
                }
            }
        }
        let written = pos / ps..upto.div_ceil(ps);
        for (j, h) in hashes
            .iter()
            .enumerate()
            .take(written.end)
            .skip(written.start)
        {
            let w = lease.windows().get(j).copied();
            assert_ne!(w, Some(NO_PAGE), "page {j} is written from {pos}");
            write_expected_page_with_window(&dev, lease.pages()[j], w, h);
        }
        sizes.push(upto - pos);
        pos = upto;
    }
    sizes
}

/// Panics unless every device and host page in the tree holds exactly the bytes its identity
/// implies. Call with no copies in flight.
pub fn verify_tree_bytes(cache: &TieredCache) {
    let t = cache.tree();
    let dev = cache.device_pool().expect("cache with data");
    let host = cache.host_pool().expect("cache with data");
    let l = dev.layout();
    let mut blob = vec![0; l.page_bytes()];
    let real = |v: &[u32], i: usize| v.get(i).copied().filter(|&w| w != NO_PAGE);
    for n in t.node_ids() {
        let v = t.view(n);
        for (i, h) in v.hashes.iter().enumerate() {
            let (dw, hw) = (real(v.device_win, i), real(v.host_win, i));
            for (ci, c) in l.chunks().iter().enumerate() {
                let want = expected_chunk(h, ci, c.bytes);
                let window = c.class == Class::Window;
                let dev_page = if window { dw } else { v.device.try_get(i) };
                if let Some(p) = dev_page {
                    let mut got = vec![0; c.bytes];
                    dev.read_chunk(c.kind, c.layer, c.plane, p, &mut got);
                    assert_eq!(got, want, "device page {p} of node {n:?}");
                }
                if window && hw.is_none() {
                    continue;
                }
                if let Some(p) = v.host.try_get(i) {
                    let blob = &mut blob[..blob_len(l, hw)];
                    host.read_page(p, hw, blob);
                    assert_eq!(
                        &blob[c.host_offset..c.host_offset + c.bytes],
                        &want[..],
                        "host page {p} of node {n:?}"
                    );
                }
            }
        }
    }
}
