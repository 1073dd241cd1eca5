//! The scheduler thread: admission, batching, sampling, insertion, cancellation.
//!
//! Each step: take commands; acknowledge finished copies; drop requests whose client went
//! away; admit waiting requests in order (match the prompt, lock the prefix, reserve device
//! pages for the whole request, start load-back of host-resident pages and L3 prefetch);
//! promote requests whose copies landed; run one model call over a batch of at most
//! `max_batch_tokens` tokens (one decode token per running request first, then prefill
//! chunks); sample; finish requests (their whole pages join the tree, which backs them up
//! per the write policy; the rest return to the pool).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use strata_kv::cache::{CacheMatch, Ticket};
use strata_kv::tree::{NodeId, ROOT};
use strata_kv::{PageHash, TieredCache};
use strata_model::{Model, SeqInput};
use tokio::sync::mpsc::UnboundedSender;

use crate::handle::{EngineConfig, PrefetchPolicy, Shared, Snapshot};
use crate::request::{
    CachedTokens, Event, ExportedKv, FinishReason, FlushScope, ImportedKv, SamplingParams,
};
use crate::sampler::{sample, Rng};

mod commands;

pub(crate) struct NewReq {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub tx: UnboundedSender<Event>,
    pub export: bool,
    pub import: Option<ImportedKv>,
}

pub(crate) enum Cmd {
    Submit(Box<NewReq>),
    Flush(FlushScope, Sender<(u64, u64)>),
    /// (epoch, next sequence number, pages per tier).
    CacheSnapshot(Sender<(u64, u64, Vec<strata_kv::CacheEvent>)>),
    Shutdown {
        deadline: Instant,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// L3 → host copy in flight (waited for until the deadline, if any); then load-back.
    Prefetch(Ticket, Option<Instant>),
    /// Host → device copy in flight.
    Loading(Option<Ticket>),
    Running,
}

struct Req {
    id: u64,
    /// Prompt, then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    params: SamplingParams,
    tx: UnboundedSender<Event>,
    rng: Rng,
    phase: Phase,
    /// Deepest tree node of the prefix in use (locked; ROOT if none).
    lock: NodeId,
    matched: CacheMatch,
    cached: CachedTokens,
    /// Device pages in position order: the prefix's (tree-owned), then the request's own.
    pages: Vec<u32>,
    prefix_pages: usize,
    /// Positions whose K/V are in `pages`.
    computed: usize,
    generated: usize,
    /// Prompt + max_tokens, counted in the tokens-in-flight bound.
    budget: usize,
    /// Send the prompt's K/V before `Done`.
    export: bool,
    /// K/V computed elsewhere, written at admission instead of matching the cache.
    import: Option<ImportedKv>,
    /// When it was submitted (the queueing-time limit counts from here).
    arrived: Instant,
}

impl Req {
    fn new(
        id: u64,
        prompt: Vec<u32>,
        params: SamplingParams,
        tx: UnboundedSender<Event>,
        seed: u64,
        export: bool,
        import: Option<ImportedKv>,
    ) -> Req {
        Req {
            id,
            prompt_len: prompt.len(),
            budget: prompt.len() + params.max_tokens,
            tokens: prompt,
            params,
            tx,
            rng: Rng::new(seed),
            phase: Phase::Loading(None),
            lock: ROOT,
            matched: CacheMatch::default(),
            cached: CachedTokens::default(),
            pages: Vec::new(),
            prefix_pages: 0,
            computed: 0,
            generated: 0,
            export,
            import,
            arrived: Instant::now(),
        }
    }

    fn own_pages(&self) -> &[u32] {
        &self.pages[self.prefix_pages..]
    }
}

pub(crate) struct Scheduler {
    model: Model,
    cache: TieredCache,
    cfg: EngineConfig,
    shared: Arc<Shared>,
    rx: Receiver<Cmd>,
    waiting: VecDeque<Req>,
    active: Vec<Req>,
    deadline: Option<Instant>,
    snap: Snapshot,
}

impl Scheduler {
    pub fn new(
        model: Model,
        cache: TieredCache,
        cfg: EngineConfig,
        shared: Arc<Shared>,
        rx: Receiver<Cmd>,
    ) -> Scheduler {
        let mut s = Scheduler {
            model,
            cache,
            cfg,
            shared,
            rx,
            waiting: VecDeque::new(),
            active: Vec::new(),
            deadline: None,
            snap: Snapshot::default(),
        };
        s.publish();
        s
    }

