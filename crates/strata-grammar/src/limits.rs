//! Size caps checked before anything is compiled: a constraint large enough to take seconds
//! of CPU (or llguidance's own limits) is refused with the limit it broke, in the time it
//! takes to count.

use regex_syntax::hir::{Hir, HirKind};

use crate::{GrammarError, OutputConstraint};

/// Most texts in a choice (`guided_choice`).
pub const MAX_CHOICES: usize = 1024;
/// Most bytes of all texts of a choice together.
pub const MAX_CHOICE_BYTES: usize = 64 << 10;
/// Most bytes of a regex, a Lark grammar or a JSON schema.
pub const MAX_SPEC_BYTES: usize = 256 << 10;
/// Largest count of a repetition (`a{n}`, `a{m,n}`), in a regex or a grammar.
pub const MAX_REPEAT: u32 = 1000;
/// Most positions a regex may expand to (nested repetitions multiply).
pub const MAX_REGEX_EXPANSION: u64 = 100_000;
/// Most alternatives (`|`) in a Lark grammar.
pub const MAX_ALTERNATIVES: usize = 4096;
/// Deepest a JSON schema may nest, counting each local `$ref` followed as a level (a chain of
/// thousands of definitions overflowed the compiler's stack and killed the process).
pub const MAX_SCHEMA_DEPTH: usize = 100;

fn too_large(m: String) -> GrammarError {
    GrammarError::Invalid(m)
}

/// Refuses a constraint beyond the caps, naming the cap.
pub fn check(c: &OutputConstraint) -> Result<(), GrammarError> {
    match c {
        OutputConstraint::JsonObject => Ok(()),
        OutputConstraint::JsonSchema(s) => {
            spec_bytes("the JSON schema", s)?;
            match serde_json::from_str::<serde_json::Value>(s) {
                Ok(v) => schema(&v),
                Err(_) => Ok(()), // refused with the parser's reason when compiled
            }
        }
        OutputConstraint::Regex(rx) => {
            spec_bytes("the regex", rx)?;
            regex("the regex", rx)
        }
        OutputConstraint::Lark(g) => {
            spec_bytes("the grammar", g)?;
            lark_repeats(g)?;
            lark_schemas(g)?;
            let alts = g.bytes().filter(|&b| b == b'|').count();
            if alts > MAX_ALTERNATIVES {
                return Err(too_large(format!(
                    "the grammar has {alts} alternatives (`|`); at most {MAX_ALTERNATIVES}"
                )));
            }
            Ok(())
        }
        OutputConstraint::Choice(v) => {
            if v.len() > MAX_CHOICES {
                return Err(too_large(format!(
                    "{} choices; at most {MAX_CHOICES}",
                    v.len()
                )));
            }
            let bytes: usize = v.iter().map(String::len).sum();
            if bytes > MAX_CHOICE_BYTES {
                return Err(too_large(format!(
                    "the choices have {bytes} bytes; at most {MAX_CHOICE_BYTES}"
                )));
            }
            Ok(())
        }
    }
}

fn spec_bytes(what: &str, s: &str) -> Result<(), GrammarError> {
    if s.len() > MAX_SPEC_BYTES {
        return Err(too_large(format!(
            "{what} has {} bytes; at most {MAX_SPEC_BYTES}",
            s.len()
        )));
    }
    Ok(())
}

/// A JSON schema's regexes (`pattern` values, `patternProperties` keys) and depth.
pub fn schema(v: &serde_json::Value) -> Result<(), GrammarError> {
    schema_patterns(v)?;
    Depth::new(v).walk(v, 0).map(|_| ())
}

/// The JSON schemas a Lark grammar embeds (`%json {…}`, as forced tool calls do) checked as
/// schemas.
fn lark_schemas(g: &str) -> Result<(), GrammarError> {
    let mut rest = g;
    while let Some(i) = rest.find("%json") {
        rest = &rest[i + "%json".len()..];
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<serde_json::Value>();
        if let Some(Ok(v)) = values.next() {
            schema(&v)?;
        }
    }
    Ok(())
}

/// How deep a JSON schema nests, following its local `$ref`s (a reference back to a schema
/// being walked is recursion, which the compiler takes lazily: no deeper). Each target's depth
/// is counted once. Its own recursion stops at [`MAX_SCHEMA_DEPTH`].
struct Depth<'a> {
    root: &'a serde_json::Value,
    below: std::collections::HashMap<&'a str, usize>,
    open: std::collections::HashSet<&'a str>,
}

