//! The tiered cache of `strata serve`: device and host pools as planned, the L3 tiers of
//! `--l3` (disk, Redis), and those tiers kept for the metrics.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use strata_kv::storage::{DiskStorage, Storage};
use strata_kv::units::parse_size;
use strata_kv::{CacheConfig, PageLayout, TieredCache};
use strata_mem::{NumaAllocator, Plan, PlanRequest};

use super::checks::{is_redis, Checked, L3_SPECS};
use super::{model_id, ServeArgs};

/// The L3 tiers of `--l3`, in order, and how many were left out: a Redis that cannot be
/// reached at start is left out (a warning, and `strata_l3_unavailable_tiers`); a bad spec
/// or an unusable disk path is an error.
fn l3_storage(
    a: &ServeArgs,
    ns: &str,
    key: strata_kv::storage::blob::BlobKey,
    page_bytes: u64,
) -> Result<(Option<Arc<dyn Storage>>, usize)> {
    let mut left_out = 0;
    let cap = parse_size(&a.l3_size).context("--l3-size")?;
    let mut tiers: Vec<Arc<dyn Storage>> = Vec::new();
    for spec in &a.l3 {
        if let Some(path) = spec.strip_prefix("disk:").filter(|p| !p.is_empty()) {
            let d = DiskStorage::open(PathBuf::from(path), cap, false)
                .with_context(|| format!("--l3 {spec}"))?
                .with_key(key)
                .with_page_bytes(page_bytes);
            tracing::info!(
                path,
                capacity_bytes = cap,
                "L3 disk tier ready (capacity in bytes)"
            );
            tiers.push(Arc::new(d));
        } else if is_redis(spec) {
            let cfg = strata_redis::RedisConfig {
                url: spec.clone(),
                namespace: ns.to_string(),
                ttl: (a.l3_ttl > 0).then(|| Duration::from_secs(a.l3_ttl)),
                timeout: Duration::from_millis(a.l3_timeout_ms.max(1)),
                page_key: key,
                max_value_bytes: page_bytes + strata_kv::storage::blob::HEADER as u64,
            };
            match strata_redis::RedisStorage::connect(&cfg) {
                Ok(r) => {
                    let url = strata_kv::units::shown_url(spec);
                    tracing::info!(url = %url, namespace = ns, "L3 remote tier (Redis) ready");
                    tiers.push(Arc::new(r));
                }
                Err(e) => {
                    left_out += 1;
                    let url = strata_kv::units::shown_url(spec);
                    tracing::warn!(url = %url, error = %e, "L3 remote tier unavailable at start: serving without it");
                    say!("strata serve: L3 remote tier {url} unavailable at start ({e}): serving without it");
                }
            }
        } else {
            bail!("--l3 `{spec}`: {L3_SPECS}");
        }
    }
    let tiers: Option<Arc<dyn Storage>> = match tiers.len() {
        0 => None,
        1 => tiers.pop(),
        _ => Some(Arc::new(strata_kv::storage::Chain::new(tiers))),
    };
    Ok((tiers, left_out))
}

/// The tiered cache: device and host pools as planned, the L3 tiers of `--l3`; also its L3
/// tiers for the metrics.
pub(super) fn build_cache(
    a: &ServeArgs,
    c: &Checked,
    path: &std::path::Path,
    req: &PlanRequest,
    plan: &Plan,
    layout: PageLayout,
    rank_allocs: &super::tp::RankAllocators,
) -> Result<(TieredCache, L3)> {
    let ps = req.page_size;
    let device_pages = (plan.device_tokens_per_rank / ps as u64) as u32;
    let host_pages = (plan.host_tokens_per_rank / ps as u64) as u32;
    let mut alloc = NumaAllocator::new(plan.numa.nodes.clone(), req.policy);
    alloc.huge_pages = a.sizing.huge_pages;
    // Pools under 1 GiB pre-fault in well under a second: no progress line for them.
    alloc.progress = Some(crate::sizing::prefault_progress(
        "host pool".into(),
        1 << 30,
    ));
    let ns_key = strata_kv::HashNamespace::new(&model_id(path), &layout).key();
    let ns: String = ns_key[..8].iter().map(|b| format!("{b:02x}")).collect();
    let blob_key = c
        .cluster_key
        .as_ref()
        .map(strata_kv::storage::blob::BlobKey::from_cluster)
        .unwrap_or_default()
        .for_layout(&layout);
    let (storage, l3_unavailable) = l3_storage(a, &ns, blob_key, layout.page_bytes() as u64)?;
    let l3 = L3 {
        tier: storage.as_ref().map(|s| s.tier()).unwrap_or("disk").into(),
        unavailable: l3_unavailable,
        storage: storage.clone(),
    };
    let mut cc = CacheConfig::new(layout, device_pages, host_pages);
    if cc.layout.has_window() {
        cc.device_window_pages = (plan.device_window_tokens_per_rank / ps as u64) as u32;
        cc.host_window_pages = (plan.host_window_tokens_per_rank / ps as u64) as u32;
    }
    cc.model_id = model_id(path);
    cc.write_policy = a.write_policy;
    // The plan refused checkpoints for a model without window kinds.
    cc.window_checkpoint_pages = plan.window_checkpoint_pages as usize;
    cc.eviction = c.eviction;
    cc.curve_pages = a.curve_pages;
    // The curve's answer: one more GiB per rank (a page holds every rank's part).
    cc.curve_step_bytes = (1u64 << 30) * plan.tp.max(1) as u64;
    cc.hashing = true;
    cc.copy_threads = a.copy_threads;
    // Each kind from its rank's allocators (the layout holds the ranks' kinds in rank order).
    let per_rank = cc.layout.kinds().len() / rank_allocs.0.len().max(1);
    let (host, device) = (
        super::tp::per_kind(&rank_allocs.0, per_rank),
        super::tp::per_kind(&rank_allocs.1, per_rank),
    );
    let cache = TieredCache::with_allocators(cc, &alloc, &host, &device, storage)?;
    Ok((cache, l3))
}

/// The L3 tiers as the metrics see them.
pub(super) struct L3 {
    /// Label of its hit tokens (`disk`, `remote`, `disk+remote`).
    pub tier: String,
    /// Tiers given with `--l3` but unreachable at start.
    pub unavailable: usize,
    pub storage: Option<Arc<dyn Storage>>,
}
