//! `strata serve --window-tokens-ratio` on a DeepSeek-V4 file (the tiny model): the worker
//! allocates the window pages `strata plan` states for the same flags, serves with them, and
//! reports them on `/metrics`.

use std::process::Command;
use std::time::Duration;

use strata_test_support::{sample, spawn_ready, tiny_dsv4_model};

fn strata() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

fn curl(args: &[&str]) -> String {
    let o = Command::new("curl")
        .arg("-s")
        .args(args)
        .output()
        .expect("curl (scripts/test.sh installs it)");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `strata plan --json` for `model` with the pool flags `pools`.
fn plan_json(model: &std::path::Path, pools: &[&str]) -> serde_json::Value {
    let o = strata()
        .arg("plan")
        .args(pools)
        .arg("--model")
        .arg(model)
        .arg("--json")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// A worker with `pools` answers an 18-token prompt; its `/metrics` then.
fn served_metrics(model: &std::path::Path, pools: &[&str]) -> String {
    let mut cmd = strata();
    cmd.args(["serve", "--port", "0", "--threads", "2"])
        .args(pools)
        .arg("--model")
        .arg(model);
    let (_guard, port) = spawn_ready(&mut cmd, Duration::from_secs(120));
    let url = format!("http://127.0.0.1:{port}");
    let body = r#"{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18],"max_tokens":4,"temperature":0}"#;
    let a = curl(&[
        "-H",
        "content-type: application/json",
        "-d",
        body,
        &format!("{url}/v1/completions"),
    ]);
    assert!(a.contains("\"choices\""), "{a}");
    curl(&[&format!("{url}/metrics")])
}

#[test]
fn the_window_ratio_sizes_the_window_pages_the_worker_allocates() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_dsv4_model(d.path());
    let pools = [
        "--page-size",
        "4",
        "--device-mem",
        "8MiB",
        "--hicache-size",
        "16MiB",
        "--window-tokens-ratio",
        "0.25",
    ];
    let plan = plan_json(&model, &pools);
    let pages = |k: &str| plan[k].as_u64().unwrap() / 4;
    let (main, window) = (
        pages("device_tokens_per_rank"),
        pages("device_window_tokens_per_rank"),
    );
    let host_window = pages("host_window_tokens_per_rank");
    assert!(window > 0 && window < main / 3, "{main} {window}");

    let m = served_metrics(&model, &pools);
    let g = |k: &str| sample(&m, k) as u64;
    assert_eq!(
        g(r#"strata_cache_pages{tier="device",state="total"}"#),
        main
    );
    assert_eq!(
        g(r#"strata_cache_window_pages{tier="device",state="total"}"#),
        window
    );
    assert_eq!(
        g(r#"strata_cache_window_pages{tier="host",state="total"}"#),
        host_window
    );
    // The request's pages joined the tree with their window pages.
    assert!(g(r#"strata_cache_window_pages{tier="device",state="used"}"#) > 0);
}

/// `--window-checkpoint-pages K`: a committed prompt keeps window pages only before its end
/// and at its checkpoints (counted on `/metrics`); refused for a model without window kinds.
#[test]
fn checkpoints_keep_window_pages_only_where_a_continuation_can_start() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_dsv4_model(d.path());
    let mut cmd = strata();
    cmd.args(["serve", "--port", "0", "--threads", "2", "--page-size", "4"])
        .args(["--device-mem", "32MiB", "--window-checkpoint-pages", "64"])
        .arg("--model")
        .arg(&model);
    let (_guard, port) = spawn_ready(&mut cmd, Duration::from_secs(120));
    let url = format!("http://127.0.0.1:{port}");
    // 600 prompt tokens and 1 computed answer token: 150 whole pages. The spans before 256
    // (pages 32..64: the widest window is 128 tokens, 32 pages of 4) and 512 (96..128) and
    // before the end (from (600 - 1 - 128) / 4 = 117 to 150) keep theirs: 32 + 54 pages.
    let prompt: Vec<u32> = (0..600u32).map(|i| (i * 37 + 11) % 280).collect();
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 2, "temperature": 0});
    let a = curl(&[
        "-H",
        "content-type: application/json",
        "-d",
        &body.to_string(),
        &format!("{url}/v1/completions"),
    ]);
    assert!(a.contains("\"choices\""), "{a}");
    let m = curl(&[&format!("{url}/metrics")]);
    let used = sample(
        &m,
        r#"strata_cache_window_pages{tier="device",state="used"}"#,
    );
    assert_eq!(used, 86.0, "{m}");
    assert!(m.contains(r#"strata_cache_window_hits_total{resumed="backed_off"} 0"#));

    let tiny = strata_test_support::tiny_model(d.path());
    let o = strata()
        .args(["serve", "--port", "0", "--window-checkpoint-pages", "8"])
        .arg("--model")
        .arg(&tiny)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no window kinds"), "{err}");
}

/// No window flag: the plan's default residency. The device keeps window rings (not a window
/// page per page), so a request far longer than its window pages completes; the worker
/// allocates the window pages the plan states.
#[test]
fn by_default_a_request_longer_than_the_window_pages_completes() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_dsv4_model(d.path());
    let pools = [
        "--page-size",
        "4",
        "--device-mem",
        "8MiB",
        "--hicache-size",
        "16MiB",
    ];
    let o = strata()
        .arg("plan")
        .args(pools)
        .arg("--model")
        .arg(&model)
        .arg("--json")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let window_tokens = plan["device_window_tokens_per_rank"].as_u64().unwrap();
    assert!(plan["window_checkpoint_pages"].as_u64().unwrap() > 0);
    assert!(window_tokens < 900, "{window_tokens}");

    let mut cmd = strata();
    cmd.args(["serve", "--port", "0", "--threads", "2"])
        .args(pools)
        .arg("--model")
        .arg(&model);
    let (_guard, port) = spawn_ready(&mut cmd, Duration::from_secs(120));
    let url = format!("http://127.0.0.1:{port}");
    let prompt: Vec<u32> = (0..900u32).map(|i| (i * 31 + 7) % 280).collect();
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 4, "temperature": 0});
    let a = curl(&[
        "-H",
        "content-type: application/json",
        "-d",
        &body.to_string(),
        &format!("{url}/v1/completions"),
    ]);
    assert!(a.contains("\"choices\""), "{a}");
    let m = curl(&[&format!("{url}/metrics")]);
    let total = sample(
        &m,
        r#"strata_cache_window_pages{tier="device",state="total"}"#,
    );
    assert_eq!(total as u64, window_tokens / 4);
}

/// By default a chat's system part is a point where the window state stays: the first
/// conversation keeps it, so the next conversation with the same system prompt resumes there
/// (without it, the second would find the window state gone and recompute everything).
#[test]
fn the_next_conversation_resumes_at_the_shared_system_prompt() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_dsv4_model(d.path());
    let mut cmd = strata();
    cmd.args(["serve", "--port", "0", "--threads", "2", "--page-size", "4"])
        .args(["--device-mem", "32MiB", "--hicache-size", "32MiB"])
        .arg("--model")
        .arg(&model);
    let (_guard, port) = spawn_ready(&mut cmd, Duration::from_secs(120));
    let url = format!("http://127.0.0.1:{port}");
    let system = "you are a careful assistant who answers in short sentences about the sea, \
                  the ships on it, the weather that moves them and the ports they call at";
    let ask = |user: &str| {
        let body = serde_json::json!({
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user},
            ],
            "max_tokens": 3,
            "temperature": 0,
        });
        let a = curl(&[
            "-H",
            "content-type: application/json",
            "-d",
            &body.to_string(),
            &format!("{url}/v1/chat/completions"),
        ]);
        let v: serde_json::Value = serde_json::from_str(&a).unwrap_or_else(|_| panic!("{a}"));
        let u = &v["usage"];
        (
            u["prompt_tokens"].as_u64().unwrap(),
            u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        )
    };
    let (first, cached) = ask("which ship is the fastest");
    assert_eq!(cached, 0);
    let (second, cached) = ask("where do storms start");
    // The system part is most of either prompt: the second resumes after it.
    assert!(first > 40 && second > 40, "{first} {second}");
    assert!(
        cached * 2 > second,
        "{cached} of {second} prompt tokens cached"
    );
    let m = curl(&[&format!("{url}/metrics")]);
    assert!(
        m.contains(r#"strata_cache_window_hits_total{resumed="backed_off"} 0"#),
        "{m}"
    );
}

