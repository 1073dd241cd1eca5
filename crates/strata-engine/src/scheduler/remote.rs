//! PD with decode-side reuse: a request whose prompt a prefill worker computes, except for
//! the prefix this worker's cache holds.
//!
//! It is admitted like any other request (its prefix matched, locked and brought onto the
//! device, its pages reserved). Once the prefix is on device, [`park`] decides: when the
//! cache holds some of the prompt and at most the request's local threshold is left, it is
//! computed here like any other (no prefill worker, no transfer); otherwise it waits
//! ([`Remote::Awaiting`], in no batch, its pages held) for the K/V of the pages after its
//! prefix. `Cmd::Deliver` writes them into its own pages ([`Scheduler::deliver`]), and it
//! decodes from the prefill worker's first token ([`Scheduler::begin_decode`], shared with
//! requests whose whole prompt was imported). A request whose cache held nothing is handed
//! back ([`Scheduler::hand_back`]): holding its pages through a cold prefill would only keep
//! other requests out; the caller submits it again with all of its K/V.

use strata_kv::TieredCache;
use strata_model::Runtime;

use super::{commit, prompt_logprobs, Req, Scheduler};
use crate::config::EngineConfig;
use crate::request::{Event, FinishReason, ImportedKv};

/// A request's part in PD with decode-side reuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Remote {
    /// Not such a request, or one computed here after all.
    No,
    /// Decides once its prefix is on device: computed here if at most `local` tokens are left.
    Wanted { local: usize },
    /// Waits for the K/V of the pages after its prefix.
    Awaiting,
    /// Its cache held none of the prompt: handed back (its pages freed, its stream closed),
    /// for the caller to submit it again with all of its K/V once they arrived.
    HandedBack,
}

/// A request whose lease just became ready: for a remote one, sends `Event::Held` and returns
/// whether it now waits for the K/V (true) or computes here (false); None for others.
pub(super) fn park(cache: &mut TieredCache, cfg: &EngineConfig, r: &mut Req) -> Option<bool> {
    let Remote::Wanted { local } = r.remote else {
        return None;
    };
    let lease = r.lease.as_ref().expect("an admitted request holds a lease");
    let held = lease.prefix_pages() * cache.page_size();
    let left = r.prompt_len - lease.start();
    let prefill = held == 0 || left > local;
    let _ = r.tx.send(Event::Held {
        tokens: held,
        prefill,
    });
    r.remote = match (held, prefill) {
        (0, _) => Remote::HandedBack,
        (_, true) => Remote::Awaiting,
        _ => Remote::No,
    };
    if r.remote != Remote::HandedBack {
        // One handed back is observed when it comes back with its K/V.
        super::publish::observe(cache, cfg, r);
    }
    Some(prefill)
}

/// Pages from the wire layout into this server's ([`Runtime::wire_kinds`]: tensor-parallel
/// ranks re-shard). A received buffer replaced by its local copy goes back to the transfer's
/// buffers at once; returns whether any was (then the pages are not the received buffers).
pub(super) fn localize(
    model: &dyn Runtime,
    page_size: usize,
    pages: &mut [Vec<u8>],
) -> Result<bool, String> {
    let mut converted = false;
    for p in pages {
        match model.page_from_wire(page_size, p) {
            Ok(Some(local)) => {
                crate::transfer::recycle([std::mem::replace(p, local)]);
                converted = true;
            }
            Ok(None) => {}
            Err(e) => return Err(format!("the K/V received: {e}")),
        }
    }
    Ok(converted)
}

