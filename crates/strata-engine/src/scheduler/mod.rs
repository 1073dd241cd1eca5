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
use strata_kv::{Lease, Served, TieredCache};
use strata_model::{Runtime, SeqInput};
use tokio::sync::mpsc::UnboundedSender;

use crate::config::EngineConfig;
use crate::constraint::{TokenConstraint, TokenMask};
use crate::request::{CachedTokens, Event, FinishReason, FlushScope, ImportedKv, SamplingParams};
use crate::sampler::{sample_with_logprobs, History, Rng};
use crate::state::{Shared, Snapshot};

mod commands;
mod constrained;
mod export;
mod imported;
mod prompt_logprobs;
mod publish;
mod remote;
mod settle;

use constrained::{commit, masks_of};
use remote::{localize, Remote};

/// Waiting requests behind the front asked about in L3 while the front waits for its answer.
const PROBE_AHEAD: usize = 8;

pub(crate) struct NewReq {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub tx: UnboundedSender<Event>,
    pub route: Route,
    /// The request's constraint, started by the handle (off this thread).
    pub constraint: Option<Box<dyn TokenConstraint>>,
}

/// Where a request's prompt K/V come from and go.
pub(crate) enum Route {
    /// Computed here.
    Local,
    /// Computed here; its pages from this index on are sent back (`Event::Kv`).
    Export(usize),
    /// Computed elsewhere, all of it: written at admission instead of matching the cache.
    Import(ImportedKv),
    /// Computed elsewhere but for the prefix this cache holds, unless at most this many
    /// tokens are left (`remote.rs`).
    Remote(usize),
}

pub(crate) enum Cmd {
    Submit(Box<NewReq>),
    /// The K/V of a request waiting in [`Remote::Awaiting`] (by id).
    Deliver(u64, Box<ImportedKv>),
    Flush(FlushScope, Sender<(u64, u64)>),
    /// (epoch, next sequence number, pages per tier).
    CacheSnapshot(Sender<(u64, u64, Vec<strata_kv::CacheEvent>)>),
    Shutdown {
        deadline: Instant,
    },
}

struct Req {
    id: u64,
    /// Prompt, then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    params: SamplingParams,
    tx: UnboundedSender<Event>,
    rng: Rng,
    /// Its hold on the cache (admitted requests): prefix lock, pages, copies in flight.
    lease: Option<Lease>,
    /// Computing (the lease was ready and `Admitted` was sent).
    running: bool,
    cached: CachedTokens,
    /// Positions whose K/V are in the lease's pages.
    computed: usize,
    generated: usize,
    /// Prompt + max_tokens, counted in the tokens-in-flight bound.
    budget: usize,
    /// Send the prompt's K/V from this page on before `Done` (`export.rs`).
    export: Option<usize>,
    /// The next page to export (the parts sent so far end there).
    export_next: usize,
    /// The prompt's page hashes (computed at the first export).
    export_hashes: Vec<[u8; 16]>,
    /// K/V computed elsewhere, written at admission instead of matching the cache.
    import: Option<ImportedKv>,
    /// Computed elsewhere but for the prefix this cache holds (`remote.rs`).
    remote: Remote,
    /// The imported pages are in this server's layout: Some(whether they are copies
    /// converted from the wire layout, not the received buffers).
    import_local: Option<bool>,
    /// When it was submitted (the queueing-time limit counts from here).
    arrived: Instant,
    /// Its output constraint (taken out while its mask is computed).
    constraint: Option<Box<dyn TokenConstraint>>,
    /// The prompt's log probabilities so far (requests that asked for them).
    prompt_lps: Vec<crate::request::TokenLogprobs>,
    /// Answered: its generated positions are being computed again as prompt rows before they
    /// are cached and its client is told it is done (`settle.rs`).
    settling: Option<settle::Settling>,
}

impl Req {
    fn new(r: NewReq, seed: u64) -> Req {
        let (export, import, remote) = match r.route {
            Route::Local => (None, None, Remote::No),
            Route::Export(from) => (Some(from), None, Remote::No),
            Route::Import(kv) => (None, Some(kv), Remote::No),
            Route::Remote(local) => (None, None, Remote::Wanted { local }),
        };
        Req {
            id: r.id,
            prompt_len: r.prompt.len(),
            budget: r.prompt.len() + r.params.max_tokens,
            tokens: r.prompt,
            params: r.params,
            tx: r.tx,
            rng: Rng::new(seed),
            lease: None,
            running: false,
            cached: CachedTokens::default(),
            computed: 0,
            generated: 0,
            export,
            export_next: 0,
            export_hashes: Vec::new(),
            import,
            remote,
            import_local: None,
            arrived: Instant::now(),
            constraint: r.constraint,
            prompt_lps: Vec::new(),
            settling: None,
        }
    }

