//! The live miss-ratio curve on a worker's `/metrics` and `/cache/curve`: every tier's points
//! at 0.25× to 8× its pages, rising with the size, Belady's bound beside them, counting every
//! served prompt's whole pages once (PD: on the prefill and the decode worker), in a memory
//! that does not change with the traffic; the router's fleet curve per role; `--curve-pages
//! 0` turns it off.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use strata_test_support::up::Up;
use strata_test_support::{
    get_json, metrics_text, port_after, post_json, sample, tiny_model_with_context, Proc,
};

fn serve(model: &Path, extra: &[&str]) -> (Proc, u16) {
    let mut args: Vec<String> = ["serve", "--port", "0", "--page-size", "16"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(["--device-mem", "1MiB", "--hicache-size", "2MiB"].map(String::from));
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(["--model".into(), model.display().to_string()]);
    let mut p = Proc::start(env!("CARGO_BIN_EXE_strata"), &args);
    let port = port_after(&p.wait_for("ready on http://", 60), "ready on http://");
    (p, port)
}

fn ask(port: u16, prompt: &[u32]) {
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 1, "temperature": 0});
    let r = post_json(port, "/v1/completions", &body);
    assert!(r["choices"][0]["text"].is_string(), "{r}");
}

#[test]
fn the_curve_rises_with_the_size_and_counts_every_prompt_page() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_model_with_context(d.path(), 2048);
    let rec = d.path().join("rec.jsonl");
    let rec_s = rec.display().to_string();
    // LRU: the curve over all traffic from the sampled reuse distances.
    let (_w, port) = serve(&model, &["--record-trace", &rec_s, "--eviction", "lru"]);
    let before = metrics_text(port);
    let memory = sample(&before, "strata_cache_curve_memory_bytes");
    assert!(memory > 0.0, "{before}");
    let (doc, pages) = a_document_read_three_times(port);
    let m = metrics_text(port);
    assert_eq!(
        sample(&m, "strata_cache_curve_references_total"),
        pages as f64,
        "{m}"
    );
    assert_eq!(sample(&m, "strata_cache_curve_memory_bytes"), memory);
    assert_eq!(sample(&m, "strata_cache_curve_sample_rate"), 1.0);
    for tier in ["device", "host"] {
        let at = |scale: &str| {
            let k = format!(
                "strata_cache_curve_hit_ratio{{tier=\"{tier}\",scale=\"{scale}\",policy=\"lru\"}}"
            );
            sample(&m, &k)
        };
        let curve: Vec<f64> = ["0.25", "0.5", "1", "2", "4", "8"].map(at).to_vec();
        assert!(
            curve.iter().all(|h| (0.0..=1.0).contains(h)),
            "{tier}: {curve:?}"
        );
        assert!(curve.windows(2).all(|w| w[0] <= w[1]), "{tier}: {curve:?}");
        // Every page of the document's second and third reading hits a large enough cache
        // (the 4 prompts between two readings hold 80 pages).
        let pages_of = |scale: &str| {
            let k = format!("strata_cache_curve_pages{{tier=\"{tier}\",scale=\"{scale}\"}}");
            sample(&m, &k)
        };
        if pages_of("8") > 100.0 {
            // 2 × 20 pages of 16 tokens of 15 × 320 prompt tokens.
            assert!(curve[5] >= 640.0 / 4800.0 - 1e-9, "{tier}: {curve:?}");
        }
    }

    // The same as JSON, with Belady's bound once the window was simulated (in the background).
    let c = settled(port, pages as u64);
    assert_eq!(c["policy"], "lru");
    for p in c["points"].as_array().unwrap() {
        let (h, b) = (
            p["hit_ratio"].as_f64().unwrap(),
            p["belady"].as_f64().unwrap(),
        );
        assert!(h <= b + 0.02, "{p}");
        assert!(
            p["bytes"].as_f64().unwrap() >= p["pages"].as_f64().unwrap(),
            "{p}"
        );
    }
    let host = c["gains"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["tier"] == "host")
        .unwrap();
    assert_eq!(host["added_bytes"], 1u64 << 30);
    let saved = host["saved_prompt_tokens_per_second"].as_f64().unwrap();
    assert!(saved.is_finite() && saved >= 0.0, "{host}");
    let m = metrics_text(port);
    assert!(m.contains("strata_cache_curve_belady_hit_ratio{"), "{m}");
    recorded_trace_replays_as_the_curve_says(port, &rec, &c);
    assert!(m.contains("strata_cache_curve_step_saved_prompt_tokens_per_second{tier=\"host\"}"));

    let (_off, port) = serve(&model, &["--curve-pages", "0"]);
    ask(port, &doc);
    let m = metrics_text(port);
    assert!(!m.contains("strata_cache_curve_"), "{m}");
    let (status, _) = strata_test_support::http1(port, "GET", "/cache/curve", "", "");
    assert_eq!(status, 404);
}

