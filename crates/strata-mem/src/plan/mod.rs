//! The sizing planner: from flags and topology to exact per-rank, per-pool numbers, validated
//! before anything is allocated.

use strata_kv::units::format_bytes;
use strata_kv::PoolKind;

use crate::model::KindSpec;
use crate::topology::Topology;

pub use types::{
    Copies, Decision, DeviceBudget, HostBudget, NumaChoice, NumaPlan, NumaPolicy, Plan, PlanError,
    PlanRequest, PoolPlan, Scratch,
};

/// Most ranks one server runs (`--tp-size`): far past any machine's sockets and devices, and
/// small enough that per-rank tables and sums stay small.
pub const MAX_TP: u32 = 256;
/// Largest `--hicache-ratio` (host tokens per device token).
pub const MAX_RATIO: f64 = 1000.0;

/// Share of a node below which a ratio-sized host pool is called out.
pub const SMALL_POOL_SHARE: f64 = 0.10;

/// `150GB (150000000000 bytes)`: in the unit typed, and exact.
fn gbx(b: u64, typed: Option<&str>) -> String {
    match typed {
        Some(t) => strata_kv::units::echo_size(b, t),
        None => format!("{} ({b} bytes)", gb(b)),
    }
}

/// A value to type back into a flag, in the unit the operator used.
fn typed_like(b: u64, typed: Option<&str>) -> String {
    match typed {
        Some(t) => strata_kv::units::in_unit_of(b, t),
        None => gb(b),
    }
}

fn gb(b: u64) -> String {
    // Decimal GB with two decimals, as operators write flags.
    format!("{:.2}GB", b as f64 / 1e9)
}

impl PlanRequest {
    /// Each rank's pool kinds (ranks with fewer KV heads than the largest hold less).
    pub fn rank_pool_kinds(&self) -> Result<Vec<Vec<PoolKind>>, PlanError> {
        let heads: Vec<Vec<usize>> = self
            .model
            .kinds
            .iter()
            .map(|k| k.heads_of_ranks(self.tp))
            .collect();
        (0..self.tp as usize)
            .map(|r| {
                self.model
                    .kinds
                    .iter()
                    .zip(&heads)
                    .map(|(k, heads)| {
                        let heads = heads[r];
                        let one = KindSpec {
                            heads,
                            split_across_tp: false,
                            ..k.clone()
                        };
                        one.per_rank(1, self.page_size)
                            .map_err(|why| PlanError::PageFit {
                                page_size: self.page_size,
                                why,
                            })
                    })
                    .collect()
            })
            .collect()
    }

    /// The model's pool kinds on one rank (the largest) in pages of the requested size: what
    /// each rank's pools are sized for.
    pub fn pool_kinds(&self) -> Result<Vec<PoolKind>, PlanError> {
        self.model
            .kinds
            .iter()
            .map(|k| {
                k.per_rank(self.tp, self.page_size)
                    .map_err(|why| PlanError::PageFit {
                        page_size: self.page_size,
                        why,
                    })
            })
            .collect()
    }
}

/// Each rank's cost of a token and bytes per token (ranks with fewer KV heads hold less).
fn rank_costs(req: &PlanRequest) -> Result<(Vec<Cost>, Vec<u64>), PlanError> {
    let kinds = req.rank_pool_kinds()?;
    let costs = kinds
        .iter()
        .map(|k| Cost::new(k, Share::Ratio(1.0), req.page_size as u64))
        .collect();
    let bpt = kinds
        .iter()
        .map(|k| k.iter().map(|k| k.bytes_per_token() as u64).sum())
        .collect();
    Ok((costs, bpt))
}

