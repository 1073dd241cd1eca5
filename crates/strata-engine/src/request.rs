//! What a caller submits and what it receives back.

use std::sync::Arc;

use thiserror::Error;
use tokio::sync::mpsc::UnboundedReceiver;

/// How to pick each next token. `temperature == 0` is greedy (top-k/top-p ignored).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Tokens to generate at most (the engine caps it at the context length).
    pub max_tokens: usize,
    pub temperature: f32,
    /// Nucleus: smallest set of tokens whose probability reaches `top_p` (1 = off).
    pub top_p: f32,
    /// Only the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Seed of the request's generator (None: from the request id).
    pub seed: Option<u64>,
    /// Token ids that end generation (the model's end-of-sequence tokens are added unless
    /// `ignore_eos`). The stop token itself is not returned.
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// OpenAI penalties on the tokens generated so far: a token's logit is lowered by
    /// `frequency_penalty × its count + presence_penalty × [count > 0]`.
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// vLLM's (and HF's) repetition penalty on tokens of the prompt or the output: a positive
    /// logit is divided by it, a negative one multiplied (1 = off).
    pub repetition_penalty: f32,
    /// Added to a token's logit before anything else (OpenAI `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// Tokens less likely than `min_p` × the likeliest token's probability are dropped
    /// (0 = off).
    pub min_p: f32,
    /// The stop tokens (the model's end-of-sequence ones and `stop_token_ids`) cannot be
    /// chosen before this many tokens were generated.
    pub min_tokens: usize,
    /// Report each chosen token's log probability and this many likeliest alternatives
    /// (None: no log probabilities).
    pub logprobs: Option<usize>,
    /// Report the log probability of every prompt token after the first (and this many
    /// likeliest alternatives), from the model's own distribution (no modifier, temperature
    /// 1). The prompt is then computed whole: logits of cached positions do not exist, so the
    /// prefix cache is not matched (its pages still join the tree at the end).
    pub prompt_logprobs: Option<usize>,
    /// The output must follow this constraint (a grammar): only the tokens it allows are
    /// chosen, and the request ends when it is complete.
    pub constraint: Option<crate::constraint::Constraint>,
    /// The first this many prompt tokens are a prefix other requests are expected to share
    /// and leave (a chat's system part, up to where a user's turn starts; 0: none). With a
    /// model whose window state is kept only where a continuation can start, the cache keeps
    /// it there too, so those requests resume at that point. Changes no output.
    pub shared_prefix: usize,
    /// The conversation or agent session this request belongs to (a keyed hash of the API's
    /// `prompt_cache_key` or `user`): the cache retires the session's previous answer when
    /// this prompt continues that request's prompt without it (`strata_kv` `cache/session.rs`).
    /// Changes no output.
    pub session: Option<u64>,
}

impl SamplingParams {
    /// Whether anything changes the logits before the choice (then the sampler works on a
    /// copy).
    pub fn modifies_logits(&self) -> bool {
        self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
            || self.min_tokens > 0
            || self.constraint.is_some()
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 16,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            min_p: 0.0,
            min_tokens: 0,
            logprobs: None,
            prompt_logprobs: None,
            constraint: None,
            shared_prefix: 0,
            session: None,
        }
    }
}

/// Why generation ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token.
    Stop,
    /// `max_tokens` (or the context length) reached.
    Length,
    /// The engine shut down before the request finished.
    Aborted,
    /// The model failed on this request's batch.
    Error(String),
    /// It waited for admission longer than the engine's queueing-time limit (nothing was
    /// computed; a retry may pass).
    QueueTimeout { waited: std::time::Duration },
}

/// Prompt tokens served from each cache tier at admission.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CachedTokens {
    pub device: usize,
    pub host: usize,
    pub storage: usize,
}

impl CachedTokens {
    pub fn total(&self) -> usize {
        self.device + self.host + self.storage
    }
}

/// A prompt's K/V (or part of it), out of (or into) a device pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportedKv {
    /// The index of the first page in `pages` (the receiver holds the ones before).
    pub first: usize,
    pub pages: Vec<Vec<u8>>,
    /// The chained hash of each page in `pages` (zero for a partial last page).
    pub hashes: Vec<[u8; 16]>,
}

