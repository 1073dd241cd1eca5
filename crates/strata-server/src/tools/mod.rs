//! Tool calling in a documented generic format (the served models' chat templates have no
//! tool support): the tools are rendered into the system message, the model answers a call
//! as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, and the answer is parsed
//! back into OpenAI's `tool_calls` ([`parse`]: a call's arguments stream as deltas).
//!
//! `tool_choice`: `none` (tools shown, nothing parsed), `auto` (shown; calls the model
//! writes are parsed), `required` (at least one call, or exactly one without
//! `parallel_tool_calls`) and a named function (one call of it): the last two constrain the
//! output with a grammar, so every call's arguments validate against the tool's schema.

use serde_json::{json, Value};
use strata_protocol::OutputConstraint;

use crate::api::{ChatRequest, ToolDef};
use crate::error::ApiError;

mod parse;
pub use parse::{parse_all, Call, CallRules, ToolOut, ToolStream};

/// Most tools one request may define.
pub const MAX_TOOLS: usize = 128;

pub(crate) const OPEN: &str = "<tool_call>";
pub(crate) const CLOSE: &str = "</tool_call>";

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
            // Every key read, or the choice refused: none is dropped unseen.
            use crate::body::unread_key;
            let key = unread_key(o, &["type", "function"])
                .or_else(|| unread_key(&o["function"], &["name"]));
            if let Some(k) = key {
                return Err(bad(
                    format!("tool_choice: `{k}` is not served ({{\"type\": \"function\", \"function\": {{\"name\": ...}}}} only)"),
                    f,
                ));
            }
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
        let Some(o) = p.as_object() else {
            return Err(bad(
                format!("tools[{i}].function.parameters: a JSON schema object"),
                f,
            ));
        };
        // The arguments are a JSON object (OpenAI refuses any other schema): a call whose
        // arguments were `1` or `"Paris"` could not be returned as one.
        // No type: an object all the same (`{}`, properties alone, a root `$ref` of pydantic's
        // recursive models) unless it names the values (`enum`, `const`).
        let object = match o.get("type") {
            Some(t) => t == "object" || *t == json!(["object"]),
            None => !o.contains_key("enum") && !o.contains_key("const"),
        };
        if !object {
            let got = o
                .get("type")
                .map_or("no type".into(), |t| format!("type {t}"));
            return Err(bad(
                format!("tools[{i}].function.parameters: the arguments are a JSON object: give a schema of type \"object\" ({got})"),
                f,
            ));
        }
    }
    Ok(())
}

/// The request's tools, checked (None: no tools and no tool choice that needs them).
pub fn tools_of(req: &ChatRequest) -> Result<Option<Tools>, ApiError> {
    tools_from(
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
    )
}

/// [`tools_of`] from the fields themselves (`/tokenize` takes them too).
pub fn tools_from(
    defs: Option<&[ToolDef]>,
    choice: Option<&Value>,
    parallel: Option<bool>,
) -> Result<Option<Tools>, ApiError> {
    let defs = defs.map(<[ToolDef]>::to_vec).unwrap_or_default();
    let choice = choice_of(choice)?;
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
        parallel: parallel.unwrap_or(true),
    }))
}

impl Tools {
    /// The tools as the prompt shows them: with every `tool_choice`, `none` included (vLLM's
    /// default), so an agent's last answer keeps the prompt, and the cached prefix, its calls
    /// had.
    pub fn shown(&self) -> &[ToolDef] {
        &self.defs
    }

    /// Whether the answer must be calls (`required`, a named function: under a grammar).
    pub fn forced(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Named(_))
    }

    /// How the answer's calls are read: forced or not, and the first only where
    /// `parallel_tool_calls` is false (under `auto` the model may write more: they are
    /// dropped; `required` and a named choice make one by their grammar).
    pub fn rules(&self) -> CallRules {
        CallRules {
            forced: self.forced(),
            one: !self.parallel,
        }
    }

    /// The names of the functions the answer may call (None: the answer is not parsed).
    pub fn callable(&self) -> Option<Vec<String>> {
        (self.choice != ToolChoice::None)
            .then(|| self.defs.iter().map(|d| d.function.name.clone()).collect())
    }

    /// Each tool's argument schema the answer is not held to (every tool under `none` and
    /// `auto`, the tools a named choice does not name; `required` compiles them all into its
    /// grammar): still checked, so a broken one (a `$ref` to nothing, a keyword of the wrong
    /// type) is refused, as OpenAI refuses it, rather than shown to the model. Checked
    /// leniently: what the grammar engine does not implement (`uniqueItems`, `not`, `if`, a
    /// custom `format`, a look-ahead in a `pattern`, as pydantic writes for decimals) is valid
    /// JSON Schema, and nothing here has to enforce it; patterns are not checked.
    pub fn unheld_schemas(&self) -> Vec<(usize, OutputConstraint)> {
        let held = |d: &ToolDef| match &self.choice {
            ToolChoice::Required => true,
            ToolChoice::Named(n) => &d.function.name == n,
            ToolChoice::None | ToolChoice::Auto => false,
        };
        let schema = |(i, d): (usize, &ToolDef)| {
            let mut p = d.function.parameters.clone().filter(|_| !held(d))?;
            without_patterns(&mut p);
            if let Some(o) = p.as_object_mut() {
                let g = o.entry("x-guidance").or_insert_with(|| json!({}));
                if let Some(g) = g.as_object_mut() {
                    g.insert("lenient".into(), json!(true));
                }
            }
            Some((i, OutputConstraint::JsonSchema(p.to_string())))
        };
        self.defs.iter().enumerate().filter_map(schema).collect()
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
            // `{}` or properties without a type: an object all the same (`check_def`).
            if let Some(o) = args.as_object_mut() {
                o.entry("type").or_insert_with(|| json!("object"));
            }
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

/// A schema without its `pattern`s (a string's; `patternProperties` keeps its schemas, each
/// under a plain key of its own): what a lenient check reads. The JSON a request body
/// parses to nests at most 128 deep, so the walk is bounded.
fn without_patterns(v: &mut Value) {
    match v {
        Value::Object(o) => {
            if o.get("pattern").is_some_and(Value::is_string) {
                o.remove("pattern");
            }
            if let Some(Value::Object(pp)) = o.get_mut("patternProperties") {
                let kept: serde_json::Map<String, Value> = std::mem::take(pp)
                    .into_iter()
                    .enumerate()
                    .map(|(i, (_, s))| (format!("^p{i}$"), s))
                    .collect();
                *pp = kept;
            }
            o.values_mut().for_each(without_patterns);
        }
        Value::Array(a) => a.iter_mut().for_each(without_patterns),
        _ => {}
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

#[cfg(test)]
mod tests {
    use super::*;

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
        // A key of the named choice that is not read is refused by name.
        for choice in [
            json!({"type": "function", "function": {"name": "a", "foo": 1}}),
            json!({"type": "function", "function": {"name": "a"}, "foo": 2}),
        ] {
            let e = bad(json!({"messages": [], "tools": [
                {"type": "function", "function": {"name": "a"}}], "tool_choice": choice}));
            let b = e.body();
            assert_eq!(b["error"]["param"], "tool_choice");
            assert!(
                b["error"]["message"].as_str().unwrap().contains("`foo`"),
                "{b}"
            );
        }
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
