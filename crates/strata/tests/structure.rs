//! The design's written-down invariants (docs/ARCHITECTURE.md), checked on the source tree:
//! files short enough to read in one sitting, functions that need no scrolling, no import
//! cycle between the modules of one crate, the engine naming no tree node, wire types in one
//! crate.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_FILE_LINES: usize = 700;
const MAX_FN_LINES: usize = 80;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "target") {
                rust_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn crates() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("Cargo.toml").exists())
        .collect();
    v.sort();
    v
}

fn all_sources() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for c in crates() {
        rust_files(&c, &mut files);
    }
    files.sort();
    files
}

/// Source files that hold only tests (their functions are not held to the length limit).
fn is_test_file(p: &Path) -> bool {
    let s = p.to_string_lossy();
    s.contains("/tests/") || s.contains("/benches/") || s.ends_with("tests.rs")
}

/// Strips string and char literals and comments from one line, so braces inside them do not
/// count (good enough for this code base: no raw strings spanning braces on one line).
fn code_of(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars().peekable();
    let mut in_str = false;
    while let Some(c) = chars.next() {
        if in_str {
            if c == '\\' {
                chars.next();
            } else if c == '"' {
                in_str = false;
            }
            continue;
        }
        match c {
            '"' => in_str = true,
            '/' if chars.peek() == Some(&'/') => break,
            '\'' => {
                // A char literal ('{', '\n') or a lifetime ('a): skip a literal's body.
                let rest: String = chars.clone().take(3).collect();
                if rest.starts_with('\\') {
                    chars.next();
                    chars.next();
                    chars.next();
                } else if rest.chars().nth(1) == Some('\'') {
                    chars.next();
                    chars.next();
                }
            }
            _ => out.push(c),
        }
    }
    out
}

