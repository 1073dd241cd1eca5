//! The stored form of a page, shared by every L3 backend: a header (magic, format version,
//! payload length, a keyed BLAKE3 MAC, the page hash, the layout tag) then the payload. A value
//! that fails any check is not this page: a miss, never used.
//!
//! The MAC is keyed ([`BlobKey`]): with a cluster key, only a holder of the key can make a value
//! that passes, so a page forged, or copied under another page's key with its hash field
//! rewritten, is a miss. Without one, the key is public and the MAC only catches damage.
//!
//! The layout tag ([`crate::PageLayout::tag`]: page size, pool kinds, their dtypes) says what
//! the payload's bytes mean: an intact page written for another layout (a quantized K/V dtype
//! where we store f16, say) is refused as [`Refused::OtherLayout`], never read as ours.

use crate::hash::PageHash;

pub const MAGIC: &[u8; 8] = b"STRATAPG";
pub const VERSION: u32 = 3;
pub const HEADER: usize = 8 + 4 + 8 + 32 + 16 + 16;

/// The key of the page MACs and the layout every page is written for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct BlobKey {
    mac: [u8; 32],
    layout: [u8; 16],
}

impl std::fmt::Debug for BlobKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BlobKey(…)")
    }
}

/// Why a stored value is not the page asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// Not a page, damaged, truncated, under another hash, or not made with our key.
    Damaged,
    /// An intact page written for another page layout (page size, kinds or K/V dtype).
    OtherLayout,
}

impl BlobKey {
    /// Without a cluster key: a fixed, public key (integrity against damage only), for pages
    /// of no stated layout (the tag is zero until [`BlobKey::for_layout`]).
    pub fn public() -> BlobKey {
        BlobKey {
            mac: blake3::derive_key("strata l3 page v2 public", b""),
            layout: [0; 16],
        }
    }

    /// From the deployment's cluster key: pages only its holders can make.
    pub fn from_cluster(k: &crate::auth::ClusterKey) -> BlobKey {
        BlobKey {
            mac: k.derive("strata l3 page v2"),
            layout: [0; 16],
        }
    }

    /// The same key, writing and expecting pages of `layout`.
    pub fn for_layout(self, layout: &crate::PageLayout) -> BlobKey {
        BlobKey {
            layout: layout.tag(),
            ..self
        }
    }

    /// A public name of the key and layout (it tells nothing of the key): a store's values of
    /// one key and layout can be kept apart from others' (Redis key prefixes).
    pub fn id(&self) -> [u8; 32] {
        let mut h = blake3::Hasher::new_derive_key("strata l3 page key id v3");
        h.update(&self.mac);
        h.update(&self.layout);
        *h.finalize().as_bytes()
    }

    fn mac(&self, h: &PageHash, layout: &[u8], data: &[u8]) -> [u8; 32] {
        let mut m = blake3::Hasher::new_keyed(&self.mac);
        m.update(&VERSION.to_le_bytes());
        m.update(&h.0);
        m.update(layout);
        m.update(&(data.len() as u64).to_le_bytes());
        m.update(data);
        *m.finalize().as_bytes()
    }
}

impl Default for BlobKey {
    fn default() -> Self {
        BlobKey::public()
    }
}

/// The header for `data` stored under `h`.
pub fn header(key: &BlobKey, h: &PageHash, data: &[u8]) -> Vec<u8> {
    let mut header = Vec::with_capacity(HEADER);
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&VERSION.to_le_bytes());
    header.extend_from_slice(&(data.len() as u64).to_le_bytes());
    header.extend_from_slice(&key.mac(h, &key.layout, data));
    header.extend_from_slice(&h.0);
    header.extend_from_slice(&key.layout);
    header
}

/// Header + payload in one buffer.
pub fn encode(key: &BlobKey, h: &PageHash, data: &[u8]) -> Vec<u8> {
    let mut v = header(key, h, data);
    v.extend_from_slice(data);
    v
}

