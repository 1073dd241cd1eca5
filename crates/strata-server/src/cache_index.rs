//! The router's exact index of which worker holds which pages in which tier, fed by the
//! workers' cache events (`GET /cache/events`, resynchronised from `/cache/snapshot` on a gap or
//! a restart), and the cache-aware score of a prompt on each worker.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use strata_kv::{HashNamespace, PageHash};
use strata_model::{ChatTemplate, Message, ModelTokenizer};

/// Weight of a cached page by tier: a host page must be loaded back first.
pub const DEVICE_WEIGHT: f64 = 1.0;
pub const HOST_WEIGHT: f64 = 0.6;
/// A page in the shared remote L3: reachable by every worker, but fetched over the network.
pub const REMOTE_WEIGHT: f64 = 0.3;
/// Tokens of cached prefix one request in flight is worth (the load term of the score).
pub const LOAD_TOKENS: f64 = 256.0;

#[derive(Default)]
struct WorkerIndex {
    epoch: u64,
    next: u64,
    synced: bool,
    /// bit 0: device, bit 1: host.
    pages: HashMap<[u8; 16], u8>,
    resyncs: u64,
}

/// Tokenizer + namespace + per-worker indexes.
pub struct CacheIndex {
    tokenizer: Arc<ModelTokenizer>,
    template: Option<ChatTemplate>,
    ns: Mutex<Option<(HashNamespace, usize)>>,
    workers: Vec<Mutex<WorkerIndex>>,
    /// Pages any worker wrote to the shared remote L3 (hints: Redis evicts silently).
    remote: Mutex<std::collections::HashSet<[u8; 16]>>,
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

impl CacheIndex {
    pub fn new(
        tokenizer: Arc<ModelTokenizer>,
        template: Option<ChatTemplate>,
        workers: usize,
    ) -> CacheIndex {
        CacheIndex {
            tokenizer,
            template,
            ns: Mutex::new(None),
            workers: (0..workers)
                .map(|_| Mutex::new(WorkerIndex::default()))
                .collect(),
            remote: Mutex::new(std::collections::HashSet::new()),
        }
    }

    /// Prompt tokens of a request body, as the worker will see them (None: not parseable).
    pub fn prompt_tokens(&self, body: &[u8]) -> Option<Vec<u32>> {
        let v: Value = serde_json::from_slice(body).ok()?;
        if let Some(msgs) = v.get("messages").and_then(Value::as_array) {
            let tpl = self.template.as_ref()?;
            let mut out = Vec::new();
            for m in msgs {
                let role = m.get("role")?.as_str()?;
                let role = if role == "developer" { "system" } else { role };
                let content = match m.get("content") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts
                        .iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .collect(),
                    _ => String::new(),
                };
                out.push(Message::new(role, &content));
            }
            let text = tpl.render(&out, true).ok()?;
            return self.tokenizer.encode(&text).ok();
        }
        match v.get("prompt")? {
            Value::String(s) => self.tokenizer.encode(s).ok(),
            Value::Array(a) if a.len() == 1 && a[0].is_string() => {
                self.tokenizer.encode(a[0].as_str()?).ok()
            }
            Value::Array(a) => a.iter().map(|x| x.as_u64().map(|t| t as u32)).collect(),
            _ => None,
        }
    }

    /// Chained page hashes of whole pages of `tokens` (empty until a worker told the namespace).
    pub fn hashes(&self, tokens: &[u32]) -> Vec<PageHash> {
        match &*self.ns.lock().expect("ns lock") {
            Some((ns, ps)) => ns.chain(PageHash::ROOT, tokens, *ps),
            None => Vec::new(),
        }
    }

    pub fn page_size(&self) -> usize {
        self.ns
            .lock()
            .expect("ns lock")
            .as_ref()
            .map(|x| x.1)
            .unwrap_or(0)
    }

    /// (device, host, remote) pages of the prefix of `hashes` worker `w` can use, page by page
    /// from the start: its own tiers first, then the shared remote L3.
    pub fn cached_prefix(&self, w: usize, hashes: &[PageHash]) -> (usize, usize, usize) {
        let idx = self.workers[w].lock().expect("index lock");
        let remote = self.remote.lock().expect("remote lock");
        let (mut dev, mut host, mut rem) = (0, 0, 0);
        for h in hashes {
            match idx.pages.get(&h.0) {
                Some(b) if b & 1 != 0 => dev += 1,
                Some(b) if b & 2 != 0 => host += 1,
                _ if remote.contains(&h.0) => rem += 1,
                _ => break,
            }
        }
        (dev, host, rem)
    }

