//! `strata sim` for a model whose state has window kinds (DeepSeek-V4, `--model-preset
//! deepseek-v4-pro`): the window residency side by side, each tier split into main and window
//! pages by the planner exactly as `strata serve` would (`strata_mem::plan`, window.rs):
//!
//! * **every page**: each cached page keeps its window kinds (`--window-checkpoint-pages 0`),
//!   at the bytes given;
//! * **default**: running requests hold a ring, committed prefixes keep their window state at
//!   their end, branch point and every K pages, at the same bytes;
//! * **every page, unbounded**: the default's main tokens with a window page for every page
//!   (the bytes it would take are shown): what the residency can at most recover, so the
//!   default's hit tokens as a share of it is what the checkpoints cost.
//!
//! Hit and miss percentages are of the prompt tokens of the requests a residency admits; a
//! request longer than the device's window tokens (every page keeping its window state) is
//! refused, as the engine refuses it, and counted apart.

use anyhow::{bail, Context, Result};
use strata_kv::units::{format_bytes, parse_size};
use strata_kv::{Class, EvictionPolicy, PageLayout, PoolKind};
use strata_mem::{
    make_plan, DeviceBudget, HostBudget, ModelSpec, Node, NumaChoice, NumaPolicy, Plan,
    PlanRequest, Topology,
};
use strata_sim::replay::{replay, SimConfig, SimResult, SimWindows};
use strata_sim::trace::TraceRequest;

use crate::sim::advice::pct;

/// What the window replay needs besides the trace.
pub struct WindowSim<'a> {
    pub spec: ModelSpec,
    pub tp: u32,
    pub page_size: usize,
    pub device: &'a str,
    pub host: &'a str,
    pub max_running: usize,
    pub max_batch_tokens: usize,
}

/// One residency's tiers, as the planner splits them.
struct Residency {
    name: &'static str,
    device_tokens: u64,
    host_tokens: u64,
    windows: SimWindows,
}

/// Whether the model has window kinds.
pub fn has_window_kinds(spec: &ModelSpec) -> bool {
    spec.kinds
        .iter()
        .any(|k| matches!(k.needed, strata_mem::Needed::Window(_)))
}

fn bytes(flag: &str, s: &str) -> Result<u64> {
    if s.trim() == "0" {
        return Ok(0);
    }
    parse_size(s).with_context(|| {
        format!("--{flag} `{s}`: a model with window kinds is sized in bytes per rank (`2GiB`, `37.5GB`): the plan splits them into main and window pages")
    })
}

/// Refuses `--device` and `--host` not given in bytes (before the trace is read).
pub fn check_sizes(device: &str, host: &str) -> Result<()> {
    bytes("device", device)?;
    bytes("host", host)?;
    Ok(())
}

impl WindowSim<'_> {
    fn plan(&self, device: u64, host: u64, k: Option<u64>) -> Result<Plan> {
        let req = PlanRequest {
            role: "sim".into(),
            model: self.spec.clone(),
            tp: self.tp,
            page_size: self.page_size,
            device: DeviceBudget::Bytes(device),
            host: (host > 0).then_some(HostBudget::PerRank(host)),
            numa: NumaChoice::Node(0),
            policy: NumaPolicy::Bind,
            reserve: Some(0),
            device_in_host_memory: false,
            allowed_cpus: Vec::new(),
            host_text: None,
            device_text: None,
            device_default: false,
            window_ratio: None,
            window_checkpoint_pages: k,
            max_running: self.max_running as u64,
            max_batch_tokens: self.max_batch_tokens as u64,
            beside: Vec::new(),
            scratch: Default::default(),
        };
        // A machine as large as needed: the replay is about the pools, not the node.
        let topo = Topology {
            nodes: vec![Node {
                id: 0,
                cpus: Vec::new(),
                total_bytes: u64::MAX / 4,
                available_bytes: u64::MAX / 4,
                source: "strata sim".into(),
            }],
        };
        Ok(make_plan(&req, &topo)?)
    }

    fn residency(&self, name: &'static str, plan: &Plan) -> Residency {
        let ps = self.page_size as u64;
        Residency {
            name,
            device_tokens: plan.device_tokens_per_rank,
            host_tokens: plan.host_tokens_per_rank,
            windows: SimWindows {
                device_pages: (plan.device_window_tokens_per_rank / ps) as u32,
                host_pages: (plan.host_window_tokens_per_rank / ps) as u32,
                checkpoint_pages: plan.window_checkpoint_pages as usize,
                chunk_tokens: self.max_batch_tokens,
            },
        }
    }

    fn layout(&self) -> Result<PageLayout> {
        let kinds: Vec<PoolKind> = self
            .spec
            .kinds
            .iter()
            .map(|k| k.per_rank(self.tp, self.page_size))
            .collect::<Result<_, _>>()
            .map_err(|why| anyhow::anyhow!("--page-size {}: {why}", self.page_size))?;
        Ok(PageLayout::new(self.page_size, kinds)?)
    }
}

