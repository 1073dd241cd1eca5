//! Redis Cluster: pages spread over the cluster's 16,384 hash slots, one pipeline per master.
//!
//! The slot map comes from `CLUSTER SLOTS`. A batch is grouped by the master of each key's slot
//! and every group goes out as one pipeline, all groups concurrently, within one deadline. A
//! `MOVED` reply updates that slot's entry and the command is sent again (to the new master);
//! `ASK` sends it once to the named node after `ASKING`. A master that cannot be reached fails
//! its own keys only (the caller counts them as misses) and the map is fetched again in the
//! background (at most every [`MIN_REFRESH`]), so after a failover the promoted replica is used.
//! Only masters are read: a replica may lag, and a page read back is verified anyway.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use futures_util::future::{join_all, select_ok};
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::{ConnectionAddr, ConnectionInfo, Value};
use strata_kv::storage::StorageError;

use crate::slot::{key_slot, SLOTS};
use crate::{dup, manager, unavailable, within, Op};

/// Sends of one command (the first, then redirects) before it is an error.
const MAX_SENDS: usize = 4;
/// The slot map is fetched at most this often.
pub(crate) const MIN_REFRESH: Duration = Duration::from_millis(100);
/// No master in the map for this slot.
const NONE: u16 = u16::MAX;
/// Most masters (and connections) one cluster may have here: a bound on what hostile
/// `CLUSTER SLOTS` or `MOVED` answers can make us hold.
pub(crate) const MAX_NODES: usize = 1024;

/// Which master serves each slot.
struct SlotMap {
    /// Index into `masters` per slot, or [`NONE`].
    slot: Vec<u16>,
    /// `host:port` (`[v6]:port`) of each master.
    masters: Vec<String>,
}

impl SlotMap {
    fn empty() -> SlotMap {
        SlotMap {
            slot: vec![NONE; SLOTS],
            masters: Vec::new(),
        }
    }

    fn master_of(&self, slot: u16) -> Option<&str> {
        let i = *self.slot.get(slot as usize)?;
        self.masters.get(i as usize).map(String::as_str)
    }

    /// The index of a master, added if new; None past [`MAX_NODES`].
    fn index(&mut self, addr: &str) -> Option<u16> {
        if let Some(i) = self.masters.iter().position(|m| m == addr) {
            return u16::try_from(i).ok();
        }
        if self.masters.len() >= MAX_NODES {
            return None;
        }
        self.masters.push(addr.to_string());
        u16::try_from(self.masters.len() - 1).ok()
    }

    /// Points `slot` at `addr` (a MOVED answer); false when that would pass [`MAX_NODES`].
    fn set(&mut self, slot: u16, addr: &str) -> bool {
        match (self.index(addr), self.slot.get_mut(slot as usize)) {
            (Some(i), Some(s)) => {
                *s = i;
                true
            }
            _ => false,
        }
    }

    fn covered(&self) -> usize {
        self.slot.iter().filter(|&&i| i != NONE).count()
    }
}

