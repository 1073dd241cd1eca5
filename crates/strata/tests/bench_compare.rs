//! `strata bench compare` with the tiny model: it starts every configuration itself (one
//! worker without prefix cache, device only, device + host, device + host + disk, and PD
//! behind the router), runs one seeded multi-turn workload against each at two concurrency
//! levels, and writes the table, results.json and the plots; the hit tokens by tier show each
//! configuration doing what it says.

use std::net::TcpListener;
use std::process::Command;

use strata_model::tiny::{write_tiny, TinySpec};

/// A base port with the next 100 ports free right now.
fn free_base() -> u16 {
    'outer: for base in (20000..60000).step_by(97) {
        for p in base..base + 100 {
            if TcpListener::bind(("127.0.0.1", p)).is_err() {
                continue 'outer;
            }
        }
        return base;
    }
    panic!("no free port range");
}

#[test]
fn compare_starts_every_configuration_and_reports_hits_by_tier() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("tiny.gguf");
    write_tiny(&model, &TinySpec::default()).unwrap();
    let out = d.path().join("out");
    // The tiny model holds 256 bytes of K/V per token: a 128 KiB device pool is 512 tokens,
    // less than the three conversations together (each grows to ~400 tokens, mostly its own
    // turns), so device-only recomputes them while the host tier keeps them.
    let o = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["bench", "compare", "--workload", "multi-turn"])
        .args(["--clients", "3", "--rounds", "3", "--system-words", "10"])
        .args([
            "--user-words",
            "20",
            "--max-tokens",
            "4",
            "--concurrency",
            "1,2",
        ])
        .args(["--device-mem", "128KiB", "--hicache-size", "1MiB"])
        .args(["--l3-size", "4MiB", "--sample-interval", "0.1"])
        .arg("--base-port")
        .arg(free_base().to_string())
        .arg("--model")
        .arg(&model)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stdout}\n{stderr}");
    for cfg in ["no-cache", "device", "host", "disk", "pd"] {
        for c in [1, 2] {
            assert!(
                stdout.contains(&format!("| {cfg} c={c} | 9 | 0 |")),
                "{cfg} c={c}:\n{stdout}"
            );
        }
    }
    assert!(
        stdout.contains("host vs device c=1: throughput"),
        "{stdout}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 10);
    let tiers = |cfg: &str, c: u64| {
        let r = runs
            .iter()
            .find(|r| r["configuration"] == cfg && r["concurrency"] == c)
            .unwrap();
        let t = &r["tiers"];
        let f = |k: &str| t[k].as_f64().unwrap();
        // Every prompt token is a hit in one tier or a miss.
        let prompt: u64 = r["requests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|q| q["prompt_tokens"].as_u64().unwrap())
            .sum();
        if cfg != "pd" {
            assert_eq!(
                f("device") + f("host") + f("l3") + f("miss"),
                prompt as f64,
                "{cfg}: {t}"
            );
        }
        (f("device"), f("host"), f("l3"), f("miss"))
    };
    for c in [1, 2] {
        let (dv, h, l3, _) = tiers("no-cache", c);
        assert_eq!((dv, h, l3), (0.0, 0.0, 0.0));
        let (dv, h, l3, _) = tiers("device", c);
        assert!(dv > 0.0 && h == 0.0 && l3 == 0.0);
        let (_, h, _, miss) = tiers("host", c);
        assert!(h > 0.0, "the host tier serves what the device evicted");
        let (_, _, _, miss_dev) = tiers("device", c);
        assert!(
            miss < miss_dev,
            "host {miss} vs device {miss_dev} misses\n{stdout}"
        );
        let (_, h, _, _) = tiers("pd", c);
        assert!(h > 0.0, "the workers' host tiers serve under PD");
    }
    // Samples over time were taken, and the plots drawn.
    assert!(runs[0]["samples"].as_array().unwrap().len() >= 2);
    for f in [
        "ttft_cdf.svg",
        "throughput_vs_concurrency.svg",
        "hit_rate_by_tier_host.svg",
        "hit_rate_by_tier_pd.svg",
    ] {
        let s = std::fs::read_to_string(out.join(f)).unwrap();
        assert!(s.starts_with("<svg") && s.contains("<polyline"), "{f}");
    }
    let cdf = std::fs::read_to_string(out.join("ttft_cdf.svg")).unwrap();
    assert_eq!(cdf.matches("<polyline").count(), 5);
    // The plots can be drawn again from results.json alone.
    let again = d.path().join("again");
    let o = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["bench", "compare", "--replot"])
        .arg(out.join("results.json"))
        .arg("--out")
        .arg(&again)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        std::fs::read_to_string(again.join("ttft_cdf.svg")).unwrap(),
        cdf
    );
    assert!(again.join("throughput_vs_concurrency.svg").exists());
    // Bad configuration names are refused before anything starts.
    let o = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "bench",
            "compare",
            "--workload",
            "multi-turn",
            "--configs",
            "host,gpu",
        ])
        .arg("--model")
        .arg(&model)
        .arg("--out")
        .arg(d.path().join("never"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("`gpu`"));
    assert!(!d.path().join("never").exists());
    if let Ok(keep) = std::env::var("STRATA_KEEP_COMPARE") {
        let _ = std::process::Command::new("cp")
            .arg("-r")
            .arg(&out)
            .arg(keep)
            .status();
        println!("{stdout}");
    }
}
