//! Every metric Strata exports, in one place: names (one prefix, `strata_`; base units;
//! `_total` counters), their help lines, and the Prometheus text rendering of a worker's and
//! the router's state. docs/METRICS.md lists them.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// Name, type, help: the catalogue (docs/METRICS.md is generated from the same list by a test).
pub const CATALOGUE: &[(&str, &str, &str)] = &[
    // Cache.
    ("strata_prompt_tokens_total", "counter", "Prompt tokens of requests admitted by this worker's cache (transferred prompts excluded)."),
    ("strata_cache_hit_tokens_total", "counter", "Prompt tokens served from a cache tier, by tier (device, host, and the L3 tier: disk, remote or disk+remote); with strata_cache_miss_tokens_total they sum to strata_prompt_tokens_total."),
    ("strata_cache_miss_tokens_total", "counter", "Prompt tokens computed because no tier held them."),
    ("strata_cache_capacity_bytes", "gauge", "Bytes a cache tier can hold, by tier and pool kind."),
    ("strata_cache_used_bytes", "gauge", "Bytes of a cache tier in use, by tier and pool kind."),
    ("strata_cache_pages", "gauge", "Pages of a cache tier, by tier and state (used, total)."),
    ("strata_cache_window_pages", "gauge", "Window pages of a cache tier (models with window kinds: their state for the last tokens before a continuation), by tier and state (used, total)."),
    ("strata_cache_window_evicted_pages_total", "counter", "Window pages dropped from a tier while their nodes kept their main pages, by tier."),
    ("strata_cache_window_hits_total", "counter", "Prompt hits of a model with window kinds by where they resumed: as_matched (where the match ended: a committed sequence's end, or a checkpoint the prompt stopped at) or backed_off (to an earlier boundary that kept its window state, usually a checkpoint; the tokens after it are recomputed and counted in strata_cache_window_cut_tokens_total)."),
    ("strata_cache_window_cut_tokens_total", "counter", "Matched prompt tokens given up because the window state before their end was gone (the hit backed off to the deepest boundary that kept it; counted as misses)."),
    ("strata_pool_bytes_per_token", "gauge", "Bytes one token takes in a pool kind on one rank (kinds kept per block amortized over its tokens); a page holds every kind."),
    ("strata_cache_hit_bytes_total", "counter", "Bytes of each pool kind served from a cache tier: hit tokens by tier times the kind's bytes per token."),
    ("strata_cache_evicted_tokens_total", "counter", "Tokens evicted from a tier."),
    ("strata_cache_session_retired_tokens_total", "counter", "Cached tokens of answers marked evict-first because their session's next request (same prompt_cache_key or user) continued the previous prompt without them."),
    ("strata_cache_auto_newcomer_credit", "gauge", "The auto eviction policy's credit for a prefix new to the cache, in accesses (0.25 to 1; 1 is GDSF's order), learnt from which removed prefixes come back; absent under another --eviction."),
    ("strata_cache_auto_removed_pages_total", "counter", "Pages the auto eviction policy removed from the cache, by class: probation (never hit since it arrived) or used (flushes and retired answers excluded)."),
    ("strata_cache_auto_returned_pages_total", "counter", "Pages of new prefixes that began where a prefix the auto policy removed began, while it still remembered the removal (about one cache of removals), by the removed prefix's class: probation or used. The new prefix's pages count whole, so a class can return more pages than it lost. Returned over removed per class is what moves strata_cache_auto_newcomer_credit."),
    ("strata_cache_copy_bytes_total", "counter", "Bytes moved between tiers, by operation (load_back, backup, prefetch, l3_put)."),
    ("strata_cache_copy_operations_total", "counter", "Copies between tiers, by operation."),
    ("strata_cache_copy_seconds_total", "counter", "Time spent in copies between tiers, by operation."),
    ("strata_cache_copy_duration_seconds", "histogram", "Duration of one copy between tiers (a batch of pages), by operation."),
    ("strata_cache_curve_hit_ratio", "gauge", "The live miss-ratio curve: the hit ratio of prompt tokens (whole pages hit; the tokens after a prompt's last whole page never) a cache of scale × a tier's pages would have had, by tier (device, host, and the L3 tier by its name; each counting the tiers above it), scale (0.25, 0.5, 1, 2, 4, 8) and policy (the worker's --eviction): LRU over all traffic seen (sampled reuse distances, SHARDS); another policy over the recent window (a miniature simulation of its page-granular form)."),
    ("strata_cache_curve_belady_hit_ratio", "gauge", "Belady's MIN at each point of the live miss-ratio curve over the recent window of sampled references (what no policy could beat; a miniature simulation, refreshed in the background), by tier and scale; absent until the first simulation."),
    ("strata_cache_curve_pages", "gauge", "Pages of each point of the live miss-ratio curve (scale × the tier's pages), by tier and scale."),
    ("strata_cache_curve_bytes", "gauge", "Bytes of each point of the live miss-ratio curve: its pages with their share of window pages (models with window kinds: the tier's proportion of window to main pages, which the plan sizes by the residency rule), by tier and scale."),
    ("strata_cache_curve_step_bytes", "gauge", "Bytes the curve's answer adds to a tier: 1 GiB per tensor-parallel rank (--tp-size)."),
    ("strata_cache_curve_step_hit_ratio", "gauge", "The hit ratio a tier would have had with strata_cache_curve_step_bytes more, by tier (as if it were the last tier)."),
    ("strata_cache_curve_step_saved_prompt_tokens_per_second", "gauge", "The answer: prompt tokens per second that strata_cache_curve_step_bytes more in a tier would have served from the cache instead of prefilling them, over the last five minutes (the hit ratio's gain × prompt tokens per second), by tier."),
    ("strata_cache_curve_sample_rate", "gauge", "Fraction of pages the miss-ratio curve's sampler follows (it falls as the working set outgrows its budget: memory stays fixed)."),
    ("strata_cache_curve_tracked_pages", "gauge", "Pages the miss-ratio curve's sampler tracks now (at most --curve-pages)."),
    ("strata_cache_curve_memory_bytes", "gauge", "Bytes the miss-ratio curve's sampler holds, its window of recent sampled references included (fixed when it is made)."),
    ("strata_cache_curve_references_total", "counter", "Prompt pages the miss-ratio curve has observed (every served prompt's whole pages, once per request: a PD decode worker's included)."),
    ("strata_cache_curve_window_references", "gauge", "Sampled references the last window simulation counted (Belady's MIN and non-LRU policies)."),
    ("strata_cache_curve_prompt_tokens_per_second", "gauge", "Prompt tokens the curve observed per second over the last five minutes."),
    ("strata_l3_errors_total", "counter", "L3 storage errors by kind and tier (corrupt: a checksum or header mismatch, treated as a miss; layout: an intact, correctly keyed page of a page's size whose header names another page layout (e.g. another K/V dtype) under this page's hash, treated as a miss: pages of another layout have other hashes, so this is a misconfigured or forging writer; timeout: an operation past its bound; unavailable: any other failed operation)."),
    ("strata_l3_unavailable_tiers", "gauge", "L3 tiers given with --l3 that were unreachable at start: the worker serves without them (restart it once they are up)."),
    ("strata_l3_entries", "gauge", "Pages an L3 tier holds, by tier (disk: its index; remote: the keys under this worker's prefix in Redis, measured at most once a second)."),
    ("strata_l3_used_bytes", "gauge", "Bytes of the pages an L3 tier holds, by tier (page files; Redis values)."),
    ("strata_l3_capacity_bytes", "gauge", "Bytes an L3 tier may hold, by tier (disk: --l3-size; remote: Redis' maxmemory, else its machine's memory, shared with every other user of that Redis)."),
    ("strata_l3_evictions_total", "counter", "Pages an L3 tier dropped to make room, by tier (remote: keys Redis evicted or expired since this worker connected, server-wide)."),
    ("strata_transferred_prompt_tokens_total", "counter", "Prompt tokens whose K/V arrived from a prefill worker."),
    ("strata_pd_held_prompt_tokens_total", "counter", "Prompt tokens of PD requests whose K/V this decode worker's cache held, so the prefill worker sent only the pages after them (also counted as cache hits)."),
    ("strata_pd_local_prefills_total", "counter", "PD requests this decode worker computed itself, with no prefill worker and no transfer: its cache held all of the prompt but at most --pd-local-prefill-tokens."),
    ("strata_pd_overlapped_pages_total", "counter", "Pages this prefill worker exported for decode workers while their prompt was still being computed (each chunk's pages are handed to the sending thread as the chunk completes, their transfer overlapping the chunks after it); the rest leave once the prompt is done. With window kinds only pages before the next position's window that hold no window page leave early."),
    // Sizing.
    ("strata_plan_device_bytes", "gauge", "Device pool bytes of each rank by pool kind, as planned (a tensor-parallel rank with fewer KV heads holds less)."),
    ("strata_plan_host_bytes", "gauge", "Host (L2) pool bytes of each rank by pool kind, as planned (a tensor-parallel rank with fewer KV heads holds less)."),
    ("strata_plan_info", "gauge", "The flag that decided the host pool size, the NUMA policy and node (value 1)."),
    ("strata_tp_rank_info", "gauge", "A tensor-parallel rank's NUMA node and the CPUs its threads are pinned to (value 1)."),
    ("strata_host_pool_node_bytes", "gauge", "Host pool bytes found on each NUMA node (sampled page placement after allocation)."),
    // Serving.
    ("strata_requests_total", "counter", "Finished HTTP requests by outcome (ok, 4xx, 429, 5xx) and requests whose client went away (cancelled)."),
    ("strata_queue_depth", "gauge", "Requests waiting for admission."),
    ("strata_running_requests", "gauge", "Requests admitted and not finished."),
    ("strata_tokens_in_flight", "gauge", "Prompt + max_tokens of accepted unfinished requests."),
    ("strata_cache_copies_in_flight", "gauge", "Copies between cache tiers under way (load-backs, backups to host, L3 writes and prefetches); one that stays high says a tier does not keep up."),
    ("strata_generation_tokens_total", "counter", "Tokens generated."),
    (
        "strata_settled_tokens_total",
        "counter",
        "Generated positions computed again as prompt rows before their answer was cached (--cache-outputs exact).",
    ),
    ("strata_time_to_first_token_seconds", "histogram", "Time from receiving a request to its first token."),
    ("strata_inter_token_latency_seconds", "histogram", "Time between consecutive tokens of a request."),
    ("strata_request_duration_seconds", "histogram", "Time from receiving a request to its end (with --cache-outputs exact, after its answer was computed again for the cache)."),
    ("strata_response_store_responses", "gauge", "Responses kept for /v1/responses' previous_response_id (bounded by --response-store-max, --response-store-size and --response-store-ttl)."),
    ("strata_response_store_bytes", "gauge", "Bytes of the conversations kept for previous_response_id (their JSON)."),
    ("strata_response_store_evictions_total", "counter", "Responses dropped before their time to keep the store within its bounds (their next turn is a 400: the client sends the conversation again)."),
    // PD.
    ("strata_kv_transfers_total", "counter", "KV transfers by direction (sent, received) and outcome (ok, failed)."),
    ("strata_http_connections", "gauge", "HTTP connections open on this process's API port."),
    ("strata_http_connections_total", "counter", "HTTP connections by outcome: accepted, refused (closed at accept: every place held by busy or protected connections), yielded (an idle connection closed to make room for a newcomer), header_timeout (closed: a request's headers did not arrive within --header-timeout, also between keep-alive requests)."),
    ("strata_http_body_timeouts_total", "counter", "Requests answered 408 because their body did not arrive within --body-timeout."),
    ("strata_http_accept_errors_total", "counter", "Failed accepts on the API port (e.g. out of file descriptors); the listener backs off from 5 ms to 1 s."),
    ("strata_kv_listener_connections", "gauge", "Connections to this decode worker's KV listener now, by state (authenticated, unauthenticated)."),
    ("strata_kv_listener_connections_total", "counter", "Connections to the KV listener that did not become transfers, by outcome: refused (closed at accept: every place held by protected or authenticated connections), yielded (an idle unauthenticated connection closed to make room for a newcomer), handshake_failed (no key, wrong key or format, too slow)."),
    ("strata_kv_transfer_bytes_total", "counter", "KV bytes transferred, by direction."),
    ("strata_kv_transfer_pages_total", "counter", "KV pages transferred, by direction."),
    ("strata_kv_transfer_seconds_total", "counter", "Time spent in KV transfers, by direction (sent: writing pages and awaiting the acknowledgement, not waiting for the prefill's next pages; received: `Begin` accepted to the last page acknowledged, which for a streamed transfer includes the prefill computing the chunks after the first)."),
    ("strata_pd_prefill_requests_total", "counter", "PD prefill requests this worker served for decode workers (POST /pd/prefill), by outcome (ok, failed)."),
    ("strata_pd_prefill_prompt_tokens_total", "counter", "Prompt tokens of the PD prefill requests this worker served."),
    ("strata_pd_prefill_duration_seconds", "histogram", "Time from a PD prefill request's arrival to its first token (the prefill's TTFT; the K/V transfer overlaps it from the first chunk's pages on, and its last pages follow)."),
    // Router.
    ("strata_router_requests_total", "counter", "Requests the router forwarded, by policy and reason (cache_hit, no_cache_hit, policy)."),
    ("strata_router_cache_hit_pages_total", "counter", "Cached pages on the chosen worker at cache-aware decisions, by tier."),
    ("strata_router_decode_cache_hits_total", "counter", "PD requests the cache-aware policy sent to a decode worker that held some of the prompt (it asks the prefill worker only for the rest)."),
    ("strata_router_retries_total", "counter", "Requests retried on another worker pair."),
    ("strata_router_worker_up", "gauge", "1 when the router's health check of a worker passes."),
    ("strata_router_worker_in_flight", "gauge", "Requests in flight on a worker, as the router counts them."),
    ("strata_router_http_requests_total", "counter", "Requests the router answered, by route, HTTP status code and decode worker (none: answered by the router itself)."),
    ("strata_router_request_duration_seconds", "histogram", "Time from a request's arrival at the router to the end of its answer (streams included)."),
    ("strata_router_added_latency_seconds", "histogram", "The router's own part of a request: arrival to the upstream request sent (key check, routing, prompt hashing)."),
    ("strata_router_upstream_errors_total", "counter", "Upstream failures by kind (connect: worker unreachable; status: a worker answered 502/503; stream: a worker's stream broke or went silent)."),
    ("strata_router_auth_failures_total", "counter", "Requests refused for a missing or wrong key: a client API key, or the admin key of /flush_cache."),
    ("strata_router_in_flight_requests", "gauge", "Requests the router is answering now."),
    ("strata_router_index_pages", "gauge", "Pages in the cache-aware router's index, over every worker and the shared remote tier."),
    ("strata_router_index_bytes", "gauge", "Heap bytes the cache-aware router's index takes for those pages."),
    ("strata_router_index_limit_bytes", "gauge", "The most heap bytes the cache-aware router's index may take (--cache-index-memory, split between the workers and the remote tier)."),
    ("strata_router_index_unindexed_pages", "gauge", "Page announcements (a page once per tier) past a worker's share of the cache-aware router's index, not indexed, since that worker's last resynchronisation."),
    // Node health.
    ("strata_numa_node_memory_bytes", "gauge", "Memory of a NUMA node by state (total, available), from sysfs."),
    ("strata_process_resident_memory_bytes", "gauge", "Resident memory of this process."),
    ("strata_process_cpu_seconds_total", "counter", "CPU time of this process (user + system)."),
    ("strata_process_open_fds", "gauge", "Open file descriptors of this process."),
    ("strata_build_info", "gauge", "Version of this binary and the role of this process (value 1)."),
];

