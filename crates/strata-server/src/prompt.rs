//! Requests → prompt token ids: the one builder the worker (to compute the prompt) and the
//! router (to hash it as the worker will) both use, so the two can never disagree on roles,
//! content parts or templates.

use std::collections::HashMap;

use strata_model::{ChatTemplate, Message, ModelTokenizer};

use crate::api::{ChatMessage, Content, Prompt, ResponseFormat, ToolDef};
use crate::error::ApiError;

/// What a chat request shows the model in its system message beside its messages: each part
/// with the request field it comes from (named in errors).
#[derive(Clone, Debug, PartialEq)]
pub struct Shown {
    parts: Vec<(&'static str, String)>,
}

impl Shown {
    /// The tools (`crate::tools::system_text`), then a `json_schema` response format's
    /// `description` (with its `name`), which OpenAI defines as what the model reads to answer
    /// in that format. None when the request has neither.
    pub fn of(tools: Option<&[ToolDef]>, format: Option<&ResponseFormat>) -> Option<Shown> {
        let mut parts = Vec::new();
        if let Some(defs) = tools {
            parts.push(("tools", crate::tools::system_text(defs)));
        }
        if let Some(ResponseFormat::JsonSchema { json_schema: f }) = format {
            if let Some(d) = f.description.as_deref().filter(|d| !d.trim().is_empty()) {
                let text = format!(
                    "# Response format\n\nAnswer in the JSON format `{}`: {d}",
                    f.name
                );
                parts.push(("response_format", text));
            }
        }
        (!parts.is_empty()).then_some(Shown { parts })
    }

    /// The text shown: the parts, a blank line between them.
    pub fn text(&self) -> String {
        let parts: Vec<&str> = self.parts.iter().map(|p| p.1.as_str()).collect();
        parts.join("\n\n")
    }

    /// Refuses a part that writes one of the template's turn markers, naming its field.
    fn check(&self, tk: &ModelTokenizer, tpl: &ChatTemplate) -> Result<(), ApiError> {
        for (from, text) in &self.parts {
            if let Some(marker) = tpl.turn_marker_in(tk, text) {
                return Err(turn_marker(from, marker, from));
            }
        }
        Ok(())
    }
}

/// The chat messages as the template sees them: roles checked (`developer` → `system`), text
/// parts joined (any other part is refused), tool calls and tool answers in the generic tool
/// format (`crate::tools`), and what else the request shows ([`Shown`]) in the system message: after the
/// first message's text when it is a system one, else as a system message of its own.
pub fn template_messages(
    messages: &[ChatMessage],
    shown: Option<&Shown>,
) -> Result<Vec<Message>, ApiError> {
    let mut msgs = Vec::with_capacity(messages.len() + 1);
    // Every call's id, and whether it is still unanswered.
    let mut call_ids: HashMap<&str, bool> = HashMap::new();
    for (i, m) in messages.iter().enumerate() {
        if !matches!(
            m.role.as_str(),
            "system" | "user" | "assistant" | "developer" | "tool"
        ) {
            return Err(ApiError::bad_request(
                format!(
                    "messages[{i}].role `{}` is not one of system, user, assistant, developer, tool",
                    m.role
                ),
                Some(&format!("messages[{i}].role")),
            ));
        }
        let text = match &m.content {
            // Only an assistant's turn may say nothing (its calls are what it said).
            None if m.role == "assistant" => String::new(),
            None => {
                return Err(ApiError::bad_request(
                    format!(
                        "messages[{i}].content: a {} message needs a content",
                        m.role
                    ),
                    Some(&format!("messages[{i}].content")),
                ))
            }
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(p)) => {
                let mut s = String::new();
                for (j, part) in p.iter().enumerate() {
                    let at = format!("messages[{i}].content[{j}]");
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(t)) => s.push_str(t),
                        ("text", None) => {
                            let msg = format!("{at}: a text part without its `text`");
                            return Err(ApiError::bad_request(msg, Some(&format!("{at}.text"))));
                        }
                        (kind, _) => {
                            let msg = format!(
                                "{at}: a part of type `{kind}`: only text parts are supported"
                            );
                            return Err(ApiError::bad_request(msg, Some(&at)));
                        }
                    }
                }
                s
            }
        };
        let text = tool_parts(i, m, text, &mut call_ids)?;
        let role = if m.role == "developer" {
            "system"
        } else {
            &m.role
        };
        msgs.push(Message::new(role, &text));
    }
    if let Some(shown) = shown {
        let text = shown.text();
        match msgs.first_mut() {
            Some(first) if first.role == "system" => {
                first.content = format!("{}\n\n{text}", first.content);
            }
            _ => msgs.insert(0, Message::new("system", &text)),
        }
    }
    Ok(msgs)
}

