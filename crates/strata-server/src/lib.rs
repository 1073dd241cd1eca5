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
//! * [`generation`]: `/v1/completions` and `/v1/chat/completions`, request to engine and back;
//!   [`choices`]: `n` > 1 at the cost of one prefill; [`respond`]: one engine request as a JSON
//!   body or an SSE stream; [`logprobs`]: log probabilities in OpenAI's two shapes.
//! * [`responses`], [`response_store`]: the Responses API and the bounded store
//!   `previous_response_id` continues.
//! * [`prompt`]: requests → prompt token ids (the one builder worker and router share);
//!   [`sampling`]: the sampling fields checked into the engine's parameters; [`fields`]: every
//!   request field's fate.
//! * [`body`]: request bodies read within limits; [`ids`]: request and completion ids;
//!   [`endpoints`]: `/v1/models`, `/tokenize`, `/detokenize`, `/tokenizer_info`, `/version`;
//!   [`internal`]: health, the admin flush, the cache views routers read.
//! * [`exposition`]: a worker's `/metrics` page; [`state`]: what every handler shares;
//!   [`curve`]: `/cache/curve`, the live miss-ratio curve as JSON.

pub mod api;
pub mod app;
pub mod auth;
pub mod body;
mod choices;
pub mod curve;
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