    pub fn run(mut self) {
        loop {
            // The heartbeat `/health` reads: one pass round this loop at least every 0.5 s
            // while idle, one per step while busy.
            self.shared.beat();
            let idle = self.waiting.is_empty() && self.active.is_empty();
            if idle && self.deadline.is_some() {
                break;
            }
            if idle {
                // Wake for commands; poll copies (backups) while some are in flight.
                let cmd = if self.cache.in_flight() == 0 {
                    self.rx.recv_timeout(Duration::from_millis(500))
                } else {
                    self.rx.recv_timeout(Duration::from_millis(2))
                };
                match cmd {
                    Ok(c) => self.command(c),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            }
            while let Ok(c) = self.rx.try_recv() {
                self.command(c);
            }
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                self.abort_all();
                break;
            }
            self.cache.poll();
            self.reap_cancelled();
            self.admit();
            self.promote();
            let ran = self.step();
            if !ran {
                // Only copies (or freed pages) to wait for: let one land instead of spinning.
                std::thread::sleep(Duration::from_micros(200));
            }
            self.publish();
        }
        self.cache.wait_all();
        self.publish();
    }

    /// Admits waiting requests in arrival order while device pages can be reserved.
    fn admit(&mut self) {
        let ps = self.cache.page_size();
        while self.active.len() < self.cfg.max_running {
            let Some(r) = self.waiting.front_mut() else {
                break;
            };
            if r.import.is_some() {
                if !self.admit_imported() {
                    break;
                }
                continue;
            }
            let m = if self.cfg.prefix_cache {
                self.cache.lookup(&r.tokens[..r.prompt_len])
            } else {
                CacheMatch {
                    queried_tokens: r.prompt_len,
                    last: ROOT,
                    ..CacheMatch::default()
                }
            };
            self.cache.lock(m.last);
            // The last prompt token is always computed (its logits give the first token): at
            // most the pages before it are used as they are.
            let dev_pages = (m.device_tokens / ps).min((r.prompt_len - 1) / ps);
            let total = (r.prompt_len + r.params.max_tokens).div_ceil(ps);
            // Reserve the worst case (nothing loaded back); the surplus returns at once when
            // a load-back starts.
            let Some(own) = self.cache.alloc_device(total - dev_pages) else {
                self.cache.unlock(m.last);
                break;
            };
            let mut r = self.waiting.pop_front().expect("front exists");
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            self.cache.record(&m);
            tracing::debug!(
                id = r.id,
                prompt = r.prompt_len,
                device = m.device_tokens,
                host = m.host_tokens,
                storage = m.storage_tokens,
                "admitted (tokens per tier)"
            );
            r.lock = m.last;
            r.pages = own;
            r.phase = if m.storage_tokens > 0 {
                match self.cache.prefetch(&r.tokens, &m) {
                    Some(t) => {
                        let deadline = match self.cfg.prefetch {
                            PrefetchPolicy::WaitComplete => None,
                            PrefetchPolicy::BestEffort => Some(Instant::now()),
                            PrefetchPolicy::Timeout { per_token } => {
                                Some(Instant::now() + per_token * m.storage_tokens as u32)
                            }
                        };
                        Phase::Prefetch(t, deadline)
                    }
                    None => Phase::Loading(None),
                }
            } else {
                Phase::Loading(None)
            };
            r.matched = m;
            if matches!(r.phase, Phase::Loading(_)) {
                self.start_load_back(&mut r);
            }
            self.active.push(r);
        }
    }

