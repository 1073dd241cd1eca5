//! How a model's attention heads, feed-forward columns and vocabulary split over
//! tensor-parallel ranks: the one place both the planner (`strata plan`: each rank's pool
//! sizes) and the model (each rank's weight shards and KV pool) take it from.
//!
//! Query heads come in groups sharing a KV head (grouped-query attention). A rank always holds
//! whole KV heads and only query heads of those, so attention inside a rank keeps one group
//! size:
//!
//! * `tp ≤ kv_heads`: the KV heads are split into `tp` contiguous runs as evenly as they go
//!   (the first `kv_heads mod tp` ranks hold one more), each rank with all query heads of its KV
//!   heads. SmolLM2 (9 heads, 3 KV heads) at TP 2: rank 0 holds KV heads 0–1 (query heads 0–5),
//!   rank 1 KV head 2 (query heads 6–8).
//! * `tp > kv_heads`: each KV head is replicated on `tp / kv_heads` ranks (the first
//!   `tp mod kv_heads` KV heads on one more), and its group's query heads are split between
//!   them. SmolLM2 at TP 4: ranks 0 and 1 both hold KV head 0, with query heads 0–1 and 2;
//!   ranks 2 and 3 hold KV heads 1 and 2 with all their query heads.
//!
//! A rank holds at most `ceil(kv_heads / tp)` KV heads: what the planner sizes each rank's
//! pools for. Ranks with fewer use less memory for the same pages.

use std::ops::Range;

/// One rank's share of the attention heads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankHeads {
    /// Query heads (model numbering).
    pub q: Range<usize>,
    /// KV heads (model numbering).
    pub kv: Range<usize>,
}

/// Splits `n` items into `parts` contiguous runs, the first `n mod parts` one longer.
pub fn even_runs(n: usize, parts: usize) -> Vec<Range<usize>> {
    let parts = parts.max(1);
    let (base, extra) = (n / parts, n % parts);
    let mut at = 0;
    (0..parts)
        .map(|i| {
            let len = base + usize::from(i < extra);
            at += len;
            at - len..at
        })
        .collect()
}

/// Each rank's heads (see the module notes); an error names why `tp` cannot split them.
pub fn split_heads(heads: usize, kv_heads: usize, tp: usize) -> Result<Vec<RankHeads>, String> {
    if tp == 0 {
        return Err("a tensor-parallel size of 0".into());
    }
    if kv_heads == 0 || heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(format!(
            "{heads} query heads are not whole groups of {kv_heads} KV heads"
        ));
    }
    if tp > heads {
        return Err(format!(
            "tensor-parallel size {tp} exceeds the model's {heads} attention heads (each rank \
             needs at least one)"
        ));
    }
    let group = heads / kv_heads;
    if tp <= kv_heads {
        return Ok(even_runs(kv_heads, tp)
            .into_iter()
            .map(|kv| RankHeads {
                q: kv.start * group..kv.end * group,
                kv,
            })
            .collect());
    }
    let mut out = Vec::with_capacity(tp);
    for (g, ranks) in even_runs(tp, kv_heads).into_iter().enumerate() {
        for q in even_runs(group, ranks.len()) {
            out.push(RankHeads {
                q: g * group + q.start..g * group + q.end,
                kv: g..g + 1,
            });
        }
    }
    Ok(out)
}

/// The pool kind of rank `r`'s share of kind `base` (`kv` → `kv.tp0`, ...).
pub fn rank_kind_name(base: &str, r: usize) -> String {
    format!("{base}.tp{r}")
}

/// KV heads each rank holds, as [`split_heads`] gives them: even runs, or one each
/// (replicated) when there are more ranks than KV heads.
pub fn kv_heads_of_ranks(kv_heads: usize, tp: usize) -> Vec<usize> {
    let tp = tp.max(1);
    if tp <= kv_heads {
        even_runs(kv_heads, tp).iter().map(|r| r.len()).collect()
    } else {
        vec![1; tp]
    }
}

/// KV heads the largest rank holds: `ceil(kv_heads / tp)` (1 when `tp > kv_heads`).
pub fn kv_heads_per_rank(kv_heads: usize, tp: usize) -> usize {
    kv_heads.div_ceil(tp.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn smollm2_splits() {
        let r = split_heads(9, 3, 2).unwrap();
        assert_eq!(r[0], RankHeads { q: 0..6, kv: 0..2 });
        assert_eq!(r[1], RankHeads { q: 6..9, kv: 2..3 });
        let r = split_heads(9, 3, 4).unwrap();
        let q: Vec<_> = r.iter().map(|h| h.q.clone()).collect();
        let kv: Vec<_> = r.iter().map(|h| h.kv.clone()).collect();
        assert_eq!(q, vec![0..2, 2..3, 3..6, 6..9]);
        assert_eq!(kv, vec![0..1, 0..1, 1..2, 2..3]);
        assert!(split_heads(9, 3, 10).unwrap_err().contains("exceeds"));
        assert!(split_heads(9, 2, 1).is_err());
        assert!(split_heads(9, 3, 0).is_err());
    }

    proptest! {
        /// Every query head on exactly one rank, in order; each rank's query heads use only
        /// its KV heads, with one group size inside the rank; no rank holds more KV heads
        /// than the planner sizes for.
        #[test]
        fn split_covers_heads_once(kv in 1usize..9, group in 1usize..9, tp in 1usize..20) {
            let heads = kv * group;
            prop_assume!(tp <= heads);
            let r = split_heads(heads, kv, tp).unwrap();
            prop_assert_eq!(r.len(), tp);
            let mut next = 0;
            for (r, h) in r.iter().enumerate() {
                prop_assert_eq!(h.q.start, next);
                prop_assert!(!h.q.is_empty() && !h.kv.is_empty());
                next = h.q.end;
                prop_assert!(h.kv.len() <= kv_heads_per_rank(kv, tp));
                prop_assert_eq!(h.kv.len(), kv_heads_of_ranks(kv, tp)[r]);
                prop_assert!(h.q.len().is_multiple_of(h.kv.len()));
                let local_group = h.q.len() / h.kv.len();
                for (i, q) in h.q.clone().enumerate() {
                    prop_assert_eq!(q / group, h.kv.start + i / local_group);
                }
            }
            prop_assert_eq!(next, heads);
        }
    }
}