/// K/V computed elsewhere (a prefill worker) for a prompt, and the first token it sampled.
#[derive(Clone, Debug)]
pub struct ImportedKv {
    /// The index of the first page in `pages`: 0 for [`crate::EngineHandle::submit_prefilled`];
    /// for [`crate::EngineHandle::deliver`], the pages the request held (`Event::Held`).
    pub first_page: usize,
    pub pages: Vec<Vec<u8>>,
    pub first_token: u32,
    /// The first token's log probabilities, when the request asked for them.
    pub first_logprobs: Option<TokenLogprobs>,
    /// How the prefill worker served the prompt (reported as this request's cached tokens).
    pub cached: CachedTokens,
    /// The prompt's log probabilities (positions 1..), when the request asked for them.
    pub prompt_logprobs: Option<Vec<TokenLogprobs>>,
}

/// The log probabilities of a prompt's tokens: the first has none (nothing precedes it); each
/// later one's comes from the logits of the position before it.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptLogprobs {
    pub first_token: u32,
    /// Positions 1.. of the prompt, in order.
    pub tokens: Vec<TokenLogprobs>,
}

/// Events of one request, in order: `Admitted`, then `Token`s, then one `Done`.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A request submitted with [`crate::EngineHandle::submit_remote`], its prefix on device:
    /// the prompt's first `tokens` (whole pages) are this worker's cache's. With `prefill` it
    /// waits for the rest's K/V ([`crate::EngineHandle::deliver`]); without, it computes the
    /// rest here (at most the request's local threshold), and `Admitted` follows at once.
    /// With `tokens` 0 it is handed back: nothing follows (the stream closes); submit it
    /// again with all of its K/V ([`crate::EngineHandle::submit_prefilled`]).
    Held { tokens: usize, prefill: bool },
    /// The prompt was matched against the cache; computing starts.
    Admitted { cached: CachedTokens },
    /// The prompt's log probabilities (requests that asked for them), once, before the first
    /// token.
    PromptLogprobs(Arc<PromptLogprobs>),
    /// The log probabilities of the token that follows (requests that asked for them).
    Logprobs(TokenLogprobs),
    /// One generated token.
    Token(u32),
    /// Part of the prompt's K/V (requests submitted with
    /// [`crate::EngineHandle::submit_export`]): one blob per page in the wire layout, with the
    /// chained page hash of each whole page (zero for a partial last page). Parts come in
    /// order without gaps, as the prompt's chunks are computed; the last one (it ends at the
    /// prompt's last page) comes after the first `Token`, before `Done`.
    Kv(Arc<ExportedKv>),
    /// The request ended; nothing follows.
    Done {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached: CachedTokens,
    },
}

/// A submitted request: its events. Dropping it cancels the request (its pages return to the
/// pool at the engine's next step).
pub struct RequestStream {
    pub id: u64,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    pub events: UnboundedReceiver<Event>,
}

/// Why a request was not accepted.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SubmitError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("token id {id} is outside the vocabulary ({vocab} tokens)")]
    BadToken { id: u32, vocab: usize },
    #[error(
        "the prompt has {prompt} tokens; with max_tokens {max_tokens} it needs {needed} tokens \
         but the context length is {context}"
    )]
    TooLongForContext {
        prompt: usize,
        max_tokens: usize,
        needed: usize,
        context: usize,
    },
    #[error(
        "the request needs {needed} tokens of KV ({prompt} prompt + {max_tokens} max_tokens) \
         but the device pool holds {capacity} tokens"
    )]
    TooLongForPool {
        prompt: usize,
        max_tokens: usize,
        needed: usize,
        capacity: usize,
    },
    #[error(
        "n = {count} choices of up to {max_tokens} tokens each after a {prompt}-token prompt \
         need {needed} tokens of the {what} at once, which holds {capacity}: {}",
        if *fits == 0 { "ask for fewer choices (or use a shorter prompt)".to_string() }
        else { format!("set max_tokens to at most {fits} or ask for fewer choices") }
    )]
    ChoicesTooLarge {
        count: usize,
        prompt: usize,
        max_tokens: usize,
        needed: usize,
        capacity: usize,
        what: &'static str,
        fits: usize,
    },
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("max_tokens {max_tokens} exceeds the context length ({context} tokens)")]
    MaxTokensTooLarge { max_tokens: usize, context: usize },
    #[error("{count} stop_token_ids: at most {limit}")]
    TooManyStopTokens { count: usize, limit: usize },
    #[error("stop_token_ids: token id {id} is outside the vocabulary ({vocab} tokens)")]
    BadStopToken { id: u32, vocab: usize },
    /// A logit modifier out of range (`field`: the request field at fault).
    #[error("{message}")]
    BadModifier {
        field: &'static str,
        message: String,
    },
    #[error("{0}")]
    BadConstraint(String),
    #[error("the engine is not running: {0}")]
    EngineDead(String),
    #[error("the waiting queue is full ({limit} requests); retry later")]
    QueueFull { limit: usize },
    #[error("too many tokens in flight ({in_flight} + {wanted} > {limit}); retry later")]
    TooManyTokens {
        in_flight: usize,
        wanted: usize,
        limit: usize,
    },
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("transferred KV refused: {0}")]
    BadKv(String),
}

