//! Tensor-parallel ranks of a llama-family model inside one server.
//!
//! Each rank is a [`Model`] holding its [`Part`]: the Q/K/V rows of its heads and the output
//! projection's columns over them, its slice of the feed-forward (gate/up rows, down
//! columns), and its rows of the vocabulary (embedding lookup and vocabulary projection). Its
//! K/V go to its own pool kind (`kv.tpR`, its KV heads only) in every page, so one radix tree
//! and one page allocator serve all ranks: a page is allocated in every rank's pool at once.
//!
//! Each rank has its own rayon pool whose workers are pinned to the rank's CPUs (its NUMA
//! node's, [`RankPlacement`]); a rank's weights are copied out of the file by those workers,
//! so the kernel's first-touch policy puts them on the rank's node. A call runs each rank as a
//! job on its own pool while the caller waits: no thread is started per call. The ranks meet
//! in [`Comm`] over shared memory: an all-reduce after each output and down projection (and
//! after the embedding lookup), a gather of the vocabulary's parts at the end. Every rank
//! adds the partial sums in rank order, so all ranks hold the same hidden state bit for bit;
//! the sum differs from one rank's by rounding, and where a rank's input columns do not fall
//! on the format's blocks (a K-quant's 256-column super-blocks split by heads) by that slice's
//! requantization to Q8_0 (greedy outputs equal TP 1's in the tests).

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock};

use strata_kv::pool::DevicePool;
use strata_kv::PoolKind;

use crate::error::ModelError;
use crate::gguf::{Config, Gguf};
use crate::model::{check_seq, Model, SeqInput};
use crate::shard::Collective;
pub use crate::shard::Part;

/// The ranks' shared memory: one slot per rank and a barrier.
pub(crate) struct Comm {
    slots: Vec<RwLock<Vec<f32>>>,
    arrived: AtomicUsize,
    generation: AtomicUsize,
    /// A rank failed: the others leave the barrier (by panicking) instead of waiting.
    failed: AtomicBool,
}

