//! `strata serve --kv-cache-dtype q8_0` end to end over a disk tier and Redis, and pages of
//! another dtype where a worker looks for its own: an f16 worker sharing the stores with a
//! q8_0 one never reads the q8_0 pages (other hashes), and q8_0 pages planted under the f16
//! worker's own hashes, on disk and in Redis, are counted misses
//! (`strata_l3_errors_total{kind="layout"}`) and the answer equals the cold run's; q8_0 pages
//! read back from disk and from Redis give the same bits.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use strata_kv::dtype::Dtype;
use strata_kv::storage::blob::{self, BlobKey};
use strata_kv::{PageHash, PageLayout};
use strata_model::tiny::{write_tiny, TinySpec};
use strata_test_support::{metrics_text, port_after, post_json, redis_cli, sample, Proc, Redis};

const PAGE: usize = 16;

/// Page files under `dir`: path → size.
fn page_files(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(page_files(&p));
        } else if p.extension().is_some_and(|x| x == "page") {
            out.push((p.clone(), e.metadata().unwrap().len()));
        }
    }
    out.sort();
    out
}

fn redis_keys(port: u16) -> BTreeSet<String> {
    let keys = redis_cli(port, &["--scan", "--pattern", "strata:*"]);
    keys.lines()
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect()
}

fn redis_set(port: u16, key: &str, value: &[u8]) {
    let mut c = Command::new("redis-cli")
        .args(["-p", &port.to_string(), "-x", "SET", key])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(value).unwrap();
    assert!(c.wait().unwrap().success());
}

fn hash_of(hex: &str) -> PageHash {
    let mut h = [0u8; 16];
    for (i, b) in h.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    PageHash(h)
}

struct Worker {
    _proc: Proc,
    port: u16,
}

