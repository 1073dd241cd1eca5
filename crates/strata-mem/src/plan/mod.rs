//! The sizing planner: from flags and topology to exact per-rank, per-pool numbers, validated
//! before anything is allocated.

use serde::Serialize;
use strata_kv::units::format_bytes;
use strata_kv::PoolKind;
use thiserror::Error;

use crate::model::{KindSpec, ModelSpec};
use crate::topology::Topology;

/// Device pool budget per rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DeviceBudget {
    /// `--device-mem SIZE`: bytes per rank.
    Bytes(u64),
    /// `--device-mem-fraction F`: that fraction of the free device memory per rank.
    FractionOfFree(f64),
}

/// Host (L2) budget: exactly one of the three flags.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum HostBudget {
    /// `--hicache-size SIZE`: bytes per rank.
    PerRank(u64),
    /// `--hicache-total SIZE`: bytes for the whole server, split evenly over its ranks.
    Total(u64),
    /// `--hicache-ratio R`: host tokens = R × device tokens.
    Ratio(f64),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NumaPolicy {
    Bind,
    Interleave,
    Preferred,
}

impl NumaPolicy {
    pub fn parse(s: &str) -> Option<NumaPolicy> {
        match s {
            "bind" => Some(NumaPolicy::Bind),
            "interleave" => Some(NumaPolicy::Interleave),
            "preferred" => Some(NumaPolicy::Preferred),
            _ => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            NumaPolicy::Bind => "bind",
            NumaPolicy::Interleave => "interleave",
            NumaPolicy::Preferred => "preferred",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NumaChoice {
    Node(u32),
    /// The node the process's CPUs belong to, else the one with the most available memory.
    Auto,
    /// Each tensor-parallel rank's node (`--numa-nodes`, one entry per rank): its pools there.
    Ranks(Vec<u32>),
}

/// Everything the planner needs.
#[derive(Clone, Debug)]
pub struct PlanRequest {
    /// `prefill`, `decode` or `server`: a label for reports.
    pub role: String,
    pub model: ModelSpec,
    pub tp: u32,
    pub page_size: usize,
    pub device: DeviceBudget,
    /// None: no host tier.
    pub host: Option<HostBudget>,
    pub numa: NumaChoice,
    pub policy: NumaPolicy,
    /// `--host-mem-reserve`; None: 10 % of the node, at most 10 GiB.
    pub reserve: Option<u64>,
    /// The device pool lives in host memory (this CPU build): it counts against the node too.
    pub device_in_host_memory: bool,
    /// CPUs the process may run on (for `--numa-node auto`).
    pub allowed_cpus: Vec<u32>,
    /// The host and device sizes as the operator typed them (`150GB`), to echo them in that
    /// unit; None: binary units.
    pub host_text: Option<String>,
    pub device_text: Option<String>,
    /// `--window-tokens-ratio R`: window pages per page in each tier (models with window
    /// kinds); None: one per page.
    pub window_ratio: Option<f64>,
}

/// A plan that cannot be carried out; each message is one line naming the fix.
#[derive(Debug, Error, PartialEq)]
pub enum PlanError {
    #[error("--tp-size must be at least 1")]
    Tp,
    #[error("--page-size must be at least 1 token")]
    PageSize,
    #[error("model `{0}` declares no pool kinds")]
    NoPools(String),
    #[error("--page-size {page_size}: {why}")]
    PageFit { page_size: usize, why: String },
    #[error("--device-mem-fraction {0} must be in (0, 1]")]
    Fraction(f64),
    #[error("--hicache-ratio {0} must be a finite number ≥ 0")]
    Ratio(f64),
    #[error("--window-tokens-ratio {0} must be in (0, 1]")]
    WindowRatio(f64),
    #[error("--window-tokens-ratio {ratio}: model `{model}` has no window kinds (every kind is read for the whole prefix)")]
    NoWindowKinds { ratio: f64, model: String },
    #[error("--window-tokens-ratio {ratio} leaves {tokens} window tokens per rank on device, less than one page of {page_size}")]
    NoWindowPage {
        ratio: f64,
        tokens: u64,
        page_size: usize,
    },
    #[error("device budget of {budget} per rank holds {tokens} tokens, less than one page of {page_size} tokens at {bpt} bytes per token")]
    DeviceTooSmall {
        budget: String,
        tokens: u64,
        page_size: usize,
        bpt: u64,
    },
    #[error("--numa-node {node}: no such NUMA node (this machine has {have})")]
    NoSuchNode { node: u32, have: String },
    #[error("--numa-nodes {0}")]
    RankNodes(String),
    #[error("{0}")]
    DoesNotFit(String),
}

/// One pool kind's share, per rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PoolPlan {
    pub kind: String,
    /// What one item belongs to: `token`, `4-token block`, ... (bytes per token amortize it).
    pub per: String,
    /// What a continuation reads of a prefix: `prefix` or `last N tokens`.
    pub needed: String,
    pub bytes_per_token: u64,
    pub device_tokens: u64,
    pub device_pages: u64,
    pub device_bytes: u64,
    pub host_tokens: u64,
    pub host_pages: u64,
    pub host_bytes: u64,
}

/// Which flag decided a number.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Decision {
    pub what: String,
    pub by: String,
}

/// Where the host pools go and how much room that leaves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NumaPlan {
    pub policy: NumaPolicy,
    pub nodes: Vec<u32>,
    pub available_bytes: u64,
    pub source: String,
    pub reserve_bytes: u64,
    /// Bytes this server places there (host pools, plus device pools when in host memory).
    pub needed_bytes: u64,
    pub headroom_bytes: u64,
}

