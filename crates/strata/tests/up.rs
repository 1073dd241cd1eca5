//! `strata up` with the tiny model: a worker whose plan cannot fit is refused before anything
//! starts; a worker failing at start-up stops everything once with its message; a TP-2 prefill worker and a TP-1 decode worker answer the smoke test; a worker killed
//! while serving is restarted and the router answers again, and one that stops answering
//! `/health` is killed after 30 s and restarted; DeepSeek-V4 with a TP-2 prefill
//! worker and a TP-1 decode worker chats as one TP-1 worker.

use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use strata_model::tiny::{write_tiny, TinySpec};
use strata_test_support::up::Up;

fn config(dir: &std::path::Path, prefill_args: &str, tp: u32) -> std::path::PathBuf {
    let text = format!(
        r#"host = "127.0.0.1"
smoke_test = true
[router]
port = 0
[[prefill]]
port = 0
tp_size = {tp}
numa_nodes = [0]
args = ["--device-mem", "16MiB", {prefill_args}]
[[decode]]
port = 0
args = ["--device-mem", "16MiB", "--hicache-size", "16MiB"]
"#
    );
    let path = dir.join("up.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// `strata up` with the tiny model written into `dir`.
fn up(dir: &Path, cfg: &Path) -> Up {
    let model = dir.join("tiny.gguf");
    write_tiny(&model, &TinySpec::default()).unwrap();
    up_with(&model, cfg)
}

/// `strata up` with the model at `model`, its state beside the configuration.
fn up_with(model: &Path, cfg: &Path) -> Up {
    let state = cfg.parent().unwrap().join("state");
    Up::start(env!("CARGO_BIN_EXE_strata"), cfg, model, &state, &[])
}

/// A worker whose own plan cannot fit is found before any process starts: `strata up` checks
/// every worker's flags and plan (and their sum per NUMA node) first, and says which worker.
#[test]
fn an_impossible_host_cache_stops_up_before_any_worker_starts() {
    let d = tempfile::tempdir().unwrap();
    let cfg = config(d.path(), r#""--hicache-size", "999TB""#, 1);
    let mut up = up(d.path(), &cfg);
    let status = up.wait_exit(60);
    let text = up.drain(200);
    assert_eq!(status.code(), Some(2), "{text}");
    assert!(text.contains("prefill-0: --hicache-size 999TB"), "{text}");
    assert!(text.contains("does not fit"), "{text}");
    assert!(!text.contains("starting prefill-0"), "{text}");
    assert!(!text.contains("restarted (pid"), "{text}");
}

/// The router's flags are checked with the workers', before any process starts.
#[test]
fn a_bad_router_flag_stops_up_before_any_worker_starts() {
    let d = tempfile::tempdir().unwrap();
    let cfg = config(d.path(), "", 1);
    let text = std::fs::read_to_string(&cfg).unwrap().replace(
        "[router]\nport = 0\n",
        "[router]\nport = 0\npolicy = \"cache_aware\"\nargs = [\"--cache-index-memory\", \"64KiB\"]\n",
    );
    std::fs::write(&cfg, text).unwrap();
    let mut up = up(d.path(), &cfg);
    let status = up.wait_exit(60);
    let text = up.drain(200);
    assert_eq!(status.code(), Some(2), "{text}");
    assert!(text.contains("router"), "{text}");
    assert!(
        text.contains("--cache-index-memory 64KiB (65536 bytes): too small"),
        "{text}"
    );
    assert!(!text.contains("starting prefill-0"), "{text}");
}

/// A worker's `--kv-port` is one of the deployment's ports: given twice, or held by another
/// process, it is refused before any process starts (it was found only when the second
/// worker could not listen, after the first had started).
#[test]
fn a_kv_port_given_twice_or_taken_stops_up_before_any_worker_starts() {
    let d = tempfile::tempdir().unwrap();
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    // Any port for the pair given twice (refused before anything binds it).
    let twice = port.checked_add(1).unwrap_or(port - 1);
    let worker = |kv: u16| {
        format!(
            "[[decode]]\nport = 0\nargs = [\"--device-mem\", \"16MiB\", \"--kv-port\", \"{kv}\"]\n"
        )
    };
    let head = "host = \"127.0.0.1\"\nsmoke_test = false\n[router]\nport = 0\n";
    let cases = [
        (
            format!("{head}{}{}", worker(twice), worker(twice)),
            format!("port {twice} is given to both decode-0's --kv-port and decode-1's --kv-port"),
        ),
        (
            format!("{head}{}", worker(port)),
            format!(
                "port {port} (decode-0's --kv-port) on 127.0.0.1 is already in use by pid {}",
                std::process::id()
            ),
        ),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let cfg = d.path().join(format!("kv{i}.toml"));
        std::fs::write(&cfg, text).unwrap();
        let mut up = up(d.path(), &cfg);
        let status = up.wait_exit(60);
        let out = up.drain(200);
        assert_eq!(status.code(), Some(2), "{out}");
        assert!(out.contains(want.as_str()), "{want}: {out}");
        assert!(!out.contains("starting decode-0"), "{out}");
    }
    drop(held);
}

/// A worker that fails once started (its L3 directory cannot be made, which no check before
/// start-up can know) stops everything once, with the worker's own message and exit code.
#[test]
fn a_worker_failing_at_start_up_stops_up_once_with_its_message() {
    let d = tempfile::tempdir().unwrap();
    let cfg = config(d.path(), r#""--l3", "disk:/proc/strata-l3""#, 1);
    let mut up = up(d.path(), &cfg);
    let status = up.wait_exit(60);
    let text = up.drain(200);
    assert_eq!(status.code(), Some(2), "{text}");
    assert!(
        text.contains("prefill-0 exited during start-up (exit code 2)"),
        "{text}"
    );
    assert!(text.contains("--l3 disk:/proc/strata-l3"), "{text}");
    assert_eq!(text.matches("starting prefill-0").count(), 1, "{text}");
    assert!(!text.contains("restarted (pid"), "{text}");
    assert!(
        text.contains("nothing is restarted after a start-up failure"),
        "{text}"
    );
}

#[test]
fn a_tp2_prefill_and_tp1_decode_answer_and_a_killed_worker_is_restarted() {
    let d = tempfile::tempdir().unwrap();
    // A TP-2 prefill worker and a TP-1 decode worker: the smoke test's K/V is re-sharded.
    let cfg = config(d.path(), r#""--hicache-size", "16MiB""#, 2);
    let mut up = up(d.path(), &cfg);
    up.wait_for("rank 1: pool `kv.tp1`", 90);
    up.wait_for("smoke test through the router", 90);
    let ready = up.ready(10);
    let router_port = ready.router;
    // The ready summary names the dashboard and the metrics, besides the API.
    up.wait_for(
        &format!("dashboard: http://127.0.0.1:{router_port}/dashboard"),
        10,
    );
    up.wait_for("metrics (Prometheus):", 10);
    let pid = ready.pid("decode-0");
    // SAFETY: kill(2) on the decode worker `strata up` started (its pid was printed).
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
    up.wait_for("decode-0 crashed", 20);
    let line = up.wait_for("decode-0 restarted", 20);
    answers_again(router_port);
    // A worker that stops answering (stopped here; hung, or its engine stalled) is killed
    // once it has not answered /health for 30 s, and restarted.
    let pid: i32 = line
        .rsplit("(pid ")
        .next()
        .and_then(|p| p.trim_end_matches(')').parse().ok())
        .expect("the restarted worker's pid");
    // SAFETY: kill(2) on the decode worker `strata up` restarted (its pid was printed).
    unsafe {
        libc::kill(pid, libc::SIGSTOP);
    }
    up.wait_for(
        "decode-0 has not answered /health healthily for 30 s: killing it",
        60,
    );
    up.wait_for("decode-0 crashed", 20);
    up.wait_for("decode-0 restarted", 20);
    answers_again(router_port);
    up.terminate();
    let status = up.wait_exit(60);
    assert_eq!(status.code(), Some(0));
}

/// Waits until the router at `port` answers a chat again (60 s at most).
fn answers_again(port: u16) {
    let t = Instant::now();
    loop {
        let out = Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", "content-type: application/json"])
            .arg("-d")
            .arg(r#"{"messages":[{"role":"user","content":"again"}],"max_tokens":3,"temperature":0}"#)
            .arg(format!("http://127.0.0.1:{port}/v1/chat/completions"))
            .output()
            .unwrap();
        if String::from_utf8_lossy(&out.stdout) == "200" {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the router never answered again"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A decode worker whose engine thread dies (fault injection: a prompt starting with token 7)
/// exits 70 and is restarted; the router (with a client key: the smoke test sends it)
/// answers again. Then the worker is killed and its port taken: its restarts fail (exit 2,
/// cannot listen), which after it served with the same flags is a crash, retried with
/// backoff, and `up` stops everything with the reason on the fifth (not at once: a port taken
/// for a moment comes free).
#[test]
fn a_dead_engine_is_restarted_and_a_port_taken_on_restart_is_retried() {
    let d = tempfile::tempdir().unwrap();
    let text = r#"host = "127.0.0.1"
smoke_test = true
[router]
port = 0
args = ["--api-key", "up-client"]
[[prefill]]
port = 0
args = ["--device-mem", "16MiB"]
[[decode]]
port = 0
args = ["--device-mem", "16MiB", "--fault-panic-token", "7"]
"#;
    let cfg = d.path().join("up.toml");
    std::fs::write(&cfg, text).unwrap();
    let mut up = up(d.path(), &cfg);
    up.wait_for("smoke test through the router", 90);
    let ready = up.ready(10);
    let (r, dp) = (ready.router, ready.port("decode-0"));
    let post = |body: &str| -> String {
        let out = Command::new("curl")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "-H",
                "content-type: application/json",
                "-H",
                "authorization: Bearer up-client",
            ])
            .arg("-d")
            .arg(body)
            .arg(format!("http://127.0.0.1:{r}/v1/completions"))
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let code = post(r#"{"prompt":[7,8,9],"max_tokens":3}"#);
    assert_ne!(code, "200", "the fault did not fire");
    up.wait_for("exiting with code 70", 20);
    up.wait_for("decode-0 crashed", 20);
    up.wait_for("decode-0 restarted", 20);
    let t = Instant::now();
    while post(r#"{"prompt":[1,2,3],"max_tokens":3}"#) != "200" {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the router never answered again:\n{}",
            up.drain(0)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Kill it and take its port: the restart cannot listen (exit 2). It served with these
    // flags before, so that is a crash, retried with backoff (a port taken for a moment comes
    // free), until `up` gives up on the fifth crash.
    up.drain(0);
    let line = up
        .log
        .iter()
        .rev()
        .find(|l| l.contains("decode-0 restarted (pid"))
        .unwrap()
        .clone();
    let pid: i32 = line
        .split("pid ")
        .nth(1)
        .unwrap()
        .trim_end_matches(')')
        .parse()
        .unwrap();
    // SAFETY: kill(2) on the decode worker `strata up` restarted (its pid was printed).
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
    let t = Instant::now();
    let _squat = loop {
        if let Ok(l) = TcpListener::bind(("127.0.0.1", dp)) {
            break l;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "the port stayed busy");
        std::thread::sleep(Duration::from_millis(10));
    };
    let status = up.wait_exit(90);
    let text = up.drain(200);
    assert_eq!(status.code(), Some(1), "{text}");
    assert!(text.contains("not restarting decode-0"), "{text}");
    assert!(text.contains("crashed 5 times"), "{text}");
    assert!(text.contains("cannot listen"), "{text}");
    // A death by signal is said as such, not with the last line the worker logged before it.
    assert!(
        text.contains("decode-0 crashed (signal: 9 (SIGKILL)); restart"),
        "{text}"
    );
    // Restarted after the engine died, after the kill, and twice more after restarts that
    // could not listen.
    assert_eq!(text.matches("decode-0 restarted").count(), 4, "{text}");
}

fn chat(port: u16, body: &serde_json::Value) -> serde_json::Value {
    let out = Command::new("curl")
        .args(["-s", "-H", "content-type: application/json", "-d"])
        .arg(body.to_string())
        .arg(format!("http://127.0.0.1:{port}/v1/chat/completions"))
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stdout)))
}

/// The incident's model in miniature, as its operators ran it: DeepSeek-V4 (the tiny model,
/// written by `strata model tiny`) with a TP-2 prefill worker and a TP-1 decode worker. The
/// smoke test passes, and a 5-turn chat through the router gets a single TP-1 worker's
/// answers, every turn's prompt state crossing from the prefill worker's two ranks.
#[test]
fn deepseek_v4_with_a_tp2_prefill_and_tp1_decode_chats_as_one_tp1_worker() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("tiny-dsv4.gguf");
    let o = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["model", "tiny", "deepseek4"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let pools = r#""--page-size", "16", "--device-mem", "16MiB", "--hicache-size", "16MiB""#;
    let text = format!(
        r#"host = "127.0.0.1"
smoke_test = true
[router]
port = 0
[[prefill]]
port = 0
tp_size = 2
numa_nodes = [0]
args = [{pools}]
[[decode]]
port = 0
args = [{pools}]
"#
    );
    let cfg = d.path().join("up.toml");
    std::fs::write(&cfg, text).unwrap();
    let mut up = up_with(&model, &cfg);
    up.wait_for("rank 1: pools `raw.tp1`", 90);
    up.wait_for("smoke test through the router", 90);
    let ready = up.ready(10);
    let (r, dp) = (ready.router, ready.port("decode-0"));

    let mut one = Command::new(env!("CARGO_BIN_EXE_strata"));
    one.args(["serve", "--port", "0", "--threads", "1"])
        .args([
            "--page-size",
            "16",
            "--device-mem",
            "16MiB",
            "--hicache-size",
            "16MiB",
        ])
        .arg("--model")
        .arg(&model);
    let (_one, one_port) = strata_test_support::spawn_ready(&mut one, Duration::from_secs(60));
    let mut messages =
        vec![serde_json::json!({"role": "system", "content": "You answer in few words."})];
    for turn in 0..5 {
        let q = format!("Turn {turn}: what comes after {}?", turn * 7 + 3);
        messages.push(serde_json::json!({"role": "user", "content": q}));
        let body = serde_json::json!({"messages": messages, "max_tokens": 8,
                                      "temperature": 0, "ignore_eos": true});
        let (a, b) = (chat(r, &body), chat(one_port, &body));
        let said = a["choices"][0]["message"]["content"].clone();
        assert!(said.is_string(), "turn {turn}: {a}");
        assert_eq!(said, b["choices"][0]["message"]["content"], "turn {turn}");
        messages.push(serde_json::json!({"role": "assistant", "content": said}));
    }
    let m = Command::new("curl")
        .arg("-s")
        .arg(format!("http://127.0.0.1:{dp}/metrics"))
        .output()
        .unwrap();
    let m = String::from_utf8_lossy(&m.stdout);
    let moved = strata_test_support::sample(&m, "strata_transferred_prompt_tokens_total");
    assert!(
        moved >= 5.0 * 20.0,
        "the turns' state came from the prefill worker: {moved}"
    );
}
