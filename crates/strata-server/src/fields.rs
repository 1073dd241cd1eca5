//! The fate of every request field: honoured, accepted as a documented no-op, accepted only
//! with a value that changes nothing (anything else is refused with the reason), or refused.
//! A field that is not listed is refused as unknown (`--lenient-fields` logs and ignores it
//! instead). A field is never accepted and silently ignored. docs/API.md is this table.

use serde_json::{Map, Value};

use crate::error::ApiError;

/// Which endpoints a field belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

/// The endpoints of a field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum On {
    Chat,
    Completions,
    Both,
}

impl On {
    pub fn covers(self, e: Endpoint) -> bool {
        matches!(
            (self, e),
            (On::Both, _) | (On::Chat, Endpoint::Chat) | (On::Completions, Endpoint::Completions)
        )
    }
}

/// What happens to a field.
#[derive(Clone, Copy)]
pub enum Fate {
    /// Honoured as documented.
    Supported,
    /// Accepted with a value of its type; it has no effect here, for the reason given.
    NoOp(Shape, &'static str),
    /// Accepted with a value that changes nothing (the predicate); any other value is refused
    /// with the reason.
    Neutral(fn(&Value) -> bool, &'static str),
    /// Refused, for the reason given.
    Refused(&'static str),
}

/// The type a no-op field's value must have: it changes nothing, but a value of another type
/// is a client's mistake, refused as any other field's would be. `null` is always taken.
#[derive(Clone, Copy)]
pub enum Shape {
    Bool,
    Str,
    /// OpenAI's `metadata`: at most 16 pairs, keys of at most 64 characters, string values of
    /// at most 512.
    Tags,
}

impl Shape {
    pub fn name(self) -> &'static str {
        match self {
            Shape::Bool => "a boolean",
            Shape::Str => "a string",
            Shape::Tags => "an object of at most 16 string values",
        }
    }

    /// Whether `v` is a value of this type (or null).
    pub fn fits(self, v: &Value) -> bool {
        match (self, v) {
            (_, Value::Null) | (Shape::Bool, Value::Bool(_)) | (Shape::Str, Value::String(_)) => {
                true
            }
            (Shape::Tags, Value::Object(o)) => tags_fit(o),
            _ => false,
        }
    }
}

/// Tags within OpenAI's bounds: at most 16, keys of at most 64 characters, string values of
/// at most 512 (chat's and the Responses API's `metadata`).
pub fn tags_fit(o: &serde_json::Map<String, Value>) -> bool {
    o.len() <= 16
        && o.iter().all(|(k, v)| {
            k.chars().count() <= 64 && v.as_str().is_some_and(|s| s.chars().count() <= 512)
        })
}

/// What a JSON value is, for an error message (the value itself may be large).
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object (or one past those limits)",
    }
}

/// One request field.
pub struct Field {
    pub name: &'static str,
    pub on: On,
    pub fate: Fate,
    /// What it does (supported fields) or what it is (the others).
    pub doc: &'static str,
}

fn null_or(v: &Value, ok: impl Fn(&Value) -> bool) -> bool {
    v.is_null() || ok(v)
}
fn is_false(v: &Value) -> bool {
    null_or(v, |v| v == &Value::Bool(false) || v.as_u64() == Some(0))
}
fn is_true(v: &Value) -> bool {
    null_or(v, |v| v == &Value::Bool(true))
}
fn is_null(v: &Value) -> bool {
    v.is_null()
}
fn is_empty(v: &Value) -> bool {
    null_or(v, |v| match v {
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    })
}
fn no_tool_choice(v: &Value) -> bool {
    null_or(v, |v| v == "none" || v == "auto")
}
fn text_modality(v: &Value) -> bool {
    null_or(v, |v| {
        v.as_array().is_some_and(|a| a.iter().all(|m| m == "text"))
    })
}
fn default_tier(v: &Value) -> bool {
    null_or(v, |v| v == "auto" || v == "default")
}

const NOT_YET: &str = "not supported yet";
const DEPRECATED_FUNCTIONS: &str = "use tools and tool_choice";

