//! Asking L3 which pages of a prompt it holds, off the caller's thread.
//!
//! Admission needs to know how much of a prompt past the tree's match L3 holds (a round trip
//! to Redis). Asked on the scheduler's thread, a Redis that stalls held every running stream
//! for up to the tier's timeout per admission. With a copy engine (a serving cache) the
//! question goes to a thread of its own: [`TieredCache::probe_ready`] asks and waits at most
//! [`PROBE_WAIT`] (a healthy tier answers within it, and admission goes on at once); past it
//! the caller leaves the request waiting, keeps running the others, and asks again once
//! [`TieredCache::poll`] has counted the answer (or the question was given up:
//! [`GIVE_UP`]). [`TieredCache::probe_ask`] asks for the requests queued behind, so their
//! answers are in when they reach the front. Admission ([`TieredCache::lookup`]) then uses the
//! answer, once; while a question is out or too many are (the tier is stalled), or the thread
//! has ended, it counts no L3 pages rather than wait. Without a copy engine (the simulator),
//! or for a caller that did not ask first, the question is asked in place, as before.

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use rustc_hash::FxHashMap;

use crate::hash::PageHash;
use crate::storage::{Storage, StorageError};

use super::TieredCache;

/// How long [`TieredCache::probe_ready`] waits for an answer before leaving the request to
/// wait on its own: a healthy tier answers in a round trip or two.
pub const PROBE_WAIT: Duration = Duration::from_millis(5);
/// How long an answer waits to be used (by the admission that asked; used once) before it is
/// dropped: the request may have gone meanwhile. One older than half of it is asked again, so
/// an answer found ready is still there when admission reads it.
const FRESH: Duration = Duration::from_secs(1);
/// How long a question may stay unanswered before its request is admitted without L3 pages:
/// the longest bound a tier puts on an operation (`--l3-timeout-ms` at most 10 s). A tier
/// whose own bound failed delays each request that asks by this.
const GIVE_UP: Duration = Duration::from_secs(10);
/// Questions unanswered at once past which the tier is taken as stalled: admissions go on
/// without L3 pages instead of queueing more questions.
const MAX_IN_FLIGHT: usize = 64;
/// Answers kept at most (past it they are all dropped: asked again when needed).
const MAX_ANSWERS: usize = 4096;

/// What is known of one prompt's pages in L3, keyed by the hash of its last whole page (which
/// names every token before it).
#[derive(Clone, Copy, Debug)]
enum Answer {
    Asked {
        from: usize,
        at: Instant,
    },
    /// From page `from` on, `held` pages in a row are held (as of `at`).
    Held {
        from: usize,
        held: usize,
        at: Instant,
    },
}

type Question = (PageHash, usize, Vec<PageHash>);
type Reply = (PageHash, usize, Result<usize, StorageError>, Instant);

/// The thread that asks L3, and its answers. Dropped, it lets the thread end after the
/// question it is on (not joined: a call that never returns must not hold a shutdown).
pub(super) struct Prober {
    tx: Sender<Question>,
    done: Receiver<Reply>,
    answers: FxHashMap<PageHash, Answer>,
    asked: usize,
    /// The thread ended (a tier that panicked): admission goes on without L3 pages from then on.
    dead: bool,
}

impl Prober {
    /// The prober of a cache with these planes: where it has L3 and a copy engine (a
    /// serving cache; the simulator asks in place).
    pub(super) fn of(planes: &crate::copy::Planes, engine: bool) -> Option<Prober> {
        planes.storage.clone().filter(|_| engine).map(Prober::start)
    }

    fn start(storage: std::sync::Arc<dyn Storage>) -> Prober {
        let (tx, rx) = crossbeam_channel::unbounded::<Question>();
        let (dtx, done) = crossbeam_channel::unbounded();
        std::thread::Builder::new()
            .name("strata-l3-probe".into())
            .spawn(move || {
                for (key, from, hashes) in rx {
                    let held = storage.prefix_len(&hashes);
                    if dtx.send((key, from, held, Instant::now())).is_err() {
                        break;
                    }
                }
            })
            .expect("spawn the L3 probe thread");
        Prober {
            tx,
            done,
            answers: FxHashMap::default(),
            asked: 0,
            dead: false,
        }
    }

    fn record(&mut self, (key, from, r, at): Reply, errors: &mut u64) {
        self.asked = self.asked.saturating_sub(1);
        let held = r.unwrap_or_else(|_| {
            *errors += 1;
            0
        });
        self.answers.insert(key, Answer::Held { from, held, at });
    }