/// Builds and validates the plan. Nothing is allocated here.
pub fn make_plan(req: &PlanRequest, topo: &Topology) -> Result<Plan, PlanError> {
    validate(req)?;
    let ps = req.page_size as u64;
    let kinds = req.pool_kinds()?;
    let bpt: u64 = kinds.iter().map(|k| k.bytes_per_token() as u64).sum();
    let base = Cost::new(&kinds, Share::Ratio(1.0), ps);
    window::validate(req, &base)?;
    let (rank_costs, rank_bpt) = rank_costs(req)?;
    let (mut decided, mut window_warnings) = (Vec::new(), Vec::new());

    // NUMA placement first: the fraction-of-free device budget needs it.
    let mut room = numa_room(req, topo, &mut decided)?;

    let (device_budget, device_tokens, host_tokens, wplan) =
        budgets(req, &base, room.avail, &mut decided, &mut window_warnings)?;
    let (cost, host_cost) = (base.with(wplan.device), base.with(wplan.host));
    let (dw, hw) = (
        cost.window_tokens(device_tokens),
        host_cost.window_tokens(host_tokens),
    );
    window_decisions(req, device_tokens, dw, &mut decided)?;
    room.hold(Scratch::LABEL, scratch_bytes(req, device_tokens));

    let pools = pool_plans(req, &kinds, ps, (device_tokens, dw), (host_tokens, hw))?;
    kinds_decision(&cost, kinds.len(), ps, &mut decided);
    kv_dtype_decision(req, &mut decided);
    let rank_costs: Vec<(Cost, Cost)> = rank_costs
        .iter()
        .map(|c| (c.with(wplan.device), c.with(wplan.host)))
        .collect();
    let s = Sizes::new(
        req,
        (&cost, &host_cost),
        &rank_costs,
        device_budget,
        device_tokens,
        host_tokens,
    );
    let where_ = where_of(&room.nodes);

    if s.needed > room.usable {
        return Err(advice::does_not_fit(req, topo, &room, &s, &where_));
    }
    ranks::check_rank_nodes(req, topo, &rank_costs, device_tokens, host_tokens)?;
    let mut warnings = advice::warnings(req, topo, &room, &s, &where_);
    warnings.extend(window_warnings);

    Ok(Plan {
        role: req.role.clone(),
        model: req.model.name.clone(),
        tp: req.tp,
        page_size: req.page_size,
        bytes_per_token: bpt,
        rank_bytes_per_token: rank_bpt,
        pools,
        device_tokens_per_rank: device_tokens,
        host_tokens_per_rank: host_tokens,
        device_window_tokens_per_rank: dw,
        host_window_tokens_per_rank: hw,
        window_checkpoint_pages: wplan.k,
        device_bytes_per_rank: s.device_bytes,
        host_bytes_per_rank: s.host_bytes,
        server_device_bytes: s.server_device,
        server_host_bytes: s.server_host,
        numa: NumaPlan {
            policy: req.policy,
            nodes: room.nodes,
            available_bytes: room.avail,
            source: room.source,
            reserve_bytes: room.reserve,
            weights_bytes: room.weights,
            beside: room.beside,
            needed_bytes: s.needed,
            headroom_bytes: room.usable - s.needed,
        },
        decided_by: decided,
        warnings,
    })
}

/// What a quantized K/V dtype does to the bytes per token (nothing said for f16).
fn kv_dtype_decision(req: &PlanRequest, decided: &mut Vec<Decision>) {
    use strata_kv::dtype::Dtype;
    let kv: Vec<&KindSpec> = req
        .model
        .kinds
        .iter()
        .filter(|k| k.split_across_tp)
        .collect();
    if kv.iter().all(|k| k.dtype == Dtype::F16) {
        return;
    }
    let bytes = |k: &KindSpec, d: Dtype| {
        let one = KindSpec {
            dtype: d,
            ..k.clone()
        };
        one.item_bytes(1).unwrap_or(0) * k.planes * k.layers
    };
    let now: usize = kv.iter().map(|k| bytes(k, k.dtype)).sum();
    let f16: usize = kv.iter().map(|k| bytes(k, Dtype::F16)).sum();
    let stored = match kv.as_slice() {
        [one] => format!("K and V as {}", one.dtype),
        _ => kv
            .iter()
            .map(|k| format!("{} as {}", k.name.to_uppercase(), k.dtype))
            .collect::<Vec<_>>()
            .join(", "),
    };
    decided.push(Decision {
        what: "K/V dtype".into(),
        by: format!(
            "--kv-cache-dtype / --cache-type-k / --cache-type-v: {stored}: {now} bytes per token \
             (whole model, one rank) where f16 takes {f16}: {:.2}× the tokens per byte in every \
             tier; pages record it (a page of another dtype in L3 is a miss) and prefill and \
             decode workers must use the same one (a KV transfer between dtypes is refused at \
             its handshake; `strata up` sets one for the deployment)",
            f16 as f64 / now.max(1) as f64
        ),
    });
}

