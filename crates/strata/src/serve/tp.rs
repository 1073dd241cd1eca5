//! `strata serve --tp-size N --numa-nodes ...`: where each tensor-parallel rank runs, the
//! allocators of its host and device pools, and the check that what is built is what the plan
//! printed.

use std::sync::Arc;

use anyhow::{bail, Result};
use strata_kv::memory::HostAllocator;
use strata_kv::tp::even_runs;
use strata_kv::PageLayout;
use strata_mem::{NumaAllocator, NumaPolicy, Topology};
use strata_model::{LoadOptions, ModelTokenizer, RankPlacement};

/// Each rank's node and CPUs from `--numa-nodes` (one node per rank, or one for all): ranks
/// on one node split its CPUs (those this process may use) into even runs, or share them
/// all when there are fewer CPUs than ranks. No nodes: ranks unpinned (none for one rank:
/// the whole model on the process's thread pool).
pub fn placements(
    nodes: &[u32],
    tp: usize,
    topo: &Topology,
    allowed: &[u32],
) -> Result<Vec<RankPlacement>> {
    if nodes.is_empty() {
        return Ok(if tp == 1 {
            Vec::new()
        } else {
            vec![RankPlacement::default(); tp]
        });
    }
    if nodes.len() != 1 && nodes.len() != tp {
        bail!(
            "--numa-nodes lists {} nodes for --tp-size {tp}: give one per rank or one for all",
            nodes.len()
        );
    }
    let node_of = |r: usize| nodes[if nodes.len() == 1 { 0 } else { r }];
    let mut out = vec![RankPlacement::default(); tp];
    let mut seen = Vec::new();
    for r in 0..tp {
        let n = node_of(r);
        if seen.contains(&n) {
            continue;
        }
        seen.push(n);
        let Some(node) = topo.node(n) else {
            bail!(
                "--numa-nodes: node {n} is not on this machine (nodes: {:?})",
                topo.ids()
            );
        };
        let cpus: Vec<usize> = node
            .cpus
            .iter()
            .filter(|c| allowed.is_empty() || allowed.contains(c))
            .map(|&c| c as usize)
            .collect();
        if cpus.is_empty() {
            bail!(
                "--numa-nodes: node {n} has no CPU this process may run on (its CPUs {:?}, \
                 allowed {allowed:?})",
                node.cpus
            );
        }
        let ranks: Vec<usize> = (0..tp).filter(|&q| node_of(q) == n).collect();
        let runs = even_runs(cpus.len(), ranks.len());
        for (i, &q) in ranks.iter().enumerate() {
            let mine = if cpus.len() >= ranks.len() {
                cpus[runs[i].clone()].to_vec()
            } else {
                cpus.clone()
            };
            out[q] = RankPlacement {
                node: Some(n),
                cpus: Some(mine),
            };
        }
    }
    Ok(out)
}

/// Each rank's host and device pool allocators ([`rank_allocators`]).
pub type RankAllocators = (Vec<Box<dyn HostAllocator>>, Vec<Box<dyn HostAllocator>>);

/// The model's runtime, tokenizer and chat template, and where its ranks run.
pub type LoadedModel = (
    Box<dyn strata_model::Runtime>,
    ModelTokenizer,
    Option<Arc<strata_model::ChatTemplate>>,
    Vec<strata_model::RankPlacement>,
);

/// The model with its tokenizer and template, its tensor-parallel ranks placed by
/// `--numa-nodes` (each rank's line logged and printed).
pub fn load_model(
    sizing: &crate::sizing::SizingArgs,
    quantized_decode: bool,
    topo: &strata_mem::Topology,
) -> Result<LoadedModel> {
    let (tp, threads) = (sizing.tp_size as usize, sizing.threads);
    let allowed = crate::sizing::allowed_cpus();
    let ranks = placements(&sizing.numa_nodes, tp, topo, &allowed)?;
    std::env::set_var("RAYON_NUM_THREADS", threads.max(1).to_string());
    let path = sizing
        .model
        .as_deref()
        .expect("the model's path is known by now");
    let loaded = strata_model::load(
        path,
        LoadOptions {
            threads: (threads / tp).max(1),
            quantized_decode,
            ranks: ranks.clone(),
            kv_dtype: sizing.kv_dtype.kv().0,
            v_dtype: Some(sizing.kv_dtype.kv().1),
        },
    )?;
    for line in describe(&*loaded.runtime, &ranks, sizing.page_size) {
        tracing::info!("{line}");
        say!("strata serve: {line}");
    }
    // Measured here, at start, where the one-row kernel is chosen by throughput.
    let kernels = strata_model::qmat::kernel_description();
    tracing::info!("integer kernels: {kernels}");
    say!("strata serve: integer kernels: {kernels}");
    let template = loaded.template.map(Arc::new);
    Ok((loaded.runtime, loaded.tokenizer, template, ranks))
}

