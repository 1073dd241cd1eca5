//! Log probabilities in OpenAI's two shapes: chat (`{"content": [{token, logprob, bytes,
//! top_logprobs}]}`) and completions (`{tokens, token_logprobs, top_logprobs, text_offset}`).

use serde_json::{json, Map, Value};
use strata_engine::{PromptLogprobs, TokenLogprobs};
use strata_model::ModelTokenizer;

/// A token's text as the client sees it (its UTF-8 bytes go with it).
fn text(tk: &ModelTokenizer, id: u32) -> String {
    tk.decode_fragment(&[id]).unwrap_or_default()
}

/// A chat entry: the token's text and its own bytes (a part of a character, whose text is
/// `�`, has its real bytes: joined, they are the output's UTF-8).
fn chat_entry(tk: &ModelTokenizer, id: u32, lp: f32) -> Value {
    let t = text(tk, id);
    let bytes = tk.token_bytes(id).unwrap_or_else(|| t.as_bytes().to_vec());
    json!({"token": t, "logprob": lp, "bytes": bytes})
}

/// The `logprobs` of a choice (or of one streamed chunk) covering `lps`, in the chat shape or
/// the completions one; `offset` is the length in characters of the text before them
/// (completions' `text_offset`).
pub(crate) fn render(
    tk: &ModelTokenizer,
    chat: bool,
    lps: &[TokenLogprobs],
    offset: usize,
) -> Value {
    match chat {
        true => {
            let content: Vec<Value> = lps
                .iter()
                .map(|l| {
                    let mut e = chat_entry(tk, l.token, l.logprob);
                    e["top_logprobs"] = l
                        .top
                        .iter()
                        .map(|&(id, lp)| chat_entry(tk, id, lp))
                        .collect();
                    e
                })
                .collect();
            json!({"content": content})
        }
        false => {
            let mut tokens = Vec::new();
            let mut offsets = Vec::new();
            let mut at = offset;
            for l in lps {
                let t = text(tk, l.token);
                offsets.push(at);
                at += t.chars().count();
                tokens.push(t);
            }
            let top: Vec<Value> = lps
                .iter()
                .map(|l| {
                    // Keyed by text: of alternatives that decode alike (two halves of one
                    // character), the likeliest stands.
                    let mut m = Map::new();
                    for &(id, lp) in &l.top {
                        m.entry(text(tk, id)).or_insert(json!(lp));
                    }
                    Value::Object(m)
                })
                .collect();
            let token_logprobs: Vec<f32> = lps.iter().map(|l| l.logprob).collect();
            json!({"tokens": tokens, "token_logprobs": token_logprobs,
                   "top_logprobs": top, "text_offset": offsets})
        }
    }
}

/// A prompt's log probabilities in the completions shape (`echo` with `logprobs`): the first
/// token's log probability and alternatives are null (nothing precedes it); offsets count from
/// the start of the prompt.
pub(crate) fn render_prompt(tk: &ModelTokenizer, p: &PromptLogprobs) -> Value {
    let first = text(tk, p.first_token);
    let mut v = render(tk, false, &p.tokens, first.chars().count());
    let lead = [
        ("tokens", json!(first)),
        ("token_logprobs", Value::Null),
        ("top_logprobs", Value::Null),
        ("text_offset", json!(0)),
    ];
    for (key, x) in lead {
        if let Some(a) = v[key].as_array_mut() {
            a.insert(0, x);
        }
    }
    v
}

/// The `text_offset` just past the last token of completions-shaped `logprobs` (None when it
/// has none): where the tokens after them start, counted the way their own offsets are (a
/// character split over two tokens counts once per token, as each token's text is `�`).
pub(crate) fn after(v: &Value) -> Option<usize> {
    let offset = v["text_offset"].as_array()?.last()?.as_u64()?;
    let token = v["tokens"].as_array()?.last()?.as_str()?;
    Some(offset as usize + token.chars().count())
}

/// Two completions-shaped `logprobs` one after the other.
pub(crate) fn concat(mut a: Value, mut b: Value) -> Value {
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(x), Value::Array(y)) = (a[key].as_array_mut(), b[key].take()) {
            x.extend(y);
        }
    }
    a
}