    fn lease(&self) -> &Lease {
        self.lease
            .as_ref()
            .expect("an admitted request holds a lease")
    }
}

pub(crate) struct Scheduler {
    model: Box<dyn Runtime>,
    cache: TieredCache,
    cfg: EngineConfig,
    shared: Arc<Shared>,
    rx: Receiver<Cmd>,
    waiting: VecDeque<Req>,
    active: Vec<Req>,
    deadline: Option<Instant>,
    snap: Snapshot,
    /// Counts what can let a refused admission pass: pages freed or unlocked (a request
    /// finished or was promoted, a flush), copies landed.
    progress: u64,
    /// `progress` when the head of the queue was last refused admission.
    blocked_at: Option<u64>,
    /// Failing L3 operations, and L3 pages that did not verify: each logged at most once a
    /// minute.
    l3_failures: strata_kv::stats::Throttled,
    l3_dropped: strata_kv::stats::Throttled,
    /// The L3 probe thread's end was logged (once).
    said_probe_ended: bool,
}

impl Scheduler {
    pub fn new(
        model: Box<dyn Runtime>,
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
            progress: 0,
            blocked_at: None,
            l3_failures: strata_kv::stats::Throttled::new(std::time::Duration::from_secs(60)),
            l3_dropped: strata_kv::stats::Throttled::new(std::time::Duration::from_secs(60)),
            said_probe_ended: false,
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
            // Only requests waiting for K/V from a prefill worker, and none that can be
            // admitted: nothing to run either.
            let stuck = self.waiting.is_empty()
                || self.blocked_at == Some(self.progress)
                || self.active.len() >= self.cfg.max_running;
            let parked = stuck && self.active.iter().all(|r| r.remote == Remote::Awaiting);
            if idle || parked {
                // Wake for commands; poll copies (backups) while some are in flight, and
                // waiting requests' clients (one that left frees its pages).
                let out = self.cache.in_flight() + self.cache.probes_in_flight();
                let wait = match (out, idle) {
                    (0, true) => 500,
                    (0, false) => 20,
                    _ => 2,
                };
                let cmd = self.rx.recv_timeout(Duration::from_millis(wait));
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
            if self.cache.poll() > 0 {
                self.progress += 1;
            }
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
        if self.blocked_at == Some(self.progress) {
            return;
        }
        self.blocked_at = None;
        while self.active.len() < self.cfg.max_running {
            let Some(r) = self.waiting.front() else {
                break;
            };
            if r.import.is_some() {
                if !self.admit_imported() {
                    break;
                }
                continue;
            }
            let prompt = &r.tokens[..r.prompt_len];
            let (new, prefetch) = (r.params.max_tokens, self.cfg.prefetch);
            let use_prefix = matches_prefix(&self.cfg, r);
            if use_prefix && !self.cache.probe_ready(prompt) {
                // L3 is asked which of its pages it holds, off this thread: the others run
                // meanwhile; its answer counts as progress at a poll. The requests behind it
                // are asked about now, so their answers are in when they reach the front.
                for r in self.waiting.iter().skip(1).take(PROBE_AHEAD) {
                    if r.import.is_none() && matches_prefix(&self.cfg, r) {
                        self.cache.probe_ask(&r.tokens[..r.prompt_len]);
                    }
                }
                self.blocked_at = Some(self.progress);
                break;
            }
            let mut lease = self.cache.admit(prompt, new, use_prefix, prefetch);
            if lease.is_none() && use_prefix && self.active.is_empty() {
                // On an idle engine only the request's own locked prefix can keep it out (a
                // fully cached page-aligned prompt whose reservation needs the page it would
                // copy): admit it without the prefix rather than never.
                lease = self.cache.admit(prompt, new, false, prefetch);
            }
            let Some(mut lease) = lease else {
                // Retried only once pages are freed or unlocked or copies land: each attempt
                // matches the prompt (tree touches, an L3 round trip).
                self.blocked_at = Some(self.progress);
                break;
            };
            if r.remote == Remote::No {
                publish::observe(&mut self.cache, &self.cfg, r); // a remote one: in `park`
            }
            hint(&mut self.cache, &mut lease, &r.params);
            let mut r = self.waiting.pop_front().expect("front exists");
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            tracing::debug!(
                id = r.id,
                prompt = r.prompt_len,
                prefetching = lease.prefetching(),
                "admitted"
            );
            r.lease = Some(lease);
            self.active.push(r);
        }
    }

    /// Moves requests whose copies landed forward: prefetched → loaded back → running.
    fn promote(&mut self) {
        let waiting = |r: &&mut Req| !r.running && r.remote != Remote::Awaiting;
        let mut handed_back = false;
        for r in self.active.iter_mut().filter(waiting) {
            let lease = r.lease.as_mut().expect("an admitted request holds a lease");
            if !self.cache.advance(lease) {
                continue;
            }
            match remote::park(&mut self.cache, &self.cfg, r) {
                Some(true) => {
                    self.progress += 1;
                    handed_back |= r.remote == Remote::HandedBack;
                    continue;
                }
                Some(false) => self.snap.pd_local_prefills += 1,
                None => {}
            }
            let lease = r.lease.as_ref().expect("an admitted request holds a lease");
            let Served {
                device,
                host,
                storage,
            } = lease.served();
            r.cached = CachedTokens {
                device,
                host,
                storage,
            };
            r.computed = lease.start();
            let s = &mut self.snap;
            s.prompt_tokens += r.prompt_len as u64;
            s.cached_device_tokens += device as u64;
            s.cached_host_tokens += host as u64;
            s.cached_storage_tokens += storage as u64;
            s.computed_prompt_tokens += (r.prompt_len - r.computed) as u64;
            r.running = true;
            self.progress += 1;
            let _ = r.tx.send(Event::Admitted { cached: r.cached });
        }
        if handed_back {
            self.hand_back();
        }
    }

    /// One model call. Returns false when nothing was ready to compute. The masks of the
    /// constrained requests that choose a token after this call are computed on a helper
    /// thread while the model runs.
    fn step(&mut self) -> bool {
        let plan = self.batch();
        if plan.is_empty() {
            return false;
        }
        let mut guests = self.take_constraints(&plan);
        let seqs: Vec<SeqInput> = plan
            .iter()
            .map(|&(i, at, n)| {
                let r = &self.active[i];
                SeqInput {
                    tokens: &r.tokens[at..at + n],
                    pos: at,
                    pages: r.lease().pages(),
                    windows: r.lease().windows(),
                    decode: at >= r.prompt_len,
                }
            })
            .collect();
        let pool = self
            .cache
            .device_pool()
            .expect("the engine's cache holds data");
        let all: Vec<bool> = plan
            .iter()
            .map(|&(i, at, _)| prompt_logprobs::wants_rows(&self.active[i], at))
            .collect();
        let model = &self.model;
        let (out, computed) = std::thread::scope(|s| {
            let helper = (!guests.is_empty()).then(|| s.spawn(|| masks_of(&mut guests)));
            let out = model.forward_rows(pool, &seqs, &all);
            (out, helper.map(|h| h.join()))
        });
        drop(seqs);
        let masks = self.put_back_constraints(&plan, guests, computed);
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
        let mut done = self.sample_batch(&plan, &logits, masks);
        self.export_parts();
        done.sort_unstable_by_key(|d| std::cmp::Reverse(d.0));
        for (i, reason) in done {
            let r = self.active.swap_remove(i);
            self.finish(r, Some(reason));
        }
        true
    }

    /// The next batch under `max_batch_tokens`: one decode token per running request first,
    /// then prefill chunks, as (active index, first position, tokens). Each request's window
    /// pages are secured for its part (with window checkpoints a request holds them for the
    /// span it reads only; short of them, a chunk is cut, never below one token).
    fn batch(&mut self) -> Vec<(usize, usize, usize)> {
        let mut plan = self.plan_batch();
        for (i, at, n) in &mut plan {
            let lease = self.active[*i]
                .lease
                .as_mut()
                .expect("a running request holds a lease");
            *n = self.cache.secure_windows(lease, *at, *at + *n) - *at;
        }
        plan
    }

    fn plan_batch(&self) -> Vec<(usize, usize, usize)> {
        let mut budget = self.cfg.max_batch_tokens.max(1);
        let mut plan: Vec<(usize, usize, usize)> = Vec::new();
        for (i, r) in self.active.iter().enumerate() {
            if r.running && r.computed >= r.prompt_len && budget > 0 {
                plan.push((i, r.computed, 1));
                budget -= 1;
            }
        }
        // Answers computed again (`settle.rs`) first, within a quarter of what is left (their
        // clients wait for them to end; their slots and pages are freed by it), then prompts,
        // then those answers again with whatever prompts leave.
        let pending: Vec<usize> = (0..self.active.len())
            .filter(|&i| {
                self.active[i].running && self.active[i].computed < self.active[i].prompt_len
            })
            .collect();
        let settling = |i: usize| self.active[i].settling.is_some();
        let mut share = (budget / 4).max(1).min(budget);
        let mut first = Vec::new();
        for &i in pending.iter().filter(|&&i| settling(i)) {
            let r = &self.active[i];
            let n = (r.prompt_len - r.computed).min(share);
            if n == 0 {
                break;
            }
            plan.push((i, r.computed, n));
            (share, budget) = (share - n, budget - n);
            first.push(i);
        }
        let prompts = pending.iter().filter(|&&i| !settling(i));
        let rest = pending
            .iter()
            .filter(|&&i| settling(i) && !first.contains(&i));
        // Rows whose every logits come back (prompt log probabilities): at most ROWS a step.
        let mut rows = prompt_logprobs::ROWS;
        for &i in prompts.chain(rest) {
            let r = &self.active[i];
            if budget == 0 {
                break;
            }
            let mut n = (r.prompt_len - r.computed).min(budget);
            if prompt_logprobs::wants_rows(r, r.computed) {
                if rows == 0 {
                    continue;
                }
                n = n.min(rows);
                rows -= n;
            }
            plan.push((i, r.computed, n));
            budget -= n;
        }
        plan
    }

    /// Advances the batch's requests past the call and samples the next token of those that
    /// reached the end of their input; returns the requests that are done, and why.
    fn sample_batch(
        &mut self,
        plan: &[(usize, usize, usize)],
        logits: &[Vec<f32>],
        mut masks: Vec<Option<Result<TokenMask, String>>>,
    ) -> Vec<(usize, FinishReason)> {
        let mut done: Vec<(usize, FinishReason)> = Vec::new();
        for (k, (&(i, at, n), l)) in plan.iter().zip(logits).enumerate() {
            let r = &mut self.active[i];
            let l = if prompt_logprobs::wants_rows(r, at) {
                prompt_logprobs::gather(r, at, n, l)
            } else {
                &l[..]
            };
            r.computed += n;
            if r.computed < r.tokens.len() {
                continue; // a prefill chunk that did not reach the end of the prompt
            }
            if r.settling.is_some() {
                done.push((i, FinishReason::Stop)); // its answer computed again: cached now
                continue;
            }
            let mask = match masks[k].take().transpose() {
                Ok(m) => m,
                Err(e) => {
                    done.push((i, FinishReason::Error(e)));
                    continue;
                }
            };
            if let Some(reason) = self.sample_one(i, l, mask.as_ref()) {
                done.push((i, reason));
            }
        }
        done
    }

    /// Chooses request `i`'s next token from its logits (under its constraint's mask) and
    /// sends it; returns why the request is done, if it is.
    fn sample_one(
        &mut self,
        i: usize,
        l: &[f32],
        mask: Option<&TokenMask>,
    ) -> Option<FinishReason> {
        let r = &mut self.active[i];
        if mask.is_some_and(|m| !m.any()) {
            return Some(FinishReason::Error(
                "the output constraint allows no token here".into(),
            ));
        }
        // The stop tokens, needed only under a mask or before min_tokens (no allocation on
        // the common path).
        let early = r.generated < r.params.min_tokens;
        let ends = if mask.is_some() || early {
            stop_tokens(&r.params, &self.cfg.stop_token_ids)
        } else {
            Vec::new()
        };
        // A constraint that allows only the end wins over min_tokens.
        let only_end = mask.is_some_and(|m| m.words.iter().all(|&w| w == 0));
        // `ignore_eos` under a constraint: the end-of-sequence tokens are not chosen while the
        // grammar allows anything else (a complete answer still ends).
        let eos = &self.cfg.stop_token_ids;
        let hold_eos = r.params.ignore_eos && mask.is_some_and(|m| m.allows_besides(eos));
        let stops: &[u32] = match (early && !only_end, hold_eos) {
            (true, _) => &ends,
            (false, true) => eos,
            (false, false) => &[],
        };
        let h = History {
            prompt: &r.tokens[..r.prompt_len],
            output: &r.tokens[r.prompt_len..],
            stops,
            mask,
            ends: &ends,
        };
        let (next, lp) = sample_with_logprobs(l, &r.params, &mut r.rng, &h);
        let stop = r.params.stop_token_ids.contains(&next)
            || (!r.params.ignore_eos && self.cfg.stop_token_ids.contains(&next));
        if stop {
            if r.export.is_some() {
                // A prefill worker forwards the first token, whatever it is, with the K/V.
                if let Some(lp) = lp {
                    let _ = r.tx.send(Event::Logprobs(lp));
                }
                let _ = r.tx.send(Event::Token(next));
            } else if let Some(lp) = lp.filter(|_| r.params.prompt_logprobs.is_some()) {
                // An evaluation harness scoring a prompt and its answer (`echo` with
                // `logprobs`) reads an entry for the token that ended it too.
                let _ = r.tx.send(Event::Logprobs(lp));
            }
            return Some(FinishReason::Stop);
        }
        let complete = match commit(r.constraint.as_deref_mut(), next) {
            Ok(c) => c,
            Err(e) => return Some(FinishReason::Error(e)),
        };
        r.tokens.push(next);
        r.generated += 1;
        self.snap.generated_tokens += 1;
        if let Some(lp) = lp {
            let _ = r.tx.send(Event::Logprobs(lp));
        }
        let _ = r.tx.send(Event::Token(next));
        if complete {
            Some(FinishReason::Stop)
        } else if r.generated >= r.params.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    /// Ends a request: an answer whose positions are computed again first stays for that
    /// (`settle.rs`); then its whole pages join the tree and everything else it holds returns
    /// to the pool (`keep`), and its client is told (`report`). `None` = cancelled by the
    /// client (no event is sent).
    fn finish(&mut self, mut r: Req, mut reason: Option<FinishReason>) {
        if let Some(s) = r.settling.take() {
            return self.settled(r, s, reason);
        }
        let ok = matches!(reason, Some(FinishReason::Stop | FinishReason::Length));
        if ok && r.export.is_some() && r.running && r.computed >= r.prompt_len {
            match self.export_rest(&mut r) {
                Ok(kv) => {
                    let _ = r.tx.send(Event::Kv(Arc::new(kv)));
                }
                Err(e) => reason = Some(FinishReason::Error(format!("K/V export: {e}"))),
            }
        }
        let ok = matches!(reason, Some(FinishReason::Stop | FinishReason::Length));
        if let Some(reason) = reason.clone().filter(|_| ok && self.settles(&r)) {
            return self.settle(r, reason);
        }
        self.progress += 1;
        self.keep(&mut r, ok, reason.is_none());
        self.report(r, reason);
    }

    /// Counts `r`'s end and tells its client (`Done`; nothing for a cancelled request).
    fn report(&mut self, r: Req, reason: Option<FinishReason>) {
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
}

/// Whether request `r` is matched against the prefix cache: prompt log probabilities need
/// every prompt position's logits (computed whole).
fn matches_prefix(cfg: &EngineConfig, r: &Req) -> bool {
    cfg.prefix_cache && r.params.prompt_logprobs.is_none()
}

/// The tokens that end a request: its `stop_token_ids`, and the model's end-of-sequence tokens
/// unless it ignores them.
fn stop_tokens(p: &SamplingParams, eos: &[u32]) -> Vec<u32> {
    let mut v = p.stop_token_ids.clone();
    if !p.ignore_eos {
        v.extend_from_slice(eos);
    }
    v
}

/// A request's hints to the cache, on its lease once admitted: where its shared prefix ends,
/// and its session.
fn hint(cache: &mut TieredCache, lease: &mut Lease, p: &SamplingParams) {
    lease.set_shared_prefix(p.shared_prefix);
    if let Some(k) = p.session {
        cache.set_session(lease, k);
    }
}
