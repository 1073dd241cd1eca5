//! `scratch::forward_scratch` against what forward calls really allocate: a counting global
//! allocator records the most bytes live during each call (every thread's), beyond what was
//! live before it, and the bound must hold for prompt chunks, decode batches, mixed batches,
//! every row's logits and tensor-parallel ranks, on the llama family and DeepSeek-V4. The
//! bound must also be close (within 3× of the largest call measured), or it would reserve
//! memory for nothing.
//!
//! One test in this binary: the counter sees the whole process.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::quantized::GgmlDType;

use strata_kv::memory::HeapAllocator;
use strata_kv::pool::DevicePool;
use strata_kv::PageLayout;
use strata_model::scratch::{CallLimits, ModelShape};
use strata_model::tiny::deepseek4::{write_tiny_dsv4, TinyDsv4Spec};
use strata_model::tiny::{write_tiny, TinySpec};
use strata_model::*;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed to the system allocator unchanged; the counters only observe.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, as GlobalAlloc::alloc requires.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: `p` came from `alloc` with this layout.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// The most bytes live during `f` beyond those live before it.
fn peak_of<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let out = f();
    (out, (PEAK.load(Ordering::Relaxed) - base) as u64)
}

const PAGE: usize = 16;
/// Tokens of the device pool the calls run over.
const POOL_TOKENS: u64 = 1024;

fn pool(m: &dyn Runtime, pages: u32) -> DevicePool {
    let layout = PageLayout::new(PAGE, m.pool_kinds(PAGE).unwrap()).unwrap();
    DevicePool::new(Arc::new(layout), pages, &HeapAllocator).unwrap()
}

fn toks(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11 + seed) % 250).collect()
}

/// One call's shape: per sequence, (tokens, position, all logits).
type Call = Vec<(usize, usize, bool)>;

/// Runs `calls` on the model in `path` and checks each against the bound; returns the largest
/// measured and the bound of the largest.
fn check(path: &Path, ranks: usize, calls: &[Call]) -> (u64, u64) {
    let mut o = LoadOptions::new(2);
    if ranks > 1 {
        o.ranks = vec![RankPlacement::default(); ranks];
    }
    let m = load(path, o).unwrap().runtime;
    let threads = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let windows = m.architecture() == "deepseek4";
    let pool = pool(&*m, (POOL_TOKENS / PAGE as u64) as u32);
    let (mut most, mut most_bound) = (0, 0);
    for call in calls {
        // Each sequence's pages: its own run of the pool (windows: the same pages).
        let inputs: Vec<(Vec<u32>, Vec<u32>)> = call
            .iter()
            .enumerate()
            .map(|(i, &(n, pos, _))| {
                let pages = (pos + n).div_ceil(PAGE) as u32;
                let first = i as u32 * 16;
                (toks(n, i as u32), (first..first + pages).collect())
            })
            .collect();
        // Positions before `pos` must be computed first (the same pages): a prefix call.
        for (&(_, pos, _), (_, pages)) in call.iter().zip(&inputs) {
            if pos > 0 {
                let t = toks(pos, 99);
                let seq = seq_input(&t, 0, pages, false, windows);
                m.forward_rows(&pool, &[seq], &[false]).unwrap();
            }
        }
        let seqs: Vec<SeqInput> = call
            .iter()
            .zip(&inputs)
            .map(|(&(n, pos, _), (t, pages))| seq_input(t, pos, pages, n == 1 && pos > 0, windows))
            .collect();
        let all: Vec<bool> = call.iter().map(|c| c.2).collect();
        // On a pool of the threads the bound counts, as `strata serve` runs its calls (ranks
        // run on pools of their own, and refuse to start from a pool's worker).
        let run = || peak_of(|| m.forward_rows(&pool, &seqs, &all).unwrap());
        let (out, used) = if ranks == 1 {
            threads.install(run)
        } else {
            run()
        };
        drop(out);
        let rows: usize = call.iter().map(|c| c.0).sum();
        let logit_rows: usize = call.iter().map(|c| if c.2 { c.0 } else { 1 }).sum();
        let limits = CallLimits {
            tokens: rows as u64,
            sequences: call.len() as u64,
            all_logit_rows: (logit_rows - call.len()) as u64,
            threads: 2,
        };
        let s = ModelShape::read(path)
            .unwrap()
            .scratch(ranks as u64, limits);
        let bound = s.bytes(ranks as u32, POOL_TOKENS);
        assert!(
            used <= bound,
            "{} ranks {ranks}, call {call:?}: {used} bytes allocated, bound {bound}",
            path.display()
        );
        eprintln!(
            "{}, {ranks} rank(s), {call:?}: {used} bytes, bound {bound}",
            path.display()
        );
        if used > most {
            (most, most_bound) = (used, bound);
        }
    }
    (most, most_bound)
}

fn seq_input<'a>(
    t: &'a [u32],
    pos: usize,
    pages: &'a [u32],
    decode: bool,
    windows: bool,
) -> SeqInput<'a> {
    SeqInput {
        tokens: t,
        pos,
        pages,
        windows: if windows { pages } else { &[] },
        decode,
    }
}

#[test]
fn forward_calls_stay_within_the_planned_scratch() {
    let d = tempfile::tempdir().unwrap();
    let calls: Vec<Call> = vec![
        vec![(200, 0, false)],
        vec![(200, 0, true)],
        vec![(64, 100, false), (1, 40, false), (1, 70, false)],
        vec![
            (1, 30, false),
            (1, 31, false),
            (1, 32, false),
            (1, 33, false),
        ],
        vec![(120, 0, true), (80, 30, false)],
    ];
    // A llama model whose layers are the larger phase; narrow layers, where the logits of every
    // row weigh as much (one head of 32 values a rank at TP 2); DeepSeek-V4.
    let llama = |hidden, heads, ffn| TinySpec {
        hidden,
        heads,
        kv_heads: 2,
        ffn,
        ..TinySpec::default()
    };
    let mut models = Vec::new();
    // And 8-bit weights, whose decode rows take the integer kernels (8-bit activations).
    let q8 = TinySpec {
        dtype: GgmlDType::Q8_0,
        ..llama(128, 4, 384)
    };
    // Shapes where another phase of a layer is its peak: eight query heads a K/V head, wider
    // than the hidden size (Q, K and V's products), and 8-bit weights with a feed-forward
    // narrower than the hidden size (the output projection).
    let q8_narrow_ffn = TinySpec {
        dtype: GgmlDType::Q8_0,
        ..llama(128, 4, 64)
    };
    let gqa8 = TinySpec {
        head_dim: Some(32),
        ..llama(128, 16, 64)
    };
    for (name, spec) in [
        ("llama", llama(128, 4, 384)),
        ("narrow", llama(64, 2, 64)),
        ("q8", q8),
        ("gqa8", gqa8),
        ("q8-narrow-ffn", q8_narrow_ffn),
    ] {
        let path = d.path().join(format!("{name}.gguf"));
        write_tiny(&path, &spec).unwrap();
        models.push(path);
    }
    let dsv4 = d.path().join("dsv4.gguf");
    write_tiny_dsv4(&dsv4, &TinyDsv4Spec::default()).unwrap();
    models.push(dsv4);
    for path in &models {
        for ranks in [1, 2] {
            let (most, bound) = check(path, ranks, &calls);
            let at = format!("{}, {ranks} ranks", path.display());
            assert!(bound <= 3 * most, "{at}: bound {bound}, measured {most}");
        }
    }
}
