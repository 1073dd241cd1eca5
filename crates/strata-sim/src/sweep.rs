//! Miss-ratio curve: hit rate against capacity for each eviction policy, beside Belady's MIN
//! and the infinite-cache ceiling. Capacity is one tier (the device), as a fraction of the
//! trace's distinct pages.

use strata_kv::EvictionPolicy;

use crate::belady::PageTrace;
use crate::replay::{check_page_size, replay, SimConfig, SimError};
use crate::trace::TraceRequest;

/// One capacity of the sweep. Rates are fractions of queried tokens.
#[derive(Clone, Debug)]
pub struct SweepPoint {
    pub fraction: f64,
    pub capacity_tokens: u64,
    /// (policy, hit rate) for each simulated policy.
    pub policies: Vec<(EvictionPolicy, f64)>,
    pub belady: f64,
    pub infinite: f64,
}

/// Runs every policy at every capacity fraction.
pub fn sweep(
    reqs: &[TraceRequest],
    base: &SimConfig,
    fractions: &[f64],
    policies: &[EvictionPolicy],
    mut progress: impl FnMut(&str),
) -> Result<Vec<SweepPoint>, SimError> {
    check_page_size(base)?;
    let ps = base.layout.page_size();
    let pt = PageTrace::new(reqs, base.block_tokens, ps);
    let queried = pt.queried_tokens() as f64;
    let infinite = pt.infinite_hit_tokens() as f64 / queried;
    let mut out = Vec::new();
    for &f in fractions {
        let cap_pages = ((pt.distinct_pages as f64 * f).round() as u64).max(1);
        let capacity_tokens = cap_pages * ps as u64;
        let belady = pt.belady_hit_tokens(cap_pages as usize) as f64 / queried;
        let mut rates = Vec::new();
        for &p in policies {
            let cfg = SimConfig {
                device_tokens: capacity_tokens,
                host_tokens: 0,
                storage_tokens: 0,
                eviction: p,
                // Belady's bound is over prompt pages: the policies compete on those alone.
                cache_outputs: false,
                ..base.clone()
            };
            let r = replay(reqs, &cfg, |_| {})?;
            progress(&format!(
                "capacity {:.1}% ({capacity_tokens} tokens), {}: hit rate {:.2}%",
                f * 100.0,
                p.name(),
                r.stats.hit_rate() * 100.0
            ));
            rates.push((p, r.stats.hit_rate()));
        }
        out.push(SweepPoint {
            fraction: f,
            capacity_tokens,
            policies: rates,
            belady,
            infinite,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_kv::{PageLayout, PoolKind, WritePolicy};

    #[test]
    fn policies_stay_between_zero_and_belady() {
        let reqs: Vec<TraceRequest> = (0..120u64)
            .map(|i| {
                // Prefix-consistent ids: the second id determines the first (21 is a multiple of 7).
                let ids = vec![i % 7, 100 + i % 21, 1000 + i];
                TraceRequest {
                    timestamp_ms: i,
                    input_length: 24,
                    output_length: 1,
                    hash_ids: ids,
                    session: None,
                }
            })
            .collect();
        let base = SimConfig {
            layout: PageLayout::new(4, vec![PoolKind::kv("kv", 1, 1, 4, 2)]).unwrap(),
            block_tokens: 8,
            vocab: 5000,
            device_tokens: 0,
            host_tokens: 0,
            storage_tokens: 0,
            write_policy: WritePolicy::WriteThrough,
            eviction: EvictionPolicy::Lru,
            gdsf_history: strata_kv::DEFAULT_GDSF_HISTORY,
            cache_outputs: true,
            windows: None,
        };
        let pts = sweep(
            &reqs,
            &base,
            &[0.05, 0.2, 1.0],
            &EvictionPolicy::ALL,
            |_| {},
        )
        .unwrap();
        for p in &pts {
            for &(_, r) in &p.policies {
                assert!(
                    r <= p.belady + 1e-9 && p.belady <= p.infinite + 1e-9,
                    "{p:?}"
                );
            }
        }
        // With room for every page, everything reusable hits.
        let last = pts.last().unwrap();
        assert!((last.policies[0].1 - last.infinite).abs() < 1e-9);
    }
}
