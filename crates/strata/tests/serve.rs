//! `strata serve` as an operator runs it: bad flags fail once with the reason; the real model
//! answers a chat question over HTTP; SIGTERM exits 0.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use strata_model::fetch::{cache_dir, MODEL_FILE};

fn strata() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

/// Kills the server however the test ends.
struct Guard(std::process::Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A one-shot HTTP/1.1 request; returns (status, body).
fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_string();
    (status, body)
}

#[test]
fn bad_flags_fail_once_with_the_reason() {
    let cases: [(&[&str], &str); 19] = [
        (&["--l3", "tape:/x"], "--l3 `tape:/x`: expected disk:PATH"),
        (&["--l3", "disk:/dev/null"], "--l3 `disk:/dev/null`: /dev/null is a device, not a directory"),
        (&["--l3", "disk:/tmp/a", "--l3", "disk:/tmp/b"], "--l3: 2 disk tiers and 0 Redis: at most one of each"),
        (&["--l3", "redis://127.0.0.1:1", "--l3", "redis://127.0.0.1:2"], "--l3: 0 disk tiers and 2 Redis"),
        (&["--l3-timeout-ms", "0"], "--l3-timeout-ms 0: between 1 and 10000"),
        (&["--l3-timeout-ms", "18446744073709551615"], "--l3-timeout-ms 18446744073709551615: between"),
        (&["--host", "not a host"], "--host `not a host`: not an IP address"),
        (&["--kv-host", "not a host"], "--kv-host `not a host`: not an IP address"),
        (&["--l3", "disk:/tmp/s", "--l3", "disk:/tmp/s/."], "--l3 `disk:/tmp/s/.` is given twice"),
        (&["--l3-ttl", "18446744073709551615"], "--l3-ttl 18446744073709551615: at most"),
        (&["--response-store-size", "0B"], "--response-store-size must be at least 1MiB"),
        (&["--response-store-size", "lots"], "--response-store-size"),
        (&["--response-store-ttl", "inf"], "--response-store-ttl inf: expected seconds > 0"),
        (&["--l3", "rediss://h:6380"], "TLS to Redis is not built in"),
        // A password with a `/` (as Redis allows) is not echoed.
        (&["--l3", "rediss://:se/cretpw@h:6380"], "`rediss://…@h:6380`: TLS"),
        (&["--l3", "ftp://u:se/cretpw@h"], "--l3 `ftp://…@h`"),
        (
            &["--write-policy", "sometimes"],
            "invalid value 'sometimes' for '--write-policy <WRITE_POLICY>': expected write_through, write_through_selective[:N]",
        ),
        (&["--tp-size", "0"], "--tp-size 0: expected at least 1 rank"),
        (&["--hicache-ratio", "-1"], "hicache-ratio"),
    ];
    for (args, want) in cases {
        let out = strata()
            .args(["serve", "--model-preset", "smollm2-135m", "--port", "1"])
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("cretpw"), "a password echoed: {err}");
    }
}

#[test]
fn the_real_model_answers_over_http_and_sigterm_exits_cleanly() {
    serve_real_model(&[]);
}

/// Two tensor-parallel ranks on NUMA node 0 (every machine has it): each rank's threads are
/// pinned to its own share of the node's CPUs (one CPU each on two), its device pool bound
/// there (the allocator verifies where the pages landed), and the answer is the same.
#[test]
fn two_tp_ranks_pinned_to_node_0_answer_over_http() {
    serve_real_model(&["--tp-size", "2", "--numa-nodes", "0"]);
}

/// The CPUs a thread named `name` of process `pid` may run on.
fn thread_cpus(pid: u32, name: &str) -> Option<String> {
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let dir = t.ok()?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
        if comm.trim() == name {
            let status = std::fs::read_to_string(dir.join("status")).ok()?;
            let line = status
                .lines()
                .find(|l| l.starts_with("Cpus_allowed_list:"))?;
            return Some(line.split(':').nth(1)?.trim().to_string());
        }
    }
    None
}

/// Starts `cmd` (a server) with its stderr piped; once it is ready, the process, its port and
/// what it wrote until then (the rest of its stderr is drained on a thread).
fn start_ready(cmd: &mut Command) -> (Guard, u16, String) {
    let mut child = cmd.stderr(Stdio::piped()).spawn().unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let child = Guard(child);
    let (port, log) = ready_port(&mut err);
    std::thread::spawn(move || {
        let mut sink = String::new();
        let _ = err.read_to_string(&mut sink);
    });
    (child, port, log)
}

