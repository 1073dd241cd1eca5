//! The `strata` binary end to end: real trace files in, reports and plots out, bad input refused
//! with messages that name the problem.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn strata(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .expect("run strata")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A small multi-turn trace: 30 conversations of growing prompts plus a shared system prompt.
fn write_trace(dir: &Path) -> PathBuf {
    strata_test_support::write_multi_turn_trace(dir, 30, 4, 10)
}

#[test]
fn sim_reports_per_tier_hit_rates() {
    let d = tempfile::tempdir().unwrap();
    let t = write_trace(d.path());
    let o = strata(&[
        "sim",
        "--trace",
        t.to_str().unwrap(),
        "--device",
        "20%",
        "--host",
        "40%",
        "--storage",
        "100%",
    ]);
    let s = text(&o);
    assert!(o.status.success(), "{s}");
    for want in [
        "device capacity:",
        "host capacity:",
        "storage capacity:",
        "lru ",
        "gdsf ",
        "belady",
        "inf",
    ] {
        assert!(s.contains(want), "missing `{want}` in:\n{s}");
    }
    // Every turn after the first re-reads the conversation: the total hit rate is substantial.
    let lru = s.lines().find(|l| l.starts_with("lru ")).unwrap();
    let total: f64 = lru.split_whitespace().nth(4).unwrap().parse().unwrap();
    assert!(total > 40.0, "{lru}");
    // `auto`'s row, and only it, says what it learnt.
    let learnt: Vec<&str> = s
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("auto: newcomer credit "))
        .collect();
    assert_eq!(learnt.len(), 1, "{s}");
    let credit: f64 = learnt[0].split(' ').next().unwrap().parse().unwrap();
    assert!((0.25..=1.0).contains(&credit), "{}", learnt[0]);
}

#[test]
fn sweep_writes_a_plot_with_belady() {
    let d = tempfile::tempdir().unwrap();
    let t = write_trace(d.path());
    let plot = d.path().join("curve.svg");
    let o = strata(&[
        "sim",
        "--trace",
        t.to_str().unwrap(),
        "--sweep",
        "--fractions",
        "0.1,0.5,1",
        "--plot",
        plot.to_str().unwrap(),
    ]);
    let s = text(&o);
    assert!(o.status.success(), "{s}");
    assert!(s.contains("belady") && s.contains("lru/belady"), "{s}");
    let svg = std::fs::read_to_string(&plot).unwrap();
    // A curve per policy, Belady's and the infinite cache's.
    let curves = strata_kv::EvictionPolicy::ALL.len() + 2;
    assert!(svg.contains("Belady (offline MIN)") && svg.matches("<polyline").count() == curves);
}

#[test]
fn malformed_trace_names_line_and_field() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("bad.jsonl");
    std::fs::write(
        &p,
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n{\"timestamp\": 1, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": \"x\"}\n",
    )
    .unwrap();
    let o = strata(&["sim", "--trace", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).contains("trace line 2, field `hash_ids`: expected an array"),
        "{}",
        text(&o)
    );
    // A small file whose requests come to more pages than a replay holds is refused before
    // anything is expanded (8 MiB of ids would otherwise take gigabytes).
    let ids = vec!["0"; 32768].join(",");
    let line = format!(
        "{{\"timestamp\": 0, \"input_length\": 16777216, \"output_length\": 1, \"hash_ids\": [{ids}]}}\n"
    );
    std::fs::write(&p, line.repeat(40)).unwrap();
    let o = strata(&["sim", "--trace", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).contains("a replay holds at most 33554432"),
        "{}",
        text(&o)
    );
    // A FIFO is refused at once (it waited for a writer for ever).
    let fifo = d.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo(3) on a NUL-terminated path in this test's own directory.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let o = strata(&["sim", "--trace", fifo.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("not a regular file"), "{}", text(&o));
}

