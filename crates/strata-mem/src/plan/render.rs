//! [`Plan::render`]: the plan as the operator reads it.

use strata_kv::units::format_bytes;

use super::Plan;

impl Plan {
    /// The human report: one table per rank's pools, server totals, NUMA, decisions, warnings.
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let ranks = if self
            .rank_bytes_per_token
            .iter()
            .all(|&b| b == self.bytes_per_token)
        {
            "every rank identical".to_string()
        } else {
            let each: Vec<String> = self
                .rank_bytes_per_token
                .iter()
                .map(u64::to_string)
                .collect();
            format!(
                "ranks hold {} bytes per token: each rank's pools are sized for the largest",
                each.join(" / ")
            )
        };
        let _ = writeln!(s, "plan ({} role): model {}, TP {} ({ranks}), page {} tokens, {} bytes per token per rank", self.role, self.model, self.tp, self.page_size, self.bytes_per_token);
        self.pool_table(&mut s);
        let _ = writeln!(
            s,
            "per server ({} rank{}): device {}, host {}",
            self.tp,
            if self.tp == 1 { "" } else { "s" },
            format_bytes(self.server_device_bytes),
            format_bytes(self.server_host_bytes)
        );
        self.tp_line(&mut s);
        let n = &self.numa;
        let _ =
            writeln!(
            s,
            "NUMA: {} on node(s) {}: {} available, {} reserve{}, this server needs {}, headroom {}",
            n.policy.name(),
            n.nodes.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(","),
            format_bytes(n.available_bytes),
            format_bytes(n.reserve_bytes),
            reserve_parts(n.weights_bytes, &n.beside),
            format_bytes(n.needed_bytes),
            format_bytes(n.headroom_bytes)
        );
        let _ = writeln!(s, "      capacity source: {}", n.source);
        for d in &self.decided_by {
            let _ = writeln!(s, "decided: {} ← {}", d.what, d.by);
        }
        for w in &self.warnings {
            let _ = writeln!(s, "WARNING: {w}");
        }
        s
    }

    /// With tensor-parallel ranks: which kinds each rank holds a share of, and which every
    /// rank holds whole (so the server holds a copy per rank).
    fn tp_line(&self, s: &mut String) {
        use std::fmt::Write;
        if self.tp <= 1 {
            return;
        }
        let of = |how: &str| -> Vec<&str> {
            let kinds = self.pools.iter().filter(|p| p.tp == how);
            kinds.map(|p| p.kind.as_str()).collect()
        };
        let (split, copies) = (of("split"), of("replicated"));
        if !split.is_empty() {
            let _ = writeln!(
                s,
                "TP {}: split over the ranks (each its KV heads): {}",
                self.tp,
                split.join(", ")
            );
        }
        if !copies.is_empty() {
            let _ = writeln!(
                s,
                "TP {}: replicated, every rank holds all of it (one K = V head or latent cannot \
                 be split), so the server keeps {} copies: {}",
                self.tp,
                self.tp,
                copies.join(", ")
            );
        }
    }

    /// One row per pool kind (what an item belongs to, what a continuation reads, per-rank
    /// tokens, pages and bytes per tier), then the per-rank total.
    fn pool_table(&self, s: &mut String) {
        use std::fmt::Write;
        let kw = self
            .pools
            .iter()
            .map(|p| p.kind.len())
            .max()
            .unwrap_or(0)
            .max(10);
        let pw = self
            .pools
            .iter()
            .map(|p| p.per.len())
            .max()
            .unwrap_or(0)
            .max(5);
        let nw = self
            .pools
            .iter()
            .map(|p| p.needed.len())
            .max()
            .unwrap_or(0)
            .max(6);
        let _ = writeln!(
            s,
            "{:<kw$} {:<pw$} {:<nw$} {:>11} {:>13} {:>11} {:>26} {:>13} {:>11} {:>30}",
            "pool",
            "per",
            "needed",
            "bytes/token",
            "device tokens",
            "dev pages",
            "device bytes",
            "host tokens",
            "host pages",
            "host bytes"
        );
        for p in &self.pools {
            let _ = writeln!(
                s,
                "{:<kw$} {:<pw$} {:<nw$} {:>11} {:>13} {:>11} {:>26} {:>13} {:>11} {:>30}",
                p.kind,
                p.per,
                p.needed,
                p.bytes_per_token,
                p.device_tokens,
                p.device_pages,
                format_bytes(p.device_bytes),
                p.host_tokens,
                p.host_pages,
                format_bytes(p.host_bytes)
            );
        }
        let _ = writeln!(
            s,
            "{:<kw$} {:<pw$} {:<nw$} {:>11} {:>13} {:>11} {:>26} {:>13} {:>11} {:>30}",
            "per rank",
            "",
            "",
            self.bytes_per_token,
            self.device_tokens_per_rank,
            self.device_tokens_per_rank / self.page_size as u64,
            format_bytes(self.device_bytes_per_rank),
            self.host_tokens_per_rank,
            self.host_tokens_per_rank / self.page_size as u64,
            format_bytes(self.host_bytes_per_rank)
        );
    }
}

/// What the reserve holds beside the OS's headroom: ` (of it: 1.00 GiB (…) the model's
/// weights, 1.00 GiB (…) --kv-staging)`; empty when nothing.
pub(super) fn reserve_parts(weights: u64, beside: &[(String, u64)]) -> String {
    let weights = ("the model's weights".to_string(), weights);
    let parts: Vec<String> = std::iter::once(&weights)
        .chain(beside)
        .filter(|p| p.1 > 0)
        .map(|(what, b)| format!("{} {what}", format_bytes(*b)))
        .collect();
    match parts.is_empty() {
        true => String::new(),
        false => format!(" (of it: {})", parts.join(", ")),
    }
}