impl<'a> Depth<'a> {
    fn new(root: &'a serde_json::Value) -> Depth<'a> {
        Depth {
            root,
            below: Default::default(),
            open: Default::default(),
        }
    }

    /// The deepest level under `v` (at level `d`).
    fn walk(&mut self, v: &'a serde_json::Value, d: usize) -> Result<usize, GrammarError> {
        use serde_json::Value;
        if d > MAX_SCHEMA_DEPTH {
            return Err(too_large(format!(
                "the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels (each `$ref` followed \
                 counts as one)"
            )));
        }
        let mut deepest = d;
        match v {
            Value::Object(m) => {
                if let Some(Value::String(r)) = m.get("$ref") {
                    deepest = deepest.max(self.reference(r, d)?);
                }
                for (k, x) in m {
                    if k != "$ref" {
                        deepest = deepest.max(self.walk(x, d + 1)?);
                    }
                }
            }
            Value::Array(a) => {
                for x in a {
                    deepest = deepest.max(self.walk(x, d + 1)?);
                }
            }
            _ => {}
        }
        Ok(deepest)
    }

    /// The deepest level reached through a local reference at level `d`.
    fn reference(&mut self, r: &'a str, d: usize) -> Result<usize, GrammarError> {
        let Some(ptr) = r.strip_prefix('#') else {
            return Ok(d);
        };
        if self.open.contains(r) {
            return Ok(d);
        }
        if let Some(&b) = self.below.get(r) {
            return Ok(d + b);
        }
        let Some(target) = self.root.pointer(ptr) else {
            return Ok(d); // refused with the compiler's reason
        };
        self.open.insert(r);
        let deepest = self.walk(target, d + 1)?;
        self.open.remove(r);
        self.below.insert(r, deepest - d);
        Ok(deepest)
    }
}

/// Every regex of a JSON schema checked as a regex (serde_json bounds the nesting at 128).
fn schema_patterns(v: &serde_json::Value) -> Result<(), GrammarError> {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("pattern", serde_json::Value::String(rx)) => {
                        regex("the schema's pattern", rx)?
                    }
                    ("patternProperties", serde_json::Value::Object(p)) => {
                        for rx in p.keys() {
                            regex("the schema's patternProperties", rx)?;
                        }
                    }
                    _ => {}
                }
                schema_patterns(x)?;
            }
            Ok(())
        }
        serde_json::Value::Array(a) => a.iter().try_for_each(schema_patterns),
        _ => Ok(()),
    }
}

/// In a Lark grammar (its strings and regexes included: conservative), every `{n}`,
/// `{m,}`, `{m,n}` (spaces allowed) and `~ n`, `~ m..n` has counts ≤ [`MAX_REPEAT`].
/// Code-point escapes (`\x{…}`, `\u{…}`) are not counts.
fn lark_repeats(s: &str) -> Result<(), GrammarError> {
    let b = s.as_bytes();
    let digits = |mut j: usize| {
        while j < b.len() && b[j] == b' ' {
            j += 1;
        }
        let start = j;
        while j < b.len() && b[j].is_ascii_digit() {
            j += 1;
        }
        (start, j)
    };
    let refuse = |c: &str| {
        Err(too_large(format!(
            "the grammar repeats {c} times; at most {MAX_REPEAT}"
        )))
    };
    let big = |c: &str| c.parse::<u64>().map_or(true, |n| n > MAX_REPEAT as u64);
    let mut i = 0;
    while i < b.len() {
        let escaped = i >= 2 && matches!(b[i - 1], b'x' | b'u' | b'U') && b[i - 2] == b'\\';
        if b[i] == b'{' && !escaped {
            let (s1, e1) = digits(i + 1);
            let mut counts = vec![&s[s1..e1]];
            let mut j = e1;
            while j < b.len() && b[j] == b' ' {
                j += 1;
            }
            if j < b.len() && b[j] == b',' {
                let (s2, e2) = digits(j + 1);
                counts.push(&s[s2..e2]);
                j = e2;
                while j < b.len() && b[j] == b' ' {
                    j += 1;
                }
            }
            if j < b.len() && b[j] == b'}' && e1 > s1 {
                if let Some(c) = counts.iter().find(|c| !c.is_empty() && big(c)) {
                    return refuse(&format!("{{{c}}}"));
                }
            }
        } else if b[i] == b'~' {
            let (s1, e1) = digits(i + 1);
            if e1 > s1 && big(&s[s1..e1]) {
                return refuse(&format!("~ {}", &s[s1..e1]));
            }
            if s.get(e1..e1 + 2) == Some("..") {
                let (s2, e2) = digits(e1 + 2);
                if e2 > s2 && big(&s[s2..e2]) {
                    return refuse(&format!("~ ..{}", &s[s2..e2]));
                }
            }
        }
        i += 1;
    }
    Ok(())
}

