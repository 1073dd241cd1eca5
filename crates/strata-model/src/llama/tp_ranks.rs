//! Tensor-parallel ranks inside one server, whatever the model: each rank's pinned thread pool,
//! the shared memory where they meet ([`Comm`], the [`Collective`] a rank's pass calls), and
//! running one pass on every rank ([`RankSet::run`]) or loading every rank's part
//! ([`RankSet::load`]). [`crate::llama::tp`] (llama family) and [`crate::deepseek4::tp`] (DeepSeek-V4)
//! split the model; this runs the ranks.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock};

use crate::error::ModelError;
use crate::shard::Collective;

/// The ranks' shared memory: one slot per rank and a barrier.
struct Comm {
    slots: Vec<RwLock<Vec<f32>>>,
    arrived: AtomicUsize,
    generation: AtomicUsize,
    /// A rank failed: the others leave the barrier (by panicking) instead of waiting.
    failed: AtomicBool,
}

impl Comm {
    fn new(ranks: usize) -> Comm {
        Comm {
            slots: (0..ranks).map(|_| RwLock::new(Vec::new())).collect(),
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
        }
    }

    fn ranks(&self) -> usize {
        self.slots.len()
    }

    /// Waits until every rank arrived: spins briefly (ranks usually arrive within
    /// microseconds of each other), then yields the CPU.
    fn barrier(&self) {
        let gen = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.ranks() {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == gen {
            if self.failed.load(Ordering::Acquire) {
                panic!("another tensor-parallel rank failed");
            }
            if spins < 4096 {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// After a failed call (every rank has returned): a fresh barrier.
    fn reset(&self) {
        self.arrived.store(0, Ordering::Relaxed);
        self.failed.store(false, Ordering::Release);
    }

    fn put(&self, rank: usize, x: &[f32]) {
        let mut s = self.slots[rank].write().unwrap_or_else(|p| p.into_inner());
        s.clear();
        s.extend_from_slice(x);
    }

    fn put_vec(&self, rank: usize, x: Vec<f32>) {
        *self.slots[rank].write().unwrap_or_else(|p| p.into_inner()) = x;
    }

    fn slot(&self, rank: usize) -> std::sync::RwLockReadGuard<'_, Vec<f32>> {
        self.slots[rank].read().unwrap_or_else(|p| p.into_inner())
    }
}

/// One rank's view of the [`Comm`].
struct RankComm<'a> {
    comm: &'a Comm,
    rank: usize,
}

impl Collective for RankComm<'_> {
    fn all_reduce(&self, x: &mut [f32]) {
        let c = self.comm;
        c.put(self.rank, x);
        c.barrier();
        x.copy_from_slice(&c.slot(0));
        for r in 1..c.ranks() {
            for (a, b) in x.iter_mut().zip(c.slot(r).iter()) {
                *a += b;
            }
        }
        c.barrier();
    }

    fn gather_vocab(&self, part: Vec<f32>, rows: usize) -> Option<Vec<f32>> {
        let c = self.comm;
        c.put_vec(self.rank, part);
        c.barrier();
        let out = (self.rank == 0).then(|| {
            let parts: Vec<_> = (0..c.ranks()).map(|r| c.slot(r)).collect();
            let cols: Vec<usize> = parts.iter().map(|p| p.len() / rows.max(1)).collect();
            let vocab: usize = cols.iter().sum();
            let mut out = Vec::with_capacity(rows * vocab);
            for i in 0..rows {
                for (p, &w) in parts.iter().zip(&cols) {
                    out.extend_from_slice(&p[i * w..(i + 1) * w]);
                }
            }
            out
        });
        c.barrier();
        // Rank 0 has read every part: no slot keeps a batch's logits until the next call.
        c.put_vec(self.rank, Vec::new());
        out
    }
}

/// Where a rank runs: the CPUs its threads are pinned to (None: anywhere) and the NUMA
/// node they belong to (for the logs and metrics).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankPlacement {
    pub node: Option<u32>,
    pub cpus: Option<Vec<usize>>,
}