/// The payload, if `bytes` is an intact page stored under `h` by a holder of `key` for the
/// key's layout.
pub fn decode(key: &BlobKey, h: &PageHash, bytes: &[u8]) -> Result<Vec<u8>, Refused> {
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return Err(Refused::Damaged);
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    let len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
    if version != VERSION || len != (bytes.len() - HEADER) as u64 || bytes[52..68] != h.0 {
        return Err(Refused::Damaged);
    }
    let (layout, payload) = (&bytes[68..84], &bytes[HEADER..]);
    if !constant_time_eq::constant_time_eq(&key.mac(h, layout, payload), &bytes[20..52]) {
        return Err(Refused::Damaged);
    }
    if layout != key.layout {
        return Err(Refused::OtherLayout);
    }
    Ok(payload.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_every_damage_is_refused() {
        let k = BlobKey::public();
        let h = PageHash([7; 16]);
        let data: Vec<u8> = (0..100u8).collect();
        let b = encode(&k, &h, &data);
        assert_eq!(decode(&k, &h, &b), Ok(data.clone()));
        assert_eq!(
            decode(&k, &PageHash([8; 16]), &b),
            Err(Refused::Damaged),
            "foreign hash"
        );
        for i in [0, 9, 13, 30, 60, 70, b.len() - 1] {
            let mut c = b.clone();
            c[i] ^= 1;
            assert_eq!(decode(&k, &h, &c), Err(Refused::Damaged), "byte {i}");
        }
        assert_eq!(
            decode(&k, &h, &b[..b.len() - 1]),
            Err(Refused::Damaged),
            "truncated"
        );
    }

    #[test]
    fn a_transplanted_or_forged_page_is_refused_under_a_cluster_key() {
        let ck = crate::auth::ClusterKey::from_secret(&[9; 32]).unwrap();
        let k = BlobKey::from_cluster(&ck);
        let (a, b) = (PageHash([1; 16]), PageHash([2; 16]));
        let v = encode(&k, &a, b"page a");
        // Copied under b's key with the hash field rewritten.
        let mut moved = v.clone();
        moved[52..68].copy_from_slice(&b.0);
        assert_eq!(decode(&k, &b, &moved), Err(Refused::Damaged));
        // Made by someone without the key (the public one, or another cluster's).
        assert_eq!(
            decode(&k, &a, &encode(&BlobKey::public(), &a, b"page a")),
            Err(Refused::Damaged)
        );
        assert_eq!(decode(&k, &a, &v).as_deref(), Ok(&b"page a"[..]));
    }

    #[test]
    fn a_page_of_another_layout_is_told_apart_and_refused() {
        use crate::dtype::Dtype;
        use crate::{PageLayout, PoolKind};
        let of = |d| PageLayout::new(4, vec![PoolKind::kv_of("kv", 2, 1, 32, d).unwrap()]);
        let (f16, q8) = (of(Dtype::F16).unwrap(), of(Dtype::Q8_0).unwrap());
        assert_ne!(f16.tag(), q8.tag());
        let ck = crate::auth::ClusterKey::from_secret(&[9; 32]).unwrap();
        let h = PageHash([3; 16]);
        let (kf, kq) = (
            BlobKey::from_cluster(&ck).for_layout(&f16),
            BlobKey::from_cluster(&ck).for_layout(&q8),
        );
        let v = encode(&kq, &h, b"q8_0 page");
        assert_eq!(decode(&kq, &h, &v).as_deref(), Ok(&b"q8_0 page"[..]));
        assert_eq!(decode(&kf, &h, &v), Err(Refused::OtherLayout));
        // The tag is under the MAC: rewriting it to ours makes the page damaged, not ours.
        let mut forged = v.clone();
        forged[68..84].copy_from_slice(&f16.tag());
        assert_eq!(decode(&kf, &h, &forged), Err(Refused::Damaged));
    }
}
