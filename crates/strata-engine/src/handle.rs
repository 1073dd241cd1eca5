//! The engine's thread-safe front: submit with admission control, flush, snapshots, shutdown.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Sender};
use strata_kv::stats::{CacheStats, PoolUsage, TierUsage};
use strata_kv::storage::StorageStats;
use strata_kv::{CacheEvent, PrefetchPolicy, TieredCache};
use strata_model::Model;
use tokio::sync::mpsc::unbounded_channel;

use crate::request::{
    EngineHealth, FlushScope, ImportedKv, RequestStream, SamplingParams, SubmitError,
    MAX_STOP_TOKEN_IDS,
};
use crate::scheduler::{Cmd, NewReq, Scheduler};

/// Scheduling limits.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Tokens per model call: one per decoding request, the rest for prefill chunks.
    pub max_batch_tokens: usize,
    /// Requests computing at once (prefill or decode).
    pub max_running: usize,
    /// Requests waiting for admission; beyond it submissions are refused (HTTP 429).
    pub max_waiting: usize,
    /// Prompt + max_tokens summed over accepted, unfinished requests; beyond it submissions
    /// are refused. 0: four times the device pool's tokens.
    pub max_tokens_in_flight: usize,
    /// Token ids that end generation (the model's end-of-sequence tokens).
    pub stop_token_ids: Vec<u32>,
    /// The model's id (as in the cache's page hashes), stated at KV-transfer handshakes.
    pub model_id: String,
    pub prefetch: PrefetchPolicy,
    /// Reuse cached prefixes. `false` (a baseline for benchmarks): every prompt is computed in
    /// full and nothing joins the tree; hits stay zero and misses count every prompt token.
    pub prefix_cache: bool,
    /// A request still waiting for admission after this long is answered
    /// [`crate::FinishReason::QueueTimeout`] (None: it waits as long as it takes).
    pub max_queue_time: Option<Duration>,
    /// The scheduler counts as stalled when one pass of its loop takes longer than this.
    pub stall_after: Duration,
    /// Test hook (fault injection): the scheduler thread panics when it receives a prompt that
    /// starts with this token id. Never set in production; it exists so that tests can check
    /// what a dead engine does to `/health` and to a supervisor.
    pub fault_panic_token: Option<u32>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_batch_tokens: 512,
            max_running: 32,
            max_waiting: 128,
            max_tokens_in_flight: 0,
            stop_token_ids: Vec::new(),
            model_id: String::new(),
            prefetch: PrefetchPolicy::WaitComplete,
            prefix_cache: true,
            max_queue_time: None,
            stall_after: Duration::from_secs(60),
            fault_panic_token: None,
        }
    }
}

/// Requests ended, by outcome.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Finished {
    pub stop: u64,
    pub length: u64,
    pub cancelled: u64,
    pub aborted: u64,
    pub error: u64,
    /// Waited longer than `max_queue_time` for admission.
    pub queue_timeout: u64,
}

/// The engine's state for metrics and tests, refreshed after every step.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub cache: CacheStats,
    pub storage: Option<StorageStats>,
    pub device: TierUsage,
    pub host: TierUsage,
    pub pools: Vec<PoolUsage>,
    /// Device pages held by requests (not in the tree): their own pages.
    pub device_pages_held: u64,
    pub waiting: usize,
    /// Requests admitted and not finished (including those waiting for load-back/prefetch).
    pub running: usize,
    pub tokens_in_flight: usize,
    /// Cache copies (load-backs, backups, L3 reads and writes) not yet landed.
    pub copies_in_flight: usize,
    pub steps: u64,
    /// Prompt tokens of admitted requests, and how each was served: from a cache tier,
    /// computed, or transferred (`cached_* + computed + transferred == prompt`, always).
    pub prompt_tokens: u64,
    pub cached_device_tokens: u64,
    pub cached_host_tokens: u64,
    pub cached_storage_tokens: u64,
    pub computed_prompt_tokens: u64,
    /// Prompt tokens whose K/V arrived from a prefill worker.
    pub transferred_prompt_tokens: u64,
    pub generated_tokens: u64,
    pub finished: Finished,
}

/// Limits and shapes callers need before submitting.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub context_length: usize,
    pub vocab: usize,
    pub page_size: usize,
    /// Bytes of one page in the host layout (what a KV transfer carries).
    pub page_bytes: usize,
    /// The page layout in words (compared at KV-transfer handshakes).
    pub layout: String,
    /// The model id of page hashes.
    pub model_id: String,
    /// Key of the page-hash namespace (None: the cache computes no hashes).
    pub hash_key: Option<[u8; 32]>,
    /// Tokens the device pool holds.
    pub device_tokens: usize,
    pub max_waiting: usize,
    pub max_tokens_in_flight: usize,
}

