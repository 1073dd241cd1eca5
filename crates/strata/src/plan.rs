//! `strata plan`: the sizing dry run (and, with `--allocate`, the real thing).

use std::sync::Arc;

use anyhow::Result;
use clap::Args;
use strata_kv::pool::HostPool;
use strata_kv::units::format_bytes;
use strata_kv::{PageLayout, PoolKind};
use strata_mem::{make_plan, NumaAllocator};

use crate::sizing::SizingArgs;

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub sizing: SizingArgs,
    /// Print the plan as JSON.
    #[arg(long, help_heading = "Output")]
    pub json: bool,
    /// After a valid plan, allocate every rank's host pool as planned (bound, pre-faulted) and
    /// report where its pages landed; then free it. Not with --machine (that machine is not
    /// this one).
    #[arg(long, help_heading = "Output", conflicts_with = "machine")]
    pub allocate: bool,
    /// Propose --hicache-size per rank from a live deployment: a worker's or a router's
    /// URL, whose `GET /cache/curve` (the live miss-ratio curve) is read; no plan is made.
    #[arg(long, value_name = "URL", help_heading = "Advice from live traffic", conflicts_with_all = ["allocate", "json"])]
    pub advise_from: Option<String>,
    /// With --advise-from: the hit ratio to reach, as a fraction of what a cache that never
    /// evicts gets (as `strata sim --advise --target`).
    #[arg(
        long,
        default_value_t = 0.9,
        requires = "advise_from",
        help_heading = "Advice from live traffic"
    )]
    pub target: f64,
    /// With --advise-from a router over prefill and decode workers: how this total of host
    /// cache (every rank of both roles, e.g. `300GB`) is best split between them.
    #[arg(
        long,
        value_name = "SIZE",
        requires = "advise_from",
        help_heading = "Advice from live traffic"
    )]
    pub pd_total: Option<String>,
}

pub fn run(a: PlanArgs) -> Result<()> {
    if let Some(url) = &a.advise_from {
        return crate::advise_from::run(&crate::advise_from::AdviseFrom {
            url,
            target: a.target,
            pd_total: a.pd_total.as_deref(),
        });
    }
    let req = a.sizing.request()?;
    let topo = a.sizing.topology()?;
    let plan = make_plan(&req, &topo)?;
    if !a.json {
        // The plan before anything is allocated (the pre-fault progress follows it).
        print!("{}", plan.render());
        use std::io::Write;
        let _ = std::io::stdout().flush();
    }
    let mut placements = Vec::new();
    if a.allocate && plan.host_tokens_per_rank > 0 {
        let kinds: Vec<PoolKind> = req.pool_kinds()?;
        let layout = Arc::new(PageLayout::new(req.page_size, kinds)?);
        let pages = (plan.host_tokens_per_rank / req.page_size as u64) as u32;
        for rank in 0..req.tp {
            let mut alloc = NumaAllocator::new(plan.numa.nodes.clone(), req.policy);
            alloc.huge_pages = a.sizing.huge_pages;
            alloc.progress = Some(crate::sizing::prefault_progress(
                format!("rank {rank} host pool"),
                0,
            ));
            let pool = HostPool::new(layout.clone(), pages, &alloc)?;
            let placement = strata_mem::numa::placement_of_pool(&pool);
            placements.push((rank, pool.bytes(), alloc.clone(), placement));
        }
    }
    if a.json {
        let mut v = serde_json::to_value(&plan)?;
        if !placements.is_empty() {
            v["allocated"] = serde_json::Value::Array(
                placements
                    .iter()
                    .map(|(rank, bytes, _, p)| serde_json::json!({"rank": rank, "bytes": bytes, "placement": p}))
                    .collect(),
            );
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        for (rank, bytes, alloc, p) in &placements {
            println!(
                "allocated rank {rank}: {} with {} — pages: {}",
                format_bytes(*bytes as u64),
                strata_kv::memory::HostAllocator::name(alloc),
                p.describe()
            );
        }
    }
    Ok(())
}
