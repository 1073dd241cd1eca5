//! The answer's text → content and tool calls, incrementally (a stream) or at once.
//!
//! A call `<tool_call>{"name": "f", "arguments": {…}}</tool_call>` whose head names a callable
//! function and whose arguments are an object streams as OpenAI's do: a first delta with the
//! call's id, name and empty arguments as soon as the head is read, then the arguments' text as
//! it is written (whitespace outside strings dropped, keys in the order written), whole and
//! streamed answers alike. A call written otherwise (other key order, arguments as a string)
//! is read whole at its close (its arguments re-serialized); a block that is no call stays
//! content. A streamed call stands once its head is read: cut by the length limit, or broken,
//! its arguments are what was written (as OpenAI's); text after a call that never closes is
//! content.

use serde_json::{json, Value};

use super::{CLOSE, OPEN};

/// Longest head (`{"name": "…", "arguments": `) a call may have to stream; past it the call is
/// read whole at its close.
const MAX_HEAD: usize = 256;

/// One parsed call.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    /// Its place among the answer's calls.
    pub index: usize,
    pub id: String,
    pub name: String,
    /// JSON text (a streamed call's first delta: empty).
    pub arguments: String,
}

impl Call {
    /// As a whole message's `tool_calls` entry.
    pub fn json(&self) -> Value {
        json!({"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}})
    }

    /// As a streamed delta's entry (with its index).
    pub fn delta_json(&self) -> Value {
        let mut v = self.json();
        v["index"] = json!(self.index);
        v
    }
}

/// What the answer's text turns into.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolOut {
    Content(String),
    /// A call begins (streamed: empty arguments, `Args` follow) or a whole call.
    Call(Call),
    /// More of the arguments of the call at `index`.
    Args {
        index: usize,
        delta: String,
    },
}

impl ToolOut {
    /// As a streamed chat delta's `tool_calls` entry (None: content).
    pub fn delta_json(&self) -> Option<Value> {
        match self {
            ToolOut::Content(_) => None,
            ToolOut::Call(c) => Some(c.delta_json()),
            ToolOut::Args { index, delta } => {
                Some(json!({"index": index, "function": {"arguments": delta}}))
            }
        }
    }
}

/// Where the reader is.
#[derive(Debug)]
enum Mode {
    /// Outside a call.
    Text,
    /// After `<tool_call>`, reading the call's head.
    Head,
    /// Inside a streamed call's arguments.
    Args(Scan),
    /// After a streamed call's arguments: the call object's `}` (true once read) and
    /// `</tool_call>`; other text ends the call there and is content.
    Tail(bool),
    /// A call read whole at its close.
    Whole,
}

/// A JSON value's end, found character by character.
#[derive(Debug, Default)]
struct Scan {
    depth: usize,
    in_string: bool,
    escape: bool,
}

enum Feed {
    Keep,
    /// Whitespace outside strings.
    Skip,
    /// The value's last character.
    Last,
    /// No JSON: the arguments end before it.
    Broken,
}

impl Scan {
    fn feed(&mut self, c: char) -> Feed {
        if self.in_string {
            match (self.escape, c) {
                (true, _) => self.escape = false,
                (false, '\\') => self.escape = true,
                (false, '"') => self.in_string = false,
                _ => {}
            }
            return Feed::Keep;
        }
        match c {
            ' ' | '\n' | '\r' | '\t' => Feed::Skip,
            '"' => {
                self.in_string = true;
                Feed::Keep
            }
            '{' | '[' => {
                self.depth += 1;
                Feed::Keep
            }
            '}' | ']' => {
                self.depth = self.depth.saturating_sub(1);
                match self.depth {
                    0 => Feed::Last,
                    _ => Feed::Keep,
                }
            }
            '<' => Feed::Broken,
            _ => Feed::Keep,
        }
    }
}

/// Why a head was not read.
enum Miss {
    /// Consistent so far: more text may complete it.
    Need,
    /// Not a streamable head.
    No,
}

struct Cur<'a> {
    s: &'a str,
    at: usize,
}

impl Cur<'_> {
    fn ws(&mut self) {
        let rest = &self.s[self.at..];
        self.at += rest.len() - rest.trim_start_matches([' ', '\n', '\r', '\t']).len();
    }

    fn lit(&mut self, l: &str) -> Result<(), Miss> {
        let rest = &self.s[self.at..];
        if rest.starts_with(l) {
            self.at += l.len();
            Ok(())
        } else if l.starts_with(rest) {
            Err(Miss::Need)
        } else {
            Err(Miss::No)
        }
    }

    fn string(&mut self) -> Result<String, Miss> {
        let start = self.at;
        self.lit("\"")?;
        let mut escape = false;
        for (i, b) in self.s.as_bytes()[self.at..].iter().enumerate() {
            match (escape, b) {
                (true, _) => escape = false,
                (false, b'\\') => escape = true,
                (false, b'"') => {
                    let end = self.at + i + 1;
                    self.at = end;
                    return serde_json::from_str(&self.s[start..end]).map_err(|_| Miss::No);
                }
                _ => {}
            }
        }
        Err(Miss::Need)
    }
}