/// Pins the calling thread to `cpus`.
fn pin_current(cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes inside it for indices below
    // CPU_SETSIZE (checked); sched_setaffinity reads `size_of::<cpu_set_t>()` bytes of it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            if c >= libc::CPU_SETSIZE as usize {
                return Err(std::io::Error::other(format!(
                    "CPU {c} is beyond CPU_SETSIZE"
                )));
            }
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A rank's thread pool: `threads` workers pinned to the placement's CPUs (checked on a
/// probe thread first, so a CPU this process may not use is an error here, not a silent
/// unpinned worker).
fn rank_pool(
    r: usize,
    threads: usize,
    place: &RankPlacement,
) -> Result<rayon::ThreadPool, ModelError> {
    let cpus = place.cpus.clone();
    if let Some(c) = &cpus {
        let probe = c.clone();
        std::thread::spawn(move || pin_current(&probe))
            .join()
            .map_err(|_| ModelError::Forward("the CPU-pinning probe panicked".into()))?
            .map_err(|e| {
                ModelError::Forward(format!("rank {r}: cannot pin threads to CPUs {c:?}: {e}"))
            })?;
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(move |i| format!("strata-tp{r}-{i}"))
        .start_handler(move |_| {
            if let Some(c) = &cpus {
                // Checked by the probe above; the same call on the same CPUs.
                let _ = pin_current(c);
            }
        })
        .build()
        .map_err(|e| ModelError::Forward(format!("rank {r}: thread pool: {e}")))
}

/// One rank's pass: its index and where it meets the others → rank 0's value (None on the
/// others).
pub(crate) type RankPass<'a, T> =
    dyn Fn(usize, &dyn Collective) -> Result<Option<T>, ModelError> + Sync + 'a;

/// What a rank's pass returns: rank 0's value, its error, or its panic.
type RankOut<T> = std::thread::Result<Result<Option<T>, ModelError>>;

/// The ranks' thread pools and where they meet.
pub(crate) struct RankSet {
    pools: Vec<rayon::ThreadPool>,
    comm: Comm,
    /// One pass at a time (the ranks share one [`Comm`]).
    busy: Mutex<()>,
}

impl RankSet {
    /// A pool of `threads` pinned workers per placement.
    pub(crate) fn new(placements: &[RankPlacement], threads: usize) -> Result<RankSet, ModelError> {
        let pools = placements
            .iter()
            .enumerate()
            .map(|(r, p)| rank_pool(r, threads, p))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(RankSet {
            comm: Comm::new(pools.len()),
            pools,
            busy: Mutex::new(()),
        })
    }

    /// Ranks.
    pub(crate) fn tp(&self) -> usize {
        self.pools.len()
    }

    /// `load(r)` for every rank at once, each on its rank's (pinned) workers, so the memory it
    /// fills is first touched on the rank's node.
    pub(crate) fn load<M: Send>(
        &self,
        load: &(dyn Fn(usize) -> Result<M, ModelError> + Sync),
    ) -> Result<Vec<M>, ModelError> {
        let out: Vec<Result<M, ModelError>> = std::thread::scope(|sc| {
            let hs: Vec<_> = self
                .pools
                .iter()
                .enumerate()
                .map(|(r, pool)| sc.spawn(move || pool.install(|| load(r))))
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(ModelError::Forward("a rank's loader panicked".into()))
                    })
                })
                .collect()
        });
        out.into_iter().collect()
    }

    /// Runs `pass(r, comm)` on every rank; returns rank 0's value (the others return None). A
    /// rank's error fails the call; a rank's panic panics here (on the caller's thread, where
    /// the engine sees it). Every check a rank would make must be made before: a rank that
    /// fails makes the others leave their barriers by panicking.
    pub(crate) fn run<T: Send>(&self, pass: &RankPass<'_, T>) -> Result<T, ModelError> {
        debug_assert!(
            rayon::current_thread_index().is_none(),
            "a tensor-parallel pass from a rayon worker"
        );
        let _busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        let comm = &self.comm;
        let slots: Vec<Mutex<Option<RankOut<T>>>> =
            (0..self.tp()).map(|_| Mutex::new(None)).collect();
        let run = |r: usize| {
            let c = RankComm { comm, rank: r };
            let out = catch_unwind(AssertUnwindSafe(|| pass(r, &c)));
            if !matches!(out, Ok(Ok(_))) {
                comm.failed.store(true, Ordering::Release);
            }
            *slots[r].lock().unwrap_or_else(|p| p.into_inner()) = Some(out);
        };
        self.run_ranks(1, &run);
        let results = slots.into_iter().map(|m| {
            let out = m.into_inner().unwrap_or_else(|p| p.into_inner());
            out.expect("every rank ran")
        });
        if comm.failed.load(Ordering::Acquire) {
            comm.reset();
        }
        let mut panics = Vec::new();
        let mut first = None;
        for (r, res) in results.into_iter().enumerate() {
            match res {
                Ok(Ok(v)) if r == 0 => first = v,
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(e),
                Err(p) => panics.push((r, panic_text(&*p))),
            }
        }
        let own = panics
            .iter()
            .find(|(_, m)| !m.contains("another tensor-parallel rank"));
        if let Some((r, m)) = own.or(panics.first()) {
            panic!("tensor-parallel rank {r} panicked: {m}");
        }
        Ok(first.expect("rank 0 returns the pass's value"))
    }

    /// Runs `run(r)` for every rank from `from` on as a job on rank r's pool (a scope per
    /// pool, borrowing the caller's stack), and rank 0 on its pool through `install`, the
    /// caller waiting: no thread is created per call, and nothing can fail to start once a
    /// rank waits. The caller must not be a rayon worker (it would run other jobs of its pool
    /// while it holds the model); the engine's scheduler thread and the tests' are not.
    fn run_ranks(&self, from: usize, run: &(dyn Fn(usize) + Sync)) {
        match self.pools.get(from) {
            None => self.pools[0].install(|| run(0)),
            Some(pool) => pool.in_place_scope(|s| {
                s.spawn(move |_| run(from));
                self.run_ranks(from + 1, run);
            }),
        }
    }
}

/// The message of a panic payload.
pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}