    /// Resynchronisations so far (gaps, restarts).
    pub fn resyncs(&self) -> u64 {
        self.workers
            .iter()
            .map(|w| w.lock().expect("index lock").resyncs)
            .sum()
    }

    fn apply(&self, w: usize, tier: &str, stored: bool, hashes: &[Value]) {
        if tier == "remote" {
            let mut r = self.remote.lock().expect("remote lock");
            for h in hashes
                .iter()
                .filter_map(Value::as_str)
                .filter_map(unhex::<16>)
            {
                if stored {
                    r.insert(h);
                } else {
                    r.remove(&h);
                }
            }
            return;
        }
        let bit = if tier == "device" { 1u8 } else { 2u8 };
        let mut idx = self.workers[w].lock().expect("index lock");
        for h in hashes
            .iter()
            .filter_map(Value::as_str)
            .filter_map(unhex::<16>)
        {
            if stored {
                *idx.pages.entry(h).or_insert(0) |= bit;
            } else if let Some(b) = idx.pages.get_mut(&h) {
                *b &= !bit;
                if *b == 0 {
                    idx.pages.remove(&h);
                }
            }
        }
    }

    /// One poll of worker `w` at `url`: learn the namespace, follow events, resync on a gap.
    pub async fn poll(
        &self,
        client: &reqwest::Client,
        key: Option<&strata_kv::auth::ClusterKey>,
        w: usize,
        url: &str,
    ) -> Result<(), String> {
        let get = |path: String| async move {
            let mut req = client
                .get(format!("{url}{path}"))
                .timeout(Duration::from_secs(5));
            if let Some(k) = key {
                let call = crate::auth::Call {
                    method: "GET",
                    target: &path,
                    body: b"",
                    prefill: None,
                };
                req = req.header(crate::auth::AUTH_HEADER, crate::auth::sign(k, &call));
            }
            req.send()
                .await
                .map_err(|e| e.to_string())?
                .error_for_status()
                .map_err(|e| e.to_string())?
                .json::<Value>()
                .await
                .map_err(|e| e.to_string())
        };
        if self.ns.lock().expect("ns lock").is_none() {
            let info = get("/cache/info".into()).await?;
            let key = info["hash_key"]
                .as_str()
                .and_then(unhex::<32>)
                .ok_or("the worker computes no page hashes")?;
            let ps = info["page_size"].as_u64().ok_or("no page_size")? as usize;
            *self.ns.lock().expect("ns lock") = Some((HashNamespace::from_key(key), ps));
        }
        let (since, epoch, synced) = {
            let i = self.workers[w].lock().expect("index lock");
            (i.next, i.epoch, i.synced)
        };
        let ev = get(format!("/cache/events?since={since}")).await?;
        let new_epoch = ev["epoch"].as_u64().unwrap_or(0);
        if !synced || new_epoch != epoch || ev["resync"].as_bool().unwrap_or(false) {
            let snap = get("/cache/snapshot".into()).await?;
            {
                let mut i = self.workers[w].lock().expect("index lock");
                i.pages.clear();
                i.epoch = snap["epoch"].as_u64().unwrap_or(0);
                i.next = snap["next"].as_u64().unwrap_or(0);
                i.synced = true;
                i.resyncs += 1;
            }
            for t in snap["tiers"].as_array().into_iter().flatten() {
                let tier = t["tier"].as_str().unwrap_or("");
                self.apply(
                    w,
                    tier,
                    true,
                    t["hashes"].as_array().map(Vec::as_slice).unwrap_or(&[]),
                );
            }
            // Remote writes are not in snapshots (L3 is not indexed by the tree): take them
            // from the events the worker still holds.
            let first = ev["first"].as_u64().unwrap_or(0);
            if let Ok(all) = get(format!("/cache/events?since={first}")).await {
                for e in all["events"].as_array().into_iter().flatten() {
                    if e["tier"] == "remote" {
                        self.apply(
                            w,
                            "remote",
                            e["stored"].as_bool().unwrap_or(false),
                            e["hashes"].as_array().map(Vec::as_slice).unwrap_or(&[]),
                        );
                    }
                }
            }
            return Ok(());
        }
        for e in ev["events"].as_array().into_iter().flatten() {
            self.apply(
                w,
                e["tier"].as_str().unwrap_or(""),
                e["stored"].as_bool().unwrap_or(false),
                e["hashes"].as_array().map(Vec::as_slice).unwrap_or(&[]),
            );
        }
        self.workers[w].lock().expect("index lock").next = ev["next"].as_u64().unwrap_or(since);
        Ok(())
    }
}
