//! Mooncake-format request traces: one JSON object per line with `timestamp` (ms),
//! `input_length`, `output_length` and `hash_ids` (one id per block of `block_tokens` tokens;
//! an id stands for the block and its whole prefix).

use std::io::BufRead;

use serde::Deserialize;
use serde_json::Value;
use thiserror::Error;

/// A malformed trace, with the line (1-based) and the field at fault.
#[derive(Debug, Error)]
pub enum TraceError {
    #[error("trace line {line}: {msg}")]
    Line { line: usize, msg: String },
    #[error("trace line {line}, field `{field}`: {msg}")]
    Field {
        line: usize,
        field: &'static str,
        msg: String,
    },
    /// The cause is in the message, not a source too (a report would print it twice).
    #[error("cannot read trace: {0}")]
    Io(std::io::Error),
    #[error("trace is empty")]
    Empty,
}

impl From<std::io::Error> for TraceError {
    fn from(e: std::io::Error) -> TraceError {
        TraceError::Io(e)
    }
}

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRequest {
    pub timestamp_ms: u64,
    pub input_length: usize,
    pub output_length: usize,
    pub hash_ids: Vec<u64>,
    /// The optional `session_id` (a string or a non-negative integer; the API's
    /// `prompt_cache_key`), as a stable 64-bit hash: replayed as the request's session.
    pub session: Option<u64>,
}

/// Longest `session_id` string taken (the API takes any; a trace line is bounded anyway).
pub const MAX_SESSION_ID_BYTES: usize = 1024;

/// The fields a line is read for. A field given twice is refused; others (tools that write
/// Mooncake-format traces add their own) are not read and are reported once by the reader,
/// but one a letter or two from a field read (a misspelt `sesion_id` would replay without
/// sessions) is refused by name.
#[derive(Deserialize)]
struct Line {
    timestamp: Option<Value>,
    input_length: Option<Value>,
    output_length: Option<Value>,
    hash_ids: Option<Value>,
    session_id: Option<Value>,
    #[serde(flatten)]
    other: std::collections::BTreeMap<String, serde::de::IgnoredAny>,
}

/// The fields a line is read for.
pub const FIELDS: [&str; 5] = [
    "timestamp",
    "input_length",
    "output_length",
    "hash_ids",
    "session_id",
];

/// Edits (insert, delete, replace one character) between `a` and `b`, up to `most + 1`.
fn edits(a: &str, b: &str, most: usize) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    if a.len().abs_diff(b.len()) > most {
        return most + 1;
    }
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()].min(most + 1)
}

/// A field not read: refused when it is within two edits of one that is (a misspelling),
/// else returned for the reader to report.
fn unread(name: &str, line: usize) -> Result<(), TraceError> {
    match FIELDS.iter().find(|f| edits(name, f, 2) <= 2) {
        Some(f) => Err(TraceError::Line {
            line,
            msg: format!("unknown field `{name}` (is it `{f}`?)"),
        }),
        None => Ok(()),
    }
}

/// The `session_id` field, if any, as a stable hash (the same id in two traces, or two runs,
/// gives the same key; strings and integers in separate namespaces).
fn session_id(v: Option<&Value>, line: usize) -> Result<Option<u64>, TraceError> {
    let field = "session_id";
    let hash = |tag: u8, bytes: &[u8]| {
        let mut h = rustc_hash::FxHasher::default();
        std::hash::Hasher::write_u8(&mut h, tag);
        std::hash::Hasher::write(&mut h, bytes);
        std::hash::Hasher::finish(&h)
    };
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) if s.len() <= MAX_SESSION_ID_BYTES => {
            Ok(Some(hash(0, s.as_bytes())))
        }
        Some(Value::String(s)) => Err(TraceError::Field {
            line,
            field,
            msg: format!("{} bytes, at most {MAX_SESSION_ID_BYTES}", s.len()),
        }),
        Some(v) => match v.as_u64() {
            Some(n) => Ok(Some(hash(1, &n.to_le_bytes()))),
            None => Err(TraceError::Field {
                line,
                field,
                msg: format!("expected a string or a non-negative integer, got {v}"),
            }),
        },
    }
}

fn uint(v: Option<&Value>, line: usize, field: &'static str) -> Result<u64, TraceError> {
    let v = v.ok_or_else(|| TraceError::Field {
        line,
        field,
        msg: "missing".into(),
    })?;
    v.as_u64().ok_or_else(|| TraceError::Field {
        line,
        field,
        msg: format!("expected a non-negative integer, got {v}"),
    })
}