/// A worker storing K/V as `dtype`, its L3 the disk tier `disk` (when given) then Redis.
fn serve(model: &Path, dtype: &str, disk: Option<&Path>, redis: &Redis) -> Worker {
    let mut args: Vec<String> = [
        "serve",
        "--port",
        "0",
        "--page-size",
        "16",
        "--device-mem",
        "4MiB",
        "--hicache-size",
        "8MiB",
        "--l3-size",
        "64MiB",
        "--kv-cache-dtype",
        dtype,
        "--model",
        model.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Some(d) = disk {
        args.extend(["--l3".into(), format!("disk:{}", d.display())]);
    }
    args.extend(["--l3".into(), redis.url()]);
    let mut proc = Proc::start(env!("CARGO_BIN_EXE_strata"), &args);
    let port = port_after(&proc.wait_for("ready on http://", 60), "ready on http://");
    Worker { _proc: proc, port }
}

impl Worker {
    /// The greedy answer to the prompt (choices with log-probabilities) and its cached tokens.
    fn ask(&self) -> (serde_json::Value, u64) {
        let prompt: Vec<u32> = (0..200).map(|j| 3 + (j * 31) % 250).collect();
        let body = serde_json::json!({
            "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 3,
        });
        let r = post_json(self.port, "/v1/completions", &body);
        let cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("no cached_tokens: {r}"));
        assert!(r["choices"][0]["text"].is_string(), "{r}");
        (r["choices"].clone(), cached)
    }

    fn metrics(&self) -> String {
        metrics_text(self.port)
    }

    /// Waits until every copy to the stores has landed.
    fn settle(&self) {
        let t = Instant::now();
        while sample(&self.metrics(), "strata_cache_copies_in_flight") != 0.0 {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "copies never settled"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[test]
fn pages_of_another_kv_dtype_are_counted_misses_never_misread() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("tiny32.gguf");
    // Heads of 32 values: a whole q8_0 block each.
    let spec = TinySpec {
        context: 1024,
        ..TinySpec::family("llama-h32").unwrap()
    };
    write_tiny(&model, &spec).unwrap();
    let disk = d.path().join("l3");
    let redis = Redis::start();

    // A q8_0 worker answers and stores pages of q8_0's size.
    let q8 = serve(&model, "q8_0", Some(&disk), &redis);
    q8.ask();
    q8.settle();
    drop(q8);
    let q8_files = page_files(&disk);
    let q8_keys = redis_keys(redis.port);
    assert!(!q8_files.is_empty() && !q8_keys.is_empty());

    // An f16 worker on the same stores finds none of them (other hashes): a cold run.
    let f16 = serve(&model, "f16", Some(&disk), &redis);
    let (cold, cached) = f16.ask();
    assert_eq!(cached, 0);
    f16.settle();
    let m = f16.metrics();
    drop(f16);
    assert_eq!(
        sample(&m, "strata_l3_errors_total{kind=\"layout\",tier=\"disk\"}"),
        0.0
    );
    let f16_files: Vec<(PathBuf, u64)> = page_files(&disk)
        .into_iter()
        .filter(|f| !q8_files.contains(f))
        .collect();
    let f16_keys: Vec<String> = redis_keys(redis.port)
        .difference(&q8_keys)
        .cloned()
        .collect();
    assert!(!f16_files.is_empty() && !f16_keys.is_empty());
    // 34 bytes per 32 values against 64, plus the header.
    let (q8_size, f16_size) = (q8_files[0].1, f16_files[0].1);
    let header = blob::HEADER as u64;
    assert_eq!((q8_size - header) * 64, (f16_size - header) * 34);

    // Plant intact q8_0 pages (their header names the q8_0 layout) under the f16 worker's own
    // hashes, on disk and in Redis.
    let mut o = strata_model::LoadOptions::new(1);
    o.kv_dtype = Dtype::Q8_0;
    let q8_model = strata_model::load(&model, o).unwrap().runtime;
    let q8_layout = PageLayout::new(PAGE, q8_model.pool_kinds(PAGE).unwrap()).unwrap();
    let q8_key = BlobKey::public().for_layout(&q8_layout);
    let payload = std::fs::read(&q8_files[0].0).unwrap()[blob::HEADER..].to_vec();
    assert_eq!(payload.len(), q8_layout.page_bytes());
    for (p, _) in &f16_files {
        let h = hash_of(p.file_stem().unwrap().to_str().unwrap());
        std::fs::write(p, blob::encode(&q8_key, &h, &payload)).unwrap();
    }
    for k in &f16_keys {
        let h = hash_of(k.rsplit(':').next().unwrap());
        redis_set(redis.port, k, &blob::encode(&q8_key, &h, &payload));
    }

    // The f16 worker again: every planted page is a counted miss, the answer the cold one,
    // and the log says pages were dropped.
    let mut f16 = serve(&model, "f16", Some(&disk), &redis);
    let (again, cached) = f16.ask();
    assert_eq!(cached, 0, "a page of another dtype was used");
    assert_eq!(again, cold);
    let m = f16.metrics();
    for tier in ["disk", "remote"] {
        let k = format!("strata_l3_errors_total{{kind=\"layout\",tier=\"{tier}\"}}");
        assert!(sample(&m, &k) >= 1.0, "{k}: {m}");
        let k = format!("strata_l3_errors_total{{kind=\"corrupt\",tier=\"{tier}\"}}");
        assert_eq!(sample(&m, &k), 0.0, "{k}");
    }
    f16._proc.wait_for("L3 pages that did not verify", 30);
    drop(f16);

    // The q8_0 pages themselves: a prefix from the disk tier and the same prefix from Redis
    // alone give the same bits (tokens and log-probabilities).
    let from_disk = serve(&model, "q8_0", Some(&disk), &redis).ask();
    let from_redis = serve(&model, "q8_0", None, &redis).ask();
    assert_eq!(
        from_disk.1, 192,
        "the prompt's whole pages but the last token's"
    );
    assert_eq!(from_disk, from_redis);
}