/// A message's tool calls (assistant) or answer (tool) added to its text; a tool answer must
/// name an earlier call.
fn tool_parts<'a>(
    i: usize,
    m: &'a ChatMessage,
    mut text: String,
    call_ids: &mut HashMap<&'a str, bool>,
) -> Result<String, ApiError> {
    let bad = |msg: String| Err(ApiError::bad_request(msg, Some("messages")));
    if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_empty()) {
        if m.role != "assistant" {
            return bad(format!(
                "messages[{i}]: only assistant messages have tool_calls"
            ));
        }
        for (j, c) in calls.iter().enumerate() {
            if c.kind != "function" {
                return bad(format!("messages[{i}].tool_calls[{j}].type: only function"));
            }
            if c.function.name.is_empty() {
                return bad(format!(
                    "messages[{i}].tool_calls[{j}].function.name is empty"
                ));
            }
            // A tool answer names its call: two unanswered calls of one id would make it
            // ambiguous (an id used again once answered is the next turn's, as some models
            // number their calls per turn).
            if c.id.is_empty() || call_ids.get(c.id.as_str()) == Some(&true) {
                return bad(format!(
                    "messages[{i}].tool_calls[{j}].id `{}`: empty, or an unanswered call's",
                    c.id
                ));
            }
            if !text.is_empty() {
                text.push('\n');
            }
            text += &crate::tools::call_text(&c.function.name, &c.function.arguments);
            call_ids.insert(&c.id, true);
        }
    }
    match (&m.tool_call_id, m.role.as_str()) {
        (Some(id), "tool") if call_ids.get(id.as_str()) == Some(&true) => {
            call_ids.insert(id, false);
            Ok(crate::tools::response_text(&text))
        }
        // Two answers to one call: which one the model should read is not said.
        (Some(id), "tool") if call_ids.contains_key(id.as_str()) => bad(format!(
            "messages[{i}].tool_call_id `{id}` answers a call an earlier tool message answered"
        )),
        (Some(id), "tool") => bad(format!(
            "messages[{i}].tool_call_id `{id}` answers no earlier tool call"
        )),
        (Some(_), _) => bad(format!(
            "messages[{i}]: only tool messages have tool_call_id"
        )),
        (None, "tool") => bad(format!(
            "messages[{i}]: a tool message needs tool_call_id (the call it answers)"
        )),
        (None, _) => Ok(text),
    }
}

/// A chat request's prompt ids: messages rendered with the model's template, tokenized.
pub fn chat_ids(
    tk: &ModelTokenizer,
    tpl: Option<&ChatTemplate>,
    messages: &[ChatMessage],
    shown: Option<&Shown>,
) -> Result<Vec<u32>, ApiError> {
    chat_ids_shared(tk, tpl, messages, shown, false, None).map(|(ids, _)| ids)
}