    /// Admits the waiting request at the front, whose K/V arrived from a prefill worker:
    /// reserves its pages, writes the K/V, and starts decoding after the first token. False
    /// when the pages cannot be reserved now.
    fn admit_imported(&mut self) -> bool {
        let ps = self.cache.page_size();
        let r = self.waiting.front().expect("front exists");
        let total = (r.prompt_len + r.params.max_tokens).div_ceil(ps);
        let Some(own) = self.cache.alloc_device(total) else {
            return false;
        };
        let mut r = self.waiting.pop_front().expect("front exists");
        self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
        let kv = r.import.take().expect("imported request");
        let pool = self.cache.device_pool().expect("the cache holds data");
        let layout = self.cache.layout();
        for (blob, &page) in kv.pages.iter().zip(&own) {
            for c in layout.chunks() {
                let src = &blob[c.host_offset..c.host_offset + c.bytes];
                pool.write_chunk(c.kind, c.layer, c.plane, page, src);
            }
        }
        r.pages = own;
        r.computed = r.prompt_len;
        r.cached = kv.cached;
        r.phase = Phase::Running;
        self.snap.prompt_tokens += r.prompt_len as u64;
        self.snap.transferred_prompt_tokens += r.prompt_len as u64;
        let _ = r.tx.send(Event::Admitted { cached: r.cached });
        let first = kv.first_token;
        let stop = r.params.stop_token_ids.contains(&first)
            || (!r.params.ignore_eos && self.cfg.stop_token_ids.contains(&first));
        if stop {
            self.finish(r, Some(FinishReason::Stop));
            return true;
        }
        r.tokens.push(first);
        r.generated = 1;
        self.snap.generated_tokens += 1;
        let _ = r.tx.send(Event::Token(first));
        if r.generated >= r.params.max_tokens {
            self.finish(r, Some(FinishReason::Length));
        } else {
            self.active.push(r);
        }
        true
    }

    /// The prompt's pages out of the device pool, in the host layout, with their hashes.
    fn export_kv(&self, r: &Req) -> ExportedKv {
        let ps = self.cache.page_size();
        let pool = self.cache.device_pool().expect("the cache holds data");
        let layout = self.cache.layout();
        let n = r.prompt_len.div_ceil(ps);
        let mut pages = Vec::with_capacity(n);
        for &page in &r.pages[..n] {
            let mut blob = vec![0u8; layout.page_bytes()];
            for c in layout.chunks() {
                let dst = &mut blob[c.host_offset..c.host_offset + c.bytes];
                pool.read_chunk(c.kind, c.layer, c.plane, page, dst);
            }
            pages.push(blob);
        }
        let mut hashes: Vec<[u8; 16]> = match self.cache.tree().namespace() {
            Some(ns) => ns
                .chain(PageHash::ROOT, &r.tokens[..r.prompt_len], ps)
                .into_iter()
                .map(|h| h.0)
                .collect(),
            None => Vec::new(),
        };
        hashes.resize(n, [0; 16]);
        ExportedKv { pages, hashes }
    }

    /// Starts copying the host-only part of the request's match to the device.
    fn start_load_back(&mut self, r: &mut Req) {
        let ps = self.cache.page_size();
        let m = &r.matched;
        // Loaded pages the request will use in place of reserved ones (see `promote`).
        let usable = (r.prompt_len - 1) / ps;
        let host_pages = (m.host_tokens / ps).min(usable.saturating_sub(m.device_tokens / ps));
        let mut ticket = None;
        if host_pages > 0 {
            // Those positions will come from the tree: hand the reserved pages back first, so
            // the load-back can land in them. (Freed after it, a pool sized for one long
            // request would need room for it twice, and long prompts would be recomputed.)
            let surplus: Vec<u32> = r.pages.drain(..host_pages).collect();
            self.cache
                .free_device(&surplus)
                .expect("reserved pages are held");
            match self.cache.load_back(m) {
                Some(t) => ticket = Some(t),
                None => {
                    // Not loaded (no room): take the reservation back; a failed load-back
                    // allocates nothing, so the pages just freed are still free.
                    let back = self
                        .cache
                        .alloc_device(host_pages)
                        .expect("the pages just freed are free");
                    r.pages.splice(0..0, back);
                }
            }
        }
        r.phase = Phase::Loading(ticket);
    }

