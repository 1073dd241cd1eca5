//! A decode worker's imported requests: the prompt's K/V computed by a prefill worker, put
//! in this server's layout and written to the pages reserved at admission.

use std::sync::atomic::Ordering;

use crate::request::FinishReason;

use super::{hint, localize, publish, Scheduler};

impl Scheduler {
    /// Admits the waiting request at the front, whose K/V arrived from a prefill worker:
    /// reserves its pages, writes the K/V, and starts decoding after the first token. False
    /// when the pages cannot be reserved now.
    pub(super) fn admit_imported(&mut self) -> bool {
        if let Err(e) = self.localize_import() {
            let r = self.waiting.pop_front().expect("front exists");
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            self.finish(r, Some(FinishReason::Error(e)));
            return true;
        }
        let r = self.waiting.front().expect("front exists");
        let kv = r.import.as_ref().expect("imported request");
        let new = r.params.max_tokens;
        let Some(mut lease) = self.cache.admit_computed(r.prompt_len, new, &kv.pages) else {
            if self.active.is_empty() && self.cache.in_flight() == 0 {
                // Nothing running frees pages: it never fits (it would block the queue).
                let r = self.waiting.pop_front().expect("front exists");
                self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
                let e = "the transferred prompt needs more device or window pages than this \
                         worker's pool holds";
                self.finish(r, Some(FinishReason::Error(e.into())));
                return true;
            }
            self.blocked_at = Some(self.progress);
            return false;
        };
        hint(&mut self.cache, &mut lease, &r.params);
        publish::observe(&mut self.cache, &self.cfg, r);
        let mut r = self.waiting.pop_front().expect("front exists");
        self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
        let mut kv = r.import.take().expect("imported request");
        if r.import_local == Some(false) {
            crate::transfer::recycle(std::mem::take(&mut kv.pages));
        }
        r.lease = Some(lease);
        r.computed = r.prompt_len;
        r.cached = kv.cached;
        r.running = true;
        self.snap.prompt_tokens += r.prompt_len as u64;
        self.snap.transferred_prompt_tokens += r.prompt_len as u64;
        self.begin_decode(r, kv);
        true
    }

    /// The front request's imported pages in this server's layout: a transfer carries the
    /// model's wire layout ([`Runtime::wire_kinds`]: tensor-parallel ranks re-shard). Once.
    fn localize_import(&mut self) -> Result<(), String> {
        let r = self.waiting.front_mut().expect("front exists");
        if r.import_local.is_some() {
            return Ok(());
        }
        let kv = r.import.as_mut().expect("imported request");
        r.import_local = Some(localize(
            self.model.as_ref(),
            self.cache.page_size(),
            &mut kv.pages,
        )?);
        Ok(())
    }
}