/// `{"name": "f", "arguments": {` → the name and where the arguments' `{` is.
fn head(s: &str) -> Result<(String, usize), Miss> {
    let mut c = Cur { s, at: 0 };
    for l in ["{", "\"name\"", ":"] {
        c.ws();
        c.lit(l)?;
    }
    c.ws();
    let name = c.string()?;
    for l in [",", "\"arguments\"", ":", "{"] {
        c.ws();
        c.lit(l)?;
    }
    Ok((name, c.at - 1))
}

fn parse_call(body: &str, names: &[String], index: usize) -> Option<Call> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?;
    if !names.iter().any(|n| n == name) {
        return None;
    }
    let arguments = match v.get("arguments")? {
        Value::String(s) => s.clone(),
        a @ Value::Object(_) => a.to_string(),
        _ => return None,
    };
    Some(Call {
        index,
        id: format!("call_{}", crate::ids::fresh_id()),
        name: name.to_string(),
        arguments,
    })
}

/// Length of the longest suffix of `s` that is a proper prefix of `pat`.
fn partial_suffix(s: &str, pat: &str) -> usize {
    (1..pat.len().min(s.len() + 1))
        .rev()
        .find(|&k| s.is_char_boundary(s.len() - k) && pat.starts_with(&s[s.len() - k..]))
        .unwrap_or(0)
}

/// The answer's text → content and calls (push pieces, then finish). Text that may begin a
/// call is held back until it is known.
#[derive(Debug)]
pub struct ToolStream {
    names: Vec<String>,
    buf: String,
    mode: Mode,
    /// Whitespace after a call is no content unless text follows it (then it separates that
    /// text from the text before the call, where there was some): held here meanwhile.
    after_call: bool,
    held_ws: String,
    /// Some content went out.
    said: bool,
    /// Calls begun.
    pub calls: usize,
    /// Calls are forced: no text is content (what is not a call is a call's markup cut short).
    forced: bool,
    /// `parallel_tool_calls: false`: the first call only (later ones are neither calls nor
    /// content).
    one: bool,
}

/// How an answer's calls are read: forced (`required`, a named function: calls only), and at
/// most one (`parallel_tool_calls: false`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallRules {
    pub forced: bool,
    pub one: bool,
}

impl From<bool> for CallRules {
    fn from(forced: bool) -> CallRules {
        CallRules { forced, one: false }
    }
}

impl ToolStream {
    pub fn new(names: Vec<String>) -> ToolStream {
        ToolStream {
            names,
            buf: String::new(),
            mode: Mode::Text,
            after_call: false,
            held_ws: String::new(),
            said: false,
            calls: 0,
            forced: false,
            one: false,
        }
    }

    /// The rules' settings: under a forced call (`required`, a named function) the grammar
    /// lets the answer be calls only, so anything else parsed out is a call cut short
    /// (`max_tokens`), dropped; with `one`, the first call only.
    pub fn ruled(mut self, r: CallRules) -> ToolStream {
        self.forced = r.forced;
        self.one = r.one;
        self
    }

    /// `out` without its text when calls are forced, without the calls after the first when
    /// only one is asked for.
    fn only_calls(&self, mut out: Vec<ToolOut>) -> Vec<ToolOut> {
        if self.forced {
            out.retain(|o| !matches!(o, ToolOut::Content(_)));
        }
        if self.one {
            out.retain(|o| match o {
                ToolOut::Call(c) => c.index == 0,
                ToolOut::Args { index, .. } => *index == 0,
                ToolOut::Content(_) => true,
            });
        }
        out
    }

    fn content(&mut self, mut s: String, out: &mut Vec<ToolOut>) {
        if self.after_call {
            self.held_ws += &s;
            let text = self.held_ws.trim_start();
            if text.is_empty() {
                return;
            }
            // "It is sunny. <tool_call>…</tool_call>\nThen…": the text on both sides of the
            // call keeps the whitespace after it between them.
            let ws = self.held_ws.len() - text.len();
            let from = if self.said { 0 } else { ws };
            s = self.held_ws[from..].to_string();
            self.held_ws.clear();
            self.after_call = false;
        }
        if !s.is_empty() {
            self.said = true;
            out.push(ToolOut::Content(s));
        }
    }

    pub fn push(&mut self, delta: &str) -> Vec<ToolOut> {
        self.buf += delta;
        let mut out = Vec::new();
        while self.step(&mut out) {}
        self.only_calls(out)
    }

    /// One step over the buffer; false when it needs more text.
    fn step(&mut self, out: &mut Vec<ToolOut>) -> bool {
        match self.mode {
            Mode::Text => self.text(out),
            Mode::Head => self.head(out),
            Mode::Args(_) => self.args(out),
            Mode::Tail(brace) => self.tail(brace),
            Mode::Whole => self.whole(out),
        }
    }

