//! `strata plan` end to end, on a fake sysfs tree of the seed's machine (2 nodes × 240 GB) and
//! on this machine for real allocation.

use std::path::Path;
use std::process::{Command, Output};

use strata_mem::topology::write_fake_sysfs;

fn strata(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .expect("run strata")
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

fn seed_machine(dir: &Path) -> String {
    let kb = |gb: u64| gb * 1_000_000_000 / 1024;
    write_fake_sysfs(
        dir,
        &[
            (0, "0-47", kb(240), kb(232)),
            (1, "48-95", kb(240), kb(231)),
        ],
    )
    .unwrap();
    dir.to_str().unwrap().to_string()
}

fn seed_args<'a>(root: &'a str, role: &'a str, node: &'a str) -> Vec<&'a str> {
    vec![
        "plan",
        "--sysfs-root",
        root,
        "--model-preset",
        "deepseek-v3.2",
        "--tp-size",
        "4",
        "--page-size",
        "64",
        "--device-mem",
        "2GiB",
        "--role",
        role,
        "--numa-node",
        node,
    ]
}

#[test]
fn seed_prefill_and_decode_plan_as_asked() {
    let d = tempfile::tempdir().unwrap();
    let root = seed_machine(d.path());
    for (role, node) in [("prefill", "0"), ("decode", "1")] {
        let mut a = seed_args(&root, role, node);
        a.extend(["--hicache-total", "150GB", "--json"]);
        let o = strata(&a);
        assert!(o.status.success(), "{}", err(&o));
        let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
        let host = v["server_host_bytes"].as_u64().unwrap();
        assert!(host <= 150_000_000_000 && host > 149_000_000_000, "{v}");
        assert_eq!(v["numa"]["nodes"][0].as_u64().unwrap().to_string(), node);
        let pools = v["pools"].as_array().unwrap();
        assert_eq!(pools.len(), 2, "KV and indexer");
        assert_eq!(pools[1]["kind"], "indexer");
        assert!(pools[1]["host_bytes"].as_u64().unwrap() > 0);
        assert_eq!(v["warnings"].as_array().unwrap().len(), 0);
    }
}

#[test]
fn seed_ratio_warns_and_text_report_names_the_deciding_flags() {
    let d = tempfile::tempdir().unwrap();
    let root = seed_machine(d.path());
    let mut a = seed_args(&root, "prefill", "0");
    a.extend(["--hicache-ratio", "2"]);
    let o = strata(&a);
    assert!(o.status.success(), "{}", err(&o));
    let s = out(&o);
    assert!(
        s.contains("WARNING: --hicache-ratio 2 sized the host cache from the device pool"),
        "{s}"
    );
    assert!(
        s.contains("decided: host tokens per rank ← --hicache-ratio 2 ×"),
        "{s}"
    );
    assert!(
        s.contains("decided: device tokens per rank ← --device-mem 2GiB (2147483648 bytes)"),
        "{s}"
    );
    assert!(s.contains("indexer"), "{s}");
}