/// The device and host pools' sizes: each tier's window share first (the device's: running
/// requests' rings; the host's: sequence ends and checkpoints), then its main tokens. Returns
/// the device budget, the device and host main tokens, and the window plan.
fn budgets(
    req: &PlanRequest,
    base: &Cost,
    avail: u64,
    decided: &mut Vec<Decision>,
    warnings: &mut Vec<String>,
) -> Result<(u64, u64, u64, window::WindowPlan), PlanError> {
    let ps = req.page_size as u64;
    let device_budget = device_budget(req, avail, decided)?;
    let mut wplan = window::device_share(req, base, device_budget, decided, warnings)?;
    let cost = base.with(wplan.device);
    let device_tokens = cost.tokens_for(device_budget);
    if device_tokens == 0 {
        return Err(PlanError::DeviceTooSmall {
            budget: format_bytes(device_budget),
            tokens: device_budget / cost.per_token(),
            page_size: req.page_size,
            bpt: cost.per_token(),
        });
    }
    // The host: never more bytes than asked.
    let host_bytes = host_budget(req, base, device_tokens);
    let mut host_window = Vec::new();
    window::host_share(
        req,
        base,
        &mut wplan,
        host_bytes,
        device_tokens / ps,
        &mut host_window,
    );
    let host_tokens = host_tokens(req, &base.with(wplan.host), device_tokens, decided)?;
    decided.extend(host_window);
    Ok((device_budget, device_tokens, host_tokens, wplan))
}

/// The NUMA nodes chosen for the host pools and the room they have.
struct Room {
    nodes: Vec<u32>,
    avail: u64,
    source: String,
    /// The reserve, the model's weights and what the server holds beside its pools included.
    reserve: u64,
    /// The model's weights (in host memory beside the pools).
    weights: u64,
    /// Available minus the reserve.
    usable: u64,
    /// The reserve's parts beside the weights and the OS's headroom.
    beside: Vec<(String, u64)>,
}

impl Room {
    /// Reserves `bytes` more, for `what`.
    fn hold(&mut self, what: &str, bytes: u64) {
        if bytes > 0 {
            self.reserve = self.reserve.saturating_add(bytes);
            self.usable = self.avail.saturating_sub(self.reserve);
            self.beside.push((what.to_string(), bytes));
        }
    }
}

/// The forward pass's scratch on every rank (in host memory only where the device pools are).
fn scratch_bytes(req: &PlanRequest, device_tokens: u64) -> u64 {
    match req.device_in_host_memory {
        true => req.scratch.bytes(req.tp, device_tokens),
        false => 0,
    }
}

/// The per-rank and per-server numbers the budgets came to.
struct Sizes {
    tp: u64,
    /// The device's and the host's cost of a token.
    cost: Cost,
    host_cost: Cost,
    device_budget: u64,
    device_tokens: u64,
    host_tokens: u64,
    device_bytes: u64,
    host_bytes: u64,
    server_device: u64,
    server_host: u64,
    /// Bytes placed on the NUMA nodes: host pools, plus device pools when in host memory.
    needed: u64,
}