    /// Moves requests whose copies landed forward: prefetched → load-back → running.
    fn promote(&mut self) {
        let ps = self.cache.page_size();
        for i in 0..self.active.len() {
            match self.active[i].phase {
                Phase::Prefetch(t, deadline)
                    if self.cache.is_done(t) || deadline.is_some_and(|d| Instant::now() >= d) =>
                {
                    let mut r = std::mem::replace(&mut self.active[i], placeholder());
                    // The prefetched pages joined the tree as host nodes: match again.
                    let m = self.cache.lookup(&r.tokens[..r.prompt_len]);
                    self.cache.lock(m.last);
                    self.cache.unlock(r.lock);
                    r.lock = m.last;
                    let tree_pages = (m.device_tokens + m.host_tokens) / ps;
                    let before = (r.matched.device_tokens + r.matched.host_tokens) / ps;
                    r.cached.storage = tree_pages.saturating_sub(before) * ps;
                    tracing::debug!(
                        id = r.id,
                        prefetched = r.cached.storage,
                        "prefetch landed (tokens)"
                    );
                    // Host tokens now include the prefetched ones.
                    r.matched = m;
                    self.start_load_back(&mut r);
                    self.active[i] = r;
                }
                Phase::Loading(t) if t.is_none_or(|t| self.cache.is_done(t)) => {
                    let r = &mut self.active[i];
                    let m = &r.matched;
                    // Prefix device pages along the path, root first.
                    let mut prefix = Vec::new();
                    for &n in &m.path {
                        let v = self.cache.tree().view(n);
                        if v.device.is_empty() {
                            break;
                        }
                        prefix.extend_from_slice(v.device);
                    }
                    // Pages used as they are: those before the last prompt token's page.
                    let keep = (r.prompt_len - 1) / ps;
                    // A page-aligned prompt matched in full: its last page also holds the last
                    // token, which is computed again. Copy the page (copy-on-write: the tree's
                    // page stays untouched) and compute only that token.
                    let cow = prefix.get(keep).copied();
                    prefix.truncate(keep);
                    // Pages not loaded (no room) are computed into the reserved pages.
                    let total = (r.prompt_len + r.params.max_tokens).div_ceil(ps);
                    let own_needed = total - prefix.len();
                    if r.pages.len() > own_needed {
                        let extra: Vec<u32> = r.pages.drain(own_needed..).collect();
                        self.cache
                            .free_device(&extra)
                            .expect("reserved pages are held");
                    }
                    let mut pages = prefix;
                    r.prefix_pages = pages.len();
                    r.computed = r.prefix_pages * ps;
                    if let Some(src) = cow {
                        let pool = self.cache.device_pool().expect("the cache holds data");
                        pool.copy_page(src, r.pages[0]);
                        r.computed = r.prompt_len - 1;
                    }
                    pages.append(&mut r.pages);
                    r.pages = pages;
                    let dev = m.device_tokens.min(r.computed);
                    let storage = r.cached.storage.min(r.computed - dev);
                    r.cached = CachedTokens {
                        device: dev,
                        host: r.computed - dev - storage,
                        storage,
                    };
                    let s = &mut self.snap;
                    s.prompt_tokens += r.prompt_len as u64;
                    s.cached_device_tokens += r.cached.device as u64;
                    s.cached_host_tokens += r.cached.host as u64;
                    s.cached_storage_tokens += r.cached.storage as u64;
                    s.computed_prompt_tokens += (r.prompt_len - r.computed) as u64;
                    r.phase = Phase::Running;
                    let _ = r.tx.send(Event::Admitted { cached: r.cached });
                }
                _ => {}
            }
        }
    }

