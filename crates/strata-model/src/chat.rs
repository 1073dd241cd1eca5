//! The chat template stored in the GGUF, rendered with a real Jinja engine.

use minijinja::{context, Environment};
use serde::Serialize;

use crate::error::ModelError;

/// One chat message.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
}

impl ChatTemplate {
    pub fn new(source: &str) -> Result<ChatTemplate, ModelError> {
        let mut env = Environment::new();
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ModelError::Template(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
        })
    }

    /// The template's Jinja source, as the GGUF holds it.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders the conversation; `add_generation_prompt` opens the assistant's turn.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| ModelError::Template(e.to_string()))?;
        t.render(context! { messages => messages, add_generation_prompt => add_generation_prompt, bos_token => "", eos_token => "" })
            .map_err(|e| ModelError::Template(e.to_string()))
    }
}
