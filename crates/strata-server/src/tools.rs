//! Tool calling in a documented generic format (the served models' chat templates have no
//! tool support): the tools are rendered into the system message, the model answers a call
//! as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, and the answer is parsed
//! back into OpenAI's `tool_calls` (streamed as one delta per completed call).
//!
//! `tool_choice`: `none` (tools shown, nothing parsed), `auto` (shown; calls the model
//! writes are parsed), `required` (at least one call, or exactly one without
//! `parallel_tool_calls`) and a named function (one call of it): the last two constrain the
//! output with a grammar, so every call's arguments validate against the tool's schema.

use serde_json::{json, Value};
use strata_protocol::OutputConstraint;

use crate::api::{ChatRequest, ToolDef};
use crate::error::ApiError;

/// Most tools one request may define.
pub const MAX_TOOLS: usize = 128;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's tools and how they may be used.
#[derive(Clone, Debug)]
pub struct Tools {
    pub defs: Vec<ToolDef>,
    pub choice: ToolChoice,
    pub parallel: bool,
}

fn bad(msg: impl Into<String>, field: &str) -> ApiError {
    ApiError::bad_request(msg, Some(field))
}

fn choice_of(v: Option<&Value>) -> Result<Option<ToolChoice>, ApiError> {
    let f = "tool_choice";
    Ok(match v {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(
                    format!("tool_choice `{other}`: none, auto, required or a named function"),
                    f,
                ))
            }
        }),
        Some(o) => {
            let name = (o.get("type") == Some(&json!("function")))
                .then(|| o.pointer("/function/name").and_then(Value::as_str))
                .flatten()
                .ok_or_else(|| {
                    bad(
                        "tool_choice: expected {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        f,
                    )
                })?;
            Some(ToolChoice::Named(name.to_string()))
        }
    })
}

fn check_def(i: usize, d: &ToolDef, seen: &mut Vec<String>) -> Result<(), ApiError> {
    let f = "tools";
    if d.kind != "function" {
        return Err(bad(
            format!("tools[{i}].type `{}`: only function", d.kind),
            f,
        ));
    }
    let n = &d.function.name;
    let ok = !n.is_empty()
        && n.len() <= 64
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !ok {
        return Err(bad(
            format!("tools[{i}].function.name: 1 to 64 of a-z, A-Z, 0-9, _ and -"),
            f,
        ));
    }
    if seen.contains(n) {
        return Err(bad(
            format!("tools[{i}]: the function `{n}` is defined twice"),
            f,
        ));
    }
    seen.push(n.clone());
    if let Some(p) = &d.function.parameters {
        if !p.is_object() {
            return Err(bad(
                format!("tools[{i}].function.parameters: a JSON schema object"),
                f,
            ));
        }
    }
    Ok(())
}

/// The request's tools, checked (None: no tools and no tool choice that needs them).
pub fn tools_of(req: &ChatRequest) -> Result<Option<Tools>, ApiError> {
    let defs = req.tools.clone().unwrap_or_default();
    let choice = choice_of(req.tool_choice.as_ref())?;
    if defs.is_empty() {
        return match choice {
            None | Some(ToolChoice::None | ToolChoice::Auto) => Ok(None),
            Some(_) => Err(bad("tool_choice needs tools", "tool_choice")),
        };
    }
    if defs.len() > MAX_TOOLS {
        return Err(bad(
            format!("{} tools: at most {MAX_TOOLS}", defs.len()),
            "tools",
        ));
    }
    let mut seen = Vec::new();
    for (i, d) in defs.iter().enumerate() {
        check_def(i, d, &mut seen)?;
    }
    let choice = choice.unwrap_or(ToolChoice::Auto);
    if let ToolChoice::Named(n) = &choice {
        if !seen.contains(n) {
            return Err(bad(
                format!("tool_choice names `{n}`, which is not among the tools"),
                "tool_choice",
            ));
        }
    }
    Ok(Some(Tools {
        defs,
        choice,
        parallel: req.parallel_tool_calls.unwrap_or(true),
    }))
}

