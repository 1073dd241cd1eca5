//! A prefill worker's export: the prompt's pages leave in parts, in order, as its chunks are
//! computed ([`Event::Kv`] after each model call that completed pages), so their transfer
//! overlaps the chunks still to compute; the last part (the pages up to the prompt's end)
//! goes when the prompt is done.

use std::sync::Arc;

use strata_kv::TieredCache;
use strata_model::Runtime;

use crate::request::{Event, ExportedKv};

use super::{Req, Scheduler};

impl Scheduler {
    /// Sends the pages that running export requests completed in this call and that leave
    /// as they are (not at their prompt's end yet: that part goes with [`Scheduler::finish`]).
    /// A failed export ends nothing here: the request's last part reports it.
    pub(super) fn export_parts(&mut self) {
        for k in 0..self.active.len() {
            let r = &self.active[k];
            if r.export.is_none() || !r.running || r.computed >= r.prompt_len {
                continue;
            }
            let from = r.export_next.max(r.export.unwrap_or(0));
            let to = self.cache.exportable_pages(r.lease(), from, r.computed);
            if to > from {
                let r = &mut self.active[k];
                if let Ok(kv) = export_kv(&self.cache, self.model.as_ref(), r, from..to) {
                    let r = &mut self.active[k];
                    r.export_next = to;
                    let _ = r.tx.send(Event::Kv(Arc::new(kv)));
                    self.snap.pd_overlapped_pages += (to - from) as u64;
                }
            }
        }
    }

    /// The last part of a computed prompt's export: its pages not sent yet.
    pub(super) fn export_rest(&mut self, r: &mut Req) -> Result<ExportedKv, String> {
        let ps = self.cache.page_size();
        let from = r.export_next.max(r.export.unwrap_or(0));
        export_kv(
            &self.cache,
            self.model.as_ref(),
            r,
            from..r.prompt_len.div_ceil(ps),
        )
    }
}

/// Pages `pages` of a request's prompt out of the device pool, in the wire layout (the host
/// layout of the unsplit model), with their hashes.
fn export_kv(
    cache: &TieredCache,
    model: &dyn Runtime,
    r: &mut Req,
    pages: std::ops::Range<usize>,
) -> Result<ExportedKv, String> {
    let ps = cache.page_size();
    let n = r.prompt_len.div_ceil(ps);
    if r.export_hashes.len() != n {
        // The chain over the whole prompt, once (zero for a partial last page).
        let mut h: Vec<[u8; 16]> = cache
            .page_hashes(&r.tokens[..r.prompt_len])
            .into_iter()
            .map(|h| h.0)
            .collect();
        h.resize(n, [0; 16]);
        r.export_hashes = h;
    }
    let mut blobs = cache.export(r.lease(), pages.clone());
    for p in &mut blobs {
        if let Some(w) = model.page_to_wire(ps, p).map_err(|e| e.to_string())? {
            *p = w;
        }
    }
    Ok(ExportedKv {
        first: pages.start,
        pages: blobs,
        hashes: r.export_hashes[pages].to_vec(),
    })
}