/// Each rank's pools' allocators (one per pool kind: the rank's), host then device: with
/// `--numa-nodes`, both bound to the rank's node under `--numa-policy` (pages verified where
/// bind); without, none for the host (the plan's one allocator) and the heap for the device.
pub fn rank_allocators(
    placements: &[RankPlacement],
    policy: NumaPolicy,
    huge_pages: bool,
) -> RankAllocators {
    if placements.iter().all(|p| p.node.is_none()) {
        // The cache's defaults: one host region from the plan's allocator, heap device pools.
        return (Vec::new(), Vec::new());
    }
    let on = |r: usize, n: u32, pool: &str, huge: bool| -> Box<dyn HostAllocator> {
        let mut a = NumaAllocator::new(vec![n], policy);
        a.huge_pages = huge;
        a.progress = Some(crate::sizing::prefault_progress(
            format!("rank {r} {pool} pool"),
            1 << 30,
        ));
        Box::new(a)
    };
    let node = |p: &RankPlacement| p.node.expect("every rank placed");
    let host = placements.iter().enumerate();
    let host = host
        .map(|(r, p)| on(r, node(p), "host", huge_pages))
        .collect();
    let device = placements.iter().enumerate();
    let device = device
        .map(|(r, p)| on(r, node(p), "device", false))
        .collect();
    (host, device)
}

/// The plan sized every pool kind the model's pages hold, with the same bytes per token: what
/// was printed is what is allocated. With tensor-parallel ranks the layout holds each rank's
/// kinds in rank order (`kv.tpR`, or DeepSeek-V4's `raw.tpR`, `csa.tpR`, ...), each with the
/// bytes per token the plan states for that rank.
pub fn check_plan_layout(plan: &strata_mem::plan::Plan, layout: &PageLayout) -> Result<()> {
    let planned: Vec<(String, u64)> = if plan.tp > 1 {
        let ranks = 0..plan.tp as usize;
        ranks
            .flat_map(|r| {
                plan.pools.iter().map(move |p| {
                    let b = p.rank_bytes_per_token.get(r).copied().unwrap_or(0);
                    (strata_kv::tp::rank_kind_name(&p.kind, r), b)
                })
            })
            .collect()
    } else {
        plan.pools
            .iter()
            .map(|p| (p.kind.clone(), p.bytes_per_token))
            .collect()
    };
    let built: Vec<(String, u64)> = layout
        .kinds()
        .iter()
        .map(|k| (k.name.clone(), k.bytes_per_token() as u64))
        .collect();
    if planned != built {
        bail!(
            "the plan's pool kinds {planned:?} differ from the model's {built:?} (bytes per token)"
        );
    }
    Ok(())
}

/// A rank's node and CPUs as metric labels (`any`, `unpinned` when not placed).
pub fn placement_labels(p: &RankPlacement) -> (String, String) {
    let node = p.node.map_or("any".to_string(), |n| n.to_string());
    let cpus = p.cpus.as_ref().map_or("unpinned".to_string(), |c| {
        let c: Vec<String> = c.iter().map(usize::to_string).collect();
        c.join(",")
    });
    (node, cpus)
}

/// One line per rank for the log and stderr: its pools, node and CPUs.
pub fn describe(
    model: &dyn strata_model::Runtime,
    placements: &[RankPlacement],
    page_size: usize,
) -> Vec<String> {
    let kinds = model.pool_kinds(page_size).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "the ranks' pool kinds could not be listed");
        Vec::new()
    });
    let per = kinds.len() / placements.len().max(1);
    placements
        .iter()
        .enumerate()
        .map(|(r, p)| {
            let node = p
                .node
                .map_or("any node".to_string(), |n| format!("node {n}"));
            let cpus = p
                .cpus
                .as_ref()
                .map_or("unpinned".to_string(), |c| format!("CPUs {c:?}"));
            let Some(mine) = kinds.get(r * per..(r + 1) * per).filter(|k| !k.is_empty()) else {
                return format!("rank {r}: pools unknown (see the error above), {node}, {cpus}");
            };
            let names: Vec<String> = mine.iter().map(|k| format!("`{}`", k.name)).collect();
            let bytes: usize = mine.iter().map(|k| k.bytes_per_token()).sum();
            format!(
                "rank {r}: pool{} {} ({bytes} bytes of state per token), {node}, {cpus}",
                if names.len() == 1 { "" } else { "s" },
                names.join(", ")
            )
        })
        .collect()
}

