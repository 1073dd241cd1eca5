use super::*;

/// The session hints reach the chat request; one that is not a string is refused.
#[test]
fn session_hints_are_passed_to_chat() {
    let body = br#"{"input": "hi", "prompt_cache_key": "conv-1", "user": "alice"}"#;
    let req = parse(body).unwrap();
    let (chat, _) = to_chat(&req, None).unwrap();
    let chat: Value = serde_json::from_slice(&chat).unwrap();
    assert_eq!(chat["prompt_cache_key"], "conv-1");
    assert_eq!(chat["user"], "alice");
    let (chat, _) = to_chat(&parse(br#"{"input": "hi"}"#).unwrap(), None).unwrap();
    let chat: Value = serde_json::from_slice(&chat).unwrap();
    assert!(chat.get("prompt_cache_key").is_none() && chat.get("user").is_none());
    assert!(parse(br#"{"input": "hi", "prompt_cache_key": 3}"#).is_err());
    // And the response object says them, as it says the other settings.
    let echo = Echo::of(&req, "m").object();
    assert_eq!(
        (&echo["user"], &echo["prompt_cache_key"]),
        (&json!("alice"), &json!("conv-1"))
    );
    // An input item's status is one a response gives.
    let item = |s: &str| {
        format!(
            r#"{{"input": [{{"type": "message", "role": "user", "content": "hi", "status": "{s}"}}]}}"#
        )
    };
    assert!(chat_of(&item("completed")).is_ok());
    let null =
        r#"{"input": [{"type": "message", "role": "user", "content": "hi", "status": null}]}"#;
    assert!(chat_of(null).is_ok());
    let e = chat_of(&item("bogus")).unwrap_err().body();
    assert_eq!(e["error"]["param"], "input", "{e}");
    // A wrong type is refused naming the field (the parser's path), as chat's.
    for (body, field) in [
        (
            &br#"{"input": "hi", "prompt_cache_key": ["x"]}"#[..],
            "prompt_cache_key",
        ),
        (br#"{"input": "hi", "user": 5}"#, "user"),
        (br#"{"input": "hi", "temperature": "hot"}"#, "temperature"),
    ] {
        let e = parse(body).unwrap_err().body();
        assert_eq!(e["error"]["param"], field, "{e}");
    }
}

fn chat_of(body: &str) -> Result<Value, ApiError> {
    let (chat, _) = to_chat(&parse(body.as_bytes())?, None)?;
    Ok(serde_json::from_slice(&chat).unwrap())
}

/// Every nested object's keys are read or refused by name, never dropped; an earlier
/// answer's items sent back (with their `id`, `status`, empty `annotations`) are taken.
/// `text` as an array (serde would read `format` from it) is refused by name.
#[test]
fn text_options_as_an_array_are_refused() {
    let e = parse(br#"{"input": "hi", "text": [{"type": "json_object"}]}"#).unwrap_err();
    assert_eq!(e.body()["error"]["param"], "text", "{}", e.body());
    assert!(parse(br#"{"input": "hi", "text": {"format": {"type": "text"}}}"#).is_ok());
}

#[test]
fn nested_keys_are_refused_by_name() {
    let tool = r#"{"type": "function", "name": "f", "parameters": {"type": "object"}"#;
    for (body, param, names) in [
        (r#"{"input": [{"role": "user", "content": "hi", "foo": 1}]}"#.to_string(), "input", "foo"),
        (r#"{"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi", "foo": 1}]}]}"#.into(), "input", "foo"),
        (r#"{"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "foo": 1}]}"#.into(), "input", "foo"),
        (r#"{"input": [{"type": "function_call_output", "call_id": "c", "output": "x", "bar": 2}]}"#.into(), "input", "bar"),
        (format!(r#"{{"input": "hi", "tools": [{tool}, "foo": 1}}]}}"#), "tools", "foo"),
        (format!(r#"{{"input": "hi", "tools": [{tool}}}], "tool_choice": {{"type": "function", "name": "f", "foo": 1}}}}"#), "tool_choice", "foo"),
        (r#"{"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "foo": 1}}}"#.into(), "text", "foo"),
        (r#"{"input": "hi", "text": {"format": {"type": "text", "schema": {"type": "object"}}}}"#.into(), "text", "schema"),
        (r#"{"input": "hi", "text": {"format": {"type": "json_object", "name": "x"}}}"#.into(), "text", "name"),
        (r#"{"input": [{"role": "user", "content": [{"type": "output_text", "text": "a", "annotations": [{"x": 1}]}]}]}"#.into(), "input", "annotations"),
    ] {
        let e = chat_of(&body).unwrap_err().body();
        assert_eq!(e["error"]["param"], param, "{body}: {e}");
        let m = e["error"]["message"].as_str().unwrap();
        assert!(m.contains(&format!("`{names}`")), "{body}: {m}");
    }
    let earlier = r#"{"input": [
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "a", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_1", "status": "completed", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "x"}]}"#;
    let chat = chat_of(earlier).unwrap();
    assert_eq!(chat["messages"].as_array().unwrap().len(), 3, "{chat}");
    // Kinds are named as the request wrote them, and a chat-shaped tool is told why.
    let e = chat_of(r#"{"input": [{"role": "tool", "content": "x"}]}"#)
        .unwrap_err()
        .body();
    assert_eq!(
        e["error"]["message"],
        "an input message's role `tool`: developer, system, user or assistant"
    );
    let e =
        chat_of(r#"{"input": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}"#)
            .unwrap_err()
            .body();
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not in a `function` object"),
        "{e}"
    );
}

/// An answer cut by `max_output_tokens`: the response is incomplete, and so is its last
/// item (the one cut), not the items before it.
#[test]
fn the_item_cut_by_the_token_limit_is_incomplete() {
    let req = parse(br#"{"input": "hi"}"#).unwrap();
    let echo = Echo::of(&req, "m");
    let chat = |finish: &str| {
        json!({"choices": [{"finish_reason": finish, "message": {
        "content": "text", "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{\"a\":"}}]}}], "usage": {}})
    };
    let (r, _) = from_chat(&chat("length"), &echo);
    assert_eq!(r["status"], "incomplete");
    assert_eq!(r["output"][0]["status"], "completed", "{r}");
    assert_eq!(r["output"][1]["status"], "incomplete", "{r}");
    // A whole call and text cut: the message is the item cut.
    let mut whole = chat("length");
    whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = json!("{}");
    let (r, _) = from_chat(&whole, &echo);
    assert_eq!(r["output"][0]["status"], "incomplete", "{r}");
    assert_eq!(r["output"][1]["status"], "completed", "{r}");
    let (r, _) = from_chat(&chat("stop"), &echo);
    assert_eq!(r["status"], "completed");
    assert!(r["output"]
        .as_array()
        .unwrap()
        .iter()
        .all(|i| i["status"] == "completed"));
}

/// A temperature or top_p beyond f32 reaches chat's own check as given (it was read as an
/// f32, became infinite, was written as `null` and served with the default).
#[test]
fn an_out_of_range_sampling_value_reaches_chat_as_given() {
    for field in ["temperature", "top_p"] {
        let body = format!(r#"{{"input": "hi", "{field}": 1e39}}"#);
        let req = parse(body.as_bytes()).unwrap();
        let (chat, _) = to_chat(&req, None).unwrap();
        let chat: Value = serde_json::from_slice(&chat).unwrap();
        assert_eq!(chat[field], json!(1e39), "{field}: {chat}");
    }
}

/// `metadata` has chat's bounds: 16 tags, keys of 64 characters, values of 512 (a 3 MB value
/// was accepted and echoed).
#[test]
fn metadata_past_openais_bounds_is_refused() {
    let long = "v".repeat(513);
    let key = "k".repeat(65);
    for body in [
        format!(r#"{{"input": "hi", "metadata": {{"a": "{long}"}}}}"#),
        format!(r#"{{"input": "hi", "metadata": {{"{key}": "v"}}}}"#),
        r#"{"input": "hi", "metadata": {"a": 1}}"#.to_string(),
    ] {
        let e = chat_of(&body).unwrap_err().body();
        assert_eq!(e["error"]["param"], "metadata", "{e}");
    }
    let fits = format!(
        r#"{{"input": "hi", "metadata": {{"{}": "{}"}}}}"#,
        &key[1..],
        &long[1..]
    );
    chat_of(&fits).unwrap();
}
