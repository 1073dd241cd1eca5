//! A worker's `/metrics` page: the engine's snapshot, the HTTP layer's measurements, PD
//! transfers and the memory plan, rendered with the catalogue of [`crate::metrics`].

use std::sync::atomic::Ordering;

use strata_engine::Snapshot;

use crate::metrics::{node_health, PlanGauges, Text};
use crate::state::AppState;

/// A worker's `/metrics`.
pub fn worker(st: &AppState) -> String {
    let s = st.engine.snapshot();
    let mut t = Text::new();
    cache_tiers(&mut t, st, &s);
    auto_learning(&mut t, &s);
    copies(&mut t, &s);
    curve(&mut t, &s);
    l3(&mut t, st);
    pd_tokens(&mut t, &s);
    t.sample("strata_l3_unavailable_tiers", &[], st.l3_unavailable as f64);
    if let Some(p) = &st.plan {
        plan(&mut t, p);
    }
    serving(&mut t, st, &s);
    transfers(&mut t, st);
    st.http.render(&mut t);
    st.responses.render(&mut t);
    node_health(&mut t, &st.role);
    t.finish()
}

/// Prompt tokens by tier served, pool bytes and pages, evictions.
fn cache_tiers(t: &mut Text, st: &AppState, s: &Snapshot) {
    let c = &s.cache;
    let prompt = s.prompt_tokens - s.transferred_prompt_tokens;
    t.sample("strata_prompt_tokens_total", &[], prompt as f64);
    let l3 = st.storage_tier.as_str();
    for (tier, v) in [
        ("device", s.cached_device_tokens),
        ("host", s.cached_host_tokens),
        (l3, s.cached_storage_tokens),
    ] {
        t.sample("strata_cache_hit_tokens_total", &[("tier", tier)], v as f64);
    }
    t.sample(
        "strata_cache_miss_tokens_total",
        &[],
        s.computed_prompt_tokens as f64,
    );
    for p in &s.pools {
        let l = [("tier", p.tier), ("pool", p.kind.as_str())];
        t.sample("strata_cache_capacity_bytes", &l, p.bytes_total as f64);
        t.sample("strata_cache_used_bytes", &l, p.bytes_used as f64);
    }
    pool_kinds(t, st, s);
    // Window pages exist only for models with window kinds: zero otherwise (a dashboard
    // shows the same panels for every model).
    for (tier, u, w) in [
        ("device", &s.device, &s.device_window),
        ("host", &s.host, &s.host_window),
    ] {
        for (state, v, wv) in [
            ("used", u.pages_used, w.pages_used),
            ("total", u.pages_total, w.pages_total),
        ] {
            let l = [("tier", tier), ("state", state)];
            t.sample("strata_cache_pages", &l, v as f64);
            t.sample("strata_cache_window_pages", &l, wv as f64);
        }
    }
    for (tier, v) in [
        ("device", c.evicted_device_window_pages),
        ("host", c.evicted_host_window_pages),
    ] {
        let l = [("tier", tier)];
        t.sample("strata_cache_window_evicted_pages_total", &l, v as f64);
    }
    let cut = c.window_cut_tokens as f64;
    t.sample("strata_cache_window_cut_tokens_total", &[], cut);
    for (resumed, n) in [
        ("as_matched", c.window_hits_as_matched),
        ("backed_off", c.window_hits_backed_off),
    ] {
        let l = [("resumed", resumed)];
        t.sample("strata_cache_window_hits_total", &l, n as f64);
    }
    t.sample(
        "strata_cache_evicted_tokens_total",
        &[("tier", "device")],
        c.evicted_device_tokens as f64,
    );
    t.sample(
        "strata_cache_evicted_tokens_total",
        &[("tier", "host")],
        c.evicted_host_tokens as f64,
    );
    t.sample(
        "strata_cache_session_retired_tokens_total",
        &[],
        c.session_retired_tokens as f64,
    );
}

