//! `strata-grammar`: structured output. A request's [`OutputConstraint`] (JSON object, JSON
//! schema, regex, Lark grammar, choice) is compiled with llguidance — the grammar engine vLLM,
//! SGLang and llama.cpp use — over the model's own tokenizer, into an engine
//! [`Constraint`]: each request then runs an llguidance matcher that gives the mask of the
//! tokens allowed next and follows the tokens chosen.
//!
//! * [`Grammars`]: built once per tokenizer (the token trie and llguidance's factory).
//! * [`Compiled`]: one compiled constraint; every request (and every choice of `n`) starts its
//!   own matcher from it.
//! * [`limits`]: size caps checked before anything is compiled.
//!
//! JSON is generated compact (no free whitespace between tokens: `{"a":1,"b":[2]}`) unless
//! the schema says otherwise with llguidance's `x-guidance` options; small models otherwise
//! spend their tokens on whitespace.

pub mod limits;

use std::any::Any;
use std::sync::{Arc, Mutex};

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory, TokenParser};
use strata_engine::{Constraint, ConstraintSource, TokenConstraint, TokenMask};
use strata_model::ModelTokenizer;
pub use strata_protocol::OutputConstraint;
use thiserror::Error;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum GrammarError {
    /// The tokenizer cannot be described to the grammar engine.
    #[error("structured output is unavailable for this tokenizer: {0}")]
    Tokenizer(String),
    /// The request's constraint is invalid (the message names the problem).
    #[error("{0}")]
    Invalid(String),
}

/// The model's tokenizer as llguidance sees it: every token's bytes in a trie, and the real
/// tokenizer for text the grammar forces.
struct TokenizerView {
    trie: TokTrie,
    tokenizer: Arc<ModelTokenizer>,
}

impl TokenizerEnv for TokenizerView {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            // The trie's greedy tokenization stands in if the tokenizer refuses the text.
            self.tokenizer
                .encode_fragment(text)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(text.as_bytes()))
        })
    }
}

/// Every token's bytes, as the trie wants them: byte-level BPE symbols mapped back to bytes,
/// special tokens marked, ids past the tokenizer's vocabulary (an embedding padded beyond it)
/// filled with unreachable special names.
fn token_bytes(tk: &ModelTokenizer, vocab: usize) -> Result<Vec<Vec<u8>>, GrammarError> {
    let bad = |e: String| GrammarError::Tokenizer(e);
    let json = tk.inner.to_string(false).map_err(|e| bad(e.to_string()))?;
    let value: serde_json::Value = serde_json::from_str(&json).map_err(|e| bad(e.to_string()))?;
    // llguidance asserts on names it does not expect (a `<0x..>` piece that is no byte): a
    // hostile vocabulary is an error here, not a panic of the worker.
    let mut bytes =
        std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&value))
            .map_err(|_| bad("the vocabulary has a token the grammar engine cannot read".into()))?
            .map_err(|e| bad(e.to_string()))?;
    if bytes.len() > vocab {
        return Err(bad(format!(
            "the tokenizer has {} tokens, the model {vocab}",
            bytes.len()
        )));
    }
    while bytes.len() < vocab {
        let mut name = format!(".<[{}]>", bytes.len()).into_bytes();
        name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
        bytes.push(name);
    }
    Ok(bytes)
}

/// The grammar engine for one model: compiles constraints.
pub struct Grammars {
    factory: ParserFactory,
    /// The tokens that end a constrained output (the model's stop tokens).
    ends: Vec<u32>,
    /// Hashes of constraints [`Grammars::check`] found valid (at most [`CHECKED`]).
    checked: Mutex<std::collections::HashSet<u64>>,
    keys: std::collections::hash_map::RandomState,
}

/// Valid constraints [`Grammars::check`] remembers; when full it forgets them all.
pub const CHECKED: usize = 1024;

