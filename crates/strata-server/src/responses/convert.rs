//! A Responses request as a chat request, and a chat answer as a response object.

use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;

/// `POST /v1/responses`' body (the fields served; any other is refused by name).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    pub input: Input,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub stream: Option<bool>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub text: Option<TextOptions>,
    pub previous_response_id: Option<String>,
    /// Keep the conversation for a later `previous_response_id` (default true).
    pub store: Option<bool>,
    /// Echoed back, at most 16 string pairs.
    pub metadata: Option<serde_json::Map<String, Value>>,
    /// Only `disabled` (a prompt longer than the context is refused, never cut).
    pub truncation: Option<String>,
    /// The session hints, passed to the chat request (the prefix cache's session).
    pub prompt_cache_key: Option<String>,
    pub user: Option<String>,
}

/// `input`: a text (one user message) or items.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<Value>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextOptions {
    pub format: Option<Value>,
}

/// The request's fields ([`ResponsesRequest`]'s).
const FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "previous_response_id",
    "store",
    "metadata",
    "truncation",
    "prompt_cache_key",
    "user",
];

/// Fields taken only with a value that asks for nothing (null, false, empty, 0; for
/// `service_tier`, `auto` or `default`): what SDKs send by default.
const NEUTRAL: &[&str] = &[
    "include",
    "reasoning",
    "top_logprobs",
    "background",
    "service_tier",
    "stream_options",
    "conversation",
    "prompt",
    "max_tool_calls",
    "safety_identifier",
];

/// The request, any field this endpoint does not serve refused by name (`reasoning` with an
/// effort, `include` with items, ...).
pub fn parse(body: &[u8]) -> Result<ResponsesRequest, ApiError> {
    // Read as a map below (the last of a key given twice kept): refused first, as chat does.
    crate::body::no_duplicate_keys(body)?;
    let Ok(serde_json::Value::Object(mut m)) = serde_json::from_slice::<Value>(body) else {
        return crate::body::parse_json(body); // the parser names what is wrong
    };
    // Fields a client sends with values that ask for nothing: taken as the absence they are.
    let neutral = |k: &str, v: &Value| {
        NEUTRAL.contains(&k)
            && match v {
                Value::Null | Value::Bool(false) => true,
                Value::Bool(true) => false,
                Value::Array(a) => a.is_empty(),
                Value::Object(o) => o.is_empty(),
                Value::Number(n) => n.as_f64() == Some(0.0),
                // An end user's id asks for nothing of the answer (a no-op, as on chat).
                Value::String(_) if k == "safety_identifier" => true,
                Value::String(s) => k == "service_tier" && matches!(s.as_str(), "auto" | "default"),
            }
    };
    match m
        .iter()
        .find(|(k, v)| !FIELDS.contains(&k.as_str()) && !neutral(k, v))
        .map(|(k, _)| k)
    {
        Some(k) => Err(bad(
            format!("`{k}` is not served by /v1/responses (docs/API.md lists the fields)"),
            k,
        )),
        None => {
            m.retain(|k, _| FIELDS.contains(&k.as_str()));
            let m = Value::Object(m);
            crate::body::objects_at(&m, &["text"])?;
            crate::body::from_value(m)
        }
    }
}

fn bad(msg: impl Into<String>, field: &str) -> ApiError {
    ApiError::bad_request(msg, Some(field))
}

/// Most input items one request may carry.
const MAX_ITEMS: usize = 4096;

/// A nested object's keys, each one this endpoint reads (or, as `id`, `status`, `annotations`
/// and `logprobs` of an earlier answer's items sent back, one that asks for nothing): any
/// other is refused by name, never dropped unseen.
fn only_keys(o: &Value, keys: &[&str], what: &str, param: &str) -> Result<(), ApiError> {
    match crate::body::unread_key(o, keys) {
        Some(k) => Err(bad(
            format!("{what}: `{k}` is not served (it takes {})", keys.join(", ")),
            param,
        )),
        None => Ok(()),
    }
}

/// A `type` (or `role`) as a message names it.
fn kind(t: Option<&str>) -> String {
    t.map_or("none".into(), |t| format!("`{t}`"))
}