impl SubmitError {
    /// True for refusals that a later retry may pass (HTTP 429 / 503).
    pub fn is_overload(&self) -> bool {
        matches!(
            self,
            SubmitError::QueueFull { .. } | SubmitError::TooManyTokens { .. }
        )
    }
}

/// Most `stop_token_ids` one request may give.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// Most `logit_bias` entries one request may give.
pub const MAX_LOGIT_BIAS: usize = 1024;

/// Most alternatives per token a request may ask log probabilities of.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A chosen token's log probability and the likeliest alternatives', from the distribution
/// the sampler chose from (after the logit modifiers and the temperature; before top-k, min-p
/// and top-p cut it).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// Likeliest first.
    pub top: Vec<(u32, f32)>,
}

/// Checks the logit modifiers of `p` for a vocabulary of `vocab` tokens.
pub fn check_modifiers(p: &SamplingParams, vocab: usize) -> Result<(), SubmitError> {
    let bad =
        |field: &'static str, message: String| Err(SubmitError::BadModifier { field, message });
    if p.logit_bias.len() > MAX_LOGIT_BIAS {
        let n = p.logit_bias.len();
        return bad(
            "logit_bias",
            format!("{n} logit_bias entries: at most {MAX_LOGIT_BIAS}"),
        );
    }
    for &(id, b) in &p.logit_bias {
        if id as usize >= vocab {
            return bad(
                "logit_bias",
                format!("logit_bias: token id {id} is outside the vocabulary ({vocab} tokens)"),
            );
        }
        if !b.is_finite() {
            return bad(
                "logit_bias",
                format!("logit_bias {b} for token {id} is not finite"),
            );
        }
    }
    for (field, v) in [
        ("frequency_penalty", p.frequency_penalty),
        ("presence_penalty", p.presence_penalty),
    ] {
        if !v.is_finite() {
            return bad(field, format!("{field} {v} is not finite"));
        }
    }
    if !(p.repetition_penalty > 0.0 && p.repetition_penalty.is_finite()) {
        let v = p.repetition_penalty;
        return bad(
            "repetition_penalty",
            format!("repetition_penalty {v} must be > 0"),
        );
    }
    if !(0.0..=1.0).contains(&p.min_p) {
        return bad("min_p", format!("min_p {} is outside [0, 1]", p.min_p));
    }
    if p.logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
        let k = p.logprobs.unwrap_or(0);
        return bad(
            "top_logprobs",
            format!("{k} alternatives per token: at most {MAX_TOP_LOGPROBS}"),
        );
    }
    if let Some(k) = p.prompt_logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
        return bad(
            "logprobs",
            format!("{k} alternatives per prompt token: at most {MAX_TOP_LOGPROBS}"),
        );
    }
    if p.min_tokens > p.max_tokens {
        let (m, x) = (p.min_tokens, p.max_tokens);
        return bad(
            "min_tokens",
            format!("min_tokens {m} exceeds max_tokens {x}"),
        );
    }
    Ok(())
}

/// Whether the scheduler thread is working.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineHealth {
    Alive,
    /// The scheduler thread ended without a shutdown (it panicked): nothing more will run.
    Dead(String),
    /// The scheduler thread has not come round its loop for this long.
    Stalled(std::time::Duration),
    /// Shutting down on request.
    Closing,
}

impl EngineHealth {
    pub fn is_alive(&self) -> bool {
        *self == EngineHealth::Alive
    }
}

/// Which tiers `flush` empties (only pages no running request uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlushScope {
    /// The device tier: prefixes stay cached in host (and L3) where they were backed up.
    Device,
    /// Device and host tiers; L3 storage is kept (it may be shared).
    All,
}
