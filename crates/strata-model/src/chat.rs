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
    /// The control tokens its source writes (its turn markers), found once per tokenizer.
    markers: std::sync::OnceLock<TurnMarkers>,
}

/// The control tokens a template writes between turns (`<|im_start|>`, `<|im_end|>`, Llama
/// 3's `<|start_header_id|>`, ...), matched at once: a message whose content writes one would
/// be read as a turn boundary of the model's own, so a user could open a system turn.
struct TurnMarkers {
    texts: Vec<String>,
    matcher: Option<aho_corasick::AhoCorasick>,
}

impl ChatTemplate {
    pub fn new(source: &str) -> Result<ChatTemplate, ModelError> {
        let mut env = Environment::new();
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ModelError::Template(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            markers: std::sync::OnceLock::new(),
            source: source.to_string(),
        })
    }

    /// The first turn marker of this template (a control token of `tk` its source writes)
    /// found in `text`, if any. The markers are found on the first call (one tokenizer per
    /// template).
    pub fn turn_marker_in(&self, tk: &crate::ModelTokenizer, text: &str) -> Option<&str> {
        let m = self.markers.get_or_init(|| {
            let texts: Vec<String> = tk
                .control_texts()
                .iter()
                .filter(|t| self.source.contains(t.as_str()))
                .cloned()
                .collect();
            let matcher = aho_corasick::AhoCorasick::new(&texts).ok();
            TurnMarkers { texts, matcher }
        });
        match &m.matcher {
            Some(ac) => ac
                .find(text)
                .map(|hit| m.texts[hit.pattern().as_usize()].as_str()),
            // No matcher could be built: each marker looked for in turn (never no check).
            None => m
                .texts
                .iter()
                .find(|t| text.contains(t.as_str()))
                .map(String::as_str),
        }
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
