//! The router's exact index of which worker holds which pages in which tier, fed by the
//! workers' cache events (`GET /cache/events`, resynchronised from `/cache/snapshot` on a gap or
//! a restart), and the cache-aware score of a prompt on each worker.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_kv::{HashNamespace, PageHash};
use strata_model::{ChatTemplate, ModelTokenizer};
use strata_protocol::{CacheEvents, CacheInfo, CacheSnapshot, Tier, WireEvent};
use strata_server::auth::Peers;

/// Weight of a cached page by tier: a host page must be loaded back first.
pub const DEVICE_WEIGHT: f64 = 1.0;
pub const HOST_WEIGHT: f64 = 0.6;
/// A page in the shared remote L3: reachable by every worker, but fetched over the network.
pub const REMOTE_WEIGHT: f64 = 0.3;
/// `--cache-index-memory` by default: the most heap the index's maps may take, split evenly
/// between the workers and the shared remote set (at 1 worker, 7.3 million pages each; at 4,
/// 3.7 million; at 8, 1.8 million).
pub const DEFAULT_INDEX_MEMORY: u64 = 1 << 30;
/// Largest page size a worker's `/cache/info` may report (a worker's own `--page-size` is
/// smaller: pages of more tokens would be one page of a whole prompt).
const MAX_PAGE_SIZE: usize = 1 << 16;
/// Fewest pages a worker's share must hold (else `--cache-index-memory` is refused).
pub const MIN_WORKER_PAGES: usize = 1024;

/// How many pages the index keeps: per worker (a worker that announces more is not believed
/// past it: the pages past it are not indexed) and of the shared remote L3 (Redis evicts
/// without saying so, so the set is told only of writes; when full it is forgotten and learnt
/// again from the next writes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexLimits {
    pub worker_pages: usize,
    pub remote_pages: usize,
}

/// The maps (hashbrown's, whose allocation is known: `allocation_size`).
type Pages = hashbrown::HashMap<[u8; 16], u8, std::hash::RandomState>;
type RemotePages = hashbrown::HashSet<[u8; 16], std::hash::RandomState>;

/// A worker map's entry (key and tier bits) and its control byte.
const WORKER_SLOT: u64 = std::mem::size_of::<([u8; 16], u8)>() as u64 + 1;
/// A remote set's entry and its control byte.
const REMOTE_SLOT: u64 = 16 + 1;
/// What a table takes beyond a slot's bytes (a group of control bytes, alignment).
const TABLE_EXTRA: u64 = 64;

/// The slots of a hashbrown table of `capacity` (it keeps 1 in 8 free from 8 slots up).
fn slots(capacity: usize) -> u64 {
    match capacity {
        0 => 0,
        1..8 => capacity as u64 + 1,
        c => (c as u64 * 8 / 7).next_power_of_two(),
    }
}

impl IndexLimits {
    /// The limits whose maps stay within `bytes` over `workers` workers and the remote set, at
    /// every moment. A map of at most 7/8·B entries (B a power of two) has B slots, or 2B once
    /// hashbrown grows a table full of tombstones (from there it rehashes in place). Growing
    /// holds the old table beside the new one for a moment, and the index applies one worker's
    /// answer at a time (`CacheIndex::applying`; the answers are read concurrently), so one
    /// table grows at a time: `bytes` is split into a share
    /// for each map and one more for that. None: a worker's share holds fewer than
    /// [`MIN_WORKER_PAGES`].
    pub fn within(bytes: u64, workers: usize) -> Option<IndexLimits> {
        let share = bytes / (workers as u64 + 2);
        let pages = |slot: u64| -> usize {
            match share.saturating_sub(TABLE_EXTRA) / (2 * slot) {
                0..8 => 0,
                s => (1u64 << s.ilog2()) as usize / 8 * 7,
            }
        };
        let limits = IndexLimits {
            worker_pages: pages(WORKER_SLOT),
            remote_pages: pages(REMOTE_SLOT),
        };
        (limits.worker_pages >= MIN_WORKER_PAGES).then_some(limits)
    }