/// The port of a server's ready line on `err` (its stderr), and what it wrote up to it.
fn ready_port(err: &mut impl BufRead) -> (u16, String) {
    let t = Instant::now();
    let mut log = String::new();
    loop {
        let mut line = String::new();
        if err.read_line(&mut line).unwrap() == 0 {
            panic!("serve exited before it was ready:\n{log}");
        }
        log.push_str(&line);
        if let Some(at) = line.find("ready on http://") {
            let addr = line[at + "ready on http://".len()..]
                .split_whitespace()
                .next();
            let port = addr.and_then(|a| a.rsplit(':').next()).map(|p| {
                p.trim_end_matches(|c: char| !c.is_ascii_digit())
                    .parse::<u16>()
            });
            match port {
                Some(Ok(p)) if p != 0 => return (p, log),
                _ => panic!("no port in the ready line: {line}"),
            }
        }
        assert!(t.elapsed() < Duration::from_secs(120), "not ready:\n{log}");
    }
}

/// Serves the real model with `extra` flags, asks it a question, checks the ranks' pinning
/// (with `--tp-size`), stops it with SIGTERM.
fn serve_real_model(extra: &[&str]) {
    let model = cache_dir().join(MODEL_FILE);
    assert!(
        model.exists(),
        "{} is missing: run `strata model fetch` (scripts/test.sh does it first)",
        model.display()
    );
    // Port 0: the server binds a port the OS picks and says which (no pick-then-bind race).
    let (mut child, port, log) = start_ready(
        strata()
            .args(["serve", "--device-mem", "64MiB", "--hicache-size", "128MiB"])
            .args(extra)
            .args(["--port", "0", "--model"])
            .arg(&model),
    );
    // The plan was printed before serving.
    assert!(
        log.contains("decided: host tokens per rank ← --hicache-size"),
        "{log}"
    );
    let (status, body) = http(
        port,
        "POST",
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"What is the capital of France?"}],"temperature":0,"max_tokens":30}"#,
    );
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(answer.contains("Paris"), "answer: {answer}");
    let (status, _) = http(port, "GET", "/health_generate", "");
    assert_eq!(status, 200);
    let pid = child.0.id();
    if extra.contains(&"--tp-size") {
        assert!(
            log.contains("rank 1: pool `kv.tp1` (7680 bytes of state per token), node 0"),
            "{log}"
        );
        let node0 = std::fs::read_to_string("/sys/devices/system/node/node0/cpulist")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        let (a, b) = (
            thread_cpus(pid, "strata-tp0-0"),
            thread_cpus(pid, "strata-tp1-0"),
        );
        let (a, b) = (a.expect("rank 0's thread"), b.expect("rank 1's thread"));
        // Two CPUs or more: each rank on its own part of the node; one CPU: shared.
        if node0.contains(['-', ',']) {
            assert_ne!(a, b, "ranks on distinct CPUs of node 0 ({node0})");
            for c in [&a, &b] {
                assert_ne!(c, &node0, "a rank pinned to part of node 0 ({node0})");
            }
        }
    }
    // SAFETY: kill(2) with a pid this test spawned and still owns.
    unsafe {
        libc::kill(child.0.id() as i32, libc::SIGTERM);
    }
    let t = Instant::now();
    let code = loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            break s.code();
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(code, Some(0));
}