impl Tools {
    /// The tools as the prompt shows them: with every `tool_choice`, `none` included (vLLM's
    /// default), so an agent's last answer keeps the prompt, and the cached prefix, its calls
    /// had.
    pub fn shown(&self) -> &[ToolDef] {
        &self.defs
    }

    /// The names of the functions the answer may call (None: the answer is not parsed).
    pub fn callable(&self) -> Option<Vec<String>> {
        (self.choice != ToolChoice::None)
            .then(|| self.defs.iter().map(|d| d.function.name.clone()).collect())
    }

    /// The grammar of the answer when calls are forced (`required`, a named function).
    pub fn constraint(&self) -> Option<OutputConstraint> {
        let (defs, many): (Vec<&ToolDef>, bool) = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => (self.defs.iter().collect(), self.parallel),
            ToolChoice::Named(n) => (
                self.defs.iter().filter(|d| &d.function.name == n).collect(),
                false,
            ),
        };
        let mut g = String::new();
        g += if many {
            "start: call (\"\\n\" call)*\n"
        } else {
            "start: call\n"
        };
        let alts: Vec<String> = (0..defs.len()).map(|i| format!("f{i}")).collect();
        g += &format!(
            "call: {} ({}) {}\n",
            lark_str(&format!("{OPEN}\n")),
            alts.join(" | "),
            lark_str(&format!("\n{CLOSE}"))
        );
        for (i, d) in defs.iter().enumerate() {
            let mut args = d
                .function
                .parameters
                .clone()
                .unwrap_or_else(|| json!({"type": "object"}));
            closed(&mut args, 0);
            let defs = hoist_defs(&mut args);
            let mut schema = json!({
                "type": "object",
                "properties": {"name": {"const": d.function.name}, "arguments": args},
                "required": ["name", "arguments"],
                "additionalProperties": false,
                "x-guidance": {"whitespace_flexible": false},
            });
            schema.as_object_mut().expect("an object").extend(defs);
            g += &format!("f{i}: %json {schema}\n");
        }
        Some(OutputConstraint::Lark(g))
    }
}

/// Objects of an argument schema that list their properties and say nothing of others take
/// only those (`additionalProperties: false`): a forced call writes the arguments the tool
/// names, not invented ones; a `strict` response format likewise. Nested schemas too, to a
/// bounded depth.
pub(crate) fn closed(schema: &mut Value, depth: usize) {
    let Some(o) = schema.as_object_mut() else {
        return;
    };
    if depth > 32 {
        return;
    }
    if o.contains_key("properties") && !o.contains_key("additionalProperties") {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    for (k, v) in o.iter_mut() {
        match (k.as_str(), v) {
            ("properties" | "$defs" | "definitions" | "patternProperties", Value::Object(m)) => {
                m.values_mut().for_each(|s| closed(s, depth + 1))
            }
            ("items" | "additionalProperties" | "not" | "if" | "then" | "else", s) => {
                closed(s, depth + 1)
            }
            ("anyOf" | "oneOf" | "allOf" | "prefixItems", Value::Array(a)) => {
                a.iter_mut().for_each(|s| closed(s, depth + 1))
            }
            _ => {}
        }
    }
}

/// The arguments' schema goes under the call's `properties.arguments`: its definitions
/// (`$defs`, `definitions`) move to the call schema's root, where `#/$defs/..` references
/// still find them, and its other local references (`#`, `#/properties/..`) are re-rooted
/// under `#/properties/arguments`. Returns the definitions to put at the root.
fn hoist_defs(args: &mut Value) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    if let Some(o) = args.as_object_mut() {
        for key in ["$defs", "definitions"] {
            if let Some(d) = o.remove(key) {
                out.push((key.to_string(), d));
            }
        }
    }
    reroot(args, 0);
    for (_, d) in &mut out {
        reroot(d, 0);
    }
    out
}