    /// The most heap the maps of `workers` workers and the remote set may take: each at 2B
    /// slots, and the old half of one growing table.
    pub fn bytes(&self, workers: usize) -> u64 {
        let table = |pages: usize, slot: u64| 2 * slots(pages) * slot + TABLE_EXTRA;
        let worker = table(self.worker_pages, WORKER_SLOT);
        let remote = table(self.remote_pages, REMOTE_SLOT);
        worker * workers as u64 + remote + worker.max(remote) / 2
    }
}

/// Tokens of cached prefix one request in flight is worth (the load term of the score).
pub const LOAD_TOKENS: f64 = 256.0;

/// What the index holds and may hold (`strata_router_index_*` on `/metrics`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Footprint {
    pub pages: usize,
    pub bytes: u64,
    pub limit_bytes: u64,
    pub unindexed: u64,
}

#[derive(Default)]
struct WorkerIndex {
    epoch: u64,
    next: u64,
    synced: bool,
    /// bit 0: device, bit 1: host.
    pages: Pages,
    resyncs: u64,
    /// Pages announced past [`IndexLimits::worker_pages`], not indexed.
    unindexed: u64,
    /// Its `/cache/info` names another namespace than the index's: not indexed (said once).
    foreign: bool,
    /// When its last snapshot was read, and how long the next asked-for resync waits: a
    /// worker that asks for one on every poll (a snapshot of hundreds of MB each time) would
    /// keep a router core busy and hold up the other workers' polls.
    last_resync: Option<std::time::Instant>,
    resync_wait: Duration,
    /// "More pages than the index keeps" was said for this worker (once, not per resync).
    said_full: bool,
}

/// The wait before a worker's next asked-for resync, after one at `now` that followed the one
/// before at `prev`: none when they were apart, else doubling from 1 s to a minute while they
/// keep coming within [`RESYNC_CALM`].
fn next_resync_wait(
    prev: Option<std::time::Instant>,
    wait: Duration,
    now: std::time::Instant,
) -> Duration {
    match prev {
        Some(p) if now.duration_since(p) < RESYNC_CALM + wait => {
            (wait * 2).clamp(Duration::from_secs(1), Duration::from_secs(60))
        }
        _ => Duration::ZERO,
    }
}

/// Resyncs further apart than this (beyond the wait) are normal: a worker restarted.
const RESYNC_CALM: Duration = Duration::from_secs(10);

/// Tokenizer + namespace + per-worker indexes.
pub struct CacheIndex {
    tokenizer: Arc<ModelTokenizer>,
    template: Option<ChatTemplate>,
    ns: Mutex<Option<(HashNamespace, usize)>>,
    workers: Vec<Mutex<WorkerIndex>>,
    /// Pages any worker wrote to the shared remote L3 (hints: Redis evicts silently).
    remote: Mutex<RemotePages>,
    limits: IndexLimits,
    /// Held while a worker's answer is applied: the workers are polled concurrently (a slow
    /// one holds up no other), their answers applied one at a time, so at most one map grows
    /// at a moment ([`IndexLimits::within`]).
    applying: Mutex<()>,
}

impl CacheIndex {
    /// The index of `workers` workers within `limits` (e.g. [`IndexLimits::within`]).
    pub fn new(
        tokenizer: Arc<ModelTokenizer>,
        template: Option<ChatTemplate>,
        workers: usize,
        limits: IndexLimits,
    ) -> CacheIndex {
        CacheIndex {
            tokenizer,
            template,
            ns: Mutex::new(None),
            workers: (0..workers)
                .map(|_| Mutex::new(WorkerIndex::default()))
                .collect(),
            remote: Mutex::new(RemotePages::default()),
            limits,
            applying: Mutex::new(()),
        }
    }

