//! What the router keeps of its workers' figures: each worker's latest `/metrics`, parsed,
//! and the ring of samples `/dashboard` draws.

use std::collections::VecDeque;
use std::sync::Arc;

use serde::Serialize;
use strata_server::metrics::LATENCY_BUCKETS;

/// Samples kept: 15 minutes at the default health interval of one second.
pub const HISTORY_SAMPLES: usize = 900;

/// What the dashboard shows of a worker, from its `/metrics` (cumulative counters and gauges
/// as scraped; the page computes rates from consecutive samples).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct WorkerStats {
    pub prompt_tokens: f64,
    pub hit_device: f64,
    pub hit_host: f64,
    pub hit_l3: f64,
    pub miss: f64,
    pub device_used: f64,
    pub device_total: f64,
    pub host_used: f64,
    pub host_total: f64,
    pub ttft_sum: f64,
    pub ttft_count: f64,
    /// Cumulative TTFT bucket counts, one per `LATENCY_BUCKETS` bound, then +Inf.
    pub ttft_buckets: Vec<f64>,
    pub running: f64,
    pub queued: f64,
    pub generated: f64,
    pub requests_ok: f64,
    pub requests_error: f64,
    pub requests_429: f64,
    pub kv_sent_bytes: f64,
    pub kv_received_bytes: f64,
    /// Tokens evicted from the device and host tiers; pages the L3 tiers dropped (all tiers).
    pub evicted_device: f64,
    pub evicted_host: f64,
    pub evicted_l3: f64,
    /// Bytes the L3 tiers hold and may hold (all tiers).
    pub l3_used_bytes: f64,
    pub l3_capacity_bytes: f64,
}

impl WorkerStats {
    /// Reads the figures from a Prometheus text exposition.
    pub fn parse(text: &str) -> WorkerStats {
        let mut w = WorkerStats {
            ttft_buckets: vec![0.0; LATENCY_BUCKETS.len() + 1],
            ..WorkerStats::default()
        };
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((key, v)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(v) = v.parse::<f64>() else { continue };
            let (name, labels) = key.split_once('{').unwrap_or((key, ""));
            let has = |l: &str| labels.contains(l);
            match name {
                "strata_prompt_tokens_total" => w.prompt_tokens = v,
                "strata_cache_hit_tokens_total" if has("tier=\"device\"") => w.hit_device = v,
                "strata_cache_hit_tokens_total" if has("tier=\"host\"") => w.hit_host = v,
                "strata_cache_hit_tokens_total" => w.hit_l3 += v,
                "strata_cache_miss_tokens_total" => w.miss = v,
                "strata_cache_pages" if has("tier=\"device\"") && has("state=\"used\"") => {
                    w.device_used = v
                }
                "strata_cache_pages" if has("tier=\"device\"") => w.device_total = v,
                "strata_cache_pages" if has("state=\"used\"") => w.host_used = v,
                "strata_cache_pages" => w.host_total = v,
                "strata_time_to_first_token_seconds_sum" => w.ttft_sum = v,
                "strata_time_to_first_token_seconds_count" => w.ttft_count = v,
                "strata_time_to_first_token_seconds_bucket" => {
                    let le = labels
                        .split_once("le=\"")
                        .and_then(|(_, r)| r.split_once('"'))
                        .map(|(le, _)| le);
                    let i = match le {
                        Some("+Inf") => Some(LATENCY_BUCKETS.len()),
                        Some(b) => b
                            .parse::<f64>()
                            .ok()
                            .and_then(|b| LATENCY_BUCKETS.iter().position(|&x| x == b)),
                        None => None,
                    };
                    if let Some(i) = i {
                        w.ttft_buckets[i] = v;
                    }
                }
                "strata_running_requests" => w.running = v,
                "strata_queue_depth" => w.queued = v,
                "strata_generation_tokens_total" => w.generated = v,
                "strata_requests_total" if has("outcome=\"ok\"") => w.requests_ok = v,
                "strata_requests_total" if has("outcome=\"429\"") => w.requests_429 = v,
                "strata_requests_total" if has("outcome=\"4xx\"") || has("outcome=\"5xx\"") => {
                    w.requests_error += v
                }
                "strata_kv_transfer_bytes_total" if has("direction=\"sent\"") => {
                    w.kv_sent_bytes = v
                }
                "strata_kv_transfer_bytes_total" => w.kv_received_bytes = v,
                "strata_cache_evicted_tokens_total" if has("tier=\"device\"") => {
                    w.evicted_device = v
                }
                "strata_cache_evicted_tokens_total" => w.evicted_host += v,
                "strata_l3_evictions_total" => w.evicted_l3 += v,
                "strata_l3_used_bytes" => w.l3_used_bytes += v,
                "strata_l3_capacity_bytes" => w.l3_capacity_bytes += v,
                _ => {}
            }
        }
        w
    }
}

/// The router's own figures in a sample (cumulative).
#[derive(Clone, Debug, Default, Serialize)]
pub struct RouterSample {
    pub requests_2xx: u64,
    pub requests_4xx: u64,
    pub requests_429: u64,
    pub requests_5xx: u64,
    pub in_flight: u64,
    pub retries: u64,
}

/// One pass of the recorder: when, every worker's latest figures (None: not heard from since
/// the previous sample), and the router's.
#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    pub seq: u64,
    pub t_ms: u64,
    pub workers: Vec<Option<WorkerStats>>,
    pub router: RouterSample,
}

/// The ring of samples (shared, so that answers copy pointers, not figures, under the lock).
#[derive(Default)]
pub struct History {
    pub samples: VecDeque<Arc<Sample>>,
    pub next_seq: u64,
}

/// Most samples one `/dashboard/history` answer carries (the page asks again for the rest).
pub const SAMPLES_PER_ANSWER: usize = 120;

/// A worker not heard from for this many intervals is stale: its samples are gaps.
pub const STALE_INTERVALS: f64 = 2.5;
