//! `strata-server`: the OpenAI-compatible HTTP API over one engine.
//!
//! * [`api`]: request and response bodies (OpenAI's shapes; unknown fields ignored, wrong
//!   types refused).
//! * [`error`]: OpenAI-style JSON errors with the right status.
//! * [`metrics`]: every metric (names, help, Prometheus text) of workers and the router.
//! * [`text`]: incremental detokenization and stop strings.
//! * [`app`]: the routes, the shared state and graceful shutdown.
//! * [`listen`]: the HTTP listener of router and workers: header/body deadlines, connection
//!   places, descriptor limit.
//! * [`kv_inbox`]: the decode worker's KV listener, bounded against hostile peers.
//! * [`places`]: bounded places for idle connections (HTTP and KV listeners), where idle
//!   strangers yield to newcomers.
//! * [`pd`]: prefill/decode disaggregation: `/pd/prefill`, the decode side.
//! * [`request_log`]: one log line per finished request (id, route, status, tokens, TTFT).
//! * [`auth`]: cluster MACs of calls between Strata processes.
//! * [`structured`]: the fields that constrain the output → one compiled grammar.
//! * [`tools`]: tool calling — tools shown in the prompt, forced calls as a grammar, the
//!   answer parsed into `tool_calls`.

pub mod api;
pub mod app;
pub mod auth;
pub mod body;
mod choices;
pub mod endpoints;
pub mod error;
pub mod exposition;
pub mod fields;
pub mod generation;
pub mod ids;
mod internal;
pub mod kv_inbox;
pub mod listen;
mod logprobs;
pub mod metrics;
pub mod pd;
pub mod places;
pub mod prompt;
pub mod request_log;
mod respond;
pub mod response_store;
pub mod responses;
pub mod sampling;
pub mod state;
pub mod structured;
pub mod text;
pub mod tools;

pub use app::{router, AppState};
pub use error::ApiError;
