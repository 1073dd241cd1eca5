//! `strata serve` validates every flag and combination before any pool is allocated: each
//! refusal below exits 2 with a message naming the flag, and the host pool was never made.

use std::net::TcpListener;
use std::process::Command;

fn serve(model: &std::path::Path, extra: &[&str]) -> (Option<i32>, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "--port", "0", "--device-mem", "16MiB"])
        .args(["--hicache-size", "16MiB", "--role", "decode", "--model"])
        .arg(model)
        .args(extra)
        .output()
        .unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn every_kv_check_comes_before_the_pools() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("tiny.gguf");
    strata_model::tiny::write_tiny(&model, &strata_model::tiny::TinySpec::default()).unwrap();
    let key = d.path().join("cluster.key");
    strata_kv::auth::ClusterKey::create_file(&key).unwrap();
    let key = key.to_str().unwrap();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--kv-host", "0.0.0.0", "--cluster-key-file", key],
            "--kv-advertise",
        ),
        (
            vec!["--kv-advertise", "10.1.2.3"],
            "loopback addresses only",
        ),
        (vec!["--kv-advertise", "pod"], "--kv-advertise `pod`"),
        (
            vec!["--kv-staging", "1KiB"],
            "--kv-staging 1KiB: one prompt of",
        ),
        (
            vec!["--kv-port", &port],
            "cannot listen for KV transfers on 127.0.0.1:",
        ),
        // The tiny model's KV heads hold 16 values: no whole q8_0 block.
        (
            vec!["--cache-type-k", "q8_0"],
            "a KV head of 16 values does not hold whole blocks",
        ),
        (
            vec!["--kv-cache-dtype", "q4_0"],
            "expected one of f16, q8_0, fp8_e4m3",
        ),
        // Memory the flags let the server hold beside its pools is planned with them.
        (
            vec![
                "--kv-staging",
                "1000TiB",
                "--prefill-worker",
                "http://127.0.0.1:9",
            ],
            "alternatives: a smaller --kv-staging (now 1000.00 TiB",
        ),
        (
            vec!["--response-store-size", "1000TiB"],
            "alternatives: a smaller --response-store-size (now 1000.00 TiB",
        ),
    ];
    for (args, says) in cases {
        let (code, err) = serve(&model, &args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: no `{says}` in {err}");
        assert!(
            !err.contains("pool allocated"),
            "{args:?}: refused only after allocating: {err}"
        );
    }
}
