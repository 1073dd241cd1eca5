//! `strata bench workload` against a `strata serve` with the tiny model: the summary and JSON
//! record come back, repeated prefixes show as cached, the agent workload's tool calls run,
//! bad parameters are refused first.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use strata_model::tiny::{write_tiny, TinySpec};

use strata_test_support::ChildGuard as Guard;

fn strata() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

#[test]
fn workloads_run_against_a_server_and_record_json() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("tiny.gguf");
    // Room for the agent workload's tools in the prompt (the tiny tokenizer: ~1 token a byte).
    let spec = TinySpec {
        context: 4096,
        ..TinySpec::default()
    };
    write_tiny(&model, &spec).unwrap();
    // Port 0: the server binds and reports its address.
    let mut child = strata()
        .args([
            "serve",
            "--device-mem",
            "16MiB",
            "--hicache-size",
            "16MiB",
            "--port",
            "0",
        ])
        .arg("--model")
        .arg(&model)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = child.stderr.take().unwrap();
    let _g = Guard(child);
    let mut url = String::new();
    for l in BufReader::new(err).lines().map_while(Result::ok) {
        if let Some(at) = l.split("ready on ").nth(1) {
            url = at.split_whitespace().next().unwrap().to_string();
            break;
        }
    }
    assert!(url.starts_with("http://"), "the server did not start");
    let json = d.path().join("sp.json");
    let o = strata()
        .args([
            "bench",
            "workload",
            "--workload",
            "shared-prefix",
            "--groups",
            "2",
        ])
        .args([
            "--per-group",
            "3",
            "--concurrency",
            "1",
            "--prefix-words",
            "60",
            "--max-tokens",
            "4",
            "--url",
            &url,
        ])
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("| 6 | 0 |"), "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["summary"]["requests"], 6);
    assert_eq!(v["summary"]["failures"], 0);
    assert!(
        v["summary"]["cached_fraction"].as_f64().unwrap() > 0.3,
        "{v}"
    );
    assert_eq!(v["requests"].as_array().unwrap().len(), 6);
    let o = strata()
        .args([
            "bench",
            "workload",
            "--workload",
            "multi-turn",
            "--clients",
            "2",
            "--rounds",
            "2",
        ])
        .args([
            "--system-words",
            "10",
            "--user-words",
            "4",
            "--max-tokens",
            "4",
            "--url",
            &url,
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("| 4 | 0 |"),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // Agents: forced tool calls, their results appended, then an answer.
    let o = strata()
        .args(["bench", "workload", "--workload", "agent", "--clients", "2"])
        .args(["--steps", "3", "--system-words", "5", "--task-words", "5"])
        .args(["--result-words", "3", "--max-tokens", "4", "--url", &url])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("| 6 | 0 |"), "{out}{err}");
    assert!(
        err.contains("of 4 tool steps returned a tool call"),
        "{err}"
    );
    // Refused before anything is sent.
    let o = strata()
        .args([
            "bench",
            "workload",
            "--workload",
            "multi-turn",
            "--clients",
            "0",
            "--url",
            &url,
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("clients must be at least 1"));
}
