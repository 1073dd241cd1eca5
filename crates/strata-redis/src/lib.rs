//! `strata-redis`: an L3 [`Storage`] on Redis, shared by every worker that points at it.
//!
//! Pages are keyed `strata:v2:{namespace}:{key tag}:{page hash}` (the namespace: model id,
//! page size and layout, so foreign pages never match; the key tag: derived from the page MAC
//! key, so deployments with different cluster keys sharing one Redis never meet, and neither
//! deletes the other's pages as corrupt) and stored in the shared page format (header with
//! format version, length, BLAKE3 checksum and the page hash): a corrupt or foreign value is a
//! miss, counted and deleted, never used. Every operation is bounded by a timeout; batches go
//! in one pipelined round trip; an optional TTL lets Redis expire pages; Redis' own eviction
//! (maxmemory) is simply a miss here. The connection reconnects by itself with backoff
//! (redis' `ConnectionManager`); while Redis is down, operations fail fast as errors (counted)
//! and the worker serves the affected prompts as misses.

use std::sync::Mutex;
use std::time::Duration;

use redis::aio::ConnectionManager;
use strata_kv::storage::{blob, Storage, StorageError, StorageStats};
use strata_kv::PageHash;

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

/// Reads pages one key at a time inside Redis, so that a key holding something else (another
/// type: WRONGTYPE; an oversized value) is a miss for that key only, and is deleted, instead of
/// failing the batch. Returns, per key, the value or false.
const GET_SCRIPT: &str = r#"
local out = {}
local max = tonumber(ARGV[1])
for i, k in ipairs(KEYS) do
  local t = redis.call('TYPE', k)['ok']
  if t == 'string' and redis.call('STRLEN', k) <= max then
    out[i] = redis.call('GET', k)
  elseif t == 'none' then
    out[i] = false
  else
    redis.call('DEL', k)
    out[i] = 0
  end
end
return out
"#;

/// The remote tier.
pub struct RedisStorage {
    rt: tokio::runtime::Runtime,
    conn: ConnectionManager,
    prefix: String,
    ttl: Option<Duration>,
    timeout: Duration,
    key: blob::BlobKey,
    max_value: u64,
    stats: Mutex<StorageStats>,
}

fn unavailable(e: impl std::fmt::Display) -> StorageError {
    StorageError::Unavailable(e.to_string())
}

impl RedisStorage {
    /// Connects (within the timeout) and checks the server answers; an unreachable Redis is an
    /// error here, so a worker can start without L3 and say so.
    pub fn connect(cfg: &RedisConfig) -> Result<RedisStorage, StorageError> {
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
        let client = redis::Client::open(cfg.url.as_str())
            .map_err(|e| StorageError::Unavailable(format!("{}: {e}", cfg.url)))?;
        let timeout = cfg.timeout;
        let conn = rt.block_on(async {
            let mc = redis::aio::ConnectionManagerConfig::new()
                .set_connection_timeout(timeout)
                .set_response_timeout(timeout)
                .set_number_of_retries(2)
                .set_max_delay(1000);
            let mut conn =
                tokio::time::timeout(timeout, ConnectionManager::new_with_config(client, mc))
                    .await
                    .map_err(|_| StorageError::Timeout(timeout))?
                    .map_err(|e| StorageError::Unavailable(format!("{}: {e}", cfg.url)))?;
            let pong: String =
                tokio::time::timeout(timeout, redis::cmd("PING").query_async(&mut conn))
                    .await
                    .map_err(|_| StorageError::Timeout(timeout))?
                    .map_err(|e| StorageError::Unavailable(format!("{}: {e}", cfg.url)))?;
            if pong != "PONG" {
                return Err(StorageError::Unavailable(format!(
                    "{}: PING answered {pong}",
                    cfg.url
                )));
            }
            Ok(conn)
        })?;
        Ok(RedisStorage {
            rt,
            conn,
            prefix: format!(
                "strata:v2:{}:{}:",
                cfg.namespace,
                strata_kv::auth::hex(
                    &blake3::derive_key("strata redis key tag", &cfg.page_key.0)[..6]
                )
            ),
            ttl: cfg.ttl,
            timeout,
            key: cfg.page_key,
            max_value: cfg.max_value_bytes,
            stats: Mutex::new(StorageStats::default()),
        })
    }

    /// The Redis key of a page.
    pub fn key_of(&self, h: &PageHash) -> String {
        self.key(h)
    }

    fn key(&self, h: &PageHash) -> String {
        format!("{}{}", self.prefix, h.to_hex())
    }

