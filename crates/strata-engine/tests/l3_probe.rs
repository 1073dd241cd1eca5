//! An L3 that stalls or breaks does not stop the engine: which pages a prompt has in L3 is
//! asked off the scheduler's thread, so running requests keep decoding while a new one waits
//! for its answer, and a tier whose probe thread ends leaves no request waiting.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use strata_engine::*;
use strata_kv::hash::PageHash;
use strata_kv::storage::{MemoryStorage, Storage, StorageError, StorageStats};

mod common;
use common::*;

/// An L3 whose `exists` waits while its gate is shut (at most a minute), or panics.
struct Gated {
    inner: MemoryStorage,
    shut: Mutex<bool>,
    cv: Condvar,
    waiting: AtomicUsize,
    panics: AtomicBool,
}

impl Gated {
    fn new() -> Arc<Gated> {
        Arc::new(Gated {
            inner: MemoryStorage::new(u64::MAX, 1 << 20),
            shut: Mutex::new(false),
            cv: Condvar::new(),
            waiting: AtomicUsize::new(0),
            panics: AtomicBool::new(false),
        })
    }
    fn set(&self, shut: bool) {
        *self.shut.lock().unwrap() = shut;
        self.cv.notify_all();
    }
}

impl Storage for Gated {
    fn tier(&self) -> &'static str {
        "remote"
    }
    fn exists(&self, hashes: &[PageHash]) -> Result<Vec<bool>, StorageError> {
        assert!(
            !self.panics.load(Ordering::SeqCst),
            "a tier that panics (this test)"
        );
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let g = self.shut.lock().unwrap();
        let wait = Duration::from_secs(60);
        let (g, t) = self.cv.wait_timeout_while(g, wait, |s| *s).unwrap();
        drop(g);
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        if t.timed_out() {
            return Err(StorageError::Timeout(wait));
        }
        self.inner.exists(hashes)
    }
    fn get(&self, h: &PageHash) -> Result<Option<Vec<u8>>, StorageError> {
        self.inner.get(h)
    }
    fn put(&self, h: &PageHash, d: &[u8]) -> Result<(), StorageError> {
        self.inner.put(h, d)
    }
    fn delete(&self, h: &PageHash) -> Result<bool, StorageError> {
        self.inner.delete(h)
    }
    fn stats(&self) -> StorageStats {
        self.inner.stats()
    }
}

fn until(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(50), "{what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A request admitted while L3 does not answer waits for its answer; the one already running
/// keeps decoding meanwhile (its tokens come while the question is still unanswered), and
/// the waiting one runs once L3 answers.
#[test]
fn a_stalled_l3_holds_up_no_running_request() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let st = Gated::new();
    let e = start(&path, 64, 64, Some(st.clone()), EngineConfig::default());
    let mut a = e.submit(prompt(8, 1), greedy(500)).unwrap();
    first_token(&mut a);
    st.set(true);
    let b = std::thread::spawn({
        let e = e.clone();
        move || run(&e, &prompt(48, 2), greedy(4))
    });
    until("the new request's question never reached L3", || {
        st.waiting.load(Ordering::SeqCst) > 0
    });
    let before = e.snapshot().generated_tokens;
    until("nothing decoded while L3 stalls", || {
        e.snapshot().generated_tokens >= before + 20
    });
    assert!(
        st.waiting.load(Ordering::SeqCst) > 0,
        "the question was answered before the tokens came: not a stall"
    );
    st.set(false);
    let (out, _, reason) = b.join().unwrap();
    assert_eq!((out.len(), reason), (4, FinishReason::Length));
    drop(a);
    e.shutdown(Duration::from_secs(5));
}

/// An L3 that panics ends the probe thread: requests are still admitted (without L3 pages),
/// none waits for an answer that cannot come.
#[test]
fn an_l3_that_panics_leaves_no_request_waiting() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let st = Gated::new();
    st.panics.store(true, Ordering::SeqCst);
    let e = start(&path, 64, 64, Some(st), EngineConfig::default());
    for salt in 0..3 {
        let (out, cached, reason) = run(&e, &prompt(48, salt), greedy(4));
        assert_eq!((out.len(), reason), (4, FinishReason::Length));
        assert_eq!(cached.storage, 0);
    }
    e.shutdown(Duration::from_secs(5));
}
