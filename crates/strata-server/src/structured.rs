//! Structured output: the request fields that constrain the output (`response_format`,
//! vLLM's `structured_outputs` and `guided_*`, forced tool calls) → one
//! [`OutputConstraint`], compiled with the model's grammar engine off the async workers.
//! At most one of them per request; an invalid one is a 400 naming its field.

use std::sync::Arc;

use strata_engine::Constraint;
use strata_grammar::{Compiled, GrammarError, Grammars};
use strata_protocol::OutputConstraint;

use crate::api::{ResponseFormat, Sampling, StructuredOutputs};
use crate::error::ApiError;
use crate::state::{off_async, AppState};

/// A constraint and the request field it came from.
pub type Asked = (OutputConstraint, &'static str);

fn bad(msg: impl Into<String>, field: &str) -> ApiError {
    ApiError::bad_request(msg, Some(field))
}

/// A JSON schema given as an object or as its JSON text.
fn schema_text(v: &serde_json::Value, field: &str) -> Result<String, ApiError> {
    match v {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Object(_) | serde_json::Value::Bool(_) => Ok(v.to_string()),
        _ => Err(bad(
            format!("{field}: a JSON schema is an object (or its JSON text)"),
            field,
        )),
    }
}

fn structured_outputs(so: &StructuredOutputs) -> Result<Vec<Asked>, ApiError> {
    const F: &str = "structured_outputs";
    let mut v = Vec::new();
    if let Some(j) = &so.json {
        v.push((OutputConstraint::JsonSchema(schema_text(j, F)?), F));
    }
    if let Some(r) = &so.regex {
        v.push((OutputConstraint::Regex(r.clone()), F));
    }
    if let Some(c) = &so.choice {
        v.push((OutputConstraint::Choice(c.clone()), F));
    }
    if let Some(g) = &so.grammar {
        v.push((OutputConstraint::Lark(g.clone()), F));
    }
    if so.json_object == Some(true) {
        v.push((OutputConstraint::JsonObject, F));
    }
    if v.len() != 1 {
        return Err(bad(
            "structured_outputs: give exactly one of json, regex, choice, grammar, json_object",
            F,
        ));
    }
    Ok(v)
}

/// The constraints a request's fields ask for (each with its field).
pub fn asked(
    s: &Sampling,
    format: Option<&ResponseFormat>,
    tools: Option<Asked>,
) -> Result<Option<Asked>, ApiError> {
    let mut all: Vec<Asked> = Vec::new();
    match format {
        None | Some(ResponseFormat::Text {}) => {}
        Some(ResponseFormat::JsonObject {}) => {
            all.push((OutputConstraint::JsonObject, "response_format"))
        }
        Some(ResponseFormat::JsonSchema { json_schema }) => {
            let schema = match &json_schema.schema {
                // OpenAI's strict mode: an object has no keys beyond its properties.
                Some(v) if json_schema.strict == Some(true) && v.is_object() => {
                    let mut v = v.clone();
                    crate::tools::closed(&mut v, 0);
                    schema_text(&v, "response_format")?
                }
                Some(v) => schema_text(v, "response_format")?,
                None => "{}".into(),
            };
            all.push((OutputConstraint::JsonSchema(schema), "response_format"));
        }
    }
    if let Some(so) = &s.structured_outputs {
        all.extend(structured_outputs(so)?);
    }
    if let Some(j) = &s.guided_json {
        all.push((
            OutputConstraint::JsonSchema(schema_text(j, "guided_json")?),
            "guided_json",
        ));
    }
    if let Some(r) = &s.guided_regex {
        all.push((OutputConstraint::Regex(r.clone()), "guided_regex"));
    }
    if let Some(c) = &s.guided_choice {
        all.push((OutputConstraint::Choice(c.clone()), "guided_choice"));
    }
    if let Some(g) = &s.guided_grammar {
        all.push((OutputConstraint::Lark(g.clone()), "guided_grammar"));
    }
    all.extend(tools);
    // A constrained answer ends when its grammar is complete: a length it must reach first
    // could not be kept (it was taken and not honoured).
    if let (Some(a), Some(m)) = (all.first(), s.min_tokens.filter(|&m| m > 0)) {
        return Err(bad(
            format!(
                "min_tokens {m} with {}: a constrained answer ends when its grammar is complete",
                a.1
            ),
            "min_tokens",
        ));
    }
    if all.len() > 1 {
        let names: Vec<&str> = all.iter().map(|a| a.1).collect();
        return Err(bad(
            format!(
                "one output constraint per request: {} were given",
                names.join(", ")
            ),
            all[1].1,
        ));
    }
    Ok(all.pop())
}

/// The grammar engine of this worker (built on first use; its error if the tokenizer cannot
/// be described to it).
fn grammars(st: &AppState) -> Result<Arc<Grammars>, String> {
    st.grammars
        .get_or_init(|| {
            let vocab = st.engine.info().vocab;
            Grammars::new(st.tokenizer.clone(), vocab)
                .map(Arc::new)
                .map_err(|e| e.to_string())
        })
        .clone()
}

/// Compiles a constraint on a blocking thread; a refusal names the field it came from.
pub async fn compile(st: &Arc<AppState>, a: Asked) -> Result<Constraint, ApiError> {
    let (c, field) = a;
    off_async(st, move |st| compile_now(st, &c, field)).await
}

/// Compiles a constraint on this thread (a prefill worker compiles what a decode worker sent).
pub fn compile_now(
    st: &AppState,
    c: &OutputConstraint,
    field: &'static str,
) -> Result<Constraint, ApiError> {
    let g = grammars(st).map_err(|m| bad(format!("{field}: {m}"), field))?;
    match g.compile(c) {
        Ok(compiled) => Ok(compiled.into_constraint()),
        Err(GrammarError::Invalid(m) | GrammarError::Tokenizer(m)) => {
            Err(bad(format!("{field}: {m}"), field))
        }
    }
}

/// Tool argument schemas the answer is not held to ([`crate::tools::Tools::unheld_schemas`]),
/// each checked on a blocking thread (once per distinct schema: [`Grammars::check`]).
pub async fn check_tool_schemas(
    st: &Arc<AppState>,
    schemas: Vec<(usize, OutputConstraint)>,
) -> Result<(), ApiError> {
    if schemas.is_empty() {
        return Ok(());
    }
    off_async(st, move |st| {
        // A tokenizer the grammar engine cannot read checks nothing: these schemas are only
        // shown to the model, which such a worker still serves.
        let Ok(g) = grammars(st) else {
            return Ok(());
        };
        for (i, c) in &schemas {
            if let Err(GrammarError::Invalid(m)) = g.check(c) {
                return Err(bad(format!("tools[{i}].function.parameters: {m}"), "tools"));
            }
        }
        Ok(())
    })
    .await
}

/// What a request's constraint was compiled from (to send it to a prefill worker).
pub fn spec_of(c: &Constraint) -> Option<OutputConstraint> {
    Compiled::of(c).map(|c| c.spec().clone())
}