#[test]
fn refusals_are_one_line_with_exit_code_2() {
    let d = tempfile::tempdir().unwrap();
    let root = seed_machine(d.path());
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--hicache-total", "300GB"],
            "does not fit NUMA node 0 (bind)",
        ),
        (
            vec!["--hicache-size", "10GB", "--hicache-ratio", "2"],
            "cannot be used with",
        ),
        (
            vec!["--hicache-size", "10GB", "--hicache-total", "40GB"],
            "cannot be used with",
        ),
        (vec!["--hicache-size", "150"], "has no unit"),
        (
            vec!["--hicache-ratio", "-1"],
            "--hicache-ratio -1 must be a finite number in [0, 1000]",
        ),
        // Values that once overflowed or allocated per rank before any check.
        (
            vec!["--hicache-ratio", "1e30"],
            "must be a finite number in [0, 1000]",
        ),
        (
            vec!["--hicache-size", "16777215TiB"],
            "too large: at most 1024TiB",
        ),
        (
            vec!["--hicache-size", "1B"],
            "less than one page of 64 tokens",
        ),
        (vec!["--numa-policy", "random"], "--numa-policy `random`"),
    ];
    for (extra, want) in cases {
        let mut a = seed_args(&root, "prefill", "0");
        a.extend(extra.iter().copied());
        let o = strata(&a);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {}", err(&o));
        let e = err(&o);
        assert_eq!(e.trim_end().lines().count(), 1, "{extra:?}: {e}");
        assert!(e.contains(want), "{extra:?}: {e}");
        assert!(
            out(&o).is_empty(),
            "nothing planned or allocated on refusal"
        );
    }
    let mut a = seed_args(&root, "prefill", "5");
    a.extend(["--hicache-total", "1GB"]);
    let o = strata(&a);
    assert!(
        err(&o).contains("--numa-node 5: no such NUMA node (this machine's nodes: 0, 1)"),
        "{}",
        err(&o)
    );
    let mut a = seed_args(&root, "prefill", "0");
    a.extend(["--hicache-total", "300GB"]);
    let e = err(&strata(&a));
    assert!(
        e.contains("--numa-policy interleave") && e.contains("split the cache over servers"),
        "{e}"
    );
}

#[test]
fn allocates_binds_and_verifies_on_this_machine() {
    let o = strata(&[
        "plan",
        "--device-mem",
        "64MiB",
        "--hicache-size",
        "256MiB",
        "--numa-node",
        "0",
        "--allocate",
    ]);
    assert!(o.status.success(), "{}", err(&o));
    let s = out(&o);
    assert!(
        s.contains("allocated rank 0:") && s.contains("node 0: 1024/1024 sampled pages"),
        "{s}"
    );
    assert!(
        err(&o).contains("pre-faulting rank 0 host pool: 100%"),
        "{}",
        err(&o)
    );
}

