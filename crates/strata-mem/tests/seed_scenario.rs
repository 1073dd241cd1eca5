//! The deployment that started the project, on a fake sysfs tree: 2 NUMA nodes × 240 GB, TP 4,
//! a model with a KV pool and an auxiliary indexer pool; prefill bound to node 0, decode to node 1.

use std::sync::Arc;

use strata_kv::pool::HostPool;
use strata_kv::{PageLayout, PoolKind};
use strata_mem::topology::write_fake_sysfs;
use strata_mem::*;

const GB: u64 = 1_000_000_000;

fn topo() -> (tempfile::TempDir, Topology) {
    let d = tempfile::tempdir().unwrap();
    let kb = |b: u64| b / 1024;
    write_fake_sysfs(
        d.path(),
        &[
            (0, "0-47", kb(240 * GB), kb(232 * GB)),
            (1, "48-95", kb(240 * GB), kb(231 * GB)),
        ],
    )
    .unwrap();
    let t = Topology::from_root(d.path(), &d.path().join("no-proc")).unwrap();
    (d, t)
}

fn req(role: &str, node: u32, host: Option<HostBudget>) -> PlanRequest {
    PlanRequest {
        role: role.into(),
        model: preset("deepseek-v3.2").unwrap(),
        tp: 4,
        page_size: 64,
        device: DeviceBudget::Bytes(2 << 30),
        host,
        numa: NumaChoice::Node(node),
        policy: NumaPolicy::Bind,
        reserve: None,
        device_in_host_memory: false,
        allowed_cpus: vec![0, 1],
        host_text: None,
        device_text: None,
        device_default: false,
        window_ratio: None,
        window_checkpoint_pages: None,
        max_running: 32,
        max_batch_tokens: 512,
        beside: Vec::new(),
        scratch: Default::default(),
    }
}

#[test]
fn prefill_and_decode_get_what_was_asked_on_their_nodes() {
    let (_d, t) = topo();
    for (role, node) in [("prefill", 0), ("decode", 1)] {
        let p = make_plan(&req(role, node, Some(HostBudget::Total(150 * GB))), &t).unwrap();
        assert_eq!(p.numa.nodes, vec![node]);
        // Whole pages of whole tokens: at most one page per rank below the budget, never above.
        let page_bytes = 64 * p.bytes_per_token;
        assert!(
            p.server_host_bytes <= 150 * GB && p.server_host_bytes > 150 * GB - 4 * page_bytes,
            "{}",
            p.render()
        );
        // Both pools are in the budget, each in proportion to its bytes per token.
        assert_eq!(p.pools.len(), 2);
        let sum: u64 = p.pools.iter().map(|x| x.host_bytes).sum();
        assert_eq!(sum, p.host_bytes_per_rank);
        for x in &p.pools {
            assert_eq!(x.host_bytes, x.host_tokens * x.bytes_per_token);
            assert_eq!(x.host_tokens, p.host_tokens_per_rank);
        }
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
        assert!(p
            .render()
            .contains("--hicache-total 150.00GB (150000000000 bytes) split over 4 ranks = 37.50GB (37500000000 bytes) per rank"));
        assert!(p.numa.headroom_bytes > 60 * GB);
    }
}

#[test]
fn ratio_on_a_small_device_pool_warns_with_the_flag_that_fixes_it() {
    let (_d, t) = topo();
    let p = make_plan(&req("prefill", 0, Some(HostBudget::Ratio(2.0))), &t).unwrap();
    assert_eq!(p.host_tokens_per_rank, 2 * p.device_tokens_per_rank);
    assert!(p.server_host_bytes < 20 * GB);
    assert_eq!(p.warnings.len(), 1, "{:?}", p.warnings);
    let w = &p.warnings[0];
    assert!(
        w.contains("--hicache-ratio 2 sized the host cache from the device pool"),
        "{w}"
    );
    assert!(
        w.contains("--hicache-total") && w.contains("--hicache-size"),
        "{w}"
    );
    assert!(p.render().contains("WARNING: --hicache-ratio 2"));
}

