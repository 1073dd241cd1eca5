//! Asking L3 which pages of a prompt it holds, off the caller's thread.
//!
//! Admission needs to know how much of a prompt past the tree's match L3 holds (a round trip
//! to Redis). Asked on the scheduler's thread, a Redis that stalls held every running stream
//! for up to the tier's timeout per admission. With a copy engine (a serving cache) the
//! question goes to a thread of its own: [`TieredCache::probe_ready`] asks and waits at most
//! [`PROBE_WAIT`] (a healthy tier answers within it, and admission goes on at once); past it
//! the caller leaves the request waiting, keeps running the others, and asks again once
//! [`TieredCache::poll`] has counted the answer. Admission ([`TieredCache::lookup`]) then uses
//! the answer; while a question is out or too many are (the tier is stalled) it counts no L3
//! pages rather than wait. Without a copy engine (the simulator), or for a caller that did not
//! ask first, the question is asked in place, as before.

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use rustc_hash::FxHashMap;

use crate::hash::PageHash;
use crate::storage::{Storage, StorageError};

use super::TieredCache;

/// How long [`TieredCache::probe_ready`] waits for an answer before leaving the request to
/// wait on its own: a healthy tier answers in a round trip or two.
pub const PROBE_WAIT: Duration = Duration::from_millis(5);
/// How long an answer waits to be used (by the admission that asked; used once) before it is
/// dropped: the request may have gone meanwhile.
const FRESH: Duration = Duration::from_secs(1);
/// Questions unanswered at once past which the tier is taken as stalled: admissions go on
/// without L3 pages instead of queueing more questions.
const MAX_IN_FLIGHT: usize = 64;
/// How long a question may stay unanswered before admission goes on without it: the longest
/// bound a tier puts on an operation (`--l3-timeout-ms` at most 10 s). A tier that never
/// answers (its own bound failed) delays a request by this, once.
const GIVE_UP: Duration = Duration::from_secs(10);
/// Answers kept at most (past it they are all dropped: asked again when needed).
const MAX_ANSWERS: usize = 4096;

/// What is known of one prompt's pages in L3, keyed by the hash of its last whole page (which
/// names every token before it).
#[derive(Clone, Copy, Debug)]
enum Answer {
    Asked {
        at: Instant,
    },
    /// From page `from` on, `held` pages in a row are held.
    Held {
        from: usize,
        held: usize,
        at: Instant,
    },
}

type Question = (PageHash, usize, Vec<PageHash>);
type Reply = (PageHash, usize, Result<usize, StorageError>);

/// The thread that asks L3, and its answers.
pub(super) struct Prober {
    tx: Option<Sender<Question>>,
    done: Receiver<Reply>,
    thread: Option<std::thread::JoinHandle<()>>,
    answers: FxHashMap<PageHash, Answer>,
    asked: usize,
    /// The thread ended (a tier that panicked): the tier counts as stalled from then on.
    dead: bool,
}

impl Prober {
    pub(super) fn start(storage: std::sync::Arc<dyn Storage>) -> Prober {
        let (tx, rx) = crossbeam_channel::unbounded::<Question>();
        let (dtx, done) = crossbeam_channel::unbounded();
        let thread = std::thread::Builder::new()
            .name("strata-l3-probe".into())
            .spawn(move || {
                for (key, from, hashes) in rx {
                    if dtx.send((key, from, storage.prefix_len(&hashes))).is_err() {
                        break;
                    }
                }
            })
            .expect("spawn the L3 probe thread");
        Prober {
            tx: Some(tx),
            done,
            thread: Some(thread),
            answers: FxHashMap::default(),
            asked: 0,
            dead: false,
        }
    }

    fn record(&mut self, (key, from, r): Reply, errors: &mut u64) {
        self.asked -= 1;
        let held = r.unwrap_or_else(|_| {
            *errors += 1;
            0
        });
        let at = Instant::now();
        self.answers.insert(key, Answer::Held { from, held, at });
    }

