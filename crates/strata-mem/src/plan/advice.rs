//! What the operator is told about a plan: the refusal when it does not fit (with the size
//! that would, in the flag and unit given, and the alternatives) and the warnings when it
//! fits but is probably not what was meant.

use strata_kv::units::format_bytes;

use super::{
    gb, typed_like, DeviceBudget, HostBudget, NumaPolicy, PlanError, PlanRequest, Room, Sizes,
    SMALL_POOL_SHARE,
};
use crate::topology::Topology;

/// The one-line refusal when the pools exceed the room: what was asked, what is there, and
/// the alternatives.
pub(super) fn does_not_fit(
    req: &PlanRequest,
    topo: &Topology,
    room: &Room,
    s: &Sizes,
    where_: &str,
) -> PlanError {
    let ht = req.host_text.as_deref();
    let fit = fitting_flag(req, room, s);
    let all_avail: u64 = topo.nodes.iter().map(|n| n.available_bytes).sum();
    let mut alts = vec![match fit {
        Some(fit) => format!("a smaller size ({fit} fits)"),
        None if req.host.is_some() && req.device_in_host_memory => {
            "no host tier fits beside the device pools in host memory: a smaller --device-mem"
                .into()
        }
        None => "no smaller size: what the reserve leaves holds less than one page".into(),
    }];
    // What the server holds beside its pools, when without it the pools would fit: its flag.
    let without = |b: u64| room.avail.saturating_sub(room.reserve.saturating_sub(b));
    for (flag, b) in room.beside.iter().filter(|b| without(b.1) >= s.needed) {
        alts.insert(0, format!("a smaller {flag} (now {})", format_bytes(*b)));
    }
    if topo.nodes.len() > 1 && req.policy != NumaPolicy::Interleave {
        alts.push(format!(
            "--numa-policy interleave ({} available on all {} nodes, slower remote accesses)",
            format_bytes(all_avail),
            topo.nodes.len()
        ));
        alts.push("split the cache over servers bound to different nodes (e.g. prefill on node 0, decode on node 1, each with half)".into());
    }
    let asked = asked_for(req, s);
    PlanError::DoesNotFit(format!(
        "{asked}{} does not fit {where_} ({}): {} available ({source}) minus {} reserve{weights} leaves {}; alternatives: {}",
        if req.device_in_host_memory && req.host.is_some() { format!(" + {} of device pools in host memory", typed_like(s.server_device, ht)) } else { String::new() },
        req.policy.name(),
        format_bytes(room.avail),
        format_bytes(room.reserve),
        format_bytes(room.usable),
        alts.join("; "),
        source = room.source,
        weights = super::render::reserve_parts(room.weights, &room.beside),
    ))
}

/// The size that would fit, as the flag that was given, in the unit it was given in; `None`
/// when not even one page fits (advice to type 0 would turn the tier off, or be refused).
fn fitting_flag(req: &PlanRequest, room: &Room, s: &Sizes) -> Option<String> {
    let (tp, c) = (s.tp, &s.host_cost);
    let ht = req.host_text.as_deref();
    let fit_host_server = room.usable.saturating_sub(if req.device_in_host_memory {
        s.server_device
    } else {
        0
    });
    let fit_tokens = c.tokens_for(fit_host_server / tp);
    if req.host.is_some() && fit_tokens == 0 {
        return None;
    }
    // The advice names the flag that was given, in the unit it was given in.
    Some(match req.host {
        Some(HostBudget::PerRank(_)) => {
            format!(
                "--hicache-size {} per rank",
                typed_like(c.bytes(fit_tokens), ht)
            )
        }
        Some(HostBudget::Ratio(_)) => format!(
            "--hicache-ratio {:.2}",
            fit_tokens as f64 / s.device_tokens as f64
        ),
        Some(HostBudget::Total(_)) => {
            format!(
                "--hicache-total {}",
                typed_like(c.bytes(fit_tokens) * tp, ht)
            )
        }
        None => {
            let d = &s.cost;
            let dev_tokens = d.tokens_for(room.usable / tp);
            if dev_tokens == 0 {
                return None;
            }
            let dev_fit = d.bytes(dev_tokens);
            match req.device {
                DeviceBudget::Bytes(_) => format!(
                    "--device-mem {} per rank",
                    typed_like(dev_fit, req.device_text.as_deref())
                ),
                DeviceBudget::FractionOfFree(_) => format!(
                    "--device-mem-fraction {:.2}",
                    dev_fit as f64 * tp as f64 / room.avail.max(1) as f64
                ),
            }
        }
    })
}

/// What the flags asked for, per rank and per server, as typed.
fn asked_for(req: &PlanRequest, s: &Sizes) -> String {
    let tp = s.tp;
    let ht = req.host_text.as_deref();
    match req.host {
        Some(HostBudget::PerRank(b)) => format!(
            "--hicache-size {} per rank × {tp} {} = {}",
            typed_like(b, ht),
            ranks(tp),
            typed_like(b.saturating_mul(tp), ht)
        ),
        Some(HostBudget::Total(b)) => format!(
            "--hicache-total {} ({tp} {} × {})",
            typed_like(b, ht),
            ranks(tp),
            typed_like(b / tp, ht)
        ),
        Some(HostBudget::Ratio(r)) => format!(
            "--hicache-ratio {r} = {} ({tp} ranks × {})",
            gb(s.server_host),
            gb(s.host_bytes)
        ),
        None => format!(
            "--device-mem {} per rank × {tp} {}",
            typed_like(s.device_budget, req.device_text.as_deref()),
            ranks(tp)
        ),
    }
}

fn ranks(tp: u64) -> &'static str {
    if tp == 1 {
        "rank"
    } else {
        "ranks"
    }
}

/// Plans that fit but are probably not what the operator meant.
pub(super) fn warnings(
    req: &PlanRequest,
    topo: &Topology,
    room: &Room,
    s: &Sizes,
    where_: &str,
) -> Vec<String> {
    let mut warnings = Vec::new();
    let (host_tokens, device_tokens) = (s.host_tokens, s.device_tokens);
    if let Some(HostBudget::Ratio(r)) = req.host {
        let share = s.server_host as f64 / room.avail.max(1) as f64;
        if share < SMALL_POOL_SHARE {
            let half = room.usable / 2;
            warnings.push(format!(
                "--hicache-ratio {r} sized the host cache from the device pool: {host_tokens} tokens = {} per rank, {} per server, only {:.1}% of {where_}'s {} available. The ratio multiplies this server's device pool, which is small on a prefill server; ask for the size directly, e.g. --hicache-total {} (or --hicache-size {} per rank) for half the node",
                format_bytes(s.host_bytes),
                format_bytes(s.server_host),
                share * 100.0,
                format_bytes(room.avail),
                gb(half),
                gb(half / s.tp),
            ));
        }
    }
    if host_tokens > 0 && host_tokens < device_tokens {
        warnings.push(format!(
            "the host tier ({host_tokens} tokens per rank) is smaller than the device tier ({device_tokens}): with write-through it only mirrors part of the device and caches nothing beyond it; make it at least as large"
        ));
    }
    if req.policy == NumaPolicy::Preferred
        && s.needed > topo.node(room.nodes[0]).map_or(0, |n| n.available_bytes)
    {
        warnings.push(format!("--numa-policy preferred: {} exceeds node {}'s available memory and will spill to other nodes", format_bytes(s.needed), room.nodes[0]));
    }
    warnings
}
