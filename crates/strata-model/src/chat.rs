//! The chat template stored in the GGUF, rendered with a real Jinja engine, on an instruction
//! budget, in a child process of its own where the program enabled it
//! ([`crate::template_sandbox`]).

use minijinja::Environment;

use crate::error::ModelError;
pub use crate::jinja::Message;
use crate::jinja::{compile, render_fueled, RAN_PAST};

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where renders run when the program enabled child processes.
    sandbox: Option<crate::template_sandbox::Sandbox>,
    source: String,
    /// The control tokens its source writes (its turn markers), found once per tokenizer.
    markers: std::sync::OnceLock<TurnMarkers>,
    /// The [`probes`] it renders.
    probed: Vec<String>,
}

/// The control tokens a template writes between turns (`<|im_start|>`, `<|im_end|>`, Llama
/// 3's `<|start_header_id|>`, ...), matched at once: a message whose content writes one would
/// be read as a turn boundary of the model's own, so a user could open a system turn.
struct TurnMarkers {
    texts: Vec<String>,
    matcher: Option<aho_corasick::AhoCorasick>,
    /// What a rendered prompt is split at before its text is tokenized: the markers and the
    /// vocabulary's user-defined tokens (leftmost, longest first, as the tokenizer's own
    /// search for special tokens).
    splits: Splits,
}

/// Texts searched for leftmost-longest, each standing for its token.
struct Splits {
    texts: Vec<String>,
    matcher: Option<aho_corasick::AhoCorasick>,
}

impl Splits {
    fn new(texts: Vec<String>) -> Splits {
        let matcher = aho_corasick::AhoCorasick::builder()
            .match_kind(aho_corasick::MatchKind::LeftmostLongest)
            .build(&texts)
            .ok();
        Splits { texts, matcher }
    }

    /// The first split at or after `from`: its start, end and text.
    fn next(&self, text: &str, from: usize) -> Option<(usize, usize, &str)> {
        if let Some(ac) = &self.matcher {
            let hit = ac.find(aho_corasick::Input::new(text).span(from..text.len()))?;
            let t = self.texts[hit.pattern().as_usize()].as_str();
            return Some((hit.start(), hit.end(), t));
        }
        // No matcher could be built: each text looked for in turn (never no split).
        self.texts
            .iter()
            .filter_map(|t| text[from..].find(t.as_str()).map(|at| (from + at, t)))
            .min_by_key(|&(at, t)| (at, std::cmp::Reverse(t.len())))
            .map(|(at, t)| (at, at + t.len(), t.as_str()))
    }
}

/// Conversations a template is rendered with to find the markers it builds: every role, with
/// and without the assistant's turn opened, in plain text that writes no special token. A
/// template that refuses one (roles must alternate, ...) is read from the others.
fn probes() -> Vec<(Vec<Message>, bool)> {
    let m = |r: &str| Message::new(r, "x");
    vec![
        (vec![m("user")], true),
        (vec![m("system"), m("user")], true),
        (
            vec![m("system"), m("user"), m("assistant"), m("user")],
            true,
        ),
        (vec![m("user"), m("assistant")], false),
        (vec![m("user"), m("assistant"), m("tool")], true),
    ]
}

impl ChatTemplate {
    /// Compiles `source` and renders the [`probes`] with it: a template that runs past a
    /// limit on a conversation of a few short messages is refused here, when the model is
    /// opened, not on a client's request.
    pub fn new(source: &str) -> Result<ChatTemplate, ModelError> {
        let mut t = ChatTemplate {
            env: compile(source)?,
            sandbox: crate::template_sandbox::Sandbox::new(source),
            markers: std::sync::OnceLock::new(),
            source: source.to_string(),
            probed: Vec::new(),
        };
        for (msgs, open) in probes() {
            match t.render(&msgs, open) {
                Ok(text) => t.probed.push(text),
                Err(ModelError::Template(e)) if e.starts_with(RAN_PAST) => {
                    return Err(ModelError::Template(format!(
                        "{e} (rendering {} short messages): the chat template loops too long",
                        msgs.len()
                    )));
                }
                Err(_) => {} // a conversation this template refuses (`probes`)
            }
        }
        Ok(t)
    }