impl Sizes {
    /// Bytes per rank and per server of the token counts, and what lands on the NUMA nodes.
    fn new(
        req: &PlanRequest,
        (cost, host_cost): (&Cost, &Cost),
        rank_costs: &[(Cost, Cost)],
        device_budget: u64,
        device_tokens: u64,
        host_tokens: u64,
    ) -> Sizes {
        let tp = req.tp as u64;
        let device_bytes = cost.bytes(device_tokens);
        let host_bytes = host_cost.bytes(host_tokens);
        // Every rank holds the same pages; a rank with fewer heads, fewer bytes.
        // Saturating: a sum past 2^64 is past any machine, and the fit check says so.
        let sum = |f: &dyn Fn(&(Cost, Cost)) -> u64| {
            rank_costs.iter().fold(0u64, |a, c| a.saturating_add(f(c)))
        };
        let server_host = sum(&|c| c.1.bytes(host_tokens));
        let server_device = sum(&|c| c.0.bytes(device_tokens));
        let needed = server_host.saturating_add(if req.device_in_host_memory {
            server_device
        } else {
            0
        });
        Sizes {
            tp,
            cost: *cost,
            host_cost: *host_cost,
            device_budget,
            device_tokens,
            host_tokens,
            device_bytes,
            host_bytes,
            server_device,
            server_host,
            needed,
        }
    }
}

/// Rejects a request no plan can satisfy whatever the machine.
fn validate(req: &PlanRequest) -> Result<(), PlanError> {
    if req.tp == 0 || req.tp > MAX_TP {
        return Err(PlanError::Tp(req.tp));
    }
    if let Some(HostBudget::Ratio(r)) = req.host {
        if !(r.is_finite() && (0.0..=MAX_RATIO).contains(&r)) {
            return Err(PlanError::Ratio(r));
        }
    }
    if req.page_size == 0 {
        return Err(PlanError::PageSize);
    }
    if req.model.kinds.is_empty() {
        return Err(PlanError::NoPools(req.model.name.clone()));
    }
    if let Some(r) = req.window_ratio {
        if !(r > 0.0 && r <= 1.0) {
            return Err(PlanError::WindowRatio(r));
        }
    }
    Ok(())
}

/// Chooses the NUMA nodes (with the reason for an automatic choice) and sums their room.
fn numa_room(
    req: &PlanRequest,
    topo: &Topology,
    decided: &mut Vec<Decision>,
) -> Result<Room, PlanError> {
    let (nodes, auto_why) = match ranks::rank_nodes(req, topo) {
        Some(r) => r.map(|(nodes, why)| (nodes, Some(why)))?,
        None => choose_nodes(req, topo)?,
    };
    let avail: u64 = nodes
        .iter()
        .map(|&n| topo.node(n).expect("checked").available_bytes)
        .sum();
    let total: u64 = nodes
        .iter()
        .map(|&n| topo.node(n).expect("checked").total_bytes)
        .sum();
    let source = nodes
        .iter()
        .map(|&n| format!("node {}: {}", n, topo.node(n).expect("checked").source))
        .collect::<Vec<_>>()
        .join("; ");
    // A reserve on each node that holds a rank's pools; else one for the nodes together.
    let reserve: u64 = match req.numa {
        NumaChoice::Ranks(_) => nodes
            .iter()
            .map(|&n| ranks::node_reserve(req, topo.node(n).expect("checked").total_bytes))
            .sum(),
        _ => ranks::node_reserve(req, total),
    };
    // The model's weights sit in host memory beside the pools: they are reserved too.
    let weights = if req.device_in_host_memory {
        req.model.weights_bytes
    } else {
        0
    };
    let beside = req.beside.iter().fold(0u64, |a, b| a.saturating_add(b.1));
    let reserve = reserve.saturating_add(weights).saturating_add(beside);
    let usable = avail.saturating_sub(reserve);
    if let Some(why) = auto_why {
        decided.push(Decision {
            what: "NUMA node".into(),
            by: why,
        });
    }
    Ok(Room {
        nodes,
        avail,
        source,
        reserve,
        weights,
        usable,
        beside: req.beside.clone(),
    })
}