/// Cache events with sequence numbers, kept in a bounded log for routers to poll.
pub struct EventLog {
    /// Differs on every start: a router that sees a new epoch resynchronises.
    pub epoch: u64,
    /// Sequence number of the oldest event still held.
    pub first: u64,
    /// Sequence number the next event will get.
    pub next: u64,
    items: std::collections::VecDeque<CacheEvent>,
    cap: usize,
}

impl EventLog {
    fn new(cap: usize) -> EventLog {
        let epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
            ^ ((std::process::id() as u64) << 40);
        EventLog {
            epoch,
            first: 0,
            next: 0,
            items: std::collections::VecDeque::new(),
            cap,
        }
    }

    pub(crate) fn push(&mut self, e: CacheEvent) {
        self.items.push_back(e);
        self.next += 1;
        while self.items.len() > self.cap {
            self.items.pop_front();
            self.first += 1;
        }
    }

    /// Events from `since` on (at most `max`); None when `since` is older than the log holds
    /// (a gap: resynchronise from a snapshot).
    pub fn since(&self, since: u64, max: usize) -> Option<Vec<(u64, CacheEvent)>> {
        if since < self.first || since > self.next {
            return None;
        }
        let skip = (since - self.first) as usize;
        Some(
            self.items
                .iter()
                .skip(skip)
                .take(max)
                .enumerate()
                .map(|(i, e)| (since + i as u64, e.clone()))
                .collect(),
        )
    }
}

/// An answer to [`EngineHandle::events_since`].
pub struct EventsPage {
    pub epoch: u64,
    /// Oldest sequence number held.
    pub first: u64,
    /// Sequence number of the next event.
    pub next: u64,
    /// (sequence number, event); None when `since` fell out of the log (resynchronise).
    pub events: Option<Vec<(u64, CacheEvent)>>,
}

impl EngineInfo {
    /// What this engine states at a KV-transfer handshake.
    pub fn hello(&self) -> crate::transfer::Hello {
        crate::transfer::Hello {
            model_id: self.model_id.clone(),
            page_size: self.page_size as u32,
            page_bytes: self.page_bytes as u64,
            layout: self.layout.clone(),
        }
    }
}

pub(crate) struct Shared {
    pub events: Mutex<EventLog>,
    pub waiting: AtomicUsize,
    pub tokens_in_flight: AtomicUsize,
    pub closing: AtomicBool,
    pub next_id: AtomicU64,
    pub snapshot: Mutex<Snapshot>,
    /// Milliseconds since `epoch` at the scheduler's latest pass round its loop.
    pub beat_ms: AtomicU64,
    pub epoch: Instant,
    /// Set when the scheduler thread ended other than by shutdown: why.
    pub dead: Mutex<Option<String>>,
    /// Set when the scheduler thread has ended (unwound, if it panicked).
    pub ended: AtomicBool,
}

impl Shared {
    pub(crate) fn beat(&self) {
        self.beat_ms
            .store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}

thread_local! {
    /// The engine whose scheduler runs on this thread (set on scheduler threads only).
    static SCHEDULER: std::cell::RefCell<Option<Arc<Shared>>> = const { std::cell::RefCell::new(None) };
}

/// Installs (once per process) a panic hook that marks the panicking scheduler's engine dead
/// before anything unwinds: before the panicking request's channel closes, so no client can
/// see its request fail while `/health` still says ok. Other threads' panics pass through to
/// the previous hook unchanged.
fn install_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let _ = SCHEDULER.try_with(|s| {
                if let Ok(s) = s.try_borrow() {
                    if let Some(shared) = s.as_ref() {
                        let msg = panic_message(info.payload());
                        let mut d = shared.dead.lock().unwrap_or_else(|p| p.into_inner());
                        if d.is_none() {
                            *d = Some(format!("the scheduler thread panicked: {msg}"));
                        }
                    }
                }
            });
            prev(info);
        }));
    });
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Starts engines.
pub struct Engine;