#[test]
fn three_hundred_gb_on_one_node_is_refused_with_alternatives() {
    let (_d, t) = topo();
    let e = make_plan(&req("prefill", 0, Some(HostBudget::Total(300 * GB))), &t)
        .unwrap_err()
        .to_string();
    assert!(!e.contains('\n'), "one line: {e}");
    assert!(
        e.starts_with(
            "--hicache-total 300.00GB (4 ranks × 75.00GB) does not fit NUMA node 0 (bind)"
        ),
        "{e}"
    );
    assert!(e.contains("--hicache-total") && e.contains("fits"), "{e}");
    assert!(e.contains("--numa-policy interleave"), "{e}");
    assert!(
        e.contains("split the cache over servers bound to different nodes"),
        "{e}"
    );
    // Interleaving over both nodes fits.
    let mut r = req("prefill", 0, Some(HostBudget::Total(300 * GB)));
    r.policy = NumaPolicy::Interleave;
    let p = make_plan(&r, &t).unwrap();
    assert_eq!(p.numa.nodes, vec![0, 1]);
}

#[test]
fn per_rank_size_refusal_suggests_a_per_rank_size() {
    let (_d, t) = topo();
    let e = make_plan(&req("prefill", 0, Some(HostBudget::PerRank(150 * GB))), &t)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("a smaller size (--hicache-size") && e.contains("per rank fits"),
        "{e}"
    );
}

#[test]
fn bad_inputs_are_refused_before_anything_else() {
    let (_d, t) = topo();
    let mut r = req("prefill", 7, Some(HostBudget::Total(GB)));
    assert_eq!(
        make_plan(&r, &t).unwrap_err().to_string(),
        "--numa-node 7: no such NUMA node (this machine's nodes: 0, 1)"
    );
    r.numa = NumaChoice::Node(0);
    r.host = Some(HostBudget::Ratio(f64::NAN));
    assert!(matches!(make_plan(&r, &t), Err(PlanError::Ratio(_))));
    r.host = None;
    r.device = DeviceBudget::Bytes(1000);
    assert!(make_plan(&r, &t)
        .unwrap_err()
        .to_string()
        .contains("less than one page"));
    r.device = DeviceBudget::FractionOfFree(1.5);
    assert!(matches!(make_plan(&r, &t), Err(PlanError::Fraction(_))));
    r.device = DeviceBudget::Bytes(GB);
    r.tp = 0;
    assert_eq!(make_plan(&r, &t), Err(PlanError::Tp(0)));
    // Bounds that once overflowed or allocated per rank before any check.
    r.tp = u32::MAX;
    assert_eq!(make_plan(&r, &t), Err(PlanError::Tp(u32::MAX)));
    r.tp = 1;
    for bad in [1e30, 1000.5, -1.0, f64::INFINITY] {
        r.host = Some(HostBudget::Ratio(bad));
        assert!(
            matches!(make_plan(&r, &t), Err(PlanError::Ratio(_))),
            "{bad}"
        );
    }
    // A host flag that asks for less than one page is an error, not a tier quietly off; 0 is
    // off.
    for host in [
        HostBudget::PerRank(1),
        HostBudget::Total(1000),
        HostBudget::Ratio(1e-9),
    ] {
        r.host = Some(host);
        let e = make_plan(&r, &t).unwrap_err();
        assert!(matches!(e, PlanError::HostTooSmall { .. }), "{e}");
    }
    r.host = Some(HostBudget::PerRank(0));
    assert!(make_plan(&r, &t).is_ok());
    // A refusal never advises a size of nothing: device pools in host memory that leave no
    // page for the host tier say so, and a reserve that leaves nothing says that.
    r.host = Some(HostBudget::PerRank(1 << 40));
    r.device = DeviceBudget::Bytes(1 << 50);
    let in_host = r.device_in_host_memory;
    r.device_in_host_memory = true;
    let e = make_plan(&r, &t).unwrap_err().to_string();
    assert!(
        e.contains("no host tier fits beside the device pools") && !e.contains("fits)"),
        "{e}"
    );
    r.device = DeviceBudget::Bytes(GB);
    r.host = None;
    r.reserve = Some(1 << 50);
    let e = make_plan(&r, &t).unwrap_err().to_string();
    assert!(
        e.contains("no smaller size: what the reserve leaves"),
        "{e}"
    );
    r.reserve = None;
    r.device_in_host_memory = in_host;
}