/// `host:port`, with an IPv6 host in brackets (as the map keeps every address).
fn addr_of(host: &str, port: u16) -> String {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// An address a node wrote (`MOVED 12 host:port`, `[v6]:port`, bare `v6:port`, or `:port` for
/// the node's own host), in the map's form.
fn norm_addr(written: &str, from: &str) -> Option<String> {
    let (h, p) = written.rsplit_once(':')?;
    let port: u16 = p.parse().ok()?;
    let host = if h.is_empty() {
        split_addr(from).ok()?.0
    } else {
        h.to_string()
    };
    (host.len() <= 255).then(|| addr_of(&host, port))
}

/// Parses a `CLUSTER SLOTS` answer from the node at `asked`. Everything is checked: a range
/// past the slots, overlapping ranges, more entries than slots or masters than
/// [`MAX_NODES`] are errors. A master's host may be empty or nil (the asked node's host) or `?`
/// (unknown: its slots stay unassigned).
fn parse_slots(v: Value, asked: &str) -> Result<SlotMap, StorageError> {
    let bad = |what: &str| unavailable(format!("CLUSTER SLOTS from {asked}: {what}"));
    let Value::Array(entries) = v else {
        return Err(bad("not an array"));
    };
    if entries.len() > SLOTS {
        return Err(bad("more ranges than slots"));
    }
    let mut map = SlotMap::empty();
    let asked_host = split_addr(asked)?.0;
    for e in entries {
        let Value::Array(e) = e else {
            return Err(bad("an entry is not an array"));
        };
        let (Some(Value::Int(lo)), Some(Value::Int(hi)), Some(Value::Array(node))) =
            (e.first(), e.get(1), e.get(2))
        else {
            return Err(bad("an entry lacks its range or master"));
        };
        if !(0..SLOTS as i64).contains(lo) || !(*lo..SLOTS as i64).contains(hi) {
            return Err(bad(&format!("slot range {lo}-{hi}")));
        }
        let host = match node.first() {
            Some(Value::BulkString(b)) if b.len() <= 255 => String::from_utf8_lossy(b).into_owned(),
            Some(Value::SimpleString(s)) if s.len() <= 255 => s.clone(),
            Some(Value::Nil) => String::new(),
            _ => return Err(bad("a master without a host")),
        };
        let port = match node.get(1) {
            Some(Value::Int(p)) => u16::try_from(*p).map_err(|_| bad("a port past 65535"))?,
            _ => return Err(bad("a master without a port")),
        };
        let range = *lo as usize..=*hi as usize;
        if map.slot[range.clone()].iter().any(|&i| i != NONE) {
            return Err(bad(&format!("overlapping slot range {lo}-{hi}")));
        }
        if host == "?" {
            continue;
        }
        let host = if host.is_empty() {
            asked_host.clone()
        } else {
            host
        };
        let i = map
            .index(&addr_of(&host, port))
            .ok_or_else(|| bad(&format!("more than {MAX_NODES} masters")))?;
        map.slot[range].fill(i);
    }
    Ok(map)
}

/// `host:port` (or `[v6]:port`) into its parts.
fn split_addr(addr: &str) -> Result<(String, u16), StorageError> {
    let (h, p) = addr
        .rsplit_once(':')
        .ok_or_else(|| unavailable(format!("`{addr}` is not host:port")))?;
    let port = p
        .parse()
        .map_err(|_| unavailable(format!("`{addr}`: bad port")))?;
    Ok((
        h.trim_start_matches('[').trim_end_matches(']').to_string(),
        port,
    ))
}

/// A redirect in a command's reply, with the target in the map's address form.
#[derive(Debug)]
enum Redirect {
    Moved(u16, String),
    Ask(u16, String),
}

/// The redirect in a reply from the node at `from`, if any (None also for a malformed one:
/// then the reply stands as the command's error).
fn redirect(v: &Value, from: &str) -> Option<Redirect> {
    let Value::ServerError(e) = v else {
        return None;
    };
    let mut d = e.details()?.split_whitespace();
    let slot = d
        .next()?
        .parse::<u16>()
        .ok()
        .filter(|&s| (s as usize) < SLOTS)?;
    let to = norm_addr(d.next()?, from)?;
    match e.code() {
        "MOVED" => Some(Redirect::Moved(slot, to)),
        "ASK" => Some(Redirect::Ask(slot, to)),
        _ => None,
    }
}

/// A connected cluster.
pub(crate) struct Cluster {
    /// Credentials and protocol for every node (the address is replaced per node).
    info: ConnectionInfo,
    seeds: Vec<String>,
    timeout: Duration,
    map: RwLock<SlotMap>,
    conns: Mutex<HashMap<String, ConnectionManager>>,
    /// When the map was last fetched; held while one fetch runs.
    fetched: tokio::sync::Mutex<Option<Instant>>,
    /// MOVED and ASK replies followed.
    redirects: AtomicU64,
}

impl Cluster {
    /// Connects through the first seed (`host:port`) that answers `CLUSTER SLOTS`.
    pub(crate) async fn connect(
        info: ConnectionInfo,
        seeds: Vec<String>,
        timeout: Duration,
    ) -> Result<Arc<Cluster>, StorageError> {
        if info.redis.db != 0 {
            return Err(unavailable(
                "Redis Cluster has only database 0: drop the /DB from the URL",
            ));
        }
        let c = Arc::new(Cluster {
            info,
            seeds,
            timeout,
            map: RwLock::new(SlotMap::empty()),
            conns: Mutex::new(HashMap::new()),
            fetched: tokio::sync::Mutex::new(None),
            redirects: AtomicU64::new(0),
        });
        let map = c.fetch_map().await?;
        let covered = map.covered();
        if covered < SLOTS {
            tracing::warn!(
                covered,
                "Redis Cluster serves only part of its slots: pages of the others are misses"
            );
        }
        tracing::info!(masters = map.masters.len(), "Redis Cluster slot map");
        *c.map.write().unwrap_or_else(|e| e.into_inner()) = map;
        Ok(c)
    }

    /// Masters in the slot map now.
    pub(crate) fn masters(&self) -> Vec<String> {
        self.map
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .masters
            .clone()
    }

    /// MOVED and ASK replies followed so far (none while the slot map is right).
    pub(crate) fn redirects(&self) -> u64 {
        self.redirects.load(Ordering::Relaxed)
    }

    pub(crate) async fn conn(&self, addr: &str) -> Result<ConnectionManager, StorageError> {
        if let Some(c) = self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(addr)
        {
            return Ok(c.clone());
        }
        if self.conns.lock().unwrap_or_else(|e| e.into_inner()).len() >= MAX_NODES {
            return Err(unavailable(format!(
                "{addr}: more than {MAX_NODES} Redis Cluster nodes"
            )));
        }
        let (host, port) = split_addr(addr)?;
        let mut info = self.info.clone();
        info.addr = ConnectionAddr::Tcp(host, port);
        let client = redis::Client::open(info).map_err(|e| unavailable(format!("{addr}: {e}")))?;
        let c = manager(client, self.timeout, addr).await?;
        let mut conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        Ok(conns.entry(addr.to_string()).or_insert(c).clone())
    }

    /// `CLUSTER SLOTS` from the first known node (masters, then seeds) to answer.
    async fn fetch_map(&self) -> Result<SlotMap, StorageError> {
        let mut nodes = self.masters();
        for s in &self.seeds {
            if !nodes.contains(s) {
                nodes.push(s.clone());
            }
        }
        let asks = nodes.into_iter().map(|addr| {
            Box::pin(async move {
                let mut c = self.conn(&addr).await?;
                let mut cmd = redis::cmd("CLUSTER");
                cmd.arg("SLOTS");
                let v = within(self.timeout, &addr, cmd.query_async::<Value>(&mut c)).await?;
                parse_slots(v, &addr)
            })
        });
        select_ok(asks).await.map(|(m, _)| m).map_err(|e| {
            unavailable(format!(
                "no Redis Cluster node answered CLUSTER SLOTS ({e})"
            ))
        })
    }

    /// Fetches the map again unless that was done within [`MIN_REFRESH`] or is under way;
    /// connections to nodes no longer masters are dropped.
    async fn refresh(&self) {
        let Ok(mut fetched) = self.fetched.try_lock() else {
            return;
        };
        if fetched.is_some_and(|t| t.elapsed() < MIN_REFRESH) {
            return;
        }
        match self.fetch_map().await {
            Ok(map) => {
                let before = self.masters();
                if before != map.masters {
                    tracing::info!(masters = ?map.masters, "Redis Cluster slot map changed");
                }
                self.conns
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .retain(|a, _| map.masters.contains(a) || self.seeds.contains(a));
                *self.map.write().unwrap_or_else(|e| e.into_inner()) = map;
            }
            Err(e) => {
                tracing::warn!(error = %e, "Redis Cluster slot map not refreshed");
                let known = self.masters();
                self.conns
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .retain(|a, _| known.contains(a) || self.seeds.contains(a));
            }
        }
        *fetched = Some(Instant::now());
    }

    /// One pipeline to one node: `(op index, ASKING first)` per command; one reply per command.
    async fn node_pipeline(
        &self,
        addr: &str,
        items: &[(usize, bool)],
        ops: &[Op],
        deadline: tokio::time::Instant,
    ) -> Result<Vec<Value>, StorageError> {
        let send = async {
            let mut c = self.conn(addr).await?;
            let mut p = redis::pipe();
            let mut n = 0;
            for &(i, asking) in items {
                if asking {
                    p.cmd("ASKING");
                    n += 1;
                }
                p.add_command(ops[i].cmd.clone());
                n += 1;
            }
            let replies = c
                .req_packed_commands(&p, 0, n)
                .await
                .map_err(|e| unavailable(format!("{addr}: {e}")))?;
            if replies.len() != n {
                return Err(unavailable(format!(
                    "{addr}: {} replies to {n} commands",
                    replies.len()
                )));
            }
            let mut replies = replies.into_iter();
            let mut out = Vec::with_capacity(items.len());
            for &(_, asking) in items {
                if asking {
                    replies.next();
                }
                out.push(replies.next().unwrap_or(Value::Nil));
            }
            Ok(out)
        };
        tokio::time::timeout_at(deadline, send)
            .await
            .map_err(|_| StorageError::Timeout(self.timeout))?
    }

    /// Runs a batch: one reply (or error) per op, in order.
    pub(crate) async fn batch(self: &Arc<Self>, ops: &[Op]) -> Vec<Result<Value, StorageError>> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut b = Batch {
            out: ops.iter().map(|_| None).collect(),
            todo: (0..ops.len()).map(|i| (i, None)).collect(),
            stale: false,
        };
        for _ in 0..MAX_SENDS {
            if b.todo.is_empty() {
                break;
            }
            let groups = self.group(ops, &mut b);
            let sends = groups
                .iter()
                .map(|(addr, items)| self.node_pipeline(addr, items, ops, deadline));
            let replies = join_all(sends).await;
            for ((addr, items), r) in groups.into_iter().zip(replies) {
                self.take(&addr, items, r, ops, &mut b);
            }
        }
        for (i, _) in std::mem::take(&mut b.todo) {
            b.out[i] = Some(Err(unavailable(format!(
                "redirected {MAX_SENDS} times (the cluster is resharding)"
            ))));
        }
        if b.stale {
            let me = Arc::clone(self);
            tokio::spawn(async move { me.refresh().await });
        }
        b.out
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Err(unavailable("no reply"))))
            .collect()
    }

    /// The ops still to send, grouped by the node each goes to: `(op, ASKING first)`.
    fn group(&self, ops: &[Op], b: &mut Batch) -> HashMap<String, Vec<(usize, bool)>> {
        let mut groups: HashMap<String, Vec<(usize, bool)>> = HashMap::new();
        let map = self.map.read().unwrap_or_else(|e| e.into_inner());
        for (i, ask) in std::mem::take(&mut b.todo) {
            let slot = key_slot(ops[i].key.as_bytes());
            let (to, asking) = match ask {
                Some(a) => (a, true),
                None => match map.master_of(slot) {
                    Some(m) => (m.to_string(), false),
                    None => {
                        b.stale = true;
                        b.out[i] = Some(Err(unavailable(format!(
                            "Redis Cluster slot {slot} has no master"
                        ))));
                        continue;
                    }
                },
            };
            groups.entry(to).or_default().push((i, asking));
        }
        groups
    }

    /// Takes one node's replies: redirects go back on the to-do list (MOVED also updates the
    /// slot map), everything else is the op's reply; a failed pipeline fails its ops.
    fn take(
        &self,
        from: &str,
        items: Vec<(usize, bool)>,
        r: Result<Vec<Value>, StorageError>,
        ops: &[Op],
        b: &mut Batch,
    ) {
        let vals = match r {
            Ok(v) => v,
            Err(e) => {
                b.stale = true;
                for (i, _) in items {
                    b.out[i] = Some(Err(dup(&e)));
                }
                return;
            }
        };
        for ((i, asked), v) in items.into_iter().zip(vals) {
            let r = redirect(&v, from);
            if r.is_some() {
                self.redirects.fetch_add(1, Ordering::Relaxed);
            }
            let own = key_slot(ops[i].key.as_bytes());
            match r {
                // A redirect for another slot than the key's, or an ASK from the node an ASK
                // named: not followed (the op fails with it).
                Some(Redirect::Moved(slot, _) | Redirect::Ask(slot, _)) if slot != own => {
                    b.out[i] = Some(Err(unavailable(format!(
                        "{from} redirected slot {slot} for a key of slot {own}"
                    ))));
                }
                Some(Redirect::Ask(..)) if asked => {
                    b.out[i] = Some(Err(unavailable(format!("{from} asked again"))));
                }
                Some(Redirect::Moved(slot, to)) => {
                    b.stale = true;
                    let set = self
                        .map
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .set(slot, &to);
                    if set {
                        b.todo.push((i, None));
                    } else {
                        b.out[i] = Some(Err(unavailable(format!(
                            "MOVED to {to}: more than {MAX_NODES} masters"
                        ))));
                    }
                }
                Some(Redirect::Ask(_, to)) => b.todo.push((i, Some(to))),
                None => {
                    if matches!(&v, Value::ServerError(e) if e.code() == "CLUSTERDOWN") {
                        b.stale = true;
                    }
                    b.out[i] = Some(Ok(v));
                }
            }
        }
    }
}