    fn count(&self, f: impl FnOnce(&mut StorageStats)) {
        f(&mut self.stats.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Runs one pipeline within the timeout; failures are counted.
    fn run<T: redis::FromRedisValue + Send + 'static>(
        &self,
        p: redis::Pipeline,
    ) -> Result<T, StorageError> {
        let mut conn = self.conn.clone();
        let timeout = self.timeout;
        let r = self.rt.block_on(async move {
            match tokio::time::timeout(timeout, p.query_async::<T>(&mut conn)).await {
                Err(_) => Err(StorageError::Timeout(timeout)),
                Ok(r) => r.map_err(unavailable),
            }
        });
        if let Err(e) = &r {
            self.count(|s| {
                s.errors += 1;
                if matches!(e, StorageError::Timeout(_)) {
                    s.timeouts += 1;
                }
            });
        }
        r
    }

    fn set_pipe(&self, pages: &[(PageHash, &[u8])]) -> redis::Pipeline {
        let mut p = redis::pipe();
        for (h, d) in pages {
            let v = blob::encode(&self.key, h, d);
            match self.ttl {
                Some(t) => p
                    .cmd("SET")
                    .arg(self.key(h))
                    .arg(v)
                    .arg("PX")
                    .arg(t.as_millis() as u64),
                None => p.cmd("SET").arg(self.key(h)).arg(v),
            };
            p.ignore();
        }
        p
    }
}

impl Storage for RedisStorage {
    fn tier(&self) -> &'static str {
        "remote"
    }

    fn exists(&self, hashes: &[PageHash]) -> Result<Vec<bool>, StorageError> {
        if hashes.is_empty() {
            return Ok(Vec::new());
        }
        let mut p = redis::pipe();
        for h in hashes {
            p.cmd("EXISTS").arg(self.key(h));
        }
        let v: Vec<i64> = self.run(p)?;
        Ok(v.into_iter().map(|x| x > 0).collect())
    }

    fn get(&self, hash: &PageHash) -> Result<Option<Vec<u8>>, StorageError> {
        self.get_many(std::slice::from_ref(hash)).remove(0)
    }

    fn get_many(&self, hashes: &[PageHash]) -> Vec<Result<Option<Vec<u8>>, StorageError>> {
        if hashes.is_empty() {
            return Vec::new();
        }
        let mut p = redis::pipe();
        let cmd = p.cmd("EVAL").arg(GET_SCRIPT).arg(hashes.len());
        for h in hashes {
            cmd.arg(self.key(h));
        }
        cmd.arg(self.max_value);
        let vals: Vec<redis::Value> = match self.run(p) {
            Ok(v) => v,
            Err(e) => {
                let msg = e.to_string();
                return hashes
                    .iter()
                    .map(|_| Err(StorageError::Unavailable(msg.clone())))
                    .collect();
            }
        };
        let Some(redis::Value::Array(vals)) = vals.into_iter().next() else {
            return hashes
                .iter()
                .map(|_| {
                    Err(StorageError::Unavailable(
                        "unexpected answer to the read script".into(),
                    ))
                })
                .collect();
        };
        let mut bad = Vec::new();
        let out = hashes
            .iter()
            .zip(vals.into_iter().chain(std::iter::repeat(redis::Value::Nil)))
            .map(|(h, v)| {
                self.count(|s| s.gets += 1);
                match v {
                    redis::Value::BulkString(bytes) => match blob::decode(&self.key, h, &bytes) {
                        Some(payload) => {
                            self.count(|s| s.hits += 1);
                            Ok(Some(payload))
                        }
                        None => {
                            self.count(|s| s.corrupt += 1);
                            bad.push(*h);
                            Ok(None)
                        }
                    },
                    // Not a string, or too big: deleted by the script already.
                    redis::Value::Int(_) => {
                        self.count(|s| s.corrupt += 1);
                        Ok(None)
                    }
                    _ => Ok(None),
                }
            })
            .collect();
        if !bad.is_empty() {
            tracing::warn!(
                pages = bad.len(),
                "corrupt or foreign L3 values dropped from Redis"
            );
            let mut p = redis::pipe();
            for h in &bad {
                p.cmd("DEL").arg(self.key(h)).ignore();
            }
            let _ = self.run::<()>(p);
        }
        out
    }

    fn put(&self, hash: &PageHash, data: &[u8]) -> Result<(), StorageError> {
        self.count(|s| s.puts += 1);
        self.run::<()>(self.set_pipe(&[(*hash, data)]))
    }

    fn put_many(&self, pages: &[(PageHash, Vec<u8>)]) -> Vec<Result<(), StorageError>> {
        self.count(|s| s.puts += pages.len() as u64);
        let refs: Vec<(PageHash, &[u8])> = pages.iter().map(|(h, d)| (*h, d.as_slice())).collect();
        match self.run::<()>(self.set_pipe(&refs)) {
            Ok(()) => pages.iter().map(|_| Ok(())).collect(),
            Err(e) => {
                let msg = e.to_string();
                pages
                    .iter()
                    .map(|_| Err(StorageError::Unavailable(msg.clone())))
                    .collect()
            }
        }
    }

    fn delete(&self, hash: &PageHash) -> Result<bool, StorageError> {
        let mut p = redis::pipe();
        p.cmd("DEL").arg(self.key(hash));
        let v: Vec<i64> = self.run(p)?;
        Ok(v.first().copied().unwrap_or(0) > 0)
    }

    fn stats(&self) -> StorageStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }
}
