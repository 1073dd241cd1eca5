//! Constraints compiled over the tiny model's byte-level BPE tokenizer, driven by random
//! choices among the allowed tokens: whatever the sampler picks, the output is valid.

use super::*;
use strata_kv::rng::SplitMix64;
use strata_model::Gguf;

fn grammars() -> (Grammars, Arc<ModelTokenizer>) {
    let dir = tempfile::tempdir().unwrap();
    let path = strata_test_support::tiny_model(dir.path());
    let g = Gguf::open(&path).unwrap();
    let tk = Arc::new(ModelTokenizer::from_gguf(&g).unwrap());
    let vocab = g.config.vocab;
    (Grammars::new(tk.clone(), vocab).unwrap(), tk)
}

/// Runs a constraint to its end, choosing uniformly among the allowed tokens (ending as soon
/// as the mask allows it with probability `p_end`); the text, or None at `limit` tokens.
fn run(c: &Compiled, tk: &ModelTokenizer, seed: u64, p_end: f64, limit: usize) -> Option<String> {
    let mut m = c.start();
    let mut rng = SplitMix64::new(seed);
    let mut out = Vec::new();
    for _ in 0..limit {
        let mask = m.mask().unwrap();
        assert!(mask.any(), "a live constraint allows some token");
        let allowed: Vec<u32> = (0..mask.words.len() as u32 * 32)
            .filter(|&t| mask.allows(t) && !tk.stop.contains(&t))
            .collect();
        if mask.can_end && (allowed.is_empty() || rng.next_f64() < p_end) {
            return Some(tk.decode(&out).unwrap());
        }
        let t = allowed[(rng.next_f64() * allowed.len() as f64) as usize % allowed.len()];
        m.commit(t).unwrap();
        out.push(t);
        if m.is_finished() {
            return Some(tk.decode(&out).unwrap());
        }
    }
    None
}

#[test]
fn json_schema_outputs_validate_whatever_is_chosen() {
    let (g, tk) = grammars();
    let schema = r#"{"type":"object","properties":{
        "name":{"type":"string","maxLength":6},
        "age":{"type":"integer","minimum":0,"maximum":120},
        "pet":{"enum":["cat","dog"]},
        "tags":{"type":"array","items":{"type":"boolean"},"maxItems":3}},
        "required":["name","age","pet","tags"],"additionalProperties":false}"#;
    let c = g
        .compile(&OutputConstraint::JsonSchema(schema.into()))
        .unwrap();
    let mut finished = 0;
    for seed in 0..40 {
        let Some(text) = run(&c, &tk, seed, 0.5, 400) else {
            continue;
        };
        finished += 1;
        let v: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
        let o = v.as_object().expect("an object");
        assert_eq!(o.len(), 4, "exactly the required keys: {text}");
        assert!(o["name"].as_str().unwrap().chars().count() <= 6, "{text}");
        let age = o["age"].as_i64().unwrap();
        assert!((0..=120).contains(&age), "{text}");
        assert!(o["pet"] == "cat" || o["pet"] == "dog", "{text}");
        let tags = o["tags"].as_array().unwrap();
        assert!(
            tags.len() <= 3 && tags.iter().all(|t| t.is_boolean()),
            "{text}"
        );
        assert!(
            !text.contains(' ') || o["name"].as_str().unwrap().contains(' '),
            "compact: {text}"
        );
    }
    assert!(
        finished >= 30,
        "only {finished} of 40 runs ended within 400 tokens"
    );
}