/// What `auto` has learnt: its credit for newcomers and the removals and returns behind it.
fn auto_learning(t: &mut Text, s: &Snapshot) {
    if let Some(a) = &s.auto {
        t.sample("strata_cache_auto_newcomer_credit", &[], a.newcomer_credit);
        for (class, removed, returned) in [
            (
                "probation",
                a.probation_removed_pages,
                a.probation_returned_pages,
            ),
            ("used", a.used_removed_pages, a.used_returned_pages),
        ] {
            let l = [("class", class)];
            t.sample("strata_cache_auto_removed_pages_total", &l, removed as f64);
            t.sample(
                "strata_cache_auto_returned_pages_total",
                &l,
                returned as f64,
            );
        }
    }
}

/// Per pool kind: bytes per token and the bytes served from each tier.
fn pool_kinds(t: &mut Text, st: &AppState, s: &Snapshot) {
    let l3 = st.storage_tier.as_str();
    for p in s.pools.iter().filter(|p| p.tier == "device") {
        let Some(bpt) = p.bytes_total.checked_div(p.tokens_total) else {
            continue;
        };
        let pool = p.kind.as_str();
        t.sample("strata_pool_bytes_per_token", &[("pool", pool)], bpt as f64);
        for (tier, v) in [
            ("device", s.cached_device_tokens),
            ("host", s.cached_host_tokens),
            (l3, s.cached_storage_tokens),
        ] {
            let l = [("tier", tier), ("pool", pool)];
            t.sample("strata_cache_hit_bytes_total", &l, (v * bpt) as f64);
        }
    }
}

/// Copies between tiers: bytes, operations, time and their durations.
fn copies(t: &mut Text, s: &Snapshot) {
    let c = &s.cache;
    for (op, x) in [
        ("load_back", &c.load_back),
        ("backup", &c.backup),
        ("prefetch", &c.storage_get),
        ("l3_put", &c.storage_put),
    ] {
        t.sample(
            "strata_cache_copy_bytes_total",
            &[("op", op)],
            x.bytes as f64,
        );
        t.sample(
            "strata_cache_copy_operations_total",
            &[("op", op)],
            x.ops as f64,
        );
        t.sample(
            "strata_cache_copy_seconds_total",
            &[("op", op)],
            x.nanos as f64 / 1e9,
        );
    }
    for (op, x) in [
        ("load_back", &c.load_back),
        ("backup", &c.backup),
        ("prefetch", &c.storage_get),
        ("l3_put", &c.storage_put),
    ] {
        t.histogram_counts(
            "strata_cache_copy_duration_seconds",
            ("op", op),
            &strata_kv::stats::COPY_BUCKETS,
            &x.buckets,
            x.ops,
            x.nanos as f64 / 1e9,
        );
    }
}

/// Each L3 tier's occupancy, evictions and errors, as the tier itself measures them at this
/// scrape (a tier absent: nothing; a disk tier: its index; Redis: what it holds under this
/// tier's prefix, measured in the background).
fn l3(t: &mut Text, st: &AppState) {
    let parts = st.l3.as_ref().map(|l| l.parts()).unwrap_or_default();
    for (tier, x) in parts {
        let l = [("tier", tier)];
        t.sample("strata_l3_entries", &l, x.entries as f64);
        t.sample("strata_l3_used_bytes", &l, x.bytes as f64);
        t.sample("strata_l3_capacity_bytes", &l, x.capacity_bytes as f64);
        t.sample("strata_l3_evictions_total", &l, x.evictions as f64);
        let unavailable = x.errors - x.timeouts.min(x.errors);
        for (kind, v) in [
            ("corrupt", x.corrupt),
            ("layout", x.other_layout),
            ("timeout", x.timeouts),
            ("unavailable", unavailable),
        ] {
            t.sample(
                "strata_l3_errors_total",
                &[("kind", kind), ("tier", tier)],
                v as f64,
            );
        }
    }
}