    fn text(&mut self, out: &mut Vec<ToolOut>) -> bool {
        if let Some(i) = self.buf.find(OPEN) {
            let before = self.buf[..i].trim_end().to_string();
            self.buf.drain(..i + OPEN.len());
            self.content(before, out);
            self.mode = Mode::Head;
            return true;
        }
        // Held back: what may begin a call, and the whitespace before it (no content if a
        // call follows).
        let partial = partial_suffix(&self.buf, OPEN);
        let head = &self.buf[..self.buf.len() - partial];
        let keep = partial + (head.len() - head.trim_end().len());
        let ready: String = self.buf.drain(..self.buf.len() - keep).collect();
        self.content(ready, out);
        false
    }

    fn head(&mut self, out: &mut Vec<ToolOut>) -> bool {
        match head(&self.buf) {
            Err(Miss::Need) if self.buf.len() <= MAX_HEAD => false,
            // Decided by where the head ends, not by how much text has come: streamed and
            // whole answers agree.
            Ok((name, at)) if at <= MAX_HEAD && self.names.contains(&name) => {
                out.push(ToolOut::Call(Call {
                    index: self.calls,
                    id: format!("call_{}", crate::ids::fresh_id()),
                    name,
                    arguments: String::new(),
                }));
                self.calls += 1;
                self.buf.drain(..at);
                self.mode = Mode::Args(Scan::default());
                true
            }
            _ => {
                self.mode = Mode::Whole;
                true
            }
        }
    }

    fn args(&mut self, out: &mut Vec<ToolOut>) -> bool {
        let Mode::Args(scan) = &mut self.mode else {
            return false;
        };
        let mut delta = String::new();
        let mut end = None;
        for (i, c) in self.buf.char_indices() {
            match scan.feed(c) {
                Feed::Keep => delta.push(c),
                Feed::Skip => {}
                Feed::Last => {
                    delta.push(c);
                    end = Some(i + c.len_utf8());
                    break;
                }
                Feed::Broken => {
                    end = Some(i);
                    break;
                }
            }
        }
        if !delta.is_empty() {
            out.push(ToolOut::Args {
                index: self.calls - 1,
                delta,
            });
        }
        match end {
            Some(e) => {
                self.buf.drain(..e);
                self.mode = Mode::Tail(false);
                true
            }
            None => {
                self.buf.clear();
                false
            }
        }
    }

    fn tail(&mut self, brace: bool) -> bool {
        let ws = self.buf.len() - self.buf.trim_start().len();
        self.buf.drain(..ws);
        if !brace && self.buf.starts_with('}') {
            self.buf.drain(..1);
            self.mode = Mode::Tail(true);
            let ws = self.buf.len() - self.buf.trim_start().len();
            self.buf.drain(..ws);
        }
        if self.buf.starts_with(CLOSE) {
            self.buf.drain(..CLOSE.len());
        } else if CLOSE.starts_with(self.buf.as_str()) {
            // Nothing yet, or the closing tag's start.
            return false;
        }
        // Closed, or the call ends without its closing tag: what follows is content.
        self.mode = Mode::Text;
        self.after_call = true;
        true
    }

    fn whole(&mut self, out: &mut Vec<ToolOut>) -> bool {
        let Some(j) = self.buf.find(CLOSE) else {
            return false;
        };
        let body: String = self.buf.drain(..j + CLOSE.len()).collect();
        let body = &body[..j];
        self.mode = Mode::Text;
        match parse_call(body, &self.names, self.calls) {
            Some(c) => {
                self.calls += 1;
                self.after_call = true;
                out.push(ToolOut::Call(c));
            }
            None => {
                self.said = true;
                out.push(ToolOut::Content(format!("{OPEN}{body}{CLOSE}")));
            }
        }
        true
    }

    /// The rest: text held back, or a call never closed (as content; a streamed call stands).
    pub fn finish(&mut self) -> Vec<ToolOut> {
        let rest = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        match std::mem::replace(&mut self.mode, Mode::Text) {
            Mode::Text => self.content(rest, &mut out),
            Mode::Head | Mode::Whole => out.push(ToolOut::Content(format!("{OPEN}{rest}"))),
            Mode::Args(_) | Mode::Tail(_) => {}
        }
        self.only_calls(out)
    }
}

/// Outputs → (content, calls with their whole arguments).
pub fn gather(outs: Vec<ToolOut>) -> (Option<String>, Vec<Call>) {
    let mut content = String::new();
    let mut calls: Vec<Call> = Vec::new();
    for o in outs {
        match o {
            ToolOut::Content(c) => content += &c,
            ToolOut::Call(c) => calls.push(c),
            ToolOut::Args { index, delta } => {
                if let Some(c) = calls.iter_mut().find(|c| c.index == index) {
                    c.arguments += &delta;
                }
            }
        }
    }
    ((!content.is_empty()).then_some(content), calls)
}

/// A whole answer's text → (content, calls).
pub fn parse_all(
    text: &str,
    names: Vec<String>,
    rules: impl Into<CallRules>,
) -> (Option<String>, Vec<Call>) {
    let mut ts = ToolStream::new(names).ruled(rules.into());
    let mut outs = ts.push(text);
    outs.extend(ts.finish());
    gather(outs)
}

#[cfg(test)]
mod tests;