#[test]
fn json_object_regex_choice_and_lark_hold() {
    let (g, tk) = grammars();
    let obj = g.compile(&OutputConstraint::JsonObject).unwrap();
    let mut ended = 0;
    for seed in 0..20 {
        if let Some(t) = run(&obj, &tk, seed, 0.9, 300) {
            ended += 1;
            let v: serde_json::Value =
                serde_json::from_str(&t).unwrap_or_else(|e| panic!("{e}: {t:?}"));
            assert!(v.is_object(), "{t}");
        }
    }
    assert!(ended > 0);
    let rx = g
        .compile(&OutputConstraint::Regex("[0-9]{3}-[a-c]{2}".into()))
        .unwrap();
    for seed in 0..20 {
        let t = run(&rx, &tk, seed, 0.5, 50).expect("a fixed-length regex ends");
        let b = t.as_bytes();
        assert_eq!(b.len(), 6, "{t}");
        assert!(b[..3].iter().all(u8::is_ascii_digit) && b[3] == b'-', "{t}");
        assert!(b[4..].iter().all(|c| (b'a'..=b'c').contains(c)), "{t}");
    }
    let choice = g
        .compile(&OutputConstraint::Choice(vec![
            "yes".into(),
            "no \"way\"".into(),
        ]))
        .unwrap();
    for seed in 0..20 {
        let t = run(&choice, &tk, seed, 0.5, 50).unwrap();
        assert!(t == "yes" || t == "no \"way\"", "{t}");
    }
    let lark = g
        .compile(&OutputConstraint::Lark(r#"start: "a" ("," "b")*"#.into()))
        .unwrap();
    for seed in 0..20 {
        let t = run(&lark, &tk, seed, 0.3, 60).unwrap();
        assert!(
            t.starts_with('a') && t[1..].split_terminator(',').skip(1).all(|x| x == "b"),
            "{t}"
        );
    }
}

#[test]
fn invalid_constraints_are_refused_with_the_reason() {
    let (g, _) = grammars();
    for bad in [
        OutputConstraint::JsonSchema("{not json".into()),
        OutputConstraint::JsonSchema("[1]".into()),
        OutputConstraint::JsonSchema(r#"{"type":"no-such-type"}"#.into()),
        OutputConstraint::Regex("(unclosed".into()),
        OutputConstraint::Lark("start: missing_rule".into()),
        OutputConstraint::Choice(vec![]),
    ] {
        match g.compile(&bad) {
            Err(GrammarError::Invalid(m)) => assert!(!m.is_empty()),
            Err(e) => panic!("{bad:?}: wrong error {e}"),
            Ok(_) => panic!("{bad:?} compiled"),
        }
    }
}

/// Limits of the grammar engine that show only once output is taken (a rule of 2,000
/// alternatives; a schema whose output never ends) are refused at compile time, not met by a
/// failing generation; just under them compiles.
#[test]
fn constraints_that_fail_on_their_first_tokens_are_refused() {
    let (g, _) = grammars();
    let alternatives = |n: usize| {
        let alts: Vec<String> = (0..n).map(|i| format!("\"a{i}\"")).collect();
        OutputConstraint::Lark(format!("start: {}", alts.join(" | ")))
    };
    let endless = [
        r##"{"type":"array","items":{"$ref":"#"},"minItems":1}"##,
        r##"{"type":"object","properties":{"a":{"$ref":"#"}},"required":["a"]}"##,
    ];
    let bad = endless
        .iter()
        .map(|s| OutputConstraint::JsonSchema(s.to_string()))
        .chain([alternatives(2000)]);
    for c in bad {
        match g.compile(&c) {
            Err(GrammarError::Invalid(m)) => assert!(m.contains("fails after"), "{m}"),
            Err(e) => panic!("wrong error {e}"),
            Ok(_) => panic!("{:.80} compiled", format!("{c:?}")),
        }
    }
    assert!(g.compile(&alternatives(1999)).is_ok());
    // A long constant start (a forced tool call's wrapper) before the part that fails: the
    // forced tokens are taken on the way, and the failure is still found.
    let call = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"const": "get_the_weather_now"},
            "arguments": {"$ref": "#/properties/arguments"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": false,
        "x-guidance": {"whitespace_flexible": false},
    });
    let wrapped = format!("start: \"<tool_call>\\n\" f0 \"\\n</tool_call>\"\nf0: %json {call}");
    match g.compile(&OutputConstraint::Lark(wrapped)) {
        Err(GrammarError::Invalid(m)) => assert!(m.contains("fails after"), "{m}"),
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("the wrapped endless schema compiled"),
    }
}

#[test]
fn a_compiled_constraint_starts_fresh_for_every_request() {
    let (g, tk) = grammars();
    let c = g
        .compile(&OutputConstraint::Choice(vec!["ab".into()]))
        .unwrap();
    let a = run(&c, &tk, 1, 0.5, 10).unwrap();
    let b = run(&c, &tk, 2, 0.5, 10).unwrap();
    assert_eq!((a.as_str(), b.as_str()), ("ab", "ab"));
    // A token the grammar rules out is refused, not followed.
    let mut m = c.start();
    let x = tk.encode("x").unwrap()[0];
    assert!(m.commit(x).is_err());
}

/// A SentencePiece vocabulary (Mistral's kind): tokens' bytes have `▁` as a space and byte
/// tokens as their byte, and a constraint over it holds.
#[test]
fn sentencepiece_tokens_map_to_their_bytes_and_constraints_hold() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("spm.gguf");
    strata_model::tiny::write_tiny(
        &path,
        &strata_model::tiny::TinySpec::family("mistral").unwrap(),
    )
    .unwrap();
    let g = Gguf::open(&path).unwrap();
    let tk = Arc::new(ModelTokenizer::from_gguf(&g).unwrap());
    let bytes = token_bytes(&tk, g.config.vocab).unwrap();
    let id = |t: &str| tk.token_to_id(t).unwrap() as usize;
    assert_eq!(bytes[id("\u{2581}hello")], b" hello");
    assert_eq!(bytes[id("<0x0A>")], b"\n");
    assert_eq!(bytes[id("he")], b"he");
    assert_eq!(bytes[id("<s>")][0], TokTrie::SPECIAL_TOKEN_MARKER);
    let g = Grammars::new(tk.clone(), g.config.vocab).unwrap();
    let rx = g
        .compile(&OutputConstraint::Regex("[0-9]{3}-[a-c]{2}".into()))
        .unwrap();
    for seed in 0..20 {
        let t = run(&rx, &tk, seed, 0.5, 50).expect("a fixed-length regex ends");
        assert_eq!(t.len(), 6, "{t}");
        assert!(t.as_bytes()[3] == b'-', "{t}");
    }
}