/// DeepSeek-V4 at TP 2: each rank holds its own copy of every state kind (one K = V head,
/// replicated), and what each rank allocates per kind is what `strata plan` stated for it.
#[test]
fn at_tp_2_each_rank_allocates_the_planned_pool_of_every_kind() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_dsv4_model(d.path());
    let pools = [
        "--page-size",
        "16",
        "--device-mem",
        "8MiB",
        "--hicache-size",
        "16MiB",
        "--tp-size",
        "2",
    ];
    let plan = plan_json(&model, &pools);
    let kinds = plan["pools"].as_array().unwrap();
    assert_eq!(kinds.len(), 7, "DeepSeek-V4's seven state kinds");

    let m = served_metrics(&model, &pools);
    let g = |k: String| sample(&m, &k) as u64;
    for p in kinds {
        let kind = p["kind"].as_str().unwrap();
        assert_eq!(p["tp"], "replicated", "{kind}");
        for r in 0..2u64 {
            let bpt = p["rank_bytes_per_token"][r as usize].as_u64().unwrap();
            assert_eq!(
                bpt,
                p["bytes_per_token"].as_u64().unwrap(),
                "{kind}: every rank all of it"
            );
            let own = format!("{kind}.tp{r}");
            for (tier, tokens) in [("device", "device_tokens"), ("host", "host_tokens")] {
                let planned = bpt * p[tokens].as_u64().unwrap();
                assert!(planned > 0, "{kind} {tier}");
                let gauge = format!(r#"strata_plan_{tier}_bytes{{pool="{kind}",rank="{r}"}}"#);
                assert_eq!(
                    g(gauge),
                    planned,
                    "{kind} rank {r} {tier}: the plan's gauge"
                );
                let built = format!(r#"strata_cache_capacity_bytes{{tier="{tier}",pool="{own}"}}"#);
                assert_eq!(g(built), planned, "{own} {tier}: allocated = planned");
            }
            let built = format!(r#"strata_pool_bytes_per_token{{pool="{own}"}}"#);
            assert_eq!(g(built), bpt, "{own}");
        }
    }
}