/// [`chat_ids`], and where other conversations are expected to leave the prompt (see
/// [`shared_prefix`]; 0 unless `shared` is asked).
pub fn chat_ids_shared(
    tk: &ModelTokenizer,
    tpl: Option<&ChatTemplate>,
    messages: &[ChatMessage],
    shown: Option<&Shown>,
    shared: bool,
    context: Option<usize>,
) -> Result<(Vec<u32>, usize), ApiError> {
    let Some(tpl) = tpl else {
        return Err(ApiError::bad_request(
            "this model has no chat template: use /v1/completions",
            Some("messages"),
        ));
    };
    if let Some(shown) = shown {
        shown.check(tk, tpl)?;
    }
    let msgs = template_messages(messages, shown)?;
    check_turn_markers(tk, tpl, &msgs, messages.len())?;
    let text = tpl
        .render(&msgs, true)
        .map_err(|e| ApiError::bad_request(e.to_string(), Some("messages")))?;
    check_fits(tk, &text, context, "messages")?;
    let ids = tpl
        .encode(tk, &text)
        .map_err(|e| ApiError::bad_request(e.to_string(), Some("messages")))?;
    let n = match shared {
        true => shared_prefix(tk, tpl, &msgs, &ids).unwrap_or(0),
        false => 0,
    };
    Ok((ids, n))
}

/// Refuses a message that writes one of the template's turn markers: tokenized with the rest,
/// it would be the marker's own id, and a user could close their turn and open a system one.
/// `given` is how many messages the request had (one more: what the request shows, checked
/// on its own by [`Shown::check`], is a message of its own at the start).
fn check_turn_markers(
    tk: &ModelTokenizer,
    tpl: &ChatTemplate,
    msgs: &[Message],
    given: usize,
) -> Result<(), ApiError> {
    let shift = msgs.len() - given;
    for (k, m) in msgs.iter().enumerate().skip(shift) {
        if let Some(marker) = tpl.turn_marker_in(tk, &m.content) {
            return Err(turn_marker(
                &format!("messages[{}]", k - shift),
                marker,
                "messages",
            ));
        }
    }
    Ok(())
}

/// The 400 for `at` writing `marker`.
fn turn_marker(at: &str, marker: &str, param: &str) -> ApiError {
    ApiError::bad_request(
        format!(
            "{at} writes `{marker}`, a turn marker of the model's chat template: it would be \
             read as a turn boundary, not as text"
        ),
        Some(param),
    )
}

/// The tokens of `ids` (a rendered chat) that every conversation with the same leading
/// system (and developer) messages shares: those messages and the next turn's opening, up to
/// where its text starts. None when the chat has no such part (or nothing after it).
pub fn shared_prefix(
    tk: &ModelTokenizer,
    tpl: &ChatTemplate,
    msgs: &[Message],
    ids: &[u32],
) -> Option<usize> {
    let lead = msgs
        .iter()
        .take_while(|m| matches!(m.role.as_str(), "system" | "developer"))
        .count();
    let next = msgs.get(lead).filter(|_| lead > 0)?;
    // The same leading messages and an empty next turn: the common start is what any other
    // conversation's prompt shares with this one.
    let mut probe = msgs[..lead].to_vec();
    probe.push(Message::new(&next.role, ""));
    let text = tpl.render(&probe, false).ok()?;
    let p = tpl.encode(tk, &text).ok()?;
    Some(p.iter().zip(ids).take_while(|(a, b)| a == b).count())
}

/// One prompt's ids (`/tokenize`, the router's cache-aware pick): one text (tokenized) or token
/// ids as given; a batch is refused here (`/v1/completions` serves batches itself).
pub fn completion_ids(tk: &ModelTokenizer, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
    match prompt {
        Prompt::Tokens(t) => Ok(t.clone()),
        Prompt::Text(t) => encode(tk, t),
        Prompt::Texts(v) if v.len() == 1 => encode(tk, &v[0]),
        Prompt::TokenLists(v) if v.len() == 1 => Ok(v[0].clone()),
        Prompt::Texts(v) => Err(several(v.len())),
        Prompt::TokenLists(v) => Err(several(v.len())),
    }
}

/// A batch where one prompt is wanted: refused, naming the way that works.
fn several(n: usize) -> ApiError {
    ApiError::bad_request(
        format!("{n} prompts in one request: send one prompt per request"),
        Some("prompt"),
    )
}

