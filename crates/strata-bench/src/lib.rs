//! `strata-bench`: what `strata bench` sends and how it summarises what came back.
//!
//! * [`workload`]: deterministic request generators (multi-turn chat, shared-prefix groups,
//!   Mooncake trace replay), checked before any request is sent.
//! * [`stats`]: percentiles and the per-configuration summary.

pub mod stats;
pub mod workload;