    /// Answers that arrived, recorded; how many.
    fn absorb(&mut self, errors: &mut u64) -> usize {
        let mut k = 0;
        loop {
            match self.done.try_recv() {
                Ok(r) => self.record(r, errors),
                Err(crossbeam_channel::TryRecvError::Empty) => return k,
                Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    self.dead = true;
                    return k;
                }
            }
            k += 1;
        }
    }

    /// Whether admission goes on without asking: the thread is gone, or too many questions
    /// are out.
    fn stalled(&self) -> bool {
        self.dead || self.asked >= MAX_IN_FLIGHT
    }

    /// Drops stale answers; past [`MAX_ANSWERS`], every answer (questions out stay).
    fn prune(&mut self) {
        let full = self.answers.len() > MAX_ANSWERS;
        self.answers.retain(|_, a| match a {
            Answer::Held { at, .. } => !full && at.elapsed() < FRESH,
            Answer::Asked { .. } => true,
        });
    }

    /// L3 pages in a row from page `from` of the prompt whose last whole page is `key`, where an
    /// answer covers it: asked from that page or before, and still fresh.
    fn held_from(&self, key: &PageHash, from: usize) -> Option<usize> {
        match self.answers.get(key)? {
            Answer::Held { from: f, held, at } if at.elapsed() < FRESH => Some(if from < *f {
                0
            } else {
                held.saturating_sub(from - f)
            }),
            _ => None,
        }
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl TieredCache {
    /// Whether admission can match `tokens` now without asking L3 on this thread: true when
    /// L3 is not asked off-thread, when no whole page past the tree's match is left to ask
    /// about, when a fresh answer covers them, when the tier is taken as stalled, when the
    /// question asked now is answered within [`PROBE_WAIT`], or when it has gone unanswered
    /// for [`GIVE_UP`]. False: the question is out; ask again after [`TieredCache::poll`]
    /// counts its answer.
    pub fn probe_ready(&mut self, tokens: &[u32]) -> bool {
        let Some(p) = &mut self.prober else {
            return true;
        };
        p.absorb(&mut self.stats.storage_errors);
        p.prune();
        let ps = self.layout.page_size();
        let (dev, host) = self.tree.peek(tokens);
        let whole = tokens.len() / ps;
        let from = (dev + host) / ps;
        if whole <= from {
            return true;
        }
        let ns = self.tree.namespace().expect("storage implies hashing");
        let mut hashes = ns.chain(PageHash::ROOT, &tokens[..whole * ps], ps);
        let key = hashes[whole - 1];
        match p.answers.get(&key) {
            // Not answered yet: wait, up to a bound (then admitted without L3 pages).
            Some(Answer::Asked { at }) => return p.dead || at.elapsed() >= GIVE_UP,
            Some(_) if p.held_from(&key, from).is_some() => return true,
            _ if p.stalled() => return true,
            _ => {}
        }
        hashes.drain(..from);
        let tx = p.tx.as_ref().expect("running");
        if tx.send((key, from, hashes)).is_err() {
            p.dead = true;
            return true;
        }
        p.asked += 1;
        let at = Instant::now();
        p.answers.insert(key, Answer::Asked { at });
        // A healthy tier answers within the wait: admission goes on in this same pass.
        let deadline = Instant::now() + PROBE_WAIT;
        loop {
            match p.done.recv_deadline(deadline) {
                Ok(r) => {
                    let mine = r.0 == key;
                    p.record(r, &mut self.stats.storage_errors);
                    if mine {
                        return true;
                    }
                }
                Err(RecvTimeoutError::Timeout) => return false,
                // The thread is gone: nothing will answer.
                Err(RecvTimeoutError::Disconnected) => {
                    p.dead = true;
                    return true;
                }
            }
        }
    }

    /// Questions to L3 not answered yet (the caller polls while some are out).
    pub fn probes_in_flight(&self) -> usize {
        self.prober.as_ref().map_or(0, |p| p.asked)
    }

    /// Answers that arrived since the last poll, recorded; how many.
    pub(super) fn absorb_probes(&mut self) -> usize {
        match &mut self.prober {
            Some(p) => p.absorb(&mut self.stats.storage_errors),
            None => 0,
        }
    }

    /// How many of `hashes` (the prompt's pages from page `from`, to its last whole page) L3
    /// holds in a row: the off-thread answer where there is one (used up: each admission
    /// asks anew, as L3 changes); none while the question is
    /// out or the tier is taken as stalled (rather than wait here); else asked now (a caller
    /// that did not ask first: the simulator, a test). An error counts as none.
    pub(super) fn storage_prefix(
        &mut self,
        st: &dyn Storage,
        from: usize,
        hashes: &[PageHash],
    ) -> usize {
        let Some(key) = hashes.last() else {
            return 0;
        };
        if let Some(p) = &mut self.prober {
            if let Some(held) = p.held_from(key, from) {
                // Used once: L3 changes (this cache writes to it), a later match asks anew.
                p.answers.remove(key);
                return held.min(hashes.len());
            }
            if p.stalled() || matches!(p.answers.get(key), Some(Answer::Asked { .. })) {
                return 0;
            }
        }
        st.prefix_len(hashes).unwrap_or_else(|_| {
            self.stats.storage_errors += 1;
            0
        })
    }
}
