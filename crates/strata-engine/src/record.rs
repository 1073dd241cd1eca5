//! `strata serve --record-trace FILE`: the requests this worker serves, as a Mooncake-format
//! trace (`timestamp` in ms since the recording began, `input_length`, `output_length`,
//! `hash_ids`), so that `strata sim --block-tokens P --page-size P` (P: the worker's page size)
//! replays the operator's own traffic.
//!
//! * **No token ids, no text.** A block is one page of the prompt; its id is a keyed chain hash
//!   (BLAKE3 under this process's random key) of the page and every page before it, cut to
//!   53 bits (exact in any JSON reader): equal prefixes give equal ids within one recording,
//!   and nothing in the file says which tokens they were, nor links it to another process's.
//! * **Order.** A request is written when the worker's cache observes it (the miss-ratio
//!   curve's order: admission), with its arrival time (never before the line above it) and
//!   its output budget (`max_tokens`) as `output_length`.
//! * **Bounded.** Past `cap_bytes` the file is renamed `FILE.1` (replacing the one before) and
//!   a new one begun (never an existing one): at most twice the cap on disk. A path that no
//!   longer names the file written (moved away and replaced) is not rotated: the recording
//!   stops. (A file swapped in between that check and the rename is still renamed to
//!   `FILE.1`: the new file is then created only where no file is, or the recording stops.)
//! * **Safe to point anywhere.** The file must be a regular file of this user with one link,
//!   opened without following a symbolic link and without blocking (a FIFO is refused), and is
//!   set to mode 0600 whatever it was. An existing file is overwritten only if it is empty or a
//!   trace (its first line begins as this recorder's do): a model, a config, anything else
//!   named by mistake is refused, never truncated. One recording holds the file's lock: a second
//!   process given the same file is refused.
//! * **Off the request path.** The scheduler hashes a request's pages and hands the line to a
//!   writer thread through a bounded queue: a slow disk drops lines (counted), never slows
//!   decoding; a write that fails stops the recording (logged), never the engine.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;

/// Lines waiting for the writer at most (beyond: dropped, counted).
const QUEUE: usize = 4096;

/// The recorder; shared through [`crate::EngineConfig::record_trace`].
pub struct TraceRecorder {
    page_size: usize,
    key: [u8; 32],
    began: Instant,
    last_ms: u64,
    tx: SyncSender<Msg>,
    counts: Arc<Counts>,
}

/// What the writer did: lines written, lines dropped (queue full or recording stopped).
#[derive(Debug, Default)]
pub struct Counts {
    pub written: AtomicU64,
    pub dropped: AtomicU64,
}

enum Msg {
    Line(String),
    /// Answered once every line before it is written.
    Sync(SyncSender<()>),
}

impl std::fmt::Debug for TraceRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceRecorder")
            .field("counts", &self.counts)
            .finish_non_exhaustive()
    }
}

/// Ids are cut to this many bits (JSON readers keep integers up to 2^53 exactly).
const ID_BITS: u32 = 53;

impl TraceRecorder {
    /// Opens (or creates) `path` as [`open_file`] does and starts its writer; blocks are pages
    /// of `page_size` tokens.
    pub fn create(path: &Path, cap_bytes: u64, page_size: usize) -> std::io::Result<Self> {
        Self::start(path, open_file(path)?, cap_bytes, page_size)
    }

    /// Starts the writer on `file`, opened by [`open_file`] (before anything was allocated).
    pub fn start(
        path: &Path,
        file: File,
        cap_bytes: u64,
        page_size: usize,
    ) -> std::io::Result<Self> {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(std::io::Error::other)?;
        let file = Some(file);
        let (tx, rx) = sync_channel(QUEUE);
        let counts = Arc::new(Counts::default());
        let w = Writer {
            path: path.to_path_buf(),
            cap_bytes: cap_bytes.max(1),
            file,
            written: 0,
            counts: counts.clone(),
        };
        std::thread::Builder::new()
            .name("strata-trace".into())
            .spawn(move || w.run(rx))?;
        Ok(TraceRecorder {
            page_size: page_size.max(1),
            key,
            began: Instant::now(),
            last_ms: 0,
            tx,
            counts,
        })
    }