/// One allocator per pool kind from one per rank (`per_rank` kinds each).
pub fn per_kind(allocs: &[Box<dyn HostAllocator>], per_rank: usize) -> Vec<&dyn HostAllocator> {
    let kinds = 0..allocs.len() * per_rank;
    kinds.map(|k| &*allocs[k / per_rank]).collect()
}

/// The plan's figures for `/metrics`, with where the host pool's pages landed (logged).
pub fn plan_gauges(
    plan: &strata_mem::plan::Plan,
    cache: &strata_kv::cache::TieredCache,
    ranks: &[strata_model::RankPlacement],
) -> strata_server::metrics::PlanGauges {
    let mut gauges = strata_server::metrics::PlanGauges {
        rank_placement: ranks.iter().map(placement_labels).collect(),
        pools: plan
            .pools
            .iter()
            .map(|p| strata_server::metrics::PoolGauge {
                kind: p.kind.clone(),
                device_bytes: p
                    .rank_bytes_per_token
                    .iter()
                    .map(|b| b * p.device_tokens)
                    .collect(),
                host_bytes: p
                    .rank_bytes_per_token
                    .iter()
                    .map(|b| b * p.host_tokens)
                    .collect(),
            })
            .collect(),
        ranks: plan.tp,
        host_flag: plan
            .decided_by
            .iter()
            .find(|d| d.what == "host tokens per rank")
            .map(|d| d.by.split_whitespace().next().unwrap_or("").to_string())
            .unwrap_or_else(|| "none".into()),
        numa_policy: plan.numa.policy.name().into(),
        numa_nodes: plan.numa.nodes.clone(),
        placement: Vec::new(),
    };
    if let Some(h) = cache.host_pool().filter(|h| h.bytes() > 0) {
        let p = strata_mem::numa::placement_of_pool(h);
        let sampled = p.sampled_pages.max(1);
        gauges.placement = p
            .pages_per_node
            .iter()
            .filter(|(n, _)| **n >= 0)
            .map(|(n, k)| (*n as u32, h.bytes() as u64 * k / sampled))
            .collect();
        tracing::info!(
            bytes = h.bytes(),
            size = %strata_kv::units::format_bytes(h.bytes() as u64),
            placement = %p.describe(),
            "host pool allocated (bytes)"
        );
    }
    gauges
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_mem::topology::Node;

    fn topo() -> Topology {
        let node = |id, cpus: &[u32]| Node {
            id,
            cpus: cpus.to_vec(),
            total_bytes: 64 << 30,
            available_bytes: 60 << 30,
            source: "test".into(),
        };
        Topology {
            nodes: vec![node(0, &[0, 1, 2, 3]), node(1, &[4, 5, 6, 7])],
        }
    }

    #[test]
    fn ranks_take_their_nodes_cpus() {
        let t = topo();
        let all: Vec<u32> = (0..8).collect();
        let p = placements(&[0, 1], 2, &t, &all).unwrap();
        assert_eq!(p[0].cpus, Some(vec![0, 1, 2, 3]));
        assert_eq!(
            (p[1].node, p[1].cpus.clone()),
            (Some(1), Some(vec![4, 5, 6, 7]))
        );
        // Two ranks per node split its CPUs.
        let p = placements(&[0, 1, 0, 1], 4, &t, &all).unwrap();
        let cpus: Vec<_> = p.iter().map(|r| r.cpus.clone().unwrap()).collect();
        assert_eq!(cpus, vec![vec![0, 1], vec![4, 5], vec![2, 3], vec![6, 7]]);
        // One node for all; only the CPUs this process may use; fewer CPUs than ranks: shared.
        let p = placements(&[1], 3, &t, &[5, 6]).unwrap();
        assert!(p.iter().all(|r| r.node == Some(1)));
        assert_eq!(p[0].cpus, Some(vec![5, 6]));
        assert_eq!(p[2].cpus, Some(vec![5, 6]));
        assert!(placements(&[], 1, &t, &all).unwrap().is_empty());
        assert_eq!(
            placements(&[], 2, &t, &all).unwrap(),
            vec![RankPlacement::default(); 2]
        );
    }

    #[test]
    fn bad_nodes_are_refused() {
        let t = topo();
        let e = placements(&[0, 1, 1], 2, &t, &[]).unwrap_err().to_string();
        assert!(e.contains("lists 3 nodes for --tp-size 2"), "{e}");
        let e = placements(&[2], 2, &t, &[]).unwrap_err().to_string();
        assert!(
            e.contains("node 2 is not on this machine (nodes: [0, 1])"),
            "{e}"
        );
        let e = placements(&[0, 1], 2, &t, &[0, 1]).unwrap_err().to_string();
        assert!(
            e.contains("node 1 has no CPU this process may run on"),
            "{e}"
        );
    }
}
