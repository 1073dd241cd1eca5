//! `strata-redis`: an L3 [`Storage`] on Redis, shared by every worker that points at it.
//!
//! Pages are keyed `strata:v3:{namespace}:{key tag}:{page hash}` (the namespace: model id,
//! page size, layout and K/V dtype, so foreign pages never match; the key tag: derived from the
//! page MAC key and the layout tag, so deployments with different cluster keys sharing one
//! Redis never meet, and neither deletes the other's pages as corrupt) and stored in the
//! shared page format (header with format version, length, keyed MAC, the page hash and the
//! layout tag): a corrupt, foreign or other-layout value is a miss, counted and deleted, never
//! used. Every operation is bounded by a timeout; batches go
//! in one pipelined round trip; an optional TTL lets Redis expire pages; Redis' own eviction
//! (maxmemory) is simply a miss here. The connection reconnects by itself with backoff
//! (redis' `ConnectionManager`); while Redis is down, operations fail as errors (counted) and
//! the worker serves the affected prompts as misses. After a few round trips in a row without a
//! reply, a breaker (`breaker`) fails batches at once for a backoff (1 s doubling to 16 s),
//! then lets one probe through, so an outage does not put the timeout on every request's path.
//!
//! **Redis Cluster** (`cluster`): a `redis://` URL naming a cluster node, or
//! `redis-cluster://` with seed nodes, spreads pages over the cluster's hash slots (the page
//! hash decides the slot; the namespace may not hold a hash tag). A batch goes as one pipeline
//! per master, concurrently; a master that is down makes its own pages misses (counted as
//! errors) until the cluster fails over to its replica and the slot map is fetched again.
//!
//! Modules: `cluster` (the cluster client), `slot` (key slots), `measure` (what the tier holds,
//! measured in Redis), `url` (`--l3` URLs checked before anything connects; logs show them through
//! `strata_kv::units::shown_url`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::ConnectionManager;
use strata_kv::storage::{blob, Storage, StorageError, StorageStats};
use strata_kv::units::shown_url;
use strata_kv::PageHash;

mod url;
pub use url::check_url;

mod breaker;
mod cluster;
mod measure;
mod slot;

/// Settings of the remote tier.
#[derive(Clone, Debug)]
pub struct RedisConfig {
    /// `redis://host:port[/db]`.
    pub url: String,
    /// Part of every key: pages of other models or layouts never match.
    pub namespace: String,
    /// Expire pages after this long (None: keep until Redis evicts them).
    pub ttl: Option<Duration>,
    /// Bound on every operation.
    pub timeout: Duration,
    /// Key of the page MACs ([`blob::BlobKey::from_cluster`] with a cluster key: pages
    /// forged or moved between keys are misses).
    pub page_key: blob::BlobKey,
    /// Largest value read back (header + one page); anything bigger is not a page of ours.
    pub max_value_bytes: u64,
}

/// The remote tier.
pub struct RedisStorage {
    rt: OwnRuntime,
    backend: Backend,
    prefix: String,
    ttl: Option<Duration>,
    timeout: Duration,
    key: blob::BlobKey,
    max_value: u64,
    stats: Mutex<StorageStats>,
    /// What Redis holds of this tier, measured in the background ([`measure`]).
    measured: Arc<Mutex<measure::Measured>>,
    /// Batches fail at once while Redis does not reply ([`breaker`]).
    breaker: breaker::Breaker,
}

/// The tier's own runtime. Dropped without waiting for its threads: the last holder of the
/// tier (a server's state, a test) may be inside another runtime, where a blocking shutdown
/// panics.
struct OwnRuntime(Option<tokio::runtime::Runtime>);

impl std::ops::Deref for OwnRuntime {
    type Target = tokio::runtime::Runtime;
    fn deref(&self) -> &tokio::runtime::Runtime {
        self.0.as_ref().expect("taken only on drop")
    }
}

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// One Redis, or a Redis Cluster.
enum Backend {
    Single(ConnectionManager),
    Cluster(Arc<cluster::Cluster>),
}