/// (name, first line, lines) of every function outside `#[cfg(test)]` items.
fn long_functions(text: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let t = lines[i].trim_start();
        if t.starts_with("#[cfg(test)]") {
            break; // test modules close the file in this code base
        }
        let is_fn = [
            "fn ",
            "pub fn ",
            "pub(crate) fn ",
            "pub(super) fn ",
            "async fn ",
        ]
        .iter()
        .any(|p| t.starts_with(p))
            || t.starts_with("pub async fn ")
            || t.starts_with("pub(crate) async fn ");
        if !is_fn {
            i += 1;
            continue;
        }
        let name = t
            .split("fn ")
            .nth(1)
            .unwrap_or("")
            .split(['(', '<'])
            .next()
            .unwrap_or("");
        let mut depth = 0i64;
        let mut opened = false;
        let mut j = i;
        while j < lines.len() {
            let c = code_of(lines[j]);
            if !opened && c.contains(';') && !c.contains('{') {
                break; // a declaration without a body
            }
            for ch in c.chars() {
                match ch {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if opened && depth == 0 {
                break;
            }
            j += 1;
        }
        let n = j + 1 - i;
        if opened && n > MAX_FN_LINES {
            out.push((name.to_string(), i + 1, n));
        }
        i = if opened { j + 1 } else { i + 1 };
    }
    out
}

#[test]
fn no_file_over_the_limit() {
    let mut bad = Vec::new();
    for f in all_sources() {
        let n = std::fs::read_to_string(&f).unwrap().lines().count();
        if n > MAX_FILE_LINES {
            bad.push(format!("{} ({n} lines)", f.display()));
        }
    }
    assert!(
        bad.is_empty(),
        "files over {MAX_FILE_LINES} lines:\n{}",
        bad.join("\n")
    );
}

#[test]
fn no_function_over_the_limit() {
    let mut bad = Vec::new();
    for f in all_sources().into_iter().filter(|f| !is_test_file(f)) {
        let text = std::fs::read_to_string(&f).unwrap();
        for (name, line, n) in long_functions(&text) {
            bad.push(format!("{}:{line} fn {name} ({n} lines)", f.display()));
        }
    }
    assert!(
        bad.is_empty(),
        "functions over {MAX_FN_LINES} lines:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_length_check_finds_long_functions() {
    let body = "    let x = 1;\n".repeat(MAX_FN_LINES);
    let text = format!("pub fn long(a: u32) -> u32 {{\n{body}    x\n}}\nfn short() {{}}\n");
    assert_eq!(
        long_functions(&text),
        vec![("long".into(), 1, MAX_FN_LINES + 3)]
    );
    let braces = "fn s() {\n    let c = '{';\n    let s = \"}}}\";\n}\n";
    assert!(long_functions(braces).is_empty());
}

/// The top-level module a source file belongs to (`a.rs`, `a/mod.rs`, `a/b.rs` → `a`);
/// None for the crate root.
fn module_of(src: &Path, f: &Path) -> Option<String> {
    let rel = f.strip_prefix(src).ok()?;
    let first = rel
        .components()
        .next()?
        .as_os_str()
        .to_string_lossy()
        .to_string();
    let m = first.trim_end_matches(".rs").to_string();
    (!["lib", "main"].contains(&m.as_str())).then_some(m)
}

/// Edges between the top-level modules of one crate: `crate::b` named in module `a`.
fn module_edges(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeSet<String> = files.iter().filter_map(|f| module_of(src, f)).collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files.iter().filter(|f| !is_test_file(f)) {
        let Some(from) = module_of(src, f) else {
            continue;
        };
        let text = std::fs::read_to_string(f).unwrap();
        let text = text.split("#[cfg(test)]").next().unwrap_or("");
        for line in text.lines() {
            let c = code_of(line);
            let mut rest = c.as_str();
            while let Some(at) = rest.find("crate::") {
                rest = &rest[at + 7..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if name != from && modules.contains(&name) {
                    edges.entry(from.clone()).or_default().insert(name);
                }
            }
        }
    }
    edges
}

fn find_cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = stack.iter().position(|s| s == n) {
            let mut c = stack[at..].to_vec();
            c.push(n.to_string());
            return Some(c);
        }
        if done.contains(n) {
            return None;
        }
        stack.push(n.to_string());
        for m in edges.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, edges, stack, done) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for n in edges.keys() {
        if let Some(c) = visit(n, edges, &mut Vec::new(), &mut done) {
            return Some(c);
        }
    }
    None
}

#[test]
fn no_import_cycle_between_modules_of_a_crate() {
    let mut bad = Vec::new();
    for c in crates() {
        let edges = module_edges(&c.join("src"));
        if let Some(cycle) = find_cycle(&edges) {
            bad.push(format!("{}: {}", c.display(), cycle.join(" → ")));
        }
    }
    assert!(bad.is_empty(), "module import cycles:\n{}", bad.join("\n"));
}

#[test]
fn the_cycle_check_finds_cycles() {
    let mut e: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    e.entry("a".into()).or_default().insert("b".into());
    e.entry("b".into()).or_default().insert("c".into());
    assert_eq!(find_cycle(&e), None);
    e.entry("c".into()).or_default().insert("a".into());
    assert_eq!(find_cycle(&e).unwrap().len(), 4);
}

#[test]
fn the_engine_names_no_tree_node() {
    let mut files = Vec::new();
    rust_files(&root().join("crates/strata-engine/src"), &mut files);
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for bad in ["strata_kv::tree", "NodeId", ".tree()"] {
            assert!(!text.contains(bad), "{} names `{bad}`", f.display());
        }
    }
}

/// Every crate root opens with a true module map: each module it declares (tests aside) is
/// named in its `//!` header.
#[test]
fn every_crate_root_names_its_modules() {
    let mut missing = Vec::new();
    for c in crates() {
        for root in ["src/lib.rs", "src/main.rs"] {
            let Ok(text) = std::fs::read_to_string(c.join(root)) else {
                continue;
            };
            let header: String = text
                .lines()
                .filter(|l| l.starts_with("//!"))
                .collect::<Vec<_>>()
                .join("\n");
            let lines: Vec<&str> = text.lines().collect();
            for (i, l) in lines.iter().enumerate() {
                let decl = l
                    .trim_start_matches("pub(crate) ")
                    .trim_start_matches("pub ")
                    .strip_prefix("mod ")
                    .and_then(|r| r.strip_suffix(';'));
                let Some(name) = decl else { continue };
                if i > 0 && lines[i - 1].contains("cfg(test)") {
                    continue;
                }
                let named = header.match_indices(&format!("`{name}")).any(|(at, _)| {
                    let next = header[at + 1 + name.len()..].chars().next();
                    !next.is_some_and(|c| c.is_alphanumeric() || c == '_')
                });
                if !named {
                    missing.push(format!("{}: `{name}`", c.join(root).display()));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "modules missing from their crate's map:\n{}",
        missing.join("\n")
    );
}
