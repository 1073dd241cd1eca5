//! `strata-engine`: one scheduler thread owns the model and the tiered cache.
//!
//! * [`sampler`]: the logit modifiers (penalties, bias, min_tokens), greedy / temperature /
//!   top-k / min-p / top-p sampling with a seeded generator, log probabilities.
//! * [`constraint`]: constrained decoding as the engine sees it — a mask of allowed tokens
//!   before each choice (computed while the model runs), the chosen token committed.
//! * [`request`]: what a caller submits and the events it receives.
//! * [`scheduler`]: admission (prefix match, lock, load-back, L3 prefetch), batches under a
//!   token budget (chunked prefill + one decode token per running request), sampling,
//!   insertion of finished sequences, cancellation.
//! * [`handle`]: the thread-safe front ([`EngineHandle`]): submit with admission control,
//!   flush, snapshots for metrics, shutdown.
//! * `config` ([`EngineConfig`]) and `state` (what the handles and the scheduler share:
//!   counters, the [`EventLog`], the latest [`Snapshot`]), both re-exported from [`handle`].
//! * [`transfer`]: KV transfer between workers (framed, checksummed, a handshake first).
//! * [`record`]: the served requests as a Mooncake-format trace (keyed page hashes, no
//!   tokens; `strata serve --record-trace`).

mod config;
pub mod constraint;
pub mod handle;
pub mod record;
pub mod request;
pub mod sampler;
pub mod scheduler;
mod state;
pub mod transfer;

pub use config::{CacheOutputs, PROMPT_LOGPROB_ROWS};
pub use constraint::{Constraint, ConstraintSource, TokenConstraint, TokenMask};
pub use handle::{Engine, EngineConfig, EngineHandle, EventLog, Snapshot};
pub use request::{
    CachedTokens, EngineHealth, Event, ExportedKv, FinishReason, FlushScope, ImportedKv,
    PromptLogprobs, RequestStream, SamplingParams, SubmitError, TokenLogprobs, MAX_STOP_TOKEN_IDS,
};
pub use strata_kv::PrefetchPolicy;
