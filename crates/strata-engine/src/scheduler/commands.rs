//! The scheduler's housekeeping: commands from the handle (submit, deliver, flush, snapshot,
//! shutdown), requests whose client went away or that waited past the queueing-time limit,
//! and aborting everything at shutdown.

use std::sync::atomic::Ordering;

use crate::request::{CachedTokens, Event, FinishReason, FlushScope};

use super::{Cmd, Req, Scheduler};

impl Scheduler {
    pub(super) fn command(&mut self, c: Cmd) {
        match c {
            Cmd::Submit(r) => {
                if self.cfg.fault_panic_token.is_some()
                    && r.prompt.first() == self.cfg.fault_panic_token.as_ref()
                {
                    panic!("fault injection: a prompt starting with the fault-panic token");
                }
                let seed = r
                    .params
                    .seed
                    .unwrap_or(r.id.wrapping_mul(0x2545_F491_4F6C_DD1D));
                self.waiting.push_back(Req::new(*r, seed));
            }
            Cmd::Deliver(id, kv) => self.deliver(id, *kv),
            Cmd::Flush(scope, reply) => {
                self.progress += 1;
                let _ = reply.send(self.flush(scope));
                self.publish();
            }
            Cmd::Shutdown { deadline } => self.deadline = Some(deadline),
            Cmd::CacheSnapshot(reply) => {
                self.publish();
                let log = self.shared.events.lock().expect("event log lock");
                let _ = reply.send((log.epoch, log.next, self.cache.snapshot()));
            }
        }
    }

    fn flush(&mut self, scope: FlushScope) -> (u64, u64) {
        self.cache.wait_all();
        let dev_before = self.cache.device_usage().pages_used;
        let host_before = self.cache.host_usage().pages_used;
        let all = self.cache.device_usage().pages_total as usize;
        self.cache.set_flushing(true);
        self.cache.evict_device(all);
        // Write-back victims are freed when their copies land.
        self.cache.wait_all();
        if scope == FlushScope::All {
            let all = self.cache.host_usage().pages_total as usize;
            self.cache.evict_host(all);
        }
        self.cache.set_flushing(false);
        let dev = dev_before.saturating_sub(self.cache.device_usage().pages_used);
        let host = host_before.saturating_sub(self.cache.host_usage().pages_used);
        let st = self.cache.stats();
        tracing::info!(
            device_pages = dev,
            host_pages = host,
            ?scope,
            backup_skipped_pages = st.backup_skipped_pages,
            storage_put_pages = st.storage_put.pages,
            storage_errors = st.storage_errors,
            "cache flushed (pages, not bytes)"
        );
        (dev, host)
    }

    pub(super) fn reap_cancelled(&mut self) {
        let mut i = 0;
        let limit = self.cfg.max_queue_time;
        while i < self.waiting.len() {
            let waited = self.waiting[i].arrived.elapsed();
            let late = limit.is_some_and(|l| waited > l);
            if self.waiting[i].tx.is_closed() || late {
                let r = self.waiting.remove(i).expect("index in range");
                // The head of the queue may have changed: admission is tried again.
                self.progress += 1;
                self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
                self.shared
                    .tokens_in_flight
                    .fetch_sub(r.budget, Ordering::SeqCst);
                if late {
                    self.snap.finished.queue_timeout += 1;
                    let _ = r.tx.send(Event::Done {
                        reason: FinishReason::QueueTimeout { waited },
                        prompt_tokens: r.prompt_len,
                        completion_tokens: 0,
                        cached: CachedTokens::default(),
                    });
                } else {
                    self.snap.finished.cancelled += 1;
                }
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.active.len() {
            // A settling request's client has its answer and may have gone.
            if self.active[i].tx.is_closed() && self.active[i].settling.is_none() {
                let r = self.active.swap_remove(i);
                self.finish(r, None);
            } else {
                i += 1;
            }
        }
    }

    pub(super) fn abort_all(&mut self) {
        for r in std::mem::take(&mut self.active) {
            self.finish(r, Some(FinishReason::Aborted));
        }
        while let Some(r) = self.waiting.pop_front() {
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            self.shared
                .tokens_in_flight
                .fetch_sub(r.budget, Ordering::SeqCst);
            self.snap.finished.aborted += 1;
            let _ = r.tx.send(Event::Done {
                reason: FinishReason::Aborted,
                prompt_tokens: r.prompt_len,
                completion_tokens: 0,
                cached: CachedTokens::default(),
            });
        }
    }
}
