//! Offline bounds over a page-granular view of a trace: Belady's MIN (with bypass) and the
//! infinite cache. Pages are numbered `block id × pages per block + index`, so no hashing.
//!
//! Every access to a page is preceded, in the same request, by an access to its parent, so the
//! parent's next use always comes first; MIN (which evicts the furthest next use, and does not
//! admit a page used later than everything cached) therefore keeps a prefix-closed set, and its
//! page hits are reachable by a prefix tree: a true upper bound for any eviction policy.

use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;

use crate::trace::TraceRequest;

/// Each request's whole pages, in order, plus its prompt length.
pub struct PageTrace {
    pub requests: Vec<(Vec<u64>, usize)>,
    pub page_size: usize,
    pub distinct_pages: usize,
}

impl PageTrace {
    /// `page_size` must divide `block_tokens`.
    pub fn new(reqs: &[TraceRequest], block_tokens: usize, page_size: usize) -> PageTrace {
        assert_eq!(
            block_tokens % page_size,
            0,
            "page size must divide the block size"
        );
        let per_block = (block_tokens / page_size) as u64;
        let mut seen = rustc_hash::FxHashSet::default();
        let requests: Vec<(Vec<u64>, usize)> = reqs
            .iter()
            .map(|r| {
                let pages = r.input_length / page_size;
                let v: Vec<u64> = (0..pages as u64)
                    .map(|p| {
                        // Ids are block counters or 64-bit hashes: past 2^64 / per_block the
                        // product wraps, and two hashes alias as rarely as they collide.
                        let id = r.hash_ids[(p / per_block) as usize];
                        id.wrapping_mul(per_block).wrapping_add(p % per_block)
                    })
                    .collect();
                seen.extend(v.iter().copied());
                (v, r.input_length)
            })
            .collect();
        PageTrace {
            requests,
            page_size,
            distinct_pages: seen.len(),
        }
    }

    pub fn queried_tokens(&self) -> u64 {
        self.requests.iter().map(|r| r.1 as u64).sum()
    }

    /// Tokens hit by a cache that never evicts.
    pub fn infinite_hit_tokens(&self) -> u64 {
        let mut seen = rustc_hash::FxHashSet::default();
        let mut hits = 0;
        for (pages, _) in &self.requests {
            for &p in pages {
                if !seen.insert(p) {
                    hits += 1;
                }
            }
        }
        hits * self.page_size as u64
    }

    /// Tokens hit by Belady's MIN with room for `cap` pages.
    pub fn belady_hit_tokens(&self, cap: usize) -> u64 {
        let flat: Vec<u64> = self
            .requests
            .iter()
            .flat_map(|r| r.0.iter().copied())
            .collect();
        const NEVER: usize = usize::MAX;
        let mut next = vec![NEVER; flat.len()];
        let mut last: FxHashMap<u64, usize> = FxHashMap::default();
        for i in (0..flat.len()).rev() {
            if let Some(&j) = last.get(&flat[i]) {
                next[i] = j;
            }
            last.insert(flat[i], i);
        }
        // page → its next use while cached; heap of (next use, page) with lazy deletion.
        let mut cached: FxHashMap<u64, usize> = FxHashMap::default();
        let mut heap: BinaryHeap<(usize, u64)> = BinaryHeap::new();
        let mut hits = 0u64;
        for (i, &p) in flat.iter().enumerate() {
            let nu = next[i];
            if let Some(e) = cached.get_mut(&p) {
                hits += 1;
                *e = nu;
                heap.push((nu, p));
                continue;
            }
            if nu == NEVER || cap == 0 {
                continue;
            }
            if cached.len() >= cap {
                // Furthest live entry.
                let far = loop {
                    let &(n, q) = heap.peek().expect("cache is full");
                    if cached.get(&q) == Some(&n) {
                        break (n, q);
                    }
                    heap.pop();
                };
                if far.0 <= nu {
                    continue; // bypass: p is needed later than anything cached
                }
                heap.pop();
                cached.remove(&far.1);
            }
            cached.insert(p, nu);
            heap.push((nu, p));
        }
        hits * self.page_size as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp_ms: 0,
            input_length: ids.len() * 4,
            output_length: 1,
            hash_ids: ids.to_vec(),
            session: None,
        }
    }

    #[test]
    fn belady_on_a_known_sequence() {
        // Pages = blocks (page size = block size 4). Accesses: 1 2 3 1 2 3 1.
        let reqs: Vec<_> = [1u64, 2, 3, 1, 2, 3, 1]
            .iter()
            .map(|&i| req(&[i]))
            .collect();
        let pt = PageTrace::new(&reqs, 4, 4);
        assert_eq!(pt.distinct_pages, 3);
        assert_eq!(pt.infinite_hit_tokens(), 4 * 4);
        // Two slots: 1 and 2 are admitted, 3 is bypassed (needed after both), then 1, 2 and
        // the final 1 hit: 3 hits.
        assert_eq!(pt.belady_hit_tokens(2), 3 * 4);
        assert_eq!(pt.belady_hit_tokens(3), 4 * 4);
        assert_eq!(pt.belady_hit_tokens(0), 0);
    }

    #[test]
    fn belady_never_below_lru_style_reuse() {
        let reqs: Vec<_> = (0..50u64).map(|i| req(&[i % 5, 100 + i])).collect();
        let pt = PageTrace::new(&reqs, 4, 2);
        let inf = pt.infinite_hit_tokens();
        assert!(pt.belady_hit_tokens(10) <= inf);
        assert_eq!(
            pt.belady_hit_tokens(10),
            inf,
            "10 pages hold the 5 shared blocks"
        );
    }
}