/// A batch between sends.
struct Batch {
    /// The reply of each op, once it has one.
    out: Vec<Option<Result<Value, StorageError>>>,
    /// Ops still to send, with the node an ASK named.
    todo: Vec<(usize, Option<String>)>,
    /// The slot map looked out of date: fetch it again.
    stale: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(lo: i64, hi: i64, host: &str, port: i64) -> Value {
        Value::Array(vec![
            Value::Int(lo),
            Value::Int(hi),
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
            ]),
        ])
    }

    #[test]
    fn a_slot_map_is_parsed_and_checked() {
        let v = Value::Array(vec![
            entry(0, 8191, "10.0.0.1", 7000),
            entry(8192, 16383, "", 7001),
        ]);
        let m = parse_slots(v, "10.0.0.9:7005").unwrap();
        assert_eq!(m.master_of(0), Some("10.0.0.1:7000"));
        assert_eq!(
            m.master_of(16383),
            Some("10.0.0.9:7001"),
            "empty host: the asked one"
        );
        assert_eq!(m.covered(), SLOTS);
        for bad in [
            entry(0, 16384, "h", 1),
            entry(5, 4, "h", 1),
            entry(-1, 3, "h", 1),
            entry(0, 1, "h", 70000),
            Value::Int(3),
        ] {
            let v = match bad {
                Value::Int(_) => bad,
                e => Value::Array(vec![e]),
            };
            assert!(parse_slots(v, "h:1").is_err());
        }
        let partial = parse_slots(Value::Array(vec![entry(0, 99, "h", 1)]), "h:1").unwrap();
        assert_eq!(partial.covered(), 100);
        assert_eq!(partial.master_of(100), None);
        // Overlapping ranges; a master of unknown endpoint (`?`: its slots unassigned); a nil
        // host (the asked node's).
        let overlap = Value::Array(vec![entry(0, 99, "a", 1), entry(50, 60, "b", 1)]);
        assert!(parse_slots(overlap, "h:1").is_err());
        let unknown = Value::Array(vec![entry(0, 9, "?", 1), entry(10, 19, "a", 2)]);
        let m = parse_slots(unknown, "h:1").unwrap();
        assert_eq!((m.master_of(0), m.master_of(10)), (None, Some("a:2")));
        let nil = Value::Array(vec![Value::Array(vec![
            Value::Int(0),
            Value::Int(5),
            Value::Array(vec![Value::Nil, Value::Int(7)]),
        ])]);
        assert_eq!(
            parse_slots(nil, "[::1]:1").unwrap().master_of(3),
            Some("[::1]:7")
        );
        // Masters past the bound: refused, in bounded time.
        let many = Value::Array(
            (0..SLOTS as i64)
                .map(|i| entry(i, i, &format!("h{i}"), 1))
                .collect(),
        );
        assert!(parse_slots(many, "h:1").is_err());
    }

    #[test]
    fn redirects_are_read_from_replies() {
        let reply = |b: &[u8]| redis::parse_redis_value(b).unwrap();
        let moved = reply(b"-MOVED 3999 127.0.0.1:6381\r\n");
        let from = "10.0.0.1:7000";
        assert!(
            matches!(redirect(&moved, from), Some(Redirect::Moved(3999, a)) if a == "127.0.0.1:6381")
        );
        // An empty host: the replying node's; a bare IPv6 host: bracketed, as in the map.
        let own = reply(b"-MOVED 5 :7002\r\n");
        assert!(
            matches!(redirect(&own, from), Some(Redirect::Moved(5, a)) if a == "10.0.0.1:7002")
        );
        let v6 = reply(b"-MOVED 5 ::1:7002\r\n");
        assert!(matches!(redirect(&v6, from), Some(Redirect::Moved(5, a)) if a == "[::1]:7002"));
        assert!(
            redirect(&reply(b"-MOVED 16384 h:1\r\n"), from).is_none(),
            "a slot past the map"
        );
        let ask = reply(b"-ASK 12 [::1]:7000\r\n");
        assert!(matches!(redirect(&ask, from), Some(Redirect::Ask(12, a)) if a == "[::1]:7000"));
        assert_eq!(split_addr("[::1]:7000").unwrap(), ("::1".to_string(), 7000));
        assert!(redirect(&Value::Int(1), from).is_none());
    }
}