impl Comm {
    pub(crate) fn new(ranks: usize) -> Comm {
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

struct Rank {
    model: Model,
    pool: rayon::ThreadPool,
}

/// What a rank's pass returns: its logits (rank 0), its error, or its panic.
type RankOut = std::thread::Result<Result<Option<Vec<Vec<f32>>>, ModelError>>;

/// A llama-family model split over tensor-parallel ranks (see the module notes).
pub struct TpModel {
    config: Config,
    parts: Vec<Part>,
    ranks: Vec<Rank>,
    comm: Comm,
    /// One forward call at a time (the ranks share one [`Comm`]).
    busy: Mutex<()>,
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

/// How to load a [`TpModel`].
#[derive(Clone, Debug)]
pub struct TpOptions {
    /// One per rank: the rank count is its length.
    pub placements: Vec<RankPlacement>,
    pub threads_per_rank: usize,
    pub quantized_decode: bool,
}

impl TpModel {
    /// Loads each rank's part on the rank's own (pinned) threads.
    pub fn load(path: &std::path::Path, opts: &TpOptions) -> Result<TpModel, ModelError> {
        let tp = opts.placements.len();
        let g = Gguf::open(path)?;
        let config = g.config.clone();
        let ffn_block = g.block_weights("blk.0.ffn_down.weight").unwrap_or(32);
        drop(g);
        let parts = Part::split(&config, tp, ffn_block)?;
        let pools = opts
            .placements
            .iter()
            .enumerate()
            .map(|(r, p)| rank_pool(r, opts.threads_per_rank, p))
            .collect::<Result<Vec<_>, _>>()?;
        let models: Vec<Result<Model, ModelError>> = std::thread::scope(|sc| {
            let hs: Vec<_> = pools
                .iter()
                .zip(&parts)
                .map(|(pool, part)| {
                    sc.spawn(move || {
                        pool.install(|| {
                            let mut g = Gguf::open(path)?;
                            let mut m = Model::load_part(&mut g, part)?;
                            m.set_threads(opts.threads_per_rank);
                            m.set_quantized_decode(opts.quantized_decode);
                            Ok(m)
                        })
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(ModelError::Forward("a rank's loader panicked".into()))
                    })
                })
                .collect()
        });
        let mut ranks = Vec::with_capacity(tp);
        for (m, pool) in models.into_iter().zip(pools) {
            ranks.push(Rank { model: m?, pool });
        }
        Ok(TpModel {
            config,
            parts,
            ranks,
            comm: Comm::new(tp),
            busy: Mutex::new(()),
        })
    }

    /// The whole model's configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Ranks.
    pub fn tp(&self) -> usize {
        self.ranks.len()
    }

    /// Bytes of weights all ranks hold.
    pub fn weight_bytes(&self) -> usize {
        self.ranks.iter().map(|r| r.model.weight_bytes()).sum()
    }

    /// Runs every rank over the call; rank 0 gathers the logits. A rank's error fails the
    /// call; a rank's panic panics here (on the caller's thread, where the engine sees it).
    pub fn forward_rows(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
        all: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        assert_eq!(all.len(), seqs.len(), "one logits choice per sequence");
        debug_assert!(
            rayon::current_thread_index().is_none(),
            "TpModel::forward_rows from a rayon worker"
        );
        let _busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        // Every check a rank makes, made before any rank waits on another.
        for r in &self.ranks {
            let k = r.model.pool_kind();
            if pool.layout().kinds().get(r.model.kind()) != Some(&k) {
                return Err(ModelError::Forward(format!(
                    "device pool layout {:?} lacks rank pool {k:?}",
                    pool.layout().kinds()
                )));
            }
        }
        for (si, s) in seqs.iter().enumerate() {
            check_seq(pool, si, s, self.config.context_length, self.config.vocab)?;
        }
        let comm = &self.comm;
        let slots: Vec<Mutex<Option<RankOut>>> = (0..self.tp()).map(|_| Mutex::new(None)).collect();
        let run = |r: usize| {
            let rank = &self.ranks[r];
            let c = RankComm { comm, rank: r };
            let out = catch_unwind(AssertUnwindSafe(|| {
                rank.model.forward_part(pool, seqs, all, &c)
            }));
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
                Err(p) => panics.push((r, crate::tp::panic_text(&*p))),
            }
        }
        let own = panics
            .iter()
            .find(|(_, m)| !m.contains("another tensor-parallel rank"));
        if let Some((r, m)) = own.or(panics.first()) {
            panic!("tensor-parallel rank {r} panicked: {m}");
        }
        Ok(first.expect("rank 0 gathers the logits"))
    }

    /// Runs `run(r)` for every rank from `from` on as a job on rank r's pool (a scope per
    /// pool, borrowing the caller's stack), and rank 0 on its pool through `install`, the
    /// caller waiting: no thread is created per call, and nothing can fail to start once a
    /// rank waits. The caller must not be a rayon worker (it would run other jobs of its pool
    /// while it holds the model); the engine's scheduler thread and the tests' are not.
    fn run_ranks(&self, from: usize, run: &(dyn Fn(usize) + Sync)) {
        match self.ranks.get(from) {
            None => self.ranks[0].pool.install(|| run(0)),
            Some(rank) => rank.pool.in_place_scope(|s| {
                s.spawn(move |_| run(from));
                self.run_ranks(from + 1, run);
            }),
        }
    }

    /// A page of this server's layout (the ranks' kinds, page-first) as the whole model's
    /// (one kind, every KV head once): what crosses to another worker.
    pub fn page_to_wire(&self, page_size: usize, blob: &[u8]) -> Result<Vec<u8>, ModelError> {
        self.reshard(page_size, blob, true)
    }

    /// A page of the whole model's layout as this server's ranks' (KV heads copied to every
    /// rank that holds them).
    pub fn page_from_wire(&self, page_size: usize, blob: &[u8]) -> Result<Vec<u8>, ModelError> {
        self.reshard(page_size, blob, false)
    }

    fn reshard(&self, ps: usize, blob: &[u8], to_wire: bool) -> Result<Vec<u8>, ModelError> {
        let c = &self.config;
        let head = c.head_dim * 2; // one f16 head row
        let kvs: Vec<Range<usize>> = self.parts.iter().map(|p| p.heads.kv.clone()).collect();
        let local_tok: usize = kvs.iter().map(|k| k.len()).sum::<usize>() * head * 2 * c.layers;
        let wire_tok = c.kv_heads * head * 2 * c.layers;
        let (from_tok, to_tok) = if to_wire {
            (local_tok, wire_tok)
        } else {
            (wire_tok, local_tok)
        };
        if ps.checked_mul(from_tok) != Some(blob.len()) {
            return Err(ModelError::Forward(format!(
                "a KV page of {} bytes, expected {ps} tokens of {from_tok} bytes",
                blob.len()
            )));
        }
        let mut out = vec![0u8; ps * to_tok];
        // Page-first blobs: per kind, per layer, per plane, `ps` token rows of the kind's heads.
        let wire_chunk = |layer: usize, plane: usize| (layer * 2 + plane) * ps * c.kv_heads * head;
        let mut base = 0;
        for kv in &kvs {
            let row = kv.len() * head;
            for layer in 0..c.layers {
                for plane in 0..2 {
                    let local = base + (layer * 2 + plane) * ps * row;
                    let wire = wire_chunk(layer, plane);
                    for t in 0..ps {
                        let l = local + t * row;
                        let w = wire + (t * c.kv_heads + kv.start) * head;
                        if to_wire {
                            out[w..w + row].copy_from_slice(&blob[l..l + row]);
                        } else {
                            out[l..l + row].copy_from_slice(&blob[w..w + row]);
                        }
                    }
                }
            }
            base += c.layers * 2 * ps * row;
        }
        Ok(out)
    }
}

/// The message of a panic payload.
pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

impl crate::Runtime for TpModel {
    fn architecture(&self) -> &'static str {
        self.config.arch.name()
    }
    fn context_length(&self) -> usize {
        self.config.context_length
    }
    fn vocab(&self) -> usize {
        self.config.vocab
    }
    fn pool_kinds(&self, _page_size: usize) -> Result<Vec<PoolKind>, ModelError> {
        Ok(self.ranks.iter().map(|r| r.model.pool_kind()).collect())
    }
    fn wire_kinds(&self, _page_size: usize) -> Result<Vec<PoolKind>, ModelError> {
        let c = &self.config;
        Ok(vec![PoolKind::kv(
            "kv", c.layers, c.kv_heads, c.head_dim, 2,
        )])
    }
    fn page_to_wire(&self, ps: usize, blob: &[u8]) -> Result<Option<Vec<u8>>, ModelError> {
        TpModel::page_to_wire(self, ps, blob).map(Some)
    }
    fn page_from_wire(&self, ps: usize, blob: &[u8]) -> Result<Option<Vec<u8>>, ModelError> {
        TpModel::page_from_wire(self, ps, blob).map(Some)
    }
    fn forward_rows(
        &self,
        pool: &DevicePool,
        seqs: &[SeqInput],
        all: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        TpModel::forward_rows(self, pool, seqs, all)
    }
}