/// Replays `reqs` under each residency and eviction policy and prints them side by side.
pub fn run(
    w: &WindowSim,
    reqs: &[TraceRequest],
    base: &SimConfig,
    evictions: &[EvictionPolicy],
) -> Result<()> {
    let (device, host) = (bytes("device", w.device)?, bytes("host", w.host)?);
    if device == 0 {
        bail!("--device: the device tier needs some bytes");
    }
    let layout = w.layout()?;
    let every = w.residency("every page", &w.plan(device, host, Some(0))?);
    let default = w.residency("default", &w.plan(device, host, None)?);
    let unbounded = Residency {
        name: "every page, unbounded",
        windows: SimWindows {
            device_pages: (default.device_tokens / w.page_size as u64) as u32,
            host_pages: (default.host_tokens / w.page_size as u64) as u32,
            checkpoint_pages: 0,
            chunk_tokens: w.max_batch_tokens,
        },
        ..default
    };
    println!(
        "window residency: model {} at TP {}, page {} tokens, device {} and host {} per rank, --max-running {}, --max-batch-tokens {}; checkpoints every {} pages by default",
        w.spec.name,
        w.tp,
        w.page_size,
        format_bytes(device),
        format_bytes(host),
        w.max_running,
        w.max_batch_tokens,
        default.windows.checkpoint_pages
    );
    println!(
        "{:<6} {:<22} {:>12} {:>10} {:>12} {:>22} {:>8} {:>8} {:>14} {:>9} {:>10} {:>8}",
        "policy",
        "residency",
        "host tokens",
        "host win",
        "dev tokens",
        "host bytes",
        "hit%",
        "miss%",
        "recomputed tok",
        "resumed",
        "backed off",
        "refused"
    );
    for &p in evictions {
        let mut hits = Vec::new();
        for r in [&every, &default, &unbounded] {
            let cfg = SimConfig {
                layout: layout.clone(),
                device_tokens: r.device_tokens,
                host_tokens: r.host_tokens,
                storage_tokens: 0,
                eviction: p,
                windows: Some(r.windows),
                ..base.clone()
            };
            let res = replay(reqs, &cfg, |_| {})?;
            print_row(p, r, &layout, &res);
            hits.push(res.stats.hit_tokens());
        }
        println!(
            "{:<6} default: {:.2}% of the hit tokens of every page unbounded ({:.1}× the bytes), {:.1}× those of every page at the same bytes",
            "",
            pct(hits[1], hits[2]),
            host_bytes(&unbounded, &layout) as f64 / host_bytes(&default, &layout).max(1) as f64,
            hits[1] as f64 / hits[0].max(1) as f64
        );
    }
    Ok(())
}

fn host_bytes(r: &Residency, layout: &PageLayout) -> u64 {
    let ps = layout.page_size() as u64;
    (r.host_tokens / ps) * layout.class_bytes(Class::Main) as u64
        + r.windows.host_pages as u64 * layout.class_bytes(Class::Window) as u64
}

fn print_row(p: EvictionPolicy, r: &Residency, layout: &PageLayout, res: &SimResult) {
    let s = &res.stats;
    let q = s.queried_tokens;
    println!(
        "{:<6} {:<22} {:>12} {:>10} {:>12} {:>22} {:>8.2} {:>8.2} {:>14} {:>9} {:>10} {:>8}",
        p.name(),
        r.name,
        r.host_tokens,
        r.windows.host_pages,
        r.device_tokens,
        format_bytes(host_bytes(r, layout)),
        pct(s.hit_tokens(), q),
        pct(s.miss_tokens, q),
        s.window_cut_tokens,
        s.window_hits_as_matched,
        s.window_hits_backed_off,
        res.refused,
    );
}
