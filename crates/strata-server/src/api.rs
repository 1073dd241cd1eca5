//! Request and response bodies, in OpenAI's shapes. Which fields are taken is decided before
//! these types see a body ([`crate::fields`]: unknown ones are refused); a field of the wrong
//! type is refused with a 400 naming it.

use serde::{Deserialize, Serialize};

/// A string or a list of strings (`stop`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// `logprobs`: a flag (chat) or a number of alternatives (completions).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum LogprobsField {
    Flag(bool),
    Count(usize),
}

/// `prompt` of `/v1/completions`: text, one text in a list, token ids, or one list of token
/// ids in a list (what evaluation harnesses send by default).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling fields shared by both endpoints.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct Sampling {
    pub max_tokens: Option<usize>,
    /// Chat's newer name for `max_tokens`.
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
    pub stop: Option<OneOrMany>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub n: Option<usize>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    /// vLLM's extension (prompt and output tokens).
    pub repetition_penalty: Option<f32>,
    /// Token id (as a string, OpenAI's shape) → bias added to its logit.
    pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    pub min_p: Option<f32>,
    pub min_tokens: Option<usize>,
    /// Chat: `true`/`false`; completions: how many alternatives (0 to 20).
    pub logprobs: Option<LogprobsField>,
    /// Chat: alternatives per token (0 to 20; needs `logprobs: true`).
    pub top_logprobs: Option<usize>,
    /// `null` is `false` (OpenAI's schema allows it).
    #[serde(default, deserialize_with = "null_is_default")]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// vLLM's constraint of the output (one of `json`, `regex`, `choice`, `grammar`,
    /// `json_object`).
    pub structured_outputs: Option<StructuredOutputs>,
    /// vLLM's older forms of the same.
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    /// The conversation or agent session (OpenAI's cache hint): see `sampling::session`.
    pub prompt_cache_key: Option<String>,
    /// An end-user id: the session when `prompt_cache_key` is absent.
    pub user: Option<String>,
}

/// vLLM's `structured_outputs`: exactly one constraint.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StructuredOutputs {
    /// A JSON schema (an object, or its JSON text).
    pub json: Option<serde_json::Value>,
    pub regex: Option<String>,
    pub choice: Option<Vec<String>>,
    /// A Lark grammar (llguidance's dialect).
    pub grammar: Option<String>,
    pub json_object: Option<bool>,
}

/// `response_format` (chat).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ResponseFormat {
    // Struct variants, not unit ones: serde refuses unknown keys only in a struct variant (a
    // `json_schema` key under `type: json_object` would otherwise be dropped unseen).
    Text {},
    JsonObject {},
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaFormat {
    pub name: String,
    pub description: Option<String>,
    /// Absent: any JSON value.
    pub schema: Option<serde_json::Value>,
    /// The output always validates; `true` also closes every object that lists its
    /// properties (`additionalProperties: false` where it says nothing), as OpenAI's strict
    /// mode defines it.
    pub strict: Option<bool>,
}

/// A function the model may call (`tools[i]`).
#[derive(Clone, Debug, Deserialize, PartialEq, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ToolDef {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDef,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionDef {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON schema of the arguments (absent: any object).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
    /// Arguments always validate against `parameters` when a call is forced.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// A tool call in an assistant message of the history.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ToolCallIn {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCallIn,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FunctionCallIn {
    pub name: String,
    /// The arguments as JSON text (OpenAI's shape).
    pub arguments: String,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    /// The prompt's text before the completion.
    pub echo: Option<bool>,
    /// Candidates generated per request, of which the `n` likeliest are returned.
    pub best_of: Option<usize>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// Message content: text, or a list of parts of which the `text` ones are used.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// A text part (`{"type": "text", "text"}`); its keys are checked by name beforehand
/// (`fields::PART_FIELDS`: any other is refused, or under `--lenient-fields` logged and
/// ignored).
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<Content>,
    /// An assistant's tool calls.
    pub tool_calls: Option<Vec<ToolCallIn>>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub response_format: Option<ResponseFormat>,
    pub tools: Option<Vec<ToolDef>>,
    /// `none`, `auto`, `required`, or `{"type": "function", "function": {"name": ...}}`.
    pub tool_choice: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

impl Usage {
    pub fn new(prompt: usize, completion: usize, cached: usize) -> Usage {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached,
            },
        }
    }
}

/// A field whose `null` means its default.
fn null_is_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + serde::Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `response_format` of any type refuses a key it does not read (a schema sent under
    /// `json_object` is not dropped unseen).
    #[test]
    fn a_response_format_refuses_keys_it_does_not_read() {
        let rf = |v: serde_json::Value| serde_json::from_value::<ResponseFormat>(v);
        assert_eq!(
            rf(serde_json::json!({"type": "text"})).unwrap(),
            ResponseFormat::Text {}
        );
        assert_eq!(
            rf(serde_json::json!({"type": "json_object"})).unwrap(),
            ResponseFormat::JsonObject {}
        );
        let schema = serde_json::json!({"name": "x", "schema": {"type": "object"}});
        for t in ["text", "json_object"] {
            let e = rf(serde_json::json!({"type": t, "json_schema": schema})).unwrap_err();
            assert!(
                e.to_string().contains("unknown field `json_schema`"),
                "{t}: {e}"
            );
        }
        let ok = rf(serde_json::json!({"type": "json_schema", "json_schema": schema}));
        assert!(matches!(ok.unwrap(), ResponseFormat::JsonSchema { .. }));
    }
}
