//! The engine's thread-safe front: submit with admission control, flush, snapshots, shutdown.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Sender};
use strata_kv::{CacheEvent, TieredCache};
use strata_model::Runtime;
use tokio::sync::mpsc::unbounded_channel;

use crate::constraint::panic_message;
use crate::request::{
    EngineHealth, FlushScope, ImportedKv, RequestStream, SamplingParams, SubmitError,
    MAX_STOP_TOKEN_IDS,
};
use crate::scheduler::{Cmd, NewReq, Route, Scheduler};
use crate::state::Shared;

pub use crate::config::EngineConfig;
pub use crate::state::{EventLog, Finished, Snapshot};

/// Limits and shapes callers need before submitting.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub context_length: usize,
    pub vocab: usize,
    pub page_size: usize,
    /// Bytes of one page in the host layout (what a KV transfer carries).
    pub page_bytes: usize,
    /// Bytes of a page's main part (= `page_bytes` without window kinds): a page older than
    /// the window travels without its window part.
    pub main_bytes: usize,
    /// Tokens before a continuation whose window state it reads (0 without window kinds).
    pub window_tokens: usize,
    /// The page layout in words (compared at KV-transfer handshakes).
    pub layout: String,
    /// The model id of page hashes.
    pub model_id: String,
    /// Key of the page-hash namespace (None: the cache computes no hashes).
    pub hash_key: Option<[u8; 32]>,
    /// Tokens the device pool holds (the longest request it can compute).
    pub device_tokens: usize,
    pub max_waiting: usize,
    pub max_tokens_in_flight: usize,
    /// Requests share the cached pages of their prompts (`EngineConfig::prefix_cache`).
    pub prefix_cache: bool,
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
    /// The size of a page without its window part, when it differs from a whole page's.
    pub fn main_page_bytes(&self) -> Option<u64> {
        (self.main_bytes != self.page_bytes).then_some(self.main_bytes as u64)
    }

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
            // A constraint's panic fails its request (it is caught), not the engine.
            let guest = crate::constraint::in_guest();
            let _ = SCHEDULER.try_with(|s| {
                if guest {
                    return;
                }
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

/// Starts engines.
pub struct Engine;

impl Engine {
    /// Moves the model and cache onto a new scheduler thread.
    pub fn start<M: Runtime + 'static>(
        model: M,
        cache: TieredCache,
        mut cfg: EngineConfig,
    ) -> EngineHandle {
        let model: Box<dyn Runtime> = Box::new(model);
        // A request computes into a page per page and, unless it holds its window state in a
        // ring (window checkpoints), a window page per page.
        let device_tokens = cache.request_capacity_tokens();
        if cfg.max_tokens_in_flight == 0 {
            cfg.max_tokens_in_flight = 4 * device_tokens;
        }
        let info = engine_info(&*model, &cache, &cfg, device_tokens);
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

/// What the engine tells its callers: sizes, and the page layout a KV transfer carries.
fn engine_info(
    model: &dyn Runtime,
    cache: &TieredCache,
    cfg: &EngineConfig,
    device_tokens: usize,
) -> EngineInfo {
    // Pages cross to other workers in the model's wire layout (the unsplit model's: a
    // tensor-parallel server re-shards on export and import).
    let wire = model
        .wire_kinds(cache.page_size())
        .map_err(|e| e.to_string())
        .and_then(|k| strata_kv::PageLayout::new(cache.page_size(), k).map_err(|e| e.to_string()))
        .unwrap_or_else(|e| {
            // Pages then cross in the local layout; a conversion a peer's page needs fails its
            // request (the converters check every page's size).
            tracing::error!(error = %e, "no wire layout for KV transfers: using this server's");
            cache.layout().clone()
        });
    EngineInfo {
        context_length: model.context_length(),
        vocab: model.vocab(),
        page_size: cache.page_size(),
        page_bytes: wire.page_bytes(),
        main_bytes: wire.class_bytes(strata_kv::Class::Main),
        window_tokens: wire.window_tokens(),
        layout: format!("{:?}", wire.kinds()),
        model_id: cfg.model_id.clone(),
        hash_key: cache.hash_key(),
        device_tokens,
        max_waiting: cfg.max_waiting,
        max_tokens_in_flight: cfg.max_tokens_in_flight,
        prefix_cache: cfg.prefix_cache,
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
        self.submit_with(prompt, params, Route::Local)
    }

    /// Like [`EngineHandle::submit`]; the prompt's K/V from page `from` on come back as
    /// [`crate::Event::Kv`] parts, as its chunks are computed, the last before `Done` (a
    /// prefill worker ships them to a decode worker, which holds the pages before).
    pub fn submit_export(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        from: usize,
    ) -> Result<RequestStream, SubmitError> {
        self.submit_with(prompt, params, Route::Export(from))
    }

    /// A request whose prompt K/V were computed elsewhere: they are written into this pool and
    /// generation continues after `kv.first_token` (which counts toward `max_tokens`).
    pub fn submit_prefilled(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        kv: ImportedKv,
    ) -> Result<RequestStream, SubmitError> {
        if kv.first_page != 0 {
            return Err(SubmitError::BadKv(
                "a prefilled request's pages start at its first".into(),
            ));
        }
        self.check_kv(prompt.len(), &kv)?;
        self.submit_with(prompt, params, Route::Import(kv))
    }

    /// A request whose prompt is computed elsewhere except for the prefix this worker's cache
    /// holds (PD with decode-side reuse): it is admitted here (its prefix matched, locked and
    /// brought onto the device, its pages reserved), then `Event::Held` says how much of the
    /// prompt the cache holds. If the rest is at most `local_tokens` and the cache holds some
    /// of the prompt, it is computed here; if the cache holds none of it, the request is
    /// handed back (its stream closes: submit it with all of its K/V,
    /// [`EngineHandle::submit_prefilled`]); otherwise it waits for the rest's K/V
    /// ([`EngineHandle::deliver`]).
    pub fn submit_remote(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        local_tokens: usize,
    ) -> Result<RequestStream, SubmitError> {
        self.submit_with(prompt, params, Route::Remote(local_tokens))
    }

    /// The K/V of a request waiting after `Event::Held { prefill: true }`: the prompt's pages
    /// from the held ones on, and the first token. A request gone meanwhile ignores them; one
    /// they do not fit ends with an error.
    pub fn deliver(&self, rs: &RequestStream, kv: ImportedKv) -> Result<(), SubmitError> {
        self.check_kv(rs.prompt_tokens, &kv)?;
        self.tx
            .send(Cmd::Deliver(rs.id, Box::new(kv)))
            .map_err(|_| SubmitError::ShuttingDown)
    }

    /// The pages of `kv` fit a prompt of `prompt_len` tokens from `kv.first_page` on, each a
    /// whole page or its main part, and those the window before the first new token reads
    /// (that the receiver does not hold) whole.
    fn check_kv(&self, prompt_len: usize, kv: &ImportedKv) -> Result<(), SubmitError> {
        let i = &self.info;
        let want = prompt_len.div_ceil(i.page_size);
        if kv.first_page >= want || kv.pages.len() != want - kv.first_page {
            return Err(SubmitError::BadKv(format!(
                "{} pages from page {} received for a {prompt_len}-token prompt ({want} pages of {})",
                kv.pages.len(),
                kv.first_page,
                i.page_size
            )));
        }
        if let Some(p) = kv
            .pages
            .iter()
            .find(|p| p.len() != i.page_bytes && p.len() != i.main_bytes)
        {
            return Err(SubmitError::BadKv(format!(
                "a page of {} bytes, this pool's pages have {}",
                p.len(),
                i.page_bytes
            )));
        }
        // The pages the window before the first new token reads must come whole.
        let from = (prompt_len.saturating_sub(i.window_tokens) / i.page_size).max(kv.first_page);
        if let Some(k) = (from..want).find(|&k| kv.pages[k - kv.first_page].len() != i.page_bytes) {
            return Err(SubmitError::BadKv(format!(
                "page {k} arrived without its window part, which the window before position \
                 {prompt_len} reads"
            )));
        }
        Ok(())
    }

    fn submit_with(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        route: Route,
    ) -> Result<RequestStream, SubmitError> {
        let needed = self.check(&prompt, &params)?;
        // A fresh constraint per request, started here (off the scheduler thread).
        let constraint = match &params.constraint {
            Some(c) => Some(
                crate::constraint::guarded(|| Ok(c.0.start()))
                    .map_err(SubmitError::BadConstraint)?,
            ),
            None => None,
        };
        self.reserve(needed)?;
        let id = self.shared.next_id.fetch_add(1, Ordering::SeqCst);
        let (etx, erx) = unbounded_channel();
        let prompt_tokens = prompt.len();
        let max_tokens = params.max_tokens;
        let req = NewReq {
            id,
            prompt,
            params,
            tx: etx,
            route,
            constraint,
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

    /// Refuses a request this engine can never serve (bad fields, too long for the context or
    /// the pool, a dead engine); returns the tokens it needs (prompt + max_tokens). Every
    /// submit checks it; a caller about to do work for a request first (a PD decode worker)
    /// may too.
    pub fn check(&self, prompt: &[u32], params: &SamplingParams) -> Result<usize, SubmitError> {
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
        crate::request::check_modifiers(params, info.vocab)?;
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
        Ok(needed)
    }

    /// Refuses `count` requests (the choices of one request, submitted together) of a
    /// `prompt`-token prompt and up to `max_tokens` each that cannot all be held at once: as
    /// the cache admits them, the prompt's pages before its last token are shared (with the
    /// prefix cache on), each choice holds the rest of its pages up to prompt + max_tokens in
    /// the device pool, and each reserves prompt + max_tokens of the in-flight bound. One
    /// choice is checked by [`EngineHandle::submit`] as it is.
    pub fn check_choices(
        &self,
        prompt: usize,
        max_tokens: usize,
        count: usize,
    ) -> Result<(), SubmitError> {
        let i = &self.info;
        if count <= 1 || prompt == 0 || prompt > i.context_length || max_tokens > i.context_length {
            return Ok(()); // one choice, or sizes the per-request check names
        }
        let ps = i.page_size;
        let shared = if i.prefix_cache { (prompt - 1) / ps } else { 0 };
        let own = |m: usize| (prompt + m).div_ceil(ps) - shared;
        let pool = (shared + count * own(max_tokens)) * ps;
        let refuse = |needed, capacity, what, fits: usize| SubmitError::ChoicesTooLarge {
            count,
            prompt,
            max_tokens,
            needed,
            capacity,
            what,
            fits,
        };
        if pool > i.device_tokens {
            let per = (i.device_tokens / ps).saturating_sub(shared) / count;
            let fits = ((shared + per) * ps).saturating_sub(prompt);
            return Err(refuse(pool, i.device_tokens, "device pool", fits));
        }
        let flight = count * (prompt + max_tokens);
        if flight > i.max_tokens_in_flight {
            let fits = (i.max_tokens_in_flight / count).saturating_sub(prompt);
            let what = "in-flight bound (--max-tokens-in-flight)";
            return Err(refuse(flight, i.max_tokens_in_flight, what, fits));
        }
        Ok(())
    }

    /// Admission control: takes a place in the queue and `needed` tokens of the in-flight
    /// bound, or refuses (shutting down, queue full, too many tokens) holding neither.
    fn reserve(&self, needed: usize) -> Result<(), SubmitError> {
        let info = &self.info;
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
        Ok(())
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
