//! `strata model bench --streams`: batched decode on the tiny model, reported against the
//! measured ceilings.

use std::process::Command;

use strata_model::tiny::{write_tiny, TinySpec};

#[test]
fn streams_bench_reports_every_count_against_the_ceilings() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("tiny.gguf");
    write_tiny(&model, &TinySpec::default()).unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["model", "bench", "--model", model.to_str().unwrap()];
        args.extend_from_slice(extra);
        Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(&args)
            .output()
            .unwrap()
    };
    let o = run(&[
        "--streams",
        "1,3",
        "--streams-context",
        "20",
        "--streams-steps",
        "2",
    ]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        out.contains("ceilings (") && out.contains("GFLOP/s"),
        "{out}"
    );
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("| 1 |") || l.starts_with("| 3 |"))
        .collect();
    assert_eq!(rows.len(), 2, "{out}");
    for r in rows {
        let cells: Vec<&str> = r.split('|').map(str::trim).collect();
        let tok_s: f64 = cells[2].parse().unwrap();
        assert!(tok_s > 0.0 && tok_s.is_finite(), "{r}");
        assert!(cells[5].ends_with('%') && cells[7].ends_with('%'), "{r}");
    }
    // Counts out of range are refused before anything runs.
    let bad = run(&["--streams", "0"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--streams takes counts from 1 to 256"));
}

/// DeepSeek-V4 (the tiny model) at TP 1 and 2: prefill and decode rates, as `strata serve`
/// runs its ranks; what it cannot measure is refused by name.
#[test]
fn deepseek_v4_bench_runs_at_tp_1_and_2_and_refuses_what_it_cannot_measure() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("tiny-dsv4.gguf");
    strata_model::tiny::deepseek4::write_tiny_dsv4(&model, &Default::default()).unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["model", "bench", "--model", model.to_str().unwrap()];
        args.extend_from_slice(extra);
        let o = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(&args)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        (o.status.success(), text)
    };
    for tp in ["1", "2"] {
        let (ok, out) = run(&[
            "--tp-size",
            tp,
            "--prefill",
            "40",
            "--chunk",
            "16",
            "--decode-context",
            "36",
            "--decode-tokens",
            "4",
            "--reps",
            "1",
        ]);
        assert!(ok, "{out}");
        assert!(out.contains(&format!("{tp} rank(s)")), "{out}");
        assert!(out.contains("prefill    40 tokens:"), "{out}");
        assert!(out.contains("decode at context 36:"), "{out}");
    }
    let (ok, out) = run(&["--streams", "1"]);
    assert!(
        !ok && out.contains("--streams measures the llama family"),
        "{out}"
    );
    // The defaults prefill 2048 tokens: more than the tiny model's 1024.
    let (ok, out) = run(&[]);
    assert!(
        !ok && out.contains("exceed the model's context length 1024"),
        "{out}"
    );
}