impl Scheduler {
    /// Drops the requests handed back (nothing held: their pages would only wait for the
    /// whole prompt's K/V, which the caller brings with a new request). Not counted as
    /// finished: the caller's new request is the same one.
    pub(super) fn hand_back(&mut self) {
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].remote != Remote::HandedBack {
                i += 1;
                continue;
            }
            // Its stream closes when it is dropped here.
            let mut r = self.active.swap_remove(i);
            if let Some(lease) = r.lease.take() {
                self.cache.release(lease);
            }
            self.shared
                .tokens_in_flight
                .fetch_sub(r.budget, std::sync::atomic::Ordering::SeqCst);
            self.progress += 1;
        }
    }

    /// `Cmd::Deliver`: the K/V of the pages after a waiting request's prefix. A request gone
    /// meanwhile (its client left) ignores them.
    pub(super) fn deliver(&mut self, id: u64, mut kv: ImportedKv) {
        let Some(i) = self
            .active
            .iter()
            .position(|r| r.id == id && r.remote == Remote::Awaiting)
        else {
            return;
        };
        let mut r = self.active.swap_remove(i);
        self.progress += 1;
        let ps = self.cache.page_size();
        let written = localize(self.model.as_ref(), ps, &mut kv.pages).and_then(|converted| {
            let lease = r.lease.as_mut().expect("an admitted request holds a lease");
            let w = self
                .cache
                .write_transferred(lease, kv.first_page, &kv.pages)
                .map_err(|e| format!("the K/V received: {e}"));
            if !converted {
                crate::transfer::recycle(std::mem::take(&mut kv.pages));
            }
            w
        });
        if let Err(e) = written {
            self.finish(r, Some(FinishReason::Error(e)));
            return;
        }
        // Served counts up to the lease's start, which is the last prompt token when a
        // page-aligned prompt was held whole (its last page, a copy, was sent again): only
        // the held pages count as served here.
        let held = kv.first_page * ps;
        let served = r.lease().served().capped(held);
        r.remote = Remote::No;
        r.computed = r.prompt_len;
        r.cached = kv.cached;
        r.running = true;
        let s = &mut self.snap;
        s.prompt_tokens += r.prompt_len as u64;
        s.cached_device_tokens += served.device as u64;
        s.cached_host_tokens += served.host as u64;
        s.cached_storage_tokens += served.storage as u64;
        s.transferred_prompt_tokens += (r.prompt_len - held) as u64;
        s.pd_held_prompt_tokens += held as u64;
        self.begin_decode(r, kv);
    }

    /// A request whose prompt's K/V are in its pages, computed elsewhere: reports it admitted
    /// (and its prompt's log probabilities), then takes the prefill worker's first token as
    /// its own and decodes on (or ends there).
    pub(super) fn begin_decode(&mut self, mut r: Req, kv: ImportedKv) {
        let _ = r.tx.send(Event::Admitted { cached: r.cached });
        if let Some(tokens) = kv.prompt_logprobs {
            prompt_logprobs::send(&r, tokens);
        }
        let first = kv.first_token;
        let stop = r.params.stop_token_ids.contains(&first)
            || (!r.params.ignore_eos && self.cfg.stop_token_ids.contains(&first));
        if stop {
            // As on one worker: the stop token's entry when the prompt's are asked for.
            if let Some(lp) = kv
                .first_logprobs
                .filter(|_| r.params.prompt_logprobs.is_some())
            {
                let _ = r.tx.send(Event::Logprobs(lp));
            }
            self.finish(r, Some(FinishReason::Stop));
            return;
        }
        // The prefill worker drew it from the same seed: this generator moves past that draw,
        // so the rest of the answer is the one a single worker gives for the seed.
        crate::sampler::skip_choice(&r.params, &mut r.rng);
        // The prefill worker chose it under the same constraint: this one follows it.
        let complete = match commit(r.constraint.as_deref_mut(), first) {
            Ok(c) => c,
            Err(e) => {
                self.finish(r, Some(FinishReason::Error(e)));
                return;
            }
        };
        r.tokens.push(first);
        r.generated = 1;
        self.snap.generated_tokens += 1;
        if let Some(lp) = kv.first_logprobs {
            let _ = r.tx.send(Event::Logprobs(lp));
        }
        let _ = r.tx.send(Event::Token(first));
        if complete {
            self.finish(r, Some(FinishReason::Stop));
        } else if r.generated >= r.params.max_tokens {
            self.finish(r, Some(FinishReason::Length));
        } else {
            self.active.push(r);
        }
    }
}
