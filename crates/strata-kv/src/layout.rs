//! What one page holds: the pool kinds a model declares and their byte layout per tier.
//!
//! A *pool kind* is one kind of per-token state (the main KV, a sparse-attention indexer's keys,
//! ...). Each has `layers × planes` chunks per page (planes: K and V for attention KV, one for an
//! indexer), each chunk `page_size × plane_bytes_per_token` bytes.
//!
//! * Device (L1) layout is layer-first: for every kind, layer and plane, one contiguous run of
//!   chunks for all pages, which is what attention kernels want.
//! * Host (L2) layout is page-first: one page is one contiguous blob holding every chunk of every
//!   kind, so it moves to disk or network in one piece.
//!
//! Kinds come in two classes. *Main* kinds are needed for the whole prefix (attention K/V,
//! compressed blocks). *Window* kinds ([`PoolKind::window`]) are read only for the last few
//! tokens before a continuation starts (a sliding window's raw K/V, a compressor's open block):
//! they live in their own page space per tier, so a page may keep its main state and drop its
//! window state. In a blob the main chunks come first, then the window chunks.

use thiserror::Error;

use crate::dtype::Dtype;

/// A layout that cannot be built.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error("page size must be at least 1 token, got 0")]
    ZeroPageSize,
    #[error("a model must declare at least one pool kind")]
    NoPools,
    #[error("pool kind `{0}`: layers, planes and bytes per token must all be non-zero")]
    EmptyPool(String),
    #[error("pool kind name `{0}` appears twice")]
    DuplicateName(String),
    #[error("page of {0} tokens overflows the address space")]
    Overflow(usize),
    #[error("pool kind `{0}`: a window must be at least one token")]
    ZeroWindow(String),
    #[error("every pool kind has a window: a page needs at least one main kind")]
    NoMainKind,
}

/// One kind of per-token state, per rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolKind {
    pub name: String,
    pub layers: usize,
    /// Planes per layer: 2 (K and V) for attention KV, 1 for a single-tensor state.
    pub planes: usize,
    pub plane_bytes_per_token: usize,
    /// `Some(w)`: a continuation at position `P` reads this kind only for positions in
    /// `[P − w, P)` (a window kind); `None`: for the whole prefix (a main kind).
    pub window: Option<usize>,
    /// `Some(d)`: every value is stored as `d`, a choice of the deployment (K/V as
    /// `--kv-cache-dtype`), part of the kind's identity: page hashes, L3 page headers and
    /// KV-transfer handshakes differ between dtypes, so a page of another dtype is a miss or a
    /// refusal, never misread. `None`: bytes whose type the model alone defines.
    pub dtype: Option<Dtype>,
}

/// A pool kind's class: which page space of a tier holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Class {
    Main,
    Window,
}

impl PoolKind {
    /// Attention KV: K and V planes of `kv_heads × head_dim × dtype_bytes` per token per layer.
    pub fn kv(
        name: &str,
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype_bytes: usize,
    ) -> Self {
        PoolKind {
            name: name.to_string(),
            layers,
            planes: 2,
            plane_bytes_per_token: kv_heads * head_dim * dtype_bytes,
            window: None,
            dtype: None,
        }
    }

    /// Attention KV stored as `dtype`: K and V planes of `kv_heads × head_dim` values per
    /// token per layer; None when a head does not hold whole blocks of the dtype or the size
    /// overflows.
    pub fn kv_of(
        name: &str,
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: Dtype,
    ) -> Option<Self> {
        if !head_dim.is_multiple_of(dtype.block()) {
            return None;
        }
        Some(PoolKind {
            name: name.to_string(),
            layers,
            planes: 2,
            plane_bytes_per_token: dtype.bytes_of(kv_heads.checked_mul(head_dim)?)?,
            window: None,
            dtype: Some(dtype),
        })
    }

    /// A one-plane auxiliary state (e.g. a sparse-attention indexer) of `bytes` per token per layer.
    pub fn aux(name: &str, layers: usize, bytes: usize) -> Self {
        PoolKind {
            name: name.to_string(),
            layers,
            planes: 1,
            plane_bytes_per_token: bytes,
            window: None,
            dtype: None,
        }
    }

    /// This kind, read only for the last `tokens` positions before a continuation.
    pub fn with_window(mut self, tokens: usize) -> Self {
        self.window = Some(tokens);
        self
    }

    pub fn class(&self) -> Class {
        if self.window.is_some() {
            Class::Window
        } else {
            Class::Main
        }
    }

    /// Bytes this kind stores per token, per rank.
    pub fn bytes_per_token(&self) -> usize {
        self.layers * self.planes * self.plane_bytes_per_token
    }
}