/// A 320-token document read three times between 12 others (20 pages each): the doc and the
/// prompt pages sent.
fn a_document_read_three_times(port: u16) -> (Vec<u32>, usize) {
    let doc: Vec<u32> = (0..320).map(|j| 3 + (j * 7) % 250).collect();
    let mut pages = 0;
    for i in 0..15u32 {
        let p: Vec<u32> = if i % 5 == 0 {
            doc.clone()
        } else {
            (0..320).map(|j| 3 + (i * 131 + j * 17) % 250).collect()
        };
        ask(port, &p);
        pages += p.len() / 16;
    }
    (doc, pages)
}

/// The default policy (`auto`): the curve from the miniature simulation of its page-granular
/// form over the window, against `strata sim --eviction auto` on the recorded trace.
#[test]
fn the_default_policy_has_its_curve_too() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_model_with_context(d.path(), 2048);
    let rec = d.path().join("rec.jsonl");
    let (_w, port) = serve(&model, &["--record-trace", &rec.display().to_string()]);
    let (_, pages) = a_document_read_three_times(port);
    let c = settled(port, pages as u64);
    assert_eq!(c["policy"], "auto");
    let m = metrics_text(port);
    assert!(
        m.contains("strata_cache_curve_hit_ratio{tier=\"host\",scale=\"1\",policy=\"auto\"}"),
        "{m}"
    );
    recorded_trace_replays_as_the_curve_says(port, &rec, &c);
}

/// The recorded trace: one line per request, mode 0600, lengths and ids only; `strata sim` on
/// it hits what the worker's curve says at the host tier's size; `strata plan --advise-from`
/// reads the curve.
fn recorded_trace_replays_as_the_curve_says(port: u16, rec: &Path, c: &Value) {
    use std::os::unix::fs::PermissionsExt;
    let text = std::fs::read_to_string(rec).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 15);
    for l in &lines {
        let mut keys: Vec<&String> = l.as_object().unwrap().keys().collect();
        keys.sort();
        assert_eq!(
            keys,
            ["hash_ids", "input_length", "output_length", "timestamp"],
            "{l}"
        );
        assert_eq!(l["input_length"], 320);
        assert_eq!(l["hash_ids"].as_array().unwrap().len(), 20);
    }
    // The document's readings share their ids, the others none with it.
    assert_eq!(lines[0]["hash_ids"], lines[5]["hash_ids"]);
    assert_ne!(lines[0]["hash_ids"][0], lines[1]["hash_ids"][0]);
    let mode = std::fs::metadata(rec).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);

    let host = c["points"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["tier"] == "host" && p["scale"] == 1.0)
        .unwrap();
    let tokens = host["pages"].as_u64().unwrap() * 16;
    let policy = c["policy"].as_str().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "sim",
            "--trace",
            &rec.display().to_string(),
            "--block-tokens",
            "16",
        ])
        .args([
            "--page-size",
            "16",
            "--eviction",
            policy,
            "--device",
            &tokens.to_string(),
        ])
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{so}");
    let sim: f64 = so
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{policy} ")))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("{so}"));
    let live = host["hit_ratio"].as_f64().unwrap() * 100.0;
    assert!(
        (live - sim).abs() <= 2.0,
        "{policy}: live {live} % vs strata sim {sim} %\n{so}"
    );

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["plan", "--advise-from", &format!("http://127.0.0.1:{port}")])
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{so}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(so.contains("advice: --hicache-size "), "{so}");
    assert!(
        so.contains("answer: +1.00 GiB (1073741824 bytes) per rank of host cache"),
        "{so}"
    );
}