    /// Answers that arrived, recorded, and questions given up ([`GIVE_UP`]: answered as none
    /// held); how many, the thread's end counted as one.
    fn absorb(&mut self, errors: &mut u64) -> usize {
        let mut k = 0;
        loop {
            match self.done.try_recv() {
                Ok(r) => self.record(r, errors),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    if !self.dead {
                        self.dead = true;
                        self.asked = 0;
                        k += 1;
                    }
                    break;
                }
            }
            k += 1;
        }
        let now = Instant::now();
        for a in self.answers.values_mut() {
            if let Answer::Asked { from, at } = *a {
                if now.duration_since(at) >= GIVE_UP {
                    // Still counted as out until it is answered.
                    *a = Answer::Held {
                        from,
                        held: 0,
                        at: now,
                    };
                    k += 1;
                }
            }
        }
        k
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
    /// answer younger than `fresh` covers it (asked from that page or before; asked from a
    /// later page, the tree has lost pages since: none).
    fn held_from(&self, key: &PageHash, from: usize, fresh: Duration) -> Option<usize> {
        match self.answers.get(key)? {
            Answer::Held { from: f, held, at } if at.elapsed() < fresh => Some(if from < *f {
                0
            } else {
                held.saturating_sub(from - f)
            }),
            _ => None,
        }
    }
}

/// Whether a question about `key` should go out now, or the caller can go on.
enum Step {
    /// Nothing to ask, an answer in, or the tier not waited on.
    Ready,
    /// A question is out.
    Waiting,
    /// Ask: the pages from page `from`, their hashes.
    Ask(PageHash, usize, Vec<PageHash>),
}

impl TieredCache {
    /// Whether admission can match `tokens` now without asking L3 on this thread: true when
    /// L3 is not asked off-thread, when no whole page past the tree's match is left to ask
    /// about, when an answer covers them, when the tier is taken as stalled, or when the
    /// question asked now is answered within [`PROBE_WAIT`]. False: the question is out; ask
    /// again after [`TieredCache::poll`] counts its answer (or its giving up).
    pub fn probe_ready(&mut self, tokens: &[u32]) -> bool {
        let key = match self.probe_step(tokens) {
            Step::Ready => return true,
            Step::Waiting => return false,
            Step::Ask(key, from, hashes) => {
                if !self.send_question(key, from, hashes) {
                    return true;
                }
                key
            }
        };
        let p = self.prober.as_mut().expect("asked");
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
                // The thread is gone: nothing will answer (counted at the next poll).
                Err(RecvTimeoutError::Disconnected) => return true,
            }
        }
    }

    /// Asks about `tokens` without waiting (a request queued behind the one admitted next:
    /// its answer is in when it reaches the front).
    pub fn probe_ask(&mut self, tokens: &[u32]) {
        if let Step::Ask(key, from, hashes) = self.probe_step(tokens) {
            self.send_question(key, from, hashes);
        }
    }

    /// What [`TieredCache::probe_ready`] and [`TieredCache::probe_ask`] do about `tokens`.
    fn probe_step(&mut self, tokens: &[u32]) -> Step {
        let Some(p) = &mut self.prober else {
            return Step::Ready;
        };
        p.absorb(&mut self.stats.storage_errors);
        p.prune();
        let ps = self.layout.page_size();
        let (dev, host) = self.tree.peek(tokens);
        let whole = tokens.len() / ps;
        let from = (dev + host) / ps;
        if whole <= from || p.dead {
            return Step::Ready;
        }
        let ns = self.tree.namespace().expect("storage implies hashing");
        let mut hashes = ns.chain(PageHash::ROOT, &tokens[..whole * ps], ps);
        let key = hashes[whole - 1];
        match p.answers.get(&key) {
            Some(Answer::Asked { .. }) => return Step::Waiting,
            Some(_) if p.held_from(&key, from, FRESH / 2).is_some() => return Step::Ready,
            _ if p.stalled() => return Step::Ready,
            _ => {}
        }
        hashes.drain(..from);
        Step::Ask(key, from, hashes)
    }

    /// Sends a question; false when the thread is gone.
    fn send_question(&mut self, key: PageHash, from: usize, hashes: Vec<PageHash>) -> bool {
        let p = self.prober.as_mut().expect("a prober asks");
        if p.tx.send((key, from, hashes)).is_err() {
            return false;
        }
        p.asked += 1;
        let at = Instant::now();
        p.answers.insert(key, Answer::Asked { from, at });
        true
    }

    /// Questions to L3 not answered yet (the caller polls while some are out).
    pub fn probes_in_flight(&self) -> usize {
        self.prober.as_ref().map_or(0, |p| p.asked)
    }

    /// Whether the thread that asks L3 has ended (a tier that panicked): L3's pages are not
    /// used by admission from then on.
    pub fn probe_thread_ended(&self) -> bool {
        self.prober.as_ref().is_some_and(|p| p.dead)
    }

    /// Answers that arrived since the last poll, recorded, and questions given up; how many.
    pub(super) fn absorb_probes(&mut self) -> usize {
        match &mut self.prober {
            Some(p) => p.absorb(&mut self.stats.storage_errors),
            None => 0,
        }
    }

    /// How many of `hashes` (the prompt's pages from page `from`, to its last whole page) L3
    /// holds in a row: the off-thread answer where there is one (used up: each admission asks
    /// anew, as L3 changes); none while the question is out, the tier is taken as stalled or
    /// the thread has ended (rather than wait here); else asked now (a caller that did not
    /// ask first: the simulator, a test). An error counts as none.
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
            if let Some(held) = p.held_from(key, from, FRESH) {
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
