//! Hostile clients against real `strata serve` / `strata route` processes (tiny model): every
//! attack here broke or poisoned a worker once. Each test starts what it needs on port 0 and
//! reads the bound port from the process's ready line.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use strata_model::tiny::{write_tiny, TinySpec};
use strata_test_support::{http1 as http, port_after, Proc};

fn start(args: &[String]) -> Proc {
    Proc::start(env!("CARGO_BIN_EXE_strata"), args)
}

fn tiny(dir: &Path) -> PathBuf {
    let p = dir.join("tiny.gguf");
    write_tiny(&p, &TinySpec::default()).unwrap();
    p
}

fn key_file(dir: &Path) -> PathBuf {
    let p = dir.join("cluster.key");
    strata_kv::auth::ClusterKey::create_file(&p).unwrap();
    p
}

/// `strata serve` on port 0 with the tiny model; returns it and its HTTP port.
fn serve(model: &Path, extra: &[&str]) -> (Proc, u16) {
    let mut args: Vec<String> = ["serve", "--port", "0", "--model"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.push(model.display().to_string());
    if !extra.contains(&"--device-mem") {
        args.extend(["--device-mem".to_string(), "16MiB".to_string()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut p = start(&args);
    let line = p.wait_for("ready on http://", 60);
    let port = port_after(&line, "http://");
    // Logs to a pipe (not a terminal) are plain text: no ANSI colour codes.
    assert!(
        p.log.iter().all(|l| !l.contains('\u{1b}')),
        "ANSI codes in piped logs:\n{}",
        p.log.join("\n")
    );
    (p, port)
}

fn body_of(resp: &str) -> serde_json::Value {
    let b = resp.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
    serde_json::from_str(b).unwrap_or(serde_json::Value::Null)
}

#[test]
fn out_of_range_sizes_get_400_naming_the_field_and_the_server_keeps_serving() {
    let d = tempfile::tempdir().unwrap();
    let (_p, port) = serve(&tiny(d.path()), &[]);
    let prompt: Vec<u32> = (1..=32).collect();
    let cases = [
        (
            format!(r#"{{"prompt":{prompt:?},"max_tokens":18446744073709551600}}"#),
            "max_tokens",
        ),
        (
            format!(
                r#"{{"prompt":{prompt:?},"max_tokens":4,"stop_token_ids":{:?}}}"#,
                vec![1u32; 1000]
            ),
            "stop_token_ids",
        ),
        (
            format!(r#"{{"prompt":{prompt:?},"max_tokens":4,"stop_token_ids":[4000000000]}}"#),
            "stop_token_ids",
        ),
        (
            r#"{"prompt":[1,4000000000],"max_tokens":4}"#.to_string(),
            "prompt",
        ),
        (
            r#"{"prompt":"hi","max_tokens":-1}"#.to_string(),
            "max_tokens",
        ),
    ];
    for (body, field) in cases {
        let (status, resp) = http(port, "POST", "/v1/completions", "", &body);
        assert_eq!(status, 400, "{body}: {resp}");
        let v = body_of(&resp);
        assert!(
            v["error"]["param"].as_str().unwrap_or("").contains(field),
            "{body}: {v}"
        );
    }
    // Still alive and serving.
    let (status, _) = http(port, "GET", "/health", "", "");
    assert_eq!(status, 200);
    let (status, resp) = http(
        port,
        "POST",
        "/v1/completions",
        "",
        &format!(r#"{{"prompt":{prompt:?},"max_tokens":4}}"#),
    );
    assert_eq!(status, 200, "{resp}");
    // Unknown routes and wrong methods answer in JSON.
    let (status, resp) = http(port, "GET", "/nope", "", "");
    assert_eq!(status, 404);
    assert!(body_of(&resp)["error"]["message"].is_string(), "{resp}");
    let (status, resp) = http(port, "GET", "/v1/completions", "", "");
    assert_eq!(status, 405);
    assert!(body_of(&resp)["error"]["message"].is_string(), "{resp}");
}

#[test]
fn a_dead_engine_thread_takes_health_to_503_and_the_worker_exits_70() {
    let d = tempfile::tempdir().unwrap();
    let (mut p, port) = serve(&tiny(d.path()), &["--fault-panic-token", "7"]);
    let (status, _) = http(port, "GET", "/health", "", "");
    assert_eq!(status, 200);
    let (status, resp) = http(
        port,
        "POST",
        "/v1/completions",
        "",
        r#"{"prompt":[7,8,9],"max_tokens":4}"#,
    );
    assert_eq!(status, 503, "{resp}");
    // /health says so at once (the process lingers 2 s before it exits).
    let (status, resp) = http(port, "GET", "/health", "", "");
    assert_eq!(status, 503, "{resp}");
    assert!(resp.contains("engine is dead"), "{resp}");
    p.wait_for("exiting with code 70", 10);
    assert_eq!(p.exit_code(20), Some(70));
}

#[test]
fn hostile_gguf_files_exit_2_with_one_line() {
    let d = tempfile::tempdir().unwrap();
    let gguf = |name: &str, kvs: &[u8], n_kv: u64, n_t: u64| {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&n_t.to_le_bytes());
        b.extend_from_slice(&n_kv.to_le_bytes());
        b.extend_from_slice(kvs);
        b.resize(b.len() + 64, 0);
        let p = d.path().join(name);
        std::fs::write(&p, b).unwrap();
        p
    };
    let key = |k: &str| {
        let mut b = (k.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(k.as_bytes());
        b
    };
    let mut huge_string = key("general.name");
    huge_string.extend_from_slice(&8u32.to_le_bytes());
    huge_string.extend_from_slice(&(1u64 << 40).to_le_bytes());
    let mut huge_array = key("tokenizer.ggml.tokens");
    huge_array.extend_from_slice(&9u32.to_le_bytes());
    huge_array.extend_from_slice(&8u32.to_le_bytes());
    huge_array.extend_from_slice(&(1u64 << 40).to_le_bytes());
    // A valid tiny model whose block_count says 10^9.
    let many_layers = d.path().join("layers.gguf");
    write_tiny(&many_layers, &TinySpec::default()).unwrap();
    let mut bytes = std::fs::read(&many_layers).unwrap();
    let k = b"llama.block_count";
    let at = bytes.windows(k.len()).position(|w| w == k).unwrap() + k.len();
    // type u32 (4), then the value
    assert_eq!(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()), 4);
    bytes[at + 4..at + 8].copy_from_slice(&1_000_000_000u32.to_le_bytes());
    std::fs::write(&many_layers, bytes).unwrap();
    for (path, want) in [
        (
            gguf("string.gguf", &huge_string, 1, 0),
            "1099511627776 bytes",
        ),
        (
            gguf("array.gguf", &huge_array, 1, 0),
            "an array of 1099511627776",
        ),
        (gguf("count.gguf", &[], 1 << 40, 0), "metadata entries"),
        (many_layers, "llama.block_count"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["serve", "--port", "0", "--device-mem", "16MiB", "--model"])
            .arg(&path)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{}: {err}", path.display());
        let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
        assert_eq!(errors.len(), 1, "{err}");
        assert!(errors[0].contains(want), "{}: {err}", path.display());
    }
}

/// Accepts connections on a port the test owns and counts them.
fn tripwire() -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let n = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let m = n.clone();
    std::thread::spawn(move || {
        for c in l.incoming().flatten() {
            m.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(c);
        }
    });
    (port, n)
}

#[test]
fn a_client_cannot_steer_a_decode_worker_to_any_prefill_url() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny(d.path());
    let (trap, hits) = tripwire();
    let url = format!("http://127.0.0.1:{trap}");
    let chat = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#;
    let asks = [
        ("/v1/chat/completions", chat),
        ("/v1/responses", r#"{"input":"hi","max_output_tokens":2}"#),
    ];
    // Without a cluster key: only configured prefill workers are followed.
    let (_p, port) = serve(&model, &["--role", "decode"]);
    for (path, body) in asks {
        let header = format!("x-strata-prefill: {url}\r\n");
        let (status, resp) = http(port, "POST", path, &header, body);
        assert_eq!(status, 400, "{path}: {resp}");
        assert!(resp.contains("configured"), "{path}: {resp}");
    }
    // With a key: even a configured prefill worker is followed only with the router's proof.
    let key = key_file(d.path());
    let (_q, port) = serve(
        &model,
        &[
            "--role",
            "decode",
            "--cluster-key-file",
            key.to_str().unwrap(),
            "--prefill-worker",
            &url,
        ],
    );
    for (path, body) in asks {
        let header = format!("x-strata-prefill: {url}\r\n");
        let (status, resp) = http(port, "POST", path, &header, body);
        assert_eq!(status, 401, "{path}: {resp}");
    }
    // Internal endpoints want the proof too.
    for path in ["/cache/info", "/cache/events", "/cache/snapshot"] {
        let (status, resp) = http(port, "GET", path, "", "");
        assert_eq!(status, 401, "{path}: {resp}");
    }
    let (status, _) = http(port, "POST", "/pd/prefill", "", "{}");
    assert_eq!(status, 401);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        hits.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the worker connected to a URL a client gave"
    );
    // A worker without a key refuses to listen beyond loopback.
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "--host", "0.0.0.0", "--port", "0", "--model"])
        .arg(&model)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("loopback only"));
}

/// RSS of a process in KiB.
fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// Whether the peer closed `s` within `secs` (a read returns 0 or fails).
fn closed_within(s: &mut TcpStream, secs: u64) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(secs))).unwrap();
    let mut b = [0u8; 256];
    let t = Instant::now();
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
        if t.elapsed() > Duration::from_secs(secs) {
            return false;
        }
    }
}