    /// One request: its prompt, output budget and arrival. Never waits for the disk.
    pub fn record(&mut self, prompt: &[u32], max_tokens: usize, arrived: Instant) {
        let ms = arrived.saturating_duration_since(self.began).as_millis() as u64;
        self.last_ms = self.last_ms.max(ms);
        let ids = self.hash_ids(prompt);
        let line = format!(
            "{{\"timestamp\":{},\"input_length\":{},\"output_length\":{},\"hash_ids\":[{}]}}\n",
            self.last_ms,
            prompt.len(),
            max_tokens,
            ids.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
        );
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) =
            self.tx.try_send(Msg::Line(line))
        {
            self.counts.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Waits until every line recorded so far is written (or dropped).
    pub fn sync(&self) {
        let (tx, rx) = sync_channel(1);
        if self.tx.send(Msg::Sync(tx)).is_ok() {
            let _ = rx.recv();
        }
    }

    /// Lines written and dropped so far.
    pub fn counts(&self) -> &Counts {
        &self.counts
    }

    /// One id per page of the prompt (the last one partial), chained.
    fn hash_ids(&self, prompt: &[u32]) -> Vec<u64> {
        let mut parent = [0u8; 32];
        prompt
            .chunks(self.page_size)
            .map(|page| {
                let mut h = blake3::Hasher::new_keyed(&self.key);
                h.update(&parent);
                h.update(&(page.len() as u64).to_le_bytes());
                for t in page {
                    h.update(&t.to_le_bytes());
                }
                parent = *h.finalize().as_bytes();
                u64::from_le_bytes(parent[..8].try_into().expect("8 bytes")) >> (64 - ID_BITS)
            })
            .collect()
    }
}

/// The writer thread's side: the file, its size, the rotation.
struct Writer {
    path: PathBuf,
    cap_bytes: u64,
    file: Option<File>,
    written: u64,
    counts: Arc<Counts>,
}

impl Writer {
    fn run(mut self, rx: Receiver<Msg>) {
        // Ends when the recorder (the sender) is dropped.
        while let Ok(m) = rx.recv() {
            match m {
                Msg::Sync(done) => {
                    let _ = done.send(());
                }
                Msg::Line(_) if self.file.is_none() => {
                    self.counts.dropped.fetch_add(1, Ordering::Relaxed);
                }
                Msg::Line(line) => match self.write(line.as_bytes()) {
                    Ok(()) => {
                        self.counts.written.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        tracing::warn!(path = %self.path.display(), error = %e, "trace recording stopped");
                        self.counts.dropped.fetch_add(1, Ordering::Relaxed);
                        self.file = None;
                    }
                },
            }
        }
    }

    fn write(&mut self, line: &[u8]) -> std::io::Result<()> {
        if self.written > 0 && self.written + line.len() as u64 > self.cap_bytes {
            self.still_ours()?;
            let mut old = self.path.clone().into_os_string();
            old.push(".1");
            std::fs::rename(&self.path, &old)?;
            self.file = open(&self.path, true)?;
            self.written = 0;
        }
        let f = self.file.as_mut().expect("checked by the caller");
        f.write_all(line)?;
        self.written += line.len() as u64;
        Ok(())
    }

