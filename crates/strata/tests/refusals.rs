//! Refusals that must stay readable and leave nothing behind: an error echoing a huge input is
//! cut (its reason kept), and `strata up` whose flags are refused makes no state or key.

use std::process::{Command, Output};

use strata_test_support::said as text;

/// `strata ARGS`, run to its end.
fn strata(args: &[&str], env: &[(&str, &std::path::Path)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    c.args(args).envs(env.iter().copied());
    c.output().expect("run strata")
}

/// An error that echoes a 200 KB line of a config file shows its start, its end and the
/// reason, not the whole line (nor a column marker 200,000 spaces wide); a flag's huge value
/// likewise.
#[test]
fn an_error_echoing_a_huge_line_is_cut_and_keeps_its_reason() {
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("up.toml");
    std::fs::write(&f, format!("x = [{}\n", "1,".repeat(100_000))).unwrap();
    let o = strata(&["up", "--config", f.to_str().unwrap()], &[]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(t.len() < 12_000, "{} bytes", t.len());
    assert!(t.contains("bytes cut") && t.contains("expected `]`"), "{t}");
    let huge = "9".repeat(100_000);
    let url = format!("http://127.0.0.1:{huge}");
    let o = strata(&["route", "--port", "0", "--decode", &url], &[]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(
        t.len() < 6_000 && t.contains("bytes cut"),
        "{} bytes",
        t.len()
    );
}

/// A number flag's value is echoed as it could be typed back: `1e300`, not three hundred
/// digits, whichever flag (a duration, a ratio, a fraction, a bench's) is refused.
#[test]
fn a_refused_number_is_echoed_in_exponent_form() {
    for (args, flag) in [
        (&["serve", "--kv-deadline"][..], "--kv-deadline"),
        (&["serve", "--hicache-ratio"], "--hicache-ratio"),
        (&["serve", "--device-mem-fraction"], "--device-mem-fraction"),
        (
            &["serve", "--prefetch-ms-per-token"],
            "--prefetch-ms-per-token",
        ),
        (&["bench", "health", "--seconds"], "--seconds"),
        (
            &["bench", "compare", "--startup-timeout"],
            "--startup-timeout",
        ),
    ] {
        for v in ["1e300", "-1e-300"] {
            let mut all = args.to_vec();
            all.push(v);
            let o = strata(&all, &[]);
            let t = text(&o);
            assert_eq!(o.status.code(), Some(2), "{t}");
            assert!(t.contains(&format!("{flag} {v}")), "{t}");
            assert!(!t.contains("0000000000"), "{t}");
        }
    }
}

/// `strata up` whose worker flags are refused leaves nothing behind: no state directory, no
/// cluster key (its flags were checked with a stand-in key, removed too).
#[test]
fn up_with_refused_flags_makes_no_state_or_key() {
    let d = tempfile::tempdir().unwrap();
    let model = strata_test_support::tiny_model(d.path());
    let state = d.path().join("state");
    let f = d.path().join("up.toml");
    std::fs::write(
        &f,
        format!(
            "model = {model:?}\nstate_dir = {state:?}\nsmoke_test = false\n[router]\nport = 0\n\
             [[prefill]]\nport = 0\nargs = []\n[[decode]]\nport = 0\nargs = [\"--device-mem\", \"1e400GB\"]\n"
        ),
    )
    .unwrap();
    let tmp = d.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let o = strata(
        &["up", "--config", f.to_str().unwrap()],
        &[("TMPDIR", &tmp)],
    );
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(t.contains("--device-mem"), "{t}");
    assert!(!state.exists(), "{t}");
    let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().flatten().collect();
    assert!(left.is_empty(), "{left:?}");
}