#[test]
fn the_kv_listener_drops_hostile_peers_and_keeps_serving_pd() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny(d.path());
    let key = key_file(d.path());
    let k = key.to_str().unwrap();
    let (_pre, pre_port) = serve(&model, &["--role", "prefill", "--cluster-key-file", k]);
    let pre_url = format!("http://127.0.0.1:{pre_port}");
    let (mut dec, dec_port) = serve(
        &model,
        &[
            "--role",
            "decode",
            "--cluster-key-file",
            k,
            "--prefill-worker",
            &pre_url,
            "--kv-max-connections",
            "4",
            "--kv-staging",
            "1MiB",
        ],
    );
    let kv_port = port_after(&dec.wait_for("KV-transfer listener on", 5), "listener on ");
    let pid = dec.child.id();
    let rss0 = rss_kib(pid);
    let connect = || TcpStream::connect(("127.0.0.1", kv_port)).unwrap();

    // Garbage: closed.
    let mut g = connect();
    g.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    assert!(closed_within(&mut g, 5), "garbage was not dropped");
    // A 250 MiB frame announced before any handshake: closed, nothing allocated.
    let mut huge = Vec::new();
    for _ in 0..4 {
        let mut c = connect();
        let _ = c.write_all(&(250u32 << 20).to_le_bytes());
        huge.push(c);
    }
    for c in huge.iter_mut() {
        assert!(closed_within(c, 5), "an oversized frame was not dropped");
    }
    // Idle connections beyond the cap (4) are closed at once; the held ones time out.
    let mut idle: Vec<TcpStream> = (0..10).map(|_| connect()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let closed_now = idle
        .iter_mut()
        .map(|c| closed_within(c, 1))
        .filter(|&x| x)
        .count();
    assert!(
        closed_now >= 6,
        "only {closed_now} of 10 idle connections were refused"
    );
    // A trickle: one byte every 300 ms is cut off by the handshake deadline (5 s).
    let mut t = connect();
    let t0 = Instant::now();
    let mut cut = false;
    while t0.elapsed() < Duration::from_secs(12) {
        if t.write_all(&[1]).is_err() {
            cut = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(cut || closed_within(&mut t, 1), "a trickling peer was kept");
    drop(idle);
    // A peer without the key: refused after the handshake, told only what failed.
    let mut c = connect();
    let hello = strata_engine::transfer::Hello {
        model_id: "x".into(),
        page_size: 16,
        page_bytes: 1,
        layout: "y".into(),
    };
    let e = strata_engine::transfer::handshake_connect(&mut c, &hello, None).unwrap_err();
    assert!(e.to_string().contains("authentication failed"), "{e}");
    // With the key but the wrong format: told which field, not the receiver's values.
    let ck = strata_kv::auth::ClusterKey::from_file(&key).unwrap();
    let mut c = connect();
    let e = strata_engine::transfer::handshake_connect(&mut c, &hello, Some(&ck)).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("differ in: model, page layout"), "{msg}");
    assert!(
        !msg.contains("tiny.gguf"),
        "the receiver's model leaked: {msg}"
    );

    let grown = rss_kib(pid).saturating_sub(rss0);
    assert!(
        grown < 64 << 10,
        "RSS grew by {grown} KiB under hostile peers"
    );

    // The next legitimate PD request (the router's header, with its proof) succeeds.
    // A proof is for one worker's instance: signed before the sender knows it, it is refused,
    // and the refusal names it.
    let body =
        r#"{"messages":[{"role":"user","content":"hello there"}],"max_tokens":3,"temperature":0}"#;
    let chat = strata_server::auth::Call {
        method: "POST",
        target: "/v1/chat/completions",
        body: body.as_bytes(),
        prefill: Some(&pre_url),
    };
    let signed = |to| {
        let sig = strata_server::auth::sign(&ck, to, &chat);
        format!(
            "x-strata-prefill: {pre_url}\r\n{}: {}\r\n",
            strata_server::auth::AUTH_HEADER,
            sig.to_str().unwrap()
        )
    };
    let (status, resp) = http(
        dec_port,
        "POST",
        "/v1/chat/completions",
        &signed(None),
        body,
    );
    assert_eq!(status, 401, "{resp}");
    assert!(resp.contains("another instance"), "{resp}");
    let dec_instance = instance_of(&resp);
    let headers = signed(Some(dec_instance));
    // Sent to another worker of the deployment (same key), it is refused there and stays
    // good for the worker it was meant for.
    let (status, resp) = http(pre_port, "POST", "/v1/chat/completions", &headers, body);
    assert_eq!(status, 401, "{resp}");
    assert!(resp.contains("another instance"), "{resp}");
    assert_ne!(instance_of(&resp), dec_instance);
    let (status, resp) = http(dec_port, "POST", "/v1/chat/completions", &headers, body);
    assert_eq!(status, 200, "{resp}");
    assert_eq!(body_of(&resp)["usage"]["completion_tokens"], 3, "{resp}");
    // The same call again (a captured header replayed): refused.
    let (status, resp) = http(dec_port, "POST", "/v1/chat/completions", &headers, body);
    assert_eq!(status, 401, "{resp}");
    assert!(resp.contains("replay"), "{resp}");
    // A Responses turn: the proof covers its own path and body.
    let body = r#"{"input":"hello over there","max_output_tokens":3,"temperature":0}"#;
    let call = |target| strata_server::auth::Call {
        method: "POST",
        target,
        body: body.as_bytes(),
        prefill: Some(&pre_url),
    };
    let headers = |sig: axum::http::HeaderValue| {
        format!(
            "x-strata-prefill: {pre_url}\r\n{}: {}\r\n",
            strata_server::auth::AUTH_HEADER,
            sig.to_str().unwrap()
        )
    };
    let to = Some(dec_instance);
    let wrong = headers(strata_server::auth::sign(
        &ck,
        to,
        &call("/v1/chat/completions"),
    ));
    let (status, resp) = http(dec_port, "POST", "/v1/responses", &wrong, body);
    assert_eq!(status, 401, "a proof for another path: {resp}");
    let right = headers(strata_server::auth::sign(&ck, to, &call("/v1/responses")));
    let (status, resp) = http(dec_port, "POST", "/v1/responses", &right, body);
    assert_eq!(status, 200, "{resp}");
    assert_eq!(body_of(&resp)["object"], "response", "{resp}");
}

/// The instance a worker's raw HTTP answer names (`x-strata-instance`).
fn instance_of(resp: &str) -> strata_server::auth::Instance {
    let name = strata_server::auth::INSTANCE_HEADER;
    let line = resp
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(':')))
        .unwrap_or_else(|| panic!("no {name} header: {resp}"));
    strata_server::auth::Instance::parse(line.trim()).expect("32 hex digits")
}

