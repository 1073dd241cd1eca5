//! A finished request's answer, computed again as prompt rows before it joins the cache
//! ([`CacheOutputs::Exact`]). A decode step computes its position's K/V with other kernels
//! than a prompt row (8-bit activations, attention that reads the pages alone), so a later
//! prompt that extends a cached answer (a conversation's next turn) would read K/V that a
//! fresh computation of that prompt never makes, and answer with other bits than an uncached
//! worker. So when the last token is chosen the request stays: its generated positions become
//! its prompt's tail, computed in the batch's prefill chunks like any prompt's, then committed,
//! and only then is its client told `Done` (what a client sees after `Done`, the cache and the
//! counters, is as final as without this step). Its client leaving does not cancel it.

use std::sync::atomic::Ordering;

use crate::config::CacheOutputs;
use crate::request::FinishReason;

use super::{Req, Scheduler};

/// What a settling request reports once its answer is cached.
pub(super) struct Settling {
    /// Why it finished (what its client is told).
    reason: FinishReason,
    /// Its prompt's length (its generated positions are the prompt's tail meanwhile).
    prompt_len: usize,
}

impl Scheduler {
    /// Whether `r`, answered, computes its answer again before it is cached.
    /// Not once shutdown has begun (the work would be aborted with the rest), nor for a
    /// request with window pages: its positions cannot be computed twice (no model with window
    /// kinds says its decode rows differ).
    pub(super) fn settles(&self, r: &Req) -> bool {
        r.running
            && self.deadline.is_none()
            && self.cfg.prefix_cache
            && self.cfg.cache_outputs == CacheOutputs::Exact
            && r.computed > r.prompt_len
            && r.lease.as_ref().is_some_and(|l| l.windows().is_empty())
            && self.model.decode_rows_differ()
    }

    /// `r` ends (`ok`: answered; `cancelled`: its client left): its whole pages join the tree,
    /// the rest return to the pool, and its tokens leave the bound. An answer's pages join up
    /// to its end (its prompt's under [`CacheOutputs::Off`]); a cancelled request's up to its
    /// prompt's end, as far as it was computed (a client that retries finds them; its
    /// generated positions are not the bits a prompt row stores); a failed one's not at all.
    pub(super) fn keep(&mut self, r: &mut Req, ok: bool, cancelled: bool) {
        if let Some(lease) = r.lease.take() {
            let upto = match (ok, cancelled, self.cfg.cache_outputs) {
                (true, _, CacheOutputs::Off) | (false, true, _) => r.computed.min(r.prompt_len),
                (true, _, _) => r.computed,
                (false, false, _) => 0,
            };
            if upto > 0 && r.running && self.cfg.prefix_cache {
                self.cache.commit(lease, &r.tokens, upto);
            } else {
                self.cache.release(lease);
            }
        }
        self.shared
            .tokens_in_flight
            .fetch_sub(r.budget, Ordering::SeqCst);
    }

    /// Answered `r` (`reason`) stays to compute its generated positions that have K/V (all
    /// but the last token) again as prompt rows.
    pub(super) fn settle(&mut self, mut r: Req, reason: FinishReason) {
        let prompt_len = r.prompt_len;
        r.tokens.truncate(r.computed);
        r.prompt_len = r.computed;
        r.computed = prompt_len;
        r.settling = Some(Settling { reason, prompt_len });
        // Nothing of the step reaches its client: no constraint, no log probabilities, no
        // export (a prefill worker's first token was sent).
        r.constraint = None;
        r.params.prompt_logprobs = None;
        r.export = None;
        self.active.push(r);
    }

    /// A settling request's end: its answer computed again (`Stop`) joins the cache;
    /// otherwise (aborted at shutdown, a failed model call) nothing of it is cached. Either
    /// way its client is told why its answer ended.
    pub(super) fn settled(&mut self, mut r: Req, s: Settling, end: Option<FinishReason>) {
        self.progress += 1;
        let ok = matches!(end, Some(FinishReason::Stop));
        if ok {
            self.snap.settled_tokens += (r.prompt_len - s.prompt_len) as u64;
        }
        self.keep(&mut r, ok, false);
        r.prompt_len = s.prompt_len;
        self.report(r, Some(s.reason));
    }
}
