//! The stored form of a page, shared by every L3 backend: a header (magic, format version,
//! payload length, a keyed BLAKE3 MAC of the page hash and the payload, the page hash) then the
//! payload. A value that fails any check is not this page: a miss, never used.
//!
//! The MAC is keyed ([`BlobKey`]): with a cluster key, only a holder of the key can make a value
//! that passes, so a page forged, or copied under another page's key with its hash field
//! rewritten, is a miss. Without one, the key is public and the MAC only catches damage.

use crate::hash::PageHash;

pub const MAGIC: &[u8; 8] = b"STRATAPG";
pub const VERSION: u32 = 2;
pub const HEADER: usize = 8 + 4 + 8 + 32 + 16;

/// The key of the page MACs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct BlobKey(pub [u8; 32]);

impl std::fmt::Debug for BlobKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BlobKey(…)")
    }
}

impl BlobKey {
    /// Without a cluster key: a fixed, public key (integrity against damage only).
    pub fn public() -> BlobKey {
        BlobKey(blake3::derive_key("strata l3 page v2 public", b""))
    }

    /// From the deployment's cluster key: pages only its holders can make.
    pub fn from_cluster(k: &crate::auth::ClusterKey) -> BlobKey {
        BlobKey(k.derive("strata l3 page v2"))
    }

    fn mac(&self, h: &PageHash, data: &[u8]) -> [u8; 32] {
        let mut m = blake3::Hasher::new_keyed(&self.0);
        m.update(&VERSION.to_le_bytes());
        m.update(&h.0);
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
    header.extend_from_slice(&key.mac(h, data));
    header.extend_from_slice(&h.0);
    header
}

/// Header + payload in one buffer.
pub fn encode(key: &BlobKey, h: &PageHash, data: &[u8]) -> Vec<u8> {
    let mut v = header(key, h, data);
    v.extend_from_slice(data);
    v
}

/// The payload, if `bytes` is an intact page stored under `h` by a holder of `key`.
pub fn decode(key: &BlobKey, h: &PageHash, bytes: &[u8]) -> Option<Vec<u8>> {
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return None;
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().ok()?);
    let len = u64::from_le_bytes(bytes[12..20].try_into().ok()?);
    if version != VERSION || len != (bytes.len() - HEADER) as u64 || bytes[52..68] != h.0 {
        return None;
    }
    let payload = &bytes[HEADER..];
    constant_time_eq::constant_time_eq(&key.mac(h, payload), &bytes[20..52])
        .then(|| payload.to_vec())
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
        assert_eq!(decode(&k, &h, &b), Some(data.clone()));
        assert_eq!(decode(&k, &PageHash([8; 16]), &b), None, "foreign hash");
        for i in [0, 9, 13, 30, 60, b.len() - 1] {
            let mut c = b.clone();
            c[i] ^= 1;
            assert_eq!(decode(&k, &h, &c), None, "byte {i}");
        }
        assert_eq!(decode(&k, &h, &b[..b.len() - 1]), None, "truncated");
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
        assert_eq!(decode(&k, &b, &moved), None);
        // Made by someone without the key (the public one, or another cluster's).
        assert_eq!(
            decode(&k, &a, &encode(&BlobKey::public(), &a, b"page a")),
            None
        );
        assert_eq!(decode(&k, &a, &v).as_deref(), Some(&b"page a"[..]));
    }
}
