//! What `strata up` checks before it starts any process: the deployment file read within a
//! bound, every worker's command line parsed and checked as `strata serve` would check it, and
//! each worker's memory plan, summed per NUMA node against what this machine has (each plan
//! alone may fit its node; together they may not).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use clap::Parser;

use super::WorkerCtx;
use crate::serve::ServeArgs;

/// Largest deployment file read (a real one is a few kilobytes).
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The deployment file's text: a regular file of at most [`MAX_CONFIG_BYTES`].
pub(super) fn read_config(p: &Path) -> Result<String> {
    let what = || format!("--config {}", p.display());
    let meta = std::fs::metadata(p).with_context(what)?;
    if !meta.is_file() {
        bail!("{}: not a regular file", what());
    }
    if meta.len() > MAX_CONFIG_BYTES {
        bail!(
            "{}: {} bytes, at most {MAX_CONFIG_BYTES}",
            what(),
            meta.len()
        );
    }
    let mut text = String::new();
    let f = std::fs::File::open(p).with_context(what)?;
    std::io::Read::read_to_string(&mut std::io::Read::take(f, MAX_CONFIG_BYTES + 1), &mut text)
        .with_context(what)?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        bail!("{}: longer than {MAX_CONFIG_BYTES} bytes", what());
    }
    Ok(text)
}

/// `strata serve`'s flags, parsed from a worker's command line.
#[derive(Parser)]
#[command(name = "strata serve")]
struct Serve {
    #[command(flatten)]
    a: ServeArgs,
}

/// `strata route`'s flags, parsed from the router's command line.
#[derive(Parser)]
#[command(name = "strata route")]
struct Route {
    #[command(flatten)]
    a: crate::route::RouteArgs,
}

/// Every worker checked and planned, the deployment's host memory summed per NUMA node, and
/// the router's flags checked; a client API key of the router's, if it asks for one.
pub(super) fn check(w: &WorkerCtx<'_>) -> Result<Option<String>> {
    let d = w.d;
    // Decode workers are told the prefill workers' URLs, and the router every worker's; their
    // ports may be 0 until they start, so well-formed URLs stand in here.
    let stand_in = |i: usize| super::procs::http_url(&d.host, 1 + i as u16);
    let prefill_urls: Vec<String> = (0..d.prefill.len()).map(stand_in).collect();
    let workers: Vec<(&str, String)> = (0..d.prefill.len() + d.decode.len())
        .map(|i| match i < d.prefill.len() {
            true => ("--prefill", stand_in(i)),
            false => ("--decode", stand_in(i)),
        })
        .collect();
    let rargs = super::router_command(d, w.model, &w.key, &workers);
    let route = parse::<Route>("router", "strata route", rargs)?;
    let client_key = crate::route::check(&route.a)
        .context("router")?
        .a_client_key();
    let mut per_node: BTreeMap<u32, u64> = BTreeMap::new();
    let mut reserve = 0u64;
    // Every port the deployment's processes listen on: HTTP, and the KV listeners a worker's
    // args fix (`--kv-port`; 0, any free one, unless given).
    let mut listens = d.ports();
    let http = listens.len();
    for (role, list) in [("prefill", &d.prefill), ("decode", &d.decode)] {
        for (i, spec) in list.iter().enumerate() {
            let name = format!("{role}-{i}");
            let urls: &[String] = if role == "decode" { &prefill_urls } else { &[] };
            let s = parse::<Serve>(&name, "strata serve", w.args(role, spec, urls))?;
            if s.a.sizing.role.receives_kv() && s.a.kv_port != 0 {
                listens.push((format!("{name}'s --kv-port"), s.a.kv_port));
            }
            let (plan, needed) = crate::serve::preflight(&s.a).with_context(|| name.clone())?;
            let nodes = &plan.numa.nodes;
            // Each worker holds its own copy of the weights (and its own staging and stores):
            // they add up as its pools do; the rest of the reserve is the node's once.
            let beside = plan.numa.beside.iter().map(|b| b.1);
            let weights = beside.fold(plan.numa.weights_bytes, u64::saturating_add);
            for &n in nodes {
                *per_node.entry(n).or_default() +=
                    needed.saturating_add(weights) / nodes.len().max(1) as u64;
            }
            reserve = reserve.max(plan.numa.reserve_bytes.saturating_sub(weights));
        }
    }
    super::ports::distinct("the deployment", &listens)?;
    let kv = &listens[http..];
    super::ports::check_free(&d.host, kv)?;
    let topo = strata_mem::Topology::detect().context("reading this machine's NUMA nodes")?;
    fits(&topo, &per_node, reserve)?;
    Ok(client_key)
}