/// A message item's text: a string, or its `input_text` / `output_text` parts joined.
fn item_text(content: &Value) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                match (p["type"].as_str(), p["text"].as_str()) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => {
                        let keys = ["type", "text", "annotations", "logprobs"];
                        only_keys(p, &keys, "a text part", "input")?;
                        for k in ["annotations", "logprobs"] {
                            if p[k].as_array().is_some_and(|a| !a.is_empty()) {
                                let msg = format!("a text part's `{k}`: only an empty list");
                                return Err(bad(msg, "input"));
                            }
                        }
                        out += t
                    }
                    (t @ Some("input_text" | "output_text" | "text"), None) => {
                        let msg = format!("a content part of type {} has no `text`", kind(t));
                        return Err(bad(msg, "input"));
                    }
                    (t, _) => {
                        let msg = format!(
                            "input content part of type {}: only text parts are served",
                            kind(t)
                        );
                        return Err(bad(msg, "input"));
                    }
                }
            }
            Ok(out)
        }
        _ => Err(bad(
            "a message's content is a text or a list of text parts",
            "input",
        )),
    }
}

/// An item given back as a response listed it: its status, where it has one, is one a
/// response gives (null asks for nothing, as a pydantic dump writes it).
fn check_status(it: &Value) -> Result<(), ApiError> {
    match it.get("status") {
        None | Some(Value::Null) => Ok(()),
        Some(s) if matches!(s.as_str(), Some("in_progress" | "completed" | "incomplete")) => Ok(()),
        Some(s) => Err(bad(
            format!("an input item's status {s}: in_progress, completed or incomplete"),
            "input",
        )),
    }
}