/// One command of a batch and the key it is routed by (in a cluster: the key's slot).
pub(crate) struct Op {
    pub key: String,
    pub cmd: redis::Cmd,
    /// What the command answers when it works.
    pub reply: Reply,
}

/// The kind of reply a command gives when it works: another (from something that is not
/// Redis, or a proxy in between) is a failed operation, counted, never a miss said quietly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    /// `EXISTS`, `DEL`.
    Int,
    /// `GETRANGE` (a missing key: empty; `Nil` taken too).
    Bytes,
    /// `SET`: `OK`.
    Done,
}

impl Reply {
    fn of(command: &str) -> Reply {
        match command {
            "EXISTS" | "DEL" => Reply::Int,
            "GETRANGE" => Reply::Bytes,
            _ => Reply::Done,
        }
    }

    /// Whether `v` is this kind of reply (a server error is judged apart).
    fn fits(self, v: &redis::Value) -> bool {
        use redis::Value as V;
        match self {
            Reply::Int => matches!(v, V::Int(_)),
            Reply::Bytes => matches!(v, V::BulkString(_) | V::Nil),
            Reply::Done => matches!(v, V::Okay) || matches!(v, V::SimpleString(s) if s == "OK"),
        }
    }
}

pub(crate) fn unavailable(e: impl std::fmt::Display) -> StorageError {
    StorageError::Unavailable(e.to_string())
}

/// The same error again (one failed pipeline fails each of its commands).
pub(crate) fn dup(e: &StorageError) -> StorageError {
    match e {
        StorageError::Timeout(t) => StorageError::Timeout(*t),
        e => unavailable(
            e.to_string()
                .trim_start_matches("storage backend unavailable: "),
        ),
    }
}

/// Reconnection of every connection: bounded retries, each within the operation timeout.
pub(crate) fn manager_config(timeout: Duration) -> redis::aio::ConnectionManagerConfig {
    redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(timeout)
        .set_response_timeout(timeout)
        .set_number_of_retries(2)
        .set_max_delay(1000)
}

/// `f` within `timeout`; its Redis error named after `whom`.
pub(crate) async fn within<T>(
    timeout: Duration,
    whom: &str,
    f: impl std::future::Future<Output = redis::RedisResult<T>>,
) -> Result<T, StorageError> {
    tokio::time::timeout(timeout, f)
        .await
        .map_err(|_| StorageError::Timeout(timeout))?
        .map_err(|e| unavailable(format!("{}: {e}", shown_url(whom))))
}

/// A reconnecting connection to `client`, made within `timeout`. The manager retries a
/// refused connection until the timeout; then one plain try says why (connection refused, no
/// such host) instead of only "timed out".
pub(crate) async fn manager(
    client: redis::Client,
    timeout: Duration,
    whom: &str,
) -> Result<ConnectionManager, StorageError> {
    let make = ConnectionManager::new_with_config(client.clone(), manager_config(timeout));
    match within(timeout, whom, make).await {
        Err(StorageError::Timeout(t)) => {
            let once = client.get_multiplexed_async_connection();
            match tokio::time::timeout(t, once).await {
                Ok(Err(e)) => Err(unavailable(format!("{}: {e}", shown_url(whom)))),
                _ => Err(StorageError::Timeout(t)),
            }
        }
        r => r,
    }
}