/// A busy port is refused before the model loads or any pool is planned; `serve --help`
/// offers no flag `serve` refuses, and every flag it offers has help.
#[test]
fn a_busy_port_is_refused_first_and_help_offers_only_what_serve_takes() {
    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let t = Instant::now();
    let out = strata()
        .args([
            "serve",
            "--port",
            &port,
            "--model",
            "/nonexistent/model.gguf",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("cannot listen"), "{err}");
    assert!(
        !err.contains("plan ("),
        "planned before the port was checked: {err}"
    );
    assert!(t.elapsed() < Duration::from_secs(10));
    let help = strata().args(["serve", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        !help.contains("--model-preset"),
        "serve --help offers --model-preset"
    );
    assert!(help.contains("--tp-size <TP_SIZE>") && help.contains("--numa-nodes <NUMA_NODES>"));
    assert!(
        help.contains("--port <PORT>\n          Port of the HTTP API"),
        "{help}"
    );
    let out = strata()
        .args(["serve", "--role", "boss", "--model", "/x"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("[possible values: prefill, decode, both, server]"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A disk tier smaller than one page is refused once the model says how large a page is,
/// before any pool is allocated.
#[test]
fn a_disk_tier_that_holds_no_page_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("tiny.gguf");
    strata_model::tiny::write_tiny(&model, &strata_model::tiny::TinySpec::default()).unwrap();
    let disk = format!("disk:{}", d.path().join("l3").display());
    let out = strata()
        .args(["serve", "--model", model.to_str().unwrap(), "--port", "0"])
        .args(["--device-mem", "1MiB", "--l3", &disk, "--l3-size", "1KiB"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--l3-size 1KiB (1024 bytes): the disk tier would hold no page"),
        "{err}"
    );
}

/// A GGUF whose chat template loops too long (nested `range`s, each under the template
/// engine's caps: 10^10 steps) is refused when the model is opened, by the worker and by the
/// cache-aware router that renders prompts with it: a client's chat request would otherwise
/// hold a CPU for hours.
#[test]
fn a_chat_template_that_loops_too_long_is_refused_at_start() {
    let d = tempfile::tempdir().unwrap();
    let model = with_template(
        d.path(),
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    );
    let m = model.to_str().unwrap();
    for args in [
        &["serve", "--model", m, "--port", "0"][..],
        &[
            "route",
            "--port",
            "0",
            "--decode",
            "http://127.0.0.1:9",
            "--policy",
            "cache_aware",
            "--model",
            m,
        ][..],
    ] {
        let out = strata().args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains("the chat template loops too long"),
            "{args:?}: {err}"
        );
    }
}

/// The tiny model with chat template `src` (no longer than the tiny one's), in `dir`.
fn with_template(dir: &std::path::Path, src: &str) -> std::path::PathBuf {
    let model = dir.join("tiny.gguf");
    strata_model::tiny::write_tiny(&model, &strata_model::tiny::TinySpec::default()).unwrap();
    let mut b = std::fs::read(&model).unwrap();
    let t = strata_model::tiny::TINY_TEMPLATE.as_bytes();
    let at = b.windows(t.len()).position(|w| w == t).unwrap();
    let padded = format!("{src:<width$}", width = t.len());
    b[at..at + t.len()].copy_from_slice(padded.as_bytes());
    std::fs::write(&model, b).unwrap();
    model
}

/// SIGTERM with a short grace stops a worker in a few seconds even when a client does not
/// read its answer (megabytes of token ids, more than the sockets buffer): the answers' drain
/// is the grace (at least 2 s), not 30 s.
#[test]
fn a_stop_with_a_short_grace_does_not_wait_for_a_client_that_does_not_read() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("tiny.gguf");
    strata_model::tiny::write_tiny(&model, &strata_model::tiny::TinySpec::default()).unwrap();
    let (mut child, port, _) = start_ready(
        strata()
            .args(["serve", "--port", "0", "--shutdown-grace", "0.1", "--model"])
            .arg(&model),
    );
    let body = format!(r#"{{"prompt":"{}"}}"#, "1 ".repeat(1_500_000));
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "POST /tokenize HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // The answer is being written (its first bytes are here), and never read further.
    let mut first = [0u8; 12];
    s.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    std::thread::sleep(Duration::from_millis(500));
    let pid = child.0.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            break s;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "still running");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
    // The grace (0.1 s), the drain (2 s) and the runtime's second at most, where the drain
    // was 30 s.
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "stopped after {:?}",
        t.elapsed()
    );
    drop(s);
}

/// Chat templates render in child processes under a memory limit and a deadline: the
/// instruction budget does not count a built-in filter's work (`range(99999)|sum`) nor a
/// value's memory (100 MB doubled 9 times). A template that exhausts either with a few
/// short messages is refused at start; one that does so for a longer conversation fails that
/// request (a 400 naming the limit) and the worker serves the next.
#[test]
fn a_template_past_its_memory_or_time_fails_its_request_not_the_worker() {
    let d = tempfile::tempdir().unwrap();
    let double = "{% set n = namespace(s='x' * 100000000) %}{% for i in range(9) %}{% set n.s = n.s ~ n.s %}{% endfor %}";
    let model = with_template(d.path(), double);
    let out = strata()
        .args(["serve", "--port", "0", "--model"])
        .arg(&model)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("the chat template ran past its memory of 1 GiB"),
        "{err}"
    );

    let chat = |port: u16, n: usize| {
        let msgs = vec![r#"{"role":"user","content":"x"}"#; n].join(",");
        http(
            port,
            "POST",
            "/v1/chat/completions",
            &format!(r#"{{"messages":[{msgs}],"max_tokens":1}}"#),
        )
    };
    let past = [
        (
            "{% if messages|length > 4 %}{% set n = namespace(s='x' * 100000000) %}{% for i in range(9) %}{% set n.s = n.s ~ n.s %}{% endfor %}{% endif %}",
            "the chat template ran past its memory of 1 GiB",
        ),
        (
            "{% if messages|length > 4 %}{% for i in range(99999) %}{{ range(99999)|sum }}{% endfor %}{% endif %}",
            "the chat template ran past its time of 5 s",
        ),
    ];
    for (when, want) in past {
        let src = format!("{when}{{% for m in messages %}}{{{{ m['content'] }}}}{{% endfor %}}");
        let model = with_template(d.path(), &src);
        let (_w, port, _) = start_ready(
            strata()
                .args(["serve", "--port", "0", "--model"])
                .arg(&model),
        );
        let (status, body) = chat(port, 6);
        assert_eq!(status, 400, "{body}");
        assert!(body.contains(want), "{body}");
        let (status, body) = chat(port, 1);
        assert_eq!(status, 200, "{body}");
    }
}
