//! Test support shared by this crate's unit tests, its property tests and later crates' tests:
//! a stand-in "model" whose K/V bytes for a page are a pure function of the page's identity, so
//! any page read back from any tier can be checked byte for byte.

use crate::cache::TieredCache;
use crate::hash::PageHash;
use crate::pool::DevicePool;

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
    for (i, c) in dev.layout().chunks().iter().enumerate() {
        dev.write_chunk(
            c.kind,
            c.layer,
            c.plane,
            page,
            &expected_chunk(h, i, c.bytes),
        );
    }
}

/// Panics unless every device and host page in the tree holds exactly the bytes its identity
/// implies. Call with no copies in flight.
pub fn verify_tree_bytes(cache: &TieredCache) {
    let t = cache.tree();
    let dev = cache.device_pool().expect("cache with data");
    let host = cache.host_pool().expect("cache with data");
    let l = dev.layout();
    let mut blob = vec![0; l.page_bytes()];
    for n in t.node_ids() {
        let v = t.view(n);
        for (i, h) in v.hashes.iter().enumerate() {
            for (ci, c) in l.chunks().iter().enumerate() {
                let want = expected_chunk(h, ci, c.bytes);
                if let Some(&p) = v.device.get(i) {
                    let mut got = vec![0; c.bytes];
                    dev.read_chunk(c.kind, c.layer, c.plane, p, &mut got);
                    assert_eq!(got, want, "device page {p} of node {n:?}");
                }
                if let Some(&p) = v.host.get(i) {
                    host.read_page(p, &mut blob);
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
