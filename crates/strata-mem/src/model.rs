//! Model pool kinds as a deployment sees them: per-rank bytes per token under tensor parallelism.

use serde::Serialize;
use strata_kv::dtype::Dtype;
use strata_kv::PoolKind;

/// What one item of a kind belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Per {
    /// A row per token.
    Token,
    /// One item per `r`-token block, `page / r` of them packed in a page (the page size must
    /// be a multiple of `r`).
    Block(usize),
    /// One item per `r`-token block, in the page holding the block's last token: one slot per
    /// page when a page divides a block, `page / r` when it holds whole blocks.
    BlockSlot(usize),
}

/// Which of a prefix's items a continuation reads: the whole prefix, or only its last tokens
/// (the kind's pages may then be dropped further back; see docs/ARCHITECTURE.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Needed {
    Prefix,
    Window(usize),
}

/// One pool kind of a model, before tensor-parallel splitting.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KindSpec {
    pub name: String,
    pub layers: usize,
    /// 2 for K and V, 1 for a single tensor (MLA latent, indexer keys).
    pub planes: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// Element type of every value (K/V: `--kv-cache-dtype`; others as the model defines).
    #[serde(serialize_with = "dtype_name")]
    pub dtype: Dtype,
    /// Heads are divided over TP ranks (attention KV); otherwise every rank holds all of them
    /// (MLA latents and indexer keys are replicated).
    pub split_across_tp: bool,
    pub per: Per,
    pub needed: Needed,
}

fn dtype_name<S: serde::Serializer>(d: &Dtype, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(d.name())
}

impl KindSpec {
    /// Heads the largest rank holds: ceil(heads / tp) when split (ranks beyond the head count
    /// replicate; [`strata_kv::tp`] is the split).
    pub fn heads_per_rank(&self, tp: u32) -> usize {
        if self.split_across_tp {
            strata_kv::tp::kv_heads_per_rank(self.heads, tp as usize)
        } else {
            self.heads
        }
    }

    /// Heads each rank holds ([`strata_kv::tp::split_heads`]: whole KV heads in even runs,
    /// one each when there are more ranks than heads).
    pub fn heads_of_ranks(&self, tp: u32) -> Vec<usize> {
        let tp = tp.max(1) as usize;
        if self.split_across_tp {
            strata_kv::tp::kv_heads_of_ranks(self.heads, tp)
        } else {
            vec![self.heads; tp]
        }
    }

    /// Bytes of one item (a token's row, or a block's) per layer and plane on one rank; None
    /// when that overflows or a head does not hold whole blocks of the dtype.
    pub fn item_bytes(&self, tp: u32) -> Option<usize> {
        if !self.head_dim.is_multiple_of(self.dtype.block()) {
            return None;
        }
        self.dtype
            .bytes_of(self.heads_per_rank(tp).checked_mul(self.head_dim)?)
    }

    /// The kind on one rank in pages of `page_size` tokens, or why such a page cannot hold it.
    pub fn per_rank(&self, tp: u32, page_size: usize) -> Result<PoolKind, String> {
        let ps = page_size;
        let too_big = || format!("kind `{}`: its size overflows", self.name);
        let item = self.item_bytes(tp).ok_or_else(too_big)?;
        if ps == 0 || item == 0 || self.layers == 0 || self.planes == 0 {
            return Err(format!("kind `{}` holds nothing (a zero size)", self.name));
        }
        let items_per_page = match self.per {
            Per::Token => Some(ps),
            Per::Block(r) => (r > 0 && ps.is_multiple_of(r)).then(|| ps / r),
            Per::BlockSlot(r) if r > 0 && ps <= r && r.is_multiple_of(ps) => Some(1),
            Per::BlockSlot(r) => (r > 0 && ps.is_multiple_of(r)).then(|| ps / r),
        };
        let items = items_per_page.ok_or_else(|| {
            format!(
                "a page of {ps} tokens does not hold whole items of kind `{}` ({})",
                self.name,
                self.per_text()
            )
        })?;
        let chunk = item.checked_mul(items).ok_or_else(too_big)?;
        if !chunk.is_multiple_of(ps) {
            return Err(format!(
                "kind `{}`: {chunk} bytes per page do not split evenly over {ps} tokens",
                self.name
            ));
        }
        let per_token = chunk / ps;
        let whole = per_token
            .checked_mul(self.layers)
            .and_then(|b| b.checked_mul(self.planes))
            .and_then(|b| b.checked_mul(ps));
        if whole.is_none() {
            return Err(too_big());
        }
        Ok(PoolKind {
            name: self.name.clone(),
            layers: self.layers,
            planes: self.planes,
            plane_bytes_per_token: per_token,
            window: match self.needed {
                Needed::Prefix => None,
                Needed::Window(n) => Some(n),
            },
            // Sizing only: the loaded model's layout names the dtype its pages hold.
            dtype: None,
        })
    }

