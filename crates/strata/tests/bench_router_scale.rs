//! `strata bench router-scale` on a small configuration: the router follows every simulated
//! worker's events, routes each prompt to the worker holding its document, and the report
//! states the figures docs/BENCHMARKS.md records.

use std::process::Command;

#[test]
fn the_router_follows_simulated_workers_and_routes_to_the_owner() {
    let o = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "bench",
            "router-scale",
            "--workers",
            "8",
            "--rate",
            "100",
            "--seconds",
            "2",
            "--documents",
            "32",
            "--events-per-second",
            "50",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["failures"], 0, "{v}");
    assert_eq!(v["requests"], 200, "{v}");
    // Every prompt starts with a document one worker holds: cache-aware routing finds it.
    assert_eq!(v["routed_elsewhere"], 0, "{v}");
    assert!(v["events_absorbed"].as_u64().unwrap() > 0, "{v}");
    let per_page = v["index_bytes_per_page"].as_f64().unwrap();
    assert!(per_page > 16.0 && per_page < 200.0, "{v}");
}
