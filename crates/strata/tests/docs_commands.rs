//! The docs run as written: every command block in README.md and docs/*.md runs here, or says
//! why it cannot (` ```sh example: REASON `, or a file-wide
//! `<!-- docs-commands example: REASON -->` for a page of benchmark recipes).
//!
//! - Every fenced block names its language; an unnamed one is refused (a command could hide in
//!   it).
//! - `sh` / `bash` / `shell` blocks run as one `bash -euo pipefail` script and must exit 0.
//! - `console` blocks are `$ command` lines (continued with `\`) each followed by the output
//!   shown: each command must exit 0, unless the next is `$ echo $?` whose shown line is the
//!   exit code expected. Shown output must match the command's (stdout and stderr together)
//!   line by line, where a line `...` stands for any number of lines and `...` inside a line
//!   for any text; a command shown without output is not checked for it. Log lines at info
//!   level (timestamped, on stderr) are not part of what is compared; warnings are.
//!
//! Commands run in a scratch directory laid out like the checkout (`./target/release/strata`
//! and `strata` on PATH are the binary under test; `deploy/`, `scripts/` and `../shared` are the
//! checkout's), so files the docs write (plots, tiny models) land in the scratch directory.

use std::path::{Path, PathBuf};
use std::process::Command;

const COMMAND_LANGS: &[&str] = &["sh", "bash", "shell", "console"];

struct Block {
    file: String,
    line: usize,
    lang: String,
    example: Option<String>,
    body: Vec<String>,
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn doc_files() -> Vec<PathBuf> {
    let root = repo();
    let mut out = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    out.extend(docs);
    out
}

/// The fenced blocks of one Markdown file, and its file-wide example reason if any.
fn blocks(path: &Path) -> (Vec<Block>, Option<String>) {
    let text = std::fs::read_to_string(path).unwrap();
    let name = path
        .strip_prefix(repo())
        .unwrap_or(path)
        .display()
        .to_string();
    let file_example = text.lines().find_map(|l| {
        l.trim()
            .strip_prefix("<!-- docs-commands example:")
            .and_then(|r| r.strip_suffix("-->"))
            .map(|r| r.trim().to_string())
    });
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let t = lines[i].trim_start();
        let indent = lines[i].len() - t.len();
        if let Some(info) = t.strip_prefix("```") {
            let start = i;
            let info = info.trim();
            let (lang, rest) = info.split_once(char::is_whitespace).unwrap_or((info, ""));
            let example = rest
                .trim()
                .strip_prefix("example:")
                .map(|r| r.trim().to_string());
            let mut body = Vec::new();
            i += 1;
            while i < lines.len() && !lines[i].trim_start().starts_with("```") {
                let l = lines[i];
                body.push(
                    l.get(indent.min(l.len() - l.trim_start().len())..)
                        .unwrap_or(l)
                        .to_string(),
                );
                i += 1;
            }
            out.push(Block {
                file: name.clone(),
                line: start + 1,
                lang: lang.to_string(),
                example,
                body,
            });
        }
        i += 1;
    }
    (out, file_example)
}

/// A scratch directory laid out like the checkout, and a PATH whose `strata` is the binary
/// under test.
struct Scratch {
    _dir: tempfile::TempDir,
    cwd: PathBuf,
    path_env: String,
}

fn scratch() -> Scratch {
    let dir = tempfile::tempdir().unwrap();
    let root = repo().canonicalize().unwrap();
    let cwd = dir.path().join("checkout");
    let bin = dir.path().join("bin");
    std::fs::create_dir_all(cwd.join("target/release")).unwrap();
    std::fs::create_dir_all(&bin).unwrap();
    let exe = Path::new(env!("CARGO_BIN_EXE_strata"));
    std::os::unix::fs::symlink(exe, cwd.join("target/release/strata")).unwrap();
    std::os::unix::fs::symlink(exe, bin.join("strata")).unwrap();
    for d in ["deploy", "scripts", "crates", "Cargo.toml"] {
        std::os::unix::fs::symlink(root.join(d), cwd.join(d)).unwrap();
    }
    if let Ok(shared) = root.join("../shared").canonicalize() {
        std::os::unix::fs::symlink(shared, dir.path().join("shared")).unwrap();
    }
    let path_env = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Scratch {
        _dir: dir,
        cwd,
        path_env,
    }
}