    /// `token`, `4-token block`, ...
    pub fn per_text(&self) -> String {
        match self.per {
            Per::Token => "token".into(),
            Per::Block(r) | Per::BlockSlot(r) => format!("{r}-token block"),
        }
    }

    /// `prefix` or `last 32 tokens`.
    pub fn needed_text(&self) -> String {
        match self.needed {
            Needed::Prefix => "prefix".into(),
            Needed::Window(n) => format!("last {n} tokens"),
        }
    }
}

/// A model's pool kinds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ModelSpec {
    pub name: String,
    pub kinds: Vec<KindSpec>,
    /// The weights' bytes in host memory beside the pools (a model file: its size; a preset:
    /// 0, its weights being on the accelerators it is planned for).
    pub weights_bytes: u64,
}

impl ModelSpec {
    /// The model with its attention K and V stored as `k` and `v` (`--kv-cache-dtype`, or
    /// `--cache-type-k` / `--cache-type-v`): the K/V kind (two planes, heads split over ranks)
    /// takes that dtype, or becomes two kinds `k` and `v` of a plane each when they differ.
    /// Other kinds keep the dtypes the model defines; a model without a K/V kind refuses
    /// anything but f16, as does a head that does not hold whole blocks of the dtype.
    pub fn with_kv_dtypes(&self, k: Dtype, v: Dtype) -> Result<ModelSpec, String> {
        let is_kv = |c: &KindSpec| c.planes == 2 && c.split_across_tp && c.dtype == Dtype::F16;
        if (k, v) == (Dtype::F16, Dtype::F16) {
            return Ok(self.clone());
        }
        if !self.kinds.iter().any(is_kv) {
            let kinds: Vec<String> = self
                .kinds
                .iter()
                .map(|c| format!("{} {}", c.name, c.dtype))
                .collect();
            return Err(format!(
                "model {} has no attention K/V pool to store as {k}/{v}: its state kinds keep the \
                 dtypes the model defines ({})",
                self.name,
                kinds.join(", ")
            ));
        }
        let mut kinds = Vec::new();
        for c in &self.kinds {
            if !is_kv(c) {
                kinds.push(c.clone());
                continue;
            }
            for d in [k, v] {
                if !c.head_dim.is_multiple_of(d.block()) {
                    return Err(format!(
                        "{d} stores blocks of {} values; a KV head of {} values does not hold \
                         whole blocks",
                        d.block(),
                        c.head_dim
                    ));
                }
            }
            if k == v {
                kinds.push(KindSpec {
                    dtype: k,
                    ..c.clone()
                });
            } else {
                for (name, d) in [("k", k), ("v", v)] {
                    kinds.push(KindSpec {
                        name: name.into(),
                        planes: 1,
                        dtype: d,
                        ..c.clone()
                    });
                }
            }
        }
        Ok(ModelSpec {
            name: self.name.clone(),
            kinds,
            weights_bytes: self.weights_bytes,
        })
    }
}

/// Names accepted by [`preset`].
pub const PRESETS: &[&str] = &[
    "smollm2-135m",
    "deepseek-v3.2",
    "deepseek-v4-flash",
    "deepseek-v4-pro",
];

