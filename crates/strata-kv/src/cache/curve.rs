//! The cache's live miss-ratio curve: every admitted prompt's whole pages, once, into a SHARDS
//! sampler ([`crate::mrc::Shards`]), read at multiples of each tier's pages.
//!
//! The pages are named by a chain hash under a namespace of this process's own random key (not
//! the deployment's page hashes, which other processes know), so the sampler's choice of pages
//! depends on nothing a client can see. A request is observed when it is admitted
//! ([`TieredCache::admit`]): an admission retried after a wait is counted once.

use super::TieredCache;
use crate::hash::{HashNamespace, PageHash};
use crate::mrc::Shards;

/// Multiples of a tier's pages the curve is read at.
pub const CURVE_SCALES: [f64; 6] = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0];

/// The sampler and the namespace its pages are named in.
pub(super) struct CurveState {
    shards: Shards,
    ns: HashNamespace,
}

impl CurveState {
    /// The curve of [`super::CacheConfig::curve_pages`] pages (0: none).
    pub(super) fn of(max_pages: usize) -> Result<Option<CurveState>, super::CacheError> {
        (max_pages > 0)
            .then(|| CurveState::new(max_pages))
            .transpose()
            .map_err(|e| super::CacheError::Random(e.to_string()))
    }

    /// A sampler tracking at most `max_pages` pages, under a fresh random key.
    pub(super) fn new(max_pages: usize) -> Result<CurveState, getrandom::Error> {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key)?;
        Ok(CurveState {
            shards: Shards::with_random_key(max_pages, 1.0)?,
            ns: HashNamespace::from_key(key),
        })
    }
}

/// One point of the curve: the LRU hit ratio of whole prompt pages a cache of `pages` pages
/// (`scale` × the tier's) would have had over the traffic seen.
#[derive(Clone, Debug, PartialEq)]
pub struct CurvePoint {
    /// `device`, `host`, or the L3 tier's own name (`disk`, `remote`, `disk+remote`).
    pub tier: &'static str,
    pub scale: f64,
    pub pages: u64,
    pub hit_ratio: f64,
}

/// The curve and what its sampler holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Curve {
    /// The sampling rate now (it falls as the working set outgrows the budget).
    pub rate: f64,
    pub tracked_pages: usize,
    pub memory_bytes: usize,
    /// Prompt pages observed.
    pub references: u64,
    pub points: Vec<CurvePoint>,
}

impl TieredCache {
    /// Counts one admitted prompt's whole pages into the curve (nothing without one).
    pub(super) fn observe(&mut self, prompt: &[u32]) {
        let ps = self.page_size();
        let Some(c) = self.curve.as_mut() else {
            return;
        };
        let mut parent = PageHash::ROOT;
        for page in prompt.chunks_exact(ps) {
            parent = c.ns.page_hash(parent, page);
            c.shards.access(&parent);
        }
    }

    /// Prompt pages the curve has observed (None: no curve): a caller that keeps the last
    /// [`TieredCache::curve`] reads it again only when this moved.
    pub fn curve_references(&self) -> Option<u64> {
        self.curve.as_ref().map(|c| c.shards.references())
    }

    /// The curve at [`CURVE_SCALES`] of the device, host and (with a known capacity) L3
    /// tiers' pages, each tier counting the tiers above it in (a tier of N pages: a cache of
    /// N pages); None when the cache keeps none ([`super::CacheConfig::curve_pages`] 0).
    pub fn curve(&self) -> Option<Curve> {
        let c = self.curve.as_ref()?;
        let page_bytes = self.layout.page_bytes().max(1) as u64;
        let mut tiers = vec![
            ("device", self.device_usage().pages_total),
            ("host", self.host_usage().pages_total),
        ];
        if let Some(st) = self.storage() {
            let cap = st.stats().capacity_bytes;
            if cap > 0 && cap < u64::MAX {
                tiers.push((st.tier(), cap / page_bytes));
            }
        }
        let sizes: Vec<f64> = tiers
            .iter()
            .flat_map(|&(_, pages)| CURVE_SCALES.map(|s| s * pages as f64))
            .collect();
        let ratios = c.shards.hit_ratios(&sizes);
        let points = tiers
            .iter()
            .flat_map(|&(tier, pages)| CURVE_SCALES.map(move |scale| (tier, scale, pages)))
            .zip(ratios)
            .map(|((tier, scale, pages), hit_ratio)| CurvePoint {
                tier,
                scale,
                pages: (scale * pages as f64) as u64,
                hit_ratio,
            })
            .collect();
        Some(Curve {
            rate: c.shards.rate(),
            tracked_pages: c.shards.tracked(),
            memory_bytes: c.shards.memory_bytes(),
            references: c.shards.references(),
            points,
        })
    }
}