impl Engine {
    /// Moves the model and cache onto a new scheduler thread.
    pub fn start(model: Model, cache: TieredCache, mut cfg: EngineConfig) -> EngineHandle {
        let d = cache.device_usage();
        let device_tokens = d.pages_total as usize * cache.page_size();
        if cfg.max_tokens_in_flight == 0 {
            cfg.max_tokens_in_flight = 4 * device_tokens;
        }
        let info = EngineInfo {
            context_length: model.config.context_length,
            vocab: model.config.vocab,
            page_size: cache.page_size(),
            page_bytes: cache.layout().page_bytes(),
            layout: format!("{:?}", cache.layout().kinds()),
            model_id: cfg.model_id.clone(),
            hash_key: cache.hash_key(),
            device_tokens,
            max_waiting: cfg.max_waiting,
            max_tokens_in_flight: cfg.max_tokens_in_flight,
        };
        let shared = Arc::new(Shared {
            events: Mutex::new(EventLog::new(100_000)),
            waiting: AtomicUsize::new(0),
            tokens_in_flight: AtomicUsize::new(0),
            closing: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            snapshot: Mutex::new(Snapshot::default()),
            beat_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            dead: Mutex::new(None),
            ended: AtomicBool::new(false),
        });
        let stall_after = cfg.stall_after;
        install_panic_hook();
        let (tx, rx) = unbounded();
        let sched = Scheduler::new(model, cache, cfg, shared.clone(), rx);
        let watched = shared.clone();
        let thread = std::thread::Builder::new()
            .name("strata-scheduler".into())
            .spawn(move || {
                let shared = watched;
                SCHEDULER.with(|s| *s.borrow_mut() = Some(shared.clone()));
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sched.run()));
                if let Err(p) = r {
                    let msg = format!("the scheduler thread panicked: {}", panic_message(&*p));
                    tracing::error!(reason = %msg, "engine dead");
                    // The panic hook set it before unwinding, unless another hook replaced ours.
                    shared
                        .dead
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert(msg);
                } else if !shared.closing.load(Ordering::SeqCst) {
                    *shared.dead.lock().unwrap_or_else(|p| p.into_inner()) =
                        Some("the scheduler thread ended without a shutdown".into());
                }
                shared.ended.store(true, Ordering::SeqCst);
            })
            .expect("spawn the scheduler thread");
        EngineHandle {
            tx,
            shared,
            info: Arc::new(info),
            thread: Arc::new(Mutex::new(Some(thread))),
            stall_after,
        }
    }
}

/// Cheap to clone; every clone talks to the same scheduler.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Cmd>,
    shared: Arc<Shared>,
    info: Arc<EngineInfo>,
    thread: Arc<Mutex<Option<JoinHandle<()>>>>,
    stall_after: Duration,
}