/// The nodes `--numa-node` and `--numa-policy` select; for `auto`, also why.
fn choose_nodes(
    req: &PlanRequest,
    topo: &Topology,
) -> Result<(Vec<u32>, Option<String>), PlanError> {
    let have = topo
        .ids()
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    // A node named that does not exist is a mistake under any policy.
    if let NumaChoice::Node(n) = req.numa {
        if topo.node(n).is_none() {
            return Err(PlanError::NoSuchNode { node: n, have });
        }
    }
    Ok(match (req.policy, &req.numa) {
        (NumaPolicy::Interleave, _) => (topo.ids(), None),
        (_, &NumaChoice::Node(n)) => (vec![n], None),
        // Answered by `ranks::rank_nodes` before.
        (_, NumaChoice::Ranks(each)) => (each.clone(), None),
        (_, NumaChoice::Auto) => {
            let owner: Vec<u32> = topo
                .nodes
                .iter()
                .filter(|n| req.allowed_cpus.iter().any(|c| n.cpus.contains(c)))
                .map(|n| n.id)
                .collect();
            if owner.len() == 1 {
                (
                    owner.clone(),
                    Some(format!(
                        "--numa-node auto: the process runs only on node {}'s CPUs",
                        owner[0]
                    )),
                )
            } else {
                let best = topo
                    .nodes
                    .iter()
                    .max_by_key(|n| n.available_bytes)
                    .expect("nodes");
                (
                    vec![best.id],
                    Some(format!(
                        "--numa-node auto: node {} has the most available memory",
                        best.id
                    )),
                )
            }
        }
    })
}

/// Device pool bytes per rank, from `--device-mem` or a fraction of `avail`.
fn device_budget(
    req: &PlanRequest,
    avail: u64,
    decided: &mut Vec<Decision>,
) -> Result<u64, PlanError> {
    let tp = req.tp as u64;
    Ok(match req.device {
        DeviceBudget::Bytes(b) => {
            decided.push(Decision {
                what: "device tokens per rank".into(),
                by: format!(
                    "--device-mem {}{} per rank",
                    gbx(b, req.device_text.as_deref()),
                    if req.device_default { " (default)" } else { "" }
                ),
            });
            b
        }
        DeviceBudget::FractionOfFree(f) => {
            if !(f > 0.0 && f <= 1.0) {
                return Err(PlanError::Fraction(f));
            }
            let b = (avail as f64 / tp as f64 * f) as u64;
            decided.push(Decision {
                what: "device tokens per rank".into(),
                by: format!(
                    "--device-mem-fraction {f} of {} free per rank",
                    format_bytes(avail / tp)
                ),
            });
            b
        }
    })
}

/// Host pool bytes per rank the `--hicache-*` flag asks for (a ratio: what its tokens take
/// with every window page, less the window share), if any.
fn host_budget(req: &PlanRequest, base: &Cost, device_tokens: u64) -> Option<u64> {
    Some(match req.host? {
        HostBudget::PerRank(b) => b,
        HostBudget::Total(b) => b / req.tp as u64,
        HostBudget::Ratio(r) if r.is_finite() && r >= 0.0 => {
            let tokens = (device_tokens as f64 * r) as u64;
            (tokens.saturating_mul(base.main) as f64 / (1.0 - window::WINDOW_HOST_SHARE)) as u64
        }
        HostBudget::Ratio(_) => 0,
    })
}