impl Grammars {
    /// Builds the token trie of `tk` (a model of `vocab` tokens); its stop tokens end a
    /// constrained output.
    pub fn new(tk: Arc<ModelTokenizer>, vocab: usize) -> Result<Grammars, GrammarError> {
        let bytes = token_bytes(&tk, vocab)?;
        let ends = tk.stop.clone();
        let eos = tk.stop.first().copied().unwrap_or(tk.eos);
        let info = TokRxInfo::new(vocab as u32, eos);
        let trie = TokTrie::from(&info, &bytes).with_eos_tokens(&tk.stop);
        let env: TokEnv = Arc::new(TokenizerView {
            trie,
            tokenizer: tk,
        });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits {
            // Errors name the problem, not the whole grammar and the tokens so far.
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(Grammars {
            factory,
            ends,
            checked: Mutex::default(),
            keys: Default::default(),
        })
    }

    /// Compiles a constraint; one beyond the size caps ([`limits`]) is refused before any
    /// work, an invalid one with llguidance's reason (its first line: no backtrace, no
    /// source path), a panic of the grammar engine as an invalid constraint.
    pub fn compile(&self, c: &OutputConstraint) -> Result<Compiled, GrammarError> {
        limits::check(c)?;
        let grammar = top_level(c)?;
        let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.factory.create_parser(grammar)
        }));
        let parser = match made {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => return Err(GrammarError::Invalid(first_line(&e.to_string()))),
            Err(_) => {
                return Err(GrammarError::Invalid(
                    "the grammar engine could not compile this constraint (an internal limit \
                     was reached); simplify it"
                        .into(),
                ))
            }
        };
        // A constraint that admits nothing (`{"$ref": "#"}`, two definitions naming each
        // other) fails its first mask; some of the grammar engine's limits show only once
        // output is taken (a rule of 2,000 alternatives, a schema that forces endless output):
        // both refused here, not as a failed generation.
        self.probe(&parser)?;
        Ok(Compiled {
            spec: c.clone(),
            parser: Mutex::new(parser),
            ends: self.ends.clone(),
        })
    }
}

/// Tokens [`Grammars::probe`] chooses along a constraint's lowest allowed path.
const PROBE_TOKENS: usize = 4;
/// Tokens the grammar forces (a forced tool call's `<tool_call>` and its name, a constant)
/// that [`Grammars::probe`] takes on the way, free, at most.
const PROBE_FORCED: usize = 256;

impl Grammars {
    /// Takes up to [`PROBE_TOKENS`] tokens along the lowest allowed path of a fresh copy of
    /// `parser` (stop tokens aside), each mask computed and each token consumed as generation
    /// would, and before each the tokens the grammar forces (up to [`PROBE_FORCED`] in all:
    /// a constant start, such as a forced call's wrapper, does not use the probe up before
    /// the part that can fail): an error on the way refuses the constraint.
    fn probe(&self, parser: &TokenParser) -> Result<(), GrammarError> {
        let fail = |taken: usize, e: &dyn std::fmt::Display| {
            let m = first_line(&e.to_string());
            GrammarError::Invalid(match taken {
                0 => format!("the constraint admits no output ({m})"),
                n => {
                    format!("the constraint fails after {n} token(s) of output ({m}); simplify it")
                }
            })
        };
        let mut m = Matcher::new(Ok(parser.deep_clone()));
        // Tokens taken, and chosen; while `forcing`, forced runs are taken free before each
        // choice. Where the engine cannot say what is forced (a run past its own cap, a panic
        // in it), the walk goes on token by token from where it was, up to
        // `PROBE_FORCED` tokens: what it could not force is not taken as a failure.
        let (mut taken, mut chosen, mut forcing) = (0, 0, true);
        while chosen < PROBE_TOKENS && taken < PROBE_FORCED + PROBE_TOKENS {
            if forcing && taken < PROBE_FORCED {
                let before = m.deep_clone();
                let mut forced = m.compute_ff_tokens();
                if m.get_error().is_some() {
                    m = before;
                    forcing = false;
                } else if !forced.is_empty() {
                    forced.truncate(PROBE_FORCED - taken);
                    m.consume_tokens(&forced)
                        .map_err(|e| fail(taken + forced.len(), &e))?;
                    taken += forced.len();
                }
            }
            if m.is_stopped() {
                break;
            }
            let mask = m.compute_mask_or_eos().map_err(|e| fail(taken, &e))?;
            let Some(t) = mask.iter().find(|t| !self.ends.contains(t)) else {
                break;
            };
            m.consume_token(t).map_err(|e| fail(taken + 1, &e))?;
            taken += 1;
            if forcing || taken >= PROBE_FORCED {
                chosen += 1;
            }
        }
        Ok(())
    }

    /// Whether a constraint compiles, for one the output is not held to (the schemas of
    /// tools a model may call or not): it is compiled once, and a valid one is remembered,
    /// as a client sends the same tools with every request.
    pub fn check(&self, c: &OutputConstraint) -> Result<(), GrammarError> {
        use std::hash::BuildHasher;
        let key = self
            .keys
            .hash_one(serde_json::to_string(c).unwrap_or_default());
        let checked = || self.checked.lock().unwrap_or_else(|p| p.into_inner());
        if checked().contains(&key) {
            return Ok(());
        }
        self.compile(c)?;
        let mut set = checked();
        if set.len() >= CHECKED {
            set.clear();
        }
        set.insert(key);
        Ok(())
    }
}

