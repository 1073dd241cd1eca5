//! What the remote tier holds, measured in Redis itself: the pages under this tier's key prefix
//! (`SCAN MATCH` + `STRLEN`: entries and value bytes), the memory Redis may use (`maxmemory`,
//! else the machine's memory) and the keys it evicted or expired since this worker connected.
//! A measurement runs in the background when the numbers are asked for and are older than
//! the interval (at least a second, and ten times as long as the last pass took, so a large
//! keyspace is not scanned back to back); [`Storage::stats`] never waits for the network.
//! In a cluster every master is measured and the sums are reported.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::aio::ConnectionManager;

use crate::{unavailable, within, Backend};
use strata_kv::storage::StorageError;

/// Keys asked for per `SCAN` step, and lengths per pipelined `STRLEN` batch.
const SCAN_COUNT: usize = 1000;

/// The latest measurement and the state of the next.
#[derive(Default)]
pub(crate) struct Measured {
    pub entries: u64,
    pub bytes: u64,
    pub capacity: u64,
    pub evictions: u64,
    /// evicted_keys + expired_keys per node when first measured (the baseline of `evictions`).
    base: std::collections::HashMap<String, u64>,
    running: bool,
    last: Option<Instant>,
    took: Duration,
}

/// One node's numbers.
struct Node {
    entries: u64,
    bytes: u64,
    capacity: u64,
    dropped: u64,
}

impl Measured {
    /// Whether a new pass is due now (and, if so, marks one as running).
    pub(crate) fn due(&mut self, now: Instant) -> bool {
        let every = (self.took * 10).max(Duration::from_secs(1));
        let due = !self.running && self.last.is_none_or(|t| now.duration_since(t) >= every);
        self.running |= due;
        due
    }
}

/// Measures every node of `backend` (in the background on `rt`), into `into`.
pub(crate) fn start(
    rt: &tokio::runtime::Runtime,
    backend: &Backend,
    prefix: String,
    timeout: Duration,
    into: Arc<Mutex<Measured>>,
) {
    let nodes: Vec<(String, NodeConn)> = match backend {
        Backend::Single(c) => vec![("single".into(), NodeConn::Ready(c.clone()))],
        Backend::Cluster(c) => c
            .masters()
            .into_iter()
            .map(|a| (a.clone(), NodeConn::Cluster(c.clone(), a)))
            .collect(),
    };
    rt.spawn(async move {
        let t = Instant::now();
        let mut sum = Node {
            entries: 0,
            bytes: 0,
            capacity: 0,
            dropped: 0,
        };
        let mut per_node = Vec::new();
        let mut failed = None;
        for (name, nc) in nodes {
            let r = async {
                let mut c = nc.get().await?;
                node(&mut c, &prefix, timeout).await
            };
            match r.await {
                Ok(n) => {
                    sum.entries += n.entries;
                    sum.bytes += n.bytes;
                    sum.capacity = sum.capacity.saturating_add(n.capacity);
                    per_node.push((name, n.dropped));
                }
                Err(e) => failed = Some(e),
            }
        }
        let mut m = into.lock().unwrap_or_else(|e| e.into_inner());
        m.running = false;
        m.last = Some(Instant::now());
        m.took = t.elapsed();
        if let Some(e) = failed {
            // The numbers stay as last measured; the operations' own errors are counted.
            tracing::debug!(error = %e, "the remote tier could not be measured");
            return;
        }
        let mut evictions = 0;
        for (name, dropped) in per_node {
            let base = *m.base.entry(name).or_insert(dropped);
            evictions += dropped.saturating_sub(base);
        }
        m.entries = sum.entries;
        m.bytes = sum.bytes;
        m.capacity = sum.capacity;
        m.evictions = m.evictions.max(evictions);
    });
}

/// A node's connection, or how to get it.
enum NodeConn {
    Ready(ConnectionManager),
    Cluster(Arc<crate::cluster::Cluster>, String),
}

impl NodeConn {
    async fn get(self) -> Result<ConnectionManager, StorageError> {
        match self {
            NodeConn::Ready(c) => Ok(c),
            NodeConn::Cluster(cl, addr) => cl.conn(&addr).await,
        }
    }
}

/// One node: its pages under `prefix`, their bytes, its memory limit, its dropped keys.
async fn node(
    c: &mut ConnectionManager,
    prefix: &str,
    timeout: Duration,
) -> Result<Node, StorageError> {
    let pattern = format!("{}*", glob_escape(prefix));
    let (mut entries, mut bytes) = (0u64, 0u64);
    let mut cursor: u64 = 0;
    loop {
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT);
        let (next, keys): (u64, Vec<String>) = within(timeout, "SCAN", scan.query_async(c)).await?;
        if !keys.is_empty() {
            let mut p = redis::pipe();
            for k in &keys {
                p.cmd("STRLEN").arg(k);
            }
            let lens: Vec<u64> = within(timeout, "STRLEN", p.query_async(c)).await?;
            // A key that expired between SCAN and STRLEN reads 0: not held.
            entries += lens.iter().filter(|&&l| l > 0).count() as u64;
            bytes += lens.iter().sum::<u64>();
        }
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    let memory: String = within(
        timeout,
        "INFO",
        redis::cmd("INFO").arg("memory").query_async(c),
    )
    .await?;
    let stats: String = within(
        timeout,
        "INFO",
        redis::cmd("INFO").arg("stats").query_async(c),
    )
    .await?;
    let field = |text: &str, name: &str| -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse().ok())
    };
    let capacity = match field(&memory, "maxmemory") {
        Some(0) | None => field(&memory, "total_system_memory").unwrap_or(0),
        Some(m) => m,
    };
    let dropped = field(&stats, "evicted_keys")
        .zip(field(&stats, "expired_keys"))
        .map(|(a, b)| a + b)
        .ok_or_else(|| unavailable("INFO stats without evicted_keys / expired_keys"))?;
    Ok(Node {
        entries,
        bytes,
        capacity,
        dropped,
    })
}

/// `s` with the glob characters of `SCAN MATCH` escaped.
fn glob_escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for ch in s.chars() {
        if matches!(ch, '*' | '?' | '[' | ']' | '\\') {
            o.push('\\');
        }
        o.push(ch);
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_is_due_once_at_a_time_and_not_more_often_than_the_interval() {
        let mut m = Measured::default();
        let t = Instant::now();
        assert!(m.due(t));
        assert!(!m.due(t), "one pass at a time");
        m.running = false;
        m.last = Some(t);
        m.took = Duration::from_millis(500);
        assert!(!m.due(t + Duration::from_secs(4)));
        assert!(m.due(t + Duration::from_secs(5)));
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}
