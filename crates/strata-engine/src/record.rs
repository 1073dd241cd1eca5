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
//!   a new one begun: at most twice the cap on disk. Created with mode 0600, never through a
//!   symbolic link. A write that fails stops the recording (logged), never the engine.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The recorder; shared through [`crate::EngineConfig::record_trace`].
pub struct TraceRecorder {
    path: PathBuf,
    cap_bytes: u64,
    page_size: usize,
    key: [u8; 32],
    file: Option<File>,
    written: u64,
    began: Instant,
    last_ms: u64,
    /// Requests written, over every file.
    pub requests: u64,
}

impl std::fmt::Debug for TraceRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceRecorder")
            .field("path", &self.path)
            .field("cap_bytes", &self.cap_bytes)
            .finish_non_exhaustive()
    }
}

/// Ids are cut to this many bits (JSON readers keep integers up to 2^53 exactly).
const ID_BITS: u32 = 53;

impl TraceRecorder {
    /// Creates (or truncates) `path` with mode 0600, not through a symbolic link; blocks are
    /// pages of `page_size` tokens.
    pub fn create(path: &Path, cap_bytes: u64, page_size: usize) -> std::io::Result<Self> {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(std::io::Error::other)?;
        let mut r = TraceRecorder {
            path: path.to_path_buf(),
            cap_bytes: cap_bytes.max(1),
            page_size: page_size.max(1),
            key,
            file: None,
            written: 0,
            began: Instant::now(),
            last_ms: 0,
            requests: 0,
        };
        r.file = Some(open(path)?);
        Ok(r)
    }

    /// One request: its prompt, output budget and arrival. Nothing after a failed write.
    pub fn record(&mut self, prompt: &[u32], max_tokens: usize, arrived: Instant) {
        if self.file.is_none() {
            return;
        }
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
        if let Err(e) = self.write(line.as_bytes()) {
            tracing::warn!(path = %self.path.display(), error = %e, "trace recording stopped");
            self.file = None;
        }
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

    fn write(&mut self, line: &[u8]) -> std::io::Result<()> {
        if self.written > 0 && self.written + line.len() as u64 > self.cap_bytes {
            let mut old = self.path.clone().into_os_string();
            old.push(".1");
            std::fs::rename(&self.path, &old)?;
            self.file = Some(open(&self.path)?);
            self.written = 0;
        }
        let f = self.file.as_mut().expect("checked by the caller");
        f.write_all(line)?;
        self.written += line.len() as u64;
        self.requests += 1;
        Ok(())
    }
}

fn open(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

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
            let keys: Vec<&str> = l.as_object().unwrap().keys().map(|k| k.as_str()).collect();
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
        assert_eq!(r.requests, 40);
        let now = std::fs::metadata(&p).unwrap().len();
        let old = std::fs::metadata(d.path().join("t.jsonl.1")).unwrap().len();
        assert!(now <= 300 && old <= 300, "{now} {old}");
        let link = d.path().join("link.jsonl");
        std::os::unix::fs::symlink(d.path().join("elsewhere"), &link).unwrap();
        assert!(TraceRecorder::create(&link, 300, 16).is_err());
        assert!(!d.path().join("elsewhere").exists());
    }
}
