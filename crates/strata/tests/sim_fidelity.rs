//! The simulator's predictions against what a live server measures (issue 20's fidelity):
//! the same trace sent by `strata bench workload --workload trace --closed-loop` at
//! concurrency 1 to a real `strata serve` (the tiny model, its device and host pools sized in
//! bytes), and replayed by `strata sim` with the same scaling, page size, pool bytes and model;
//! the hit rate per tier agrees within 2 points.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use strata_test_support::{sample, spawn_ready, write_multi_turn_trace, ChildGuard};

fn strata() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Starts `strata serve` on a port the OS picks; the guard and the port.
fn serve(model: &Path, pools: &[&str]) -> (ChildGuard, u16) {
    let mut cmd = strata();
    cmd.args([
        "serve",
        "--port",
        "0",
        "--page-size",
        "16",
        "--threads",
        "2",
    ])
    .args(pools)
    .arg("--model")
    .arg(model);
    spawn_ready(&mut cmd, Duration::from_secs(120))
}

fn metrics(port: u16) -> String {
    let o = Command::new("curl")
        .args(["-s", &format!("http://127.0.0.1:{port}/metrics")])
        .output()
        .expect("curl (scripts/test.sh installs it)");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn the_simulator_predicts_the_live_servers_hit_rate_per_tier() {
    let d = tempfile::tempdir().unwrap();
    let model = strata_test_support::tiny_model_with_context(d.path(), 2048);
    // 24 conversations of 4 turns, 40 output tokens a request.
    let trace = write_multi_turn_trace(d.path(), 24, 4, 40);
    // The tiny model takes 256 B per token: 4,096 device and 12,288 host tokens, against
    // ~22,000 distinct ones, so both tiers evict.
    let pools = ["--device-mem", "1MiB", "--hicache-size", "3MiB"];
    let scaling = [
        "--length-scale",
        "0.25",
        "--max-tokens",
        "8",
        "--vocab",
        "288",
        "--limit",
        "0",
    ];
    let (_server, port) = serve(&model, &pools);
    let url = format!("http://127.0.0.1:{port}");
    let o = strata()
        .args([
            "bench",
            "workload",
            "--url",
            &url,
            "--workload",
            "trace",
            "--closed-loop",
        ])
        .args(["--concurrency", "1", "--trace"])
        .arg(&trace)
        .args(scaling)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let m = metrics(port);
    let prompt = sample(&m, "strata_prompt_tokens_total");
    let live = |tier: &str| {
        100.0
            * sample(
                &m,
                &format!("strata_cache_hit_tokens_total{{tier=\"{tier}\"}}"),
            )
            / prompt
    };
    let (live_device, live_host) = (live("device"), live("host"));
    let o = strata()
        .args(["sim", "--trace"])
        .arg(&trace)
        .args(["--model"])
        .arg(&model)
        .args([
            "--page-size",
            "16",
            "--device",
            "1MiB",
            "--host",
            "3MiB",
            "--eviction",
            "lru",
        ])
        .args(scaling)
        .output()
        .unwrap();
    let s = text(&o);
    assert!(o.status.success(), "{s}");
    let row = s
        .lines()
        .find(|l| l.starts_with("lru "))
        .unwrap_or_else(|| panic!("{s}"));
    let col = |i: usize| -> f64 { row.split_whitespace().nth(i).unwrap().parse().unwrap() };
    let (sim_device, sim_host) = (col(1), col(2));
    eprintln!(
        "live: device {live_device:.2}% host {live_host:.2}% of {prompt} prompt tokens; simulated: device {sim_device:.2}% host {sim_host:.2}%"
    );
    assert!(
        live_device > 5.0 && live_host > 5.0,
        "both tiers serve hits: {m}"
    );
    assert!(
        (live_device - sim_device).abs() <= 2.0,
        "device: live {live_device:.2} vs simulated {sim_device:.2}\n{s}"
    );
    assert!(
        (live_host - sim_host).abs() <= 2.0,
        "host: live {live_host:.2} vs simulated {sim_host:.2}\n{s}"
    );
}
