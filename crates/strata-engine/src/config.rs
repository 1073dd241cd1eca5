//! The engine's configuration: scheduling limits and admission bounds.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_kv::PrefetchPolicy;

use crate::record::TraceRecorder;

/// Most prompt tokens per model call, over all requests that want their log probabilities:
/// the logits of every such row come back from the call (the memory plan reserves them).
pub const PROMPT_LOGPROB_ROWS: usize = 256;

/// What a finished request's answer leaves in the prefix cache. A later prompt that extends
/// it (the next turn of a conversation, an agent's next call) reuses what is cached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheOutputs {
    /// The answer's positions computed again as prompt rows once its last token is chosen,
    /// then cached, then its client told it is done (`Done` waits for that prefill): a later
    /// prompt reads the K/V a fresh computation of it makes, bit for bit, for the cost of a
    /// prefill of the answer. Models whose decode
    /// steps store the prompt rows' bits ([`strata_model::Runtime::decode_rows_differ`])
    /// cache the answer as computed.
    Exact,
    /// The answer cached as its decode steps computed it: no extra work, but a later prompt
    /// that extends it gets other bits in its last places than an uncached worker's.
    AsDecoded,
    /// Prompts only: a later prompt computes the answer again itself.
    Off,
}

impl CacheOutputs {
    /// The flag's value (`--cache-outputs`).
    pub fn parse(s: &str) -> Option<CacheOutputs> {
        match s {
            "exact" => Some(CacheOutputs::Exact),
            "as-decoded" => Some(CacheOutputs::AsDecoded),
            "off" => Some(CacheOutputs::Off),
            _ => None,
        }
    }
}

/// Scheduling limits.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Tokens per model call: one per decoding request, the rest for prefill chunks.
    pub max_batch_tokens: usize,
    /// Requests computing at once (prefill or decode).
    pub max_running: usize,
    /// Requests waiting for admission; beyond it submissions are refused (HTTP 429).
    pub max_waiting: usize,
    /// Prompt + max_tokens summed over accepted, unfinished requests; beyond it submissions
    /// are refused. 0: four times the device pool's tokens.
    pub max_tokens_in_flight: usize,
    /// Token ids that end generation (the model's end-of-sequence tokens).
    pub stop_token_ids: Vec<u32>,
    /// The model's id (as in the cache's page hashes), stated at KV-transfer handshakes.
    pub model_id: String,
    pub prefetch: PrefetchPolicy,
    /// Reuse cached prefixes. `false` (a baseline for benchmarks): every prompt is computed in
    /// full and nothing joins the tree; hits stay zero and misses count every prompt token.
    pub prefix_cache: bool,
    /// What a finished request's generated tokens leave in the cache (with `prefix_cache`).
    pub cache_outputs: CacheOutputs,
    /// A request still waiting for admission after this long is answered
    /// [`crate::FinishReason::QueueTimeout`] (None: it waits as long as it takes).
    pub max_queue_time: Option<Duration>,
    /// The scheduler counts as stalled when one pass of its loop takes longer than this.
    pub stall_after: Duration,
    /// Test hook (fault injection): the scheduler thread panics when it receives a prompt that
    /// starts with this token id. Never set in production; it exists so that tests can check
    /// what a dead engine does to `/health` and to a supervisor.
    pub fault_panic_token: Option<u32>,
    /// Records every served request into a Mooncake-format trace (`strata serve
    /// --record-trace`); None: nothing recorded.
    pub record_trace: Option<Arc<Mutex<TraceRecorder>>>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_batch_tokens: 512,
            max_running: 32,
            max_waiting: 128,
            max_tokens_in_flight: 0,
            stop_token_ids: Vec::new(),
            model_id: String::new(),
            prefetch: PrefetchPolicy::WaitComplete,
            prefix_cache: true,
            cache_outputs: CacheOutputs::Exact,
            max_queue_time: None,
            stall_after: Duration::from_secs(60),
            fault_panic_token: None,
            record_trace: None,
        }
    }
}
