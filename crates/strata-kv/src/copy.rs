//! Worker threads that move pages between tiers asynchronously.
//!
//! The cache submits a job with a ticket and polls completions; until a ticket is acknowledged
//! its pages stay locked in the tree, so no other party reads or frees them.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use crate::hash::PageHash;
use crate::layout::Class;
use crate::pool::{blob_len, copy_pages, DevicePool, Direction, HostPool};
use crate::storage::Storage;

/// Work for a copy worker.
#[derive(Debug)]
pub enum JobKind {
    /// (device page, host page) pairs of main pages and of window pages.
    Copy {
        dir: Direction,
        pairs: Vec<(u32, u32)>,
        window_pairs: Vec<(u32, u32)>,
    },
    /// Host pages to L3 under their hashes; a page with a host window page is written with
    /// its window part (`windows` is empty or one entry per page).
    Put {
        host_pages: Vec<u32>,
        windows: Vec<Option<u32>>,
        hashes: Vec<PageHash>,
    },
    /// L3 pages into host pages, in order; stops at the first miss. An entry's window part
    /// goes to the page's window page when it has one (`windows`: empty or one per page);
    /// [`Done::windows`] says which pages got theirs.
    Get {
        hashes: Vec<PageHash>,
        host_pages: Vec<u32>,
        windows: Vec<Option<u32>>,
    },
}

/// A finished job.
#[derive(Debug)]
pub struct Done {
    pub ticket: u64,
    pub bytes: u64,
    /// Pages that completed (for `Get`, the leading run that was found and intact).
    pub pages_ok: usize,
    pub nanos: u64,
    pub errors: u64,
    /// `Get`: per page found, whether its window part was written.
    pub windows: Vec<bool>,
}

/// The pools and the storage backend a job touches; `None` pools mean metadata-only (no bytes).
#[derive(Clone)]
pub struct Planes {
    pub device: Option<Arc<DevicePool>>,
    pub host: Option<Arc<HostPool>>,
    pub storage: Option<Arc<dyn Storage>>,
}

impl Planes {
    /// Runs one job on the calling thread.
    pub fn run(&self, ticket: u64, job: &JobKind) -> Done {
        let t0 = Instant::now();
        let mut done = Done {
            ticket,
            bytes: 0,
            pages_ok: 0,
            nanos: 0,
            errors: 0,
            windows: Vec::new(),
        };
        match job {
            JobKind::Copy {
                dir,
                pairs,
                window_pairs,
            } => {
                if let (Some(d), Some(h)) = (&self.device, &self.host) {
                    done.bytes = copy_pages(d, h, *dir, pairs, window_pairs);
                }
                done.pages_ok = pairs.len();
            }
            JobKind::Put {
                host_pages,
                windows,
                hashes,
            } => self.put(host_pages, windows, hashes, &mut done),
            JobKind::Get {
                hashes,
                host_pages,
                windows,
            } => self.get(hashes, host_pages, windows, &mut done),
        }
        done.nanos = t0.elapsed().as_nanos() as u64;
        done
    }
}

impl Planes {
    fn put(
        &self,
        host_pages: &[u32],
        windows: &[Option<u32>],
        hashes: &[PageHash],
        done: &mut Done,
    ) {
        let st = self.storage.as_ref().expect("put without storage");
        let window_of = |i: usize| windows.get(i).copied().flatten();
        // Batches keep round trips few (pipelined backends) and memory bounded.
        for (b, (ps, hs)) in host_pages
            .chunks(BATCH)
            .zip(hashes.chunks(BATCH))
            .enumerate()
        {
            let batch: Vec<(PageHash, Vec<u8>)> = ps
                .iter()
                .zip(hs)
                .enumerate()
                .map(|(j, (&p, h))| {
                    let w = window_of(b * BATCH + j);
                    let buf = match &self.host {
                        Some(host) => {
                            let mut buf = vec![0u8; blob_len(host.layout(), w)];
                            host.read_page(p, w, &mut buf);
                            buf
                        }
                        None => Vec::new(),
                    };
                    (*h, buf)
                })
                .collect();
            for (r, (_, buf)) in st.put_many(&batch).into_iter().zip(&batch) {
                match r {
                    Ok(()) => {
                        done.pages_ok += 1;
                        done.bytes += buf.len() as u64;
                    }
                    Err(_) => done.errors += 1,
                }
            }
        }
    }

    fn get(
        &self,
        hashes: &[PageHash],
        host_pages: &[u32],
        windows: &[Option<u32>],
        done: &mut Done,
    ) {
        let st = self.storage.as_ref().expect("get without storage");
        let (main, full) = self.host.as_ref().map_or((0, 0), |h| {
            (h.layout().class_bytes(Class::Main), h.layout().page_bytes())
        });
        // Only a consecutive run from the start is usable: stop at the first miss.
        'batches: for (b, (hs, ps)) in hashes
            .chunks(BATCH)
            .zip(host_pages.chunks(BATCH))
            .enumerate()
        {
            for (j, (r, &p)) in st.get_many(hs).into_iter().zip(ps).enumerate() {
                match r {
                    // An entry is the main part, or the main and window parts.
                    Ok(Some(data)) if data.len() == main || data.len() == full => {
                        let w = windows.get(b * BATCH + j).copied().flatten();
                        // Metadata-only (no bytes): a window comes back wherever one is asked.
                        let with_window = w.is_some()
                            && (self.host.is_none() || (data.len() == full && full > main));
                        if let Some(host) = &self.host {
                            if with_window {
                                host.write_page(p, w, &data);
                            } else {
                                host.write_page(p, None, &data[..main]);
                            }
                        }
                        done.windows.push(with_window);
                        done.pages_ok += 1;
                        done.bytes += data.len() as u64;
                    }
                    Ok(Some(_)) => {
                        // Intact entry of the wrong size: a layout mismatch, never used.
                        done.errors += 1;
                        break 'batches;
                    }
                    Ok(None) => break 'batches,
                    Err(_) => {
                        done.errors += 1;
                        break 'batches;
                    }
                }
            }
        }
    }
}

/// Pages per storage round trip.
const BATCH: usize = 16;

/// A pool of copy threads.
pub struct CopyEngine {
    tx: Option<Sender<(u64, JobKind)>>,
    done: Receiver<Done>,
    workers: Vec<JoinHandle<()>>,
}

impl CopyEngine {
    pub fn start(planes: Planes, threads: usize) -> CopyEngine {
        let (tx, rx) = crossbeam_channel::unbounded::<(u64, JobKind)>();
        let (dtx, drx) = crossbeam_channel::unbounded();
        let workers = (0..threads.max(1))
            .map(|i| {
                let rx = rx.clone();
                let dtx = dtx.clone();
                let planes = planes.clone();
                std::thread::Builder::new()
                    .name(format!("strata-copy-{i}"))
                    .spawn(move || {
                        for (t, job) in rx {
                            if dtx.send(planes.run(t, &job)).is_err() {
                                break;
                            }
                        }
                    })
                    .expect("spawn copy worker")
            })
            .collect();
        CopyEngine {
            tx: Some(tx),
            done: drx,
            workers,
        }
    }

    pub fn submit(&self, ticket: u64, job: JobKind) {
        self.tx
            .as_ref()
            .expect("engine running")
            .send((ticket, job))
            .expect("copy workers alive");
    }

    pub fn try_recv(&self) -> Option<Done> {
        self.done.try_recv().ok()
    }

    pub fn recv(&self) -> Done {
        self.done.recv().expect("copy workers alive")
    }
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        self.tx.take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
