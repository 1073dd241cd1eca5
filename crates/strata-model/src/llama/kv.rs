//! Where a model's K and V live in the pool: its pool kinds (`kv`, or `k` and `v` when their
//! dtypes differ), each plane's kind, plane and dtype, and the planes as attention reads them.

use half::f16;
use strata_kv::dtype::Dtype;
use strata_kv::pool::DevicePool;
use strata_kv::PoolKind;

use super::Model;
use crate::attn;

fn as_f16(b: &[u8]) -> &[f16] {
    // SAFETY: f16 is a plain 2-byte value for which every bit pattern is valid; align_to only
    // reinterprets the aligned middle, and pool planes start 4 KiB aligned with even lengths.
    let (pre, mid, post) = unsafe { b.align_to::<f16>() };
    assert!(
        pre.is_empty() && post.is_empty(),
        "pool plane is not f16-aligned"
    );
    mid
}

impl Model {
    /// Where plane `plane` (0: K, 1: V) lives: (kind in the layout, plane of that kind,
    /// dtype).
    pub(super) fn plane_at(&self, plane: usize) -> (usize, usize, Dtype) {
        let dtype = [self.k_dtype, self.v_dtype][plane];
        if self.k_dtype == self.v_dtype {
            (self.first_kind(), plane, dtype)
        } else {
            (self.first_kind() + plane, 0, dtype)
        }
    }

    /// Plane `plane` (0: K, 1: V) of `layer` in this model's pool kinds, as attention reads it.
    pub(super) fn plane<'a>(
        &self,
        pool: &'a DevicePool,
        layer: usize,
        plane: usize,
    ) -> attn::Plane<'a> {
        let (kind, kind_plane, dtype) = self.plane_at(plane);
        let bytes = pool.plane(kind, layer, kind_plane);
        match dtype {
            Dtype::F16 => attn::Plane::F16(as_f16(bytes)),
            dtype => attn::Plane::Packed {
                bytes,
                dtype,
                row: pool.layout().kinds()[kind].plane_bytes_per_token,
            },
        }
    }
}

/// The K/V pool kinds of `heads` KV heads of `head_dim` values over `layers` layers, named with
/// `suffix` (a rank's `.tpR`): one kind `kv` of K and V planes when K and V share a dtype, else
/// `k` and `v` of one plane each. Heads must hold whole blocks of both dtypes (checked when
/// the dtypes are set).
pub(crate) fn kv_kinds(
    suffix: &str,
    layers: usize,
    heads: usize,
    head_dim: usize,
    k: Dtype,
    v: Dtype,
) -> Vec<PoolKind> {
    let kind = |name: &str, d| {
        PoolKind::kv_of(&format!("{name}{suffix}"), layers, heads, head_dim, d)
            .expect("checked when set")
    };
    if k == v {
        return vec![kind("kv", k)];
    }
    [("k", k), ("v", v)]
        .into_iter()
        .map(|(n, d)| PoolKind {
            planes: 1,
            ..kind(n, d)
        })
        .collect()
}