    /// The first turn marker of this template (a control token of `tk` it writes, in its
    /// source or as it renders) found in `text`, if any. The markers are found
    /// on the first call (one tokenizer per template).
    pub fn turn_marker_in(&self, tk: &crate::ModelTokenizer, text: &str) -> Option<&str> {
        let m = self.markers(tk);
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

    /// The markers of this template for `tk`, found on the first call: the control tokens it
    /// writes, in its source or built as it renders (`'<|' + role + '|>'`, found by rendering
    /// [`probes`]).
    fn markers(&self, tk: &crate::ModelTokenizer) -> &TurnMarkers {
        self.markers.get_or_init(|| {
            let written =
                |t: &str| self.source.contains(t) || self.probed.iter().any(|r| r.contains(t));
            let texts: Vec<String> = tk
                .control_texts()
                .iter()
                .filter(|t| written(t))
                .cloned()
                .collect();
            let matcher = aho_corasick::AhoCorasick::new(&texts).ok();
            // User-defined tokens are their ids wherever they are written (llama.cpp's rule),
            // and no marker: the server writes some itself in messages (a Qwen vocabulary's
            // `<tool_call>`, around a call in the history).
            let mut split = texts.clone();
            split.extend(tk.user_defined_texts().iter().cloned());
            TurnMarkers {
                texts,
                matcher,
                splits: Splits::new(split),
            }
        })
    }

    /// The token ids of `text`, a conversation this template rendered, as a prompt (BOS first
    /// where the vocabulary adds one): the template's turn markers are their tokens, and every
    /// other special token written in the text (`<|endoftext|>` in a message) is read as text,
    /// so what a message says cannot become a control token. Refuses text that still
    /// tokenizes to a control token (a vocabulary whose merges make one).
    pub fn encode(&self, tk: &crate::ModelTokenizer, text: &str) -> Result<Vec<u32>, ModelError> {
        let splits = &self.markers(tk).splits;
        let mut ids = Vec::new();
        let mut at = 0;
        while at < text.len() {
            let next = splits.next(text, at);
            let end = next.map_or(text.len(), |(start, _, _)| start);
            let part = tk.encode_text(&text[at..end])?;
            if let Some(&c) = part.iter().find(|&&id| tk.is_control(id)) {
                let name = tk.inner.id_to_token(c).unwrap_or_default();
                return Err(ModelError::Tokenizer(format!(
                    "the text tokenizes to control token {c} (`{}`) where it is not a marker \
                     of the chat template",
                    name.escape_debug()
                )));
            }
            ids.extend(part);
            let Some((_, stop, t)) = next else { break };
            let id = tk
                .token_to_id(t)
                .ok_or_else(|| ModelError::Tokenizer(format!("special token `{t}` has no id")))?;
            ids.push(id);
            at = stop;
        }
        Ok(tk.with_bos(ids))
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
        match &self.sandbox {
            Some(s) => s.render(messages, add_generation_prompt),
            None => render_fueled(&self.env, messages, add_generation_prompt),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nested loops each under minijinja's own caps: refused when the model is opened, in
    /// about the allowance's time (not the 10^10 steps').
    #[test]
    fn a_template_that_loops_too_long_is_refused_when_opened() {
        let t0 = std::time::Instant::now();
        let src =
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}";
        let e = ChatTemplate::new(src).err().expect("refused").to_string();
        assert!(e.contains("ran past its budget"), "{e}");
        assert!(e.contains("the chat template loops too long"), "{e}");
        eprintln!("refused in {:?}", t0.elapsed());
    }

    /// A template whose work grows with the conversation is refused for the conversation
    /// that takes it past the budget (an error for that request), not for short ones; a real
    /// template renders a conversation of tens of thousands of messages.
    #[test]
    fn the_budget_grows_with_the_conversation() {
        let per = "{% for m in messages %}{% for i in range(100000) %}{% endfor %}{{ m['content'] }}{% endfor %}";
        let t = ChatTemplate::new(per).unwrap();
        let msgs = |n: usize| vec![Message::new("user", "x"); n];
        assert!(t.render(&msgs(4), true).is_ok());
        let e = t.render(&msgs(400), true).unwrap_err().to_string();
        assert!(
            e.contains("ran past its budget of 5400000 instructions for 400 messages"),
            "{e}"
        );
        // However long the conversation, at most 50 million.
        let e = t.render(&msgs(120_000), true).unwrap_err().to_string();
        assert!(
            e.contains("budget of 50000000 instructions for 120000 messages"),
            "{e}"
        );
        let t0 = std::time::Instant::now();
        let t = ChatTemplate::new(crate::tiny::TINY_TEMPLATE).unwrap();
        let out = t.render(&msgs(50_000), true).unwrap();
        assert_eq!(out.matches("<|im_start|>user").count(), 50_000);
        eprintln!("50,000 messages in {:?}", t0.elapsed());
    }
}