/// [`encode`], for a prompt to run within `context` tokens: a text that cannot fit (its bytes
/// alone say so, [`ModelTokenizer::fewest_tokens`]) is refused before it is tokenized, naming
/// `field`.
pub fn encode_within(
    tk: &ModelTokenizer,
    text: &str,
    context: Option<usize>,
    field: &str,
) -> Result<Vec<u32>, ApiError> {
    check_fits(tk, text, context, field)?;
    encode(tk, text)
}

/// Refuses a prompt's text that cannot fit `context` tokens: its bytes alone say so
/// ([`ModelTokenizer::fewest_tokens`]), before seconds of tokenizing; names `field`.
fn check_fits(
    tk: &ModelTokenizer,
    text: &str,
    context: Option<usize>,
    field: &str,
) -> Result<(), ApiError> {
    let fewest = tk.fewest_tokens(text);
    if let Some(c) = context.filter(|&c| fewest > c) {
        let m = format!(
            "the prompt ({} bytes) has at least {fewest} tokens; the context length is {c}",
            text.len()
        );
        return Err(ApiError::bad_request(m, Some(field)).with_code("context_length_exceeded"));
    }
    Ok(())
}

pub fn encode(tk: &ModelTokenizer, text: &str) -> Result<Vec<u32>, ApiError> {
    tk.encode_prompt(text)
        .map_err(|e| ApiError::bad_request(e.to_string(), Some("prompt")))
}

/// Token ids → text (completions' `echo` of a prompt given as ids).
pub fn decode_ids(tk: &ModelTokenizer, ids: &[u32]) -> Result<String, ApiError> {
    tk.decode(ids)
        .map_err(|e| ApiError::bad_request(e.to_string(), Some("prompt")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::JsonSchemaFormat;

    fn format(description: Option<&str>) -> ResponseFormat {
        ResponseFormat::JsonSchema {
            json_schema: JsonSchemaFormat {
                name: "person".into(),
                description: description.map(Into::into),
                schema: None,
                strict: None,
            },
        }
    }

    fn tool() -> ToolDef {
        serde_json::from_str(r#"{"type": "function", "function": {"name": "f"}}"#).unwrap()
    }

    #[test]
    fn what_a_request_shows_names_where_it_comes_from() {
        assert_eq!(Shown::of(None, None), None);
        assert_eq!(Shown::of(None, Some(&ResponseFormat::JsonObject {})), None);
        assert_eq!(Shown::of(None, Some(&format(None))), None);
        assert_eq!(Shown::of(None, Some(&format(Some(" \n")))), None);
        let d = Shown::of(None, Some(&format(Some("Who was asked about.")))).unwrap();
        assert_eq!(
            d.parts,
            [(
                "response_format",
                "# Response format\n\nAnswer in the JSON format `person`: Who was asked about."
                    .to_string()
            )]
        );
        let tools = [tool()];
        let t = Shown::of(Some(&tools), None).unwrap();
        assert_eq!(t.parts, [("tools", crate::tools::system_text(&tools))]);
        let both = Shown::of(Some(&tools), Some(&format(Some("Who was asked about.")))).unwrap();
        assert_eq!(both.parts, [t.parts[0].clone(), d.parts[0].clone()]);
        assert_eq!(both.text(), format!("{}\n\n{}", t.text(), d.text()));
    }

    #[test]
    fn what_a_request_shows_goes_in_the_system_message() {
        let shown = Shown::of(None, Some(&format(Some("Who.")))).unwrap();
        let user: ChatMessage =
            serde_json::from_str(r#"{"role": "user", "content": "hi"}"#).unwrap();
        let sys: ChatMessage =
            serde_json::from_str(r#"{"role": "developer", "content": "Be brief."}"#).unwrap();
        let alone = template_messages(std::slice::from_ref(&user), Some(&shown)).unwrap();
        assert_eq!(alone.len(), 2);
        assert_eq!(
            (alone[0].role.as_str(), alone[0].content.as_str()),
            ("system", shown.text().as_str())
        );
        let joined = template_messages(&[sys, user], Some(&shown)).unwrap();
        assert_eq!(joined.len(), 2);
        assert_eq!(joined[0].content, format!("Be brief.\n\n{}", shown.text()));
    }
}
