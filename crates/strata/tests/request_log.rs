//! One log line per finished request, at info under `strata::request`: a whole answer, a
//! streamed one, a refused one and a client's own request id each get theirs, with tokens and
//! timings; probes and scrapes get none; `--no-request-log` turns the lines off.

use std::process::Command;

use strata_test_support::{port_after, Proc};

fn serve(model: &std::path::Path, extra: &[&str]) -> (Proc, u16) {
    let mut args: Vec<String> = ["serve", "--port", "0", "--device-mem", "16MiB"]
        .iter()
        .chain(&["--hicache-size", "16MiB", "--model"])
        .map(|s| s.to_string())
        .collect();
    args.push(model.display().to_string());
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut p = Proc::start(env!("CARGO_BIN_EXE_strata"), &args);
    let line = p.wait_for("ready on http://", 60);
    let port = port_after(&line, "ready on http://");
    (p, port)
}

fn curl(port: u16, path: &str, headers: &[&str], body: Option<&str>) -> String {
    let mut c = Command::new("curl");
    c.args(["-s", "-N", "-o", "/dev/null", "-w", "%{http_code}"]);
    for h in headers {
        c.args(["-H", h]);
    }
    if let Some(b) = body {
        c.args(["-H", "content-type: application/json", "-d", b]);
    }
    let o = c
        .arg(format!("http://127.0.0.1:{port}{path}"))
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The request lines logged so far (waiting until there are `n`).
fn request_lines(p: &mut Proc, n: usize) -> Vec<String> {
    let t = std::time::Instant::now();
    loop {
        let lines: Vec<String> = p
            .drain()
            .iter()
            .filter(|l| l.contains("strata::request"))
            .cloned()
            .collect();
        if lines.len() >= n || t.elapsed() > std::time::Duration::from_secs(20) {
            return lines;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// The value of `key=` in a log line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    let at = line
        .find(&format!(" {key}="))
        .unwrap_or_else(|| panic!("no {key} in {line}"));
    let rest = &line[at + key.len() + 2..];
    rest.split_whitespace().next().unwrap().trim_matches('"')
}

#[test]
fn every_finished_request_gets_one_line() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("tiny.gguf");
    strata_model::tiny::write_tiny(&model, &strata_model::tiny::TinySpec::default()).unwrap();
    let (mut p, port) = serve(&model, &[]);
    let chat = r#"{"messages":[{"role":"user","content":"hello there"}],"max_tokens":3,"temperature":0,"ignore_eos":true}"#;
    let streamed = r#"{"messages":[{"role":"user","content":"hello there"}],"max_tokens":4,"temperature":0,"ignore_eos":true,"stream":true}"#;
    assert_eq!(curl(port, "/health", &[], None), "200");
    assert_eq!(curl(port, "/metrics", &[], None), "200");
    let id = ["x-request-id: trace-42"];
    assert_eq!(curl(port, "/v1/chat/completions", &id, Some(chat)), "200");
    assert_eq!(
        curl(port, "/v1/chat/completions", &[], Some(streamed)),
        "200"
    );
    assert_eq!(
        curl(
            port,
            "/v1/chat/completions",
            &[],
            Some(r#"{"messages":[]}"#)
        ),
        "400"
    );
    // Two choices of a new prompt: it is computed once, and each choice finds it cached; the
    // request found nothing cached, as its usage says (the line said what the choices found).
    let words = "a new prompt of many words that fill two pages or more ".repeat(4);
    let two = format!(r#"{{"prompt":"{words}","max_tokens":2,"n":2,"temperature":0.9,"seed":3}}"#);
    assert_eq!(curl(port, "/v1/completions", &[], Some(&two)), "200");
    let lines = request_lines(&mut p, 4);
    assert_eq!(lines.len(), 4, "{lines:#?}");
    let (whole, stream, refused) = (&lines[0], &lines[1], &lines[2]);
    assert_eq!(field(&lines[3], "cached_tokens"), "0", "{}", lines[3]);
    assert!(field(&lines[3], "prompt_tokens").parse::<u32>().unwrap() > 32);
    assert_eq!(field(whole, "request_id"), "trace-42", "{whole}");
    for l in [whole, stream, refused] {
        assert_eq!(field(l, "route"), "/v1/chat/completions", "{l}");
        assert_eq!(field(l, "method"), "POST", "{l}");
        assert!(field(l, "duration_ms").parse::<f64>().is_ok(), "{l}");
    }
    assert_eq!(field(whole, "status"), "200");
    assert_eq!(field(whole, "output_tokens"), "3", "{whole}");
    assert_eq!(field(whole, "finish"), "length", "{whole}");
    assert!(
        field(whole, "prompt_tokens").parse::<u32>().unwrap() > 0,
        "{whole}"
    );
    assert!(field(whole, "ttft_ms").parse::<f64>().is_ok(), "{whole}");
    // The second asks the same prompt: the cache served part of it.
    assert!(
        field(stream, "cached_tokens").parse::<u32>().unwrap() > 0,
        "{stream}"
    );
    assert_eq!(field(stream, "output_tokens"), "4", "{stream}");
    assert_eq!(field(stream, "finish"), "length", "{stream}");
    assert_eq!(field(refused, "status"), "400", "{refused}");
    assert_eq!(field(refused, "output_tokens"), "0", "{refused}");
    drop(p);

    let (mut q, port) = serve(&model, &["--no-request-log"]);
    assert_eq!(curl(port, "/v1/chat/completions", &[], Some(chat)), "200");
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(request_lines(&mut q, 0).is_empty(), "{:#?}", q.drain());
}

fn route(worker: u16, extra: &[&str]) -> (Proc, u16) {
    let mut args: Vec<String> = ["route", "--port", "0", "--decode"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.push(format!("http://127.0.0.1:{worker}"));
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut p = Proc::start(env!("CARGO_BIN_EXE_strata"), &args);
    let line = p.wait_for("ready on http://", 60);
    let port = port_after(&line, "ready on http://");
    (p, port)
}

/// The router logs its own line per API request: the id, the status it answered and the
/// worker that answered; probes get none; `strata route --no-request-log` turns it off.
#[test]
fn the_router_logs_each_api_request_with_the_worker_that_answered() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("tiny.gguf");
    strata_model::tiny::write_tiny(&model, &strata_model::tiny::TinySpec::default()).unwrap();
    let (_w, wport) = serve(&model, &["--no-request-log"]);
    let (mut r, port) = route(wport, &[]);
    let chat = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"temperature":0}"#;
    assert_eq!(curl(port, "/health", &[], None), "200");
    let id = ["x-request-id: routed-7"];
    assert_eq!(curl(port, "/v1/chat/completions", &id, Some(chat)), "200");
    assert_eq!(
        curl(
            port,
            "/v1/completions",
            &[],
            Some(r#"{"prompt":"x","max_tokens":-1}"#)
        ),
        "400"
    );
    let lines = request_lines(&mut r, 2);
    assert_eq!(lines.len(), 2, "{lines:#?}");
    let (ok, refused) = (&lines[0], &lines[1]);
    assert_eq!(field(ok, "request_id"), "routed-7", "{ok}");
    assert_eq!(field(ok, "route"), "/v1/chat/completions", "{ok}");
    assert_eq!(field(ok, "status"), "200", "{ok}");
    assert_eq!(
        field(ok, "worker"),
        format!("http://127.0.0.1:{wport}"),
        "{ok}"
    );
    assert!(field(ok, "duration_ms").parse::<f64>().is_ok(), "{ok}");
    assert_eq!(field(refused, "route"), "/v1/completions", "{refused}");
    assert_eq!(field(refused, "status"), "400", "{refused}");
    drop(r);

    let (mut q, port) = route(wport, &["--no-request-log"]);
    assert_eq!(curl(port, "/v1/chat/completions", &[], Some(chat)), "200");
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(request_lines(&mut q, 0).is_empty(), "{:#?}", q.drain());
}