/// Input items → chat messages (consecutive function calls become one assistant message).
fn messages_of(items: &[Value], out: &mut Vec<Value>) -> Result<(), ApiError> {
    if items.len() > MAX_ITEMS {
        return Err(bad(
            format!("{} input items: at most {MAX_ITEMS}", items.len()),
            "input",
        ));
    }
    for it in items {
        check_status(it)?;
        match it["type"].as_str().unwrap_or("message") {
            "message" => {
                only_keys(
                    it,
                    &["type", "role", "content", "id", "status"],
                    "a message",
                    "input",
                )?;
                let role = match it["role"].as_str() {
                    Some("developer" | "system") => "system",
                    Some(r @ ("user" | "assistant")) => r,
                    r => {
                        let msg = format!(
                            "an input message's role {}: developer, system, user or assistant",
                            kind(r)
                        );
                        return Err(bad(msg, "input"));
                    }
                };
                out.push(json!({"role": role, "content": item_text(&it["content"])?}));
            }
            "function_call" => {
                let keys = ["type", "call_id", "name", "arguments", "id", "status"];
                only_keys(it, &keys, "a function_call item", "input")?;
                let (Some(id), Some(name), Some(args)) = (
                    it["call_id"].as_str(),
                    it["name"].as_str(),
                    it["arguments"].as_str(),
                ) else {
                    return Err(bad(
                        "a function_call item needs call_id, name and arguments",
                        "input",
                    ));
                };
                let call = json!({"id": id, "type": "function",
                                  "function": {"name": name, "arguments": args}});
                match out.last_mut() {
                    Some(m) if m["role"] == "assistant" && m["tool_calls"].is_array() => {
                        m["tool_calls"].as_array_mut().expect("an array").push(call)
                    }
                    _ => out
                        .push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let keys = ["type", "call_id", "output", "id", "status"];
                only_keys(it, &keys, "a function_call_output item", "input")?;
                let (Some(id), Some(output)) = (it["call_id"].as_str(), it["output"].as_str())
                else {
                    return Err(bad(
                        "a function_call_output item needs call_id and output (a text)",
                        "input",
                    ));
                };
                out.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
            }
            t => {
                return Err(bad(
                    format!("input items of type `{t}` are not served"),
                    "input",
                ))
            }
        }
    }
    Ok(())
}

/// Flat function tools → chat tools.
fn tools_of(tools: &[Value]) -> Result<Vec<Value>, ApiError> {
    tools
        .iter()
        .map(|t| match (t["type"].as_str(), t["name"].as_str()) {
            (Some("function"), Some(name)) => {
                let keys = ["type", "name", "description", "parameters", "strict"];
                only_keys(t, &keys, "a function tool", "tools")?;
                let mut f = json!({"name": name});
                for k in ["description", "parameters", "strict"] {
                    if !t[k].is_null() {
                        f[k] = t[k].clone();
                    }
                }
                Ok(json!({"type": "function", "function": f}))
            }
            (Some("function"), None) if t["function"].is_object() => Err(bad(
                "a function tool names itself at its top level here (`{\"type\": \"function\", \"name\": ...}`), not in a `function` object as in chat",
                "tools",
            )),
            (Some("function"), None) => Err(bad("a function tool without a `name`", "tools")),
            (ty, _) => Err(bad(
                format!("a tool of type {}: only function tools are served", kind(ty)),
                "tools",
            )),
        })
        .collect()
}

/// The chat request's body, and the conversation to keep (its messages but the instructions).
pub fn to_chat(
    req: &ResponsesRequest,
    earlier: Option<&[Value]>,
) -> Result<(Vec<u8>, Vec<Value>), ApiError> {
    if let Some(t) = req.truncation.as_deref().filter(|t| *t != "disabled") {
        return Err(bad(
            format!("truncation `{t}`: only `disabled` (a prompt is refused, never cut)"),
            "truncation",
        ));
    }
    if let Some(m) = &req.metadata {
        if !crate::fields::tags_fit(m) {
            return Err(bad(
                "metadata: at most 16 string values, keys of at most 64 characters, values \
                 of at most 512",
                "metadata",
            ));
        }
    }
    let mut conversation: Vec<Value> = earlier.map(<[Value]>::to_vec).unwrap_or_default();
    match &req.input {
        Input::Text(t) => conversation.push(json!({"role": "user", "content": t})),
        Input::Items(items) => messages_of(items, &mut conversation)?,
    }
    let mut messages = Vec::with_capacity(conversation.len() + 1);
    if let Some(i) = &req.instructions {
        messages.push(json!({"role": "system", "content": i}));
    }
    messages.extend(conversation.iter().cloned());
    let mut body = json!({"messages": messages});
    if let Some(n) = req.max_output_tokens {
        body["max_tokens"] = json!(n);
    }
    for (k, v) in [("temperature", req.temperature), ("top_p", req.top_p)] {
        if let Some(v) = v {
            body[k] = json!(v);
        }
    }
    if let Some(t) = &req.tools {
        body["tools"] = json!(tools_of(t)?);
    }
    if let Some(c) = &req.tool_choice {
        body["tool_choice"] = match c {
            Value::String(_) => c.clone(),
            Value::Object(o) if o.get("type") == Some(&json!("function")) => {
                only_keys(c, &["type", "name"], "tool_choice", "tool_choice")?;
                json!({"type": "function", "function": {"name": o.get("name").cloned().unwrap_or(Value::Null)}})
            }
            _ => {
                return Err(bad(
                    "tool_choice: auto, none, required or {\"type\": \"function\", \"name\"}",
                    "tool_choice",
                ))
            }
        };
    }
    if let Some(p) = req.parallel_tool_calls {
        body["parallel_tool_calls"] = json!(p);
    }
    for (k, v) in [
        ("prompt_cache_key", &req.prompt_cache_key),
        ("user", &req.user),
    ] {
        if let Some(v) = v {
            body[k] = json!(v);
        }
    }
    if let Some(f) = req.text.as_ref().and_then(|t| t.format.as_ref()) {
        if let Some(rf) = response_format(f)? {
            body["response_format"] = rf;
        }
    }

    if req.stream == Some(true) {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    Ok((body.to_string().into_bytes(), conversation))
}

/// `text.format` → chat's `response_format` (None: plain text).
fn response_format(f: &Value) -> Result<Option<Value>, ApiError> {
    let t = f["type"].as_str();
    let keys: &[&str] = match t {
        Some("json_schema") => &["type", "name", "schema", "strict", "description"],
        _ => &["type"],
    };
    only_keys(f, keys, &format!("text.format of type {}", kind(t)), "text")?;
    Ok(match t {
        Some("text") => None,
        Some("json_object") => Some(json!({"type": "json_object"})),
        Some("json_schema") => {
            let mut js = json!({"name": f["name"].as_str().unwrap_or("output")});
            for k in ["schema", "strict", "description"] {
                if !f[k].is_null() {
                    js[k] = f[k].clone();
                }
            }
            Some(json!({"type": "json_schema", "json_schema": js}))
        }
        t => {
            return Err(bad(
                format!(
                    "text.format of type {}: text, json_object or json_schema",
                    kind(t)
                ),
                "text",
            ))
        }
    })
}

/// A chat refusal's `param` in the Responses request's terms.
/// With `instructions`, they are the chat's first message: its refusal names them.
pub fn rename_param(mut e: ApiError, instructions: bool) -> ApiError {
    let first = instructions && e.message.starts_with("messages[0]");
    let renamed = match e.param.as_deref() {
        Some("messages") if first => Some("instructions"),
        Some("messages" | "prompt") => Some("input"),
        Some("max_tokens") => Some("max_output_tokens"),
        Some("response_format") => Some("text"),
        _ => None,
    };
    if let Some(r) = renamed {
        e.param = Some(r.into());
    }
    e
}

/// What a response object echoes of its request.
#[derive(Clone, Debug)]
pub struct Echo {
    pub id: String,
    pub created_at: u64,
    fields: Value,
}

impl Echo {
    pub fn of(req: &ResponsesRequest, model: &str) -> Echo {
        let format = req
            .text
            .as_ref()
            .and_then(|t| t.format.clone())
            .unwrap_or(json!({"type": "text"}));
        Echo {
            id: format!("resp_{}", crate::state::fresh_id()),
            created_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            fields: json!({
                "model": model,
                "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens,
                "temperature": req.temperature.unwrap_or(1.0),
                "top_p": req.top_p.unwrap_or(1.0),
                "tools": req.tools.clone().unwrap_or_default(),
                "tool_choice": req.tool_choice.clone().unwrap_or(json!("auto")),
                "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true),
                "previous_response_id": req.previous_response_id,
                "text": {"format": format},
                "truncation": "disabled",
                "store": req.store != Some(false),
                "metadata": req.metadata.clone().unwrap_or_default(),
                "user": req.user,
                "prompt_cache_key": req.prompt_cache_key,
            }),
        }
    }

    /// The response object's fields but output, status and usage.
    pub fn object(&self) -> Value {
        let mut r = json!({"id": self.id, "object": "response", "created_at": self.created_at,
                           "error": null, "incomplete_details": null});
        for (k, v) in self.fields.as_object().expect("an object") {
            r[k] = v.clone();
        }
        r
    }
}

/// A function call output item.
pub fn call_item(call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": format!("fc_{}", crate::state::fresh_id()),
           "call_id": call_id, "name": name, "arguments": arguments, "status": status})
}