fn bash(s: &Scratch, script: &str, strict: bool) -> (i32, String) {
    let mut c = Command::new("bash");
    if strict {
        c.args(["-euo", "pipefail"]);
    } else {
        c.args(["-o", "pipefail"]);
    }
    let out = c
        .arg("-c")
        .arg(format!("exec 2>&1\n{script}"))
        .current_dir(&s.cwd)
        .env("PATH", &s.path_env)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    (out.status.code().unwrap_or(-1), text)
}

/// One command of a console block and the output shown after it.
struct Shown {
    cmd: String,
    output: Vec<String>,
}

fn console_commands(body: &[String]) -> Vec<Shown> {
    let mut out: Vec<Shown> = Vec::new();
    let mut it = body.iter().peekable();
    while let Some(l) = it.next() {
        if let Some(c) = l.strip_prefix("$ ") {
            let mut cmd = c.to_string();
            while cmd.ends_with('\\') {
                match it.next() {
                    Some(n) => {
                        cmd.pop();
                        cmd.push_str(n.trim_start());
                    }
                    None => break,
                }
            }
            out.push(Shown {
                cmd,
                output: Vec::new(),
            });
        } else if let Some(last) = out.last_mut() {
            last.output.push(l.clone());
        } else {
            panic!("console output before any `$ ` command: {l}");
        }
    }
    // A blank line before the next command separates; it is not output.
    for s in &mut out {
        while s.output.last().is_some_and(|l| l.trim().is_empty()) {
            s.output.pop();
        }
    }
    out
}