/// Seconds buckets for latency histograms.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// A fixed-bucket histogram of seconds, lock-free.
pub struct Histogram {
    counts: Vec<AtomicU64>,
    sum_ns: AtomicU64,
    count: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: LATENCY_BUCKETS.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    pub fn observe(&self, seconds: f64) {
        if let Some(i) = LATENCY_BUCKETS.iter().position(|&b| seconds <= b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.sum_ns
            .fetch_add((seconds * 1e9) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str) {
        let mut cum = 0;
        for (b, c) in LATENCY_BUCKETS.iter().zip(&self.counts) {
            cum += c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let n = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9
        );
        let _ = writeln!(out, "{name}_count {n}");
    }
}

/// What the HTTP layer measures itself.
#[derive(Default)]
pub struct ServerMetrics {
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    /// ok, 4xx, 429, 5xx.
    pub outcomes: [AtomicU64; 4],
}

impl ServerMetrics {
    pub fn count_status(&self, status: u16) {
        let i = match status {
            429 => 2,
            400..=499 => 1,
            500..=599 => 3,
            _ => 0,
        };
        self.outcomes[i].fetch_add(1, Ordering::Relaxed);
    }
}

/// One pool kind of the plan: its bytes on each rank.
#[derive(Clone, Debug, Default)]
pub struct PoolGauge {
    pub kind: String,
    /// Per rank.
    pub device_bytes: Vec<u64>,
    pub host_bytes: Vec<u64>,
}

/// The memory plan, as gauges.
#[derive(Clone, Debug, Default)]
pub struct PlanGauges {
    /// Each pool kind as planned, on each rank (ranks with fewer KV heads hold less of the
    /// same pages).
    pub pools: Vec<PoolGauge>,
    pub ranks: u32,
    /// Each tensor-parallel rank's NUMA node and CPUs (`any`, `unpinned` without
    /// `--numa-nodes`); empty for one unpinned rank.
    pub rank_placement: Vec<(String, String)>,
    /// The flag that decided the host size (`--hicache-size`, ...; `none`).
    pub host_flag: String,
    pub numa_policy: String,
    pub numa_nodes: Vec<u32>,
    /// (node, bytes of the host pool found there).
    pub placement: Vec<(u32, u64)>,
}

/// Builds the text of one `/metrics` answer.
pub struct Text {
    out: String,
    declared: Vec<&'static str>,
}

impl Default for Text {
    fn default() -> Self {
        Text::new()
    }
}

impl Text {
    pub fn new() -> Text {
        Text {
            out: String::with_capacity(16 << 10),
            declared: Vec::new(),
        }
    }

    fn head(&mut self, name: &'static str) {
        if self.declared.contains(&name) {
            return;
        }
        let (_, kind, help) = CATALOGUE
            .iter()
            .find(|m| m.0 == name)
            .unwrap_or_else(|| panic!("metric {name} is not in the catalogue"));
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
        self.declared.push(name);
    }

    /// One sample; `labels` as (name, value) pairs.
    pub fn sample(&mut self, name: &'static str, labels: &[(&str, &str)], value: f64) {
        self.head(name);
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let v = v
                    .replace('\\', "\\\\")
                    .replace('"', "\\\"")
                    .replace('\n', "\\n");
                let _ = write!(self.out, "{k}=\"{v}\"");
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }

    pub fn histogram(&mut self, name: &'static str, h: &Histogram) {
        self.head(name);
        h.render(&mut self.out, name);
    }

    /// A histogram from per-bucket counts (not cumulative) with one label.
    pub fn histogram_counts(
        &mut self,
        name: &'static str,
        label: (&str, &str),
        bounds: &[f64],
        counts: &[u64],
        count: u64,
        sum: f64,
    ) {
        self.head(name);
        let (k, v) = label;
        let mut cum = 0;
        for (b, c) in bounds.iter().zip(counts) {
            cum += c;
            let _ = writeln!(self.out, "{name}_bucket{{{k}=\"{v}\",le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(self.out, "{name}_bucket{{{k}=\"{v}\",le=\"+Inf\"}} {count}");
        let _ = writeln!(self.out, "{name}_sum{{{k}=\"{v}\"}} {sum}");
        let _ = writeln!(self.out, "{name}_count{{{k}=\"{v}\"}} {count}");
    }

    pub fn finish(self) -> String {
        self.out
    }
}

/// Node health: NUMA memory, this process's RSS, CPU time, fds; build info.
pub fn node_health(t: &mut Text, role: &str) {
    if let Ok(topo) = strata_mem::Topology::detect() {
        for n in &topo.nodes {
            let id = n.id.to_string();
            t.sample(
                "strata_numa_node_memory_bytes",
                &[("node", &id), ("state", "total")],
                n.total_bytes as f64,
            );
            t.sample(
                "strata_numa_node_memory_bytes",
                &[("node", &id), ("state", "available")],
                n.available_bytes as f64,
            );
        }
    }
    // SAFETY: sysconf has no preconditions.
    let (page, ticks) = unsafe {
        (
            libc::sysconf(libc::_SC_PAGESIZE),
            libc::sysconf(libc::_SC_CLK_TCK),
        )
    };
    if let Ok(statm) = std::fs::read_to_string("/proc/self/statm") {
        if let Some(rss) = statm
            .split_whitespace()
            .nth(1)
            .and_then(|x| x.parse::<f64>().ok())
        {
            t.sample(
                "strata_process_resident_memory_bytes",
                &[],
                rss * page as f64,
            );
        }
    }
    if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
        // Fields after the command name (which may hold spaces) start after the last ')'.
        let rest = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
        let f: Vec<&str> = rest.split_whitespace().collect();
        if let (Some(u), Some(s)) = (f.get(11), f.get(12)) {
            let secs = (u.parse::<f64>().unwrap_or(0.0) + s.parse::<f64>().unwrap_or(0.0))
                / ticks.max(1) as f64;
            t.sample("strata_process_cpu_seconds_total", &[], secs);
        }
    }
    if let Ok(d) = std::fs::read_dir("/proc/self/fd") {
        t.sample("strata_process_open_fds", &[], d.count() as f64);
    }
    t.sample(
        "strata_build_info",
        &[("version", env!("CARGO_PKG_VERSION")), ("role", role)],
        1.0,
    );
}

/// What a prefill worker measures of the PD prefill work it does.
#[derive(Default)]
pub struct PdPrefillMetrics {
    /// K/V transfers sent to decode workers: whole, failed, pages, bytes and time (spent
    /// sending, not waiting for the prefill's next pages).
    pub kv_sent: AtomicU64,
    pub kv_send_failures: AtomicU64,
    pub kv_sent_pages: AtomicU64,
    pub kv_sent_bytes: AtomicU64,
    pub kv_send_nanos: AtomicU64,
    pub ok: AtomicU64,
    pub failed: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub duration: Histogram,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalogue_follows_the_conventions_and_docs_list_every_metric() {
        let docs = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/METRICS.md"
        ))
        .expect("docs/METRICS.md");
        for (name, kind, help) in CATALOGUE {
            assert!(name.starts_with("strata_"), "{name}");
            assert_eq!(
                *kind == "counter",
                name.ends_with("_total"),
                "{name}: counters and only counters end in _total"
            );
            assert!(!help.is_empty());
            assert!(
                docs.contains(&format!("`{name}`")),
                "docs/METRICS.md does not list {name}"
            );
        }
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::default();
        for s in [0.0005, 0.003, 0.003, 7.0, 100.0] {
            h.observe(s);
        }
        let mut t = Text::new();
        t.histogram("strata_time_to_first_token_seconds", &h);
        let out = t.finish();
        assert!(out.contains("strata_time_to_first_token_seconds_bucket{le=\"0.001\"} 1"));
        assert!(out.contains("strata_time_to_first_token_seconds_bucket{le=\"0.005\"} 3"));
        assert!(out.contains("strata_time_to_first_token_seconds_bucket{le=\"10\"} 4"));
        assert!(out.contains("strata_time_to_first_token_seconds_bucket{le=\"+Inf\"} 5"));
        assert!(out.contains("strata_time_to_first_token_seconds_count 5"));
    }
}
