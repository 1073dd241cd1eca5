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

use thiserror::Error;

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
}

/// One kind of per-token state, per rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolKind {
    pub name: String,
    pub layers: usize,
    /// Planes per layer: 2 (K and V) for attention KV, 1 for a single-tensor state.
    pub planes: usize,
    pub plane_bytes_per_token: usize,
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
        }
    }

    /// A one-plane auxiliary state (e.g. a sparse-attention indexer) of `bytes` per token per layer.
    pub fn aux(name: &str, layers: usize, bytes: usize) -> Self {
        PoolKind {
            name: name.to_string(),
            layers,
            planes: 1,
            plane_bytes_per_token: bytes,
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
    /// Offset of this chunk inside a host page blob.
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
}

impl PageLayout {
    pub fn new(page_size: usize, kinds: Vec<PoolKind>) -> Result<PageLayout, LayoutError> {
        if page_size == 0 {
            return Err(LayoutError::ZeroPageSize);
        }
        if kinds.is_empty() {
            return Err(LayoutError::NoPools);
        }
        let mut chunks = Vec::new();
        let mut off = 0usize;
        for (ki, k) in kinds.iter().enumerate() {
            if k.layers == 0 || k.planes == 0 || k.plane_bytes_per_token == 0 {
                return Err(LayoutError::EmptyPool(k.name.clone()));
            }
            if kinds[..ki].iter().any(|o| o.name == k.name) {
                return Err(LayoutError::DuplicateName(k.name.clone()));
            }
            let bytes = page_size
                .checked_mul(k.plane_bytes_per_token)
                .ok_or(LayoutError::Overflow(page_size))?;
            for layer in 0..k.layers {
                for plane in 0..k.planes {
                    chunks.push(Chunk {
                        kind: ki,
                        layer,
                        plane,
                        host_offset: off,
                        bytes,
                    });
                    off = off
                        .checked_add(bytes)
                        .ok_or(LayoutError::Overflow(page_size))?;
                }
            }
        }
        Ok(PageLayout {
            page_size,
            kinds,
            chunks,
            page_bytes: off,
        })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn kinds(&self) -> &[PoolKind] {
        &self.kinds
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