/// Every field of `/v1/chat/completions` and `/v1/completions` the official clients send, and
/// the vLLM/SGLang extensions that users migrating bring.
pub const FIELDS: &[Field] = &[
    // The request.
    Field { name: "model", on: On::Both, fate: Fate::Supported, doc: "Must name the served model when given (404 otherwise)." },
    Field { name: "messages", on: On::Chat, fate: Fate::Supported, doc: "Roles system, developer (as system), user, assistant, tool; content text or text parts (other parts refused)." },
    Field { name: "prompt", on: On::Completions, fate: Fate::Supported, doc: "A text, token ids, a list of texts or a list of token-id lists (evaluation harnesses' default): a batch of up to 64 prompts (at most `--max-waiting`; their prompts and every candidate's answer at `max_tokens` within `--max-tokens-in-flight`: else a 400 before any runs), prompt p's choices at indices p·n to p·n + n − 1 (OpenAI's order), usage summed over the batch." },
    Field { name: "stream", on: On::Both, fate: Fate::Supported, doc: "Server-sent events, ending with `data: [DONE]`; `null` is `false`." },
    Field { name: "stream_options", on: On::Both, fate: Fate::Supported, doc: "`include_usage` (a last chunk with usage); `continuous_usage_stats` only false. Options given without `stream: true` are a 400." },
    // Length and stopping.
    Field { name: "max_tokens", on: On::Both, fate: Fate::Supported, doc: "At most this many tokens (default: the room the context and the device pool leave, capped by --default-max-tokens)." },
    Field { name: "max_completion_tokens", on: On::Chat, fate: Fate::Supported, doc: "Chat's newer name for max_tokens (wins over it)." },
    Field { name: "stop", on: On::Both, fate: Fate::Supported, doc: "Up to 16 stop strings of 1 to 256 bytes; the text ends before the first one found." },
    Field { name: "stop_token_ids", on: On::Both, fate: Fate::Supported, doc: "vLLM: up to 64 token ids that end generation (not returned)." },
    Field { name: "ignore_eos", on: On::Both, fate: Fate::Supported, doc: "vLLM: the model's end-of-sequence tokens do not end generation. Under an output constraint, only while the grammar allows more (more forced calls, a longer string); a complete answer still ends." },
    Field { name: "min_tokens", on: On::Both, fate: Fate::Supported, doc: "vLLM: stop tokens and stop strings count only after this many tokens (at most max_tokens). Refused above 0 with an output constraint (its answer ends when its grammar is complete)." },
    // Sampling.
    Field { name: "temperature", on: On::Both, fate: Fate::Supported, doc: "[0, 2]; 0 is greedy (default 1)." },
    Field { name: "top_p", on: On::Both, fate: Fate::Supported, doc: "(0, 1]: the smallest set of tokens whose probability reaches it." },
    Field { name: "top_k", on: On::Both, fate: Fate::Supported, doc: "vLLM: the k likeliest tokens (0 or -1: all)." },
    Field { name: "min_p", on: On::Both, fate: Fate::Supported, doc: "vLLM: [0, 1]; tokens less likely than min_p × the likeliest are dropped." },
    Field { name: "seed", on: On::Both, fate: Fate::Supported, doc: "The request's generator seed: the same seed, the same tokens, alone or under load (the decode kernels are batch-invariant unless the worker runs with `STRATA_ONE_ROW_KERNEL=fastest` or `=avx2`, docs/DEPLOY.md)." },
    Field { name: "frequency_penalty", on: On::Both, fate: Fate::Supported, doc: "[-2, 2]: a generated token's logit is lowered by this × its count so far." },
    Field { name: "presence_penalty", on: On::Both, fate: Fate::Supported, doc: "[-2, 2]: a generated token's logit is lowered by this once it appeared." },
    Field { name: "repetition_penalty", on: On::Both, fate: Fate::Supported, doc: "vLLM: (0, 2]; logits of prompt and output tokens: positive ÷ it, negative × it." },
    Field { name: "logit_bias", on: On::Both, fate: Fate::Supported, doc: "Token id (a string) → [-100, 100] added to its logit; up to 1024 entries." },
    Field { name: "n", on: On::Both, fate: Fate::Supported, doc: "1 to 16 choices at the cost of one prefill: the prompt is computed once, each choice continues from it cached (seed + index when a seed is given, wrapping past 2^64 − 1). Under PD the prefill worker computes the prompt once and the decode worker continues the choices from its K/V." },
    Field { name: "best_of", on: On::Completions, fate: Fate::Supported, doc: "n to 16 candidates (seed + index each), of which the n with the highest mean log probability per token are returned, likeliest first (best_of = n: every candidate, in order, as n alone gives them, and it may stream); the usage counts every candidate's tokens. Not streamed when best_of > n (400)." },
    // Output options.
    Field { name: "logprobs", on: On::Both, fate: Fate::Supported, doc: "Chat: `true` for each token's log probability (a number N, as vLLM takes it, is `true` with N alternatives; not with `top_logprobs`); completions: a number of alternatives (0 to 20; `true` is 0). From the distribution the choice was made from (after penalties, bias and temperature), streamed too." },
    Field { name: "top_logprobs", on: On::Chat, fate: Fate::Supported, doc: "0 to 20 likeliest alternatives per token (needs `logprobs: true`)." },
    Field { name: "prompt_logprobs", on: On::Both, fate: Fate::Neutral(is_null, "vLLM's prompt_logprobs is not supported: on /v1/completions, echo with logprobs gives the prompt's"), doc: "vLLM: log probabilities of the prompt's tokens in vLLM's shape (use completions' `echo` with `logprobs`)." },
    Field { name: "echo", on: On::Completions, fate: Fate::Supported, doc: "The prompt's text before the completion (streamed first). With `logprobs`, the prompt tokens' log probabilities come first too (the first token's null), from the model's own distribution; the prompt is then computed whole (not matched in the prefix cache, whose logits are not kept). An answer ended by a stop token (end of sequence) has an entry for that token too, as evaluation harnesses expect (it is not in the text, nor counted in `completion_tokens`)." },
    Field { name: "echo", on: On::Chat, fate: Fate::Neutral(is_false, "echo is not supported on chat"), doc: "vLLM: the last message repeated before the answer." },
    Field { name: "suffix", on: On::Completions, fate: Fate::Neutral(is_empty, "insertion (suffix) is not supported"), doc: "Text after the completion (insertion)." },
    Field { name: "include_stop_str_in_output", on: On::Both, fate: Fate::Neutral(is_false, NOT_YET), doc: "vLLM: the stop string kept in the text." },
    Field { name: "skip_special_tokens", on: On::Both, fate: Fate::Neutral(is_true, NOT_YET), doc: "vLLM: special tokens left out of the text (they are: control tokens, such as the end of a turn, leave no text; their log probabilities stay)." },
    Field { name: "spaces_between_special_tokens", on: On::Both, fate: Fate::Neutral(is_true, NOT_YET), doc: "vLLM: detokenizer spacing." },
    Field { name: "response_format", on: On::Chat, fate: Fate::Supported, doc: "`text`, `json_object` (any JSON object), or `json_schema` (`{\"name\", \"schema\", \"strict\", \"description\"}`: the output validates against the schema; `strict: true` closes every object that lists its properties, as OpenAI's strict mode: no keys beyond them; a `description` is shown to the model at the end of the system message, after any tools, as ``# Response format`` / ``Answer in the JSON format `NAME`: DESCRIPTION``). Generated under a grammar (llguidance), compact: no whitespace between JSON tokens unless the schema's `x-guidance` asks. An invalid schema is a 400." },
    Field { name: "modalities", on: On::Chat, fate: Fate::Neutral(text_modality, "only text output"), doc: "`[\"text\"]` only." },
    // Tools.
    Field { name: "tools", on: On::Chat, fate: Fate::Supported, doc: "Up to 128 functions (`{\"type\": \"function\", \"function\": {\"name\", \"description\", \"parameters\"}}`), shown to the model in the system message in the generic tool format (docs/API.md); calls in the answer come back as `tool_calls`. Each `parameters` schema describes a JSON object (a `type` other than `\"object\"`, or an `enum` or `const` at its root, is a 400: a call's arguments are an object) and is compiled whatever `tool_choice` says: an invalid one is a 400 naming the tool (a keyword the grammar engine does not implement, such as `uniqueItems`, and a string's `pattern` or `format` are checked only where calls are forced: elsewhere the schema is only shown)." },
    Field { name: "tool_choice", on: On::Chat, fate: Fate::Supported, doc: "`none` (tools shown, nothing parsed), `auto` (default: calls the model writes are parsed), `required` (at least one call) or `{\"type\": \"function\", \"function\": {\"name\"}}` (one call of it); the last two are generated under a grammar: the arguments validate against the tool's parameters." },
    Field { name: "parallel_tool_calls", on: On::Chat, fate: Fate::Supported, doc: "Default true; false: at most one call (`required` makes exactly one, by its grammar; under `auto` the answer keeps its first call, a later one is neither a call nor content)." },
    Field { name: "functions", on: On::Chat, fate: Fate::Neutral(is_empty, DEPRECATED_FUNCTIONS), doc: "The deprecated form of tools." },
    Field { name: "function_call", on: On::Chat, fate: Fate::Neutral(no_tool_choice, DEPRECATED_FUNCTIONS), doc: "The deprecated form of tool_choice." },
    // Chat template.
    Field { name: "add_generation_prompt", on: On::Chat, fate: Fate::Neutral(is_true, NOT_YET), doc: "vLLM: the assistant turn is opened (it is)." },
    Field { name: "continue_final_message", on: On::Chat, fate: Fate::Neutral(is_false, NOT_YET), doc: "vLLM: continue the last assistant message." },
    Field { name: "chat_template_kwargs", on: On::Chat, fate: Fate::Neutral(is_empty, NOT_YET), doc: "vLLM: extra template variables." },
    // Accounting and routing hints.
    Field { name: "user", on: On::Both, fate: Fate::Supported, doc: "An end-user id (a string): the prefix cache's session when `prompt_cache_key` is absent (see there); no per-user accounting." },
    Field { name: "metadata", on: On::Chat, fate: Fate::NoOp(Shape::Tags, "nothing is stored"), doc: "Tags for stored completions (keys of at most 64 characters, values of at most 512)." },
    Field { name: "store", on: On::Chat, fate: Fate::NoOp(Shape::Bool, "nothing is stored"), doc: "Store the completion." },
    Field { name: "service_tier", on: On::Chat, fate: Fate::Neutral(default_tier, "one service tier"), doc: "`auto` or `default`." },
    Field { name: "prompt_cache_key", on: On::Both, fate: Fate::Supported, doc: "A conversation or agent session (a string; empty: none). Prefixes are still matched by content; when a request's prompt begins with its session's previous prompt but not with the answer the cache holds after it, that answer is evicted first, on every tier, until something uses it (`strata_cache_session_retired_tokens_total`; docs/ARCHITECTURE.md, \"Sessions\")." },
    Field { name: "safety_identifier", on: On::Chat, fate: Fate::NoOp(Shape::Str, "no per-user accounting"), doc: "An end-user id for abuse detection." },
    // Refused.
    Field { name: "audio", on: On::Chat, fate: Fate::Refused("only text output"), doc: "Audio output." },
    Field { name: "prediction", on: On::Chat, fate: Fate::Refused(NOT_YET), doc: "Predicted output." },
    Field { name: "reasoning_effort", on: On::Chat, fate: Fate::Refused("the model has no reasoning mode"), doc: "Reasoning models' effort." },
    Field { name: "verbosity", on: On::Chat, fate: Fate::Refused(NOT_YET), doc: "Answer length hint." },
    Field { name: "web_search_options", on: On::Chat, fate: Fate::Refused("no web search"), doc: "Web search." },
    Field { name: "guided_json", on: On::Both, fate: Fate::Supported, doc: "vLLM: a JSON schema (object or JSON text) the output validates against." },
    Field { name: "guided_regex", on: On::Both, fate: Fate::Supported, doc: "vLLM: the whole output matches this regular expression." },
    Field { name: "guided_choice", on: On::Both, fate: Fate::Supported, doc: "vLLM: the output is exactly one of these texts." },
    Field { name: "guided_grammar", on: On::Both, fate: Fate::Supported, doc: "vLLM: a grammar in llguidance's Lark dialect (not GBNF/EBNF)." },
    Field { name: "structured_outputs", on: On::Both, fate: Fate::Supported, doc: "vLLM: exactly one of `json`, `regex`, `choice`, `grammar` (Lark), `json_object: true`. One output constraint per request: with `response_format`, a `guided_*` field or a forced tool call it is a 400." },
    Field { name: "use_beam_search", on: On::Both, fate: Fate::Refused("no beam search"), doc: "vLLM: beam search." },
    Field { name: "allowed_token_ids", on: On::Both, fate: Fate::Refused(NOT_YET), doc: "vLLM: the only tokens allowed." },
    Field { name: "bad_words", on: On::Both, fate: Fate::Refused(NOT_YET), doc: "vLLM: words never generated." },
    Field { name: "truncate_prompt_tokens", on: On::Both, fate: Fate::Refused(NOT_YET), doc: "vLLM: keep only the last k prompt tokens." },
    Field { name: "priority", on: On::Both, fate: Fate::Refused("requests are served in arrival order"), doc: "vLLM: scheduling priority." },
    Field { name: "request_id", on: On::Both, fate: Fate::Refused("use the X-Request-Id header"), doc: "vLLM: the request's id." },
    Field { name: "chat_template", on: On::Chat, fate: Fate::Refused("the model's own template is used"), doc: "vLLM: a template for this request." },
    Field { name: "documents", on: On::Chat, fate: Fate::Refused(NOT_YET), doc: "vLLM: documents for RAG templates." },
];