    /// An error unless the path still names the file being written: one moved away and
    /// replaced (by an operator, another program) is not renamed over `FILE.1` and written
    /// after; the recording stops instead.
    fn still_ours(&self) -> std::io::Result<()> {
        let f = self
            .file
            .as_ref()
            .expect("checked by the caller")
            .metadata()?;
        let named = std::fs::symlink_metadata(&self.path);
        match named {
            Ok(m) if (m.dev(), m.ino()) == (f.dev(), f.ino()) => Ok(()),
            _ => Err(std::io::Error::other(format!(
                "{} is no longer the file this recording writes (moved or replaced): not rotated",
                self.path.display()
            ))),
        }
    }
}

/// How every line this recorder writes begins: an existing file that does not is no trace.
const LINE_START: &[u8] = b"{\"timestamp\":";

/// The trace file of `strata serve --record-trace`, opened (or created) before anything is
/// allocated, emptied and locked, as [`open`] with `fresh` false does.
pub fn open_file(path: &Path) -> std::io::Result<File> {
    Ok(open(path, false)?.expect("open gives a file"))
}

/// Opens `path` for writing, truncated: never through a symbolic link, never blocking (a FIFO
/// without a reader is refused), created with mode 0600 (`fresh`: only a new file, else an
/// existing one too, which must be a regular file of this user with one link, empty or a trace
/// (never another file named by mistake), and is set to 0600), and locked (another process
/// recording into it is refused).
fn open(path: &Path, fresh: bool) -> std::io::Result<Option<File>> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let mut o = OpenOptions::new();
    o.read(true)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC);
    if fresh {
        o.create_new(true);
    } else {
        o.create(true);
    }
    let f = o.open(path)?;
    let m = f.metadata()?;
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if !m.file_type().is_file() || m.nlink() != 1 || m.uid() != me {
        return Err(std::io::Error::other(format!(
            "{}: not a regular file of this user with one link",
            path.display()
        )));
    }
    if m.len() > 0 {
        let mut start = [0u8; LINE_START.len()];
        let n = f.read_at(&mut start, 0)?;
        let trace =
            LINE_START.starts_with(&start[..n]) && (n == start.len() || n as u64 == m.len());
        if !trace {
            return Err(std::io::Error::other(format!(
                "{} holds {} bytes that are not a trace (a trace's lines begin `{{\"timestamp\":`): not overwritten; name a new file",
                path.display(),
                m.len()
            )));
        }
    }
    // SAFETY: flock(2) on this open file's descriptor, which outlives the call.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(std::io::Error::new(
            e.kind(),
            format!("{}: another process records into it ({e})", path.display()),
        ));
    }
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    f.set_len(0)?;
    Ok(Some(f))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_holds_lengths_and_chained_ids_and_no_token() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.jsonl");
        let mut r = TraceRecorder::create(&p, 1 << 20, 4).unwrap();
        let t0 = Instant::now();
        let a: Vec<u32> = (1000..1010).collect();
        let mut b = a[..8].to_vec();
        b.extend([7, 7, 7, 7, 7]);
        r.record(&a, 5, t0);
        r.record(&b, 3, t0);
        r.sync();
        let text = std::fs::read_to_string(&p).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        let ids = |i: usize| -> Vec<u64> {
            let v = lines[i]["hash_ids"].as_array().unwrap();
            v.iter().map(|x| x.as_u64().unwrap()).collect()
        };
        assert_eq!(lines[0]["input_length"], 10);
        assert_eq!(lines[0]["output_length"], 5);
        assert_eq!((ids(0).len(), ids(1).len()), (3, 4));
        // Two shared pages, then different ones.
        assert_eq!(ids(0)[..2], ids(1)[..2]);
        assert_ne!(ids(0)[2], ids(1)[2]);
        assert!(ids(0).iter().all(|&x| x < 1 << ID_BITS));
        for l in &lines {
            let mut keys: Vec<&str> = l.as_object().unwrap().keys().map(|k| k.as_str()).collect();
            keys.sort();
            assert_eq!(
                keys,
                ["hash_ids", "input_length", "output_length", "timestamp"]
            );
        }
        for t in a.iter().chain(&b) {
            assert!(!ids(0).contains(&(*t as u64)) && !ids(1).contains(&(*t as u64)));
        }
        let mode = std::fs::metadata(&p).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // Another recorder (another key) names the same pages otherwise.
        let q = d.path().join("u.jsonl");
        let r2 = TraceRecorder::create(&q, 1 << 20, 4).unwrap();
        assert_ne!(r2.hash_ids(&a), ids(0));
    }

    #[test]
    fn the_file_rotates_at_its_cap_and_refuses_a_symbolic_link() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.jsonl");
        let mut r = TraceRecorder::create(&p, 300, 16).unwrap();
        for i in 0..40u32 {
            r.record(&[i; 64], 1, Instant::now());
        }
        r.sync();
        assert_eq!(r.counts().written.load(Ordering::Relaxed), 40);
        let now = std::fs::metadata(&p).unwrap().len();
        let old = std::fs::metadata(d.path().join("t.jsonl.1")).unwrap().len();
        assert!(now <= 300 && old <= 300, "{now} {old}");
        drop(r);
        let link = d.path().join("link.jsonl");
        std::os::unix::fs::symlink(d.path().join("elsewhere"), &link).unwrap();
        assert!(TraceRecorder::create(&link, 300, 16).is_err());
        assert!(!d.path().join("elsewhere").exists());
        // A FIFO (it would block), a second link, a loose mode: refused, or tightened.
        let fifo = d.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo(3) on a NUL-terminated path in this test's own directory.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(TraceRecorder::create(&fifo, 300, 16).is_err());
        let linked = d.path().join("linked");
        std::fs::hard_link(&p, &linked).unwrap();
        assert!(TraceRecorder::create(&p, 300, 16).is_err());
        std::fs::remove_file(&linked).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)).unwrap();
        let _r = once_free(&p);
        let mode = std::fs::metadata(&p).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    /// A trace file moved away and replaced by another file is not rotated over `FILE.1`:
    /// the other file is left whole, the recording stops (lines counted as dropped).
    #[test]
    fn a_replaced_file_is_not_rotated() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.jsonl");
        let mut r = TraceRecorder::create(&p, 300, 16).unwrap();
        r.record(&[1; 64], 1, Instant::now());
        r.sync();
        std::fs::rename(&p, d.path().join("moved.jsonl")).unwrap();
        std::fs::write(&p, b"someone else's").unwrap();
        for i in 0..40u32 {
            r.record(&[i; 64], 1, Instant::now());
        }
        r.sync();
        assert_eq!(std::fs::read(&p).unwrap(), b"someone else's");
        assert!(!d.path().join("t.jsonl.1").exists());
        assert!(r.counts().dropped.load(Ordering::Relaxed) > 0);
    }

    /// A file that is not a trace (a model, a config named by mistake) is refused and left
    /// whole; a trace or an empty file is taken; a second recording into one file is refused.
    #[test]
    fn only_a_trace_is_overwritten_and_one_recording_holds_the_file() {
        let d = tempfile::tempdir().unwrap();
        let model = d.path().join("model.gguf");
        std::fs::write(&model, b"GGUF\x03\x00\x00\x00 weights").unwrap();
        let e = TraceRecorder::create(&model, 300, 16).unwrap_err();
        assert!(e.to_string().contains("not a trace"), "{e}");
        assert_eq!(
            std::fs::read(&model).unwrap(),
            b"GGUF\x03\x00\x00\x00 weights"
        );
        let short = d.path().join("short");
        std::fs::write(&short, b"{").unwrap();
        assert!(
            TraceRecorder::create(&short, 300, 16).is_ok(),
            "a trace cut short"
        );
        let p = d.path().join("t.jsonl");
        let mut r = TraceRecorder::create(&p, 1 << 20, 16).unwrap();
        r.record(&[1; 16], 1, Instant::now());
        r.sync();
        // Another process's recording (a second open file description) is refused.
        let e = open_file(&p).unwrap_err();
        assert!(
            e.to_string().contains("another process records into it"),
            "{e}"
        );
        drop(r);
        // Once the first is gone (its writer thread closes the file), its trace is taken.
        let _r = once_free(&p);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 0);
    }

    /// A recorder on `p` once the one before it has let the file go (its writer thread ends
    /// after the recorder is dropped).
    fn once_free(p: &Path) -> TraceRecorder {
        for _ in 0..500 {
            match TraceRecorder::create(p, 300, 16) {
                Ok(r) => return r,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(std::time::Duration::from_millis(10))
                }
                Err(e) => panic!("{e}"),
            }
        }
        panic!("{} still locked after 5 s", p.display());
    }
}