/// A regex parses, its repetition counts are ≤ [`MAX_REPEAT`], and the positions it expands
/// to (each repetition's larger bound, or its lower one when unbounded, times what it
/// repeats) stay within [`MAX_REGEX_EXPANSION`].
fn regex(what: &str, rx: &str) -> Result<(), GrammarError> {
    let hir = regex_syntax::ParserBuilder::new()
        .nest_limit(64)
        .build()
        .parse(rx)
        .map_err(|e| {
            let first = e.to_string();
            let line = first.lines().last().unwrap_or("").trim().to_string();
            GrammarError::Invalid(format!("{what} does not parse: {line}"))
        })?;
    if let Some(n) = largest_repeat(&hir).filter(|&n| n > MAX_REPEAT) {
        return Err(too_large(format!(
            "{what} repeats {{{n}}} times; at most {MAX_REPEAT}"
        )));
    }
    if expansion(&hir) > MAX_REGEX_EXPANSION {
        return Err(too_large(format!(
            "{what} expands to over {MAX_REGEX_EXPANSION} positions (nested repetitions multiply)"
        )));
    }
    Ok(())
}

fn largest_repeat(h: &Hir) -> Option<u32> {
    match h.kind() {
        HirKind::Repetition(r) => {
            let here = r.max.unwrap_or(r.min).max(r.min);
            Some(largest_repeat(&r.sub).map_or(here, |n| n.max(here)))
        }
        HirKind::Capture(c) => largest_repeat(&c.sub),
        HirKind::Concat(v) | HirKind::Alternation(v) => v.iter().filter_map(largest_repeat).max(),
        _ => None,
    }
}

fn expansion(h: &Hir) -> u64 {
    match h.kind() {
        HirKind::Empty | HirKind::Look(_) => 0,
        HirKind::Literal(l) => l.0.len() as u64,
        HirKind::Class(_) => 1,
        HirKind::Repetition(r) => {
            let times = r.max.unwrap_or(r.min).max(1) as u64;
            times.saturating_mul(expansion(&r.sub))
        }
        HirKind::Capture(c) => expansion(&c.sub),
        HirKind::Concat(v) | HirKind::Alternation(v) => {
            v.iter().map(expansion).fold(0u64, u64::saturating_add)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(c: OutputConstraint, needle: &str) {
        let e = check(&c).unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
    }

    #[test]
    fn caps_are_checked_before_compiling() {
        refused(
            OutputConstraint::Choice((0..70_000).map(|i| i.to_string()).collect()),
            "70000 choices; at most 1024",
        );
        refused(OutputConstraint::Regex("a{1000000}".into()), "{1000000}");
        refused(
            OutputConstraint::Regex("(?x) a {5000}".into()),
            "at most 1000",
        );
        refused(
            OutputConstraint::Lark("start: \"a\" ~ 5000".into()),
            "~ 5000",
        );
        refused(
            OutputConstraint::Lark("start: \"a\" ~ 1..5000".into()),
            "~ ..5000",
        );
        refused(
            OutputConstraint::Lark("start: /a{ 2000 }/".into()),
            "{2000}",
        );
        refused(
            OutputConstraint::JsonSchema(r#"{"type":"string","pattern":"x{9999}"}"#.into()),
            "pattern repeats",
        );
        refused(OutputConstraint::Regex("(a{900}){900}".into()), "expands");
        refused(
            OutputConstraint::Regex("a{99999999999999999999999}".into()),
            "does not parse",
        );
        let alts: Vec<String> = (0..20_001).map(|i| format!("\"x{i}\"")).collect();
        refused(
            OutputConstraint::Lark(format!("start: {}", alts.join(" | "))),
            "20000 alternatives",
        );
        refused(
            OutputConstraint::JsonSchema("x".repeat(MAX_SPEC_BYTES + 1)),
            "at most 262144",
        );
        // Within the caps: fine.
        for ok in [
            OutputConstraint::Regex("[a-z]{1,1000}".into()),
            OutputConstraint::Regex("(ab|cd){3}x{2,}".into()),
            OutputConstraint::Lark("start: \"a\" | \"b\"".into()),
            OutputConstraint::Choice(vec!["yes".into(), "no".into()]),
            OutputConstraint::Regex("{not a count}".into()),
            OutputConstraint::Regex(r"\x{2000}\u{3000}+".into()),
            OutputConstraint::Lark(r#"start: /\x{2019}/ "a" ~ 3"#.into()),
            OutputConstraint::JsonSchema(r#"{"type":"string","maxLength":100000}"#.into()),
        ] {
            if let OutputConstraint::Regex(r) = &ok {
                if r.starts_with('{') {
                    // Not a regex at all: refused by the parser, naming it.
                    assert!(check(&ok)
                        .unwrap_err()
                        .to_string()
                        .contains("does not parse"));
                    continue;
                }
            }
            check(&ok).unwrap();
        }
    }
}
