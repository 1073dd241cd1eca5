//! Every external program that the code or the tests start is named in the `PROGRAMS` list of
//! `scripts/test.sh`, which installs what a fresh machine lacks. A new `Command::new` of a
//! program (or a program looked up with `command -v`) without a line there fails here, so a
//! green run on a machine where the program was installed by hand cannot hide the missing
//! install step.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "target") {
                rust_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// String literals that follow `needle` directly, e.g. `Command::new("redis-server")`.
fn literals_after(src: &str, needle: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = src;
    while let Some(i) = rest.find(needle) {
        rest = &rest[i + needle.len()..];
        if let Some(lit) = rest.strip_prefix('"') {
            if let Some(end) = lit.find('"') {
                out.push(lit[..end].to_string());
            }
        }
    }
    out
}

/// Programs started from Rust (`Command::new` with a literal name), plus the arrays of candidate names that a
/// test probes with `command -v` (`["chromium", "chromium-browser", ...]`: the first must be
/// installable).
fn started_programs() -> BTreeSet<String> {
    let mut files = Vec::new();
    rust_files(&repo().join("crates"), &mut files);
    let mut progs = BTreeSet::new();
    for f in files {
        // This file names programs in its own documentation and tests.
        if f.ends_with("tests/programs.rs") {
            continue;
        }
        let src = fs::read_to_string(&f).unwrap();
        for p in literals_after(&src, "Command::new(") {
            progs.insert(p);
        }
        for p in literals_after(&src, "need(") {
            progs.insert(p);
        }
        for line in src.lines() {
            // An array of candidate names probed with `command -v`: the first must install.
            if line.contains("\"chromium-browser\"") {
                progs.extend(literals_after(line, "[").into_iter().take(1));
            }
        }
        // `python3 -m pip` is how the model is fetched.
        if src.contains("Command::new(\"python3\")") && src.contains("\"pip\"") {
            progs.insert("pip".into());
        }
    }
    progs
}

/// The programs of the `PROGRAMS="..."` block of scripts/test.sh (`program package` lines).
fn listed_programs() -> BTreeSet<String> {
    let script = fs::read_to_string(repo().join("scripts/test.sh")).unwrap();
    let start = script
        .find("PROGRAMS=\"")
        .expect("a PROGRAMS list in scripts/test.sh")
        + 10;
    let len = script[start..].find('"').expect("the end of PROGRAMS");
    script[start..start + len]
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let mut it = l.split_whitespace();
            let prog = it.next().unwrap().to_string();
            assert!(
                it.next().is_some(),
                "scripts/test.sh PROGRAMS: `{l}` names no Debian package"
            );
            prog
        })
        .collect()
}

#[test]
fn every_started_program_is_installed_by_the_test_script() {
    let started = started_programs();
    // The scan itself must see the programs known to be started, or it proves nothing.
    for known in [
        "redis-server",
        "redis-cli",
        "prometheus",
        "promtool",
        "chromium",
        "python3",
        "pip",
    ] {
        assert!(
            started.contains(known),
            "the scan missed {known}: {started:?}"
        );
    }
    let listed = listed_programs();
    let missing: Vec<_> = started.difference(&listed).collect();
    assert!(
        missing.is_empty(),
        "programs started by the code or tests but not in the PROGRAMS list of scripts/test.sh \
         (so it would not install them on a fresh machine): {missing:?}"
    );
    let script = fs::read_to_string(repo().join("scripts/test.sh")).unwrap();
    assert!(
        script.contains("<<< \"$PROGRAMS\"") && script.contains("apt-get install"),
        "scripts/test.sh must install the packages of its PROGRAMS list"
    );
}

#[test]
fn the_scan_finds_command_literals() {
    let src = "let a = Command::new(\"foo\"); Command::new(exe); need(\"bar\")";
    assert_eq!(literals_after(src, "Command::new("), vec!["foo"]);
    assert_eq!(literals_after(src, "need("), vec!["bar"]);
}