/// The validated plan. Every rank of the server gets the same pools.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Plan {
    pub role: String,
    pub model: String,
    pub tp: u32,
    pub page_size: usize,
    /// Bytes per token of the largest rank (what each rank's pools are sized for).
    pub bytes_per_token: u64,
    /// Each rank's: less on ranks holding fewer KV heads (SmolLM2's 3 over 2 ranks: 2 and 1).
    pub rank_bytes_per_token: Vec<u64>,
    pub pools: Vec<PoolPlan>,
    pub device_tokens_per_rank: u64,
    pub host_tokens_per_rank: u64,
    /// Tokens whose window state each tier keeps (= the tokens above without window kinds,
    /// or with the ratio 1).
    pub device_window_tokens_per_rank: u64,
    pub host_window_tokens_per_rank: u64,
    pub device_bytes_per_rank: u64,
    pub host_bytes_per_rank: u64,
    pub server_device_bytes: u64,
    pub server_host_bytes: u64,
    pub numa: NumaPlan,
    pub decided_by: Vec<Decision>,
    pub warnings: Vec<String>,
}

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
    let ratio = req.window_ratio.unwrap_or(1.0);
    let costs = kinds
        .iter()
        .map(|k| Cost::new(k, ratio, req.page_size as u64))
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
    let cost = Cost::new(&kinds, req.window_ratio.unwrap_or(1.0), ps);
    let (rank_costs, rank_bpt) = rank_costs(req)?;
    let mut decided = Vec::new();

    // NUMA placement first: the fraction-of-free device budget needs it.
    let room = numa_room(req, topo, &mut decided)?;

    // Device pool.
    let device_budget = device_budget(req, room.avail, &mut decided)?;
    let device_tokens = cost.tokens_for(device_budget);
    if device_tokens == 0 {
        return Err(PlanError::DeviceTooSmall {
            budget: format_bytes(device_budget),
            tokens: device_budget / cost.per_token(),
            page_size: req.page_size,
            bpt: cost.per_token(),
        });
    }

    // Host pool: whole tokens of every kind, never more bytes than asked.
    let host_tokens = host_tokens(req, &cost, device_tokens, &mut decided)?;
    let (dw, hw) = (
        cost.window_tokens(device_tokens),
        cost.window_tokens(host_tokens),
    );
    window_decisions(req, &cost, device_tokens, dw, &mut decided)?;

    let pools = pool_plans(req, &kinds, ps, (device_tokens, dw), (host_tokens, hw));
    kinds_decision(&cost, kinds.len(), ps, &mut decided);
    let s = Sizes::new(
        req,
        &cost,
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
    let warnings = advice::warnings(req, topo, &room, &s, &where_);

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
            needed_bytes: s.needed,
            headroom_bytes: room.usable - s.needed,
        },
        decided_by: decided,
        warnings,
    })
}