/// Re-roots the local references of a schema moved under `#/properties/arguments` (those
/// into the definitions stay), to a bounded depth.
fn reroot(v: &mut Value, depth: usize) {
    if depth > 64 {
        return;
    }
    match v {
        Value::Object(o) => {
            for (k, x) in o.iter_mut() {
                if let (true, Value::String(r)) = (k == "$ref", &mut *x) {
                    let into_defs = r.starts_with("#/$defs/") || r.starts_with("#/definitions/");
                    if (r == "#" || r.starts_with("#/")) && !into_defs {
                        *r = format!("#/properties/arguments{}", &r[1..]);
                    }
                } else {
                    reroot(x, depth + 1);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| reroot(x, depth + 1)),
        _ => {}
    }
}

fn lark_str(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// The system text that shows the tools to the model.
pub fn system_text(defs: &[ToolDef]) -> String {
    const INTRO: [&str; 5] = [
        "# Tools",
        "",
        "You may call one or more functions to assist with the user query.",
        "",
        "You are provided with function signatures within <tools></tools> XML tags:",
    ];
    const HOW: [&str; 6] = [
        "</tools>",
        "",
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:",
        "<tool_call>",
        r#"{"name": <function-name>, "arguments": <args-json-object>}"#,
        "</tool_call>",
    ];
    let mut lines: Vec<String> = INTRO.iter().map(|l| l.to_string()).collect();
    lines.push("<tools>".into());
    lines.extend(
        defs.iter()
            .map(|d| serde_json::to_string(d).expect("a tool serializes")),
    );
    lines.extend(HOW.iter().map(|l| l.to_string()));
    lines.join("\n")
}

/// An earlier call as the model wrote it (assistant messages of the history), byte for byte
/// what a forced call generates: `{"name":…,"arguments":…}` in that order, the arguments'
/// JSON text as given (their keys in the order written), so the tokens the call generated are
/// the prompt's next time and their cached K/V serves it. Arguments that are not JSON are shown
/// as a JSON string.
pub fn call_text(name: &str, arguments: &str) -> String {
    let args = match serde_json::from_str::<Value>(arguments) {
        Ok(_) => arguments.trim().to_string(),
        Err(_) => Value::String(arguments.into()).to_string(),
    };
    format!(
        "{OPEN}\n{{\"name\":{},\"arguments\":{args}}}\n{CLOSE}",
        Value::String(name.into())
    )
}

/// A tool's answer as the prompt shows it.
pub fn response_text(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

/// One parsed call.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    /// Its place among the answer's calls.
    pub index: usize,
    pub id: String,
    pub name: String,
    /// JSON text.
    pub arguments: String,
}

impl Call {
    /// As a whole message's `tool_calls` entry.
    pub fn json(&self) -> Value {
        json!({"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}})
    }

    /// As a streamed delta's entry (with its index).
    pub fn delta_json(&self) -> Value {
        let mut v = self.json();
        v["index"] = json!(self.index);
        v
    }
}

/// What the answer's text turns into.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolOut {
    Content(String),
    Call(Call),
}

/// The answer's text → content and calls, incrementally (a stream) or at once (push all,
/// then finish). Text that may begin a call is held back until it is known.
#[derive(Debug)]
pub struct ToolStream {
    names: Vec<String>,
    buf: String,
    in_call: bool,
    /// Whitespace after a call is no content.
    after_call: bool,
    pub calls: usize,
}

fn parse_call(body: &str, names: &[String], index: usize) -> Option<Call> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?;
    if !names.iter().any(|n| n == name) {
        return None;
    }
    let arguments = match v.get("arguments")? {
        Value::String(s) => s.clone(),
        a @ Value::Object(_) => a.to_string(),
        _ => return None,
    };
    Some(Call {
        index,
        id: format!("call_{}", crate::state::fresh_id()),
        name: name.to_string(),
        arguments,
    })
}

/// Length of the longest suffix of `s` that is a proper prefix of `pat`.
fn partial_suffix(s: &str, pat: &str) -> usize {
    (1..pat.len().min(s.len() + 1))
        .rev()
        .find(|&k| s.is_char_boundary(s.len() - k) && pat.starts_with(&s[s.len() - k..]))
        .unwrap_or(0)
}

impl ToolStream {
    pub fn new(names: Vec<String>) -> ToolStream {
        ToolStream {
            names,
            buf: String::new(),
            in_call: false,
            after_call: false,
            calls: 0,
        }
    }

    fn content(&mut self, mut s: String, out: &mut Vec<ToolOut>) {
        if self.after_call {
            s = s.trim_start().to_string();
            if !s.is_empty() {
                self.after_call = false;
            }
        }
        if !s.is_empty() {
            out.push(ToolOut::Content(s));
        }
    }

    pub fn push(&mut self, delta: &str) -> Vec<ToolOut> {
        self.buf += delta;
        let mut out = Vec::new();
        loop {
            if !self.in_call {
                if let Some(i) = self.buf.find(OPEN) {
                    let before = self.buf[..i].trim_end().to_string();
                    self.buf.drain(..i + OPEN.len());
                    self.content(before, &mut out);
                    self.in_call = true;
                    continue;
                }
                // Held back: what may begin a call, and the whitespace before it (no content
                // if a call follows).
                let partial = partial_suffix(&self.buf, OPEN);
                let head = &self.buf[..self.buf.len() - partial];
                let keep = partial + (head.len() - head.trim_end().len());
                let ready: String = self.buf.drain(..self.buf.len() - keep).collect();
                self.content(ready, &mut out);
                break;
            }
            let Some(j) = self.buf.find(CLOSE) else {
                break;
            };
            let body: String = self.buf.drain(..j + CLOSE.len()).collect();
            let body = &body[..j];
            self.in_call = false;
            match parse_call(body, &self.names, self.calls) {
                Some(c) => {
                    self.calls += 1;
                    self.after_call = true;
                    out.push(ToolOut::Call(c));
                }
                None => out.push(ToolOut::Content(format!("{OPEN}{body}{CLOSE}"))),
            }
        }
        out
    }

    /// The rest: text held back, or a call never closed (as content).
    pub fn finish(&mut self) -> Vec<ToolOut> {
        let rest = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        if self.in_call {
            self.in_call = false;
            out.push(ToolOut::Content(format!("{OPEN}{rest}")));
        } else {
            self.content(rest, &mut out);
        }
        out
    }
}

/// A whole answer's text → (content, calls).
pub fn parse_all(text: &str, names: Vec<String>) -> (Option<String>, Vec<Call>) {
    let mut ts = ToolStream::new(names);
    let mut outs = ts.push(text);
    outs.extend(ts.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for o in outs {
        match o {
            ToolOut::Content(c) => content += &c,
            ToolOut::Call(c) => calls.push(c),
        }
    }
    ((!content.is_empty()).then_some(content), calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["get_weather".into(), "add".into()]
    }

    #[test]
    fn a_history_call_is_rendered_as_a_forced_call_writes_it() {
        let t = call_text("search_docs", "{\"query\":\"cache\",\"k\":1}");
        assert_eq!(
            t,
            "<tool_call>\n{\"name\":\"search_docs\",\"arguments\":{\"query\":\"cache\",\"k\":1}}\n</tool_call>"
        );
        // Not JSON: a JSON string, so the block stays one JSON object.
        let t = call_text("f", "not json");
        assert!(t.contains("\"arguments\":\"not json\"}"), "{t}");
    }

    #[test]
    fn calls_are_parsed_from_the_text_in_any_split() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\":\"add\",\"arguments\":{\"a\":1}}\n</tool_call>";
        let (content, calls) = parse_all(text, names());
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, r#"{"city":"Paris"}"#);
        assert_eq!(calls[1].arguments, r#"{"a":1}"#);
        // Streamed in pieces of every size: the same content and calls.
        for step in 1..12 {
            let mut ts = ToolStream::new(names());
            let mut outs = Vec::new();
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(step) {
                outs.extend(ts.push(&piece.iter().collect::<String>()));
            }
            outs.extend(ts.finish());
            let content: String = outs
                .iter()
                .filter_map(|o| match o {
                    ToolOut::Content(c) => Some(c.as_str()),
                    _ => None,
                })
                .collect();
            let got: Vec<(&str, &str)> = outs
                .iter()
                .filter_map(|o| match o {
                    ToolOut::Call(c) => Some((c.name.as_str(), c.arguments.as_str())),
                    _ => None,
                })
                .collect();
            assert_eq!(content, "Let me check.", "step {step}");
            assert_eq!(
                got,
                vec![
                    ("get_weather", r#"{"city":"Paris"}"#),
                    ("add", r#"{"a":1}"#)
                ]
            );
        }
    }

    #[test]
    fn text_that_is_no_call_stays_content() {
        let (c, calls) = parse_all("a < b and <tool_ is not a tag", names());
        assert_eq!(c.as_deref(), Some("a < b and <tool_ is not a tag"));
        assert!(calls.is_empty());
        // An unknown function or broken JSON: the block stays as text.
        let t = "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>";
        assert_eq!(parse_all(t, names()), (Some(t.to_string()), vec![]));
        let (c, calls) = parse_all("<tool_call>{\"name\": \"add\"", names());
        assert_eq!(c.as_deref(), Some("<tool_call>{\"name\": \"add\""));
        assert!(calls.is_empty());
        assert_eq!(parse_all("", names()), (None, vec![]));
    }

    #[test]
    fn forced_calls_get_a_grammar_of_the_tools() {
        let req: ChatRequest = serde_json::from_value(json!({
            "messages": [],
            "tools": [{"type": "function", "function": {"name": "add",
                       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}],
            "tool_choice": "required", "parallel_tool_calls": false,
        }))
        .unwrap();
        let t = tools_of(&req).unwrap().unwrap();
        let Some(OutputConstraint::Lark(g)) = t.constraint() else {
            panic!("no grammar");
        };
        assert!(g.starts_with("start: call\n"), "{g}");
        // The arguments take only the listed properties.
        let closed = r#""properties":{"a":{"type":"integer"}},"additionalProperties":false"#;
        assert!(g.contains(closed), "{g}");
        assert!(g.contains(r#""const":"add""#), "{g}");
        let bad = |v: Value| tools_of(&serde_json::from_value(v).unwrap()).unwrap_err();
        let e = bad(json!({"messages": [], "tool_choice": "required"}));
        assert_eq!(e.body()["error"]["param"], "tool_choice");
        let e = bad(json!({"messages": [], "tools": [
            {"type": "function", "function": {"name": "a b"}}]}));
        assert_eq!(e.body()["error"]["param"], "tools");
        let e = bad(json!({"messages": [], "tools": [
            {"type": "function", "function": {"name": "a"}}],
            "tool_choice": {"type": "function", "function": {"name": "b"}}}));
        assert_eq!(e.body()["error"]["param"], "tool_choice");
    }

    #[test]
    fn definitions_move_to_the_call_root_and_local_references_follow_the_arguments() {
        let mut args = json!({
            "$defs": {"U": {"type": "object", "properties": {"self": {"$ref": "#"}}}},
            "type": "object",
            "properties": {"u": {"$ref": "#/$defs/U"}, "v": {"$ref": "#/properties/u"},
                           "$ref": {"type": "string"}}});
        let defs = hoist_defs(&mut args);
        assert_eq!(defs.len(), 1);
        assert_eq!(defs[0].0, "$defs");
        assert!(args.get("$defs").is_none());
        assert_eq!(args["properties"]["u"]["$ref"], "#/$defs/U");
        assert_eq!(
            args["properties"]["v"]["$ref"],
            "#/properties/arguments/properties/u"
        );
        assert_eq!(args["properties"]["$ref"]["type"], "string");
        assert_eq!(
            defs[0].1["U"]["properties"]["self"]["$ref"],
            "#/properties/arguments"
        );
    }
}
