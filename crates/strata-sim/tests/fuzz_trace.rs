//! Fuzzing the trace parser (a bounded number of cases in the test suite): any bytes give a
//! trace or an error naming a line, never a panic; the hostile inputs seen so far stay here as
//! regression cases.

use proptest::prelude::*;
use strata_sim::trace::{parse_line, read_trace};

const VALID: &str =
    r#"{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]}"#;

/// Inputs that once needed a guard: zero block size, huge lengths, wrong types, deep nesting.
#[test]
fn hostile_corpus() {
    let corpus = [
        r#"{"timestamp": 0, "input_length": 18446744073709551615, "output_length": 0, "hash_ids": []}"#,
        r#"{"timestamp": -1, "input_length": 1, "output_length": 0, "hash_ids": [0]}"#,
        r#"{"timestamp": 0, "input_length": 1, "output_length": 0, "hash_ids": [1.5]}"#,
        r#"{"timestamp": 0, "input_length": 1, "output_length": 0, "hash_ids": {"a": 1}}"#,
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
        // Lengths that once reached an allocation (an output of 2^64 − 1 tokens, a prompt of
        // 10^12 under a block as large), a misspelt and a repeated field.
        r#"{"timestamp": 0, "input_length": 1024, "output_length": 18446744073709551615, "hash_ids": [1, 2]}"#,
        r#"{"timestamp": 0, "input_length": 1000000000000, "output_length": 1, "hash_ids": [1]}"#,
        r#"{"timestamp": 0, "input_length": 1, "output_length": 0, "hash_ids": [1], "sesion_id": "a"}"#,
        r#"{"timestamp": 0, "timestamp": 1, "input_length": 1, "output_length": 0, "hash_ids": [1]}"#,
        "null",
        "\u{0}\u{0}",
    ];
    for c in corpus {
        assert!(parse_line(c, 1, 512).is_err(), "{c}");
    }
    assert!(parse_line(VALID, 1, 0).is_err(), "blocks of 0 tokens");
    assert!(
        parse_line(VALID, 1, 1_000_000_000_000).is_err(),
        "blocks past any request"
    );
    assert!(parse_line(VALID, 1, 512).is_ok());
    // A line past the limit is refused without reading it all into one line.
    let long = format!("{}\n", " ".repeat(17 << 20));
    assert!(read_trace(long.as_bytes(), 512).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512), bt in 0usize..2048) {
        let _ = read_trace(&bytes[..], bt);
    }

    /// Any `session_id` (a string of any characters and length, any number, nested values)
    /// gives a request or an error, never a panic.
    #[test]
    fn any_session_id_never_panics(v in prop_oneof![
        ".{0,1100}".prop_map(serde_json::Value::String),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(serde_json::Value::from),
        Just(serde_json::json!([1, {"a": null}])),
    ]) {
        let mut line: serde_json::Value = serde_json::from_str(VALID).unwrap();
        line["session_id"] = v;
        let _ = parse_line(&line.to_string(), 1, 512);
    }

    #[test]
    fn mutated_valid_lines_never_panic(pos in 0usize..VALID.len(), with in any::<char>(), bt in 0usize..4096) {
        let mut s: Vec<char> = VALID.chars().collect();
        s[pos] = with;
        let line: String = s.into_iter().collect();
        let _ = parse_line(&line, 1, bt);
    }
}
