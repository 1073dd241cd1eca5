//! `/metrics` of a worker with a disk tier and a Redis tier: each tier under its own label,
//! its entries, bytes and evictions equal to what the directory and Redis hold after a
//! workload that overflows both (a 1 MiB disk tier, a Redis with a 2 MB maxmemory).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use strata_test_support::{port_after, redis_cli, sample, Proc, Redis};

/// Regular files under `dir` (recursively) but the store's marker: how many, and their bytes.
fn files(dir: &Path) -> (u64, u64) {
    let (mut n, mut b) = (0, 0);
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.file_name() == "STRATA-L3" {
            continue;
        }
        let md = e.metadata().unwrap();
        if md.is_dir() {
            let (m, c) = files(&e.path());
            (n, b) = (n + m, b + c);
        } else if md.is_file() {
            (n, b) = (n + 1, b + md.len());
        }
    }
    (n, b)
}

/// Keys under `strata:` in Redis, and their value bytes.
fn redis_pages(port: u16) -> (u64, u64) {
    let keys = redis_cli(port, &["--scan", "--pattern", "strata:*"]);
    let keys: Vec<&str> = keys.lines().filter(|l| !l.is_empty()).collect();
    let mut bytes = 0;
    for k in &keys {
        bytes += redis_cli(port, &["STRLEN", k]).parse::<u64>().unwrap();
    }
    (keys.len() as u64, bytes)
}

fn info_field(port: u16, section: &str, name: &str) -> u64 {
    redis_cli(port, &["INFO", section])
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

fn metrics(port: u16) -> String {
    let o = Command::new("curl")
        .args(["-s", &format!("http://127.0.0.1:{port}/metrics")])
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn each_l3_tier_reports_what_it_holds() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("tiny.gguf");
    let spec = strata_model::tiny::TinySpec {
        context: 2048,
        ..Default::default()
    };
    strata_model::tiny::write_tiny(&model, &spec).unwrap();
    let redis = Redis::start();
    redis_cli(redis.port, &["CONFIG", "SET", "maxmemory", "2mb"]);
    redis_cli(
        redis.port,
        &["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"],
    );
    let disk = d.path().join("l3");
    let args: Vec<String> = [
        "serve",
        "--port",
        "0",
        "--device-mem",
        "1MiB",
        "--hicache-size",
        "2MiB",
        "--l3-size",
        "1MiB",
        "--l3",
        &format!("disk:{}", disk.display()),
        "--l3",
        &redis.url(),
        "--model",
        model.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut w = Proc::start(env!("CARGO_BIN_EXE_strata"), &args);
    let port = port_after(&w.wait_for("ready on http://", 60), "ready on http://");
    // Distinct prompts of 512 tokens: 32 pages of 4 KiB each, far more than both tiers hold.
    for i in 0..40u32 {
        let prompt: Vec<u32> = (0..512).map(|j| 3 + (i * 7919 + j * 31) % 250).collect();
        let body = serde_json::json!({"prompt": prompt, "max_tokens": 1}).to_string();
        let o = Command::new("curl")
            .args(["-s", "-H", "content-type: application/json", "-d", &body])
            .arg(format!("http://127.0.0.1:{port}/v1/completions"))
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("\"choices\""),
            "{}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
    // Every copy landed and both stores stopped changing; then the metrics match them.
    let t = Instant::now();
    loop {
        let m = metrics(port);
        let (files_n, files_b) = files(&disk);
        let (keys, key_bytes) = redis_pages(redis.port);
        let evicted = info_field(redis.port, "stats", "evicted_keys");
        let want = [
            ("strata_l3_entries{tier=\"disk\"}", files_n),
            ("strata_l3_used_bytes{tier=\"disk\"}", files_b),
            ("strata_l3_entries{tier=\"remote\"}", keys),
            ("strata_l3_used_bytes{tier=\"remote\"}", key_bytes),
            ("strata_l3_evictions_total{tier=\"remote\"}", evicted),
            (
                "strata_l3_capacity_bytes{tier=\"remote\"}",
                info_field(redis.port, "memory", "maxmemory"),
            ),
            ("strata_l3_capacity_bytes{tier=\"disk\"}", 1 << 20),
        ];
        let wrong: Vec<String> = want
            .iter()
            .filter(|(k, v)| sample(&m, k) != *v as f64)
            .map(|(k, v)| format!("{k}: metric {} store {v}", sample(&m, k)))
            .collect();
        let settled = sample(&m, "strata_cache_copies_in_flight") == 0.0;
        if wrong.is_empty() && settled {
            // Both tiers overflowed: each evicted, and each count is a real one.
            assert!(
                sample(&m, "strata_l3_evictions_total{tier=\"disk\"}") > 0.0,
                "{m}"
            );
            assert!(evicted > 0 && files_n > 0 && keys > 0, "{m}");
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the metrics never matched the stores: {}",
            wrong.join("; ")
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    drop(w);
}