/// The live miss-ratio curve (nothing when the worker keeps none).
fn curve(t: &mut Text, s: &Snapshot) {
    let Some(c) = &s.curve else {
        return;
    };
    for p in &c.points {
        let scale = format!("{}", p.scale);
        let l = [("tier", p.tier), ("scale", scale.as_str())];
        let lp = [
            ("tier", p.tier),
            ("scale", scale.as_str()),
            ("policy", c.policy),
        ];
        t.sample("strata_cache_curve_hit_ratio", &lp, p.hit_ratio);
        if let Some(b) = p.belady {
            t.sample("strata_cache_curve_belady_hit_ratio", &l, b);
        }
        t.sample("strata_cache_curve_pages", &l, p.pages as f64);
        t.sample("strata_cache_curve_bytes", &l, p.bytes as f64);
    }
    for g in &c.gains {
        let l = [("tier", g.tier)];
        t.sample("strata_cache_curve_step_bytes", &l, g.added_bytes as f64);
        t.sample("strata_cache_curve_step_hit_ratio", &l, g.hit_ratio_after);
        t.sample(
            "strata_cache_curve_step_saved_prompt_tokens_per_second",
            &l,
            g.saved_prompt_tokens_per_second,
        );
    }
    let scalars = [
        ("strata_cache_curve_sample_rate", c.rate),
        ("strata_cache_curve_tracked_pages", c.tracked_pages as f64),
        ("strata_cache_curve_memory_bytes", c.memory_bytes as f64),
        ("strata_cache_curve_references_total", c.references as f64),
        (
            "strata_cache_curve_window_references",
            c.window_references as f64,
        ),
        (
            "strata_cache_curve_prompt_tokens_per_second",
            c.prompt_tokens_per_second,
        ),
    ];
    for (name, v) in scalars {
        t.sample(name, &[], v);
    }
}

/// Prompt tokens that arrived by KV transfer, and the PD counters of the decode side.
fn pd_tokens(t: &mut Text, s: &Snapshot) {
    t.sample(
        "strata_transferred_prompt_tokens_total",
        &[],
        s.transferred_prompt_tokens as f64,
    );
    t.sample(
        "strata_pd_held_prompt_tokens_total",
        &[],
        s.pd_held_prompt_tokens as f64,
    );
    t.sample(
        "strata_pd_local_prefills_total",
        &[],
        s.pd_local_prefills as f64,
    );
    t.sample(
        "strata_pd_overlapped_pages_total",
        &[],
        s.pd_overlapped_pages as f64,
    );
}

/// The memory plan as gauges, with the verified NUMA placement.
fn plan(t: &mut Text, p: &PlanGauges) {
    for pool in &p.pools {
        for (rank, (dev, host)) in pool.device_bytes.iter().zip(&pool.host_bytes).enumerate() {
            let labels = [("pool", pool.kind.as_str()), ("rank", &rank.to_string())];
            t.sample("strata_plan_device_bytes", &labels, *dev as f64);
            t.sample("strata_plan_host_bytes", &labels, *host as f64);
        }
    }
    for (rank, (node, cpus)) in p.rank_placement.iter().enumerate() {
        let r = rank.to_string();
        let labels = [("rank", r.as_str()), ("node", node), ("cpus", cpus)];
        t.sample("strata_tp_rank_info", &labels, 1.0);
    }
    let nodes: Vec<String> = p.numa_nodes.iter().map(|n| n.to_string()).collect();
    t.sample(
        "strata_plan_info",
        &[
            ("host_flag", &p.host_flag),
            ("numa_policy", &p.numa_policy),
            ("numa_nodes", &nodes.join(",")),
        ],
        1.0,
    );
    for (node, bytes) in &p.placement {
        t.sample(
            "strata_host_pool_node_bytes",
            &[("node", &node.to_string())],
            *bytes as f64,
        );
    }
}

/// Requests by outcome, queue and running figures, serving latencies.
fn serving(t: &mut Text, st: &AppState, s: &Snapshot) {
    let m = &st.metrics;
    for (i, outcome) in ["ok", "4xx", "429", "5xx"].iter().enumerate() {
        t.sample(
            "strata_requests_total",
            &[("outcome", outcome)],
            m.outcomes[i].load(Ordering::Relaxed) as f64,
        );
    }
    t.sample(
        "strata_requests_total",
        &[("outcome", "cancelled")],
        s.finished.cancelled as f64,
    );
    t.sample("strata_queue_depth", &[], s.waiting as f64);
    t.sample("strata_running_requests", &[], s.running as f64);
    t.sample("strata_tokens_in_flight", &[], s.tokens_in_flight as f64);
    t.sample(
        "strata_cache_copies_in_flight",
        &[],
        s.copies_in_flight as f64,
    );
    t.sample(
        "strata_generation_tokens_total",
        &[],
        s.generated_tokens as f64,
    );
    t.sample("strata_settled_tokens_total", &[], s.settled_tokens as f64);
    t.histogram("strata_time_to_first_token_seconds", &m.ttft);
    t.histogram("strata_inter_token_latency_seconds", &m.itl);
    t.histogram("strata_request_duration_seconds", &m.e2e);
}