#[test]
fn auto_node_follows_the_cpus_the_process_may_use() {
    let (_d, t) = topo();
    let mut r = req("decode", 0, Some(HostBudget::Total(10 * GB)));
    r.numa = NumaChoice::Auto;
    r.allowed_cpus = vec![50, 51];
    let p = make_plan(&r, &t).unwrap();
    assert_eq!(p.numa.nodes, vec![1]);
    assert!(p.render().contains("node 1's CPUs"));
}

/// The prefill plan, scaled down 1000×, allocated for real on this machine's node 0 through
/// the cache's HostPool; decode's node 1 does not exist here and is refused clearly.
#[test]
fn scaled_down_allocation_as_planned() {
    let (_d, t) = topo();
    let p = make_plan(&req("prefill", 0, Some(HostBudget::Total(150 * GB))), &t).unwrap();
    let model = preset("deepseek-v3.2").unwrap();
    let kinds: Vec<PoolKind> = model
        .kinds
        .iter()
        .map(|k| k.per_rank(4, 64).unwrap())
        .collect();
    let layout = Arc::new(PageLayout::new(64, kinds).unwrap());
    let pages = (p.host_tokens_per_rank / 64 / 1000) as u32;
    let alloc = NumaAllocator::new(p.numa.nodes.clone(), NumaPolicy::Bind);
    let pool = HostPool::new(layout.clone(), pages, &alloc).unwrap();
    assert_eq!(pool.bytes() as u64, pages as u64 * 64 * p.bytes_per_token);
    assert_eq!(
        pool.bytes() as u64 * 1000 / 1000,
        p.host_bytes_per_rank / 1000 / (64 * p.bytes_per_token) * 64 * p.bytes_per_token
    );
    let (_r, placed) = alloc.allocate_verified(pool.bytes()).unwrap();
    assert!(placed.all_on(&[0]), "{}", placed.describe());
    let d = make_plan(&req("decode", 1, Some(HostBudget::Total(150 * GB))), &t).unwrap();
    let alloc1 = NumaAllocator::new(d.numa.nodes.clone(), NumaPolicy::Bind);
    if Topology::detect().unwrap().node(1).is_none() {
        let e = HostPool::new(layout, pages, &alloc1)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("mbind(bind to node(s) [1]) failed"), "{e}");
    }
}

/// SmolLM2's 3 KV heads over 2 ranks: 2 and 1 (`strata_kv::tp`). Each rank's pools hold the
/// same pages, sized for the larger rank; the server's bytes are each rank's own, not 2 × the
/// larger's.
#[test]
fn ranks_with_fewer_kv_heads_are_counted_as_they_are() {
    let (_d, t) = topo();
    let mut r = req("server", 0, Some(HostBudget::PerRank(GB)));
    r.model = preset("smollm2-135m").unwrap();
    r.page_size = 16;
    for (tp, each) in [
        (1, vec![23_040]),
        (2, vec![15_360, 7_680]),
        (4, vec![7_680; 4]),
    ] {
        r.tp = tp;
        let p = make_plan(&r, &t).unwrap();
        assert_eq!(p.rank_bytes_per_token, each, "TP {tp}");
        assert_eq!(p.bytes_per_token, each[0]);
        let all: u64 = each.iter().sum();
        assert_eq!(p.server_host_bytes, p.host_tokens_per_rank * all);
        assert_eq!(p.server_device_bytes, p.device_tokens_per_rank * all);
        let text = p.render();
        let line = text.lines().next().unwrap();
        if tp == 2 {
            assert!(
                line.contains("ranks hold 15360 / 7680 bytes per token"),
                "{line}"
            );
        } else {
            assert!(line.contains("every rank identical"), "{line}");
        }
    }
}

