//! `--numa-nodes`: each tensor-parallel rank's pools on its own NUMA node. The nodes chosen
//! are the ranks' nodes; each node must hold the pools of the ranks placed on it.

use strata_kv::units::format_bytes;

use super::cost::Cost;
use super::{NumaChoice, NumaPolicy, PlanError, PlanRequest};
use crate::topology::Topology;

/// The default reserve of one node: 10 % of it, at most 10 GiB.
pub(super) fn node_reserve(req: &PlanRequest, total: u64) -> u64 {
    req.reserve.unwrap_or_else(|| (total / 10).min(10 << 30))
}

/// With `--numa-nodes`: the distinct nodes of the ranks and the line saying where each rank
/// goes; None otherwise.
pub(super) fn rank_nodes(
    req: &PlanRequest,
    topo: &Topology,
) -> Option<Result<(Vec<u32>, String), PlanError>> {
    let NumaChoice::Ranks(each) = &req.numa else {
        return None;
    };
    Some((|| {
        if each.len() != req.tp as usize {
            return Err(PlanError::RankNodes(format!(
                "lists {} nodes for --tp-size {}: give one per rank or one for all",
                each.len(),
                req.tp
            )));
        }
        if req.policy == NumaPolicy::Interleave {
            return Err(PlanError::RankNodes(
                "places each rank on its node; --numa-policy interleave spreads every pool over \
                 all nodes: use bind or preferred"
                    .into(),
            ));
        }
        let mut nodes = each.clone();
        nodes.sort_unstable();
        nodes.dedup();
        if let Some(&n) = nodes.iter().find(|&&n| topo.node(n).is_none()) {
            let have: Vec<String> = topo.ids().iter().map(u32::to_string).collect();
            return Err(PlanError::RankNodes(format!(
                "node {n} is not on this machine (it has {})",
                have.join(", ")
            )));
        }
        let list: Vec<String> = each
            .iter()
            .enumerate()
            .map(|(r, n)| format!("rank {r} on node {n}"))
            .collect();
        Ok((nodes, format!("--numa-nodes: {}", list.join(", "))))
    })())
}

/// Each node holds the pools of its ranks (host pools, and device pools when they are in host
/// memory) within what it has available minus its reserve.
pub(super) fn check_rank_nodes(
    req: &PlanRequest,
    topo: &Topology,
    rank_costs: &[(Cost, Cost)],
    device_tokens: u64,
    host_tokens: u64,
) -> Result<(), PlanError> {
    let NumaChoice::Ranks(each) = &req.numa else {
        return Ok(());
    };
    let mut nodes = each.clone();
    nodes.sort_unstable();
    nodes.dedup();
    for n in nodes {
        let node = topo.node(n).expect("checked by rank_nodes");
        let ranks: Vec<usize> = (0..each.len()).filter(|&r| each[r] == n).collect();
        let need: u64 = ranks
            .iter()
            .map(|&r| {
                let (d, h) = &rank_costs[r];
                h.bytes(host_tokens)
                    + if req.device_in_host_memory {
                        d.bytes(device_tokens)
                    } else {
                        0
                    }
            })
            .sum();
        // Each rank holds its share of the weights (a split of the model's parts) and its
        // forward calls' scratch.
        let weights = if req.device_in_host_memory {
            let share = req.model.weights_bytes / u64::from(req.tp.max(1));
            ranks
                .iter()
                .map(|&r| share.saturating_add(req.scratch.rank_bytes(r, device_tokens)))
                .fold(0, u64::saturating_add)
        } else {
            0
        };
        let reserve = node_reserve(req, node.total_bytes).saturating_add(weights);
        let usable = node.available_bytes.saturating_sub(reserve);
        if need > usable {
            return Err(PlanError::DoesNotFit(format!(
                "node {n}: ranks {ranks:?} need {} but it has {} usable ({} available − {} \
                 reserve); lower --device-mem / --hicache-size or spread the ranks over more \
                 nodes with --numa-nodes",
                format_bytes(need),
                format_bytes(usable),
                format_bytes(node.available_bytes),
                format_bytes(reserve)
            )));
        }
    }
    Ok(())
}
