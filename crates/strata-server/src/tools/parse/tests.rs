use super::*;

fn names() -> Vec<String> {
    vec!["get_weather".into(), "add".into()]
}

/// The text pushed in pieces of `step` characters: every output.
fn streamed(text: &str, step: usize) -> Vec<ToolOut> {
    let mut ts = ToolStream::new(names());
    let mut outs = Vec::new();
    let chars: Vec<char> = text.chars().collect();
    for piece in chars.chunks(step) {
        outs.extend(ts.push(&piece.iter().collect::<String>()));
    }
    outs.extend(ts.finish());
    outs
}

fn pairs(calls: &[Call]) -> Vec<(&str, &str)> {
    calls
        .iter()
        .map(|c| (c.name.as_str(), c.arguments.as_str()))
        .collect()
}

#[test]
fn calls_are_parsed_from_the_text_in_any_split() {
    let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"at\": [1, 2]}}\n</tool_call>\n<tool_call>\n{\"name\":\"add\",\"arguments\":{\"b\":1,\"a\":2}}\n</tool_call>";
    let want = vec![
        ("get_weather", r#"{"city":"Paris","at":[1,2]}"#),
        ("add", r#"{"b":1,"a":2}"#),
    ];
    let (content, calls) = parse_all(text, names(), false);
    assert_eq!(content.as_deref(), Some("Let me check."));
    assert_eq!(pairs(&calls), want);
    assert_eq!((calls[0].index, calls[1].index), (0, 1));
    // Streamed in pieces of every size: the same content and calls.
    for step in 1..12 {
        let (content, calls) = gather(streamed(text, step));
        assert_eq!(content.as_deref(), Some("Let me check."), "step {step}");
        assert_eq!(pairs(&calls), want, "step {step}");
    }
}

#[test]
fn arguments_stream_as_deltas_after_a_first_delta_with_the_name() {
    let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris </tool_call> {x\", \"n\": 3}}\n</tool_call>";
    let outs = streamed(text, 4);
    let ToolOut::Call(first) = &outs[0] else {
        panic!("{outs:?}");
    };
    assert_eq!(
        (first.name.as_str(), first.arguments.as_str()),
        ("get_weather", "")
    );
    assert!(first.id.starts_with("call_"));
    let args: Vec<&str> = outs[1..]
        .iter()
        .map(|o| match o {
            ToolOut::Args { index: 0, delta } => delta.as_str(),
            o => panic!("{o:?}"),
        })
        .collect();
    assert!(args.len() > 3, "{args:?}");
    // A closing tag and spaces inside a string are the arguments' text.
    assert_eq!(args.concat(), r#"{"city":"Paris </tool_call> {x","n":3}"#);
    // The delta entries as OpenAI's.
    assert_eq!(outs[0].delta_json().unwrap()["function"]["arguments"], "");
    assert_eq!(
        outs[1].delta_json().unwrap(),
        json!({"index": 0, "function": {"arguments": args[0]}})
    );
}

#[test]
fn a_call_written_otherwise_is_read_whole_at_its_close() {
    // Arguments first, or as a string: one call, whole.
    for text in [
        "<tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"add\"}</tool_call>",
        "<tool_call>{\"name\": \"add\", \"arguments\": \"{\\\"a\\\":1}\"}</tool_call>",
    ] {
        for step in [1, 3, 100] {
            let outs = streamed(text, step);
            assert_eq!(outs.len(), 1, "{outs:?}");
            let ToolOut::Call(c) = &outs[0] else {
                panic!("{outs:?}");
            };
            assert_eq!(
                (c.name.as_str(), c.arguments.as_str()),
                ("add", r#"{"a":1}"#)
            );
        }
    }
}

#[test]
fn a_streamed_call_cut_by_the_length_limit_keeps_what_was_written() {
    let (content, calls) = parse_all(
        "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\"",
        names(),
        false,
    );
    assert_eq!(content, None);
    assert_eq!(pairs(&calls), vec![("add", r#"{"a":1,"b""#)]);
    // Broken arguments end where the JSON does; the rest of the block is dropped.
    let (content, calls) = parse_all(
        "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1 </tool_call> then",
        names(),
        false,
    );
    assert_eq!(content.as_deref(), Some("then"));
    assert_eq!(pairs(&calls), vec![("add", r#"{"a":1"#)]);
}

#[test]
fn text_that_is_no_call_stays_content() {
    let (c, calls) = parse_all("a < b and <tool_ is not a tag", names(), false);
    assert_eq!(c.as_deref(), Some("a < b and <tool_ is not a tag"));
    assert!(calls.is_empty());
    // An unknown function or broken JSON: the block stays as text.
    let t = "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>";
    assert_eq!(parse_all(t, names(), false), (Some(t.to_string()), vec![]));
    let (c, calls) = parse_all("<tool_call>{\"name\": \"add\"", names(), false);
    assert_eq!(c.as_deref(), Some("<tool_call>{\"name\": \"add\""));
    assert!(calls.is_empty());
    assert_eq!(parse_all("", names(), false), (None, vec![]));
    // A head longer than a call's: read whole (here: no call).
    let long = format!("<tool_call>{{\"name\": \"{}\"</tool_call>", "x".repeat(400));
    assert_eq!(
        parse_all(&long, names(), false),
        (Some(long.clone()), vec![])
    );
}

#[test]
fn streamed_and_whole_answers_agree_on_long_heads_and_unclosed_calls() {
    let padded = format!(
        "<tool_call>{}{{\"name\": \"add\", \"arguments\": {{\"a\": 1.50}}}}</tool_call>",
        " ".repeat(300)
    );
    let unclosed = "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1}}\nDone.";
    for text in [padded.as_str(), unclosed] {
        let whole = parse_all(text, names(), false);
        for step in [1, 7, 1000] {
            let (content, calls) = gather(streamed(text, step));
            assert_eq!(content, whole.0, "step {step}: {text}");
            assert_eq!(pairs(&calls), pairs(&whole.1), "step {step}: {text}");
        }
    }
    // A head past the limit is read whole (its arguments re-serialized).
    assert_eq!(
        pairs(&parse_all(&padded, names(), false).1),
        vec![("add", r#"{"a":1.5}"#)]
    );
    // Text after a call that never closes is content.
    let (content, calls) = parse_all(unclosed, names(), false);
    assert_eq!(content.as_deref(), Some("Done."));
    assert_eq!(pairs(&calls), vec![("add", r#"{"a":1}"#)]);
}

/// Under a forced call the answer is calls only: a second call's head cut short by the
/// length limit is dropped, not returned as text (whole or streamed).
#[test]
fn a_forced_answer_has_no_text() {
    let text = "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"ad";
    let (content, calls) = parse_all(text, names(), false);
    assert!(content.is_some_and(|c| c.contains("<tool_call>")));
    assert_eq!(calls.len(), 1);
    let (content, calls) = parse_all(text, names(), true);
    assert_eq!(content, None);
    assert_eq!(pairs(&calls), vec![("add", r#"{"a":1}"#)]);
    for step in [1, 3, 7] {
        let mut ts = ToolStream::new(names()).ruled(true.into());
        let mut outs = Vec::new();
        for chunk in text.as_bytes().chunks(step) {
            outs.extend(ts.push(std::str::from_utf8(chunk).unwrap()));
        }
        outs.extend(ts.finish());
        assert_eq!(gather(outs).0, None, "step {step}");
    }
}

/// Text on both sides of a call keeps the whitespace after the call between them (not
/// "sunny.Then"); whitespace after a last call, or before a first, is no content.
#[test]
fn text_around_a_call_keeps_a_separator() {
    let call = "<tool_call>\n{\"name\":\"add\",\"arguments\":{\"a\":1}}\n</tool_call>";
    for (text, want) in [
        (
            format!("It is sunny. {call}\nThen more."),
            Some("It is sunny.\nThen more."),
        ),
        (format!("It is sunny.\n{call}\n\n"), Some("It is sunny.")),
        (format!("{call}\n  Then more."), Some("Then more.")),
        (format!("{call}\n{call} Done"), Some("Done")),
    ] {
        let (content, calls) = parse_all(&text, names(), false);
        assert_eq!(content.as_deref(), want, "{text:?}");
        assert!(!calls.is_empty());
        for step in 1..12 {
            let (c, _) = gather(streamed(&text, step));
            assert_eq!(c.as_deref(), want, "step {step}: {text:?}");
        }
    }
}

/// `parallel_tool_calls: false`: the first call only, whole and streamed; a later block is
/// neither a call nor content.
#[test]
fn at_most_one_call_keeps_the_first() {
    let call = |a: u32| {
        format!("<tool_call>\n{{\"name\":\"add\",\"arguments\":{{\"a\":{a}}}}}\n</tool_call>")
    };
    let text = format!("Sure. {}\n{}", call(1), call(2));
    let one = CallRules {
        forced: false,
        one: true,
    };
    let (content, calls) = parse_all(&text, names(), one);
    assert_eq!(content.as_deref(), Some("Sure."));
    assert_eq!(pairs(&calls), vec![("add", r#"{"a":1}"#)]);
    for step in 1..12 {
        let mut ts = ToolStream::new(names()).ruled(one);
        let chars: Vec<char> = text.chars().collect();
        let mut outs = Vec::new();
        for piece in chars.chunks(step) {
            outs.extend(ts.push(&piece.iter().collect::<String>()));
        }
        outs.extend(ts.finish());
        // Nothing of the dropped call goes out: no head, no argument delta.
        let later = |o: &ToolOut| match o {
            ToolOut::Call(c) => c.index > 0,
            ToolOut::Args { index, .. } => *index > 0,
            ToolOut::Content(_) => false,
        };
        assert!(!outs.iter().any(later), "step {step}");
        let (c, calls) = gather(outs);
        assert_eq!(c.as_deref(), Some("Sure."), "step {step}");
        assert_eq!(pairs(&calls), vec![("add", r#"{"a":1}"#)], "step {step}");
    }
    let (_, calls) = parse_all(&text, names(), false);
    assert_eq!(calls.len(), 2);
}