/// Fields of a message in `messages`.
pub const MESSAGE_FIELDS: &[Field] = &[
    Field {
        name: "role",
        on: On::Chat,
        fate: Fate::Supported,
        doc: "system, developer (as system), user, assistant, tool.",
    },
    Field {
        name: "content",
        on: On::Chat,
        fate: Fate::Supported,
        doc: "Text, or text parts (`{\"type\": \"text\", \"text\"}`: below). A content (or a tool's description) that writes a turn marker of the chat template (a control token the template writes, in its source or as it renders: `<|im_start|>`, `<|eot_id|>`, ...) is a 400: it would be read as a turn boundary, not as text. Any other control token written in it (`<|endoftext|>`, ...) is tokenized as text, never as its token (a completion's prompt reads special tokens as tokens).",
    },
    Field {
        name: "name",
        on: On::Chat,
        fate: Fate::NoOp(Shape::Str, "the chat template does not render participant names"),
        doc: "A participant's name.",
    },
    Field {
        name: "refusal",
        on: On::Chat,
        fate: Fate::Neutral(is_empty, NOT_YET),
        doc: "An assistant's refusal.",
    },
    Field {
        name: "tool_calls",
        on: On::Chat,
        fate: Fate::Supported,
        doc: "An assistant's tool calls, shown to the model as it writes them (`<tool_call>` blocks); each with a name and an id no unanswered call has (400 otherwise).",
    },
    Field {
        name: "tool_call_id",
        on: On::Chat,
        fate: Fate::Supported,
        doc: "The call a tool message answers: an earlier assistant tool call's id that no earlier tool message answered (400 otherwise).",
    },
    Field {
        name: "function_call",
        on: On::Chat,
        fate: Fate::Neutral(is_empty, DEPRECATED_FUNCTIONS),
        doc: "The deprecated form of tool_calls.",
    },
    Field {
        name: "audio",
        on: On::Chat,
        fate: Fate::Refused("only text"),
        doc: "An earlier audio answer.",
    },
];