/// `line` matches `pattern`, where `...` in the pattern stands for any text.
fn line_matches(pattern: &str, line: &str) -> bool {
    let parts: Vec<&str> = pattern.trim_end().split("...").collect();
    let line = line.trim_end();
    if parts.len() == 1 {
        return parts[0] == line;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !line.starts_with(first) || line.len() < first.len() + last.len() || !line.ends_with(last) {
        return false;
    }
    let mut rest = &line[first.len()..line.len() - last.len()];
    for p in &parts[1..parts.len() - 1] {
        match rest.find(p) {
            Some(i) => rest = &rest[i + p.len()..],
            None => return false,
        }
    }
    true
}

/// The output matches the shown lines, a `...` line standing for any number of lines.
fn output_matches(shown: &[String], actual: &[&str]) -> bool {
    match shown.split_first() {
        None => actual.is_empty(),
        Some((p, rest)) if p.trim() == "..." => {
            (0..=actual.len()).any(|k| output_matches(rest, &actual[k..]))
        }
        Some((p, rest)) => {
            !actual.is_empty() && line_matches(p, actual[0]) && output_matches(rest, &actual[1..])
        }
    }
}

/// A log line at info level or below (`2026-12-04T15:00:24.663300Z  INFO target: ...`): what
/// the docs show is the command's output, not its progress log; warnings are compared.
fn is_info_log(l: &str) -> bool {
    let b = l.as_bytes();
    let stamped = b.len() > 28 && b[4] == b'-' && b[7] == b'-' && b[10] == b'T';
    stamped
        && l.split_whitespace()
            .nth(1)
            .is_some_and(|lvl| matches!(lvl, "INFO" | "DEBUG" | "TRACE"))
}

/// Which shown lines the output lacks, and (where the docs skip nothing) which output lines
/// the docs lack.
fn difference(shown: &[String], actual: &[&str]) -> String {
    let mut d = String::new();
    for p in shown.iter().filter(|p| p.trim() != "...") {
        if !actual.iter().any(|a| line_matches(p, a)) {
            d += &format!("shown, not in the output: {p}\n");
        }
    }
    if !shown.iter().any(|p| p.trim() == "...") {
        for a in actual {
            if !shown.iter().any(|p| line_matches(p, a)) {
                d += &format!("in the output, not shown: {a}\n");
            }
        }
    }
    d
}

/// Runs one block; the reason it failed, if it did.
fn run_block(s: &Scratch, b: &Block) -> Result<(), String> {
    if b.lang != "console" {
        let (code, out) = bash(s, &b.body.join("\n"), true);
        if code != 0 {
            return Err(format!("exit code {code}; output:\n{out}"));
        }
        return Ok(());
    }
    let cmds = console_commands(&b.body);
    let mut i = 0;
    while i < cmds.len() {
        let c = &cmds[i];
        let (code, out) = bash(s, &c.cmd, false);
        let want = match cmds.get(i + 1) {
            Some(n) if n.cmd.trim() == "echo $?" => {
                i += 1;
                let shown = n.output.first().map(|l| l.trim()).unwrap_or("");
                shown
                    .parse::<i32>()
                    .map_err(|_| format!("`$ echo $?` shows `{shown}`, not an exit code"))?
            }
            _ => 0,
        };
        if code != want {
            return Err(format!(
                "`{}`: exit code {code}, the docs show {want}; output:\n{out}",
                c.cmd
            ));
        }
        let actual: Vec<&str> = out.lines().filter(|l| !is_info_log(l)).collect();
        if !c.output.is_empty() && !output_matches(&c.output, &actual) {
            return Err(format!(
                "`{}`: the output differs from the docs'.\n{}--- actual\n{}",
                c.cmd,
                difference(&c.output, &actual),
                out
            ));
        }
        i += 1;
    }
    Ok(())
}

#[test]
fn every_command_block_in_the_docs_runs_as_written_or_says_why_not() {
    let mut failures = Vec::new();
    let mut runnable = Vec::new();
    let mut examples = 0;
    for f in doc_files() {
        let (bs, file_example) = blocks(&f);
        for b in bs {
            let at = format!("{}:{}", b.file, b.line);
            if b.lang.is_empty() {
                failures.push(format!(
                    "{at}: a code block without a language: name it (sh, console, text, ...)"
                ));
                continue;
            }
            if !COMMAND_LANGS.contains(&b.lang.as_str()) {
                continue;
            }
            match (&b.example, &file_example) {
                (Some(why), _) | (None, Some(why)) if !why.is_empty() => examples += 1,
                (Some(_), _) => failures.push(format!("{at}: `example:` needs a reason")),
                _ => runnable.push(b),
            }
        }
    }
    eprintln!(
        "{} command blocks run, {examples} are examples",
        runnable.len()
    );
    assert!(
        runnable.len() >= 5,
        "only {} command blocks run",
        runnable.len()
    );
    // Each block in a scratch directory of its own, as many at once as there are CPUs.
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failed = std::sync::Mutex::new(Vec::new());
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|sc| {
        for _ in 0..cpus.min(runnable.len()) {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(b) = runnable.get(i) else { break };
                let t = std::time::Instant::now();
                let r = run_block(&scratch(), b);
                eprintln!(
                    "{}:{}: {:.1} s, {}",
                    b.file,
                    b.line,
                    t.elapsed().as_secs_f64(),
                    if r.is_ok() { "as written" } else { "FAILED" }
                );
                if let Err(why) = r {
                    failed
                        .lock()
                        .unwrap()
                        .push(format!("{}:{}: {why}", b.file, b.line));
                }
            });
        }
    });
    failures.extend(failed.into_inner().unwrap());
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn output_patterns_match_as_documented() {
    let l = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert!(output_matches(
        &l(&["a", "...", "d"]),
        &["a", "b", "c", "d"]
    ));
    assert!(output_matches(&l(&["a", "...", "d"]), &["a", "d"]));
    assert!(!output_matches(&l(&["a", "d"]), &["a", "b", "d"]));
    assert!(!output_matches(
        &l(&["a", "...", "d"]),
        &["a", "b", "d", "e"]
    ));
    assert!(output_matches(&l(&["x ... y (...)"]), &["x 1 2 y (3)"]));
    assert!(!output_matches(&l(&["x ... y"]), &["x 1 2 z"]));
    assert!(!output_matches(&l(&["ab...ba"]), &["aba"]));
}