    /// Prompt tokens of a request body, as the worker will see them (None: not parseable).
    pub fn prompt_tokens(&self, body: &[u8]) -> Option<Vec<u32>> {
        // Built exactly as the worker builds it (`strata_server::prompt`), from the same typed request.
        let v: serde_json::Value = serde_json::from_slice(body).ok()?;
        if v.get("messages").is_some() {
            let req: strata_server::api::ChatRequest = serde_json::from_value(v).ok()?;
            let tools = strata_server::tools::tools_of(&req).ok()?;
            let shown = strata_server::prompt::Shown::of(
                tools.as_ref().map(|t| t.shown()),
                req.response_format.as_ref(),
            );
            strata_server::prompt::chat_ids(
                &self.tokenizer,
                self.template.as_ref(),
                &req.messages,
                shown.as_ref(),
            )
            .ok()
        } else {
            let req: strata_server::api::CompletionRequest = serde_json::from_value(v).ok()?;
            strata_server::prompt::completion_ids(&self.tokenizer, &req.prompt).ok()
        }
    }

    /// Chained page hashes of whole pages of `tokens` (empty until a worker told the namespace).
    pub fn hashes(&self, tokens: &[u32]) -> Vec<PageHash> {
        match self.ns() {
            Some((ns, ps)) => ns.chain(PageHash::ROOT, tokens, ps),
            None => Vec::new(),
        }
    }