/// Seeds of `redis-cluster://[user:pass@]host:port,host:port,...`: the connection settings
/// (from the first) and every `host:port`.
fn cluster_seeds(url: &str) -> Result<(redis::ConnectionInfo, Vec<String>), StorageError> {
    let bad = |why: &str| unavailable(format!("{}: {why}", shown_url(url)));
    let rest = url
        .strip_prefix("redis-cluster://")
        .ok_or_else(|| bad("expected redis-cluster://HOST:PORT[,HOST:PORT...]"))?;
    let (first, others) = rest.split_once(',').unwrap_or((rest, ""));
    let info: redis::ConnectionInfo = format!("redis://{first}")
        .parse()
        .map_err(|e| bad(&format!("{e}")))?;
    let mut seeds = Vec::new();
    let redis::ConnectionAddr::Tcp(h, p) = &info.addr else {
        return Err(bad("only TCP seeds"));
    };
    seeds.push(format!("{h}:{p}"));
    if rest.split(',').any(|s| s.trim().is_empty()) {
        return Err(bad("an empty seed between commas"));
    }
    for s in others.split(',').filter(|s| !s.is_empty()) {
        let (h, p) = s
            .rsplit_once(':')
            .filter(|(h, _)| !h.is_empty() && !h.contains('@') && !h.contains('/'))
            .ok_or_else(|| bad(&format!("seed `{s}` is not HOST:PORT")))?;
        p.parse::<u16>()
            .map_err(|_| bad(&format!("seed `{s}`: bad port")))?;
        seeds.push(format!("{h}:{p}"));
    }
    Ok((info, seeds))
}

impl RedisStorage {
    /// Connects (within the timeout) and checks the server answers; an unreachable Redis is an
    /// error here, so a worker can start without L3 and say so. A `redis://` URL naming a node
    /// of a Redis Cluster uses the whole cluster; `redis-cluster://` lists seed nodes and
    /// requires one.
    pub fn connect(cfg: &RedisConfig) -> Result<RedisStorage, StorageError> {
        if cfg.namespace.contains(['{', '}']) {
            return Err(unavailable(format!(
                "namespace `{}` holds a brace: in a Redis Cluster every page would share one slot",
                cfg.namespace
            )));
        }
        // On a thread of its own: the caller may itself be inside an async runtime.
        std::thread::scope(|s| {
            s.spawn(|| Self::connect_here(cfg))
                .join()
                .unwrap_or_else(|_| Err(unavailable("the connecting thread panicked")))
        })
    }

