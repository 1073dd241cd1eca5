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
}

pub fn run(a: PlanArgs) -> Result<()> {
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
