//! Stable chained page identity.
//!
//! `hash(page) = BLAKE3-keyed(namespace, parent_hash ‖ tokens as u32 LE)[..16]`, where the key is a
//! 32-byte namespace derived from the model id, the page size and the pool layout. BLAKE3 is a fixed
//! specification, so the value is identical across processes, machines and Rust versions; it keys
//! L3 storage and the router's cache events. 128 bits keep accidental collisions out of reach.

use std::fmt;

use crate::layout::PageLayout;

/// 128-bit identity of one page *and its whole prefix*.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PageHash(pub [u8; 16]);

impl PageHash {
    /// The parent of the first page of every sequence.
    pub const ROOT: PageHash = PageHash([0; 16]);

    /// Lower-case hex, 32 characters.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(32);
        for b in self.0 {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }

    /// Parses 32 hex characters.
    pub fn from_hex(s: &str) -> Option<PageHash> {
        if s.len() != 32 || !s.is_ascii() {
            return None;
        }
        let mut out = [0u8; 16];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(PageHash(out))
    }
}

impl fmt::Debug for PageHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PageHash({})", self.to_hex())
    }
}

impl fmt::Display for PageHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// The key every page hash of one deployment is computed under. Two deployments share cached
/// pages only when model, page size and pool layout all agree.
#[derive(Clone, PartialEq, Eq)]
pub struct HashNamespace {
    key: [u8; 32],
}

impl fmt::Debug for HashNamespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "HashNamespace({})",
            blake3::Hash::from(self.key).to_hex()
        )
    }
}

impl HashNamespace {
    /// Namespace for a model id and a pool layout (the page size is part of the layout).
    pub fn new(model_id: &str, layout: &PageLayout) -> HashNamespace {
        let mut h = blake3::Hasher::new_derive_key("strata 2026 page hash namespace v1");
        put_str(&mut h, model_id);
        layout.hash_into(&mut h);
        HashNamespace {
            key: *h.finalize().as_bytes(),
        }
    }

    /// The 32-byte key (to hand the namespace to another process, e.g. the router).
    pub fn key(&self) -> [u8; 32] {
        self.key
    }

    /// A namespace from a key obtained with [`HashNamespace::key`].
    pub fn from_key(key: [u8; 32]) -> HashNamespace {
        HashNamespace { key }
    }

    /// Hash of one page given its parent's hash.
    pub fn page_hash(&self, parent: PageHash, tokens: &[u32]) -> PageHash {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(&parent.0);
        let mut buf = [0u8; 256];
        for chunk in tokens.chunks(64) {
            for (i, t) in chunk.iter().enumerate() {
                buf[4 * i..4 * i + 4].copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..4 * chunk.len()]);
        }
        let mut out = [0u8; 16];
        out.copy_from_slice(&h.finalize().as_bytes()[..16]);
        PageHash(out)
    }

    /// Chained hashes of every whole page of `tokens`, starting under `parent`.
    pub fn chain(&self, parent: PageHash, tokens: &[u32], page_size: usize) -> Vec<PageHash> {
        let mut out = Vec::with_capacity(tokens.len() / page_size);
        self.extend_chain(parent, tokens, page_size, &mut out);
        out
    }

    /// Like [`HashNamespace::chain`], appending to `out`.
    pub fn extend_chain(
        &self,
        mut parent: PageHash,
        tokens: &[u32],
        page_size: usize,
        out: &mut Vec<PageHash>,
    ) {
        for page in tokens.chunks_exact(page_size) {
            parent = self.page_hash(parent, page);
            out.push(parent);
        }
    }
}

fn put_str(h: &mut blake3::Hasher, s: &str) {
    h.update(&(s.len() as u64).to_le_bytes());
    h.update(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{PageLayout, PoolKind};

    fn ns() -> HashNamespace {
        let layout = PageLayout::new(4, vec![PoolKind::kv("kv", 2, 1, 4, 2)]).unwrap();
        HashNamespace::new("test-model", &layout)
    }

    /// Fixed vectors, also reproduced by an independent Python `blake3` implementation of the
    /// documented scheme. If these change, every stored L3 page and every router index breaks.
    #[test]
    fn fixed_test_vectors() {
        let ns = ns();
        let h1 = ns.page_hash(PageHash::ROOT, &[1, 2, 3, 4]);
        let h2 = ns.page_hash(h1, &[5, 6, 7, 8]);
        assert_eq!(h1.to_hex(), "8d75425af6ed3387f5f5b170eb34fe0b");
        assert_eq!(h2.to_hex(), "29bbadc61476884ab1e4e3de5c94b6bb");
        assert_eq!(
            ns.chain(PageHash::ROOT, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 4),
            vec![h1, h2]
        );
    }

    #[test]
    fn namespace_separates_layouts_and_models() {
        let a = ns();
        let l2 = PageLayout::new(4, vec![PoolKind::kv("kv", 2, 1, 4, 4)]).unwrap();
        let b = HashNamespace::new("test-model", &l2);
        let c = HashNamespace::new(
            "other",
            &PageLayout::new(4, vec![PoolKind::kv("kv", 2, 1, 4, 2)]).unwrap(),
        );
        let t = [1, 2, 3, 4];
        assert_ne!(
            a.page_hash(PageHash::ROOT, &t),
            b.page_hash(PageHash::ROOT, &t)
        );
        assert_ne!(
            a.page_hash(PageHash::ROOT, &t),
            c.page_hash(PageHash::ROOT, &t)
        );
    }

    #[test]
    fn a_stored_dtype_is_its_own_namespace_even_at_equal_sizes() {
        use crate::dtype::Dtype;
        let of = |d| PageLayout::new(4, vec![PoolKind::kv_of("kv", 2, 1, 32, d).unwrap()]);
        let (f16, bf16, q8) = (
            of(Dtype::F16).unwrap(),
            of(Dtype::Bf16).unwrap(),
            of(Dtype::Q8_0).unwrap(),
        );
        assert_eq!(f16.page_bytes(), bf16.page_bytes());
        let t = [1, 2, 3, 4];
        let h = |l: &PageLayout| HashNamespace::new("m", l).page_hash(PageHash::ROOT, &t);
        assert_ne!(h(&f16), h(&bf16));
        assert_ne!(h(&f16), h(&q8));
        assert_ne!(f16.tag(), bf16.tag());
        // A kind of no stated dtype hashes as kinds did before dtypes were stated (the llama
        // family's kinds state theirs, f16 included, so their hashes changed with them).
        let plain = PageLayout::new(4, vec![PoolKind::kv("kv", 2, 1, 32, 2)]).unwrap();
        assert_ne!(h(&plain), h(&f16));
        assert_eq!(
            plain.kinds()[0].bytes_per_token(),
            f16.kinds()[0].bytes_per_token()
        );
    }

    #[test]
    fn chaining_depends_on_parent_and_hex_roundtrips() {
        let ns = ns();
        let x = ns.page_hash(PageHash::ROOT, &[9, 9, 9, 9]);
        let y = ns.page_hash(x, &[9, 9, 9, 9]);
        assert_ne!(x, y);
        assert_eq!(PageHash::from_hex(&y.to_hex()), Some(y));
        assert_eq!(PageHash::from_hex("zz"), None);
    }
}