    fn connect_here(cfg: &RedisConfig) -> Result<RedisStorage, StorageError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("strata-redis")
            .enable_all()
            .build()
            .map_err(unavailable)?;
        let timeout = cfg.timeout;
        let backend = if cfg.url.starts_with("redis-cluster://") {
            let (info, seeds) = cluster_seeds(&cfg.url)?;
            Backend::Cluster(rt.block_on(cluster::Cluster::connect(info, seeds, timeout))?)
        } else {
            rt.block_on(Self::single_or_cluster(&cfg.url, timeout))?
        };
        Ok(RedisStorage {
            rt: OwnRuntime(Some(rt)),
            backend,
            prefix: format!(
                "strata:v3:{}:{}:",
                cfg.namespace,
                strata_kv::auth::hex(&cfg.page_key.id()[..6])
            ),
            ttl: cfg.ttl,
            timeout,
            key: cfg.page_key,
            max_value: cfg.max_value_bytes,
            stats: Mutex::new(StorageStats::default()),
            measured: Arc::default(),
            breaker: breaker::Breaker::new(),
        })
    }

    /// Connects to one Redis and asks whether it is a cluster node.
    async fn single_or_cluster(url: &str, timeout: Duration) -> Result<Backend, StorageError> {
        let client = redis::Client::open(url)
            .map_err(|e| StorageError::Unavailable(format!("{}: {e}", shown_url(url))))?;
        let info = client.get_connection_info().clone();
        let mut conn = manager(client, timeout, url).await?;
        let info_cluster: Result<String, _> = tokio::time::timeout(
            timeout,
            redis::cmd("INFO").arg("cluster").query_async(&mut conn),
        )
        .await
        .map_err(|_| StorageError::Timeout(timeout))?;
        let cluster = match info_cluster {
            Ok(text) => text.contains("cluster_enabled:1"),
            // INFO refused (an ACL without @dangerous, a proxy): not a cluster we can see, so
            // a single Redis if it answers PING.
            Err(e) if e.kind() == redis::ErrorKind::ResponseError || e.code().is_some() => {
                let pong: String =
                    within(timeout, url, redis::cmd("PING").query_async(&mut conn)).await?;
                if pong != "PONG" {
                    return Err(unavailable(format!(
                        "{}: PING answered {pong}",
                        shown_url(url)
                    )));
                }
                false
            }
            Err(e) => {
                return Err(StorageError::Unavailable(format!(
                    "{}: {e}",
                    shown_url(url)
                )))
            }
        };
        if !cluster {
            return Ok(Backend::Single(conn));
        }
        let redis::ConnectionAddr::Tcp(h, p) = &info.addr else {
            return Err(unavailable(format!(
                "{}: a cluster node over TCP",
                shown_url(url)
            )));
        };
        let seed = format!("{h}:{p}");
        Ok(Backend::Cluster(
            cluster::Cluster::connect(info, vec![seed], timeout).await?,
        ))
    }

    /// The Redis key of a page.
    pub fn key_of(&self, h: &PageHash) -> String {
        self.key(h)
    }

    /// The masters serving the pages now (`host:port`), or empty for a single Redis.
    pub fn cluster_masters(&self) -> Vec<String> {
        match &self.backend {
            Backend::Single(_) => Vec::new(),
            Backend::Cluster(c) => c.masters(),
        }
    }

    /// MOVED and ASK replies followed (0 for a single Redis): none while the slot map is right,
    /// some while slots move.
    pub fn cluster_redirects(&self) -> u64 {
        match &self.backend {
            Backend::Single(_) => 0,
            Backend::Cluster(c) => c.redirects(),
        }
    }

    fn key(&self, h: &PageHash) -> String {
        format!("{}{}", self.prefix, h.to_hex())
    }

    fn count(&self, f: impl FnOnce(&mut StorageStats)) {
        f(&mut self.stats.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Runs a batch within the timeout: one reply per op, in order. A reply may be a server
    /// error (`Value::ServerError`) for its own command. A batch with failed commands counts
    /// one error (and one timeout if any timed out).
    fn batch(&self, ops: Vec<Op>) -> Vec<Result<redis::Value, StorageError>> {
        if ops.is_empty() {
            return Vec::new();
        }
        let timeout = self.timeout;
        let n = ops.len();
        let expected: Vec<Reply> = ops.iter().map(|o| o.reply).collect();
        if let Err(why) = self.breaker.allow(std::time::Instant::now()) {
            self.count(|s| s.errors += 1);
            return (0..n).map(|_| Err(unavailable(&why))).collect();
        }
        let out = match &self.backend {
            Backend::Cluster(c) => self.rt.block_on(c.batch(&ops)),
            Backend::Single(conn) => {
                let mut conn = conn.clone();
                let mut p = redis::pipe();
                for op in ops {
                    p.add_command(op.cmd);
                }
                let r = self.rt.block_on(async move {
                    use redis::aio::ConnectionLike;
                    tokio::time::timeout(timeout, conn.req_packed_commands(&p, 0, n)).await
                });
                match r {
                    Err(_) => (0..n)
                        .map(|_| Err(StorageError::Timeout(timeout)))
                        .collect(),
                    Ok(Err(e)) => (0..n).map(|_| Err(unavailable(&e))).collect(),
                    Ok(Ok(v)) if v.len() == n => v.into_iter().map(Ok).collect(),
                    Ok(Ok(_)) => (0..n)
                        .map(|_| Err(unavailable("a reply count other than the commands'")))
                        .collect(),
                }
            }
        };
        // Redis replied at all (a command's own error is a reply): the breaker stays closed.
        let reached = out.iter().any(|r| r.is_ok());
        self.breaker.record(reached, std::time::Instant::now());
        // A command's own server error (CLUSTERDOWN, LOADING, OOM, NOPERM...) is a failure
        // too, and so is a reply of another kind than the command's; WRONGTYPE is a foreign
        // key, counted as corrupt by the reader.
        let failed = out.iter().zip(&expected).any(|(r, want)| match r {
            Err(_) => true,
            Ok(redis::Value::ServerError(e)) => e.code() != "WRONGTYPE",
            Ok(v) => !want.fits(v),
        });
        let timed_out = out
            .iter()
            .any(|r| matches!(r, Err(StorageError::Timeout(_))));
        if failed {
            self.count(|s| {
                s.errors += 1;
                s.timeouts += timed_out as u64;
            });
        }
        out
    }

    fn op(&self, h: &PageHash, name: &str) -> Op {
        let key = self.key(h);
        let mut cmd = redis::cmd(name);
        cmd.arg(&key);
        let reply = Reply::of(name);
        Op { key, cmd, reply }
    }

    fn set_ops(&self, pages: &[(PageHash, &[u8])]) -> Vec<Op> {
        pages
            .iter()
            .map(|(h, d)| {
                let mut op = self.op(h, "SET");
                op.cmd.arg(blob::encode(&self.key, h, d));
                if let Some(t) = self.ttl {
                    op.cmd.arg("PX").arg(t.as_millis() as u64);
                }
                op
            })
            .collect()
    }

    /// Deletes keys found corrupt, foreign or of another type (best effort).
    fn drop_bad(&self, bad: &[PageHash]) {
        if bad.is_empty() {
            return;
        }
        let _ = self.batch(bad.iter().map(|h| self.op(h, "DEL")).collect());
    }

    /// One read reply: the payload, a miss, or a value that is not ours (to delete).
    fn read_reply(&self, h: &PageHash, v: redis::Value) -> Result<Read, StorageError> {
        match v {
            // GETRANGE of a missing key is empty; a page is never empty.
            redis::Value::BulkString(b) if b.is_empty() => Ok(Read::Miss),
            redis::Value::BulkString(b) if b.len() as u64 > self.max_value => Ok(Read::Bad),
            redis::Value::BulkString(b) => Ok(match blob::decode(&self.key, h, &b) {
                Ok(p) => Read::Page(p),
                Err(blob::Refused::Damaged) => Read::Bad,
                Err(blob::Refused::OtherLayout) => Read::OtherLayout,
            }),
            redis::Value::Nil => Ok(Read::Miss),
            redis::Value::ServerError(e) if e.code() == "WRONGTYPE" => Ok(Read::Bad),
            redis::Value::ServerError(e) => Err(unavailable(format!(
                "{} {}",
                e.code(),
                e.details().unwrap_or("")
            ))),
            other => Err(unavailable(format!("unexpected reply {other:?}"))),
        }
    }
}

/// What a read found.
enum Read {
    Page(Vec<u8>),
    Miss,
    Bad,
    /// An intact page written for another page layout (page size, kinds or K/V dtype).
    OtherLayout,
}

/// A reply that is not what the command answers on success: its server error, or what it was.
fn reply_error(v: &redis::Value) -> StorageError {
    match v {
        redis::Value::ServerError(e) => {
            unavailable(format!("{} {}", e.code(), e.details().unwrap_or("")))
        }
        other => unavailable(format!("unexpected reply {other:?}")),
    }
}

/// An integer reply, or the command's error.
fn int_reply(r: Result<redis::Value, StorageError>) -> Result<i64, StorageError> {
    match r? {
        redis::Value::Int(n) => Ok(n),
        other => Err(reply_error(&other)),
    }
}

/// `OK`, or the command's error (another reply too: the page was not stored as asked).
fn ok_reply(r: Result<redis::Value, StorageError>) -> Result<(), StorageError> {
    match r? {
        v if Reply::Done.fits(&v) => Ok(()),
        v => Err(reply_error(&v)),
    }
}

impl Storage for RedisStorage {
    fn tier(&self) -> &'static str {
        "remote"
    }

    /// A key whose master cannot be reached is reported absent (the error is counted); only
    /// when every key failed is the answer an error.
    fn exists(&self, hashes: &[PageHash]) -> Result<Vec<bool>, StorageError> {
        let replies = self.batch(hashes.iter().map(|h| self.op(h, "EXISTS")).collect());
        let (mut first_err, mut failed) = (None, 0);
        let out: Vec<bool> = replies
            .into_iter()
            .map(|r| match int_reply(r) {
                Ok(n) => n > 0,
                Err(e) => {
                    failed += 1;
                    first_err.get_or_insert(e);
                    false
                }
            })
            .collect();
        match first_err {
            Some(e) if failed == hashes.len() => Err(e),
            _ => Ok(out),
        }
    }

    fn get(&self, hash: &PageHash) -> Result<Option<Vec<u8>>, StorageError> {
        self.get_many(std::slice::from_ref(hash)).remove(0)
    }

    /// Reads with `GETRANGE key 0 max`: never more than one byte past the largest page is read
    /// back, and a key of another type is a `WRONGTYPE` error for that key only. Such keys and
    /// values that do not verify are misses, counted and deleted.
    fn get_many(&self, hashes: &[PageHash]) -> Vec<Result<Option<Vec<u8>>, StorageError>> {
        let ops = hashes
            .iter()
            .map(|h| {
                let mut op = self.op(h, "GETRANGE");
                op.cmd.arg(0).arg(self.max_value);
                op
            })
            .collect();
        let mut bad = Vec::new();
        let out = hashes
            .iter()
            .zip(self.batch(ops))
            .map(|(h, r)| {
                self.count(|s| s.gets += 1);
                match self.read_reply(h, r?)? {
                    Read::Page(p) => {
                        self.count(|s| s.hits += 1);
                        Ok(Some(p))
                    }
                    Read::Miss => Ok(None),
                    Read::Bad => {
                        self.count(|s| s.corrupt += 1);
                        bad.push(*h);
                        Ok(None)
                    }
                    Read::OtherLayout => {
                        self.count(|s| s.other_layout += 1);
                        bad.push(*h);
                        Ok(None)
                    }
                }
            })
            .collect();
        self.drop_bad(&bad);
        out
    }

    fn put(&self, hash: &PageHash, data: &[u8]) -> Result<(), StorageError> {
        self.count(|s| s.puts += 1);
        let r = self.batch(self.set_ops(&[(*hash, data)])).remove(0);
        ok_reply(r)
    }

    fn put_many(&self, pages: &[(PageHash, Vec<u8>)]) -> Vec<Result<(), StorageError>> {
        self.count(|s| s.puts += pages.len() as u64);
        let refs: Vec<(PageHash, &[u8])> = pages.iter().map(|(h, d)| (*h, d.as_slice())).collect();
        self.batch(self.set_ops(&refs))
            .into_iter()
            .map(ok_reply)
            .collect()
    }

    fn delete(&self, hash: &PageHash) -> Result<bool, StorageError> {
        let r = self.batch(vec![self.op(hash, "DEL")]).remove(0);
        Ok(int_reply(r)? > 0)
    }

    /// The counters of this worker's operations, with what Redis holds under this tier's
    /// prefix (entries, value bytes), its memory limit and the keys it evicted or expired since
    /// this worker connected, as last measured; a new measurement starts in the background when
    /// the last is older than its interval.
    fn stats(&self) -> StorageStats {
        let mut s = *self.stats.lock().unwrap_or_else(|e| e.into_inner());
        let due = self
            .measured
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .due(std::time::Instant::now());
        if due {
            measure::start(
                &self.rt,
                &self.backend,
                self.prefix.clone(),
                self.timeout,
                self.measured.clone(),
            );
        }
        let m = self.measured.lock().unwrap_or_else(|e| e.into_inner());
        s.entries = m.entries;
        s.bytes = m.bytes;
        s.capacity_bytes = m.capacity;
        s.evictions = m.evictions;
        s
    }
}
