//! The official `openai` Python client, langchain-openai, lm-eval and instructor (pinned in
//! scripts/requirements-test.txt, installed by scripts/test.sh) against real processes: a
//! `strata serve`, then the router (`strata route`) in front of a prefill and a decode worker
//! (`strata serve --role prefill|decode`), all on port 0 with the tiny model. The scripts
//! (tests/python) check chat, streaming with usage, logprobs (the prompt's with echo), best_of,
//! sampling fields, documented no-ops, refusals naming their field, unknown fields refused,
//! models, request ids, structured output (20/20 valid at temperature 1) and tool calls; and
//! langchain-openai's `bind_tools` (`tool_choice="required"`) and `with_structured_output`
//! (json_schema, 20/20); lm-evaluation-harness's `local-completions` (its default tokenized
//! requests, the server's tokenizer) and `local-chat-completions` on a log-likelihood and a
//! generate-until task, the same scores cold and warm; instructor's TOOLS mode with nested
//! models (`$defs`), validated 10 times out of 10; the Responses API through the openai client
//! and the OpenAI Agents SDK's default model with a function tool.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use strata_model::tiny::{write_tiny, TinySpec};

/// A child process killed however the test ends; its stderr lines go to a channel.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `strata ARGS` and waits for its ready line; the process and its URL.
fn start(args: &[&str]) -> (Proc, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, lines) = mpsc::channel();
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let p = Proc { child, lines };
    let mut log = Vec::new();
    loop {
        let l = p
            .lines
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("{args:?} never got ready:\n{}", log.join("\n")));
        if let Some(at) = l.split("ready on ").nth(1) {
            let url = at.split_whitespace().next().unwrap().to_string();
            return (p, url);
        }
        log.push(l);
    }
}

fn serve(model: &Path, extra: &[&str]) -> (Proc, String) {
    let m = model.to_str().unwrap();
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--device-mem",
        "64MiB",
        "--model",
        m,
    ];
    args.extend_from_slice(extra);
    start(&args)
}

/// Runs both client scripts against `base`; fails with their output.
fn client_checks(base: &str, mode: &str) {
    // instructor pins a jiter the openai client cannot take: its own virtual environment
    // (scripts/test.sh makes it).
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/py-instructor/bin/python");
    assert!(
        venv.exists(),
        "{} is missing: scripts/test.sh makes it (python3 -m venv, scripts/requirements-instructor.txt)",
        venv.display()
    );
    for script in [
        "openai_client.py",
        "langchain_client.py",
        "lm_eval_client.py",
        "instructor_client.py",
        "responses_client.py",
        "agents_client.py",
    ] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/python")
            .join(script);
        let python = if script == "instructor_client.py" {
            venv.as_os_str()
        } else {
            std::ffi::OsStr::new("python3")
        };
        let out = Command::new(python)
            .arg(&path)
            .args([base, "tiny", mode])
            .output()
            .expect("python3 (scripts/test.sh installs it with the openai package)");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            !text.contains("No module named"),
            "a Python package is missing: pip install -r scripts/requirements-test.txt (scripts/test.sh does)\n{text}"
        );
        assert!(
            out.status.success() && text.contains("all checks passed"),
            "{script} ({mode}):\n{text}"
        );
    }
}

/// A counter's value in a worker's `/metrics` (one HTTP/1.0 GET).
fn counter(url: &str, name: &str) -> f64 {
    let host = url.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(host).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {host}\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

#[test]
fn the_official_clients_work_against_strata_serve_and_the_pd_router() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("tiny.gguf");
    // Room for tools in the prompt (the tiny tokenizer: about a token a byte).
    let spec = TinySpec {
        context: 4096,
        ..TinySpec::default()
    };
    write_tiny(&model, &spec).unwrap();
    let (_single, url) = serve(&model, &[]);
    client_checks(&url, "single");

    let (_prefill, p) = serve(&model, &["--role", "prefill"]);
    let (_decode, dec) = serve(&model, &["--role", "decode", "--prefill-worker", &p]);
    let (_router, r) = start(&["route", "--port", "0", "--prefill", &p, "--decode", &dec]);
    client_checks(&r, "pd");
    assert!(
        counter(&dec, "strata_transferred_prompt_tokens_total") > 0.0,
        "the requests went through PD"
    );
}