/// KV transfers sent and received, and the PD prefill work done for decode workers.
fn transfers(t: &mut Text, st: &AppState) {
    let sent = st.pd.metrics.kv_sent.load(Ordering::Relaxed) as f64;
    let sent_failed = st.pd.metrics.kv_send_failures.load(Ordering::Relaxed) as f64;
    t.sample(
        "strata_kv_transfers_total",
        &[("direction", "sent"), ("outcome", "ok")],
        sent,
    );
    t.sample(
        "strata_kv_transfers_total",
        &[("direction", "sent"), ("outcome", "failed")],
        sent_failed,
    );
    t.sample(
        "strata_kv_transfer_bytes_total",
        &[("direction", "sent")],
        st.pd.metrics.kv_sent_bytes.load(Ordering::Relaxed) as f64,
    );
    t.sample(
        "strata_kv_transfer_pages_total",
        &[("direction", "sent")],
        st.pd.metrics.kv_sent_pages.load(Ordering::Relaxed) as f64,
    );
    t.sample(
        "strata_kv_transfer_seconds_total",
        &[("direction", "sent")],
        st.pd.metrics.kv_send_nanos.load(Ordering::Relaxed) as f64 / 1e9,
    );
    let pd = &st.pd.metrics;
    for (outcome, n) in [("ok", &pd.ok), ("failed", &pd.failed)] {
        t.sample(
            "strata_pd_prefill_requests_total",
            &[("outcome", outcome)],
            n.load(Ordering::Relaxed) as f64,
        );
    }
    t.sample(
        "strata_pd_prefill_prompt_tokens_total",
        &[],
        pd.prompt_tokens.load(Ordering::Relaxed) as f64,
    );
    t.histogram("strata_pd_prefill_duration_seconds", &pd.duration);
    if let Some(k) = &st.pd.kv {
        let (ok, failed, bytes) = (
            k.received.load(Ordering::Relaxed),
            k.failed.load(Ordering::Relaxed),
            k.bytes.load(Ordering::Relaxed),
        );
        t.sample(
            "strata_kv_transfers_total",
            &[("direction", "received"), ("outcome", "ok")],
            ok as f64,
        );
        t.sample(
            "strata_kv_transfers_total",
            &[("direction", "received"), ("outcome", "failed")],
            failed as f64,
        );
        t.sample(
            "strata_kv_transfer_bytes_total",
            &[("direction", "received")],
            bytes as f64,
        );
        t.sample(
            "strata_kv_transfer_pages_total",
            &[("direction", "received")],
            k.pages.load(Ordering::Relaxed) as f64,
        );
        t.sample(
            "strata_kv_transfer_seconds_total",
            &[("direction", "received")],
            k.nanos.load(Ordering::Relaxed) as f64 / 1e9,
        );
        kv_listener(t, k);
    }
}

/// The KV listener's connections: held now, and those that did not become transfers.
fn kv_listener(t: &mut Text, k: &crate::kv_inbox::KvInbox) {
    let (authed, strangers) = k.connections();
    for (state, n) in [("authenticated", authed), ("unauthenticated", strangers)] {
        t.sample(
            "strata_kv_listener_connections",
            &[("state", state)],
            n as f64,
        );
    }
    for (outcome, n) in [
        ("refused", &k.refused_connections),
        ("yielded", &k.yielded_connections),
        ("handshake_failed", &k.handshake_failures),
    ] {
        t.sample(
            "strata_kv_listener_connections_total",
            &[("outcome", outcome)],
            n.load(Ordering::Relaxed) as f64,
        );
    }
}