/// One contiguous piece of a page: (kind, layer, plane), `bytes` long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub kind: usize,
    pub layer: usize,
    pub plane: usize,
    pub class: Class,
    /// Offset of this chunk inside a host page blob (main chunks, then window chunks).
    pub host_offset: usize,
    pub bytes: usize,
}

/// Page size plus pool kinds, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageLayout {
    page_size: usize,
    kinds: Vec<PoolKind>,
    chunks: Vec<Chunk>,
    page_bytes: usize,
    main_bytes: usize,
    window: usize,
}

impl PageLayout {
    pub fn new(page_size: usize, kinds: Vec<PoolKind>) -> Result<PageLayout, LayoutError> {
        if page_size == 0 {
            return Err(LayoutError::ZeroPageSize);
        }
        if kinds.is_empty() {
            return Err(LayoutError::NoPools);
        }
        for (ki, k) in kinds.iter().enumerate() {
            if k.layers == 0 || k.planes == 0 || k.plane_bytes_per_token == 0 {
                return Err(LayoutError::EmptyPool(k.name.clone()));
            }
            if kinds[..ki].iter().any(|o| o.name == k.name) {
                return Err(LayoutError::DuplicateName(k.name.clone()));
            }
            if k.window == Some(0) {
                return Err(LayoutError::ZeroWindow(k.name.clone()));
            }
        }
        if kinds.iter().all(|k| k.window.is_some()) {
            return Err(LayoutError::NoMainKind);
        }
        let mut chunks = Vec::new();
        let mut off = 0usize;
        let mut main_bytes = 0;
        for class in [Class::Main, Class::Window] {
            for (ki, k) in kinds.iter().enumerate().filter(|(_, k)| k.class() == class) {
                let bytes = page_size
                    .checked_mul(k.plane_bytes_per_token)
                    .ok_or(LayoutError::Overflow(page_size))?;
                for layer in 0..k.layers {
                    for plane in 0..k.planes {
                        chunks.push(Chunk {
                            kind: ki,
                            layer,
                            plane,
                            class,
                            host_offset: off,
                            bytes,
                        });
                        off = off
                            .checked_add(bytes)
                            .ok_or(LayoutError::Overflow(page_size))?;
                    }
                }
            }
            if class == Class::Main {
                main_bytes = off;
            }
        }
        let window = kinds.iter().filter_map(|k| k.window).max().unwrap_or(0);
        Ok(PageLayout {
            page_size,
            kinds,
            chunks,
            page_bytes: off,
            main_bytes,
            window,
        })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn kinds(&self) -> &[PoolKind] {
        &self.kinds
    }

    /// 16 bytes naming this layout (page size, kinds, their dtypes), without the model: what
    /// every L3 page header carries, so a page written for another layout is told apart from
    /// ours. Its version also names how the K/V were computed: v2 since every prompt row takes
    /// the attention tile and answers are cached as prompt rows (stop 73), so a disk L3 kept
    /// from an earlier build, whose pages hold other bits for the same tokens, is refused as
    /// another layout rather than read.
    pub fn tag(&self) -> [u8; 16] {
        let mut h = blake3::Hasher::new_derive_key("strata 2026 page layout v2");
        self.hash_into(&mut h);
        let mut out = [0u8; 16];
        out.copy_from_slice(&h.finalize().as_bytes()[..16]);
        out
    }

    /// The page size and every kind (name, shape, window, stored dtype) into `h`: what makes
    /// two layouts' pages interchangeable (the page-hash namespace and the tag hash this).
    pub(crate) fn hash_into(&self, h: &mut blake3::Hasher) {
        let put_str = |h: &mut blake3::Hasher, s: &str| {
            h.update(&(s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        };
        h.update(&(self.page_size as u64).to_le_bytes());
        h.update(&(self.kinds.len() as u64).to_le_bytes());
        for k in &self.kinds {
            put_str(h, &k.name);
            for v in [k.layers, k.planes, k.plane_bytes_per_token] {
                h.update(&(v as u64).to_le_bytes());
            }
            // A window kind changes the blob's order (main chunks first): its own namespace.
            // Main kinds add nothing, so the hashes of layouts without windows are unchanged.
            if let Some(w) = k.window {
                h.update(b"window");
                h.update(&(w as u64).to_le_bytes());
            }
            // A stored dtype (quantized K/V) is what the bytes mean: pages of another dtype
            // never share a hash, even where the sizes agree (f16 and bf16).
            if let Some(d) = k.dtype {
                h.update(b"dtype");
                put_str(h, d.name());
            }
        }
    }

    /// Every chunk of one page, in host (page-first) order.
    pub fn chunks(&self) -> &[Chunk] {
        &self.chunks
    }

    /// Bytes of one page over all kinds: the host blob size.
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Bytes per token over all kinds.
    pub fn bytes_per_token(&self) -> usize {
        self.page_bytes / self.page_size
    }

    /// Bytes of one page's chunks of `class` (a blob is the main part, then the window part).
    pub fn class_bytes(&self, class: Class) -> usize {
        match class {
            Class::Main => self.main_bytes,
            Class::Window => self.page_bytes - self.main_bytes,
        }
    }

    /// Window pages for a pool of `pages` pages when every page keeps its window state: as
    /// many, or none without window kinds.
    pub fn window_pages_for(&self, pages: u32) -> u32 {
        if self.has_window() {
            pages
        } else {
            0
        }
    }

    /// Whether some kind is a window kind.
    pub fn has_window(&self) -> bool {
        self.main_bytes < self.page_bytes
    }

    /// Tokens before a continuation whose window state it reads: the largest window of any
    /// kind (0 without window kinds).
    pub fn window_tokens(&self) -> usize {
        self.window
    }

    /// The class of kind `kind`.
    pub fn class_of(&self, kind: usize) -> Class {
        self.kinds[kind].class()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_layout_sizes() {
        // SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, f16 → 23,040 bytes per token.
        let l = PageLayout::new(16, vec![PoolKind::kv("kv", 30, 3, 64, 2)]).unwrap();
        assert_eq!(l.bytes_per_token(), 23_040);
        assert_eq!(l.page_bytes(), 16 * 23_040);
        assert_eq!(l.chunks().len(), 60);
        assert_eq!(l.chunks()[1].host_offset, 16 * 384);
    }

    #[test]
    fn aux_pool_is_part_of_every_page() {
        let l = PageLayout::new(
            2,
            vec![
                PoolKind::kv("kv", 2, 1, 4, 2),
                PoolKind::aux("indexer", 2, 3),
            ],
        )
        .unwrap();
        assert_eq!(l.bytes_per_token(), 2 * 2 * 8 + 2 * 3);
        let last = l.chunks().last().unwrap();
        assert_eq!((last.kind, last.layer, last.plane), (1, 1, 0));
        assert_eq!(last.host_offset + last.bytes, l.page_bytes());
    }

    #[test]
    fn window_kinds_follow_the_main_part_of_a_blob() {
        let l = PageLayout::new(
            2,
            vec![
                PoolKind::aux("raw", 2, 5).with_window(8),
                PoolKind::aux("blocks", 1, 3),
                PoolKind::aux("rows", 1, 7).with_window(128),
            ],
        )
        .unwrap();
        assert_eq!(l.class_bytes(Class::Main), 2 * 3);
        assert_eq!(l.class_bytes(Class::Window), 2 * (2 * 5 + 7));
        assert_eq!(l.window_tokens(), 128);
        assert!(l.has_window());
        let c = l.chunks();
        assert_eq!(
            (c[0].kind, c[0].class, c[0].host_offset),
            (1, Class::Main, 0)
        );
        assert_eq!(
            (c[1].kind, c[1].class, c[1].host_offset),
            (0, Class::Window, 6)
        );
        assert_eq!(c.last().unwrap().host_offset + 14, l.page_bytes());
        assert!(matches!(
            PageLayout::new(1, vec![PoolKind::aux("a", 1, 1).with_window(0)]),
            Err(LayoutError::ZeroWindow(_))
        ));
        assert_eq!(
            PageLayout::new(1, vec![PoolKind::aux("a", 1, 1).with_window(4)]),
            Err(LayoutError::NoMainKind)
        );
        let plain = PageLayout::new(4, vec![PoolKind::kv("kv", 2, 1, 4, 2)]).unwrap();
        assert!(!plain.has_window());
        assert_eq!(plain.class_bytes(Class::Main), plain.page_bytes());
    }

    #[test]
    fn bad_layouts_are_refused() {
        assert_eq!(
            PageLayout::new(0, vec![PoolKind::aux("a", 1, 1)]),
            Err(LayoutError::ZeroPageSize)
        );
        assert_eq!(PageLayout::new(1, vec![]), Err(LayoutError::NoPools));
        assert!(matches!(
            PageLayout::new(1, vec![PoolKind::aux("a", 0, 1)]),
            Err(LayoutError::EmptyPool(_))
        ));
        assert!(matches!(
            PageLayout::new(1, vec![PoolKind::aux("a", 1, 1), PoolKind::aux("a", 1, 1)]),
            Err(LayoutError::DuplicateName(_))
        ));
    }
}
