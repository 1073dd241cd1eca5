//! Model pool kinds as a deployment sees them: per-rank bytes per token under tensor parallelism.

use serde::Serialize;
use strata_kv::PoolKind;

/// One pool kind of a model, before tensor-parallel splitting.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KindSpec {
    pub name: String,
    pub layers: usize,
    /// 2 for K and V, 1 for a single tensor (MLA latent, indexer keys).
    pub planes: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub dtype_bytes: usize,
    /// Heads are divided over TP ranks (attention KV); otherwise every rank holds all of them
    /// (MLA latents and indexer keys are replicated).
    pub split_across_tp: bool,
}

impl KindSpec {
    /// Heads one rank holds: ceil(heads / tp) when split (ranks beyond the head count replicate).
    pub fn heads_per_rank(&self, tp: u32) -> usize {
        if self.split_across_tp {
            self.heads.div_ceil(tp.max(1) as usize)
        } else {
            self.heads
        }
    }

    pub fn per_rank(&self, tp: u32) -> PoolKind {
        PoolKind {
            name: self.name.clone(),
            layers: self.layers,
            planes: self.planes,
            plane_bytes_per_token: self.heads_per_rank(tp) * self.head_dim * self.dtype_bytes,
        }
    }
}

/// A model's pool kinds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ModelSpec {
    pub name: String,
    pub kinds: Vec<KindSpec>,
}

/// Names accepted by [`preset`].
pub const PRESETS: &[&str] = &["smollm2-135m", "dsv4-like"];

/// Built-in models.
/// * `smollm2-135m`: the reference model; 30 layers, 3 KV heads of 64, f16 KV.
/// * `dsv4-like`: a DeepSeek-style model like the seed incident's: an MLA latent KV pool (61
///   layers, 576 values, bf16) plus a sparse-attention indexer pool (61 layers, 128 values,
///   fp8), both replicated on every rank.
pub fn preset(name: &str) -> Option<ModelSpec> {
    let kind = |name: &str, layers, planes, heads, head_dim, dtype_bytes, split| KindSpec {
        name: name.into(),
        layers,
        planes,
        heads,
        head_dim,
        dtype_bytes,
        split_across_tp: split,
    };
    match name {
        "smollm2-135m" => Some(ModelSpec {
            name: name.into(),
            kinds: vec![kind("kv", 30, 2, 3, 64, 2, true)],
        }),
        "dsv4-like" => Some(ModelSpec {
            name: name.into(),
            kinds: vec![
                kind("kv", 61, 1, 1, 576, 2, false),
                kind("indexer", 61, 1, 1, 128, 1, false),
            ],
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_rank_bytes() {
        let s = preset("smollm2-135m").unwrap();
        assert_eq!(s.kinds[0].per_rank(1).bytes_per_token(), 23_040);
        // 3 KV heads over 2 ranks: 2 heads each (one replicated).
        assert_eq!(s.kinds[0].per_rank(2).bytes_per_token(), 15_360);
        let d = preset("dsv4-like").unwrap();
        assert_eq!(d.kinds[0].per_rank(4).bytes_per_token(), 61 * 576 * 2);
        assert_eq!(d.kinds[1].per_rank(4).bytes_per_token(), 61 * 128);
        assert!(preset("gpt-9").is_none());
    }
}