/// `--numa-nodes`: each rank's pools on its node; each node holds its own ranks' pools with its
/// own reserve; a node that cannot is named; interleave and unknown nodes are refused.
#[test]
fn ranks_on_their_own_nodes_fit_node_by_node() {
    let (_d, t) = topo();
    let mut r = req("server", 0, Some(HostBudget::PerRank(150 * GB)));
    r.model = preset("smollm2-135m").unwrap();
    r.page_size = 16;
    r.tp = 2;
    r.device_in_host_memory = true;
    // One rank per node: 150 GB + 75 GB (the 1-head rank) fit their nodes.
    r.numa = NumaChoice::Ranks(vec![0, 1]);
    let p = make_plan(&r, &t).unwrap();
    assert_eq!(p.numa.nodes, vec![0, 1]);
    assert!(p
        .decided_by
        .iter()
        .any(|d| d.by == "--numa-nodes: rank 0 on node 0, rank 1 on node 1"));
    // Both on node 0 with bigger caches: node 0 cannot hold 2 × its share.
    r.host = Some(HostBudget::PerRank(160 * GB));
    r.numa = NumaChoice::Ranks(vec![0, 0]);
    let e = make_plan(&r, &t).unwrap_err().to_string();
    assert!(e.contains("does not fit NUMA node 0"), "{e}");
    // Node 1 with the big rank: its share alone is over what node 1 has.
    r.host = Some(HostBudget::PerRank(225 * GB));
    r.numa = NumaChoice::Ranks(vec![1, 0]);
    let e = make_plan(&r, &t).unwrap_err().to_string();
    assert!(e.contains("node 1: ranks [0] need"), "{e}");
    r.host = Some(HostBudget::PerRank(GB));
    r.numa = NumaChoice::Ranks(vec![0, 2]);
    let e = make_plan(&r, &t).unwrap_err().to_string();
    assert!(
        e.contains("--numa-nodes node 2 is not on this machine"),
        "{e}"
    );
    r.numa = NumaChoice::Ranks(vec![0]);
    let e = make_plan(&r, &t).unwrap_err().to_string();
    assert!(e.contains("lists 1 nodes for --tp-size 2"), "{e}");
    r.numa = NumaChoice::Ranks(vec![0, 1]);
    r.policy = NumaPolicy::Interleave;
    let e = make_plan(&r, &t).unwrap_err().to_string();
    assert!(e.contains("--numa-policy interleave"), "{e}");
}

/// The forward pass's scratch (`PlanRequest::scratch`): reserved on every rank (the gathered
/// logits on rank 0 only), named in the report, named in a refusal that it alone causes,
/// checked node by node with `--numa-nodes`; nothing where the device pools are not in host
/// memory.
#[test]
fn the_forward_pass_is_reserved_on_every_rank() {
    let (_d, t) = topo();
    let mut r = req("server", 0, Some(HostBudget::PerRank(100 * GB)));
    r.model = preset("smollm2-135m").unwrap();
    r.page_size = 16;
    r.tp = 2;
    r.device_in_host_memory = true;
    let without = make_plan(&r, &t).unwrap();
    r.scratch = Scratch {
        layer: GB,
        logits: GB / 2,
        panels: 3,
        gathering: 7,
        copies: Copies {
            per_position: 100,
            block: 32,
            budget: 1000,
            context: 1 << 40,
            sequences: 32,
        },
    };
    let p = make_plan(&r, &t).unwrap();
    // The copies: one sequence of the whole device pool (over the budget), on each rank.
    let copies = 100 * p.device_tokens_per_rank.div_ceil(32) * 32;
    let all = 2 * (GB + copies + 3) + 7;
    let label = Scratch::LABEL.to_string();
    assert_eq!(p.numa.beside.last(), Some(&(label, all)));
    assert_eq!(p.numa.reserve_bytes, without.numa.reserve_bytes + all);
    assert_eq!(p.numa.headroom_bytes, without.numa.headroom_bytes - all);
    assert!(p.render().contains(Scratch::LABEL));
    // Pools that fit only without it: the refusal names it.
    let room = without.numa.headroom_bytes;
    r.scratch.layer = room / 2 + GB;
    let e = make_plan(&r, &t).unwrap_err().to_string();
    assert!(e.contains(&format!("a smaller {}", Scratch::LABEL)), "{e}");
    // One rank per node: each node holds its rank's scratch.
    r.scratch.layer = 80 * GB;
    r.host = Some(HostBudget::PerRank(150 * GB));
    r.numa = NumaChoice::Ranks(vec![0, 1]);
    let e = make_plan(&r, &t).unwrap_err().to_string();
    assert!(e.contains("node 0: ranks [0] need"), "{e}");
    // Device pools elsewhere (an accelerator plan): nothing reserved.
    r.device_in_host_memory = false;
    r.numa = NumaChoice::Node(0);
    r.host = Some(HostBudget::PerRank(100 * GB));
    let p = make_plan(&r, &t).unwrap();
    assert!(
        p.numa.beside.iter().all(|b| b.0 != Scratch::LABEL),
        "{:?}",
        p.numa.beside
    );
}