#[test]
fn the_model_file_declares_its_pools() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("tiny.gguf");
    strata_model::tiny::write_tiny(&m, &strata_model::tiny::TinySpec::default()).unwrap();
    let o = strata(&[
        "plan",
        "--model",
        m.to_str().unwrap(),
        "--device-mem",
        "1MiB",
        "--hicache-size",
        "4MiB",
        "--json",
    ]);
    assert!(o.status.success(), "{}", err(&o));
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    // 2 layers × K,V × 2 KV heads × 16 dims × f16.
    assert_eq!(v["bytes_per_token"], 256);
    let bad = d.path().join("bad.gguf");
    std::fs::write(&bad, b"not a model").unwrap();
    let o = strata(&["plan", "--model", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(err(&o).trim_end().lines().count(), 1, "{}", err(&o));
    assert!(
        err(&o).contains("is not a readable GGUF file"),
        "{}",
        err(&o)
    );
    // Ranks the model does not split over are refused as `strata serve` refuses them (the
    // tiny model: 4 heads of 16 values; 2 ranks take 2 heads, 32 values, each).
    let m = m.to_str().unwrap();
    for (tp, code, want) in [
        ("3", 2, "--tp-size 3: a rank with 1 heads of 16 values"),
        ("5", 2, "--tp-size 5: tensor-parallel size 5 exceeds"),
        ("2", 0, ""),
    ] {
        let o = strata(&["plan", "--model", m, "--tp-size", tp]);
        assert_eq!(o.status.code(), Some(code), "{}", err(&o));
        assert!(err(&o).contains(want), "{}", err(&o));
    }
}

/// The seed's scenario planned for a machine other than this one (`--machine 2x240GB`): the
/// per-rank, per-pool table prints on any machine, sizes are echoed in the unit typed, and
/// 300 GB on one 240 GB node is refused with alternatives naming the flag that was given.
#[test]
fn what_if_machine_plans_the_seed_scenario_anywhere() {
    let args = |total: &str| {
        vec![
            "plan",
            "--machine",
            "2x240GB",
            "--model-preset",
            "deepseek-v3.2",
            "--tp-size",
            "4",
            "--device-mem",
            "2GiB",
            "--hicache-total",
            total,
            "--numa-node",
            "0",
        ]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>()
    };
    let a = args("150GB");
    let o = strata(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let text = out(&o);
    assert!(o.status.success(), "{}{}", text, err(&o));
    for want in [
        "kv ",
        "indexer ",
        "per rank",
        "per server (4 ranks)",
        "--machine 2x240GB: node 0 of 240GB",
        "--device-mem 2GiB (2147483648 bytes) per rank",
        "--hicache-total 150GB (150000000000 bytes) split over 4 ranks = 37.5GB (37500000000 bytes) per rank",
    ] {
        assert!(text.contains(want), "missing `{want}`:\n{text}");
    }
    let a = args("300GB");
    let o = strata(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(o.status.code(), Some(2));
    let e = err(&o);
    assert!(e.contains("--hicache-total 300GB (4 ranks × 75GB)"), "{e}");
    assert!(e.contains("does not fit NUMA node 0"), "{e}");
    assert!(
        e.contains("alternatives: a smaller size (--hicache-total "),
        "{e}"
    );
    assert!(e.contains("--numa-policy interleave"), "{e}");
    assert!(e.contains("split the cache over servers"), "{e}");
    // A size per rank is echoed as typed, not as the whole pages it makes.
    let o = strata(&["plan", "--hicache-size", "150GB", "--machine", "1x100GB"]);
    assert_eq!(o.status.code(), Some(2));
    let e = err(&o);
    assert!(
        e.contains("--hicache-size 150GB per rank × 1 rank = 150GB + "),
        "{e}"
    );
}

/// A device pool too big for the node: the advice names --device-mem (the flag given), in its
/// unit, not a host flag that was never typed.
#[test]
fn advice_names_the_flag_that_was_given() {
    let o = strata(&["plan", "--machine", "1x8GiB", "--device-mem", "64GiB"]);
    assert_eq!(o.status.code(), Some(2));
    let e = err(&o);
    assert!(e.contains("--device-mem 64GiB per rank"), "{e}");
    assert!(e.contains("(--device-mem "), "{e}");
    assert!(e.contains("GiB per rank fits)"), "{e}");
    assert!(!e.contains("--hicache"), "{e}");
    let o = strata(&[
        "plan",
        "--machine",
        "2x240GB",
        "--device-mem",
        "1GiB",
        "--hicache-size",
        "1GiB",
    ]);
    assert!(o.status.success(), "{}", err(&o));
    assert!(
        out(&o).contains("--hicache-size 1GiB (1073741824 bytes) per rank"),
        "{}",
        out(&o)
    );
    let o = strata(&["plan", "--machine", "0x8GB"]);
    assert_eq!(o.status.code(), Some(2));
}

/// A DeepSeek-V4 file: every state kind per rank from its header, with the granularity and
/// what a continuation reads, the same bytes per token as the layout the engine lays out (so
/// `strata serve` allocates what was printed); a page that splits a block is refused naming
/// --page-size.
#[test]
fn a_deepseek_v4_file_plans_every_state_kind_as_the_engine_lays_it_out() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("tiny-dsv4.gguf");
    let spec = strata_model::tiny::deepseek4::TinyDsv4Spec::default();
    strata_model::tiny::deepseek4::write_tiny_dsv4(&m, &spec).unwrap();
    let model = strata_model::deepseek4::load::load_dsv4(&m).unwrap();
    for ps in [4usize, 16, 64, 256] {
        let o = strata(&[
            "plan",
            "--model",
            m.to_str().unwrap(),
            "--page-size",
            &ps.to_string(),
            "--device-mem",
            "8MiB",
            "--hicache-size",
            "32MiB",
            "--json",
        ]);
        assert!(o.status.success(), "{}", err(&o));
        let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
        let planned: Vec<(String, u64)> = v["pools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                let kind = p["kind"].as_str().unwrap().to_string();
                (kind, p["bytes_per_token"].as_u64().unwrap())
            })
            .collect();
        let laid_out: Vec<(String, u64)> = model
            .pool_kinds(ps)
            .unwrap()
            .iter()
            .map(|k| (k.name.clone(), k.bytes_per_token() as u64))
            .collect();
        assert_eq!(planned, laid_out, "page size {ps}");
        assert_eq!(planned.len(), 7);
    }
    let o = strata(&[
        "plan",
        "--model",
        m.to_str().unwrap(),
        "--page-size",
        "16",
        "--device-mem",
        "8MiB",
        "--hicache-size",
        "32MiB",
    ]);
    let text = out(&o);
    for want in [
        "raw        token           last 32 tokens",
        "csa        4-token block   prefix",
        "hca        128-token block prefix",
        "hca_rows   token           last 128 tokens",
        "each of the 7 pool kinds' tokens per rank ← --page-size 16",
        "--hicache-size 32MiB (33554432 bytes) per rank",
    ] {
        assert!(text.contains(want), "missing `{want}`:\n{text}");
    }
    let o = strata(&["plan", "--model", m.to_str().unwrap(), "--page-size", "6"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(err(&o).contains("--page-size 6:"), "{}", err(&o));
}

/// The incident's scenario with DeepSeek-V4's published dimensions: TP 4, 150 GB of host
/// cache per server on node 0 of a 2 × 240 GB machine, an absolute size — what the incident's
/// stack refused for this model — planned with every state kind inside the budget.
#[test]
fn the_incident_plans_deepseek_v4_with_an_absolute_host_size() {
    for preset in ["deepseek-v4-flash", "deepseek-v4-pro"] {
        let o = strata(&[
            "plan",
            "--machine",
            "2x240GB",
            "--model-preset",
            preset,
            "--tp-size",
            "4",
            "--page-size",
            "64",
            "--device-mem",
            "2GiB",
            "--hicache-total",
            "150GB",
            "--numa-node",
            "0",
            "--role",
            "prefill",
            "--json",
        ]);
        assert!(o.status.success(), "{preset}: {}", err(&o));
        let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
        let pools = v["pools"].as_array().unwrap();
        let kinds: Vec<&str> = pools.iter().map(|p| p["kind"].as_str().unwrap()).collect();
        let want: &[&str] = &[
            "raw",
            "csa",
            "index",
            "hca",
            "csa_rows",
            "index_rows",
            "hca_rows",
        ];
        assert_eq!(kinds, want, "{preset}");
        let host: u64 = pools
            .iter()
            .map(|p| p["host_bytes"].as_u64().unwrap())
            .sum();
        assert_eq!(host, v["host_bytes_per_rank"].as_u64().unwrap());
        let server = v["server_host_bytes"].as_u64().unwrap();
        assert!(
            server <= 150_000_000_000 && server > 149_000_000_000,
            "{preset}: {server}"
        );
        // One K = V head of 512 in bf16 on every rank, whatever the TP size.
        let layers = if preset == "deepseek-v4-flash" {
            43
        } else {
            61
        };
        assert_eq!(pools[0]["bytes_per_token"], layers * 512 * 2);
    }
}

/// Each family's file sizes its K/V from its own metadata: Qwen3's head size is its
/// `key_length` (32 here), not embedding / heads (16).
#[test]
fn every_familys_file_sizes_its_kv() {
    let d = tempfile::tempdir().unwrap();
    // 2 layers × K,V × 2 KV heads × head size × f16.
    for (family, bytes) in [
        ("llama", 256),
        ("llama3", 256),
        ("qwen2", 256),
        ("qwen3", 512),
    ] {
        let m = d.path().join(format!("{family}.gguf"));
        let spec = strata_model::tiny::TinySpec::family(family).unwrap();
        strata_model::tiny::write_tiny(&m, &spec).unwrap();
        let o = strata(&[
            "plan",
            "--model",
            m.to_str().unwrap(),
            "--device-mem",
            "1MiB",
            "--json",
        ]);
        assert!(o.status.success(), "{family}: {}", err(&o));
        let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
        assert_eq!(v["bytes_per_token"], bytes, "{family}");
    }
}

/// `--window-tokens-ratio`: DeepSeek-V4-Pro's window kinds (98 % of a page) keep their state
/// for a share of the tokens only, so the incident's 150 GB hold many times the tokens of
/// compressed prefix; the plan states the ratio, every kind's tokens and bytes inside the
/// budget. A ratio out of (0, 1], or for a model without window kinds, is refused by name.
#[test]
fn a_window_ratio_lets_the_same_budget_hold_more_prefix() {
    let plan = |ratio: Option<&str>, preset: &str| {
        plan_incident(
            preset,
            ratio.map(|r| ["--window-tokens-ratio", r]).as_slice(),
        )
    };
    // Every page keeping its window kinds (the old default): what the ratio is against.
    let whole: serde_json::Value = serde_json::from_str(&out(&plan_incident(
        "deepseek-v4-pro",
        &[["--window-checkpoint-pages", "0"]],
    )))
    .unwrap();
    let o = plan(Some("0.02"), "deepseek-v4-pro");
    assert!(o.status.success(), "{}", err(&o));
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    let tokens = v["host_tokens_per_rank"].as_u64().unwrap();
    let before = whole["host_tokens_per_rank"].as_u64().unwrap();
    assert!(tokens > 20 * before, "{tokens} vs {before}");
    let window = v["host_window_tokens_per_rank"].as_u64().unwrap();
    assert_eq!(window, (tokens as f64 * 0.02) as u64 / 64 * 64);
    let mut sum = 0;
    for p in v["pools"].as_array().unwrap() {
        let want = if p["needed"] == "prefix" {
            tokens
        } else {
            window
        };
        assert_eq!(p["host_tokens"].as_u64().unwrap(), want, "{}", p["kind"]);
        sum += p["host_bytes"].as_u64().unwrap();
    }
    assert_eq!(sum, v["host_bytes_per_rank"].as_u64().unwrap());
    assert!(sum <= 37_500_000_000, "{sum}");
    let decided = v["decided_by"].to_string();
    assert!(decided.contains("--window-tokens-ratio 0.02"), "{decided}");
    for (ratio, preset, want) in [
        ("0", "deepseek-v4-pro", "must be in (0, 1]"),
        ("1.5", "deepseek-v4-pro", "must be in (0, 1]"),
        ("0.5", "smollm2-135m", "has no window kinds"),
    ] {
        let o = plan(Some(ratio), preset);
        assert_eq!(o.status.code(), Some(2), "{ratio} {preset}");
        assert!(err(&o).contains(want), "{ratio} {preset}: {}", err(&o));
    }
}

/// The incident's plan (DeepSeek-V4-Pro, TP 4, 2 GiB device, 150 GB host on node 0) at pages
/// of 64 tokens, with extra flags.
fn plan_incident(preset: &str, extra: &[[&str; 2]]) -> std::process::Output {
    let mut args = vec![
        "plan",
        "--machine",
        "2x240GB",
        "--model-preset",
        preset,
        "--tp-size",
        "4",
        "--page-size",
        "64",
        "--device-mem",
        "2GiB",
        "--hicache-total",
        "150GB",
        "--numa-node",
        "0",
        "--json",
    ];
    for f in extra {
        args.extend(f);
    }
    strata(&args)
}

/// The incident with no window flag at the default page size: the host holds ≥ 2.9 M main
/// tokens per rank (≥ 90 % of 37.5 GB at the 11,584 bytes per token a continuation needs for
/// the whole prefix), the window pages are sized for `--max-running` sequence ends plus
/// checkpoints (stated with their bytes, what K costs and saves), the device keeps rings, and
/// a K given by the operator is honoured (more checkpoints: fewer main tokens).
#[test]
fn the_incidents_150gb_hold_the_prefix_tokens_the_operator_bought() {
    let run = |extra: &[&str]| {
        let mut args = vec![
            "plan",
            "--machine",
            "2x240GB",
            "--model-preset",
            "deepseek-v4-pro",
            "--tp-size",
            "4",
            "--device-mem",
            "2GiB",
            "--hicache-total",
            "150GB",
            "--numa-node",
            "0",
            "--json",
        ];
        args.extend(extra);
        let o = strata(&args);
        assert!(o.status.success(), "{}", err(&o));
        serde_json::from_str::<serde_json::Value>(&out(&o)).unwrap()
    };
    let v = run(&[]);
    let host = v["host_tokens_per_rank"].as_u64().unwrap();
    let bound = 37_500_000_000u64 / 11_584;
    assert!(host >= 2_900_000, "{host} host tokens per rank");
    assert!(host * 10 >= bound * 9, "{host} of {bound}");
    assert!(v["host_bytes_per_rank"].as_u64().unwrap() <= 37_500_000_000);
    let k = v["window_checkpoint_pages"].as_u64().unwrap();
    assert!(k > 0, "checkpoints by default");
    // 32 sequence ends of 9 pages at least, within ~10 % of the budget.
    let window_pages = v["host_window_tokens_per_rank"].as_u64().unwrap() / 16;
    assert!(window_pages >= 32 * 9, "{window_pages}");
    let decided = v["decided_by"].to_string();
    for want in [
        "host window pages per rank",
        "sequence ends",
        "a checkpoint of 8 pages every",
        "halving the interval would cost",
        "a running request holds its window state",
    ] {
        assert!(decided.contains(want), "{want}: {decided}");
    }
    // The longest request: the device's main tokens, not its window tokens.
    assert!(v["device_tokens_per_rank"].as_u64().unwrap() > 50_000);
    // The operator's K: twice as many checkpoints cost main tokens.
    let half = (k / 2).to_string();
    let w = run(&["--window-checkpoint-pages", &half]);
    assert_eq!(w["window_checkpoint_pages"].as_u64().unwrap(), k / 2);
    assert!(w["host_tokens_per_rank"].as_u64().unwrap() < host);
    // Every page keeping its window kinds: the incident again, as the plan says.
    let every = run(&["--window-checkpoint-pages", "0"]);
    assert!(every["host_tokens_per_rank"].as_u64().unwrap() < host / 30);
    // Checkpoints for a model without window kinds: refused by name.
    let o = strata(&[
        "plan",
        "--model-preset",
        "smollm2-135m",
        "--window-checkpoint-pages",
        "8",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(err(&o).contains("has no window kinds"), "{}", err(&o));
}

/// `--help` names every preset the planner knows (from its own table), for plan, serve and
/// sim alike.
#[test]
fn help_names_every_preset() {
    for cmd in ["plan", "sim"] {
        let o = strata(&[cmd, "--help"]);
        let text = out(&o);
        for p in strata_mem::PRESETS {
            assert!(text.contains(p), "`strata {cmd} --help` lacks {p}:\n{text}");
        }
    }
}

/// `--kv-cache-dtype q8_0` holds ≥ 1.85× the host tokens of f16 in the same bytes, the plan
/// says why, K and V apart become two kinds, and a model without K/V planes refuses it.
#[test]
fn quantized_kv_plans_more_tokens_in_the_same_bytes() {
    let host_tokens = |extra: &[&str]| -> (u64, serde_json::Value) {
        let mut a = vec!["plan", "--machine", "2x240GB", "--numa-node", "0"];
        a.extend(["--tp-size", "4", "--hicache-total", "150GB", "--json"]);
        a.extend(extra);
        let o = strata(&a);
        assert!(o.status.success(), "{extra:?}: {}", err(&o));
        let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
        (v["host_tokens_per_rank"].as_u64().unwrap(), v)
    };
    let (f16, _) = host_tokens(&[]);
    let (q8, v) = host_tokens(&["--kv-cache-dtype", "q8_0"]);
    assert!(q8 as f64 >= 1.85 * f16 as f64, "{q8} vs {f16}");
    let said = v["decided_by"].to_string();
    assert!(said.contains("K and V as q8_0"), "{said}");
    let (split, v) = host_tokens(&["--cache-type-k", "q8_0", "--cache-type-v", "f16"]);
    assert!(split > f16 && split < q8, "{split}");
    let kinds: Vec<&str> = v["pools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["k", "v"], "{v}");
    let o = strata(&[
        "plan",
        "--model-preset",
        "deepseek-v4-pro",
        "--kv-cache-dtype",
        "fp8_e4m3",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        err(&o).contains("keep the dtypes the model defines"),
        "{}",
        err(&o)
    );
}
