//! `strata up --kv-cache-dtype q8_0`: every worker stores K/V as q8_0 (each says so), K/V moves
//! from the prefill worker to the decode worker in q8_0 and the answer equals one q8_0 worker's;
//! a worker's own args setting a dtype stop `up` before anything starts; a worker with K and V
//! in two dtypes holds them as two kinds.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use strata_model::tiny::{write_tiny, TinySpec};
use strata_test_support::up::Up;

fn up(dir: &Path, model: &Path, toml: &str, extra: &[&str]) -> Up {
    let cfg = dir.join("up.toml");
    std::fs::write(&cfg, toml).unwrap();
    let exe = env!("CARGO_BIN_EXE_strata");
    Up::start(exe, &cfg, model, &dir.join("state"), extra)
}

/// The tiny model with heads of 32 values (a whole q8_0 block each).
fn tiny32(dir: &Path) -> PathBuf {
    let model = dir.join("tiny32.gguf");
    let spec = TinySpec {
        context: 1024,
        ..TinySpec::family("llama-h32").unwrap()
    };
    write_tiny(&model, &spec).unwrap();
    model
}

const WORKER: &str =
    "[\"--page-size\", \"16\", \"--device-mem\", \"16MiB\", \"--hicache-size\", \"16MiB\"]";

/// One `strata serve` on the model with `dtype_args`, ready; its port.
fn serve(model: &Path, dtype_args: &[&str]) -> (strata_test_support::ChildGuard, u16) {
    let mut one = Command::new(env!("CARGO_BIN_EXE_strata"));
    one.args([
        "serve",
        "--port",
        "0",
        "--page-size",
        "16",
        "--device-mem",
        "16MiB",
    ])
    .args(["--hicache-size", "16MiB"])
    .args(dtype_args)
    .arg("--model")
    .arg(model);
    strata_test_support::spawn_ready(&mut one, Duration::from_secs(60))
}

fn completion(port: u16) -> serde_json::Value {
    let prompt: Vec<u32> = (0..100).map(|j| 3 + (j * 29) % 250).collect();
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                  "ignore_eos": true});
    strata_test_support::post_json(port, "/v1/completions", &body)
}

#[test]
fn one_q8_0_dtype_for_the_deployment_and_pd_moves_it() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny32(d.path());
    let toml = format!(
        "host = \"127.0.0.1\"\nsmoke_test = false\n[router]\nport = 0\n\
         [[prefill]]\nport = 0\nargs = {WORKER}\n[[decode]]\nport = 0\nargs = {WORKER}\n"
    );
    let mut up = up(d.path(), &model, &toml, &["--kv-cache-dtype", "q8_0"]);
    let ready = up.ready(90);
    let log = up.log.join("\n");
    for w in ["prefill-0", "decode-0"] {
        assert!(
            up.log
                .iter()
                .any(|l| l.starts_with(&format!("[{w}]")) && l.contains("K and V as q8_0")),
            "{w} did not say it stores q8_0: {log}"
        );
    }
    let via_pd = completion(ready.router);
    let text = via_pd["choices"][0]["text"].clone();
    assert!(text.is_string(), "{via_pd}");

    let (_one, port) = serve(&model, &["--kv-cache-dtype", "q8_0"]);
    assert_eq!(completion(port)["choices"][0]["text"], text);

    let m = strata_test_support::metrics_text(ready.port("decode-0"));
    let moved = strata_test_support::sample(&m, "strata_transferred_prompt_tokens_total");
    assert!(
        moved >= 96.0,
        "the prompt's K/V came from the prefill worker: {moved}"
    );
}

#[test]
fn a_workers_own_dtype_stops_up_before_anything_starts() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny32(d.path());
    let toml = "host = \"127.0.0.1\"\n[router]\nport = 0\n[[prefill]]\nport = 0\n\
                args = [\"--device-mem\", \"16MiB\"]\n[[decode]]\nport = 0\n\
                args = [\"--kv-cache-dtype=q8_0\"]\n";
    let mut up = up(d.path(), &model, toml, &[]);
    let status = up.wait_exit(30);
    let text = up.drain(200);
    assert_eq!(status.code(), Some(2), "{text}");
    assert!(
        text.contains("decode-0's args give --kv-cache-dtype: set kv_cache_dtype once"),
        "{text}"
    );
    assert!(!text.contains("starting"), "something started: {text}");
}

/// `strata serve --cache-type-k q8_0 --cache-type-v f16`: the pools are two kinds, `k` and `v`,
/// each sized in its dtype, and the worker answers.
#[test]
fn a_worker_stores_k_and_v_in_two_dtypes() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny32(d.path());
    let (_one, port) = serve(&model, &["--cache-type-k", "q8_0", "--cache-type-v", "f16"]);
    assert!(completion(port)["choices"][0]["text"].is_string());
    let m = strata_test_support::metrics_text(port);
    let cap = |pool: &str| {
        let k = format!("strata_cache_capacity_bytes{{tier=\"host\",pool=\"{pool}\"}}");
        strata_test_support::sample(&m, &k)
    };
    // The same tokens in each: K's 34 bytes per 32 values against V's 64.
    let (k, v) = (cap("k"), cap("v"));
    assert!(k > 0.0 && v > 0.0, "{m}");
    assert_eq!(k * 64.0, v * 34.0, "{m}");
}