/// The first line of an error, at most 300 bytes: llguidance's messages can carry a
/// backtrace or an assertion with source paths after it.
fn first_line(m: &str) -> String {
    let mut lines = m.lines().map(str::trim).filter(|l| !l.is_empty());
    let mut line = lines.next().unwrap_or("").to_string();
    // A line that only announces the reason ("regex parse error:", then the pattern, a caret
    // and "error: unclosed group") gets the reason: the line that starts with `error:`, else
    // the next.
    if line.ends_with(':') {
        let rest: Vec<&str> = lines.collect();
        let reason = rest
            .iter()
            .find(|l| l.starts_with("error:"))
            .or(rest.first());
        if let Some(r) = reason {
            line = format!("{line} {}", r.trim_start_matches("error:").trim_start());
        }
    }
    let line = line.as_str();
    let mut end = line.len().min(300);
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    let mut out = line[..end].to_string();
    if end < line.len() {
        out.push('…');
    }
    out
}

/// Compact JSON unless the schema sets llguidance's own options.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}

/// The llguidance grammar of a constraint.
fn top_level(c: &OutputConstraint) -> Result<TopLevelGrammar, GrammarError> {
    let invalid = |m: String| GrammarError::Invalid(m);
    Ok(match c {
        OutputConstraint::JsonObject => {
            TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
        }
        OutputConstraint::JsonSchema(text) => {
            let schema: serde_json::Value = serde_json::from_str(text)
                .map_err(|e| invalid(format!("the JSON schema is not JSON: {e}")))?;
            if !(schema.is_object() || schema.is_boolean()) {
                return Err(invalid("a JSON schema is an object or a boolean".into()));
            }
            TopLevelGrammar::from_json_schema(compact(schema))
        }
        OutputConstraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
        OutputConstraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        OutputConstraint::Choice(v) => {
            if v.is_empty() {
                return Err(invalid("a choice needs at least one text".into()));
            }
            let alts: Vec<String> = v
                .iter()
                .map(|s| serde_json::to_string(s).expect("a string serializes"))
                .collect();
            TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
        }
    })
}

/// One compiled constraint.
pub struct Compiled {
    spec: OutputConstraint,
    /// Each request starts from a deep copy.
    parser: Mutex<TokenParser>,
    ends: Vec<u32>,
}

impl Compiled {
    /// What was compiled.
    pub fn spec(&self) -> &OutputConstraint {
        &self.spec
    }

    /// As an engine constraint for a request's sampling parameters.
    pub fn into_constraint(self) -> Constraint {
        Constraint(Arc::new(self))
    }

    /// The compiled constraint behind an engine constraint made by [`Compiled`].
    pub fn of(c: &Constraint) -> Option<&Compiled> {
        c.0.as_any().downcast_ref::<Compiled>()
    }
}

impl ConstraintSource for Compiled {
    fn start(&self) -> Box<dyn TokenConstraint> {
        let parser = self
            .parser
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .deep_clone();
        Box::new(Guided {
            matcher: Matcher::new(Ok(parser)),
            ends: self.ends.clone(),
        })
    }

    fn describe(&self) -> String {
        match &self.spec {
            OutputConstraint::JsonObject => "json_object".into(),
            OutputConstraint::JsonSchema(s) => format!("json_schema ({} bytes)", s.len()),
            OutputConstraint::Regex(s) => format!("regex ({} bytes)", s.len()),
            OutputConstraint::Lark(s) => format!("lark ({} bytes)", s.len()),
            OutputConstraint::Choice(v) => format!("choice of {}", v.len()),
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// One request's matcher.
struct Guided {
    matcher: Matcher,
    ends: Vec<u32>,
}

impl TokenConstraint for Guided {
    fn mask(&mut self) -> Result<TokenMask, String> {
        let vob = self.matcher.compute_mask_or_eos().map_err(|e| {
            format!(
                "the output constraint failed: {}",
                first_line(&e.to_string())
            )
        })?;
        let can_end = self.ends.iter().any(|&t| vob.is_allowed(t));
        Ok(TokenMask {
            words: vob.as_slice().to_vec(),
            can_end,
        })
    }

    fn commit(&mut self, token: u32) -> Result<(), String> {
        self.matcher.consume_token(token).map_err(|e| {
            let e = first_line(&e.to_string());
            format!("the output constraint refused token {token}: {e}")
        })
    }

    fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests;