/// `check` compiles a constraint once: a valid one is remembered (a second check of the same
/// one finds it), an invalid one is refused every time, and a full memory starts over.
#[test]
fn check_remembers_valid_constraints_only() {
    let (g, _) = grammars();
    let ok = OutputConstraint::JsonSchema(r#"{"type":"object"}"#.into());
    let bad = OutputConstraint::JsonSchema(r##"{"$ref":"#/$defs/none"}"##.into());
    let held = |g: &Grammars| g.checked.lock().unwrap().len();
    for _ in 0..2 {
        g.check(&ok).unwrap();
        assert!(g.check(&bad).is_err());
        assert_eq!(held(&g), 1);
    }
    for i in 0..CHECKED {
        g.check(&OutputConstraint::Regex(format!("a{i}"))).unwrap();
        assert!(held(&g) <= CHECKED);
    }
    // 1 + CHECKED valid ones: the last found the memory full and started it over.
    assert_eq!(held(&g), 1);
}

/// An error whose first line only announces its reason ("regex parse error:") keeps the
/// reason.
#[test]
fn a_regex_error_keeps_its_reason() {
    let (g, _) = grammars();
    match g.compile(&OutputConstraint::Regex("(unclosed".into())) {
        Err(GrammarError::Invalid(m)) => {
            assert!(!m.trim_end().ends_with(':'), "{m}");
            assert!(m.len() > "regex parse error:".len() + 3, "{m}");
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    assert_eq!(
        super::first_line("regex parse error:\n    (a\n    ^\nerror: unclosed group\n"),
        "regex parse error: unclosed group"
    );
}

/// A long forced run that is valid (a constant repeated thousands of times) compiles: the
/// probe takes at most 256 forced tokens, and what the engine cannot force is walked token by
/// token, never taken as a failure.
#[test]
fn a_long_valid_forced_run_compiles() {
    let (g, _) = grammars();
    let long = r#"{"type":"array","items":{"const":"abc"},"minItems":3000,"maxItems":3000}"#;
    let c = OutputConstraint::JsonSchema(long.into());
    assert!(g.compile(&c).is_ok(), "{:?}", g.compile(&c).err());
}