/// The shape of a DeepSeek-V4 model's per-sequence state (docs/DSV4-FORWARD.md §11).
#[derive(Clone, Copy, Debug)]
pub struct Dsv4Shape {
    pub layers: usize,
    /// Layers with compression ratio 4 (CSA, with the indexer) and 128 (HCA).
    pub csa_layers: usize,
    pub hca_layers: usize,
    /// K (= V) length, one head.
    pub head_dim: usize,
    pub indexer_dim: usize,
    /// The raw sliding window.
    pub window: usize,
    /// Element type of a cached value (raw, compressed, indexer keys) and of a
    /// compressor-state value.
    pub cache_dtype: Dtype,
    pub state_dtype: Dtype,
}

/// DeepSeek-V4's pool kinds, as the engine lays them out in pages (`strata_model::deepseek4`'s
/// `pool_kinds`; `strata serve` refuses to start when the two disagree). The state is one
/// K = V head, the same on every tensor-parallel rank. Kinds of a ratio no layer has are
/// left out.
pub fn dsv4_kinds(s: &Dsv4Shape) -> Vec<KindSpec> {
    let kind = |name: &str, layers, planes, head_dim, dtype, per, needed| KindSpec {
        name: name.into(),
        layers,
        planes,
        heads: 1,
        head_dim,
        dtype,
        split_across_tp: false,
        per,
        needed,
    };
    let (d, di, c, st) = (s.head_dim, s.indexer_dim, s.cache_dtype, s.state_dtype);
    let (prefix, w) = (Needed::Prefix, Needed::Window);
    [
        kind("raw", s.layers, 1, d, c, Per::Token, w(s.window)),
        kind("csa", s.csa_layers, 1, d, c, Per::Block(4), prefix),
        kind("index", s.csa_layers, 1, di, c, Per::Block(4), prefix),
        kind("hca", s.hca_layers, 1, d, c, Per::BlockSlot(128), prefix),
        // A compressor's value and score rows; CSA's overlap needs the previous block too.
        kind("csa_rows", s.csa_layers, 2, 2 * d, st, Per::Token, w(8)),
        kind("index_rows", s.csa_layers, 2, 2 * di, st, Per::Token, w(8)),
        kind("hca_rows", s.hca_layers, 2, d, st, Per::Token, w(128)),
    ]
    .into_iter()
    .filter(|k| k.layers > 0)
    .collect()
}