    /// The page-hash namespace and page size the workers told, if one has.
    fn ns(&self) -> Option<(HashNamespace, usize)> {
        self.ns.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// A worker's `/cache/info`: a page size in range, and the namespace every other worker
    /// has (the first to answer sets it). A worker of another namespace (another model, page
    /// size or layout, or one that lies) is not indexed: its events would never match a
    /// prompt, or match what they should not. Said once in the log per worker until it agrees.
    fn check_namespace(&self, w: usize, url: &str, info: &CacheInfo) -> Result<(), String> {
        let hash_key = info.hash_key.ok_or("the worker computes no page hashes")?;
        if !(1..=MAX_PAGE_SIZE).contains(&info.page_size) {
            return Err(format!(
                "page size {} (expected 1 to {MAX_PAGE_SIZE})",
                info.page_size
            ));
        }
        let mut ns = self.ns.lock().unwrap_or_else(|p| p.into_inner());
        let same = match &*ns {
            None => {
                *ns = Some((HashNamespace::from_key(hash_key.0), info.page_size));
                true
            }
            Some((have, ps)) => have.key() == hash_key.0 && *ps == info.page_size,
        };
        drop(ns);
        let mut i = self.workers[w].lock().expect("index lock");
        if same {
            i.foreign = false;
            return Ok(());
        }
        if !i.foreign {
            tracing::warn!(worker = %url, page_size = info.page_size, "a worker's page hashes are of another namespace than the first worker's (another model, page size or K/V layout): its cache is not indexed");
        }
        i.foreign = true;
        Err("another page-hash namespace".into())
    }

    pub fn page_size(&self) -> usize {
        self.ns().map_or(0, |x| x.1)
    }

    /// (device, host, remote) pages of the prefix of `hashes` worker `w` can use, page by page
    /// from the start: its own tiers first, then the shared remote L3.
    pub fn cached_prefix(&self, w: usize, hashes: &[PageHash]) -> (usize, usize, usize) {
        let Some(idx) = self.workers.get(w) else {
            return (0, 0, 0);
        };
        let idx = idx.lock().expect("index lock");
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

    /// Pages indexed (over every worker and the remote set), the heap bytes their maps take
    /// (their tables' allocations), the most they may take, and the announcements of pages
    /// past a worker's limit (not indexed; a page per tier).
    pub fn footprint(&self) -> Footprint {
        let mut f = Footprint {
            limit_bytes: self.limits.bytes(self.workers.len()),
            ..Footprint::default()
        };
        for w in &self.workers {
            let i = w.lock().expect("index lock");
            f.pages += i.pages.len();
            f.bytes += i.pages.allocation_size() as u64;
            f.unindexed += i.unindexed;
        }
        let r = self.remote.lock().expect("remote lock");
        f.pages += r.len();
        f.bytes += r.allocation_size() as u64;
        f
    }

    /// Resynchronisations so far (gaps, restarts).
    pub fn resyncs(&self) -> u64 {
        self.workers
            .iter()
            .map(|w| w.lock().expect("index lock").resyncs)
            .sum()
    }

    fn apply(&self, w: usize, e: &WireEvent) {
        if e.tier == Tier::Remote {
            let mut r = self.remote.lock().expect("remote lock");
            for h in &e.hashes {
                if e.stored {
                    if r.len() >= self.limits.remote_pages {
                        r.clear();
                    }
                    r.insert(h.0);
                } else {
                    r.remove(&h.0);
                }
            }
            return;
        }
        let bit = if e.tier == Tier::Device { 1u8 } else { 2u8 };
        let mut idx = self.workers[w].lock().expect("index lock");
        for h in &e.hashes {
            if e.stored {
                let full = idx.pages.len() >= self.limits.worker_pages;
                match idx.pages.get_mut(&h.0) {
                    Some(b) => *b |= bit,
                    None if !full => {
                        idx.pages.insert(h.0, bit);
                    }
                    None => {
                        if !idx.said_full {
                            tracing::warn!(worker = w, max = self.limits.worker_pages, "a worker announces more cached pages than the index keeps (--cache-index-memory): the rest are not indexed");
                            idx.said_full = true;
                        }
                        idx.unindexed += 1;
                    }
                }
            } else if let Some(b) = idx.pages.get_mut(&h.0) {
                *b &= !bit;
                if *b == 0 {
                    idx.pages.remove(&h.0);
                }
            }
        }
    }

    /// One poll of worker `w` at `url`: learn the namespace, follow events, resync on a gap.
    /// The worker's answers are typed (`strata_protocol`): a malformed one is an error, never
    /// read with defaults.
    pub async fn poll(
        &self,
        client: &reqwest::Client,
        key: Option<(&strata_kv::auth::ClusterKey, &Peers)>,
        w: usize,
        url: &str,
    ) -> Result<(), String> {
        if w >= self.workers.len() {
            return Err(format!("the index has {} places", self.workers.len()));
        }
        let (since, epoch, synced) = {
            let i = self.workers[w].lock().expect("index lock");
            (i.next, i.epoch, i.synced)
        };
        if !synced || self.ns().is_none() {
            let info: CacheInfo = get(client, key, url, "/cache/info").await?;
            self.check_namespace(w, url, &info)?;
        }
        let ev: CacheEvents =
            get(client, key, url, &format!("/cache/events?since={since}")).await?;
        if !synced || ev.epoch != epoch || ev.resync {
            let now = std::time::Instant::now();
            {
                // A worker asking again soon after the last one waits (its index as it was).
                let i = self.workers[w].lock().expect("index lock");
                if synced && i.last_resync.is_some_and(|t| now < t + i.resync_wait) {
                    return Ok(());
                }
            }
            let snap: CacheSnapshot = get(client, key, url, "/cache/snapshot").await?;
            let one = self.applying();
            {
                let mut i = self.workers[w].lock().expect("index lock");
                i.pages.clear();
                i.unindexed = 0;
                i.epoch = snap.epoch;
                i.next = snap.next;
                i.synced = true;
                i.resyncs += 1;
                i.resync_wait = next_resync_wait(i.last_resync, i.resync_wait, now);
                i.last_resync = Some(now);
            }
            for t in &snap.tiers {
                self.apply(w, t);
            }
            drop(one);
            // Remote writes are not in snapshots (L3 is not indexed by the tree): take them
            // from the events the worker still holds.
            let path = format!("/cache/events?since={}", ev.first);
            if let Ok(all) = get::<CacheEvents>(client, key, url, &path).await {
                let _one = self.applying();
                for e in all.events.iter().filter(|e| e.tier == Tier::Remote) {
                    self.apply(w, e);
                }
            }
            return Ok(());
        }
        let _one = self.applying();
        for e in &ev.events {
            self.apply(w, e);
        }
        self.workers[w].lock().expect("index lock").next = ev.next;
        Ok(())
    }

    /// The right to apply a worker's answer (one at a time; see `applying`).
    fn applying(&self) -> std::sync::MutexGuard<'_, ()> {
        self.applying.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A typed GET of a worker's cache endpoint (signed with the cluster key when there is one, for
/// the worker's instance as `peers` knows it).
async fn get<T: serde::de::DeserializeOwned>(
    client: &reqwest::Client,
    key: Option<(&strata_kv::auth::ClusterKey, &Peers)>,
    url: &str,
    path: &str,
) -> Result<T, String> {
    let build = || {
        client
            .get(format!("{url}{path}"))
            .timeout(Duration::from_secs(5))
    };
    let call = strata_server::auth::Call {
        method: "GET",
        target: path,
        body: b"",
        prefill: None,
    };
    let sent = match key {
        Some((k, peers)) => strata_server::auth::send(peers, Some(k), url, &call, build).await,
        None => build().send().await,
    };
    let r = sent
        .map_err(|e| e.to_string())?
        .error_for_status()
        .map_err(|e| e.to_string())?;
    // A snapshot of a large host tier is megabytes; a worker's answer is still bounded.
    let (idle, total) = (Duration::from_secs(5), Duration::from_secs(60));
    let body = crate::upstream::body_within(r, crate::upstream::MAX_ANSWER_BYTES, idle, total)
        .await
        .map_err(|e| format!("{path}: {e}"))?;
    serde_json::from_slice::<T>(&body).map_err(|e| format!("{path}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_protocol::Hex;

    fn event(tier: Tier, stored: bool, from: u32, n: u32) -> WireEvent {
        let hashes = (from..from + n)
            .map(|i| {
                let mut h = [0u8; 16];
                h[..4].copy_from_slice(&i.to_le_bytes());
                Hex(h)
            })
            .collect();
        WireEvent {
            seq: None,
            stored,
            tier,
            hashes,
        }
    }

    /// A worker that announces more pages than its cap is not believed past it, and the
    /// remote hints, which only grow, start over when full.
    fn tokenizer() -> Arc<ModelTokenizer> {
        let d = tempfile::tempdir().unwrap();
        let g = strata_model::Gguf::open(&strata_test_support::tiny_model(d.path())).unwrap();
        Arc::new(ModelTokenizer::from_gguf(&g).unwrap())
    }

    #[test]
    fn the_index_is_bounded() {
        let tk = tokenizer();
        let limits = IndexLimits {
            worker_pages: 100,
            remote_pages: 50,
        };
        let idx = CacheIndex::new(tk, None, 1, limits);
        idx.apply(0, &event(Tier::Device, true, 0, 150));
        idx.apply(0, &event(Tier::Host, true, 0, 150));
        let i = idx.workers[0].lock().unwrap();
        assert_eq!((i.pages.len(), i.unindexed), (100, 100));
        assert!(
            i.pages.values().all(|&b| b == 3),
            "pages indexed take both tiers"
        );
        drop(i);
        idx.apply(0, &event(Tier::Remote, true, 0, 70));
        assert_eq!(idx.remote.lock().unwrap().len(), 20);
        let f = idx.footprint();
        assert_eq!((f.pages, f.unindexed), (120, 100));
        assert!(f.bytes <= f.limit_bytes, "{f:?}");
    }

    /// A worker's `/cache/info` with a page size out of range is refused (a page size of 0
    /// divided by zero, under the namespace lock, at every pick); one of another namespace than
    /// the first worker's is not indexed; the first sets it; hashing stays sane.
    #[test]
    fn a_worker_of_no_or_another_namespace_is_not_indexed() {
        let limits = IndexLimits {
            worker_pages: 100,
            remote_pages: 50,
        };
        let idx = CacheIndex::new(tokenizer(), None, 2, limits);
        let info = |page_size: usize, key: u8| CacheInfo {
            model_id: "m".into(),
            page_size,
            hash_key: Some(Hex([key; 32])),
            epoch: 1,
            next: 0,
        };
        for ps in [0, (1 << 16) + 1, usize::MAX] {
            let e = idx
                .check_namespace(0, "http://w0", &info(ps, 1))
                .unwrap_err();
            assert!(e.contains("page size"), "{e}");
        }
        assert!(idx.hashes(&[1, 2, 3, 4]).is_empty(), "no namespace yet");
        idx.check_namespace(0, "http://w0", &info(2, 1)).unwrap();
        assert_eq!(idx.hashes(&[1, 2, 3, 4, 5]).len(), 2);
        for other in [info(2, 9), info(4, 1)] {
            assert!(idx.check_namespace(1, "http://w1", &other).is_err());
            assert!(idx.workers[1].lock().unwrap().foreign);
        }
        idx.check_namespace(1, "http://w1", &info(2, 1)).unwrap();
        assert!(!idx.workers[1].lock().unwrap().foreign);
        assert_eq!(idx.page_size(), 2);
    }

    /// Resyncs a worker asks for back to back wait 1 s, doubling to a minute; one well apart
    /// from the last (a restart) waits nothing.
    #[test]
    fn resyncs_asked_back_to_back_back_off() {
        let t0 = std::time::Instant::now();
        let s = Duration::from_secs;
        assert_eq!(next_resync_wait(None, Duration::ZERO, t0), Duration::ZERO);
        let mut wait = Duration::ZERO;
        let mut at = t0;
        let mut prev = None;
        for want in [0, 1, 2, 4, 8, 16, 32, 60, 60] {
            wait = next_resync_wait(prev, wait, at);
            assert_eq!(wait, s(want));
            prev = Some(at);
            at += wait + s(2);
        }
        assert_eq!(next_resync_wait(prev, wait, at + s(71)), Duration::ZERO);
    }

    /// Maps filled to their limits, and churned (removals leave tombstones that make
    /// hashbrown grow a table whose entries are fewer than its capacity), stay within the
    /// memory the limits were derived from.
    #[test]
    fn limits_keep_the_maps_within_their_memory() {
        assert_eq!(IndexLimits::within(1 << 20, 64), None, "16 KiB a worker");
        for (bytes, workers) in [(1u64 << 30, 1), (1 << 30, 4), (1 << 30, 8), (24 << 20, 3)] {
            let l = IndexLimits::within(bytes, workers).unwrap();
            assert!(
                l.bytes(workers) <= bytes,
                "{l:?} over {bytes} for {workers}"
            );
            assert!(
                l.bytes(workers) > bytes / 4,
                "{l:?} wastes {bytes} for {workers}"
            );
        }
        let l = IndexLimits::within(1 << 30, 1).unwrap();
        assert_eq!(l.worker_pages, 7 << 20, "7.3 million pages");
        // A small index, filled by events, then churned: a quarter of its pages removed and
        // new ones stored up to the limit, round after round. Tombstones use up the table's
        // empty slots until hashbrown grows it with fewer entries than its limit; the remote
        // set fills and starts over. Measured by the tables' allocations.
        let small = IndexLimits::within(4 << 20, 1).unwrap();
        let idx = CacheIndex::new(tokenizer(), None, 1, small);
        let table = |slot: u64| 2 * slots(small.worker_pages) * slot + TABLE_EXTRA;
        let (mut most, mut next) = (0u64, 0u32);
        for _ in 0..12 {
            let held = idx.workers[0].lock().unwrap().pages.len() as u32;
            let n = small.worker_pages as u32 - held;
            idx.apply(0, &event(Tier::Device, true, next, n));
            idx.apply(0, &event(Tier::Remote, true, next, n));
            most = most.max(idx.workers[0].lock().unwrap().pages.allocation_size() as u64);
            next += n;
            // Every fourth page stored so far (some already gone).
            for p in (0..next).step_by(4) {
                idx.apply(0, &event(Tier::Device, false, p, 1));
            }
        }
        let f = idx.footprint();
        assert_eq!(f.unindexed, 0);
        assert!(f.bytes <= f.limit_bytes, "{f:?}");
        assert!(
            most <= table(WORKER_SLOT),
            "{most} bytes, bound {}",
            table(WORKER_SLOT)
        );
        assert!(
            most > table(WORKER_SLOT) / 2,
            "the churn never grew the table past B slots ({most} bytes): the test shows nothing"
        );
    }
}