/// A process's command line (`args`, its subcommand first) read as `program` reads its own
/// (a negative value joined to its flag); an error names the process (`name`).
fn parse<P: Parser>(name: &str, program: &str, args: Vec<String>) -> Result<P> {
    let argv = std::iter::once(program.to_string())
        .chain(args.into_iter().skip(1))
        .map(Into::into)
        .collect();
    let argv = crate::argv::join_negative_values(P::command(), argv);
    P::try_parse_from(argv).map_err(|e| {
        let text = e.render().to_string();
        let first = text.lines().next().unwrap_or_default();
        anyhow::anyhow!("{name}: {}", first.trim_start_matches("error: "))
    })
}

/// The sum of the workers' pools on each node against its available memory less one reserve.
fn fits(topo: &strata_mem::Topology, per_node: &BTreeMap<u32, u64>, reserve: u64) -> Result<()> {
    for (&n, &needed) in per_node {
        let Some(node) = topo.node(n) else { continue };
        let room = node.available_bytes.saturating_sub(reserve);
        if needed > room {
            bail!(
                "the deployment's workers place {} (pools and each one's weights, forward pass, staging and stores) on NUMA node {n}, which has {} available less a {} reserve: fewer workers or smaller pools (each worker's plan alone fits; together they do not)",
                strata_kv::units::format_bytes(needed),
                strata_kv::units::format_bytes(node.available_bytes),
                strata_kv::units::format_bytes(reserve),
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: u32, gib: u64) -> strata_mem::Node {
        strata_mem::Node {
            id,
            cpus: Vec::new(),
            total_bytes: gib << 30,
            available_bytes: gib << 30,
            source: "test".into(),
        }
    }

    /// Workers that each fit their node alone are refused together when their sum on a node
    /// passes what it has less one reserve; other nodes' room does not count.
    #[test]
    fn the_workers_sum_per_node_must_fit() {
        let topo = strata_mem::Topology {
            nodes: vec![node(0, 16), node(1, 64)],
        };
        let per = |v: &[(u32, u64)]| v.iter().map(|&(n, g)| (n, g << 30)).collect();
        assert!(fits(&topo, &per(&[(0, 14), (1, 60)]), 1 << 30).is_ok());
        let e = fits(&topo, &per(&[(0, 16), (1, 10)]), 1 << 30).unwrap_err();
        assert!(e.to_string().contains("NUMA node 0"), "{e}");
        assert!(fits(&topo, &per(&[(1, 64)]), 1).is_err());
    }

    #[test]
    fn a_config_is_a_bounded_regular_file() {
        let d = tempfile::tempdir().unwrap();
        assert!(read_config(d.path()).is_err(), "a directory");
        assert!(read_config(Path::new("/dev/zero")).is_err(), "a device");
        let big = d.path().join("big.toml");
        std::fs::write(&big, vec![b'#'; MAX_CONFIG_BYTES as usize + 1]).unwrap();
        assert!(read_config(&big).is_err(), "over the bound");
        let ok = d.path().join("ok.toml");
        std::fs::write(&ok, "[router]\nport = 0\n").unwrap();
        assert_eq!(read_config(&ok).unwrap(), "[router]\nport = 0\n");
    }
}