#[test]
fn impossible_capacities_and_bad_flags_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let t = write_trace(d.path());
    let t = t.to_str().unwrap();
    let o = strata(&["sim", "--trace", t, "--device", "3"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).contains("device capacity of 3 tokens is smaller than one page (16 tokens)"),
        "{}",
        text(&o)
    );
    // An output that cannot be written is a flag error before the trace is read (it was
    // found when the sweep was done).
    for plot in [d.path().to_str().unwrap(), "/nonexistent/dir/plot.svg"] {
        let o = strata(&[
            "sim",
            "--trace",
            "/nonexistent/trace.jsonl",
            "--sweep",
            "--plot",
            plot,
        ]);
        assert_eq!(o.status.code(), Some(2));
        assert!(
            text(&o).contains(&format!("--plot {plot}: ")),
            "{}",
            text(&o)
        );
    }
    // A tiny scale is shown as written, not as 300 digits.
    let o = strata(&["sim", "--trace", t, "--length-scale", "1e-300"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("--length-scale 1e-300)"), "{}", text(&o));
    let o = strata(&["sim", "--trace", t, "--device", "0"]);
    assert!(
        text(&o).contains("device capacity of 0 tokens"),
        "{}",
        text(&o)
    );
    let o = strata(&["sim", "--trace", t, "--host", "12XB"]);
    assert!(text(&o).contains("unknown unit `XB`"), "{}", text(&o));
    // Flags the advice would ignore are refused by name.
    let o = strata(&["sim", "--trace", t, "--advise", "--host", "1GiB"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("drop --host"), "{}", text(&o));
    let o = strata(&[
        "sim",
        "--trace",
        t,
        "--compare",
        "1GB,2GB",
        "--tp-size",
        "4",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).contains("--tp-size 4 needs --model"),
        "{}",
        text(&o)
    );
    let o = strata(&["sim", "--trace", t, "--write-policy", "sometimes"]);
    assert!(
        text(&o).contains("invalid value 'sometimes' for '--write-policy <WRITE_POLICY>': expected write_through, write_through_selective[:N] (N: hits, default 2) or write_back"),
        "{}",
        text(&o)
    );
    let o = strata(&["sim", "--trace", t, "--page-size", "0"]);
    assert!(
        text(&o).contains("page size must be at least 1"),
        "{}",
        text(&o)
    );
    let o = strata(&["sim", "--trace", t, "--page-size", "24"]);
    assert!(
        text(&o).contains("--page-size 24 must divide the block of 512 tokens"),
        "{}",
        text(&o)
    );
    let o = strata(&["sim", "--trace", "/nonexistent/trace.jsonl"]);
    assert!(
        text(&o).contains("cannot open trace /nonexistent/trace.jsonl"),
        "{}",
        text(&o)
    );
    let o = strata(&["sim", "--trace", t, "--vocab", "0"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("--vocab 0: expected at least 2"),
        "{}",
        text(&o)
    );
    // A capacity past all the replay inserts is that much (memory follows the trace, not the
    // flag; the byte figures do not overflow).
    for huge in ["18446744073709551615", "1024TiB"] {
        let o = strata(&["sim", "--trace", t, "--device", huge, "--storage", huge]);
        assert!(o.status.success(), "{huge}: {}", text(&o));
        assert!(
            text(&o).contains(&format!(
                "device capacity `{huge}` is more than the replay inserts"
            )),
            "{}",
            text(&o)
        );
    }
}

/// The shared Mooncake trace at block granularity (fast in a debug build).
#[test]
fn shared_mooncake_trace_replays() {
    let t = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/traces/mooncake_synthetic_trace.jsonl");
    assert!(
        t.exists(),
        "the shared trace is expected beside the checkout at {}",
        t.display()
    );
    let o = strata(&[
        "sim",
        "--trace",
        t.to_str().unwrap(),
        "--page-size",
        "1",
        "--ids-as-tokens",
        "--device",
        "5%",
    ]);
    let s = text(&o);
    assert!(o.status.success(), "{s}");
    assert!(s.contains("3993 requests"), "{s}");
    let rate = |name: &str| -> f64 {
        let l = s.lines().find(|l| l.starts_with(name)).unwrap();
        l.split_whitespace()
            .nth(if name == "belady" || name == "inf" {
                1
            } else {
                4
            })
            .unwrap()
            .parse()
            .unwrap()
    };
    let (lru, gdsf, belady, inf) = (rate("lru "), rate("gdsf "), rate("belady"), rate("inf"));
    assert!(
        lru > 10.0 && gdsf > lru && belady > gdsf && inf >= belady,
        "{s}"
    );
}

/// The reference model end to end (scripts/test.sh fetches it first).
#[test]
fn generate_answers_a_chat_question() {
    let o = strata(&[
        "generate",
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "24",
    ]);
    let s = text(&o);
    assert!(o.status.success(), "{s}");
    assert!(String::from_utf8_lossy(&o.stdout).contains("Paris"), "{s}");
    assert!(s.contains("tok/s"), "{s}");
}

/// `--compare`: host sizes per rank side by side in the model's bytes per token (here a preset
/// at TP 4), more host giving more hits; `--advise`: the sweep, the size that reaches the
/// target, the knee and the plot; bad combinations refused by name.
#[test]
fn sim_compares_host_sizes_and_advises_one() {
    let d = tempfile::tempdir().unwrap();
    let t = write_trace(d.path());
    let t = t.to_str().unwrap();
    let o = strata(&[
        "sim",
        "--trace",
        t,
        "--model-preset",
        "smollm2-135m",
        "--tp-size",
        "3",
        "--device",
        "20MB",
        "--compare",
        "10MB,1GB",
    ]);
    let s = text(&o);
    assert!(o.status.success(), "{s}");
    // 3 KV heads over 3 ranks: one each, 7,680 bytes per token per rank.
    assert!(
        s.contains("model smollm2-135m at TP 3: 7680 bytes per token per rank"),
        "{s}"
    );
    let rows: Vec<&str> = s
        .lines()
        .filter(|l| l.starts_with("| 10MB") || l.starts_with("| 1GB"))
        .collect();
    assert_eq!(rows.len(), 2, "{s}");
    let total = |l: &str| -> f64 { l.split('|').nth(5).unwrap().trim().parse().unwrap() };
    assert!(total(rows[1]) > total(rows[0]), "{s}");
    assert!(rows[1].contains("1GB (1000000000 bytes) | 130208 |"), "{s}");
    let plot = d.path().join("advise.svg");
    let o = strata(&[
        "sim",
        "--trace",
        t,
        "--device",
        "10%",
        "--advise",
        "--target",
        "0.8",
        "--fractions",
        "0.1,0.25,0.5,1",
        "--plot",
        plot.to_str().unwrap(),
    ]);
    let s = text(&o);
    assert!(o.status.success(), "{s}");
    assert!(
        s.contains("advice: --hicache-size ") && s.contains("reaches 80% of the unbounded"),
        "{s}"
    );
    assert!(std::fs::read_to_string(&plot)
        .unwrap()
        .contains("<polyline"));
    for (args, want) in [
        (vec!["--advise", "--sweep"], "give one"),
        (vec!["--advise", "--target", "1.5"], "--target 1.5"),
        (vec!["--compare", "lots"], "--compare `lots`"),
        (
            vec!["--model-preset", "gpt-9", "--advise"],
            "--model-preset `gpt-9`: unknown",
        ),
        (
            vec![
                "--model-preset",
                "smollm2-135m",
                "--bytes-per-token",
                "5",
                "--advise",
            ],
            "give one",
        ),
    ] {
        let mut a = vec!["sim", "--trace", t];
        a.extend(args);
        let o = strata(&a);
        assert!(
            !o.status.success() && text(&o).contains(want),
            "{a:?}: {}",
            text(&o)
        );
    }
}

/// `strata bench workload` refuses a URL that is none, and a run in which every request
/// failed is no success (it measured nothing).
#[test]
fn a_workload_that_measured_nothing_fails() {
    let o = strata(&["bench", "workload", "--url", "notaurl"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("--url `notaurl`: expected http://HOST:PORT"),
        "{}",
        text(&o)
    );
    // A port nothing listens on (bound, then closed: refused at once).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let o = strata(&["bench", "workload", "--url", &url]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("requests failed against"), "{}", text(&o));
}

/// The benches' flags past what a bench can use are refused by name (exit code 2), before any
/// buffer is built: they panicked on an overflow, or allocated until the kernel stopped them.
#[test]
fn bench_flags_past_their_bounds_are_refused() {
    let max = "18446744073709551615";
    for (args, want) in [
        (&["transfer", "--pages", max][..], "past the bench's"),
        (
            &["transfer", "--pages", "100000", "--page-bytes", "1000000"],
            "past the bench's",
        ),
        (&["router", "--rate", "1e30"], "--rate 1e30: expected"),
        (
            &["router-scale", "--workers", max],
            "--workers 18446744073709551615: expected 1 to 4096",
        ),
        (
            &["router-scale", "--index-interval", "0"],
            "--index-interval 0: expected",
        ),
        (
            &["l3", "--page-bytes", max],
            "--page-bytes 18446744073709551615: at most",
        ),
        (
            &["health", "--prompt-bytes", "1024TiB"],
            "--prompt-bytes 1024TiB: at most 1GiB",
        ),
        (
            &["workload", "--clients", max],
            "--clients 18446744073709551615: at most",
        ),
    ] {
        let mut all = vec!["bench"];
        all.extend_from_slice(args);
        let o = strata(&all);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        assert!(text(&o).contains(want), "{args:?}: {}", text(&o));
    }
}

/// `strata route` refuses bad flags at once, naming them (exit code 2), before it listens.
#[test]
fn route_refuses_bad_flags_with_the_reason() {
    let d = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &[u8]| {
        let p = d.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let (blank, empty) = (file("blank", b"\n  \n# a comment\n"), file("empty", b""));
    let big = file("big", &vec![b'k'; (1 << 20) + 1]);
    let fifo = d.path().join("fifo").to_str().unwrap().to_string();
    let c = std::ffi::CString::new(fifo.clone()).unwrap();
    // SAFETY: mkfifo(3) on a NUL-terminated path in this test's own directory.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for (args, want) in [
        (&["--policy", "random"][..], "--policy `random`"),
        (&["--health-interval", "0"][..], "--health-interval 0"),
        (
            &["--stream-idle-timeout", "0"][..],
            "--stream-idle-timeout 0",
        ),
        (
            &["--stream-idle-timeout", "NaN"][..],
            "--stream-idle-timeout NaN",
        ),
        // Past `Duration`'s range these panicked where they were used.
        (&["--health-interval", "1e30"][..], "--health-interval"),
        (&["--index-interval", "inf"][..], "--index-interval inf"),
        (&["--body-limit", "0B"][..], "--body-limit 0B"),
        (
            &["--decode", "http://"][..],
            "--decode `http://`: expected http://HOST:PORT",
        ),
        (
            &["--decode", "http://a b:1"][..],
            "expected http://HOST:PORT",
        ),
        (
            &["--decode", "http://127.0.0.1:9/"][..],
            "--decode `http://127.0.0.1:9/` is given twice",
        ),
        // A user or password (not echoed), a path, a query, a fragment; one worker spelled two ways.
        (
            &["--decode", "http://user:secretpw@127.0.0.1:8"][..],
            "--decode: a worker URL with a user or password",
        ),
        (
            &["--decode", "http://127.0.0.1:8/../x?y=1"][..],
            "a path, query or fragment",
        ),
        (
            &["--decode", "http://127.0.0.1:8#f"][..],
            "a path, query or fragment",
        ),
        (
            &[
                "--decode",
                "http://LOCALHOST:80",
                "--decode",
                "http://localhost",
            ][..],
            "--decode `http://localhost` is given twice",
        ),
        // Keys asked for and not given: an error, never a router left open (or shut to all).
        (
            &["--api-key", ""][..],
            "an empty key would refuse every client",
        ),
        (&["--api-key-file", &blank][..], "no key in it"),
        (&["--api-key-file", &empty][..], "no key in it"),
        (&["--api-key-file", &fifo][..], "not a regular file"),
        (&["--api-key-file", "/dev/zero"][..], "not a regular file"),
        (&["--api-key-file", &big][..], "a key file is small"),
        // The admin key: not blank, nothing at its ends a header would lose, not a client's.
        (
            &["--admin-key", " "][..],
            "--admin-key (or $STRATA_ADMIN_KEY) is empty",
        ),
        (&["--admin-key", "op\n"][..], "white space at an end"),
        (
            &["--admin-key", "sesame", "--api-key", "sesame"][..],
            "is also a client API key",
        ),
        // The index's memory: only with the index, and enough for a share of pages.
        (
            &["--cache-index-memory", "1GiB"][..],
            "--cache-index-memory sizes the index of --policy cache_aware",
        ),
        (
            &[
                "--policy",
                "cache_aware",
                "--model",
                "/nonexistent.gguf",
                "--cache-index-memory",
                "64KiB",
            ][..],
            "--cache-index-memory 64KiB (65536 bytes): too small for 1 worker(s)",
        ),
        (
            &[
                "--policy",
                "cache_aware",
                "--model",
                "/nonexistent.gguf",
                "--cache-index-memory",
                "-1GB",
            ][..],
            "--cache-index-memory: size `-1GB` is negative",
        ),
    ] {
        let mut all = vec!["route", "--port", "0", "--decode", "http://127.0.0.1:9"];
        all.extend_from_slice(args);
        let o = strata(&all);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        assert!(text(&o).contains(want), "{args:?}: {}", text(&o));
        assert!(
            !text(&o).contains("secretpw"),
            "a password echoed: {}",
            text(&o)
        );
    }
}

/// `strata sim` with DeepSeek-V4-Pro (window kinds) on a multi-turn trace: the window residency
/// side by side at the incident's bytes per rank. The default caches 40 times the tokens of
/// every page keeping its window state, serves far more hit tokens than it at the same bytes,
/// and at least 99 % of those of every page keeping it with the default's main tokens (40× the
/// bytes).
#[test]
fn sim_puts_the_window_residency_side_by_side_for_deepseek_v4() {
    let d = tempfile::tempdir().unwrap();
    let t = strata_test_support::write_multi_turn_trace(d.path(), 24, 12, 64);
    let o = strata(&[
        "sim",
        "--trace",
        t.to_str().unwrap(),
        "--model-preset",
        "deepseek-v4-pro",
        "--tp-size",
        "4",
        "--device",
        "2GiB",
        "--host",
        "37.5GB",
        "--eviction",
        "lru",
    ]);
    let s = text(&o);
    assert!(o.status.success(), "{s}");
    let row = |name: &str| -> Vec<String> {
        let l = s
            .lines()
            .find(|l| l.starts_with("lru") && l.contains(name))
            .unwrap_or_else(|| panic!("no `{name}` row in:\n{s}"));
        l.split("  ")
            .filter(|x| !x.trim().is_empty())
            .map(|x| x.trim().to_string())
            .collect()
    };
    let host_tokens = |r: &[String]| r[2].parse::<u64>().unwrap();
    let (every, default) = (row("every page   "), row("default"));
    assert!(host_tokens(&default) > 30 * host_tokens(&every), "{s}");
    let share = s
        .lines()
        .find_map(|l| l.trim().strip_prefix("default: "))
        .unwrap_or_else(|| panic!("no summary in:\n{s}"));
    let pct: f64 = share.split('%').next().unwrap().parse().unwrap();
    assert!(pct >= 99.0, "{share}");
    let times: f64 = share
        .split(", ")
        .nth(1)
        .and_then(|x| x.split('×').next())
        .unwrap()
        .parse()
        .unwrap();
    assert!(times >= 2.0, "{share}");
    // Flags it does not model are refused, not ignored.
    let o = strata(&[
        "sim",
        "--trace",
        t.to_str().unwrap(),
        "--model-preset",
        "deepseek-v4-pro",
        "--device",
        "2GiB",
        "--host",
        "10%",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("sized in bytes per rank"), "{}", text(&o));
    assert!(
        !text(&o).contains("trace loaded"),
        "refused before any work"
    );
}

#[test]
fn model_tiny_writes_the_test_models_and_keeps_an_existing_file() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("tiny-dsv4.gguf");
    let o = strata(&["model", "tiny", "deepseek4", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    // The same seeded bytes the tests' generator writes.
    let want = d.path().join("want.gguf");
    strata_model::tiny::deepseek4::write_tiny_dsv4(&want, &Default::default()).unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&want).unwrap());
    // It loads as DeepSeek-V4.
    strata_model::deepseek4::load::load_dsv4(&out).unwrap();
    // An existing file is kept unless --force.
    std::fs::write(&out, b"mine").unwrap();
    let o = strata(&["model", "tiny", "llama3", out.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(text(&o).contains("exists: give --force"), "{}", text(&o));
    assert_eq!(std::fs::read(&out).unwrap(), b"mine");
    let o = strata(&["model", "tiny", "llama3", out.to_str().unwrap(), "--force"]);
    assert!(o.status.success(), "{}", text(&o));
    let g = strata_model::Gguf::open(&out).unwrap();
    assert_eq!(g.config.arch.name(), "llama");
    let o = strata(&["model", "tiny", "gpt5", out.to_str().unwrap()]);
    assert!(text(&o).contains("possible values"), "{}", text(&o));
}

/// `strata sim` sizes byte capacities with the K/V dtype asked for, as `strata plan` does.
#[test]
fn sim_sizes_by_the_kv_dtype() {
    let d = tempfile::tempdir().unwrap();
    let t = write_trace(d.path());
    let t = t.to_str().unwrap();
    let args = ["sim", "--trace", t, "--model-preset", "smollm2-135m"];
    let o = strata(&[&args[..], &["--device", "1MiB"]].concat());
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("at 23040 B/token"), "{}", text(&o));
    let o = strata(&[&args[..], &["--device", "1MiB", "--kv-cache-dtype", "q8_0"]].concat());
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("at 12240 B/token"), "{}", text(&o));
    // Without a model there are no K/V pools to size: refused, not ignored.
    let o = strata(&["sim", "--trace", t, "--kv-cache-dtype", "q8_0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).contains("need --model or --model-preset"),
        "{}",
        text(&o)
    );
}
