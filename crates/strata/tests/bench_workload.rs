//! `strata bench workload` against a `strata serve` with the tiny model: the summary and JSON
//! record come back, repeated prefixes show as cached, bad parameters are refused first.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};

use strata_model::tiny::{write_tiny, TinySpec};

struct Guard(Child);
impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn strata() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

#[test]
fn workloads_run_against_a_server_and_record_json() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("tiny.gguf");
    write_tiny(&model, &TinySpec::default()).unwrap();
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = strata()
        .args([
            "serve",
            "--device-mem",
            "16MiB",
            "--hicache-size",
            "16MiB",
            "--port",
        ])
        .arg(port.to_string())
        .arg("--model")
        .arg(&model)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = child.stderr.take().unwrap();
    let _g = Guard(child);
    for l in BufReader::new(err).lines().map_while(Result::ok) {
        if l.contains("ready on http://") {
            break;
        }
    }
    let url = format!("http://127.0.0.1:{port}");
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
