//! The stored form of a page, shared by every L3 backend: a header (magic, format version,
//! payload length, BLAKE3 of the payload, the page hash) then the payload. A value that fails
//! any check is not this page: a miss, never used.

use crate::hash::PageHash;

pub const MAGIC: &[u8; 8] = b"STRATAPG";
pub const VERSION: u32 = 1;
pub const HEADER: usize = 8 + 4 + 8 + 32 + 16;

/// The header for `data` stored under `h`.
pub fn header(h: &PageHash, data: &[u8]) -> Vec<u8> {
    let mut header = Vec::with_capacity(HEADER);
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&VERSION.to_le_bytes());
    header.extend_from_slice(&(data.len() as u64).to_le_bytes());
    header.extend_from_slice(blake3::hash(data).as_bytes());
    header.extend_from_slice(&h.0);
    header
}

/// Header + payload in one buffer.
pub fn encode(h: &PageHash, data: &[u8]) -> Vec<u8> {
    let mut v = header(h, data);
    v.extend_from_slice(data);
    v
}

/// The payload, if `bytes` is an intact page stored under `h`.
pub fn decode(h: &PageHash, bytes: &[u8]) -> Option<Vec<u8>> {
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return None;
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().ok()?);
    let len = u64::from_le_bytes(bytes[12..20].try_into().ok()?);
    if version != VERSION || len != (bytes.len() - HEADER) as u64 || bytes[52..68] != h.0 {
        return None;
    }
    let payload = &bytes[HEADER..];
    (blake3::hash(payload).as_bytes()[..] == bytes[20..52]).then(|| payload.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_every_damage_is_refused() {
        let h = PageHash([7; 16]);
        let data: Vec<u8> = (0..100u8).collect();
        let b = encode(&h, &data);
        assert_eq!(decode(&h, &b), Some(data.clone()));
        assert_eq!(decode(&PageHash([8; 16]), &b), None, "foreign hash");
        for i in [0, 9, 13, 30, 60, b.len() - 1] {
            let mut c = b.clone();
            c[i] ^= 1;
            assert_eq!(decode(&h, &c), None, "byte {i}");
        }
        assert_eq!(decode(&h, &b[..b.len() - 1]), None, "truncated");
    }
}