/// Fields of a content part (`messages[i].content[j]`).
pub const PART_FIELDS: &[Field] = &[
    Field {
        name: "type",
        on: On::Chat,
        fate: Fate::Supported,
        doc: "`text` only.",
    },
    Field {
        name: "text",
        on: On::Chat,
        fate: Fate::Supported,
        doc: "The part's text.",
    },
    Field {
        name: "image_url",
        on: On::Chat,
        fate: Fate::Refused("only text parts are supported"),
        doc: "An image.",
    },
    Field {
        name: "input_audio",
        on: On::Chat,
        fate: Fate::Refused("only text parts are supported"),
        doc: "Audio.",
    },
    Field {
        name: "file",
        on: On::Chat,
        fate: Fate::Refused("only text parts are supported"),
        doc: "A file.",
    },
];

/// Fields of `stream_options`.
pub const STREAM_OPTION_FIELDS: &[Field] = &[
    Field {
        name: "include_usage",
        on: On::Both,
        fate: Fate::Supported,
        doc: "A last chunk with the usage.",
    },
    Field {
        name: "continuous_usage_stats",
        on: On::Both,
        fate: Fate::Neutral(is_false, NOT_YET),
        doc: "vLLM: usage in every chunk.",
    },
];

/// Checks one object's keys against a table; `at` prefixes the field names in errors.
/// Unknown keys: a 400, or (lenient) a warning and nothing, unless another endpoint takes
/// the key (then a 400 in either mode).
fn check_object(
    obj: &Map<String, Value>,
    table: &[Field],
    e: Endpoint,
    at: &str,
    lenient: bool,
) -> Result<(), ApiError> {
    for (k, v) in obj {
        let name = format!("{at}{k}");
        let Some(f) = table.iter().find(|f| f.name == k && f.on.covers(e)) else {
            // Lenient: only names the API does not know are dropped; one of the other endpoint
            // (`response_format` on completions) would change the answer, and is refused.
            let other = table.iter().find(|f| f.name == k);
            // A value that asks for nothing (null, or one the other endpoint takes as neutral)
            // changes no answer: lenient drops it too.
            let asks_nothing = v.is_null()
                || other.is_some_and(|f| matches!(f.fate, Fate::Neutral(ok, _) if ok(v)));
            if lenient && (other.is_none() || asks_nothing) {
                tracing::warn!(field = ?name, "unknown request field ignored (--lenient-fields)");
                continue;
            }
            let msg = if other.is_some() {
                let other = match e {
                    Endpoint::Chat => "/v1/completions",
                    Endpoint::Completions => "/v1/chat/completions",
                };
                format!("`{name}` is a field of {other}, not of this endpoint (docs/API.md)")
            } else {
                format!("unknown field `{name}`: see docs/API.md for the fields this server takes")
            };
            return Err(ApiError::bad_request(msg, Some(&name)));
        };
        match f.fate {
            Fate::Supported => {}
            Fate::NoOp(shape, _) if shape.fits(v) => {}
            Fate::NoOp(shape, _) => {
                return Err(ApiError::bad_request(
                    format!("`{name}`: expected {}, got {}", shape.name(), kind(v)),
                    Some(&name),
                ));
            }
            Fate::Neutral(ok, _) if ok(v) => {}
            // A refused field sent as null asks for nothing (clients send `reasoning_effort:
            // null`): taken as absent, as every other field's null is.
            Fate::Refused(_) if v.is_null() => {}
            Fate::Neutral(_, why) | Fate::Refused(why) => {
                return Err(ApiError::bad_request(
                    format!("`{name}`: {why}"),
                    Some(&name),
                ));
            }
        }
    }
    Ok(())
}

