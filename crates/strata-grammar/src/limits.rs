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

fn too_large(m: String) -> GrammarError {
    GrammarError::Invalid(m)
}

/// Refuses a constraint beyond the caps, naming the cap.
pub fn check(c: &OutputConstraint) -> Result<(), GrammarError> {
    match c {
        OutputConstraint::JsonObject => Ok(()),
        OutputConstraint::JsonSchema(s) => spec_bytes("the JSON schema", s),
        OutputConstraint::Regex(rx) => {
            spec_bytes("the regex", rx)?;
            repeats("the regex", rx)?;
            regex_expansion(rx)
        }
        OutputConstraint::Lark(g) => {
            spec_bytes("the grammar", g)?;
            repeats("the grammar", g)?;
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

/// Every `{n}`, `{m,}` and `{m,n}` in the text (also inside a grammar's regexes and strings:
/// conservative) has counts ≤ [`MAX_REPEAT`].
fn repeats(what: &str, s: &str) -> Result<(), GrammarError> {
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'{' {
            let mut j = i + 1;
            let mut counts = Vec::new();
            loop {
                let start = j;
                while j < b.len() && b[j].is_ascii_digit() {
                    j += 1;
                }
                if j > start {
                    counts.push(&s[start..j]);
                }
                if j < b.len() && b[j] == b',' && counts.len() < 2 {
                    j += 1;
                    continue;
                }
                break;
            }
            if j < b.len() && b[j] == b'}' {
                for c in counts {
                    // Digits only: a count too long for u64 is too large too.
                    if c.parse::<u64>().map_or(true, |n| n > MAX_REPEAT as u64) {
                        return Err(too_large(format!(
                            "{what} repeats {{{c}}} times; at most {MAX_REPEAT}"
                        )));
                    }
                }
            }
        }
        i += 1;
    }
    Ok(())
}

/// The regex parses, and the positions it expands to (each repetition's larger bound, or
/// its lower one when unbounded, times what it repeats) stay within the cap.
fn regex_expansion(rx: &str) -> Result<(), GrammarError> {
    let hir = regex_syntax::ParserBuilder::new()
        .nest_limit(64)
        .build()
        .parse(rx)
        .map_err(|e| {
            let first = e.to_string();
            let line = first.lines().last().unwrap_or("").trim().to_string();
            GrammarError::Invalid(format!("the regex does not parse: {line}"))
        })?;
    let n = expansion(&hir);
    if n > MAX_REGEX_EXPANSION {
        return Err(too_large(format!(
            "the regex expands to over {MAX_REGEX_EXPANSION} positions (nested repetitions multiply)"
        )));
    }
    Ok(())
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
        refused(OutputConstraint::Regex("(a{900}){900}".into()), "expands");
        refused(
            OutputConstraint::Regex("a{99999999999999999999999}".into()),
            "at most 1000",
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