/// Most tokens a request's prompt, or its output, may have (16,777,216: beyond any model's
/// context), and the largest block: a longer one is an error naming it, not an allocation.
pub const MAX_REQUEST_TOKENS: usize = 1 << 24;

/// Lengths scaled by `--length-scale`, as `strata sim` and `strata bench` both scale them:
/// every block alike (sharing keeps its structure), a prompt to at least one token and at most
/// its blocks, an output to at least one token. A block or a prompt past
/// [`MAX_REQUEST_TOKENS`] is an error naming it (an output is capped by the caller's
/// `--max-tokens` first).
#[derive(Clone, Copy, Debug)]
pub struct Scale {
    pub factor: f64,
    /// The scaled block, in tokens.
    pub block: usize,
}

impl Scale {
    pub fn new(block_tokens: usize, factor: f64) -> Result<Scale, String> {
        let block = ((block_tokens as f64 * factor).round() as usize).max(1);
        let s = Scale { factor, block };
        s.bounded("a block", block)?;
        Ok(s)
    }

    /// Request `r`'s (the `i`-th, from 0) prompt length, scaled.
    pub fn prompt(&self, i: usize, r: &TraceRequest) -> Result<usize, String> {
        let cap = self.block.saturating_mul(r.hash_ids.len().max(1));
        let n = ((r.input_length as f64 * self.factor).round() as usize).clamp(1, cap);
        self.bounded(&format!("request {}: the prompt", i + 1), n)
    }

    /// Request `r`'s output length, scaled.
    pub fn output(&self, r: &TraceRequest) -> usize {
        ((r.output_length as f64 * self.factor).round() as usize).max(1)
    }

    /// `n` for `what`, or the error naming it past [`MAX_REQUEST_TOKENS`].
    pub fn bounded(&self, what: &str, n: usize) -> Result<usize, String> {
        if n > MAX_REQUEST_TOKENS {
            return Err(format!(
                "{what} of {n} tokens after the length scale {}: at most {MAX_REQUEST_TOKENS}",
                strata_kv::units::shown_number(self.factor)
            ));
        }
        Ok(n)
    }
}

/// A length field: at most [`MAX_REQUEST_TOKENS`].
fn length(v: Option<&Value>, line: usize, field: &'static str) -> Result<usize, TraceError> {
    let n = uint(v, line, field)?;
    if n > MAX_REQUEST_TOKENS as u64 {
        return Err(TraceError::Field {
            line,
            field,
            msg: format!("{n} tokens, at most {MAX_REQUEST_TOKENS}"),
        });
    }
    Ok(n as usize)
}

/// Parses one line (1-based `line` for messages).
pub fn parse_line(
    text: &str,
    line: usize,
    block_tokens: usize,
) -> Result<TraceRequest, TraceError> {
    parse_line_reporting(text, line, block_tokens, &mut Default::default())
}

/// [`parse_line`], adding the names of fields not read to `unread_fields`.
fn parse_line_reporting(
    text: &str,
    line: usize,
    block_tokens: usize,
    unread_fields: &mut std::collections::BTreeSet<String>,
) -> Result<TraceRequest, TraceError> {
    if block_tokens == 0 || block_tokens > MAX_REQUEST_TOKENS {
        return Err(TraceError::Line {
            line,
            msg: format!("blocks of {block_tokens} tokens: expected 1 to {MAX_REQUEST_TOKENS}"),
        });
    }
    // An object, not serde's other form of a struct (an array of the fields in order).
    if !text.trim_start().starts_with('{') {
        return Err(TraceError::Line {
            line,
            msg: "expected a JSON object".into(),
        });
    }
    let l: Line = serde_json::from_str(text).map_err(|e| TraceError::Line {
        line,
        msg: match e.classify() {
            serde_json::error::Category::Data => e.to_string(),
            _ => format!("not valid JSON: {e}"),
        },
    })?;
    for name in l.other.keys() {
        unread(name, line)?;
        // A few names are enough to report (a hostile trace may have a new one a line).
        if unread_fields.len() < 16 && !unread_fields.contains(name) {
            unread_fields.insert(name.clone());
        }
    }
    let timestamp_ms = uint(l.timestamp.as_ref(), line, "timestamp")?;
    let input_length = length(l.input_length.as_ref(), line, "input_length")?;
    let output_length = length(l.output_length.as_ref(), line, "output_length")?;
    let field = "hash_ids";
    let ids = l.hash_ids.ok_or_else(|| TraceError::Field {
        line,
        field,
        msg: "missing".into(),
    })?;
    let Value::Array(arr) = ids else {
        return Err(TraceError::Field {
            line,
            field,
            msg: "expected an array".into(),
        });
    };
    let want = input_length.div_ceil(block_tokens);
    if arr.len() != want {
        return Err(TraceError::Field {
            line,
            field,
            msg: format!(
                "{} ids for input_length {input_length}; blocks of {block_tokens} tokens need {want}",
                arr.len()
            ),
        });
    }
    let mut hash_ids = Vec::with_capacity(arr.len());
    for (i, x) in arr.iter().enumerate() {
        hash_ids.push(x.as_u64().ok_or_else(|| TraceError::Field {
            line,
            field,
            msg: format!("element {i} is {x}, expected a non-negative integer"),
        })?);
    }
    Ok(TraceRequest {
        timestamp_ms,
        input_length,
        output_length,
        hash_ids,
        session: session_id(l.session_id.as_ref(), line)?,
    })
}

