//! PD with decode-side reuse under `strata up` (router, prefill and decode worker as real
//! processes, the tiny model): the decode worker asks the prefill worker only for the pages
//! after the prefix its own cache holds.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use strata_model::tiny::{write_tiny, TinySpec};
use strata_test_support::sample;
use strata_test_support::up::Up;

fn post(url: &str, body: &Value) -> Option<Value> {
    let out = std::process::Command::new("curl")
        .args(["-s", "-f", "-H", "content-type: application/json", "-d"])
        .arg(body.to_string())
        .arg(url)
        .output()
        .expect("curl (scripts/test.sh installs it)");
    serde_json::from_slice(&out.stdout).ok()
}

fn received_bytes(decode: u16) -> f64 {
    let out = std::process::Command::new("curl")
        .args(["-s", &format!("http://127.0.0.1:{decode}/metrics")])
        .output()
        .unwrap();
    let m = String::from_utf8_lossy(&out.stdout);
    sample(
        &m,
        r#"strata_kv_transfer_bytes_total{direction="received"}"#,
    )
}

/// A repeated 2,000-token chat moves at most 5 % of the first one's K/V bytes, with the same
/// greedy answer; each next turn of the conversation moves only the pages of what it adds.
#[test]
fn a_repeat_and_a_next_turn_move_only_what_the_decode_worker_lacks() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("tiny.gguf");
    let spec = TinySpec {
        context: 4096,
        ..TinySpec::default()
    };
    write_tiny(&model, &spec).unwrap();
    // Every request goes through the prefill worker (none is computed on the decode worker),
    // so what crosses is what the decode worker lacks.
    let cfg = r#"host = "127.0.0.1"
smoke_test = false
[router]
port = 0
[[prefill]]
port = 0
args = ["--device-mem", "64MiB", "--hicache-size", "64MiB"]
[[decode]]
port = 0
args = ["--device-mem", "64MiB", "--hicache-size", "64MiB", "--pd-local-prefill-tokens", "0"]
"#;
    let path = d.path().join("up.toml");
    std::fs::write(&path, cfg).unwrap();
    let mut up = Up::start(
        env!("CARGO_BIN_EXE_strata"),
        &path,
        &model,
        &d.path().join("state"),
        &[],
    );
    let ready = up.ready(120);
    let (r, dp) = (ready.router, ready.port("decode-0"));
    let url = format!("http://127.0.0.1:{r}/v1/chat/completions");
    let system = "the harbour log of a long voyage, read again at every question. ".repeat(32);
    let mut messages = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": "where did the ship call first"}),
    ];
    let ask = |messages: &[Value]| {
        let body =
            json!({"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": true});
        post(&url, &body)
    };
    let t = Instant::now();
    let first = loop {
        if let Some(v) = ask(&messages) {
            break v;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "strata up never answered"
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    let prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt >= 2000, "{prompt} prompt tokens");
    let b1 = received_bytes(dp);
    assert!(b1 > 0.0);

    let again = ask(&messages).unwrap();
    let b2 = received_bytes(dp) - b1;
    assert_eq!(
        again["choices"][0]["message"]["content"],
        first["choices"][0]["message"]["content"]
    );
    eprintln!("first: {prompt} tokens, {b1} bytes; repeat: {b2} bytes");
    assert!(b2 <= 0.05 * b1, "the repeat moved {b2} of {b1} bytes");

    // Next turns: what crosses is the pages of the answer and the new question.
    let page_bytes = b1 / prompt.div_ceil(16) as f64;
    let mut last = (prompt, received_bytes(dp));
    for q in ["and after that", "how long did it stay there"] {
        let answer = first["choices"][0]["message"]["content"].clone();
        messages.push(json!({"role": "assistant", "content": answer}));
        messages.push(json!({"role": "user", "content": q}));
        let v = ask(&messages).unwrap();
        let n = v["usage"]["prompt_tokens"].as_u64().unwrap();
        let moved = received_bytes(dp) - last.1;
        let new_pages = (n - last.0).div_ceil(16) + 1;
        eprintln!("turn: {} new tokens, {moved} bytes", n - last.0);
        assert!(
            moved > 0.0 && moved <= new_pages as f64 * page_bytes,
            "a turn of {} new tokens moved {moved} bytes ({page_bytes} a page)",
            n - last.0
        );
        last = (n, received_bytes(dp));
    }
}
