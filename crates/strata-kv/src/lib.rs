//! `strata-kv`: cached KV data across tiers.
//!
//! * [`layout`]: pool kinds and page layouts (device layer-first, host page-first).
//! * [`pages`], [`memory`], [`pool`]: page allocation and the byte pools.
//! * [`tree`]: the radix tree with per-tier residency, locks and eviction order.
//! * [`policy`]: write policies and eviction policies.
//! * [`hash`]: stable chained page hashes (keys for L3 and routing).
//! * [`storage`]: the L3 trait with disk and memory backends.
//! * [`copy`]: asynchronous copy workers.
//! * [`cache`]: [`TieredCache`], which ties it all together and keeps [`CacheStats`].
//! * [`mrc`]: a live miss-ratio curve from the page stream (SHARDS sampling, fixed memory).
//! * [`stats`]: the counters every cache operation updates; [`units`]: sizes with units;
//!   [`dtype`]: element types of cached state (K/V quantized or not) and their row bytes.
//! * [`auth`]: the cluster key and its MACs; [`rng`]: the workspace's one deterministic
//!   generator; [`tp`]: how heads, feed-forward columns and vocabulary split over ranks.
//! * [`testing`]: a stand-in model whose pages are a function of their identity (tests).
//!
//! No async runtime here: callers own a `TieredCache` on one thread; copies run on workers.

pub mod auth;
pub mod cache;
pub mod copy;
pub mod dtype;
pub mod hash;
pub mod layout;
pub mod memory;
pub mod mrc;
pub mod pages;
pub mod policy;
pub mod pool;
pub mod rng;
pub mod stats;
pub mod storage;
#[doc(hidden)]
pub mod testing;
pub mod tp;
pub mod tree;
pub mod units;

pub use cache::{
    CacheConfig, CacheError, CacheEvent, CacheMatch, Lease, Served, Ticket, Tier, TieredCache,
    DEFAULT_GDSF_HISTORY,
};
pub use hash::{HashNamespace, PageHash};
pub use layout::{Class, PageLayout, PoolKind};
pub use policy::{EvictionPolicy, PrefetchPolicy, WritePolicy};
pub use stats::{AutoLearning, CacheStats, PoolUsage, TierUsage, Transfer};
pub use tree::{NodeId, RadixTree, Slot, NO_PAGE, ROOT};