/// Host pool tokens per rank (whole pages) from the `--hicache-*` flag given, if any.
fn host_tokens(
    req: &PlanRequest,
    cost: &Cost,
    device_tokens: u64,
    decided: &mut Vec<Decision>,
) -> Result<u64, PlanError> {
    let tp = req.tp as u64;
    let ps = req.page_size as u64;
    let ht = req.host_text.as_deref();
    let tokens = match req.host {
        None => {
            decided.push(Decision {
                what: "host tokens per rank".into(),
                by: "no --hicache-* flag: host tier off".into(),
            });
            0
        }
        Some(HostBudget::PerRank(b)) => {
            decided.push(Decision {
                what: "host tokens per rank".into(),
                by: format!("--hicache-size {} per rank", gbx(b, ht)),
            });
            cost.tokens_for(b)
        }
        Some(HostBudget::Total(b)) => {
            decided.push(Decision {
                what: "host tokens per rank".into(),
                by: format!(
                    "--hicache-total {} split over {} ranks = {} per rank",
                    gbx(b, ht),
                    tp,
                    gbx(b / tp, ht)
                ),
            });
            cost.tokens_for(b / tp)
        }
        Some(HostBudget::Ratio(r)) => {
            decided.push(Decision {
                what: "host tokens per rank".into(),
                by: format!("--hicache-ratio {r} × {device_tokens} device tokens per rank"),
            });
            ((device_tokens as f64 * r) as u64) / ps * ps
        }
    };
    // A flag that asks for a host tier gets one, or an error: never a tier quietly off.
    let asked = match req.host {
        Some(HostBudget::PerRank(b)) if b > 0 => Some(gbx(b, ht)),
        Some(HostBudget::Total(b)) if b > 0 => Some(gbx(b / tp, ht)),
        Some(HostBudget::Ratio(r)) if r > 0.0 => {
            Some(format!("--hicache-ratio {r} × {device_tokens} tokens"))
        }
        _ => None,
    };
    if let (Some(budget), 0) = (asked, tokens) {
        return Err(PlanError::HostTooSmall {
            budget,
            tokens,
            page_size: req.page_size,
        });
    }
    Ok(tokens)
}

/// Every pool kind's share of the device and host tokens.
fn pool_plans(
    req: &PlanRequest,
    kinds: &[PoolKind],
    ps: u64,
    (device_main, device_window): (u64, u64),
    (host_main, host_window): (u64, u64),
) -> Result<Vec<PoolPlan>, PlanError> {
    let ranks = req.rank_pool_kinds()?;
    Ok(kinds
        .iter()
        .zip(&req.model.kinds)
        .enumerate()
        .map(|(i, (k, spec))| {
            let b = k.bytes_per_token() as u64;
            let (device_tokens, host_tokens) = match k.window {
                None => (device_main, host_main),
                Some(_) => (device_window, host_window),
            };
            PoolPlan {
                kind: k.name.clone(),
                per: spec.per_text(),
                needed: spec.needed_text(),
                tp: if spec.split_across_tp {
                    "split"
                } else {
                    "replicated"
                }
                .into(),
                bytes_per_token: b,
                rank_bytes_per_token: ranks
                    .iter()
                    .map(|r| r[i].bytes_per_token() as u64)
                    .collect(),
                device_tokens,
                device_pages: device_tokens / ps,
                device_bytes: device_tokens.saturating_mul(b),
                host_tokens,
                host_pages: host_tokens / ps,
                host_bytes: host_tokens.saturating_mul(b),
            }
        })
        .collect())
}

/// `NUMA node 0` or `NUMA nodes 0,1`.
fn where_of(nodes: &[u32]) -> String {
    if nodes.len() == 1 {
        format!("NUMA node {}", nodes[0])
    } else {
        format!(
            "NUMA nodes {}",
            nodes
                .iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(",")
        )
    }
}

mod advice;
mod cost;
mod render;
mod types;
mod window;

use cost::{Cost, Share};
pub use window::WINDOW_HOST_SHARE;
use window::{kinds_decision, window_decisions};
mod ranks;