    /// One model call. Returns false when nothing was ready to compute.
    fn step(&mut self) -> bool {
        let mut budget = self.cfg.max_batch_tokens.max(1);
        // (active index, first position, tokens)
        let mut plan: Vec<(usize, usize, usize)> = Vec::new();
        for (i, r) in self.active.iter().enumerate() {
            if r.phase == Phase::Running && r.computed >= r.prompt_len && budget > 0 {
                plan.push((i, r.computed, 1));
                budget -= 1;
            }
        }
        for (i, r) in self.active.iter().enumerate() {
            if r.phase == Phase::Running && r.computed < r.prompt_len && budget > 0 {
                let n = (r.prompt_len - r.computed).min(budget);
                plan.push((i, r.computed, n));
                budget -= n;
            }
        }
        if plan.is_empty() {
            return false;
        }
        let seqs: Vec<SeqInput> = plan
            .iter()
            .map(|&(i, at, n)| {
                let r = &self.active[i];
                SeqInput {
                    tokens: &r.tokens[at..at + n],
                    pos: at,
                    pages: &r.pages,
                    decode: at >= r.prompt_len,
                }
            })
            .collect();
        let pool = self
            .cache
            .device_pool()
            .expect("the engine's cache holds data");
        let out = self.model.forward(pool, &seqs, false);
        self.snap.steps += 1;
        let logits = match out {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "model call failed; its requests end with an error");
                let mut idx: Vec<usize> = plan.iter().map(|p| p.0).collect();
                idx.sort_unstable_by_key(|&i| std::cmp::Reverse(i));
                for i in idx {
                    let r = self.active.swap_remove(i);
                    self.finish(r, Some(FinishReason::Error(e.to_string())));
                }
                return true;
            }
        };
        let mut done: Vec<(usize, FinishReason)> = Vec::new();
        for (&(i, _, n), l) in plan.iter().zip(&logits) {
            let r = &mut self.active[i];
            r.computed += n;
            if r.computed < r.tokens.len() {
                continue; // a prefill chunk that did not reach the end of the prompt
            }
            let next = sample(l, &r.params, &mut r.rng);
            let stop = r.params.stop_token_ids.contains(&next)
                || (!r.params.ignore_eos && self.cfg.stop_token_ids.contains(&next));
            if stop {
                if r.export {
                    // A prefill worker forwards the first token, whatever it is, with the K/V.
                    let _ = r.tx.send(Event::Token(next));
                }
                done.push((i, FinishReason::Stop));
                continue;
            }
            r.tokens.push(next);
            r.generated += 1;
            self.snap.generated_tokens += 1;
            let _ = r.tx.send(Event::Token(next));
            if r.generated >= r.params.max_tokens {
                done.push((i, FinishReason::Length));
            }
        }
        done.sort_unstable_by_key(|d| std::cmp::Reverse(d.0));
        for (i, reason) in done {
            let r = self.active.swap_remove(i);
            self.finish(r, Some(reason));
        }
        true
    }

    /// Ends a request: on success its whole pages join the tree; everything else it holds
    /// returns to the pool. `None` = cancelled by the client (no event is sent).
    fn finish(&mut self, r: Req, reason: Option<FinishReason>) {
        let ps = self.cache.page_size();
        let ok = matches!(reason, Some(FinishReason::Stop | FinishReason::Length));
        if let Phase::Prefetch(t, _) | Phase::Loading(Some(t)) = r.phase {
            // The copy writes into pages the tree owns; let it land before unlocking.
            self.cache.wait(t);
        }
        if ok && r.export && r.phase == Phase::Running && r.computed >= r.prompt_len {
            let kv = self.export_kv(&r);
            let _ = r.tx.send(Event::Kv(Arc::new(kv)));
        }
        let own = r.own_pages().to_vec();
        if ok && r.phase == Phase::Running && self.cfg.prefix_cache {
            let whole = (r.computed / ps).max(r.prefix_pages);
            let give = whole - r.prefix_pages;
            self.cache
                .insert(&r.tokens[..whole * ps], &own[..give], r.prefix_pages);
            self.cache
                .free_device(&own[give..])
                .expect("request pages are held");
        } else {
            self.cache
                .free_device(&own)
                .expect("request pages are held");
        }
        self.cache.unlock(r.lock);
        self.shared
            .tokens_in_flight
            .fetch_sub(r.budget, Ordering::SeqCst);
        let f = &mut self.snap.finished;
        match &reason {
            None => f.cancelled += 1,
            Some(FinishReason::Stop) => f.stop += 1,
            Some(FinishReason::Length) => f.length += 1,
            Some(FinishReason::Aborted) => f.aborted += 1,
            Some(FinishReason::Error(_)) => f.error += 1,
            Some(FinishReason::QueueTimeout { .. }) => f.queue_timeout += 1,
        }
        // Callers that saw Done see the counters that include it.
        self.publish();
        if let Some(reason) = reason {
            tracing::debug!(
                id = r.id,
                ?reason,
                generated = r.generated,
                "request finished"
            );
            let _ = r.tx.send(Event::Done {
                reason,
                prompt_tokens: r.prompt_len,
                completion_tokens: r.generated,
                cached: r.cached,
            });
        }
    }

    fn publish(&mut self) {
        let events = self.cache.take_events();
        if !events.is_empty() {
            let mut log = self.shared.events.lock().expect("event log lock");
            for e in events {
                log.push(e);
            }
        }
        let s = &mut self.snap;
        s.cache = *self.cache.stats();
        s.storage = self.cache.storage().map(|st| st.stats());
        s.device = self.cache.device_usage();
        s.host = self.cache.host_usage();
        s.pools = self.cache.pool_usage();
        s.device_pages_held = self.active.iter().map(|r| r.own_pages().len() as u64).sum();
        s.waiting = self.shared.waiting.load(Ordering::SeqCst);
        s.running = self.active.len();
        s.tokens_in_flight = self.shared.tokens_in_flight.load(Ordering::SeqCst);
        *self.shared.snapshot.lock().expect("snapshot lock") = s.clone();
    }
}

/// A request-shaped value to move out of the active list briefly.
fn placeholder() -> Req {
    let (tx, _) = tokio::sync::mpsc::unbounded_channel();
    Req::new(0, Vec::new(), SamplingParams::default(), tx, 0, false, None)
}
