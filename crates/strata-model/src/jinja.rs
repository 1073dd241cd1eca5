//! Rendering a chat template with minijinja on an instruction budget: what
//! [`crate::chat::ChatTemplate`] does in its own process and a child of
//! [`crate::template_sandbox`] does in its.

use minijinja::{context, Environment};
use serde::{Deserialize, Serialize};

use crate::error::ModelError;

/// One chat message.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
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

/// Instructions one render may run (minijinja's fuel): an allowance, and more per message.
/// A template comes from a file (a hostile boundary): nested loops each under minijinja's
/// own caps (`range` of 100,000, twice: 10^10 steps) would hold a CPU for hours. The 39
/// templates of llama.cpp's `models/templates` that render plain messages take 94–301
/// instructions and 35–80 a message (DeepSeek-V4's the most): the allowance is 12 times
/// that, and at most 50 million (625,000 of DeepSeek-V4's messages, more than a body holds).
/// A template that spends it all holds a CPU for 0.13 s (5 million) to 1.3 s (50 million;
/// docs/BENCHMARKS.md, "Chat templates on a budget").
const FUEL: u64 = 5_000_000;
const FUEL_PER_MESSAGE: u64 = 1_000;
const FUEL_MAX: u64 = 50_000_000;

/// How a render that ran past one of its limits (instructions, and in a child process
/// memory, time, output) is reported.
pub(crate) const RAN_PAST: &str = "the chat template ran past";

/// `source` compiled as the template `chat`.
pub(crate) fn compile(source: &str) -> Result<Environment<'static>, ModelError> {
    let mut env = Environment::new();
    env.add_template_owned("chat", source.to_string())
        .map_err(|e| ModelError::Template(e.to_string()))?;
    Ok(env)
}

/// Renders `messages` with `env`'s template `chat` on the instruction budget.
pub(crate) fn render_fueled(
    env: &Environment<'static>,
    messages: &[Message],
    add_generation_prompt: bool,
) -> Result<String, ModelError> {
    let mut env = env.clone();
    let per_message = FUEL_PER_MESSAGE.saturating_mul(messages.len() as u64);
    let fuel = FUEL.saturating_add(per_message).min(FUEL_MAX);
    env.set_fuel(Some(fuel));
    let t = env
        .get_template("chat")
        .map_err(|e| ModelError::Template(e.to_string()))?;
    t.render(context! { messages => messages, add_generation_prompt => add_generation_prompt, bos_token => "", eos_token => "" })
        .map_err(|e| match e.kind() {
            minijinja::ErrorKind::OutOfFuel => ModelError::Template(format!(
                "{RAN_PAST} its budget of {fuel} instructions for {} messages",
                messages.len()
            )),
            _ => ModelError::Template(e.to_string()),
        })
}