/// Built-in models.
/// * `smollm2-135m`: the reference model; 30 layers, 3 KV heads of 64, f16 KV.
/// * `deepseek-v3.2`: the seed incident's numbers as its operators wrote them: an MLA latent KV
///   pool (61 layers, 576 values, bf16) plus a sparse-attention indexer pool (61 layers, 128
///   values, fp8), both replicated on every rank (DeepSeek-V3.2's shape).
/// * `deepseek-v4-flash`, `deepseek-v4-pro`: DeepSeek-V4's published dimensions, every state
///   kind ([`dsv4_kinds`]).
pub fn preset(name: &str) -> Option<ModelSpec> {
    let kind = |name: &str, layers, planes, heads, head_dim, dtype, split| KindSpec {
        name: name.into(),
        layers,
        planes,
        heads,
        head_dim,
        dtype,
        split_across_tp: split,
        per: Per::Token,
        needed: Needed::Prefix,
    };
    match name {
        "smollm2-135m" => Some(ModelSpec {
            name: name.into(),
            kinds: vec![kind("kv", 30, 2, 3, 64, Dtype::F16, true)],
            weights_bytes: 0,
        }),
        // Published configurations (docs/SIZING.md cites them): 1 K = V head of 512, window
        // 128, indexer keys of 128; caches in bf16 and compressor state in f32, as DeepSeek's
        // reference inference code keeps them. Flash: layers 0-1 window only, then 4 and 128
        // alternating (21 CSA, 20 HCA). Pro: layers 0-1 ratio 128, then alternating (30 CSA,
        // 31 HCA).
        "deepseek-v4-flash" | "deepseek-v4-pro" => {
            let (layers, csa_layers, hca_layers) = if name == "deepseek-v4-flash" {
                (43, 21, 20)
            } else {
                (61, 30, 31)
            };
            Some(ModelSpec {
                name: name.into(),
                kinds: dsv4_kinds(&Dsv4Shape {
                    layers,
                    csa_layers,
                    hca_layers,
                    head_dim: 512,
                    indexer_dim: 128,
                    window: 128,
                    cache_dtype: Dtype::Bf16,
                    state_dtype: Dtype::F32,
                }),
                weights_bytes: 0,
            })
        }
        "deepseek-v3.2" => Some(ModelSpec {
            name: name.into(),
            kinds: vec![
                kind("kv", 61, 1, 1, 576, Dtype::Bf16, false),
                kind("indexer", 61, 1, 1, 128, Dtype::Fp8E4m3, false),
            ],
            weights_bytes: 0,
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
        let r = |k: &KindSpec, tp| k.per_rank(tp, 16).unwrap().bytes_per_token();
        assert_eq!(r(&s.kinds[0], 1), 23_040);
        // 3 KV heads over 2 ranks: 2 heads each (one replicated).
        assert_eq!(r(&s.kinds[0], 2), 15_360);
        let d = preset("deepseek-v3.2").unwrap();
        assert_eq!(r(&d.kinds[0], 4), 61 * 576 * 2);
        assert_eq!(r(&d.kinds[1], 4), 61 * 128);
        assert!(preset("gpt-9").is_none());
    }

    #[test]
    fn kv_dtypes_size_the_kv_kind_and_nothing_else() {
        let s = preset("smollm2-135m").unwrap();
        let bpt = |m: &ModelSpec, tp| -> usize {
            m.kinds
                .iter()
                .map(|k| k.per_rank(tp, 16).unwrap().bytes_per_token())
                .sum()
        };
        let q8 = s.with_kv_dtypes(Dtype::Q8_0, Dtype::Q8_0).unwrap();
        assert_eq!(q8.kinds.len(), 1);
        // 30 layers × 2 planes × 3 heads × 64 values: 34 bytes per 32 values.
        assert_eq!(bpt(&q8, 1), 30 * 2 * 6 * 34);
        assert!(bpt(&s, 1) as f64 / bpt(&q8, 1) as f64 > 1.85);
        // At TP 2 each rank holds 2 heads (one replicated), still whole blocks.
        assert_eq!(bpt(&q8, 2), 30 * 2 * 4 * 34);
        let fp8 = s.with_kv_dtypes(Dtype::Fp8E4m3, Dtype::Fp8E4m3).unwrap();
        assert_eq!(bpt(&fp8, 1), bpt(&s, 1) / 2);
        // K and V apart: two kinds of one plane each.
        let kv = s.with_kv_dtypes(Dtype::Q8_0, Dtype::F16).unwrap();
        let names: Vec<&str> = kv.kinds.iter().map(|k| k.name.as_str()).collect();
        assert_eq!(names, ["k", "v"]);
        assert_eq!(bpt(&kv, 1), 30 * 6 * 34 + 30 * 192 * 2);
        assert_eq!(s.with_kv_dtypes(Dtype::F16, Dtype::F16).unwrap(), s);
        // DeepSeek's kinds are not K/V planes: refused, naming what they are.
        let e = preset("deepseek-v4-pro")
            .unwrap()
            .with_kv_dtypes(Dtype::Q8_0, Dtype::Q8_0)
            .unwrap_err();
        assert!(e.contains("keep the dtypes the model defines"), "{e}");
        assert!(e.contains("raw bf16"), "{e}");
        // A head of 48 values holds no whole Q8_0 blocks.
        let mut odd = s.clone();
        odd.kinds[0].head_dim = 48;
        let e = odd.with_kv_dtypes(Dtype::Q8_0, Dtype::Q8_0).unwrap_err();
        assert!(e.contains("does not hold whole blocks"), "{e}");
    }
}
