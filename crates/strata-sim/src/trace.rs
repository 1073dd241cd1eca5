//! Mooncake-format request traces: one JSON object per line with `timestamp` (ms),
//! `input_length`, `output_length` and `hash_ids` (one id per block of `block_tokens` tokens;
//! an id stands for the block and its whole prefix).

use std::io::BufRead;

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
    #[error("cannot read trace: {0}")]
    Io(#[from] std::io::Error),
    #[error("trace is empty")]
    Empty,
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

/// The `session_id` field, if any, as a stable hash (the same id in two traces, or two runs,
/// gives the same key; strings and integers in separate namespaces).
fn session_id(
    obj: &serde_json::Map<String, Value>,
    line: usize,
) -> Result<Option<u64>, TraceError> {
    let field = "session_id";
    let hash = |tag: u8, bytes: &[u8]| {
        let mut h = rustc_hash::FxHasher::default();
        std::hash::Hasher::write_u8(&mut h, tag);
        std::hash::Hasher::write(&mut h, bytes);
        std::hash::Hasher::finish(&h)
    };
    match obj.get(field) {
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

fn uint(
    obj: &serde_json::Map<String, Value>,
    line: usize,
    field: &'static str,
) -> Result<u64, TraceError> {
    let v = obj.get(field).ok_or_else(|| TraceError::Field {
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

/// Parses one line (1-based `line` for messages).
pub fn parse_line(
    text: &str,
    line: usize,
    block_tokens: usize,
) -> Result<TraceRequest, TraceError> {
    if block_tokens == 0 {
        return Err(TraceError::Line {
            line,
            msg: "blocks of 0 tokens".into(),
        });
    }
    let v: Value = serde_json::from_str(text).map_err(|e| TraceError::Line {
        line,
        msg: format!("not valid JSON: {e}"),
    })?;
    let obj = v.as_object().ok_or_else(|| TraceError::Line {
        line,
        msg: "expected a JSON object".into(),
    })?;
    let timestamp_ms = uint(obj, line, "timestamp")?;
    let input_length = uint(obj, line, "input_length")? as usize;
    let output_length = uint(obj, line, "output_length")? as usize;
    let field = "hash_ids";
    let ids = obj.get(field).ok_or_else(|| TraceError::Field {
        line,
        field,
        msg: "missing".into(),
    })?;
    let arr = ids.as_array().ok_or_else(|| TraceError::Field {
        line,
        field,
        msg: "expected an array".into(),
    })?;
    let mut hash_ids = Vec::with_capacity(arr.len());
    for (i, x) in arr.iter().enumerate() {
        hash_ids.push(x.as_u64().ok_or_else(|| TraceError::Field {
            line,
            field,
            msg: format!("element {i} is {x}, expected a non-negative integer"),
        })?);
    }
    let want = input_length.div_ceil(block_tokens);
    if hash_ids.len() != want {
        return Err(TraceError::Field {
            line,
            field,
            msg: format!(
                "{} ids for input_length {input_length}; blocks of {block_tokens} tokens need {want}",
                hash_ids.len()
            ),
        });
    }
    Ok(TraceRequest {
        timestamp_ms,
        input_length,
        output_length,
        hash_ids,
        session: session_id(obj, line)?,
    })
}

/// Longest trace line read (a line is one request; real ones are kilobytes).
pub const MAX_LINE_BYTES: u64 = 16 << 20;

/// Reads a whole trace; blank lines are skipped. A line longer than [`MAX_LINE_BYTES`] is an
/// error, not an unbounded allocation.
pub fn read_trace(
    mut r: impl BufRead,
    block_tokens: usize,
) -> Result<Vec<TraceRequest>, TraceError> {
    let mut out = Vec::new();
    let mut buf = Vec::new();
    let mut i = 0;
    loop {
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
        out.push(parse_line(l.trim_end(), i, block_tokens)?);
    }
    if out.is_empty() {
        return Err(TraceError::Empty);
    }
    Ok(out)
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