/// Longest trace line read (a line is one request; real ones are kilobytes).
pub const MAX_LINE_BYTES: u64 = 16 << 20;

/// Reads a whole trace; blank lines are skipped. A line longer than [`MAX_LINE_BYTES`] is an
/// error, not an unbounded allocation.
pub fn read_trace(r: impl BufRead, block_tokens: usize) -> Result<Vec<TraceRequest>, TraceError> {
    read_trace_first(r, block_tokens, 0).map(|t| t.requests)
}

/// A trace as read: its requests, and the names of fields its lines had that are not read (for
/// the reader to report).
#[derive(Debug)]
pub struct Trace {
    pub requests: Vec<TraceRequest>,
    pub unread_fields: std::collections::BTreeSet<String>,
}

/// Reads the first `limit` requests of a trace (0: all); what follows them is not read.
pub fn read_trace_first(
    mut r: impl BufRead,
    block_tokens: usize,
    limit: usize,
) -> Result<Trace, TraceError> {
    let mut unread_fields = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    let mut buf = Vec::new();
    let mut i = 0;
    while limit == 0 || out.len() < limit {
        buf.clear();
        i += 1;
        let n = std::io::Read::take(&mut r, MAX_LINE_BYTES + 1).read_until(b'\n', &mut buf)?;
        if n == 0 {
            break;
        }
        if buf.len() as u64 > MAX_LINE_BYTES {
            return Err(TraceError::Line {
                line: i,
                msg: format!("longer than {MAX_LINE_BYTES} bytes"),
            });
        }
        let l = std::str::from_utf8(&buf).map_err(|_| TraceError::Line {
            line: i,
            msg: "not UTF-8".into(),
        })?;
        if l.trim().is_empty() {
            continue;
        }
        out.push(parse_line_reporting(
            l.trim_end(),
            i,
            block_tokens,
            &mut unread_fields,
        )?);
    }
    if out.is_empty() {
        return Err(TraceError::Empty);
    }
    Ok(Trace {
        requests: out,
        unread_fields,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `session_id`: a string or a non-negative integer, hashed stably (the same id, the same
    /// key; a string and the integer it spells are different sessions); null or empty is none;
    /// anything else, or an overlong string, is refused naming the line and the field.
    #[test]
    fn session_ids_are_hashed_or_refused() {
        let line = |v: &str| {
            let text = format!(
                r#"{{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], "session_id": {v}}}"#
            );
            parse_line(&text, 7, 512)
        };
        let key = |v: &str| line(v).unwrap().session;
        assert_eq!(key(r#""conv-1""#), key(r#""conv-1""#));
        assert!(key(r#""conv-1""#).is_some());
        assert_ne!(key(r#""conv-1""#), key(r#""conv-2""#));
        assert_ne!(key(r#""12""#), key("12"));
        assert!(key("12").is_some());
        assert_eq!(key("null"), None);
        assert_eq!(key(r#""""#), None);
        let long = format!("\"{}\"", "x".repeat(MAX_SESSION_ID_BYTES + 1));
        for bad in ["-1", "1.5", "true", "[1]", r#"{"a": 1}"#, long.as_str()] {
            let e = line(bad).unwrap_err().to_string();
            assert!(
                e.contains("line 7") && e.contains("session_id"),
                "{bad}: {e}"
            );
        }
        let none = parse_line(
            r#"{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}"#,
            1,
            512,
        );
        assert_eq!(none.unwrap().session, None);
    }

    /// A field given twice, or one a letter or two from a field read, is refused by name;
    /// others are reported; lengths are bounded before anything is built from them; an empty
    /// prompt parses (the replay counts it apart).
    #[test]
    fn misspelt_repeated_overlong_are_refused_and_others_reported() {
        let err = |text: &str| parse_line(text, 4, 512).unwrap_err().to_string();
        let e = err(
            r#"{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], "sesion_id": "a"}"#,
        );
        assert_eq!(
            e,
            "trace line 4: unknown field `sesion_id` (is it `session_id`?)"
        );
        let e = err(r#"{"timestamp": 0, "input_length": 10, "output_lenght": 1, "hash_ids": [1]}"#);
        assert!(e.contains("is it `output_length`?"), "{e}");
        let e = err(
            r#"{"timestamp": 0, "timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1]}"#,
        );
        assert!(
            e.starts_with("trace line 4: duplicate field `timestamp`"),
            "{e}"
        );
        // serde's other form of a struct, its fields in order, is not a trace line.
        let e = err(r#"[0, 10, 1, [1], null]"#);
        assert_eq!(e, "trace line 4: expected a JSON object");
        let e = err(
            r#"{"timestamp": 0, "input_length": 10, "output_length": 18446744073709551615, "hash_ids": [1]}"#,
        );
        assert!(e.starts_with("trace line 4, field `output_length`: 18446744073709551615 tokens, at most 16777216"), "{e}");
        let e = err(
            r#"{"timestamp": 0, "input_length": 16777217, "output_length": 1, "hash_ids": [1]}"#,
        );
        assert!(e.contains("field `input_length`: 16777217 tokens"), "{e}");
        let ok = r#"{"timestamp": 0, "input_length": 16777216, "output_length": 16777216, "hash_ids": [1]}"#;
        assert!(parse_line(ok, 1, MAX_REQUEST_TOKENS).is_ok());
        let e = parse_line(ok, 1, MAX_REQUEST_TOKENS + 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("blocks of 16777217 tokens"), "{e}");
        let empty = r#"{"timestamp": 0, "input_length": 0, "output_length": 4, "hash_ids": []}"#;
        assert_eq!(parse_line(empty, 1, 512).unwrap().input_length, 0);
        // Fields other tools write are read past, and named once.
        let other = r#"{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], "text_input": "x", "type": 2}"#;
        let text = format!("{other}\n{other}\n");
        let t = read_trace_first(text.as_bytes(), 512, 0).unwrap();
        assert_eq!(t.requests.len(), 2);
        assert_eq!(
            t.unread_fields.iter().collect::<Vec<_>>(),
            ["text_input", "type"]
        );
    }

    /// `read_trace_first` stops at its limit: a bad line after it is never read.
    #[test]
    fn a_limit_reads_no_further() {
        let good = r#"{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}"#;
        let text = format!("{good}\n{good}\nnot json\n");
        assert_eq!(
            read_trace_first(text.as_bytes(), 512, 2)
                .unwrap()
                .requests
                .len(),
            2
        );
        assert!(read_trace_first(text.as_bytes(), 512, 3).is_err());
        assert!(read_trace(text.as_bytes(), 512).is_err());
    }

    #[test]
    fn parses_a_line() {
        let r = parse_line(
            r#"{"timestamp": 40, "input_length": 1000, "output_length": 3, "hash_ids": [4, 5]}"#,
            1,
            512,
        )
        .unwrap();
        assert_eq!(r.hash_ids, vec![4, 5]);
        assert_eq!(r.timestamp_ms, 40);
    }

    #[test]
    fn errors_name_line_and_field() {
        let text = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n\n{\"timestamp\": 0, \"input_length\": \"ten\", \"output_length\": 1, \"hash_ids\": [1]}\n";
        let e = read_trace(text.as_bytes(), 512).unwrap_err().to_string();
        assert_eq!(
            e,
            "trace line 3, field `input_length`: expected a non-negative integer, got \"ten\""
        );
        let e = parse_line(
            r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}"#,
            7,
            512,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("trace line 7, field `hash_ids`: 1 ids for input_length 600"),
            "{e}"
        );
        let e = parse_line(
            r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [-1]}"#,
            2,
            512,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("field `hash_ids`: element 0 is -1"), "{e}");
        let e = parse_line("{oops", 5, 512).unwrap_err().to_string();
        assert!(e.starts_with("trace line 5: not valid JSON"), "{e}");
        let e = parse_line(
            r#"{"input_length": 1, "output_length": 1, "hash_ids": [1]}"#,
            9,
            512,
        )
        .unwrap_err()
        .to_string();
        assert_eq!(e, "trace line 9, field `timestamp`: missing");
        assert!(matches!(
            read_trace("\n".as_bytes(), 512),
            Err(TraceError::Empty)
        ));
    }
}
