//! `strata-router`: the router in front of Strata workers.
//!
//! * [`policy`]: the [`policy::LoadBalancingPolicy`] trait, one module per policy (round
//!   robin, least load, cache aware).
//! * [`cache_index`]: which worker holds which pages in which tier, from their cache events.
//! * [`forward`]: picking a pair, retrying once before any token, relaying.
//! * [`sse`]: a worker's SSE answer relayed under guard (its end, an idle bound, an error tail).
//! * [`front`]: the front door: answers counted, latencies, API keys.
//! * [`flush`]: `/flush_cache`, the router's admin endpoint (its `--admin-key`), on every worker.
//! * [`metrics`]: the router's `/metrics`, rendered from a snapshot of its figures.
//! * [`dashboard`], [`scrape`]: the workers' scraped figures, `/dashboard` and its history.
//! * [`curve`]: `/cache/curve`, the workers' live miss-ratio curves and the fleet's per role.
//! * [`routes`]: the HTTP API and the cache-event follower.
//! * [`state`], [`worker`]: what the handlers share.
//! * [`upstream`]: a worker's answer read within bounds (size, time, JSON).
//! * [`responses`], [`response_owners`]: `/v1/responses`, a continuation routed to the worker
//!   that stores its conversation.
//!
//! Wire types (cache events, cache info, PD requests) come from `strata-protocol`; request
//! bodies, errors, the prompt builder and cluster MACs from `strata-server`.

pub mod cache_index;
pub mod curve;
pub mod dashboard;
pub mod flush;
pub mod forward;
pub mod front;
pub mod metrics;
pub mod policy;
pub mod response_owners;
pub mod responses;
pub mod routes;
pub mod scrape;
pub mod sse;
pub mod state;
pub mod upstream;
pub mod worker;

pub use dashboard::health_loop;
pub use policy::Policy;
pub use routes::{index_loop, router};
pub use scrape::WorkerStats;
pub use state::RouterState;
pub use worker::Worker;