impl EngineHandle {
    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// Whether the scheduler thread is alive and coming round its loop (it passes at least
    /// once a second while idle).
    pub fn health(&self) -> EngineHealth {
        if let Some(why) = self
            .shared
            .dead
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return EngineHealth::Dead(why);
        }
        if self.is_closing() {
            return EngineHealth::Closing;
        }
        let now = self.shared.epoch.elapsed().as_millis() as u64;
        let since =
            Duration::from_millis(now.saturating_sub(self.shared.beat_ms.load(Ordering::Relaxed)));
        if since > self.stall_after {
            return EngineHealth::Stalled(since);
        }
        EngineHealth::Alive
    }

    /// Checks and enqueues a request. Refusals are immediate: bad requests, a full queue, too
    /// many tokens in flight, shutdown.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<RequestStream, SubmitError> {
        self.submit_with(prompt, params, false, None)
    }

    /// Like [`EngineHandle::submit`]; the prompt's K/V come back as an [`crate::Event::Kv`]
    /// before `Done` (a prefill worker ships them to a decode worker).
    pub fn submit_export(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<RequestStream, SubmitError> {
        self.submit_with(prompt, params, true, None)
    }

    /// A request whose prompt K/V were computed elsewhere: they are written into this pool and
    /// generation continues after `kv.first_token` (which counts toward `max_tokens`).
    pub fn submit_prefilled(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        kv: ImportedKv,
    ) -> Result<RequestStream, SubmitError> {
        let want = prompt.len().div_ceil(self.info.page_size);
        if kv.pages.len() != want {
            return Err(SubmitError::BadKv(format!(
                "{} pages received for a {}-token prompt ({want} pages of {})",
                kv.pages.len(),
                prompt.len(),
                self.info.page_size
            )));
        }
        if let Some(p) = kv.pages.iter().find(|p| p.len() != self.info.page_bytes) {
            return Err(SubmitError::BadKv(format!(
                "a page of {} bytes, this pool's pages have {}",
                p.len(),
                self.info.page_bytes
            )));
        }
        self.submit_with(prompt, params, false, Some(kv))
    }

    fn submit_with(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        export: bool,
        import: Option<ImportedKv>,
    ) -> Result<RequestStream, SubmitError> {
        let info = &self.info;
        if prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if params.max_tokens == 0 {
            return Err(SubmitError::ZeroMaxTokens);
        }
        if let EngineHealth::Dead(why) = self.health() {
            return Err(SubmitError::EngineDead(why));
        }
        // Sizes first, so that no sum below can overflow.
        if params.max_tokens > info.context_length {
            return Err(SubmitError::MaxTokensTooLarge {
                max_tokens: params.max_tokens,
                context: info.context_length,
            });
        }
        if params.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(SubmitError::TooManyStopTokens {
                count: params.stop_token_ids.len(),
                limit: MAX_STOP_TOKEN_IDS,
            });
        }
        if let Some(&id) = params
            .stop_token_ids
            .iter()
            .find(|&&t| t as usize >= info.vocab)
        {
            return Err(SubmitError::BadStopToken {
                id,
                vocab: info.vocab,
            });
        }
        if let Some(&id) = prompt.iter().find(|&&t| t as usize >= info.vocab) {
            return Err(SubmitError::BadToken {
                id,
                vocab: info.vocab,
            });
        }
        let needed = prompt.len().saturating_add(params.max_tokens);
        if needed > info.context_length {
            return Err(SubmitError::TooLongForContext {
                prompt: prompt.len(),
                max_tokens: params.max_tokens,
                needed,
                context: info.context_length,
            });
        }
        if needed.div_ceil(info.page_size) * info.page_size > info.device_tokens {
            return Err(SubmitError::TooLongForPool {
                prompt: prompt.len(),
                max_tokens: params.max_tokens,
                needed,
                capacity: info.device_tokens,
            });
        }
        if self.shared.closing.load(Ordering::SeqCst) {
            return Err(SubmitError::ShuttingDown);
        }
        let w = self.shared.waiting.fetch_add(1, Ordering::SeqCst);
        if w >= info.max_waiting {
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull {
                limit: info.max_waiting,
            });
        }
        let before = self
            .shared
            .tokens_in_flight
            .fetch_add(needed, Ordering::SeqCst);
        // One request that fits the pool is always accepted when nothing else is in flight.
        if before > 0 && before + needed > info.max_tokens_in_flight {
            self.shared
                .tokens_in_flight
                .fetch_sub(needed, Ordering::SeqCst);
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::TooManyTokens {
                in_flight: before,
                wanted: needed,
                limit: info.max_tokens_in_flight,
            });
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::SeqCst);
        let (etx, erx) = unbounded_channel();
        let prompt_tokens = prompt.len();
        let max_tokens = params.max_tokens;
        let req = NewReq {
            id,
            prompt,
            params,
            tx: etx,
            export,
            import,
        };
        if self.tx.send(Cmd::Submit(Box::new(req))).is_err() {
            self.shared
                .tokens_in_flight
                .fetch_sub(needed, Ordering::SeqCst);
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::ShuttingDown);
        }
        Ok(RequestStream {
            id,
            prompt_tokens,
            max_tokens,
            events: erx,
        })
    }

    /// Empties the tiers in `scope` of every page no running request uses; returns the device
    /// and host pages freed. Blocks until done.
    pub fn flush(&self, scope: FlushScope) -> Option<(u64, u64)> {
        let (tx, rx) = bounded(1);
        self.tx.send(Cmd::Flush(scope, tx)).ok()?;
        rx.recv().ok()
    }

    /// Cache events from `since` (at most `max`).
    pub fn events_since(&self, since: u64, max: usize) -> EventsPage {
        let log = self.shared.events.lock().expect("event log lock");
        EventsPage {
            epoch: log.epoch,
            first: log.first,
            next: log.next,
            events: log.since(since, max),
        }
    }

    /// Every page in the device and host tiers now, and the sequence number events continue
    /// from. Blocks until the scheduler answers.
    pub fn cache_snapshot(&self) -> Option<(u64, u64, Vec<CacheEvent>)> {
        let (tx, rx) = bounded(1);
        self.tx.send(Cmd::CacheSnapshot(tx)).ok()?;
        rx.recv().ok()
    }

    /// The latest state.
    pub fn snapshot(&self) -> Snapshot {
        self.shared.snapshot.lock().expect("snapshot lock").clone()
    }

    /// True once the scheduler thread has ended (after unwinding, if it panicked).
    pub fn has_ended(&self) -> bool {
        self.shared.ended.load(Ordering::SeqCst)
    }

    /// True once [`EngineHandle::shutdown`] was called.
    pub fn is_closing(&self) -> bool {
        self.shared.closing.load(Ordering::SeqCst)
    }

    /// Stops admitting, lets running requests finish until `grace` has passed, aborts the
    /// rest, waits for copies in flight and joins the scheduler thread.
    pub fn shutdown(&self, grace: Duration) {
        self.shared.closing.store(true, Ordering::SeqCst);
        let _ = self.tx.send(Cmd::Shutdown {
            deadline: Instant::now() + grace,
        });
        let t = self.thread.lock().expect("thread lock").take();
        if let Some(t) = t {
            let _ = t.join();
        }
    }
}
