//! The sizing planner: from flags and topology to exact per-rank, per-pool numbers, validated
//! before anything is allocated.

use serde::Serialize;
use strata_kv::units::format_bytes;
use thiserror::Error;

use crate::model::ModelSpec;
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NumaChoice {
    Node(u32),
    /// The node the process's CPUs belong to, else the one with the most available memory.
    Auto,
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
    #[error("--device-mem-fraction {0} must be in (0, 1]")]
    Fraction(f64),
    #[error("--hicache-ratio {0} must be a finite number ≥ 0")]
    Ratio(f64),
    #[error("device budget of {budget} per rank holds {tokens} tokens, less than one page of {page_size} tokens at {bpt} bytes per token")]
    DeviceTooSmall {
        budget: String,
        tokens: u64,
        page_size: usize,
        bpt: u64,
    },
    #[error("--numa-node {node}: no such NUMA node (this machine has {have})")]
    NoSuchNode { node: u32, have: String },
    #[error("{0}")]
    DoesNotFit(String),
}

/// One pool kind's share, per rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PoolPlan {
    pub kind: String,
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
    pub bytes_per_token: u64,
    pub pools: Vec<PoolPlan>,
    pub device_tokens_per_rank: u64,
    pub host_tokens_per_rank: u64,
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

/// Builds and validates the plan. Nothing is allocated here.
pub fn make_plan(req: &PlanRequest, topo: &Topology) -> Result<Plan, PlanError> {
    if req.tp == 0 {
        return Err(PlanError::Tp);
    }
    if req.page_size == 0 {
        return Err(PlanError::PageSize);
    }
    if req.model.kinds.is_empty() {
        return Err(PlanError::NoPools(req.model.name.clone()));
    }
    let tp = req.tp as u64;
    let ps = req.page_size as u64;
    let kinds: Vec<_> = req.model.kinds.iter().map(|k| k.per_rank(req.tp)).collect();
    let bpt: u64 = kinds.iter().map(|k| k.bytes_per_token() as u64).sum();
    let mut decided = Vec::new();
    let mut warnings = Vec::new();

    // NUMA placement first: the fraction-of-free device budget needs it.
    let have = topo
        .ids()
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let (nodes, auto_why) = match (req.policy, req.numa) {
        (NumaPolicy::Interleave, _) => (topo.ids(), None),
        (_, NumaChoice::Node(n)) => {
            if topo.node(n).is_none() {
                return Err(PlanError::NoSuchNode { node: n, have });
            }
            (vec![n], None)
        }
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
    let reserve = req.reserve.unwrap_or_else(|| (total / 10).min(10 << 30));
    let usable = avail.saturating_sub(reserve);
    if let Some(why) = auto_why {
        decided.push(Decision {
            what: "NUMA node".into(),
            by: why,
        });
    }

    // Device pool.
    let device_budget = match req.device {
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
    };
    let device_tokens = device_budget / bpt / ps * ps;
    if device_tokens == 0 {
        return Err(PlanError::DeviceTooSmall {
            budget: format_bytes(device_budget),
            tokens: device_budget / bpt,
            page_size: req.page_size,
            bpt,
        });
    }

    // Host pool: whole tokens of every kind, never more bytes than asked.
    let ht = req.host_text.as_deref();
    let host_tokens = match req.host {
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
            b / bpt / ps * ps
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
            b / tp / bpt / ps * ps
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
    };

    let pools: Vec<PoolPlan> = kinds
        .iter()
        .map(|k| {
            let b = k.bytes_per_token() as u64;
            PoolPlan {
                kind: k.name.clone(),
                bytes_per_token: b,
                device_tokens,
                device_pages: device_tokens / ps,
                device_bytes: device_tokens * b,
                host_tokens,
                host_pages: host_tokens / ps,
                host_bytes: host_tokens * b,
            }
        })
        .collect();
    let device_bytes = device_tokens * bpt;
    let host_bytes = host_tokens * bpt;
    let server_host = host_bytes * tp;
    let server_device = device_bytes * tp;
    let needed = server_host
        + if req.device_in_host_memory {
            server_device
        } else {
            0
        };
    let where_ = if nodes.len() == 1 {
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
    };

    if needed > usable {
        let fit_host_server = usable.saturating_sub(if req.device_in_host_memory {
            server_device
        } else {
            0
        });
        let fit_tokens = fit_host_server / tp / bpt / ps * ps;
        // The advice names the flag that was given, in the unit it was given in.
        let fit = match req.host {
            Some(HostBudget::PerRank(_)) => {
                format!(
                    "--hicache-size {} per rank",
                    typed_like(fit_tokens * bpt, ht)
                )
            }
            Some(HostBudget::Ratio(_)) => format!(
                "--hicache-ratio {:.2}",
                fit_tokens as f64 / device_tokens as f64
            ),
            Some(HostBudget::Total(_)) => {
                format!("--hicache-total {}", typed_like(fit_tokens * bpt * tp, ht))
            }
            None => {
                let dev_fit = usable / tp / bpt / ps * ps * bpt;
                match req.device {
                    DeviceBudget::Bytes(_) => format!(
                        "--device-mem {} per rank",
                        typed_like(dev_fit, req.device_text.as_deref())
                    ),
                    DeviceBudget::FractionOfFree(_) => format!(
                        "--device-mem-fraction {:.2}",
                        dev_fit as f64 * tp as f64 / avail.max(1) as f64
                    ),
                }
            }
        };
        let all_avail: u64 = topo.nodes.iter().map(|n| n.available_bytes).sum();
        let mut alts = vec![format!("a smaller size ({fit} fits)")];
        if topo.nodes.len() > 1 && req.policy != NumaPolicy::Interleave {
            alts.push(format!(
                "--numa-policy interleave ({} available on all {} nodes, slower remote accesses)",
                format_bytes(all_avail),
                topo.nodes.len()
            ));
            alts.push("split the cache over servers bound to different nodes (e.g. prefill on node 0, decode on node 1, each with half)".into());
        }
        let asked = match req.host {
            Some(HostBudget::PerRank(b)) => format!(
                "--hicache-size {} per rank × {tp} ranks = {}",
                typed_like(b, ht),
                typed_like(server_host, ht)
            ),
            Some(HostBudget::Total(b)) => format!(
                "--hicache-total {} ({tp} ranks × {})",
                typed_like(b, ht),
                typed_like(b / tp, ht)
            ),
            Some(HostBudget::Ratio(r)) => format!(
                "--hicache-ratio {r} = {} ({tp} ranks × {})",
                gb(server_host),
                gb(host_bytes)
            ),
            None => format!(
                "--device-mem {} per rank × {tp} ranks",
                typed_like(device_budget, req.device_text.as_deref())
            ),
        };
        return Err(PlanError::DoesNotFit(format!(
            "{asked}{} does not fit {where_} ({}): {} available ({source}) minus {} reserve leaves {}; alternatives: {}",
            if req.device_in_host_memory && req.host.is_some() { format!(" + {} of device pools in host memory", typed_like(server_device, ht)) } else { String::new() },
            req.policy.name(),
            format_bytes(avail),
            format_bytes(reserve),
            format_bytes(usable),
            alts.join("; ")
        )));
    }

    if let Some(HostBudget::Ratio(r)) = req.host {
        let share = server_host as f64 / avail.max(1) as f64;
        if share < SMALL_POOL_SHARE {
            let half = usable / 2;
            warnings.push(format!(
                "--hicache-ratio {r} sized the host cache from the device pool: {host_tokens} tokens = {} per rank, {} per server, only {:.1}% of {where_}'s {} available. The ratio multiplies this server's device pool, which is small on a prefill server; ask for the size directly, e.g. --hicache-total {} (or --hicache-size {} per rank) for half the node",
                format_bytes(host_bytes),
                format_bytes(server_host),
                share * 100.0,
                format_bytes(avail),
                gb(half),
                gb(half / tp),
            ));
        }
    }
    if host_tokens > 0 && host_tokens < device_tokens {
        warnings.push(format!(
            "the host tier ({host_tokens} tokens per rank) is smaller than the device tier ({device_tokens}): with write-through it only mirrors part of the device and caches nothing beyond it; make it at least as large"
        ));
    }
    if req.policy == NumaPolicy::Preferred
        && needed > topo.node(nodes[0]).map_or(0, |n| n.available_bytes)
    {
        warnings.push(format!("--numa-policy preferred: {} exceeds node {}'s available memory and will spill to other nodes", format_bytes(needed), nodes[0]));
    }

    Ok(Plan {
        role: req.role.clone(),
        model: req.model.name.clone(),
        tp: req.tp,
        page_size: req.page_size,
        bytes_per_token: bpt,
        pools,
        device_tokens_per_rank: device_tokens,
        host_tokens_per_rank: host_tokens,
        device_bytes_per_rank: device_bytes,
        host_bytes_per_rank: host_bytes,
        server_device_bytes: server_device,
        server_host_bytes: server_host,
        numa: NumaPlan {
            policy: req.policy,
            nodes,
            available_bytes: avail,
            source,
            reserve_bytes: reserve,
            needed_bytes: needed,
            headroom_bytes: usable - needed,
        },
        decided_by: decided,
        warnings,
    })
}

impl Plan {
    /// The human report: one table per rank's pools, server totals, NUMA, decisions, warnings.
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(s, "plan ({} role): model {}, TP {} (every rank identical), page {} tokens, {} bytes per token per rank", self.role, self.model, self.tp, self.page_size, self.bytes_per_token);
        let _ = writeln!(
            s,
            "{:<10} {:>11} {:>13} {:>11} {:>26} {:>13} {:>11} {:>30}",
            "pool",
            "bytes/token",
            "device tokens",
            "dev pages",
            "device bytes",
            "host tokens",
            "host pages",
            "host bytes"
        );
        for p in &self.pools {
            let _ = writeln!(
                s,
                "{:<10} {:>11} {:>13} {:>11} {:>26} {:>13} {:>11} {:>30}",
                p.kind,
                p.bytes_per_token,
                p.device_tokens,
                p.device_pages,
                format_bytes(p.device_bytes),
                p.host_tokens,
                p.host_pages,
                format_bytes(p.host_bytes)
            );
        }
        let _ = writeln!(
            s,
            "{:<10} {:>11} {:>13} {:>11} {:>26} {:>13} {:>11} {:>30}",
            "per rank",
            self.bytes_per_token,
            self.device_tokens_per_rank,
            self.device_tokens_per_rank / self.page_size as u64,
            format_bytes(self.device_bytes_per_rank),
            self.host_tokens_per_rank,
            self.host_tokens_per_rank / self.page_size as u64,
            format_bytes(self.host_bytes_per_rank)
        );
        let _ = writeln!(
            s,
            "per server ({} ranks): device {}, host {}",
            self.tp,
            format_bytes(self.server_device_bytes),
            format_bytes(self.server_host_bytes)
        );
        let n = &self.numa;
        let _ =
            writeln!(
            s,
            "NUMA: {} on node(s) {}: {} available, {} reserve, this server needs {}, headroom {}",
            n.policy.name(),
            n.nodes.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(","),
            format_bytes(n.available_bytes),
            format_bytes(n.reserve_bytes),
            format_bytes(n.needed_bytes),
            format_bytes(n.headroom_bytes)
        );
        let _ = writeln!(s, "      capacity source: {}", n.source);
        for d in &self.decided_by {
            let _ = writeln!(s, "decided: {} ← {}", d.what, d.by);
        }
        for w in &self.warnings {
            let _ = writeln!(s, "WARNING: {w}");
        }
        s
    }
}