/// Where a body holds an object (a struct of `api`), never the array serde would read as one.
pub const OBJECTS: &[&str] = &[
    "stream_options",
    "structured_outputs",
    "response_format",
    "response_format.json_schema",
    "tools[]",
    "tools[].function",
];

/// [`OBJECTS`] of a body's `messages` (also `/tokenize`'s).
pub const MESSAGE_OBJECTS: &[&str] = &[
    "messages[]",
    "messages[].content[]",
    "messages[].tool_calls[]",
    "messages[].tool_calls[].function",
];

/// Checks a request body's fields (the body's JSON errors are `parse_json`'s to report).
pub fn check(bytes: &[u8], e: Endpoint, lenient: bool) -> Result<(), ApiError> {
    let Ok(whole) = serde_json::from_slice::<Value>(bytes) else {
        return Ok(());
    };
    let Value::Object(body) = &whole else {
        return Ok(());
    };
    check_object(body, FIELDS, e, "", lenient)?;
    crate::body::objects_at(&whole, OBJECTS)?;
    crate::body::objects_at(&whole, MESSAGE_OBJECTS)?;
    if let Some(Value::Object(o)) = body.get("stream_options") {
        check_object(o, STREAM_OPTION_FIELDS, e, "stream_options.", lenient)?;
        // Options of a stream, for a request that asks for none (`{}` asks for nothing).
        if !o.is_empty() && body.get("stream") != Some(&Value::Bool(true)) {
            return Err(ApiError::bad_request(
                "stream_options is only taken with stream: true",
                Some("stream_options"),
            ));
        }
    }
    if let (Endpoint::Chat, Some(Value::Array(msgs))) = (e, body.get("messages")) {
        for (i, m) in msgs.iter().enumerate() {
            let Value::Object(o) = m else { continue };
            check_object(o, MESSAGE_FIELDS, e, &format!("messages[{i}]."), lenient)?;
            if let Some(Value::Array(parts)) = o.get("content") {
                for (j, p) in parts.iter().enumerate() {
                    if let Value::Object(p) = p {
                        let at = format!("messages[{i}].content[{j}].");
                        check_object(p, PART_FIELDS, e, &at, lenient)?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// docs/API.md's tables, generated from the lists above.
pub fn markdown() -> String {
    let mut out = String::new();
    for (title, table) in [
        ("Request fields", FIELDS),
        ("Fields of a message (`messages[i]`)", MESSAGE_FIELDS),
        (
            "Fields of a content part (`messages[i].content[j]`)",
            PART_FIELDS,
        ),
        ("Fields of `stream_options`", STREAM_OPTION_FIELDS),
    ] {
        out += &format!("### {title}\n\n| field | endpoints | fate | notes |\n|---|---|---|---|\n");
        for f in table {
            let on = match f.on {
                On::Chat => "chat",
                On::Completions => "completions",
                On::Both => "both",
            };
            let fate = match f.fate {
                Fate::Supported => "supported".to_string(),
                Fate::NoOp(shape, why) => format!("no-op ({}): {why}", shape.name()),
                Fate::Neutral(_, why) => format!("neutral values only; otherwise refused: {why}"),
                Fate::Refused(why) => format!("refused: {why}"),
            };
            out += &format!("| `{}` | {on} | {fate} | {} |\n", f.name, f.doc);
        }
        out += "\n";
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(r: Result<(), ApiError>) -> Option<String> {
        r.err().map(|e| {
            e.body()["error"]["param"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
    }

    /// An object sent as an array of its fields (which serde would read in order, past the
    /// checks by name) is a 400 naming where, at every depth; the object form passes.
    #[test]
    fn an_array_for_an_object_is_refused_naming_where() {
        let chat = |b: &str| code(check(b.as_bytes(), Endpoint::Chat, false));
        let call =
            r#"{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}"#;
        let said = format!(r#"{{"role": "assistant", "tool_calls": [{call}]}}"#);
        let tool = r#"{"type": "function", "function": {"name": "f"}}"#;
        let fine = format!(r#"{{"messages": [{said}], "tools": [{tool}]}}"#);
        assert_eq!(chat(&fine), None);
        for (body, at) in [
            (r#"{"messages": [], "stream": true, "stream_options": [true]}"#.to_string(), "stream_options"),
            (r#"{"messages": [], "stream_options": []}"#.to_string(), "stream_options"),
            (r#"{"messages": [["user", "hi"]]}"#.to_string(), "messages[0]"),
            (r#"{"messages": [{"role": "user", "content": [["text", "hi"]]}]}"#.to_string(), "messages[0].content[0]"),
            (fine.replace(call, r#"["c", "function", {"name": "f", "arguments": "{}"}]"#), "messages[0].tool_calls[0]"),
            (fine.replace(r#"{"name": "f", "arguments": "{}"}"#, r#"["f", "{}"]"#), "messages[0].tool_calls[0].function"),
            (fine.replace(tool, r#"["function", {"name": "f"}]"#), "tools[0]"),
            (fine.replace(r#"{"name": "f"}"#, r#"["f", null, null, null]"#), "tools[0].function"),
            (r#"{"messages": [], "response_format": ["text"]}"#.to_string(), "response_format"),
            (r#"{"messages": [], "response_format": {"type": "json_schema", "json_schema": ["n", null, null, null]}}"#.to_string(), "response_format.json_schema"),
            (r#"{"messages": [], "structured_outputs": [null, "a+"]}"#.to_string(), "structured_outputs"),
        ] {
            assert_eq!(chat(&body).as_deref(), Some(at), "{body}");
        }
        // What serde alone makes of the first: include_usage, from the array.
        let r: crate::api::ChatRequest =
            serde_json::from_str(r#"{"messages": [], "stream": true, "stream_options": [true]}"#)
                .unwrap();
        assert_eq!(
            r.sampling.stream_options.map(|o| o.include_usage),
            Some(true)
        );
    }

    #[test]
    fn unknown_refused_and_non_neutral_fields_name_themselves() {
        let chat = |b: &str| code(check(b.as_bytes(), Endpoint::Chat, false));
        assert_eq!(chat(r#"{"messages": [], "max_tokens": 3}"#), None);
        assert_eq!(
            chat(r#"{"messages": [], "max_tokns": 3}"#).as_deref(),
            Some("max_tokns")
        );
        assert_eq!(chat(r#"{"messages": [], "logprobs": false, "n": 1}"#), None);
        assert_eq!(chat(r#"{"messages": [], "logprobs": true}"#), None);
        assert_eq!(
            chat(r#"{"messages": [], "echo": true}"#).as_deref(),
            Some("echo")
        );
        assert_eq!(chat(r#"{"messages": [], "guided_json": {}}"#), None);
        assert_eq!(
            chat(r#"{"messages": [], "response_format": {"type": "json_object"}}"#),
            None
        );
        assert_eq!(
            chat(r#"{"messages": [], "functions": [{"name": "f"}]}"#).as_deref(),
            Some("functions")
        );
        assert_eq!(
            chat(r#"{"messages": [{"role": "tool", "content": "x", "tool_call_id": "a"}]}"#),
            None
        );
        assert_eq!(
            chat(r#"{"messages": [], "stream_options": {"include_usage": true, "x": 1}}"#)
                .as_deref(),
            Some("stream_options.x")
        );
        // A refused field as null asks for nothing; with a value it is refused.
        for f in [
            "audio",
            "prediction",
            "reasoning_effort",
            "web_search_options",
        ] {
            assert_eq!(
                chat(&format!(r#"{{"messages": [], "{f}": null}}"#)),
                None,
                "{f}"
            );
            let v = chat(&format!(r#"{{"messages": [], "{f}": {{}}}}"#));
            assert_eq!(v.as_deref(), Some(f));
        }
        // A completions-only field on chat is unknown there.
        assert_eq!(
            chat(r#"{"messages": [], "suffix": ""}"#).as_deref(),
            Some("suffix")
        );
        let comp = |b: &str| code(check(b.as_bytes(), Endpoint::Completions, false));
        assert_eq!(
            comp(r#"{"prompt": "a", "suffix": "", "echo": false, "best_of": 1}"#),
            None
        );
        assert_eq!(comp(r#"{"prompt": "a", "echo": true, "best_of": 2}"#), None);
        assert_eq!(
            comp(r#"{"prompt": "a", "prompt_logprobs": 0}"#).as_deref(),
            Some("prompt_logprobs")
        );
        assert_eq!(
            comp(r#"{"prompt": "a", "messages": []}"#).as_deref(),
            Some("messages")
        );
        // Lenient: unknown fields pass (logged), refused ones still do not.
        assert!(check(
            br#"{"prompt": "a", "max_tokns": 1}"#,
            Endpoint::Completions,
            true
        )
        .is_ok());
        assert!(check(
            br#"{"prompt": "a", "prompt_logprobs": 1}"#,
            Endpoint::Completions,
            true
        )
        .is_err());
    }

    /// A no-op field changes nothing, but takes only a value of its type (and null).
    /// Lenient: a name no endpoint knows is dropped; one of the other endpoint is refused.
    #[test]
    fn lenient_drops_only_unknown_names() {
        let completion = |b: &str| code(check(b.as_bytes(), Endpoint::Completions, true));
        assert_eq!(completion(r#"{"prompt": "a", "x_vendor_hint": 1}"#), None);
        for f in ["response_format", "tools", "top_logprobs"] {
            let body = format!(r#"{{"prompt": "a", "{f}": {{}}}}"#);
            assert_eq!(completion(&body).as_deref(), Some(f), "{f}");
            // Null asks for nothing: dropped.
            let body = format!(r#"{{"prompt": "a", "{f}": null}}"#);
            assert_eq!(completion(&body), None, "{f}");
        }
    }

    #[test]
    fn no_op_fields_take_only_their_type() {
        let chat = |b: &str| code(check(b.as_bytes(), Endpoint::Chat, false));
        for ok in [
            r#"{"messages": [], "store": false, "metadata": {"a": "b"}, "safety_identifier": "u1"}"#,
            r#"{"messages": [], "store": null, "metadata": null, "safety_identifier": null}"#,
            r#"{"messages": [{"role": "user", "content": "x", "name": "ann"}]}"#,
        ] {
            assert_eq!(chat(ok), None, "{ok}");
        }
        let many: String = (0..17)
            .map(|i| format!(r#""k{i}": "v""#))
            .collect::<Vec<_>>()
            .join(",");
        let many = format!(r#"{{"messages": [], "metadata": {{{many}}}}}"#);
        let long = format!(
            r#"{{"messages": [], "metadata": {{"k": "{}"}}}}"#,
            "v".repeat(513)
        );
        for (bad, field) in [
            (r#"{"messages": [], "store": "yes"}"#, "store"),
            (r#"{"messages": [], "metadata": 7}"#, "metadata"),
            (r#"{"messages": [], "metadata": {"a": 1}}"#, "metadata"),
            (many.as_str(), "metadata"),
            (long.as_str(), "metadata"),
            (
                r#"{"messages": [], "safety_identifier": 5}"#,
                "safety_identifier",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x", "name": 3}]}"#,
                "messages[0].name",
            ),
        ] {
            assert_eq!(chat(bad).as_deref(), Some(field), "{bad}");
        }
    }

    #[test]
    fn docs_api_md_lists_every_field() {
        let docs =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/API.md"))
                .expect("docs/API.md");
        let table = markdown();
        assert!(
            docs.contains(&table),
            "docs/API.md is out of date: put this between its markers:\n{table}"
        );
        for (i, f) in FIELDS.iter().enumerate() {
            for g in &FIELDS[i + 1..] {
                let overlap = f.name == g.name
                    && [Endpoint::Chat, Endpoint::Completions]
                        .iter()
                        .any(|&e| f.on.covers(e) && g.on.covers(e));
                assert!(!overlap, "`{}` listed twice for one endpoint", f.name);
            }
        }
    }
}