/// A message output item with its text.
pub fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": []}]})
}

/// Chat usage → Responses usage.
pub fn usage(u: &Value) -> Value {
    let (i, o) = (
        u["prompt_tokens"].as_u64().unwrap_or(0),
        u["completion_tokens"].as_u64().unwrap_or(0),
    );
    let cached = u["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    json!({"input_tokens": i, "input_tokens_details": {"cached_tokens": cached},
           "output_tokens": o, "output_tokens_details": {"reasoning_tokens": 0},
           "total_tokens": i + o})
}

/// `completed`, or `incomplete` with its reason.
pub fn status(finish: &str, r: &mut Value) {
    if finish == "length" {
        r["status"] = json!("incomplete");
        r["incomplete_details"] = json!({"reason": "max_output_tokens"});
    } else {
        r["status"] = json!("completed");
    }
}

/// A chat completion → the response object, and the assistant message to keep.
pub fn from_chat(chat: &Value, echo: &Echo) -> (Value, Value) {
    let choice = &chat["choices"][0];
    let msg = &choice["message"];
    let mut output = Vec::new();
    if let Some(t) = msg["content"].as_str().filter(|t| !t.is_empty()) {
        output.push(message_item(
            &format!("msg_{}", crate::state::fresh_id()),
            t,
            "completed",
        ));
    }
    for c in msg["tool_calls"].as_array().into_iter().flatten() {
        let f = &c["function"];
        output.push(call_item(
            c["id"].as_str().unwrap_or(""),
            f["name"].as_str().unwrap_or(""),
            f["arguments"].as_str().unwrap_or(""),
            "completed",
        ));
    }
    let finish = choice["finish_reason"].as_str().unwrap_or("stop");
    if finish == "length" {
        // The item `max_output_tokens` cut: a call whose arguments it broke off, else the
        // text (the message holds all of it, wherever it was written), else the last item.
        let broken = |i: &Value| {
            i["type"] == "function_call"
                && serde_json::from_str::<Value>(i["arguments"].as_str().unwrap_or("")).is_err()
        };
        let cut = output
            .iter()
            .position(broken)
            .or_else(|| output.iter().position(|i| i["type"] == "message"))
            .or(output.len().checked_sub(1));
        if let Some(i) = cut {
            output[i]["status"] = json!("incomplete");
        }
    }
    let mut r = echo.object();
    status(finish, &mut r);
    r["output"] = Value::Array(output);
    r["usage"] = usage(&chat["usage"]);
    let said = json!({"role": "assistant", "content": msg["content"].clone(),
                      "tool_calls": msg["tool_calls"].clone()});
    (r, said)
}

/// The conversation with the answer's message (tool calls kept only when there were some).
pub fn with_answer(mut conversation: Vec<Value>, mut said: Value) -> Vec<Value> {
    if !said["tool_calls"].is_array() {
        said.as_object_mut()
            .expect("an object")
            .remove("tool_calls");
    }
    conversation.push(said);
    conversation
}

#[cfg(test)]
mod tests;