/// Streams a long answer from a worker through a router (with `router_args`), does `to_worker`
/// to the worker after a few tokens, and returns the rest of the client's stream.
fn stream_through_router_then(router_args: &[&str], to_worker: impl FnOnce(&mut Child)) -> String {
    use strata_model::fetch::{cache_dir, MODEL_FILE};
    let model = cache_dir().join(MODEL_FILE);
    assert!(
        model.exists(),
        "{} is missing: run `strata model fetch` (scripts/test.sh does it first)",
        model.display()
    );
    let (mut worker, wport) = serve(&model, &["--device-mem", "64MiB"]);
    let mut args: Vec<String> = vec![
        "route".into(),
        "--port".into(),
        "0".into(),
        "--decode".into(),
        format!("http://127.0.0.1:{wport}"),
    ];
    args.extend(router_args.iter().map(|a| a.to_string()));
    let mut router = start(&args);
    let rport = port_after(&router.wait_for("ready on http://", 30), "http://");
    let mut s = TcpStream::connect(("127.0.0.1", rport)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = r#"{"messages":[{"role":"user","content":"Count slowly to one thousand."}],"max_tokens":600,"ignore_eos":true,"stream":true}"#;
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let mut seen = String::new();
    // Wait for some content, then act on the worker.
    while seen.matches("\"content\"").count() < 3 {
        let mut l = String::new();
        assert!(
            r.read_line(&mut l).unwrap() > 0,
            "stream ended early: {seen}"
        );
        seen.push_str(&l);
    }
    to_worker(&mut worker.child);
    let mut rest = String::new();
    let _ = r.read_to_string(&mut rest);
    let _ = Command::new("kill")
        .args(["-CONT", &worker.child.id().to_string()])
        .status();
    rest
}

fn assert_error_event_then_done(rest: &str, why: &str) {
    assert!(
        rest.contains("\"error\"") && rest.contains(why),
        "no error event ({why}):\n{rest}"
    );
    let err_at = rest.find(why).unwrap();
    assert!(
        rest[err_at..].contains("data: [DONE]"),
        "no [DONE] after the error event:\n{rest}"
    );
}

/// A worker killed mid-stream: the client behind the router gets an SSE error event and a
/// clean end (`[DONE]`), never a silent truncation.
#[test]
fn a_worker_dying_mid_stream_ends_the_clients_stream_with_an_error_event() {
    let rest = stream_through_router_then(&[], |w| {
        w.kill().unwrap();
        let _ = w.wait();
    });
    assert_error_event_then_done(&rest, "stream broke");
}

/// A worker that hangs mid-stream (stopped: its connection stays open, nothing more comes):
/// after `--stream-idle-timeout` the client gets the error event and `[DONE]`.
#[test]
fn a_worker_going_silent_mid_stream_is_cut_after_the_idle_timeout() {
    // (The client's read times out at 60 s: without the cut, no error event would come.)
    let rest = stream_through_router_then(&["--stream-idle-timeout", "1"], |w| {
        let ok = Command::new("kill")
            .args(["-STOP", &w.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    });
    assert_error_event_then_done(&rest, "no data from the worker for 1.0 s");
}

/// A raw request with `Origin` (and a preflight's headers for OPTIONS); the whole answer.
fn with_origin(port: u16, method: &str, path: &str, origin: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let body = r#"{"prompt":[1,2],"max_tokens":1}"#;
    let extra = if method == "OPTIONS" {
        "Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type, authorization\r\n".to_string()
    } else {
        format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        )
    };
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nOrigin: {origin}\r\n{extra}Connection: close\r\n\r\n{}",
        if method == "OPTIONS" { "" } else { body }
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.to_ascii_lowercase()
}

/// CORS is off by default (no header for any origin); `--allowed-origins` answers preflights
/// and requests of the listed origins only (worker and router alike); a bad origin is refused
/// at start.
#[test]
fn cors_is_off_by_default_and_allows_only_the_listed_origins() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny(d.path());
    let (_plain, p) = serve(&model, &[]);
    let r = with_origin(p, "POST", "/v1/completions", "https://app.example");
    assert!(
        r.starts_with("http/1.1 200") && !r.contains("access-control-allow-origin"),
        "{r}"
    );
    let (_w, p) = serve(
        &model,
        &[
            "--allowed-origins",
            "https://app.example,http://localhost:3000",
        ],
    );
    let pre = with_origin(p, "OPTIONS", "/v1/completions", "https://app.example");
    assert!(pre.starts_with("http/1.1 200"), "{pre}");
    assert!(
        pre.contains("access-control-allow-origin: https://app.example"),
        "{pre}"
    );
    assert!(pre.contains("access-control-allow-methods"), "{pre}");
    let ok = with_origin(p, "POST", "/v1/completions", "http://localhost:3000");
    assert!(
        ok.contains("access-control-allow-origin: http://localhost:3000"),
        "{ok}"
    );
    assert!(
        ok.contains("access-control-expose-headers: x-request-id"),
        "{ok}"
    );
    let other = with_origin(p, "POST", "/v1/completions", "https://evil.example");
    assert!(!other.contains("access-control-allow-origin"), "{other}");
    // The router, any origin.
    let url = format!("http://127.0.0.1:{p}");
    let mut r = start(
        &[
            "route",
            "--port",
            "0",
            "--decode",
            &url,
            "--allowed-origins",
            "*",
        ]
        .map(String::from),
    );
    let rp = port_after(&r.wait_for("ready on http://", 60), "http://");
    let pre = with_origin(rp, "OPTIONS", "/v1/completions", "https://any.example");
    assert!(pre.contains("access-control-allow-origin: *"), "{pre}");
    drop(r);
    // A router with client keys: a browser's preflight carries no key and is answered; the
    // request itself still needs one. Without --allowed-origins a preflight is a 401 as
    // any keyless request.
    for (origins, pre_ok) in [(&["--allowed-origins", "*"][..], true), (&[][..], false)] {
        let mut args = vec!["route", "--port", "0", "--decode", &url, "--api-key", "k3y"];
        args.extend_from_slice(origins);
        let mut r = start(&args.iter().map(|a| a.to_string()).collect::<Vec<_>>());
        let rp = port_after(&r.wait_for("ready on http://", 60), "http://");
        let pre = with_origin(rp, "OPTIONS", "/v1/completions", "https://any.example");
        assert_eq!(pre.starts_with("http/1.1 200"), pre_ok, "{pre}");
        assert_eq!(
            pre.contains("access-control-allow-origin: *"),
            pre_ok,
            "{pre}"
        );
        let post = with_origin(rp, "POST", "/v1/completions", "https://any.example");
        assert!(post.starts_with("http/1.1 401"), "{post}");
        // A "preflight" with a body is no preflight: refused on its head, its body unread.
        let mut s = TcpStream::connect(("127.0.0.1", rp)).unwrap();
        write!(
            s,
            "OPTIONS /v1/completions HTTP/1.1\r\nHost: x\r\nOrigin: https://any.example\r\nAccess-Control-Request-Method: POST\r\nContent-Length: 10\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 401"), "{out}");
    }
    // A router without keys on a non-loopback address says at start that it is open.
    let mut r = start(
        &[
            "route", "--host", "0.0.0.0", "--port", "0", "--decode", &url,
        ]
        .map(String::from),
    );
    r.wait_for("no --api-key and listening on 0.0.0.0: any client", 60);
    // A path or another scheme is not an origin: refused before anything starts.
    for bad in ["https://app.example/x", "ftp://a", "*,https://a.example"] {
        let o = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["serve", "--port", "0", "--model"])
            .arg(&model)
            .args(["--allowed-origins", bad])
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{bad}: {e}");
        assert!(e.contains("--allowed-origins"), "{bad}: {e}");
    }
}