/// `/cache/curve` of the worker on `port` once its window simulations counted `refs`
/// references (they run in the background).
fn settled(port: u16, refs: u64) -> Value {
    let t = Instant::now();
    loop {
        let c = get_json(port, "/cache/curve");
        if c["window_references"].as_u64() == Some(refs) {
            return c;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "never settled: {c}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Under PD (decode-side reuse on), the prefill and the decode worker each count every
/// request's prompt pages once (a request the decode worker handed back and took again with
/// its K/V too), and the router's `/cache/curve` has a fleet curve per role.
#[test]
fn pd_workers_count_each_prompt_once_and_the_router_draws_the_fleet() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_model_with_context(d.path(), 2048);
    let cfg = r#"host = "127.0.0.1"
smoke_test = false
[router]
port = 0
[[prefill]]
port = 0
args = ["--page-size", "16", "--device-mem", "4MiB", "--hicache-size", "8MiB"]
[[decode]]
port = 0
args = ["--page-size", "16", "--device-mem", "4MiB", "--hicache-size", "8MiB", "--pd-local-prefill-tokens", "0"]
"#;
    let path = d.path().join("up.toml");
    std::fs::write(&path, cfg).unwrap();
    let state = d.path().join("state");
    let mut up = Up::start(env!("CARGO_BIN_EXE_strata"), &path, &model, &state, &[]);
    let ready = up.ready(120);
    let (r, pp, dp) = (
        ready.router,
        ready.port("prefill-0"),
        ready.port("decode-0"),
    );
    // A document asked about four times (the decode worker holds it from the second on),
    // and four one-off prompts (handed back: nothing held).
    let doc: Vec<u32> = (0..320).map(|j| 3 + (j * 7) % 250).collect();
    let mut pages = 0u64;
    for i in 0..8u32 {
        let mut p = if i % 2 == 0 {
            doc.clone()
        } else {
            (0..320).map(|j| 3 + (i * 131 + j * 17) % 250).collect()
        };
        p.extend([5 + i, 6, 7]);
        let body = serde_json::json!({"prompt": p, "max_tokens": 2, "temperature": 0});
        let a = post_json(r, "/v1/completions", &body);
        assert!(a["choices"][0]["text"].is_string(), "{a}");
        pages += (p.len() / 16) as u64;
    }
    for port in [pp, dp] {
        let m = metrics_text(port);
        assert_eq!(
            sample(&m, "strata_cache_curve_references_total"),
            pages as f64,
            "{m}"
        );
    }
    let t = Instant::now();
    let fleet = loop {
        let f = get_json(r, "/cache/curve");
        let roles: Vec<&str> = f["roles"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|c| c["role"].as_str())
            .collect();
        if roles == ["prefill", "decode"] {
            break f;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "{f}");
        std::thread::sleep(Duration::from_millis(200));
    };
    for role in fleet["roles"].as_array().unwrap() {
        assert_eq!(role["references"].as_u64(), Some(pages), "{role}");
        assert!(!role["points"].as_array().unwrap().is_empty(), "{role}");
    }
    assert_eq!(fleet["workers"].as_array().unwrap().len(), 2);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["plan", "--advise-from", &format!("http://127.0.0.1:{r}")])
        .args(["--pd-total", "32MiB"])
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{so}");
    for line in ["prefill: ", "decode: ", "| 50% |", "split: "] {
        assert!(so.contains(line), "{line}: {so}");
    }
}

/// Prompts a client chooses cannot grow the sampler past its budget or make a figure of the
/// curve non-finite: a worker tracking 64 pages, sent more distinct pages than that, one-token
/// prompts (nothing to reference, all miss) and a prompt of one page repeated.
#[test]
fn crafted_prompts_keep_the_sampler_in_its_budget_and_every_figure_finite() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_model_with_context(d.path(), 2048);
    let (_w, port) = serve(&model, &["--curve-pages", "64"]);
    let memory = sample(&metrics_text(port), "strata_cache_curve_memory_bytes");
    ask(port, &[7]);
    let m = metrics_text(port);
    assert_eq!(
        sample(&m, "strata_cache_curve_references_total"),
        0.0,
        "{m}"
    );
    for i in 0..12u32 {
        let p: Vec<u32> = (0..320).map(|j| 3 + (i * 977 + j * 31) % 250).collect();
        ask(port, &p);
        ask(port, &[5 + i]);
    }
    let same: Vec<u32> = [9u32; 16].repeat(40);
    ask(port, &same);
    let m = metrics_text(port);
    assert_eq!(sample(&m, "strata_cache_curve_memory_bytes"), memory, "{m}");
    assert!(
        sample(&m, "strata_cache_curve_tracked_pages") <= 64.0,
        "{m}"
    );
    assert!(sample(&m, "strata_cache_curve_sample_rate") < 1.0, "{m}");
    for line in m.lines().filter(|l| l.starts_with("strata_cache_curve_")) {
        let v: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(v.is_finite() && v >= 0.0, "{line}");
    }
    let c = get_json(port, "/cache/curve");
    for p in c["points"].as_array().unwrap() {
        let h = p["hit_ratio"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&h), "{p}");
    }
}
