//! Requests → prompt token ids: the one builder the worker (to compute the prompt) and the
//! router (to hash it as the worker will) both use, so the two can never disagree on roles,
//! content parts or templates.

use strata_model::{ChatTemplate, Message, ModelTokenizer};

use crate::api::{ChatMessage, Content, Prompt};
use crate::error::ApiError;

/// The chat messages as the template sees them: roles checked (`developer` → `system`), text
/// parts joined; any other part is refused.
pub fn template_messages(messages: &[ChatMessage]) -> Result<Vec<Message>, ApiError> {
    let mut msgs = Vec::with_capacity(messages.len());
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
                Some("messages"),
            ));
        }
        let text = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(p)) => {
                let mut s = String::new();
                for (j, part) in p.iter().enumerate() {
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(t)) => s.push_str(t),
                        _ => {
                            return Err(ApiError::bad_request(
                                format!(
                                    "messages[{i}].content[{j}]: only text parts are supported"
                                ),
                                Some("messages"),
                            ))
                        }
                    }
                }
                s
            }
        };
        let role = if m.role == "developer" {
            "system"
        } else {
            &m.role
        };
        msgs.push(Message::new(role, &text));
    }
    Ok(msgs)
}

/// A chat request's prompt ids: messages rendered with the model's template, tokenized.
pub fn chat_ids(
    tk: &ModelTokenizer,
    tpl: Option<&ChatTemplate>,
    messages: &[ChatMessage],
) -> Result<Vec<u32>, ApiError> {
    let Some(tpl) = tpl else {
        return Err(ApiError::bad_request(
            "this model has no chat template: use /v1/completions",
            Some("messages"),
        ));
    };
    let text = tpl
        .render(&template_messages(messages)?, true)
        .map_err(|e| ApiError::bad_request(e.to_string(), Some("messages")))?;
    encode(tk, &text)
}

/// A completion request's prompt ids: one text (tokenized) or token ids as given.
pub fn completion_ids(tk: &ModelTokenizer, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
    match prompt {
        Prompt::Tokens(t) => Ok(t.clone()),
        Prompt::Text(t) => encode(tk, t),
        Prompt::Texts(v) if v.len() == 1 => encode(tk, &v[0]),
        Prompt::Texts(v) => Err(ApiError::bad_request(
            format!(
                "{} prompts in one request: send one prompt per request",
                v.len()
            ),
            Some("prompt"),
        )),
    }
}

pub fn encode(tk: &ModelTokenizer, text: &str) -> Result<Vec<u32>, ApiError> {
    tk.encode(text)
        .map_err(|e| ApiError::bad_request(e.to_string(), Some("prompt")))
}

/// Token ids → text (completions' `echo` of a prompt given as ids).
pub fn decode_ids(tk: &ModelTokenizer, ids: &[u32]) -> Result<String, ApiError> {
    tk.decode(ids)
        .map_err(|e| ApiError::bad_request(e.to_string(), Some("prompt")))
}