/// The NUMA nodes chosen for the host pools and the room they have.
struct Room {
    nodes: Vec<u32>,
    avail: u64,
    source: String,
    reserve: u64,
    /// Available minus the reserve.
    usable: u64,
}

/// The per-rank and per-server numbers the budgets came to.
struct Sizes {
    tp: u64,
    cost: Cost,
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
        cost: &Cost,
        rank_costs: &[Cost],
        device_budget: u64,
        device_tokens: u64,
        host_tokens: u64,
    ) -> Sizes {
        let tp = req.tp as u64;
        let device_bytes = cost.bytes(device_tokens);
        let host_bytes = cost.bytes(host_tokens);
        // Every rank holds the same pages; a rank with fewer heads, fewer bytes.
        let server_host = rank_costs.iter().map(|c| c.bytes(host_tokens)).sum();
        let server_device = rank_costs.iter().map(|c| c.bytes(device_tokens)).sum();
        let needed = server_host
            + if req.device_in_host_memory {
                server_device
            } else {
                0
            };
        Sizes {
            tp,
            cost: *cost,
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
    if req.tp == 0 {
        return Err(PlanError::Tp);
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
    let reserve = match req.numa {
        NumaChoice::Ranks(_) => nodes
            .iter()
            .map(|&n| ranks::node_reserve(req, topo.node(n).expect("checked").total_bytes))
            .sum(),
        _ => ranks::node_reserve(req, total),
    };
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
        usable,
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
    Ok(match (req.policy, &req.numa) {
        (NumaPolicy::Interleave, _) => (topo.ids(), None),
        (_, &NumaChoice::Node(n)) => {
            if topo.node(n).is_none() {
                return Err(PlanError::NoSuchNode { node: n, have });
            }
            (vec![n], None)
        }
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
                    "--device-mem {} per rank",
                    gbx(b, req.device_text.as_deref())
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
    Ok(match req.host {
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
            if !(r.is_finite() && r >= 0.0) {
                return Err(PlanError::Ratio(r));
            }
            decided.push(Decision {
                what: "host tokens per rank".into(),
                by: format!("--hicache-ratio {r} × {device_tokens} device tokens per rank"),
            });
            ((device_tokens as f64 * r) as u64) / ps * ps
        }
    })
}

/// Every pool kind's share of the device and host tokens.
fn pool_plans(
    req: &PlanRequest,
    kinds: &[PoolKind],
    ps: u64,
    (device_main, device_window): (u64, u64),
    (host_main, host_window): (u64, u64),
) -> Vec<PoolPlan> {
    kinds
        .iter()
        .zip(&req.model.kinds)
        .map(|(k, spec)| {
            let b = k.bytes_per_token() as u64;
            let (device_tokens, host_tokens) = match k.window {
                None => (device_main, host_main),
                Some(_) => (device_window, host_window),
            };
            PoolPlan {
                kind: k.name.clone(),
                per: spec.per_text(),
                needed: spec.needed_text(),
                bytes_per_token: b,
                device_tokens,
                device_pages: device_tokens / ps,
                device_bytes: device_tokens * b,
                host_tokens,
                host_pages: host_tokens / ps,
                host_bytes: host_tokens * b,
            }
        })
        .collect()
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

use cost::{kinds_decision, window_decisions, Cost};
mod ranks;
